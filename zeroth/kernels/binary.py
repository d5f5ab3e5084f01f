"""Bit-packed binary and ternary layers: XOR-popcount dense and 3x3 convolution with an integer threshold.

One file in the style of jax's Pallas ops: the block function shared by the Pallas kernel and
the plain ``jnp`` version, the kernel, and wrappers that pad to whole tiles and dispatch. The
NumPy reference (no jax) is :mod:`zeroth.binary.reference`; all three agree bit for bit.

The bit layout, the weights, the op, the convolution and the tiling are specified in the docs
(Kernels: "Binary and ternary layers").

Example:
  >>> import numpy as np
  >>> x = np.array([[0b0101]], np.uint32)            # values (-1, +1, -1, +1)
  >>> w = np.array([[0b0001], [0b1111]], np.uint32)  # rows (-1,+1,+1,+1) and (-1,-1,-1,-1)
  >>> dots(x, w, n=4).tolist()                        # 4 - 2*popcount(x ^ w)
  [[2, 0]]
  >>> dense(x, w, np.array([1, 1], np.int32), n=4).tolist()   # 2 >= 1 -> +1 (0); 0 < 1 -> -1 (bit 1)
  [[2]]
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from zeroth import rule as _rule
from zeroth.kernels import out_struct, triton_params
from zeroth.noise import popcount

__all__ = [
    "Blocks",
    "DEFAULT_BLOCKS",
    "IMPLS",
    "WORD_BITS",
    "INT32_MIN",
    "n_words",
    "resolve_impl",
    "popcount",
    "valid_counts",
    "dots",
    "dots_ref",
    "dense",
    "dense_ref",
    "im2col3x3",
    "conv3x3",
    "conv3x3_ref",
    "conv3x3_dots",
]

WORD_BITS = 32
IMPLS = ("auto", "pallas", "jnp")
INT32_MIN = -(2**31)


@dataclasses.dataclass(frozen=True)
class Blocks:
    """Tile sizes of the Pallas kernel.

    Attributes:
      rows: batch rows (or conv pixels) per tile; a power of two >= 8 (128 suits TPU tiling).
    """

    rows: int = 128

    def __post_init__(self):
        r = self.rows
        if not isinstance(r, int) or isinstance(r, bool) or r < 8 or r & (r - 1):
            raise ValueError(f"Blocks.rows must be a power of two >= 8, got {r!r}")


DEFAULT_BLOCKS = Blocks()


def n_words(n: int) -> int:
    """Words holding ``n`` bits: ``ceil(n / 32)``."""
    if n < 0:
        raise ValueError(f"number of bits must be >= 0, got {n}")
    return -(-n // WORD_BITS)


def resolve_impl(impl: str) -> str:
    """``"auto"`` -> ``"pallas"`` on GPU and TPU, ``"jnp"`` on CPU and on a TPU v3 or v4, whose
    Mosaic cannot compile the kernel's lane reduction (:func:`zeroth.rule.lacks_sublane_gather`);
    other names are checked and returned."""
    if impl not in IMPLS:
        raise ValueError(f"unknown impl {impl!r}; expected one of {list(IMPLS)}")
    if impl == "auto":
        if _rule.lacks_sublane_gather():
            return "jnp"
        return "pallas" if _rule.default_platform() in ("gpu", "tpu") else "jnp"
    return impl


def _next_pow2(n: int) -> int:
    return 1 if n <= 1 else 1 << (n - 1).bit_length()


# --------------------------------------------------------------------------- checks


def _u32_2d(name: str, a) -> jax.Array:
    a = jnp.asarray(a)
    if a.dtype != jnp.uint32 or a.ndim != 2:
        raise TypeError(f"{name} must be packed words u32[rows, words], got dtype {a.dtype} shape {a.shape}")
    return a


def _check_dense(x, sign, mask, thresh, n):
    x, sign = _u32_2d("x", x), _u32_2d("sign", sign)
    if x.shape[1] != sign.shape[1]:
        raise ValueError(f"x has {x.shape[1]} words per row but sign has {sign.shape[1]}; they must match")
    if mask is not None:
        mask = _u32_2d("mask", mask)
        if mask.shape != sign.shape:
            raise ValueError(f"mask shape {mask.shape} must equal sign shape {sign.shape}")
    elif n is None or not isinstance(n, int) or not 0 <= n <= WORD_BITS * x.shape[1]:
        raise ValueError(f"binary weights need n (valid bits per row, 0..{WORD_BITS * x.shape[1]}), got {n!r}")
    return x, sign, mask, None if thresh is None else _check_thresh(thresh, sign.shape[0])


def _check_thresh(thresh, o: int) -> jax.Array:
    dtype, shape = getattr(thresh, "dtype", None), getattr(thresh, "shape", None)
    if dtype != jnp.int32 or shape != (o,):
        raise TypeError(f"thresh must be int32[{o}], got dtype {dtype} shape {shape}")
    return jnp.asarray(thresh)


# --------------------------------------------------------------------------- block function


def _pack_rows(bits: jax.Array) -> jax.Array:
    """``(rows, 32)`` of 0/1 ``uint32`` -> ``u32[rows]`` (disjoint bits: the int32 sum is the OR)."""
    lanes = jax.lax.broadcasted_iota(jnp.uint32, bits.shape, 1)
    as_int = jax.lax.bitcast_convert_type(bits << lanes, jnp.int32)
    return jax.lax.bitcast_convert_type(jnp.sum(as_int, axis=1, dtype=jnp.int32), jnp.uint32)


# --------------------------------------------------------------------------- jnp versions


def valid_counts(sign, mask, n: int | None) -> jax.Array:
    """``int32[O]``: ``n`` for every output (binary) or ``popcount(mask[o])`` (ternary)."""
    if mask is None:
        return jnp.full((jnp.asarray(sign).shape[0],), n, jnp.int32)
    return jnp.sum(jax.lax.population_count(jnp.asarray(mask)).astype(jnp.int32), axis=1, dtype=jnp.int32)


def dots_ref(x, sign, mask=None, *, n: int | None = None) -> jax.Array:
    """``jnp`` version of :func:`dots` (``lax.population_count``, no Pallas)."""
    x, sign, mask, _ = _check_dense(x, sign, mask, None, n)
    diff = x[:, None, :] ^ sign[None, :, :]
    if mask is not None:
        diff = diff & mask[None, :, :]
    p = jnp.sum(jax.lax.population_count(diff).astype(jnp.int32), axis=2, dtype=jnp.int32)
    return valid_counts(sign, mask, n)[None, :] - 2 * p


def _threshold_pack(d: jax.Array, thresh: jax.Array) -> jax.Array:
    """``int32[B, O]`` dots -> ``u32[B, words(O)]``: bit set where ``dot < thresh``."""
    b, o = d.shape
    ow = n_words(o)
    bits = (d < thresh[None, :]).astype(jnp.uint32)
    bits = jnp.pad(bits, ((0, 0), (0, ow * WORD_BITS - o))).reshape(b * ow, WORD_BITS)
    return _pack_rows(bits).reshape(b, ow)


def dense_ref(x, sign, thresh, mask=None, *, n: int | None = None) -> jax.Array:
    """``jnp`` version of :func:`dense`."""
    x, sign, mask, thresh = _check_dense(x, sign, mask, thresh, n)
    return _threshold_pack(dots_ref(x, sign, mask, n=n), thresh)


def im2col3x3(x) -> jax.Array:
    """Bit-packed patches ``u32[B, H, W, Wc]`` -> ``u32[B, H, W, 9 * Wc]`` (padding 1 reads as +1 = 0 bits).

    Patch word ``k * Wc + j`` is word ``j`` of pixel ``(h + k // 3 - 1, w + k % 3 - 1)``.
    """
    x = jnp.asarray(x)
    if x.dtype != jnp.uint32 or x.ndim != 4:
        raise TypeError(f"conv input must be u32[B, H, W, words], got dtype {x.dtype} shape {x.shape}")
    _, h, w, _ = x.shape
    xp = jnp.pad(x, ((0, 0), (1, 1), (1, 1), (0, 0)))
    return jnp.concatenate([xp[:, dy : dy + h, dx : dx + w, :] for dy in range(3) for dx in range(3)], axis=-1)


def _check_conv(x, sign, c: int | None, mask):
    x = jnp.asarray(x)
    if x.dtype != jnp.uint32 or x.ndim != 4:
        raise TypeError(f"conv input must be u32[B, H, W, words], got dtype {x.dtype} shape {x.shape}")
    sign = _u32_2d("sign", sign)
    if sign.shape[1] != 9 * x.shape[3]:
        raise ValueError(
            f"3x3 conv weights need 9 * {x.shape[3]} = {9 * x.shape[3]} words per output, got {sign.shape[1]}"
        )
    if mask is None and (c is None or not 0 <= c <= WORD_BITS * x.shape[3]):
        raise ValueError(f"binary conv needs c (input channels, 0..{WORD_BITS * x.shape[3]}), got {c!r}")
    return x, sign


def conv3x3_dots(x, sign, mask=None, *, c: int | None = None) -> jax.Array:
    """``int32[B, H, W, O]`` pre-activations of the 3x3 conv (``jnp``; used by training)."""
    x, sign = _check_conv(x, sign, c, mask)
    b, h, w, _ = x.shape
    cols = im2col3x3(x).reshape(b * h * w, -1)
    d = dots_ref(cols, sign, mask, n=None if mask is not None else 9 * c)
    return d.reshape(b, h, w, sign.shape[0])


def conv3x3_ref(x, sign, thresh, mask=None, *, c: int | None = None) -> jax.Array:
    """``jnp`` version of :func:`conv3x3`."""
    x, sign = _check_conv(x, sign, c, mask)
    b, h, w, _ = x.shape
    thresh = _check_thresh(thresh, sign.shape[0])
    d = conv3x3_dots(x, sign, mask, c=c).reshape(b * h * w, sign.shape[0])
    return _threshold_pack(d, thresh).reshape(b, h, w, -1)


# --------------------------------------------------------------------------- Pallas kernel


def _dense_kernel(*refs, ternary: bool, out_dots: bool, by_word: bool):
    """One tile: 32 outputs (rows of the tile's weight planes) against ``bb`` input rows, transposed.

    Computed as ``(32, bb)`` so that the packed word (a reduction over the 32 outputs) comes out
    as ``(1, bb)``, a lane-dense row on TPU. ``by_word`` (the GPU's body): the counts accumulate
    over the words one at a time, so a thread holds ``(32, bb)`` integers instead of the whole
    ``(32, bb, words)`` XOR of the tile (which spills to local memory for wide inputs). The same integers.
    """
    if ternary:
        x_ref, s_ref, m_ref, n_ref, t_ref, o_ref = refs
    else:
        x_ref, s_ref, n_ref, t_ref, o_ref = refs
        m_ref = None
    if by_word:

        def add_word(w, p):
            diff = s_ref[:, w][:, None] ^ x_ref[:, w][None, :]  # (32, bb)
            if m_ref is not None:
                diff = diff & m_ref[:, w][:, None]
            return p + popcount(diff)

        p = jax.lax.fori_loop(0, x_ref.shape[1], add_word, jnp.zeros((s_ref.shape[0], x_ref.shape[0]), jnp.int32))
    else:
        diff = s_ref[...][:, None, :] ^ x_ref[...][None, :, :]  # (32, bb, words)
        if m_ref is not None:
            diff = diff & m_ref[...][:, None, :]
        p = jnp.sum(popcount(diff), axis=2, dtype=jnp.int32)  # (32, bb)
    d = n_ref[...] - 2 * p  # n_valid: (32, 1)
    if out_dots:
        o_ref[...] = d
        return
    bits = (d < t_ref[...]).astype(jnp.uint32)
    lanes = jax.lax.broadcasted_iota(jnp.uint32, bits.shape, 0)
    as_int = jax.lax.bitcast_convert_type(bits << lanes, jnp.int32)
    o_ref[...] = jax.lax.bitcast_convert_type(jnp.sum(as_int, axis=0, keepdims=True, dtype=jnp.int32), jnp.uint32)


def _on_gpu(platform: str | None) -> bool:
    return (_rule.default_platform() if platform is None else _rule.platform_name(platform)) == "gpu"


def _compiler_params(platform: str | None, interpret: bool):
    return None if interpret or not _on_gpu(platform) else triton_params()


def _dense_pallas(x, sign, mask, nvalid, thresh, out_dots: bool, blocks: Blocks, interpret: bool, platform):
    """Pad to whole tiles and run the kernel; returns ``u32[B, words(O)]`` or ``int32[B, O]``."""
    b, wi = x.shape
    o = sign.shape[0]
    ow = max(1, n_words(o))
    wp = max(8, _next_pow2(wi))
    bb = blocks.rows
    bp = max(bb, -(-b // bb) * bb)
    op = ow * WORD_BITS

    def pad2(a, rows, cols):
        return jnp.pad(a, ((0, rows - a.shape[0]), (0, cols - a.shape[1])))

    xs = pad2(x, bp, wp)
    planes = [pad2(sign, op, wp)] + ([pad2(mask, op, wp)] if mask is not None else [])
    nv = jnp.pad(nvalid.astype(jnp.int32), (0, op - o))
    th = jnp.pad(thresh.astype(jnp.int32), (0, op - o), constant_values=INT32_MIN)
    nv, th = nv.reshape(ow, WORD_BITS, 1), th.reshape(ow, WORD_BITS, 1)
    plane_spec = pl.BlockSpec((WORD_BITS, wp), lambda i, j: (j, 0))
    if out_dots:
        out_shape = out_struct((ow, WORD_BITS, bp), jnp.int32, xs, *planes, nv, th)
        out_spec = pl.BlockSpec((None, WORD_BITS, bb), lambda i, j: (j, 0, i))
    else:
        out_shape = out_struct((ow, 1, bp), jnp.uint32, xs, *planes, nv, th)
        out_spec = pl.BlockSpec((None, 1, bb), lambda i, j: (j, 0, i))
    out = pl.pallas_call(
        functools.partial(_dense_kernel, ternary=mask is not None, out_dots=out_dots, by_word=_on_gpu(platform)),
        out_shape=out_shape,
        grid=(bp // bb, ow),
        in_specs=[pl.BlockSpec((bb, wp), lambda i, j: (i, 0))]
        + [plane_spec] * len(planes)
        + [pl.BlockSpec((None, WORD_BITS, 1), lambda i, j: (j, 0, 0))] * 2,
        out_specs=out_spec,
        interpret=interpret,
        compiler_params=_compiler_params(platform, interpret),
        name="zeroth_binary_dots" if out_dots else "zeroth_binary_dense",
    )(xs, *planes, nv, th)
    if out_dots:
        return out.reshape(op, bp).T[:b, :o]
    return out.reshape(ow, bp).T[:b]


# --------------------------------------------------------------------------- public wrappers


def dots(
    x,
    sign,
    mask=None,
    *,
    n: int | None = None,
    impl: str = "auto",
    blocks: Blocks = DEFAULT_BLOCKS,
    interpret: bool = False,
    platform: str | None = None,
) -> jax.Array:
    """Integer pre-activations ``int32[B, O]``: ``n_valid[o] - 2 * popcount((x ^ sign[o]) [& mask[o]])``.

    Args:
      x: ``u32[B, words]`` packed activations.
      sign: ``u32[O, words]`` weight signs (set bit = -1).
      mask: ``u32[O, words]`` nonzero mask of ternary weights, or None (binary).
      n: valid bits per row (binary only; the ternary count is ``popcount(mask[o])``).
      impl: ``"auto"`` (Pallas on GPU/TPU, jnp on CPU), ``"pallas"`` or ``"jnp"``.
      blocks: Pallas tile sizes; interpret: Pallas interpret mode (CPU tests);
      platform: the platform the kernel is lowered for (``"gpu"``: through Triton, with the GPU's kernel
        body, which interpret mode runs too; default: jax's default backend).
    """
    x, sign, mask, _ = _check_dense(x, sign, mask, None, n)
    if resolve_impl(impl) == "jnp" or x.shape[0] == 0 or sign.shape[0] == 0:
        return dots_ref(x, sign, mask, n=n)
    nv = valid_counts(sign, mask, n)
    zero = jnp.zeros((sign.shape[0],), jnp.int32)
    return _dense_pallas(x, sign, mask, nv, zero, True, blocks, interpret, platform)


def dense(
    x,
    sign,
    thresh,
    mask=None,
    *,
    n: int | None = None,
    impl: str = "auto",
    blocks: Blocks = DEFAULT_BLOCKS,
    interpret: bool = False,
    platform: str | None = None,
) -> jax.Array:
    """Binary/ternary dense layer: ``u32[B, words(O)]`` with bit ``o`` set where ``dot[b, o] < thresh[o]``.

    Args: as :func:`dots`, plus ``thresh: int32[O]``.
    """
    x, sign, mask, thresh = _check_dense(x, sign, mask, thresh, n)
    if resolve_impl(impl) == "jnp" or x.shape[0] == 0 or sign.shape[0] == 0:
        return dense_ref(x, sign, thresh, mask, n=n)
    return _dense_pallas(x, sign, mask, valid_counts(sign, mask, n), thresh, False, blocks, interpret, platform)


def conv3x3(
    x,
    sign,
    thresh,
    mask=None,
    *,
    c: int | None = None,
    impl: str = "auto",
    blocks: Blocks = DEFAULT_BLOCKS,
    interpret: bool = False,
    platform: str | None = None,
) -> jax.Array:
    """Binary/ternary 3x3 convolution, padding 1, stride 1: ``u32[B, H, W, Wc]`` -> ``u32[B, H, W, words(O)]``.

    Args:
      x: packed input pixels, ``Wc = words(C)``.
      sign, mask: ``u32[O, 9 * Wc]`` in im2col order (see module docstring).
      thresh: ``int32[O]``.
      c: input channels ``C`` (binary: ``n = 9 C``).
    """
    x, sign = _check_conv(x, sign, c, mask)
    b, h, w, _ = x.shape
    cols = im2col3x3(x).reshape(b * h * w, -1)
    n = None if mask is not None else 9 * c
    out = dense(cols, sign, thresh, mask, n=n, impl=impl, blocks=blocks, interpret=interpret, platform=platform)
    return out.reshape(b, h, w, -1)
