"""Experiment runner for the sign-bit family: ``python -m zeroth.bench.marsit CONFIG --out DIR``.

A config (YAML) is a base setup plus a list of ``runs``, each a partial override of the base
(deep-merged); the runner trains them one after another with M CPU devices as M workers (the
device count is set before jax starts) and writes

* ``DIR/metrics.jsonl``: one record per evaluation (``"kind": "eval"``) and one per run
  (``"kind": "summary"``);
* ``DIR/config.yaml``: the config as resolved.

Per round it checks that every worker holds bit-identical parameters (``zeroth.replay.checksum``
of each device shard) every ``train.checksum_every`` rounds, and counts the bits that cross
``ppermute`` (:mod:`zeroth.collectives.bits`) for that round's phase. ``comm_model_s`` models the
communication time on links of ``network.gbps`` with ``network.latency_us`` per hop: every
``ppermute`` step costs ``latency + bits per sender / bandwidth`` (senders work in parallel).
``wall_s`` is measured compute time (the first round of each phase compiles; it is timed apart as
``compile_s`` and counted at the steady mean); ``time_est_s`` = rounds of each phase times that
phase's median round time, plus ``comm_model_s``: robust to a busy machine.

Config schema (every key optional except ``runs``; unknown keys are errors)::

    name: marsit_fig3b          # run name
    seed: 0                     # names init, batches and round keys
    data: {dataset: mnist5k, batch_size: 32, eval_size: 1000}   # batch_size per worker
    model: {name: cnn, kwargs: {features: [8, 16], dense: 32}}
    topology: {kind: ring, workers: 4, rows: null}
    train: {rounds: 300, eta_l: 0.05, eval_every: 25, checksum_every: 1, target_acc: 0.9}
    sync: {method: marsit, eta_s: 0.001, K: null, norm: l2}     # K: null = infinity; norm: SSDM's
    network: {gbps: 1.0, latency_us: 50.0}
    runs: [{label: "K=1", sync: {K: 1}}, {label: "K=inf"}]
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import json
import math
import os
import sys
import time
from collections.abc import Mapping
from pathlib import Path

import yaml

__all__ = [
    "DataSpec",
    "ModelSpec",
    "TopologySpec",
    "TrainSpec",
    "SyncSpec",
    "NetworkSpec",
    "RunSpec",
    "load_runs",
    "run_one",
    "main",
]


@dataclasses.dataclass(frozen=True)
class DataSpec:
    """Dataset and batching."""

    dataset: str = "mnist5k"  # a zeroth.data name
    batch_size: int = 32  # examples per worker per round
    eval_size: int = 0  # test examples used for evaluation; 0 = all


@dataclasses.dataclass(frozen=True)
class ModelSpec:
    """Model from zeroth.models."""

    name: str = "cnn"
    kwargs: dict = dataclasses.field(default_factory=lambda: {"features": [8, 16], "dense": 32})


@dataclasses.dataclass(frozen=True)
class TopologySpec:
    """Workers and how they are wired."""

    kind: str = "ring"  # ring | torus
    workers: int = 4
    rows: int | None = None  # torus rows (default: most square)


@dataclasses.dataclass(frozen=True)
class TrainSpec:
    """Rounds and step sizes."""

    rounds: int = 200
    eta_l: float = 0.05  # local step size: u = eta_l * grad
    eval_every: int = 25
    checksum_every: int = 1  # compare every worker's parameter checksum every this many rounds
    target_acc: float = 0.9  # "rounds" = first evaluated round reaching this test accuracy


@dataclasses.dataclass(frozen=True)
class SyncSpec:
    """Synchronization method (zeroth.collectives.sync.METHODS)."""

    method: str = "psgd"
    eta_s: float | None = None  # global step size of the sign methods
    K: int | None = None  # Marsit: full precision every K rounds; null = never
    norm: str = "l2"  # SSDM's norm: l2 (the seed's) or linf


@dataclasses.dataclass(frozen=True)
class NetworkSpec:
    """Modeled links for comm_model_s."""

    gbps: float = 1.0
    latency_us: float = 50.0


@dataclasses.dataclass(frozen=True)
class RunSpec:
    """One training run (base config merged with one entry of ``runs``)."""

    label: str
    name: str = "collectives"
    seed: int = 0
    group: str = ""  # runs of one group are alternatives (e.g. a step-size grid); tables keep the best
    data: DataSpec = DataSpec()
    model: ModelSpec = ModelSpec()
    topology: TopologySpec = TopologySpec()
    train: TrainSpec = TrainSpec()
    sync: SyncSpec = SyncSpec()
    network: NetworkSpec = NetworkSpec()


_SECTIONS = {
    "data": DataSpec,
    "model": ModelSpec,
    "topology": TopologySpec,
    "train": TrainSpec,
    "sync": SyncSpec,
    "network": NetworkSpec,
}


def _build(cls, raw: Mapping, where: str):
    if not isinstance(raw, Mapping):
        raise ValueError(f"{where} must be a mapping, got {raw!r}")
    names = [f.name for f in dataclasses.fields(cls)]
    unknown = [k for k in raw if k not in names]
    if unknown:
        raise ValueError(f"unknown key {where}.{unknown[0]}; valid keys are {names}")
    kwargs = {}
    for f in dataclasses.fields(cls):
        if f.name not in raw:
            continue
        v = raw[f.name]
        if f.name in _SECTIONS and cls is RunSpec:
            v = _build(_SECTIONS[f.name], v, f.name)
        elif f.name == "K" and isinstance(v, str) and v.lower() in ("inf", "infinity"):
            v = None
        elif isinstance(f.default, float) and isinstance(v, str):
            v = float(v)
        kwargs[f.name] = v
    return cls(**kwargs)


def _merge(base: dict, over: Mapping) -> dict:
    out = copy.deepcopy(base)
    for k, v in over.items():
        if isinstance(v, Mapping) and isinstance(out.get(k), Mapping) and k != "kwargs":
            out[k] = _merge(out[k], v)
        else:
            out[k] = copy.deepcopy(v)
    return out


def _validate(spec: RunSpec) -> RunSpec:
    from zeroth.collectives import sync as _sync

    if spec.sync.method not in _sync.METHODS:
        raise ValueError(f"run {spec.label!r}: unknown sync.method {spec.sync.method!r}; expected one of {list(_sync.METHODS)}")
    if spec.sync.norm not in ("l2", "linf"):
        raise ValueError(f"run {spec.label!r}: sync.norm must be 'l2' or 'linf', got {spec.sync.norm!r}")
    if spec.topology.kind not in ("ring", "torus"):
        raise ValueError(f"run {spec.label!r}: topology.kind must be 'ring' or 'torus', got {spec.topology.kind!r}")
    for name, v in (("train.rounds", spec.train.rounds), ("train.eval_every", spec.train.eval_every),
                    ("train.checksum_every", spec.train.checksum_every), ("topology.workers", spec.topology.workers),
                    ("data.batch_size", spec.data.batch_size)):
        if not isinstance(v, int) or v < 1:
            raise ValueError(f"run {spec.label!r}: {name} must be an int >= 1, got {v!r}")
    if not spec.train.eta_l > 0:
        raise ValueError(f"run {spec.label!r}: train.eta_l must be > 0, got {spec.train.eta_l!r}")
    return spec


def load_runs(path: str | Path, overrides: Mapping | None = None) -> list[RunSpec]:
    """Parse a config file into its runs (base deep-merged with each ``runs`` entry, then ``overrides``).

    Raises:
      ValueError: unknown keys (named, with the valid ones), bad values, no runs.
    """
    raw = yaml.safe_load(Path(path).read_text()) or {}
    if not isinstance(raw, Mapping):
        raise ValueError(f"{path}: a config is a mapping, got {type(raw).__name__}")
    runs = raw.get("runs")
    if not runs:
        raise ValueError(f"{path}: 'runs' must list at least one run (e.g. runs: [{{label: base}}])")
    base = {k: v for k, v in raw.items() if k != "runs"}
    out = []
    for i, r in enumerate(runs):
        merged = _merge(base, r)
        if overrides:
            merged = _merge(merged, overrides)
        merged.setdefault("label", f"run{i}")
        out.append(_validate(_build(RunSpec, merged, "config")))
    labels = [r.label for r in out]
    if len(set(labels)) != len(labels):
        raise ValueError(f"{path}: run labels must be unique, got {labels}")
    return out


def _ensure_devices(n: int) -> None:
    flags = os.environ.get("XLA_FLAGS", "")
    if "xla_force_host_platform_device_count" not in flags:
        os.environ["XLA_FLAGS"] = f"{flags} --xla_force_host_platform_device_count={n}".strip()
    os.environ.setdefault("JAX_PLATFORMS", "cpu")


def run_one(spec: RunSpec, log) -> dict:
    """Train one run, calling ``log(record)`` per evaluation; returns its summary record."""
    import jax
    import jax.numpy as jnp
    import numpy as np
    import optax

    from zeroth import data as _data
    from zeroth import models as _models
    from zeroth.collectives import bits as _bits
    from zeroth.collectives import sync as _sync
    from zeroth.collectives import topology as _topo
    from zeroth.collectives import train as _train

    topo = _topo.make_topology(spec.topology.kind, spec.topology.workers, spec.topology.rows)
    if len(jax.devices()) < topo.size:
        raise ValueError(
            f"run {spec.label!r} needs {topo.size} devices, found {len(jax.devices())}; start a fresh process "
            f"(the runner sets XLA_FLAGS=--xla_force_host_platform_device_count before jax starts)"
        )
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

    sync = _sync.build(spec.sync.method, topo, eta_s=spec.sync.eta_s, K=spec.sync.K, norm=spec.sync.norm)
    tr = _train.make_trainer(loss_fn, params0, topo, sync, eta_l=spec.train.eta_l, run_seed=spec.seed)
    state = tr.init(params0)
    m, b, n_train = topo.size, spec.data.batch_size, train_ds.x.shape[0]

    def batch(t):
        idx = [_data.batch_indices(spec.seed, t * m + k, b, n_train) for k in range(m)]
        return np.stack([train_ds.x[i] for i in idx]), np.stack([train_ds.y[i] for i in idx])

    xs0, ys0 = batch(0)
    ref_bits = tr.reference_bits()
    phase_bits: dict[str, int] = {}
    phase_comm: dict[str, float] = {}

    def account(phase: str) -> None:
        if phase in phase_bits:
            return
        report = tr.round_report(phase, xs0, ys0)
        phase_bits[phase] = int(sum(r["bits"] for r in report))
        phase_comm[phase] = sum(
            spec.network.latency_us * 1e-6 + r["per_send_bits"] / (spec.network.gbps * 1e9) for r in report
        )

    total_bits, comm_s, wall_s, rounds_done = 0, 0.0, 0.0, 0
    compiled: set[str] = set()
    compile_s, steady = 0.0, 0
    phase_times: dict[str, list[float]] = {}
    phase_count: dict[str, int] = {}

    def wall_total() -> float:
        return wall_s * rounds_done / steady if steady else 0.0
    checks_ok, diverged, reached = True, False, None
    best_acc, last = 0.0, {}
    loss0 = None
    for t in range(spec.train.rounds):
        phase = sync.phase(t)
        account(phase)
        xs, ys = batch(t)
        t0 = time.perf_counter()
        state, losses = tr.round(state, t, xs, ys)
        losses = np.asarray(losses)
        dt = time.perf_counter() - t0
        phase_count[phase] = phase_count.get(phase, 0) + 1
        if phase in compiled:
            wall_s += dt
            steady += 1
            phase_times.setdefault(phase, []).append(dt)
        else:  # the first round of a phase compiles it: kept apart, counted at the steady mean
            compiled.add(phase)
            compile_s += dt
        rounds_done = t + 1
        total_bits += phase_bits[phase]
        comm_s += phase_comm[phase]
        train_loss = float(losses.mean())
        loss0 = train_loss if loss0 is None else loss0
        if (t + 1) % spec.train.checksum_every == 0:
            checks_ok = checks_ok and len(set(_train.worker_checksums(state.params))) == 1
        if not math.isfinite(train_loss):
            diverged = True
        if diverged or (t + 1) % spec.train.eval_every == 0 or t + 1 == spec.train.rounds:
            p0 = jax.tree_util.tree_map(jnp.asarray, _train.worker_copy(state.params, 0))
            test_loss, acc = (float(v) for v in evaluate(p0))
            if not math.isfinite(test_loss):
                diverged = True
            best_acc = max(best_acc, acc if math.isfinite(acc) else 0.0)
            if reached is None and acc >= spec.train.target_acc:
                reached = t + 1
            last = {
                "kind": "eval",
                "run": spec.label,
                "group": spec.group,
                "round": t + 1,
                "phase": phase,
                "train_loss": train_loss,
                "test_loss": test_loss,
                "test_acc": acc,
                "wall_s": wall_total(),
                "comm_model_s": comm_s,
                "bits_total": total_bits,
                "bits_per_element": _bits.bits_per_element(total_bits, ref_bits * rounds_done),
                "checksums_equal": checks_ok,
            }
            log(last)
        if diverged:
            break
    final_acc = last.get("test_acc", float("nan"))
    diverged = diverged or not math.isfinite(last.get("test_loss", float("nan"))) or final_acc < 0.2
    round_median = {k: float(np.median(v)) for k, v in phase_times.items()}
    summary = {
        "kind": "summary",
        "run": spec.label,
        "group": spec.group,
        "method": spec.sync.method,
        "topology": spec.topology.kind,
        "workers": topo.size,
        "K": spec.sync.K,
        "norm": spec.sync.norm if spec.sync.method == "ssdm" else None,
        "eta_l": spec.train.eta_l,
        "eta_s": spec.sync.eta_s,
        "rounds": rounds_done,
        "rounds_to_target": reached,
        "target_acc": spec.train.target_acc,
        "final_acc": final_acc,
        "best_acc": best_acc,
        "initial_train_loss": loss0,
        "final_train_loss": last.get("train_loss"),
        "diverged": diverged,
        "bits_per_element": _bits.bits_per_element(total_bits, ref_bits * max(rounds_done, 1)),
        "bits_per_element_by_phase": {k: _bits.bits_per_element(v, ref_bits) for k, v in phase_bits.items()},
        "wall_s": wall_total(),
        "compile_s": compile_s,
        "comm_model_s": comm_s,
        "time_model_s": wall_total() + comm_s,
        "round_s_median_by_phase": round_median,
        "rounds_by_phase": phase_count,
        # robust to a busy machine: rounds of each phase x that phase's median round time, + links
        "time_est_s": sum(phase_count[k] * round_median.get(k, 0.0) for k in phase_count) + comm_s,
        "checksums_equal": checks_ok,
        "params": tr.dim,
    }
    log(summary)
    return summary


def _table(summaries: list[dict]) -> str:
    cols = ["run", "method", "workers", "K", "eta_l", "eta_s", "rounds_to_target", "final_acc", "best_acc",
            "diverged", "bits_per_element", "wall_s", "comm_model_s", "checksums_equal"]
    rows = [cols] + [[_fmt(s.get(c)) for c in cols] for s in summaries]
    widths = [max(len(r[i]) for r in rows) for i in range(len(cols))]
    return "\n".join("  ".join(v.ljust(w) for v, w in zip(r, widths)) for r in rows)


def _fmt(v) -> str:
    if isinstance(v, float):
        return f"{v:.4g}"
    return "-" if v is None else str(v)


def main(argv: list[str] | None = None) -> int:
    """CLI: ``python -m zeroth.bench.marsit CONFIG --out DIR [--only LABEL ...] [--rounds N]``."""
    ap = argparse.ArgumentParser(prog="python -m zeroth.bench.marsit", description=__doc__.split("\n")[0])
    ap.add_argument("config", help="YAML config (see module docstring)")
    ap.add_argument("--out", required=True, help="output folder (metrics.jsonl, config.yaml)")
    ap.add_argument("--only", nargs="*", default=None, help="run only these labels")
    ap.add_argument("--rounds", type=int, default=None, help="override train.rounds of every run")
    args = ap.parse_args(argv)
    overrides = {"train": {"rounds": args.rounds}} if args.rounds else None
    runs = load_runs(args.config, overrides)
    if args.only:
        missing = [o for o in args.only if o not in {r.label for r in runs}]
        if missing:
            print(f"unknown run label(s) {missing}; labels are {[r.label for r in runs]}", file=sys.stderr)
            return 2
        runs = [r for r in runs if r.label in args.only]
    _ensure_devices(max(r.topology.workers for r in runs))
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.yaml").write_text(yaml.safe_dump({"runs": [dataclasses.asdict(r) for r in runs]}, sort_keys=False))
    summaries = []
    with open(out / "metrics.jsonl", "w") as f:

        def log(rec):
            f.write(json.dumps(rec) + "\n")
            f.flush()
            if rec["kind"] == "eval":
                print(
                    f"[{rec['run']}] round {rec['round']:>5}  loss {rec['train_loss']:.4f}  acc {rec['test_acc']:.4f}  "
                    f"bits/elem {rec['bits_per_element']:.3f}  wall {rec['wall_s']:.1f}s",
                    flush=True,
                )

        for spec in runs:
            summaries.append(run_one(spec, log))
    print(_table(summaries))
    return 0


if __name__ == "__main__":
    sys.exit(main())
