"""Activation compression for pipeline links: FP32, DirectQ and AQ-SGD behind one interface.

A :class:`LinkCodec` (:func:`make_codec`) is an optax-like ``NamedTuple`` of pure functions plus a
state: ``init``, ``encode`` (the sender) and ``decode`` (the receiver), with the AQ-SGD buffers
and their digests. The codecs, the grid, the wire format and the rounding's keys are described in
the docs (``docs/systems/aqsgd.md``, "Link codecs").
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np

from zeroth import reference as _ref
from zeroth import rng as _rng

__all__ = [
    "CODEC_NAMES",
    "ROUNDINGS",
    "SCALE_AXES",
    "LinkCodec",
    "Encoded",
    "DeltaState",
    "CodecMismatch",
    "make_codec",
    "fp32",
    "directq",
    "aqsgd",
    "quantize_rows",
    "dequantize_rows",
    "relative_errors",
    "save_buffers",
    "load_buffers",
]

CODEC_NAMES = ("fp32", "directq", "aqsgd")
SCALE_AXES = ("channel", "row")  # the default first
ROUNDINGS = ("stochastic", "nearest")  # the default first
GRID = "zero-level"
MIN_QUANT_BITS = 2
MAX_BITS = 8
_U_SCALE = np.float32(2.0**-24)
_UNIFORM_WORDS = 1 << 18  # words per threefry call of :func:`uniforms` (its temporaries: a few MB)


class CodecMismatch(ValueError):
    """A message does not fit the receiver's codec or buffers (shape, bits, first-sight flags)."""


class Encoded(NamedTuple):
    """One compressed tensor as it travels.

    Attributes:
      shape: the full tensor shape ``(B, *row_shape)``.
      bits: bits per quantized value (0 = every example in float32).
      fresh: ``bool[B]``: example sent in full precision (fp32 codec, or AQ-SGD's first sight).
      full: float32 little-endian rows of the fresh examples, in order.
      packed: the levels of the other examples, ``bits`` per value (:func:`pack_bits`).
      scales: float32 little-endian scale of every row of the other examples.
      quantizer: the grid and scale axis of ``packed`` and ``scales`` (:func:`quantizer_id`);
        ``""`` in a float32 message (``bits = 0``).
    """

    shape: tuple[int, ...]
    bits: int
    fresh: np.ndarray
    full: bytes
    packed: bytes
    scales: bytes
    quantizer: str = ""

    @property
    def nbytes(self) -> int:
        """Payload bytes: ``len(full) + len(packed) + len(scales)`` (headers not counted)."""
        return len(self.full) + len(self.packed) + len(self.scales)


class DeltaState(NamedTuple):
    """AQ-SGD buffers of one end of a link.

    Attributes:
      m: ``f32[N, *row_shape]``: the last activation both ends agreed on for each example
        (``np.ndarray`` or ``np.memmap``; updated in place, the returned state aliases it).
      seen: ``bool[N]``: the example has passed once.
    """

    m: np.ndarray
    seen: np.ndarray


class LinkCodec(NamedTuple):
    """An activation/gradient codec (the signatures: ``docs/systems/aqsgd.md``, "Link codecs")."""

    name: str
    bits: int
    init: Callable[..., Any]
    encode: Callable[..., tuple[Any, Encoded, np.ndarray]]
    decode: Callable[..., tuple[Any, np.ndarray]]
    axis: str = "channel"
    rounding: str = "stochastic"


# --------------------------------------------------------------------------- keys and uniforms


def example_keys(run_seed: int, *, link: int, direction: int, step: int, ids) -> np.ndarray:
    """``u32[B, 2]``: the key of each example's rounding noise on one link, direction and step.

    ``sample_key(run_seed, machine=2·link + direction, iteration=step, sample=ξ)`` for every ξ in
    ``ids`` (direction 0 = activations forward, 1 = gradients backward).
    """
    if direction not in (0, 1):
        raise ValueError(f"direction must be 0 (forward) or 1 (backward), got {direction!r}")
    machine = 2 * int(link) + direction
    return _rng.sample_keys(run_seed, [(machine, int(step), int(i)) for i in np.asarray(ids).reshape(-1)])


def uniforms(keys: np.ndarray, n: int) -> np.ndarray:
    """``f32[B, n]`` in ``[0, 1)``: row b is ``(noise_words(keys[b], n) >> 8) · 2^−24`` (exact).

    The rows are computed :data:`_UNIFORM_WORDS` words at a time, many keys per threefry call
    (a call per row would pay NumPy's fixed cost per row)."""
    keys = np.asarray(keys, np.uint32).reshape(-1, 2)
    out = np.empty((keys.shape[0], n), np.float32)
    rows = max(1, _UNIFORM_WORDS // max(n, 1))
    for b in range(0, keys.shape[0], rows):
        words = _ref.noise_words(keys[b : b + rows], n)
        out[b : b + rows] = (words >> np.uint32(8)).astype(np.float32) * _U_SCALE
    return out


# --------------------------------------------------------------------------- quantizer


def _check_bits(bits: int) -> int:
    if isinstance(bits, bool) or not isinstance(bits, (int, np.integer)) or not 1 <= bits <= MAX_BITS:
        raise ValueError(f"bits must be an integer in [1, {MAX_BITS}], got {bits!r}")
    return int(bits)


def _check_quant_bits(bits: int) -> int:
    if isinstance(bits, bool) or not isinstance(bits, (int, np.integer)) or not MIN_QUANT_BITS <= bits <= MAX_BITS:
        raise ValueError(
            f"quantizer bits must be an integer in [{MIN_QUANT_BITS}, {MAX_BITS}] (the zero-level grid "
            f"needs a negative, a zero and a positive level), got {bits!r}"
        )
    return int(bits)


def _check_rounding(rounding: str) -> str:
    if rounding not in ROUNDINGS:
        raise ValueError(f"rounding must be one of {list(ROUNDINGS)}, got {rounding!r}")
    return rounding


def quantize_rows(x: np.ndarray, bits: int, u: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray]:
    """Quantize each row of ``x: f32[R, C]`` to the zero-level grid: ``(q int8[R, C], s f32[R])``.

    ``q ∈ [−h, h − 1]`` with ``h = 2^(b−1)``; the row decodes to ``x̂ = q · s / h``
    (:func:`dequantize_rows`), so zero is a level and ``Q(0) = 0`` exactly. With uniforms
    ``u: f32[R, C]`` in ``[0, 1)`` the rounding is stochastic, ``q = floor(v + u)``; with
    ``u = None`` it is to the nearest level, ``q = floor(v + ½)``; ``v = x · h / s``.

    The scale is chosen so that no value clips: with ``p = max(x, 0)`` and ``n = max(−x, 0)`` over
    the row, the level spacing is ``Δ = min(max(n/h, p/(h−1)), max(p/h, n/(h−1)))``, and
    ``s = +Δ·h`` when the first term is taken (the negatives may use the extra level ``−h``),
    ``s = −Δ·h`` otherwise (the row is mirrored: the positives use it). Every ``v`` then lies in
    ``[−h, h − 1]``, the stochastic rounding never leaves the grid and
    ``E[x̂] = x`` (up to float32 rounding of ``v``, which is clamped into that interval, and the
    ``2^−24`` resolution of ``u``); ``|x̂ − x| < Δ``. Nearest rounding is biased (``|x̂ − x| ≤ Δ/2``).
    ``h`` is a power of two, so ``s / h = ±Δ`` exactly. An all-zero row has ``s = 0`` and ``q = 0``.

    Raises:
      ValueError: bits outside ``[2, 8]``, or values so large that the scale overflows float32.
    """
    bits = _check_quant_bits(bits)
    x = np.asarray(x, np.float32)
    h = np.float32(1 << (bits - 1))
    if x.size:
        p = np.max(np.maximum(x, np.float32(0.0)), axis=1)
        n = np.max(np.maximum(-x, np.float32(0.0)), axis=1)
    else:
        p = n = np.zeros(x.shape[0], np.float32)
    d_up = np.maximum(n / h, p / (h - np.float32(1.0)))
    d_mirror = np.maximum(p / h, n / (h - np.float32(1.0)))
    mirror = d_mirror < d_up
    delta = np.where(mirror, d_mirror, d_up).astype(np.float32)
    s = (np.where(mirror, -delta, delta) * h).astype(np.float32)
    if not np.all(np.isfinite(s)):
        raise ValueError(
            f"values up to {float(np.max(np.maximum(p, n))):g} overflow the float32 scale of the {bits}-bit grid"
        )
    step = np.where(delta > 0, s / h, np.float32(1.0)).astype(np.float32)
    v = np.clip(x / step[:, None], -h, h - np.float32(1.0))
    r = np.float32(0.5) if u is None else np.asarray(u, np.float32)
    q = np.clip(np.floor(v + r), -h, h - np.float32(1.0))
    return q.astype(np.int8), s


def dequantize_rows(q: np.ndarray, s: np.ndarray, bits: int) -> np.ndarray:
    """``f32[R, C]``: ``q · s / h`` with ``h = 2^(b−1)`` (zero where ``q = 0`` or ``s = 0``)."""
    bits = _check_quant_bits(bits)
    h = np.float32(1 << (bits - 1))
    return (q.astype(np.float32) * np.asarray(s, np.float32)[:, None]) / h


def levels_to_codes(q: np.ndarray, bits: int) -> np.ndarray:
    """Signed levels ``q ∈ [−h, h − 1]`` as the unsigned codes packed on the wire: ``q + h`` (uint8)."""
    return (np.asarray(q, np.int16) + (1 << (bits - 1))).astype(np.uint8)


def codes_to_levels(c: np.ndarray, bits: int) -> np.ndarray:
    """Inverse of :func:`levels_to_codes`: ``int8`` levels."""
    return (np.asarray(c, np.int16) - (1 << (bits - 1))).astype(np.int8)


def relative_errors(x: np.ndarray, err: np.ndarray) -> np.ndarray:
    """``f64[b]``: ``‖err_i‖ / ‖x_i‖`` per example ``i`` (Frobenius norms over the example's values):
    the quantizer's relative error ``c_Q`` when ``x`` is its input and ``err = Q(x) − x``.

    An example with ``x_i = 0`` counts 0 when its error is 0 (the zero-level grid maps 0 to 0), inf otherwise.
    """
    b = x.shape[0]
    nx = np.linalg.norm(np.asarray(x, np.float64).reshape(b, -1), axis=1)
    ne = np.linalg.norm(np.asarray(err, np.float64).reshape(b, -1), axis=1)
    with np.errstate(divide="ignore", invalid="ignore"):
        return np.where(nx > 0, ne / np.where(nx > 0, nx, 1.0), np.where(ne > 0, np.inf, 0.0))


def pack_bits(q: np.ndarray, bits: int) -> bytes:
    """Pack values ``q < 2^bits`` (uint8, any shape, row-major) into ``ceil(n·bits/8)`` bytes.

    Value ``i`` occupies bits ``[i·b, (i+1)·b)`` of the little-endian bit stream.

    Example:
      >>> pack_bits(np.array([1, 2, 3, 0], np.uint8), 2).hex()
      '39'
    """
    bits = _check_bits(bits)
    q = np.ascontiguousarray(q, np.uint8).reshape(-1)
    if q.size and int(q.max()) >= (1 << bits):
        raise ValueError(f"value {int(q.max())} does not fit in {bits} bits")
    stream = np.unpackbits(q[:, None], axis=1, count=bits, bitorder="little").reshape(-1)
    return np.packbits(stream, bitorder="little").tobytes()


def unpack_bits(data: bytes, bits: int, n: int) -> np.ndarray:
    """Inverse of :func:`pack_bits`: ``uint8[n]``.

    Raises:
      ValueError: ``data`` does not hold exactly ``ceil(n·bits/8)`` bytes.
    """
    bits = _check_bits(bits)
    want = (n * bits + 7) // 8
    if len(data) != want:
        raise ValueError(f"{n} values of {bits} bits need {want} packed bytes, got {len(data)}")
    stream = np.unpackbits(np.frombuffer(data, np.uint8), count=n * bits, bitorder="little").reshape(n, bits)
    return np.packbits(stream, axis=1, bitorder="little").reshape(n)


def _to_rows(x: np.ndarray, axis: str) -> np.ndarray:
    """Examples ``f32[b, ..., d]`` as quantization rows: ``row``: every length-``d`` vector (one scale
    per token); ``channel``: every channel across the example's other axes (one scale per channel)."""
    b, d = x.shape[0], x.shape[-1] if x.ndim > 1 else 1
    v = x.reshape(b, -1, d)
    if axis == "channel":
        v = np.swapaxes(v, 1, 2)
    return np.ascontiguousarray(v).reshape(-1, v.shape[-1])


def _from_rows(r: np.ndarray, shape: tuple[int, ...], axis: str) -> np.ndarray:
    """Inverse of :func:`_to_rows`."""
    b, d = shape[0], shape[-1] if len(shape) > 1 else 1
    if axis == "channel":
        return np.swapaxes(r.reshape(b, d, -1), 1, 2).reshape(shape)
    return r.reshape(shape)


def scales_per_example(row_shape: tuple[int, ...], axis: str) -> int:
    """Float32 scales sent per quantized example of shape ``row_shape``."""
    d = row_shape[-1] if row_shape else 1
    per = int(np.prod(row_shape, dtype=np.int64)) if row_shape else 1
    return d if axis == "channel" else per // d


def quantizer_id(axis: str) -> str:
    """The name a frame carries for the grid and scale axis of its quantized values: ``zero-level/<axis>``."""
    return f"{GRID}/{_check_axis(axis)}"


def _quantize_examples(x: np.ndarray, bits: int, keys, axis: str, rounding: str) -> tuple[bytes, bytes, np.ndarray]:
    """Quantize examples ``x: f32[b, *row]`` (keys ``u32[b, 2]``, unused by nearest rounding): ``(packed, scales, x̂)``."""
    rows = _to_rows(x, axis)
    u = None
    if rounding == "stochastic":
        if keys is None:
            raise ValueError(
                "stochastic rounding needs the examples' keys (example_keys); pass keys or use rounding='nearest'"
            )
        per = int(np.prod(x.shape[1:], dtype=np.int64))
        u = uniforms(keys, per).reshape(rows.shape)
    q, s = quantize_rows(rows, bits, u)
    xhat = _from_rows(dequantize_rows(q, s, bits), x.shape, axis)
    return pack_bits(levels_to_codes(q, bits), bits), s.astype("<f4").tobytes(), xhat


def _dequantize_examples(enc: Encoded, shape: tuple[int, ...], axis: str) -> np.ndarray:
    """Decode the quantized part of ``enc`` into ``f32[shape]`` (``shape[0]`` examples)."""
    n = int(np.prod(shape, dtype=np.int64))
    n_rows = shape[0] * scales_per_example(shape[1:], axis)
    if len(enc.scales) != 4 * n_rows:
        raise CodecMismatch(
            f"{shape[0]} quantized examples of shape {shape[1:]} need {4 * n_rows} scale bytes, got {len(enc.scales)}"
        )
    try:
        c = unpack_bits(enc.packed, enc.bits, n)
    except ValueError as e:
        raise CodecMismatch(str(e)) from None
    s = np.frombuffer(enc.scales, "<f4").astype(np.float32)
    q = codes_to_levels(c, enc.bits).reshape(n_rows, -1)
    return _from_rows(dequantize_rows(q, s, enc.bits), shape, axis)


def _full_rows(enc: Encoded, shape: tuple[int, ...]) -> np.ndarray:
    want = 4 * int(np.prod(shape, dtype=np.int64))
    if len(enc.full) != want:
        raise CodecMismatch(
            f"{shape[0]} full-precision examples of shape {shape[1:]} need {want} bytes, got {len(enc.full)}"
        )
    return np.frombuffer(enc.full, "<f4").astype(np.float32).reshape(shape)


def _as_batch(x, ids) -> tuple[np.ndarray, np.ndarray]:
    x = np.asarray(x, np.float32)
    ids = np.asarray(ids, np.int64).reshape(-1)
    if x.ndim < 1 or x.shape[0] != ids.shape[0]:
        raise ValueError(f"tensor of shape {x.shape} does not hold one row per example id ({ids.shape[0]} ids)")
    if not np.all(np.isfinite(x)):
        raise ValueError("cannot encode a tensor with non-finite values")
    return x, ids


def _check_shape(enc: Encoded, ids: np.ndarray, bits: int, quantizer: str = "") -> tuple[int, ...]:
    shape = tuple(int(d) for d in enc.shape)
    if not shape or shape[0] != ids.shape[0]:
        raise CodecMismatch(f"message shape {shape} does not hold one row per example id ({ids.shape[0]} ids)")
    if enc.bits != bits:
        raise CodecMismatch(f"message quantized to {enc.bits} bits; this link's codec uses {bits}")
    if enc.quantizer != quantizer:
        raise CodecMismatch(f"message quantized on grid {enc.quantizer!r}; this link's codec uses {quantizer!r}")
    fresh = np.asarray(enc.fresh, bool).reshape(-1)
    if fresh.shape[0] != shape[0]:
        raise CodecMismatch(f"message has {fresh.shape[0]} first-sight flags for {shape[0]} examples")
    return shape


def _full_message(x: np.ndarray) -> Encoded:
    """Every example in float32 (``bits = 0``): the fp32 codec, and any codec's uncompressed warm-up."""
    return Encoded(x.shape, 0, np.ones(x.shape[0], bool), x.astype("<f4").tobytes(), b"", b"")


def _decode_full(enc: Encoded, ids: np.ndarray, what: str) -> np.ndarray:
    if enc.bits != 0:
        raise CodecMismatch(f"message quantized to {enc.bits} bits; {what} carries every example in full precision")
    shape = _check_shape(enc, ids, 0)
    if not np.all(enc.fresh) or enc.packed or enc.scales:
        raise CodecMismatch(f"{what} carries every example in full precision")
    return _full_rows(enc, shape)


# --------------------------------------------------------------------------- codecs


def fp32() -> LinkCodec:
    """Lossless float32 (no state)."""

    def init(n_examples: int = 0, row_shape: tuple = (), path=None):
        return None

    def encode(state, x, ids, keys=None, full: bool = False):
        x, ids = _as_batch(x, ids)
        return state, _full_message(x), x.copy()

    def decode(state, enc: Encoded, ids, full: bool = False):
        ids = np.asarray(ids, np.int64).reshape(-1)
        return state, _decode_full(enc, ids, "an fp32 link")

    return LinkCodec("fp32", 0, init, encode, decode)


def _check_axis(axis: str) -> str:
    if axis not in SCALE_AXES:
        raise ValueError(f"scale axis must be one of {list(SCALE_AXES)}, got {axis!r}")
    return axis


def directq(bits: int, axis: str = "channel", rounding: str = "stochastic") -> LinkCodec:
    """Direct quantization to ``bits`` bits on the zero-level grid, one scale per channel (or per row; no state).

    ``full=True`` (encode and decode): the uncompressed warm-up, every example in float32.
    """
    bits, axis, rounding = _check_quant_bits(bits), _check_axis(axis), _check_rounding(rounding)
    qid = quantizer_id(axis)

    def init(n_examples: int = 0, row_shape: tuple = (), path=None):
        return None

    def encode(state, x, ids, keys=None, full: bool = False):
        x, ids = _as_batch(x, ids)
        if full:
            return state, _full_message(x), x.copy()
        packed, scales, xhat = _quantize_examples(x, bits, keys, axis, rounding)
        return state, Encoded(x.shape, bits, np.zeros(x.shape[0], bool), b"", packed, scales, qid), xhat

    def decode(state, enc: Encoded, ids, full: bool = False):
        ids = np.asarray(ids, np.int64).reshape(-1)
        if full:
            return state, _decode_full(enc, ids, "a link in its uncompressed warm-up")
        shape = _check_shape(enc, ids, bits, qid)
        if np.any(enc.fresh) or enc.full:
            raise CodecMismatch("a directq link sends no example in full precision")
        return state, _dequantize_examples(enc, shape, axis)

    return LinkCodec("directq", bits, init, encode, decode, axis, rounding)


def _check_ids(state: DeltaState, ids: np.ndarray) -> None:
    n = state.m.shape[0]
    if ids.size and (ids.min() < 0 or ids.max() >= n):
        raise CodecMismatch(
            f"example id {int(ids.max() if ids.max() >= n else ids.min())} is outside the buffers of {n} examples"
        )
    if np.unique(ids).size != ids.size:
        raise CodecMismatch(f"example ids {ids.tolist()} repeat within one message")


def aqsgd(bits: int, axis: str = "channel", rounding: str = "stochastic") -> LinkCodec:
    """AQ-SGD: full precision at first sight, then ``Q(a − m[ξ])`` with buffers on both ends.

    ``full=True`` (encode and decode): the uncompressed warm-up, every example in float32 and both
    ends set ``m[ξ] = a``.
    """
    bits, axis, rounding = _check_quant_bits(bits), _check_axis(axis), _check_rounding(rounding)
    qid = quantizer_id(axis)

    def init(n_examples: int, row_shape: tuple, path: str | os.PathLike | None = None) -> DeltaState:
        shape = (int(n_examples), *(int(d) for d in row_shape))
        if path is None:
            m = np.zeros(shape, np.float32)
        else:
            m = np.lib.format.open_memmap(Path(path), mode="w+", dtype=np.float32, shape=shape)
        return DeltaState(m, np.zeros(shape[0], bool))

    def _check_rows(state: DeltaState, shape: tuple[int, ...], err) -> None:
        if tuple(shape[1:]) != state.m.shape[1:]:
            raise err(f"activation rows of shape {tuple(shape[1:])}; the buffers hold {state.m.shape[1:]}")

    def encode(state: DeltaState, x, ids, keys=None, full: bool = False):
        x, ids = _as_batch(x, ids)
        _check_ids(state, ids)
        _check_rows(state, x.shape, ValueError)
        if full:
            state.m[ids] = x
            state.seen[ids] = True
            return state, _full_message(x), x.copy()
        fresh = ~state.seen[ids]
        old = ids[~fresh]
        packed, scales = b"", b""
        if old.size:
            delta = x[~fresh] - state.m[old]
            packed, scales, dq = _quantize_examples(
                delta, bits, None if keys is None else np.asarray(keys, np.uint32)[~fresh], axis, rounding
            )
            state.m[old] = state.m[old] + dq
        state.m[ids[fresh]] = x[fresh]
        state.seen[ids[fresh]] = True
        enc = Encoded(x.shape, bits, fresh, x[fresh].astype("<f4").tobytes(), packed, scales, qid)
        return state, enc, np.array(state.m[ids])

    def decode(state: DeltaState, enc: Encoded, ids, full: bool = False):
        ids = np.asarray(ids, np.int64).reshape(-1)
        _check_ids(state, ids)
        if full:
            x = _decode_full(enc, ids, "a link in its uncompressed warm-up")
            _check_rows(state, x.shape, CodecMismatch)
            state.m[ids] = x
            state.seen[ids] = True
            return state, x.copy()
        shape = _check_shape(enc, ids, bits, qid)
        _check_rows(state, shape, CodecMismatch)
        fresh = np.asarray(enc.fresh, bool).reshape(-1)
        expect = ~state.seen[ids]
        if not np.array_equal(fresh, expect):
            i = int(np.flatnonzero(fresh != expect)[0])
            raise CodecMismatch(
                f"example {int(ids[i])} arrives {'in full precision' if fresh[i] else 'as a difference'} but this end "
                f"has {'no' if expect[i] else 'a'} buffer for it: the two ends' buffers are out of step"
            )
        old = ids[~fresh]
        full_rows = _full_rows(enc, (int(fresh.sum()), *shape[1:]))
        if old.size:
            dq = _dequantize_examples(enc, (old.size, *shape[1:]), axis)
            state.m[old] = state.m[old] + dq
        elif enc.packed or enc.scales:
            raise CodecMismatch("message carries quantized values but no example is a difference")
        state.m[ids[fresh]] = full_rows
        state.seen[ids[fresh]] = True
        return state, np.array(state.m[ids])

    return LinkCodec("aqsgd", bits, init, encode, decode, axis, rounding)


def quantizer_input(codec: LinkCodec, state, x, ids, full: bool = False) -> tuple[np.ndarray, np.ndarray]:
    """What ``codec.encode(state, x, ids, full=full)`` will hand its quantizer, before it runs:
    ``(mask bool[B], v f32[k, ...])``, the examples that will be quantized and their input
    (directq: ``x``; aqsgd: ``x − m[ξ]`` of the examples seen before; none for fp32 or ``full``).

    With the encoder's ``x̂``, ``relative_errors(v, (x̂ − x)[mask])`` is the quantizer's ``c_Q`` on
    this message (for aqsgd ``x̂ − x = Q(v) − v`` up to the float32 rounding of ``m[ξ] + Q(v)``).
    """
    x = np.asarray(x, np.float32)
    ids = np.asarray(ids, np.int64).reshape(-1)
    if codec.name == "fp32" or full:
        return np.zeros(x.shape[0], bool), x[:0]
    if codec.name == "directq":
        return np.ones(x.shape[0], bool), x
    mask = np.asarray(state.seen[ids], bool)
    return mask, x[mask] - state.m[ids[mask]]


def make_codec(name: str, bits: int = 0, axis: str = "channel", rounding: str = "stochastic") -> LinkCodec:
    """The codec ``name`` (``fp32``, ``directq`` or ``aqsgd``) with ``bits``, scale ``axis`` and
    ``rounding`` (ignored by fp32).

    Raises:
      ValueError: an unknown name, bits outside ``[2, 8]``, axis or rounding (the valid values are named).

    Example:
      >>> c = make_codec("aqsgd", bits=2)  # zero-level grid, channel scales, stochastic rounding
      >>> s_send, s_recv = c.init(4, (3,)), c.init(4, (3,))
      >>> x = np.arange(6, dtype=np.float32).reshape(2, 3); ids = np.array([0, 2])
      >>> keys = example_keys(0, link=0, direction=0, step=0, ids=ids)
      >>> s_send, msg, xs = c.encode(s_send, x, ids, keys)
      >>> s_recv, xr = c.decode(s_recv, msg, ids)
      >>> bool((xs == xr).all()), buffer_digest(s_send) == buffer_digest(s_recv)
      (True, True)
    """
    if name == "fp32":
        return fp32()
    if name == "directq":
        return directq(bits, axis, rounding)
    if name == "aqsgd":
        return aqsgd(bits, axis, rounding)
    raise ValueError(f"unknown activation codec {name!r}; expected one of {list(CODEC_NAMES)}")


# --------------------------------------------------------------------------- buffers


def buffer_digest(state: DeltaState | None) -> str | None:
    """SHA-256 hex of the buffers (``seen`` flags, then ``m`` as little-endian float32); None without buffers."""
    if state is None:
        return None
    h = hashlib.sha256()
    h.update(np.ascontiguousarray(state.seen, np.uint8).tobytes())
    h.update(np.ascontiguousarray(state.m, "<f4").tobytes())
    return h.hexdigest()


def buffer_nbytes(state: DeltaState | None) -> int:
    """Bytes held by the buffers (``m`` and ``seen``); 0 without buffers."""
    if state is None:
        return 0
    return int(state.m.nbytes + state.seen.nbytes)


def save_buffers(state: DeltaState | None, path: str | os.PathLike) -> str | None:
    """Write the buffers to ``path`` (``.npz``, atomically: a temporary file renamed); returns the digest."""
    if state is None:
        return None
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "wb") as fh:
        np.savez(fh, m=np.asarray(state.m), seen=np.asarray(state.seen))
    os.replace(tmp, path)
    return buffer_digest(state)


def read_buffer_file(path: str | os.PathLike) -> tuple[np.ndarray, np.ndarray]:
    """The ``(m, seen)`` arrays of a buffer file written by :func:`save_buffers`.

    Raises:
      ValueError: the file is missing, or truncated or damaged (one line naming the file and why).
    """
    import zipfile

    path = Path(path)
    if not path.is_file():
        raise ValueError(f"AQ-SGD buffer file {path} is missing")
    try:
        with np.load(path, allow_pickle=False) as f:
            return np.asarray(f["m"]), np.asarray(f["seen"])
    except (zipfile.BadZipFile, OSError, EOFError, KeyError, ValueError) as e:
        why = str(e).splitlines()[0] if str(e) else ""
        raise ValueError(f"AQ-SGD buffer file {path} is truncated or damaged ({type(e).__name__}: {why})") from None


def load_buffers(state: DeltaState, path: str | os.PathLike, digest: str | None = None) -> DeltaState:
    """Read buffers saved by :func:`save_buffers` into ``state`` (in place) and check their digest.

    Raises:
      ValueError: the file is missing or damaged, its shapes differ from ``state``'s, or its digest is not ``digest``.
    """
    path = Path(path)
    m, seen = read_buffer_file(path)
    if m.shape != state.m.shape or seen.shape != state.seen.shape:
        raise ValueError(f"buffers in {path} have shape {m.shape}; this link needs {state.m.shape}")
    state.m[...] = m
    state.seen[...] = seen
    if digest is not None and buffer_digest(state) != digest:
        raise ValueError(
            f"buffers in {path} have digest {buffer_digest(state)[:16]}..., the checkpoint says {digest[:16]}..."
        )
    return state
