"""Cluster formation (Ravnest §3.5.2): the genetic algorithm against brute force and greedy, the
penalty fitness, infeasible pools, the RAM-proportional layer split, calibration."""

from __future__ import annotations

import itertools
import math
import types

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from zeroth.cluster import formation
from zeroth.cluster.formation import (
    Formation,
    InfeasibleError,
    Node,
    Stage,
    brute_force,
    calibrate,
    canonical,
    check_nodes,
    describe,
    fitness,
    form_clusters,
    greedy,
    peak_memory_bytes,
    plan_stages,
    split_layers,
    transfer_seconds,
)

GB = 1e9
MESSAGE = 4e6  # bytes per message: 32 Mbit


def random_pool(n: int, seed: int) -> list[Node]:
    """RAM uniform in 2-32 GB, bandwidth log-uniform in 10 Mbit/s - 1 Gbit/s."""
    rng = np.random.default_rng(seed)
    ram = rng.uniform(2 * GB, 32 * GB, n)
    bw = 10 ** rng.uniform(7, 9, n)
    return [Node(f"n{i}", float(ram[i]), float(bw[i])) for i in range(n)]


def all_partitions_fitness(nodes, k, peak):
    """Every assignment with node 0 in cluster 0 (an independent enumeration): (canonical, fitness)."""
    n = len(nodes)
    a = np.array([(0,) + rest for rest in itertools.product(range(k), repeat=n - 1)], dtype=np.int64)
    return canonical(a), fitness(a, nodes, k, peak, MESSAGE)


def assert_valid(f: Formation, nodes, k, peak):
    assert len(f.clusters) == k
    assert sorted(i for c in f.clusters for i in c) == list(range(len(nodes)))
    assert all(list(c) == sorted(c) and c for c in f.clusters)
    assert [c[0] for c in f.clusters] == sorted(c[0] for c in f.clusters)
    for c, members in enumerate(f.clusters):
        assert f.ram_bytes[c] == pytest.approx(sum(nodes[i].ram_bytes for i in members), rel=1e-12)
        assert f.ram_bytes[c] >= peak
        assert f.transfer_s[c] == pytest.approx(sum(transfer_seconds(nodes[i], MESSAGE) for i in members), rel=1e-12)
    assert f.spread_s == max(f.transfer_s) - min(f.transfer_s)
    assert f.fitness == f.spread_s  # feasible: no penalty
    assert f.fitness == fitness(np.array(f.assignment), nodes, k, peak, MESSAGE)


# --------------------------------------------------------------------------- inputs and fitness


def test_peak_memory_and_transfer():
    assert peak_memory_bytes(4_000, 1_000) == 4_000 * 4 + 1_000  # params + AdamW m, v + gradient + activations
    assert peak_memory_bytes(4_000, 1_000, optimizer_slots=0) == 9_000
    with pytest.raises(ValueError, match="activation_bytes"):
        peak_memory_bytes(10, -1)
    assert transfer_seconds(Node("a", GB, 1e8), 1e6) == pytest.approx(0.08)


@pytest.mark.parametrize(
    ("nodes", "match"),
    [
        ([Node("a", 0.0, 1e8)], "'a' has ram_bytes=0.0"),
        ([Node("a", GB, -5.0)], "'a' has bandwidth_bps=-5.0"),
        ([Node("a", GB, 1e8, speed=float("nan"))], "'a' has speed=nan"),
        ([Node("a", GB, 1e8), Node("a", GB, 1e8)], "'a' is used by nodes 0 and 1"),
        ([Node("", GB, 1e8)], "non-empty"),
        ([], "empty"),
    ],
)
def test_bad_nodes(nodes, match):
    with pytest.raises(ValueError, match=match):
        check_nodes(nodes)
    with pytest.raises(ValueError, match=match):
        form_clusters(nodes, 1, GB, MESSAGE, seed=0)


def test_fitness_penalty_orders_feasible_before_infeasible():
    nodes = [Node("a", 8 * GB, 1e8), Node("b", 4 * GB, 5e8), Node("c", 8 * GB, 2e8), Node("d", 4 * GB, 1e9)]
    t = [transfer_seconds(x, MESSAGE) for x in nodes]
    a = np.array([[0, 1, 1, 0], [0, 0, 1, 1], [0, 1, 0, 0], [0, 0, 0, 0]])
    f = fitness(a, nodes, 2, 10 * GB, MESSAGE)
    assert f[0] == pytest.approx(abs((t[0] + t[3]) - (t[1] + t[2])))  # feasible: the spread
    assert f[1] == pytest.approx(abs((t[0] + t[1]) - (t[2] + t[3])))
    # [0,1,0,0]: cluster 1 holds 4 GB of 10 (60 % short); [0,0,0,0]: one empty cluster (100 % short)
    S = sum(t)
    assert f[2] == pytest.approx(abs(t[1] - (S - t[1])) + S + S * 0.6)
    assert f[3] == pytest.approx(S + S + S * (1.0 + 1))
    assert max(f[:2]) < S < min(f[2:])
    assert fitness(a[0], nodes, 2, 10 * GB, MESSAGE) == f[0]
    with pytest.raises(ValueError, match=r"integers in 0..1"):
        fitness(np.array([0, 1, 2, 0]), nodes, 2, 10 * GB, MESSAGE)


def test_canonical():
    np.testing.assert_array_equal(canonical([2, 2, 0, 1]), [0, 0, 1, 2])
    np.testing.assert_array_equal(canonical([[1, 0, 1], [0, 1, 0]]), [[0, 1, 0], [0, 1, 0]])


# --------------------------------------------------------------------------- the GA against brute force


@pytest.mark.parametrize(("n", "k", "seed"), [(6, 2, 0), (7, 2, 1), (7, 3, 2), (8, 3, 3), (9, 2, 4), (9, 3, 5)])
def test_ga_finds_the_brute_force_optimum(n, k, seed):
    nodes = random_pool(n, seed)
    peak = 0.7 * sum(x.ram_bytes for x in nodes) / k
    exact = brute_force(nodes, k, peak, MESSAGE)
    ga = form_clusters(nodes, k, peak, MESSAGE, seed=seed, generations=100)
    assert_valid(exact, nodes, k, peak)
    assert_valid(ga, nodes, k, peak)
    assert ga.fitness == exact.fitness
    parts, f = all_partitions_fitness(nodes, k, peak)
    assert exact.fitness == f.min()
    optima = {tuple(p) for p in parts[f == f.min()]}
    if len(optima) == 1:
        assert ga.clusters == exact.clusters
        assert ga.assignment == optima.pop()


@settings(max_examples=120)
@given(
    rams=st.lists(st.integers(1, 16), min_size=4, max_size=8),
    data=st.data(),
)
def test_ga_matches_brute_force_on_any_small_pool(rams, data):
    """Hypothesis over pools: RAM in whole GB, bandwidths from a few levels (ties included), a peak
    anywhere up to the average; the GA is feasible exactly when brute force is, with its fitness."""
    n = len(rams)
    bws = data.draw(st.lists(st.sampled_from([1e7, 2.5e7, 1e8, 3e8, 1e9]), min_size=n, max_size=n))
    k = data.draw(st.integers(1, min(3, n)))
    frac = data.draw(st.sampled_from([0.2, 0.5, 0.8, 0.95, 1.0]))
    nodes = [Node(f"n{i}", r * GB, b) for i, (r, b) in enumerate(zip(rams, bws))]
    peak = frac * sum(rams) * GB / k
    try:
        exact = brute_force(nodes, k, peak, MESSAGE)
    except InfeasibleError:
        with pytest.raises(InfeasibleError, match="short"):
            form_clusters(nodes, k, peak, MESSAGE, seed=0, generations=60)
        return
    ga = form_clusters(nodes, k, peak, MESSAGE, seed=0, generations=60)
    assert_valid(ga, nodes, k, peak)
    assert ga.fitness == exact.fitness


# --------------------------------------------------------------------------- large pools


@pytest.mark.parametrize(("n", "k", "seed"), [(40, 4, 0), (50, 5, 1), (60, 6, 2), (60, 4, 3)])
def test_ga_no_worse_than_greedy_on_large_pools(n, k, seed):
    nodes = random_pool(n, seed)
    peak = 0.8 * sum(x.ram_bytes for x in nodes) / k
    base = greedy(nodes, k, peak, MESSAGE)
    ga = form_clusters(nodes, k, peak, MESSAGE, seed=seed)
    assert_valid(base, nodes, k, peak)
    assert_valid(ga, nodes, k, peak)
    assert ga.fitness <= base.fitness
    assert 1 <= ga.generations <= 200


def test_deterministic_for_a_seed():
    nodes = random_pool(30, 7)
    peak = 0.75 * sum(x.ram_bytes for x in nodes) / 3
    a = form_clusters(nodes, 3, peak, MESSAGE, seed=11)
    b = form_clusters(nodes, 3, peak, MESSAGE, seed=11)
    c = form_clusters(nodes, 3, peak, MESSAGE, seed=12)
    assert a == b
    assert_valid(a, nodes, 3, peak)
    assert_valid(c, nodes, 3, peak)
    # Node order is part of the answer only through the indices: relabelled input, same partition.
    perm = list(reversed(range(30)))
    d = form_clusters([nodes[i] for i in perm], 3, peak, MESSAGE, seed=11)
    assert_valid(d, [nodes[i] for i in perm], 3, peak)


def test_plain_ga_without_the_memetic_step_is_valid():
    nodes = random_pool(9, 3)
    peak = 0.6 * sum(x.ram_bytes for x in nodes) / 3
    ga = form_clusters(nodes, 3, peak, MESSAGE, seed=1, polish=0)
    assert_valid(ga, nodes, 3, peak)
    assert ga.fitness == brute_force(nodes, 3, peak, MESSAGE).fitness


# --------------------------------------------------------------------------- infeasible pools


def test_total_ram_short_names_the_shortfall():
    nodes = [Node(f"n{i}", 1.2 * GB, 1e8) for i in range(5)]  # 6.0 GB
    for fn in (brute_force, greedy, lambda *a: form_clusters(*a, seed=0)):
        with pytest.raises(
            InfeasibleError,
            match=r"6\.00 GB over 5 nodes\) cannot hold 3 clusters of 2\.50 GB peak memory: 1\.50 GB short",
        ):
            fn(nodes, 3, 2.5 * GB, MESSAGE)


def test_no_partition_names_the_short_cluster():
    # 16 GB in total for 2 clusters of 8 GB, but 5+5+5+1 splits into 10+6 at best.
    nodes = [Node("a", 5 * GB, 1e8), Node("b", 5 * GB, 1e8), Node("c", 5 * GB, 1e8), Node("d", 1 * GB, 1e8)]
    with pytest.raises(InfeasibleError, match=r"has 6\.00 GB of 8\.00 GB \(2\.00 GB short\)"):
        brute_force(nodes, 2, 8 * GB, MESSAGE)
    with pytest.raises(
        InfeasibleError, match=r"best one cluster \d \(nodes [a-d, ]+\) has \d\.00 GB of 8\.00 GB \(\d\.00 GB short\)"
    ):
        form_clusters(nodes, 2, 8 * GB, MESSAGE, seed=0, generations=30)
    with pytest.raises(InfeasibleError, match=r"greedy formation leaves cluster \d .* short"):
        greedy(nodes, 2, 8 * GB, MESSAGE)


def test_ga_feasible_where_greedy_is_not():
    # RAM 6, 5, 4, 3, 2 GB into two clusters of 10 GB: only {6, 4} + {5, 3, 2}; greedy deals
    # 6 | 5 4 | 6 3, then 2 joins the smaller transfer sum (5 4) and 6 3 stays 1 GB short.
    nodes = [Node(f"n{r}", r * GB, 1e8 * r) for r in (6, 5, 4, 3, 2)]
    with pytest.raises(
        InfeasibleError,
        match=r"greedy formation leaves cluster 0 \(nodes n6, n3\) has 9\.00 GB of 10\.0 GB \(1\.00 GB short\)",
    ):
        greedy(nodes, 2, 10 * GB, MESSAGE)
    ga = form_clusters(nodes, 2, 10 * GB, MESSAGE, seed=0)
    assert ga.clusters == ((0, 2), (1, 3, 4)) == brute_force(nodes, 2, 10 * GB, MESSAGE).clusters
    assert_valid(ga, nodes, 2, 10 * GB)


def test_more_clusters_than_nodes():
    nodes = random_pool(3, 0)
    with pytest.raises(InfeasibleError, match="cannot form 4 clusters from 3 nodes"):
        form_clusters(nodes, 4, GB, MESSAGE, seed=0)
    with pytest.raises(ValueError, match="n_clusters=0"):
        greedy(nodes, 0, GB, MESSAGE)


def test_max_cluster_nodes():
    nodes = random_pool(9, 4)
    peak = 0.5 * sum(x.ram_bytes for x in nodes) / 2
    with pytest.raises(InfeasibleError, match=r"9 nodes do not fit in 2 clusters of at most 4 nodes"):
        form_clusters(nodes, 2, peak, MESSAGE, seed=0, max_cluster_nodes=4)
    free = brute_force(nodes, 2, peak, MESSAGE)
    exact = brute_force(nodes, 2, peak, MESSAGE, max_cluster_nodes=5)
    ga = form_clusters(nodes, 2, peak, MESSAGE, seed=0, max_cluster_nodes=5)
    base = greedy(nodes, 2, peak, MESSAGE, max_cluster_nodes=5)
    for f in (exact, ga, base):
        assert_valid(f, nodes, 2, peak)
        assert sorted(len(c) for c in f.clusters) == [4, 5]
    assert ga.fitness == exact.fitness >= free.fitness
    assert ga.fitness <= base.fitness
    a = np.zeros(9, dtype=np.int64)
    a[:2] = 1  # 7 nodes in cluster 0: 2 beyond the limit
    assert fitness(a, nodes, 2, peak, MESSAGE, max_cluster_nodes=5) > fitness(a, nodes, 2, peak, MESSAGE)


def test_brute_force_refuses_large_pools():
    with pytest.raises(ValueError, match="13 nodes is too many"):
        brute_force(random_pool(13, 0), 2, GB, MESSAGE)


def test_describe():
    nodes = [Node("a", 8 * GB, 1e8), Node("b", 4 * GB, 5e8), Node("c", 8 * GB, 2e8), Node("d", 4 * GB, 1e9)]
    f = form_clusters(nodes, 2, 10 * GB, 1e6, seed=0)
    assert f.clusters == ((0, 3), (1, 2))
    text = describe(f, nodes)
    assert "a, d" in text and "b, c" in text and "12.0 GB" in text and "10.0 GB" in text
    assert "spread 0.032 s" in text


# --------------------------------------------------------------------------- split_layers


def brute_split(rams, layer_bytes):
    """Every split into contiguous non-empty ranges: the best (max ratio, sum of squared ratios)."""
    m, u = len(rams), len(layer_bytes)
    prefix = np.concatenate([[0], np.cumsum(layer_bytes)])
    best = None
    for cuts in itertools.combinations(range(1, u), m - 1):
        stops = list(cuts) + [u]
        ranges = [(0 if j == 0 else stops[j - 1], stops[j]) for j in range(m)]
        ratios = [float(prefix[e] - prefix[s]) / rams[j] for j, (s, e) in enumerate(ranges)]
        key = (max(ratios), sum(r * r for r in ratios))
        if best is None or key < best[0]:
            best = (key, ranges)
    return best


def split_key(rams, layer_bytes, ranges):
    prefix = np.concatenate([[0], np.cumsum(layer_bytes)])
    ratios = [float(prefix[e] - prefix[s]) / rams[j] for j, (s, e) in enumerate(ranges)]
    return max(ratios), sum(r * r for r in ratios)


def test_split_proportional_to_ram():
    ranges = split_layers([2 * GB, 1 * GB], [100] * 12)
    assert ranges == [(0, 8), (8, 12)]  # twice the RAM, twice the layers
    ranges = split_layers([1 * GB, 3 * GB, 2 * GB], [10] * 30)
    assert ranges == [(0, 5), (5, 20), (20, 30)]
    ranges = split_layers([4.0, 4.0, 4.0], [1, 1, 1, 1, 1, 1, 1, 1, 1, 1])
    assert [e - s for s, e in ranges] in ([4, 3, 3], [3, 4, 3], [3, 3, 4])


@settings(max_examples=80)
@given(
    rams=st.lists(st.integers(1, 9), min_size=1, max_size=4),
    layer_bytes=st.lists(st.integers(0, 20), min_size=4, max_size=9),
)
def test_split_is_the_exact_optimum(rams, layer_bytes):
    """Against every contiguous split: the same bottleneck, the same sum of squares; a split whose
    best bottleneck exceeds the RAM is refused."""
    r = [float(x) * 10 for x in rams]
    m, u = len(r), len(layer_bytes)
    best_key, _ = brute_split(r, layer_bytes)
    if best_key[0] > 1:
        with pytest.raises(ValueError, match="would hold units"):
            split_layers(r, layer_bytes)
        return
    ranges = split_layers(r, layer_bytes)
    assert ranges[0][0] == 0 and ranges[-1][1] == u
    assert all(s < e for s, e in ranges)
    assert all(ranges[j][1] == ranges[j + 1][0] for j in range(m - 1))
    key = split_key(r, layer_bytes, ranges)
    assert key[0] == best_key[0]
    assert key[1] == pytest.approx(best_key[1], rel=1e-12)


def test_split_errors():
    with pytest.raises(ValueError, match="cannot give 3 nodes at least one of 2 layer units"):
        split_layers([1.0, 1.0, 1.0], [1, 1])
    # 10 + 10 + 10 bytes over RAMs 12 and 14: one node must hold 20 bytes, the larger one at best.
    with pytest.raises(ValueError, match=r"node 'second' would hold units \[1, 3\) = 20 B but has 14 B of RAM"):
        split_layers([12.0, 14.0], [10, 10, 10], names=["first", "second"])
    with pytest.raises(ValueError, match="node '1' has ram 0"):
        split_layers([1.0, 0], [1, 1])
    with pytest.raises(ValueError, match="whole numbers >= 0"):
        split_layers([1.0], [1, -2])


def test_plan_stages():
    nodes = [Node("a", 2 * GB, 1e8), Node("b", 6 * GB, 1e8), Node("c", 4 * GB, 1e8), Node("d", 4 * GB, 1e8)]
    f = form_clusters(nodes, 2, 7 * GB, MESSAGE, seed=0)
    assert f.clusters == ((0, 1), (2, 3))
    units = [GB // 2] * 14  # 7 GB in 14 units
    stages = plan_stages(f, nodes, units)
    assert stages == (
        (Stage(0, 0, 3), Stage(1, 3, 14)),  # 2 : 6 GB of RAM -> 3.5 : 10.5 units, rounded to the lower bottleneck
        (Stage(2, 0, 7), Stage(3, 7, 14)),
    )
    with pytest.raises(ValueError, match=r"cluster 0 \(a, b\): node 'b' would hold"):
        plan_stages(f, nodes, [GB // 2] * 2 + [7 * GB])


# --------------------------------------------------------------------------- calibration


def test_calibrate_counts_units_until_the_time_is_up(monkeypatch):
    a = calibrate(0.05)
    assert math.isfinite(a) and a > 0
    # On a clock that moves 1 s per reading, the warm-up unit is not counted, the start reading is
    # taken after it and each unit reads once: 5 units in 5 s with seconds=4.5, 1 unit per second.
    # (No wall-clock ratio is asserted: under a loaded machine BLAS threads can be 100x slower.)
    clock = itertools.count()
    monkeypatch.setattr(formation, "time", types.SimpleNamespace(perf_counter=lambda: float(next(clock))))
    assert calibrate(4.5) == 1.0
    assert calibrate(1.0) == 1.0
    with pytest.raises(ValueError, match="seconds=0"):
        calibrate(0)
    with pytest.raises(ValueError, match=r"seconds=nan: it must be a finite number > 0"):
        calibrate(float("nan"))
