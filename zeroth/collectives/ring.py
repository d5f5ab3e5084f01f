"""Multi-hop all-reduce from ``jax.lax.ppermute``: ring reduce-scatter, ring all-gather, their stages.

These functions run *inside* ``jax.shard_map`` (one program per worker, mesh axes named by a
:mod:`~zeroth.collectives.topology`). Nothing but ``ppermute`` crosses between workers, so what
moves is exactly what :mod:`zeroth.collectives.bits` counts.

**Reduce-scatter over a ring of n workers** (one stage). The local vector is split into ``n``
segments. At step ``s = 0 .. n-2`` worker ``i`` sends the message of segment ``(i - s - 1) mod n``
to worker ``i + 1``, which combines it with its own piece of that segment and sends the result on
at the next step. Segment ``j`` therefore starts at worker ``j + 1`` (chain position ``m = 1``,
``hop = 0``), is combined at hops ``1 .. n-1`` by the workers ``j + 2, .., j`` (the ``m = hop +
1``-th contributor) and ends, fully reduced, at worker ``j``.

**All-gather** sends each finished segment ``n - 1`` steps around the ring; every worker ends
with bit-identical copies of all of them (nothing is recomputed, only copied).

**Schemes.** What a message is and how a hop combines is a :class:`Scheme`: full-precision sums,
Marsit sign merges, bit-sliced counts and cascading compression all use the same driver.

**Stages.** :func:`allreduce` runs the stages of a topology: reduce-scatter along stage 0, the
scattered piece reduce-scattered along stage 1, ..., then all-gathers back out. A ring has one
stage; the 2D torus has two (rows, then columns), which is the torus all-reduce.

Example (inside ``jax.shard_map`` over a 4-worker ring)::

    total = allreduce_sum(x, Ring(4))  # psum(x, "w"): exact for integers; the same bits on every worker
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from zeroth import rng as _rng

__all__ = [
    "Hop",
    "Scheme",
    "ring_perm",
    "send",
    "hop_key",
    "ring_reduce_scatter",
    "ring_all_gather",
    "allreduce",
    "sum_scheme",
    "allreduce_sum",
    "allreduce_mean",
    "all_gather_workers",
    "worker_index",
    "padded_length",
]


class Hop(NamedTuple):
    """Where a combine happens. Static fields are Python ints; the others are traced.

    Attributes:
      stage: stage index (0 = the first ring of the topology).
      hop: 0 for the segment's first contributor (encode), ``1 .. n-1`` for combines.
      m: the contributor's 1-based position in the segment's chain, ``hop + 1``.
      weight: workers each local piece of this stage stands for (product of earlier stage sizes).
      segment: ``int32[]`` segment index within this stage's ring.
      group: ``int32[]`` which ring of this stage (linear index over the other mesh axes).
      key: ``u32[2]`` key of this hop (:func:`hop_key`), or ``None`` without a round key.
    """

    stage: int
    hop: int
    m: int
    weight: int
    segment: jax.Array
    group: jax.Array
    key: jax.Array | None


class Scheme(NamedTuple):
    """How one reduction travels: ``local`` is what a worker holds, ``message`` what crosses a hop.

    Attributes:
      split: ``(local, n) -> segments``: every leaf gets a leading axis ``n``.
      first: ``(local_segment, hop) -> message``: what the first contributor sends.
      combine: ``(message, local_segment, hop) -> message``: one hop's reduction.
      to_local: ``message -> local``: a stage's result as the next stage's local value.
      finish: ``message -> message``: applied once to the fully reduced segment (last stage)
        before it is all-gathered (e.g. a majority threshold); ``None`` = identity.
    """

    split: Callable[[Any, int], Any]
    first: Callable[[Any, Hop], Any]
    combine: Callable[[Any, Any, Hop], Any]
    to_local: Callable[[Any], Any]
    finish: Callable[[Any], Any] | None = None


def ring_perm(n: int, shift: int = 1) -> list[tuple[int, int]]:
    """The ``ppermute`` permutation ``i -> (i + shift) mod n``."""
    return [(i, (i + shift) % n) for i in range(n)]


def send(x: Any, axis: str, n: int) -> Any:
    """Send a pytree one step around the ring of ``axis`` (``ppermute``); returns what arrives."""
    return jax.lax.ppermute(x, axis, ring_perm(n))


def hop_key(round_key: jax.Array, stage: int, group, hop: int, segment) -> jax.Array:
    """``fold_in`` chain ``round_key -> stage -> group -> hop -> segment``: the key of one merge.

    Every argument is a named integer, so any worker (or a replay) regenerates the key of any hop.
    """
    k = _rng.fold_in(round_key, np.uint32(stage))
    k = _rng.fold_in(k, jnp.asarray(group).astype(jnp.uint32))
    k = _rng.fold_in(k, np.uint32(hop))
    return _rng.fold_in(k, jnp.asarray(segment).astype(jnp.uint32))


def _take(tree: Any, i: jax.Array) -> Any:
    return jax.tree_util.tree_map(lambda a: jax.lax.dynamic_index_in_dim(a, i, 0, keepdims=False), tree)


def _group(stages, level: int) -> jax.Array:
    g = jnp.int32(0)
    for j, (axis, n) in enumerate(stages):
        if j != level:
            g = g * n + jax.lax.axis_index(axis)
    return g


def ring_reduce_scatter(
    segments: Any,
    scheme: Scheme,
    *,
    axis: str,
    n: int,
    stage: int = 0,
    weight: int = 1,
    group=0,
    round_key: jax.Array | None = None,
) -> Any:
    """Reduce-scatter over the ring of mesh axis ``axis`` (``n`` workers), inside ``shard_map``.

    Args:
      segments: this worker's ``n`` local segments (every leaf with leading axis ``n``).
      scheme: the :class:`Scheme` (first / combine).
      axis, n: the ring's mesh axis and size.
      stage, weight, group: see :class:`Hop`.
      round_key: ``u32[2]``; when given each hop gets ``hop_key(round_key, stage, group, hop, segment)``.

    Returns:
      The message of segment ``axis_index(axis)``, reduced over all ``n`` workers of the ring.
    """
    i = jax.lax.axis_index(axis)

    def hop_of(h: int, seg) -> Hop:
        key = None if round_key is None else hop_key(round_key, stage, group, h, seg)
        return Hop(stage, h, h + 1, weight, seg, jnp.asarray(group, jnp.int32), key)

    seg0 = (i - 1) % n
    msg = scheme.first(_take(segments, seg0), hop_of(0, seg0))
    for s in range(n - 1):
        msg = send(msg, axis, n)
        seg = (i - s - 2) % n
        msg = scheme.combine(msg, _take(segments, seg), hop_of(s + 1, seg))
    return msg


def ring_all_gather(msg: Any, *, axis: str, n: int) -> Any:
    """All-gather over the ring of ``axis``: every leaf gets a leading axis ``n``, indexed by worker.

    Entry ``j`` is worker ``j``'s ``msg``, bit for bit, on every worker.
    """
    i = jax.lax.axis_index(axis)

    def place(out, x, j):
        return jax.tree_util.tree_map(lambda o, a: jax.lax.dynamic_update_index_in_dim(o, a, j, 0), out, x)

    out = jax.tree_util.tree_map(lambda a: jnp.zeros((n,) + a.shape, a.dtype), msg)
    out = place(out, msg, i)
    cur = msg
    for s in range(n - 1):
        cur = send(cur, axis, n)
        out = place(out, cur, (i - s - 1) % n)
    return out


def allreduce(local: Any, scheme: Scheme, stages, *, round_key: jax.Array | None = None) -> Any:
    """All-reduce through the rings of ``stages`` (``Topology.stages``), inside ``shard_map``.

    Returns the gathered messages: every leaf with leading axes ``(n_0, n_1, ...)``, segment
    ``(j_0, j_1, ...)`` being piece ``j_1`` of stage-0 segment ``j_0`` (and so on); bit-identical
    on every worker; ``leaf.reshape(-1)`` of a per-element leaf is the reduced vector in order.
    """
    stages = tuple(stages)

    def level(x, lvl: int, weight: int):
        axis, n = stages[lvl]
        group = _group(stages, lvl)
        msg = ring_reduce_scatter(
            scheme.split(x, n), scheme, axis=axis, n=n, stage=lvl, weight=weight, group=group, round_key=round_key
        )
        if lvl + 1 < len(stages):
            msg = level(scheme.to_local(msg), lvl + 1, weight * n)
        elif scheme.finish is not None:
            msg = scheme.finish(msg)
        return ring_all_gather(msg, axis=axis, n=n)

    return level(local, 0, 1)


def _split_rows(x: Any, n: int) -> Any:
    def one(a):
        if a.shape[0] % n:
            raise ValueError(f"cannot split length {a.shape[0]} into {n} equal segments; pad it first (padded_length)")
        return a.reshape((n, a.shape[0] // n) + a.shape[1:])

    return jax.tree_util.tree_map(one, x)


def sum_scheme() -> Scheme:
    """Full-precision sum: messages are partial sums (exact for integers)."""
    return Scheme(
        split=_split_rows,
        first=lambda seg, hop: seg,
        combine=lambda msg, seg, hop: msg + seg,
        to_local=lambda msg: msg,
    )


def worker_index(topology) -> jax.Array:
    """``int32[]`` this worker's row-major index over the topology's mesh axes (inside ``shard_map``)."""
    k = jnp.int32(0)
    for axis, n in zip(topology.axes, topology.shape):
        k = k * n + jax.lax.axis_index(axis)
    return k


def padded_length(d: int, topology, unit: int = 1) -> int:
    """Smallest multiple of ``unit * topology.size`` that is >= ``d``: every stage splits evenly."""
    q = unit * topology.size
    return -(-d // q) * q


def allreduce_sum(x: jax.Array, topology) -> jax.Array:
    """Sum of ``x`` (any 1-D dtype) over all workers by the topology's multi-hop all-reduce.

    Inside ``shard_map``. Integers are exact; floats are summed in the ring order of each segment,
    once, and copied, so every worker gets the same bits.
    """
    if x.ndim != 1:
        raise ValueError(f"allreduce_sum takes a 1-D vector, got shape {x.shape}")
    d = x.shape[0]
    dp = padded_length(d, topology)
    xp = jnp.pad(x, (0, dp - d))
    return allreduce(xp, sum_scheme(), topology.stages).reshape(-1)[:d]


def allreduce_mean(x: jax.Array, topology) -> jax.Array:
    """``allreduce_sum(x) / M`` for float vectors (the PSGD aggregation)."""
    if not jnp.issubdtype(x.dtype, jnp.floating):
        raise TypeError(f"allreduce_mean takes floats, got {x.dtype}; use allreduce_sum for integers")
    return allreduce_sum(x, topology) / jnp.asarray(topology.size, x.dtype)


def all_gather_workers(msg: Any, topology) -> Any:
    """Every worker's ``msg``, stacked in worker order (leading axis ``M``), via ring all-gathers."""
    out = msg
    for axis, n in topology.stages:
        out = ring_all_gather(out, axis=axis, n=n)
    # Gathering stage 0 first, then stage 1, nests as (n_1, n_0, ...): the stages reversed, which for
    # Ring and Torus is the mesh's axis order, so the flattened index is the row-major worker index.
    lead = len(topology.stages)
    if tuple(a for a, _ in reversed(topology.stages)) != tuple(topology.axes):
        raise ValueError(f"topology {topology}: its stages reversed must be its mesh axes {topology.axes}")
    return jax.tree_util.tree_map(lambda a: a.reshape((topology.size,) + a.shape[lead:]), out)
