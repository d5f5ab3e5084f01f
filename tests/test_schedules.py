"""Learning-rate schedules on the host: values, determinism, config errors, and the trainer using them."""

import doctest
import json
import math

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from hypothesis import given
from hypothesis import strategies as st

from zeroth import schedules, zo
from zeroth.config import load_config_dict
from zeroth.train import trainer
from zeroth.train.metrics import check_schema, read_metrics


def test_the_module_examples_hold():
    assert doctest.testmod(schedules).failed == 0


# --------------------------------------------------------------------------- values


def _formula(name, lr, w, a, d, r, t):
    """The float64 definition with the C library's cos: the schedule must match it to ~1e-15."""
    if t < w:
        return lr * (a + (1 - a) * t / w)
    if name == "constant":
        return lr
    if t >= d:
        return lr * r
    u = (t - w) / (d - w)
    c = (1 + math.cos(math.pi * u)) / 2 if name == "cosine" else 1 - u
    return lr * r + (lr - lr * r) * c


decaying = st.tuples(
    st.sampled_from(["cosine", "linear", "constant"]),
    st.floats(1e-6, 10.0),
    st.integers(0, 50),
    st.floats(0.0, 1.0),
    st.integers(1, 500),
    st.floats(0.0, 1.0),
)


@given(decaying, st.integers(0, 700))
def test_host_value_is_deterministic_and_the_float64_formula(args, t):
    name, lr, w, a, extra, r = args
    kw = {"warmup_steps": w, "init_ratio": a}
    if name != "constant":
        kw.update(decay_steps=w + extra, final_ratio=r)
    s = schedules.make(name, lr, **kw)
    v = s(t)
    assert type(v) is float
    assert v.hex() == s(t).hex() == schedules.make(name, lr, **kw)(np.int64(t)).hex()  # the same bits, every call
    d = w + extra
    assert v == pytest.approx(
        _formula(name, lr, w, a, d, r if name != "constant" else 0.0, t), rel=1e-14, abs=1e-15 * lr
    )
    assert min(lr * a, lr * r if name != "constant" else lr) - 1e-15 * lr <= v <= lr


@given(st.floats(1e-6, 10.0), st.integers(1, 50), st.floats(0.0, 1.0), st.integers(1, 500), st.floats(0.0, 1.0))
def test_warmup_starts_at_init_ratio_and_cosine_ends_at_the_floor(lr, w, a, extra, r):
    s = schedules.cosine(lr, warmup_steps=w, init_ratio=a, decay_steps=w + extra, final_ratio=r)
    assert s(0) == lr * a  # exactly
    assert s(w) == lr  # the peak, exactly, at the first step after the warmup
    assert s(w + extra) == s(w + extra + 1000) == lr * r  # the floor, exactly, from decay_steps on
    values = [s(t) for t in range(w + extra + 1)]
    assert all(x <= y for x, y in zip(values[:w], values[1 : w + 1], strict=True))  # warmup rises
    assert all(x >= y for x, y in zip(values[w:], values[w + 1 :], strict=False))  # decay falls


@given(st.floats(0.0, 1.0))
def test_cos_pi_uses_no_libm_but_matches_it(u):
    c = schedules.cos_pi(u)
    assert abs(c - math.cos(math.pi * u)) <= 4 * 2.0**-53
    if u >= 0.5:  # 1 - u is exact here: the odd symmetry about 1/2 holds bit for bit
        assert schedules.cos_pi(1.0 - u) == -c


def test_golden_bits_hold_on_every_host():
    # IEEE basic operations only: these bit patterns are the same on every machine. A host whose
    # schedule differs here would replay different coefficients, and this test says so.
    s = schedules.cosine(0.02, warmup_steps=50, init_ratio=0.1, decay_steps=1000, final_ratio=0.05)
    got = {t: s(t).hex() for t in (0, 1, 49, 50, 51, 333, 500, 777, 999, 1000)}
    assert got == {
        0: "0x1.0624dd2f1a9fcp-9",
        1: "0x1.355475a31a4bep-9",
        49: "0x1.41c8216c61523p-6",
        50: "0x1.47ae147ae147bp-6",
        51: "0x1.47addcb4480c0p-6",
        333: "0x1.0859b562f0212p-6",
        500: "0x1.71c54758fd129p-7",
        777: "0x1.c6963103ded28p-9",
        999: "0x1.06285998ae5b0p-10",
        1000: "0x1.0624dd2f1a9fcp-10",
    }
    assert schedules.step(0.1, gamma=0.9, every=7)(700).hex() == "0x1.6480458aa101cp-19"


def test_matches_optax_schedules_within_float32():
    lr, w, d, a, r = 0.05, 20, 300, 0.1, 0.2
    ours = schedules.cosine(lr, warmup_steps=w, init_ratio=a, decay_steps=d, final_ratio=r)
    theirs = optax.warmup_cosine_decay_schedule(a * lr, lr, w, d, r * lr)
    lin = schedules.linear(lr, decay_steps=d, final_ratio=r)
    lin_theirs = optax.linear_schedule(lr, r * lr, d)
    stair = schedules.step(lr, gamma=0.5, every=40)
    stair_theirs = optax.exponential_decay(lr, 40, 0.5, staircase=True)
    with jax.numpy_dtype_promotion("standard"):
        for t in range(0, 400, 7):
            np.testing.assert_allclose(ours(t), float(theirs(t)), rtol=2e-6, atol=1e-9)
            np.testing.assert_allclose(lin(t), float(lin_theirs(t)), rtol=2e-6, atol=1e-9)
            np.testing.assert_allclose(stair(t), float(stair_theirs(t)), rtol=2e-6, atol=1e-9)


def test_the_exact_path_takes_host_schedules_and_refuses_optax_ones():
    s = schedules.linear(0.5, decay_steps=4)
    g = {0: [1.0, -2.0]}
    assert zo.canonical_updates(0, 2, g, s)[0][1] == zo.canonical_updates(0, 2, g, 0.25)[0][1]
    with pytest.raises(TypeError, match="zeroth.schedules"):
        zo.canonical_updates(0, 2, g, optax.linear_schedule(0.5, 0.0, 4))
    assert s(np.int64(3)) == s(jnp.int32(3)) == s(3)  # concrete host integers
    with pytest.raises(TypeError, match="integer step"):
        jax.jit(lambda t: s(t))(3)  # a traced step: optax schedules are for that
    with pytest.raises(TypeError, match="integer step"):
        s(3.0)


@pytest.mark.parametrize(
    ("make", "field"),
    [
        (lambda: schedules.cosine(0.1, decay_steps=10, warmup_steps=10), "decay_steps"),
        (lambda: schedules.Schedule("cosine", 0.1), "decay_steps"),
        (lambda: schedules.step(0.1, gamma=1.5, every=3), "gamma"),
        (lambda: schedules.step(0.1, gamma=0.5, every=0), "every"),
        (lambda: schedules.constant(0.1, init_ratio=2.0), "init_ratio"),
        (lambda: schedules.make("cosine", 0.1, decay_steps=5, finale=0.1), "finale"),
        (lambda: schedules.make("exp", 0.1), "name"),
        (lambda: schedules.constant(-1.0), "lr"),
    ],
)
def test_bad_arguments_name_the_field(make, field):
    with pytest.raises(ValueError, match=rf"^{field}: "):
        make()


# --------------------------------------------------------------------------- config


@pytest.mark.parametrize(
    ("schedule", "message"),
    [
        ({"name": "cosine"}, "config field train.schedule.decay_steps: schedule 'cosine' needs"),
        (
            {"name": "cosine", "warmup_steps": 50, "decay_steps": 50},
            "config field train.schedule.decay_steps: expected an integer > warmup_steps = 50, got 50",
        ),
        ({"name": "warmup_cosine"}, "config field train.schedule.name: bad value 'warmup_cosine'; expected one of"),
        ({"name": "constant", "final_ratio": 0.1}, "config field train.schedule.final_ratio:"),
        ({"name": "cosine", "decay_steps": 9, "gamma": 0.5}, "config field train.schedule.gamma: only schedule 'step'"),
        ({"init_ratio": 1.5}, "config field train.schedule.init_ratio: bad value 1.5; expected <= 1.0"),
        ({"warmup": 10}, "unknown config key 'warmup' in section 'train.schedule'"),
    ],
)
def test_config_errors_name_the_field(schedule, message):
    with pytest.raises(ValueError) as e:
        load_config_dict({"train": {"schedule": schedule}})
    assert str(e.value).startswith(message) or message in str(e.value), str(e.value)
    assert "\n" not in str(e.value)


def test_a_schedule_is_refused_where_nothing_applies_it():
    raw = {
        "data": {"dataset": "sotu", "batch_size": 4},
        "model": {"name": "transformer"},
        "train": {"method": "backprop", "schedule": {"name": "cosine", "decay_steps": 10}},
    }
    with pytest.raises(ValueError, match="config field train.schedule: 'cosine' .* not applied by ravnest runs"):
        load_config_dict({**raw, "ravnest": {}})
    cfg = load_config_dict({**raw, "pipeline": {"examples": 8}})  # pipeline stages apply it (zeroth.pipeline.build)
    assert cfg.train.schedule.name == "cosine"


# --------------------------------------------------------------------------- the trainer

SMALL = {
    "run": {"name": "sched", "seed": 0},
    "data": {"dataset": "digits", "batch_size": 32, "eval_size": 200},
    "model": {"name": "mlp", "kwargs": {"hidden": [16]}},
    "train": {
        "method": "zo",
        "lr": 0.05,
        "eps": 1.0e-3,
        "n_perturbations": 8,
        "codec": "onebyte",
        "steps": 30,
        "eval_every": 30,
        "log_every": 1,
    },
}
WARMUP_COSINE = {"name": "cosine", "warmup_steps": 5, "init_ratio": 0.0, "decay_steps": 30, "final_ratio": 0.1}


def _run(tmp_path, name, **train):
    raw = json.loads(json.dumps(SMALL))
    raw["train"].update(train)
    cfg = load_config_dict(raw)
    res = trainer.train(cfg, tmp_path / name, progress=False)
    return res, read_metrics(tmp_path / name / "metrics.jsonl")


def test_trainer_with_a_schedule_is_reproducible_logs_lr_and_differs_from_constant(tmp_path):
    a, rows = _run(tmp_path, "a", schedule=WARMUP_COSINE)
    b, _ = _run(tmp_path, "b", schedule=WARMUP_COSINE)
    c, rows_c = _run(tmp_path, "c")
    assert a.digest == b.digest  # run to run, bit for bit
    assert a.digest != c.digest
    check_schema(rows)
    train = [r for r in rows if r["kind"] == "train"]
    s = schedules.cosine(0.05, warmup_steps=5, decay_steps=30, final_ratio=0.1)
    assert [r["lr"] for r in train] == [s(t) for t in range(30)]  # row of step t + 1 carries eta_t
    assert train[0]["lr"] == 0.0 and train[5]["lr"] == 0.05 and train[-1]["lr"] == s(29) > 0.005
    # eta_0 = 0: the first update is an exact no-op, the second moves the parameters
    start = next(r for r in rows if r["kind"] == "eval" and r["step"] == 0)["digest"]
    assert train[0]["digest"] == start != train[1]["digest"]
    assert {r["lr"] for r in rows_c if r["kind"] == "train"} == {0.05}


def test_backprop_follows_the_schedule(tmp_path):
    # A zero learning rate at every step (warmup from 0 over more steps than the run) leaves the
    # parameters unchanged; with the same peak and no warmup they move.
    frozen, rows = _run(
        tmp_path,
        "bp0",
        method="backprop",
        lr=1e-2,
        steps=3,
        eval_every=3,
        schedule={"name": "constant", "warmup_steps": 1000},
    )
    moved, _ = _run(tmp_path, "bp1", method="backprop", lr=1e-2, steps=3, eval_every=3)
    start = rows[0]["digest"]
    assert frozen.digest != moved.digest
    assert [r["lr"] for r in rows if r["kind"] == "train"] == [0.0, 1e-5, 2e-5]
    assert rows[1]["digest"] == start  # step 0 ran at lr 0
