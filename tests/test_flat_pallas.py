"""The flat Pallas replay: every segment of a flat buffer in ONE ``pallas_call`` (one Triton kernel
on GPU, one Mosaic kernel on TPU), whatever the number of leaves, with the bits of the NumPy
reference leaf by leaf. Runs in interpret mode on CPU (TPU interpret mode for the TPU kernel); the
GPU and TPU lowerings are checked by exporting for those platforms."""

import functools
import json

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from zeroth import doctor, replay, rng, rule
from zeroth import reference as ref
from zeroth.kernels import perturb as kp
from lowering_util import kernel_launches, tpu_chip_info  # noqa: F401 (a fixture)

# NaN payloads (any sign, signalling or quiet), subnormals, -0 and infinities in each dtype's bits.
SPECIAL_BITS = {
    np.dtype(np.float32): [0x7F800001, 0xFFC00001, 0x7FFFFFFF, 0x00000001, 0x807FFFFF, 0x80000000, 0x7F800000],
    np.dtype(ml_dtypes.bfloat16): [0x7FFF, 0xFFC1, 0x7F81, 0x0001, 0x807F, 0x8000, 0xFF80],
    np.dtype(np.float16): [0x7FFF, 0xFC01, 0x7E00, 0x0001, 0x83FF, 0x8000, 0x7C00],
}


def _bits(a) -> np.ndarray:
    a = np.asarray(a)
    return a.reshape(-1).view(np.dtype(f"u{a.dtype.itemsize}"))


def _leaf(seed: int, shape, dtype) -> np.ndarray:
    """Values of every magnitude, the dtype's special bit patterns spread over the leaf."""
    g = np.random.default_rng(seed)
    n = int(np.prod(shape))
    x = (g.standard_normal(n) * np.ldexp(1.0, g.integers(-30, 4, n))).astype(np.float32).astype(dtype)
    special = np.asarray(SPECIAL_BITS[np.dtype(dtype)], np.dtype(f"u{np.dtype(dtype).itemsize}")).view(dtype)
    where = g.choice(n, size=min(n, len(special)), replace=False)
    x[where] = special[: len(where)]
    return x.reshape(shape)


def _tree(seed: int) -> dict:
    """Leaves of odd sizes in three dtypes, interleaved: each buffer holds segments that start
    anywhere and end in partial tiles."""
    shapes = [(37, 29), (5,), (3, 67), (129,), (1,), (2, 3, 50), (7, 11), (300,), (61,)]
    dtypes = [np.float32, ml_dtypes.bfloat16, np.float16]
    return {f"l{i}": _leaf(seed + i, s, dtypes[i % 3]) for i, s in enumerate(shapes)}


def _reference(tree, updates, dist):
    with_path, treedef = jax.tree_util.tree_flatten_with_path(tree)
    return jax.tree_util.tree_unflatten(
        treedef, [ref.replay_leaf(np.asarray(x), rng.leaf_path(p), updates, dist) for p, x in with_path]
    )


@functools.cache
def _flat_fn(layout, dist, donate, platform, blocks):
    """The jitted one-launch-per-buffer replay in interpret mode (keys and scales are arguments)."""
    tables = layout.tables()
    return jax.jit(
        lambda bufs, keys, scales: kp.apply_updates_flat(
            bufs,
            keys,
            scales,
            tables,
            distribution=dist,
            impl="pallas",
            interpret=True,
            inplace=donate,
            platform=platform,
            block_sizes=blocks,
        ),
        donate_argnums=(0,) if donate else (),
    )


def _flat_replay(flat, keys, scales, dist, *, donate, platform, block_sizes):
    fn = _flat_fn(flat.layout, dist, donate, platform, block_sizes)
    return replay.Flat(fn(flat.buffers, jnp.asarray(keys, jnp.uint32).reshape(-1, 2), jnp.asarray(scales)), flat.layout)


@pytest.mark.parametrize(
    "dist,k,donate,platform,blocks",
    [
        # (grouped rows, one threefry call each, K = 16: the golden test below)
        ("binomial", 3, False, "gpu", kp.BlockSizes(tile=256, lanes=32)),  # per-element counters
        ("rademacher", 1, True, "cpu", kp.BlockSizes(tile=192, lanes=64)),  # 3 rows: interpret takes any tiling
        ("binomial", 0, True, "gpu", None),  # no update: the flush and cast alone; GPU default tiles
    ],
)
def test_one_launch_replay_is_the_reference_bit_for_bit(dist, k, donate, platform, blocks):
    tree = _tree(k)
    updates = [
        (rng.sample_key(7, m, 2, s), float(c))
        for s, (m, c) in enumerate(zip(range(k), np.random.default_rng(k).standard_normal(k) * 1e-2))
    ]
    keys = np.stack([u for u, _ in updates]) if k else np.zeros((0, 2), np.uint32)
    scales = replay.update_scales(dist, [c for _, c in updates])
    flat = replay.flatten(tree)
    want = _reference(tree, updates, dist)
    got = _flat_replay(flat, keys, scales, dist, donate=donate, platform=platform, block_sizes=blocks)
    for (path, a), b in zip(
        jax.tree_util.tree_leaves_with_path(replay.unflatten(got)), jax.tree_util.tree_leaves(want), strict=True
    ):
        assert a.dtype == b.dtype and a.shape == b.shape, path
        np.testing.assert_array_equal(_bits(a), _bits(b), err_msg=rng.leaf_path(path))
    assert replay.checksum(got) == replay.checksum(replay.replay(replay.flatten(tree), updates, distribution=dist))
    if donate:
        assert all(b.is_deleted() for b in flat.buffers)


def test_the_doctors_canonical_replay_gives_the_golden_digests():
    """The doctor's canonical log (64 updates in four units, every special value) on its
    parameters in the flat layout, each unit one launch per buffer through the GPU tiling:
    the golden digests, the float32/bfloat16 part and the float16 part."""
    golden = json.loads(doctor.GOLDEN_PATH.read_text())
    flat = replay.flatten(doctor.canonical_params())
    for dist, updates in doctor.canonical_units():
        keys = np.stack([k for k, _ in updates])
        scales = replay.update_scales(dist, [c for _, c in updates])
        flat = _flat_replay(flat, keys, scales, dist, donate=True, platform="gpu", block_sizes=kp.BlockSizes(tile=512))
    tree = replay.unflatten(flat)
    assert replay.checksum({k: v for k, v in tree.items() if k != "norm"}) == golden["digest"]
    assert replay.checksum({"norm": tree["norm"]}) == golden["float16_digest"]


def _segment_reference(host, segments, keys, coefficients, dist="binomial"):
    """The NumPy reference on each segment of a flat buffer; every other element keeps its bits."""
    want = host.copy()
    for o, z, lid in segments:
        p = ref._flush(want[o : o + z].astype(np.float32))
        for key, c in zip(keys, coefficients):
            p = ref.apply_update(p, ref.update_scale(dist, c), ref.noise_int(dist, ref.fold_in(key, lid), z))
        want[o : o + z] = ref.flush_cast(p, want.dtype)
    return want


def test_gaps_and_unordered_segments_keep_their_bits_without_aliasing():
    """Segments out of order with gaps: the kernel writes only its segments' elements, and
    without ``inplace`` the buffer is still aliased (copied by XLA), so the gaps keep every bit.
    (NaN payloads stay inside the segments: XLA's CPU backend, which runs interpret mode, quiets
    a bf16 NaN that any op moves, a slice included.)"""
    segments = ((400, 299, 11), (2, 131, 22), (140, 0, 33), (150, 200, 44))
    host = (np.random.default_rng(3).standard_normal(700) * 0.1).astype(ml_dtypes.bfloat16)
    host[[2, 5, 132, 150, 401, 698]] = np.asarray([0x7FFF, 0xFFC1, 0x0001, 0x807F, 0x7F81, 0x8000], np.uint16).view(
        ml_dtypes.bfloat16
    )
    buf = jnp.asarray(host)
    keys = rng.sample_keys(4, [(0, 1, s) for s in range(2)])
    coefficients = [0.5, -0.125]
    scales = replay.update_scales("binomial", coefficients)
    want = _segment_reference(np.asarray(buf), segments, keys, coefficients)
    got = jax.jit(
        lambda b: kp.perturb_pallas_flat(
            b,
            kp.common._all_leaf_keys(jnp.asarray(keys), [lid for _, _, lid in segments]),
            jnp.asarray(scales),
            segments,
            interpret=True,
            platform="gpu",
            block_sizes=kp.BlockSizes(tile=128),
        )
    )(buf)
    np.testing.assert_array_equal(_bits(got), _bits(want))


class _PallasCallSpy:
    """Counts the ``pallas_call`` s of the replay kernels, with their grids."""

    def __init__(self, monkeypatch):
        self.grids = []
        real = kp.pallas.pl.pallas_call

        def spy(kernel, **kwargs):
            self.grids.append(tuple(kwargs["grid"] if "grid" in kwargs else kwargs["grid_spec"].grid))
            return real(kernel, **kwargs)

        monkeypatch.setattr(kp.pallas.pl, "pallas_call", spy)


@pytest.mark.parametrize("n_leaves", [1, 7, 50])
@pytest.mark.parametrize("k", [1, 16])
def test_exactly_one_pallas_call_per_buffer_whatever_the_number_of_leaves(n_leaves, k, monkeypatch):
    tree = {
        f"l{i:02d}": np.zeros(3 + 61 * (i % 5), np.float32 if i % 3 else ml_dtypes.bfloat16) for i in range(n_leaves)
    }
    flat = replay.flatten(tree)
    keys = rng.sample_keys(0, [(0, 0, s) for s in range(k)])
    scales = replay.update_scales("binomial", [1e-3] * k)
    spy = _PallasCallSpy(monkeypatch)
    jaxpr = jax.make_jaxpr(
        lambda bufs: kp.apply_updates_flat(
            bufs,
            keys,
            scales,
            flat.layout.tables(),
            impl="pallas",
            interpret=True,
            platform="gpu",
            inplace=True,
            block_sizes=kp.BlockSizes(tile=256),
        )
    )(flat.buffers)
    assert len(spy.grids) == len(flat.buffers) == (1 if n_leaves == 1 else 2)
    # every leaf is shorter than a tile: one grid step each; nothing left to a pass over ragged ends
    assert sum(g for (g,) in spy.grids) == n_leaves
    names = [eqn.primitive.name for eqn in jaxpr.jaxpr.eqns]
    assert names.count("pallas_call") == len(flat.buffers)
    assert "dynamic_update_slice" not in names and "concatenate" not in names


def test_on_a_gpu_auto_takes_the_flat_kernel_for_every_k(monkeypatch):
    """``impl="auto"`` on GPU: one Triton launch per buffer even for one update (the per-leaf
    choice for K = 1 is the jnp rule, which would be one fusion per segment)."""
    monkeypatch.setattr(kp.plans, "_triton_available", lambda: True)
    spy = _PallasCallSpy(monkeypatch)
    flat = replay.flatten({f"l{i}": np.zeros(70, np.float32) for i in range(9)})
    keys, scales = rng.sample_keys(0, [(0, 0, 0)]), replay.update_scales("binomial", [0.5])
    jax.make_jaxpr(
        lambda bufs: kp.apply_updates_flat(bufs, keys, scales, flat.layout.tables(), platform="gpu", interpret=True)
    )(flat.buffers)
    assert len(spy.grids) == 1


@pytest.mark.parametrize(
    "dist,blocks,step",
    [
        ("binomial", None, 7),  # leaves at odd offsets
        ("rademacher", None, 7),
        ("binomial", kp.BlockSizes(tile=8192, lanes=1024), 7),
        ("rademacher", kp.BlockSizes(tile=8192, lanes=1024), 16),  # every offset a multiple of 16: aligned loads
    ],
)
def test_flat_replay_lowers_to_one_triton_kernel_per_buffer(dist, blocks, step):
    """Exported for CUDA on this CPU machine: the whole Pallas -> Triton lowering runs, and the
    module holds exactly one Triton custom call per dtype buffer, for 50 leaves."""
    tree = {
        f"l{i:02d}": jax.ShapeDtypeStruct((1008 + step * i,), jnp.bfloat16 if i % 4 else jnp.float32) for i in range(50)
    }
    layout = replay.layout_of(tree)
    k = 3

    def f(bufs, keys, scales):
        return kp.apply_updates_flat(
            bufs, keys, scales, layout.tables(), distribution=dist, platform="gpu", inplace=True, block_sizes=blocks
        )

    bufs = [jax.ShapeDtypeStruct((n,), jnp.dtype(d)) for d, n in zip(layout.dtypes, layout.sizes)]
    args = (bufs, jax.ShapeDtypeStruct((k, 2), jnp.uint32), jax.ShapeDtypeStruct((k,), jnp.float32))
    assert kernel_launches(f, args, "cuda") == len(bufs) == 2


@pytest.mark.parametrize(
    "dist,dtypes,kernels",
    [("binomial", (jnp.bfloat16, jnp.float32), 2), ("rademacher", (jnp.float16, jnp.float32, jnp.bfloat16), 2)],
)
def test_flat_replay_lowers_to_one_mosaic_kernel_per_buffer(dist, dtypes, kernels, tpu_chip_info):
    """Exported for TPU on this CPU machine: the whole Pallas -> Mosaic lowering runs (block
    specs, scalar prefetch, SMEM tables), and a TPU layout of 50 leaves is one Mosaic kernel per
    dtype buffer, but for the float16 buffer, which Mosaic cannot load (the jnp rule updates it)."""
    tree = {f"l{i:02d}": jax.ShapeDtypeStruct((1008 + 7 * i,), dtypes[i % len(dtypes)]) for i in range(50)}
    layout = replay.layout_of(tree, platform="tpu")
    assert all(kp.plans.tpu_flat_fits(n, d) for d, n in zip(layout.dtypes, layout.sizes))

    def f(bufs, keys, scales):
        return kp.apply_updates_flat(
            bufs, keys, scales, layout.tables(), distribution=dist, platform="tpu", inplace=True
        )

    bufs = [jax.ShapeDtypeStruct((n,), jnp.dtype(d)) for d, n in zip(layout.dtypes, layout.sizes)]
    args = (bufs, jax.ShapeDtypeStruct((3, 2), jnp.uint32), jax.ShapeDtypeStruct((3,), jnp.float32))
    assert len(bufs) == len(dtypes)
    assert kernel_launches(f, args, "tpu") == kernels


def test_a_tpu_buffer_not_in_whole_blocks_goes_segment_by_segment(tpu_chip_info):
    """A buffer the TPU kernel cannot view as whole blocks (the leaves back to back, unpadded:
    not a multiple of 128) is replayed segment by segment, one Mosaic kernel per segment holding
    a whole tile."""
    sizes = (70_000, 9_000, 140_000)  # with 8-row tiles of 1024 lanes: 8, 1 and 17 whole tiles
    layout = replay.layout_of(
        {f"l{i}": jax.ShapeDtypeStruct((n,), jnp.float32) for i, n in enumerate(sizes)}, platform="cpu"
    )
    assert not kp.plans.tpu_flat_fits(layout.sizes[0], jnp.float32)

    def f(bufs, keys, scales):
        return kp.apply_updates_flat(bufs, keys, scales, layout.tables(), platform="tpu", inplace=True)

    args = (
        [jax.ShapeDtypeStruct((sum(sizes),), jnp.float32)],
        jax.ShapeDtypeStruct((2, 2), jnp.uint32),
        jax.ShapeDtypeStruct((2,), jnp.float32),
    )
    assert kernel_launches(f, args, "tpu") == len(sizes)


# TPU interpret mode simulates VMEM and SMEM; an output block the kernel has not written yet reads
# as NaN, so a work item that kept another's elements from it would show.
_TPU_BLOCKS = kp.BlockSizes(tile=1024, lanes=128)  # blocks of 8 rows (16 for 16-bit): several per buffer


def _tpu_interpret():
    from jax.experimental.pallas import tpu as pltpu

    return pltpu.InterpretParams(uninitialized_memory="nan")


@functools.cache
def _tpu_fn(layout, dist, donate):
    tables = layout.tables()
    return jax.jit(
        lambda bufs, keys, scales: kp.apply_updates_flat(  # auto: the float16 buffer by the jnp rule
            bufs,
            keys,
            scales,
            tables,
            distribution=dist,
            interpret=_tpu_interpret(),
            inplace=donate,
            platform="tpu",
            block_sizes=_TPU_BLOCKS,
        ),
        donate_argnums=(0,) if donate else (),
    )


@pytest.mark.parametrize("dist,k,donate", [("binomial", 3, False), ("rademacher", 16, True), ("binomial", 0, True)])
def test_the_tpu_kernel_in_tpu_interpret_mode_is_the_reference_bit_for_bit(dist, k, donate):
    """The Mosaic kernel's semantics (TPU interpret mode): a TPU layout of leaves of odd sizes in
    three dtypes, every special value, several blocks per buffer and blocks shared by several
    leaves: the bits of the NumPy reference leaf by leaf."""
    tree = _tree(k)
    updates = [
        (rng.sample_key(7, m, 2, s), float(c))
        for s, (m, c) in enumerate(zip(range(k), np.random.default_rng(k).standard_normal(k) * 1e-2))
    ]
    keys = np.stack([u for u, _ in updates]) if k else np.zeros((0, 2), np.uint32)
    scales = replay.update_scales(dist, [c for _, c in updates])
    flat = replay.flatten(tree, platform="tpu")
    plans = [
        kp.plans.plan_tpu_flat_tiles(flat.layout.table(b), n, _TPU_BLOCKS, d)
        for b, (d, n) in enumerate(zip(flat.layout.dtypes, flat.layout.sizes))
    ]
    assert any(p.table.shape[0] > len(flat.layout.table(b)) for b, p in enumerate(plans))  # a leaf over two blocks
    assert all((p.table[:, 4] == 0).any() for p in plans)  # in every buffer a block shared by several leaves
    got = replay.Flat(
        _tpu_fn(flat.layout, dist, donate)(flat.buffers, jnp.asarray(keys), jnp.asarray(scales)), flat.layout
    )
    want = _reference(tree, updates, dist)
    for (path, a), b in zip(
        jax.tree_util.tree_leaves_with_path(replay.unflatten(got)), jax.tree_util.tree_leaves(want), strict=True
    ):
        np.testing.assert_array_equal(_bits(a), _bits(b), err_msg=rng.leaf_path(path))
    for b, buf in zip(flat.layout.tables(), got.buffers):  # the padding past the last leaf is untouched
        np.testing.assert_array_equal(np.asarray(buf)[max(o + z for o, z, _ in b) :].astype(np.float32), 0)


def test_the_doctors_canonical_replay_gives_the_golden_digests_through_the_tpu_kernel():
    golden = json.loads(doctor.GOLDEN_PATH.read_text())
    flat = replay.flatten(doctor.canonical_params(), platform="tpu")
    for dist, updates in doctor.canonical_units():
        keys = np.stack([k for k, _ in updates])
        scales = replay.update_scales(dist, [c for _, c in updates])
        flat = replay.Flat(
            _tpu_fn(flat.layout, dist, True)(flat.buffers, jnp.asarray(keys), jnp.asarray(scales)), flat.layout
        )
    tree = replay.unflatten(flat)
    assert replay.checksum({k: v for k, v in tree.items() if k != "norm"}) == golden["digest"]
    assert replay.checksum({"norm": tree["norm"]}) == golden["float16_digest"]


def test_tpu_kernel_keeps_gaps_and_blocks_without_segments(monkeypatch):
    """Unordered segments with gaps, one block holding none (so the plan aliases the input even
    without ``inplace``), and a replay split over several launches when SMEM cannot hold its
    tables: every segment gets its updates, every other element keeps its bits."""
    segments = ((2100, 299, 11), (2, 131, 22), (140, 0, 33), (150, 200, 44), (900, 100, 55))
    host = (np.random.default_rng(5).standard_normal(4096) * 0.1).astype(np.float32)
    host[[2, 5, 132, 150, 401, 2398, 3000]] = np.asarray(
        [0x7FC00001, 0x00000001, 0x807FFFFF, 0xFF800000, 0x80000000, 0x7F800000, 0x7FFFFFFF], np.uint32
    ).view(np.float32)
    keys = rng.sample_keys(4, [(0, 1, s) for s in range(3)])
    coefficients = [0.5, -0.125, 0.03]
    scales = replay.update_scales("binomial", coefficients)
    want = _segment_reference(host, segments, keys, coefficients)
    plan = kp.plans.plan_tpu_flat_tiles(segments, host.size, _TPU_BLOCKS)
    assert plan.aliased and plan.block_rows == 8  # block 3 (elements 3072-4095) holds no segment
    seg_keys = kp.common._all_leaf_keys(jnp.asarray(keys), [lid for _, _, lid in segments])

    def run(inplace):
        return np.asarray(
            jax.jit(
                lambda b: kp.perturb_pallas_flat(
                    b,
                    seg_keys,
                    jnp.asarray(scales),
                    segments,
                    interpret=_tpu_interpret(),
                    platform="tpu",
                    block_sizes=_TPU_BLOCKS,
                    inplace=inplace,
                )
            )(jnp.asarray(host))
        )

    np.testing.assert_array_equal(_bits(run(False)), _bits(want))
    spy = _PallasCallSpy(monkeypatch)
    monkeypatch.setattr(kp.plans, "_TPU_SMEM_WORDS", 30)  # the tables of two segments at most per launch
    np.testing.assert_array_equal(_bits(run(True)), _bits(want))
    assert spy.grids == [(2,), (1,), (1,)]  # segments 0 and 1; 2 (empty) and 3; 4


def test_a_launchs_smem_budget_is_half_the_chips(monkeypatch):
    """Compiled with libtpu for a TPU v3 (16 KiB of SMEM), a flat replay of 50 leaves at K = 64 asked
    for 25 KiB in one launch; the budget is now at most half the chip's SMEM (4 KiB words there,
    the 512 KiB default on a v4, v5e or v6e with 1 MiB), and the replay goes in several launches."""
    from jax._src.pallas.mosaic import tpu_info
    from jax.experimental.pallas import tpu as pltpu

    kind = rule.default_devices()[0].device_kind  # Pallas's chip: the default device's (the CPU's beside a GPU)
    assert kp.plans._tpu_smem_words(interpret=True) == kp.plans._TPU_SMEM_WORDS
    budgets = {}
    for chip in (pltpu.ChipVersion.TPU_V3, pltpu.ChipVersion.TPU_V4, pltpu.ChipVersion.TPU_V5E):
        tpu_info.get_tpu_info.cache_clear()
        monkeypatch.setitem(tpu_info.registry, kind, lambda chip=chip: pltpu.get_tpu_info_for_chip(chip, 1))
        budgets[chip.value] = kp.plans._tpu_smem_words(interpret=False)
    tpu_info.get_tpu_info.cache_clear()
    assert budgets == {"v3": 2048, "v4": kp.plans._TPU_SMEM_WORDS, "v5e": kp.plans._TPU_SMEM_WORDS}
    segments = tuple((1024 * i, 1008 + 7 * i, i) for i in range(50))
    assert len(kp.mosaic._tpu_launch_groups(segments, 1024, 64)) == 1
    groups = kp.mosaic._tpu_launch_groups(segments, 1024, 64, budgets["v3"])
    assert [j for g in groups for j in g] == list(range(50)) and len(groups) == 4
    assert all(
        65 + sum(2 * 64 + 5 * len(kp.plans._blocks_touched(*segments[j][:2], 1024)) for j in g) <= 2048 for g in groups
    )


@settings(max_examples=60, deadline=None)
@given(
    sizes=st.lists(st.integers(0, 5000), min_size=1, max_size=12),
    gaps=st.lists(st.integers(0, 300), min_size=12, max_size=12),
    tile_log2=st.integers(10, 17),
    half=st.booleans(),
)
def test_tpu_plan_covers_each_segment_once_in_whole_blocks(sizes, gaps, tile_log2, half):
    """Whatever the segments: blocks divide the rows, every element of every segment is in exactly
    one item of its own segment, the items of a block are consecutive and the first is marked,
    and the plan aliases exactly when some block holds no segment."""
    segments, o = [], 0
    for j, (z, gap) in enumerate(zip(sizes, gaps)):
        segments.append((o + gap, z, j))
        o += gap + z
    n = kp.plans.tpu_flat_size(o)
    dtype = jnp.bfloat16 if half else jnp.float32
    blocks = kp.BlockSizes(tile=2**tile_log2, lanes=128)
    plan = kp.plans.plan_tpu_flat_tiles(segments, n, blocks, dtype)
    rows = n // kp.plans.TPU_LANES
    assert rows % plan.block_rows == 0 and (plan.block_rows == rows or plan.block_rows % (16 if half else 8) == 0)
    assert plan.block <= max(blocks.tile, 16 * kp.plans.TPU_LANES) or plan.block_rows == rows
    covered = np.zeros(n, np.int32)
    for b, start, end, j, _ in plan.table.tolist():
        assert (start, end - start) == segments[j][:2]
        lo, hi = max(start, b * plan.block), min(end, (b + 1) * plan.block)
        assert lo < hi  # an item holds part of its segment
        covered[lo:hi] += 1
    want = np.zeros(n, np.int32)
    for start, z, _ in segments:
        want[start : start + z] = 1
    np.testing.assert_array_equal(covered, want)
    order = plan.table[:, 0].tolist()
    assert order == sorted(order)
    assert plan.table[:, 4].tolist() == [int(i == 0 or order[i - 1] != b) for i, b in enumerate(order)]
    assert plan.aliased == (len(set(order)) < rows // plan.block_rows)


def test_tpu_plan_shares_blocks_and_sizes_them_to_the_leaves():
    segments = ((0, 300, 9), (300, 5, 1), (512, 1000, 2), (1600, 700, 3), (2400, 3, 4))
    plan = kp.plans.plan_tpu_flat_tiles(segments, 2560, kp.BlockSizes(tile=4096, lanes=128))
    assert plan.block_rows == 20 and not plan.aliased  # every row in one block: 5 items, no step wasted
    assert plan.table.tolist() == [
        [0, 0, 300, 0, 1],
        [0, 300, 305, 1, 0],
        [0, 512, 1512, 2, 0],
        [0, 1600, 2300, 3, 0],
        [0, 2400, 2403, 4, 0],
    ]
    # blocks of 8 rows: a leaf across two blocks is two items; each block's first item is marked
    split = kp.plans.plan_tpu_flat_tiles(segments, 3072, kp.BlockSizes(tile=1024, lanes=128))
    assert split.block_rows == 8 and not split.aliased
    assert split.table.tolist() == [
        [0, 0, 300, 0, 1],
        [0, 300, 305, 1, 0],
        [0, 512, 1512, 2, 0],
        [1, 512, 1512, 2, 1],
        [1, 1600, 2300, 3, 0],
        [2, 1600, 2300, 3, 1],
        [2, 2400, 2403, 4, 0],
    ]
    # one large leaf takes the largest block; many small leaves in a large buffer take small blocks
    big = kp.plans.plan_tpu_flat_tiles(((0, 2**20, 1),), 2**20, kp.default_block_sizes("tpu"))
    assert big.block_rows == 1024 and big.table.shape[0] == 8
    small = tuple((64 * i, 64, i) for i in range(200)) + ((2**20 - 2**18, 2**18, 999),)
    mixed = kp.plans.plan_tpu_flat_tiles(small, 2**20, kp.default_block_sizes("tpu"))
    assert (mixed.block_rows, mixed.table.shape[0], mixed.aliased) == (32, 200 + 64, True)
    assert (
        kp.plans.tpu_flat_size(1) == 2048
        and kp.plans.tpu_flat_size(2**17) == 2**17
        and kp.plans.tpu_flat_size(2**17 + 1) == 2**18
    )
    with pytest.raises(ValueError, match="do not fit"):
        kp.plans.plan_tpu_flat_tiles(((0, 100, 1),), 1000, kp.default_block_sizes("tpu"))
    with pytest.raises(ValueError, match="do not fit"):  # 1032 rows: more than a block, not a multiple of 16
        kp.plans.plan_tpu_flat_tiles(((0, 100, 1),), 1032 * 128, kp.default_block_sizes("tpu"), jnp.bfloat16)


def test_plan_covers_each_segment_with_tiles_of_its_own():
    segments = ((0, 0, 9), (16, 600, 1), (700, 5, 2), (720, 64, 3))
    plan = kp.plans.plan_flat_tiles(segments, "binomial", kp.BlockSizes(tile=256), "gpu")
    assert (plan.width, plan.tile_rows, plan.grouped, plan.align) == (4, 64, True, 4)
    assert plan.table.tolist() == [
        [1, 16, 0, 256],
        [1, 272, 256, 256],
        [1, 528, 512, 88],
        [2, 700, 0, 5],
        [3, 720, 0, 64],
    ]
    # a buffer of small leaves gets a small tile (a power of two of rows on GPU), aligned starts a hint
    small = kp.plans.plan_flat_tiles(((0, 5, 1), (32, 20, 2)), "rademacher", kp.BlockSizes(tile=8192), "gpu")
    assert (small.width, small.tile_rows, small.align, small.table.shape) == (64, 1, 16, (2, 4))
    lanes = kp.plans.plan_flat_tiles(((3, 300, 1),), "binomial", kp.BlockSizes(tile=1024, lanes=128), "cpu")
    assert (lanes.width, lanes.tile_rows, lanes.grouped, lanes.align) == (128, 3, False, 1)


def test_flat_kernel_errors_name_the_problem():
    keys, scales = jnp.zeros((2, 1, 2), jnp.uint32), jnp.ones(1, jnp.float32)
    with pytest.raises(ValueError, match=r"segment keys must be u32\[2, 1, 2\]"):
        kp.perturb_pallas_flat(jnp.zeros(10), keys[:1], scales, ((0, 3, 1), (3, 3, 2)), interpret=True)
    with pytest.raises(ValueError, match="interpret=True"):
        kp.perturb_pallas_flat(jnp.zeros(10), keys, scales, ((0, 3, 1), (3, 3, 2)), platform="cpu")
    with pytest.raises(ValueError, match="on TPU use plan_tpu_flat_tiles"):
        kp.plans.plan_flat_tiles(((0, 3, 1),), "binomial", kp.BlockSizes(), "tpu")
    with pytest.raises(ValueError, match="rows per tile must be a power of two"):
        kp.plans.plan_flat_tiles(((0, 3000, 1),), "binomial", kp.BlockSizes(tile=192, lanes=64), "gpu")


@pytest.mark.parametrize(
    "dist,k,blocks",
    [
        ("binomial", 1, None),  # the GPU's default tiles: one grouped row per threefry call
        ("rademacher", 3, kp.BlockSizes(tile=256, lanes=32)),  # several tiles per leaf, per-element counters
    ],
)
def test_leaves_perturbed_apart_are_their_segments_of_the_flat_replay(dist, k, blocks):
    """``perturb_pallas_segments``: the leaves of a flat buffer (odd offsets and sizes, three
    dtypes, special values), read in place and written one after the other into an array of
    their own by one launch (every leaf of a buffer, in an order not the buffer's, or one leaf
    alone), have the bits of the reference's replay of each leaf; their keys are their rows of a
    table shared by every launch. The buffers are not changed."""
    tree = _tree(10 + k)
    updates = [
        (rng.sample_key(5, 1, 3, s), float(c)) for s, c in enumerate(np.random.default_rng(k).standard_normal(k) * 1e-2)
    ]
    keys = jnp.asarray(np.stack([u for u, _ in updates]))
    scales = jnp.asarray(replay.update_scales(dist, [c for _, c in updates]))
    flat = replay.flatten(tree)
    before = [np.asarray(b).copy() for b in flat.buffers]
    want = jax.tree_util.tree_leaves(_reference(tree, updates, dist))
    table = kp.common._all_leaf_keys(keys, [g.leaf_id for g in flat.layout.segments])  # u32[L, K, 2], tree order
    segments = flat.layout.segments
    groups = [[i for i, g in enumerate(segments) if g.buffer == b][::-1] for b in range(len(flat.buffers))]
    groups += [[i] for i in range(len(segments))]
    run = jax.jit(
        lambda bufs, t, s: [
            kp.perturb_pallas_segments(
                bufs[segments[group[0]].buffer],
                t,
                s,
                [(segments[i].offset, segments[i].size, i) for i in group],
                distribution=dist,
                interpret=True,
                platform="gpu",
                block_sizes=blocks,
            )
            for group in groups
        ]
    )
    for group, got in zip(groups, run(flat.buffers, table, scales), strict=True):
        assert got.shape == (sum(segments[i].size for i in group),) and got.dtype == want[group[0]].dtype
        at = 0
        for i in group:
            np.testing.assert_array_equal(
                _bits(got[at : at + segments[i].size]), _bits(want[i]), err_msg=segments[i].path
            )
            at += segments[i].size
    for b, a in zip(flat.buffers, before, strict=True):
        np.testing.assert_array_equal(_bits(b), _bits(a))


def test_leaves_perturbed_apart_refuse_what_the_kernel_cannot_do():
    table, scales = jnp.zeros((3, 1, 2), jnp.uint32), jnp.ones(1, jnp.float32)
    buf = jnp.zeros(100)
    with pytest.raises(ValueError, match=r"rows \[3\] are missing"):
        kp.perturb_pallas_segments(buf, table, scales, [(0, 10, 3)], interpret=True)
    with pytest.raises(ValueError, match="perturb_pallas_segments"):  # past the buffer's end
        kp.perturb_pallas_segments(buf, table, scales, [(95, 10, 0)], interpret=True)
    with pytest.raises(ValueError, match="on a TPU compute each leaf with perturb_reference"):
        kp.perturb_pallas_segments(buf, table, scales, [(0, 10, 0)], interpret=True, platform="tpu")
    with pytest.raises(ValueError, match="interpret=True"):
        kp.perturb_pallas_segments(buf, table, scales, [(0, 10, 0)], platform="cpu")
    assert kp.perturb_pallas_segments(buf, table, scales, [(7, 0, 2)], interpret=True).shape == (0,)
    # no update: each leaf flushed and cast alone, as the reference does (a subnormal becomes +-0)
    special = jnp.asarray(_leaf(3, (40,), np.float32))
    none = kp.perturb_pallas_segments(
        special, jnp.zeros((2, 0, 2), jnp.uint32), jnp.zeros(0, jnp.float32), [(30, 10, 1), (0, 25, 0)], interpret=True
    )
    want = [
        kp.perturb_reference(special[o : o + z], jnp.zeros((0, 2), jnp.uint32), jnp.zeros(0, jnp.float32))
        for o, z in ((30, 10), (0, 25))
    ]
    np.testing.assert_array_equal(_bits(none), _bits(jnp.concatenate(want)))
    assert np.any(_bits(special[:25]) != _bits(want[1]))  # the flush changed something
