"""The training loop: a method, a batch stream and hooks with a cadence; it knows no model.

:func:`train` runs ``state, info = method.step(state, batches(state.step))`` until
``state.step == steps``, adds what each step cost to the :class:`Counters`, then calls every
:class:`Hook` whose cadence falls on that step, in the order given. Evaluation, logging,
checkpoints, progress bars and anything else a run does besides stepping are hooks
(:func:`hook`): ``hook(fn, every=n)`` runs ``fn(event)`` after every ``n``-th step and, unless
``at_end=False``, after the last one; ``every=0`` runs it only at the end.

Example:
  >>> import numpy as np
  >>> from zeroth.methods.base import Method, StepInfo, TrainState
  >>> count = Method(lambda p, k: TrainState(0, p, None, k),
  ...                lambda s, b: (s._replace(step=s.step + 1, params=s.params + b[0].sum()), StepInfo(1, 0, 0, 0.0, None)))
  >>> seen = []
  >>> state, counters = train(count.init(np.float32(0), None), count, lambda t: (np.ones((2, 1)),),
  ...                         [hook(lambda e: seen.append(e.step), every=2)], steps=5)
  >>> float(state.params), seen, counters.forward_passes, counters.examples
  (10.0, [2, 4, 5], 5, 10)
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import jax

from zeroth.methods.base import Method, StepInfo, TrainState, settle

__all__ = ["Counters", "Event", "Hook", "hook", "train"]


class Counters(NamedTuple):
    """Cumulative counters of a run (saved in checkpoints)."""

    forward_passes: int = 0
    backward_passes: int = 0
    examples: int = 0  # forward passes x batch size
    payload_bytes: int = 0
    train_time: float = 0.0  # seconds fetching batches and inside method.step (hooks excluded)
    wall_time: float = 0.0  # seconds since the run started (kept by the caller, saved in checkpoints)


class Event(NamedTuple):
    """What a hook is called with, after a step."""

    step: int  # steps done (== state.step)
    state: TrainState  # the state after the step
    info: StepInfo  # what the step cost and measured
    counters: Counters  # the run's counters, this step included
    last: bool  # the run's last step


class Hook(NamedTuple):
    """``fn(event)`` after every ``every``-th step (0: never on a cadence) and, with ``at_end``, after the last.

    ``reads_params``: whether ``fn`` reads ``event.state.params``; before such a hook the loop
    settles the state (:func:`zeroth.methods.base.settle`), and only then.
    """

    fn: Callable[[Event], Any]
    every: int
    at_end: bool = True
    reads_params: bool = True

    def due(self, step: int, last: bool) -> bool:
        """Whether the hook runs after step ``step``."""
        return bool((self.every and step % self.every == 0) or (self.at_end and last))


def hook(fn: Callable[[Event], Any], every: int = 1, *, at_end: bool = True, reads_params: bool = True) -> Hook:
    """A :class:`Hook` running ``fn`` after every ``every``-th step (and after the last one, with
    ``at_end``); ``reads_params=False`` for one that does not read the parameters (a progress bar),
    so that the loop need not settle the state for it."""
    if every < 0:
        raise ValueError(f"a hook's cadence must be >= 0 steps (0 = only at the end), got every={every}")
    return Hook(fn, int(every), at_end, reads_params)


def _examples(info: StepInfo, batch) -> int:
    leaves = jax.tree_util.tree_leaves(batch)
    return info.forward_passes * (int(leaves[0].shape[0]) if leaves else 0)


def train(
    state: TrainState,
    method: Method,
    batches: Callable[[int], Any],
    hooks: Sequence[Hook] = (),
    *,
    steps: int,
    counters: Counters = Counters(),
    stop: Callable[[], bool] | None = None,
) -> tuple[TrainState, Counters]:
    """Step ``method`` from ``state`` until ``steps`` steps are done, calling the hooks on their cadence.

    Args:
      state: the state to start from (``method.init(params, key)``, or one restored from a checkpoint).
      method: ``init``/``step`` of :mod:`zeroth.methods.base`.
      batches: ``batches(t) -> batch`` of step ``t`` (a pure function of ``t``, so a resumed run
        sees the batches the uninterrupted one saw).
      hooks: run in this order after each step on which they are due.
      steps: the total number of steps of the run (not the number left).
      counters: the counters so far (a resumed run's).
      stop: called before each step; when it returns True the loop returns at once, with
        ``state.step < steps`` (a signal flag, :mod:`zeroth.train.interrupt`: the step under
        way always finishes and its hooks run).

    Returns:
      ``(state, counters)`` after the last step (or the step before ``stop`` said so), settled
      (:func:`zeroth.methods.base.settle`). ``train_time`` counts fetching the batch and the step
      (until the new parameters are ready; for a ``pipelined`` method, until the step is
      dispatched and the one before it fetched), and settling the state where a hook reads the
      parameters, not the hooks.
    """
    settled = True
    for t in range(state.step, steps):
        if stop is not None and stop():
            break
        t_step = time.perf_counter()
        batch = batches(t)
        state, info = method.step(state, batch)
        done = t + 1
        due = [h for h in hooks if h.due(done, done == steps)]
        settled = done == steps or any(h.reads_params for h in due)
        if settled:
            state = settle(method, state)
        if settled or not method.pipelined:  # a pipelined step is waited for by the next one
            jax.block_until_ready(state.params)
        counters = counters._replace(
            forward_passes=counters.forward_passes + info.forward_passes,
            backward_passes=counters.backward_passes + info.backward_passes,
            examples=counters.examples + _examples(info, batch),
            payload_bytes=counters.payload_bytes + info.payload_bytes,
            train_time=counters.train_time + (time.perf_counter() - t_step),
        )
        if state.step != done:
            raise RuntimeError(f"method.step returned state.step={state.step} after step {t}; expected {done}")
        event = Event(done, state, info, counters, done == steps)
        for h in due:
            h.fn(event)
    return (state if settled else settle(method, state)), counters
