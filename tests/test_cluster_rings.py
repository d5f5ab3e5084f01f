"""zeroth.cluster.rings: ring planning, the ring all-reduce's bits, all rings at once over an exchange."""

import json
import threading

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from zeroth.cluster import rings as R

# Cluster 0 cuts at 10; cluster 1 at 20 and 25; cluster 2 holds everything on one node.
LAYOUTS = [[(0, 10), (10, 30)], [(0, 20), (20, 25), (25, 30)], [(0, 30)]]


def _bits(a: np.ndarray) -> bytes:
    return np.ascontiguousarray(a, np.float32).view(np.uint32).tobytes()


# ----------------------------------------------------------------------------------------------
# Planning


def test_identical_layouts_one_ring_per_node():
    layout = [(0, 7), (7, 19), (19, 40)]
    rings = R.plan_rings([layout] * 4)
    assert rings == [R.Ring(0, 0, 7, (0, 0, 0, 0)), R.Ring(1, 7, 19, (1, 1, 1, 1)), R.Ring(2, 19, 40, (2, 2, 2, 2))]


def test_non_uniform_layouts_segments_and_members():
    rings = R.plan_rings(LAYOUTS[:2])
    assert rings == [
        R.Ring(0, 0, 10, (0, 0)),
        R.Ring(1, 10, 20, (1, 0)),
        R.Ring(2, 20, 25, (1, 1)),
        R.Ring(3, 25, 30, (1, 2)),
    ]
    # Node 1 of cluster 0 joins three rings, each with a different peer of cluster 1.
    assert [r.ring_id for r in R.rings_of(rings, 0, 1)] == [1, 2, 3]
    assert [r.ring_id for r in R.rings_of(rings, 1, 0)] == [0, 1]
    assert [r.ring_id for r in R.rings_of(rings, 1, 2)] == [3]
    # Four rings: more than the largest cluster's three nodes.
    three = R.plan_rings(LAYOUTS)
    assert [(r.start, r.stop, r.members) for r in three] == [
        (0, 10, (0, 0, 0)),
        (10, 20, (1, 0, 0)),
        (20, 25, (1, 1, 0)),
        (25, 30, (1, 2, 0)),
    ]
    assert len(R.rings_of(three, 2, 0)) == 4


def test_empty_stage_joins_no_ring():
    rings = R.plan_rings([[(0, 5), (5, 5), (5, 9)], [(0, 9)]])
    assert [(r.start, r.stop, r.members) for r in rings] == [(0, 5, (0, 0)), (5, 9, (2, 0))]
    assert R.rings_of(rings, 0, 1) == []


@st.composite
def _layouts(draw):
    n = draw(st.integers(1, 60))
    clusters = draw(st.integers(1, 4))
    out = []
    for _ in range(clusters):
        cuts = sorted(draw(st.lists(st.integers(0, n), max_size=4)))
        pts = [0, *cuts, n]
        out.append(list(zip(pts[:-1], pts[1:])))
    return n, out


@given(_layouts())
def test_plan_rings_properties(case):
    n, layouts = case
    rings = R.plan_rings(layouts)
    # Rings tile [0, n), ids in order of start, each member's node really holds the ring's range.
    assert [r.ring_id for r in rings] == list(range(len(rings)))
    assert rings[0].start == 0 and rings[-1].stop == n
    assert all(a.stop == b.start for a, b in zip(rings, rings[1:]))
    for r in rings:
        assert r.start < r.stop
        for c, i in enumerate(r.members):
            a, b = layouts[c][i]
            assert a <= r.start and r.stop <= b
    # Minimal: adjacent rings differ in a member, and there is one ring per distinct inner cut.
    assert all(a.members != b.members for a, b in zip(rings, rings[1:]))
    inner = {b for layout in layouts for _, b in layout if 0 < b < n}
    assert len(rings) == len(inner) + 1
    # Every node's rings cover exactly its range.
    for c, layout in enumerate(layouts):
        for i, (a, b) in enumerate(layout):
            assert sum(r.size for r in R.rings_of(rings, c, i)) == b - a


@pytest.mark.parametrize(
    "layouts, match",
    [
        ([[(0, 10), (11, 30)], [(0, 30)]], r"cluster 0 node 1 holds \[11, 30\).*start at 10"),
        ([[(0, 30)], [(0, 10), (5, 30)]], r"cluster 1 node 1 holds \[5, 30\)"),
        ([[(1, 30)]], r"cluster 0 node 0 holds \[1, 30\).*start at 0"),
        ([[(0, 10), (10, 5)]], r"cluster 0 node 1 holds \[10, 5\)"),
        ([[(0, 30)], [(0, 20)]], r"cluster 1 covers \[0, 20\) but cluster 0 covers \[0, 30\)"),
        ([[(0, 30)], []], r"cluster 1 has no nodes"),
        ([], r"at least one cluster"),
    ],
)
def test_plan_rings_rejects_bad_tilings(layouts, match):
    with pytest.raises(ValueError, match=match):
        R.plan_rings(layouts)


@given(st.integers(0, 200), st.integers(1, 9))
def test_chunk_bounds(n, parts):
    b = R.chunk_bounds(n, parts)
    assert len(b) == parts and b[0][0] == 0 and b[-1][1] == n
    assert all(x[1] == y[0] for x, y in zip(b, b[1:]))
    sizes = [y - x for x, y in b]
    assert max(sizes) - min(sizes) <= 1 and min(sizes) >= 0
    assert sizes == sorted(sizes, reverse=True)


# ----------------------------------------------------------------------------------------------
# The ring's arithmetic

_F32 = st.floats(width=32, allow_nan=False, allow_infinity=False, min_value=-(2.0**100), max_value=2.0**100)


@st.composite
def _ring_values(draw):
    C = draw(st.integers(1, 5))
    n = draw(st.integers(0, 50))
    # Magnitudes from subnormal to 2^120 (five of them still sum below float32's 2^128).
    scale = np.float32(draw(st.sampled_from([1.0, 2.0**-100, 2.0**-130, 2.0**20])))
    return [np.multiply(draw(hnp.arrays(np.float32, n, elements=_F32)), scale) for _ in range(C)]


@given(_ring_values())
def test_ring_equals_ordered_mean_bit_for_bit(vs):
    C, n = len(vs), vs[0].shape[0]
    out = R.ring_allreduce_local(vs)
    assert len(out) == C and all(o.dtype == np.float32 and o.shape == (n,) for o in out)
    # The same bits on every member.
    assert len({_bits(o) for o in out}) == 1
    # Chunk j equals the plain mean summed in the ring's order, to the bit.
    for j, (a, b) in enumerate(R.chunk_bounds(n, C)):
        want = R.ordered_mean([v[a:b] for v in vs], R.summation_order(j, C))
        assert _bits(out[0][a:b]) == _bits(want)
    # And the float64 mean within C float32 roundings of the magnitudes involved.
    v64 = np.stack([v.astype(np.float64) for v in vs]) if n else np.zeros((C, 0))
    mean64 = v64.mean(axis=0)
    tol = (C + 1) * 2.0**-23 * np.abs(v64).sum(axis=0) / C + C * 2.0**-149
    assert np.all(np.abs(out[0].astype(np.float64) - mean64) <= tol)


def test_summation_order_is_the_ring_order():
    assert R.summation_order(0, 4) == [1, 2, 3, 0]
    assert R.summation_order(3, 4) == [0, 1, 2, 3]
    assert R.summation_order(0, 1) == [0]
    # The order matters: these three sum to different floats in different orders.
    vs = [np.array([1e8], np.float32), np.array([1.0], np.float32), np.array([-1e8], np.float32)]
    got = R.ring_allreduce_local(vs)[0]  # n=1 < C=3: chunk 0 holds it, summed 1, 2, 0
    assert _bits(got) == _bits(R.ordered_mean(vs, [1, 2, 0]))
    assert _bits(got) != _bits(R.ordered_mean(vs, [0, 2, 1]))


def test_ordered_mean_divides_in_float32():
    vs = [np.array([1.0], np.float32)] * 3
    assert R.ordered_mean(vs, [0, 1, 2]).dtype == np.float32
    assert R.ordered_mean(vs, [0, 1, 2])[0] == np.float32(1.0)  # 3/3, not 3 * float32(1/3) = 1.0000001
    with pytest.raises(ValueError, match="permutation"):
        R.ordered_mean(vs, [0, 0, 1])
    with pytest.raises(ValueError, match="float32"):
        R.ordered_mean([np.ones(2)], [0])


# ----------------------------------------------------------------------------------------------
# All rings at once over an exchange


def _run_nodes(layouts, full, rounds, *, timeout_s=10.0, skip=(), peer_of=None):
    """Every node in its own thread averages its slice of its cluster's full vector, ``rounds`` times."""
    rings = R.plan_rings(layouts)
    hub = R.QueueExchange()
    results, errors = {}, {}

    def node(c, i):
        a, b = layouts[c][i]
        x = full[c][a:b]
        me = hub.endpoint(peer_of(c, i) if peer_of else (c, i))
        try:
            for rid in rounds:
                x = R.average_node(x, a, rings, c, i, me, round_id=rid, timeout_s=timeout_s, peer_of=peer_of)
                results[(c, i, rid)] = x
        except BaseException as e:  # noqa: BLE001 - checked by the test
            errors[(c, i)] = e

    threads = [
        threading.Thread(target=node, args=(c, i), daemon=True)
        for c, layout in enumerate(layouts)
        for i in range(len(layout))
        if (c, i) not in skip
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
        assert not t.is_alive()
    return rings, hub, results, errors


def _expected(rings, vecs):
    """The averaged full vector: each ring's segment through ring_allreduce_local."""
    out = np.empty_like(vecs[0])
    for r in rings:
        out[r.start : r.stop] = R.ring_allreduce_local([v[r.start : r.stop] for v in vecs])[0]
    return out


LAYOUT_CASES = [
    LAYOUTS,
    [[(0, 3), (3, 40)], [(0, 1), (1, 2), (2, 40)]],  # rings of 1 element: every chunk but one empty
    [[(0, 17), (17, 60)], [(0, 5), (5, 31), (31, 60)], [(0, 44), (44, 60)], [(0, 9), (9, 40), (40, 52), (52, 60)]],
]


@pytest.mark.parametrize("layouts", LAYOUT_CASES, ids=["3c-30", "2c-tiny", "4c-60"])
def test_average_node_over_queue_exchange(layouts):
    C, n = len(layouts), layouts[0][-1][1]
    rng = np.random.default_rng(C)
    full = [rng.standard_normal(n).astype(np.float32) * np.float32(10.0 ** (c - 1)) for c in range(C)]
    rings, hub, results, errors = _run_nodes(layouts, full, rounds=[0, 1, 2])
    assert errors == {}
    assert hub.pending() == []
    want = full
    for rid in range(3):
        want = [_expected(rings, want)] * C
        for c, layout in enumerate(layouts):
            for i, (a, b) in enumerate(layout):
                got = results[(c, i, rid)]
                assert got.dtype == np.float32
                assert _bits(got) == _bits(want[0][a:b]), (c, i, rid)
    # After the first round: the plain average of the clusters' vectors, within float tolerance.
    first = np.concatenate([results[(0, i, 0)] for i in range(len(layouts[0]))])
    np.testing.assert_allclose(first, np.mean(np.stack(full).astype(np.float64), axis=0), rtol=1e-6, atol=1e-6)
    # Bytes: what the exchange carried in three rounds equals the plan's count, pair by pair and per node.
    assert dict(hub.bytes_sent) == {k: 3 * v for k, v in R.pair_bytes(rings, C).items()}
    per_node = {}
    for (src, _), b in hub.bytes_sent.items():
        per_node[src] = per_node.get(src, 0) + b
    assert per_node == {k: 3 * v for k, v in R.ring_bytes(rings, C).items()}


def test_peer_addresses_and_round_ids_keep_rings_apart():
    # Peers addressed by name; rounds 7 and 3 in a row (ids need not increase).
    layouts = LAYOUT_CASES[2]
    full = [np.full(60, c, np.float32) for c in range(4)]
    _, hub, results, errors = _run_nodes(layouts, full, rounds=[7, 3], peer_of=lambda c, i: f"cluster{c}/node{i}")
    assert errors == {} and hub.pending() == []
    assert {src for src, _ in hub.bytes_sent} == {
        f"cluster{c}/node{i}" for c in range(4) for i in range(len(layouts[c]))
    }
    for c, layout in enumerate(layouts):
        for i, (a, b) in enumerate(layout):
            assert _bits(results[(c, i, 3)]) == _bits(np.full(b - a, 1.5, np.float32))


def test_float64_parameters_rejected():
    ring = R.Ring(0, 0, 4, (0, 0))
    with pytest.raises(ValueError, match="values_segment must be a 1-D float32 array, got dtype float64"):
        R.ring_member(ring, 0, np.zeros(4), R.QueueExchange().endpoint((0, 0)), round_id=0, timeout_s=1.0)


def test_one_cluster_is_the_identity():
    layouts = [[(0, 4), (4, 9)]]
    full = [np.arange(9, dtype=np.float32) - np.float32(4.5)]
    _, hub, results, errors = _run_nodes(layouts, full, rounds=[0])
    assert errors == {} and hub.bytes_sent == {}
    assert _bits(np.concatenate([results[(0, 0, 0)], results[(0, 1, 0)]])) == _bits(full[0])


def test_silent_members_time_out():
    # Cluster 1 nodes 1 and 2 never answer: rings 2 and 3 of cluster 0 node 1 stall, its ring 1 completes.
    layouts = LAYOUTS[:2]
    full = [np.ones(30, np.float32), np.zeros(30, np.float32)]
    _, _, results, errors = _run_nodes(layouts, full, rounds=[0], timeout_s=0.3, skip={(1, 1), (1, 2)})
    assert set(errors) == {(0, 1)}
    err = errors[(0, 1)]
    assert isinstance(err, TimeoutError) and "from (1, 1)" in str(err)
    assert any("ring 3 also failed" in note and "(1, 2)" in note for note in err.__notes__)
    # Nodes whose rings do not involve the silent ones finish: cluster 1 node 0 with both nodes of cluster 0.
    assert _bits(results[(0, 0, 0)]) == _bits(np.full(10, 0.5, np.float32))
    assert _bits(results[(1, 0, 0)]) == _bits(np.full(20, 0.5, np.float32))


def test_bad_message_rejected():
    hub = R.QueueExchange()
    ring = R.Ring(0, 0, 6, (0, 0))
    # Cluster 1's member sends a chunk of the wrong length for step 0 of the reduce-scatter.
    hub.put((1, 0), (0, 0), (0, 5, "reduce", 0), np.zeros(4, np.float32))
    with pytest.raises(ValueError, match=r"shape \(4,\); expected float32 of shape \(3,\)"):
        R.ring_member(ring, 0, np.ones(6, np.float32), hub.endpoint((0, 0)), round_id=5, timeout_s=1.0)


def test_average_node_rejects_wrong_slice():
    rings = R.plan_rings(LAYOUTS)
    with pytest.raises(ValueError, match=r"cluster 0 node 1 holds \[10, 30\).*flat_part covers \[0, 20\)"):
        R.average_node(
            np.zeros(20, np.float32), 0, rings, 0, 1, R.QueueExchange().endpoint((0, 1)), round_id=0, timeout_s=1.0
        )


def test_duplicate_message_rejected():
    hub = R.QueueExchange()
    hub.put("a", "b", (0,), np.zeros(1, np.float32))
    with pytest.raises(ValueError, match="sent twice"):
        hub.put("a", "b", (0,), np.zeros(1, np.float32))


# ----------------------------------------------------------------------------------------------
# Cost model


def test_ring_bytes_and_seconds():
    rings = R.plan_rings(LAYOUTS[:2])
    b = R.ring_bytes(rings, 2)
    # C = 2: each member sends one half of each segment in each phase, the whole segment in all.
    assert b == {(0, 0): 40, (0, 1): 80, (1, 0): 80, (1, 1): 20, (1, 2): 20}
    one = R.single_ring(30, 2)
    assert R.ring_bytes(one, 2) == {(0, 0): 120, (1, 0): 120}
    # Uniform links: the busiest pair sets the time; a latency per step adds 2 (C-1) of them.
    assert R.ring_seconds(rings, 2, 10.0) == pytest.approx(max(R.pair_bytes(rings, 2).values()) / 10.0)
    assert R.ring_seconds(one, 2, 10.0, latency_s=0.5) == pytest.approx(12.0 + 1.0)
    slow = {k: (1.0 if k == ((0, 1), (1, 2)) else 1e9) for k in R.pair_bytes(rings, 2)}
    assert R.ring_seconds(rings, 2, slow) == pytest.approx(R.pair_bytes(rings, 2)[((0, 1), (1, 2))] / 1.0)


def test_proportional_layout():
    assert R.proportional_layout(12, [4, 8]) == [(0, 4), (4, 12)]
    assert R.proportional_layout(10, [1, 1, 1]) == [(0, 3), (3, 7), (7, 10)]
    assert R.proportional_layout(2, [1, 1, 1]) == [(0, 1), (1, 1), (1, 2)]


def test_cost_table_program(capsys):
    R.main(["--n", "1200", "--clusters", "1", "2", "4", "--mbit", "8"])
    rows = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert [r["clusters"] for r in rows] == [1, 2, 4]
    one, two, four = rows
    assert one["multi_total_bytes"] == 0 and one["multi_s_pair_links"] == 0.0
    # Two clusters cut 1:2 and 1:2:3 -> cuts at 200, 400 and 600: four rings.
    assert two["rings"] == 4
    # Every plan moves the same total, 2 (C-1) / C of the model per cluster; multi-ring spreads it.
    for r in (two, four):
        C = r["clusters"]
        assert r["multi_total_bytes"] == r["one_total_bytes"] == 2 * (C - 1) * 1200 * 4
        assert r["one_max_node_bytes"] == 2 * (C - 1) * 1200 * 4 // C
        assert r["multi_max_node_bytes"] < r["one_max_node_bytes"]
        assert r["multi_s_pair_links"] < r["one_s_pair_links"] == pytest.approx(r["one_max_node_bytes"] / 1e6)
    with pytest.raises(ValueError, match="clusters must be in 1..4, got 5"):
        R.cost_table(10, [5], 1.0)
