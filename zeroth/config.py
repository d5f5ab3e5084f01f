"""Experiment configs: YAML -> nested frozen dataclasses, validated field by field.

A config has the sections ``run``, ``data``, ``model``, ``train`` and at most one system section:
``peers``, ``pipeline``, ``binary`` or ``ravnest`` (:data:`SYSTEMS`). The system sections are a
tagged union whose tag is the section's key: the decoder (:func:`zeroth.schema.build`) refuses two
of them by name, so no system checks another. Each system owns its section, in its own package
(``zeroth/net/config.py``, ``zeroth/pipeline/config.py``, ``zeroth/cluster/config.py``,
``zeroth/binary/config.py``): a dataclass with ``check(cfg)``, what it asks of the rest of the
config, and ``applies_schedule``, whether its runs follow ``train.schedule``. Those modules sit at this layer, below the systems, and import only :mod:`zeroth.schema`
(and models), so decoding a config imports no system. Every field carries its description in its
metadata; ``zeroth run --help-config`` prints them all (:func:`describe`).

Rules:

* An unknown key is a ``ValueError`` naming the key, its section and the valid keys.
* A bad value is a ``ValueError`` naming the field, the value and what would be valid.
* ``overrides`` are ``"section.field=value"`` strings; the value is parsed as YAML
  (``train.lr=0.01``, ``peers.token=null``, ``peers.join_at=[3, 5]``,
  ``model.kwargs={hidden: [32]}``, ``model.kwargs.hidden=[32]``). Setting a field of a
  system section creates it with defaults (and is refused when the config has another system).
* Floats may be written ``1e-3`` (YAML 1.1 reads that as a string; it is accepted here).

:func:`config_digest` is SHA-256 of the canonical JSON of a config: peers compare it before
training together.

Example:
  >>> cfg = load_config_dict({"run": {"name": "demo"}, "train": {"steps": 10}})
  >>> cfg.train.steps, cfg.train.method
  (10, 'zo')
  >>> cfg2 = apply_overrides(cfg, ["train.lr=0.5"])
  >>> cfg2.train.lr
  0.5
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import yaml

import zeroth.models.pretrained  # noqa: F401  (registers the pretrained models' names)
from zeroth import codecs, data, methods, models, noise, objectives, schedules, zo
from zeroth import schema as _schema
from zeroth.binary.config import BINARY_METHODS, BINARY_WEIGHTS, BinaryConfig
from zeroth.cluster.config import RAVNEST_ORDERS, RavnestConfig
from zeroth.models.pretrained import q4train
from zeroth.net.config import PeersConfig
from zeroth.pipeline.config import PIPELINE_COMPRESSIONS, PIPELINE_MODELS, PipelineConfig
from zeroth.schema import (
    MAX_BATCH,
    MAX_PERTURBATIONS,
    MAX_PROCESSES,
    MAX_WIDTH,
    MAX_YAML_DEPTH,
    MAX_YAML_NODES,
    PIPELINE_OBJECTIVES,
    SAFE_NAME,
    bad,
    check_name,
    field,
    parse_yaml,
    plain,
)

__all__ = [
    "field",
    "RunConfig",
    "DataConfig",
    "ModelConfig",
    "OptimizerConfig",
    "ScheduleConfig",
    "TrainConfig",
    "PeersConfig",
    "BinaryConfig",
    "BINARY_METHODS",
    "BINARY_WEIGHTS",
    "PipelineConfig",
    "RavnestConfig",
    "RAVNEST_ORDERS",
    "Config",
    "SECTIONS",
    "SYSTEMS",
    "OPTIONAL_SECTIONS",
    "LR_SCALINGS",
    "METHODS",
    "OBJECTIVES",
    "OPTIMIZERS",
    "SCHEDULES",
    "CODECS",
    "REQUANTIZE",
    "PIPELINE_COMPRESSIONS",
    "PIPELINE_OBJECTIVES",
    "PIPELINE_MODELS",
    "load_config",
    "load_config_dict",
    "MAX_PROCESSES",
    "MAX_BATCH",
    "MAX_PERTURBATIONS",
    "MAX_WIDTH",
    "SAFE_NAME",
    "parse_yaml",
    "MAX_YAML_NODES",
    "MAX_YAML_DEPTH",
    "apply_overrides",
    "to_dict",
    "to_yaml",
    "config_digest",
    "describe",
    "diff",
]

# The allowed values of the choice fields, each read from the module that implements them.
METHODS = tuple(methods.METHODS)  # train.method
LR_SCALINGS = zo.SCALINGS  # train.lr_scaling
OBJECTIVES = tuple(objectives.OBJECTIVES)  # train.objective
OPTIMIZERS = tuple(methods.OPTIMIZERS)  # train.optimizer.name
SCHEDULES = schedules.SCHEDULES  # train.schedule.name
CODECS = tuple(codecs.CODECS)  # train.codec
DISTRIBUTIONS = noise.EXACT  # train.distribution: the exact noises only
REQUANTIZE = q4train.ROUNDINGS  # train.requantize
LAYOUTS = ("auto", "tree", "flat")  # train.layout


def _dataset_names() -> tuple[str, ...]:
    return data.names()


def _model_names() -> tuple[str, ...]:
    return models.names()


@dataclasses.dataclass(frozen=True)
class RunConfig:
    """What the run is called, its seed and where it writes."""

    name: str = field("run", "Name of the run (used in logs and as the default output folder name).")
    seed: int = field(
        0,
        "Run seed: the root of every key (model init, batches, perturbations). An integer in [0, 2**32).",
        min=0,
        max=2**32 - 1,
    )
    out_dir: str | None = field(
        None,
        "Output folder for metrics.jsonl, config.yaml and checkpoints/. null = runs/<name>. "
        "`zeroth run --out DIR` overrides it.",
    )
    tensorboard: bool = field(
        True,
        "Also write TensorBoard event files (events.out.tfevents.*) next to every metrics.jsonl, "
        "no TensorFlow needed: each row's numbers as scalars <kind>/<name> (train/loss, eval/accuracy) "
        "at its step; `tensorboard --logdir OUT` opens them. false = metrics.jsonl only.",
    )


@dataclasses.dataclass(frozen=True)
class DataConfig:
    """Which dataset, and how it is batched and evaluated."""

    dataset: str = field(
        "digits", "Dataset name (`zeroth datasets` lists them with their status).", choices=_dataset_names
    )
    batch_size: int = field(
        64,
        "Training examples per step. Batches are a pure function of (run.seed, step): a fresh "
        "permutation of the train split per epoch.",
        min=1,
        max=MAX_BATCH,
    )
    eval_size: int = field(0, "Examples of the test split used for evaluation; 0 = the whole split.", min=0)
    eval_batch_size: int = field(
        512, "Examples per forward pass during evaluation (memory bound only).", min=1, max=MAX_BATCH
    )


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """The model and its constructor arguments."""

    name: str = field("mlp", "Model name: mlp, cnn, transformer (see zeroth.models).", choices=_model_names)
    kwargs: dict = field(
        help="Keyword arguments of the model constructor, e.g. {hidden: [64]} for mlp, "
        "{features: [8, 16], dense: 32} for cnn, {d_model: 32, heads: 2, layers: 2} for transformer. "
        "num_classes is taken from the dataset.",
        factory=dict,
    )


@dataclasses.dataclass(frozen=True)
class OptimizerConfig:
    """The optax optimizer of the backprop baseline (train.method = backprop)."""

    name: str = field(
        "adam",
        "Optax optimizer for backprop: sgd, momentum, adam, adamw (learning rate = train.lr).",
        choices=OPTIMIZERS,
    )
    momentum: float = field(0.9, "Momentum of the `momentum` optimizer.", min=0.0, max=1.0)
    b1: float = field(0.9, "Adam beta1.", min=0.0, max=1.0)
    b2: float = field(0.999, "Adam beta2.", min=0.0, max=1.0)
    weight_decay: float = field(1e-4, "Decoupled weight decay of adamw.", min=0.0)


@dataclasses.dataclass(frozen=True)
class ScheduleConfig:
    """The learning-rate schedule: eta_t at step t, peak train.lr, evaluated on the host (zeroth.schedules)."""

    name: str = field(
        "constant",
        "Decay shape after the warmup: constant (eta), cosine or linear (from eta at warmup_steps to final_ratio*eta "
        "at decay_steps), step (eta * gamma**floor((t - warmup_steps) / every)). Float64 host arithmetic, identical on "
        "every machine, so peers agree and replays stay exact.",
        choices=SCHEDULES,
    )
    warmup_steps: int = field(
        0, "Steps of linear warmup from init_ratio*eta (step 0) towards eta (step warmup_steps); 0 = none.", min=0
    )
    init_ratio: float = field(
        0.0, "The learning rate at step 0 is init_ratio * train.lr (with warmup_steps > 0).", min=0.0, max=1.0
    )
    decay_steps: int | None = field(
        None,
        "cosine, linear: the step (counted from 0, warmup included) at which the learning rate reaches its floor "
        "final_ratio * train.lr and stays; required by them, null for constant and step.",
        min=1,
    )
    final_ratio: float = field(0.0, "cosine, linear: the floor is final_ratio * train.lr.", min=0.0, max=1.0)
    gamma: float = field(1.0, "step: the factor applied every `every` steps (in (0, 1]).", gt=0.0, max=1.0)
    every: int = field(1, "step: steps between two decays.", min=1)


@dataclasses.dataclass(frozen=True)
class TrainConfig:
    """How the model is trained: the ZO estimator (MeZO / Just One Byte) or the backprop baseline."""

    method: str = field(
        "zo",
        "zo: two-point SPSA with exact replay (forward passes only); backprop: jax.grad + optax on the same "
        "model, data and evaluation.",
        choices=METHODS,
    )
    steps: int = field(1000, "Number of training steps (iterations).", min=1)
    lr: float = field(
        1e-3, "Learning rate (eta): the peak of train.schedule (the rate at every step when constant).", gt=0.0
    )
    schedule: ScheduleConfig = field(
        help="Learning-rate schedule (warmup, cosine/linear/step decay); logged as `lr` in metrics.jsonl.",
        factory=ScheduleConfig,
    )
    objective: str = field(
        "cross_entropy",
        "Training objective on a batch: cross_entropy (differentiable) or error_rate = 1 - accuracy "
        "(not differentiable; zo only).",
        choices=OBJECTIVES,
    )
    eps: float = field(1e-3, "ZO perturbation scale epsilon (host-rounded to 20 significant bits).", gt=0.0)
    n_perturbations: int = field(
        16,
        "ZO perturbations per step; each costs two forward passes (L(theta+eps z), L(theta-eps z)).",
        min=1,
        max=MAX_PERTURBATIONS,
    )
    lr_scaling: str = field(
        "sqrt",
        "ZO update coefficient -lr*g/sqrt(N) (sqrt, as in Just One Byte) or -lr*g/N (linear), N = "
        "perturbations per step.",
        choices=LR_SCALINGS,
    )
    distribution: str = field(
        "binomial",
        "Exact perturbation noise: binomial ((popcount(16 bits)-8)/2, variance 1) or rademacher (+-1).",
        choices=DISTRIBUTIONS,
    )
    codec: str = field(
        "onebyte",
        "Projected-gradient codec: float32 (4 bytes) or onebyte (signed log, 1 byte). The decoded value is "
        "what is applied.",
        choices=CODECS,
    )
    weight_decay: float = field(0.0, "ZO weight decay (applied as an exact separate step by zeroth.zo).", min=0.0)
    layout: str = field(
        "auto",
        "How the zo method holds the parameters between steps: tree (an array per leaf), flat "
        "(zeroth.replay.flatten: the leaves under 2**21 elements in one buffer per dtype, so each compiled "
        "call passes a few arrays instead of one per leaf: host time an accelerator pays per array), or auto "
        "(flat where the parameters live on a GPU, tree elsewhere: zeroth.replay.preferred_layout). The same "
        "bits either way; which is faster is measured in the docs (Replay layout).",
        choices=LAYOUTS,
    )
    requantize: str | None = field(
        None,
        "4-bit forward-only training (zo only, models with 4-bit weight grids: smollm2_prompt): after every "
        "update each quantized weight is put back on its fixed grid from the model file, by nearest or "
        "stochastic (unbiased) rounding; nearest warns at the first step that moved no weight by half a grid "
        "step (no code can change at that step size). null = train float32 weights.",
        choices=REQUANTIZE,
    )
    optimizer: OptimizerConfig = field(help="Optimizer of the backprop baseline.", factory=OptimizerConfig)
    eval_every: int = field(100, "Evaluate on the test split every this many steps (and at the end).", min=1)
    log_every: int = field(
        10, "Write a training record (loss, passes, bytes, digest) to metrics.jsonl every this many steps.", min=1
    )
    checkpoint_every: int = field(
        0, "Save an orbax checkpoint every this many steps (and at the end); 0 = only at the end.", min=0
    )
    keep_checkpoints: int = field(3, "How many most recent checkpoints to keep; 0 = keep all.", min=0)


@dataclasses.dataclass(frozen=True)
class Config:
    """A whole experiment: the core sections, and at most one system section (the tag of :data:`SYSTEMS`)."""

    run: RunConfig = field(help="Name, seed and output folder.", factory=RunConfig)
    data: DataConfig = field(help="Dataset and batching.", factory=DataConfig)
    model: ModelConfig = field(help="Model and its arguments.", factory=ModelConfig)
    train: TrainConfig = field(help="Training method and hyperparameters.", factory=TrainConfig)
    peers: PeersConfig | None = field(None, "Optional: run as several peers over loopback gRPC.", one_of="system")
    pipeline: PipelineConfig | None = field(
        None,
        "Optional: pipeline-parallel backprop, one process per stage over loopback gRPC (AQ-SGD).",
        one_of="system",
    )
    binary: BinaryConfig | None = field(
        None, "Optional: a binary learning experiment (seed 002) instead of train.", one_of="system"
    )
    ravnest: RavnestConfig | None = field(
        None,
        "Optional: Ravnest (seed 003): clusters of asynchronous pipelines averaged by parallel rings, one process per node.",
        one_of="system",
    )

    @property
    def system(self) -> str | None:
        """The key of the config's system section (one of :data:`SYSTEMS`), or None: one process trains."""
        return next((name for name in SYSTEMS if getattr(self, name) is not None), None)


SECTIONS = tuple(f.name for f in dataclasses.fields(Config))
# The systems' sections: a tagged union whose tag is the section's key (at most one in a config).
SYSTEMS = tuple(f.name for f in dataclasses.fields(Config) if f.metadata.get("one_of") == "system")
OPTIONAL_SECTIONS = SYSTEMS


# --------------------------------------------------------------------------- validation


def _check_schedule(cfg: Config) -> None:
    s = schedules.from_train(cfg.train)
    if s.is_constant or cfg.system is None or getattr(cfg, cfg.system).applies_schedule:
        return
    raise ValueError(
        f"config field train.schedule: {cfg.train.schedule.name!r} with warmup_steps={cfg.train.schedule.warmup_steps} "
        f"is not applied by {cfg.system} runs (their optimizers keep a constant rate); use name constant and warmup_steps 0"
    )


def _check_consistency(cfg: Config) -> None:
    if cfg.train.method == "backprop" and cfg.train.objective != "cross_entropy":
        raise ValueError(
            f"config field train.objective: {cfg.train.objective!r} is not differentiable and cannot be "
            f"trained with train.method='backprop'; use objective 'cross_entropy' or method 'zo'"
        )
    if cfg.train.requantize is not None and cfg.train.method != "zo":
        raise ValueError(
            f"config field train.requantize: {cfg.train.requantize!r} needs train.method='zo' (4-bit "
            f"forward-only training); got {cfg.train.method!r}"
        )
    if cfg.train.layout == "flat" and (cfg.train.method != "zo" or cfg.train.requantize is not None):
        raise ValueError(
            f"config field train.layout: {cfg.train.layout!r} applies to train.method='zo' on one machine without "
            f"train.requantize (the other methods hold trees); use layout 'tree' or 'auto'"
        )


def _check_bounds(cfg: Config) -> None:
    """The bounds a single field cannot say: integers in model.kwargs, the run's name."""

    def ints(where, x):
        if isinstance(x, bool):
            return
        if isinstance(x, int) and not 0 <= x <= MAX_WIDTH:
            raise bad(where, x, f"an integer in [0, {MAX_WIDTH}] (MAX_WIDTH: widths, layers, heads)")
        if isinstance(x, float) and not math.isfinite(x):
            raise bad(where, x, "a finite number")
        if isinstance(x, Mapping):
            for k, v in x.items():
                ints(f"{where}.{k}", v)
        elif isinstance(x, (list, tuple)):
            for i, v in enumerate(x):
                ints(f"{where}[{i}]", v)

    ints("model.kwargs", cfg.model.kwargs)
    check_name("run.name", cfg.run.name, "the default output folder runs/<name>")


def load_config_dict(raw: Mapping[str, Any] | None, overrides: Sequence[str] = ()) -> Config:
    """Build and validate a :class:`Config` from a (YAML-parsed) mapping, then apply ``overrides``.

    Raises:
      ValueError: unknown key (named, with its section and the valid keys) or bad value.
    """
    raw = plain(dict(raw or {}))
    for ov in overrides:
        _set_path(raw, ov)
    cfg = _schema.build(Config, raw)  # refuses two system sections (the union of SYSTEMS)
    _schema.validate_defaults(cfg)
    _check_bounds(cfg)
    _check_consistency(cfg)
    _check_schedule(cfg)
    if cfg.system is not None:
        getattr(cfg, cfg.system).check(cfg)  # what the system asks of the rest of the config
    return cfg


def load_config(path: str | Path, overrides: Sequence[str] = ()) -> Config:
    """Read a YAML experiment config and apply ``--set`` style overrides.

    Args:
      path: YAML file with the sections run, data, model, train and optionally peers.
      overrides: strings ``"section.field=value"`` (value parsed as YAML).

    Returns:
      A validated, frozen :class:`Config`.

    Example:
      >>> cfg = load_config("experiments/mezo_digits.yaml", ["train.steps=5"])  # doctest: +SKIP
    """
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"config file {str(path)!r} does not exist")
    with path.open() as fh:
        raw = parse_yaml(fh, f"config file {str(path)!r}")
    if raw is not None and not isinstance(raw, Mapping):
        raise ValueError(f"config file {str(path)!r}: expected a mapping of sections {list(SECTIONS)}, got {raw!r}")
    return load_config_dict(raw, overrides)


def _set_path(raw: dict, override: str) -> None:
    if "=" not in override:
        raise ValueError(f"override {override!r} must look like section.field=value (e.g. train.lr=0.01)")
    key, text = override.split("=", 1)
    parts = [p for p in key.strip().split(".")]
    if len(parts) < 2 or not all(parts):
        raise ValueError(
            f"override {override!r}: the key must name a section and a field, e.g. train.lr=0.01; "
            f"sections are {list(SECTIONS)}"
        )
    value = parse_yaml(text, f"override {override!r}: the value") if text.strip() else ""
    node = raw
    for p in parts[:-1]:
        child = node.get(p)
        if child is None:
            child = {}
            node[p] = child
        if not isinstance(child, dict):
            raise ValueError(f"override {override!r}: {p!r} is a value, not a section")
        node = child
    node[parts[-1]] = plain(value)


def apply_overrides(cfg: Config, overrides: Sequence[str]) -> Config:
    """A new config with ``"section.field=value"`` overrides applied and validated."""
    return load_config_dict(to_dict(cfg), overrides)


def to_dict(cfg: Any) -> Any:
    """The config as plain JSON-able Python (tuples as lists); ``peers`` is ``None`` when absent."""
    if dataclasses.is_dataclass(cfg):
        return {f.name: to_dict(getattr(cfg, f.name)) for f in dataclasses.fields(cfg)}
    return plain(cfg)


def to_yaml(cfg: Config) -> str:
    """The config as YAML (loads back to an equal config)."""
    return yaml.safe_dump(to_dict(cfg), sort_keys=False, default_flow_style=None)


def config_digest(cfg: Config, *, exclude: Sequence[str] = ()) -> str:
    """SHA-256 hex of the canonical JSON of ``cfg`` (sorted keys, no spaces).

    Args:
      cfg: a config.
      exclude: dotted field paths left out (e.g. ``("run.out_dir",)`` when only the training
        semantics must match).

    Example:
      >>> config_digest(load_config_dict({})) == config_digest(load_config_dict({"train": {"lr": 1e-3}}))
      True
    """
    d = to_dict(cfg)
    for path in exclude:
        node = d
        parts = path.split(".")
        for p in parts[:-1]:
            node = node.get(p) if isinstance(node, dict) else None
        if isinstance(node, dict):
            node.pop(parts[-1], None)
    text = json.dumps(d, sort_keys=True, separators=(",", ":"), ensure_ascii=True, allow_nan=False)
    return hashlib.sha256(text.encode()).hexdigest()


def diff(a: Config, b: Config) -> list[str]:
    """Dotted paths of the fields that differ between two configs."""

    def walk(x, y, prefix):
        if isinstance(x, dict) and isinstance(y, dict) and prefix.count(".") < 2 and not prefix.endswith("kwargs"):
            out = []
            for k in sorted(set(x) | set(y)):
                out += walk(x.get(k), y.get(k), f"{prefix}.{k}" if prefix else k)
            return out
        return [] if x == y else [prefix]

    return walk(to_dict(a), to_dict(b), "")


def describe(cls=Config, prefix: str = "") -> str:
    """Every field of the config (or of dataclass ``cls``): dotted name, type, default and description
    (for ``--help-config``)."""
    return _schema.describe(cls, prefix)
