"""Projected-gradient codecs: what a machine sends for each projected gradient, and what every
machine applies.

A :class:`Codec` is ``(name, encode, decode, bytes_per_value)``. ``encode(g f32[n]) -> bytes``
(``n * bytes_per_value`` bytes) runs on the machine that measured ``g``; ``decode(bytes) ->
f32[n]`` runs everywhere, and the *decoded* values are what the update applies, on the sender
too, so every machine applies exactly what was sent.

``float32`` is lossless; ``onebyte`` is the signed-log code of Just One Byte (seed 000), specified
byte by byte in the docs (Systems, Just One Byte: "The one-byte code").

Example:
  >>> c = get_codec("onebyte")
  >>> payload = c.encode(np.array([0.0, 1.0, -2.5], np.float32))
  >>> payload.hex()
  '80c031'
  >>> c.decode(payload).tolist()
  [0.0, 1.0, -2.553589344024658]
"""

from __future__ import annotations

import decimal
import hashlib
import math
from collections.abc import Callable
from fractions import Fraction
from typing import NamedTuple

import numpy as np

__all__ = [
    "Codec",
    "CODECS",
    "FLOAT32",
    "ONEBYTE",
    "get_codec",
    "quantize",
    "onebyte_codes",
]


class Codec(NamedTuple):
    """A projected-gradient codec.

    ``encode :: f32[n] -> bytes`` (``n * bytes_per_value`` bytes); ``decode :: bytes -> f32[n]``.
    """

    name: str
    encode: Callable[[np.ndarray], bytes]
    decode: Callable[[bytes], np.ndarray]
    bytes_per_value: int


ONEBYTE_STEPS_PER_E = 16  # levels per unit of ln|g|: q = round(16 ln|g|)
ONEBYTE_LEVEL_OFFSET = 64  # byte 128 ± m  <->  q = m - 64
ONEBYTE_ZERO = 0x80
ONEBYTE_TABLE_SHA256 = "a5e6e559bd73bfa72f72227bfcd597054e87277d328a9b3628d3feced571f97c"
_Q_MIN = 1 - ONEBYTE_LEVEL_OFFSET  # -63
_Q_MAX_POS = 127 - ONEBYTE_LEVEL_OFFSET  # 63
_Q_MAX_NEG = 128 - ONEBYTE_LEVEL_OFFSET  # 64
_DIGITS = 40


def _exp_q(q: int) -> Fraction:
    """``exp(q / 16)`` correctly rounded to 40 significant digits (pure-Python ``decimal``)."""
    ctx = decimal.Context(prec=_DIGITS, rounding=decimal.ROUND_HALF_EVEN)
    return Fraction(ctx.exp(ctx.divide(decimal.Decimal(q), decimal.Decimal(ONEBYTE_STEPS_PER_E))))


def _round_binary(x: Fraction, bits: int) -> float:
    """The nearest number with ``bits`` significant bits to ``x > 0`` (ties to even), exactly."""
    e = x.numerator.bit_length() - x.denominator.bit_length()
    if Fraction(2) ** e > x:
        e -= 1
    # now 2**e <= x < 2**(e+1); scale x to [2**(bits-1), 2**bits) and round to an integer
    shift = bits - 1 - e
    q = round(x * Fraction(2) ** shift)  # Fraction.__round__: half to even
    return float(Fraction(q) / Fraction(2) ** shift)


def _level_value(q: int) -> np.float32:
    """The float32 nearest to exp(q / 16)."""
    return np.float32(_round_binary(_exp_q(q), 24))


def _boundary(q: int) -> float:
    """float64 nearest to exp((q + 1/2) / 16), the boundary between levels q and q + 1."""
    ctx = decimal.Context(prec=_DIGITS, rounding=decimal.ROUND_HALF_EVEN)
    x = ctx.exp(ctx.divide(decimal.Decimal(2 * q + 1), decimal.Decimal(2 * ONEBYTE_STEPS_PER_E)))
    return _round_binary(Fraction(x), 53)


def _build_table() -> np.ndarray:
    table = np.zeros(256, dtype=np.float32)
    for m in range(1, 129):
        mag = _level_value(m - ONEBYTE_LEVEL_OFFSET)
        if m <= 127:
            table[ONEBYTE_ZERO + m] = mag
        table[ONEBYTE_ZERO - m] = -mag
    return table


def _table_digest(table: np.ndarray) -> str:
    return hashlib.sha256(np.ascontiguousarray(table, dtype="<f4").tobytes()).hexdigest()


ONEBYTE_TABLE = _build_table()
ONEBYTE_TABLE.setflags(write=False)
if _table_digest(ONEBYTE_TABLE) != ONEBYTE_TABLE_SHA256:  # pragma: no cover - a broken host
    raise RuntimeError(
        f"the one-byte decode table built on this host has digest {_table_digest(ONEBYTE_TABLE)}, "
        f"not the committed {ONEBYTE_TABLE_SHA256}; this host's decimal arithmetic is broken"
    )
# boundaries between levels q and q+1 for q = -63 .. 63 (127 values, increasing)
_BOUNDS = np.array([_boundary(q) for q in range(_Q_MIN, _Q_MAX_NEG)], dtype=np.float64)
_BOUNDS.setflags(write=False)


def _ceil_f32_bits(b: float) -> int:
    """The bit pattern of the smallest float32 >= ``b > 0`` (a float64)."""
    f = np.float32(b)
    if float(f) < b:
        f = np.nextafter(f, np.float32(np.inf))
    return int(np.array(f, np.float32).view(np.uint32))


# The level boundaries as float32 bit patterns: for a float32 |g|, ``boundary <= |g|`` (float64)
# exactly when ``ONEBYTE_BOUND_BITS[j] <= bits(|g|)`` (the smallest float32 at or above the
# boundary; the bits of non-negative floats sort like the floats), so integer comparisons encode
# like the host's float64 ones, on any backend, subnormals included.
ONEBYTE_BOUND_BITS = np.array([_ceil_f32_bits(b) for b in _BOUNDS], dtype=np.uint32)
ONEBYTE_BOUND_BITS.setflags(write=False)
ONEBYTE_RANGE = (float(ONEBYTE_TABLE[ONEBYTE_ZERO + 1]), float(ONEBYTE_TABLE[255]))
ONEBYTE_MAX_REL_ERROR = float(np.expm1(1.0 / (2 * ONEBYTE_STEPS_PER_E)))


def onebyte_level(code: int) -> int | None:
    """The level ``q`` of a byte (``|decoded| ≈ exp(q/16)``), or ``None`` for the zero code.

    Example:
      >>> onebyte_level(0xC0), onebyte_level(0x80), onebyte_level(0x00)
      (0, None, 64)
    """
    if isinstance(code, bool) or not isinstance(code, (int, np.integer)) or not 0 <= code <= 255:
        raise ValueError(f"a one-byte code is an integer in [0, 255], got {code!r}")
    if code == ONEBYTE_ZERO:
        return None
    return abs(int(code) - ONEBYTE_ZERO) - ONEBYTE_LEVEL_OFFSET


# --------------------------------------------------------------------------- helpers


def _as_values(g) -> np.ndarray:
    arr = np.asarray(g)
    if arr.dtype == object or not (np.issubdtype(arr.dtype, np.floating) or np.issubdtype(arr.dtype, np.integer)):
        raise TypeError(f"projected gradients must be a real array f32[n], got dtype {arr.dtype}")
    if arr.ndim != 1:
        raise ValueError(f"projected gradients must be 1-D f32[n], got shape {arr.shape}")
    arr = arr.astype(np.float64)
    bad = np.flatnonzero(~np.isfinite(arr))
    if bad.size:
        raise ValueError(
            f"cannot encode non-finite projected gradient(s): index {int(bad[0])} is {float(arr[bad[0]])!r} "
            f"({bad.size} non-finite of {arr.size}); only finite values can be sent"
        )
    return arr


def _as_payload(payload, bytes_per_value: int, name: str) -> bytes:
    if not isinstance(payload, (bytes, bytearray, memoryview)):
        raise TypeError(f"{name} payload must be bytes, got {type(payload).__name__}")
    payload = bytes(payload)
    if len(payload) % bytes_per_value:
        raise ValueError(f"{name} payload of {len(payload)} bytes is not a multiple of {bytes_per_value} bytes")
    return payload


# --------------------------------------------------------------------------- float32


def _f32_encode(g) -> bytes:
    if type(g) is np.ndarray and g.dtype == np.float32 and g.ndim == 1 and all(map(math.isfinite, g.tolist())):
        # the common case (a step's fetched projected gradients), in a few operations: a ZO step's
        # host time sits between two calls on the device, which waits for it
        return g.astype("<f4", copy=False).tobytes()
    arr = _as_values(np.asarray(g))
    with np.errstate(over="ignore"):
        out = arr.astype("<f4")
    if not np.all(np.isfinite(out)):
        i = int(np.flatnonzero(~np.isfinite(out))[0])
        raise ValueError(f"projected gradient {i} ({float(arr[i])!r}) overflows float32")
    return out.tobytes()


def _f32_decode(payload) -> np.ndarray:
    return np.frombuffer(_as_payload(payload, 4, "float32"), dtype="<f4").astype(np.float32)


# --------------------------------------------------------------------------- onebyte


def _onebyte_encode(g) -> bytes:
    arr = _as_values(g)
    a = np.abs(arr)
    q = _Q_MIN + np.searchsorted(_BOUNDS, a, side="right")  # round(16 ln a), clipped to [-63, 64]
    neg = arr < 0
    q = np.where(neg, q, np.minimum(q, _Q_MAX_POS))
    m = q + ONEBYTE_LEVEL_OFFSET
    code = np.where(neg, ONEBYTE_ZERO - m, ONEBYTE_ZERO + m)
    code = np.where(a == 0.0, ONEBYTE_ZERO, code)
    return code.astype(np.uint8).tobytes()


def onebyte_codes(bits, xp=np):
    """The one-byte codes of float32 values given as their bit patterns ``u32[n]``, with integer
    operations only (``xp``: NumPy, or ``jax.numpy`` inside a program): the codes
    :data:`ONEBYTE`'s ``encode`` gives for the finite values, whatever the backend does with
    subnormal floats. A non-finite value gets a code too; check the values first.

    Example:
      >>> g = np.array([0.0, 1.0, -2.5, 1e-40], np.float32)
      >>> bytes(onebyte_codes(g.view(np.uint32)).tolist()) == ONEBYTE.encode(g)
      True
    """
    bits = xp.asarray(bits, dtype=xp.uint32)
    mag = bits & xp.uint32(0x7FFFFFFF)
    count = xp.sum(xp.asarray(ONEBYTE_BOUND_BITS)[None, :] <= mag[:, None], axis=1, dtype=xp.int32)
    q = count + _Q_MIN  # round(16 ln |g|), clipped to [-63, 64]
    neg = (bits >> 31) == 1
    q = xp.where(neg, q, xp.minimum(q, _Q_MAX_POS))
    m = q + ONEBYTE_LEVEL_OFFSET
    code = xp.where(neg, ONEBYTE_ZERO - m, ONEBYTE_ZERO + m)
    return xp.where(mag == 0, ONEBYTE_ZERO, code).astype(xp.uint8)


def _onebyte_decode(payload) -> np.ndarray:
    codes = np.frombuffer(_as_payload(payload, 1, "onebyte"), dtype=np.uint8)
    return ONEBYTE_TABLE[codes].astype(np.float32)


FLOAT32 = Codec("float32", _f32_encode, _f32_decode, 4)
ONEBYTE = Codec("onebyte", _onebyte_encode, _onebyte_decode, 1)
CODECS: dict[str, Codec] = {c.name: c for c in (FLOAT32, ONEBYTE)}


def get_codec(name: str) -> Codec:
    """The codec called ``name`` (``"float32"`` or ``"onebyte"``).

    Raises:
      ValueError: an unknown name (the valid ones are listed).
    """
    if name not in CODECS:
        raise ValueError(f"unknown codec {name!r}; expected one of {sorted(CODECS)}")
    return CODECS[name]


def quantize(g, codec: str = "onebyte") -> np.ndarray:
    """``decode(encode(g))``: the values a peer receiving ``g`` would apply, ``f32[n]``.

    Example:
      >>> quantize(np.array([1.0], np.float32)).tolist()
      [1.0]
    """
    c = get_codec(codec)
    return c.decode(c.encode(g))
