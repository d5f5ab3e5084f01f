"""zeroth.replay: the exact update rule equals the NumPy reference bit for bit, handles special
values as documented, rounds coefficients so c*z is exact, and checksums the whole state."""

import math
import os

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from zeroth import noise, replay
from zeroth import reference as ref
from zeroth import rng

U32 = st.integers(0, 2**32 - 1)
DISTS = st.sampled_from(noise.EXACT)
BF16, F16, F32 = np.dtype(ml_dtypes.bfloat16), np.dtype(np.float16), np.dtype(np.float32)
COEFFS = st.one_of(
    st.floats(-1e3, 1e3, allow_nan=False, allow_infinity=False),
    st.floats(-1e-34, 1e-34, allow_nan=False, allow_infinity=False),  # around the 2**-120 cut
    st.sampled_from([0.0, 2.0**-120, -3 * 2.0**-120, 1.0 + 2.0**-20, 2.0**-14]),
)
SPECIAL_F32 = [
    0x00000000,
    0x80000000,
    0x00000001,
    0x807FFFFF,
    0x00800000,
    0x7F800000,
    0xFF800000,
    0x7FC00000,
    0x7F800001,
    0xFFC00123,
    0x7F7FFFFF,
    0x3F800000,
]


def _bits(a) -> np.ndarray:
    a = np.asarray(a)
    return a.view({1: np.uint8, 2: np.uint16, 4: np.uint32}[a.dtype.itemsize])


def _assert_same_bits(got, want):
    assert np.asarray(got).dtype == np.asarray(want).dtype
    assert np.shape(got) == np.shape(want)
    np.testing.assert_array_equal(_bits(np.asarray(got)).reshape(-1), _bits(np.asarray(want)).reshape(-1))


def _values(seed: int, shape, dtype) -> np.ndarray:
    """Float values of every magnitude (subnormal to 2**20), with ±0, ±inf and NaNs sprinkled in."""
    g = np.random.default_rng(seed)
    n = math.prod(shape)
    x = g.choice([-1.0, 1.0], n) * np.ldexp(1.0 + g.random(n), g.integers(-135, 20, n))
    x = x.astype(np.float32)
    special = g.random(n) < 0.1
    x[special] = np.array(SPECIAL_F32, np.uint32).view(np.float32)[g.integers(0, len(SPECIAL_F32), n)][special]
    with np.errstate(over="ignore", invalid="ignore"):
        return x.astype(dtype).reshape(shape)


def _reference_tree(tree: dict, updates, dist) -> dict:
    with_path, treedef = jax.tree_util.tree_flatten_with_path(tree)
    out = [ref.replay_leaf(np.asarray(leaf), rng.leaf_path(p), updates, dist) for p, leaf in with_path]
    return jax.tree_util.tree_unflatten(treedef, out)


def _assert_tree_bits(got, want):
    g, w = jax.tree_util.tree_leaves(got), jax.tree_util.tree_leaves(want)
    assert jax.tree_util.tree_structure(got) == jax.tree_util.tree_structure(want)
    for a, b in zip(g, w):
        _assert_same_bits(np.asarray(a), b)


# ------------------------------------------------------------------ replay == reference


@given(
    seed=st.integers(0, 2**32 - 1),
    dist=DISTS,
    run=U32,
    updates=st.one_of(
        st.lists(st.tuples(st.integers(0, 99), U32, st.integers(0, 9), COEFFS), min_size=1, max_size=1),
        st.lists(st.tuples(st.integers(0, 99), U32, st.integers(0, 9), COEFFS), min_size=3, max_size=3),
    ),
)
def test_replay_equals_reference_bit_for_bit(seed, dist, run, updates):
    tree = {
        "a": _values(seed, (65,), F32),
        "b": {"c": _values(seed + 1, (3, 11), BF16)},
        "d": _values(seed + 2, (), F16),
    }
    ups = [(rng.sample_key(run, m, it, s), c) for m, it, s, c in updates]
    got = replay.replay(jax.device_put(tree), ups, distribution=dist)
    _assert_tree_bits(got, _reference_tree(tree, ups, dist))


@given(seed=st.integers(0, 2**16), dist=DISTS, c=st.lists(COEFFS, min_size=3, max_size=3))
def test_float32_replay_is_associative_over_calls(seed, dist, c):
    # float32 leaves are never re-rounded by the cast, so 3 calls of 1 update == 1 call of 3.
    p = {"w": _values(seed, (65,), F32)}
    ups = [(rng.sample_key(0, 0, 1, s), c[s]) for s in range(3)]
    one_by_one = jax.device_put(p)
    for u in ups:
        one_by_one = replay.replay(one_by_one, [u], distribution=dist)
    _assert_tree_bits(one_by_one, replay.replay(jax.device_put(p), ups, distribution=dist))


def test_bf16_leaves_are_cast_once_per_call():
    # bf16: one replay call of many small updates keeps them (float32 inside); one call per update
    # rounds each one away. Both agree with the reference for their own grouping.
    p = {"w": np.ones(64, BF16)}
    ups = [(rng.sample_key(0, 0, 1, s), 2.0**-10) for s in range(8)]
    batched = replay.replay(p, ups, distribution="rademacher")
    one_by_one = p
    for u in ups:
        one_by_one = replay.replay(one_by_one, [u], distribution="rademacher")
    _assert_tree_bits(batched, _reference_tree(p, ups, "rademacher"))
    assert not np.array_equal(np.asarray(batched["w"]), np.asarray(one_by_one["w"]))
    assert np.all(np.asarray(one_by_one["w"]) == 1)  # 1 ± 2**-10 rounds back to 1 in bfloat16


def test_perturb_is_params_plus_rounded_scale_times_noise():
    key = rng.sample_key(4, 3, 2, 1)
    x = np.linspace(-2, 2, 101, dtype=np.float32)
    for dist in noise.EXACT:
        got = np.asarray(replay.perturb({"w": x}, key, 0.1, distribution=dist)["w"])
        k = ref.noise_int(dist, ref.leaf_key(key, "['w']"), x.size).astype(np.float32)
        z = k / np.float32(2) if dist == "binomial" else k
        want = x + np.float32(replay.round_coefficient(0.1)) * z
        _assert_same_bits(got, want)
        assert not np.array_equal(got, x + np.float32(0.1) * z)  # the coefficient really is rounded


def test_perturb_flax_params():
    import flax.linen as nn

    model = nn.Sequential([nn.Dense(7), nn.relu, nn.Dense(3)])
    params = model.init(jax.random.PRNGKey(0), jnp.ones((1, 5)))
    key = rng.sample_key(0, 1, 2, 3)
    got = replay.perturb(params, key, -0.03)
    _assert_tree_bits(got, _reference_tree(params, [(key, -0.03)], "binomial"))
    assert jax.tree_util.tree_structure(got) == jax.tree_util.tree_structure(params)


# ------------------------------------------------------------------ special values


def test_float32_special_values_as_documented():
    specials = np.array(SPECIAL_F32, np.uint32).view(np.float32)
    out = np.asarray(replay.replay({"w": specials}, [(rng.sample_key(0, 0, 0, 0), 0.0)])["w"])
    want = np.array(
        [
            0x00000000,
            0x00000000,
            0x00000000,
            0x00000000,
            0x00800000,
            0x7F800000,
            0xFF800000,
            0x7FC00000,
            0x7FC00000,
            0x7FC00000,
            0x7F7FFFFF,
            0x3F800000,
        ],
        np.uint32,
    )  # -0 and subnormals -> +0; inf stays; every NaN -> 0x7fc00000
    np.testing.assert_array_equal(_bits(out), want)
    _assert_same_bits(out, ref.replay_leaf(specials, "['w']", [(rng.sample_key(0, 0, 0, 0), 0.0)], "binomial"))


@pytest.mark.parametrize("jit", [False, True])
def test_flush_and_flush_cast_directly(jit):
    # XLA:CPU runs with flush-to-zero / denormals-are-zero, which hides a missing flush inside
    # arithmetic; values that pass through untouched show it.
    flush = jax.jit(replay.flush) if jit else replay.flush
    x = np.array(SPECIAL_F32, np.uint32).view(np.float32)
    np.testing.assert_array_equal(
        _bits(np.asarray(flush(x))),
        [0, 0, 0, 0, 0x00800000, 0x7F800000, 0xFF800000, 0x7FC00000, 0x7FC00000, 0x7FC00000, 0x7F7FFFFF, 0x3F800000],
    )
    np.testing.assert_array_equal(_bits(np.asarray(flush(x))), _bits(ref._flush(x)))
    y = np.array(
        [2.0**-20, -(2.0**-20), 2.0**-14, -0.0, 65520.0, np.nan, 1.0], np.float32
    )  # f16: subnormal, min normal, overflow
    for dtype, want in [
        (F16, [0, 0, 0x0400, 0, 0x7C00, 0x7E00, 0x3C00]),
        (BF16, [0x3580, 0xB580, 0x3880, 0, 0x4780, 0x7FC0, 0x3F80]),
    ]:
        cast = jax.jit(replay.flush_cast, static_argnums=1) if jit else replay.flush_cast
        got = np.asarray(cast(jnp.asarray(y), dtype))
        np.testing.assert_array_equal(_bits(got), want)
        _assert_same_bits(got, ref.flush_cast(y, dtype))


@pytest.mark.parametrize("dist", noise.EXACT)
def test_subnormal_results_are_flushed_to_plus_zero(dist):
    key = rng.sample_key(1, 2, 3, 4)
    n = 64
    s = float(replay.update_scale(dist, 2.0**-118))
    k = ref.noise_int(dist, ref.leaf_key(key, "['w']"), n).astype(np.float64)
    k = np.where(k == 0, 1.0, k)  # binomial k == 0 leaves p unchanged; use those slots as controls
    tail = np.array([2.0**-127, -(2.0**-127), 0.0, 2.0**-126] * (n // 4))  # subnormal, -subnormal, 0, FLT_MIN
    p = (-s * k + tail).astype(np.float32)
    assert np.all(np.abs(p[p != 0]) >= np.finfo(np.float32).tiny)  # inputs are normal
    out = np.asarray(replay.replay({"w": p}, [(key, 2.0**-118)], distribution=dist)["w"])
    _assert_same_bits(out, ref.replay_leaf(p, "['w']", [(key, 2.0**-118)], dist))
    k_true = ref.noise_int(dist, ref.leaf_key(key, "['w']"), n)
    hit = k_true != 0
    expected = np.where(np.abs(tail) < 2.0**-126, 0.0, tail).astype(np.float32)
    np.testing.assert_array_equal(_bits(out[hit]), _bits(expected[hit]))  # +0 bits, never -0
    assert np.count_nonzero(hit & (tail != 0) & (np.abs(tail) < 2.0**-126)) > 10


def test_half_precision_casts_flush_overflow_and_canonicalise():
    key = rng.sample_key(0, 0, 0, 7)
    k = ref.noise_int("rademacher", ref.leaf_key(key, "['h']"), 8)
    h = np.array([0, 0, 65504, -65504, np.inf, -np.inf, np.nan, 1], F16)
    b = np.array([0x0001, 0x8001, 0x7F7F, 0x0080, 0x7F80, 0xFF80, 0xFFC1, 0x3F80], np.uint16).view(BF16)
    got = replay.replay({"h": h, "b": b}, [(key, 2.0**-16)], distribution="rademacher")
    gh, gb = np.asarray(got["h"]), np.asarray(got["b"])
    _assert_tree_bits(got, _reference_tree({"h": h, "b": b}, [(key, 2.0**-16)], "rademacher"))
    assert _bits(gh)[0] == 0 and _bits(gh)[1] == 0  # ±2**-16 is a float16 subnormal: flushed to +0
    assert _bits(gh)[6] == 0x7E00  # canonical float16 NaN
    assert np.isposinf(gh[4]) and np.isneginf(gh[5]) and np.isposinf(gb[4].astype(np.float32))
    kb = ref.noise_int("rademacher", ref.leaf_key(key, "['b']"), 8)
    np.testing.assert_array_equal(gb[:2].astype(np.float32), kb[:2] * np.float32(2.0**-16))  # subnormals read as +0
    assert _bits(gb)[6] == 0x7FC0  # canonical bfloat16 NaN
    same = replay.replay({"b": b}, [(key, 0.0)], distribution="rademacher")["b"]
    np.testing.assert_array_equal(_bits(np.asarray(same)), [0, 0, 0x7F7F, 0x0080, 0x7F80, 0xFF80, 0x7FC0, 0x3F80])
    # 65504 + 32 * k: overflows to inf in float16 when k = +1
    big = replay.replay({"h": np.full(8, 65504, F16)}, [(key, 32.0)], distribution="rademacher")
    np.testing.assert_array_equal(np.isinf(np.asarray(big["h"])), k == 1)


# ------------------------------------------------------------------ coefficients


def _significant_bits(x: float) -> int:
    num, _ = abs(x).as_integer_ratio()
    return (num >> ((num & -num).bit_length() - 1)).bit_length() if num else 0


FINITE = st.floats(-(2.0**99), 2.0**99, allow_nan=False, allow_infinity=False, allow_subnormal=True)


@given(c=FINITE)
def test_round_coefficient_properties(c):
    r = replay.round_coefficient(c)
    assert _significant_bits(r) <= replay.COEFF_BITS
    assert replay.round_coefficient(r) == r  # idempotent
    assert replay.round_coefficient(-c) == -r  # odd
    if r == 0.0:
        assert abs(c) < 2.0**-119
    else:
        _, e = math.frexp(c)
        assert abs(r - c) <= math.ldexp(1, e - replay.COEFF_BITS - 1)  # within half a unit in the 20th bit
        assert r * c > 0 and abs(r) >= 2.0**-120
        assert float(np.float32(r)) == r  # exactly a float32


@given(a=FINITE, b=FINITE)
def test_round_coefficient_is_monotone(a, b):
    lo, hi = min(a, b), max(a, b)
    assert replay.round_coefficient(lo) <= replay.round_coefficient(hi)


@pytest.mark.parametrize(
    "c, want",
    [
        (1 + 2.0**-20, 1.0),  # tie, 1 is even
        (1 + 3 * 2.0**-20, 1 + 2.0**-18),  # tie, rounds up to even
        (-(1 + 2.0**-20), -1.0),
        (math.ldexp(1 + 2.0**-20, -60), math.ldexp(1.0, -60)),
        (math.ldexp(1 + 2.0**-20 + 2.0**-40, 7), math.ldexp(1 + 2.0**-19, 7)),  # above the tie
        (0.1, 0.10000002384185791),
        (1e-40, 0.0),
        (0.0, 0.0),
    ],
)
def test_round_coefficient_half_to_even(c, want):
    assert replay.round_coefficient(c) == want


@pytest.mark.parametrize("bad", [math.nan, math.inf, -math.inf, 2.0**100, 1e300])
def test_round_coefficient_rejects_non_finite_and_huge(bad):
    with pytest.raises(ValueError, match="coefficient"):
        replay.round_coefficient(bad)
    with pytest.raises(ValueError, match="coefficient"):
        replay.replay({"w": np.zeros(2, np.float32)}, [(rng.sample_key(0, 0, 0, 0), bad)])


_EDGE = [
    1 + 2.0**-20,
    1 + 3 * 2.0**-20,
    -(1 + 2.0**-20),
    2.0**-120,
    2.0**-121,
    -(2.0**-120) * 0.999,
    (2.0**-120) * (1 - 2.0**-21),
    0.0,
    -0.0,
    5e-324,
    2.0**99 * (2 - 2.0**-19),
    0.1,
    -3,
]


@given(cs=st.lists(st.one_of(FINITE, st.sampled_from(_EDGE)), min_size=0, max_size=40), dist=DISTS)
def test_update_scales_every_path_equals_the_reference(cs, dist):
    """Short lists (rounded one by one with Python floats) and long ones (NumPy, vectorised) give
    the bits of the scalar reference, whatever the container."""
    want = np.array([np.float32(ref.update_scale(dist, c)) for c in cs], np.float32).reshape(-1)
    for arg in (cs, tuple(cs), np.asarray(cs, np.float64), [np.float64(c) for c in cs], list(cs) * 3):
        got = replay.update_scales(dist, arg)
        assert got.dtype == np.float32
        n = len(cs)
        np.testing.assert_array_equal(got[:n].view(np.uint32), want.view(np.uint32))


@pytest.mark.parametrize("n", [1, 40])
@pytest.mark.parametrize("bad", [math.nan, math.inf, 2.0**100, 2.0**100 * (1 - 2.0**-22), -1e300])
def test_update_scales_rejects_what_round_coefficient_rejects(n, bad):
    with pytest.raises(ValueError, match="coefficient"):
        replay.update_scales("binomial", [0.5] * (n - 1) + [bad])


@pytest.mark.parametrize("bits", [0, 21, 24])
def test_round_coefficient_rejects_bits_that_break_exactness(bits):
    with pytest.raises(ValueError, match="bits must be in"):
        replay.round_coefficient(0.3, bits=bits)


@given(c=st.one_of(FINITE, st.floats(2.0**-120, 2.0**-100)), dist=DISTS)
def test_scale_times_noise_is_exact_in_float32(c, dist):
    s = replay.update_scale(dist, c)
    assert s.dtype == np.float32
    assert float(s) == (replay.round_coefficient(c) / 2 if dist == "binomial" else replay.round_coefficient(c))
    ks = np.arange(-8, 9, dtype=np.float32) if dist == "binomial" else np.array([-1, 1], np.float32)
    prod32 = (s * ks).astype(np.float32)
    np.testing.assert_array_equal(prod32.astype(np.float64), float(s) * ks.astype(np.float64))  # no rounding
    assert np.all((prod32 == 0) | (np.abs(prod32) >= np.finfo(np.float32).tiny))  # never subnormal


def test_replay_rounds_the_coefficients_itself():
    p = {"w": np.linspace(-1, 1, 50, dtype=np.float32)}
    key = rng.sample_key(0, 0, 0, 0)
    a = replay.replay(p, [(key, 0.123456789)])
    b = replay.replay(p, [(key, replay.round_coefficient(0.123456789))])
    _assert_tree_bits(a, b)


# ------------------------------------------------------------------ API: forms, errors, jit, memory


def test_update_forms_are_equivalent():
    p = {"w": np.linspace(-1, 1, 9, dtype=np.float32)}
    keys = rng.sample_keys(0, [(0, 0, 0), (0, 0, 1)])
    coeffs = [0.25, -0.5]
    a = replay.replay(p, [(keys[0], coeffs[0]), (keys[1], coeffs[1])])
    b = replay.replay(p, ((keys[0], coeffs[0]), (keys[1], coeffs[1])))  # a tuple of two updates
    c = replay.replay(p, (keys, np.array(coeffs)))  # the (keys, coefficients) form
    _assert_tree_bits(a, b)
    _assert_tree_bits(a, c)
    # no updates: only the flush and the cast
    empty = replay.replay({"w": np.array([-0.0, 1e-45, 2.0], np.float32)}, [])
    np.testing.assert_array_equal(_bits(np.asarray(empty["w"])), [0, 0, 0x40000000])


def test_bad_inputs_are_clear_errors():
    p = {"w": np.zeros(3, np.float32)}
    key = rng.sample_key(0, 0, 0, 0)
    with pytest.raises(ValueError, match="keys must be uint32"):
        replay.replay(p, [(key.astype(np.int64), 0.1)])
    with pytest.raises(ValueError, match="2 keys but 3 coefficients"):
        replay.replay(p, (rng.sample_keys(0, [(0, 0, 0), (0, 0, 1)]), np.ones(3)))
    with pytest.raises(TypeError, match=r"\['i'\] has dtype int32"):
        replay.replay({"i": np.zeros(3, np.int32)}, [(key, 0.1)])
    with pytest.raises(TypeError, match="float64"):
        replay.apply_updates({"d": np.zeros(3, np.float64)}, key[None], np.ones(1, np.float32))
    for fn in (
        lambda: replay.replay(p, [(key, 0.1)], distribution="gaussian"),
        lambda: replay.perturb(p, key, 0.1, distribution="gaussian"),
        lambda: replay.apply_updates(p, key[None], np.ones(1, np.float32), distribution="gaussian"),
        lambda: replay.update_scale("gaussian", 0.1),
    ):
        with pytest.raises(ValueError, match="backend-dependent"):
            fn()


def test_new_keys_and_coefficients_do_not_recompile():
    from zeroth.kernels import perturb as fused

    p = {"recompile_probe": np.zeros(17, np.float32)}
    before = fused.dispatch._fused_copy._cache_size()
    replay.replay(p, [(rng.sample_key(0, 0, 0, s), 0.1 * (s + 1)) for s in range(2)])
    after_first = fused.dispatch._fused_copy._cache_size()
    replay.replay(p, [(rng.sample_key(9, 8, 7, s), -3.0 * (s + 1)) for s in range(2)])
    assert after_first == before + 1 and fused.dispatch._fused_copy._cache_size() == after_first


def test_a_replay_call_sends_its_updates_in_one_array_with_their_bits():
    """replay sends keys and scales to the device as one ``u32[K, 3]`` array (on an NVIDIA H200 each
    argument sent from the host cost a K = 1 replay of 2^27 elements about 0.07 ms of its 0.7):
    unpacked in the program, they are the keys and the scales' float32 bits, negative zero and
    subnormal scales included."""
    from zeroth.kernels import perturb as fused

    keys = rng.sample_keys(3, [(1, 2, s) for s in range(5)])
    scales = np.array([0.5, -0.0, 2.0**-140, -3.25e-7, 1.0], np.float32)
    packed = fused.dispatch.pack_updates(keys, scales)
    assert packed.dtype == np.uint32 and packed.shape == (5, 3)
    got_keys, got_scales = jax.jit(fused.dispatch.unpack_updates)(packed)
    np.testing.assert_array_equal(np.asarray(got_keys), keys)
    np.testing.assert_array_equal(np.asarray(got_scales).view(np.uint32), scales.view(np.uint32))
    # one argument besides the parameters: what replay compiles and calls
    p = {"one_transfer_probe": np.zeros(9, np.float32)}
    lowered = fused.dispatch._fused_copy.lower(p, packed[:2], "binomial", "jnp", None)
    assert [a.shape for a in jax.tree_util.tree_leaves(lowered.args_info)] == [(9,), (2, 3)]


def test_donation_reuses_the_input_buffers():
    p = jax.device_put({"w": np.ones(33, np.float32), "b": np.ones((), BF16)})
    want = replay.replay(p, [(rng.sample_key(0, 0, 0, 0), 0.5)])
    got = replay.replay(p, [(rng.sample_key(0, 0, 0, 0), 0.5)], donate=True)
    assert p["w"].is_deleted() and p["b"].is_deleted()
    _assert_tree_bits(got, jax.device_get(want))


@pytest.mark.parametrize("n_devices", [2, 4])
def test_sharded_replay_equals_unsharded(n_devices):
    if len(jax.devices()) < n_devices:
        pytest.skip(f"needs {n_devices} devices (tests/conftest.py forces 4 CPU devices)")
    mesh = Mesh(np.array(jax.devices()[:n_devices]), ("x",))
    tree = {
        "w": _values(3, (n_devices * 37, 3), F32),
        "e": _values(4, (n_devices * 5, 2), BF16),
        "b": _values(5, (7,), F32),
    }
    shardings = {
        "w": NamedSharding(mesh, P("x", None)),
        "e": NamedSharding(mesh, P("x", None)),
        "b": NamedSharding(mesh, P()),
    }
    updates = [(rng.sample_key(2, m, 1, s), 0.01 * (m - s) + 2.0**-119) for m in range(2) for s in range(2)]
    keys = np.stack([k for k, _ in updates])
    scales = replay.update_scales("binomial", [c for _, c in updates])
    sharded = jax.device_put(tree, shardings)
    fn = jax.jit(
        lambda p, k, s: replay.apply_updates(p, k, s, distribution="binomial"),
        in_shardings=(shardings, None, None),
        out_shardings=shardings,
    )
    out = fn(sharded, keys, scales)
    assert out["w"].sharding.is_equivalent_to(shardings["w"], 2)
    want = _reference_tree(tree, updates, "binomial")
    _assert_tree_bits(jax.device_get(out), want)
    _assert_tree_bits(jax.device_get(replay.replay(sharded, updates)), want)  # host entry, sharded input
    assert replay.checksum(out) == replay.checksum(want)


# ------------------------------------------------------------------ checksum

CHECK_TREE = {
    "dense": {"kernel": np.arange(12, dtype=np.float32).reshape(3, 4), "bias": np.array([1.5, -2.0], BF16)},
    "h": np.array([0.5, 0.25, 0.125], F16),
    "s": np.array(3.0, np.float32),
}


def test_checksum_is_sha256_hex_and_independent_of_dict_order_and_device():
    d = replay.checksum(CHECK_TREE)
    assert len(d) == 64 and int(d, 16) >= 0
    reordered = {
        "s": CHECK_TREE["s"],
        "h": CHECK_TREE["h"],
        "dense": {"bias": CHECK_TREE["dense"]["bias"], "kernel": CHECK_TREE["dense"]["kernel"]},
    }
    assert replay.checksum(reordered) == d
    assert replay.checksum(jax.device_put(CHECK_TREE)) == d
    if len(jax.devices()) >= 2:
        mesh = Mesh(np.array(jax.devices()[:2]), ("x",))
        kernel = jax.device_put(CHECK_TREE["dense"]["kernel"], NamedSharding(mesh, P(None, "x")))
        sharded = {**CHECK_TREE, "dense": {**CHECK_TREE["dense"], "kernel": kernel}}
        assert replay.checksum(sharded) == d


@given(leaf=st.sampled_from([("dense", "kernel"), ("dense", "bias"), ("h",), ("s",)]), data=st.data())
def test_checksum_changes_on_any_single_bit_flip(leaf, data):
    tree = jax.tree_util.tree_map(np.copy, CHECK_TREE)
    parent = tree
    for name in leaf[:-1]:
        parent = parent[name]
    arr = parent[leaf[-1]]
    flat = _bits(arr).reshape(-1).copy()
    i = data.draw(st.integers(0, flat.size - 1), label="element")
    b = data.draw(st.integers(0, 8 * arr.dtype.itemsize - 1), label="bit")
    flat[i] ^= flat.dtype.type(1 << b)
    parent[leaf[-1]] = flat.view(arr.dtype).reshape(arr.shape)
    assert replay.checksum(tree) != replay.checksum(CHECK_TREE)


def test_checksum_covers_every_element_of_a_large_leaf():
    big = np.zeros(1 << 20, np.float32)
    d = replay.checksum({"big": big})
    big[-1] = 1e-30
    assert replay.checksum({"big": big}) != d


def test_checksum_names_paths_dtypes_and_shapes():
    x = np.arange(6, dtype=np.float32)
    base = replay.checksum({"a": x})
    assert replay.checksum({"b": x}) != base  # path rename
    assert replay.checksum({"a": {"a": x}}) != base  # nesting is part of the path
    assert replay.checksum({"a": x.view(np.uint32)}) != base  # same bytes, other dtype
    assert replay.checksum({"a": x.reshape(2, 3)}) != base  # same bytes, other shape
    h = np.arange(4, dtype=F16)
    assert replay.checksum({"a": h}) != replay.checksum({"a": h.view(BF16)})
    assert replay.checksum({"a": x, "b": x}) != base  # an extra leaf
    assert replay.checksum({"a": np.zeros(0, np.float32)}) != replay.checksum({"a": np.zeros((0, 1), np.float32)})


def test_checksum_hashes_each_leafs_little_endian_row_major_bytes():
    """The definition, written out: every leaf's header, then ``tobytes()`` of its little-endian,
    row-major copy (the checksum reads the bytes in place; a transposed or big-endian leaf is the
    same state as its copy)."""
    import hashlib

    x = np.arange(12, dtype=np.float32).reshape(3, 4)
    leaves = {
        "t": x.T,
        "big": x.astype(">f4"),
        "bf": np.array([1.5, -2.0, 0.0], BF16),
        "s": np.array(3.0, np.float32),
        "e": np.zeros((0, 2), F16),
    }
    h = hashlib.sha256(f"zeroth-checksum-v1 {len(leaves)}\n".encode())
    for path in sorted(leaves):
        a = np.ascontiguousarray(leaves[path]).astype(leaves[path].dtype.newbyteorder("<"))
        h.update(f"{path}\0{a.dtype.name}\0{a.shape}\0{a.nbytes}\n".encode() + a.tobytes())
    assert ref.checksum_leaves(leaves) == h.hexdigest()
    assert ref.checksum_leaves({**leaves, "t": np.ascontiguousarray(x.T), "big": x}) == h.hexdigest()


def test_copy_mode_keeps_freed_host_memory_for_reuse():
    """The first copy-mode replay on a CPU asks glibc to keep freed blocks (no page faults per
    call); ZEROTH_REUSE_HOST_MEMORY=0 turns it off. Checked in fresh processes."""
    import platform
    import subprocess
    import sys

    code = (
        "import jax.numpy as jnp; from zeroth import replay, rng; from zeroth.kernels import host_memory as h; "
        "p = {'w': jnp.zeros(8)}; q = replay.replay(p, [(rng.sample_key(0, 0, 0, 0), 0.5)]); "
        "print(h._state.get('done'))"
    )
    cpu = {**os.environ, "JAX_PLATFORMS": "cpu"}  # a CPU replay also where the tests run beside a GPU
    on = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True, env=cpu)
    off = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
        env={**cpu, "ZEROTH_REUSE_HOST_MEMORY": "0"},
    )
    assert off.stdout.strip() == "False"
    if platform.libc_ver()[0] == "glibc":
        assert on.stdout.strip() == "True"


@given(
    st.lists(
        st.one_of(
            st.floats(allow_nan=False, allow_infinity=False, min_value=-(2.0**99), max_value=2.0**99),
            st.sampled_from([0.0, -0.0, 1.0 + 3 * 2.0**-20, 1.0 + 2.0**-20, 2.0**-120, -(2.0**-121), 1e-40, 5e-324]),
        ),
        max_size=40,
    ),
    st.sampled_from(noise.EXACT),
)
def test_vectorised_update_scales_equal_the_scalar_rule(coefficients, dist):
    got = replay.update_scales(dist, coefficients)
    want = np.array([ref.update_scale(dist, c) for c in coefficients], np.float32).reshape(-1)
    np.testing.assert_array_equal(got.view(np.uint32), want.view(np.uint32))
    assert got.dtype == np.float32 and got.shape == (len(coefficients),)


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), 2.0**100, -(2.0**101)])
def test_update_scales_name_a_bad_coefficient(bad):
    with pytest.raises(ValueError, match="coefficient"):
        replay.update_scales("binomial", [0.5, bad])


_TIES = st.builds(
    lambda q, e, sign: sign * (q + 0.5) * 2.0**e,  # exactly half way between two 20-bit values
    st.integers(2**19, 2**20 - 1),
    st.integers(-150, 79),
    st.sampled_from([1.0, -1.0]),
)
_LIMIT = 2.0**100 - 2.0**79  # the tie that rounds up to 2**100: refused


@given(
    cs=st.lists(
        st.one_of(
            _TIES,
            _TIES.map(lambda x: float(np.nextafter(x, 0.0))),
            _TIES.map(lambda x: float(np.nextafter(x, np.inf))),
            st.sampled_from(
                [
                    0.0,
                    -0.0,
                    5e-324,
                    -1e-310,
                    2.0**-120,
                    -(2.0**-121),
                    float(np.nextafter(2.0**-120, 0.0)),
                    float(np.nextafter(_LIMIT, 0.0)),
                    -float(np.nextafter(_LIMIT, 0.0)),
                    2.0**99,
                    1.0 + 2.0**-20,
                ]
            ),
        ),
        min_size=1,
        max_size=40,
    ),
    dist=DISTS,
)
def test_update_scales_round_ties_to_even_like_the_reference(cs, dist):
    """Ties between two 20-bit values, their neighbours, tiny, subnormal, -0 and the largest
    accepted magnitudes: the scalar path (up to 16) and the NumPy path give the reference's bits."""
    want = np.array([ref.update_scale(dist, c) for c in cs], np.float32).view(np.uint32)
    np.testing.assert_array_equal(replay.update_scales(dist, cs).view(np.uint32), want)
    np.testing.assert_array_equal(
        replay.update_scales(dist, np.asarray(cs * 2)).view(np.uint32), np.concatenate([want, want])
    )


@pytest.mark.parametrize("bad", [math.nan, math.inf, -math.inf, _LIMIT, -_LIMIT, 2.0**100, 1e300])
def test_flat_replay_rejects_what_update_scales_rejects_before_touching_the_buffers(bad):
    with pytest.raises(ValueError, match="coefficient"):
        replay.update_scales("binomial", [bad])
    with pytest.raises(ValueError, match="coefficient"):
        replay.update_scales("binomial", np.array([0.5, bad]))
    flat = replay.flatten({"w": np.ones(5, np.float32)})
    keys = rng.sample_keys(0, [(0, 0, 0), (0, 0, 1)])
    with pytest.raises(ValueError, match="coefficient"):
        replay.replay(flat, (keys, [0.5, bad]), donate=True)
    assert not flat.buffers[0].is_deleted()
    np.testing.assert_array_equal(np.asarray(flat.buffers[0]), np.ones(5, np.float32))
