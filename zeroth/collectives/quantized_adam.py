"""Averaging across data-parallel replicas on the host: float32 means and QuantizedAdam (1-bit Adam).

Every function here is NumPy float32 arithmetic with one IEEE rounding per operation (no fused
multiply-add, no reassociation), applied in a fixed order, so every replica and every machine
computes the same bits from the same inputs.

* :func:`mean`: the float32 mean of R vectors, summed in replica order ``((v_0 + v_1) + v_2) ...``
  and divided by R once.
* Sign compression: ``C(c) = scale · sign(c)`` with one scale per segment (a parameter tensor),
  ``scale = ‖c_seg‖₂ / √n_seg``, so that ``‖C(c_seg)‖ = ‖c_seg‖``, as 1-bit Adam's reference
  implementation (DeepSpeed) scales its signs. (The mean magnitude ``‖c_seg‖₁ / n_seg`` would minimize
  ``‖c − C(c)‖``, but it shrinks the momentum wherever magnitudes are uneven, and trained slower:
  docs/measurements/2026-12-05-aqsgd-replicas.md.) Signs travel as the packed words of
  :mod:`zeroth.kernels.signbits` (bit 1 for ``+``, a zero's sign is ``+``), 1 bit per value plus
  one float32 per segment; they are packed and unpacked here with NumPy's ``packbits`` (the words
  of ``signbits.pack_ref``, bit for bit, without a device dispatch per operation).
* :class:`ErrorFeedback`: ``c = x + e; q = C(c); e ← c − q``; the compressor's error is carried into
  the next round, so what the rounds deliver sums to what they were given, up to the last error:
  ``Σ_t q_t = Σ_t x_t − e_T`` (exactly, up to float32 rounding of each ``c − q``).
* :class:`QuantizedAdam`: the optimizer of 1-bit Adam (Tang et al., 2021), as the AQ-SGD seed
  combines it with activation compression. For ``warmup`` steps it is Adam on the replicas' float32
  mean gradient. Then the variance ``v`` is frozen; each replica updates the shared momentum with
  its own gradient, ``m_r = β₁ m + (1 − β₁) g_r``, and the replicas average ``m_r`` through a
  compressed all-reduce with error feedback on both sides: each worker sends ``C(m_r + e_r)``, the
  server averages them (:func:`mean`), adds its own error and sends back ``C(avg + e_s)``, which
  every replica takes as the new ``m``, except where the frozen variance is 0 (entries that never
  had a gradient in the warm-up, such as the embedding rows of unseen tokens: there a sign's
  ``scale / ε`` would be a step of 10⁸ scales, so their momentum is held at 0, as DeepSpeed's
  1-bit Adam masks them). The update is AdamW's with bias corrections
  ``m / (1 − β₁^t)`` and ``v / (1 − β₂^min(t, warmup))``:
  ``p ← p − lr · (m̂ / (√v̂ + ε) + λ p)``.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np

__all__ = ["ErrorFeedback", "QuantizedAdam", "mean", "segments_of", "sign_compress", "sign_decompress", "sign_nbytes"]


def mean(vectors: Sequence[np.ndarray]) -> np.ndarray:
    """The float32 mean of ``vectors`` (replica order): summed left to right, divided by their count once.

    Example:
      >>> mean([np.float32([1, 2]), np.float32([3, 5])]).tolist()
      [2.0, 3.5]
    """
    if not vectors:
        raise ValueError("mean of no vectors: at least one replica must contribute")
    total = np.array(vectors[0], np.float32, copy=True)
    for v in vectors[1:]:
        if v.shape != total.shape:
            raise ValueError(f"replica vectors differ in shape: {v.shape} vs {total.shape}")
        total += np.asarray(v, np.float32)
    return total / np.float32(len(vectors))


def segments_of(sizes: Sequence[int]) -> np.ndarray:
    """Segment boundaries ``[0, n_0, n_0 + n_1, ...]`` of tensors of ``sizes`` laid end to end."""
    sizes = [int(s) for s in sizes]
    if any(s < 1 for s in sizes):
        raise ValueError(f"segment sizes must be positive, got {sizes}")
    return np.concatenate([[0], np.cumsum(sizes)]).astype(np.int64)


def _scales(c: np.ndarray, bounds: np.ndarray) -> np.ndarray:
    """``‖c_seg‖₂ / √n_seg`` per segment: the squares (exact in float64 for float32 values) summed
    exactly (``math.fsum``, correctly rounded whatever the order), divided and square-rooted in
    float64 (IEEE, correctly rounded), rounded once to float32."""
    a = np.asarray(c, np.float32).astype(np.float64)
    out = np.empty(len(bounds) - 1, np.float32)
    for k in range(len(bounds) - 1):
        seg = a[bounds[k] : bounds[k + 1]]
        out[k] = np.float32(math.sqrt(math.fsum((seg * seg).tolist()) / seg.size))
    return out


def sign_nbytes(n: int, segments: int) -> int:
    """Payload bytes of one compressed vector: ``⌈n / 32⌉`` uint32 words of signs and one float32 per segment."""
    return 4 * ((int(n) + 31) // 32) + 4 * int(segments)


_TINY = np.finfo(np.float32).tiny


def _pack_signs(c: np.ndarray) -> np.ndarray:
    """The words of :func:`zeroth.kernels.signbits.pack_ref`: bit ``i % 32`` of word ``i // 32`` is 1
    unless ``c[i] <= -tiny`` (zeros, negative subnormals and NaN pack as ``+``); padding bits are 0."""
    bits = ~(c <= -_TINY)
    pad = (-bits.size) % 32
    if pad:
        bits = np.concatenate([bits, np.zeros(pad, bool)])
    return np.packbits(bits, bitorder="little").view("<u4").astype(np.uint32)


def sign_compress(c: np.ndarray, bounds: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``(words uint32, scales float32[segments], q)``: the packed signs of ``c``, one scale per
    segment and the decompressed ``q = C(c)`` (what the receiver rebuilds, bit for bit)."""
    c = np.asarray(c, np.float32)
    if c.ndim != 1 or c.size != int(bounds[-1]):
        raise ValueError(f"sign_compress takes a flat float32 vector of {int(bounds[-1])} values, got shape {c.shape}")
    words = _pack_signs(c)
    scales = _scales(c, bounds)
    return words, scales, sign_decompress(words, scales, bounds)


def sign_decompress(words: np.ndarray, scales: np.ndarray, bounds: np.ndarray) -> np.ndarray:
    """``q``: ``+scale`` where the sign bit is 1, ``-scale`` where it is 0, per segment (exact in float32)."""
    n = int(bounds[-1])
    words, scales = np.asarray(words, np.uint32), np.asarray(scales, np.float32)
    if words.size != (n + 31) // 32 or scales.size != len(bounds) - 1:
        raise ValueError(
            f"{words.size} words and {scales.size} scales; {n} values in {len(bounds) - 1} segments need "
            f"{(n + 31) // 32} and {len(bounds) - 1}"
        )
    bits = np.unpackbits(words.astype("<u4").view(np.uint8), bitorder="little")[:n]
    signs = np.where(bits == 1, np.float32(1.0), np.float32(-1.0))
    return signs * np.repeat(scales, np.diff(bounds))


class ErrorFeedback:
    """One end's error-feedback compressor over vectors of ``bounds`` (a worker's or the server's).

    :meth:`step` returns ``(words, scales, q)`` of ``C(x + e)`` and keeps ``e ← (x + e) − q``.
    Per segment ``‖e‖² = 2‖c‖² − 2‖c‖₂‖c‖₁/√n ≤ 2‖c‖²`` (``c = x + e``): the error does not vanish
    but stays of the order of the inputs, which is what error feedback needs.
    """

    def __init__(self, bounds: np.ndarray):
        self.bounds = np.asarray(bounds, np.int64)
        self.error = np.zeros(int(self.bounds[-1]), np.float32)

    def step(self, x: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        c = np.asarray(x, np.float32) + self.error
        words, scales, q = sign_compress(c, self.bounds)
        self.error = c - q
        return words, scales, q


class QuantizedAdam:
    """The QuantizedAdam (1-bit Adam) state of one replica of one parameter vector (see the module docstring).

    Args:
      bounds: the parameter tensors' segments (:func:`segments_of`).
      warmup: steps of Adam with float32 averaging before the variance is frozen (at least 1).
      b1, b2, eps, weight_decay: Adam's and AdamW's constants.
      server: whether this replica also reduces (holds the server's error).

    The caller drives a step in three parts: :meth:`compressed` says whether step ``t`` compresses;
    :meth:`local_momentum` gives the vector this replica contributes (its gradient during the
    warm-up, ``m_r`` after); the server's :meth:`reduce` turns every replica's message into the
    shared one; :meth:`apply` updates the parameters from it.
    """

    def __init__(
        self,
        bounds: np.ndarray,
        warmup: int,
        b1: float = 0.9,
        b2: float = 0.999,
        eps: float = 1e-8,
        weight_decay: float = 0.0,
        server: bool = False,
    ):
        if int(warmup) < 1:
            raise ValueError(f"QuantizedAdam warmup={warmup}: the variance needs at least 1 uncompressed step")
        self.bounds = np.asarray(bounds, np.int64)
        n = int(self.bounds[-1])
        self.warmup, self.b1, self.b2 = int(warmup), float(b1), float(b2)
        self.eps, self.weight_decay = float(eps), float(weight_decay)
        self.m = np.zeros(n, np.float32)
        self.v = np.zeros(n, np.float32)
        self.count = 0
        self.worker = ErrorFeedback(self.bounds)
        self.server = ErrorFeedback(self.bounds) if server else None

    def compressed(self, step: int) -> bool:
        """Whether step ``step`` (0-based) averages compressed momenta (after the warm-up)."""
        return int(step) >= self.warmup

    def local_momentum(self, step: int, grad: np.ndarray) -> tuple[np.ndarray, np.ndarray | None]:
        """What this replica contributes at ``step``: ``(grad, None)`` in the warm-up (sent in float32);
        after it ``(q, (words, scales))``: ``C(m_r + e_r)`` with ``m_r = β₁ m + (1 − β₁) grad``."""
        grad = np.asarray(grad, np.float32)
        if not self.compressed(step):
            return grad, None
        m_r = np.float32(self.b1) * self.m + np.float32(1.0 - self.b1) * grad
        words, scales, q = self.worker.step(m_r)
        return q, (words, scales)

    def reduce(self, step: int, contributions: Sequence[np.ndarray]) -> tuple[np.ndarray, np.ndarray | None]:
        """Server side: every replica's contribution (replica order, decompressed) -> the shared
        vector: the float32 mean gradient in the warm-up, ``(q_s, (words, scales))`` after it."""
        avg = mean(contributions)
        if not self.compressed(step):
            return avg, None
        if self.server is None:
            raise ValueError("reduce() on a replica without the server's state (server=False)")
        words, scales, q = self.server.step(avg)
        return q, (words, scales)

    def apply(self, step: int, params: np.ndarray, shared: np.ndarray, lr: float) -> np.ndarray:
        """The parameters after step ``step`` from the shared vector (mean gradient, or the compressed momentum)."""
        b1, b2 = np.float32(self.b1), np.float32(self.b2)
        shared = np.asarray(shared, np.float32)
        if self.compressed(step):
            self.m = shared * (self.v > 0).astype(np.float32)
        else:
            self.m = b1 * self.m + np.float32(1.0 - self.b1) * shared
            self.v = b2 * self.v + np.float32(1.0 - self.b2) * (shared * shared)
        self.count += 1
        c1 = np.float32(1.0 / (1.0 - self.b1**self.count))
        c2 = np.float32(1.0 / (1.0 - self.b2 ** min(self.count, self.warmup)))
        update = (self.m * c1) / (np.sqrt(self.v * c2) + np.float32(self.eps))
        if self.weight_decay:
            update = update + np.float32(self.weight_decay) * params
        return np.asarray(params, np.float32) - np.float32(lr) * update

    def state(self) -> dict[str, np.ndarray]:
        """The arrays of the state (for digests and checkpoints): ``m``, ``v``, the worker's and server's errors."""
        out = {"m": self.m, "v": self.v, "worker_error": self.worker.error, "count": np.int64(self.count)}
        if self.server is not None:
            out["server_error"] = self.server.error
        return out

    def load(self, state: dict) -> None:
        """Take the arrays of :meth:`state` (a checkpoint's) back, bit for bit.

        Raises:
          ValueError: a missing array, or one whose shape is not this state's (another model or replica).
        """
        want = self.state()
        missing = sorted(set(want) - set(state))
        if missing:
            raise ValueError(f"QuantizedAdam state without {', '.join(missing)} (saved by another replica or version)")
        for k, v in want.items():
            if np.shape(state[k]) != np.shape(v):
                raise ValueError(
                    f"QuantizedAdam state {k} has shape {np.shape(state[k])}; this one needs {np.shape(v)}"
                )
        self.m = np.array(state["m"], np.float32)
        self.v = np.array(state["v"], np.float32)
        self.count = int(state["count"])
        self.worker.error = np.array(state["worker_error"], np.float32)
        if self.server is not None:
            self.server.error = np.array(state["server_error"], np.float32)
