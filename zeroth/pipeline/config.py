"""The ``pipeline`` section of a config: pipeline-parallel backprop (AQ-SGD, seed 001, :mod:`zeroth.pipeline`).

One member of :data:`zeroth.config.SYSTEMS`, the union of the systems' sections: the section's key
is its tag. It sits at the config's layer (it imports :mod:`zeroth.schema` and the models only), so
:mod:`zeroth.config` can decode it without importing the system.
"""

from __future__ import annotations

import dataclasses
from typing import Any, ClassVar

from zeroth.schema import MAX_BATCH, MAX_PROCESSES, MAX_WIDTH, PIPELINE_DATASETS, PIPELINE_OBJECTIVES, field

__all__ = [
    "PipelineConfig",
    "PIPELINE_COMPRESSIONS",
    "PIPELINE_MODELS",
    "PIPELINE_BUFFERS",
    "REPLICA_SYNCS",
]

# Link compressions, models that split into stages, buffer stores, replica averaging.
PIPELINE_COMPRESSIONS = ("fp32", "directq", "aqsgd")
PIPELINE_MODELS = ("transformer", "smollm2_prompt")
PIPELINE_BUFFERS = ("memory", "memmap")
REPLICA_SYNCS = ("fp32", "onebit_adam")  # how the data-parallel replicas of a pipeline stage average


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

    applies_schedule: ClassVar[bool] = True  # zeroth.pipeline.build.optimizer_of applies it

    def check(self, cfg: Any) -> None:
        """What this section asks of the rest of ``cfg`` (a :class:`zeroth.config.Config`)."""
        p = self
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


def _model_blocks(cfg: Any) -> int | None:
    """Blocks of the pipeline's model (what its stages split), read from the config."""
    if cfg.model.name == "smollm2_prompt":
        from zeroth.models.pretrained import llama

        return llama.SMOLLM2_135M.n_layers
    if cfg.model.name == "transformer":
        from zeroth.models.classifiers import Transformer

        layers = cfg.model.kwargs.get("layers", Transformer.layers)
        return layers if isinstance(layers, int) else None
    return None
