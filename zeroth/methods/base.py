"""The method protocol: what the trainer calls, knowing nothing about any model.

A method is a pair of functions (optax style), built by a factory from a config and a model:

* ``init(params, key) -> TrainState``: the state at step 0;
* ``step(state, batch) -> (TrainState, StepInfo)``: one training step on ``batch`` (the step's
  index is ``state.step``, which names its keys), returning the next state and what the step
  cost and measured;
* optionally ``settle(state) -> TrainState``: the state with ``params`` up to date, for a method
  whose step leaves work for the next one (:class:`Method`).

The trainer's state is one pytree, :class:`TrainState` ``(step, params, opt_state, key)``; a
method may hold ``params`` in the flat layout (:class:`zeroth.replay.Flat`), which the trainer's
evaluation, digest and checkpoints take as the tree it stands for. The
methods are :mod:`zeroth.methods.mezo` (MeZO / Just One Byte with exact replay),
:mod:`zeroth.methods.backprop` (``jax.value_and_grad`` + optax) and :mod:`zeroth.methods.q4`
(MeZO on 4-bit weights); :func:`zeroth.methods.make_method` picks one from a config.

Example:
  >>> import numpy as np
  >>> state = TrainState(0, {"w": np.zeros(3, np.float32)}, None, np.zeros(2, np.uint32))
  >>> state._replace(step=state.step + 1).step
  1
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any, NamedTuple

import numpy as np

__all__ = ["MACHINE", "TrainState", "StepInfo", "Method", "Later", "settle"]

MACHINE = 0  # machine id of a single-machine run in sample_key(seed, machine, iteration, sample)


class TrainState(NamedTuple):
    """Everything a training run carries from one step to the next (a pytree)."""

    step: int  # steps done = the index of the next step (its keys' iteration)
    params: Any  # the model's parameters: a pytree of arrays, or its zeroth.replay.Flat (the ZO method)
    opt_state: Any  # the method's own state (optax state for backprop, None for the ZO methods)
    key: np.ndarray  # u32[2], the run key root_key(run.seed); the methods' streams derive from the same seed


class StepInfo(NamedTuple):
    """What one training step cost and produced."""

    forward_passes: int  # forward passes over a batch
    backward_passes: int  # backward passes over a batch (backprop)
    payload_bytes: int  # projected-gradient bytes a peer would send (zo)
    loss: Any  # f32[] objective on the step's batch before the update (zo: mean over the pairs); float() it
    grads: Any  # f32[n] decoded projected gradients (zo; np.asarray() it), else None
    metrics: Mapping[str, float] | None = None  # more numbers to log with the loss (q4: {"changed": fraction})


class Method(NamedTuple):
    """A training method: ``init(params, key) -> TrainState``; ``step(state, batch) -> (TrainState, StepInfo)``;
    optionally ``settle(state) -> TrainState``.

    A method whose ``step`` holds part of its work back for the next step to do (the ZO method
    holds each update for the next step's program, :class:`zeroth.zo.Held`) gives ``settle``,
    which finishes that work: the state it returns has ``params`` up to date. The training loop
    calls it before anything reads the parameters and at the end (:func:`settle`).

    ``pipelined``: ``step`` returns before the device has run the step, and the next ``step`` (or
    ``settle``) waits for it; the loop then does not wait after each step, so that the host
    prepares and dispatches step t + 1 while the device runs step t. Its :class:`StepInfo`
    ``loss`` and ``grads`` are then :class:`Later` values.
    """

    init: Callable[[Any, np.ndarray], TrainState]
    step: Callable[[TrainState, tuple], tuple[TrainState, StepInfo]]
    settle: Callable[[TrainState], TrainState] | None = None
    pipelined: bool = False


class Later:
    """A value computed when first read, then kept: ``float(x)`` or ``np.asarray(x)`` calls ``fn()``
    (a pipelined step's loss and gradients, fetched from the device when a hook reads them).

    Example:
      >>> x = Later(lambda: 2.5)
      >>> float(x), np.asarray(Later(lambda: [1.0, 2.0])).tolist()
      (2.5, [1.0, 2.0])
    """

    __slots__ = ("_fn", "_value")

    def __init__(self, fn: Callable[[], Any]):
        self._fn, self._value = fn, None

    def get(self) -> Any:
        if self._fn is not None:
            self._value, self._fn = self._fn(), None
        return self._value

    def __float__(self) -> float:
        return float(self.get())

    def __array__(self, dtype=None, copy=None):
        return np.asarray(self.get(), dtype=dtype)

    def __repr__(self) -> str:
        return f"Later({self._value!r})" if self._fn is None else "Later(<not fetched>)"


def settle(method: Method, state: TrainState) -> TrainState:
    """``method.settle(state)``, or ``state`` for a method that holds nothing back."""
    return state if method.settle is None else method.settle(state)
