"""The training loop: hooks run on their cadence, counters add up, a resumed loop goes on where it stopped."""

import doctest

import numpy as np
import pytest

from zeroth.methods.base import Method, StepInfo, TrainState
from zeroth.train import loop


def _counting_method(forward_passes: int = 2) -> Method:
    """params += sum of the batch; each step costs ``forward_passes`` forward passes and 3 payload bytes."""

    def init(params, key):
        return TrainState(0, params, None, key)

    def step(state, batch):
        info = StepInfo(forward_passes, 0, 3, np.float32(state.step), None, {"seen": float(batch[0].sum())})
        return state._replace(step=state.step + 1, params=state.params + batch[0].sum()), info

    return Method(init, step)


def _batches(t: int):
    return (np.full((4, 1), t, np.float32),)


def _run(hooks, *, steps=7, start=None, counters=loop.Counters()):
    method = _counting_method()
    state = method.init(np.float32(0), np.zeros(2, np.uint32))
    if start is not None:
        state = state._replace(step=start)
    return loop.train(state, method, _batches, hooks, steps=steps, counters=counters)


def test_hooks_run_on_their_cadence_and_at_the_end():
    seen = {"every2": [], "end_only": [], "no_end": [], "info": []}
    hooks = [
        loop.hook(lambda e: seen["every2"].append(e.step), every=2),
        loop.hook(lambda e: seen["end_only"].append((e.step, e.last)), every=0),
        loop.hook(lambda e: seen["no_end"].append(e.step), every=3, at_end=False),
        loop.hook(lambda e: seen["info"].append(e.info.metrics["seen"]), every=1),
    ]
    state, counters = _run(hooks)
    assert seen["every2"] == [2, 4, 6, 7]
    assert seen["end_only"] == [(7, True)]
    assert seen["no_end"] == [3, 6]
    assert seen["info"] == [4.0 * t for t in range(7)]  # each hook sees its own step's metrics
    assert state.step == 7 and float(state.params) == 4.0 * sum(range(7))
    assert counters.forward_passes == 14 and counters.examples == 14 * 4 and counters.payload_bytes == 21
    assert counters.backward_passes == 0 and counters.train_time > 0


def test_hooks_run_in_the_order_given():
    order = []
    hooks = [loop.hook(lambda e, n=n: order.append((e.step, n)), every=1) for n in ("log", "eval", "save")]
    _run(hooks, steps=2)
    assert order == [(1, "log"), (1, "eval"), (1, "save"), (2, "log"), (2, "eval"), (2, "save")]


def test_a_resumed_loop_continues_from_the_state_step_and_counters():
    steps = []
    state, counters = _run([loop.hook(lambda e: steps.append(e.step), every=2)], start=4,
                           counters=loop.Counters(forward_passes=8, examples=32, payload_bytes=12))  # fmt: skip
    assert steps == [6, 7]
    assert float(state.params) == 4.0 * (4 + 5 + 6)  # batches are a function of the step index
    assert counters.forward_passes == 8 + 6 and counters.examples == 32 + 24 and counters.payload_bytes == 12 + 9


def _holding_method():
    """The counting method, holding each step's sum back as ``("held", params, pending)`` until
    the next step or ``settle`` adds it (as the ZO method holds its update), counting settles."""
    settles = []

    def init(params, key):
        return TrainState(0, params, None, key)

    def value(p):
        return p[1] + p[2] if isinstance(p, tuple) else p

    def step(state, batch):
        info = StepInfo(1, 0, 0, np.float32(0), None)
        return state._replace(step=state.step + 1, params=("held", value(state.params), batch[0].sum())), info

    def settle(state):
        settles.append(state.step)
        return state._replace(params=value(state.params))

    return Method(init, step, settle), settles


def test_the_loop_settles_a_holding_method_before_hooks_that_read_the_parameters_and_at_the_end():
    method, settles = _holding_method()
    seen = {"params": [], "ticks": []}
    hooks = [
        loop.hook(lambda e: seen["ticks"].append(e.step), every=1, reads_params=False),
        loop.hook(lambda e: seen["params"].append((e.step, float(e.state.params))), every=3),
    ]
    state, _ = loop.train(method.init(np.float32(0), None), method, _batches, hooks, steps=7)
    assert settles == [3, 6, 7]  # only where a hook reads the parameters, and after the last step
    assert seen["ticks"] == list(range(1, 8))
    assert seen["params"] == [(3, 4.0 * 3), (6, 4.0 * 15), (7, 4.0 * 21)]  # up to date when read
    assert float(state.params) == 4.0 * 21
    # stopped between two steps: the state returned is settled too
    method, settles = _holding_method()
    calls = iter(range(100))
    state, _ = loop.train(
        method.init(np.float32(0), None), method, _batches, [], steps=7, stop=lambda: next(calls) == 4
    )
    assert state.step == 4 and settles == [4] and float(state.params) == 4.0 * 6


@pytest.mark.parametrize("pipelined", [False, True])
def test_the_loop_waits_after_each_step_unless_the_method_is_pipelined(monkeypatch, pipelined):
    # a pipelined method's next step waits for the one before (zeroth.zo.Deferred): the loop then
    # waits only where it settles, so the host dispatches a step while the device runs the last
    import jax

    waited = []
    real = jax.block_until_ready
    monkeypatch.setattr(jax, "block_until_ready", lambda x: waited.append(x) or real(x))
    method, settles = _holding_method()
    method = method._replace(pipelined=pipelined)
    hooks = [loop.hook(lambda e: None, every=1, reads_params=False), loop.hook(lambda e: None, every=3)]
    state, counters = loop.train(method.init(np.float32(0), None), method, _batches, hooks, steps=7)
    assert settles == [3, 6, 7] and float(state.params) == 4.0 * 21 and counters.forward_passes == 7
    assert len(waited) == (3 if pipelined else 7)


def test_a_method_that_does_not_advance_the_step_is_refused():
    method = _counting_method()
    stuck = Method(method.init, lambda s, b: (method.step(s, b)[0]._replace(step=s.step), method.step(s, b)[1]))
    with pytest.raises(RuntimeError, match=r"state.step=0 after step 0; expected 1"):
        loop.train(stuck.init(np.float32(0), None), stuck, _batches, steps=2)


def test_a_negative_cadence_is_refused():
    with pytest.raises(ValueError, match="every=-1"):
        loop.hook(print, every=-1)


def test_the_docstring_example_runs():
    assert doctest.testmod(loop).failed == 0
