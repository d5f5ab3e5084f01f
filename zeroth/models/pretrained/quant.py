"""ggml block quantization (Q4_1, Q8_0): vectorized NumPy codecs and a JAX projection onto a grid.

Formats (blocks of 32 consecutive values along the last axis, little endian):

* ``Q4_1``: 20 bytes = ``f16 d, f16 m, u8 qs[16]``; value ``j < 16`` is ``(qs[j] & 15)·d + m``,
  value ``j + 16`` is ``(qs[j] >> 4)·d + m``. Quantization (ggml's reference):
  ``m = min``, ``d = (max − min) / 15``, ``q = min(15, trunc((x − m)/d + 0.5))`` computed with the
  float32 ``d`` and ``m`` before they are stored as f16.
* ``Q8_0``: 34 bytes = ``f16 d, i8 qs[32]``; value ``qs[j]·d``. Quantization:
  ``d = max|x| / 127``, ``q = round(x / d)``.

Dequantization is exact in float32: ``q·d`` has at most 4 + 11 (resp. 8 + 11) significant bits,
so ``q·d + m`` is rounded once, with or without FMA.

The *grid* of a quantized tensor is its per-block ``(d, m)`` with the code range; projecting a
float tensor onto it (:func:`project_to_grid`) is the requantization step of 4-bit forward-only
training (:mod:`zeroth.models.pretrained.q4train`).

Example:
  >>> x = np.linspace(-1, 1, 64, dtype=np.float32).reshape(2, 32)
  >>> raw = quantize_q4_1(x)
  >>> raw.shape, float(np.abs(dequantize_q4_1(raw) - x).max()) < 0.07
  ((2, 20), True)
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

__all__ = [
    "BLOCK",
    "SNAP",
    "FORMATS",
    "Grid",
    "block_bytes",
    "dequantize_q4_1",
    "quantize_q4_1",
    "dequantize_q8_0",
    "quantize_q8_0",
    "dequantize",
    "quantize",
    "grid_of",
    "codes_on_grid",
    "project_to_grid",
    "pack_q4_1",
]

BLOCK = 32
SNAP = 2.0**-10  # |t − round(t)| below this counts as on the grid (codes_on_grid)
# format -> (bytes per block, smallest code, largest code)
FORMATS: dict[str, tuple[int, int, int]] = {"q4_1": (20, 0, 15), "q8_0": (34, -127, 127)}


def block_bytes(fmt: str) -> int:
    """Bytes per block of 32 values of ``fmt`` (``"q4_1"`` or ``"q8_0"``)."""
    return FORMATS[_check_format(fmt)][0]


def _check_format(fmt: str) -> str:
    if fmt not in FORMATS:
        raise ValueError(f"unknown quantization format {fmt!r}; supported: {sorted(FORMATS)}")
    return fmt


def _blocks(raw: np.ndarray, nbytes: int) -> np.ndarray:
    raw = np.asarray(raw)
    if raw.dtype != np.uint8:
        raise TypeError(f"quantized data must be uint8 bytes, got dtype {raw.dtype}")
    if raw.ndim < 1 or raw.shape[-1] % nbytes:
        raise ValueError(f"the last axis ({raw.shape}) must hold whole blocks of {nbytes} bytes")
    return raw.reshape(*raw.shape[:-1], raw.shape[-1] // nbytes, nbytes)


def _f16(b: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(b).view("<f2")[..., 0].astype(np.float32)


def dequantize_q4_1(raw: np.ndarray) -> np.ndarray:
    """``u8[..., nb*20]`` Q4_1 rows -> ``f32[..., nb*32]`` (exact ``q·d + m``)."""
    b = _blocks(raw, 20)
    d, m = _f16(b[..., 0:2]), _f16(b[..., 2:4])
    qs = b[..., 4:]
    q = np.concatenate([qs & 0x0F, qs >> 4], axis=-1).astype(np.float32)
    out = q * d[..., None] + m[..., None]
    return out.reshape(*b.shape[:-2], b.shape[-2] * BLOCK)


def dequantize_q8_0(raw: np.ndarray) -> np.ndarray:
    """``u8[..., nb*34]`` Q8_0 rows -> ``f32[..., nb*32]`` (exact ``q·d``)."""
    b = _blocks(raw, 34)
    d = _f16(b[..., 0:2])
    q = np.ascontiguousarray(b[..., 2:]).view(np.int8).astype(np.float32)
    out = q * d[..., None]
    return out.reshape(*b.shape[:-2], b.shape[-2] * BLOCK)


def _values(x: np.ndarray) -> np.ndarray:
    x = np.asarray(x, dtype=np.float32)
    if x.ndim < 1 or x.shape[-1] % BLOCK:
        raise ValueError(f"the last axis of {x.shape} must be a multiple of {BLOCK}")
    return x.reshape(*x.shape[:-1], x.shape[-1] // BLOCK, BLOCK)


def _half_bytes(v: np.ndarray) -> np.ndarray:
    return v.astype("<f2")[..., None].view(np.uint8)


def quantize_q4_1(x: np.ndarray) -> np.ndarray:
    """``f32[..., nb*32]`` -> ``u8[..., nb*20]`` with ggml's reference Q4_1 quantizer."""
    v = _values(x)
    lo, hi = v.min(axis=-1), v.max(axis=-1)
    d = (hi - lo) / np.float32(15.0)
    with np.errstate(divide="ignore"):
        inv = np.where(d != 0, np.float32(1.0) / np.where(d != 0, d, np.float32(1.0)), np.float32(0.0)).astype(
            np.float32
        )
    t = (v - lo[..., None]) * inv[..., None] + np.float32(0.5)
    q = np.minimum(np.trunc(t), np.float32(15.0)).astype(np.uint8)
    qs = (q[..., :16] | (q[..., 16:] << 4)).astype(np.uint8)
    out = np.concatenate([_half_bytes(d), _half_bytes(lo), qs], axis=-1)
    return out.reshape(*v.shape[:-2], v.shape[-2] * 20)


def quantize_q8_0(x: np.ndarray) -> np.ndarray:
    """``f32[..., nb*32]`` -> ``u8[..., nb*34]`` with ggml's reference Q8_0 quantizer."""
    v = _values(x)
    amax = np.abs(v).max(axis=-1)
    d = amax / np.float32(127.0)
    with np.errstate(divide="ignore"):
        inv = np.where(d != 0, np.float32(1.0) / np.where(d != 0, d, np.float32(1.0)), np.float32(0.0)).astype(
            np.float32
        )
    t = (v * inv[..., None]).astype(np.float64)
    q = np.trunc(t + np.copysign(0.5, t)).astype(np.int8)  # C roundf: half away from zero
    out = np.concatenate([_half_bytes(d), q.view(np.uint8)], axis=-1)
    return out.reshape(*v.shape[:-2], v.shape[-2] * 34)


def dequantize(fmt: str, raw: np.ndarray) -> np.ndarray:
    """Dispatch: ``"q4_1"`` or ``"q8_0"`` bytes -> float32 values."""
    return {"q4_1": dequantize_q4_1, "q8_0": dequantize_q8_0}[_check_format(fmt)](raw)


def quantize(fmt: str, x: np.ndarray) -> np.ndarray:
    """Dispatch: float32 values -> ``"q4_1"`` or ``"q8_0"`` bytes."""
    return {"q4_1": quantize_q4_1, "q8_0": quantize_q8_0}[_check_format(fmt)](x)


class Grid(NamedTuple):
    """The fixed quantization grid of a tensor: value ``q·d + m`` for integer ``q`` in ``[qmin, qmax]``.

    Attributes:
      d: ``f32[..., nb]`` per-block step (the stored f16 value, widened).
      m: ``f32[..., nb]`` per-block offset (Q4_1: the stored min; Q8_0: zeros).
      qmin, qmax: the code range (Q4_1: 0..15, Q8_0: -127..127).
    """

    d: np.ndarray
    m: np.ndarray
    qmin: int
    qmax: int


def grid_of(fmt: str, raw: np.ndarray) -> Grid:
    """The per-block grid stored in quantized bytes ``raw`` of format ``fmt``."""
    nbytes, qmin, qmax = FORMATS[_check_format(fmt)]
    b = _blocks(raw, nbytes)
    d = _f16(b[..., 0:2])
    m = _f16(b[..., 2:4]) if fmt == "q4_1" else np.zeros_like(d)
    return Grid(d, m, qmin, qmax)


def _grid_arrays(x, d, m):
    lead = x.shape[:-1]
    nb = x.shape[-1] // BLOCK
    if d.shape != (*lead, nb) or m.shape != (*lead, nb):
        raise ValueError(f"grid shapes {d.shape}, {m.shape} do not match values {x.shape} (expected {(*lead, nb)})")
    return x.reshape(*lead, nb, BLOCK), d[..., None], m[..., None]


def codes_on_grid(
    x: jax.Array, d: jax.Array, m: jax.Array, qmin: int, qmax: int, *, uniform: jax.Array | None = None
) -> jax.Array:
    """Integer codes of ``x`` on the grid ``(d, m)``: ``clip(round((x − m)/d), qmin, qmax)`` (traceable).

    Args:
      x: ``f32[..., nb*32]`` values.
      d, m: ``f32[..., nb]`` grid (blocks with ``d == 0`` get code 0, i.e. the value ``m``).
      qmin, qmax: code range.
      uniform: optional ``f32[..., nb*32]`` in [0, 1): stochastic rounding
        ``floor(t) + [u < t − floor(t)]`` (unbiased: ``E[q] = t``) instead of round-half-to-even.

    ``t = (x − m)/d`` within :data:`SNAP` of an integer is taken as that integer first, so values
    on the grid keep their code under either rounding (a bias of at most ``SNAP`` steps).

    Returns:
      ``f32[..., nb*32]`` integer-valued codes.
    """
    v, dd, mm = _grid_arrays(x, d, m)
    safe = jnp.where(dd == 0, jnp.float32(1.0), dd)
    t = (v - mm) / safe
    # a grid value q·d + m gives t = q up to float rounding: snap it, so that grid values are
    # fixed points of both roundings (stochastic rounding would otherwise move them rarely)
    nearest = jnp.round(t)
    t = jnp.where(jnp.abs(t - nearest) < jnp.float32(SNAP), nearest, t)
    if uniform is None:
        q = jnp.round(t)
    else:
        floor = jnp.floor(t)
        q = floor + (uniform.reshape(v.shape) < t - floor).astype(jnp.float32)  # t − floor(t) is exact
    q = jnp.clip(q, jnp.float32(qmin), jnp.float32(qmax))
    q = jnp.where(dd == 0, jnp.float32(0.0), q)
    return q.reshape(x.shape)


def project_to_grid(
    x: jax.Array, d: jax.Array, m: jax.Array, qmin: int, qmax: int, *, uniform: jax.Array | None = None
) -> jax.Array:
    """Requantize ``x`` onto the fixed grid and dequantize again: ``q·d + m`` (traceable).

    Idempotent on grid values (``project_to_grid(q·d + m) == q·d + m`` exactly: the error of
    ``(x − m)/d`` is far below 1/2). ``q·d`` is exact in float32, so the result does not depend
    on FMA contraction.

    Example:
      >>> g = grid_of("q4_1", quantize_q4_1(np.linspace(0, 1, 32, dtype=np.float32)))
      >>> y = project_to_grid(jnp.full((32,), 0.5), g.d, g.m, g.qmin, g.qmax)
    """
    q = codes_on_grid(x, d, m, qmin, qmax, uniform=uniform)
    qv, dd, mm = _grid_arrays(q, d, m)
    return (qv * dd + mm).reshape(x.shape)


def pack_q4_1(x: np.ndarray, grid: Grid) -> np.ndarray:
    """Store grid values ``x`` losslessly as Q4_1 bytes with the grid's own ``(d, m)``.

    The result has the GGUF layout; ``dequantize_q4_1(pack_q4_1(x, g)) == x`` for any ``x`` on
    the grid ``g`` (raises ``ValueError`` if ``x`` is not on it).
    """
    if (grid.qmin, grid.qmax) != (0, 15):
        raise ValueError(f"pack_q4_1 needs a Q4_1 grid (codes 0..15), got {grid.qmin}..{grid.qmax}")
    x = np.asarray(x, np.float32)
    q = np.asarray(codes_on_grid(jnp.asarray(x), jnp.asarray(grid.d), jnp.asarray(grid.m), 0, 15))
    v = q.reshape(*x.shape[:-1], x.shape[-1] // BLOCK, BLOCK).astype(np.uint8)
    back = v.astype(np.float32) * grid.d[..., None] + grid.m[..., None]
    if not np.array_equal(back.reshape(x.shape), x):
        bad = int(np.flatnonzero(back.reshape(-1) != x.reshape(-1))[0])
        raise ValueError(f"value {x.reshape(-1)[bad]!r} at flat index {bad} is not on the Q4_1 grid")
    qs = (v[..., :16] | (v[..., 16:] << 4)).astype(np.uint8)
    out = np.concatenate([_half_bytes(grid.d), _half_bytes(grid.m), qs], axis=-1)
    return out.reshape(*v.shape[:-2], v.shape[-2] * 20)
