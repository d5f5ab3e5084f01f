"""A stage's compute, timed, on an emulated slower machine.

:func:`run_timed` runs a jitted computation to completion and returns its seconds; with
``slowdown = k > 1`` it then sleeps ``(k − 1)`` times that long, so the stage behaves like a
machine ``k`` times slower without using more CPU (the sleep leaves the cores to the other stages
on the same host). :class:`SlowClock` does it for the calls after the first of each function:
the first call compiles, and compiling is a one-off cost, not the machine's speed. Both model-parallel systems use it: the pipeline's ``pipeline.slowdown`` and a
Ravnest node's ``speed`` (slowdown ``1 / speed``).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import jax

__all__ = ["SlowClock", "check_slowdown", "run_timed"]


def check_slowdown(slowdown: float) -> float:
    """``slowdown`` as a float ≥ 1, or a ValueError naming it."""
    if not slowdown >= 1.0:
        raise ValueError(f"slowdown must be >= 1 (1 = this machine's speed), got {slowdown!r}")
    return float(slowdown)


def run_timed(f: Callable, *args, slowdown: float = 1.0) -> tuple[Any, float]:
    """``(f(*args) finished, seconds it took)``, then a sleep of ``(slowdown − 1) · seconds``."""
    t0 = time.perf_counter()
    out = jax.block_until_ready(f(*args))
    dt = time.perf_counter() - t0
    if slowdown > 1.0:
        time.sleep(dt * (slowdown - 1.0))
    return out, dt


class SlowClock:
    """:func:`run_timed` at ``slowdown``, except for the first call of each function (its compilation)."""

    def __init__(self, slowdown: float = 1.0):
        self.slowdown = check_slowdown(slowdown)
        self._warm: set[int] = set()

    def run(self, f: Callable, *args) -> tuple[Any, float]:
        """``(result, seconds)`` of ``f(*args)``."""
        warm = id(f) in self._warm
        self._warm.add(id(f))
        return run_timed(f, *args, slowdown=self.slowdown if warm else 1.0)
