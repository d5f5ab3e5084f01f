"""Run the sparse-mutation server in this process and its workers as processes on 127.0.0.1.

:func:`run` initializes the model from ``(seed, data)``, serves it, starts ``workers`` worker
processes (``python -m zeroth.binary.worker``), kills one with SIGKILL as the server opens
each round of ``kill_at`` (before any worker hears of it: the killed worker takes no part in that
round), pauses one with SIGSTOP as each round of ``pause_at`` opens (SIGCONT as the next round
opens, or ``pause_s`` seconds later: dropped at the round's deadline, it rejoins) and releases a new one at each round of
``join_at`` (it fetches the packed model), and returns when the run has finished (or
``timeout_s`` passed: then it raises).

A worker process that dies, whoever killed it, is counted as lost and the run carries on with
the others: the server closes each round with the lists it has at its deadline, as long as at
least ``cfg.min_workers`` take part. Only when fewer worker processes are left alive than that
(none of them can complete a round) does the launcher stop and raise, naming the lost workers. The
summary holds the test accuracy of the model before and after, the bytes per round per worker of
the sparse lists next to a dense float32 gradient, the checksum comparisons and the wall-clock.

Example:
  $ python -m zeroth.binary.launch --workers 3 --rounds 10
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import signal
import subprocess
import sys
import tempfile
import threading
import time
from typing import NamedTuple

import jax.numpy as jnp
import numpy as np

from zeroth.binary import layers as L
from zeroth.binary import protocol as P
from zeroth.binary import service as S
from zeroth.binary import train as T
from zeroth.binary import worker as W
from zeroth.transport import identity, processes

__all__ = ["run", "accuracy", "fit_head", "initial_model", "InitialModel", "server_summary", "main"]


def accuracy(cfg: W.DistConfig, w, thresh, head, x, y) -> float:
    """Test accuracy of the model (``head`` None: the votes head)."""
    spec = W.model_spec(cfg)
    h = W.votes(cfg, x.shape[1], x.shape[2])[0] if head is None else L.Head(jnp.asarray(head[0]), jnp.asarray(head[1]))
    return T.accuracy(L.ConvLayer(jnp.asarray(w), jnp.asarray(thresh)), h, x, y, spec, cfg.grid)


def fit_head(cfg: W.DistConfig, layer: L.ConvLayer, x, y) -> tuple[np.ndarray, np.ndarray]:
    """Fit the auxiliary head to the initial layer's features (``head_steps`` Adam steps); it is then frozen."""
    spec = W.model_spec(cfg)
    h, w = x.shape[1:3]
    reg = L.regions(h, w, cfg.grid)
    head = L.init_head(cfg.c_out, len(reg.counts), cfg.classes)
    fns = T.step_functions(spec, h, w, cfg.grid)
    state = T.ADAM.init(head)
    for i in range(cfg.head_steps):
        idx = np.random.default_rng([cfg.seed, 8, i]).choice(len(y), size=min(cfg.batch_size, len(y)), replace=False)
        head, state, _ = fns.head_step(layer, head, state, jnp.asarray(x[idx]), jnp.asarray(y[idx]), jnp.float32(0.01))
    return np.asarray(head.a), np.asarray(head.b)


class InitialModel(NamedTuple):
    """What the server starts from: the layer (``w``, ``thresh``), the frozen ``head`` (None: votes),
    its test ``accuracy``, the ``server_config`` and the test split (``x_test``, ``y_test``)."""

    w: np.ndarray
    thresh: np.ndarray
    head: tuple | None
    accuracy: float
    server_config: P.ServerConfig
    x_test: np.ndarray
    y_test: np.ndarray


def initial_model(cfg: W.DistConfig) -> InitialModel:
    """The sparse-mutation run's starting model, a function of ``cfg`` (its seed and data) only."""
    x, y = W.load_split(cfg, "train")
    xt, yt = W.load_split(cfg, "test")
    spec = W.model_spec(cfg)
    rng = np.random.default_rng([cfg.seed, 7])
    layer = L.init_layer(spec, x[rng.choice(len(x), size=min(256, len(x)), replace=False)], seed=cfg.seed)
    w0, t0 = np.asarray(layer.w), np.asarray(layer.thresh)
    head = fit_head(cfg, layer, x, y) if cfg.head == "trained" else None
    return InitialModel(w0, t0, head, accuracy(cfg, w0, t0, head, xt, yt), cfg.server_config(x.shape[1:3]), xt, yt)


def server_summary(cfg: W.DistConfig, server: S.Server, init: InitialModel) -> dict:
    """What the server knows of a finished run: accuracies before and after, the final checksum,
    flips, contributors and dropped workers per round, the bytes of a dense gradient and of the model."""
    st = server.snapshot()
    results = [st.results[r] for r in range(min(cfg.rounds, st.round))]
    return {
        "config": cfg._asdict(),
        "rounds": cfg.rounds,
        "test_accuracy_before": init.accuracy,
        "test_accuracy": accuracy(cfg, st.w, st.thresh, st.head, init.x_test, init.y_test),
        "final_checksum": st.checksum,
        "flips_per_round": [len(r.mutations) for r in results],
        "contributors_per_round": [len(r.contributors) for r in results],
        "contributors": [list(r.contributors) for r in results],
        "dropped": sorted({d for r in results for d in r.dropped}),
        "dense_float32_bytes_per_round_per_worker": P.dense_bytes(init.server_config),
        "packed_model_bytes": len(P.model_bytes(st.w, st.thresh, cfg.levels, cfg.ternary, st.head)),
    }


def _spawn(
    address: str, cfg: W.DistConfig, metrics: pathlib.Path, run_env: dict, hold: pathlib.Path | None = None
) -> subprocess.Popen:
    """Start a worker process writing ``metrics``; its output goes to the log beside it (``worker<i>.log``)."""
    env = {
        **run_env,
        "PYTHONPATH": os.pathsep.join(
            [str(pathlib.Path(__file__).resolve().parents[2]), run_env.get("PYTHONPATH", "")]
        ),
    }
    env.setdefault("JAX_PLATFORMS", "cpu")
    insecure = not any(env.get(k) for k in identity.SECRET_ENV)
    return processes.start(
        [
            sys.executable,
            "-m",
            "zeroth.binary.worker",
            "--server",
            address,
            "--config",
            json.dumps(cfg._asdict()),
            "--metrics",
            str(metrics),
        ]
        + ([] if hold is None else ["--hold", str(hold)])
        + (["--insecure"] if insecure else []),
        metrics.with_suffix(".log"),
        env=env,
    )


def _log_end(out: pathlib.Path, i: int) -> str:
    """The end of worker ``i``'s log (its last 500 characters)."""
    log = out / f"worker{i}.log"
    return log.read_text(errors="replace")[-500:].strip() if log.is_file() else ""


def run(
    cfg: W.DistConfig,
    *,
    workers: int = 3,
    kill_at: tuple = (),
    join_at: tuple = (),
    pause_at: tuple = (),
    pause_s: float | None = None,
    out_dir=None,
    timeout_s: float = 300.0,
    insecure: bool = False,
) -> dict:
    """Run the server and the workers to the end; returns the summary dict (also ``out_dir/summary.json``).
    Worker ``i`` writes its rows to ``out_dir/worker<i>.jsonl`` and its output to ``worker<i>.log``.

    The run has a fresh secret, given to the workers in their environment; every call carries its
    access token (``insecure``: none, and the server takes calls from anyone).
    """
    out = pathlib.Path(out_dir or tempfile.mkdtemp(prefix="zeroth-binary-"))
    out.mkdir(parents=True, exist_ok=True)
    for old in [
        *out.glob("worker*.jsonl"),
        *out.glob("worker*.log"),
        *out.glob("join*.go"),
    ]:  # a previous run's logs would be counted
        old.unlink()
    init = initial_model(cfg)
    w0, t0, head, scfg = init.w, init.thresh, init.head, init.server_config
    procs: list[subprocess.Popen] = []
    killed: list[int] = []
    kill_rounds: list[int] = []  # the round each kill was sent at: the moment it opened
    paused: list[int] = []
    pause_rounds: list[int] = []
    to_resume: list[int] = []  # paused workers resumed as the next round opens
    holds = [out / f"join{j}.go" for j in range(len(join_at))]
    pending_kills, pending_joins, pending_pauses = sorted(kill_at), sorted(join_at), sorted(pause_at)
    errors: list[BaseException] = []
    act_lock = threading.Lock()

    def _live_worker(excluded: list[int], what: str, rnd: int) -> int:
        victim = next((i for i, p in enumerate(procs[:workers]) if p.poll() is None and i not in excluded), None)
        if victim is None:
            raise RuntimeError(f"no live worker left to {what} at round {rnd}")
        return victim

    def act(rnd: int) -> None:
        # called by the server, under its lock, as round ``rnd`` opens: no worker has heard of it yet,
        # so a worker killed here takes no part in it, however loaded the machine
        with act_lock:
            try:
                while to_resume:  # the round they were paused in closed without them: they were dropped
                    procs[to_resume.pop()].send_signal(signal.SIGCONT)
                for _ in range(processes.due(pending_kills, rnd)):
                    victim = _live_worker(killed, "kill", rnd)
                    procs[victim].send_signal(signal.SIGKILL)
                    killed.append(victim)
                    kill_rounds.append(rnd)
                for _ in range(processes.due(pending_pauses, rnd)):
                    victim = _live_worker(killed + paused, "pause", rnd)
                    procs[victim].send_signal(signal.SIGSTOP)
                    paused.append(victim)
                    pause_rounds.append(rnd)
                    if pause_s is None:
                        to_resume.append(victim)
                    else:
                        resume = threading.Timer(pause_s, procs[victim].send_signal, (signal.SIGCONT,))
                        resume.daemon = True
                        resume.start()
                first = len(join_at) - len(pending_joins)  # the joiners released so far
                for k in range(first, first + processes.due(pending_joins, rnd)):
                    holds[k].touch()
            except BaseException as e:  # raised by the launcher's loop, not inside the RPC
                errors.append(e)

    run_env = identity.launch_env(insecure)
    server = S.Server(
        scfg,
        w0,
        t0,
        head,
        on_round=act,
        token=identity.token_from_env(insecure, run_env),
        secret=None if insecure else identity.secret_from_env(run_env),
    )
    lost: dict[int, int] = {}  # worker process -> its exit code (a negative signal number: killed)
    port = server.start("127.0.0.1:0")
    address = f"127.0.0.1:{port}"
    start = time.monotonic()
    try:
        for i in range(workers):
            procs.append(_spawn(address, cfg, out / f"worker{i}.jsonl", run_env))
        # joiners start now (loading and compiling take seconds) and join when their round comes
        for h in holds:
            h.unlink(missing_ok=True)
            procs.append(_spawn(address, cfg, out / f"worker{len(procs)}.jsonl", run_env, hold=h))
        act(server.snapshot().round)  # round 0 opened before the workers existed

        def tick() -> str | None:
            if errors:
                raise errors[0]
            st = server.snapshot()
            if st.round >= cfg.rounds:
                return "done"
            if time.monotonic() - start > timeout_s:
                raise RuntimeError(
                    f"the run did not finish {cfg.rounds} rounds within {timeout_s} s (at round {st.round})"
                )
            for i, p in enumerate(procs):
                if i not in lost and p.poll() not in (None, 0):
                    lost[i] = p.returncode  # the run goes on without it
                    why = "" if p.returncode < 0 else f": {_log_end(out, i)}"
                    print(
                        f"zeroth binary: worker process {i} exited with {p.returncode}{why}; the run carries on "
                        "without it",
                        file=sys.stderr,
                        flush=True,
                    )
            alive = sum(p.poll() is None for p in procs)
            if alive < cfg.min_workers:
                raise RuntimeError(
                    f"the run cannot finish: {alive} worker processes left, fewer than min_workers="
                    f"{cfg.min_workers} (lost: {', '.join(f'{i} rc {c}' for i, c in lost.items())})"
                )
            return None

        processes.watch(procs, tick, until_exited=False, grace_s=0)
        for i, p in enumerate(procs):
            if i not in lost:
                try:
                    p.wait(timeout=60)
                except subprocess.TimeoutExpired:
                    p.kill()
                    raise RuntimeError(f"worker process {i} did not finish after the last round") from None
                if p.returncode != 0:
                    lost[i] = p.returncode
                    print(
                        f"zeroth binary: worker process {i} exited with {p.returncode} after the last round: "
                        f"{_log_end(out, i)}",
                        file=sys.stderr,
                        flush=True,
                    )
    finally:
        processes.stop(procs, grace_s=0)
        server.stop()
    wall = time.monotonic() - start
    records = []
    for f in sorted(out.glob("worker*.jsonl")):
        records += [json.loads(line) for line in f.read_text().splitlines() if line.strip()]
    rounds = [r for r in records if r["event"] == "round"]
    joins = [r for r in records if r["event"] in ("join", "rejoin")]
    summary = {
        **server_summary(cfg, server, init),
        "workers": workers,
        "killed": killed,
        "killed_at_round": kill_rounds,
        "paused": paused,
        "paused_at_round": pause_rounds,
        "lost": {str(i): c for i, c in sorted(lost.items())},
        "rejoins": sum(r["event"] == "rejoin" for r in records),
        "joined_at": list(join_at),
        "checksum_comparisons": len(rounds) + len(joins),
        "checksum_mismatches": sum(not r["checksum_ok"] for r in rounds + joins),
        "bytes_up_per_round_per_worker": float(np.mean([r["bytes_up"] for r in rounds])) if rounds else 0.0,
        "bytes_down_per_round_per_worker": float(np.mean([r["bytes_down"] for r in rounds])) if rounds else 0.0,
        "wall_s": wall,
        "loss_per_round": [
            float(np.mean([r["loss"] for r in rounds if r["round"] == k]))
            for k in range(cfg.rounds)
            if any(r["round"] == k for r in rounds)
        ],
    }
    (out / "summary.json").write_text(json.dumps(summary, indent=1))
    return summary


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m zeroth.binary.launch", description="Sparse-mutation server + workers on 127.0.0.1."
    )
    p.add_argument("--workers", type=int, default=3)
    p.add_argument("--rounds", type=int, default=20)
    p.add_argument("--kill-at", type=int, action="append", default=[])
    p.add_argument("--join-at", type=int, action="append", default=[])
    p.add_argument("--pause-at", type=int, action="append", default=[])
    p.add_argument("--out", default=None)
    p.add_argument("--config", default="{}", help="DistConfig fields as JSON")
    args = p.parse_args(argv)
    cfg = W.DistConfig(**{**json.loads(args.config), "rounds": args.rounds})
    s = run(
        cfg,
        workers=args.workers,
        kill_at=tuple(args.kill_at),
        join_at=tuple(args.join_at),
        pause_at=tuple(args.pause_at),
        out_dir=args.out,
    )
    print(json.dumps({k: v for k, v in s.items() if k not in ("config", "loss_per_round")}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
