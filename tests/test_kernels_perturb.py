"""Fused replay kernels: Pallas (interpret mode on CPU), native CPU and jnp give the bits of the
NumPy reference, for every tiling, offset, dtype and thread split."""

import ctypes
import itertools
import platform

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from zeroth import reference as ref
from zeroth import replay, rng, rule
from zeroth.kernels import cpu_native
from zeroth.kernels import perturb as kp
from lowering_util import lowered_kernels, tpu_chip_info  # noqa: F401 (a fixture)

DISTS = ("binomial", "rademacher")
# NaNs with payloads, quiet and signalling, of both signs: each must come out as the canonical 0x7FC00000
NAN_PAYLOADS = np.array([0x7FC00001, 0xFFC00000, 0x7F800001, 0xFF812345], np.uint32).view(np.float32)
NATIVE = cpu_native.available()
needs_native = pytest.mark.skipif(not NATIVE, reason=str(cpu_native.unavailable_reason()))
ACCELERATOR = jax.default_backend() in ("gpu", "cuda", "rocm", "tpu")


def _bits(a) -> np.ndarray:
    a = np.asarray(a)
    return a.reshape(-1).view(np.dtype(f"u{a.dtype.itemsize}"))


def assert_same_bits(a, b):
    assert np.asarray(a).dtype == np.asarray(b).dtype
    assert np.shape(a) == np.shape(b)
    np.testing.assert_array_equal(_bits(a), _bits(b))


def _leaf_keys(n_updates: int, seed: int = 0) -> np.ndarray:
    keys = rng.sample_keys(seed, [(1, 2, s) for s in range(n_updates)])
    return np.stack([ref.fold_in(k, 12345) for k in keys]) if n_updates else np.zeros((0, 2), np.uint32)


def _scales(dist: str, n_updates: int, magnitude: float = 1.0, seed: int = 0) -> np.ndarray:
    cs = np.random.default_rng(seed).normal(size=n_updates) * magnitude
    return replay.update_scales(dist, list(cs))


def numpy_perturb(x, leaf_keys, scales, dist: str, offset: int = 0) -> np.ndarray:
    """The NumPy specification: flush, K exact updates on global indices, one flush_cast."""
    x = np.asarray(x)
    p = ref._flush(x.astype(np.float32).reshape(-1))
    for key, s in zip(leaf_keys, scales):
        p = ref.apply_update(p, np.float32(s), ref.noise_int(dist, key, p.size, offset))
    return ref.flush_cast(p, x.dtype).reshape(x.shape)


def _array(shape, dtype, seed=0, scale=2.0):
    return jnp.asarray(np.random.default_rng(seed).normal(size=shape) * scale, dtype)


# --------------------------------------------------------------------------- Pallas kernel


PALLAS_CASES = [
    # (distribution, dtype, shape, block sizes)
    ("binomial", jnp.float32, (1000,), kp.BlockSizes(tile=256, lanes=None)),
    ("binomial", jnp.bfloat16, (37, 29), kp.BlockSizes(tile=256, lanes=32)),
    ("binomial", jnp.float32, (5,), kp.BlockSizes(tile=64, lanes=None)),
    ("binomial", jnp.bfloat16, (), kp.BlockSizes(tile=64, lanes=None)),
    ("rademacher", jnp.float32, (13, 77), kp.BlockSizes(tile=512, lanes=None)),
    ("rademacher", jnp.bfloat16, (333,), kp.BlockSizes(tile=512, lanes=64)),
    ("rademacher", jnp.float16, (2, 3, 50), kp.BlockSizes(tile=512, lanes=None)),
    ("binomial", jnp.bfloat16, (1536, 37), kp.BlockSizes(tile=8192, lanes=None)),  # a partial last tile
    ("binomial", jnp.float16, (999, 11), kp.BlockSizes(tile=8192, lanes=None)),  # not a whole number of rows
]


def _agrees_with_the_specification(build):
    """The kernel of ``build`` against the NumPy specification: whole float32 tiles with special
    values in every group, in place and not, K = 1 to 5 (one and two groups left over at a tile's
    end), a leaf at an odd global offset, and float16 and bfloat16 leaves."""
    tiny = np.float32(jnp.finfo(jnp.float32).tiny)
    specials = np.concatenate(
        [
            np.array([0.0, -0.0, np.inf, -np.inf, tiny, -tiny, tiny / 4, -tiny / 8, 3.0e38, -3.0e38], np.float32),
            NAN_PAYLOADS,
        ]
    )
    r = np.random.default_rng(16)
    # of the size of the small updates, so that some sums cancel into the subnormal range
    tiles = (r.standard_normal(2 * 4096 + 64 + 40) * 2.0**-117).astype(np.float32)
    for start in range(0, tiles.size - specials.size, 61):
        tiles[start : start + specials.size] = specials
    cases = [
        (jnp.asarray(tiles), 0),
        (jnp.asarray(tiles[: 4096 + 128 + 7]), 0),
        (_array((777,), jnp.float32, 17), 4096 * 3 + 37),
        (_array((9000,), jnp.float16, seed=15), 0),
        (_array((5000,), jnp.bfloat16, seed=18), 129),
    ]
    # first coefficients: tiny (the sums of the first update flushed from the loaded values on), or
    # making the kernel's first scale exactly the smallest with which a fused path adds to the loaded
    # value unflushed (2**-100: a subnormal x can no longer change the sum), and just below it
    # (a coefficient's 20 bits: 2**-k * (1 - 2**-20) is the one below 2**-k; a binomial scale is half its coefficient)
    firsts = {
        "binomial": (2.0**-118 * 3, 2.0**-99, -(2.0**-99) * (1 - 2.0**-20)),
        "rademacher": (2.0**-118 * 3, 2.0**-100, -(2.0**-100) * (1 - 2.0**-20)),
    }
    for dist in DISTS:
        for n_updates, first in itertools.product((1, 2, 5), firsts[dist]):
            keys = _leaf_keys(n_updates, seed=15 + n_updates)
            scales = replay.update_scales(dist, [first, -(2.0**-118) * 5, 2.0**-118, -2.5, 8.0][:n_updates])
            for x, offset in cases:
                want = numpy_perturb(x, keys, scales, dist, offset)
                for inplace in (False, True):
                    f = jax.jit(
                        lambda x: kp.perturb_native(
                            x, keys, scales, distribution=dist, offset=offset, inplace=inplace, build=build
                        ),
                        donate_argnums=0 if inplace else (),
                    )
                    assert_same_bits(f(jnp.copy(x)), want)


class TestPallasInterpret:
    """Runs every case in Pallas interpret mode (CPU); the subclass below runs it natively."""

    INTERPRET = True

    @pytest.mark.parametrize("dist,dtype,shape,blocks", PALLAS_CASES)
    def test_matches_references(self, dist, dtype, shape, blocks):
        x = _array(shape, dtype)
        keys, scales = _leaf_keys(6), _scales(dist, 6)
        got = jax.jit(
            lambda x, k, s: kp.perturb_pallas(x, k, s, distribution=dist, block_sizes=blocks, interpret=self.INTERPRET)
        )(x, keys, scales)
        assert_same_bits(got, kp.perturb_reference(x, keys, scales, distribution=dist))
        assert_same_bits(got, numpy_perturb(x, keys, scales, dist))

    @pytest.mark.parametrize("dist", DISTS)
    def test_two_tilings_identical(self, dist):
        x = _array((3, 700), jnp.float32, seed=1)
        keys, scales = _leaf_keys(4, seed=1), _scales(dist, 4, seed=1)
        outs = [
            kp.perturb_pallas(x, keys, scales, distribution=dist, block_sizes=b, interpret=self.INTERPRET)
            for b in (kp.BlockSizes(tile=1024, lanes=None), kp.BlockSizes(tile=1024, lanes=128))
        ]
        assert_same_bits(outs[0], outs[1])
        assert_same_bits(outs[0], numpy_perturb(x, keys, scales, dist))

    @pytest.mark.parametrize("offset", [0, 66])
    def test_slice_at_offset_matches_whole_leaf(self, offset):
        # A shard [offset, offset + n) regenerates its own noise; 66 is not a multiple of 4 or 64,
        # so the grouped layout falls back to lane rows (same bits).
        dist = "binomial"
        whole = _array((400,), jnp.float32, seed=2)
        keys, scales = _leaf_keys(3, seed=2), _scales(dist, 3, seed=2)
        part = kp.perturb_pallas(
            whole[offset : offset + 200],
            keys,
            scales,
            distribution=dist,
            offset=offset,
            block_sizes=kp.BlockSizes(tile=128, lanes=None),
            interpret=self.INTERPRET,
        )
        full = numpy_perturb(whole, keys, scales, dist)
        assert_same_bits(part, full[offset : offset + 200])

    def test_pytree_replay_digest(self):
        params = {"w": _array((9, 31), jnp.float32, seed=3), "b": _array((31,), jnp.bfloat16, seed=4)}
        keys = rng.sample_keys(5, [(m, 0, s) for m in range(2) for s in range(3)])
        coeffs = [0.02, -0.5, 1.25, -0.003, 0.7, 0.1]
        scales = replay.update_scales("binomial", coeffs)
        got = kp.apply_updates(params, keys, scales, distribution="binomial", impl="pallas", interpret=self.INTERPRET)
        want = replay.replay(params, list(zip(keys, coeffs)), distribution="binomial")
        assert replay.checksum(got) == replay.checksum(want)

    @pytest.mark.parametrize("dist", DISTS)
    def test_gpu_settings(self, dist):
        # The GPU path pads K to a power of two for Triton; the padding must never be read.
        x = _array((777,), jnp.float32, seed=14)
        keys, scales = _leaf_keys(5, seed=14), _scales(dist, 5, seed=14)
        got = kp.perturb_pallas(x, keys, scales, distribution=dist, interpret=self.INTERPRET, platform="gpu")
        assert_same_bits(got, numpy_perturb(x, keys, scales, dist))


@pytest.mark.parametrize(
    "platform,blocks",
    [
        ("cuda", kp.BlockSizes(tile=8192, lanes=None)),
        ("cuda", kp.BlockSizes(tile=8192, lanes=1024)),
        ("tpu", None),  # the TPU default: lane-dense rows of 1024
    ],
)
@pytest.mark.parametrize("dist", DISTS)
def test_lowers_for_gpu_and_tpu(platform, blocks, dist, tpu_chip_info):
    # No accelerator needed: exporting runs the Pallas -> Triton / Mosaic lowering of every op.
    keys, scales = rng.sample_keys(0, [(0, 0, s) for s in range(3)]), _scales(dist, 3)
    target = "gpu" if platform == "cuda" else platform

    def f(x, k, s):
        return kp.perturb_pallas(
            x, kp.leaf_keys(k, 5), s, distribution=dist, block_sizes=blocks, platform=target, inplace=True
        )

    args = (jax.ShapeDtypeStruct((100_003,), jnp.bfloat16), keys, scales)
    assert "zeroth_fused_replay" in lowered_kernels(f, args, platform)


@pytest.mark.parametrize("offset", [65, 130])
@pytest.mark.parametrize("tile", [64, 256, 2048])
def test_tpu_tiles_at_offsets_that_break_the_grouping(tile, offset, tpu_chip_info):
    """A binomial tile of ``tile`` elements has tile / 4 rows of one threefry call each; a leaf at
    an offset that is not a multiple of 4 has rows of 64 elements, fewer per tile (1, 4 and 32
    here). On a TPU they are still a multiple of 8 (Mosaic's blocks): the kernel lowers for a TPU,
    and with the TPU's plan it gives the reference's bits (interpret mode)."""
    blocks = kp.BlockSizes(tile=tile)
    keys, scales = rng.sample_keys(0, [(0, 0, s) for s in range(3)]), _scales("binomial", 3)
    n = 1000

    def f(x, k, s, interpret=False):
        return kp.perturb_pallas(
            x,
            kp.leaf_keys(k, 5),
            s,
            distribution="binomial",
            block_sizes=blocks,
            offset=offset,
            platform="tpu",
            interpret=interpret,
        )

    plan = kp.plans.plan_tiles(n, "binomial", blocks, "tpu", offset)
    assert not plan.grouped and plan.tiles and plan.tile_rows % 8 == 0, plan
    args = (jax.ShapeDtypeStruct((n,), jnp.float32), keys, scales)
    assert "zeroth_fused_replay" in lowered_kernels(f, args, "tpu")
    x = _array((n,), jnp.float32, seed=offset)
    got = jax.jit(lambda x: f(x, keys, scales, interpret=True))(x)
    assert_same_bits(got, numpy_perturb(x, kp.leaf_keys(keys, 5), scales, "binomial", offset))


@pytest.mark.parametrize("platform", ["cuda", "tpu"])
def test_every_tiling_the_benchmark_sweeps_lowers(platform, tpu_chip_info):
    """`zeroth bench kernels` times each tiling of TILE_CANDIDATES on a GPU or TPU: each must pass
    the platform's block rules and lower for it (a sweep that fails there spends device time)."""
    from zeroth.bench.kernels import TILE_CANDIDATES

    target = "gpu" if platform == "cuda" else platform
    keys = rng.sample_keys(0, [(0, 0, s) for s in range(3)])
    for blocks in TILE_CANDIDATES[target]:
        for dist in DISTS:
            kp.check_block_sizes(blocks, target, dist)

            def f(x, k, s, blocks=blocks, dist=dist):
                return kp.perturb_pallas(
                    x, kp.leaf_keys(k, 5), s, distribution=dist, block_sizes=blocks, platform=target, inplace=True
                )

            args = (jax.ShapeDtypeStruct((1 << 18,), jnp.float32), keys, _scales(dist, 3))
            assert "zeroth_fused_replay" in lowered_kernels(f, args, platform), (blocks, dist)


@pytest.mark.accelerator
@pytest.mark.skipif(not ACCELERATOR, reason="native Pallas needs a GPU or TPU")
class TestPallasNative(TestPallasInterpret):
    INTERPRET = False


# --------------------------------------------------------------------------- native CPU kernel


@needs_native
class TestNative:
    @pytest.mark.parametrize("dist", DISTS)
    @pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16, jnp.float16])
    @pytest.mark.parametrize("shape", [(), (1,), (3,), (63,), (65,), (17, 61), (4097,), (2, 4096)])
    def test_matches_numpy_reference(self, dist, dtype, shape):
        x = _array(shape, dtype, seed=len(shape) + sum(shape))
        keys, scales = _leaf_keys(5), _scales(dist, 5)
        got = kp.perturb_native(x, keys, scales, distribution=dist)
        assert_same_bits(got, numpy_perturb(x, keys, scales, dist))

    @pytest.mark.parametrize("dist", DISTS)
    def test_threaded_split_matches(self, dist):
        # 70001 elements x 4 updates is above the threading threshold: tiles go to several threads.
        x = _array((70001,), jnp.float32, seed=5)
        keys, scales = _leaf_keys(4, seed=5), _scales(dist, 4, seed=5)
        got = jax.jit(lambda x: kp.perturb_native(x, keys, scales, distribution=dist))(x)
        assert_same_bits(got, numpy_perturb(x, keys, scales, dist))

    # The binomial kernel computes the noise of four updates at a time, then two, then one: every
    # remainder of K mod 4, after none, one or several groups of four.
    @pytest.mark.parametrize("n_updates", [0, 1, 2, 3, 4, 5, 6, 7, 8, 11])
    def test_update_counts(self, n_updates):
        x = _array((300,), jnp.bfloat16, seed=6)
        keys, scales = _leaf_keys(n_updates, seed=6), _scales("binomial", n_updates, seed=6)
        got = kp.perturb_native(x, keys, scales, distribution="binomial")
        assert_same_bits(got, numpy_perturb(x, keys, scales, "binomial"))

    @pytest.mark.parametrize("offset", [1, 4095, 8197])
    def test_whole_tiles_at_unaligned_offsets(self, offset):
        # Whole float32 tiles are updated in the output buffer itself, here at addresses that are
        # not 64-byte aligned; with and without aliasing the input.
        x = _array((13000,), jnp.float32, seed=offset)
        for dist in DISTS:
            keys, scales = _leaf_keys(2, seed=offset), _scales(dist, 2, seed=offset)
            want = numpy_perturb(x, keys, scales, dist, offset)
            for inplace in (False, True):
                f = jax.jit(
                    lambda x: kp.perturb_native(x, keys, scales, distribution=dist, offset=offset, inplace=inplace),
                    donate_argnums=0 if inplace else (),
                )
                assert_same_bits(f(jnp.copy(x)), want)

    @settings(max_examples=25)
    @given(
        n=st.integers(1, 3000),
        offset=st.integers(0, 9000),
        n_updates=st.integers(0, 4),
        dist=st.sampled_from(DISTS),
        seed=st.integers(0, 2**32 - 1),
    )
    def test_slices_at_any_offset(self, n, offset, n_updates, dist, seed):
        x = _array((n,), jnp.float32, seed=seed % 1000)
        keys, scales = _leaf_keys(n_updates, seed=seed), _scales(dist, n_updates, seed=seed)
        got = kp.perturb_native(x, keys, scales, distribution=dist, offset=offset)
        assert_same_bits(got, numpy_perturb(x, keys, scales, dist, offset))

    @pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16, jnp.float16])
    @pytest.mark.parametrize("dist", DISTS)
    def test_special_values(self, dtype, dist):
        tiny = float(jnp.finfo(dtype).tiny)
        big = float(jnp.finfo(dtype).max)
        specials = np.array(
            [0.0, -0.0, np.inf, -np.inf, np.nan, -np.nan, tiny, -tiny, tiny / 4, -tiny / 8, big, -big, 1.0, -1.0],
            np.float32,
        )
        x = jnp.asarray(np.concatenate([specials, np.float32(tiny) * np.arange(-50, 50, dtype=np.float32)]), dtype)
        keys = _leaf_keys(7, seed=7)
        # Small scales push results into the subnormal range (flushed each update), large ones
        # towards overflow (float16), 2**90 far from the inputs. 2**-118 is near the smallest
        # coefficient the host rounding keeps (2**-120).
        small = max(tiny, 2.0**-118)
        scales = replay.update_scales(dist, [small * 3, -small * 5, 2.0**90, -(2.0**90), small, 2.5, 8.0])
        got = kp.perturb_native(x, keys, scales, distribution=dist)
        assert_same_bits(got, kp.perturb_reference(x, keys, scales, distribution=dist))
        assert_same_bits(got, numpy_perturb(x, keys, scales, dist))

    @pytest.mark.parametrize("n_updates", [1, 2, 3, 4])
    @pytest.mark.parametrize("inplace", [False, True])
    @pytest.mark.parametrize("dist", DISTS)
    def test_whole_float32_tiles_of_special_values(self, dist, n_updates, inplace):
        # Whole float32 tiles (4096 elements at global multiples of 4096) of fewer than four
        # binomial updates, or one Rademacher update, are flushed in registers as they are read
        # and stored; special values in every group of such tiles, and a partial tile after them,
        # against the reference.
        tiny = np.float32(jnp.finfo(jnp.float32).tiny)
        specials = np.concatenate(
            [
                np.array([0.0, -0.0, np.inf, -np.inf, tiny, -tiny, tiny / 4, -tiny / 8, 3.0e38, -3.0e38], np.float32),
                NAN_PAYLOADS,
            ]
        )
        r = np.random.default_rng(n_updates)
        x = (r.standard_normal(3 * 4096 + 100) * tiny * 4).astype(np.float32)  # some become subnormal
        for start in range(0, x.size - specials.size, 61):
            x[start : start + specials.size] = specials
        x = jnp.asarray(x)
        keys = _leaf_keys(n_updates, seed=9)
        # 2**-118 is near the smallest coefficient the host rounding keeps: a subnormal input that
        # were not flushed on load would change such a sum
        scales = replay.update_scales(dist, [2.0**-118 * 3, -2.5, -(2.0**-118) * 5, 8.0][:n_updates])
        want = numpy_perturb(x, keys, scales, dist)
        f = jax.jit(
            lambda x: kp.perturb_native(x, keys, scales, distribution=dist, inplace=inplace),
            donate_argnums=0 if inplace else (),
        )
        assert_same_bits(f(jnp.copy(x)), want)

    def test_nan_payloads_become_canonical(self):
        x = jnp.asarray(NAN_PAYLOADS)
        keys, scales = _leaf_keys(1), _scales("binomial", 1)
        got = np.asarray(kp.perturb_native(x, keys, scales, distribution="binomial"))
        np.testing.assert_array_equal(got.view(np.uint32), np.full(4, 0x7FC00000, np.uint32))

    def test_portable_build_gives_the_same_bits(self):
        # The same source compiled for the x86-64 baseline (no AVX-512, no popcount instructions).
        x = _array((5000,), jnp.bfloat16, seed=8)
        for dist in DISTS:
            keys, scales = _leaf_keys(3, seed=8), _scales(dist, 3, seed=8)
            a = kp.perturb_native(x, keys, scales, distribution=dist)
            b = kp.perturb_native(x, keys, scales, distribution=dist, build=cpu_native.PORTABLE_BUILD)
            assert_same_bits(a, b)

    @pytest.mark.slow
    @pytest.mark.parametrize("march", ["x86-64-v3", "x86-64-v4"])
    def test_other_instruction_sets_give_the_same_bits(self, march):
        # AVX2 (its own paths: threefry 8 calls per register, popcounts by a nibble table, signs by
        # variable shifts) and AVX-512 without BITALG (popcount by shifts), where this CPU can run
        # them; the default build is the native one.
        if missing := cpu_native.missing_instructions(march):
            pytest.skip(f"this CPU lacks {missing} for -march={march}")
        _agrees_with_the_specification(cpu_native.build_for(march))

    @pytest.mark.slow
    @pytest.mark.parametrize("march", ["native", "x86-64-v3", "x86-64"])
    def test_the_kernels_own_flushes_give_the_bits_without_the_runtimes_flush_to_zero(self, march):
        # XLA's CPU runtime runs the kernel with flush-to-zero and denormals-are-zero on, which makes
        # the same bits as the contract's flush whether or not the kernel flushes: a build whose work
        # runs with both modes off shows that its own flushes do it, on each of its paths (AVX-512
        # where the CPU has it, AVX2, plain loops).
        # (the floating-point modes are x86's MXCSR: another architecture lacks x86-64 itself)
        if missing := cpu_native.missing_instructions("x86-64" if march == "native" else march):
            pytest.skip(f"this CPU lacks {missing} for -march={march}")
        build = cpu_native.BuildConfig(
            name=f"gradual_{march.replace('-', '_')}", march=march, extra_flags=("-DZEROTH_GRADUAL_UNDERFLOW",)
        )
        assert ctypes.CDLL(str(cpu_native.build(build))).ZerothPerturbGradualUnderflow() == 1
        assert ctypes.CDLL(str(cpu_native.build(cpu_native.DEFAULT_BUILD))).ZerothPerturbGradualUnderflow() == 0
        _agrees_with_the_specification(build)

    def test_each_build_reports_the_path_it_was_compiled_with(self, monkeypatch):
        flags = set(cpu_native._cpu_fingerprint().split())
        if {"avx512f", "avx512bw", "avx512dq"} <= flags:
            native = "avx512"
        else:
            native = "avx2" if "avx2" in flags else "portable"
        assert cpu_native.kernel_path() == native
        if platform.machine() in ("x86_64", "AMD64"):
            assert cpu_native.kernel_path(cpu_native.PORTABLE_BUILD) == "portable"
        for march, path in (("x86-64-v3", "avx2"), ("x86-64-v4", "avx512")):
            if not cpu_native.missing_instructions(march):
                assert cpu_native.kernel_path(cpu_native.build_for(march)) == path
        monkeypatch.setenv("ZEROTH_NATIVE", "0")
        assert cpu_native.kernel_path() is None

    def test_an_instruction_set_the_cpu_lacks_is_refused_by_name(self, monkeypatch):
        monkeypatch.setattr(cpu_native.platform, "machine", lambda: "x86_64")
        monkeypatch.setattr(cpu_native, "_cpu_fingerprint", lambda: "x86_64 Linux avx fpu sse sse2")
        assert cpu_native.missing_instructions("x86-64") == []
        assert cpu_native.build_for("x86-64") is cpu_native.PORTABLE_BUILD
        with pytest.raises(
            ValueError, match=r"-march=x86-64-v3: it lacks abm, avx2, bmi1, bmi2, f16c, fma, movbe, xsave"
        ):
            cpu_native.build_for("x86-64-v3")
        with pytest.raises(ValueError, match=r"unknown instruction set 'skylake'; expected one of \['x86-64-v4'"):
            cpu_native.build_for("skylake")
        monkeypatch.setattr(cpu_native.platform, "machine", lambda: "aarch64")
        assert cpu_native.missing_instructions("x86-64") == ["x86-64 (this is aarch64)"]

    def test_donated_replay_in_place(self):
        params = {"w": _array((50, 40), jnp.float32, seed=9), "v": _array((7,), jnp.float16, seed=10)}
        keys = rng.sample_keys(2, [(0, 3, s) for s in range(16)])
        scales = replay.update_scales("rademacher", list(np.linspace(-1, 1, 16)))
        want = replay.apply_updates(params, keys, scales, distribution="rademacher")
        copy = jax.tree_util.tree_map(jnp.copy, params)
        got = kp.fused_apply_updates(copy, keys, scales, distribution="rademacher", donate=True, impl="native")
        assert copy["w"].is_deleted()
        assert replay.checksum(got) == replay.checksum(want)
        again = kp.fused_apply_updates(params, keys, scales, distribution="rademacher", impl="native")
        assert not params["w"].is_deleted()
        assert replay.checksum(again) == replay.checksum(want)

    def test_traced_keys_under_jit(self):
        params = {"layer": {"kernel": _array((33, 3), jnp.float32, seed=11)}}
        keys = rng.sample_keys(4, [(0, 0, s) for s in range(3)])
        scales = replay.update_scales("binomial", [0.5, -0.5, 0.25])
        f = jax.jit(lambda p, k, s: kp.apply_updates(p, k, s, distribution="binomial", impl="native"))
        want = replay.apply_updates(params, keys, scales, distribution="binomial")
        assert replay.checksum(f(params, keys, scales)) == replay.checksum(want)

    def test_a_launch_per_leaf_gives_the_bits_of_one_launch(self):
        """``per_leaf=True`` (how the ZO estimator perturbs) launches the kernel once per leaf: the
        leaf keys are still derived inside it from each leaf's id, so the bits are the tree launch's."""
        params = {
            "a": _array((4099,), jnp.float32, seed=21),
            "b": {"c": _array((5, 9), jnp.bfloat16, seed=22)},
            "d": _array((130,), jnp.float16, seed=23),
        }
        keys = rng.sample_keys(8, [(1, 0, s) for s in range(2)])
        for dist in DISTS:
            scales = replay.update_scales(dist, [0.25, -0.125])
            want = replay.apply_updates(params, keys, scales, distribution=dist)
            for per_leaf in (False, True):
                f = jax.jit(
                    lambda p, k, s, per_leaf=per_leaf, dist=dist: kp.apply_updates(
                        p, k, s, distribution=dist, impl="native", per_leaf=per_leaf
                    )
                )
                assert f.lower(params, keys, scales).as_text().count("stablehlo.custom_call") == (3 if per_leaf else 1)
                assert replay.checksum(f(params, keys, scales)) == replay.checksum(want), (dist, per_leaf)


def test_leaf_keys_derived_by_the_caller_give_the_same_update():
    """apply_updates(..., leaf_keys=) with each leaf's keys derived outside (as a ZO estimator
    derives those of all its evaluations before its loop) gives the bits of deriving them inside,
    with the jnp rule whole or leaf by leaf; a table of the wrong shape is refused."""
    params = {"a": _array((33, 5), jnp.float32, seed=21), "b": {"c": _array((70,), jnp.bfloat16, seed=22)}}
    keys = rng.sample_keys(3, [(0, 4, s) for s in range(2)])
    paths = [rng.leaf_path(p) for p, _ in jax.tree_util.tree_flatten_with_path(params)[0]]
    table = kp.leaf_key_table(keys, [rng.leaf_id(p) for p in paths])
    assert np.array_equal(table[1], kp.leaf_keys(keys, rng.leaf_id(paths[1])))
    for dist in DISTS:
        scales = replay.update_scales(dist, [0.5, -0.25])
        want = replay.checksum(replay.apply_updates(params, keys, scales, distribution=dist))
        for per_leaf in (False, True):
            f = jax.jit(
                lambda p, k, s, t, dist=dist, per_leaf=per_leaf: kp.apply_updates(
                    p, k, s, distribution=dist, impl="jnp", per_leaf=per_leaf, leaf_keys=t
                )
            )
            assert replay.checksum(f(params, keys, scales, table)) == want, (dist, per_leaf)
            # and they are what it uses: the table of other keys gives other bits
            assert replay.checksum(f(params, keys, scales, table[:, ::-1])) != want, (dist, per_leaf)
    with pytest.raises(ValueError, match=r"leaf_keys must be u32\[L, K, 2\] = \[2, 2, 2\] .* got shape \[1, 2, 2\]"):
        kp.apply_updates(params, keys, scales, impl="jnp", leaf_keys=table[:1])


# --------------------------------------------------------------------------- dispatch and errors


def test_fused_apply_updates_auto_matches_replay():
    params = {"a": _array((10, 10), jnp.float32, seed=12), "b": _array((), jnp.bfloat16, seed=13)}
    keys = rng.sample_keys(6, [(1, 1, s) for s in range(4)])
    coeffs = [1.0, -0.125, 0.3, 7.0]
    for dist in DISTS:
        got = kp.fused_apply_updates(params, keys, replay.update_scales(dist, coeffs), distribution=dist)
        want = replay.replay(params, (keys, np.array(coeffs)), distribution=dist)
        assert replay.checksum(got) == replay.checksum(want)


def test_sharded_params_keep_their_sharding():
    devices = rule.default_devices()  # the host CPU's four beside a GPU, not the GPU's one
    if len(devices) < 2:
        pytest.skip("needs several devices (tests/conftest.py forces 4 CPU devices)")
    mesh = jax.sharding.Mesh(np.array(devices), ("d",))
    sharding = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("d", None))
    params = {"w": jax.device_put(_array((8 * len(devices), 33), jnp.float32, seed=16), sharding)}
    keys = rng.sample_keys(8, [(0, 1, s) for s in range(3)])
    scales = replay.update_scales("binomial", [0.5, 0.25, -1.0])
    got = kp.fused_apply_updates(params, keys, scales, distribution="binomial")
    assert got["w"].sharding.is_equivalent_to(sharding, 2)
    assert replay.checksum(got) == replay.checksum(replay.apply_updates(params, keys, scales, distribution="binomial"))


def test_auto_on_cpu_is_native_or_jnp(monkeypatch):
    assert kp.resolve_impl("auto", "cpu") == ("native" if NATIVE else "jnp")
    assert (cpu_native.unavailable_reason() is None) == NATIVE
    monkeypatch.setenv("ZEROTH_NATIVE", "0")
    assert kp.resolve_impl("auto", "cpu") == "jnp"
    assert cpu_native.unavailable_reason() == "ZEROTH_NATIVE=0 disables the native CPU kernel"


def test_failed_build_warns_once_and_falls_back(monkeypatch, tmp_path):
    monkeypatch.setenv("ZEROTH_NATIVE", "1")  # a build is tried, whatever the environment says
    monkeypatch.setenv("ZEROTH_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(cpu_native, "_warned", False)
    broken = cpu_native.BuildConfig(name="broken_for_test", extra_flags=("-include", str(tmp_path / "missing.h")))
    with pytest.warns(cpu_native.NativeKernelWarning, match="plain XLA path"):
        assert cpu_native.available(broken) is False
    assert cpu_native.available(broken) is False  # remembered, no second build
    reason = cpu_native.unavailable_reason(broken)
    assert reason.startswith("the native CPU kernel cannot be built:") and "missing.h" in reason, reason
    with pytest.raises(RuntimeError, match="failed"):
        cpu_native.build(broken)
    assert not list(tmp_path.rglob("*.so"))


@pytest.mark.parametrize(
    "kwargs,error,match",
    [
        ({"distribution": "gaussian"}, ValueError, "backend-dependent"),
        ({"distribution": "uniform"}, ValueError, "unknown noise distribution"),
        ({"impl": "cuda"}, ValueError, "unknown impl"),
    ],
)
def test_bad_arguments(kwargs, error, match):
    keys, scales = _leaf_keys(1), _scales("binomial", 1)
    with pytest.raises(error, match=match):
        kp.perturb_leaf(jnp.zeros(4), keys, scales, **kwargs)


def test_bad_shapes_and_dtypes():
    keys, scales = _leaf_keys(2), _scales("binomial", 2)
    with pytest.raises(TypeError, match="int32"):
        kp.perturb_leaf(jnp.zeros(4, jnp.int32), keys, scales, impl="jnp")
    with pytest.raises(ValueError, match=r"u32\[K, 2\]"):
        kp.perturb_leaf(jnp.zeros(4), keys.reshape(-1), scales, impl="jnp")
    with pytest.raises(ValueError, match="scales must be f32"):
        kp.perturb_leaf(jnp.zeros(4), keys, scales[:1], impl="jnp")
    with pytest.raises(ValueError, match="offset"):
        kp.perturb_leaf(jnp.zeros(4), keys, scales, offset=-1, impl="jnp")
    with pytest.raises(ValueError, match="float32"):
        kp.fused_apply_updates({"w": jnp.zeros(3)}, rng.sample_keys(0, [(0, 0, 0)]), np.array([0.5]))
    if jax.default_backend() == "cpu":
        with pytest.raises(ValueError, match="interpret mode"):
            kp.perturb_leaf(jnp.zeros(4), keys, scales, impl="pallas")
    with pytest.raises(ValueError, match="multiple of 64"):
        kp.BlockSizes(tile=100, lanes=None)
    with pytest.raises(ValueError, match="multiple of lanes"):
        kp.BlockSizes(tile=100, lanes=64)


# --------------------------------------------------------------------------- whole tiles only

# Hardware conversions disagree on NaN: NVIDIA's f32 -> bf16 / f16 give 0x7fff, x86 and NumPy
# 0x7fc0 / 0x7e00. These are fed straight to the cast-and-canonicalise step.
NVIDIA_NAN_CASES = [
    (jnp.bfloat16, [0x7FFF, 0xFFFF, 0x7F81, 0xFFC1, 0x0001, 0x8000, 0x7F80, 0x3F80], 0x7FC0),
    (jnp.float16, [0x7FFF, 0xFFFF, 0x7C01, 0xFE01, 0x0001, 0x8000, 0x7C00, 0x3C00], 0x7E00),
    (
        jnp.float32,
        [0x7FFFFFFF, 0xFFFFFFFF, 0x7F800001, 0xFFC00001, 0x1, 0x80000000, 0x7F800000, 0x3F800000],
        0x7FC00000,
    ),
]


def _from_bits(bits, dtype) -> np.ndarray:
    dt = jnp.dtype(dtype)
    return np.array(bits, np.dtype(f"u{dt.itemsize}")).view(dt)


@pytest.mark.parametrize("dtype,bits,nan", NVIDIA_NAN_CASES)
def test_any_nan_a_conversion_produces_becomes_canonical(dtype, bits, nan):
    x = _from_bits(bits, dtype)
    inf, one = bits[6], bits[7]
    want = [nan, nan, nan, nan, 0, 0, inf, one]
    np.testing.assert_array_equal(_bits(ref.canonicalize(x)), want)
    np.testing.assert_array_equal(_bits(rule.canonicalize(jnp.asarray(x))), want)
    np.testing.assert_array_equal(_bits(jax.jit(rule.canonicalize)(jnp.asarray(x))), want)

    def kernel(x_ref, o_ref):  # the step the Pallas replay ends with, inside a kernel
        o_ref[...] = rule.canonicalize(x_ref[...])

    x2 = jnp.asarray(np.tile(x, 16).reshape(8, 16))
    from jax.experimental import pallas as pl

    got = pl.pallas_call(kernel, out_shape=jax.ShapeDtypeStruct(x2.shape, x2.dtype), interpret=True)(x2)
    np.testing.assert_array_equal(_bits(got), np.tile(want, 16))


@pytest.mark.parametrize("dtype,bits,nan", NVIDIA_NAN_CASES)
def test_flush_cast_canonicalises_after_the_cast(dtype, bits, nan, monkeypatch):
    """A backend whose float32 -> 16-bit conversion yields 0x7fff (NVIDIA's) still stores the
    canonical NaN: the cast is followed by canonicalisation by bit pattern, in every path."""
    dt = jnp.dtype(dtype)
    real_convert = rule._convert

    def nvidia_convert(x32, new_dtype):
        out = real_convert(x32, new_dtype)
        if jnp.dtype(new_dtype).itemsize == 2:  # NVIDIA's cvt gives 0x7fff for any NaN
            u = jnp.where(jnp.isnan(out), jnp.uint16(0x7FFF), jax.lax.bitcast_convert_type(out, jnp.uint16))
            out = jax.lax.bitcast_convert_type(u, new_dtype)
        return out

    monkeypatch.setattr(rule, "_convert", nvidia_convert)
    x32 = jnp.asarray(np.array([np.nan, -np.nan, 1.0, 2.0**-140, -0.0], np.float32))
    if dt.itemsize == 2:
        assert set(_bits(nvidia_convert(x32, dt))[:2].tolist()) == {0x7FFF}  # the simulated hardware
    got = jax.jit(rule.flush_cast, static_argnums=1)(x32, dt)
    np.testing.assert_array_equal(_bits(got)[:2], [nan, nan])
    np.testing.assert_array_equal(_bits(got)[3:], [0, 0])
    assert_same_bits(got, ref.flush_cast(np.asarray(x32), dt))
    # the whole replay of a leaf holding NaNs, through the jnp rule and the Pallas kernel alike
    leaf = jnp.asarray(_from_bits(bits, dtype))
    keys, scales = _leaf_keys(2), _scales("binomial", 2, magnitude=1e-3)
    want = numpy_perturb(np.asarray(leaf), keys, scales, "binomial")
    assert_same_bits(kp.perturb_reference(leaf, keys, scales), want)
    assert_same_bits(
        kp.perturb_pallas(leaf, keys, scales, interpret=True, platform="gpu", block_sizes=kp.BlockSizes(tile=64)), want
    )


class _PallasCallSpy:
    """Records every ``pallas_call`` of the replay kernel: operand shape, block shape and grid."""

    def __init__(self, monkeypatch):
        self.calls = []
        real = kp.pallas.pl.pallas_call

        def spy(kernel, *, out_shape, grid, in_specs, out_specs, **kwargs):
            self.calls.append((tuple(out_shape.shape), tuple(out_specs.block_shape), tuple(grid)))
            return real(kernel, out_shape=out_shape, grid=grid, in_specs=in_specs, out_specs=out_specs, **kwargs)

        monkeypatch.setattr(kp.pallas.pl, "pallas_call", spy)


def _assert_whole_tiles_inside(calls, n):
    for (rows, width), (tile_rows, tile_width), (grid,) in calls:
        assert tile_width == width and tile_rows >= 1 and grid >= 1
        assert grid * tile_rows <= rows, f"block {grid - 1} reaches row {grid * tile_rows} of {rows}"
        assert rows * width <= n, f"the kernel's operand ({rows}x{width}) is larger than the leaf ({n})"


@settings(max_examples=60)
@given(
    n=st.integers(1, 300_000),
    dist=st.sampled_from(DISTS),
    dtype=st.sampled_from(["float32", "bfloat16", "float16"]),
    platform=st.sampled_from(["gpu", "tpu", "cpu"]),
    tile_log2=st.integers(6, 14),
    lanes=st.sampled_from([None, 64, 128, 1024]),
    offset_calls=st.integers(0, 3),
)
def test_no_block_addresses_outside_the_leaf(n, dist, dtype, platform, tile_log2, lanes, offset_calls):
    blocks = kp.BlockSizes(tile=max(1 << tile_log2, lanes or 64), lanes=lanes)
    if platform == "tpu" and (blocks.tile // (lanes or kp.plans._PER_CALL[dist])) % 8:
        with pytest.raises(ValueError, match="multiple of 8"):
            kp.check_block_sizes(blocks, platform, dist)
        return
    offset = offset_calls * 64 + (offset_calls % 2)  # some offsets break the grouped layout
    if platform == "tpu" and dtype == "float16":  # Mosaic has no float16 vectors: refused before any plan
        with pytest.raises(ValueError, match="cannot take float16 arrays"):
            jax.eval_shape(
                lambda x: kp.perturb_pallas(
                    x,
                    _leaf_keys(3),
                    _scales(dist, 3),
                    distribution=dist,
                    block_sizes=blocks,
                    offset=offset,
                    interpret=True,
                    platform=platform,
                ),
                jax.ShapeDtypeStruct((n,), jnp.float16),
            )
        return
    plan = kp.plans.plan_tiles(n, dist, blocks, platform, offset)
    # the plan: whole tiles inside [0, head), head + tail = n, the tail shorter than a tile plus a row
    assert plan.head == plan.tiles * plan.tile_rows * plan.width <= n
    assert plan.tail == n - plan.head >= 0
    if plan.tiles:
        assert plan.tail < plan.tile_rows * plan.width + plan.width
    if platform == "gpu" and plan.tile_rows:
        assert plan.tile_rows & (plan.tile_rows - 1) == 0 and plan.width & (plan.width - 1) == 0
    if platform == "tpu" and plan.tile_rows:
        assert plan.tile_rows % 8 == 0
    # and what the wrapper really asks Pallas for (traced only)
    with pytest.MonkeyPatch.context() as mp:
        spy = _PallasCallSpy(mp)
        jax.eval_shape(
            lambda x: kp.perturb_pallas(
                x,
                _leaf_keys(3),
                _scales(dist, 3),
                distribution=dist,
                block_sizes=blocks,
                offset=offset,
                interpret=True,
                platform=platform,
            ),
            jax.ShapeDtypeStruct((n,), jnp.dtype(dtype)),
        )
    assert len(spy.calls) == (1 if plan.tiles else 0)
    _assert_whole_tiles_inside(spy.calls, n)


@pytest.mark.parametrize("donate", [False, True])
@pytest.mark.parametrize("dist", DISTS)
def test_adjacent_16bit_leaves_with_partial_tiles_match_reference(dist, donate, monkeypatch):
    """The H100 corruption's shape (a bf16 leaf with a partial last tile next to a padded f16 leaf),
    scaled down, through the GPU tiling in interpret mode: every block inside its leaf, every bit
    equal to the reference, with and without donation."""
    params = {
        "embed": _array((41, 77), jnp.float32, seed=1, scale=0.05),
        "w1": _array((96, 257), jnp.bfloat16, seed=2, scale=0.05),  # 24,672: 3 tiles of 8192 and a part
        "w2": _array((99, 101), jnp.float16, seed=3, scale=0.05),  # 9,999: not a whole number of rows
        "b": _array((3,), jnp.float32, seed=4),
    }
    keys = rng.sample_keys(3, [(0, 11, s) for s in range(3)])
    scales = replay.update_scales(dist, [1e-3, -2e-3, 5e-4])
    want = {
        k: numpy_perturb(v, kp.leaf_keys(keys, rng.leaf_id((jax.tree_util.DictKey(k),))), scales, dist)
        for k, v in params.items()
    }
    spy = _PallasCallSpy(monkeypatch)
    fn = jax.jit(
        lambda p, k, s: kp.apply_updates(
            p, k, s, distribution=dist, impl="pallas", interpret=True, platform="gpu", inplace=donate
        ),
        donate_argnums=(0,) if donate else (),
    )
    sizes = {k: v.size for k, v in params.items()}
    got = fn(params, keys, scales)
    for name in params:
        assert_same_bits(got[name], want[name])
    assert spy.calls and all(c[0][0] * c[0][1] <= max(sizes.values()) for c in spy.calls)
    for call in spy.calls:
        _assert_whole_tiles_inside([call], call[0][0] * call[0][1])


@pytest.mark.parametrize(
    "platform,blocks,match",
    [
        ("gpu", kp.BlockSizes(tile=640, lanes=128), "5 rows"),
        ("gpu", kp.BlockSizes(tile=192, lanes=64), "3 rows"),
        ("gpu", kp.BlockSizes(tile=960, lanes=96), "power of two"),
        ("tpu", kp.BlockSizes(tile=512, lanes=128), "multiple of 8"),
        ("cuda", kp.BlockSizes(tile=640, lanes=128), "tile=512"),
    ],
)
def test_block_sizes_are_checked_per_platform(platform, blocks, match):
    with pytest.raises(ValueError, match=match):
        kp.check_block_sizes(blocks, platform)
    with pytest.raises(ValueError, match=match):
        kp.perturb_pallas(
            jnp.zeros(4096),
            _leaf_keys(1),
            _scales("binomial", 1),
            block_sizes=blocks,
            interpret=True,
            platform=platform,
        )
    kp.check_block_sizes(blocks, "cpu")  # interpret mode takes any tiling


# --------------------------------------------------------------------------- dispatch by device


def test_resolve_impl_follows_the_platform(monkeypatch):
    assert kp.resolve_impl("auto", "tpu") == "pallas"
    assert kp.resolve_impl("auto", "cuda", 16) == "pallas"
    assert kp.resolve_impl("auto", "gpu", 1) == "jnp"  # XLA's fused loop is as fast for one update
    monkeypatch.setattr(kp.plans, "_triton_available", lambda: False)
    assert kp.resolve_impl("auto", "gpu", 16) == "jnp"
    with pytest.raises(ValueError, match="impl='native' is the CPU kernel, but the arrays live on gpu"):
        kp.resolve_impl("native", "cuda")


def test_float16_leaves_on_a_tpu_take_the_jnp_rule():
    """Mosaic has no float16 vectors: compiled for a TPU v4, v5e and v6e with libtpu, the kernel on
    a float16 leaf failed ("Invalid vector type for load"), the doctor's replay among them (its
    canonical tree has a float16 leaf). ``auto`` takes float16 leaves on a TPU to the jnp rule,
    ``pallas`` refuses them with a message saying what to do; other dtypes and platforms keep
    their kernels."""
    for dtype in (jnp.float32, jnp.bfloat16):
        assert kp.resolve_impl("auto", "tpu", 1, dtype) == kp.resolve_impl("pallas", "tpu", 1, dtype) == "pallas"
    assert kp.resolve_impl("auto", "tpu", 1, jnp.float16) == "jnp"
    assert kp.resolve_impl("jnp", "tpu", 1, jnp.float16) == "jnp"
    assert kp.resolve_impl("auto", "cuda", 16, jnp.float16) == "pallas"
    with pytest.raises(ValueError, match="cannot take float16 arrays .* use impl=.auto."):
        kp.resolve_impl("pallas", "tpu", 1, jnp.float16)
    keys, scales = _leaf_keys(2), _scales("binomial", 2)
    with pytest.raises(ValueError, match="cannot take float16 arrays"):  # interpret mode is the TPU's too
        kp.perturb_pallas(_array((2048,), jnp.float16), keys, scales, interpret=True, platform="tpu")
    with pytest.raises(ValueError, match="cannot take float16 arrays"):
        kp.perturb_pallas_flat(
            jnp.zeros(2048, jnp.float16), keys[None], scales, ((0, 2048, 1),), interpret=True, platform="tpu"
        )
    with pytest.raises(ValueError, match="cannot take float16 arrays"):
        kp.apply_updates({"w": jnp.zeros(8, jnp.float16)}, keys, scales, impl="pallas", interpret=True, platform="tpu")
    # auto on a TPU: the float16 leaf through the jnp rule, the others through the kernel, all exact
    params = {
        "a": _array((2, 1024), jnp.float16, seed=3),
        "b": _array((2, 1024), jnp.bfloat16, seed=4),
        "c": _array((8, 1024), jnp.float32, seed=5),
    }
    sample = rng.sample_keys(1, [(0, 0, 0), (0, 0, 1)])
    got = kp.apply_updates(params, sample, scales, interpret=True, platform="tpu")
    assert replay.checksum(got) == replay.checksum(replay.apply_updates(params, sample, scales))


def test_cpu_parameters_replay_on_cpu_when_the_default_backend_is_a_gpu(monkeypatch):
    """On a GPU machine, parameters placed on the host CPU replay with the CPU implementation
    (they used to be sent to the Pallas kernel, which cannot run on a CPU device)."""
    cpu = jax.devices("cpu")[0]
    params = {"w": jax.device_put(_array((33, 65), jnp.bfloat16, seed=5), cpu), "b": jax.device_put(jnp.ones(7), cpu)}
    want = replay.checksum(
        replay.apply_updates(
            params, rng.sample_keys(2, [(0, 1, 0), (0, 1, 1)]), replay.update_scales("binomial", [0.25, -0.5])
        )
    )
    assert kp.platform_of(params) == "cpu"
    monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
    with jax.default_device(None):  # none set (tests/conftest.py sets the host CPU's beside a GPU)
        assert kp.platform_of({"np": np.zeros(3, np.float32)}) == "gpu"  # uncommitted: where jit puts it
    assert kp.platform_of(params) == "cpu"
    chosen = []
    real = kp.resolve_impl
    monkeypatch.setattr(kp.plans, "resolve_impl", lambda *a, **k: chosen.append(real(*a, **k)) or chosen[-1])
    got = replay.replay(params, (rng.sample_keys(2, [(0, 1, 0), (0, 1, 1)]), np.array([0.25, -0.5])))
    assert replay.checksum(got) == want
    assert chosen and set(chosen) <= {"native", "jnp"}
    assert got["w"].devices() == {cpu}


def test_a_process_with_several_platforms_chooses_at_lowering(monkeypatch):
    """In a process with a CPU and a GPU, ``apply_updates`` stages one path per platform and the
    lowering keeps the one for the devices the computation runs on: here the CPU's (the native
    kernel, one launch for every leaf), with no Triton call and no conditional left to compile."""
    monkeypatch.setattr(kp.dispatch, "_process_platforms", lambda: ("cpu", "cuda"))
    params = {"w": _array((37, 29), jnp.bfloat16, seed=8), "b": _array((3,), jnp.float32, seed=9)}
    keys = rng.sample_keys(0, [(0, 0, s) for s in range(3)])
    scales = replay.update_scales("binomial", [0.1, -0.2, 0.3])
    lowered = jax.jit(lambda p, k, s: kp.apply_updates(p, k, s, distribution="binomial")).lower(params, keys, scales)
    text, compiled = lowered.as_text(), lowered.compile()
    assert "triton" not in text and "conditional" not in compiled.as_text()
    if NATIVE:
        assert text.count(cpu_native.target_name(tree=True)) == 1  # one launch for both leaves
    got = compiled(params, keys, scales)
    assert replay.checksum(got) == replay.checksum(
        {
            k: numpy_perturb(v, kp.leaf_keys(keys, rng.leaf_id((jax.tree_util.DictKey(k),))), scales, "binomial")
            for k, v in params.items()
        }
    )


@needs_native
@pytest.mark.parametrize("donate", [False, True])
def test_one_native_launch_for_every_leaf(donate):
    """The native tree kernel: every leaf of a replay in one custom call, bit-identical to the
    per-leaf kernel and the reference, including empty and 0-D leaves."""
    params = {
        "a": _array((1000,), jnp.float32, seed=1),
        "b": _array((37, 29), jnp.bfloat16, seed=2),
        "c": _array((), jnp.float16, seed=3),
        "d": jnp.zeros((0, 4), jnp.float32),
        "e": _array((5000,), jnp.float16, seed=4),
    }
    keys = rng.sample_keys(4, [(m, 9, s) for m in range(2) for s in range(3)])
    scales = replay.update_scales("rademacher", [0.5, -0.25, 1e-3, 2.0, -7.0, 1e-30])
    want = {
        k: numpy_perturb(v, kp.leaf_keys(keys, rng.leaf_id((jax.tree_util.DictKey(k),))), scales, "rademacher")
        for k, v in params.items()
    }
    fn = jax.jit(
        lambda p: kp.apply_updates(p, keys, scales, distribution="rademacher", impl="native", inplace=donate),
        donate_argnums=(0,) if donate else (),
    )
    text = fn.lower(params).as_text()
    assert text.count(cpu_native.target_name(tree=True)) == 1 and cpu_native.target_name() + '"' not in text
    got = fn(params)
    for k in want:
        assert_same_bits(got[k], want[k])
    with pytest.raises(ValueError, match="3 leaves but 2 leaf ids"):
        kp.native.perturb_native_tree([jnp.zeros(2)] * 3, keys, scales, [1, 2])


@pytest.mark.parametrize("impl", ["jnp", "pallas"])
def test_leaf_keys_are_derived_once_per_call_for_every_leaf(impl):
    """The jnp rule and the per-leaf Pallas kernels get every leaf's keys from one computation per
    call: the compiled replay of 12 leaves runs an op per leaf and one key derivation (a derivation
    per leaf was an op of its own before each leaf's, on a GPU a launch), with the reference's bits."""
    from zeroth.bench import profile as bench_profile

    params = {f"l{i:02d}": _array((i + 3, 5), jnp.float32, seed=i) for i in range(12)}
    keys = rng.sample_keys(2, [(0, 7, 0)])
    scales = replay.update_scales("binomial", [0.03])
    kwargs = {"interpret": True} if impl == "pallas" else {}
    fn = jax.jit(lambda p, k, s: kp.apply_updates(p, k, s, impl=impl, **kwargs))  # keys known at run time only
    got = fn(params, keys, scales)
    for k, v in params.items():
        assert_same_bits(
            got[k], numpy_perturb(v, kp.leaf_keys(keys, rng.leaf_id((jax.tree_util.DictKey(k),))), scales, "binomial")
        )
    if impl == "jnp":  # the Pallas interpreter runs each kernel as many small ops: count the jnp rule's
        ops = bench_profile.profile(lambda: jax.block_until_ready(fn(params, keys, scales)), calls=2)["ops_per_call"]
        assert ops <= len(params) + 3, f"{ops} ops per call for {len(params)} leaves"
    hlo = fn.lower(params, keys, scales).compile().as_text()
    assert hlo.count("u32[12,1,2]") >= 1, "the 12 leaves' keys are not one array"


# --------------------------------------------------------------------------- slices and rows chosen at run time


SLICE_IMPLS = ("native", "jnp") if NATIVE else ("jnp",)


@settings(max_examples=20, deadline=None)
@given(
    n=st.integers(1, 9000),
    frac=st.tuples(st.floats(0, 1), st.floats(0, 1), st.floats(0, 1)),
    n_updates=st.integers(1, 3),
    dist=st.sampled_from(DISTS),
    dtype=st.sampled_from([jnp.float32, jnp.bfloat16, jnp.float16]),
    impl=st.sampled_from(SLICE_IMPLS),
    seed=st.integers(0, 2**32 - 1),
)
def test_a_slice_with_a_run_time_start_has_the_whole_leafs_bits(n, frac, n_updates, dist, dtype, impl, seed):
    """perturb_slice at a traced start (any, odd included) and any size gives exactly those elements
    of the whole leaf's update, for every dtype, distribution and implementation."""
    m = max(1, int(frac[0] * n))
    starts = sorted({int(frac[1] * (n - m)), int(frac[2] * (n - m))})
    x = _array((n,), dtype, seed=seed % 1000)
    keys, scales = _leaf_keys(n_updates, seed=seed), _scales(dist, n_updates, seed=seed)
    want = numpy_perturb(x, keys, scales, dist)
    f = jax.jit(lambda x, s: kp.slices.perturb_slice(x, keys, scales, s, (m,), distribution=dist, impl=impl))
    for s in starts:
        assert_same_bits(f(x, jnp.uint32(s)), want[s : s + m])


@pytest.mark.parametrize("impl", SLICE_IMPLS)
def test_layers_of_a_stacked_leaf_inside_a_scan(impl):
    """Layer i of a stacked [L, a, b] leaf, built inside a scan body at start i * a * b, is layer i
    of the whole leaf's update (the ZO estimator's in-scan path)."""
    x = _array((5, 7, 13), jnp.bfloat16, seed=3)
    keys, scales = _leaf_keys(1, seed=5), _scales("binomial", 1, seed=5)
    want = numpy_perturb(x, keys, scales, "binomial")

    def body(c, i):
        return c, kp.slices.perturb_slice(
            x, keys, scales, i.astype(jnp.uint32) * 91, (7, 13), distribution="binomial", impl=impl
        )

    got = jax.jit(lambda: jax.lax.scan(body, 0, jnp.arange(5))[1])()
    assert_same_bits(got, want)


@pytest.mark.parametrize("impl", SLICE_IMPLS)
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_a_slice_of_a_leaf_inside_a_buffer_has_the_leafs_bits(impl, dtype):
    """With base and size, perturb_slice reads layer i of a stacked leaf lying in a flat buffer
    (elements [base, base + size)), inside a scan over the layers, with the noise of the leaf's own
    indices: the layers of the whole leaf's update, whatever lies around it."""
    x = _array((5, 7, 13), dtype, seed=3)
    buffer = jnp.concatenate([_array((29,), dtype, seed=4), x.reshape(-1), _array((17,), dtype, seed=5)])
    keys, scales = _leaf_keys(2, seed=6), _scales("binomial", 2, seed=6)
    want = numpy_perturb(x, keys, scales, "binomial")

    def body(c, i):
        return c, kp.slices.perturb_slice(
            buffer,
            keys,
            scales,
            i.astype(jnp.uint32) * 91,
            (7, 13),
            distribution="binomial",
            impl=impl,
            base=29,
            size=x.size,
        )

    assert_same_bits(jax.jit(lambda: jax.lax.scan(body, 0, jnp.arange(5))[1])(), want)
    # a run-time start whose slice ends past the leaf (370 + 91 > 455) but inside the buffer: never
    # the 17 elements that follow the leaf
    late = jax.jit(lambda s: kp.slices.perturb_slice(buffer, keys, scales, s, (7, 13), impl=impl, base=29, size=x.size))
    if impl == "native":
        with pytest.raises(Exception, match="leaves the leaf"):
            jax.block_until_ready(late(jnp.uint32(370)))
    else:  # clamped to the leaf's last layer, data and noise, as a dynamic slice clamps
        assert_same_bits(late(jnp.uint32(370)), want[4])
    with pytest.raises(ValueError, match="a leaf of 455 elements from element 29 leaves x of 469 elements"):
        kp.slices.perturb_slice(buffer[:-32], keys, scales, 0, (7, 13), impl=impl, base=29, size=x.size)
    with pytest.raises(ValueError, match="slice start 400 \\+ 91 elements leaves the leaf of 455"):
        kp.slices.perturb_slice(buffer, keys, scales, 400, (7, 13), impl=impl, base=29, size=x.size)
    with pytest.raises(ValueError, match="base must be a non-negative int"):
        kp.slices.perturb_slice(buffer, keys, scales, 0, (7, 13), impl=impl, base=-1)


@needs_native
def test_native_slice_outside_the_leaf_is_refused():
    x = _array((10, 4), jnp.float32)
    keys, scales = _leaf_keys(1), _scales("binomial", 1)
    with pytest.raises(ValueError, match="slice start 38 \\+ 4 elements leaves the leaf of 40"):
        kp.slices.perturb_native_slice(x, keys, scales, 38, (4,))
    f = jax.jit(lambda s: kp.slices.perturb_native_slice(x, keys, scales, s, (4,)))
    with pytest.raises(Exception, match="leaves the leaf"):
        jax.block_until_ready(f(jnp.uint32(37)))
    with pytest.raises(ValueError, match="a run-time offset must be a u32"):
        kp.perturb_reference(x, keys, scales, offset=jnp.int32(3))


@pytest.mark.parametrize("dist", DISTS)
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16, jnp.float16])
def test_rows_of_an_updated_table(dist, dtype):
    """perturb_rows gathers rows of the whole table's update (repeated ids, any order), and only those."""
    table = _array((37, 3, 5), dtype, seed=8)
    keys, scales = _leaf_keys(2, seed=9), _scales(dist, 2, seed=9)
    ids = np.array([[0, 36, 5], [5, 1, 2]], np.int32)
    got = jax.jit(lambda t, i: kp.slices.perturb_rows(t, keys, scales, i, distribution=dist))(table, ids)
    assert_same_bits(got, numpy_perturb(table, keys, scales, dist)[ids])
    with pytest.raises(ValueError, match="row ids must be integers"):
        kp.slices.perturb_rows(table, keys, scales, jnp.zeros(2), distribution=dist)


# Bit patterns of every class the flushes treat apart: ±0, ±inf, NaNs (quiet and signalling, both
# signs, with payloads), subnormals, the smallest normals, one and the largest finite value.
SPECIAL_BITS = {
    jnp.float32: [
        0x00000000,
        0x80000000,
        0x7F800000,
        0xFF800000,
        0x7FC00000,
        0xFFC00001,
        0x7F800001,
        0xFF812345,
        0x00000001,
        0x807FFFFF,
        0x00800000,
        0x80800000,
        0x3F800000,
        0x7F7FFFFF,
    ],
    jnp.bfloat16: [
        0x0000,
        0x8000,
        0x7F80,
        0xFF80,
        0x7FC0,
        0xFFC1,
        0x7F81,
        0xFF92,
        0x0001,
        0x807F,
        0x0080,
        0x8080,
        0x3F80,
        0x7F7F,
    ],
    jnp.float16: [
        0x0000,
        0x8000,
        0x7C00,
        0xFC00,
        0x7E00,
        0xFE01,
        0x7C01,
        0xFD23,
        0x0001,
        0x83FF,
        0x0400,
        0x8400,
        0x3C00,
        0x7BFF,
    ],
}


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16, jnp.float16])
@pytest.mark.parametrize("n_updates", [0, 1, 3])
def test_flushing_in_halves_gives_the_specifications_bits(dtype, n_updates):
    """The kernels flush zeros after the load and after each update and NaNs once, at the store
    (zeroth.rule.cast_flushed); the NumPy specification flushes both at every step. Every special
    value, and results pushed into the subnormal range, must come out with the same bits: the jnp
    rule, the Pallas tile kernel (GPU tiling), the flat kernel (TPU blocks) and table rows."""
    utype = np.uint32 if dtype == jnp.float32 else np.uint16
    specials = np.asarray(SPECIAL_BITS[dtype], utype).view(jnp.dtype(dtype))
    tiny = np.float32(jnp.finfo(dtype).tiny)
    near = (tiny * np.arange(-40, 40, dtype=np.float32)).astype(jnp.dtype(dtype))
    host = np.tile(np.concatenate([specials, near]), 12)[: 1024 + 37]  # whole tiles and a ragged tail
    x = jnp.asarray(host)
    keys = _leaf_keys(n_updates, seed=3)
    small = max(float(tiny), 2.0**-118)  # results in and near the subnormal range, flushed each update
    scales = replay.update_scales("binomial", [small * 3, -small * 5, 2.5][:n_updates])
    want = numpy_perturb(host, keys, scales, "binomial")
    assert_same_bits(kp.perturb_reference(x, keys, scales), want)
    if n_updates != 1:  # the kernels' chain: no updates (load, store) and several
        assert_same_bits(
            kp.perturb_pallas(x, keys, scales, interpret=True, platform="gpu", block_sizes=kp.BlockSizes(tile=256)),
            want,
        )
        # two segments with the same leaf keys, in a buffer padded to whole TPU blocks (Mosaic
        # has no float16: that one takes the GPU's flat kernel)
        platform = "gpu" if dtype == jnp.float16 else "tpu"
        buffer = jnp.pad(x, (0, kp.plans.tpu_flat_size(host.size) - host.size))
        segments = ((0, 500, 7), (500, host.size - 500, 8))
        got = kp.perturb_pallas_flat(
            buffer,
            jnp.asarray(np.stack([keys, keys])),
            jnp.asarray(scales),
            segments,
            interpret=True,
            platform=platform,
        )
        assert_same_bits(
            got[: host.size], np.concatenate([want[:500], numpy_perturb(host[500:], keys, scales, "binomial")])
        )
    ids = np.array([0, 3, 5, 41, 7], np.int32)
    table = x[: 80 * 3].reshape(80, 3)
    assert_same_bits(
        kp.slices.perturb_rows(table, keys, scales, ids),
        numpy_perturb(host[:240].reshape(80, 3), keys, scales, "binomial")[ids],
    )
