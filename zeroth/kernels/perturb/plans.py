"""Tiles and implementations: block sizes, the tile plans of the kernels, which one runs where."""

from __future__ import annotations

import dataclasses
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl

from zeroth import rng as _rng
from zeroth import rule as _rule
from zeroth.kernels import cpu_native, triton_params
from zeroth.kernels.perturb import common as _common


IMPLS = ("auto", "pallas", "native", "jnp")
# Elements per threefry call: binomial uses 4 16-bit halves, Rademacher 64 bits.
_PER_CALL = {"binomial": 4, "rademacher": 64}
_LOG2_PER_CALL = {"binomial": 2, "rademacher": 6}
_DIST_CODE = {"binomial": 0, "rademacher": 1}


@dataclasses.dataclass(frozen=True)
class BlockSizes:
    """Tiles of the Pallas kernel.

    The leaf is viewed as a 2-D array of rows; a tile is ``tile // row`` consecutive rows.

    Attributes:
      tile: elements per tile (a multiple of the row length, and of 64 when ``lanes`` is None).
      lanes: elements per row. ``None`` makes each row exactly one threefry call (4 binomial or
        64 Rademacher elements): the hash runs once per call and is broadcast along the row,
        the layout for GPUs. An integer gives rows of that many elements where every element
        hashes its own call (lane-dense; the layout for TPUs, whose tiles are (8, 128)).
        Both give the same bits. :func:`check_block_sizes` holds them to each platform's rules
        (GPU: both dimensions of a tile powers of two; TPU: rows per tile a multiple of 8).
    """

    tile: int = 8192
    lanes: int | None = None

    def __post_init__(self):
        if not isinstance(self.tile, int) or isinstance(self.tile, bool) or self.tile < 1:
            raise ValueError(f"BlockSizes.tile must be a positive int, got {self.tile!r}")
        if self.lanes is None:
            if self.tile % 64:
                raise ValueError(f"BlockSizes.tile must be a multiple of 64 when lanes is None, got {self.tile}")
        elif not isinstance(self.lanes, int) or isinstance(self.lanes, bool) or self.lanes < 1:
            raise ValueError(f"BlockSizes.lanes must be None or a positive int, got {self.lanes!r}")
        elif self.tile % self.lanes:
            raise ValueError(f"BlockSizes.tile ({self.tile}) must be a multiple of lanes ({self.lanes})")


_DEFAULT_BLOCKS = {
    "gpu": BlockSizes(tile=8192, lanes=None),
    "tpu": BlockSizes(tile=128 * 1024, lanes=1024),
}


def default_block_sizes(platform: str | None = None) -> BlockSizes:
    """Tiles for ``platform`` (:func:`zeroth.rule.default_platform` when None): grouped rows on GPU,
    lane-dense rows on TPU, small grouped tiles elsewhere (interpret mode)."""
    platform = _rule.default_platform() if platform is None else _rule.platform_name(platform)
    return _DEFAULT_BLOCKS.get(platform, BlockSizes(tile=1024, lanes=None))


def _is_power_of_two(v: int) -> bool:
    return v > 0 and v & (v - 1) == 0


def check_block_sizes(blocks: BlockSizes, platform: str, distribution: str = "binomial") -> BlockSizes:
    """Refuse tiles that ``platform``'s Pallas backend cannot compile, naming the bad value.

    GPU (Triton): rows per tile (``tile // row length``) and the row length are powers of two.
    TPU (Mosaic): rows per tile are a multiple of 8 (the row is the whole last dimension).
    Other platforms (interpret mode) take any tiling.
    """
    platform = _rule.platform_name(platform)
    width = _PER_CALL[distribution] if blocks.lanes is None else blocks.lanes
    rows = max(1, blocks.tile // width)
    if platform == "gpu":
        if not _is_power_of_two(width):
            raise ValueError(f"on GPU the row length must be a power of two (Triton blocks), got lanes={width}")
        if not _is_power_of_two(rows):
            good = 1 << (rows.bit_length() - 1)
            raise ValueError(
                f"on GPU rows per tile must be a power of two (Triton blocks): tile={blocks.tile} // "
                f"row length {width} = {rows} rows; use e.g. BlockSizes(tile={good * width}, lanes={blocks.lanes})"
            )
    elif platform == "tpu" and rows % 8:
        raise ValueError(
            f"on TPU rows per tile must be a multiple of 8 (Mosaic tiles are (8, 128)): tile={blocks.tile} // "
            f"row length {width} = {rows} rows"
        )
    return blocks


class TilePlan(NamedTuple):
    """How :func:`perturb_pallas` covers a leaf of ``n`` elements: the kernel runs ``tiles``
    whole tiles of ``tile_rows`` rows of ``width`` elements over elements ``[0, head)``; the ragged
    tail ``[head, n)`` (fewer elements than a tile) goes through the exact jnp rule, which hashes
    the same global indices. No block ever addresses an element outside ``[0, head)``.
    """

    n: int  # elements of the leaf
    width: int  # elements per row
    grouped: bool  # one threefry call per row (hash broadcast along the row)
    tile_rows: int  # rows per tile (0: the leaf is smaller than a tile, the kernel does not run)
    tiles: int  # whole tiles: the kernel's grid
    head: int  # tiles * tile_rows * width: elements the kernel covers

    @property
    def tail(self) -> int:
        return self.n - self.head


def plan_tiles(n: int, distribution: str, blocks: BlockSizes, platform: str, offset: int = 0) -> TilePlan:
    """The whole-tile cover of a leaf (see :class:`TilePlan`) for ``platform``'s tiling rules.

    A leaf smaller than one tile gets a smaller tile that still obeys the platform's rules (the
    largest power of two of rows that fits on GPU, a multiple of 8 on TPU), or none at all.
    """
    platform = _rule.platform_name(platform)
    check_block_sizes(blocks, platform, distribution)
    per_call = _PER_CALL[distribution]
    grouped = blocks.lanes is None and offset % per_call == 0
    width = per_call if grouped else (blocks.lanes or 64)
    tile_rows = max(1, blocks.tile // width)
    if platform == "tpu":
        # Mosaic's multiple of 8 for every row length: check_block_sizes counted rows of one
        # threefry call, and a leaf whose offset breaks that grouping has rows of 64 elements
        tile_rows = max(8, tile_rows - tile_rows % 8)
    rows = n // width
    if tile_rows > rows:
        if platform == "gpu":
            tile_rows = 1 << (rows.bit_length() - 1) if rows else 0
        elif platform == "tpu":
            tile_rows = rows - rows % 8
        else:
            tile_rows = rows
    tiles = rows // tile_rows if tile_rows else 0
    return TilePlan(n=n, width=width, grouped=grouped, tile_rows=tile_rows, tiles=tiles, head=tiles * tile_rows * width)


def _triton_available() -> bool:
    try:
        triton_params()
    except ImportError:  # a jax without Pallas' Triton backend: the jnp rule runs on GPU
        return False
    return True


def platform_of(params: Any) -> str:
    """The platform family (``"cpu"``, ``"gpu"``, ``"tpu"``) of the devices ``params`` live on.

    Leaves that are not committed jax arrays (NumPy arrays, Python scalars, tracers) go where
    ``jit`` puts them (:func:`zeroth.rule.default_platform`). Leaves on two platforms at once are refused.
    """
    found: dict[str, str] = {}
    for path, leaf in jax.tree_util.tree_flatten_with_path(params)[0]:
        if isinstance(leaf, jax.Array) and not isinstance(leaf, jax.core.Tracer):
            for platform in {_rule.platform_name(d.platform) for d in leaf.devices()}:
                found.setdefault(platform, _rng.leaf_path(path))
    if len(found) > 1:
        where = ", ".join(f"{leaf} on {platform}" for platform, leaf in sorted(found.items()))
        raise ValueError(f"parameters live on several platforms ({where}); put every leaf on one platform first")
    return next(iter(found)) if found else _rule.default_platform()


def resolve_impl(impl: str, platform: str | None = None, n_updates: int | None = None, dtype=None) -> str:
    """The implementation for arrays on ``platform`` (default: :func:`zeroth.rule.default_platform`)
    of ``dtype`` (any dtype when None).

    ``"auto"``: on CPU the native kernel if it builds, else ``"jnp"``; on TPU ``"pallas"``, or
    ``"jnp"`` for a dtype of :data:`zeroth.rule.MOSAIC_REFUSES` (float16; ``"pallas"`` refuses it there); on GPU
    ``"jnp"`` for a single update (XLA's fused element-wise loop reaches memory speed there) and ``"pallas"`` (Triton) for
    K > 1 updates (one pass for K updates; ``zeroth bench kernels`` measures both), or ``"jnp"`` where jax has no Triton
    backend. Other names are checked against the platform and returned unchanged.
    """
    if impl not in IMPLS:
        raise ValueError(f"unknown impl {impl!r}; expected one of {list(IMPLS)}")
    platform = _rule.default_platform() if platform is None else _rule.platform_name(platform)
    if impl == "native" and platform != "cpu":
        raise ValueError(f"impl='native' is the CPU kernel, but the arrays live on {platform}; use impl='auto'")
    if _rule.mosaic_refuses(impl, dtype, platform):
        return "jnp"
    if impl != "auto":
        return impl
    if platform == "tpu":
        return "pallas"
    if platform == "gpu":
        return "pallas" if (n_updates is None or n_updates > 1) and _triton_available() else "jnp"
    if platform == "cpu" and cpu_native.available():
        return "native"
    return "jnp"


class FlatTilePlan(NamedTuple):
    """How :func:`perturb_pallas_flat` covers every segment of one flat buffer in **one launch**.

    The grid runs over work items; item ``i`` is one tile of one segment, described by row ``i``
    of ``table``: ``(segment, buffer_start, leaf_start, count)``. It updates the ``count <=
    tile_rows * width`` elements ``buffer[buffer_start : buffer_start + count]``, which are
    elements ``[leaf_start, leaf_start + count)`` of segment ``segment``'s leaf (its noise
    counters), with that segment's leaf keys. ``leaf_start`` is a multiple of the tile, so a
    grouped row (one threefry call) never straddles two calls, wherever the segment starts in the
    buffer; the tile is loaded and stored element-wise under a mask (``count`` may be short), so
    no element outside the segment is read into the update or written.
    """

    width: int  # elements per row
    grouped: bool  # one threefry call per row (hash broadcast along the row)
    tile_rows: int  # rows per tile
    table: np.ndarray  # int32[items, 4]: (segment, buffer_start, leaf_start, count) per grid step
    align: int  # every buffer_start is a multiple of it (a power of two <= 16): Triton's load hint

    @property
    def tile(self) -> int:
        return self.tile_rows * self.width


# Element indices of the flat kernel are int32 (Triton's 32-bit pointer offsets).
_FLAT_MAX_ELEMENTS = 2**31 - 1


def plan_flat_tiles(segments, distribution: str, blocks: BlockSizes, platform: str) -> FlatTilePlan:
    """The work items of :func:`perturb_pallas_flat` (see :class:`FlatTilePlan`).

    ``blocks`` is checked for ``platform`` (:func:`check_block_sizes`); the tile shrinks to the
    largest segment (rows per tile stay a power of two on GPU), so a buffer of small leaves does
    not run a large tile per leaf. Segments of size 0 get no work item.

    Args:
      segments: ``(offset, size, leaf_id)`` int triples (checked: inside the buffer, not overlapping).
      distribution: ``"binomial"`` or ``"rademacher"``.
      blocks: the tiling; ``lanes=None`` gives grouped rows of one threefry call each.
      platform: ``"gpu"`` or an interpret-mode platform (``"cpu"``); on TPU the plan is
        :func:`plan_tpu_flat_tiles` (Mosaic has no loads by element index).
    """
    platform = _rule.platform_name(platform)
    if platform == "tpu":
        raise ValueError(
            "plan_flat_tiles is the GPU plan (tiles loaded by element index, Triton's); on TPU use plan_tpu_flat_tiles"
        )
    check_block_sizes(blocks, platform, distribution)
    per_call = _PER_CALL[distribution]
    grouped = blocks.lanes is None
    width = per_call if grouped else blocks.lanes
    tile_rows = max(1, blocks.tile // width)
    longest = max((int(z) for _, z, _ in segments), default=0)
    needed = max(1, -(-longest // width))
    if needed < tile_rows:
        tile_rows = pl.next_power_of_2(needed) if platform == "gpu" else needed
    tile = tile_rows * width
    rows = [
        (j, o + start, start, min(tile, z - start))
        for j, (o, z, _) in enumerate(segments)
        for start in range(0, z, tile)
    ]
    table = np.asarray(rows, np.int32).reshape(-1, 4)
    align = 16
    while align > 1 and np.any(table[:, 1] % align):
        align //= 2
    return FlatTilePlan(width=width, grouped=grouped, tile_rows=tile_rows, table=table, align=align)


# A TPU vector register is (8, 128) 32-bit elements: the flat buffer is viewed as rows of 128 lanes.
TPU_LANES = 128
# Planning weight of one grid step, in elements of a block (its fixed cost: pipeline bookkeeping,
# the DMA issue, the scalar reads of its work item). Not measured on a TPU: it only trades
# many small blocks against the elements a large block computes for nothing.
_TPU_STEP_ELEMENTS = 8192
# 32-bit words of the work-item table, keys and scales one launch may put in SMEM (512 KiB; a
# TPU v4, v5e or v6e has 1 MiB), at most half the chip's (a TPU v3 has 16 KiB: _tpu_smem_words). A
# replay of more segments x updates is split over several launches.
_TPU_SMEM_WORDS = 2**17


def _tpu_smem_words(interpret: bool) -> int:
    """The SMEM words one flat launch may fill on the TPU it is compiled for: :data:`_TPU_SMEM_WORDS`,
    or half the chip's SMEM where that is less (``pltpu.get_tpu_info``; interpret mode has no chip)."""
    if interpret:
        return _TPU_SMEM_WORDS
    from jax.experimental.pallas import tpu as pltpu

    try:
        capacity = pltpu.get_tpu_info().smem_capacity_bytes
    except ValueError:  # a device kind Pallas has no description of: the default budget
        return _TPU_SMEM_WORDS
    return min(_TPU_SMEM_WORDS, capacity // 8)


class TpuFlatPlan(NamedTuple):
    """How :func:`perturb_pallas_flat` covers the segments of one flat buffer on TPU in **one
    Mosaic launch** (Mosaic has no loads by element index, so blocks are fixed and segments are
    masked inside them).

    The buffer (``n`` elements, a multiple of :data:`TPU_LANES`) is viewed as rows of 128 lanes,
    cut into whole blocks of ``block_rows`` rows. The grid runs over work items; item ``i`` is row
    ``i`` of ``table``, ``(block, start, end, segment, first)``: block ``block`` gets the updates of segment
    ``segment`` (the buffer elements ``[start, end)``, noise counter ``element - start``) on the
    elements it holds of it, and keeps every other element as it is. Items are ordered by block,
    so the items of one block run back to back and the block stays in VMEM between them (Pallas
    writes an output block back when the block index changes); ``first`` is 1 on the first item
    of a block, which takes the other elements from the input (the output block holds nothing
    yet), and 0 on the others, which keep what the earlier items wrote.
    """

    block_rows: int  # rows of 128 lanes per block (dividing the buffer's rows)
    table: np.ndarray  # int32[items, 5]: (block, start, end, segment, first)
    aliased: bool  # some block holds no segment: the output aliases the input so that it keeps its bits

    @property
    def block(self) -> int:
        return self.block_rows * TPU_LANES


def _blocks_touched(offset: int, size: int, block: int) -> range:
    """The blocks of ``block`` elements a segment touches (one work item each; none if empty)."""
    return range(offset // block, (offset + size - 1) // block + 1) if size else range(0)


def _tpu_items(segments, block: int) -> list[tuple[int, int, int, int, int]]:
    """The work items of blocks of ``block`` elements, ordered by block, then segment offset."""
    items = sorted((b, o, o + z, j) for j, (o, z, _) in enumerate(segments) for b in _blocks_touched(o, z, block))
    return [(b, o, e, j, int(i == 0 or items[i - 1][0] != b)) for i, (b, o, e, j) in enumerate(items)]


def _tpu_rows(dtype, blocks: BlockSizes) -> tuple[int, int]:
    """The fewest and the most rows of a TPU block: (16, 128) packed registers for 16-bit dtypes,
    (8, 128) otherwise; at most ``blocks.tile`` elements."""
    least = 16 if jnp.dtype(dtype).itemsize == 2 else 8
    return least, max(least, blocks.tile // TPU_LANES)


def tpu_flat_size(n: int) -> int:
    """The size :func:`zeroth.replay.flatten` gives a TPU buffer holding ``n`` elements of leaves:
    whole blocks for :func:`plan_tpu_flat_tiles` at the default tiling, so that no block is
    partial. Below 2**17 elements a multiple of 2048 (16 rows of 128, one packed register of a
    16-bit dtype); from there a multiple of 2**17 (blocks of 1024 rows). The padding is at most
    2047 elements, or 2**17 - 1 (512 KiB of float32) for a buffer of at least that size."""
    unit = 2048 if n < 2**17 else 2**17
    return -(-n // unit) * unit


def tpu_flat_fits(n: int, dtype, blocks: BlockSizes | None = None) -> bool:
    """Whether :func:`plan_tpu_flat_tiles` takes a buffer of ``n`` elements: whole rows of 128,
    and blocks that divide the rows (every row as one block, or a multiple of the fewest rows)."""
    blocks = _DEFAULT_BLOCKS["tpu"] if blocks is None else blocks
    least, most = _tpu_rows(dtype, blocks)
    rows = n // TPU_LANES
    return n % TPU_LANES == 0 and (rows <= most or rows % least == 0)


def plan_tpu_flat_tiles(segments, n: int, blocks: BlockSizes, dtype=jnp.float32) -> TpuFlatPlan:
    """The work items of :func:`perturb_pallas_flat` on TPU (see :class:`TpuFlatPlan`).

    Blocks divide the buffer's rows (no block is partial): every row as one block when the buffer
    has at most ``blocks.tile`` elements, or ``least * 2**j`` rows up to ``blocks.tile // 128``
    (``least``: 8 rows, 16 for 16-bit dtypes, whose registers pack (16, 128)). Among those the
    plan takes the one that minimises (items) x (block elements + a grid step's fixed cost): a
    buffer of large leaves gets large blocks, one of many small leaves small ones, so that the
    elements computed and masked away stay few.

    Args:
      segments: ``(offset, size, leaf_id)`` int triples (checked: inside the buffer, not overlapping).
      n: the buffer's elements (:func:`tpu_flat_fits`; :func:`tpu_flat_size` pads to such a size).
      blocks: the tiling; ``blocks.tile`` bounds the block (elements).
      dtype: the buffer's dtype.
    """
    if not tpu_flat_fits(n, dtype, blocks):
        raise ValueError(
            f"the TPU flat kernel views a buffer as rows of {TPU_LANES} lanes cut into whole blocks: {n} elements of "
            f"{jnp.dtype(dtype).name} do not fit (a size from tpu_flat_size does; zeroth.replay.flatten pads TPU "
            f"buffers so)"
        )
    segments = _common._check_segments(segments, n, "plan_tpu_flat_tiles")
    rows = n // TPU_LANES
    least, most = _tpu_rows(dtype, blocks)
    if rows == 0:  # an empty buffer (its leaves, if any, are empty): nothing to launch
        return TpuFlatPlan(block_rows=least, table=np.zeros((0, 5), np.int32), aliased=False)
    candidates = [rows] if rows <= most else []
    b = least
    while b <= most and b < rows:
        if rows % b == 0:
            candidates.append(b)
        b *= 2

    def cost(block_rows):
        items = sum(len(_blocks_touched(o, z, block_rows * TPU_LANES)) for o, z, _ in segments)
        return items * (block_rows * TPU_LANES + _TPU_STEP_ELEMENTS)

    block_rows = min(candidates, key=lambda r: (cost(r), -r))
    items = _tpu_items(segments, block_rows * TPU_LANES)
    return TpuFlatPlan(
        block_rows=block_rows,
        table=np.asarray(items, np.int32).reshape(-1, 5),
        aliased=len({it[0] for it in items}) < rows // block_rows,
    )
