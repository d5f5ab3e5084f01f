"""Just One Byte at scale, on the simulator: what each barrier kept and lost, silent members, the join cap.

The counters (:mod:`zeroth.net.counters`) are the same in a peer process, the simulator and
``zeroth verify``; here the simulator drives them with timings that make a push late on purpose.
"""

import pytest

from zeroth.net import protocol as P
from zeroth.net.counters import BarrierCounters, from_decisions
from zeroth.net.sim import SimNet


def params(**kw):
    base = dict(run_id="run", config_digest="cfg", bytes_per_value=1, max_count=4, iterations=12,
                iteration_timeout_s=1.0, barrier_timeout_s=0.5, founders=3)
    base.update(kw)
    return P.Params(**base)


def done(net):
    return [p for p in net.peers.values() if p.alive and p.finished == "done"]


def test_a_push_computed_too_late_is_counted_with_its_wasted_forward_passes_and_the_contributors():
    net = SimNet(params())
    net.start(3)
    assert net.run_until(lambda: all(p.log for p in net.peers.values() if p.address != "sim:1002")
                         and len(net.peers) == 3 and all(p.state is not None for p in net.peers.values()), limit=30.0)
    slow = net.peers["sim:1002"]
    at = len(net.peers["sim:1000"].log)  # the iteration being decided now
    slow.stall = 3.0  # past the barrier deadline (iteration timeout + barrier timeout = 1.5 s)
    assert net.run_until(lambda: len(net.peers["sim:1000"].log) > at + 1, limit=net.now + 10)
    slow.stall = 0.0
    assert net.run_until(lambda: net.all_finished(), limit=net.now + 60)
    fin = done(net)
    assert len(fin) == 3
    chains = {tuple(p.chain()) for p in fin}
    assert len(chains) == 1
    per = [len(c) for _, c, _ in fin[0].chain()]
    assert min(per) == 2 and max(per) == 3  # the slow peer missed at least one barrier, then came back
    # Every peer counts the contributors of every decision it applied, as its chain says.
    for p in fin:
        assert p.counters.contributors[-len(per):] == per
    # The slow peer's gradients of iterations decided without it were computed for nothing (it
    # computes no more while a computation is pending, so not every iteration it missed cost any).
    missed = sum(1 for _, c, _ in slow.chain() if slow.machines[0] not in {m for m, _ in c})
    late = slow.counters.totals["pushes_late"]
    assert 1 <= late <= missed
    assert slow.counters.totals["forward_passes_wasted"] == 2 * net.params.max_count * late
    assert slow.counters.totals["barrier_wait_s_total"] > 0
    on_time = [p for p in fin if p is not slow]
    assert all(p.counters.totals["pushes_late"] == 0 and p.counters.totals["forward_passes_wasted"] == 0 for p in on_time)
    # What the decisions alone show (zeroth verify): the barriers that went on without an active member.
    seen = from_decisions(fin[0].log)
    assert seen["contributors_per_iteration"] == per and seen["contributors_min"] == 2
    assert seen["missed_barrier"] >= 1 and seen["iterations_with_missed"] >= 1
    assert seen["forward_passes_applied"] == 2 * net.params.max_count * sum(per)


def test_a_push_that_arrives_after_the_decision_is_counted_as_late_where_it_arrives():
    net = SimNet(params(iterations=6))
    net.start(3)
    assert net.run_until(lambda: net.all_finished(), limit=60.0)
    leader, other = net.peers["sim:1000"], net.peers["sim:1001"]
    # A copy of a push of iteration 2 (decided long ago) delivered again: refused as stale.
    entry = leader.log[2]
    m, n = entry.commit.contributors[1]
    stale = P.Push("run", m, 2, n, entry.payloads[1], b"", entry.commit.previous)
    before = dict(leader.counters.totals)
    leader.state = leader.state._replace(phase=P.MEMBER)  # still taking pushes
    net._deliver(other, P.Send(leader.state.me, leader.address, stale))
    net.run_until(lambda: False, limit=net.now + 1.0)
    assert leader.counters.totals["late_pushes_received"] == before["late_pushes_received"] + 1
    assert other.counters.totals["late_pushes_received"] == 0


def test_counters_summary_has_the_contributors_and_totals():
    c = BarrierCounters()
    for t, who in enumerate([(0, 1, 2), (0, 1), (0, 1, 2)]):
        c.pushed(t, count=3, now=float(t))
        c.decided(t, contributors=who, me=2, now=t + 0.5)
    s = c.summary()
    assert s["contributors_per_iteration"] == [3, 2, 3]
    assert (s["contributors_min"], s["contributors_median"], s["contributors_max"]) == (2, 3, 3)
    assert s["pushes_late"] == 1 and s["forward_passes_wasted"] == 6 and s["barrier_wait_s_total"] == pytest.approx(1.5)
    c.pushed(1, count=3, now=9.0)  # computed after its iteration was applied: wasted at once
    assert c.summary()["forward_passes_wasted"] == 12
