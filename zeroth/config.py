"""Experiment configs: YAML -> nested frozen dataclasses, validated field by field.

A config has the sections ``run``, ``data``, ``model``, ``train`` and, for runs over several
peers, ``peers``. Every field carries its description in ``dataclasses.field(metadata={"help":
...})``; ``zeroth run --help-config`` prints them all (:func:`describe`).

Rules:

* An unknown key is a ``ValueError`` naming the key, its section and the valid keys.
* A bad value is a ``ValueError`` naming the field, the value and what would be valid.
* ``overrides`` are ``"section.field=value"`` strings; the value is parsed as YAML
  (``train.lr=0.01``, ``peers.token=null``, ``peers.join_at=[3, 5]``,
  ``model.kwargs={hidden: [32]}``, ``model.kwargs.hidden=[32]``). Setting a field of the
  optional ``peers`` section creates it with defaults.
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
import re
import types
import typing
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import yaml

import zeroth.models.pretrained  # noqa: F401  (registers the pretrained models' names)
from zeroth import codecs, data, methods, models, noise, objectives, schedules, zo
from zeroth.models.pretrained import q4train

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
# binary learning (seed 002): the trainers and weight kinds of zeroth.binary
BINARY_METHODS = ("flips", "evolution", "ste", "head", "float32")
BINARY_WEIGHTS = ("binary", "ternary")
# pipelines (AQ-SGD, seed 001): compressions, objectives and their datasets, models, buffer stores
PIPELINE_COMPRESSIONS = ("fp32", "directq", "aqsgd")
PIPELINE_OBJECTIVES = ("lm", "classify")
PIPELINE_DATASETS = {"lm": "sotu", "classify": "sentiment"}
PIPELINE_MODELS = ("transformer", "smollm2_prompt")
PIPELINE_BUFFERS = ("memory", "memmap")
REPLICA_SYNCS = ("fp32", "onebit_adam")  # how the data-parallel replicas of a pipeline stage average
# Ravnest (seed 003): the orders of a node's work, the keys of a node description
RAVNEST_ORDERS = ("fixed", "arrival")
RAVNEST_NODE_KEYS = {
    "name": str,
    "ram_mb": float,
    "bandwidth_mbps": float,
    "speed": float,
    "backup": bool,
    "join_round": int,
    "latency_ms": float,
}


# Upper bounds, checked before any process starts: a config asking for more is refused in one line.
MAX_PROCESSES = 64  # peers (count + join_at), pipeline stages, binary workers, Ravnest nodes
MAX_BATCH = 1 << 16  # examples per batch, per example set
MAX_PERTURBATIONS = 1 << 12  # perturbations (projected gradients) per step or per peer iteration
MAX_WIDTH = 1 << 16  # every integer in model.kwargs (widths, layers, heads) and sequence lengths
# Names that become file and folder names (Ravnest nodes): letters, digits, '_', '-', '.', no '..'.
SAFE_NAME = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.-]{0,63}")


def _dataset_names() -> tuple[str, ...]:
    return data.names()


def _model_names() -> tuple[str, ...]:
    return models.names()


def field(default: Any = dataclasses.MISSING, help: str = "", *, factory: Callable | None = None, **checks) -> Any:  # noqa: A002
    """A dataclass field with its ``help`` text and checks (``choices``, ``min``, ``max``, ``gt``)."""
    meta = {"help": help, **checks}
    if factory is not None:
        return dataclasses.field(default_factory=factory, metadata=meta)
    return dataclasses.field(default=default, metadata=meta)


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
class PeersConfig:
    """Several Just One Byte peers on one machine (loopback gRPC), launched by `zeroth run`."""

    count: int = field(2, "Number of peers started at iteration 0.", min=1, max=MAX_PROCESSES)
    inferences_per_iteration: int = field(
        4, "Projected gradients each peer computes per iteration (its n_perturbations).", min=1, max=MAX_PERTURBATIONS
    )
    iteration_timeout_s: float = field(
        30.0, "An iteration ends when every peer has sent its inferences or after this many seconds.", gt=0.0
    )
    barrier_timeout_s: float = field(
        30.0, "How long a peer waits for the others to confirm they applied the iteration's updates.", gt=0.0
    )
    iterations: int | None = field(None, "Iterations to run; null = train.steps.", min=1)
    checksum_every: int = field(
        1, "Compare the parameter checksum with a peer every this many iterations; 0 = never.", min=0
    )
    token: str | None = field(
        None,
        "The run secret: whoever holds it may join (every call carries a token derived from it; every message is "
        "signed by its sender's own key). null = `zeroth run` generates one into OUT/run.secret and `zeroth peer` "
        "takes --secret-file / $ZEROTH_SECRET, or generates one when founding.",
    )
    insecure: bool = field(
        False,
        "Run without a secret: anyone who reaches a port may join (messages stay signed by their senders). "
        "Needed explicitly to run without one.",
    )
    clip: float | None = field(
        None,
        "Clip every decoded projected gradient to [-clip, clip] before the replay (bounds what one member can do "
        "with outlier bytes); null = no clip.",
        gt=0.0,
    )
    stall_timeout_s: float | None = field(
        None,
        "An iteration without a decision for this long is re-synchronised with the others; after as long again "
        "the peer ends the run (exit 1, state saved). null = iteration_timeout_s + 6 * barrier_timeout_s.",
        gt=0.0,
    )
    max_members: int = field(
        1024,
        "Most members a run holds: further joins are refused (RESOURCE_EXHAUSTED, the joiner retries) until a "
        "member leaves or is removed; at least peers.count.",
        min=1,
        max=4096,
    )
    idle_timeout_s: float | None = field(
        120.0,
        "A member that contributes nothing (admitted but silent, or still catching up) for this many seconds is "
        "removed from the run and must rejoin, so members that never push do not hold the majority; null = never.",
        gt=0.0,
    )
    startup_timeout_s: float | None = field(
        None,
        "Seconds for every founder to join before iteration 0; fewer by then fails the run (exit 1). "
        "null = 60 + 4 per peer (many processes starting at once on a small machine are slow).",
        gt=0.0,
    )
    tls: bool = field(False, "Use TLS between peers (self-signed certificates are generated for loopback runs).")
    host: str = field("127.0.0.1", "Address the peers listen on.")
    base_port: int = field(0, "First port; peer i listens on base_port + i. 0 = pick free ports.", min=0, max=65535)
    join_at: tuple[int, ...] = field(
        (), "Iterations at which one extra peer joins the run (demonstrates joining mid-run).", factory=tuple, min=0
    )
    kill_at: tuple[int, ...] = field(
        (), "Iterations at which one running peer is killed (demonstrates leaving mid-run).", factory=tuple, min=0
    )


@dataclasses.dataclass(frozen=True)
class BinaryConfig:
    """Binary learning (seed 002): binary/ternary conv layers trained layer-wise; `zeroth run` runs it when present.

    Uses data.dataset (images), data.batch_size, data.eval_size (test examples; 0 = all) and run.seed.
    """

    methods: tuple[str, ...] = field(
        ("flips", "evolution", "ste", "float32"),
        "What to train: flips (exact single-flip loss deltas, top-k), evolution (random flips kept if the loss "
        "fell), ste (straight-through estimator on float shadow weights), head (control: random weights that never "
        "move, only the head trains), float32 (the same conv shapes with float weights and ReLU, end-to-end backprop).",
        factory=lambda: ("flips", "evolution", "ste", "float32"),
    )
    weights: tuple[str, ...] = field(
        ("binary", "ternary"),
        "Weight kinds of the binary methods: binary {-1,+1}, ternary {-1,0,+1}.",
        factory=lambda: ("binary", "ternary"),
    )
    channels: tuple[int, ...] = field(
        (32, 32),
        "Output channels of each 3x3 conv layer (each followed by a 2x2 max-pool).",
        factory=lambda: (32, 32),
        min=1,
    )
    levels: int = field(8, "Thermometer channels encoding each grey pixel as bits.", min=1, max=32)
    train_size: int = field(10000, "Training examples used (the first ones of the train split); 0 = all.", min=0)
    steps: int = field(150, "Training steps per layer (binary methods).", min=1)
    k: int = field(8, "flips: weights flipped per step (the best ones that lower the batch loss).", min=1)
    min_gain: float = field(0.0, "flips: a flip must lower the summed batch loss by more than this.", min=0.0)
    thresh_k: int = field(
        0,
        "flips: also move this many channel thresholds by one step per step, those whose exact loss change is "
        "lowest (not in the seed, whose thresholds stay at their initial medians); 0 = thresholds never move.",
        min=0,
    )
    evolution_k: int = field(4, "evolution: random weights flipped per trial.", min=1)
    head_lr: float = field(1e-2, "Adam learning rate of the auxiliary heads.", gt=0.0)
    ste_lr: float = field(1e-2, "Adam learning rate of the STE shadow weights.", gt=0.0)
    grid: int = field(4, "The auxiliary head averages activations over grid x grid regions.", min=1)
    float_steps: int = field(300, "float32 baseline: end-to-end backprop steps.", min=1)
    float_lr: float = field(1e-3, "float32 baseline: Adam learning rate.", gt=0.0)
    workers: int = field(
        3, "Sparse-mutation run: worker processes on 127.0.0.1 (0 = skip it).", min=0, max=MAX_PROCESSES
    )
    min_workers: int = field(
        0,
        "Sparse-mutation run: a round closes only with lists from at least this many workers, so the run carries "
        "on after losing workers while this many remain (a dropped worker rejoins); 0 = a majority of binary.workers.",
        min=0,
        max=MAX_PROCESSES,
    )
    rounds: int = field(30, "Sparse-mutation run: rounds.", min=1)
    dist_train_size: int = field(3000, "Sparse-mutation run: training examples split over the workers.", min=1)
    dist_channels: int = field(
        40, "Sparse-mutation run: channels of its one binary layer (votes head).", min=1, max=MAX_WIDTH
    )
    dist_k: int = field(4, "Sparse-mutation run: flips applied per round.", min=1)
    dist_head_steps: int = field(
        100,
        "Sparse-mutation run: Adam steps fitting its head to the initial layer's features (then frozen, shipped "
        "with the packed model); 0 = a fixed votes head.",
        min=0,
    )
    threshold: float = field(0.05, "Sparse-mutation run: |loss delta| a list entry must exceed.", min=0.0)
    max_entries: int = field(
        512, "Sparse-mutation run: longest list a worker sends (the largest |deltas|).", min=1, max=1 << 20
    )
    kill_at: tuple[int, ...] = field(
        (), "Sparse-mutation run: rounds at which a worker is killed.", factory=tuple, min=0
    )
    speed_repeats: int = field(5, "Timed repeats of the binary vs float32 speed measurement.", min=1)


@dataclasses.dataclass(frozen=True)
class PipelineConfig:
    """Pipeline-parallel backprop (AQ-SGD, seed 001): one process per stage on loopback gRPC, launched by `zeroth run`."""

    stages: int = field(
        2,
        "Number of stages S: contiguous runs of blocks (embedding in the first, head in the last), one process each; "
        "at most the model's blocks.",
        min=2,
        max=MAX_PROCESSES,
    )
    micro_batches: int = field(2, "GPipe micro-batches per step (fill and drain); must divide data.batch_size.", min=1)
    objective: str = field(
        "lm",
        "lm: next-token cross-entropy over fixed token windows of the SOTU addresses (data.dataset = sotu); "
        "classify: sentiment sentences (data.dataset = sentiment).",
        choices=PIPELINE_OBJECTIVES,
    )
    examples: int = field(
        32,
        "Size of the fixed example set revisited every epoch (windows or sentences); data.batch_size must divide it.",
        min=1,
        max=MAX_BATCH,
    )
    seq_len: int = field(
        32, "Tokens per example (window length, or sentence length after padding/cutting).", min=2, max=MAX_WIDTH
    )
    compression: str = field(
        "fp32",
        "Link compression: fp32 (none); directq (activations and their gradients quantized to fw_bits / bw_bits); "
        "aqsgd (first sight of an example in float32, then the quantized change of its activation since it was last "
        "sent, fw_bits; gradients quantized directly, bw_bits).",
        choices=PIPELINE_COMPRESSIONS,
    )
    fw_bits: int = field(
        4,
        "Bits per activation value (directq, aqsgd) on the zero-level grid: levels q in [-2^(b-1), 2^(b-1)-1], "
        "value q*s/2^(b-1).",
        min=2,
        max=8,
    )
    bw_bits: int = field(8, "Bits per activation-gradient value (directq, aqsgd), on the same grid.", min=2, max=8)
    scale_axis: str = field(
        "channel",
        "Quantization scale of directq/aqsgd: channel (one float32 scale per channel of an example, across its tokens: "
        "isolates a language model's outlier channels) or row (one per token vector).",
        choices=("channel", "row"),
    )
    rounding: str = field(
        "stochastic",
        "Rounding to the grid: stochastic (unbiased, keyed by run, link, direction, step and example; no value clips) "
        "or nearest (deterministic, biased, half a level at most).",
        choices=("stochastic", "nearest"),
    )
    full_epochs: int = field(
        0,
        "Uncompressed warm-up: the first full_epochs epochs (of examples/batch_size steps) send float32 on every link "
        "in both directions, AQ-SGD's buffers taking every activation (the seed's recipe: 1). The learning-rate "
        "warm-up is train.schedule.warmup_steps.",
        min=0,
    )
    replicas: int = field(
        1,
        "Data-parallel pipeline replicas R: R copies of the S stages (R x S processes), each taking 1/R of every batch; "
        "each stage's parameter gradients are averaged over its R replicas (replica_sync) before the update.",
        min=1,
        max=MAX_PROCESSES // 2,
    )
    replica_sync: str = field(
        "fp32",
        "How the replicas of a stage average: fp32 (the mean of their float32 gradients, in replica order, then "
        "train.optimizer) or onebit_adam (QuantizedAdam / 1-bit Adam: Adam with float32 averaging for "
        "replica_warmup_steps steps, then the variance frozen and the momentum sent as signs with one scale per "
        "tensor, error feedback on worker and server).",
        choices=REPLICA_SYNCS,
    )
    replica_warmup_steps: int = field(
        8,
        "onebit_adam: steps of uncompressed Adam before the variance is frozen and the momentum is compressed.",
        min=1,
    )
    bandwidth_bps: float | None = field(
        None,
        "Enforced bandwidth of every link in bits/s (a token bucket on the bytes actually sent); null = unlimited.",
        gt=0.0,
    )
    latency_ms: float = field(0.0, "Enforced one-way latency of every frame on every link, in milliseconds.", min=0.0)
    emulate_bandwidths_bps: tuple[float, ...] = field(
        (10e9, 500e6, 100e6),
        "Bandwidths (bits/s) for which the report computes an emulated wall-clock from the measured compute time "
        "and bytes (not enforced).",
        factory=lambda: (10e9, 500e6, 100e6),
        gt=0.0,
    )
    buffers: str = field(
        "memory",
        "Where AQ-SGD buffers live: memory (NumPy) or memmap (a file per link end in the stage folder).",
        choices=PIPELINE_BUFFERS,
    )
    slowdown: float = field(
        1.0,
        "Emulated compute speed of every stage: each computation is followed by a sleep of (slowdown - 1) times "
        "its duration (1 = this machine).",
        min=1.0,
    )
    host: str = field("127.0.0.1", "Address the stages listen on.")
    timeout_s: float = field(
        600.0, "A stage gives up when a frame it waits for does not come within this many seconds.", gt=0.0
    )


def _default_nodes() -> tuple[dict, ...]:
    return (
        {"name": "n0", "ram_mb": 6.0, "bandwidth_mbps": 200.0, "speed": 1.0},
        {"name": "n1", "ram_mb": 3.0, "bandwidth_mbps": 100.0, "speed": 1.0},
        {"name": "n2", "ram_mb": 4.0, "bandwidth_mbps": 150.0, "speed": 1.0},
        {"name": "n3", "ram_mb": 5.0, "bandwidth_mbps": 150.0, "speed": 1.0},
    )


@dataclasses.dataclass(frozen=True)
class RavnestConfig:
    """Ravnest (seed 003): clusters of nodes formed by a genetic algorithm, each an asynchronous pipeline,
    averaged with each other by parallel rings; one process per node on loopback gRPC, launched by `zeroth run`."""

    nodes: tuple[dict, ...] = field(
        (),
        "The node pool: one mapping per node, {name, ram_mb (usable RAM), bandwidth_mbps (steady bandwidth), "
        "speed (compute speed relative to this machine, <= 1: a node of speed 0.5 sleeps as long as it computes; the "
        "formation reads it as given), backup with join_round r: the spare arrives at round r and receives its "
        "primary's state then, backup (true: a "
        "spare that shadows the least reliable node of a cluster and takes over when it dies), join_round (r >= 1: the "
        "node arrives late; the nodes with the same join_round form a new cluster that starts from the parameters "
        "averaged at round r - 1 and joins the rings at round r), latency_ms (the node's access latency: a message between two nodes takes "
        "ravnest.latency_ms plus both nodes' latency_ms)}.",
        factory=_default_nodes,
    )
    clusters: int = field(2, "Number of clusters the genetic algorithm forms from the non-backup nodes.", min=1)
    objective: str = field(
        "classify",
        "lm: next-token loss on SOTU windows (data.dataset = sotu); classify: sentiment sentences (sentiment).",
        choices=PIPELINE_OBJECTIVES,
    )
    examples: int = field(64, "Size of the fixed example set; data.batch_size must divide it.", min=1, max=MAX_BATCH)
    seq_len: int = field(32, "Tokens per example.", min=2, max=MAX_WIDTH)
    order: str = field(
        "fixed",
        "fixed: one-forward-one-backward after a warm-up (bit-reproducible); arrival: whatever is ready, "
        "backward first (the seed's event loop; timing decides the interleaving).",
        choices=RAVNEST_ORDERS,
    )
    max_in_flight: int = field(
        0,
        "The delay bound D: batches a stage may hold forwarded and not yet back (min(D, S - stage)); "
        "0 = the pipeline depth (no throttling). Staleness of stage s is min(D, S - s) - 1.",
        min=0,
    )
    average_every: int = field(
        4, "R: every node averages its parameters with the other clusters after every R-th update (0 = never).", min=0
    )
    latency_ms: float = field(
        0.0, "Enforced one-way latency of every message between two nodes, in milliseconds.", min=0.0
    )
    enforce_bandwidth: bool = field(True, "Pace every message at min(bandwidth of sender, bandwidth of receiver).")
    population: int = field(64, "Genetic algorithm: chromosomes per generation.", min=4)
    generations: int = field(
        200, "Genetic algorithm: most generations (it stops earlier when the best stops improving).", min=1
    )
    kill_at: tuple[int, ...] = field(
        (),
        "Batches at which the launcher SIGKILLs the primary shadowed by each backup (one entry per backup, in "
        "pool order); the backup takes over.",
        factory=tuple,
        min=1,
    )
    host: str = field("127.0.0.1", "Address the nodes listen on.")
    timeout_s: float = field(
        300.0, "A node gives up when a message it waits for does not come within this many seconds.", gt=0.0
    )


@dataclasses.dataclass(frozen=True)
class Config:
    """A whole experiment."""

    run: RunConfig = field(help="Name, seed and output folder.", factory=RunConfig)
    data: DataConfig = field(help="Dataset and batching.", factory=DataConfig)
    model: ModelConfig = field(help="Model and its arguments.", factory=ModelConfig)
    train: TrainConfig = field(help="Training method and hyperparameters.", factory=TrainConfig)
    peers: PeersConfig | None = field(None, "Optional: run as several peers over loopback gRPC.")
    pipeline: PipelineConfig | None = field(
        None, "Optional: pipeline-parallel backprop, one process per stage over loopback gRPC (AQ-SGD)."
    )
    binary: BinaryConfig | None = field(None, "Optional: a binary learning experiment (seed 002) instead of train.")
    ravnest: RavnestConfig | None = field(
        None,
        "Optional: Ravnest (seed 003): clusters of asynchronous pipelines averaged by parallel rings, one process per node.",
    )


SECTIONS = tuple(f.name for f in dataclasses.fields(Config))
OPTIONAL_SECTIONS = ("peers", "pipeline", "binary", "ravnest")


# --------------------------------------------------------------------------- validation


def _hints(cls) -> dict[str, Any]:
    return typing.get_type_hints(cls)


def _unwrap_optional(tp) -> tuple[Any, bool]:
    args = typing.get_args(tp)
    if typing.get_origin(tp) in (typing.Union, types.UnionType) and type(None) in args:
        rest = [a for a in args if a is not type(None)]
        return rest[0], True
    return tp, False


def _type_name(tp) -> str:
    inner, optional = _unwrap_optional(tp)
    if typing.get_origin(inner) is tuple:
        name = f"list of {typing.get_args(inner)[0].__name__}"
    elif dataclasses.is_dataclass(inner):
        name = "mapping"
    else:
        name = getattr(inner, "__name__", str(inner))
    return name + (" or null" if optional else "")


def _bad(where: str, value: Any, expected: str) -> ValueError:
    return ValueError(f"config field {where}: bad value {value!r}; expected {expected}")


def _coerce_scalar(where: str, tp, value: Any) -> Any:
    if tp is bool:
        if isinstance(value, bool):
            return value
        raise _bad(where, value, "true or false")
    if tp is int:
        if isinstance(value, bool) or not isinstance(value, int):
            if isinstance(value, float) and value.is_integer():
                return int(value)
            raise _bad(where, value, "an integer")
        return int(value)
    if tp is float:
        if isinstance(value, bool):
            raise _bad(where, value, "a number")
        if isinstance(value, str):
            # YAML 1.1 reads 1e-3 (no dot) as a string: take it as the number it spells. A string
            # that YAML would have read as a number unquoted was quoted on purpose: refuse it.
            if isinstance(parse_yaml(value, f"config field {where}"), (int, float)):
                raise _bad(where, value, "a number, not a quoted string (remove the quotes)")
            try:
                value = float(value)
            except ValueError:
                raise _bad(where, value, "a number (e.g. 0.001 or 1e-3)") from None
        if not isinstance(value, (int, float)) or not math.isfinite(float(value)):
            raise _bad(where, value, "a finite number")
        return float(value)
    if tp is str:
        if not isinstance(value, str):
            raise _bad(where, value, "a string")
        return value
    if tp is dict:
        if not isinstance(value, Mapping):
            raise _bad(where, value, "a mapping (e.g. {hidden: [64]})")
        return _plain(dict(value))
    raise TypeError(f"config field {where}: unsupported field type {tp!r}")


def _plain(x: Any) -> Any:
    """YAML-ish values as plain JSON-able Python (tuples -> lists, keys -> str)."""
    if isinstance(x, Mapping):
        return {str(k): _plain(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_plain(v) for v in x]
    return x


def _check_limits(where: str, f: dataclasses.Field, value: Any) -> None:
    meta = f.metadata
    choices = meta.get("choices")
    if choices is not None and value is not None:
        valid = tuple(choices() if callable(choices) else choices)
        if value not in valid:
            raise _bad(where, value, f"one of {list(valid)}")
    values = value if isinstance(value, tuple) else (value,)
    for v in values:
        if v is None or isinstance(v, (str, bool, dict)):
            continue
        if "min" in meta and v < meta["min"]:
            raise _bad(where, value, f">= {meta['min']}")
        if "max" in meta and v > meta["max"]:
            raise _bad(where, value, f"<= {meta['max']}")
        if "gt" in meta and not v > meta["gt"]:
            raise _bad(where, value, f"> {meta['gt']}")


def _build(cls, raw: Any, where: str):
    """Build dataclass ``cls`` from a mapping, validating every key and value."""
    if raw is None:
        raw = {}
    if isinstance(raw, cls):
        return raw
    if not isinstance(raw, Mapping):
        raise ValueError(f"config section {where or 'top level'}: expected a mapping, got {raw!r}")
    fields = {f.name: f for f in dataclasses.fields(cls)}
    unknown = [k for k in raw if k not in fields]
    if unknown:
        section = f"section {where!r}" if where else "the top level"
        raise ValueError(
            f"unknown config key {unknown[0]!r} in {section}; valid keys are {sorted(fields)}"
            + (f" (also unknown: {unknown[1:]})" if len(unknown) > 1 else "")
        )
    hints = _hints(cls)
    kwargs = {}
    for name, value in raw.items():
        f = fields[name]
        path = f"{where}.{name}" if where else name
        kwargs[name] = _convert(path, hints[name], f, value)
    return cls(**kwargs)


def _convert(path: str, tp, f: dataclasses.Field, value: Any) -> Any:
    inner, optional = _unwrap_optional(tp)
    if value is None:
        if optional:
            return None
        raise _bad(path, value, _type_name(tp))
    if dataclasses.is_dataclass(inner):
        return _build(inner, value, path)
    if typing.get_origin(inner) is tuple:
        elem = typing.get_args(inner)[0]
        if not isinstance(value, (list, tuple)):
            raise _bad(path, value, f"a list of {elem.__name__}")
        out = tuple(_coerce_scalar(f"{path}[{i}]", elem, v) for i, v in enumerate(value))
    else:
        out = _coerce_scalar(path, inner, value)
    _check_limits(path, f, out)
    return out


def _validate_defaults(cfg: Any, where: str = "") -> None:
    """Check limits of every field, defaults included (choices registered later may be missing)."""
    for f in dataclasses.fields(cfg):
        value = getattr(cfg, f.name)
        path = f"{where}.{f.name}" if where else f.name
        if dataclasses.is_dataclass(value):
            _validate_defaults(value, path)
        else:
            _check_limits(path, f, value)


def _check_binary(cfg: Config) -> None:
    b = cfg.binary
    if b is None:
        return
    for name, valid in (("methods", BINARY_METHODS), ("weights", BINARY_WEIGHTS)):
        values = getattr(b, name)
        if not values:
            raise ValueError(f"config field binary.{name}: empty; expected a list of {list(valid)}")
        for v in values:
            if v not in valid:
                raise _bad(f"binary.{name}", v, f"one of {list(valid)}")
    if not b.channels:
        raise ValueError("config field binary.channels: empty; expected at least one layer, e.g. [32, 32]")
    if b.min_workers > b.workers:
        raise ValueError(
            f"config field binary.min_workers: {b.min_workers} exceeds binary.workers={b.workers}; "
            "a round could never close: lower it (0 = a majority of the workers)"
        )
    if cfg.peers is not None:
        raise ValueError("config sections 'binary' and 'peers' cannot be combined; remove one of them")
    if cfg.pipeline is not None:
        raise ValueError("config sections 'binary' and 'pipeline' cannot be combined; remove one of them")


def _check_schedule(cfg: Config) -> None:
    s = schedules.from_train(cfg.train)
    if s.is_constant:
        return
    for section in ("ravnest", "binary"):  # pipeline runs apply the schedule (zeroth.pipeline.build.optimizer_of)
        if getattr(cfg, section) is not None:
            raise ValueError(
                f"config field train.schedule: {cfg.train.schedule.name!r} with warmup_steps={cfg.train.schedule.warmup_steps} "
                f"is not applied by {section} runs (their optimizers keep a constant rate); use name constant and warmup_steps 0"
            )


def _check_consistency(cfg: Config) -> None:
    _check_binary(cfg)
    _check_schedule(cfg)
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
    if cfg.train.requantize is not None and cfg.peers is not None:
        raise ValueError(
            f"config field train.requantize: {cfg.train.requantize!r} is not supported with a 'peers' section "
            f"(peers apply float32 updates); remove one of them"
        )
    if cfg.train.layout == "flat" and (
        cfg.train.method != "zo" or cfg.train.requantize is not None or cfg.peers is not None
    ):
        raise ValueError(
            f"config field train.layout: {cfg.train.layout!r} applies to train.method='zo' on one machine without "
            f"train.requantize (the other methods and the peers hold trees); use layout 'tree' or 'auto'"
        )
    if cfg.peers is not None and cfg.train.method != "zo":
        raise ValueError(
            f"config section 'peers' needs train.method='zo' (peers exchange projected gradients); "
            f"got {cfg.train.method!r}"
        )


def _check_bounds(cfg: Config) -> None:
    """The bounds a single field cannot say: integers in model.kwargs, processes of a section."""

    def ints(where, x):
        if isinstance(x, bool):
            return
        if isinstance(x, int) and not 0 <= x <= MAX_WIDTH:
            raise _bad(where, x, f"an integer in [0, {MAX_WIDTH}] (MAX_WIDTH: widths, layers, heads)")
        if isinstance(x, float) and not math.isfinite(x):
            raise _bad(where, x, "a finite number")
        if isinstance(x, Mapping):
            for k, v in x.items():
                ints(f"{where}.{k}", v)
        elif isinstance(x, (list, tuple)):
            for i, v in enumerate(x):
                ints(f"{where}[{i}]", v)

    ints("model.kwargs", cfg.model.kwargs)
    _check_name("run.name", cfg.run.name, "the default output folder runs/<name>")
    if cfg.peers is not None and cfg.peers.count + len(cfg.peers.join_at) > MAX_PROCESSES:
        raise ValueError(
            f"config field peers.join_at: peers.count={cfg.peers.count} plus {len(cfg.peers.join_at)} joiners "
            f"exceed MAX_PROCESSES={MAX_PROCESSES} peer processes; start fewer"
        )
    if cfg.peers is not None and cfg.peers.count > cfg.peers.max_members:
        raise ValueError(
            f"config field peers.max_members: {cfg.peers.max_members} is below peers.count={cfg.peers.count}; "
            f"raise it to at least {cfg.peers.count}"
        )
    if cfg.ravnest is not None:
        if len(cfg.ravnest.nodes) > MAX_PROCESSES:
            raise ValueError(
                f"config field ravnest.nodes: {len(cfg.ravnest.nodes)} nodes exceed MAX_PROCESSES={MAX_PROCESSES} "
                "node processes; list fewer"
            )
        for i, node in enumerate(cfg.ravnest.nodes):
            name = node.get("name") if isinstance(node, Mapping) else None
            if isinstance(name, str):
                _check_name(f"ravnest.nodes[{i}].name", name, "the node's folder and address file")


def _check_name(where: str, name: str, becomes: str) -> None:
    if not SAFE_NAME.fullmatch(name) or ".." in name:
        raise _bad(where, name, f"at most 64 letters, digits, '_', '-' or '.', no '..' (it names {becomes})")


def _model_blocks(cfg: Config) -> int | None:
    """Blocks of the pipeline's model (what its stages split), read from the config."""
    if cfg.model.name == "smollm2_prompt":
        from zeroth.models.pretrained import llama

        return llama.SMOLLM2_135M.n_layers
    if cfg.model.name == "transformer":
        from zeroth.models.classifiers import Transformer

        layers = cfg.model.kwargs.get("layers", Transformer.layers)
        return layers if isinstance(layers, int) else None
    return None


def _check_pipeline(cfg: Config) -> None:
    p = cfg.pipeline
    if p is None:
        return
    if cfg.peers is not None:
        raise ValueError("config sections 'peers' and 'pipeline' exclude each other; keep one")
    if cfg.train.method != "backprop":
        raise ValueError(f"config section 'pipeline' needs train.method='backprop'; got {cfg.train.method!r}")
    if cfg.model.name not in PIPELINE_MODELS:
        raise ValueError(
            f"config field model.name: {cfg.model.name!r} cannot be split into stages; expected one of {list(PIPELINE_MODELS)}"
        )
    want = PIPELINE_DATASETS[p.objective]
    if cfg.data.dataset != want:
        raise ValueError(
            f"config field data.dataset: pipeline.objective {p.objective!r} trains on {want!r}, got {cfg.data.dataset!r}"
        )
    if cfg.model.name == "smollm2_prompt" and p.objective != "lm":
        raise ValueError(
            "config field pipeline.objective: the SmolLM2 pipeline trains the language-model objective 'lm'"
        )
    if cfg.data.batch_size % p.micro_batches:
        raise ValueError(
            f"config field pipeline.micro_batches: {p.micro_batches} must divide data.batch_size={cfg.data.batch_size}"
        )
    if p.examples % cfg.data.batch_size:
        raise ValueError(
            f"config field pipeline.examples: data.batch_size={cfg.data.batch_size} must divide {p.examples}"
        )
    if p.replicas * p.stages > MAX_PROCESSES:
        raise ValueError(
            f"config field pipeline.replicas: {p.replicas} replicas x {p.stages} stages = {p.replicas * p.stages} "
            f"processes; expected at most {MAX_PROCESSES}"
        )
    if p.replicas > 1 and cfg.data.batch_size % (p.replicas * p.micro_batches):
        raise ValueError(
            f"config field pipeline.replicas: {p.replicas} replicas x {p.micro_batches} micro-batches must divide "
            f"data.batch_size={cfg.data.batch_size} (each replica takes an equal share of every batch)"
        )
    if p.replicas > 1 and p.replica_sync == "onebit_adam" and cfg.train.optimizer.name not in ("adam", "adamw"):
        raise ValueError(
            f"config field pipeline.replica_sync: onebit_adam is an Adam; train.optimizer.name is "
            f"{cfg.train.optimizer.name!r}, expected adam or adamw (or replica_sync fp32)"
        )
    blocks = _model_blocks(cfg)
    if blocks is not None and p.stages > blocks:
        raise ValueError(
            f"config field pipeline.stages: {p.stages} stages but model {cfg.model.name!r} has {blocks} blocks; "
            f"expected at most {blocks} (each stage holds at least one block)"
        )
    warm = p.full_epochs * (p.examples // cfg.data.batch_size)
    if p.compression != "fp32" and warm >= cfg.train.steps > 0:
        raise ValueError(
            f"config field pipeline.full_epochs: {p.full_epochs} epoch(s) of uncompressed warm-up ({warm} steps) cover all "
            f"train.steps={cfg.train.steps}, so {p.compression!r} never compresses; lower full_epochs or raise train.steps"
        )


def _check_ravnest(cfg: Config) -> None:
    r = cfg.ravnest
    if r is None:
        return
    for other in ("peers", "pipeline", "binary"):
        if getattr(cfg, other) is not None:
            raise ValueError(f"config sections 'ravnest' and '{other}' exclude each other; keep one")
    if cfg.train.method != "backprop":
        raise ValueError(f"config section 'ravnest' needs train.method='backprop'; got {cfg.train.method!r}")
    if cfg.model.name != "transformer":
        raise ValueError(
            f"config field model.name: Ravnest splits zeroth's transformer into stages; got {cfg.model.name!r}, expected 'transformer'"
        )
    want = PIPELINE_DATASETS[r.objective]
    if cfg.data.dataset != want:
        raise ValueError(
            f"config field data.dataset: ravnest.objective {r.objective!r} trains on {want!r}, got {cfg.data.dataset!r}"
        )
    if r.examples % cfg.data.batch_size:
        raise ValueError(
            f"config field ravnest.examples: data.batch_size={cfg.data.batch_size} must divide {r.examples}"
        )
    names = []
    for i, node in enumerate(r.nodes):
        where = f"ravnest.nodes[{i}]"
        unknown = [k for k in node if k not in RAVNEST_NODE_KEYS]
        if unknown:
            raise ValueError(
                f"config field {where}: unknown key {unknown[0]!r}; valid keys are {sorted(RAVNEST_NODE_KEYS)}"
            )
        for key in ("name", "ram_mb", "bandwidth_mbps"):
            if key not in node:
                raise ValueError(
                    f"config field {where}: missing {key!r} (a node is {{name, ram_mb, bandwidth_mbps, speed, backup}})"
                )
        for key, tp in RAVNEST_NODE_KEYS.items():
            if key not in node:
                continue
            v = node[key]
            if tp is float:
                _coerce_scalar(f"{where}.{key}", float, v)
                if key == "latency_ms" and float(v) < 0:
                    raise _bad(f"{where}.{key}", v, ">= 0")
                if key != "latency_ms" and not float(v) > 0:
                    raise _bad(f"{where}.{key}", v, "> 0")
            elif tp is int:
                _coerce_scalar(f"{where}.{key}", int, v)
                if v < 1:
                    raise _bad(f"{where}.{key}", v, ">= 1 (the averaging round at which the node's cluster joins)")
            else:
                _coerce_scalar(f"{where}.{key}", tp, v)
        names.append(node["name"])
    dup = sorted({n for n in names if names.count(n) > 1})
    if dup:
        raise ValueError(f"config field ravnest.nodes: node name {dup[0]!r} appears twice; names must be unique")
    for i, node in enumerate(r.nodes):
        if "join_round" not in node:
            continue
        if r.average_every == 0:
            raise ValueError(
                f"config field ravnest.nodes[{i}].join_round: a late cluster joins at an averaging round; set ravnest.average_every > 0"
            )
        if (node["join_round"] - 1) * r.average_every >= cfg.train.steps:
            raise ValueError(
                f"config field ravnest.nodes[{i}].join_round: {node['join_round']} starts after the run's last batch "
                f"(train.steps={cfg.train.steps}, average_every={r.average_every})"
            )
    workers = [n for n in r.nodes if not n.get("backup", False) and "join_round" not in n]
    if len(workers) < r.clusters:
        raise ValueError(
            f"config field ravnest.clusters: {r.clusters} clusters need at least {r.clusters} non-backup nodes, the pool has {len(workers)}"
        )
    backups = len(r.nodes) - len(workers)
    if len(r.kill_at) > backups:
        raise ValueError(
            f"config field ravnest.kill_at: {len(r.kill_at)} kills but {backups} backup nodes; each kill is taken over by one backup"
        )
    late_backups = [n for n in r.nodes if n.get("backup", False)]
    for n, at in zip(late_backups, r.kill_at):
        joined = n.get("join_round", 0) * r.average_every
        if at <= joined:
            raise ValueError(
                f"config field ravnest.kill_at: backup {n['name']!r} joins after update {joined}; "
                f"its primary can be killed only after that (got {at})"
            )
    if any(k >= cfg.train.steps for k in r.kill_at):
        raise ValueError(f"config field ravnest.kill_at: {list(r.kill_at)} must be below train.steps={cfg.train.steps}")


MAX_YAML_NODES = 100_000  # values in a config once its aliases are expanded
MAX_YAML_DEPTH = 32  # nesting of mappings and lists


class _BoundedLoader(yaml.SafeLoader):
    """PyYAML's safe loader that measures the document before building it: the number of values
    it holds with every alias expanded, and its nesting (an alias is a reference, so a few lines
    of aliases can stand for billions of values: checked on the node graph, in linear time)."""

    def construct_document(self, node):
        sizes: dict[int, int] = {}
        _expanded_size(node, sizes, set(), 0)
        return super().construct_document(node)


def _expanded_size(node, sizes: dict, open_: set, depth: int) -> int:
    key = id(node)
    if key in sizes:
        return sizes[key]
    if key in open_:
        raise ValueError("it holds a recursive alias (an anchor used inside itself)")
    if depth > MAX_YAML_DEPTH:
        raise ValueError(f"it nests deeper than {MAX_YAML_DEPTH} levels")
    open_.add(key)
    n = 1
    if isinstance(node, yaml.SequenceNode):
        for child in node.value:
            n += _expanded_size(child, sizes, open_, depth + 1)
    elif isinstance(node, yaml.MappingNode):
        for k, v in node.value:
            n += _expanded_size(k, sizes, open_, depth + 1) + _expanded_size(v, sizes, open_, depth + 1)
    open_.discard(key)
    if n > MAX_YAML_NODES:
        raise ValueError(f"it expands to more than {MAX_YAML_NODES} values (aliases of aliases?); write the values out")
    sizes[key] = n
    return n


def parse_yaml(text, what: str) -> Any:
    """YAML ``text`` (a string or a file) as Python values, refused in one line (naming ``what``)
    when it is not YAML, holds more than :data:`MAX_YAML_NODES` values once its aliases are
    expanded, or nests deeper than :data:`MAX_YAML_DEPTH`."""
    try:
        return yaml.load(text, Loader=_BoundedLoader)  # a SafeLoader subclass
    except yaml.YAMLError as e:
        raise ValueError(f"{what} is not valid YAML: {' '.join(str(e).split())}") from None
    except RecursionError:
        raise ValueError(f"{what} is refused: it nests deeper than {MAX_YAML_DEPTH} levels") from None
    except ValueError as e:
        raise ValueError(f"{what} is refused: {e}") from None


def load_config_dict(raw: Mapping[str, Any] | None, overrides: Sequence[str] = ()) -> Config:
    """Build and validate a :class:`Config` from a (YAML-parsed) mapping, then apply ``overrides``.

    Raises:
      ValueError: unknown key (named, with its section and the valid keys) or bad value.
    """
    raw = _plain(dict(raw or {}))
    for ov in overrides:
        _set_path(raw, ov)
    cfg = _build(Config, raw, "")
    _validate_defaults(cfg)
    _check_bounds(cfg)
    _check_consistency(cfg)
    _check_pipeline(cfg)
    _check_ravnest(cfg)
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
    node[parts[-1]] = _plain(value)


def apply_overrides(cfg: Config, overrides: Sequence[str]) -> Config:
    """A new config with ``"section.field=value"`` overrides applied and validated."""
    return load_config_dict(to_dict(cfg), overrides)


def to_dict(cfg: Any) -> Any:
    """The config as plain JSON-able Python (tuples as lists); ``peers`` is ``None`` when absent."""
    if dataclasses.is_dataclass(cfg):
        return {f.name: to_dict(getattr(cfg, f.name)) for f in dataclasses.fields(cfg)}
    return _plain(cfg)


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
    """Every field of the config: dotted name, type, default and description (for ``--help-config``)."""
    lines = []
    hints = _hints(cls)
    for f in dataclasses.fields(cls):
        path = f"{prefix}.{f.name}" if prefix else f.name
        inner, _ = _unwrap_optional(hints[f.name])
        if dataclasses.is_dataclass(inner):
            lines.append(f"{path}:  {f.metadata.get('help', '')}")
            lines.append(describe(inner, path))
            continue
        if f.default is not dataclasses.MISSING:
            default = f"default {json.dumps(_plain(f.default))}"
        elif f.default_factory is not dataclasses.MISSING:
            default = f"default {json.dumps(_plain(f.default_factory()))}"
        else:
            default = "required"
        choices = f.metadata.get("choices")
        extra = ""
        if choices is not None:
            extra = f" [choices: {', '.join(choices() if callable(choices) else choices)}]"
        lines.append(f"  {path} ({_type_name(hints[f.name])}, {default}){extra}\n      {f.metadata.get('help', '')}")
    return "\n".join(lines)
