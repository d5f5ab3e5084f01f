"""The Pallas kernels for GPUs (Triton) and TPUs: a leaf in tiles, and the segments of a flat buffer."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl

from zeroth import noise as _noise
from zeroth import rule as _rule
from zeroth.kernels import out_struct, triton_params
from zeroth.kernels.perturb import common as _common
from zeroth.kernels.perturb import mosaic as _mosaic
from zeroth.kernels.perturb import plans as _plans


def _perturb_kernel(
    keys_ref,
    scales_ref,
    x_ref,
    o_ref,
    *,
    distribution: str,
    n_updates: int,
    offset: int,
    grouped: bool,
    flat_keys: bool = False,
):
    """One tile; ``flat_keys``: the keys come as ``u32[2K]`` (TPU: SMEM pads a 2-D array's rows to
    128 words, so ``u32[K, 2]`` took 512 bytes per update, 32 KiB at K = 64, more than a TPU v3's
    16 KiB of SMEM; a TPU v4 or v5e failed to compile K = 4096: 2 MiB of its 1 MiB)."""
    rows, width = x_ref.shape
    base = jnp.uint32(offset) + pl.program_id(0).astype(jnp.uint32) * jnp.uint32(rows * width)
    log2 = _plans._LOG2_PER_CALL[distribution]
    if grouped:  # one row = one threefry call: hash a column, broadcast along the row
        call = (base >> log2) + jax.lax.broadcasted_iota(jnp.uint32, (rows, 1), 0)
        within = jax.lax.broadcasted_iota(jnp.uint32, (1, width), 1)
    else:
        idx = (
            base
            + jax.lax.broadcasted_iota(jnp.uint32, (rows, width), 0) * jnp.uint32(width)
            + jax.lax.broadcasted_iota(jnp.uint32, (rows, width), 1)
        )
        call = idx >> log2
        within = idx & jnp.uint32(_plans._PER_CALL[distribution] - 1)
    p32 = _rule.flush_tiny(x_ref[...].astype(jnp.float32))

    def body(u, p):
        k0, k1 = (keys_ref[2 * u], keys_ref[2 * u + 1]) if flat_keys else (keys_ref[u, 0], keys_ref[u, 1])
        return _common._update_block(p, call, within, k0, k1, scales_ref[u], distribution)

    if n_updates:
        p32 = jax.lax.fori_loop(0, n_updates, body, p32)
    o_ref[...] = _rule.cast_flushed(p32, o_ref.dtype)


def _pallas_tiles(x2d, keys, scales, plan: _plans.TilePlan, *, distribution, offset, interpret, inplace, platform):
    """Run the kernel over the first ``plan.tiles`` whole tiles of the ``(rows, width)`` array ``x2d``."""
    n_updates = keys.shape[0]
    compiler_params = None
    flat_keys = platform == "tpu"
    if flat_keys:  # interpret mode too, so that the tests run the TPU's indexing
        keys = keys.reshape(-1)
    if platform == "tpu" and not interpret:
        from jax.experimental.pallas import tpu as pltpu

        key_spec = scale_spec = pl.BlockSpec(memory_space=pltpu.SMEM)
    else:
        if platform == "gpu":
            if not interpret:
                compiler_params = triton_params()
            # Triton blocks are powers of two: pad K (the padding is never read).
            k_pad = pl.next_power_of_2(max(1, n_updates))
            keys = jnp.pad(keys, ((0, k_pad - n_updates), (0, 0)))
            scales = jnp.pad(scales, (0, k_pad - n_updates))
        key_spec = pl.BlockSpec(keys.shape, lambda i: (0,) * keys.ndim)
        scale_spec = pl.BlockSpec(scales.shape, lambda i: (0,))
    kernel = functools.partial(
        _perturb_kernel,
        distribution=distribution,
        n_updates=n_updates,
        offset=offset,
        grouped=plan.grouped,
        flat_keys=flat_keys,
    )
    tile_spec = pl.BlockSpec((plan.tile_rows, plan.width), lambda i: (i, 0))
    return pl.pallas_call(
        kernel,
        out_shape=out_struct(x2d.shape, x2d.dtype, x2d, keys, scales),
        grid=(plan.tiles,),
        in_specs=[key_spec, scale_spec, tile_spec],
        out_specs=tile_spec,
        input_output_aliases={2: 0} if inplace else {},
        interpret=interpret,
        compiler_params=compiler_params,
        name="zeroth_fused_replay",
    )(keys, scales, x2d)


def _pallas_target(
    platform: str | None, interpret: bool, block_sizes: _plans.BlockSizes | None, dtype=None
) -> tuple[str, _plans.BlockSizes]:
    """The platform a Pallas kernel is lowered for and its tiles (the platform's default when
    None), for a leaf of ``dtype`` (:func:`zeroth.rule.check_mosaic_dtype`)."""
    platform = _rule.default_platform() if platform is None else _rule.platform_name(platform)
    if platform == "cpu" and not interpret:
        raise ValueError(
            "the Pallas kernel runs on CPU only in interpret mode (tests): pass interpret=True, "
            "or use impl='native' or impl='jnp' on CPU"
        )
    if dtype is not None:
        _rule.check_mosaic_dtype(dtype, platform)
    return platform, _plans.default_block_sizes(platform) if block_sizes is None else block_sizes


def perturb_pallas(
    x,
    leaf_keys_,
    scales,
    *,
    distribution: str = "binomial",
    offset: int = 0,
    block_sizes: _plans.BlockSizes | None = None,
    interpret: bool = False,
    inplace: bool = False,
    platform: str | None = None,
) -> jax.Array:
    """The Pallas kernel on one leaf (see :func:`perturb_reference` for the arguments).

    The kernel touches whole tiles only (:func:`plan_tiles`); the ragged tail of fewer elements
    than a tile goes through :func:`perturb_reference` at its global offset (same bits). When the
    leaf's size is a multiple of the row length the kernel works on the leaf's own buffer (in
    place with ``inplace``) and the tail is written into it; otherwise the whole tiles are sliced
    out and the result is concatenated (one extra copy).

    Args:
      block_sizes: tiles (:func:`default_block_sizes` when None), checked for ``platform`` by
        :func:`check_block_sizes`. A grouped layout (``lanes=None``) needs ``offset`` to be a
        multiple of the elements per call; otherwise rows of 64 lanes are used (same bits).
      interpret: run in Pallas interpret mode (CPU tests).
      inplace: alias the output to ``x``'s buffer (use under ``jit`` with ``x`` donated).
      platform: the platform the kernel is lowered for (default :func:`zeroth.rule.default_platform`):
        ``"gpu"`` lowers through Triton (power-of-two blocks, keys padded to a power of two),
        ``"tpu"`` through Mosaic with keys and scales in SMEM.
    """
    x, keys, scales = _common._check_args(x, leaf_keys_, scales, distribution)
    offset = _common._check_offset(offset, x.size)
    platform, blocks = _pallas_target(platform, interpret, block_sizes, x.dtype)
    plan = _plans.plan_tiles(x.size, distribution, blocks, platform, offset)
    if plan.tiles == 0:
        return _common.perturb_reference(x, keys, scales, distribution=distribution, offset=offset)
    flat = x.reshape(-1)
    run = functools.partial(
        _pallas_tiles,
        keys=keys,
        scales=scales,
        plan=plan,
        distribution=distribution,
        offset=offset,
        interpret=interpret,
        platform=platform,
    )
    if plan.n % plan.width == 0:  # the leaf's own buffer as (rows, width): no copy
        out = run(flat.reshape(-1, plan.width), inplace=inplace).reshape(-1)
        if plan.tail:
            # Rows past the whole tiles are untouched: the input's values (aliased) or undefined.
            tail_in = out[plan.head :] if inplace else flat[plan.head :]
            tail = _common.perturb_reference(
                tail_in, keys, scales, distribution=distribution, offset=offset + plan.head
            )
            out = jax.lax.dynamic_update_slice(out, tail, (plan.head,))
    else:
        head = run(flat[: plan.head].reshape(-1, plan.width), inplace=True).reshape(-1)
        tail = _common.perturb_reference(
            flat[plan.head :], keys, scales, distribution=distribution, offset=offset + plan.head
        )
        out = jnp.concatenate([head, tail])
    return out.reshape(x.shape)


def _flat_kernel(
    table_ref,
    keys_ref,
    scales_ref,
    x_ref,
    o_ref,
    *,
    distribution: str,
    n_updates: int,
    tile_rows: int,
    width: int,
    grouped: bool,
    align: int,
    out_align: int = 0,
):
    """One work item (a row of :attr:`FlatTilePlan.table`): a masked tile of one segment, loaded
    and stored by element index, its noise named by the element's index in its leaf. With
    ``out_align`` > 0 the output holds the segments apart (:func:`perturb_pallas_segments`): a work
    item has a fifth column, where its tile starts in the output (a multiple of ``out_align``)."""
    from jax.experimental.pallas import triton as pltriton  # masked loads by index (Triton's)

    columns = 5 if out_align else 4
    i = pl.program_id(0) * columns
    segment, buffer_start, leaf_start, count = (table_ref[i + c] for c in range(4))
    if align > 1:  # known from the static table: lets Triton vectorise the loads and stores
        buffer_start = pl.multiple_of(buffer_start, align)
    pos = jax.lax.broadcasted_iota(jnp.int32, (tile_rows, width), 0) * width + jax.lax.broadcasted_iota(
        jnp.int32, (tile_rows, width), 1
    )
    mask = pos < count
    where = buffer_start + pos
    log2 = _plans._LOG2_PER_CALL[distribution]
    base = leaf_start.astype(jnp.uint32)
    if grouped:  # leaf_start is a multiple of the tile: row r is call (leaf_start >> log2) + r
        call = (base >> log2) + jax.lax.broadcasted_iota(jnp.uint32, (tile_rows, 1), 0)
        within = jax.lax.broadcasted_iota(jnp.uint32, (1, width), 1)
    else:
        idx = base + pos.astype(jnp.uint32)
        call = idx >> log2
        within = idx & jnp.uint32(_plans._PER_CALL[distribution] - 1)
    x = pltriton.load(x_ref.at[where], mask=mask, other=0)
    new = _common._segment_update(
        x, call, within, keys_ref, scales_ref, segment, n_updates=n_updates, distribution=distribution
    )
    if out_align:
        out_start = table_ref[i + 4]
        where = (pl.multiple_of(out_start, out_align) if out_align > 1 else out_start) + pos
    pltriton.store(o_ref.at[where], new, mask=mask)


def _flat_operands(buffer, segment_keys, scales, segments, distribution: str, what: str):
    """The checked operands of a flat kernel's call (:func:`perturb_pallas_flat`,
    :func:`perturb_pallas_segments`): ``(buffer, segments, segment_keys, scales, K)``, the buffer
    1-D in a float dtype of at most :data:`_FLAT_MAX_ELEMENTS` elements, the segments inside it
    (:func:`_check_segments`), the scales ``f32[K]``. Each caller checks the keys' shape."""
    _noise.check_distribution(distribution)
    buffer = jnp.asarray(buffer)
    _rule.check_dtype(buffer.dtype, "flat buffer")
    if buffer.ndim != 1:
        raise ValueError(f"the flat buffer must be 1-D, got shape {buffer.shape}")
    n = buffer.shape[0]
    if n > _plans._FLAT_MAX_ELEMENTS:
        raise ValueError(
            f"the flat Pallas kernel takes buffers of at most {_plans._FLAT_MAX_ELEMENTS} elements, got {n}"
        )
    segments = _common._check_segments(segments, n, what)
    segment_keys, scales = jnp.asarray(segment_keys), jnp.asarray(scales)
    n_updates = scales.shape[0] if scales.ndim == 1 else -1
    if scales.dtype != jnp.float32 or n_updates < 0:
        raise ValueError(f"scales must be f32[K], got dtype {scales.dtype} shape {scales.shape}")
    return buffer, segments, segment_keys, scales, n_updates


def _padded(segment_keys, scales, n_updates: int) -> tuple[jax.Array, jax.Array]:
    """The keys as one word vector and the scales, zero-size ones padded to one element (never
    read: no key or scale is read when K = 0, where a flat kernel still flushes and casts)."""
    return (jnp.pad(segment_keys.reshape(-1), (0, 0 if n_updates else 2)), jnp.pad(scales, (0, 0 if n_updates else 1)))


def perturb_pallas_flat(
    buffer,
    segment_keys,
    scales,
    segments,
    *,
    distribution: str = "binomial",
    block_sizes: _plans.BlockSizes | None = None,
    interpret: bool = False,
    inplace: bool = False,
    platform: str | None = None,
) -> jax.Array:
    """The Pallas kernel on every segment of one flat buffer in **one launch** (one
    ``pallas_call``: one Triton kernel on GPU, one Mosaic kernel on TPU), whatever the number of
    segments.

    Segment ``j = (offset, size, leaf_id)`` is a whole leaf stored at ``buffer[offset : offset +
    size]``; its element ``i`` gets the noise of counter ``i`` under the leaf keys
    ``segment_keys[j]``. Segments need no alignment and ragged ends need no second pass:

    * GPU (Triton): the grid runs over the tiles of every segment (:func:`plan_flat_tiles`), each
      loading and storing its elements by index under a mask.
    * TPU (Mosaic, which loads fixed blocks only): the buffer (:func:`tpu_flat_fits`) is viewed
      as rows of 128 lanes cut into whole blocks; the grid runs over (block, segment) work items
      (:func:`plan_tpu_flat_tiles`, a table prefetched into SMEM that also gives each step its
      block), each computing its segment's update on the block and keeping it where the element
      belongs to the segment. A block shared by several segments stays in VMEM while their items
      run back to back. Keys, scales and the table live in SMEM; a replay whose tables exceed
      :data:`_TPU_SMEM_WORDS` words (or half the chip's SMEM) is split into a few launches, in place.

    Same bits as :func:`perturb_pallas` on each leaf; elements outside every segment keep their bits.

    Args:
      buffer: a 1-D f32 / bf16 / f16 array of fewer than 2**31 elements.
      segment_keys: ``u32[S, K, 2]`` leaf keys of the S segments (:func:`leaf_keys` of the sample
        keys and each segment's leaf id, derived once per call).
      scales: ``f32[K]`` host-rounded scales.
      segments: ``(offset, size, leaf_id)`` int triples (static; not overlapping).
      distribution: ``"binomial"`` or ``"rademacher"``.
      block_sizes: tiles (:func:`default_block_sizes` when None), checked for ``platform``.
      interpret: run in Pallas interpret mode (CPU tests).
      inplace: alias the output to ``buffer`` (under ``jit`` with the buffer donated: no copy).
        Without it, a buffer whose segments leave gaps is aliased all the same (XLA copies it
        first), so the gaps keep their bits.
      platform: ``"gpu"`` (Triton), ``"tpu"`` (Mosaic), or in interpret mode any platform (TPU
        interpret mode: ``interpret=jax.experimental.pallas.tpu.InterpretParams()``).

    Returns:
      The updated buffer (same shape and dtype).
    """
    buffer, segments, segment_keys, scales, n_updates = _flat_operands(
        buffer, segment_keys, scales, segments, distribution, "perturb_pallas_flat"
    )
    if segment_keys.dtype != jnp.uint32 or segment_keys.shape != (len(segments), n_updates, 2):
        raise ValueError(
            f"segment keys must be u32[{len(segments)}, {n_updates}, 2] (segments, updates, key words), "
            f"got dtype {segment_keys.dtype} shape {segment_keys.shape}"
        )
    platform, blocks = _pallas_target(platform, interpret, block_sizes, buffer.dtype)
    keys_flat, scales = _padded(segment_keys, scales, n_updates)
    if platform == "tpu":
        return _mosaic._tpu_flat(
            buffer,
            keys_flat,
            scales,
            segments,
            n_updates=n_updates,
            distribution=distribution,
            blocks=blocks,
            interpret=interpret,
            inplace=inplace,
        )
    plan = _plans.plan_flat_tiles(segments, distribution, blocks, platform)
    if plan.table.shape[0] == 0:
        return buffer
    covered = sum(z for _, z, _ in segments) == buffer.shape[0]  # segments do not overlap: they cover every element
    table = jnp.asarray(plan.table.reshape(-1))
    whole = lambda a: pl.BlockSpec(a.shape, lambda i: (0,))  # noqa: E731 (the kernel indexes it)
    kernel = functools.partial(
        _flat_kernel,
        distribution=distribution,
        n_updates=n_updates,
        tile_rows=plan.tile_rows,
        width=plan.width,
        grouped=plan.grouped,
        align=plan.align,
    )
    return pl.pallas_call(
        kernel,
        out_shape=out_struct(buffer.shape, buffer.dtype, buffer, keys_flat, scales),
        grid=(plan.table.shape[0],),
        in_specs=[whole(table), whole(keys_flat), whole(scales), whole(buffer)],
        out_specs=whole(buffer),
        input_output_aliases={3: 0} if inplace or not covered else {},
        interpret=interpret,
        compiler_params=triton_params() if platform == "gpu" and not interpret else None,
        name="zeroth_fused_replay_flat",
    )(table, keys_flat, scales, buffer)


def perturb_pallas_segments(
    buffer,
    segment_keys,
    scales,
    segments,
    *,
    distribution: str = "binomial",
    block_sizes: _plans.BlockSizes | None = None,
    interpret: bool = False,
    platform: str | None = None,
) -> jax.Array:
    """The leaves stored at ``buffer[offset : offset + size]`` for each ``(offset, size, index)`` of
    ``segments``, with K updates applied, one after the other in a new 1-D array of their own (in
    the order of ``segments``), in **one launch** of the flat kernel (:func:`perturb_pallas_flat`'s,
    GPU only), which reads the leaves where they lie in the buffer (no copy of them or of it).

    A segment's keys are row ``index`` of ``segment_keys``: a ZO estimator passes every launch the
    same table of all its leaves' keys (:func:`leaf_key_table`) and each segment its own row, so
    that nothing is computed per leaf outside the kernel and launches of one shape are one kernel.
    Same bits as :func:`perturb_pallas_flat` on those segments and as :func:`perturb_reference`
    on each leaf (its element ``i`` takes noise counter ``i``).

    A kernel per leaf instead of the jnp rule's fused operations is what a GPU compiler handles
    quickly: each leaf's threefry graph is some 130 operations that XLA's fusion passes merge one by
    one, where a launch of this kernel is one custom call (the compile times are on the docs'
    measurement pages).

    Args:
      buffer: a 1-D f32 / bf16 / f16 array of fewer than 2**31 elements (one leaf's own, several
        leaves laid end to end, or a :class:`zeroth.replay.Flat` buffer).
      segment_keys: ``u32[L, K, 2]`` leaf keys.
      scales: ``f32[K]`` host-rounded scales.
      segments: ``(offset, size, index)`` int triples (static; not overlapping).
      distribution, block_sizes, interpret: see :func:`perturb_pallas_flat`.
      platform: ``"gpu"`` (Triton), or in interpret mode any platform but a TPU's (Mosaic loads
        fixed blocks only: there the jnp rule computes a leaf apart).

    Returns:
      The updated leaves laid end to end: ``sum(size)`` elements.
    """
    buffer, segments, segment_keys, scales, n_updates = _flat_operands(
        buffer, segment_keys, scales, segments, distribution, "perturb_pallas_segments"
    )
    rows = segment_keys.shape[0] if segment_keys.ndim == 3 else 0
    bad = [i for _, _, i in segments if not 0 <= i < rows]
    if segment_keys.dtype != jnp.uint32 or segment_keys.shape[1:] != (n_updates, 2) or bad:
        raise ValueError(
            f"segment keys must be u32[L, {n_updates}, 2] with a row for every segment's index "
            f"(rows {bad} are missing), got dtype {segment_keys.dtype} shape {segment_keys.shape}"
        )
    platform, blocks = _pallas_target(platform, interpret, block_sizes, buffer.dtype)
    if platform == "tpu":
        raise ValueError(
            "perturb_pallas_segments loads by element index (Triton's); on a TPU compute each leaf "
            "with perturb_reference"
        )
    total = sum(z for _, z, _ in segments)
    if total == 0:
        return buffer[:0]
    keys_flat, scales = _padded(segment_keys, scales, n_updates)  # K = 0 still flushes and casts
    plan = _plans.plan_flat_tiles(segments, distribution, blocks, platform)
    starts = np.cumsum([0] + [z for _, z, _ in segments])[:-1]
    table = np.concatenate([plan.table, (starts[plan.table[:, 0]] + plan.table[:, 2])[:, None]], axis=1)
    table[:, 0] = np.asarray([i for _, _, i in segments])[plan.table[:, 0]]
    out_align = 16
    while out_align > 1 and np.any(table[:, 4] % out_align):
        out_align //= 2
    return _segments_call(
        jnp.asarray(table.astype(np.int32).reshape(-1)),
        keys_flat,
        scales,
        buffer,
        size=total,
        distribution=distribution,
        n_updates=n_updates,
        tile_rows=plan.tile_rows,
        width=plan.width,
        grouped=plan.grouped,
        align=plan.align,
        out_align=out_align,
        interpret=interpret,
        platform=platform,
    )


@functools.partial(
    jax.jit,
    static_argnames=(
        "size",
        "distribution",
        "n_updates",
        "tile_rows",
        "width",
        "grouped",
        "align",
        "out_align",
        "interpret",
        "platform",
    ),
)
def _segments_call(
    table,
    keys_flat,
    scales,
    buffer,
    *,
    size,
    distribution,
    n_updates,
    tile_rows,
    width,
    grouped,
    align,
    out_align,
    interpret,
    platform,
):
    """The ``pallas_call`` of :func:`perturb_pallas_segments`, its work items an argument: every
    launch of one shape is then one traced and lowered function (jit's cache), which a program of
    many leaves lowers once (a ``pallas_call`` per leaf took 0.13 s each to lower to Triton)."""
    whole = lambda a: pl.BlockSpec(a.shape, lambda i: (0,))  # noqa: E731 (the kernel indexes it)
    kernel = functools.partial(
        _flat_kernel,
        distribution=distribution,
        n_updates=n_updates,
        tile_rows=tile_rows,
        width=width,
        grouped=grouped,
        align=align,
        out_align=out_align,
    )
    return pl.pallas_call(
        kernel,
        out_shape=out_struct((size,), buffer.dtype, buffer, keys_flat, scales, table),
        grid=(table.shape[0] // 5,),
        in_specs=[whole(table), whole(keys_flat), whole(scales), whole(buffer)],
        out_specs=pl.BlockSpec((size,), lambda i: (0,)),
        interpret=interpret,
        compiler_params=triton_params() if platform == "gpu" and not interpret else None,
        name="zeroth_perturbed_leaves",
    )(table, keys_flat, scales, buffer)
