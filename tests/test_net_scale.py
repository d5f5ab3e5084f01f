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


def silent_run(idle_timeout_s):
    """Three real peers, then four members that are admitted but never push and answer commits
    but no takeover's prepare; once the four have been silent for 4 s, a real peer (not the
    leader) is killed."""
    net = SimNet(params(iterations=400, idle_timeout_s=idle_timeout_s))
    net.start(3)
    assert net.run_until(lambda: len(net.peers["sim:1000"].log) >= 2, limit=30.0)
    silent = [net.join(f"sim:{2000 + i}", via="sim:1000") for i in range(4)]
    for p in silent:
        p.stall = 1e9  # their projected gradients never come
        p.promises = False
    assert net.run_until(lambda: all(p.state is not None and p.phase == P.MEMBER for p in silent), limit=net.now + 30)
    assert len(net.peers["sim:1000"].state.view.members) == 7
    net.run_until(lambda: False, limit=net.now + 4.0)
    net.kill("sim:1002")
    net.run_until(lambda: net.all_finished(), limit=net.now + 120)
    return net, silent


def test_members_that_never_push_are_removed_after_the_idle_timeout_so_a_lost_peer_is_survived():
    net, silent = silent_run(idle_timeout_s=2.0)
    survivors = [net.peers["sim:1000"], net.peers["sim:1001"]]
    assert [p.finished for p in survivors] == ["done", "done"], [p.events[-3:] for p in survivors]
    assert survivors[0].chain() == survivors[1].chain() and len(survivors[0].log) == 400
    assert all(p.phase == P.DROPPED for p in silent)  # removed from the view: they must rejoin
    assert {m.machine for m in survivors[0].state.view.members} <= {0, 1}


def test_without_the_idle_timeout_silent_members_hold_the_majority_and_a_lost_peer_ends_the_run():
    net, _ = silent_run(idle_timeout_s=None)  # the failure the idle timeout fixes
    survivors = [net.peers["sim:1000"], net.peers["sim:1001"]]
    assert [p.finished for p in survivors] == ["failed", "failed"]
    assert len(survivors[0].log) < 400


def test_joins_beyond_max_members_are_refused_and_a_rejoin_on_a_members_address_is_not():
    net = SimNet(params(max_members=4))
    net.start(3)
    assert net.run_until(lambda: len(net.peers["sim:1000"].log) >= 1, limit=30.0)
    leader = net.peers["sim:1000"]
    st = P.on_join(net.params, leader.state, P.JoinRequest(91, "sim:3000", "cfg"), net.now).state
    assert len(st.joins) == 1  # 3 members and 1 queued join: the cap
    with pytest.raises(P.Rejected) as e:
        P.on_join(net.params, st, P.JoinRequest(92, "sim:3001", "cfg"), net.now)
    assert e.value.code == "RESOURCE_EXHAUSTED" and "peers.max_members" in e.value.message
    # An inactive member restarted on its old address replaces itself: not refused by the cap.
    view = st.view._replace(members=tuple(m._replace(active=m.machine != 2) for m in st.view.members))
    again = P.on_join(net.params, st._replace(view=view), P.JoinRequest(93, "sim:1002", "cfg"), net.now).state
    assert len(again.joins) == 2
    # The simulated run admits one joiner and keeps the other out while the cap holds.
    net.join("sim:3000", via="sim:1000")
    net.join("sim:3001", via="sim:1000")
    assert net.run_until(lambda: all(p.finished for p in net.peers.values() if p.state is not None), limit=120.0)
    assert len(leader.state.view.members) == 4 and net.peers["sim:3001"].state is None
    assert net.admitted == [0, 1, 2, 3]


@pytest.mark.parametrize("bad", [dict(max_members=2), dict(max_members=5000), dict(idle_timeout_s=0.0)])
def test_bad_caps_are_refused_with_the_field_named(bad):
    with pytest.raises(ValueError, match=next(iter(bad))):
        params(**bad)


@pytest.mark.parametrize("peers, field", [({"count": 3, "max_members": 2}, "peers.max_members: 2 is below peers.count=3"),
                                          ({"max_members": 5000}, "peers.max_members: bad value 5000"),
                                          ({"idle_timeout_s": 0}, "peers.idle_timeout_s: bad value 0")])
def test_a_config_with_a_bad_cap_is_refused_in_one_line_naming_the_field(peers, field):
    from zeroth.config import load_config_dict

    with pytest.raises(ValueError, match=field):
        load_config_dict({"peers": peers})
    assert load_config_dict({"peers": {"count": 3}}).peers.idle_timeout_s == 120.0


def test_the_scale_harness_counts_every_call_and_its_wire_bytes():
    from zeroth.bench import peers as bench

    rows = [bench.measure(m, iterations=2, budget_s=60) for m in (4, 16)]
    for r, m in zip(rows, (4, 16), strict=True):
        assert r["ran"] and r["iterations"] == 2
        assert r["messages"] == m * (m - 1) + (m - 1)  # every member pushes to every other, one commit to each
        assert r["contributors"] == [m, m]
        # m - 1 pushes and the commit, each signed (the leader receives no commit)
        assert r["sig_checks_max"] == m and r["sig_checks_per_peer"] == ((m - 1) * m + m - 1) / m
        assert r["bytes_busiest"] <= r["bytes_all"] and r["c"] == r["bytes_busiest"] / m
        assert 2 * 0.1 / 4 < r["iteration_s"] < 3.0  # at least a round trip (medians 100 ms), well within the timeouts
    # A push is at least its 16 payload bytes, a 64-byte signature, a 32-byte chain digest and the call's framing.
    assert rows[0]["bytes_all"] > 12 * (16 + 64 + 32 + 58)
    text = bench.table(rows + [{"peers": 1024, "ran": False, "wall_s": 120.0}], 80.0)
    assert "1024  not run: its warm-up did not finish within the budget (120 s)" in text


def test_the_scale_harness_refuses_bad_arguments_in_one_line(capsys):
    from zeroth.bench import peers as bench

    assert bench.main(["--peers", "4,x"]) == 2
    assert "--peers must be comma-separated integers, got '4,x'" in capsys.readouterr().err
    assert bench.main(["--peers", "0"]) == 2
    assert bench.main(["--peers", "4", "--rtt-ms", "0"]) == 2
