"""NumPy reference of the bit-packed binary/ternary ops (never imports jax).

Same layout and semantics as :mod:`zeroth.kernels.binary` (see its docstring): values in
{-1, +1} pack 32 per ``uint32`` word, **-1 a set bit**, bit ``i % 32`` of word ``i // 32``,
padding bits 0. Ternary weights are a sign plane and a nonzero mask plane.

``dot = n_valid - 2 * popcount((x ^ sign) & mask)``; output bit set (-1) where ``dot < thresh``.

Example:
  >>> import numpy as np
  >>> w = pack(np.array([[-1, 1, 1, 1]]))
  >>> int(w[0, 0]), unpack(w, 4).tolist()
  (1, [[-1, 1, 1, 1]])
"""

from __future__ import annotations

import numpy as np

__all__ = [
    "WORD_BITS",
    "n_words",
    "pack",
    "unpack",
    "pack_ternary",
    "unpack_ternary",
    "popcount",
    "dots",
    "dense",
    "threshold_pack",
    "im2col3x3",
    "conv3x3_dots",
    "conv3x3",
]

WORD_BITS = 32


def n_words(n: int) -> int:
    """Words holding ``n`` bits."""
    return -(-int(n) // WORD_BITS)


def pack(values) -> np.ndarray:
    """``{-1, +1}[..., n]`` (or bools, True = -1) -> ``u32[..., words(n)]``; -1 -> set bit."""
    v = np.asarray(values)
    bits = v if v.dtype == bool else v < 0
    n = bits.shape[-1]
    pad = n_words(n) * WORD_BITS - n
    bits = np.concatenate([bits, np.zeros(bits.shape[:-1] + (pad,), bool)], axis=-1)
    packed = np.packbits(bits, axis=-1, bitorder="little")
    return np.ascontiguousarray(packed).view("<u4").astype(np.uint32)


def unpack(words, n: int) -> np.ndarray:
    """``u32[..., words]`` -> ``int8[..., n]`` in {-1, +1}."""
    w = np.ascontiguousarray(np.asarray(words, np.uint32).astype("<u4"))
    bits = np.unpackbits(w.view(np.uint8), axis=-1, bitorder="little")[..., :n]
    return (1 - 2 * bits.astype(np.int8)).astype(np.int8)


def pack_ternary(values) -> tuple[np.ndarray, np.ndarray]:
    """``{-1, 0, +1}[..., n]`` -> ``(sign, mask)`` planes (a zero has sign 0 and mask 0)."""
    v = np.asarray(values)
    return pack(v < 0), pack(v != 0)


def unpack_ternary(sign, mask, n: int) -> np.ndarray:
    """``(sign, mask)`` planes -> ``int8[..., n]`` in {-1, 0, +1}."""
    return (unpack(sign, n) * (unpack(mask, n) < 0)).astype(np.int8)


def popcount(words) -> np.ndarray:
    """Set bits per ``uint32`` as ``int64``."""
    return np.bitwise_count(np.asarray(words, np.uint32)).astype(np.int64)


def dots(x, sign, mask=None, *, n: int | None = None) -> np.ndarray:
    """``int32[B, O]``: ``n_valid[o] - 2 * popcount((x ^ sign[o]) & mask[o])`` summed over words."""
    x, sign = np.asarray(x, np.uint32), np.asarray(sign, np.uint32)
    diff = x[:, None, :] ^ sign[None, :, :]
    if mask is None:
        if n is None:
            raise ValueError("binary weights need n, the number of valid bits per row")
        nvalid = np.full(sign.shape[0], n, np.int64)
    else:
        mask = np.asarray(mask, np.uint32)
        diff = diff & mask[None, :, :]
        nvalid = popcount(mask).sum(axis=1)
    return (nvalid[None, :] - 2 * popcount(diff).sum(axis=2)).astype(np.int32)


def threshold_pack(d, thresh) -> np.ndarray:
    """``int32[..., O]`` dots -> ``u32[..., words(O)]``, bit set where ``dot < thresh``."""
    return pack(np.asarray(d) < np.asarray(thresh))


def dense(x, sign, thresh, mask=None, *, n: int | None = None) -> np.ndarray:
    """Packed output ``u32[B, words(O)]`` of the binary/ternary dense layer."""
    return threshold_pack(dots(x, sign, mask, n=n), thresh)


def im2col3x3(x) -> np.ndarray:
    """``u32[B, H, W, Wc]`` -> ``u32[B, H, W, 9 Wc]``: the nine neighbours' words, row-major, outside = 0 bits."""
    x = np.asarray(x, np.uint32)
    _, h, w, _ = x.shape
    xp = np.pad(x, ((0, 0), (1, 1), (1, 1), (0, 0)))
    return np.concatenate([xp[:, dy : dy + h, dx : dx + w, :] for dy in range(3) for dx in range(3)], axis=-1)


def conv3x3_dots(x, sign, mask=None, *, c: int | None = None) -> np.ndarray:
    """``int32[B, H, W, O]`` pre-activations of the 3x3 conv (padding 1, stride 1)."""
    x = np.asarray(x, np.uint32)
    b, h, w, _ = x.shape
    cols = im2col3x3(x).reshape(b * h * w, -1)
    d = dots(cols, sign, mask, n=None if mask is not None else 9 * c)
    return d.reshape(b, h, w, -1)


def conv3x3(x, sign, thresh, mask=None, *, c: int | None = None) -> np.ndarray:
    """Packed output ``u32[B, H, W, words(O)]`` of the 3x3 binary/ternary conv."""
    return threshold_pack(conv3x3_dots(x, sign, mask, c=c), thresh)
