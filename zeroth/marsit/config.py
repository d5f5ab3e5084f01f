"""The config of a Marsit experiment (seed 004): a base setup and a list of ``runs``, each a partial override.

A Marsit config is recognised by its top-level ``runs`` list (:func:`is_config`); ``zeroth run``
sends it here instead of to :mod:`zeroth.config`. Each entry of ``runs`` is deep-merged into the
base, then the ``--set`` overrides are merged into every run (they win over the entries). Every key
is optional except ``runs``; an unknown key is a ``ValueError`` naming it and the valid keys::

    name: marsit_fig3b          # run name (default output folder: runs/<name>)
    seed: 0                     # names init, batches and round keys
    data: {dataset: mnist5k, batch_size: 32, eval_size: 1000}   # batch_size per worker
    model: {name: cnn, kwargs: {features: [8, 16], dense: 32}}
    topology: {kind: ring, workers: 4, rows: null}
    train: {rounds: 300, eta_l: 0.05, eval_every: 25, log_every: 1, checksum_every: 1, target_acc: 0.9,
            local_steps: 1, momentum: 0.0, lr_decay: 1.0, lr_decay_every: null}
    sync: {method: marsit, eta_s: 0.001, K: null, norm: l2, bucket: 256}  # K: null = infinity; norm, bucket: SSDM's
    network: {gbps: 1.0, latency_us: 50.0}
    runs: [{label: "K=1", sync: {K: 1}}, {label: "K=inf"}]

Example:
  >>> specs = load_runs_dict({"train": {"rounds": 3}, "runs": [{"label": "a"}, {"label": "b", "seed": 1}]},
  ...                        ["train.rounds=5"])
  >>> [(s.label, s.seed, s.train.rounds) for s in specs]
  [('a', 0, 5), ('b', 1, 5)]
"""

from __future__ import annotations

import copy
import dataclasses
from collections.abc import Mapping, Sequence
from pathlib import Path

from zeroth import config as _config
from zeroth.collectives import sync as _sync

__all__ = [
    "DataSpec",
    "ModelSpec",
    "TopologySpec",
    "TrainSpec",
    "SyncSpec",
    "NetworkSpec",
    "RunSpec",
    "is_config",
    "read_config",
    "parse_overrides",
    "load_runs",
    "load_runs_dict",
    "spec_dict",
    "spec_diff",
]


@dataclasses.dataclass(frozen=True)
class DataSpec:
    """Dataset and batching."""

    dataset: str = _config.field("mnist5k", "Dataset name, as in zeroth.data (`zeroth datasets` lists them).")
    batch_size: int = _config.field(32, "Training examples per worker per round.")
    eval_size: int = _config.field(0, "Test examples used for evaluation; 0 = the whole split.")


@dataclasses.dataclass(frozen=True)
class ModelSpec:
    """Model from zeroth.models."""

    name: str = _config.field("cnn", "Model name in zeroth.models.")
    kwargs: dict = _config.field(
        help="The model's arguments (replaced whole by a run entry, not merged).",
        factory=lambda: {"features": [8, 16], "dense": 32},
    )


@dataclasses.dataclass(frozen=True)
class TopologySpec:
    """Workers and how they are wired."""

    kind: str = _config.field(
        "ring", "How the workers are wired for the multi-hop all-reduce.", choices=("ring", "torus")
    )
    workers: int = _config.field(4, "Number of workers (simulated devices of this process).")
    rows: int | None = _config.field(None, "Torus rows; null = the most square factorisation of workers.")


@dataclasses.dataclass(frozen=True)
class TrainSpec:
    """Rounds and step sizes."""

    rounds: int = _config.field(200, "Training rounds (local_steps local steps and one synchronization each).")
    eta_l: float = _config.field(0.05, "Local step size: each worker's update is u = eta_l * grad.")
    eval_every: int = _config.field(25, "Evaluate test accuracy every this many rounds (and at the last).")
    log_every: int = _config.field(1, "A train row in metrics.jsonl every this many rounds (and at the last).")
    checksum_every: int = _config.field(1, "Compare every worker's parameter checksum every this many rounds.")
    target_acc: float = _config.field(
        0.9, "rounds_to_target in summary.json is the first evaluated round reaching this test accuracy."
    )
    local_steps: int = _config.field(1, "Local steps per worker between two synchronizations, each on its own batch.")
    momentum: float = _config.field(0.0, "Heavy-ball momentum of the local steps (0 = plain SGD; kept across rounds).")
    lr_decay: float = _config.field(
        1.0, "Factor on the local step size at each decay point (1.0 = constant; the seed's 0.1)."
    )
    lr_decay_every: int | str | None = _config.field(
        None,
        "When the step size decays: null = never, an int N = every N rounds, 'full' = after every "
        "full-precision synchronization (round t > 0 of phase full; Marsit with K > 1).",
    )


@dataclasses.dataclass(frozen=True)
class SyncSpec:
    """Synchronization method (zeroth.collectives.sync.METHODS)."""

    method: str = _config.field("psgd", "Synchronization method.", choices=lambda: list(_sync.METHODS))
    eta_s: float | None = _config.field(
        None, "Global step size of signsgd, majority_vote and marsit (required there); unused by the others."
    )
    K: int | None = _config.field(None, "Marsit: a full-precision round every K rounds; null (or inf) = never.")
    norm: str = _config.field(
        "l2",
        "SSDM's norm: l2 (the seed's, whole vector), linf, or bucket (l2 per bucket elements).",
        choices=("l2", "linf", "bucket"),
    )
    bucket: int = _config.field(256, "SSDM's bucket length for norm: bucket (a multiple of 32).")


@dataclasses.dataclass(frozen=True)
class NetworkSpec:
    """Modeled links for comm_model_s."""

    gbps: float = _config.field(1.0, "Link bandwidth in Gbit/s of the communication-time model.")
    latency_us: float = _config.field(50.0, "Per-hop latency in microseconds of the communication-time model.")


@dataclasses.dataclass(frozen=True)
class RunSpec:
    """One training run (base config merged with one entry of ``runs``, then the overrides)."""

    label: str = _config.field(help="The run's label (required in every entry of runs; names its folder and its rows).")
    name: str = _config.field("marsit", "Experiment name (default output folder: runs/<name>).")
    seed: int = _config.field(0, "Seed of the initialisation, the batches and the round keys.")
    group: str = _config.field("", "Runs of one group are alternatives (a step-size grid): the tables keep the best.")
    data: DataSpec = _config.field(DataSpec(), "Dataset and batching.")
    model: ModelSpec = _config.field(ModelSpec(), "Model and its arguments.")
    topology: TopologySpec = _config.field(TopologySpec(), "Workers and how they are wired.")
    train: TrainSpec = _config.field(TrainSpec(), "Rounds and step sizes.")
    sync: SyncSpec = _config.field(SyncSpec(), "Synchronization method.")
    network: NetworkSpec = _config.field(NetworkSpec(), "Modeled links of the communication-time model (comm_model_s).")


_SECTIONS = {
    "data": DataSpec,
    "model": ModelSpec,
    "topology": TopologySpec,
    "train": TrainSpec,
    "sync": SyncSpec,
    "network": NetworkSpec,
}


def is_config(raw: object) -> bool:
    """True for a parsed YAML mapping that is a Marsit config: it has a top-level ``runs`` key."""
    return isinstance(raw, Mapping) and "runs" in raw


def read_config(path: str | Path) -> object:
    """The parsed YAML of ``path`` (``FileNotFoundError`` / ``ValueError`` naming the file)."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"config file {str(path)!r} does not exist")
    return _config.parse_yaml(path.read_text(), f"config file {str(path)!r}")


def _build(cls, raw: Mapping, where: str):
    if not isinstance(raw, Mapping):
        raise ValueError(f"{where} must be a mapping, got {raw!r}")
    names = [f.name for f in dataclasses.fields(cls)]
    unknown = [k for k in raw if k not in names]
    if unknown:
        key = f"{where}.{unknown[0]}" if where != "config" else unknown[0]
        raise ValueError(f"unknown config key {key}; valid keys are {names}")
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
            try:
                v = float(v)
            except ValueError:
                raise ValueError(f"config field {where}.{f.name}: {v!r} is not a number") from None
        kwargs[f.name] = v
    return cls(**kwargs)


def _merge(base: Mapping, over: Mapping) -> dict:
    """``over`` deep-merged into a copy of ``base`` (``model.kwargs`` is replaced whole)."""
    out = copy.deepcopy(dict(base))
    for k, v in over.items():
        if isinstance(v, Mapping) and isinstance(out.get(k), Mapping) and k != "kwargs":
            out[k] = _merge(out[k], v)
        else:
            out[k] = copy.deepcopy(v)
    return out


def _validate(spec: RunSpec) -> RunSpec:
    where = f"run {spec.label!r}"
    if spec.sync.method not in _sync.METHODS:
        raise ValueError(f"{where}: unknown sync.method {spec.sync.method!r}; expected one of {list(_sync.METHODS)}")
    if spec.sync.norm not in ("l2", "linf", "bucket"):
        raise ValueError(f"{where}: sync.norm must be 'l2', 'linf' or 'bucket', got {spec.sync.norm!r}")
    b = spec.sync.bucket
    if isinstance(b, bool) or not isinstance(b, int) or b < 32 or b % 32:
        raise ValueError(f"{where}: sync.bucket must be a positive multiple of 32, got {b!r}")
    tr = spec.train
    if isinstance(tr.local_steps, bool) or not isinstance(tr.local_steps, int) or tr.local_steps < 1:
        raise ValueError(f"{where}: train.local_steps must be an int >= 1, got {tr.local_steps!r}")
    if isinstance(tr.momentum, bool) or not isinstance(tr.momentum, (int, float)) or not 0 <= tr.momentum < 1:
        raise ValueError(f"{where}: train.momentum must be a number in [0, 1), got {tr.momentum!r}")
    if isinstance(tr.lr_decay, bool) or not isinstance(tr.lr_decay, (int, float)) or not 0 < tr.lr_decay <= 1:
        raise ValueError(f"{where}: train.lr_decay must be a number in (0, 1], got {tr.lr_decay!r}")
    e = tr.lr_decay_every
    if e is not None and e != "full" and (isinstance(e, bool) or not isinstance(e, int) or e < 1):
        raise ValueError(f"{where}: train.lr_decay_every must be null, an int >= 1 or 'full', got {e!r}")
    if e == "full" and not (spec.sync.method == "marsit" and spec.sync.K is not None and spec.sync.K > 1):
        raise ValueError(
            f"{where}: train.lr_decay_every 'full' decays after each full-precision synchronization, "
            f"which needs sync.method marsit with K > 1 (got {spec.sync.method}, K={spec.sync.K}); "
            f"use an int (every N rounds) or null"
        )
    if spec.topology.kind not in ("ring", "torus"):
        raise ValueError(f"{where}: topology.kind must be 'ring' or 'torus', got {spec.topology.kind!r}")
    for name, v in (
        ("train.rounds", spec.train.rounds),
        ("train.eval_every", spec.train.eval_every),
        ("train.log_every", spec.train.log_every),
        ("train.checksum_every", spec.train.checksum_every),
        ("topology.workers", spec.topology.workers),
        ("data.batch_size", spec.data.batch_size),
        ("seed", spec.seed),
    ):
        if isinstance(v, bool) or not isinstance(v, int) or v < (0 if name == "seed" else 1):
            raise ValueError(f"{where}: {name} must be an int >= {0 if name == 'seed' else 1}, got {v!r}")
    for name, v in (("train.eta_l", spec.train.eta_l), ("network.gbps", spec.network.gbps)):
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not v > 0:
            raise ValueError(f"{where}: {name} must be a number > 0, got {v!r}")
    if spec.sync.K is not None and (
        isinstance(spec.sync.K, bool) or not isinstance(spec.sync.K, int) or spec.sync.K < 1
    ):
        raise ValueError(f"{where}: sync.K must be an int >= 1 or null (infinity), got {spec.sync.K!r}")
    return spec


def parse_overrides(overrides: Sequence[str]) -> dict:
    """``["train.rounds=5", "seed=1"]`` -> ``{"train": {"rounds": 5}, "seed": 1}`` (values parsed as YAML).

    Raises:
      ValueError: an override without ``=``, an empty key part, or one that sets ``runs`` or ``label``
        (the list of runs and their labels are the config's own).
    """
    out: dict = {}
    for ov in overrides:
        if "=" not in ov:
            raise ValueError(f"override {ov!r} must look like key=value or section.field=value (e.g. train.rounds=50)")
        key, text = ov.split("=", 1)
        parts = key.strip().split(".")
        if not all(parts):
            raise ValueError(f"override {ov!r}: empty key part; e.g. train.rounds=50")
        if parts[0] in ("runs", "label"):
            raise ValueError(f"override {ov!r}: {parts[0]!r} cannot be set from the command line; edit the config")
        value = _config.parse_yaml(text, f"override {ov!r}: the value") if text.strip() else ""
        node = {parts[-1]: value}
        for p in reversed(parts[:-1]):
            node = {p: node}
        out = _merge(out, node)
    return out


def load_runs_dict(raw: Mapping, overrides: Sequence[str] | Mapping = (), where: str = "config") -> list[RunSpec]:
    """The runs of a parsed config: base deep-merged with each ``runs`` entry, then with ``overrides``.

    Args:
      raw: the parsed YAML mapping.
      overrides: ``--set`` strings (:func:`parse_overrides`) or an already nested mapping.

    Raises:
      ValueError: unknown keys (named, with the valid ones), bad values, no runs, repeated labels.
    """
    if not isinstance(raw, Mapping):
        raise ValueError(f"{where}: a config is a mapping, got {type(raw).__name__}")
    runs = raw.get("runs")
    if not runs or not isinstance(runs, list) or not all(isinstance(r, Mapping) for r in runs):
        raise ValueError(f"{where}: 'runs' must list at least one run (e.g. runs: [{{label: base}}])")
    over = parse_overrides(overrides) if not isinstance(overrides, Mapping) else dict(overrides)
    base = {k: v for k, v in raw.items() if k != "runs"}
    out = []
    for i, r in enumerate(runs):
        merged = _merge(_merge(base, r), over)
        merged.setdefault("label", f"run{i}")
        merged["label"] = str(merged["label"])
        out.append(_validate(_build(RunSpec, merged, "config")))
    labels = [r.label for r in out]
    if len(set(labels)) != len(labels):
        raise ValueError(f"{where}: run labels must be unique, got {labels}")
    return out


def load_runs(path: str | Path, overrides: Sequence[str] | Mapping = ()) -> list[RunSpec]:
    """:func:`load_runs_dict` of the YAML file ``path``."""
    return load_runs_dict(read_config(path), overrides, where=str(path))


def spec_dict(spec: RunSpec) -> dict:
    """A run as plain nested dicts (what ``config.yaml`` holds for it)."""
    return dataclasses.asdict(spec)


def spec_diff(a: Mapping, b: Mapping, prefix: str = "") -> list[str]:
    """Dotted names of the fields that differ between two :func:`spec_dict` results."""
    out = []
    for k in sorted(set(a) | set(b)):
        va, vb = a.get(k), b.get(k)
        if isinstance(va, Mapping) and isinstance(vb, Mapping) and k != "kwargs":
            out += spec_diff(va, vb, f"{prefix}{k}.")
        elif va != vb:
            out.append(f"{prefix}{k}")
    return out
