"""zeroth.noise: integer-only noise equal to the NumPy reference bit for bit, invariant under
slicing, tiling and sharding; the backend-dependent gaussian is refused where exactness is asked."""

import functools
import math

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from zeroth import noise, rule
from zeroth import reference as ref

U32 = st.integers(0, 2**32 - 1)
DISTS = st.sampled_from(noise.EXACT)
SHAPES = st.sampled_from([(), (0,), (1,), (5,), (31,), (33,), (64,), (65,), (129,), (3, 7), (2, 3, 5), (4, 33)])
DTYPES = [jnp.float32, jnp.bfloat16, jnp.float16]


@functools.partial(jax.jit, static_argnames=("dist", "shape"))
def _noise_int(key, offset, *, dist, shape):
    return noise.noise_int(dist, key, shape, offset)


def _key(k0, k1):
    return np.array([k0, k1], np.uint32)


def _spec_noise(dist, key, n, offset):
    """The module docstring's definition, evaluated with the reference threefry at only the calls
    needed (so it works at any offset, up to 2**32)."""
    i = np.arange(offset, offset + n, dtype=np.uint64)
    per_call = 64 if dist == "rademacher" else 4
    calls = (i // np.uint64(per_call)).astype(np.uint32)
    x0, x1 = ref.threefry2x32(key, (np.zeros_like(calls), calls))
    if dist == "rademacher":
        word = np.where((i >> np.uint64(5)) & np.uint64(1), x1, x0)
        bit = (word >> (i % np.uint64(32)).astype(np.uint32)) & np.uint32(1)
        return bit.astype(np.int8) * 2 - 1
    word = np.where((i >> np.uint64(1)) & np.uint64(1), x1, x0)
    half = (word >> (16 * (i % np.uint64(2))).astype(np.uint32)) & np.uint32(0xFFFF)
    return np.array([bin(int(h)).count("1") - 8 for h in half], np.int8)


@given(k0=U32, k1=U32, dist=DISTS, shape=SHAPES, offset=st.integers(0, 5000))
def test_noise_int_equals_reference(k0, k1, dist, shape, offset):
    key = _key(k0, k1)
    got = np.asarray(_noise_int(key, np.uint32(offset), dist=dist, shape=shape))
    assert got.shape == shape and got.dtype == np.int8
    n = math.prod(shape)
    want = ref.noise_int(dist, key, n, offset)
    np.testing.assert_array_equal(got.reshape(-1), want)
    np.testing.assert_array_equal(want, _spec_noise(dist, key, n, offset))


@pytest.mark.parametrize("dist", noise.EXACT)
def test_noise_int_at_the_top_of_the_index_range(dist):
    key = ref.sample_key(1, 2, 3, 4)
    n = 70
    offset = noise.MAX_LEAF_SIZE - n  # the last elements a leaf may have
    got = np.asarray(noise.noise_int(dist, key, (n,), offset))
    np.testing.assert_array_equal(got, _spec_noise(dist, key, n, offset))
    with pytest.raises(ValueError, match="exceeds"):
        noise.noise_int(dist, key, (n,), offset + 1)
    with pytest.raises(ValueError, match="non-negative"):
        noise.noise_int(dist, key, (n,), -1)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("dist", noise.EXACT)
@given(k0=U32, k1=U32, shape=st.sampled_from([(), (1,), (37,), (3, 11)]))
def test_float_noise_is_the_integer_noise_exactly(dist, dtype, k0, k1, shape):
    key = _key(k0, k1)
    z = np.asarray(jax.jit(noise.sample, static_argnums=(0, 2, 3))(dist, key, shape, dtype))
    assert z.dtype == jnp.dtype(dtype) and z.shape == shape
    k = ref.noise_int(dist, key, math.prod(shape)).astype(np.float64)
    want = k / 2 if dist == "binomial" else k
    np.testing.assert_array_equal(z.astype(np.float64).reshape(-1), want)  # every value is representable


@pytest.mark.parametrize("dist", noise.EXACT)
def test_multi_dim_noise_is_row_major_flat_noise(dist):
    key = ref.sample_key(0, 1, 2, 3)
    flat = np.asarray(_noise_int(key, np.uint32(0), dist=dist, shape=(3 * 5 * 7,)))
    np.testing.assert_array_equal(
        np.asarray(_noise_int(key, np.uint32(0), dist=dist, shape=(3, 5, 7))), flat.reshape(3, 5, 7)
    )
    np.testing.assert_array_equal(
        np.asarray(_noise_int(key, np.uint32(0), dist=dist, shape=(15, 7))), flat.reshape(15, 7)
    )


def test_distributions_have_the_documented_law():
    key = ref.sample_key(9, 0, 0, 0)
    n = 1 << 16
    r = np.asarray(noise.rademacher_int(key, (n,))).astype(np.int64)
    assert set(np.unique(r)) == {-1, 1}
    assert abs(r.mean()) < 4 / math.sqrt(n)
    k = np.asarray(noise.binomial_int(key, (n,))).astype(np.int64)
    assert k.min() >= -8 and k.max() <= 8
    z = k / 2
    assert abs(z.mean()) < 4 / math.sqrt(n) and abs(z.var() - 1.0) < 0.03
    # k + 8 ~ Binomial(16, 1/2): compare the histogram with the exact law
    counts = np.bincount(k + 8, minlength=17)
    expected = np.array([math.comb(16, j) for j in range(17)]) / 2**16 * n
    chi2 = float(((counts - expected) ** 2 / np.maximum(expected, 1e-9))[2:15].sum())
    assert chi2 < 45  # 12 degrees of freedom: p ~ 1e-5


@settings(max_examples=20)  # every distinct slice length compiles once
@given(dist=DISTS, n=st.integers(1, 300), cuts=st.lists(st.integers(0, 300), max_size=4))
def test_slices_concatenate_to_the_whole(dist, n, cuts):
    key = ref.sample_key(3, 1, 4, 1)
    whole = ref.noise_int(dist, key, n)
    bounds = sorted({0, n, *[c for c in cuts if c < n]})
    pieces = [
        np.asarray(_noise_int(key, np.uint32(a), dist=dist, shape=(b - a,))) for a, b in zip(bounds[:-1], bounds[1:])
    ]
    np.testing.assert_array_equal(np.concatenate(pieces), whole)
    np.testing.assert_array_equal(np.asarray(_noise_int(key, np.uint32(0), dist=dist, shape=(n,))), whole)


@pytest.mark.parametrize("n_devices", [2, 4])
@pytest.mark.parametrize("dist", noise.EXACT)
def test_sharded_generation_equals_unsharded(dist, n_devices):
    devices = rule.default_devices()  # the host CPU's four beside a GPU, not the GPU's one
    if len(devices) < n_devices:
        pytest.skip(f"needs {n_devices} devices (tests/conftest.py forces 4 CPU devices)")
    mesh = Mesh(np.array(devices[:n_devices]), ("x",))
    key = ref.sample_key(5, 0, 1, 2)
    shape = (n_devices * 37, 3)  # 111 elements per shard: not a multiple of 4, 32 or 64
    whole = np.asarray(noise.noise_int(dist, key, shape))

    sharded = jax.jit(lambda k: noise.noise_int(dist, k, shape), out_shardings=NamedSharding(mesh, P("x", None)))(key)
    assert len(sharded.addressable_shards) == n_devices
    np.testing.assert_array_equal(np.asarray(sharded), whole)
    for shard in sharded.addressable_shards:
        np.testing.assert_array_equal(np.asarray(shard.data), whole[shard.index])

    per = math.prod(shape) // n_devices

    def local(k):  # each device generates only its own slice, from its global offset
        offset = (jax.lax.axis_index("x") * per).astype(jnp.uint32)
        return noise.noise_int(dist, k, (per,), offset)

    by_shard = jax.jit(jax.shard_map(local, mesh=mesh, in_specs=P(), out_specs=P("x")))(key)
    np.testing.assert_array_equal(np.asarray(by_shard), whole.reshape(-1))


def test_gaussian_refused_where_exactness_is_asked():
    key = ref.sample_key(0, 0, 0, 0)
    with pytest.raises(ValueError, match="backend-dependent"):
        noise.check_distribution("gaussian")
    with pytest.raises(ValueError, match="backend-dependent.*binomial.*rademacher"):
        noise.sample("gaussian", key, (4,))
    with pytest.raises(ValueError, match="backend-dependent"):
        noise.noise_int("gaussian", key, (4,))
    assert noise.check_distribution("gaussian", exact=False) == "gaussian"
    z = noise.sample("gaussian", key, (1000,), exact=False)
    assert z.dtype == jnp.float32 and abs(float(jnp.std(z)) - 1.0) < 0.1
    with pytest.raises(ValueError, match="offset"):
        noise.gaussian(key, (4,), offset=4)
    with pytest.raises(ValueError, match=r"unknown noise distribution 'normal'.*binomial"):
        noise.check_distribution("normal")


@pytest.mark.parametrize("dtype", [np.float32, ml_dtypes.bfloat16, np.float16])
def test_noise_values_fit_every_dtype(dtype):
    # |k| <= 8 and k/2: representable exactly in the narrowest supported float
    for k in range(-8, 9):
        assert float(np.asarray(k / 2, dtype)) == k / 2


def test_popcount_counts_uint32_words():
    # Kernels count uint32 bits as int32 (what Triton and Mosaic compile): every 16-bit value,
    # random 32-bit words and the sign bit count as Python does.
    halves = np.arange(1 << 16, dtype=np.uint32)
    words = np.random.default_rng(0).integers(0, 2**32, 4096, dtype=np.uint64).astype(np.uint32)
    for v in (halves, words, np.array([0, 0xFFFFFFFF, 0x80000000, 0x7FFFFFFF, 1], np.uint32)):
        want = np.array([bin(int(x)).count("1") for x in v], np.int32)
        got = noise.popcount(jnp.asarray(v))
        assert got.dtype == jnp.int32
        np.testing.assert_array_equal(np.asarray(got), want)


def test_binomial_counts_every_half_word():
    # Every 16-bit value, in each of the four positions of a call, gives popcount - 8, and
    # the word's other half (different bits for every element) is never counted.
    halves = np.arange(1 << 16, dtype=np.uint32)
    rest = halves[::-1] ^ np.uint32(0x5A5A)
    want = np.array([bin(int(x)).count("1") - 8 for x in halves], np.int32)
    placed = {
        0: ((rest << 16) | halves, ~halves),
        1: ((halves << 16) | rest, ~halves),
        2: (~halves, (rest << 16) | halves),
        3: (~halves, (halves << 16) | rest),
    }
    for within, (x0, x1) in placed.items():
        got = noise.binomial_from_words(jnp.asarray(x0), jnp.asarray(x1), jnp.full(halves.shape, within, jnp.uint32))
        assert got.dtype == jnp.int32
        np.testing.assert_array_equal(np.asarray(got), want, err_msg=f"within={within}")
