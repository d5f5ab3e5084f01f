"""zeroth.replay's flat layout: a Flat replays to the bits of the tree it came from (and of the
NumPy reference) through one kernel launch per buffer (one per dtype for the small leaves, one per
large leaf), unflattens inside jit, and checksums like its tree."""

import gc

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from zeroth import noise, replay, rng
from zeroth import reference as ref
from zeroth.kernels import cpu_native
from zeroth.kernels import perturb as kp

NATIVE = cpu_native.available()
needs_native = pytest.mark.skipif(not NATIVE, reason=str(cpu_native.unavailable_reason()))
DTYPES = (np.dtype(np.float32), np.dtype(ml_dtypes.bfloat16), np.dtype(np.float16))
SHAPES = ((), (0,), (1,), (7,), (3, 5), (64,), (65,), (4099,))


def _bits(a) -> np.ndarray:
    a = np.asarray(a)
    return a.view({2: np.uint16, 4: np.uint32}[a.dtype.itemsize]).reshape(-1)


def _assert_tree_bits(got, want):
    assert jax.tree_util.tree_structure(got) == jax.tree_util.tree_structure(want)
    for a, b in zip(jax.tree_util.tree_leaves(got), jax.tree_util.tree_leaves(want), strict=True):
        assert np.asarray(a).dtype == np.asarray(b).dtype and np.shape(a) == np.shape(b)
        np.testing.assert_array_equal(_bits(a), _bits(b))


def _values(seed: int, shape, dtype) -> np.ndarray:
    g = np.random.default_rng(seed)
    x = (g.standard_normal(int(np.prod(shape))) * np.ldexp(1.0, g.integers(-20, 4))).astype(np.float32)
    return x.astype(dtype).reshape(shape)


def _tree(seed: int, leaves) -> dict:
    """A nested dict of the given ``(dtype index, shape index)`` leaves, mixed dtypes interleaved."""
    out: dict = {"top": {}, "nested": {"deeper": {}}}
    for i, (d, s) in enumerate(leaves):
        where = out["top"] if i % 2 == 0 else out["nested"]["deeper"]
        where[f"leaf{i}"] = _values(seed + i, SHAPES[s], DTYPES[d])
    return out


def _reference(tree, updates, dist):
    with_path, treedef = jax.tree_util.tree_flatten_with_path(tree)
    return jax.tree_util.tree_unflatten(
        treedef, [ref.replay_leaf(np.asarray(x), rng.leaf_path(p), updates, dist) for p, x in with_path]
    )


LEAVES = st.lists(st.tuples(st.integers(0, 2), st.integers(0, len(SHAPES) - 1)), min_size=1, max_size=6)


@settings(max_examples=24)
@given(
    seed=st.integers(0, 2**16),
    leaves=LEAVES,
    dist=st.sampled_from(noise.EXACT),
    k=st.sampled_from([0, 1, 3, 16]),
    donate=st.booleans(),
    alone_from=st.sampled_from([None, 1, 7, 65, replay.ALONE_FROM]),
)
def test_flat_replay_is_the_tree_replay_bit_for_bit(seed, leaves, dist, k, donate, alone_from):
    tree = _tree(seed, leaves)
    g = np.random.default_rng(seed)
    updates = [
        (rng.sample_key(seed, int(m), 3, s), float(c))
        for s, (m, c) in enumerate(zip(g.integers(0, 5, k), g.standard_normal(k) * 1e-2))
    ]
    want = replay.replay(jax.device_put(tree), updates, distribution=dist)
    flat = replay.flatten(jax.device_put(tree), alone_from=alone_from)
    flat = replay.replay(flat, updates, distribution=dist, donate=donate)
    assert isinstance(flat, replay.Flat)
    _assert_tree_bits(replay.unflatten(flat), want)
    _assert_tree_bits(replay.unflatten(flat), _reference(tree, updates, dist))
    assert replay.checksum(flat) == replay.checksum(want)


def test_flat_layout_groups_leaves_by_dtype_in_tree_order():
    tree = {"a": np.zeros(3, np.float16), "b": np.ones((2, 2), np.float32), "c": np.full(5, 2, np.float16)}
    flat = replay.flatten(tree)
    layout = flat.layout
    assert layout.dtypes == ("float16", "float32") and layout.sizes == (8, 4)
    assert [(s.path, s.buffer, s.offset, s.size, s.shape) for s in layout.segments] == [
        ("['a']", 0, 0, 3, (3,)),
        ("['b']", 1, 0, 4, (2, 2)),
        ("['c']", 0, 3, 5, (5,)),
    ]
    assert [s.leaf_id for s in layout.segments] == [rng.leaf_id(s.path) for s in layout.segments]
    np.testing.assert_array_equal(np.asarray(flat.buffers[0]), np.array([0, 0, 0, 2, 2, 2, 2, 2], np.float16))
    _assert_tree_bits(replay.unflatten(flat), tree)
    assert replay.layout_of(tree) == layout and hash(replay.layout_of(tree)) == hash(layout)
    assert replay.layout_of({**tree, "c": np.zeros(6, np.float16)}) != layout


def test_a_leaf_of_alone_from_elements_or_more_has_a_buffer_of_its_own():
    """Large leaves are not sliced out of a shared buffer (a copy where XLA cannot fuse the slice);
    the small ones still share one buffer per dtype. Buffers come in the order of their first leaf."""
    tree = {
        "a": np.zeros(3, np.float16),
        "b": np.ones((4, 4), np.float32),
        "c": np.full(5, 2, np.float16),
        "d": np.ones(2, np.float32),
        "e": np.ones(16, np.float16),
    }
    layout = replay.layout_of(tree, alone_from=16)
    assert layout.dtypes == ("float16", "float32", "float32", "float16") and layout.sizes == (8, 16, 2, 16)
    assert [(s.path, s.buffer, s.offset) for s in layout.segments] == [
        ("['a']", 0, 0),
        ("['b']", 1, 0),
        ("['c']", 0, 3),
        ("['d']", 2, 0),
        ("['e']", 3, 0),
    ]
    assert repr(layout) == "Layout(5 leaves in 4 buffers: float16[8], float32[16], float32[2], float16[16])"
    assert replay.layout_of(tree, alone_from=None).dtypes == ("float16", "float32")
    assert len(replay.layout_of(tree, alone_from=1).dtypes) == 5
    assert replay.layout_of(tree) == replay.layout_of(tree, alone_from=None)  # all below ALONE_FROM
    big = {"small": np.zeros(3, np.float32), "big": jax.ShapeDtypeStruct((replay.ALONE_FROM,), jnp.float32)}
    assert replay.layout_of(big).sizes == (replay.ALONE_FROM, 3)  # "big" sorts first in the tree
    # On a TPU the shared buffers are padded to whole blocks; a leaf alone is replayed as in the tree.
    assert replay.layout_of(tree, alone_from=16, platform="tpu").sizes == (2048, 16, 2048, 16)
    flat = replay.flatten(tree, alone_from=16)
    _assert_tree_bits(replay.unflatten(flat), tree)
    assert replay.checksum(flat) == replay.checksum(tree)
    for bad in (0, -3, 2.5, True, "16"):
        with pytest.raises(ValueError, match=rf"alone_from must be an int >= 1 \(elements\) or None, got {bad!r}"):
            replay.layout_of(tree, alone_from=bad)


def test_flatten_with_donation_hands_a_leaf_alone_over_without_a_copy():
    # A leaf that is its buffer's whole becomes that buffer (aliased, not copied); the leaves that
    # share a buffer are copied into it (not donated to XLA, which could not use them) and deleted.
    tree = {
        "b": jnp.asarray(_values(1, (3,), np.float32)),
        "big": jnp.asarray(_values(2, (300, 500), np.float32)),
        "c": jnp.asarray(_values(3, (4,), np.float32)),
        "h": jnp.asarray(_values(4, (7,), np.float16)),
    }
    want = replay.checksum(tree)
    layout = replay.layout_of(tree, alone_from=1000)
    own = replay._own_buffer(layout)
    assert own == (False, True, False, True)
    leaves = jax.tree_util.tree_leaves(tree)
    compiled = (
        replay._flatten_fn(layout, True)
        .lower([x for x, o in zip(leaves, own) if o], [x for x, o in zip(leaves, own) if not o])
        .compile()
    )
    assert compiled.memory_analysis().alias_size_in_bytes == 300 * 500 * 4 + 7 * 2
    flat = replay.flatten(tree, alone_from=1000, donate=True)
    assert all(tree[k].is_deleted() for k in ("b", "big", "c", "h"))  # "b" and "c" deleted once copied
    assert replay.checksum(flat) == want
    kept = replay.flatten(tree_copy := {k: jnp.array(v, copy=True) for k, v in replay.host_tree(flat).items()})
    assert not any(a.is_deleted() for a in tree_copy.values()) and replay.checksum(kept) == want


def test_a_tpu_layout_pads_each_buffer_to_whole_blocks_outside_every_leaf():
    """``platform="tpu"``: the same leaves at the same offsets, each buffer padded with zeros to
    ``tpu_flat_size``; unflatten, checksum and a replay (on this CPU) see the leaves only."""
    tree = {
        "a": _values(1, (3,), np.float16),
        "b": _values(2, (300, 500), np.float32),
        "c": _values(3, (5,), np.float16),
    }
    flat, tpu = replay.flatten(tree), replay.flatten(tree, platform="tpu")
    assert tpu.layout.segments == flat.layout.segments and tpu.layout != flat.layout
    assert tpu.layout.sizes == (2048, 2**18) == tuple(kp.plans.tpu_flat_size(n) for n in flat.layout.sizes)
    for padded, exact in zip(tpu.buffers, flat.buffers):
        np.testing.assert_array_equal(
            np.asarray(padded)[: exact.shape[0]].view(np.uint8), np.asarray(exact).view(np.uint8)
        )
        assert not np.asarray(padded)[exact.shape[0] :].any()
    _assert_tree_bits(replay.unflatten(tpu), tree)
    assert replay.checksum(tpu) == replay.checksum(tree)
    updates = [(rng.sample_key(0, 1, 2, s), 0.01 * (s + 1)) for s in range(3)]
    moved = replay.replay(tpu, updates, donate=True)
    assert replay.checksum(moved) == replay.checksum(replay.replay(tree, updates))
    assert not np.asarray(moved.buffers[1])[150_000:].any()
    with pytest.raises(ValueError, match="unknown platform 'metal'"):
        replay.layout_of(tree, platform="metal")


def test_unflatten_inside_jit_is_a_forward_pass_on_the_flat_buffers():
    tree = {"w": _values(1, (4, 3), np.float32), "b": _values(2, (3,), np.float32)}
    flat = replay.flatten(tree)

    def forward(p, x):
        return x @ p["w"] + p["b"][None, :]

    x = jnp.asarray(_values(3, (2, 4), np.float32))
    got = jax.jit(lambda f, x: forward(replay.unflatten(f), x))(flat, x)
    np.testing.assert_array_equal(np.asarray(got), np.asarray(jax.jit(forward)(tree, x)))


def test_checksum_of_a_flat_is_the_checksum_of_its_tree():
    tree = {"x": _values(5, (3, 7), ml_dtypes.bfloat16), "y": {"z": _values(6, (11,), np.float32)}}
    flat = replay.flatten(tree)
    assert replay.checksum(flat) == replay.checksum(tree) == replay.checksum(replay.unflatten(flat))
    moved = replay.replay(flat, [(rng.sample_key(0, 0, 0, 0), 0.5)])
    assert replay.checksum(moved) != replay.checksum(tree)


@pytest.mark.parametrize("impl", ["jnp", "pallas", pytest.param("native", marks=needs_native)])
def test_apply_updates_flat_leaves_gaps_alone_and_matches_each_leaf(impl):
    """Segments anywhere in a buffer (gaps between them, out of order): each gets its leaf's
    updates, the gaps keep their bits, with and without aliasing. Pallas runs in interpret mode
    with tiles of 64 elements (whole tiles plus a ragged tail per segment)."""
    buf = jnp.asarray(_values(9, (300,), np.float32))
    segments = ((120, 65, 77), (3, 40, 5), (200, 0, 9), (250, 50, 123456789))
    keys = rng.sample_keys(2, [(1, 0, s) for s in range(3)])
    coefficients = [0.25, -1e-3, 3.0]
    scales = replay.update_scales("binomial", coefficients)
    want = np.asarray(buf).copy()
    for o, z, lid in segments:  # the NumPy reference, leaf by leaf, keys fold_in(key, leaf id)
        p = ref._flush(want[o : o + z])
        for key, c in zip(keys, coefficients):
            p = ref.apply_update(
                p, ref.update_scale("binomial", c), ref.noise_int("binomial", ref.fold_in(key, lid), z)
            )
        want[o : o + z] = ref.flush_cast(p, np.float32)
    for inplace in (True,) if impl == "pallas" else (False, True):  # Pallas interprets slowly: once
        pallas = {"interpret": True, "block_sizes": kp.BlockSizes(tile=64)} if impl == "pallas" else {}
        fn = jax.jit(
            lambda b, inplace=inplace, pallas=pallas: kp.apply_updates_flat(
                [b], keys, scales, (segments,), impl=impl, inplace=inplace, **pallas
            )[0],
            donate_argnums=0 if inplace else (),
        )
        got = np.asarray(fn(jnp.array(buf, copy=True)))
        np.testing.assert_array_equal(_bits(got), _bits(want))


@needs_native
@pytest.mark.parametrize("dist", noise.EXACT)
def test_native_flat_threaded_launch_shares_chunks_of_small_leaves(dist):
    """Above the native kernel's threading threshold (here about 95,000 elements x 4 updates) a
    launch is cut into chunks of about equal work: runs of many small segments share a chunk, the
    large one spans several, and the threads claim them in any order. Every segment still gets its
    own leaf's bits and the gaps between segments keep theirs."""
    g = np.random.default_rng(11)
    sizes = [int(z) for z in g.integers(1, 300, 240)] + [65, 60001] + [int(z) for z in g.integers(1, 9, 20)]
    segments, offset = [], 0
    for i, z in enumerate(sizes):
        offset += i % 3  # gaps of 0, 1 or 2 elements
        segments.append((offset, z, int(g.integers(0, 2**32))))
        offset += z
    buf = jnp.asarray(_values(12, (offset + 5,), np.float32))
    keys = rng.sample_keys(4, [(2, 1, s) for s in range(4)])
    coefficients = [0.5, -2e-3, 1.25, 7e-5]
    scales = replay.update_scales(dist, coefficients)
    want = np.asarray(buf).copy()
    for o, z, lid in segments:  # the NumPy reference, leaf by leaf, keys fold_in(key, leaf id)
        p = ref._flush(want[o : o + z])
        for key, c in zip(keys, coefficients):
            p = ref.apply_update(p, ref.update_scale(dist, c), ref.noise_int(dist, ref.fold_in(key, lid), z))
        want[o : o + z] = ref.flush_cast(p, np.float32)
    fn = jax.jit(
        lambda b: kp.native.perturb_native_flat(b, keys, scales, segments, distribution=dist, inplace=True),
        donate_argnums=0,
    )
    for _ in range(3):  # the threads' share of the chunks differs from call to call
        np.testing.assert_array_equal(_bits(fn(jnp.array(buf, copy=True))), _bits(want))


@needs_native
def test_one_native_launch_per_buffer_whatever_the_number_of_leaves():
    tree = {f"l{i:03d}": np.zeros(5 + i % 3, np.float32 if i % 4 else np.float16) for i in range(40)}
    flat = replay.flatten(tree)
    keys, scales = rng.sample_keys(0, [(0, 0, 0)]), replay.update_scales("binomial", [0.5])
    tables = flat.layout.tables()
    text = (
        jax.jit(
            lambda bufs: kp.apply_updates_flat(bufs, keys, scales, tables, impl="native", inplace=True),
            donate_argnums=0,
        )
        .lower(flat.buffers)
        .as_text()
    )
    assert text.count(cpu_native.target_name(flat=True)) == 2  # float16 and float32: one each
    assert cpu_native.target_name(tree=True) not in text and cpu_native.target_name() + '"' not in text


def test_flat_replay_compiles_once_per_layout_and_k():
    tree = {"a": np.zeros(9, np.float32), "b": np.zeros(4, np.float16)}
    flat = replay.flatten(tree)
    ups = [(rng.sample_key(0, 0, 0, s), 0.1) for s in range(2)]
    flat = replay.replay(flat, ups, donate=True)
    before = replay._flat_fn.cache_info()
    fn = replay._flat_fn(flat.layout, "binomial", True, "auto")
    traced = fn._cache_size()
    for _ in range(3):
        flat = replay.replay(replay.flatten(replay.unflatten(flat)), ups, donate=True)
    assert replay._flat_fn.cache_info().misses == before.misses  # the same compiled replay each time
    assert fn._cache_size() == traced == 1


def test_equal_layouts_are_one_object_while_alive():
    # replay's compiled-call lookup then compares layouts by identity, not segment by segment
    tree = {f"w{i:03d}": np.zeros(5, np.float32) for i in range(50)}
    a = replay.flatten(tree).layout
    assert replay.layout_of(tree) is a
    assert replay.flatten(replay.unflatten(replay.flatten(tree))).layout is a
    other = replay.layout_of({**tree, "w000": np.zeros(6, np.float32)})
    assert other is not a and other != a
    assert replay.layout_of(tree, platform="tpu") is not a  # padded: another value
    assert replay._LAYOUTS.get(a._key) is a
    alone = replay.layout_of({"only_here": np.zeros(3, np.float16)})  # no compiled call holds it
    key = alone._key
    del alone
    gc.collect()
    assert replay._LAYOUTS.get(key) is None  # interning keeps no layout alive


def test_flat_donation_and_copy():
    tree = {"a": _values(4, (10,), np.float32)}
    flat = replay.flatten(tree)
    ups = [(rng.sample_key(0, 0, 0, 0), 0.5)]
    copy = replay.replay(flat, ups)
    _assert_tree_bits(replay.unflatten(flat), tree)  # the input is untouched
    donated = replay.replay(flat, ups, donate=True)
    assert flat.buffers[0].is_deleted()
    assert replay.checksum(donated) == replay.checksum(copy)


def test_flat_errors_name_the_problem():
    with pytest.raises(TypeError, match=r"leaf \['n'\] has dtype int32"):
        replay.flatten({"n": np.zeros(3, np.int32)})
    with pytest.raises(TypeError, match="unflatten takes a zeroth.replay.Flat"):
        replay.unflatten({"a": np.zeros(3)})
    keys, scales = rng.sample_keys(0, [(0, 0, 0)]), replay.update_scales("binomial", [0.5])
    with pytest.raises(ValueError, match=r"segment \(offset 4, size 10, leaf id 2\) must lie in \[0, 12\)"):
        kp.apply_updates_flat([jnp.zeros(12)], keys, scales, (((0, 5, 1), (4, 10, 2)),), impl="jnp")
    with pytest.raises(ValueError, match="1 buffers but 2 segment tables"):
        kp.apply_updates_flat([jnp.zeros(12)], keys, scales, ((), ()), impl="jnp")


def test_empty_tree_flattens_and_replays():
    flat = replay.replay(replay.flatten({}), [(rng.sample_key(0, 0, 0, 0), 0.5)])
    assert flat.buffers == () and replay.unflatten(flat) == {} and replay.checksum(flat) == replay.checksum({})


@pytest.mark.parametrize("dist", noise.EXACT)
def test_flat_jnp_path_is_exact_too(dist):
    """The path off the CPU kernel (GPU/TPU without Pallas, sharded buffers): the jnp rule per
    segment, each at its own counters, gives the reference's bits on mixed dtypes."""
    tree = _tree(11, [(0, 6), (1, 4), (2, 6), (0, 0), (1, 3)])
    updates = [(rng.sample_key(1, 2, 3, s), 0.01 * (s - 1)) for s in range(3)]
    flat = replay.flatten(tree)
    keys = np.stack([k for k, _ in updates])
    scales = replay.update_scales(dist, [c for _, c in updates])
    out = jax.jit(
        lambda bufs: kp.apply_updates_flat(bufs, keys, scales, flat.layout.tables(), distribution=dist, impl="jnp")
    )(flat.buffers)
    want = _reference(tree, updates, dist)
    _assert_tree_bits(replay.unflatten(replay.Flat(out, flat.layout)), want)
    # The public traceable rule takes a Flat too (inside a jit), with the same bits.
    traced = jax.jit(lambda f: replay.apply_updates(f, keys, scales, distribution=dist))(flat)
    assert isinstance(traced, replay.Flat)
    _assert_tree_bits(replay.unflatten(traced), want)


def test_flat_buffers_sharded_across_devices_replay_exactly():
    """A flat buffer split across the (forced) CPU devices replays through the jnp rule, which XLA
    partitions; the bits are the unsharded tree's, and the result keeps the sharding."""
    devices = jax.devices()
    tree = {"w": _values(21, (len(devices) * 9, 3), np.float32), "b": _values(22, (len(devices) * 5,), np.float32)}
    flat = replay.flatten(tree)
    sharding = NamedSharding(Mesh(np.array(devices), ("x",)), P("x"))
    sharded = jax.device_put(flat, sharding)
    updates = [(rng.sample_key(3, 1, 0, s), 0.02 * (s + 1)) for s in range(2)]
    out = replay.replay(sharded, updates, donate=True)
    if len(devices) > 1:
        assert out.buffers[0].sharding.is_equivalent_to(sharding, 1)
    _assert_tree_bits(replay.unflatten(out), _reference(tree, updates, "binomial"))
