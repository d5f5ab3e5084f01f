"""The ``binary`` section of a config: binary learning (seed 002, :mod:`zeroth.binary`).

One member of :data:`zeroth.config.SYSTEMS`, the union of the systems' sections: the section's key
is its tag. It sits at the config's layer (it imports :mod:`zeroth.schema` only), so
:mod:`zeroth.config` can decode it without importing the system.
"""

from __future__ import annotations

import dataclasses
from typing import Any, ClassVar

from zeroth.schema import MAX_PROCESSES, MAX_WIDTH, bad, field

__all__ = ["BinaryConfig", "BINARY_METHODS", "BINARY_WEIGHTS"]

# The trainers and weight kinds of zeroth.binary.
BINARY_METHODS = ("flips", "evolution", "ste", "head", "float32")
BINARY_WEIGHTS = ("binary", "ternary")


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

    applies_schedule: ClassVar[bool] = False  # its optimizers keep a constant rate

    def check(self, cfg: Any) -> None:
        """What this section asks of itself and the rest of ``cfg`` (a :class:`zeroth.config.Config`)."""
        for name, valid in (("methods", BINARY_METHODS), ("weights", BINARY_WEIGHTS)):
            values = getattr(self, name)
            if not values:
                raise ValueError(f"config field binary.{name}: empty; expected a list of {list(valid)}")
            for v in values:
                if v not in valid:
                    raise bad(f"binary.{name}", v, f"one of {list(valid)}")
        if not self.channels:
            raise ValueError("config field binary.channels: empty; expected at least one layer, e.g. [32, 32]")
        if self.min_workers > self.workers:
            raise ValueError(
                f"config field binary.min_workers: {self.min_workers} exceeds binary.workers={self.workers}; "
                "a round could never close: lower it (0 = a majority of the workers)"
            )
