"""The loss change of every single-weight mutation of a binary/ternary conv layer, exactly, and top-k flips.

A **mutation** ``(o, j, d)`` moves weight ``w[o, j]`` by ``d * step`` (``d = ±1``; binary:
``step = 2``, a sign flip, valid only for ``d = -w``; ternary: ``step = 1``, valid while the
weight stays in {-1, 0, +1}). Its index is ``m = 2 (o J + j) + (d > 0)``. A weight whose move in
direction ``d`` is invalid is "at its limit".

The seed's per-patch method: the dot of output ``o`` at pixel ``p`` changes by
``step * d * x[p, j]``; the output bit flips only where the dot is within one step of the threshold:

    U[p, o]  = t <= dot < t + step   (output +1; turns -1 if the dot falls by a step: x[p, j] = -d)
    Dn[p, o] = t - step <= dot < t   (output -1; turns +1 if the dot rises by a step: x[p, j] = d)

A flipped activation ``act -> -act`` moves the logits by ``G[p, o] = -2 act[p, o] V[p, o, :]``
(the head is linear, :mod:`zeroth.binary.layers`), so the logits of one example after mutation
``(o, j, d)`` are exactly

    z + 1/2 S0[o] + d/2 S1[o, j],   S0[o] = sum_p G (U + Dn),   S1[o, j] = sum_p G (Dn - U) x[p, j]

(using ``[x = d] = (1 + d x) / 2``). The loss delta is ``sum_b CE(z_b + ...) - CE(z_b)``, the
float softmax cross-entropy summed over the examples: the change of every one of the ``2 O 9 C``
mutations from one forward pass, equal (up to float rounding) to re-running the layer with the
mutation applied.

Example:
  >>> import numpy as np
  >>> d = np.array([[[np.inf, -0.5], [0.2, np.inf]]], np.float32)   # O=1, J=2
  >>> select(d, k=4, min_gain=0.0).tolist()                          # only (0, 0, +1) lowers the loss
  [1]
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from zeroth.binary import layers as L

__all__ = [
    "valid_moves",
    "cross_entropy",
    "batch_loss",
    "mutation_deltas",
    "threshold_deltas",
    "select_thresholds",
    "apply_thresholds",
    "select",
    "apply_mutations",
    "apply_mutations_np",
    "at_limit_np",
]


def valid_moves(w, ternary: bool) -> jax.Array:
    """``bool[O, J, 2]``: is the move ``d = -1`` (index 0) / ``d = +1`` (index 1) of each weight allowed."""
    w = jnp.asarray(w).astype(jnp.int32)
    if ternary:
        return jnp.stack([w > -1, w < 1], axis=-1)
    return jnp.stack([w > 0, w < 0], axis=-1)


def cross_entropy(logits, labels) -> jax.Array:
    """Per-example softmax cross-entropy ``logsumexp(z) - z[y]`` (float32)."""
    return jax.nn.logsumexp(logits, axis=-1) - jnp.take_along_axis(logits, labels[..., None], axis=-1)[..., 0]


def batch_loss(layer: L.ConvLayer, head: L.Head, x, labels, spec: L.ConvSpec, reg: L.Regions) -> jax.Array:
    """Summed cross-entropy of the batch through the packed layer and the head."""
    d = L.dots(layer, x, spec)
    b = d.shape[0]
    act = jnp.where(d >= layer.thresh[None, None, None, :], 1.0, -1.0).reshape(b, -1, spec.c_out)
    return jnp.sum(cross_entropy(L.head_logits(head, act, reg), labels))


def mutation_deltas(layer: L.ConvLayer, head: L.Head, x, labels, spec: L.ConvSpec, reg: L.Regions) -> jax.Array:
    """``f32[O, 9 C, 2]``: summed loss change of each mutation (``+inf`` where the weight is at its limit).

    Args:
      layer, head: the current layer and its auxiliary head.
      x: packed input ``u32[B, H, W, words(C)]``; labels: ``int32[B]``.
    """
    d = L.dots(layer, x, spec)  # (B, H, W, O) int32, XOR-popcount
    b, h, w, o = d.shape
    d = d.reshape(b, h * w, o)
    t, s = layer.thresh[None, None, :], spec.step
    act = jnp.where(d >= t, 1.0, -1.0)
    up = ((d >= t) & (d < t + s)).astype(jnp.float32)
    down = ((d >= t - s) & (d < t)).astype(jnp.float32)
    v = L.head_matrix(head, reg)  # (P, O, K)
    z = L.head_logits(head, act, reg)  # (B, K)
    xcol = L.im2col_pm1(x, spec.c_in)  # (B, P, J)
    s0 = -2.0 * jnp.einsum("bpo,pok->bok", act * (up + down), v)
    gd = (-2.0 * act * (down - up))[..., None] * v[None]  # (B, P, O, K)
    s1 = jnp.einsum("bpok,bpj->bojk", gd, xcol)
    base = cross_entropy(z, labels)  # (B,)
    zz = z[:, None, None, :] + 0.5 * s0[:, :, None, :]
    lab = labels[:, None, None]
    minus = jnp.sum(cross_entropy(zz - 0.5 * s1, lab) - base[:, None, None], axis=0)
    plus = jnp.sum(cross_entropy(zz + 0.5 * s1, lab) - base[:, None, None], axis=0)
    deltas = jnp.stack([minus, plus], axis=-1)  # (O, J, 2)
    return jnp.where(valid_moves(layer.w, spec.ternary), deltas, jnp.inf)


def threshold_deltas(layer: L.ConvLayer, head: L.Head, x, labels, spec: L.ConvSpec, reg: L.Regions) -> jax.Array:
    """``f32[O, 2]``: summed loss change of moving each output channel's threshold down (index 0)
    or up (index 1) by one step (not in the seed, whose thresholds stay where they start).

    Lowering ``t`` by a step turns the outputs with ``t - step <= dot < t`` from -1 to +1; raising
    it turns those with ``t <= dot < t + step`` from +1 to -1: the logits move by ``sum_p G Dn`` or
    ``sum_p G U`` (``G``, ``U``, ``Dn`` as in :func:`mutation_deltas`), exactly.
    """
    d = L.dots(layer, x, spec)
    b, h, w, o = d.shape
    d = d.reshape(b, h * w, o)
    t, s = layer.thresh[None, None, :], spec.step
    act = jnp.where(d >= t, 1.0, -1.0)
    up = ((d >= t) & (d < t + s)).astype(jnp.float32)
    down = ((d >= t - s) & (d < t)).astype(jnp.float32)
    v = L.head_matrix(head, reg)  # (P, O, K)
    z = L.head_logits(head, act, reg)  # (B, K)
    lower = -2.0 * jnp.einsum("bpo,pok->bok", act * down, v)
    raise_ = -2.0 * jnp.einsum("bpo,pok->bok", act * up, v)
    base = cross_entropy(z, labels)[:, None]
    lab = labels[:, None]
    minus = jnp.sum(cross_entropy(z[:, None, :] + lower, lab) - base, axis=0)
    plus = jnp.sum(cross_entropy(z[:, None, :] + raise_, lab) - base, axis=0)
    return jnp.stack([minus, plus], axis=-1)


def select_thresholds(deltas, *, k: int, min_gain: float = 0.0) -> np.ndarray:
    """``int32[O]`` moves (-1, 0, +1) of the up-to-``k`` thresholds whose best move lowers the loss
    most (by more than ``min_gain``); ties break by the lower channel, then by moving down."""
    dl = np.asarray(deltas, np.float32)
    best_dir = np.argmin(dl, axis=-1)
    best = dl[np.arange(len(dl)), best_dir]
    cand = np.flatnonzero(best < -min_gain)
    chosen = cand[np.lexsort((cand, best[cand]))[:k]]
    moves = np.zeros(len(dl), np.int32)
    moves[chosen] = 2 * best_dir[chosen] - 1
    return moves


def apply_thresholds(thresh, moves, spec: L.ConvSpec) -> np.ndarray:
    """``int32[O]`` thresholds moved by ``moves * spec.step``."""
    return (np.asarray(thresh, np.int32) + np.asarray(moves, np.int32) * spec.step).astype(np.int32)


def select(deltas, *, k: int, min_gain: float = 0.0) -> np.ndarray:
    """Indices (ascending) of the up-to-``k`` mutations that lower the loss most, one per weight.

    Only mutations with ``delta < -min_gain`` qualify; ties break by the lower index.
    """
    dl = np.asarray(deltas, np.float32)
    best_dir = np.argmin(dl, axis=-1)  # ties -> d = -1
    best = np.take_along_axis(dl, best_dir[..., None], axis=-1)[..., 0].reshape(-1)
    idx = 2 * np.arange(best.size) + best_dir.reshape(-1)
    ok = best < -min_gain
    cand, vals = idx[ok], best[ok]
    order = np.lexsort((cand, vals))[:k]
    return np.sort(cand[order]).astype(np.int64)


def apply_mutations(w, indices, ternary: bool) -> jax.Array:
    """Apply mutations (indices ``2 * weight + (d > 0)``) to ``int8[O, J]`` values."""
    return jnp.asarray(apply_mutations_np(np.asarray(w), np.asarray(indices), ternary))


def at_limit_np(w, indices, ternary: bool) -> np.ndarray:
    """``bool`` per mutation index: the weight cannot move that way (NumPy)."""
    flat = np.asarray(w).reshape(-1).astype(np.int32)
    idx = np.asarray(indices, np.int64)
    cur = flat[idx // 2]
    d = 2 * (idx % 2) - 1
    if ternary:
        return (cur + d < -1) | (cur + d > 1)
    return cur == d


def apply_mutations_np(w, indices, ternary: bool) -> np.ndarray:
    """NumPy version of :func:`apply_mutations`; raises ``ValueError`` naming a mutation at its limit."""
    w = np.array(w, np.int8)
    idx = np.asarray(indices, np.int64)
    if idx.size and (idx.min() < 0 or idx.max() >= 2 * w.size):
        raise ValueError(f"mutation index out of range [0, {2 * w.size}): {idx.min()}..{idx.max()}")
    if len(np.unique(idx // 2)) != idx.size:
        raise ValueError("two mutations of one weight in one step")
    bad = at_limit_np(w, idx, ternary)
    if bad.any():
        raise ValueError(f"mutation {int(idx[bad][0])} moves a weight past its limit")
    flat = w.reshape(-1)
    step = 1 if ternary else 2
    flat[idx // 2] += (step * (2 * (idx % 2) - 1)).astype(np.int8)
    return flat.reshape(w.shape)
