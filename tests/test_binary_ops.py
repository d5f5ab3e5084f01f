"""Bit-packed binary/ternary ops: NumPy reference, jnp and the Pallas kernel (interpret mode) agree bit for bit.

The NumPy side is also checked against plain integer arithmetic on the unpacked {-1, 0, +1} values,
so the three implementations cannot share a layout mistake.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings, strategies as st
from numpy.testing import assert_array_equal

from zeroth import rule
from zeroth.binary import reference as R
from zeroth.kernels import binary as kb
from lowering_util import PLATFORMS, lowered_kernels, tpu_chip_info  # noqa: F401 (a fixture)


def interpret() -> bool:
    """Pallas in interpret mode where the test's arrays go to a CPU: everywhere but beside an
    accelerator, where these tests run on the host CPU's devices too (tests/conftest.py). Decided by
    ``jax.default_backend()``, beside an NVIDIA H200 these tests asked for native kernels on CPU
    arrays: the first test failed, and its process's share of the suite ran past its time limit."""
    return rule.default_platform() == "cpu"


def _weights(rng, shape, ternary):
    if ternary:
        v = rng.integers(-1, 2, shape)
        s, m = R.pack_ternary(v)
        return v, s, m
    v = rng.choice([-1, 1], shape)
    return v, R.pack(v), None


def _all_dense(x, s, m, t, n, rows):
    out = {
        "numpy": R.dense(x, s, t, m, n=n),
        "jnp": np.asarray(kb.dense(x, s, t, m, n=n, impl="jnp")),
        "pallas": np.asarray(kb.dense(x, s, t, m, n=n, impl="pallas", blocks=kb.Blocks(rows), interpret=interpret())),
        # the GPU's body (a loop over the words), in interpret mode on a CPU
        "pallas gpu": np.asarray(
            kb.dense(x, s, t, m, n=n, impl="pallas", blocks=kb.Blocks(rows), interpret=interpret(), platform="gpu")
        ),
    }
    dots = {
        "numpy": R.dots(x, s, m, n=n),
        "jnp": np.asarray(kb.dots(x, s, m, n=n, impl="jnp")),
        "pallas": np.asarray(kb.dots(x, s, m, n=n, impl="pallas", blocks=kb.Blocks(rows), interpret=interpret())),
        "pallas gpu": np.asarray(
            kb.dots(x, s, m, n=n, impl="pallas", blocks=kb.Blocks(rows), interpret=interpret(), platform="gpu")
        ),
    }
    return out, dots


@settings(max_examples=8, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    b=st.integers(1, 40),
    o=st.integers(1, 70),
    n=st.integers(1, 100),
    ternary=st.booleans(),
    rows=st.sampled_from([8, 16]),
    seed=st.integers(0, 2**31),
)
def test_dense_three_ways_bit_exact(b, o, n, ternary, rows, seed):
    rng = np.random.default_rng(seed)
    xv = rng.choice([-1, 1], (b, n))
    wv, s, m = _weights(rng, (o, n), ternary)
    t = rng.integers(-n - 1, n + 2, o).astype(np.int32)
    x = R.pack(xv)
    assert x.shape == (b, R.n_words(n)) and x.dtype == np.uint32
    want_dots = (xv @ wv.T).astype(np.int32)  # plain integer arithmetic on the values
    outs, dots = _all_dense(x, s, m, t, None if ternary else n, rows)
    for name, d in dots.items():
        assert_array_equal(d, want_dots, err_msg=name)
    want = R.pack(want_dots < t)
    for name, got in outs.items():
        assert got.dtype == np.uint32 and got.shape == (b, R.n_words(o)), name
        assert_array_equal(got, want, err_msg=name)


@settings(max_examples=6, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    b=st.integers(1, 3),
    h=st.integers(1, 6),
    w=st.integers(1, 6),
    c=st.integers(1, 40),
    o=st.integers(1, 40),
    ternary=st.booleans(),
    seed=st.integers(0, 2**31),
)
def test_conv3x3_three_ways_bit_exact(b, h, w, c, o, ternary, seed):
    rng = np.random.default_rng(seed)
    xv = rng.choice([-1, 1], (b, h, w, c))
    wv, s, m = _weights(rng, (o, 9, c), ternary)
    s = s.reshape(o, -1)
    m = None if m is None else m.reshape(o, -1)
    t = rng.integers(-9 * c, 9 * c, o).astype(np.int32)
    x = R.pack(xv)
    # integer conv with +1 outside the image
    xp = np.pad(xv, ((0, 0), (1, 1), (1, 1), (0, 0)), constant_values=1)
    want_dots = sum(
        np.einsum("bhwc,oc->bhwo", xp[:, k // 3 : k // 3 + h, k % 3 : k % 3 + w], wv[:, k]) for k in range(9)
    )
    cc = None if ternary else c
    assert_array_equal(R.conv3x3_dots(x, s, m, c=cc), want_dots)
    assert_array_equal(np.asarray(kb.conv3x3_dots(x, s, m, c=cc)), want_dots)
    want = R.pack(want_dots < t)
    assert_array_equal(R.conv3x3(x, s, t, m, c=cc), want)
    assert_array_equal(np.asarray(kb.conv3x3(x, s, t, m, c=cc, impl="jnp")), want)
    got = kb.conv3x3(x, s, t, m, c=cc, impl="pallas", blocks=kb.Blocks(8), interpret=interpret())
    assert_array_equal(np.asarray(got), want)


def test_im2col_and_padding_bits():
    rng = np.random.default_rng(1)
    x = R.pack(rng.choice([-1, 1], (2, 4, 5, 33)))
    assert_array_equal(np.asarray(kb.im2col3x3(x)), R.im2col3x3(x))
    # padding bits of every output word are 0 (33 outputs -> 31 unused bits of word 1)
    s = R.pack(rng.choice([-1, 1], (33, 9, 33))).reshape(33, -1)
    out = R.conv3x3(x, s, np.full(33, 10**6, np.int32), c=33)  # every output -1
    assert (out[..., 0] == 0xFFFFFFFF).all() and (out[..., 1] == 1).all()
    got = kb.conv3x3(
        x, s, np.full(33, 10**6, np.int32), c=33, impl="pallas", blocks=kb.Blocks(8), interpret=interpret()
    )
    assert_array_equal(np.asarray(got), out)


def test_two_tilings_agree_and_popcount():
    rng = np.random.default_rng(2)
    x = R.pack(rng.choice([-1, 1], (300, 200)))
    s = R.pack(rng.choice([-1, 1], (64, 200)))
    t = rng.integers(-20, 20, 64).astype(np.int32)
    a = kb.dense(x, s, t, n=200, impl="pallas", blocks=kb.Blocks(8), interpret=interpret())
    b = kb.dense(x, s, t, n=200, impl="pallas", blocks=kb.Blocks(128), interpret=interpret())
    assert_array_equal(np.asarray(a), np.asarray(b))
    v = rng.integers(0, 2**32, 1000, dtype=np.uint64).astype(np.uint32)
    assert_array_equal(np.asarray(kb.popcount(jnp.asarray(v))), R.popcount(v))


def test_bad_arguments_are_named():
    x = np.zeros((2, 2), np.uint32)
    with pytest.raises(ValueError, match="binary weights need n"):
        kb.dense(x, x, np.zeros(2, np.int32))
    with pytest.raises(ValueError, match="words per row"):
        kb.dots(x, np.zeros((2, 3), np.uint32), n=10)
    with pytest.raises(TypeError, match="thresh must be int32"):
        kb.dense(x, x, np.zeros(2, np.int64), n=10)
    with pytest.raises(ValueError, match="9 \\* 2 = 18 words"):
        kb.conv3x3(np.zeros((1, 2, 2, 2), np.uint32), x, np.zeros(2, np.int32), c=40)
    with pytest.raises(ValueError, match="Blocks.rows"):
        kb.Blocks(12)


@pytest.mark.parametrize("platform", PLATFORMS)
def test_binary_kernels_lower_for_gpu_and_tpu(platform, tpu_chip_info):
    target = "gpu" if platform == "cuda" else platform
    x = jax.ShapeDtypeStruct((300, 20), jnp.uint32)
    s = jax.ShapeDtypeStruct((70, 20), jnp.uint32)
    t = jax.ShapeDtypeStruct((70,), jnp.int32)
    img = jax.ShapeDtypeStruct((2, 7, 7, 2), jnp.uint32)
    ws = jax.ShapeDtypeStruct((40, 18), jnp.uint32)
    wt = jax.ShapeDtypeStruct((40,), jnp.int32)
    ops = {
        "zeroth_binary_dense": [
            (lambda x, s, t: kb.dense(x, s, t, n=600, impl="pallas", platform=target), (x, s, t)),
            (lambda x, s, m, t: kb.dense(x, s, t, m, impl="pallas", platform=target), (x, s, s, t)),
            (lambda x, s, t: kb.conv3x3(x, s, t, c=50, impl="pallas", platform=target), (img, ws, wt)),
        ],
        "zeroth_binary_dots": [(lambda x, s, m: kb.dots(x, s, m, impl="pallas", platform=target), (x, s, s))],
    }
    for name, cases in ops.items():
        for fn, args in cases:
            assert name in lowered_kernels(fn, args, platform), name


def test_bench_binary_rows_side_by_side():
    from zeroth.bench import binary as bench

    rows = bench.binary_rows(batch=8, features=70, channels=33, image=5, conv_batch=2, repeats=1, warmup=1)
    kinds = {(r["layer"], r["kind"], r["impl"]) for r in rows}
    assert {
        ("dense", "float32", "xla"),
        ("dense", "binary", "jnp"),
        ("conv3x3", "float32", "xla"),
        ("conv3x3", "binary", "jnp"),
        ("conv3x3", "binary", "numpy"),
    } <= kinds
    for r in rows:
        assert r["ops"] > 0 and r["ops_per_s"] > 0
        assert ("speedup_vs_float32" in r) == (r["kind"] == "binary")


def test_a_tpu_without_sublane_gather_takes_the_jnp_path(monkeypatch):
    """The kernel's lane reduction needs Mosaic's sublane gather, which a TPU v3 or v4 lacks
    (compiled with libtpu); ``auto`` runs the jnp path there and the kernel on v5 and later."""
    from zeroth import rule

    monkeypatch.setattr(jax, "default_backend", lambda: "tpu")
    monkeypatch.setattr(rule, "default_platform", lambda: "tpu")
    for generation, impl in ((3, "jnp"), (4, "jnp"), (5, "pallas"), (6, "pallas")):
        monkeypatch.setattr(rule, "tpu_generation", lambda device_kind=None, g=generation: g)
        assert kb.resolve_impl("auto") == impl, generation


def test_work_pinned_to_the_cpu_beside_a_gpu_takes_the_jnp_path(monkeypatch):
    """On a GPU machine, arrays under ``jax.default_device(cpu)`` are CPU arrays: ``auto`` and the
    speed rows follow where the arrays go (:func:`zeroth.rule.default_platform`), not jax's default
    backend, which named the Pallas kernel for them (on an NVIDIA H200 the doctest of
    zeroth.bench.binary, these rows pinned to the CPU, failed)."""
    from zeroth.binary.speed import binary_rows

    monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
    with jax.default_device(jax.devices("cpu")[0]):
        assert kb.resolve_impl("auto") == "jnp"
        rows = binary_rows(batch=4, features=32, channels=32, image=4, repeats=1, warmup=0, host=False)
    assert {r["impl"] for r in rows if r["kind"] == "binary"} == {"jnp"}
