"""zeroth.kernels.signbits: Pallas kernels (interpret mode) bit-exact with the jnp reference and NumPy.

The NumPy side is written independently: ``np.packbits`` for the layout, ``zeroth.reference``'s
threefry for the Bernoulli stream, Python integers for the counts.
"""

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from numpy.testing import assert_array_equal

from zeroth import reference as ref
from zeroth.kernels import signbits as sb
from lowering_util import PLATFORMS, lowered_kernels, tpu_chip_info  # noqa: F401 (a fixture)

# Interpret mode on CPU; on a GPU or TPU (JAX_PLATFORMS=cuda or tpu) the same tests run the kernels natively.
INTERPRET = jax.default_backend() == "cpu"
pytestmark = pytest.mark.accelerator

KEY = np.array([0x12345678, 0x9ABCDEF0], np.uint32)


def np_pack(x: np.ndarray) -> np.ndarray:
    bits = ~(np.asarray(x, np.float32).reshape(-1) <= -np.finfo(np.float32).tiny)
    bits = np.concatenate([bits, np.zeros(-bits.size % 32, bool)])
    return np.packbits(bits, bitorder="little").view("<u4").astype(np.uint32)


def np_bits(words: np.ndarray, n: int) -> np.ndarray:
    return np.unpackbits(np.asarray(words, "<u4").view(np.uint8), bitorder="little")[:n].astype(bool)


def np_uniforms(key, n_words: int, word_offset: int = 0) -> np.ndarray:
    """u32 per element of words word_offset.. : element i -> x0/x1 of threefry(key, (0, i >> 1))."""
    i = np.arange(word_offset * 32, (word_offset + n_words) * 32, dtype=np.uint64)
    j = (i >> np.uint64(1)).astype(np.uint32)
    x0, x1 = ref.threefry2x32((int(key[0]), int(key[1])), (np.zeros_like(j), j))
    return np.where(i % 2 == 0, x0, x1).astype(np.uint32)


def np_bernoulli(key, n_words: int, thresh: int, word_offset: int = 0) -> np.ndarray:
    u = np_uniforms(key, n_words, word_offset).astype(np.uint64)
    bits = u < np.uint64(thresh)
    return np.packbits(bits, bitorder="little").view("<u4").astype(np.uint32)


def np_merge(v, vs, key, m, word_offset=0):
    s = np_bernoulli(key, v.shape[0], sb.threshold(1, m), word_offset)
    r = ~(s ^ vs)
    return (v & vs) | ((v ^ vs) & r)


def rand_words(rng, n):
    return rng.integers(0, 2**32, n, dtype=np.uint64).astype(np.uint32)


# ----------------------------------------------------------------------------- pack / unpack


@pytest.mark.parametrize(
    "shape,dtype,tiles",
    [
        ((1,), jnp.float32, (8,)),
        ((33,), jnp.float32, (8,)),
        ((1000,), jnp.float32, (8, 16)),
        ((7, 45), jnp.bfloat16, (8, 32)),
        ((3, 5, 67), jnp.float32, (8,)),
        ((), jnp.bfloat16, (8,)),
    ],
)
def test_pack_pallas_equals_reference_and_numpy(shape, dtype, tiles):
    rng = np.random.default_rng(hash(shape) % 2**32)
    x = jnp.asarray(rng.standard_normal(shape).astype(np.float32)).astype(dtype)
    want = np_pack(np.asarray(x.astype(jnp.float32)))
    assert_array_equal(np.asarray(sb.pack(x, impl="jnp")), want)
    for bw in tiles:
        got = sb.pack(x, impl="pallas", blocks=sb.Blocks(bw), interpret=INTERPRET)
        assert got.dtype == jnp.uint32 and got.shape == (sb.n_words(int(np.prod(shape))),)
        assert_array_equal(np.asarray(got), want)


def test_pack_sign_convention_zero_negative_zero_nan_inf():
    x = np.array([1.0, -2.0, 0.0, -0.0, np.nan, -np.nan, np.inf, -np.inf, -1e-45, 1e-45], np.float32)
    bits = np_bits(np.asarray(sb.pack(jnp.asarray(x))), x.size)
    # subnormals (+-1e-45) count as zero whether or not the backend flushes them
    #          1     -2    0     -0    nan   -nan  inf   -inf   -1e-45 1e-45
    expect = [True, False, True, True, True, True, True, False, True, True]
    assert bits.tolist() == expect
    # bf16 follows the same rule; the padding bits of the last word are 0.
    w = np.asarray(sb.pack(jnp.asarray(x).astype(jnp.bfloat16)))
    assert np_bits(w, x.size).tolist() == expect
    assert int(w[0]) >> x.size == 0


def test_two_tilings_give_identical_bits_for_every_kernel():
    rng = np.random.default_rng(1)
    x = jnp.asarray(rng.standard_normal(32 * 50 + 7).astype(np.float32))
    v, vs = rand_words(rng, 50), rand_words(rng, 50)
    stack = np.stack([rand_words(rng, 50) for _ in range(3)])
    a, b = sb.Blocks(8), sb.Blocks(64)
    for fn in (
        lambda blk: sb.pack(x, impl="pallas", blocks=blk, interpret=INTERPRET),
        lambda blk: sb.merge(v, vs, KEY, 3, impl="pallas", blocks=blk, interpret=INTERPRET),
        lambda blk: sb.majority(stack, impl="pallas", blocks=blk, interpret=INTERPRET),
        lambda blk: sb.unpack(v, (1590,), scale=0.25, impl="pallas", blocks=blk, interpret=INTERPRET),
    ):
        assert_array_equal(np.asarray(fn(a)), np.asarray(fn(b)))


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_unpack_pallas_equals_reference_and_roundtrips(dtype):
    rng = np.random.default_rng(2)
    shape = (5, 77)
    x = jnp.asarray(rng.standard_normal(shape).astype(np.float32)).astype(dtype)
    w = sb.pack(x)
    scale = np.float32(0.375)
    want = np.where(np.asarray(x.astype(jnp.float32)) < 0, -scale, scale).astype(np.float32)
    ref_out = sb.unpack(w, shape, dtype=dtype, scale=scale, impl="jnp")
    got = sb.unpack(w, shape, dtype=dtype, scale=scale, impl="pallas", blocks=sb.Blocks(8), interpret=INTERPRET)
    assert got.dtype == dtype and got.shape == shape
    assert_array_equal(np.asarray(got), np.asarray(ref_out))
    assert_array_equal(np.asarray(got.astype(jnp.float32)), want)


# ----------------------------------------------------------------------------- Bernoulli bits


@pytest.mark.parametrize("m", [1, 2, 3, 7])
def test_bernoulli_words_match_numpy_threefry(m):
    thresh = sb.threshold(1, m)
    got = np.asarray(sb.bernoulli_words(KEY, 40, thresh, word_offset=5))
    assert_array_equal(got, np_bernoulli(KEY, 40, thresh, 5))
    # a slice regenerates from its global offset alone
    whole = np.asarray(sb.bernoulli_words(KEY, 45, thresh))
    assert_array_equal(got, whole[5:])


def test_threshold_is_exact_integer_probability():
    assert sb.threshold(1, 2) == 2**31
    assert sb.threshold(1, 1) == 2**32 and sb.threshold(0, 5) == 0
    assert sb.threshold(2, 3) == round(2 * 2**32 / 3)
    assert_array_equal(np.asarray(sb.bernoulli_words(KEY, 3, 0)), np.zeros(3, np.uint32))
    assert_array_equal(np.asarray(sb.bernoulli_words(KEY, 3, 2**32)), np.full(3, 0xFFFFFFFF, np.uint32))


# ----------------------------------------------------------------------------- merge


@pytest.mark.parametrize("n,m,tile,offset", [(1, 2, 8, 0), (37, 3, 8, 0), (100, 8, 32, 11)])
def test_merge_pallas_equals_reference_and_numpy(n, m, tile, offset):
    rng = np.random.default_rng(n)
    v, vs = rand_words(rng, n), rand_words(rng, n)
    want = np_merge(v, vs, KEY, m, offset)
    assert_array_equal(np.asarray(sb.merge_ref(v, vs, KEY, m, word_offset=offset)), want)
    got = sb.merge(v, vs, KEY, m, word_offset=offset, impl="pallas", blocks=sb.Blocks(tile), interpret=INTERPRET)
    assert_array_equal(np.asarray(got), want)


def test_merge_keeps_agreeing_bits_and_is_a_select():
    rng = np.random.default_rng(3)
    v, vs = rand_words(rng, 64), rand_words(rng, 64)
    assert_array_equal(np.asarray(sb.merge(v, v, KEY, 5)), v)
    # m = 1: the first contributor has nothing to keep, the output is its own bits
    assert_array_equal(np.asarray(sb.merge(v, vs, KEY, 1)), vs)
    # where bits differ the output is v* exactly where the Bernoulli(1/m) stream is set
    s = np_bernoulli(KEY, 64, sb.threshold(1, 4))
    assert_array_equal(np.asarray(sb.merge(v, vs, KEY, 4)), (v & ~s) | (vs & s))


@pytest.mark.parametrize("m", [2, 3, 8])
def test_transient_vector_probabilities_follow_equation_2(m):
    """P(r=1 | v*=0) = (m-1)/m and P(r=1 | v*=1) = 1/m, within 5 binomial standard deviations."""
    n_words = 4096
    v_star = rand_words(np.random.default_rng(m), n_words)
    r = np_bits(np.asarray(sb.transient_words(KEY, v_star, m)), 32 * n_words)
    vb = np_bits(v_star, 32 * n_words)
    for cond, p in ((~vb, (m - 1) / m), (vb, 1 / m)):
        k = int(cond.sum())
        std = np.sqrt(p * (1 - p) / k)
        assert abs(r[cond].mean() - p) < 5 * std, (m, p, r[cond].mean(), std)


def test_merge_chain_is_unbiased():
    """A chain of M merges (m = 1..M) leaves each bit set with probability (#contributors set) / M."""
    big_m, reps = 5, 2048
    patterns = np.arange(2**big_m)  # every combination of the 5 contributors' bits
    contrib = ((patterns[None, :] >> np.arange(big_m)[:, None]) & 1).astype(bool)  # [M, 32]
    bits = np.tile(contrib, (1, reps))  # [M, 32 * reps]: position j has pattern j % 32
    words = [np.packbits(b, bitorder="little").view("<u4").astype(np.uint32) for b in bits]
    out = words[0]
    for m in range(2, big_m + 1):
        out = np.asarray(sb.merge(out, words[m - 1], ref.fold_in(KEY, m), m))
    got = np_bits(out, bits.shape[1]).reshape(reps, 32).mean(axis=0)
    want = contrib.mean(axis=0)
    std = np.sqrt(np.maximum(want * (1 - want), 1.0 / reps) / reps)
    assert np.all(np.abs(got - want) < 5 * std), np.c_[want, got]
    assert np.all(got[want == 0] == 0) and np.all(got[want == 1] == 1)


# ----------------------------------------------------------------------------- counts and majority


@pytest.mark.parametrize("k", [1, 2, 3, 4, 7])
def test_majority_matches_numpy_vote(k):
    rng = np.random.default_rng(k)
    n = 29
    stack = np.stack([rand_words(rng, n) for _ in range(k)])
    counts = np.stack([np_bits(w, 32 * n) for w in stack]).sum(axis=0)
    want = np.packbits(2 * counts >= k, bitorder="little").view("<u4")
    assert_array_equal(np.asarray(sb.majority(stack, impl="jnp")), want)
    got = sb.majority(stack, impl="pallas", blocks=sb.Blocks(8), interpret=INTERPRET)
    assert_array_equal(np.asarray(got), want)


def test_bit_sliced_counts_and_comparator_match_integers():
    rng = np.random.default_rng(4)
    n = 8
    vecs = [rand_words(rng, n) for _ in range(6)]
    ints = np.stack([np_bits(w, 32 * n) for w in vecs]).astype(int)

    def value(planes):
        return sum(np_bits(np.asarray(p), 32 * n).astype(int) << j for j, p in enumerate(planes))

    a = []
    for i, w in enumerate(vecs[:4]):
        a = sb.count_add(a, jnp.asarray(w), i + 1)
    b = []
    for i, w in enumerate(vecs[4:]):
        b = sb.count_add(b, jnp.asarray(w), i + 1)
    assert len(a) == sb.planes_for(4) == 3 and len(b) == 2
    assert_array_equal(value(a), ints[:4].sum(0))
    total = sb.counts_add(a, b, 6)
    assert len(total) == 3
    assert_array_equal(value(total), ints.sum(0))
    for t in range(1, 8):
        got = np_bits(np.asarray(sb.count_geq(total, t)), 32 * n)
        assert_array_equal(got, ints.sum(0) >= t)


# ----------------------------------------------------------------------------- dispatch and errors


def test_auto_dispatch_uses_jnp_on_cpu():
    if jax.default_backend() == "cpu":
        assert sb.resolve_impl("auto") == "jnp"
    assert sb.resolve_impl("pallas") == "pallas"


def test_bad_arguments_are_named():
    with pytest.raises(TypeError, match="floating"):
        sb.pack(jnp.arange(4))
    with pytest.raises(ValueError, match="power of two"):
        sb.Blocks(12)
    with pytest.raises(ValueError, match="m .*>= 1"):
        sb.merge(np.zeros(2, np.uint32), np.zeros(2, np.uint32), KEY, 0)
    with pytest.raises(ValueError, match="one shape"):
        sb.merge(np.zeros(2, np.uint32), np.zeros(3, np.uint32), KEY, 2)
    with pytest.raises(TypeError, match="key must be u32"):
        sb.merge(np.zeros(2, np.uint32), np.zeros(2, np.uint32), np.zeros(3, np.uint32), 2)
    with pytest.raises(ValueError, match="cannot hold shape"):
        sb.unpack(np.zeros(2, np.uint32), (100,))
    with pytest.raises(ValueError, match="unknown impl"):
        sb.pack(jnp.ones(3), impl="cuda")
    with pytest.raises(ValueError, match="num <= den"):
        sb.threshold(3, 2)


def test_bf16_values_pack_like_their_float32():
    x = np.array([-0.0, 3.0, -1e-40], np.float32)  # -1e-40 is a float32 subnormal, bf16 keeps its sign
    b = np.asarray(jnp.asarray(x).astype(jnp.bfloat16).astype(jnp.float32))
    assert_array_equal(np.asarray(sb.pack(jnp.asarray(x.astype(ml_dtypes.bfloat16)))), np_pack(b))


@pytest.mark.parametrize("platform", PLATFORMS)
def test_every_kernel_lowers_for_gpu_and_tpu(platform, tpu_chip_info):
    # No accelerator needed: exporting runs the Pallas -> Triton / Mosaic lowering of every op.
    # (Without Triton parameters jax picks Mosaic GPU, whose copies take at most 256 elements
    # per dimension; Mosaic TPU has no unsigned reductions: both failed here before.)
    target = "gpu" if platform == "cuda" else platform
    n = 100_003
    x = jax.ShapeDtypeStruct((n,), jnp.bfloat16)
    w = jax.ShapeDtypeStruct((sb.n_words(n),), jnp.uint32)
    stack = jax.ShapeDtypeStruct((5, sb.n_words(n)), jnp.uint32)
    key = jax.ShapeDtypeStruct((2,), jnp.uint32)
    ops = {
        "zeroth_signbits_pack": (lambda x: sb.pack(x, impl="pallas", platform=target), (x,)),
        "zeroth_signbits_unpack": (
            lambda w: sb.unpack(w, (n,), dtype=jnp.bfloat16, scale=0.25, impl="pallas", platform=target),
            (w,),
        ),
        "zeroth_signbits_merge": (
            lambda v, vs, k: sb.merge(v, vs, k, 3, word_offset=64, impl="pallas", platform=target),
            (w, w, key),
        ),
        "zeroth_signbits_majority": (lambda s: sb.majority(s, impl="pallas", platform=target), (stack,)),
    }
    for name, (fn, args) in ops.items():
        assert name in lowered_kernels(fn, args, platform), name


def test_a_tpu_without_sublane_gather_takes_the_jnp_path(monkeypatch):
    """Compiled with libtpu for a TPU v3 and v4 the sign-bit kernels' lane reductions need
    Mosaic's sublane gather, which those generations lack ("Sublane gather not supported by this
    TPU generation"; v5e, v5p and v6e compile them): ``auto`` runs the jnp path there."""
    from zeroth import rule

    kinds = {
        "TPU v3": 3,
        "TPU v4": 4,
        "TPU v5 lite": 5,
        "TPU v5p": 5,
        "TPU v6 lite": 6,
        "TPU7x": 7,
        "cpu": None,
        "NVIDIA H100 80GB HBM3": None,
    }
    assert {k: rule.tpu_generation(k) for k in kinds} == kinds
    assert [rule.lacks_sublane_gather(k) for k in kinds] == [True, True, False, False, False, False, False, False]
    assert not rule.lacks_sublane_gather()  # this process: a CPU
    monkeypatch.setattr(rule, "default_platform", lambda: "tpu")
    for kind, impl in (("TPU v4", "jnp"), ("TPU v5 lite", "pallas"), ("TPU v6 lite", "pallas")):
        monkeypatch.setattr(rule, "tpu_generation", lambda device_kind=None, kind=kind: kinds[kind])
        assert rule.lacks_sublane_gather() == (impl == "jnp")
        assert sb.resolve_impl("auto") == impl, kind
        assert sb.resolve_impl("pallas") == "pallas"  # asked for by name: Mosaic's own error on a v4


def test_float16_on_a_tpu_takes_the_jnp_path():
    """Compiled with libtpu for a TPU v5e, packing float16 values failed ("Invalid vector type for
    load") and unpacking to float16 too ("failed to legalize operation 'tpu.pack_subelements'"):
    on a TPU float16 goes through the jnp path under ``auto`` and is refused under ``pallas``."""
    assert sb.resolve_impl("auto", jnp.float16, "tpu") == "jnp"
    assert sb.resolve_impl("pallas", jnp.bfloat16, "tpu") == "pallas"
    assert sb.resolve_impl("pallas", jnp.float16, "gpu") == "pallas"
    x = jnp.asarray(np.random.default_rng(3).standard_normal(1000), jnp.float16)
    with pytest.raises(ValueError, match="cannot take float16 arrays .* use impl='auto'"):
        sb.pack(x, impl="pallas", interpret=True, platform="tpu")
    with pytest.raises(ValueError, match="cannot take float16 arrays"):
        sb.unpack(sb.pack(x), (1000,), dtype=jnp.float16, impl="pallas", interpret=True, platform="tpu")
    words = sb.pack(x, platform="tpu")  # auto: the jnp path, the same words
    assert_array_equal(np.asarray(words), np.asarray(sb.pack_ref(x)))
    assert_array_equal(
        np.asarray(sb.unpack(words, (1000,), dtype=jnp.float16, scale=0.5, platform="tpu")),
        np.asarray(sb.unpack_ref(words, (1000,), dtype=jnp.float16, scale=0.5)),
    )
