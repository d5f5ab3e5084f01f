"""Sign bits, 32 per ``uint32`` word: pack, unpack, the Marsit merge, exact Bernoulli bits, majority.

One file in the style of jax's Pallas ops: block functions shared by the Pallas kernels and the
plain ``jnp`` reference, the kernels, and wrappers that pick tiles and dispatch (Pallas on GPU
and TPU, ``jnp`` on CPU, where Pallas runs only in interpret mode, for tests).

The layout, the sign convention, the Bernoulli bits, the Marsit merge and the bit-sliced counts
are specified in the docs (Kernels: "Sign bits").

Example:
  >>> import jax.numpy as jnp
  >>> w = pack(jnp.array([1.0, -2.0, 0.0, -0.0]))
  >>> int(w[0])  # bits 0, 2, 3 set
  13
  >>> unpack(w, (4,)).tolist()
  [1.0, -1.0, 1.0, 1.0]
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from zeroth import noise as _noise
from zeroth import rule as _rule
from zeroth.rng import threefry2x32
from zeroth.kernels import out_struct, triton_params

__all__ = [
    "WORD_BITS",
    "IMPLS",
    "Blocks",
    "n_words",
    "threshold",
    "pack",
    "unpack",
    "merge",
    "majority",
    "count_add",
    "counts_add",
    "count_geq",
]

WORD_BITS = 32
IMPLS = ("auto", "pallas", "jnp")
_U32_LIMIT = 1 << 32


@dataclasses.dataclass(frozen=True)
class Blocks:
    """Tile sizes of the Pallas kernels.

    Attributes:
      words: packed words per tile (``32 * words`` elements); a power of two >= 8.
    """

    words: int = 512

    def __post_init__(self):
        w = self.words
        if not isinstance(w, int) or isinstance(w, bool) or w < 8 or w & (w - 1):
            raise ValueError(f"Blocks.words must be a power of two >= 8, got {w!r}")


DEFAULT_BLOCKS = Blocks()


def n_words(n: int) -> int:
    """Words needed for ``n`` sign bits: ``ceil(n / 32)``."""
    if n < 0:
        raise ValueError(f"number of elements must be >= 0, got {n}")
    return -(-n // WORD_BITS)


def threshold(num: int, den: int) -> int:
    """Integer threshold ``T = round(num * 2**32 / den)`` (half up) of a Bernoulli(num/den) bit.

    The bit ``u < T`` of a uniform 32-bit ``u`` is 1 with probability exactly ``T / 2**32``,
    within ``2**-33`` of ``num / den``; ``T = 2**32`` (``num == den``) means always 1.

    Example:
      >>> threshold(1, 2)
      2147483648
    """
    if not (isinstance(num, int) and isinstance(den, int)) or den <= 0 or not 0 <= num <= den:
        raise ValueError(f"need integers 0 <= num <= den, den > 0; got num={num!r}, den={den!r}")
    return ((num << 32) + den // 2) // den


def resolve_impl(impl: str, dtype=None, platform: str | None = None) -> str:
    """``"auto"`` -> ``"pallas"`` where uncommitted arrays go to a GPU or TPU
    (:func:`zeroth.rule.default_platform`), ``"jnp"`` on CPU and on a TPU v3 or v4, whose Mosaic
    cannot compile the kernels' lane reductions (:func:`zeroth.rule.lacks_sublane_gather`); other
    names are checked and returned. For float arrays of ``dtype`` on a TPU (``platform``, default
    :func:`zeroth.rule.default_platform`), a dtype of :data:`zeroth.rule.MOSAIC_REFUSES` (float16)
    takes ``"jnp"`` under ``"auto"`` and is refused under ``"pallas"``."""
    if impl not in IMPLS:
        raise ValueError(f"unknown impl {impl!r}; expected one of {list(IMPLS)}")
    if _rule.mosaic_refuses(impl, dtype, platform):
        return "jnp"
    if impl == "auto":
        if _rule.lacks_sublane_gather():
            return "jnp"
        return "pallas" if _rule.default_platform() in ("gpu", "tpu") else "jnp"
    return impl


def _check_float(x) -> jax.Array:
    x = jnp.asarray(x)
    if not jnp.issubdtype(x.dtype, jnp.floating):
        raise TypeError(f"pack takes a floating array, got dtype {x.dtype}")
    return x


def _check_words(name: str, w) -> jax.Array:
    w = jnp.asarray(w)
    if w.dtype != jnp.uint32 or w.ndim != 1:
        raise TypeError(f"{name} must be packed words u32[n_words], got dtype {w.dtype} shape {w.shape}")
    return w


def _check_key(key) -> jax.Array:
    key = jnp.asarray(key)
    if key.dtype != jnp.uint32 or key.shape != (2,):
        raise TypeError(f"key must be u32[2] (e.g. from zeroth.rng.fold_in), got dtype {key.dtype} shape {key.shape}")
    return key


def _check_m(m) -> int:
    if not isinstance(m, int) or isinstance(m, bool) or m < 1:
        raise ValueError(f"m (the merging worker's position in the chain, 1-based) must be an int >= 1, got {m!r}")
    return m


# --------------------------------------------------------------------------- block functions
# Shared by the kernels (on one tile) and the references (on the whole array).


def _or_rows(words: jax.Array) -> jax.Array:
    """OR along axis 1 of ``u32`` values whose set bits are disjoint, as an int32 sum.

    Disjoint bits never carry, so the two's-complement sum has exactly the OR's bits; Mosaic
    (TPU) has no reductions over unsigned integers, hence the round trip through int32.
    """
    as_int = jax.lax.bitcast_convert_type(words, jnp.int32)
    return jax.lax.bitcast_convert_type(jnp.sum(as_int, axis=1, dtype=jnp.int32), jnp.uint32)


def _pack_block(x2: jax.Array) -> jax.Array:
    """``(rows, 32)`` floats -> ``u32[rows]``."""
    bits = jnp.logical_not(x2 <= -jnp.finfo(x2.dtype).tiny).astype(jnp.uint32)
    lanes = jax.lax.broadcasted_iota(jnp.uint32, x2.shape, 1)
    return _or_rows(bits << lanes)


def _unpack_block(w: jax.Array, scale: jax.Array, dtype) -> jax.Array:
    """``u32[rows]`` -> ``(rows, 32)`` of ``+scale`` / ``-scale`` in ``dtype``."""
    lanes = jax.lax.broadcasted_iota(jnp.uint32, (w.shape[0], WORD_BITS), 1)
    bits = (w[:, None] >> lanes) & jnp.uint32(1)
    scale = scale.astype(jnp.float32)
    return jnp.where(bits == 1, scale, -scale).astype(dtype)


def _bernoulli_block(key: jax.Array, word0, rows: int, thresh: int) -> jax.Array:
    """Bernoulli words for global word indices ``word0 .. word0 + rows`` (``word0`` may be traced)."""
    if thresh <= 0:
        return jnp.zeros((rows,), jnp.uint32)
    if thresh >= _U32_LIMIT:
        return jnp.full((rows,), 0xFFFFFFFF, jnp.uint32)
    half = WORD_BITS // 2
    k = jax.lax.broadcasted_iota(jnp.uint32, (rows, half), 1)
    w = jax.lax.broadcasted_iota(jnp.uint32, (rows, half), 0) + jnp.asarray(word0, jnp.uint32)
    calls = w * jnp.uint32(half) + k
    x0, x1 = threefry2x32((key[0], key[1]), (jnp.zeros_like(calls), calls))
    b0, b1 = _noise.bernoulli_bits(x0, x1, thresh)
    even = b0 << (k * jnp.uint32(2))
    odd = b1 << (k * jnp.uint32(2) + jnp.uint32(1))
    return _or_rows(even | odd)


def _merge_block(v: jax.Array, vs: jax.Array, key: jax.Array, word0, m: int) -> jax.Array:
    s = _bernoulli_block(key, word0, v.shape[0], threshold(1, m))
    r = ~(s ^ vs)
    return (v & vs) | ((v ^ vs) & r)


def planes_for(bound: int) -> int:
    """Bit planes needed for counts in ``[0, bound]``: ``max(1, bound.bit_length())``."""
    if bound < 0:
        raise ValueError(f"count bound must be >= 0, got {bound}")
    return max(1, int(bound).bit_length())


def count_add(planes: list, words: jax.Array, bound: int) -> list:
    """Add a 1-bit vector to bit-sliced counts: ``count + words`` for every bit position.

    Args:
      planes: counts, a list of ``u32[n]`` planes (least significant first); ``[]`` is zero.
      words: ``u32[n]`` packed bits to add.
      bound: the largest count after the addition (fixes the number of planes returned).

    Returns:
      ``planes_for(bound)`` planes.
    """
    out, carry = [], words
    for p in planes:
        out.append(p ^ carry)
        carry = p & carry
    out.append(carry)
    return _fit(out, planes_for(bound), words)


def counts_add(a: list, b: list, bound: int) -> list:
    """Add two bit-sliced counts position by position (ripple-carry on whole words).

    Returns ``planes_for(bound)`` planes; ``bound`` is the largest possible sum.
    """
    like = (a or b)[0]
    zero = jnp.zeros_like(like)
    n = max(len(a), len(b))
    out, carry = [], zero
    for j in range(n):
        x = a[j] if j < len(a) else zero
        y = b[j] if j < len(b) else zero
        xy = x ^ y
        out.append(xy ^ carry)
        carry = (x & y) | (carry & xy)
    out.append(carry)
    return _fit(out, planes_for(bound), like)


def _fit(planes: list, n: int, like) -> list:
    planes = list(planes[:n])
    while len(planes) < n:
        planes.append(jnp.zeros_like(like))
    return planes


def count_geq(planes: list, t: int) -> jax.Array:
    """Packed bits of ``count >= t`` for a static integer ``t >= 1`` (bitwise comparator, MSB first)."""
    if not isinstance(t, int) or t < 1:
        raise ValueError(f"threshold t must be an int >= 1 (padding bits must stay 0), got {t!r}")
    if t >> len(planes):
        return jnp.zeros_like(planes[0])
    ones = jnp.full_like(planes[0], 0xFFFFFFFF)
    gt, eq = jnp.zeros_like(planes[0]), ones
    for j in reversed(range(len(planes))):
        c = planes[j]
        if (t >> j) & 1:
            eq = eq & c
        else:
            gt = gt | (eq & c)
            eq = eq & ~c
    return gt | eq


def _majority_block(rows: list) -> jax.Array:
    planes: list = []
    for k, w in enumerate(rows):
        planes = count_add(planes, w, k + 1)
    return count_geq(planes, (len(rows) + 1) // 2)


# --------------------------------------------------------------------------- references (plain jnp)


def _pad_to_words(flat: jax.Array, total_words: int) -> jax.Array:
    pad = total_words * WORD_BITS - flat.shape[0]
    if pad:
        # -1 packs to bit 0: padding bits stay 0.
        flat = jnp.concatenate([flat, jnp.full((pad,), -1, flat.dtype)])
    return flat.reshape(total_words, WORD_BITS)


def pack_ref(x) -> jax.Array:
    """``jnp`` reference of :func:`pack`."""
    x = _check_float(x)
    nw = n_words(x.size)
    if nw == 0:
        return jnp.zeros((0,), jnp.uint32)
    return _pack_block(_pad_to_words(x.reshape(-1), nw))


def unpack_ref(words, shape, *, dtype=jnp.float32, scale=1.0) -> jax.Array:
    """``jnp`` reference of :func:`unpack`."""
    words, n = _check_unpack(words, shape)
    scale = jnp.asarray(scale, jnp.float32)
    out = _unpack_block(words, scale, dtype).reshape(-1)[:n]
    return out.reshape(tuple(shape))


def bernoulli_words(key, n: int, thresh: int, *, word_offset: int = 0) -> jax.Array:
    """``u32[n]`` packed Bernoulli bits, ``P(bit) = thresh / 2**32`` (see module docstring).

    Args:
      key: ``u32[2]`` stream key (traced allowed).
      n: number of words (``32 n`` bits).
      thresh: integer threshold in ``[0, 2**32]`` (see :func:`threshold`).
      word_offset: global index of the first word (a tile's or a slice's position in the stream).

    Example:
      >>> import numpy as np
      >>> bernoulli_words(np.array([0, 1], np.uint32), 2, threshold(1, 1)).tolist()
      [4294967295, 4294967295]
    """
    key = _check_key(key)
    if not 0 <= thresh <= _U32_LIMIT:
        raise ValueError(f"threshold must be in [0, 2**32], got {thresh}")
    return _bernoulli_block(key, word_offset, n, thresh)


def transient_words(key, v_star, m: int, *, word_offset: int = 0) -> jax.Array:
    """The transient vector ``r`` of equation (2) for the ``m``-th contributor.

    ``P(r_j = 1) = (m-1)/m`` where bit ``j`` of ``v_star`` is 0 and ``1/m`` where it is 1;
    ``r = NOT (s XOR v_star)`` with ``s`` = Bernoulli(1/m) bits of ``key``. Padding bits of ``r``
    are not meaningful (the merge masks them with ``v XOR v*``, which is 0 there).
    """
    key, v_star, m = _check_key(key), _check_words("v_star", v_star), _check_m(m)
    s = _bernoulli_block(key, word_offset, v_star.shape[0], threshold(1, m))
    return ~(s ^ v_star)


def merge_ref(v, v_star, key, m: int, *, word_offset: int = 0) -> jax.Array:
    """``jnp`` reference of :func:`merge`."""
    v, v_star = _check_merge(v, v_star)
    return _merge_block(v, v_star, _check_key(key), word_offset, _check_m(m))


def majority_ref(words) -> jax.Array:
    """``jnp`` reference of :func:`majority`."""
    words = _check_stack(words)
    return _majority_block([words[k] for k in range(words.shape[0])])


def _check_unpack(words, shape):
    words = _check_words("words", words)
    shape = tuple(int(s) for s in shape)
    n = math.prod(shape)
    if words.shape[0] != n_words(n):
        raise ValueError(f"{words.shape[0]} words cannot hold shape {shape}: need n_words({n}) = {n_words(n)}")
    return words, n


def _check_merge(v, v_star):
    v, v_star = _check_words("v", v), _check_words("v_star", v_star)
    if v.shape != v_star.shape:
        raise ValueError(f"v and v_star must have one shape, got {v.shape} and {v_star.shape}")
    return v, v_star


def _check_stack(words) -> jax.Array:
    words = jnp.asarray(words)
    if words.dtype != jnp.uint32 or words.ndim != 2 or words.shape[0] < 1:
        raise TypeError(f"majority takes u32[K >= 1, n_words], got dtype {words.dtype} shape {words.shape}")
    return words


# --------------------------------------------------------------------------- Pallas kernels


def _pack_kernel(x_ref, o_ref):
    o_ref[...] = _pack_block(x_ref[...])


def _unpack_kernel(w_ref, s_ref, o_ref, *, dtype):
    o_ref[...] = _unpack_block(w_ref[...], s_ref[0], dtype)


def _merge_kernel(v_ref, vs_ref, key_ref, o_ref, *, m: int, rows: int, word_offset: int):
    word0 = pl.program_id(0) * rows + word_offset
    key = (key_ref[0], key_ref[1])  # two scalar loads
    o_ref[...] = _merge_block(v_ref[...], vs_ref[...], key, word0, m)


def _majority_kernel(w_ref, o_ref, *, k: int):
    o_ref[...] = _majority_block([w_ref[i, :] for i in range(k)])


def _compiler_params(platform: str | None, interpret: bool):
    """Triton parameters on GPU (:func:`zeroth.kernels.triton_params`), none elsewhere."""
    platform = _rule.default_platform() if platform is None else _rule.platform_name(platform)
    if interpret or platform != "gpu":
        return None
    return triton_params()


def _tiles(nw: int, blocks: Blocks) -> tuple[int, int]:
    bw = blocks.words
    n_tiles = max(1, -(-nw // bw))
    return bw, n_tiles


def _pad_words(w: jax.Array, total: int) -> jax.Array:
    return jnp.pad(w, [(0, 0)] * (w.ndim - 1) + [(0, total - w.shape[-1])])


def _pack_pallas(x: jax.Array, blocks: Blocks, interpret: bool, platform: str | None) -> jax.Array:
    nw = n_words(x.size)
    bw, n_tiles = _tiles(nw, blocks)
    x2 = _pad_to_words(x.reshape(-1), n_tiles * bw)
    out = pl.pallas_call(
        _pack_kernel,
        out_shape=out_struct((n_tiles * bw,), jnp.uint32, x2),
        grid=(n_tiles,),
        in_specs=[pl.BlockSpec((bw, WORD_BITS), lambda i: (i, 0))],
        out_specs=pl.BlockSpec((bw,), lambda i: (i,)),
        interpret=interpret,
        compiler_params=_compiler_params(platform, interpret),
        name="zeroth_signbits_pack",
    )(x2)
    return out[:nw]


def _unpack_pallas(words, n, scale, dtype, blocks: Blocks, interpret: bool, platform: str | None) -> jax.Array:
    nw = words.shape[0]
    bw, n_tiles = _tiles(nw, blocks)
    out = pl.pallas_call(
        functools.partial(_unpack_kernel, dtype=dtype),
        out_shape=out_struct((n_tiles * bw, WORD_BITS), dtype, words, scale),
        grid=(n_tiles,),
        in_specs=[pl.BlockSpec((bw,), lambda i: (i,)), pl.BlockSpec((1,), lambda i: (0,))],
        out_specs=pl.BlockSpec((bw, WORD_BITS), lambda i: (i, 0)),
        interpret=interpret,
        compiler_params=_compiler_params(platform, interpret),
        name="zeroth_signbits_unpack",
    )(_pad_words(words, n_tiles * bw), scale.reshape(1))
    return out.reshape(-1)[:n]


def _merge_pallas(v, vs, key, m, word_offset, blocks: Blocks, interpret: bool, platform: str | None) -> jax.Array:
    nw = v.shape[0]
    bw, n_tiles = _tiles(nw, blocks)
    word_spec = pl.BlockSpec((bw,), lambda i: (i,))
    out = pl.pallas_call(
        functools.partial(_merge_kernel, m=m, rows=bw, word_offset=word_offset),
        out_shape=out_struct((n_tiles * bw,), jnp.uint32, v, vs, key),
        grid=(n_tiles,),
        in_specs=[word_spec, word_spec, pl.BlockSpec((2,), lambda i: (0,))],
        out_specs=word_spec,
        interpret=interpret,
        compiler_params=_compiler_params(platform, interpret),
        name="zeroth_signbits_merge",
    )(_pad_words(v, n_tiles * bw), _pad_words(vs, n_tiles * bw), key)
    return out[:nw]


def _majority_pallas(words, blocks: Blocks, interpret: bool, platform: str | None) -> jax.Array:
    k, nw = words.shape
    bw, n_tiles = _tiles(nw, blocks)
    out = pl.pallas_call(
        functools.partial(_majority_kernel, k=k),
        out_shape=out_struct((n_tiles * bw,), jnp.uint32, words),
        grid=(n_tiles,),
        in_specs=[pl.BlockSpec((k, bw), lambda i: (0, i))],
        out_specs=pl.BlockSpec((bw,), lambda i: (i,)),
        interpret=interpret,
        compiler_params=_compiler_params(platform, interpret),
        name="zeroth_signbits_majority",
    )(_pad_words(words, n_tiles * bw))
    return out[:nw]


# --------------------------------------------------------------------------- public wrappers


def pack(
    x, *, impl: str = "auto", blocks: Blocks = DEFAULT_BLOCKS, interpret: bool = False, platform: str | None = None
) -> jax.Array:
    """Pack the signs of a float array into ``u32[ceil(x.size / 32)]`` (see module docstring).

    Args:
      x: any shape (0-D allowed), any float dtype (f32, bf16, f16, ...).
      impl: ``"auto"`` (Pallas on GPU/TPU, jnp on CPU), ``"pallas"`` or ``"jnp"``.
      blocks: Pallas tile sizes.
      interpret: run the Pallas kernel in interpret mode (CPU tests).
      platform: the platform the Pallas kernel is lowered for (default :func:`zeroth.rule.default_platform`;
        ``"gpu"`` lowers through Triton). Every wrapper of this module takes it.

    Returns:
      Packed words; bit 1 where ``not x <= -tiny`` (see module docstring); padding bits 0.
    """
    x = _check_float(x)
    if resolve_impl(impl, x.dtype, platform) == "jnp" or x.size == 0:
        return pack_ref(x)
    return _pack_pallas(x, blocks, interpret, platform)


def unpack(
    words,
    shape,
    *,
    dtype=jnp.float32,
    scale=1.0,
    impl: str = "auto",
    blocks: Blocks = DEFAULT_BLOCKS,
    interpret: bool = False,
    platform: str | None = None,
) -> jax.Array:
    """Unpack sign bits to ``+scale`` (bit 1) / ``-scale`` (bit 0) of ``dtype`` and ``shape``.

    Args:
      words: ``u32[ceil(prod(shape) / 32)]``.
      shape: output shape.
      dtype: output dtype; ``±scale`` is formed in float32 (exact) and cast once.
      scale: a float32 scalar (may be traced), e.g. a global step size.

    Example:
      >>> unpack(pack(jnp.array([-3.0, 2.0])), (2,), scale=0.5).tolist()
      [-0.5, 0.5]
    """
    words, n = _check_unpack(words, shape)
    scale = jnp.asarray(scale, jnp.float32)
    if scale.shape != ():
        raise ValueError(f"scale must be a scalar, got shape {scale.shape}")
    if resolve_impl(impl, dtype, platform) == "jnp" or n == 0:
        return unpack_ref(words, shape, dtype=dtype, scale=scale)
    return _unpack_pallas(words, n, scale, jnp.dtype(dtype), blocks, interpret, platform).reshape(tuple(shape))


def merge(
    v,
    v_star,
    key,
    m: int,
    *,
    word_offset: int = 0,
    impl: str = "auto",
    blocks: Blocks = DEFAULT_BLOCKS,
    interpret: bool = False,
    platform: str | None = None,
) -> jax.Array:
    """The Marsit merge ``(v AND v*) OR ((v XOR v*) AND r)`` of the ``m``-th contributor.

    Args:
      v: ``u32[n]`` received bits (merged signs of contributors ``1..m-1``).
      v_star: ``u32[n]`` this worker's own sign bits.
      key: ``u32[2]`` key of this merge, e.g. ``fold_in`` of (run, round, hop, segment); every
        worker can regenerate ``r`` from it.
      m: this worker's 1-based position in the chain (``m = hop + 1``), static.
      word_offset: global word index of ``v[0]`` in the key's stream.

    Returns:
      ``u32[n]``, with ``E[bit] = ((m-1) v + v*) / m`` bit by bit.

    Example:
      >>> import numpy as np
      >>> k = np.array([0, 7], np.uint32)
      >>> same = pack(jnp.array([1.0, -1.0]))
      >>> bool((merge(same, same, k, 3) == same).all())
      True
    """
    v, v_star = _check_merge(v, v_star)
    key, m = _check_key(key), _check_m(m)
    if resolve_impl(impl) == "jnp" or v.shape[0] == 0:
        return _merge_block(v, v_star, key, word_offset, m)
    return _merge_pallas(v, v_star, key, m, word_offset, blocks, interpret, platform)


def majority(
    words, *, impl: str = "auto", blocks: Blocks = DEFAULT_BLOCKS, interpret: bool = False, platform: str | None = None
) -> jax.Array:
    """Bit-wise majority vote of ``K`` packed vectors ``u32[K, n]`` -> ``u32[n]``: ``2 * count >= K``.

    Counts are bit-sliced (a vertical popcount by ripple-carry adders); ties resolve to 1.

    Example:
      >>> import numpy as np
      >>> majority(np.array([[1], [3], [2]], np.uint32)).tolist()
      [3]
    """
    words = _check_stack(words)
    if resolve_impl(impl) == "jnp" or words.shape[1] == 0:
        return majority_ref(words)
    return _majority_pallas(words, blocks, interpret, platform)
