"""Parallel multi-ring all-reduce across clusters (Ravnest §3.2).

The cut points of every cluster split the flat parameter vector into segments; on each segment one
node of every cluster holds the parameters, and those nodes average it in a ring (reduce-scatter,
a float32 division, all-gather) that gives every member the same bits. :func:`plan_rings` plans
the rings, :func:`average_node` runs a node's rings at once; the algorithm is described in the
docs (``docs/systems/ravnest.md``, "Multi-ring all-reduce").
"""

from __future__ import annotations

import argparse
import itertools
import json
import threading
import time
from collections import Counter
from collections.abc import Callable, Hashable, Mapping, Sequence
from typing import NamedTuple, Protocol

import numpy as np

from zeroth.stages import partition as _partition

__all__ = [
    "Ring",
    "plan_rings",
    "ring_allreduce_local",
    "ordered_mean",
    "ring_bytes",
    "ring_seconds",
]

DTYPE = np.float32
REDUCE = "reduce"
GATHER = "gather"


class Ring(NamedTuple):
    """One ring: the flat index range ``[start, stop)`` and who averages it.

    ``members[c]`` is the index, within cluster ``c``, of the node holding the range; one member
    per cluster, in cluster order (the ring's order: ``c`` sends to ``c+1 mod C``).
    """

    ring_id: int
    start: int
    stop: int
    members: tuple[int, ...]

    @property
    def size(self) -> int:
        return self.stop - self.start


# ----------------------------------------------------------------------------------------------
# Planning


def _check_layout(c: int, layout: Sequence[tuple[int, int]]) -> int:
    """Check that cluster ``c``'s node ranges tile ``[0, N)`` in node order; return ``N``."""
    if len(layout) == 0:
        raise ValueError(f"cluster {c} has no nodes; every cluster needs at least one node range")
    expect = 0
    for i, rng in enumerate(layout):
        start, stop = (int(v) for v in rng)
        if start != expect or stop < start:
            raise ValueError(
                f"cluster {c} node {i} holds [{start}, {stop}); node ranges must tile [0, N) contiguously "
                f"in node order, so this one should start at {expect} and stop at or after it"
            )
        expect = stop
    return expect


def plan_rings(layouts: Sequence[Sequence[tuple[int, int]]]) -> list[Ring]:
    """The rings of ``C = len(layouts)`` clusters: one per segment between the union of cut points.

    Args:
      layouts: ``layouts[c][i] = (start, stop)``, node ``i`` of cluster ``c``; each cluster's
        ranges tile ``[0, N)`` in node order (empty ranges allowed: such a node joins no ring).

    Returns:
      Rings in order of ``start``, ids ``0, 1, ...``, tiling ``[0, N)``. Adjacent rings always
      differ in at least one member (each cut point is a change of node in some cluster), so
      no two could be merged: the number of rings is minimal.

    Raises:
      ValueError: a cluster's ranges do not tile ``[0, N)``, or clusters disagree on ``N``.
    """
    if len(layouts) == 0:
        raise ValueError("plan_rings needs at least one cluster layout, got none")
    sizes = [_check_layout(c, layout) for c, layout in enumerate(layouts)]
    n = sizes[0]
    for c, size in enumerate(sizes):
        if size != n:
            raise ValueError(
                f"cluster {c} covers [0, {size}) but cluster 0 covers [0, {n}); every cluster holds the whole model"
            )
    cuts = sorted({0, n} | {int(stop) for layout in layouts for _, stop in layout})
    # Per cluster, the node whose (non-empty) range contains each segment: walk the cuts once.
    rings: list[Ring] = []
    cursor = [0] * len(layouts)
    for start, stop in itertools.pairwise(cuts):
        members = []
        for c, layout in enumerate(layouts):
            while int(layout[cursor[c]][1]) <= start:
                cursor[c] += 1
            members.append(cursor[c])
        rings.append(Ring(len(rings), start, stop, tuple(members)))
    return rings


def single_ring(n: int, clusters: int) -> list[Ring]:
    """One ring over the whole model (one node per cluster holds ``[0, n)``): the baseline of §3.2."""
    return plan_rings([[(0, n)]] * clusters)


def rings_of(rings: Sequence[Ring], cluster: int, node: int) -> list[Ring]:
    """The rings node ``node`` of cluster ``cluster`` takes part in, in order of ``start``."""
    return [r for r in rings if r.members[cluster] == node]


def chunk_bounds(n: int, parts: int) -> list[tuple[int, int]]:
    """``[0, n)`` split into ``parts`` contiguous chunks whose sizes differ by at most one.

    The first ``n mod parts`` chunks get one more element; when ``n < parts`` the last
    ``parts - n`` chunks are empty. ``chunk_bounds(7, 3) == [(0, 3), (3, 5), (5, 7)]``.
    """
    if parts < 1 or n < 0:
        raise ValueError(f"chunk_bounds needs n >= 0 and parts >= 1, got n={n}, parts={parts}")
    return _partition.even_split(n, parts)


# ----------------------------------------------------------------------------------------------
# The arithmetic of one ring


def summation_order(chunk: int, C: int) -> list[int]:
    """The members in the order the ring sums chunk ``chunk``: ``chunk+1, chunk+2, .., chunk`` (mod C)."""
    return [(chunk + 1 + i) % C for i in range(C)]


def _as_f32(x, what: str) -> np.ndarray:
    a = np.asarray(x)
    if a.dtype != DTYPE or a.ndim != 1:
        raise ValueError(f"{what} must be a 1-D float32 array, got dtype {a.dtype} and shape {a.shape}")
    return a


def ordered_mean(values: Sequence[np.ndarray], order: Sequence[int]) -> np.ndarray:
    """``(((v[o0] + v[o1]) + v[o2]) + ...) / C`` in float32, ``C = len(values)``, ``o = order``.

    Args:
      values: ``C`` float32 arrays of one shape.
      order: a permutation of ``range(C)``.
    """
    C = len(values)
    if sorted(order) != list(range(C)):
        raise ValueError(f"order must be a permutation of range({C}), got {list(order)}")
    vs = [_as_f32(v, f"values[{k}]") for k, v in enumerate(values)]
    acc = vs[order[0]].copy()
    for k in order[1:]:
        acc = np.add(acc, vs[k])
    return np.divide(acc, DTYPE(C))


def ring_allreduce_local(values: Sequence[np.ndarray]) -> list[np.ndarray]:
    """The whole ring in one process, step by step as the members run it; one result per member.

    Args:
      values: ``C`` float32 arrays of one length ``n`` (the ring's segment on each member).

    Returns:
      ``C`` arrays, bit-identical, equal to ``ordered_mean(values, summation_order(j, C))`` on
      chunk ``j`` of :func:`chunk_bounds`.
    """
    C = len(values)
    if C == 0:
        raise ValueError("ring_allreduce_local needs at least one member, got none")
    vs = [_as_f32(v, f"values[{k}]") for k, v in enumerate(values)]
    n = vs[0].shape[0]
    for k, v in enumerate(vs):
        if v.shape[0] != n:
            raise ValueError(
                f"values[{k}] has length {v.shape[0]}, values[0] has {n}; a ring's members hold one segment"
            )
    bounds = chunk_bounds(n, C)
    acc = [[v[a:b].copy() for a, b in bounds] for v in vs]  # acc[k][j]: member k's chunk j
    for s in range(C - 1):
        sent = [acc[k][(k - s - 1) % C] for k in range(C)]
        for k in range(C):
            j = (k - s - 2) % C
            acc[k][j] = np.add(sent[(k - 1) % C], acc[k][j])
    out = [[None] * C for _ in range(C)]
    for k in range(C):
        out[k][k] = np.divide(acc[k][k], DTYPE(C))
    for s in range(C - 1):
        sent = [out[k][(k - s) % C] for k in range(C)]
        for k in range(C):
            out[k][(k - s - 1) % C] = sent[(k - 1) % C]
    return [np.concatenate(chunks).astype(DTYPE, copy=False) for chunks in out]


# ----------------------------------------------------------------------------------------------
# Over a message exchange


class Exchange(Protocol):
    """How ring members talk; peers are addressed as ``(cluster, node)`` (or what ``peer_of`` gives).

    ``send`` returns without waiting for the peer (or as paced by the transport's bandwidth);
    ``recv`` blocks until the message with ``tag`` from ``peer`` arrives and raises
    ``TimeoutError`` after ``timeout_s`` seconds.
    """

    def send(self, peer: Hashable, tag: tuple, array: np.ndarray) -> None: ...

    def recv(self, peer: Hashable, tag: tuple, timeout_s: float) -> np.ndarray: ...


def _recv_chunk(exchange: Exchange, peer, tag: tuple, size: int, timeout_s: float) -> np.ndarray:
    try:
        got = exchange.recv(peer, tag, timeout_s)
    except TimeoutError as e:
        raise TimeoutError(f"no message {tag} from {peer} within {timeout_s} s") from e
    a = np.asarray(got)
    if a.dtype != DTYPE or a.shape != (size,):
        raise ValueError(
            f"message {tag} from {peer} has dtype {a.dtype} and shape {a.shape}; expected float32 of shape ({size},)"
        )
    return a


def ring_member(
    ring: Ring,
    cluster: int,
    values_segment: np.ndarray,
    exchange: Exchange,
    *,
    round_id: int,
    timeout_s: float,
    peer_of: Callable[[int], Hashable] | None = None,
) -> np.ndarray:
    """Cluster ``cluster``'s part of ``ring`` in averaging round ``round_id``; returns its averaged segment.

    Args:
      ring: the ring (:func:`plan_rings`).
      cluster: this member's cluster ``k`` (its position in the ring).
      values_segment: ``float32[ring.size]``, this member's parameters on ``[ring.start, ring.stop)``.
      exchange: the transport.
      round_id: the averaging round (a tag field: rounds never mix).
      timeout_s: the bound on each wait for a message.
      peer_of: cluster index -> the address of that cluster's member of this ring; defaults to
        ``(c, ring.members[c])``.

    Returns:
      ``float32[ring.size]``: the ring's average, bit-identical on every member and equal to
      :func:`ring_allreduce_local` of the members' segments.

    Raises:
      TimeoutError: a message did not arrive within ``timeout_s``.
      ValueError: a message of the wrong dtype or length.
    """
    C = len(ring.members)
    v = _as_f32(values_segment, "values_segment")
    if v.shape[0] != ring.size:
        raise ValueError(
            f"ring {ring.ring_id} covers [{ring.start}, {ring.stop}), values_segment has length {v.shape[0]}"
        )
    if not 0 <= cluster < C:
        raise ValueError(f"cluster {cluster} is not in ring {ring.ring_id} of {C} clusters")
    if C == 1:
        return np.divide(v, DTYPE(1))
    addr = peer_of if peer_of is not None else (lambda c: (c, ring.members[c]))
    k = cluster
    succ, pred = addr((k + 1) % C), addr((k - 1) % C)
    bounds = chunk_bounds(ring.size, C)
    sizes = [b - a for a, b in bounds]
    acc = [v[a:b].copy() for a, b in bounds]
    for s in range(C - 1):
        exchange.send(succ, (ring.ring_id, round_id, REDUCE, s), acc[(k - s - 1) % C])
        j = (k - s - 2) % C
        got = _recv_chunk(exchange, pred, (ring.ring_id, round_id, REDUCE, s), sizes[j], timeout_s)
        acc[j] = np.add(got, acc[j])
    out: list[np.ndarray | None] = [None] * C
    out[k] = np.divide(acc[k], DTYPE(C))
    for s in range(C - 1):
        exchange.send(succ, (ring.ring_id, round_id, GATHER, s), out[(k - s) % C])
        j = (k - s - 1) % C
        out[j] = _recv_chunk(exchange, pred, (ring.ring_id, round_id, GATHER, s), sizes[j], timeout_s)
    return np.concatenate(out).astype(DTYPE, copy=False)


def average_node(
    flat_part: np.ndarray,
    part_start: int,
    rings: Sequence[Ring],
    cluster: int,
    node: int,
    exchange: Exchange,
    *,
    round_id: int,
    timeout_s: float,
    peer_of: Callable[[int, int], Hashable] | None = None,
) -> np.ndarray:
    """Node ``node`` of cluster ``cluster`` averages its slice: all its rings at once, one thread each.

    Args:
      flat_part: ``float32[L]``, the node's parameters ``[part_start, part_start + L)`` of the flat
        vector; must be exactly the union of the node's rings (its stage).
      part_start: where the slice starts in the flat vector.
      rings: all rings (:func:`plan_rings`).
      cluster, node: who this is.
      exchange: the transport, as this node.
      round_id: the averaging round.
      timeout_s: the bound on each wait for a message; a ring takes at most ``2 (C-1)`` waits.
      peer_of: ``(cluster, node) -> address``; defaults to the tuple itself.

    Returns:
      ``float32[L]``: the averaged slice (a new array).

    Raises:
      After every ring has ended (or outlived its bound): the error of the lowest failed ring id
      (``TimeoutError``, ``ValueError``, ...), with the other failed rings' errors attached as notes.
    """
    x = _as_f32(flat_part, "flat_part")
    mine = rings_of(rings, cluster, node)
    lo, hi = part_start, part_start + x.shape[0]
    span = (mine[0].start, mine[-1].stop) if mine else (lo, lo)
    if (lo, hi) != span or sum(r.size for r in mine) != x.shape[0]:
        raise ValueError(
            f"cluster {cluster} node {node} holds [{span[0]}, {span[1]}) in the rings, "
            f"but flat_part covers [{lo}, {hi}); pass exactly the node's stage"
        )
    out = x.copy()
    if not mine:
        return out
    addr = peer_of if peer_of is not None else (lambda c, i: (c, i))
    results: dict[int, np.ndarray] = {}
    errors: list[tuple[int, BaseException]] = []

    def run(r: Ring) -> None:
        try:
            results[r.ring_id] = ring_member(
                r,
                cluster,
                x[r.start - lo : r.stop - lo],
                exchange,
                round_id=round_id,
                timeout_s=timeout_s,
                peer_of=lambda c, r=r: addr(c, r.members[c]),
            )
        except BaseException as e:  # noqa: BLE001 - handed to the caller below
            errors.append((r.ring_id, e))

    threads = [threading.Thread(target=run, args=(r,), name=f"ring-{r.ring_id}", daemon=True) for r in mine]
    for t in threads:
        t.start()
    # Each ring waits at most 2 (C-1) times; the margin covers the local arithmetic and sends.
    deadline = time.monotonic() + 2 * len(rings[0].members) * timeout_s + 5.0
    for r, t in zip(mine, threads):
        t.join(max(0.0, deadline - time.monotonic()))
        if t.is_alive():
            errors.append(
                (r.ring_id, TimeoutError(f"ring {r.ring_id} still running after its bound (a send blocked?)"))
            )
    if errors:
        failed = sorted(list(errors), key=lambda e: e[0])
        first = failed[0][1]
        for rid, e in failed[1:]:
            first.add_note(f"ring {rid} also failed: {type(e).__name__}: {e}")
        raise first
    for r in mine:
        out[r.start - lo : r.stop - lo] = results[r.ring_id]
    return out


# ----------------------------------------------------------------------------------------------
# In-process transport


class QueueExchange:
    """In-process mailboxes keyed by ``(src, dst, tag)``: the hub; :meth:`endpoint` is one peer's Exchange.

    ``bytes_sent[(src, dst)]`` counts the payload bytes (``array.nbytes``) sent from ``src`` to ``dst``.
    A second message with the same ``(src, dst, tag)`` before the first was received is an error.
    """

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._box: dict[tuple, np.ndarray] = {}
        self.bytes_sent: Counter = Counter()

    def endpoint(self, me: Hashable) -> QueueEndpoint:
        """The :class:`Exchange` of peer ``me``."""
        return QueueEndpoint(self, me)

    def put(self, src: Hashable, dst: Hashable, tag: tuple, array: np.ndarray) -> None:
        """Deliver a copy of ``array`` from ``src`` to ``dst`` under ``tag``."""
        a = np.array(array, copy=True)
        key = (src, dst, tuple(tag))
        with self._cond:
            if key in self._box:
                raise ValueError(f"message {tag} from {src} to {dst} sent twice before it was received")
            self._box[key] = a
            self.bytes_sent[(src, dst)] += a.nbytes
            self._cond.notify_all()

    def take(self, src: Hashable, dst: Hashable, tag: tuple, timeout_s: float) -> np.ndarray:
        """Wait up to ``timeout_s`` for the message; raises ``TimeoutError``."""
        key = (src, dst, tuple(tag))
        with self._cond:
            if not self._cond.wait_for(lambda: key in self._box, timeout=timeout_s):
                raise TimeoutError(f"no message {tag} from {src} to {dst} within {timeout_s} s")
            return self._box.pop(key)

    def pending(self) -> list[tuple]:
        """The ``(src, dst, tag)`` of messages sent and not yet received."""
        with self._cond:
            return sorted(self._box, key=repr)


class QueueEndpoint(NamedTuple):
    """Peer ``me``'s :class:`Exchange` over a :class:`QueueExchange`."""

    hub: QueueExchange
    me: Hashable

    def send(self, peer: Hashable, tag: tuple, array: np.ndarray) -> None:
        self.hub.put(self.me, peer, tag, array)

    def recv(self, peer: Hashable, tag: tuple, timeout_s: float) -> np.ndarray:
        return self.hub.take(peer, self.me, tag, timeout_s)


# ----------------------------------------------------------------------------------------------
# Cost model


def pair_bytes(rings: Sequence[Ring], C: int, *, itemsize: int = 4) -> dict[tuple, int]:
    """Payload bytes each ``(src, dst)`` pair carries in one averaging, peers as ``(cluster, node)``.

    Member ``k`` of a ring sends every chunk but ``k`` (reduce-scatter) and every chunk but
    ``k+1`` (all-gather) to member ``k+1``: ``2 n - |chunk k| - |chunk k+1|`` items, about
    ``2 (C-1)/C`` of the segment's ``n``.
    """
    out: Counter = Counter()
    if C < 2:
        return dict(out)
    for r in rings:
        sizes = [b - a for a, b in chunk_bounds(r.size, C)]
        for k in range(C):
            nxt = (k + 1) % C
            items = 2 * r.size - sizes[k] - sizes[nxt]
            out[((k, r.members[k]), (nxt, r.members[nxt]))] += items * itemsize
    return dict(out)


def ring_bytes(rings: Sequence[Ring], C: int, *, itemsize: int = 4) -> dict[tuple[int, int], int]:
    """Payload bytes each node ``(cluster, node)`` sends in one averaging (all its rings)."""
    out: Counter = Counter()
    for (src, _), b in pair_bytes(rings, C, itemsize=itemsize).items():
        out[src] += b
    return dict(out)


def ring_seconds(
    rings: Sequence[Ring],
    C: int,
    bytes_per_s: float | Callable[[tuple, tuple], float] | Mapping[tuple, float],
    *,
    latency_s: float = 0.0,
    itemsize: int = 4,
) -> float:
    """An estimate of one averaging's wall time: the busiest link plus the rounds' latency.

    ``max over (src, dst) of pair_bytes / bytes_per_s(src, dst) + 2 (C-1) latency_s``: rings run
    at once, links between different pairs do not contend, rings sharing a pair share its
    bandwidth, and each ring's ``2 (C-1)`` steps each pay one latency. ``bytes_per_s`` is one
    number for every pair, a mapping ``{(src, dst): B/s}``, or a function ``(src, dst) -> B/s``.
    """
    if C < 2:
        return 0.0
    if callable(bytes_per_s):
        bw = bytes_per_s
    elif isinstance(bytes_per_s, Mapping):
        bw = lambda s, d: bytes_per_s[(s, d)]
    else:
        bw = lambda s, d: float(bytes_per_s)
    busiest = max((b / bw(s, d) for (s, d), b in pair_bytes(rings, C, itemsize=itemsize).items()), default=0.0)
    return busiest + 2 * (C - 1) * latency_s


# ----------------------------------------------------------------------------------------------
# The multi-ring vs one-ring comparison (``python -m zeroth.cluster.rings``)

# Per cluster, the nodes' relative memory: stages are cut in proportion (non-uniform layouts).
EXAMPLE_MEMORY = ((4, 8), (2, 4, 6), (8, 4, 4), (3, 3, 6, 4))


def proportional_layout(n: int, weights: Sequence[float]) -> list[tuple[int, int]]:
    """``[0, n)`` cut into contiguous ranges in proportion to ``weights`` (cut ``i`` at ``round(n W_i / W)``)."""
    total = float(sum(weights))
    cuts, acc = [0], 0.0
    for w in weights:
        acc += w
        cuts.append(round(n * acc / total))
    cuts[-1] = n
    return list(itertools.pairwise(cuts))


def cost_table(n: int, clusters: Sequence[int], bytes_per_s: float, *, latency_s: float = 0.0) -> list[dict]:
    """Multi-ring vs one ring over the whole model, for ``C`` clusters of :data:`EXAMPLE_MEMORY` layouts.

    Per ``C``: the number of rings, the largest and total bytes a node sends per averaging, and
    the estimated seconds with every pair its own link of ``bytes_per_s`` (:func:`ring_seconds`)
    and with every node's links sharing one uplink of ``bytes_per_s`` (its bytes / bandwidth,
    plus the same latency), for the multi-ring plan and for :func:`single_ring`.
    """
    rows = []
    for C in clusters:
        if not 1 <= C <= len(EXAMPLE_MEMORY):
            raise ValueError(f"clusters must be in 1..{len(EXAMPLE_MEMORY)}, got {C}")
        rings = plan_rings([proportional_layout(n, EXAMPLE_MEMORY[c]) for c in range(C)])
        one = single_ring(n, C)
        row = {"clusters": C, "n": n, "rings": len(rings)}
        for name, plan in (("multi", rings), ("one", one)):
            per_node = ring_bytes(plan, C)
            lat = 2 * (C - 1) * latency_s if C > 1 else 0.0
            row[f"{name}_max_node_bytes"] = max(per_node.values(), default=0)
            row[f"{name}_total_bytes"] = sum(per_node.values())
            row[f"{name}_s_pair_links"] = ring_seconds(plan, C, bytes_per_s, latency_s=latency_s)
            row[f"{name}_s_node_uplink"] = max(per_node.values(), default=0) / bytes_per_s + lat
        rows.append(row)
    return rows


def main(argv: Sequence[str] | None = None) -> None:
    """Print :func:`cost_table` as a table and one JSON line."""
    ap = argparse.ArgumentParser(prog="python -m zeroth.cluster.rings", description=cost_table.__doc__)
    ap.add_argument("--n", type=int, default=1_000_000, help="parameters (float32) in the model")
    ap.add_argument("--clusters", type=int, nargs="+", default=[2, 3, 4])
    ap.add_argument("--mbit", type=float, default=100.0, help="link bandwidth, Mbit/s")
    ap.add_argument("--latency-ms", type=float, default=0.0, help="latency per ring step, ms")
    a = ap.parse_args(argv)
    rows = cost_table(a.n, a.clusters, a.mbit * 1e6 / 8, latency_s=a.latency_ms / 1e3)
    print(f"n={a.n} float32, {a.mbit:g} Mbit/s, {a.latency_ms:g} ms per step")
    print(
        "C  rings  max bytes/node (multi | one)  total bytes (multi | one)  s pair links (multi | one)  s node uplink (multi | one)"
    )
    for r in rows:
        print(
            f"{r['clusters']}  {r['rings']:5d}  {r['multi_max_node_bytes']:12d} | {r['one_max_node_bytes']:<12d}"
            f"  {r['multi_total_bytes']:11d} | {r['one_total_bytes']:<11d}"
            f"  {r['multi_s_pair_links']:11.4f} | {r['one_s_pair_links']:<11.4f}"
            f"  {r['multi_s_node_uplink']:11.4f} | {r['one_s_node_uplink']:.4f}"
        )
    print(json.dumps(rows))


if __name__ == "__main__":
    main()
