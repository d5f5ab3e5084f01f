"""Fused replay kernels: Pallas (interpret mode on CPU), native CPU and jnp give the bits of the
NumPy reference, for every tiling, offset, dtype and thread split."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from zeroth import reference as ref
from zeroth import replay, rng
from zeroth.kernels import cpu_native
from zeroth.kernels import perturb as kp
from lowering_util import lowered_kernels, tpu_chip_info  # noqa: F401 (a fixture)

DISTS = ("binomial", "rademacher")
NATIVE = cpu_native.available()
needs_native = pytest.mark.skipif(not NATIVE, reason="no C++ compiler: the native CPU kernel cannot be built")
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
    ("binomial", jnp.bfloat16, (37, 29), kp.BlockSizes(tile=128, lanes=32)),
    ("binomial", jnp.float32, (5,), kp.BlockSizes(tile=64, lanes=None)),
    ("binomial", jnp.bfloat16, (), kp.BlockSizes(tile=64, lanes=None)),
    ("rademacher", jnp.float32, (13, 77), kp.BlockSizes(tile=512, lanes=None)),
    ("rademacher", jnp.bfloat16, (333,), kp.BlockSizes(tile=192, lanes=64)),
    ("rademacher", jnp.float16, (2, 3, 50), kp.BlockSizes(tile=128, lanes=None)),
]


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
            for b in (kp.BlockSizes(tile=1024, lanes=None), kp.BlockSizes(tile=640, lanes=128))
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

    @pytest.mark.parametrize("n_updates", [0, 1, 8])
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

    def test_nan_payloads_become_canonical(self):
        payloads = np.array([0x7FC00001, 0xFFC00000, 0x7F800001, 0xFF812345], np.uint32).view(np.float32)
        x = jnp.asarray(payloads)
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
    @pytest.mark.parametrize("march", ["x86-64-v3", "skylake-avx512"])
    def test_other_instruction_sets_give_the_same_bits(self, march):
        # AVX2 (the portable loops) and AVX-512 without BITALG (popcount by shifts), where this
        # CPU can run them; the default build is the native one.
        needed = {"x86-64-v3": {"avx2", "bmi2"}, "skylake-avx512": {"avx512f", "avx512bw", "avx512dq"}}[march]
        flags = cpu_native._cpu_fingerprint().split()
        if not needed <= set(flags):
            pytest.skip(f"this CPU lacks {sorted(needed - set(flags))} for -march={march}")
        build = cpu_native.BuildConfig(name=march.replace("-", "_"), march=march)
        x = _array((9000,), jnp.float16, seed=15)
        for dist in DISTS:
            keys, scales = _leaf_keys(3, seed=15), _scales(dist, 3, seed=15)
            a = kp.perturb_native(x, keys, scales, distribution=dist, build=build)
            assert_same_bits(a, numpy_perturb(x, keys, scales, dist))

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
    devices = jax.devices()
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
    if jax.default_backend() == "cpu":
        assert kp.resolve_impl("auto") == ("native" if NATIVE else "jnp")
        monkeypatch.setenv("ZEROTH_NATIVE", "0")
        assert kp.resolve_impl("auto") == "jnp"
    else:
        assert kp.resolve_impl("auto") == "pallas"


def test_failed_build_warns_once_and_falls_back(monkeypatch, tmp_path):
    monkeypatch.setenv("ZEROTH_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(cpu_native, "_warned", False)
    broken = cpu_native.BuildConfig(name="broken_for_test", extra_flags=("-include", str(tmp_path / "missing.h")))
    with pytest.warns(cpu_native.NativeKernelWarning, match="plain XLA path"):
        assert cpu_native.available(broken) is False
    assert cpu_native.available(broken) is False  # remembered, no second build
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
