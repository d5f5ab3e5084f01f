"""``zeroth run CONFIG`` for a config with a ``peers:`` section: peer processes on loopback.

:func:`run_config` writes the config to ``OUT/config.yaml``, starts ``peers.count`` processes
of ``python -m zeroth peer`` on ``peers.host`` (the first founds the run, the others join it
before iteration 0), shows progress, plays the demo events (``peers.join_at``: a new peer, started
with the others, joins when the run reaches that iteration; ``peers.kill_at``: a running peer, the newest founder
other than machine 0, is killed with SIGKILL), and when every peer has exited prints the
summary and writes ``OUT/summary.json``: the accuracy, iterations, projected gradients,
payload and wire bytes, checksum comparisons and mismatches, whether every peer ended with
the same digest, per-member statistics of the projected gradients, the wall time.

Secure by default: the run secret (``peers.token``, else a fresh one) is written to
``OUT/run.secret`` (mode 0600) and every peer gets ``--secret-file``; ``peers.insecure: true``
starts them with ``--insecure`` instead.

Folder ``peers/p<i>`` is machine ``i``: the founders start up and compile at once, and founder
``p<i>`` asks to join once the run has ``i`` members (``--join-members``); a joiner's id is the
next free one. Each peer writes its machine id to ``peers/p<i>/machine``.

Resumable and never overwriting: a folder that already holds a run is refused (``ValueError``,
exit 2) unless ``--resume`` is in ``argv``; the peers save ``checkpoints/<iteration>/`` every
``train.checkpoint_every`` iterations, at the end and on SIGINT/SIGTERM, and ``--resume`` founds
the new run from :func:`newest_checkpoint` (the earlier peer folders are kept as ``peers.<n>/``;
the fields of :data:`PEER_RESUME_INVARIANT` may change, others are refused). SIGINT/SIGTERM of
the launcher stop the peers (each saves a checkpoint and leaves), write the summary and return
130 after one line on stderr with the command that resumes the run.

Each peer process runs single-threaded XLA (:data:`PEER_XLA_FLAGS`, added to any
``XLA_FLAGS`` of the caller) so several fit on a small machine; each runs in its own session, so
a Ctrl-C on the terminal reaches only the launcher. The run is bounded in time
(:func:`time_limit`); children are stopped on exit, interrupts and errors.

Example:
  $ zeroth run experiments/job_digits.yaml --out runs/job
"""

from __future__ import annotations

import dataclasses
import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from zeroth.config import Config, to_yaml
from zeroth.net import state as _state
from zeroth.net.counters import TOTALS as BARRIER_TOTALS
from zeroth.net.counters import summarize_contributors
from zeroth.net import updatelog as _updatelog
from zeroth.net.runtime import JOIN_DIGEST_EXCLUDE
from zeroth.train import interrupt
from zeroth.train.trainer import RESUME_INVARIANT, check_resumable
from zeroth.transport import identity as _id
from zeroth.transport import processes
from zeroth.transport import rendezvous as _rdv

__all__ = [
    "PEER_XLA_FLAGS",
    "PeerProcess",
    "free_ports",
    "peer_env",
    "start_peer",
    "time_limit",
    "startup_timeout",
    "missing_peers",
    "read_records",
    "summarize",
    "newest_checkpoint",
    "PEER_RESUME_INVARIANT",
    "run_config",
]

# Fields that may change when a peer run is resumed (they do not change the parameters of the
# iterations already done): the single-machine ones, the deployment ones, and the run's length.
PEER_RESUME_INVARIANT = (*RESUME_INVARIANT, *JOIN_DIGEST_EXCLUDE, "peers.iterations")

PEER_XLA_FLAGS = (
    "--xla_cpu_multi_thread_eigen=false intra_op_parallelism_threads=1 --xla_force_host_platform_device_count=1"
)


@dataclasses.dataclass
class PeerProcess:
    """A started peer: its index, address, output folder, log file and process."""

    index: int
    address: str
    out: Path
    log: Path
    proc: subprocess.Popen
    founder: bool
    started_at: float

    def alive(self) -> bool:
        return self.proc.poll() is None


def free_ports(n: int, host: str = "127.0.0.1") -> list[int]:
    """``n`` distinct ports that were free a moment ago on ``host``."""
    socks, ports = [], []
    for _ in range(n):
        s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        s.bind((host, 0))
        socks.append(s)
        ports.append(s.getsockname()[1])
    for s in socks:
        s.close()
    return ports


def peer_env(extra_xla_flags: str = "", env: dict | None = None) -> dict:
    """The environment of a peer process: single-threaded CPU XLA (plus ``extra_xla_flags``)."""
    out = dict(os.environ if env is None else env)
    flags = " ".join(
        f for f in out.get("XLA_FLAGS", "").split() if not f.startswith("--xla_force_host_platform_device_count")
    )
    out["XLA_FLAGS"] = " ".join(x for x in (flags, PEER_XLA_FLAGS, extra_xla_flags) if x).strip()
    out.setdefault("JAX_PLATFORMS", "cpu")
    out["OMP_NUM_THREADS"] = "1"
    out["PYTHONUNBUFFERED"] = "1"
    return out


def start_peer(
    config: str | Path,
    out: str | Path,
    listen: str,
    *,
    index: int,
    join: str | None = None,
    founders: int | None = None,
    extra_args: tuple[str, ...] = (),
    env: dict | None = None,
    founder: bool | None = None,
) -> PeerProcess:
    """Start ``python -m zeroth peer`` (its stdout and stderr go to ``OUT.log``).

    ``founder`` marks a peer started with the run (default: it founds the run or gets ``founders``).
    """
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, "-m", "zeroth", "peer", "--config", str(config), "--listen", listen, "--out", str(out)]
    if join:
        cmd += ["--join", join]
    if founders is not None:
        cmd += ["--founders", str(founders)]
    cmd += list(extra_args)
    log = out.with_suffix(".log")
    # its own session: a Ctrl-C on the terminal reaches the launcher, which stops the peers
    proc = processes.start(cmd, log, env=env if env is not None else peer_env(), own_session=True)
    if founder is None:
        founder = join is None or founders is not None
    return PeerProcess(index, listen, out, log, proc, founder, time.monotonic())


def startup_timeout(cfg: Config) -> float:
    """The peers' start-up window: ``peers.startup_timeout_s``, else one that grows with the peers started."""
    p = cfg.peers
    return p.startup_timeout_s or _rdv.startup_window(p.count + len(p.join_at))


def time_limit(cfg: Config) -> float:
    """Seconds after which the launcher stops a run: start-up window + a minute + every iteration at its timeouts."""
    p = cfg.peers
    iterations = p.iterations or cfg.train.steps
    return startup_timeout(cfg) + 60.0 + iterations * (p.iteration_timeout_s + 2 * p.barrier_timeout_s)


def missing_peers(summary: dict) -> list[str]:
    """One phrase per peer that should have finished the run and did not (a peer killed by a
    ``peers.kill_at`` event is not missing): ``"p3 (exit 1: <its error>)"``.

    Example:
      >>> missing_peers({"events": [{"event": "kill", "peer": 2}], "peers": [
      ...     {"index": 0, "finish_reason": "done"}, {"index": 1, "finish_reason": "failed", "exit_code": 1,
      ...     "error": "could not join"}, {"index": 2, "finish_reason": "killed", "exit_code": -9}]})
      ['p1 (exit 1: could not join)']
    """
    killed = {e["peer"] for e in summary.get("events", []) if e.get("event") == "kill"}
    return [
        f"p{s['index']} (exit {s.get('exit_code')}: {s.get('error') or s.get('finish_reason')})"
        for s in summary["peers"]
        if s.get("finish_reason") not in ("done", "left") and s["index"] not in killed
    ]


def read_records(path: Path, offset: int = 0) -> tuple[list[dict], int]:
    """Complete JSON lines of ``path`` from byte ``offset``: ``(records, new offset)``."""
    try:
        with path.open("rb") as fh:
            fh.seek(offset)
            data = fh.read()
    except FileNotFoundError:
        return [], offset
    end = data.rfind(b"\n") + 1
    out = []
    for line in data[:end].splitlines():
        if line.strip():
            out.append(json.loads(line))
    return out, offset + end


def summarize(cfg: Config, peers: list[PeerProcess], events: list[dict], wall: float) -> dict:
    """The run's summary from each peer's ``summary.json`` and ``metrics.jsonl``."""
    per = []
    for p in peers:
        path = p.out / "summary.json"
        address = (p.out / "address").read_text().strip() if (p.out / "address").exists() else p.address
        s = json.loads(path.read_text()) if path.exists() else {"finish_reason": "killed", "address": address}
        s["index"] = p.index
        s["exit_code"] = p.proc.returncode
        per.append(s)
    done = [s for s in per if s.get("finish_reason") == "done"]
    digests = sorted({s["digest"] for s in done})
    ref = min(done, key=lambda s: min(s.get("machines") or [1 << 40]), default=None)
    records: list[dict] = []
    if ref is not None:
        records, _ = read_records(peers[ref["index"]].out / "metrics.jsonl")
    it_records = {r["step"]: r for r in records if r.get("kind") == "train"}
    gradients = sum(r["gradients"] for r in it_records.values())
    bpv = 1 if cfg.train.codec == "onebyte" else 4
    total = {
        k: sum(s.get(k, 0) for s in per) for k in ("payload_sent", "payload_received", "wire_sent", "wire_received")
    }
    iterations = max((s.get("iterations", 0) for s in done), default=0)
    return {
        "run": cfg.run.name,
        "peers_started": len(peers),
        "peers_done": len(done),
        "iterations": iterations,
        "accuracy": (ref or {}).get("eval", {}).get("eval_accuracy"),
        "eval_loss": (ref or {}).get("eval", {}).get("eval_loss"),
        "final_digest": digests[0] if len(digests) == 1 else None,
        "digests_agree": len(digests) == 1,
        "final_digests": digests,
        "projected_gradients": gradients,
        "payload_bytes": gradients * bpv,
        "payload_bytes_sent": total["payload_sent"],
        "payload_bytes_received": total["payload_received"],
        "wire_bytes_sent": total["wire_sent"],
        "wire_bytes_received": total["wire_received"],
        "checksum_comparisons": sum(s.get("checksum_comparisons", 0) for s in per),
        "checksum_mismatches": sum(s.get("checksum_mismatches", 0) for s in per),
        "repairs": sum(s.get("repairs", 0) for s in per),
        "refused_requests": sum(s.get("refused_requests", 0) for s in per),
        "member_stats": (ref or {}).get("member_stats", {}),
        "errors": sorted({s["error"] for s in per if s.get("error")}),
        "rejoins": sum(s.get("rejoins", 0) for s in per),
        # the barrier (zeroth.net.counters): contributors of each iteration (the reference peer's
        # decisions), and what every peer lost at it
        "contributors_per_iteration": (ref or {}).get("contributors_per_iteration", []),
        **summarize_contributors((ref or {}).get("contributors_per_iteration", [])),
        **{k: sum(s.get(k, 0) for s in per) for k in BARRIER_TOTALS},
        "events": events,
        "wall_time_s": wall,
        "peers": per,
    }


def progress_line(latest: dict[int, dict], iterations: int, accuracy: float | None) -> str:
    """The launcher's progress line from each peer's latest ``train`` record (``latest``: peer
    index -> record, finished and killed peers included): the newest iteration a peer has
    logged, its membership and digest, and the mean of the losses the peers logged for that
    iteration (each peer's loss is over its own samples, so one peer's would change with the
    peer that happens to be newest; a killed peer's older record counts for nothing).

    Example:
      >>> r = lambda step, loss: {"step": step, "peers": 3, "loss": loss, "digest": "ab" * 8}
      >>> progress_line({0: r(600, 0.1), 1: r(600, 0.2), 2: r(414, 0.9)}, 600, 0.97)
      'iteration 600/600  peers 3  loss 0.1500 (mean of 2)  accuracy 0.9700  digest abababababab'
    """
    if not latest:
        raise ValueError("progress_line needs at least one peer's train record")
    step = max(r["step"] for r in latest.values())
    at = [latest[i] for i in sorted(latest) if latest[i]["step"] == step]
    losses = [r["loss"] for r in at if r.get("loss") is not None]
    loss = "-" if not losses else f"{sum(losses) / len(losses):.4f} (mean of {len(losses)})"
    return (
        f"iteration {step}/{iterations}  peers {at[0]['peers']}  loss {loss}  "
        f"accuracy {'-' if accuracy is None else f'{accuracy:.4f}'}  digest {at[0]['digest'][:12]}"
    )


def _fmt_bytes(n: float) -> str:
    for unit in ("B", "kB", "MB", "GB"):
        if abs(n) < 1000 or unit == "GB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1000
    return str(n)


def newest_checkpoint(out: str | Path) -> tuple[int, Path] | None:
    """``(iteration, folder)`` of the newest resumable peer checkpoint under ``out``; None when there is none.

    Every attempt's peer folders count (``peers/`` and the ``peers.<n>/`` of earlier attempts).
    A peer that got SIGINT/SIGTERM saves the iteration it reached (reason ``"interrupted"``),
    then leaves; iterations decided after the first of those leaves miss a contributor that an
    uninterrupted run would have had. So within an attempt where peers were interrupted, only
    checkpoints up to the smallest interrupted iteration count: every iteration before it was
    decided before any peer asked to leave. Folders found for the chosen iteration must agree on
    the digest (``ValueError`` otherwise); the first whose files are as saved is chosen
    (:func:`zeroth.net.state.check_state`; ``ValueError`` naming each file when none is).
    """
    found: dict[int, list[tuple[Path, str]]] = {}
    for attempt in sorted(Path(out).glob("peers*")):
        metas = [
            (m.parent, json.loads(m.read_text()))
            for m in attempt.glob("p*/checkpoints/*/state.json")
            if m.parent.name.isdigit()
        ]
        stops = [int(meta["iteration"]) for _, meta in metas if meta.get("reason") == "interrupted"]
        bound = min(stops) if stops else None
        for folder, meta in metas:
            if bound is None or int(meta["iteration"]) <= bound:
                found.setdefault(int(meta["iteration"]), []).append((folder, meta["digest"]))
    if not found:
        return None
    newest = max(found)
    digests = sorted({d for _, d in found[newest]})
    if len(digests) > 1:
        raise ValueError(
            f"the peers' checkpoints of iteration {newest} in {out} differ: "
            + ", ".join(f"{p} has {d[:16]}" for p, d in found[newest])
        )
    # the first copy whose files are as saved (the peers' copies of one iteration hold the same state)
    damaged = []
    for folder in sorted(p for p, _ in found[newest]):
        try:
            _state.check_state(folder)
        except ValueError as e:
            damaged.append(str(e))
            continue
        return newest, folder
    raise ValueError(
        f"the newest checkpoint, of iteration {newest}, cannot be resumed: {'; '.join(damaged)}. Nothing was "
        f"moved or deleted; move {'it' if len(damaged) == 1 else 'them'} aside to resume from the one before"
    )


def _machine_of(p: PeerProcess) -> str:
    path = p.out / "machine"
    return path.read_text().strip() if path.exists() else "?"


def _holds_run(out: Path) -> bool:
    return (out / "summary.json").exists() or any(out.glob("peers*/p*/metrics.jsonl"))


def _prepare_resume(cfg: Config, out: Path) -> tuple[int, Path]:
    """The checkpoint to resume from; the earlier attempt's peer folders are moved to ``peers.<n>``."""
    newest = newest_checkpoint(out)
    if newest is None:
        raise ValueError(f"no checkpoint in {out}; run without --resume to start")
    check_resumable(cfg, out, PEER_RESUME_INVARIANT)
    iteration, folder = newest
    if (out / "peers").exists():
        n = 1
        while (out / f"peers.{n}").exists():
            n += 1
        (out / "peers").rename(out / f"peers.{n}")  # kept, not overwritten
        folder = (
            out / f"peers.{n}" / folder.relative_to(out / "peers") if folder.is_relative_to(out / "peers") else folder
        )
    return iteration, folder


def run_config(cfg: Config, out_dir: str | Path, argv: list[str] | None = None) -> int:
    """Run ``cfg.peers.count`` peers on loopback (see the module docstring). Returns the exit code:
    0 when the run finished and every peer that finished holds the same digest, 130 when
    interrupted, 1 otherwise.

    Raises:
      ValueError: ``out`` holds a run and ``argv`` has no ``--resume``; ``--resume`` without a
        checkpoint, or with a config that changes the parameters; ``--resume-step``.
    """
    if cfg.peers is None:
        raise ValueError("run_config needs a config with a peers: section")
    p = cfg.peers
    out = Path(out_dir)
    argv = list(argv or [])
    resume = "--resume" in argv
    if "--resume-step" in argv:
        raise ValueError("--resume-step is for single-machine runs; a peer run resumes from its newest checkpoint")
    resumed_from: tuple[int, Path] | None = None
    if resume:
        resumed_from = _prepare_resume(cfg, out)
    elif _holds_run(out):
        raise ValueError(
            f"output folder {out} already holds a run (summary.json, peers/); pass --resume to continue it or choose another --out"
        )
    out.mkdir(parents=True, exist_ok=True)
    (out / "summary.json").unlink(missing_ok=True)  # an interrupted attempt's, when resuming
    config_path = out / "config.yaml"
    config_path.write_text(to_yaml(cfg))
    quiet = "--quiet" in (argv or [])
    iterations = p.iterations or cfg.train.steps
    extra: list[str] = [
        "--progress-every",
        "0",
        "--timeout",
        str(time_limit(cfg)),
        "--startup-timeout",
        f"{startup_timeout(cfg):g}",
    ]
    (out / "run.secret").unlink(missing_ok=True)
    if p.insecure:
        extra.append("--insecure")
        security_note = "INSECURE (peers.insecure: true): no run secret"
    else:
        secret_file = _id.write_secret(out / "run.secret", p.token or _id.new_secret())
        extra += ["--secret-file", str(secret_file)]
        security_note = f"run secret in {secret_file} (mode 0600); every message signed by its sender"
    if p.tls:
        from zeroth.transport import security as _sec

        tls = _sec.self_signed(out / "tls", hosts=(p.host, "localhost"))
        extra += ["--tls-cert", tls.cert, "--tls-key", tls.key, "--tls-ca", tls.ca]
    n_extra = len(p.join_at)
    if p.base_port:
        addresses = [f"{p.host}:{p.base_port + i}" for i in range(p.count + n_extra)]
    else:  # each peer binds a free port itself and writes it to its `address` file; the others wait for it
        addresses = [f"{p.host}:0"] * (p.count + n_extra)
    founder_address = addresses[0] if p.base_port else f"@{out / 'peers' / 'p0' / 'address'}"
    # p<i> is machine i: founder p<i> asks to join once the run has i members (all start up and compile at once)
    peers: list[PeerProcess] = []
    events: list[dict] = []
    t0 = time.monotonic()

    def say(text: str) -> None:
        if not quiet:
            print(f"[job {time.monotonic() - t0:6.1f}s] {text}", file=sys.stderr, flush=True)

    say(
        f"{p.count} peers on {p.host}, {iterations} iterations, {p.inferences_per_iteration} projected gradients "
        f"per peer per iteration, codec {cfg.train.codec}; logs in {out / 'peers'}"
    )
    say(security_note)
    if resumed_from is not None:
        say(f"resuming from iteration {resumed_from[0]} ({resumed_from[1]})")
    catcher = interrupt.catch()  # SIGINT/SIGTERM: the peers save a checkpoint and leave; exit 130
    flag = catcher.__enter__()
    current = resumed_from[0] if resumed_from else 0
    try:

        def add_peer(i: int, join: str | None, args: tuple, **kw) -> None:
            peers.append(
                start_peer(
                    config_path,
                    out / "peers" / f"p{i}",
                    addresses[i],
                    index=i,
                    join=join,
                    **kw,
                    extra_args=tuple(extra) + args,
                )
            )

        for i in range(p.count):
            add_peer(
                i,
                None if i == 0 else founder_address,
                (("--resume", str(resumed_from[1])) if i == 0 and resumed_from else ())
                + (("--join-members", str(i)) if i > 0 else ()),
                founders=p.count if i == 0 else None,
                founder=True,
            )
        # Joiners start at once (start-up and compilation take a while) and join at their iteration.
        for k in sorted(p.join_at):
            i = len(peers)
            add_peer(i, founder_address, ("--join-at", str(k)), founder=False)
            events.append({"event": "join", "peer": i, "at_iteration": k})
        kill_at = sorted(p.kill_at)
        offsets: dict[int, int] = {}
        latest: dict[int, dict] = {}
        accuracy = None
        last_print = 0.0
        limit = time_limit(cfg)

        def tick() -> str | None:
            nonlocal current, accuracy, last_print
            if flag.is_set():
                say(f"{flag.signal_name()}: the peers save a checkpoint and leave")
                events.append({"event": "interrupted", "at_iteration": current, "time": time.monotonic() - t0})
                return "interrupted"
            if time.monotonic() - t0 > limit:
                say(f"time limit of {limit:.0f}s reached; stopping the peers")
                events.append({"event": "time_limit", "time": time.monotonic() - t0})
                return "time limit"
            if not any(q.alive() for q in peers if q.founder):  # no run is left for a joiner still waiting to join
                waiting = [q for q in peers if q.alive()]
                if waiting:
                    say(f"every founder has exited; stopping {len(waiting)} peer(s) still waiting to join")
                return "founders gone"
            for q in peers:
                recs, offsets[q.index] = read_records(q.out / "metrics.jsonl", offsets.get(q.index, 0))
                for r in recs:
                    if r.get("kind") == "train":
                        latest[q.index] = r
                    if "eval_accuracy" in r:
                        accuracy = r["eval_accuracy"]
            live = [latest[q.index] for q in peers if q.alive() and q.index in latest]
            current = max((r["step"] for r in live), default=current)
            for _ in range(processes.due(kill_at, current)):
                victims = [q for q in peers if q.alive() and q.index != 0 and q.founder] or [
                    q for q in peers if q.alive() and q.index != 0
                ]
                if victims:
                    v = victims[-1]
                    v.proc.kill()
                    events.append(
                        {"event": "kill", "peer": v.index, "at_iteration": current, "time": time.monotonic() - t0}
                    )
                    say(f"iteration {current}: killed peer p{v.index} (machine {_machine_of(v)}) with SIGKILL")
            if live and time.monotonic() - last_print > 2.0:
                last_print = time.monotonic()
                say(progress_line(latest, iterations, accuracy))
            return None

        # a signal is acted on within 20 ms (flag.wait), not at the next poll
        processes.watch([q.proc for q in peers], tick, interval_s=0.25, pause=flag.wait, grace_s=15.0)
    finally:
        processes.stop([q.proc for q in peers], grace_s=15.0)
        catcher.__exit__(None, None, None)
    wall = time.monotonic() - t0
    summary = summarize(cfg, peers, events, wall)
    summary["resumed_from"] = resumed_from[0] if resumed_from else None
    (out / "summary.json").write_text(json.dumps(summary, indent=2, sort_keys=True) + "\n")
    if flag.is_set():
        newest = newest_checkpoint(out)
        saved = (
            f"checkpoint of iteration {newest[0]} of {iterations} in {newest[1]}" if newest else "no checkpoint saved"
        )
        print(
            f"zeroth run: interrupted by {flag.signal_name()}; {saved}; "
            f"resume with: {interrupt.resume_command(argv, out)}",
            file=sys.stderr,
            flush=True,
        )
        return interrupt.EXIT_CODE
    _print_summary(summary, cfg, out)
    missing = missing_peers(summary)
    if missing:
        shown = "; ".join(missing[:3]) + (f"; and {len(missing) - 3} more" if len(missing) > 3 else "")
        print(
            f"zeroth run: error: {len(missing)} of {len(peers)} peers did not finish the run: {shown}; "
            f"their logs are in {out / 'peers'}",
            file=sys.stderr,
            flush=True,
        )
    ok = summary["peers_done"] > 0 and summary["digests_agree"] and summary["iterations"] >= iterations and not missing
    return 0 if ok else 1


def _print_summary(s: dict[str, Any], cfg: Config, out: Path) -> None:
    acc = s["accuracy"]
    lines = [
        f"Just One Byte run '{s['run']}' finished in {s['wall_time_s']:.1f}s ({out / 'summary.json'})",
        f"  accuracy            {'-' if acc is None else f'{acc:.4f}'} (test split, final parameters)",
        f"  iterations          {s['iterations']}  peers done {s['peers_done']} of {s['peers_started']} started",
        f"  projected gradients {s['projected_gradients']}  payload {_fmt_bytes(s['payload_bytes'])} "
        f"({'1 byte' if cfg.train.codec == 'onebyte' else '4 bytes'} each, codec {cfg.train.codec})",
        f"  payload on the wire {_fmt_bytes(s['payload_bytes_sent'])} sent, {_fmt_bytes(s['payload_bytes_received'])} received (all peers)",
        f"  wire bytes          {_fmt_bytes(s['wire_bytes_sent'])} sent, {_fmt_bytes(s['wire_bytes_received'])} received (all peers, all messages)",
        f"  checksums           {s['checksum_comparisons']} comparisons, {s['checksum_mismatches']} mismatches, {s['repairs']} repairs",
        f"  final digests       {'agree' if s['digests_agree'] else 'DIFFER'}: {', '.join(d[:16] for d in s['final_digests']) or '-'}",
    ]
    stats = s.get("member_stats") or {}
    if stats:
        lines.append(
            "  per member          "
            + "; ".join(
                f"m{m}: {v['count']} g, mean|g| {v['mean_abs']:.3g}, max|g| {v['max_abs']:.3g}, clipped {v['clipped']}"
                for m, v in stats.items()
            )
        )
    for err in s.get("errors", []):
        lines.append(f"  error               {err}")
    if s["events"]:
        lines.append(
            "  events              "
            + "; ".join(f"{e['event']} p{e.get('peer', '')} at {e.get('at_iteration', '')}" for e in s["events"])
        )
    logs = sorted((out / "peers").glob(f"*/{_updatelog.FILENAME}"))
    if logs:
        size = sum(p.stat().st_size for p in logs)
        lines.append(
            f"  update logs         {len(logs)} ({_fmt_bytes(size)}, peers/p*/{_updatelog.FILENAME}); "
            f"replay them on any machine: zeroth verify {out}"
            + (f" --secret-file {out / 'run.secret'}" if (out / "run.secret").is_file() else "")
        )
    print("\n".join(lines), flush=True)
