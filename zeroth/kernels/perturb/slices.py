"""Slices chosen at run time: a layer of a stacked leaf and rows of a table, perturbed alone."""

from __future__ import annotations


import jax
import jax.numpy as jnp
import numpy as np

from zeroth import rule as _rule
from zeroth.kernels import cpu_native
from zeroth.kernels.perturb import common as _common
from zeroth.kernels.perturb import plans as _plans


def _slice_start(start, m: int, size: int) -> jax.Array:
    if m > size:
        raise ValueError(f"a slice of {m} elements does not fit in a leaf of {size}")
    if isinstance(start, (int, np.integer)) and not isinstance(start, bool) and not 0 <= int(start) <= size - m:
        raise ValueError(f"slice start {int(start)} + {m} elements leaves the leaf of {size} elements")
    return jnp.asarray(start).astype(jnp.uint32).reshape(())


def perturb_native_slice(
    x,
    leaf_keys_,
    scales,
    start,
    shape: tuple[int, ...],
    *,
    distribution: str = "binomial",
    base: int = 0,
    size: int | None = None,
    build: cpu_native.BuildConfig = cpu_native.DEFAULT_BUILD,
) -> jax.Array:
    """The native CPU kernel on one slice of a leaf whose start is known only at run time.

    ``out = perturb(x.reshape(-1)[start : start + m]).reshape(shape)`` (``m = prod(shape)``), each
    element with the noise of its global index ``start + j``: exactly the bits of the whole leaf's
    update at those positions. The kernel reads the slice where it lies in ``x`` (no copy of it).

    Args:
      x: the whole leaf (f32 / bf16 / f16, any shape), e.g. stacked layers ``[L, ...]``; or, with
        ``base``, a buffer holding the leaf in its elements ``[base, base + size)`` (a
        :class:`zeroth.replay.Flat`'s shared buffer), read where the leaf lies in it.
      leaf_keys_: ``u32[K, 2]`` leaf keys; scales: ``f32[K]`` host-rounded scales.
      start: flat index of the slice's first element in the leaf (a traced ``u32[]`` or an int); a
        slice that leaves the leaf (with ``base``: that ends past ``base + size`` in the buffer)
        is a run-time error of the kernel.
      shape: the slice's shape (static).
      base, size: where the leaf lies in ``x`` (static; default the whole of ``x``).
    """
    x, keys, scales = _common._check_args(x, leaf_keys_, scales, distribution)
    shape = tuple(int(d) for d in shape)
    base, size = _leaf_in(x, base, size)
    start = _slice_start(start, int(np.prod(shape, dtype=np.int64)), size)
    _common._check_offset(0, size)
    cpu_native.register(build)
    call = jax.ffi.ffi_call(cpu_native.target_name(build, sliced=True), jax.ShapeDtypeStruct(shape, x.dtype))
    # the kernel reads from element start + base of x, with the noise of index (start + base) - base
    at = start + jnp.uint32(base) if base else start
    return call(
        x,
        keys,
        scales,
        at.reshape(1),
        distribution=np.int32(_plans._DIST_CODE[distribution]),
        offset=np.int64(-base),
        end=np.int64(base + size),
    )


def _leaf_in(x, base: int, size: int | None) -> tuple[int, int]:
    """``(base, size)`` of a leaf lying in the elements ``[base, base + size)`` of ``x`` (static
    ints; ``size`` None: up to the end of ``x``), checked against ``x``."""
    n = int(np.size(x))
    size = n - base if size is None else size
    for name, v in (("base", base), ("size", size)):
        if isinstance(v, bool) or not isinstance(v, (int, np.integer)) or v < 0:
            raise ValueError(f"{name} must be a non-negative int (elements), got {v!r}")
    if base + size > n:
        raise ValueError(f"a leaf of {size} elements from element {base} leaves x of {n} elements")
    return int(base), int(size)


def perturb_slice(
    x,
    leaf_keys_,
    scales,
    start,
    shape: tuple[int, ...],
    *,
    distribution: str = "binomial",
    impl: str = "auto",
    platform: str | None = None,
    base: int = 0,
    size: int | None = None,
) -> jax.Array:
    """One slice of an updated leaf, its start known only at run time (traceable).

    Bit-identical to ``perturb_leaf(x, ...).reshape(-1)[start : start + m].reshape(shape)``
    (``m = prod(shape)``) without building the rest of the updated leaf: the noise of element
    ``j`` of the slice is that of global index ``start + j``. Inside a ``lax.scan`` over stacked
    layers, ``start = i · m`` gives layer ``i``'s updated weights just before it runs.

    Implementations: the native CPU kernel (reads the slice in place, :func:`perturb_native_slice`),
    elsewhere the jnp rule on ``lax.dynamic_slice`` of the leaf with a run-time offset (the Pallas
    kernel takes static offsets only, so ``"pallas"`` runs the jnp rule here too). The caller keeps
    ``start + m <= size`` (the leaf's size): the native kernel refuses a slice outside the leaf,
    and the jnp rule clamps its start to ``size - m`` (the leaf's last ``m`` elements, data and
    noise alike), as XLA's dynamic slice clamps, so it never reads past the leaf either.

    With ``base`` (and ``size``), ``x`` is a buffer holding the leaf in its elements ``[base, base
    + size)``, a :class:`zeroth.replay.Flat`'s shared buffer: the slice is read there, with the
    noise of the leaf's own indices. Inside a scan the buffer is then what the loop reads, where a
    slice of it taken outside the loop is a copy of the whole leaf, held for the whole loop.

    Args:
      x: the whole leaf, or a buffer holding it (``base``, ``size``); ``leaf_keys_``: ``u32[K, 2]``;
        scales: ``f32[K]``.
      start: ``u32[]`` (or int) flat index of the slice's first element in the leaf.
      shape: the slice's shape (static).
      distribution, impl, platform: as for :func:`perturb_leaf`.
      base, size: where the leaf lies in ``x`` (static ints; default: the whole of ``x``).
    """
    impl = _plans.resolve_impl(impl, platform, int(np.shape(leaf_keys_)[0]))
    if impl == "native":
        return perturb_native_slice(
            x, leaf_keys_, scales, start, shape, distribution=distribution, base=base, size=size
        )
    x = jnp.asarray(x)
    base, size = _leaf_in(x, base, size)
    _common._check_offset(0, size)  # every global index fits in 32 bits
    shape = tuple(int(d) for d in shape)
    m = int(np.prod(shape, dtype=np.int64))
    # clamped to the leaf (the noise's indices too), as the dynamic slice alone clamps to x only
    start = jnp.minimum(_slice_start(start, m, size), jnp.uint32(size - m))
    piece = jax.lax.dynamic_slice(x.reshape(-1), (start + jnp.uint32(base) if base else start,), (m,))
    return _common.perturb_reference(piece, leaf_keys_, scales, distribution=distribution, offset=start).reshape(shape)


def perturb_rows(table, leaf_keys_, scales, ids, *, distribution: str = "binomial") -> jax.Array:
    """Rows of an updated leaf: ``perturb_leaf(table, ...)[ids]`` without the other rows (traceable).

    The jnp rule on the gathered rows, each element with the noise of its global index
    ``ids[...] · r + j`` (``r`` elements per row): an embedding lookup perturbs the rows it reads,
    not the whole table.

    Args:
      table: the whole leaf ``[V, ...]`` (f32 / bf16 / f16).
      leaf_keys_: ``u32[K, 2]`` leaf keys; scales: ``f32[K]`` host-rounded scales.
      ids: integer row indices in ``[0, V)`` (any shape; the caller normalises them).

    Returns:
      ``ids.shape + table.shape[1:]``, the dtype of ``table``.
    """
    table, keys, scales = _common._check_args(table, leaf_keys_, scales, distribution)
    if table.ndim < 1:
        raise ValueError(f"rows of a 0-d leaf: the table must have at least one axis, got shape {table.shape}")
    _common._check_offset(0, table.size)
    ids = jnp.asarray(ids)
    if not jnp.issubdtype(ids.dtype, jnp.integer):
        raise ValueError(f"row ids must be integers, got dtype {ids.dtype}")
    row_shape = table.shape[1:]
    r = int(np.prod(row_shape, dtype=np.int64))
    within_row = jax.lax.iota(jnp.uint32, r).reshape((1,) * ids.ndim + row_shape)
    idx = ids.astype(jnp.uint32).reshape(ids.shape + (1,) * len(row_shape)) * jnp.uint32(r) + within_row
    call = idx >> _plans._LOG2_PER_CALL[distribution]
    within = idx & jnp.uint32(_plans._PER_CALL[distribution] - 1)
    p32 = _rule.flush_tiny(table[ids].astype(jnp.float32))

    def body(u, p):
        return _common._update_block(p, call, within, keys[u, 0], keys[u, 1], scales[u], distribution)

    if keys.shape[0] == 1:
        p32 = body(0, p32)
    elif keys.shape[0] > 1:
        p32 = jax.lax.fori_loop(0, keys.shape[0], body, p32)
    return _rule.cast_flushed(p32, table.dtype)
