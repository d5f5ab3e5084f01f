"""A Marsit experiment (seed 004) as ``zeroth run`` runs it: every run of a config's ``runs`` list, one folder.

``run_config`` trains the runs one after another with M CPU devices as M workers
(:mod:`zeroth.collectives.train`: one ``shard_map`` program per phase) and writes the layout every
``zeroth run`` writes (:mod:`zeroth.train.runs`):

* ``config.yaml``: ``name`` and every run, resolved (base, entry and ``--set`` merged);
* ``metrics.jsonl``: schema v1 of :mod:`zeroth.train.metrics`, every row labelled with its ``run``;
  a ``train`` row every ``train.log_every`` rounds and an ``eval`` row every ``train.eval_every`` rounds and at the end;
* ``summary.json``: ``{"name", "runs": [one summary per finished run, in config order], "finished",
  "total"}``, rewritten after each run;
* ``params/run_<i>.npz``: worker 0's final parameters of the ``i``-th run (leaf paths ``a/b/c``).

Field meanings (Marsit's part of the schema): ``step`` is the round (rounds completed);
``forward_passes`` counts one worker's batches (every worker makes the same number);
``payload_bytes`` / ``payload_bytes_total`` are the bytes all M workers send through ``ppermute``
in that round / since the run began (:mod:`zeroth.collectives.bits`); ``digest`` is
:func:`zeroth.replay.checksum` of worker 0's parameters, and ``checksums_equal`` says every
worker's checksum agreed at each check so far (every ``train.checksum_every`` rounds).
``comm_model_s`` models the link time on links of ``network.gbps`` with ``network.latency_us``
per hop (every ``ppermute`` costs ``latency + bits per sender / bandwidth``; senders work in
parallel). ``wall_time_s`` is measured; ``compute_time_s`` counts each phase's first round
(which compiles it) at the steady mean, and ``time_est_s`` = rounds of each phase x that phase's
median round time + ``comm_model_s``: robust to a busy machine.

Resumable: with ``resume`` the runs that finished (in ``summary.json``) are kept if their config
is unchanged, their rows stay in ``metrics.jsonl``, and the others start again from round 0. A
``stop`` callable that turns true (SIGINT / SIGTERM) ends the run under way after its round and
raises :class:`Stopped`; the finished runs stay on disk.
"""

from __future__ import annotations

import json
import math
import os
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax
import yaml

from zeroth import data as _data
from zeroth import models as _models
from zeroth import replay as _replay
from zeroth.collectives import bits as _bits
from zeroth.collectives import sync as _sync
from zeroth.collectives import topology as _topo
from zeroth.collectives import train as _train
from zeroth.marsit import config as _config
from zeroth.marsit.devices import DeviceError, ensure_cpu_devices
from zeroth.train.interrupt import Interrupted
from zeroth.train.metrics import MetricsWriter, read_metrics

__all__ = ["Setup", "Stopped", "flat_params", "lr_scales", "run_one", "run_config", "setup", "table"]


class Stopped(Interrupted):
    """A stop request ended run ``label`` after ``step`` of ``total`` rounds; ``finished`` runs of ``runs`` are kept."""

    def __init__(self, label: str, step: int, total: int, finished: int, runs: int):
        super().__init__(step, total, None)
        self.label, self.finished, self.runs = label, finished, runs


def flat_params(tree: Any) -> dict[str, np.ndarray]:
    """``{"a/b/c": array}`` of a pytree of dicts (the keys of ``params/run_<i>.npz``)."""
    out = {}
    for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]:
        out["/".join(str(getattr(k, "key", getattr(k, "idx", k))) for k in path)] = np.asarray(leaf)
    return out


def _bytes(bits: int) -> int:
    return -(-int(bits) // 8)


class Setup(NamedTuple):
    """One run ready to train (:func:`setup`): its topology, synchronization, trainer and first
    state, ``batch(t)`` (round ``t``'s batches of every worker), ``evaluate(params)`` (test loss and
    accuracy) and ``lr_scale(t)`` (the step-size factor of round ``t``)."""

    topo: Any
    sync: Any
    trainer: Any
    state: Any
    batch: Callable[[int], tuple[np.ndarray, np.ndarray]]
    evaluate: Callable[[Any], tuple[jax.Array, jax.Array]]
    lr_scale: Callable[[int], float]


def setup(spec: _config.RunSpec) -> Setup:
    """Build run ``spec`` as :func:`run_one` trains it: the same data, model, batches, keys and
    step-size schedule, so a tool that drives ``trainer.round`` itself reaches the same digests."""
    topo = _topo.make_topology(spec.topology.kind, spec.topology.workers, spec.topology.rows)
    devices = _workers_devices(topo.size)
    train_ds = _data.load(spec.data.dataset, "train")
    test_ds = _data.load(spec.data.dataset, "test")
    n_eval = spec.data.eval_size or test_ds.x.shape[0]
    x_test, y_test = jnp.asarray(test_ds.x[:n_eval]), jnp.asarray(test_ds.y[:n_eval])
    model = _models.build(spec.model.name, num_classes=train_ds.num_classes, **dict(spec.model.kwargs))
    params0 = _models.init(model, _models.init_key(spec.seed), train_ds.x[:1])

    def loss_fn(p, x, y):
        return optax.softmax_cross_entropy_with_integer_labels(_models.apply(model, p, x), y).mean()

    @jax.jit
    def evaluate(p):
        logits = _models.apply(model, p, x_test)
        loss = optax.softmax_cross_entropy_with_integer_labels(logits, y_test).mean()
        return loss, jnp.mean((jnp.argmax(logits, -1) == y_test).astype(jnp.float32))

    sync = _sync.build(
        spec.sync.method, topo, eta_s=spec.sync.eta_s, K=spec.sync.K, norm=spec.sync.norm, bucket=spec.sync.bucket
    )
    h = spec.train.local_steps
    tr = _train.make_trainer(
        loss_fn,
        params0,
        topo,
        sync,
        eta_l=spec.train.eta_l,
        run_seed=spec.seed,
        mesh=topo.mesh(devices),
        local_steps=h,
        momentum=spec.train.momentum,
    )
    state = tr.init(params0)
    m, b, n_train = topo.size, spec.data.batch_size, train_ds.x.shape[0]
    lr_scale = lr_scales(spec, sync.phase)

    def batch(t):
        if h == 1:
            idx = [_data.batch_indices(spec.seed, t * m + k, b, n_train) for k in range(m)]
            return np.stack([train_ds.x[i] for i in idx]), np.stack([train_ds.y[i] for i in idx])
        idx = [[_data.batch_indices(spec.seed, (t * h + j) * m + k, b, n_train) for j in range(h)] for k in range(m)]
        return (
            np.stack([np.stack([train_ds.x[i] for i in row]) for row in idx]),
            np.stack([np.stack([train_ds.y[i] for i in row]) for row in idx]),
        )

    return Setup(topo, sync, tr, state, batch, evaluate, lr_scale)


def run_one(
    spec: _config.RunSpec,
    log: Callable[[dict], None],
    *,
    stop: Callable[[], bool] = lambda: False,
    params_file: Path | None = None,
) -> dict:
    """Train one run, calling ``log(row)`` per schema-v1 row; returns its summary.

    Raises:
      Stopped: ``stop()`` turned true (checked after every round).
    """
    topo, sync, tr, state, batch, evaluate, lr_scale = setup(spec)
    h = spec.train.local_steps
    xs0, ys0 = batch(0)
    ref_bits = tr.reference_bits()
    phase_bits: dict[str, int] = {}
    phase_comm: dict[str, float] = {}

    start = time.time()
    total_bits, comm_s, compile_s = 0, 0.0, 0.0
    phase_times: dict[str, list[float]] = {}
    phase_count: dict[str, int] = {}
    checks_ok, diverged, reached = True, False, None
    best_acc, loss0, last_eval, train_loss, digest = 0.0, None, {}, float("nan"), ""
    rounds_done = 0

    def compute_time() -> float:
        steady = sum(len(v) for v in phase_times.values())
        return sum(sum(v) for v in phase_times.values()) * rounds_done / steady if steady else 0.0

    def common(step: int) -> dict:
        return {
            "run": spec.label,
            "group": spec.group,
            "step": step,
            "time_unix_s": time.time(),
            "wall_time_s": time.time() - start,
            "digest": digest,
            "forward_passes": step * h,
            "backward_passes": step * h,
            "payload_bytes_total": _bytes(total_bits),
        }

    for t in range(spec.train.rounds):
        phase = sync.phase(t)
        if phase not in phase_bits:  # bits of one round of this phase, counted from its program once
            report = tr.round_report(phase, xs0, ys0)
            phase_bits[phase] = int(sum(r["bits"] for r in report))
            phase_comm[phase] = sum(
                spec.network.latency_us * 1e-6 + r["per_send_bits"] / (spec.network.gbps * 1e9) for r in report
            )
        xs, ys = batch(t)
        t0 = time.perf_counter()
        state, losses = tr.round(state, t, xs, ys, lr_scale=lr_scale(t))
        losses = _train.gather(losses)
        dt = time.perf_counter() - t0
        phase_count[phase] = phase_count.get(phase, 0) + 1
        if phase_count[phase] == 1:  # the first round of a phase compiles it: kept apart
            compile_s += dt
        else:
            phase_times.setdefault(phase, []).append(dt)
        rounds_done = t + 1
        total_bits += phase_bits[phase]
        comm_s += phase_comm[phase]
        train_loss = float(losses.mean())
        loss0 = train_loss if loss0 is None else loss0
        if rounds_done % spec.train.checksum_every == 0:
            sums = _train.all_worker_checksums(state.params)
            checks_ok = checks_ok and len(set(sums)) == 1
            digest = sums[0]
        else:
            digest = _replay.checksum(_train.worker_copy(state.params, _train.first_local_worker(state.params)))
        if not math.isfinite(train_loss):
            diverged = True
        if diverged or rounds_done % spec.train.log_every == 0 or rounds_done == spec.train.rounds:
            log(
                {
                    "kind": "train",
                    **common(rounds_done),
                    "phase": phase,
                    "loss": train_loss,
                    "lr": spec.train.eta_l * lr_scale(t),
                    "eta_s": spec.sync.eta_s,
                    "step_time_s": dt,
                    "payload_bytes": _bytes(phase_bits[phase]),
                    "bits_per_element": _bits.bits_per_element(phase_bits[phase], ref_bits),
                }
            )
        if diverged or rounds_done % spec.train.eval_every == 0 or rounds_done == spec.train.rounds:
            # this process's first worker (worker 0 on one process; every worker holds the same bits when checksums agree)
            p0 = jax.tree_util.tree_map(
                jnp.asarray, _train.worker_copy(state.params, _train.first_local_worker(state.params))
            )
            test_loss, acc = (float(v) for v in evaluate(p0))
            diverged = diverged or not math.isfinite(test_loss)
            best_acc = max(best_acc, acc)
            if reached is None and acc >= spec.train.target_acc:
                reached = rounds_done
            last_eval = {
                "kind": "eval",
                **common(rounds_done),
                "phase": phase,
                "eval_loss": test_loss,
                "eval_accuracy": acc,
                "train_loss": train_loss,
                "compute_time_s": compute_time(),
                "comm_model_s": comm_s,
                "bits_per_element_mean": _bits.bits_per_element(total_bits, ref_bits * rounds_done),
                "checksums_equal": checks_ok,
            }
            log(last_eval)
        if diverged:
            break
        if stop() and rounds_done < spec.train.rounds:
            raise Stopped(spec.label, rounds_done, spec.train.rounds, 0, 0)
    final_acc = last_eval.get("eval_accuracy", float("nan"))
    diverged = diverged or not math.isfinite(last_eval.get("eval_loss", float("nan"))) or final_acc < 0.2
    round_median = {k: float(np.median(v)) for k, v in phase_times.items()}
    if params_file is not None:
        params_file.parent.mkdir(parents=True, exist_ok=True)
        np.savez(params_file, **flat_params(_train.worker_copy(state.params, _train.first_local_worker(state.params))))
    return {
        "run": spec.label,
        "group": spec.group,
        "method": spec.sync.method,
        "topology": spec.topology.kind,
        "workers": topo.size,
        "K": spec.sync.K,
        "norm": spec.sync.norm if spec.sync.method == "ssdm" else None,
        "eta_l": spec.train.eta_l,
        "eta_s": spec.sync.eta_s,
        "local_steps": h,
        "momentum": spec.train.momentum,
        "lr_decay": spec.train.lr_decay,
        "lr_decay_every": spec.train.lr_decay_every,
        "bucket": spec.sync.bucket if spec.sync.norm == "bucket" else None,
        "seed": spec.seed,
        "rounds": rounds_done,
        "rounds_to_target": reached,
        "target_accuracy": spec.train.target_acc,
        "eval_accuracy": final_acc,
        "best_eval_accuracy": best_acc,
        "eval_loss": last_eval.get("eval_loss"),
        "initial_train_loss": loss0,
        "final_train_loss": train_loss,
        "diverged": diverged,
        "bits_per_element": _bits.bits_per_element(total_bits, ref_bits * max(rounds_done, 1)),
        "bits_per_element_by_phase": {k: _bits.bits_per_element(v, ref_bits) for k, v in phase_bits.items()},
        "payload_bytes_by_phase": {k: _bytes(v) for k, v in phase_bits.items()},
        "payload_bytes_total": _bytes(total_bits),
        "wall_time_s": time.time() - start,
        "compute_time_s": compute_time(),
        "compile_time_s": compile_s,
        "comm_model_s": comm_s,
        "round_time_s_median_by_phase": round_median,
        "rounds_by_phase": phase_count,
        "time_est_s": sum(phase_count[k] * round_median.get(k, 0.0) for k in phase_count) + comm_s,
        "checksums_equal": checks_ok,
        "digest": digest,
        "params": tr.dim,
        "params_file": None if params_file is None else f"{params_file.parent.name}/{params_file.name}",
    }


def lr_scales(spec: _config.RunSpec, phase: Callable[[int], str]) -> Callable[[int], float]:
    """``t -> `` the factor on ``train.eta_l`` in round ``t``: ``lr_decay ** n(t)`` where ``n(t)``
    counts the decay points before round ``t`` (``lr_decay_every``: every N rounds, ``t // N``; or
    ``"full"``: the full-precision rounds ``s`` with ``0 < s < t``, so a full round averages updates
    made at the step size before it)."""
    f, every = float(spec.train.lr_decay), spec.train.lr_decay_every
    if every is None or f == 1.0:
        return lambda t: 1.0
    if every != "full":
        return lambda t: f ** (t // every)
    fulls: list[int] = []  # fulls[t] = full-precision rounds s with 0 < s < t

    def scale(t: int) -> float:
        while len(fulls) <= t:
            s = len(fulls)
            fulls.append(0 if s == 0 else fulls[-1] + (1 if s - 1 > 0 and phase(s - 1) == "full" else 0))
        return f ** fulls[t]

    return scale


def _workers_devices(n: int) -> list:
    """The ``n`` devices of the run's workers: this process's CPU devices, or, in a job of several
    processes (``jax.distributed``), every process's devices.

    Raises:
      DeviceError: a job of several processes whose devices are not ``n`` in all.
    """
    if not jax.distributed.is_initialized():  # asked without starting jax's backend: the count is not set yet
        return ensure_cpu_devices(n)
    devices = jax.devices()
    if len(devices) != n:
        raise DeviceError(
            f"this run has {n} workers but the {jax.process_count()} processes hold {len(devices)} "
            f"devices in all; give each process {n} / {jax.process_count()} devices"
        )
    return devices


def _write_json(path: Path, obj: Any) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(obj, indent=1))
    os.replace(tmp, path)


def _finished_earlier(out: Path, runs: Sequence[_config.RunSpec]) -> list[dict]:
    """The summaries of ``out``'s finished runs, each checked against the same label's config now."""
    if not (out / "config.yaml").is_file():
        raise ValueError(f"--resume: {out} holds no Marsit run to resume (no config.yaml); drop --resume to start one")
    old_cfg = yaml.safe_load((out / "config.yaml").read_text()) or {}
    old = {r["label"]: r for r in old_cfg.get("runs", [])}
    summary = json.loads((out / "summary.json").read_text()) if (out / "summary.json").is_file() else {"runs": []}
    now = {s.label: _config.spec_dict(s) for s in runs}
    kept = []
    for s in summary.get("runs", []):
        label = s["run"]
        if label not in now:
            raise ValueError(
                f"--resume: run {label!r} finished in {out} is not in the config any more; "
                f"choose another --out or restore the config"
            )
        changed = _config.spec_diff(old.get(label, {}), now[label])
        if changed:
            raise ValueError(
                f"--resume: run {label!r} finished in {out} with another config: {', '.join(changed)} "
                f"differ; choose another --out or drop the --set that changed them"
            )
        kept.append(s)
    return kept


def run_config(
    runs: Sequence[_config.RunSpec],
    out: str | os.PathLike,
    *,
    name: str = "marsit",
    resume: bool = False,
    stop: Callable[[], bool] = lambda: False,
    progress: Callable[[str], None] | None = print,
) -> dict:
    """Train every run of ``runs`` into ``out`` (see the module docstring); returns ``summary.json``'s content.

    Raises:
      ValueError: ``out`` already holds a run (without ``resume``); with ``resume``, nothing to
        resume or a finished run whose config changed (the fields named).
      DeviceError: jax started earlier with fewer CPU devices than a run's workers.
      Stopped: ``stop()`` turned true; the finished runs are in ``summary.json``.
    """
    out = Path(out)
    held = [m for m in ("config.yaml", "metrics.jsonl", "summary.json") if (out / m).exists()]
    if held and not resume:
        raise ValueError(
            f"output folder {out} already holds a run ({', '.join(held)}); pass --resume to continue it "
            f"or choose another --out"
        )
    kept = _finished_earlier(out, runs) if resume else []
    done = {s["run"] for s in kept}
    if not jax.distributed.is_initialized():
        ensure_cpu_devices(max(r.topology.workers for r in runs if r.label not in done) if len(done) < len(runs) else 1)
    out.mkdir(parents=True, exist_ok=True)
    metrics = out / "metrics.jsonl"
    rows = [r for r in read_metrics(metrics) if r.get("run") in done] if resume and metrics.exists() else []
    with metrics.open("w", encoding="utf-8") as fh:  # the unfinished runs' rows are produced again
        fh.writelines(json.dumps(r) + "\n" for r in rows)
    (out / "config.yaml").write_text(
        yaml.safe_dump({"name": name, "runs": [_config.spec_dict(r) for r in runs]}, sort_keys=False)
    )
    order = {r.label: i for i, r in enumerate(runs)}
    summaries = list(kept)

    def write_summary() -> dict:
        obj = {
            "name": name,
            "runs": sorted(summaries, key=lambda s: order[s["run"]]),
            "finished": len(summaries),
            "total": len(runs),
        }
        _write_json(out / "summary.json", obj)
        return obj

    obj = write_summary()
    with MetricsWriter(metrics) as w:

        def log(row: dict) -> None:
            w.write(row)
            if progress is not None and row["kind"] == "eval":
                progress(
                    f"[{row['run']}] round {row['step']:>5}  loss {row['train_loss']:.4f}  "
                    f"acc {row['eval_accuracy']:.4f}  bits/elem {row['bits_per_element_mean']:.3f}  "
                    f"wall {row['wall_time_s']:.1f}s"
                )

        for i, spec in enumerate(runs):
            if spec.label in done:
                if progress is not None:
                    progress(f"[{spec.label}] finished earlier: kept")
                continue
            if stop():  # asked to stop between two runs: the next one does not start
                raise Stopped(spec.label, 0, spec.train.rounds, len(summaries), len(runs))
            try:
                summaries.append(run_one(spec, log, stop=stop, params_file=out / "params" / f"run_{i}.npz"))
            except Stopped as e:
                raise Stopped(e.label, e.step, e.total, len(summaries), len(runs)) from None
            obj = write_summary()
    return obj


def _fmt(v) -> str:
    if isinstance(v, float):
        return f"{v:.4g}"
    return "-" if v is None else str(v)


def table(summaries: Sequence[dict]) -> str:
    """A plain-text table of run summaries (one line per run)."""
    cols = [
        "run",
        "method",
        "workers",
        "K",
        "eta_l",
        "eta_s",
        "rounds_to_target",
        "eval_accuracy",
        "best_eval_accuracy",
        "diverged",
        "bits_per_element",
        "compute_time_s",
        "comm_model_s",
        "checksums_equal",
    ]
    rows = [cols] + [[_fmt(s.get(c)) for c in cols] for s in summaries]
    widths = [max(len(r[i]) for r in rows) for i in range(len(cols))]
    return "\n".join("  ".join(v.ljust(w) for v, w in zip(r, widths)) for r in rows)
