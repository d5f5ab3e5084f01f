"""Cluster formation (Ravnest §3.5.2): nodes grouped into clusters by a genetic algorithm.

A pool of ``n`` nodes ``N_i = (ram_i, bw_i)`` (usable RAM in bytes, steady bandwidth in bits/s,
plus a relative compute speed) is cut into ``k`` clusters. A chromosome is an assignment
``c ∈ {0..k-1}^n`` (node ``i`` joins cluster ``c_i``). Each cluster runs a whole copy of the model
as a pipeline, so it must hold the model's peak memory ``M`` (eq. 16, :func:`peak_memory_bytes`):

* constraint 1: ``R_c = Σ_{i: c_i = c} ram_i ≥ M`` for every cluster ``c``;
* constraint 2: the clusters' sums of transfer times ``T_c = Σ_{i: c_i = c} t_i``, with
  ``t_i = 8 · message_bytes / bw_i`` (:func:`transfer_seconds`), are as equal as possible:
  minimise the spread ``max_c T_c − min_c T_c``.

:func:`fitness` turns both into one penalty fitness (lower is better); :func:`form_clusters` is
the genetic algorithm, :func:`brute_force` the exact optimum of small pools, :func:`greedy` the
baseline. Inside a cluster, :func:`split_layers` cuts the model into contiguous stages in
proportion to each node's RAM (:func:`plan_stages` does it for every cluster of a formation);
``max_cluster_nodes`` keeps clusters no larger than the model has layer units. Everything is
NumPy and deterministic: the only randomness is ``np.random.default_rng(seed)``, and answers are
canonical (cluster labels are symmetric, so a partition is reported with its clusters sorted by
their first node).

Beyond the seed's description (which names a penalty fitness, selection, crossover, mutation and
tracking the best individual): the fitness puts every feasible assignment before every infeasible
one, parents' labels are aligned before crossover, clones are replaced by random chromosomes, and
the best individual is improved by steepest descent (a memetic step, ``polish``). A node's
compute ``speed`` (measured by :func:`calibrate` or declared) is carried for the pipelines and
reports; the seed's fitness, and this one, use RAM and bandwidth only.

Example::

    >>> nodes = [Node("a", 8e9, 1e8), Node("b", 4e9, 5e8), Node("c", 8e9, 2e8), Node("d", 4e9, 1e9)]
    >>> f = form_clusters(nodes, 2, peak_bytes=10e9, message_bytes=1e6, seed=0)
    >>> f.clusters
    ((0, 3), (1, 2))
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import NamedTuple

import numpy as np

__all__ = [
    "Formation",
    "Node",
    "Stage",
    "InfeasibleError",
    "form_clusters",
    "plan_stages",
    "describe",
]

BRUTE_FORCE_MAX_NODES = 12
""":func:`brute_force` refuses larger pools (``k^(n-1)`` assignments are enumerated)."""

CALIBRATION_SIZE = 128
"""One calibration work unit: a ``128 × 128 @ 128 × 128`` float32 matmul (``2·128³`` flops)."""


class Node(NamedTuple):
    """One compute node of the pool.

    Attributes:
      name: unique name (a host, a process).
      ram_bytes: usable RAM, bytes (> 0).
      bandwidth_bps: steady bandwidth, bits per second (> 0).
      speed: relative compute speed, examples per second relative to a reference (> 0; 2.0 is
        twice as fast). :func:`calibrate` measures it in work units per second; a pool compares
        speeds with each other only, so all of a pool's speeds must be on one scale.
    """

    name: str
    ram_bytes: float
    bandwidth_bps: float
    speed: float = 1.0


class Formation(NamedTuple):
    """A pool cut into clusters, in canonical form.

    Attributes:
      clusters: node indices per cluster, each sorted, clusters sorted by their first index.
      assignment: the canonical chromosome: ``assignment[i]`` is the cluster of node ``i``.
      fitness: :func:`fitness` of the assignment (lower is better; the spread when feasible).
      spread_s: ``max_c T_c − min_c T_c``, seconds.
      ram_bytes: ``R_c`` per cluster, bytes.
      transfer_s: ``T_c`` per cluster, seconds.
      peak_bytes: the peak memory ``M`` every cluster must hold.
      generations: generations run (0 for :func:`brute_force` and :func:`greedy`).
      evaluations: fitness evaluations spent.
      method: ``"ga"``, ``"brute_force"`` or ``"greedy"``.
    """

    clusters: tuple[tuple[int, ...], ...]
    assignment: tuple[int, ...]
    fitness: float
    spread_s: float
    ram_bytes: tuple[float, ...]
    transfer_s: tuple[float, ...]
    peak_bytes: float
    generations: int
    evaluations: int
    method: str


class InfeasibleError(ValueError):
    """No assignment gives every cluster the peak memory (the message names the shortfall)."""


# --------------------------------------------------------------------------- inputs


def check_nodes(nodes: Sequence[Node]) -> None:
    """Validate a pool: at least one node, names unique non-empty strings, RAM, bandwidth and speed
    finite and > 0.

    Raises:
      ValueError: naming the node and the bad value.
      TypeError: an entry that is not a :class:`Node`.
    """
    if len(nodes) == 0:
        raise ValueError("the node pool is empty: describe at least one node (name, ram_bytes, bandwidth_bps, speed)")
    seen: dict[str, int] = {}
    for i, node in enumerate(nodes):
        if not isinstance(node, Node):
            raise TypeError(f"node {i} is {node!r}, not a Node(name, ram_bytes, bandwidth_bps, speed)")
        if not isinstance(node.name, str) or not node.name:
            raise ValueError(f"node {i} has name {node.name!r}: a node needs a non-empty string name")
        if node.name in seen:
            raise ValueError(
                f"node name {node.name!r} is used by nodes {seen[node.name]} and {i}: names must be unique"
            )
        seen[node.name] = i
        for field in ("ram_bytes", "bandwidth_bps", "speed"):
            value = getattr(node, field)
            try:
                ok = bool(np.isfinite(value)) and value > 0
            except TypeError:
                ok = False
            if not ok:
                raise ValueError(f"node {node.name!r} has {field}={value!r}: it must be a finite number > 0")


def peak_memory_bytes(param_bytes: int, activation_bytes: int, optimizer_slots: int = 2) -> int:
    """The model's peak training memory (eq. 16): ``M = P · (1 + s + 1) + A``.

    ``P`` bytes of parameters, ``s`` optimizer slots of the parameters' size (AdamW keeps the two
    moments: ``s = 2``; SGD ``s = 0``), one gradient of the parameters' size, and ``A`` bytes of
    one batch's forward/backward activations (the forward/backward pass size, a good
    approximation of the memory that processing one batch takes).

    Example: ``peak_memory_bytes(4_000, 1_000) == 17_000``.

    Raises:
      ValueError: a negative size or slot count.
    """
    for name, value in (
        ("param_bytes", param_bytes),
        ("activation_bytes", activation_bytes),
        ("optimizer_slots", optimizer_slots),
    ):
        if int(value) != value or value < 0:
            raise ValueError(f"{name}={value!r}: it must be a whole number >= 0")
    return int(param_bytes) * (2 + int(optimizer_slots)) + int(activation_bytes)


def transfer_seconds(node: Node, message_bytes: float) -> float:
    """A node's time to move one message: ``t = 8 · message_bytes / bandwidth_bps`` seconds."""
    return 8.0 * float(message_bytes) / float(node.bandwidth_bps)


def _fmt_bytes(value: float) -> str:
    """``1.5e9 -> "1.50 GB"``: decimal units, two decimals below 10, one above."""
    for unit, scale in (("TB", 1e12), ("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if abs(value) >= scale:
            v = value / scale
            return f"{v:.1f} {unit}" if abs(v) >= 10 else f"{v:.2f} {unit}"
    return f"{value:.0f} B"


class _Problem(NamedTuple):
    ram: np.ndarray  # shape=(n,), float64: usable RAM, bytes
    t: np.ndarray  # shape=(n,), float64: transfer seconds per node
    k: int
    peak: float
    penalty: float
    names: tuple[str, ...]
    max_nodes: int  # at most this many nodes per cluster (n: no limit)


def _problem(
    nodes: Sequence[Node],
    n_clusters: int,
    peak_bytes: float,
    message_bytes: float,
    penalty: float | None,
    max_cluster_nodes: int | None,
    *,
    feasible: bool = True,
) -> _Problem:
    """Validate the inputs; with ``feasible``, check the necessary conditions ``k ≤ n``,
    ``n ≤ k · max_cluster_nodes`` and ``Σ ram ≥ k · M``."""
    check_nodes(nodes)
    if int(n_clusters) != n_clusters or n_clusters < 1:
        raise ValueError(f"n_clusters={n_clusters!r}: it must be a whole number >= 1")
    k, n = int(n_clusters), len(nodes)
    for name, value in (("peak_bytes", peak_bytes), ("message_bytes", message_bytes)):
        if not (np.isfinite(value) and value > 0):
            raise ValueError(f"{name}={value!r}: it must be a finite number > 0")
    if feasible and k > n:
        raise InfeasibleError(
            f"cannot form {k} clusters from {n} nodes: every cluster needs at least one node; add nodes or use at most {n} clusters"
        )
    if max_cluster_nodes is None:
        max_nodes = n
    elif int(max_cluster_nodes) != max_cluster_nodes or max_cluster_nodes < 1:
        raise ValueError(f"max_cluster_nodes={max_cluster_nodes!r}: it must be a whole number >= 1 (or None: no limit)")
    else:
        max_nodes = int(max_cluster_nodes)
    if feasible and n > k * max_nodes:
        raise InfeasibleError(
            f"{n} nodes do not fit in {k} clusters of at most {max_nodes} nodes (max_cluster_nodes): "
            f"use more clusters, a larger limit (finer layer units), or fewer nodes"
        )
    ram = np.array([float(x.ram_bytes) for x in nodes], dtype=np.float64)
    t = np.array([transfer_seconds(x, message_bytes) for x in nodes], dtype=np.float64)
    total = float(ram.sum())
    if feasible and total < k * peak_bytes:
        raise InfeasibleError(
            f"the pool's RAM ({_fmt_bytes(total)} over {n} nodes) cannot hold {k} clusters of {_fmt_bytes(peak_bytes)} peak memory: "
            f"{_fmt_bytes(k * peak_bytes - total)} short; add nodes or use fewer clusters"
        )
    if penalty is None:
        penalty = float(t.sum())
    elif not (np.isfinite(penalty) and penalty > 0):
        raise ValueError(f"penalty={penalty!r}: it must be a finite number of seconds > 0")
    return _Problem(ram, t, k, float(peak_bytes), float(penalty), tuple(x.name for x in nodes), max_nodes)


# --------------------------------------------------------------------------- fitness


def _cluster_sums(a: np.ndarray, w: np.ndarray, k: int) -> np.ndarray:
    """``out[p, c] = Σ_{i: a[p, i] = c} w[i]``; a int[P, n] -> float64[P, k] (sums in node order)."""
    p = a.shape[0]
    idx = (a + k * np.arange(p, dtype=np.int64)[:, None]).ravel()
    return np.bincount(idx, weights=np.broadcast_to(w, a.shape).ravel(), minlength=p * k).reshape(p, k)


def _fitness(a: np.ndarray, pr: _Problem) -> np.ndarray:
    """The penalty fitness of int[P, n] assignments -> float64[P] (see :func:`fitness`)."""
    T = _cluster_sums(a, pr.t, pr.k)
    R = _cluster_sums(a, pr.ram, pr.k)
    spread = T.max(axis=1) - T.min(axis=1)
    short = np.maximum(pr.peak - R, 0.0).sum(axis=1)
    size = _cluster_sums(a, np.ones_like(pr.t), pr.k)
    empty = (size == 0).sum(axis=1)
    over = np.maximum(size - pr.max_nodes, 0.0).sum(axis=1)
    infeasible = (short > 0) | (empty > 0) | (over > 0)
    return spread + np.where(infeasible, pr.t.sum() + pr.penalty * (short / pr.peak + empty + over), 0.0)


def fitness(
    assignment,
    nodes: Sequence[Node],
    n_clusters: int,
    peak_bytes: float,
    message_bytes: float,
    penalty: float | None = None,
    max_cluster_nodes: int | None = None,
):
    """The penalty fitness of assignments, lower is better.

    With ``T_c`` and ``R_c`` the cluster sums of transfer times and RAM (module docstring),
    ``S = Σ_i t_i``, ``short = Σ_c max(0, M − R_c)``, ``E`` the number of empty clusters and
    ``O = Σ_c max(0, |c| − max_cluster_nodes)`` the nodes beyond the limit::

        f(c) = max_c T_c − min_c T_c                                       if feasible (short = E = O = 0)
        f(c) = max_c T_c − min_c T_c + S + penalty · (short / M + E + O)   otherwise

    The barrier ``S`` exceeds any feasible spread, so every feasible assignment beats every
    infeasible one; beyond it each byte short costs ``penalty / M`` seconds and each empty cluster
    or extra node ``penalty`` seconds (default ``penalty = S``), which steers the search towards
    feasibility. ``max_cluster_nodes`` (default: no limit) keeps every node's share of the model at
    one layer unit or more (:func:`split_layers`): at most the number of units.

    Args:
      assignment: int[n] or int[P, n], values in ``0..n_clusters-1``.
      nodes, n_clusters, peak_bytes, message_bytes: the problem (:func:`form_clusters`).
      penalty: seconds per peak-sized shortfall, per empty cluster, per extra node (> 0; default ``S``).
      max_cluster_nodes: at most this many nodes per cluster (None: no limit).

    Returns:
      a float for int[n], float64[P] for int[P, n].
    """
    pr = _problem(nodes, n_clusters, peak_bytes, message_bytes, penalty, max_cluster_nodes, feasible=False)
    a = np.asarray(assignment)
    single = a.ndim == 1
    a2 = a[None, :] if single else a
    if a2.ndim != 2 or a2.shape[1] != len(nodes):
        raise ValueError(f"assignment has shape {a.shape}: expected ({len(nodes)},) or (P, {len(nodes)})")
    if not np.issubdtype(a2.dtype, np.integer) or (a2.size and (a2.min() < 0 or a2.max() >= pr.k)):
        raise ValueError(f"assignment values must be integers in 0..{pr.k - 1}")
    out = _fitness(a2.astype(np.int64), pr)
    return float(out[0]) if single else out


def canonical(a: np.ndarray) -> np.ndarray:
    """Relabel assignments so clusters are numbered in the order of their first node.

    int[P, n] -> int64[P, n] (or int[n] -> int64[n]); ``canonical([2, 2, 0, 1]) == [0, 0, 1, 2]``.
    Two assignments describe the same partition iff their canonical forms are equal.
    """
    arr = np.asarray(a, dtype=np.int64)
    single = arr.ndim == 1
    a2 = arr[None, :] if single else arr
    p, n = a2.shape
    k = int(a2.max()) + 1 if a2.size else 1
    # First position of every label in every row (n where absent); rank labels by it.
    first = np.full((p, k), n, dtype=np.int64)
    rows = np.repeat(np.arange(p), n)
    np.minimum.at(first, (rows, a2.ravel()), np.tile(np.arange(n), p))
    rank = np.argsort(np.argsort(first, axis=1, kind="stable"), axis=1, kind="stable")
    out = np.take_along_axis(rank, a2, axis=1)
    return out[0] if single else out


def _formation(a: np.ndarray, pr: _Problem, generations: int, evaluations: int, method: str) -> Formation:
    """A canonical :class:`Formation` of one assignment (fitness recomputed from the canonical form)."""
    c = canonical(a)
    k = pr.k
    T = _cluster_sums(c[None, :], pr.t, k)[0]
    R = _cluster_sums(c[None, :], pr.ram, k)[0]
    clusters = tuple(tuple(int(i) for i in np.flatnonzero(c == j)) for j in range(k))
    return Formation(
        clusters=clusters,
        assignment=tuple(int(x) for x in c),
        fitness=float(_fitness(c[None, :], pr)[0]),
        spread_s=float(T.max() - T.min()),
        ram_bytes=tuple(float(x) for x in R),
        transfer_s=tuple(float(x) for x in T),
        peak_bytes=pr.peak,
        generations=int(generations),
        evaluations=int(evaluations),
        method=method,
    )


def _short_clusters(a: np.ndarray, pr: _Problem) -> str:
    """``"cluster 1 (nodes a, b) has 2.20 GB of 2.50 GB (0.30 GB short)"`` for every short cluster
    (and ``"cluster 2 has 9 nodes, more than max_cluster_nodes=8"`` for every overfull one).
    Unassigned nodes (label -1) are left out."""
    a = np.asarray(a)
    c = np.full(a.shape, -1, dtype=np.int64)
    c[a >= 0] = canonical(a[a >= 0])
    parts = []
    for j in range(pr.k):
        members = np.flatnonzero(c == j)
        ram = float(pr.ram[members].sum())
        names = ", ".join(pr.names[i] for i in members) or "none"
        if ram < pr.peak:
            parts.append(
                f"cluster {j} (nodes {names}) has {_fmt_bytes(ram)} of {_fmt_bytes(pr.peak)} ({_fmt_bytes(pr.peak - ram)} short)"
            )
        if members.size > pr.max_nodes:
            parts.append(f"cluster {j} has {members.size} nodes, more than max_cluster_nodes={pr.max_nodes}")
    return "; ".join(parts)


# --------------------------------------------------------------------------- genetic algorithm


def _align(a: np.ndarray, b: np.ndarray, k: int) -> np.ndarray:
    """Relabel each row of ``b`` to agree with the same row of ``a`` as much as possible.

    Labels are symmetric, so two parents can describe similar partitions with different numbers;
    a uniform crossover of unaligned parents mixes unrelated clusters. The overlap counts
    ``O[p, x, y] = #{i: a[p,i] = x, b[p,i] = y}`` are matched greedily (largest overlap first).
    int[P, n], int[P, n] -> int[P, n].
    """
    p = a.shape[0]
    idx = (a * k + b + (k * k) * np.arange(p, dtype=np.int64)[:, None]).ravel()
    overlap = np.bincount(idx, minlength=p * k * k).reshape(p, k, k).astype(np.int64)
    perm = np.zeros((p, k), dtype=np.int64)
    rows = np.arange(p)
    for _ in range(k):
        flat = overlap.reshape(p, k * k).argmax(axis=1)
        x, y = flat // k, flat % k
        perm[rows, y] = x
        overlap[rows, x, :] = -1
        overlap[rows, :, y] = -1
    return np.take_along_axis(perm, b, axis=1)


def _neighbours(a: np.ndarray, pr: _Problem) -> np.ndarray:
    """Every single move (one node to another cluster) and every swap of two nodes of different
    clusters where one of them is in the cluster with the largest or the smallest transfer sum.
    int[n] -> int[Q, n]."""
    n, k = a.shape[0], pr.k
    moves = np.repeat(a[None, :], n * k, axis=0)
    moves[np.arange(n * k), np.repeat(np.arange(n), k)] = np.tile(np.arange(k), n)
    T = _cluster_sums(a[None, :], pr.t, k)[0]
    ends = np.isin(a, [int(T.argmax()), int(T.argmin())])
    i, j = np.nonzero(ends[:, None] & (a[:, None] != a[None, :]))
    swaps = np.repeat(a[None, :], i.size, axis=0)
    r = np.arange(i.size)
    swaps[r, i], swaps[r, j] = a[j], a[i]
    return np.concatenate([moves, swaps])


def _polish(a: np.ndarray, f: float, pr: _Problem, steps: int) -> tuple[np.ndarray, float, int]:
    """Steepest descent over :func:`_neighbours` for at most ``steps`` improving steps.

    Returns ``(assignment, fitness, evaluations)``."""
    evals = 0
    for _ in range(steps):
        cand = _neighbours(a, pr)
        fc = _fitness(cand, pr)
        evals += cand.shape[0]
        best = int(fc.argmin())
        if not fc[best] < f:
            break
        a, f = cand[best], float(fc[best])
    return a, f, evals


def form_clusters(
    nodes: Sequence[Node],
    n_clusters: int,
    peak_bytes: float,
    message_bytes: float,
    *,
    seed: int,
    population: int = 64,
    generations: int = 200,
    mutation: float | None = None,
    elite: int = 2,
    patience: int = 40,
    tournament: int = 3,
    polish: int = 1,
    penalty: float | None = None,
    max_cluster_nodes: int | None = None,
) -> Formation:
    """Cluster the pool with a genetic algorithm (§3.5.2); deterministic for a seed.

    1. ``population`` random chromosomes ``c ∈ {0..k-1}^n`` (``rng = np.random.default_rng(seed)``).
    2. Each generation: the ``elite`` best individuals survive unchanged; the rest of the next
       generation are children of two parents, each the best of ``tournament`` individuals drawn
       at random; the second parent's labels are aligned with the first's (labels are symmetric),
       then uniform crossover (each gene from either parent with probability 1/2) and mutation
       (each gene redrawn uniformly with probability ``mutation``, default ``1/n``). A child that
       is the same partition as an elite or an earlier child is replaced by a random chromosome
       (keeps the population diverse: without it, tight RAM constraints make it converge early).
    3. Memetic step: the generation's best individual takes up to ``polish`` steps of steepest
       descent over single moves and swaps (``polish=0`` is the plain GA); a local optimum is
       not polished again.
    4. The best individual of all generations is tracked; the run stops after ``generations``
       generations or ``patience`` generations without improvement.

    Args:
      nodes: the pool (:func:`check_nodes`).
      n_clusters: ``k``, the number of clusters.
      peak_bytes: ``M``, the model's peak memory every cluster must hold (:func:`peak_memory_bytes`).
      message_bytes: the bytes a node moves per message (e.g. one micro-batch's activations).
      seed: the only source of randomness.
      penalty, max_cluster_nodes: see :func:`fitness`.

    Returns:
      the best :class:`Formation` found (``method="ga"``).

    Raises:
      InfeasibleError: ``k > n``, the pool's total RAM is below ``k · M`` (naming the shortfall),
        or no feasible individual was found (naming the short clusters of the best one).
    """
    pr = _problem(nodes, n_clusters, peak_bytes, message_bytes, penalty, max_cluster_nodes)
    n, k = len(nodes), pr.k
    for name, value, low in (
        ("population", population, 2),
        ("generations", generations, 1),
        ("elite", elite, 0),
        ("patience", patience, 1),
        ("tournament", tournament, 1),
        ("polish", polish, 0),
    ):
        if int(value) != value or value < low:
            raise ValueError(f"{name}={value!r}: it must be a whole number >= {low}")
    if elite >= population:
        raise ValueError(f"elite={elite} must be below population={population}")
    mutation = 1.0 / n if mutation is None else float(mutation)
    if not 0.0 <= mutation <= 1.0:
        raise ValueError(f"mutation={mutation!r}: it must be a probability in [0, 1]")
    rng = np.random.default_rng(seed)
    pop = rng.integers(0, k, size=(population, n), dtype=np.int64)
    fit = _fitness(pop, pr)
    evals = population
    best_i = int(fit.argmin())
    best, best_f = pop[best_i].copy(), float(fit[best_i])
    stale, gen = 0, 0
    m = population - elite
    settled = np.full(n, -1, dtype=np.int64)  # the last polished local optimum: not polished again
    while gen < generations:
        gen += 1
        order = np.argsort(fit, kind="stable")
        elites = pop[order[:elite]]
        draws = rng.integers(0, population, size=(2 * m, tournament))
        winners = draws[np.arange(2 * m), fit[draws].argmin(axis=1)]
        pa, pb = pop[winners[:m]], pop[winners[m:]]
        pb = _align(pa, pb, k)
        child = np.where(rng.random((m, n)) < 0.5, pa, pb)
        child = np.where(rng.random((m, n)) < mutation, rng.integers(0, k, size=(m, n)), child)
        pop = np.concatenate([elites, child])
        # Clones (the same partition under any labels) are replaced by fresh random chromosomes.
        _, first = np.unique(canonical(pop), axis=0, return_index=True)
        clone = np.ones(population, dtype=bool)
        clone[first] = False
        clone[:elite] = False
        pop[clone] = rng.integers(0, k, size=(int(clone.sum()), n), dtype=np.int64)
        fit = np.concatenate([fit[order[:elite]], _fitness(pop[elite:], pr)])
        evals += m
        i = int(fit.argmin())
        if polish and not np.array_equal(pop[i], settled):
            pop[i], f_i, e = _polish(pop[i].copy(), float(fit[i]), pr, polish)
            if f_i == fit[i]:
                settled = pop[i].copy()
            fit[i] = f_i
            evals += e
        if fit[i] < best_f:
            best, best_f, stale = pop[i].copy(), float(fit[i]), 0
        else:
            stale += 1
            if stale >= patience:
                break
    out = _formation(best, pr, gen, evals, "ga")
    if best_f >= pr.t.sum():
        raise InfeasibleError(
            f"no feasible cluster formation found after {gen} generations of {population} "
            f"(the pool's RAM suffices in total, {_fmt_bytes(float(pr.ram.sum()))} for {k} × {_fmt_bytes(pr.peak)}); "
            f"in the best one {_short_clusters(best, pr)}; add nodes, use fewer clusters, or run longer"
        )
    return out


# --------------------------------------------------------------------------- baselines


def brute_force(
    nodes: Sequence[Node],
    n_clusters: int,
    peak_bytes: float,
    message_bytes: float,
    *,
    penalty: float | None = None,
    max_cluster_nodes: int | None = None,
) -> Formation:
    """The exact optimum of :func:`fitness` by enumeration (for tests and small pools).

    Node 0 is fixed in cluster 0 (labels are symmetric), the other ``k^(n-1)`` assignments are
    evaluated in chunks; ties go to the first in enumeration order (node 1 the fastest-changing
    digit). Pools of more than :data:`BRUTE_FORCE_MAX_NODES` nodes are refused.

    Raises:
      ValueError: a pool too large to enumerate.
      InfeasibleError: as :func:`form_clusters`; when no partition is feasible, the message names
        the short clusters of the partition closest to feasible.
    """
    pr = _problem(nodes, n_clusters, peak_bytes, message_bytes, penalty, max_cluster_nodes)
    n, k = len(nodes), pr.k
    if n > BRUTE_FORCE_MAX_NODES:
        raise ValueError(
            f"brute_force enumerates {k}^{n - 1} assignments: {n} nodes is too many (at most {BRUTE_FORCE_MAX_NODES}); use form_clusters"
        )
    total = k ** (n - 1)
    powers = k ** np.arange(n - 1, dtype=np.int64)
    best, best_f = None, np.inf
    chunk = 1 << 16
    for start in range(0, total, chunk):
        ids = np.arange(start, min(start + chunk, total), dtype=np.int64)
        a = np.zeros((ids.size, n), dtype=np.int64)
        a[:, 1:] = (ids[:, None] // powers) % k
        f = _fitness(a, pr)
        j = int(f.argmin())
        if f[j] < best_f:
            best, best_f = a[j].copy(), float(f[j])
    if best_f >= pr.t.sum():
        raise InfeasibleError(
            f"no partition of the {n} nodes into {k} clusters gives every cluster {_fmt_bytes(pr.peak)} "
            f"(the pool's RAM suffices only in total, {_fmt_bytes(float(pr.ram.sum()))}); "
            f"the closest one: {_short_clusters(best, pr)}; add nodes or use fewer clusters"
        )
    return _formation(best, pr, 0, total, "brute_force")


def greedy(
    nodes: Sequence[Node],
    n_clusters: int,
    peak_bytes: float,
    message_bytes: float,
    *,
    penalty: float | None = None,
    max_cluster_nodes: int | None = None,
) -> Formation:
    """The greedy baseline: RAM first, then balance the transfer sums.

    1. Nodes by RAM, largest first (ties by index), each to the cluster with the least RAM so far
       (ties: the smaller transfer sum, then the lower label), until every cluster holds ``M``.
    2. The remaining nodes by transfer time, largest first, each to the cluster with the smallest
       transfer sum (longest-processing-time rule; ties: the lower label).

    Both steps skip clusters that already have ``max_cluster_nodes`` nodes.

    Raises:
      InfeasibleError: as :func:`form_clusters`; when step 1 runs out of nodes, naming the short
        clusters (a partition may still exist: greedy is not exact).
    """
    pr = _problem(nodes, n_clusters, peak_bytes, message_bytes, penalty, max_cluster_nodes)
    n, k = len(nodes), pr.k
    a = np.full(n, -1, dtype=np.int64)
    R, T, size = np.zeros(k), np.zeros(k), np.zeros(k, dtype=np.int64)
    for i in sorted(range(n), key=lambda i: (-pr.ram[i], i)):
        open_ = [c for c in range(k) if size[c] < pr.max_nodes]
        if (R >= pr.peak).all() or not open_:
            break
        c = min(open_, key=lambda c: (R[c], T[c], c))
        a[i] = c
        R[c] += pr.ram[i]
        T[c] += pr.t[i]
        size[c] += 1
    if not (R >= pr.peak).all():
        raise InfeasibleError(
            f"the greedy formation leaves {_short_clusters(a, pr)} (the pool's RAM suffices in total, "
            f"{_fmt_bytes(float(pr.ram.sum()))}; form_clusters or brute_force may still find a partition)"
        )
    for i in sorted(np.flatnonzero(a < 0).tolist(), key=lambda i: (-pr.t[i], i)):
        c = min((c for c in range(k) if size[c] < pr.max_nodes), key=lambda c: (T[c], c))
        a[i] = c
        T[c] += pr.t[i]
        size[c] += 1
    return _formation(a, pr, 0, 1, "greedy")


# --------------------------------------------------------------------------- inside a cluster


def split_layers(
    rams: Sequence[float], layer_bytes: Sequence[int], *, names: Sequence[str] | None = None
) -> list[tuple[int, int]]:
    """Cut a model's layer units into contiguous stages in proportion to each node's RAM.

    The caller chooses the units (e.g. unit 0 the embeddings, units ``1..L`` the blocks, unit
    ``L+1`` the final norm and head) and each unit's bytes (its share of the peak memory, e.g.
    :func:`peak_memory_bytes` of its parameters and activations). Node ``j`` (in the given order:
    node 0 is the first stage) gets units ``[start_j, stop_j)``, at least one, the ranges covering
    all units in order. With ``load_j`` the bytes of node ``j``'s units, the split minimises

        ``max_j load_j / ram_j``  (then, among those, ``Σ_j (load_j / ram_j)²``)

    exactly, by dynamic programming over prefix sums (``O(m · U²)`` for ``m`` nodes, ``U`` units).

    Returns:
      ``[(start_0, stop_0), ..., (start_{m-1}, stop_{m-1})]``, ``start_0 = 0``, ``stop_{m-1} = U``.

    Raises:
      ValueError: fewer units than nodes, bad sizes, or a node whose range in the best split holds
        more bytes than its RAM (naming it and the bytes).
    """
    r = np.asarray(rams, dtype=np.float64)
    w = np.asarray(layer_bytes)
    m, u = r.shape[0], w.shape[0]
    label = list(names) if names is not None else [str(j) for j in range(m)]
    if len(label) != m:
        raise ValueError(f"{len(label)} names for {m} nodes")
    if m == 0:
        raise ValueError("split_layers needs at least one node")
    if not (np.isfinite(r).all() and (r > 0).all()):
        j = int(np.flatnonzero(~(np.isfinite(r) & (r > 0)))[0])
        raise ValueError(f"node {label[j]!r} has ram {rams[j]!r}: it must be a finite number > 0")
    if u < m:
        raise ValueError(f"cannot give {m} nodes at least one of {u} layer units each: use fewer nodes or finer units")
    if w.ndim != 1 or not (np.issubdtype(w.dtype, np.integer) or (w == np.round(w)).all()) or (w < 0).any():
        raise ValueError(f"layer_bytes must be whole numbers >= 0, got {list(layer_bytes)!r}")
    prefix = np.concatenate([[0], np.cumsum(w.astype(np.int64))])
    load = (prefix[None, :] - prefix[:, None]).astype(np.float64)  # load[s, e] = bytes of units [s, e)
    ratio = load[None, :, :] / r[:, None, None]  # ratio[j, s, e]
    valid = np.triu(np.ones((u + 1, u + 1), dtype=bool), k=1)  # s < e
    # Phase 1: the smallest bottleneck. b[e] = best max ratio of nodes 0..j covering units [0, e).
    b = np.where(np.arange(u + 1) >= 1, ratio[0, 0], np.inf)
    for j in range(1, m):
        cand = np.where(valid, np.maximum(b[:, None], ratio[j]), np.inf)
        b = cand.min(axis=0)
    bottleneck = b[u]
    # Phase 2: among splits with every ratio <= bottleneck, the smallest sum of squared ratios.
    ok = valid & (ratio <= bottleneck)
    sq = ratio * ratio
    cost = np.where(ok[0, 0], sq[0, 0], np.inf)
    back = []
    for j in range(1, m):
        cand = np.where(ok[j], cost[:, None] + sq[j], np.inf)
        arg = cand.argmin(axis=0)
        back.append(arg)
        cost = cand[arg, np.arange(u + 1)]
    stops = [u]
    for arg in reversed(back):
        stops.append(int(arg[stops[-1]]))
    stops.reverse()
    ranges = [(0 if j == 0 else stops[j - 1], stops[j]) for j in range(m)]
    for j, (s, e) in enumerate(ranges):
        if load[s, e] > r[j]:
            raise ValueError(
                f"node {label[j]!r} would hold units [{s}, {e}) = {_fmt_bytes(load[s, e])} but has {_fmt_bytes(r[j])} of RAM, "
                f"in the best split of {_fmt_bytes(float(prefix[-1]))} over {_fmt_bytes(float(r.sum()))} of RAM "
                f"(loads {', '.join(_fmt_bytes(load[s2, e2]) for s2, e2 in ranges)}); use finer units or more RAM"
            )
    return ranges


class Stage(NamedTuple):
    """One pipeline stage of a cluster: node ``node`` (an index into the pool) holds the layer
    units ``[start, stop)``."""

    node: int
    start: int
    stop: int


def plan_stages(
    formation: Formation, nodes: Sequence[Node], layer_bytes: Sequence[int]
) -> tuple[tuple[Stage, ...], ...]:
    """Every cluster's pipeline: :func:`split_layers` over its nodes in the formation's order
    (ascending pool index: the cluster's first node runs the first stage).

    Returns:
      one tuple of :class:`Stage` per cluster, in the order of ``formation.clusters``.

    Raises:
      ValueError: a cluster whose nodes cannot hold the model's units (naming the cluster and node).
    """
    out = []
    for c, members in enumerate(formation.clusters):
        try:
            ranges = split_layers(
                [nodes[i].ram_bytes for i in members], layer_bytes, names=[nodes[i].name for i in members]
            )
        except ValueError as err:
            raise ValueError(f"cluster {c} ({', '.join(nodes[i].name for i in members)}): {err}") from err
        out.append(tuple(Stage(i, s, e) for i, (s, e) in zip(members, ranges)))
    return tuple(out)


# --------------------------------------------------------------------------- measuring a node


def calibrate(seconds: float = 0.2) -> float:
    """A node's measured compute speed, in work units per second.

    One unit is a :data:`CALIBRATION_SIZE`-square float32 matmul (``2·128³`` flops) on fixed
    inputs; the unit is repeated for about ``seconds`` (after one warm-up) and the count divided
    by the time taken. This is what ``speed`` means for a node described as measured: a pool's
    speeds are compared with each other only, so measured speeds must not be mixed with declared
    relative ones.
    """
    if not (np.isfinite(seconds) and seconds > 0):
        raise ValueError(f"seconds={seconds!r}: it must be a finite number > 0")
    rng = np.random.default_rng(0)
    x = rng.standard_normal((CALIBRATION_SIZE, CALIBRATION_SIZE)).astype(np.float32)
    y = rng.standard_normal((CALIBRATION_SIZE, CALIBRATION_SIZE)).astype(np.float32)
    out = np.empty_like(x)
    np.matmul(x, y, out=out)
    count, start = 0, time.perf_counter()
    while True:
        np.matmul(x, y, out=out)
        count += 1
        elapsed = time.perf_counter() - start
        if elapsed >= seconds:
            return count / elapsed


def describe(formation: Formation, nodes: Sequence[Node]) -> str:
    """A small table for logs: one row per cluster (its nodes, RAM against the peak, transfer sum)."""
    rows = [("cluster", "nodes", "RAM", "peak", "transfer s")]
    for c, members in enumerate(formation.clusters):
        rows.append(
            (
                str(c),
                ", ".join(nodes[i].name for i in members),
                _fmt_bytes(formation.ram_bytes[c]),
                _fmt_bytes(formation.peak_bytes),
                f"{formation.transfer_s[c]:.4g}",
            )
        )
    widths = [max(len(row[j]) for row in rows) for j in range(len(rows[0]))]
    lines = ["  ".join(cell.ljust(wd) for cell, wd in zip(row, widths)).rstrip() for row in rows]
    lines.append(
        f"{formation.method}: spread {formation.spread_s:.4g} s, fitness {formation.fitness:.4g}, "
        f"{formation.generations} generations, {formation.evaluations} evaluations"
    )
    return "\n".join(lines)
