"""Dispatch: a leaf, a pytree or a flat layout to the implementation for its platform."""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from zeroth import noise as _noise
from zeroth import rng as _rng
from zeroth import rule as _rule
from zeroth.kernels.perturb import common as _common
from zeroth.kernels.perturb import native as _native
from zeroth.kernels.perturb import pallas as _pallas
from zeroth.kernels.perturb import plans as _plans


def perturb_leaf(
    x,
    leaf_keys_,
    scales,
    *,
    distribution: str = "binomial",
    offset: int = 0,
    impl: str = "auto",
    inplace: bool = False,
    block_sizes: _plans.BlockSizes | None = None,
    interpret: bool = False,
    platform: str | None = None,
) -> jax.Array:
    """Apply K updates to one array with the implementation ``impl`` (see :func:`resolve_impl`).

    Args:
      x: the leaf, any shape, f32 / bf16 / f16.
      leaf_keys_: ``u32[K, 2]`` leaf keys (:func:`leaf_keys` of the sample keys and the leaf id).
      scales: ``f32[K]`` host-rounded scales (:func:`zeroth.replay.update_scales`).
      distribution: ``"binomial"`` or ``"rademacher"``.
      offset: global flat index of ``x[0]`` in its leaf (a shard's or a slice's position).
      impl: ``"auto"``, ``"pallas"``, ``"native"`` or ``"jnp"``.
      inplace: let the output reuse ``x``'s buffer (only useful when ``x`` is donated).
      block_sizes, interpret: Pallas settings.
      platform: where ``x`` lives (:func:`zeroth.rule.default_platform` when None): picks ``"auto"``'s
        implementation and the Pallas lowering.

    Returns:
      The updated array (same shape and dtype), bit-identical for every ``impl``.
    """
    impl = _plans.resolve_impl(impl, platform, int(np.shape(leaf_keys_)[0]), jnp.result_type(x))
    if impl == "native":
        return _native.perturb_native(x, leaf_keys_, scales, distribution=distribution, offset=offset, inplace=inplace)
    if impl == "pallas":
        return _pallas.perturb_pallas(
            x,
            leaf_keys_,
            scales,
            distribution=distribution,
            offset=offset,
            block_sizes=block_sizes,
            interpret=interpret,
            inplace=inplace,
            platform=platform,
        )
    return _common.perturb_reference(x, leaf_keys_, scales, distribution=distribution, offset=offset)


@functools.lru_cache(maxsize=None)
def _process_platforms() -> tuple[str, ...]:
    """The jax platforms of this process that have devices (``"cpu"``, ``"cuda"``, ``"rocm"``, ``"tpu"``)."""
    found = []
    for name in ("cpu", "cuda", "rocm", "tpu"):
        try:
            if jax.devices(name):
                found.append(name)
        except RuntimeError:  # no such backend in this process
            pass
    return tuple(found)


def _keys_and_scales(keys, scales) -> tuple[jax.Array, jax.Array]:
    """``(u32[K, 2], f32[K])`` of the sample keys and scales of K updates; a count mismatch is an error."""
    keys = jnp.asarray(keys, jnp.uint32).reshape(-1, 2)
    scales = jnp.asarray(scales, jnp.float32).reshape(-1)
    if scales.shape[0] != keys.shape[0]:
        raise ValueError(f"{keys.shape[0]} keys but {scales.shape[0]} scales")
    return keys, scales


def _by_platform(run, arrays, keys, scales, *, impl: str, platform: str | None):
    """``run(arrays, keys, scales, platform=...)`` for the platform the computation is lowered for:
    the named ``platform`` or ``impl``, the process's only platform, else one branch per platform
    (``jax.lax.platform_dependent``, the host CPU's as default)."""
    platforms = _process_platforms()
    if impl != "auto" or platform is not None or len(platforms) <= 1:
        fixed = platform if platform is not None else (platforms[0] if len(platforms) == 1 else None)
        return run(arrays, keys, scales, platform=fixed)
    branches = {name: functools.partial(run, platform=name) for name in platforms}
    return jax.lax.platform_dependent(arrays, keys, scales, **branches, default=functools.partial(run, platform="cpu"))


def apply_updates(
    params: Any,
    keys,
    scales,
    *,
    distribution: str = "binomial",
    impl: str = "auto",
    inplace: bool = False,
    block_sizes: _plans.BlockSizes | None = None,
    interpret: bool = False,
    platform: str | None = None,
    per_leaf: bool = False,
    leaf_keys: jax.Array | None = None,
) -> Any:
    """Traceable: :func:`zeroth.replay.apply_updates` through the fused kernels, same bits.

    With ``impl="auto"`` and no ``platform``, the implementation is chosen when the computation is
    lowered, for the devices it runs on (``jax.lax.platform_dependent`` over the platforms this
    process has; a CPU-only process has one and traces one path): parameters on the host CPU of a
    GPU machine get the CPU kernel, parameters on the GPU the GPU path.

    Args:
      params: pytree of f32 / bf16 / f16 arrays.
      keys: ``u32[K, 2]`` sample keys (may be traced).
      scales: ``f32[K]`` host-rounded scales (may be traced).
      distribution: ``"binomial"`` or ``"rademacher"``.
      impl, inplace, block_sizes, interpret, platform: see :func:`perturb_leaf`; pass
        ``inplace=True`` only where ``params`` is donated; ``platform`` fixes where the parameters
        live instead of choosing at lowering.
      per_leaf: keep the updated leaves apart (same bits), for use inside a larger program (a ZO
        step's forward passes), so that XLA computes each updated leaf just before its first use
        and frees it after its last. The native kernel then runs one launch per leaf instead of
        one for the whole tree, which would hold every updated leaf at once, a whole copy of the
        parameters. With the jnp rule or Pallas, each leaf of at least :data:`APART_MIN_BYTES`
        reads its keys through an optimization barrier of its own: the table of every leaf's keys
        is the one array its update would share with the others' (the scales are scalars), and
        XLA's GPU multi-output fusion merges updates that share an operand into one kernel whose
        outputs are all live at once (a perturbed copy of every large leaf at once).
      leaf_keys: ``u32[L, K, 2]``, the leaves' keys in tree order (:func:`leaf_key_table` of
        ``keys`` and the leaves' ids), derived by the caller: a ZO estimator derives those of all its
        evaluations once, before its loop, instead of once per evaluation. ``None`` (the default)
        derives them here. The native kernel derives its own and ignores them.

    Returns:
      The updated pytree (same structure, dtypes and shapes).
    """
    _noise.check_distribution(distribution)
    keys, scales = _keys_and_scales(keys, scales)
    with_path, treedef = jax.tree_util.tree_flatten_with_path(params)
    for path, leaf in with_path:
        _rule.check_dtype(getattr(leaf, "dtype", None) or np.asarray(leaf).dtype, f"leaf {_rng.leaf_path(path)}")
    leaves = [jnp.asarray(leaf) for _, leaf in with_path]
    ids = [_rng.leaf_id(path) for path, _ in with_path]
    if leaf_keys is not None and tuple(np.shape(leaf_keys)) != (len(leaves), keys.shape[0], 2):
        raise ValueError(
            f"leaf_keys must be u32[L, K, 2] = {[len(leaves), keys.shape[0], 2]} for these "
            f"{len(leaves)} leaves and {keys.shape[0]} keys, got shape {list(np.shape(leaf_keys))}"
        )
    run = functools.partial(
        _apply_leaves,
        ids=ids,
        distribution=distribution,
        impl=impl,
        inplace=inplace,
        block_sizes=block_sizes,
        interpret=interpret,
        per_leaf=per_leaf,
        given=leaf_keys,
    )
    return jax.tree_util.tree_unflatten(treedef, _by_platform(run, leaves, keys, scales, impl=impl, platform=platform))


APART_MIN_BYTES = 1 << 20
"""With ``per_leaf``, the jnp rule and the Pallas kernels update each leaf of at least this many
bytes from operands of its own (:func:`apply_updates`); smaller leaves may still share a fusion."""


def _apply_leaves(
    leaves, keys, scales, *, ids, distribution, impl, inplace, block_sizes, interpret, platform, per_leaf, given=None
):
    """The updated ``leaves`` with the implementation for ``platform`` (see :func:`apply_updates`);
    on a TPU each leaf's dtype may take it to the jnp rule (:data:`zeroth.rule.MOSAIC_REFUSES`)."""
    requested, impl = impl, _plans.resolve_impl(impl, platform, keys.shape[0])
    if impl == "native" and per_leaf:  # one launch per leaf, leaf keys derived inside the kernel
        return [
            _native.perturb_native_tree([leaf], keys, scales, [lid], distribution=distribution, inplace=inplace)[0]
            for leaf, lid in zip(leaves, ids)
        ]
    if impl == "native":  # every leaf in one launch, leaf keys derived inside the kernel
        return _native.perturb_native_tree(leaves, keys, scales, ids, distribution=distribution, inplace=inplace)
    # every leaf's keys in one computation per call: derived leaf by leaf, each would be an op of
    # its own before the leaf's (on a GPU, a kernel launch per leaf; ZO estimator, transformer at
    # the default width, batch 256: 437 ops per call against 573 on a CPU)
    all_keys = given if given is not None else (_common._all_leaf_keys(keys, ids) if ids else None)

    def update(i, leaf):
        leaf_impl = _plans.resolve_impl(requested, platform, keys.shape[0], leaf.dtype)
        leaf_keys_, offset = all_keys[i], 0
        if per_leaf and leaf.size * leaf.dtype.itemsize >= APART_MIN_BYTES:
            leaf_keys_, zero = _keys_apart(all_keys, i)
            if leaf_impl == "jnp":  # the Pallas kernel takes a static offset
                offset = zero
        return perturb_leaf(
            leaf,
            leaf_keys_,
            scales,
            distribution=distribution,
            offset=offset,
            impl=leaf_impl,
            inplace=inplace,
            block_sizes=block_sizes,
            interpret=interpret,
            platform=platform,
        )

    return [update(i, leaf) for i, leaf in enumerate(leaves)]


def _keys_apart(all_keys: jax.Array, i: int) -> tuple[jax.Array, jax.Array]:
    """``(keys, zero)``: leaf ``i``'s keys, read from ``all_keys`` through an optimization barrier
    of their own, and a ``u32[]`` zero that XLA cannot see, from the same barrier, for the leaf's
    element offset (:data:`APART_MIN_BYTES`), so that its update shares no array with the other
    leaves'.

    The index ``i`` passes the barrier with the table, and what comes out is read: the keys are
    ``table[i] + (j - i)`` and the zero ``j - i``. XLA merges barriers of the same operands into
    one and drops the outputs that nothing reads, so without ``j`` every leaf's barrier would be
    one again; the table is sliced at the constant ``i``, which fuses into the leaf's update
    (sliced at ``j``, the keys were a kernel of their own per leaf). With the jnp rule the zero is
    the leaf's offset: the element indices of leaves of one shape are otherwise the same arrays
    (one iota), which XLA computes once and shares, and sharing them makes the leaves' updates
    siblings that its GPU multi-output fusion merges again (SmolLM2's 30 perturbed [576, 576]
    weights, one per layer, in one kernel). The leaf stays out of the barrier: one sliced from a
    shared buffer (``replay.Flat``) would be copied to pass it."""
    table, j = jax.lax.optimization_barrier((all_keys, jnp.uint32(i)))
    zero = j - jnp.uint32(i)
    return table[i] + zero, zero


def apply_updates_flat(
    buffers,
    keys,
    scales,
    segments,
    *,
    distribution: str = "binomial",
    impl: str = "auto",
    inplace: bool = False,
    block_sizes: _plans.BlockSizes | None = None,
    interpret: bool = False,
    platform: str | None = None,
) -> list[jax.Array]:
    """Traceable: K updates applied to leaves laid out as segments of flat buffers, same bits as
    :func:`apply_updates` on the leaves themselves.

    Args:
      buffers: 1-D f32 / bf16 / f16 arrays.
      keys: ``u32[K, 2]`` sample keys; scales: ``f32[K]`` host-rounded scales (may be traced).
      segments: one tuple per buffer of ``(offset, size, leaf_id)`` int triples (static): the
        leaf with id ``leaf_id`` is ``buffer[offset : offset + size]`` flattened row-major, and
        its noise counter ``i`` is its own flat index (0 at ``offset``).
      distribution, impl, inplace, block_sizes, interpret, platform: see :func:`apply_updates`.
        Each buffer is **one launch** whatever its number of segments on CPU (the native
        kernel, :func:`perturb_native_flat`), on GPU (one Triton kernel over the tiles of
        every segment, :func:`perturb_pallas_flat`; ``impl="auto"`` takes it for every K, since
        the jnp rule would launch one fusion per segment) and on TPU (one Mosaic kernel over
        fixed blocks, :func:`perturb_pallas_flat`, for a buffer of whole blocks,
        :func:`tpu_flat_fits`, as :func:`zeroth.replay.flatten` makes them on a TPU); the
        leaf keys of every segment of every buffer are derived once per call. On the jnp path,
        and for a TPU buffer not in whole blocks, each segment is updated on its slice
        (:func:`perturb_leaf`) and written back in place. Elements outside every segment keep
        their bits.

    Returns:
      The updated buffers (same shapes and dtypes).
    """
    _noise.check_distribution(distribution)
    keys, scales = _keys_and_scales(keys, scales)
    buffers = [jnp.asarray(b) for b in buffers]
    if len(segments) != len(buffers):
        raise ValueError(f"{len(buffers)} buffers but {len(segments)} segment tables")
    for i, b in enumerate(buffers):
        _rule.check_dtype(b.dtype, f"flat buffer {i}")
        if b.ndim != 1:
            raise ValueError(f"flat buffer {i} must be 1-D, got shape {b.shape}")
    segments = tuple(
        _common._check_segments(seg, b.shape[0], f"flat buffer {i}")
        for i, (b, seg) in enumerate(zip(buffers, segments))
    )
    run = functools.partial(
        _apply_flat,
        segments=segments,
        distribution=distribution,
        impl=impl,
        inplace=inplace,
        block_sizes=block_sizes,
        interpret=interpret,
    )
    return _by_platform(run, buffers, keys, scales, impl=impl, platform=platform)


def _apply_flat(buffers, keys, scales, *, segments, distribution, impl, inplace, block_sizes, interpret, platform):
    """The updated ``buffers`` with the implementation for ``platform`` (see :func:`apply_updates_flat`)."""
    platform = _rule.default_platform() if platform is None else _rule.platform_name(platform)
    # On GPU the flat kernel is one launch for every K; the jnp rule would be one fusion per segment.
    n_updates = None if platform == "gpu" else keys.shape[0]
    requested, impl = impl, _plans.resolve_impl(impl, platform, n_updates)
    if impl == "native":  # one launch per buffer, leaf keys derived inside the kernel
        return [
            _native.perturb_native_flat(b, keys, scales, seg, distribution=distribution, inplace=inplace)
            for b, seg in zip(buffers, segments)
        ]
    ids = [lid for seg in segments for _, _, lid in seg]
    all_keys = _common._all_leaf_keys(keys, ids) if ids else None  # every segment's leaf keys, once per call
    out, first = [], 0
    for b, seg in zip(buffers, segments):
        seg_keys, first = (all_keys[first : first + len(seg)] if seg else None), first + len(seg)
        buffer_impl = _plans.resolve_impl(requested, platform, n_updates, b.dtype)  # a float16 buffer on a TPU: jnp
        if (
            buffer_impl == "pallas"
            and b.shape[0] <= _plans._FLAT_MAX_ELEMENTS
            and (platform != "tpu" or _plans.tpu_flat_fits(b.shape[0], b.dtype, block_sizes))
        ):
            out.append(
                b
                if not seg
                else _pallas.perturb_pallas_flat(
                    b,
                    seg_keys,
                    scales,
                    seg,
                    distribution=distribution,
                    block_sizes=block_sizes,
                    interpret=interpret,
                    inplace=inplace,
                    platform=platform,
                )
            )
            continue
        for j, (o, z, _) in enumerate(seg):  # the jnp rule, a TPU buffer not in whole blocks: segment by segment
            new = perturb_leaf(
                jax.lax.slice(b, (o,), (o + z,)),
                seg_keys[j],
                scales,
                distribution=distribution,
                impl=buffer_impl,
                block_sizes=block_sizes,
                interpret=interpret,
                platform=platform,
            )
            b = jax.lax.dynamic_update_slice(b, new, (o,))
        out.append(b)
    return out


def pack_updates(keys: np.ndarray, scales: np.ndarray) -> np.ndarray:
    """``u32[K, 3]``: the sample keys ``u32[K, 2]`` and the bits of their float32 scales ``f32[K]``
    side by side, so that a call sends its updates to the device in one transfer, not two
    (:func:`unpack_updates` inside the compiled call gives both back, bit for bit)."""
    return np.concatenate([keys.reshape(-1, 2), scales.reshape(-1, 1).view(np.uint32)], axis=1)


def unpack_updates(packed: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Traceable inverse of :func:`pack_updates`: ``(u32[K, 2] keys, f32[K] scales)``."""
    return packed[:, :2], jax.lax.bitcast_convert_type(packed[:, 2], jnp.float32)


@functools.partial(jax.jit, static_argnames=("distribution", "impl", "platform"), donate_argnums=(0,))
def _fused_donated(params, packed, distribution, impl, platform):
    keys, scales = unpack_updates(packed)
    return apply_updates(params, keys, scales, distribution=distribution, impl=impl, inplace=True, platform=platform)


@functools.partial(jax.jit, static_argnames=("distribution", "impl", "platform"))
def _fused_copy(params, packed, distribution, impl, platform):
    keys, scales = unpack_updates(packed)
    return apply_updates(params, keys, scales, distribution=distribution, impl=impl, inplace=False, platform=platform)


def fused_apply_updates(
    params: Any, keys, scales, *, distribution: str = "binomial", donate: bool = False, impl: str = "auto"
) -> Any:
    """Host entry: apply K updates with already-rounded scales to a pytree, fused and jitted.

    Same semantics and bits as :func:`zeroth.replay.apply_updates`; each leaf is read and written
    once for all K updates (native and Pallas paths). The implementation follows the devices the
    parameters live on, not the default backend (:func:`apply_updates`): parameters on the CPU of
    a GPU machine replay with the native CPU kernel. With ``impl="auto"``, parameters split
    across several devices go through the ``jnp`` path, which XLA partitions shard by shard (the
    fused kernels see whole leaves: under ``jit`` a custom call on a sharded leaf would gather it).

    Args:
      params: pytree of f32 / bf16 / f16 arrays.
      keys: ``u32[K, 2]`` sample keys (NumPy or jax).
      scales: ``f32[K]``, from :func:`zeroth.replay.update_scales` (host-rounded).
      distribution: ``"binomial"`` or ``"rademacher"``.
      donate: update the buffers in place (``params`` must not be used afterwards).
      impl: ``"auto"`` (default), ``"native"``, ``"pallas"`` or ``"jnp"``.

    Example:
      >>> from zeroth import rng, replay
      >>> keys = rng.sample_keys(1, [(0, 5, s) for s in range(4)])
      >>> q = fused_apply_updates({"b": jnp.ones(7)}, keys, replay.update_scales("rademacher", [0.1] * 4),
      ...                         distribution="rademacher")
    """
    _noise.check_distribution(distribution)
    keys_np = np.asarray(keys)
    if keys_np.dtype != np.uint32 or keys_np.ndim not in (1, 2) or keys_np.shape[-1] != 2:
        raise ValueError(
            f"keys must be uint32 of shape (2,) or (K, 2), got dtype {keys_np.dtype} shape {keys_np.shape}"
        )
    keys_np = keys_np.reshape(-1, 2)
    scales_np = np.asarray(scales)
    if scales_np.dtype != np.float32 or scales_np.reshape(-1).shape[0] != keys_np.shape[0]:
        raise ValueError(
            f"scales must be float32 with one per key ({keys_np.shape[0]}), from zeroth.replay.update_scales; "
            f"got dtype {scales_np.dtype} shape {scales_np.shape}"
        )
    if impl == "auto" and _multi_device() and _is_sharded(params):
        impl = "jnp"  # XLA partitions the elementwise reference; a custom call would gather the leaf
    elif impl != "auto":
        impl = _plans.resolve_impl(impl, _plans.platform_of(params), keys_np.shape[0])
    fn = _fused_donated if donate else _fused_copy
    return fn(params, pack_updates(keys_np, scales_np), distribution, impl, None)


@functools.lru_cache(maxsize=None)
def _multi_device() -> bool:
    """Whether some platform of this process has several devices (so a leaf can be sharded)."""
    return any(len(jax.devices(name)) > 1 for name in _process_platforms())


def _is_sharded(params: Any) -> bool:
    """Whether some leaf is split across several devices (not merely replicated)."""
    for leaf in jax.tree_util.tree_leaves(params):
        sharding = getattr(leaf, "sharding", None)
        if sharding is not None and len(sharding.device_set) > 1 and not sharding.is_fully_replicated:
            return True
    return False


def is_sharded(params: Any) -> bool:
    """Whether some leaf of ``params`` is split across several devices of this process (then
    ``impl="auto"`` replays through the ``jnp`` path, which XLA partitions shard by shard)."""
    return _multi_device() and _is_sharded(params)
