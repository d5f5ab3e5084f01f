"""Fused exact replay: K ``(key, scale)`` updates applied to a leaf in one read and one write.

One op in three implementations that give the same bits (the tests hold them to
``assert_array_equal`` against each other and against :mod:`zeroth.reference`):

* ``"pallas"``: a Pallas kernel. Each tile is loaded once, widened to float32 and flushed, gets
  all K updates in canonical order, and is cast and stored once. Every element regenerates its
  noise from its *global* flat index, so any tiling (and any shard, through ``offset``) gives
  the same bits. The default on GPU and TPU (but for float16 leaves on TPU, which Mosaic cannot
  load: :data:`zeroth.rule.MOSAIC_REFUSES`); on CPU it runs in interpret mode, for tests only.
* ``"native"``: a C++ XLA FFI custom call for CPU (:mod:`zeroth.kernels.cpu_native` builds and
  caches it with the machine's compiler): cache-resident tiles, 16 threefry calls per SIMD
  vector, XLA's thread pool. The default on CPU when it builds.
* ``"jnp"``: the plain ``jnp`` reference, :func:`perturb_reference` (one pass over the leaf
  per update). The fallback on CPU when no compiler is available.

The rule is the contract's (see :mod:`zeroth.replay`): with ``k_u`` the integer noise of update
``u`` (:func:`zeroth.noise.noise_int` of the leaf key ``fold_in(key_u, leaf_id(path))``),

    p32 = flush(float32(x));   p32 = flush(p32 + s_u * k_u)  for u = 0..K-1;   out = flush_cast(p32)

``s_u`` are host-rounded scales (:func:`zeroth.replay.update_scales`), so ``s_u * k_u`` is exact
and the add rounds once, identically everywhere. Every implementation flushes in halves with the
same bits (:mod:`zeroth.rule`): the zeros after the load and after each update
(:func:`zeroth.rule.flush_tiny`), the NaNs once, when the result is stored.

Entry points: :func:`perturb_leaf` (one array, leaf keys given), :func:`apply_updates` (a pytree,
traceable, same arguments as :func:`zeroth.replay.apply_updates`),
:func:`fused_apply_updates` (the host entry: jitted, optionally donating) and
:func:`apply_updates_flat` (leaves laid out as segments of flat buffers, one launch per buffer:
the op behind :class:`zeroth.replay.Flat`; on GPU and TPU :func:`perturb_pallas_flat`: on GPU a
grid over the tiles of every segment, loaded by element index; on TPU a grid over fixed blocks of
the buffer, each segment masked inside the blocks it touches).

Example:
  >>> import numpy as np, jax.numpy as jnp
  >>> from zeroth import rng, replay
  >>> keys = rng.sample_keys(0, [(0, 0, 0), (0, 0, 1)])
  >>> scales = replay.update_scales("binomial", [0.5, -0.25])
  >>> p = {"w": jnp.zeros((3, 5))}
  >>> q = fused_apply_updates(p, keys, scales, distribution="binomial")
  >>> bool((q["w"] == replay.apply_updates(p, keys, scales, distribution="binomial")["w"]).all())
  True
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl

from zeroth import noise as _noise
from zeroth import rng as _rng
from zeroth import rule as _rule
from zeroth.kernels import cpu_native, out_struct, triton_params

__all__ = [
    "IMPLS",
    "APART_MIN_BYTES",
    "BlockSizes",
    "default_block_sizes",
    "check_block_sizes",
    "resolve_impl",
    "platform_of",
    "leaf_keys",
    "leaf_key_table",
    "perturb_reference",
    "perturb_pallas",
    "perturb_pallas_flat",
    "perturb_pallas_segments",
    "perturb_native",
    "perturb_leaf",
    "apply_updates",
    "apply_updates_flat",
    "fused_apply_updates",
]

IMPLS = ("auto", "pallas", "native", "jnp")
# Elements per threefry call: binomial uses 4 16-bit halves, Rademacher 64 bits.
_PER_CALL = {"binomial": 4, "rademacher": 64}
_LOG2_PER_CALL = {"binomial": 2, "rademacher": 6}
_DIST_CODE = {"binomial": 0, "rademacher": 1}


# --------------------------------------------------------------------------- configuration


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
    platform = (_rule.default_platform() if platform is None else _rule.platform_name(platform))
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
    platform = (_rule.default_platform() if platform is None else _rule.platform_name(platform))
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


# --------------------------------------------------------------------------- shared pieces


def leaf_keys(keys, lid: int) -> jax.Array:
    """``u32[K, 2]`` leaf keys ``fold_in(keys[u], lid)`` of the sample keys ``u32[K, 2]``."""
    return _all_leaf_keys(keys, [lid])[0]


def leaf_key_table(keys, ids) -> jax.Array:
    """``u32[L, K, 2]``: :func:`leaf_keys` of the sample keys ``u32[K, 2]`` for each leaf id of
    ``ids`` (in one computation), what :func:`apply_updates` takes as ``leaf_keys``."""
    return _all_leaf_keys(keys, [int(i) for i in ids])


def _check_args(x, keys, scales, distribution: str):
    _noise.check_distribution(distribution)
    x = jnp.asarray(x)
    _rule.check_dtype(x.dtype, "leaf")
    keys = jnp.asarray(keys)
    scales = jnp.asarray(scales)
    if keys.dtype != jnp.uint32 or keys.ndim != 2 or keys.shape[1] != 2:
        raise ValueError(f"leaf keys must be u32[K, 2], got dtype {keys.dtype} shape {keys.shape}")
    if scales.dtype != jnp.float32 or scales.shape != (keys.shape[0],):
        raise ValueError(
            f"scales must be f32[K] with K = {keys.shape[0]} (one per key), got dtype {scales.dtype} shape {scales.shape}"
        )
    return x, keys, scales


def _check_offset(offset, n: int):
    if isinstance(offset, jax.Array) and not isinstance(offset, np.ndarray):  # known at run time (traced)
        if offset.dtype != jnp.uint32 or offset.shape != ():
            raise ValueError(f"a run-time offset must be a u32[] scalar, got dtype {offset.dtype} shape {offset.shape}")
        return offset
    if not isinstance(offset, (int, np.integer)) or isinstance(offset, bool) or offset < 0:
        raise ValueError(f"offset must be a non-negative int (a global flat index), got {offset!r}")
    if int(offset) + n > _noise.MAX_LEAF_SIZE:
        raise ValueError(f"offset {offset} + {n} elements exceeds the supported {_noise.MAX_LEAF_SIZE} elements per leaf")
    return int(offset)


def _update_block(p32, call, within, k0, k1, scale, distribution: str):
    """One exact update on a block: ``flush(p32 + scale * k)``, NaNs left to the store
    (:func:`zeroth.rule.flush_tiny`).

    ``call`` (threefry counter) and ``within`` (position inside the call) broadcast to ``p32``.
    """
    x0, x1 = _rng.threefry2x32((k0, k1), (jnp.zeros_like(call), call))
    if distribution == "binomial":
        delta = scale * _noise.binomial_from_words(x0, x1, within).astype(jnp.float32)
    else:
        delta = jnp.where(_noise.rademacher_from_words(x0, x1, within) == 1, scale, -scale)
    return _rule.flush_tiny(p32 + delta)


# --------------------------------------------------------------------------- reference (plain jnp)


def perturb_reference(x, leaf_keys_, scales, *, distribution: str = "binomial", offset: int = 0) -> jax.Array:
    """Plain ``jnp`` reference: one pass of :func:`zeroth.noise.noise_int` per update.

    Args:
      x: the leaf (any shape; f32, bf16 or f16).
      leaf_keys_: ``u32[K, 2]`` *leaf* keys (see :func:`leaf_keys`).
      scales: ``f32[K]`` host-rounded scales.
      distribution: ``"binomial"`` or ``"rademacher"``.
      offset: global flat index of ``x``'s first element (0 for a whole leaf); an int, or a
        ``u32[]`` known only at run time (a slice chosen inside a loop, :func:`perturb_slice`).

    Returns:
      The updated array, same shape and dtype.
    """
    x, keys, scales = _check_args(x, leaf_keys_, scales, distribution)
    offset = _check_offset(offset, x.size)
    p32 = _rule.flush_tiny(x.astype(jnp.float32))

    def body(u, p):
        k = _noise.noise_int(distribution, keys[u], x.shape, offset)
        return _rule.flush_tiny(p + scales[u] * k.astype(jnp.float32))

    if keys.shape[0] == 1:
        p32 = body(0, p32)
    elif keys.shape[0] > 1:
        p32 = jax.lax.fori_loop(0, keys.shape[0], body, p32)
    return _rule.cast_flushed(p32, x.dtype)


# --------------------------------------------------------------------------- Pallas kernel


def _perturb_kernel(keys_ref, scales_ref, x_ref, o_ref, *, distribution: str, n_updates: int, offset: int, grouped: bool,
                    flat_keys: bool = False):
    """One tile; ``flat_keys``: the keys come as ``u32[2K]`` (TPU: SMEM pads a 2-D array's rows to
    128 words, so ``u32[K, 2]`` took 512 bytes per update, 32 KiB at K = 64, more than a TPU v3's
    16 KiB of SMEM; a TPU v4 or v5e failed to compile K = 4096: 2 MiB of its 1 MiB)."""
    rows, width = x_ref.shape
    base = jnp.uint32(offset) + pl.program_id(0).astype(jnp.uint32) * jnp.uint32(rows * width)
    log2 = _LOG2_PER_CALL[distribution]
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
        within = idx & jnp.uint32(_PER_CALL[distribution] - 1)
    p32 = _rule.flush_tiny(x_ref[...].astype(jnp.float32))

    def body(u, p):
        k0, k1 = (keys_ref[2 * u], keys_ref[2 * u + 1]) if flat_keys else (keys_ref[u, 0], keys_ref[u, 1])
        return _update_block(p, call, within, k0, k1, scales_ref[u], distribution)

    if n_updates:
        p32 = jax.lax.fori_loop(0, n_updates, body, p32)
    o_ref[...] = _rule.cast_flushed(p32, o_ref.dtype)


def _pallas_tiles(x2d, keys, scales, plan: TilePlan, *, distribution, offset, interpret, inplace, platform):
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
        _perturb_kernel, distribution=distribution, n_updates=n_updates, offset=offset, grouped=plan.grouped,
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


def _pallas_target(platform: str | None, interpret: bool, block_sizes: BlockSizes | None,
                   dtype=None) -> tuple[str, BlockSizes]:
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
    return platform, default_block_sizes(platform) if block_sizes is None else block_sizes


def perturb_pallas(
    x,
    leaf_keys_,
    scales,
    *,
    distribution: str = "binomial",
    offset: int = 0,
    block_sizes: BlockSizes | None = None,
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
    x, keys, scales = _check_args(x, leaf_keys_, scales, distribution)
    offset = _check_offset(offset, x.size)
    platform, blocks = _pallas_target(platform, interpret, block_sizes, x.dtype)
    plan = plan_tiles(x.size, distribution, blocks, platform, offset)
    if plan.tiles == 0:
        return perturb_reference(x, keys, scales, distribution=distribution, offset=offset)
    flat = x.reshape(-1)
    run = functools.partial(
        _pallas_tiles, keys=keys, scales=scales, plan=plan, distribution=distribution, offset=offset,
        interpret=interpret, platform=platform,
    )
    if plan.n % plan.width == 0:  # the leaf's own buffer as (rows, width): no copy
        out = run(flat.reshape(-1, plan.width), inplace=inplace).reshape(-1)
        if plan.tail:
            # Rows past the whole tiles are untouched: the input's values (aliased) or undefined.
            tail_in = out[plan.head :] if inplace else flat[plan.head :]
            tail = perturb_reference(tail_in, keys, scales, distribution=distribution, offset=offset + plan.head)
            out = jax.lax.dynamic_update_slice(out, tail, (plan.head,))
    else:
        head = run(flat[: plan.head].reshape(-1, plan.width), inplace=True).reshape(-1)
        tail = perturb_reference(flat[plan.head :], keys, scales, distribution=distribution, offset=offset + plan.head)
        out = jnp.concatenate([head, tail])
    return out.reshape(x.shape)


# --------------------------------------------------------------------------- Pallas kernel over a flat buffer


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
            "plan_flat_tiles is the GPU plan (tiles loaded by element index, Triton's); on TPU use plan_tpu_flat_tiles")
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


def _flat_kernel(table_ref, keys_ref, scales_ref, x_ref, o_ref, *, distribution: str, n_updates: int,
                 tile_rows: int, width: int, grouped: bool, align: int, out_align: int = 0):
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
    pos = (
        jax.lax.broadcasted_iota(jnp.int32, (tile_rows, width), 0) * width
        + jax.lax.broadcasted_iota(jnp.int32, (tile_rows, width), 1)
    )
    mask = pos < count
    where = buffer_start + pos
    log2 = _LOG2_PER_CALL[distribution]
    base = leaf_start.astype(jnp.uint32)
    if grouped:  # leaf_start is a multiple of the tile: row r is call (leaf_start >> log2) + r
        call = (base >> log2) + jax.lax.broadcasted_iota(jnp.uint32, (tile_rows, 1), 0)
        within = jax.lax.broadcasted_iota(jnp.uint32, (1, width), 1)
    else:
        idx = base + pos.astype(jnp.uint32)
        call = idx >> log2
        within = idx & jnp.uint32(_PER_CALL[distribution] - 1)
    x = pltriton.load(x_ref.at[where], mask=mask, other=0)
    new = _segment_update(x, call, within, keys_ref, scales_ref, segment, n_updates=n_updates, distribution=distribution)
    if out_align:
        out_start = table_ref[i + 4]
        where = (pl.multiple_of(out_start, out_align) if out_align > 1 else out_start) + pos
    pltriton.store(o_ref.at[where], new, mask=mask)


def _segment_update(x, call, within, keys_ref, scales_ref, segment, *, n_updates: int, distribution: str):
    """The K updates of one segment on a block ``x`` of a flat kernel: flush, the updates in
    order with the segment's leaf keys (``keys_ref[2K * segment :]``, word pairs), cast once."""
    p32 = _rule.flush_tiny(x.astype(jnp.float32))
    first_key = segment * (2 * n_updates)

    def body(u, p):
        k = first_key + 2 * u
        return _update_block(p, call, within, keys_ref[k], keys_ref[k + 1], scales_ref[u], distribution)

    if n_updates:
        p32 = jax.lax.fori_loop(0, n_updates, body, p32)
    return _rule.cast_flushed(p32, x.dtype)


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
    if n > _FLAT_MAX_ELEMENTS:
        raise ValueError(f"the flat Pallas kernel takes buffers of at most {_FLAT_MAX_ELEMENTS} elements, got {n}")
    segments = _check_segments(segments, n, what)
    segment_keys, scales = jnp.asarray(segment_keys), jnp.asarray(scales)
    n_updates = scales.shape[0] if scales.ndim == 1 else -1
    if scales.dtype != jnp.float32 or n_updates < 0:
        raise ValueError(f"scales must be f32[K], got dtype {scales.dtype} shape {scales.shape}")
    return buffer, segments, segment_keys, scales, n_updates


def _padded(segment_keys, scales, n_updates: int) -> tuple[jax.Array, jax.Array]:
    """The keys as one word vector and the scales, zero-size ones padded to one element (never
    read: no key or scale is read when K = 0, where a flat kernel still flushes and casts)."""
    return (jnp.pad(segment_keys.reshape(-1), (0, 0 if n_updates else 2)),
            jnp.pad(scales, (0, 0 if n_updates else 1)))


def perturb_pallas_flat(
    buffer,
    segment_keys,
    scales,
    segments,
    *,
    distribution: str = "binomial",
    block_sizes: BlockSizes | None = None,
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
        buffer, segment_keys, scales, segments, distribution, "perturb_pallas_flat")
    if segment_keys.dtype != jnp.uint32 or segment_keys.shape != (len(segments), n_updates, 2):
        raise ValueError(
            f"segment keys must be u32[{len(segments)}, {n_updates}, 2] (segments, updates, key words), "
            f"got dtype {segment_keys.dtype} shape {segment_keys.shape}"
        )
    platform, blocks = _pallas_target(platform, interpret, block_sizes, buffer.dtype)
    keys_flat, scales = _padded(segment_keys, scales, n_updates)
    if platform == "tpu":
        return _tpu_flat(buffer, keys_flat, scales, segments, n_updates=n_updates, distribution=distribution,
                         blocks=blocks, interpret=interpret, inplace=inplace)
    plan = plan_flat_tiles(segments, distribution, blocks, platform)
    if plan.table.shape[0] == 0:
        return buffer
    covered = sum(z for _, z, _ in segments) == buffer.shape[0]  # segments do not overlap: they cover every element
    table = jnp.asarray(plan.table.reshape(-1))
    whole = lambda a: pl.BlockSpec(a.shape, lambda i: (0,))  # noqa: E731 (the kernel indexes it)
    kernel = functools.partial(
        _flat_kernel, distribution=distribution, n_updates=n_updates, tile_rows=plan.tile_rows,
        width=plan.width, grouped=plan.grouped, align=plan.align,
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
    block_sizes: BlockSizes | None = None,
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
        buffer, segment_keys, scales, segments, distribution, "perturb_pallas_segments")
    rows = segment_keys.shape[0] if segment_keys.ndim == 3 else 0
    bad = [i for _, _, i in segments if not 0 <= i < rows]
    if segment_keys.dtype != jnp.uint32 or segment_keys.shape[1:] != (n_updates, 2) or bad:
        raise ValueError(f"segment keys must be u32[L, {n_updates}, 2] with a row for every segment's index "
                         f"(rows {bad} are missing), got dtype {segment_keys.dtype} shape {segment_keys.shape}")
    platform, blocks = _pallas_target(platform, interpret, block_sizes, buffer.dtype)
    if platform == "tpu":
        raise ValueError("perturb_pallas_segments loads by element index (Triton's); on a TPU compute each leaf "
                         "with perturb_reference")
    total = sum(z for _, z, _ in segments)
    if total == 0:
        return buffer[:0]
    keys_flat, scales = _padded(segment_keys, scales, n_updates)  # K = 0 still flushes and casts
    plan = plan_flat_tiles(segments, distribution, blocks, platform)
    starts = np.cumsum([0] + [z for _, z, _ in segments])[:-1]
    table = np.concatenate([plan.table, (starts[plan.table[:, 0]] + plan.table[:, 2])[:, None]], axis=1)
    table[:, 0] = np.asarray([i for _, _, i in segments])[plan.table[:, 0]]
    out_align = 16
    while out_align > 1 and np.any(table[:, 4] % out_align):
        out_align //= 2
    return _segments_call(
        jnp.asarray(table.astype(np.int32).reshape(-1)), keys_flat, scales, buffer, size=total,
        distribution=distribution, n_updates=n_updates, tile_rows=plan.tile_rows, width=plan.width,
        grouped=plan.grouped, align=plan.align, out_align=out_align, interpret=interpret, platform=platform)


@functools.partial(jax.jit, static_argnames=("size", "distribution", "n_updates", "tile_rows", "width", "grouped", "align",
                                             "out_align", "interpret", "platform"))
def _segments_call(table, keys_flat, scales, buffer, *, size, distribution, n_updates, tile_rows, width, grouped, align,
                   out_align, interpret, platform):
    """The ``pallas_call`` of :func:`perturb_pallas_segments`, its work items an argument: every
    launch of one shape is then one traced and lowered function (jit's cache), which a program of
    many leaves lowers once (a ``pallas_call`` per leaf took 0.13 s each to lower to Triton)."""
    whole = lambda a: pl.BlockSpec(a.shape, lambda i: (0,))  # noqa: E731 (the kernel indexes it)
    kernel = functools.partial(
        _flat_kernel, distribution=distribution, n_updates=n_updates, tile_rows=tile_rows, width=width,
        grouped=grouped, align=align, out_align=out_align,
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


# --------------------------------------------------------------------------- the flat kernel on TPU (Mosaic)

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
    segments = _check_segments(segments, n, "plan_tpu_flat_tiles")
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


def _tpu_flat_kernel(table_ref, keys_ref, scales_ref, x_ref, o_ref, *, distribution: str, n_updates: int):
    """One work item (a row of :attr:`TpuFlatPlan.table`): the updates of one segment on the
    elements of one block that belong to it; the other elements keep their values."""
    i = pl.program_id(0) * 5
    block, start, end, segment, first = (table_ref[i + c] for c in range(5))
    rows, width = x_ref.shape
    shape = (rows, width)
    g = (
        (block.astype(jnp.uint32) * jnp.uint32(rows) + jax.lax.broadcasted_iota(jnp.uint32, shape, 0)) * jnp.uint32(width)
        + jax.lax.broadcasted_iota(jnp.uint32, shape, 1)
    )
    start, end = start.astype(jnp.uint32), end.astype(jnp.uint32)
    mask = (g >= start) & (g < end)
    idx = g - start  # the element's counter in its leaf (wraps outside the segment: masked away)
    call = idx >> _LOG2_PER_CALL[distribution]
    within = idx & jnp.uint32(_PER_CALL[distribution] - 1)
    x = x_ref[...]
    new = _segment_update(x, call, within, keys_ref, scales_ref, segment, n_updates=n_updates, distribution=distribution)

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
    budget = _TPU_SMEM_WORDS if budget is None else budget
    groups, group, words = [], [], n_updates + 1
    for j, (o, z, _) in enumerate(segments):
        need = 2 * n_updates + 5 * len(_blocks_touched(o, z, block))
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
    plan = plan_tpu_flat_tiles(segments, n, blocks, buffer.dtype)
    groups = _tpu_launch_groups(segments, plan.block, n_updates, _tpu_smem_words(interpret))
    x2d = buffer.reshape(n // TPU_LANES, TPU_LANES)
    seg_keys = keys_flat.reshape(len(segments), 2 * n_updates) if n_updates else None
    tile = pl.BlockSpec((plan.block_rows, TPU_LANES), lambda i, t: (t[5 * i], 0))  # the item's block
    smem = pl.BlockSpec(memory_space=pltpu.SMEM)
    for group in groups:
        if len(groups) > 1:  # this launch's segments, renumbered; the others keep their bits (aliased)
            group_segments = tuple(segments[j] for j in group)
            table = np.asarray(_tpu_items(group_segments, plan.block), np.int32).reshape(-1, 5)
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
                num_scalar_prefetch=1, grid=(table.shape[0],), in_specs=[smem, smem, tile], out_specs=tile,
            ),
            input_output_aliases={3: 0} if aliased else {},
            interpret=interpret,
            # The items of a block must run in order on one core.
            compiler_params=None if interpret else pltpu.CompilerParams(dimension_semantics=("arbitrary",)),
            name="zeroth_fused_replay_flat",
        )(jnp.asarray(table.reshape(-1)), keys_g, scales, x2d)
    return x2d.reshape(n)


# --------------------------------------------------------------------------- native CPU kernel


def perturb_native(
    x,
    leaf_keys_,
    scales,
    *,
    distribution: str = "binomial",
    offset: int = 0,
    inplace: bool = False,
    build: cpu_native.BuildConfig = cpu_native.DEFAULT_BUILD,
) -> jax.Array:
    """The native CPU kernel on one leaf (see :func:`perturb_reference` for the arguments).

    Args:
      inplace: alias the output to ``x``'s buffer (under ``jit`` with ``x`` donated: no copy;
        without donation XLA would insert one, so leave it False there).
      build: which compiled variant to call (tests compare the portable and native builds).

    Raises:
      RuntimeError: the kernel cannot be built (``cpu_native.available()`` says so without raising).
    """
    x, keys, scales = _check_args(x, leaf_keys_, scales, distribution)
    offset = _check_offset(offset, x.size)
    name = cpu_native.register(build)
    call = jax.ffi.ffi_call(
        name,
        jax.ShapeDtypeStruct(x.shape, x.dtype),
        input_output_aliases={0: 0} if inplace else None,
    )
    return call(x, keys, scales, distribution=np.int32(_DIST_CODE[distribution]), offset=np.int64(offset))


def perturb_native_tree(
    leaves: list,
    keys,
    scales,
    leaf_ids: list[int],
    *,
    distribution: str = "binomial",
    inplace: bool = False,
    build: cpu_native.BuildConfig = cpu_native.DEFAULT_BUILD,
) -> list[jax.Array]:
    """The native CPU kernel on every leaf of a replay in **one launch** (one custom call): the
    leaf keys ``fold_in(keys[u], leaf_ids[i])`` are derived inside it, the tiles of all leaves
    are shared out to the threads together. Same bits as :func:`perturb_native` leaf by leaf.

    Args:
      leaves: the arrays (f32 / bf16 / f16, any shapes).
      keys: ``u32[K, 2]`` *sample* keys; scales: ``f32[K]`` host-rounded scales.
      leaf_ids: one 32-bit id per leaf (:func:`zeroth.rng.leaf_id` of its path).
      inplace: alias every output to its leaf's buffer (under ``jit`` with the leaves donated).
    """
    _noise.check_distribution(distribution)
    if len(leaf_ids) != len(leaves):
        raise ValueError(f"{len(leaves)} leaves but {len(leaf_ids)} leaf ids")
    leaves = [jnp.asarray(x) for x in leaves]
    for i, x in enumerate(leaves):
        _rule.check_dtype(x.dtype, f"leaf {i}")
        _check_offset(0, x.size)
    keys = jnp.asarray(keys, jnp.uint32).reshape(-1, 2)
    scales = jnp.asarray(scales, jnp.float32).reshape(-1)
    if scales.shape[0] != keys.shape[0]:
        raise ValueError(f"{keys.shape[0]} keys but {scales.shape[0]} scales")
    if not leaves:
        return []
    cpu_native.register(build)
    call = jax.ffi.ffi_call(
        cpu_native.target_name(build, tree=True),
        [jax.ShapeDtypeStruct(x.shape, x.dtype) for x in leaves],
        input_output_aliases={i + 2: i for i in range(len(leaves))} if inplace else None,
    )
    return list(
        call(keys, scales, *leaves, leaf_ids=np.asarray(leaf_ids, np.int64),
             distribution=np.int32(_DIST_CODE[distribution]))
    )


def _check_segments(segments, n: int, what: str) -> tuple[tuple[int, int, int], ...]:
    """``segments`` as a tuple of ``(offset, size, leaf_id)`` int triples, each inside ``[0, n)``,
    not overlapping one another, with fewer than 2**32 elements and a 32-bit leaf id."""
    out = tuple((int(o), int(z), int(lid)) for o, z, lid in segments)
    end = 0
    for o, z, lid in sorted(out):
        if o < end or z < 0 or o + z > n or z > _noise.MAX_LEAF_SIZE or not 0 <= lid < 2**32:
            raise ValueError(
                f"{what}: segment (offset {o}, size {z}, leaf id {lid}) must lie in [0, {n}) after the previous "
                f"one (which ends at {end}), hold fewer than 2**32 elements and have a 32-bit leaf id"
            )
        end = o + z
    return out


def perturb_native_flat(
    buffer,
    keys,
    scales,
    segments,
    *,
    distribution: str = "binomial",
    inplace: bool = False,
    build: cpu_native.BuildConfig = cpu_native.DEFAULT_BUILD,
) -> jax.Array:
    """The native CPU kernel on every segment of one flat buffer in **one launch** (one custom
    call): segment ``(offset, size, leaf_id)`` is a whole leaf of ``size`` elements stored at
    ``buffer[offset : offset + size]``, its noise counters start at 0 there, and its leaf keys
    ``fold_in(keys[u], leaf_id)`` are derived inside the kernel. Same bits as
    :func:`perturb_native_tree` on the leaves; elements outside every segment keep their bits.

    Args:
      buffer: a 1-D f32 / bf16 / f16 array.
      keys: ``u32[K, 2]`` *sample* keys; scales: ``f32[K]`` host-rounded scales.
      segments: ``(offset, size, leaf_id)`` int triples (static; not overlapping).
      inplace: alias the output to ``buffer`` (under ``jit`` with the buffer donated: no copy).
    """
    _noise.check_distribution(distribution)
    buffer = jnp.asarray(buffer)
    _rule.check_dtype(buffer.dtype, "flat buffer")
    if buffer.ndim != 1:
        raise ValueError(f"the flat buffer must be 1-D, got shape {buffer.shape}")
    segments = _check_segments(segments, buffer.shape[0], "perturb_native_flat")
    keys = jnp.asarray(keys, jnp.uint32).reshape(-1, 2)
    scales = jnp.asarray(scales, jnp.float32).reshape(-1)
    if scales.shape[0] != keys.shape[0]:
        raise ValueError(f"{keys.shape[0]} keys but {scales.shape[0]} scales")
    cpu_native.register(build)
    call = jax.ffi.ffi_call(
        cpu_native.target_name(build, flat=True),
        jax.ShapeDtypeStruct(buffer.shape, buffer.dtype),
        input_output_aliases={2: 0} if inplace else None,
    )
    column = lambda j: np.asarray([seg[j] for seg in segments], np.int64)  # noqa: E731
    return call(keys, scales, buffer, offsets=column(0), sizes=column(1), leaf_ids=column(2),
                distribution=np.int32(_DIST_CODE[distribution]))


# --------------------------------------------------------------------------- slices chosen at run time


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
    x, keys, scales = _check_args(x, leaf_keys_, scales, distribution)
    shape = tuple(int(d) for d in shape)
    base, size = _leaf_in(x, base, size)
    start = _slice_start(start, int(np.prod(shape, dtype=np.int64)), size)
    _check_offset(0, size)
    cpu_native.register(build)
    call = jax.ffi.ffi_call(cpu_native.target_name(build, sliced=True), jax.ShapeDtypeStruct(shape, x.dtype))
    # the kernel reads from element start + base of x, with the noise of index (start + base) - base
    at = start + jnp.uint32(base) if base else start
    return call(x, keys, scales, at.reshape(1), distribution=np.int32(_DIST_CODE[distribution]), offset=np.int64(-base),
                end=np.int64(base + size))


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
    impl = resolve_impl(impl, platform, int(np.shape(leaf_keys_)[0]))
    if impl == "native":
        return perturb_native_slice(x, leaf_keys_, scales, start, shape, distribution=distribution, base=base, size=size)
    x = jnp.asarray(x)
    base, size = _leaf_in(x, base, size)
    _check_offset(0, size)  # every global index fits in 32 bits
    shape = tuple(int(d) for d in shape)
    m = int(np.prod(shape, dtype=np.int64))
    # clamped to the leaf (the noise's indices too), as the dynamic slice alone clamps to x only
    start = jnp.minimum(_slice_start(start, m, size), jnp.uint32(size - m))
    piece = jax.lax.dynamic_slice(x.reshape(-1), (start + jnp.uint32(base) if base else start,), (m,))
    return perturb_reference(piece, leaf_keys_, scales, distribution=distribution, offset=start).reshape(shape)


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
    table, keys, scales = _check_args(table, leaf_keys_, scales, distribution)
    if table.ndim < 1:
        raise ValueError(f"rows of a 0-d leaf: the table must have at least one axis, got shape {table.shape}")
    _check_offset(0, table.size)
    ids = jnp.asarray(ids)
    if not jnp.issubdtype(ids.dtype, jnp.integer):
        raise ValueError(f"row ids must be integers, got dtype {ids.dtype}")
    row_shape = table.shape[1:]
    r = int(np.prod(row_shape, dtype=np.int64))
    within_row = jax.lax.iota(jnp.uint32, r).reshape((1,) * ids.ndim + row_shape)
    idx = ids.astype(jnp.uint32).reshape(ids.shape + (1,) * len(row_shape)) * jnp.uint32(r) + within_row
    call = idx >> _LOG2_PER_CALL[distribution]
    within = idx & jnp.uint32(_PER_CALL[distribution] - 1)
    p32 = _rule.flush_tiny(table[ids].astype(jnp.float32))

    def body(u, p):
        return _update_block(p, call, within, keys[u, 0], keys[u, 1], scales[u], distribution)

    if keys.shape[0] == 1:
        p32 = body(0, p32)
    elif keys.shape[0] > 1:
        p32 = jax.lax.fori_loop(0, keys.shape[0], body, p32)
    return _rule.cast_flushed(p32, table.dtype)


# --------------------------------------------------------------------------- dispatch


def perturb_leaf(
    x,
    leaf_keys_,
    scales,
    *,
    distribution: str = "binomial",
    offset: int = 0,
    impl: str = "auto",
    inplace: bool = False,
    block_sizes: BlockSizes | None = None,
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
    impl = resolve_impl(impl, platform, int(np.shape(leaf_keys_)[0]), jnp.result_type(x))
    if impl == "native":
        return perturb_native(x, leaf_keys_, scales, distribution=distribution, offset=offset, inplace=inplace)
    if impl == "pallas":
        return perturb_pallas(
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
    return perturb_reference(x, leaf_keys_, scales, distribution=distribution, offset=offset)


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
    block_sizes: BlockSizes | None = None,
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
        raise ValueError(f"leaf_keys must be u32[L, K, 2] = {[len(leaves), keys.shape[0], 2]} for these "
                         f"{len(leaves)} leaves and {keys.shape[0]} keys, got shape {list(np.shape(leaf_keys))}")
    run = functools.partial(
        _apply_leaves, ids=ids, distribution=distribution, impl=impl, inplace=inplace,
        block_sizes=block_sizes, interpret=interpret, per_leaf=per_leaf, given=leaf_keys,
    )
    return jax.tree_util.tree_unflatten(treedef, _by_platform(run, leaves, keys, scales, impl=impl, platform=platform))


APART_MIN_BYTES = 1 << 20
"""With ``per_leaf``, the jnp rule and the Pallas kernels update each leaf of at least this many
bytes from operands of its own (:func:`apply_updates`); smaller leaves may still share a fusion."""


def _apply_leaves(leaves, keys, scales, *, ids, distribution, impl, inplace, block_sizes, interpret, platform, per_leaf,
                  given=None):
    """The updated ``leaves`` with the implementation for ``platform`` (see :func:`apply_updates`);
    on a TPU each leaf's dtype may take it to the jnp rule (:data:`zeroth.rule.MOSAIC_REFUSES`)."""
    requested, impl = impl, resolve_impl(impl, platform, keys.shape[0])
    if impl == "native" and per_leaf:  # one launch per leaf, leaf keys derived inside the kernel
        return [
            perturb_native_tree([leaf], keys, scales, [lid], distribution=distribution, inplace=inplace)[0]
            for leaf, lid in zip(leaves, ids)
        ]
    if impl == "native":  # every leaf in one launch, leaf keys derived inside the kernel
        return perturb_native_tree(leaves, keys, scales, ids, distribution=distribution, inplace=inplace)
    # every leaf's keys in one computation per call: derived leaf by leaf, each would be an op of
    # its own before the leaf's (on a GPU, a kernel launch per leaf; ZO estimator, transformer at
    # the default width, batch 256: 437 ops per call against 573 on a CPU)
    all_keys = given if given is not None else (_all_leaf_keys(keys, ids) if ids else None)

    def update(i, leaf):
        leaf_impl = resolve_impl(requested, platform, keys.shape[0], leaf.dtype)
        leaf_keys_, offset = all_keys[i], 0
        if per_leaf and leaf.size * leaf.dtype.itemsize >= APART_MIN_BYTES:
            leaf_keys_, zero = _keys_apart(all_keys, i)
            if leaf_impl == "jnp":  # the Pallas kernel takes a static offset
                offset = zero
        return perturb_leaf(
            leaf, leaf_keys_, scales, distribution=distribution, offset=offset, impl=leaf_impl, inplace=inplace,
            block_sizes=block_sizes, interpret=interpret, platform=platform,
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
    block_sizes: BlockSizes | None = None,
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
    segments = tuple(_check_segments(seg, b.shape[0], f"flat buffer {i}") for i, (b, seg) in enumerate(zip(buffers, segments)))
    run = functools.partial(
        _apply_flat, segments=segments, distribution=distribution, impl=impl, inplace=inplace,
        block_sizes=block_sizes, interpret=interpret,
    )
    return _by_platform(run, buffers, keys, scales, impl=impl, platform=platform)


def _all_leaf_keys(keys, ids: list[int]) -> jax.Array:
    """``u32[L, K, 2]``: :func:`leaf_keys` of the sample keys ``u32[K, 2]`` for every leaf id at once."""
    keys = jnp.asarray(keys, jnp.uint32).reshape(-1, 2)
    lid = jnp.asarray(np.asarray(ids, np.uint32))[:, None]
    k0 = jnp.broadcast_to(keys[None, :, 0], (len(ids), keys.shape[0]))
    k1 = jnp.broadcast_to(keys[None, :, 1], (len(ids), keys.shape[0]))
    x0, x1 = _rng.threefry2x32((k0, k1), (jnp.zeros_like(k0), jnp.broadcast_to(lid, k0.shape)))
    return jnp.stack([x0, x1], axis=-1)


def _apply_flat(buffers, keys, scales, *, segments, distribution, impl, inplace, block_sizes, interpret, platform):
    """The updated ``buffers`` with the implementation for ``platform`` (see :func:`apply_updates_flat`)."""
    platform = _rule.default_platform() if platform is None else _rule.platform_name(platform)
    # On GPU the flat kernel is one launch for every K; the jnp rule would be one fusion per segment.
    n_updates = None if platform == "gpu" else keys.shape[0]
    requested, impl = impl, resolve_impl(impl, platform, n_updates)
    if impl == "native":  # one launch per buffer, leaf keys derived inside the kernel
        return [
            perturb_native_flat(b, keys, scales, seg, distribution=distribution, inplace=inplace)
            for b, seg in zip(buffers, segments)
        ]
    ids = [lid for seg in segments for _, _, lid in seg]
    all_keys = _all_leaf_keys(keys, ids) if ids else None  # every segment's leaf keys, once per call
    out, first = [], 0
    for b, seg in zip(buffers, segments):
        seg_keys, first = (all_keys[first : first + len(seg)] if seg else None), first + len(seg)
        buffer_impl = resolve_impl(requested, platform, n_updates, b.dtype)  # a float16 buffer on a TPU: jnp
        if buffer_impl == "pallas" and b.shape[0] <= _FLAT_MAX_ELEMENTS and (
                platform != "tpu" or tpu_flat_fits(b.shape[0], b.dtype, block_sizes)):
            out.append(b if not seg else perturb_pallas_flat(
                b, seg_keys, scales, seg, distribution=distribution, block_sizes=block_sizes, interpret=interpret,
                inplace=inplace, platform=platform,
            ))
            continue
        for j, (o, z, _) in enumerate(seg):  # the jnp rule, a TPU buffer not in whole blocks: segment by segment
            new = perturb_leaf(
                jax.lax.slice(b, (o,), (o + z,)), seg_keys[j], scales, distribution=distribution, impl=buffer_impl,
                block_sizes=block_sizes, interpret=interpret, platform=platform,
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
        raise ValueError(f"keys must be uint32 of shape (2,) or (K, 2), got dtype {keys_np.dtype} shape {keys_np.shape}")
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
        impl = resolve_impl(impl, platform_of(params), keys_np.shape[0])
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
