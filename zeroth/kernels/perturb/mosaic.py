"""The flat kernel on TPU (Mosaic): a grid over fixed blocks of the buffer, segments masked inside."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl

from zeroth.kernels import out_struct
from zeroth.kernels.perturb import common as _common
from zeroth.kernels.perturb import plans as _plans


def _tpu_flat_kernel(table_ref, keys_ref, scales_ref, x_ref, o_ref, *, distribution: str, n_updates: int):
    """One work item (a row of :attr:`TpuFlatPlan.table`): the updates of one segment on the
    elements of one block that belong to it; the other elements keep their values."""
    i = pl.program_id(0) * 5
    block, start, end, segment, first = (table_ref[i + c] for c in range(5))
    rows, width = x_ref.shape
    shape = (rows, width)
    g = (block.astype(jnp.uint32) * jnp.uint32(rows) + jax.lax.broadcasted_iota(jnp.uint32, shape, 0)) * jnp.uint32(
        width
    ) + jax.lax.broadcasted_iota(jnp.uint32, shape, 1)
    start, end = start.astype(jnp.uint32), end.astype(jnp.uint32)
    mask = (g >= start) & (g < end)
    idx = g - start  # the element's counter in its leaf (wraps outside the segment: masked away)
    call = idx >> _plans._LOG2_PER_CALL[distribution]
    within = idx & jnp.uint32(_plans._PER_CALL[distribution] - 1)
    x = x_ref[...]
    new = _common._segment_update(
        x, call, within, keys_ref, scales_ref, segment, n_updates=n_updates, distribution=distribution
    )

    @pl.when(first == 1)
    def _():
        o_ref[...] = jnp.where(mask, new, x)

    @pl.when(first == 0)
    def _():
        o_ref[...] = jnp.where(mask, new, o_ref[...])


def _tpu_launch_groups(segments, block: int, n_updates: int, budget: int | None = None) -> list[tuple[int, ...]]:
    """Consecutive groups of segment indices whose work items, keys and scales fit in ``budget``
    words of SMEM together (default :data:`_TPU_SMEM_WORDS`): one launch each (one group in all
    but huge replays)."""
    budget = _plans._TPU_SMEM_WORDS if budget is None else budget
    groups, group, words = [], [], n_updates + 1
    for j, (o, z, _) in enumerate(segments):
        need = 2 * n_updates + 5 * len(_plans._blocks_touched(o, z, block))
        if group and words + need > budget:
            groups.append(tuple(group))
            group, words = [], n_updates + 1
        group.append(j)
        words += need
    return groups + [tuple(group)] if group else groups


def _tpu_flat(buffer, keys_flat, scales, segments, *, n_updates, distribution, blocks, interpret, inplace):
    """:func:`perturb_pallas_flat` on TPU: one Mosaic kernel over the work items of
    :func:`plan_tpu_flat_tiles` (several in turn, in place, when SMEM cannot hold one launch's tables)."""
    from jax.experimental.pallas import tpu as pltpu

    n = buffer.shape[0]
    plan = _plans.plan_tpu_flat_tiles(segments, n, blocks, buffer.dtype)
    groups = _tpu_launch_groups(segments, plan.block, n_updates, _plans._tpu_smem_words(interpret))
    x2d = buffer.reshape(n // _plans.TPU_LANES, _plans.TPU_LANES)
    seg_keys = keys_flat.reshape(len(segments), 2 * n_updates) if n_updates else None
    tile = pl.BlockSpec((plan.block_rows, _plans.TPU_LANES), lambda i, t: (t[5 * i], 0))  # the item's block
    smem = pl.BlockSpec(memory_space=pltpu.SMEM)
    for group in groups:
        if len(groups) > 1:  # this launch's segments, renumbered; the others keep their bits (aliased)
            group_segments = tuple(segments[j] for j in group)
            table = np.asarray(_plans._tpu_items(group_segments, plan.block), np.int32).reshape(-1, 5)
            keys_g = seg_keys[np.asarray(group)].reshape(-1) if n_updates else keys_flat
            aliased = True
        else:
            table, keys_g, aliased = plan.table, keys_flat, inplace or plan.aliased
        if table.shape[0] == 0:
            continue
        x2d = pl.pallas_call(
            functools.partial(_tpu_flat_kernel, distribution=distribution, n_updates=n_updates),
            out_shape=out_struct(x2d.shape, x2d.dtype, x2d, keys_g, scales),
            grid_spec=pltpu.PrefetchScalarGridSpec(
                num_scalar_prefetch=1,
                grid=(table.shape[0],),
                in_specs=[smem, smem, tile],
                out_specs=tile,
            ),
            input_output_aliases={3: 0} if aliased else {},
            interpret=interpret,
            # The items of a block must run in order on one core.
            compiler_params=None if interpret else pltpu.CompilerParams(dimension_semantics=("arbitrary",)),
            name="zeroth_fused_replay_flat",
        )(jnp.asarray(table.reshape(-1)), keys_g, scales, x2d)
    return x2d.reshape(n)
