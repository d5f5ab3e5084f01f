"""Just One Byte at scale, on the simulator: what each barrier kept and lost, silent members, the join cap.

The counters (:mod:`zeroth.net.counters`) are the same in a peer process, the simulator and
``zeroth verify``; here the simulator drives them with timings that make a push late on purpose.
"""

import dataclasses

import pytest

from zeroth.net import protocol as P
from zeroth.net.counters import BarrierCounters, from_decisions
from zeroth.net.sim import SimNet

from test_net_protocol import finished as done
from test_net_protocol import params as _protocol_params


def params(**kw):
    return _protocol_params(**{"iterations": 12, **kw})


def test_a_push_computed_too_late_is_counted_with_its_wasted_forward_passes_and_the_contributors():
    net = SimNet(params())
    net.start(3)
    assert net.run_until(
        lambda: (
            all(p.log for p in net.peers.values() if p.address != "sim:1002")
            and len(net.peers) == 3
            and all(p.state is not None for p in net.peers.values())
        ),
        limit=30.0,
    )
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
        assert p.counters.contributors[-len(per) :] == per
    # The slow peer's gradients of iterations decided without it were computed for nothing (it
    # computes no more while a computation is pending, so not every iteration it missed cost any).
    missed = sum(1 for _, c, _ in slow.chain() if slow.machines[0] not in {m for m, _ in c})
    late = slow.counters.totals["pushes_late"]
    assert 1 <= late <= missed
    assert slow.counters.totals["forward_passes_wasted"] == 2 * net.params.max_count * late
    assert slow.counters.totals["barrier_wait_s_total"] > 0
    on_time = [p for p in fin if p is not slow]
    assert all(
        p.counters.totals["pushes_late"] == 0 and p.counters.totals["forward_passes_wasted"] == 0 for p in on_time
    )
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


@pytest.mark.parametrize(
    "bad", [dict(max_members=2), dict(max_members=5000), dict(idle_timeout_s=0.0), dict(measured_timeouts=1.5)]
)
def test_bad_caps_are_refused_with_the_field_named(bad):
    with pytest.raises(ValueError, match=next(iter(bad))):
        params(**bad)


@pytest.mark.parametrize(
    "peers, field",
    [
        ({"count": 3, "max_members": 2}, "peers.max_members: 2 is below peers.count=3"),
        ({"max_members": 5000}, "peers.max_members: bad value 5000"),
        ({"idle_timeout_s": 0}, "peers.idle_timeout_s: bad value 0"),
        ({"measured_timeouts": 1.5}, "peers.measured_timeouts: 1.5 is below 2"),
    ],
)
def test_a_config_with_a_bad_cap_is_refused_in_one_line_naming_the_field(peers, field):
    from zeroth.config import load_config_dict

    with pytest.raises(ValueError, match=field):
        load_config_dict({"peers": peers})
    assert load_config_dict({"peers": {"count": 3}}).peers.idle_timeout_s == 120.0


def test_the_scale_harness_counts_every_call_and_its_wire_bytes():
    from zeroth.bench import peers as bench

    rows = [bench.measure(m, iterations=2, budget_s=60, call_slots=16, whole_commits=True) for m in (4, 16)]
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
    text = bench.table(rows + [{"peers": 1024, "ran": False, "wall_s": 300.0, "cpu_s": 120.0}], 80.0)
    assert "1024  not run: its warm-up did not finish within the budget (120 s of CPU)" in text


def test_the_scale_harness_refuses_bad_arguments_in_one_line(capsys):
    from zeroth.bench import peers as bench

    assert bench.main(["--peers", "4,x"]) == 2
    assert "--peers must be comma-separated integers, got '4,x'" in capsys.readouterr().err
    assert bench.main(["--peers", "0"]) == 2
    assert bench.main(["--peers", "4", "--rtt-ms", "0"]) == 2


def _view(n, t=4, inactive=()):
    return P.View(
        t, tuple(P.Member(i, f"10.0.0.{i}:7000", i not in inactive, bytes([i % 256]) * 32) for i in range(n)), n
    )


def _commit(base, contributors, next_view):
    return P.Commit(
        "run", 0, base.iteration, P.Ballot(0, 0), tuple(contributors), b"d" * 32, next_view, b"s" * 64, b"p" * 32
    )


def test_a_commit_sent_as_a_delta_of_its_view_is_rebuilt_exactly_and_costs_the_same_bytes_at_any_size():
    from zeroth.net import wire

    sizes = []
    for n in (10, 1000):
        base = _view(n)
        same = _commit(base, [(i, 4) for i in range(n)], base._replace(iteration=base.iteration + 1))
        msg = wire.commit_to_pb(same, base, 4)
        assert msg.HasField("delta") and not msg.contributors and not msg.HasField("next_view")
        assert wire.commit_from_pb(msg, base, 4) == same
        sizes.append(msg.ByteSize())
        assert wire.commit_to_pb(same).ByteSize() > 40 * n  # whole: every member's address and key
    assert sizes[1] - sizes[0] <= 1  # the next id: one more varint byte
    # Every kind of change: an active member absent, an inactive one contributing, a count below the
    # most, a member removed, one admitted, one turned inactive.
    base = _view(6, inactive=(4,))
    members = [m for m in base.members if m.machine != 5]
    members[2] = members[2]._replace(active=False)
    nxt = P.View(5, (*members, P.Member(6, "10.0.0.6:7000", False, b"\x06" * 32)), 7)
    c = _commit(base, [(0, 4), (1, 2), (3, 4), (4, 4)], nxt)
    msg = wire.commit_to_pb(c, base, 4)
    d = msg.delta
    assert (list(d.absent), [(x.machine, x.count) for x in d.other], list(d.removed)) == ([2, 5], [(1, 2), (4, 4)], [5])
    assert [x.machine for x in d.changed] == [2, 6]  # turned inactive, admitted
    assert wire.commit_from_pb(msg, base, 4) == c
    assert wire.commit_from_pb(wire.pb.Commit.FromString(msg.SerializeToString()), base, 4) == c


def test_an_unchanged_membership_arrives_as_the_receivers_own_members_and_a_changed_one_is_checked():
    """A delta that changes no member rebuilds the next view on the receiver's very tuple of members,
    which its checks then skip (O(1) a commit while the membership holds); any other next view is
    checked member by member, and an impossible next id is refused either way."""
    from zeroth.net import wire

    base = _view(6)
    same = _commit(base, [(i, 4) for i in range(6)], base._replace(iteration=5))
    got = wire.commit_from_pb(wire.commit_to_pb(same, base, 4), base, 4)
    assert got == same and got.next_view.members is base.members
    P._check_commit(P.Params("run", "c", 1, 4, 100, 1.0, 1.0), got, base)
    params = P.Params("run", "c", 1, 4, 100, 1.0, 1.0)
    bad = (*base.members[:5], base.members[5]._replace(address="no-port"))
    with pytest.raises(P.Rejected, match="no-port"):
        P._check_commit(params, same._replace(next_view=P.View(5, bad, 6)), base)
    with pytest.raises(P.Rejected, match="next_machine_id 3 must exceed every member id"):
        P._check_commit(params, same._replace(next_view=P.View(5, base.members, 3)), base)
    # The committer hands its own tuple on when nobody joined, left or changed activity.
    st = P.PeerState(
        0,
        P.MEMBER,
        4,
        base,
        0.0,
        10.0,
        0,
        P.Inbox(),
        {},
        {},
        frozenset(),
        None,
        (),
        {},
        frozenset(),
        frozenset(),
        False,
        {},
        -1,
        None,
        0,
        0.0,
    )
    for m in range(6):
        st = st._replace(inbox=st.inbox.put((4, m), P.Push("run", m, 4, 4, b"\x01" * 4, b"", b"")))
    entry, _ = P._decide(params, st, P.Ballot(0, 0), frozenset(range(6)), frozenset(range(6)), 0.0)
    assert entry.commit.next_view.members is base.members


def test_a_runs_first_decision_travels_as_a_delta_like_every_later_one():
    """The commit of a run's first iteration goes to each member as a delta of the view it was
    decided in, as every later one does: the committer's bytes for it are those of any other
    iteration, not O(M) bytes to each of M members (61 MB instead of 1 MB at 1,024 members)."""
    from zeroth.bench import peers as bench

    m = 64
    net = bench.WanNet(
        params(pushes="leader", relay_fanout=8, founders=m, iterations=4, max_members=m),
        rtt_s=0.1,
        uplink_bps=20e6,
        seed=0,
        call_slots=None,
        tick=0.05,
    )
    net.start(m)
    assert net.run_until(lambda: net.all_finished(), limit=60.0)
    first, second = (net.sent[t]["sim:1000"] for t in (0, 1))
    assert first < 1.2 * second, (first, second)


def test_a_delta_commit_needs_the_receivers_view_and_a_malformed_one_is_refused():
    from zeroth.net import wire

    base = _view(4)
    c = _commit(base, [(0, 4), (1, 4)], base._replace(iteration=5))
    msg = wire.commit_to_pb(c, base, 4)
    for other in (None, _view(4, t=3), _view(4, inactive=(3,))):  # none, another iteration's, another view
        with pytest.raises(wire.NoBase):
            wire.commit_from_pb(msg, other, 4)
    assert wire.commit_from_pb(wire.commit_to_pb(c), None, 4) == c  # a whole commit needs nothing
    # Not the view of its iteration: sent whole.
    assert not wire.commit_to_pb(c, _view(4, t=3), 4).HasField("delta")
    bad = wire.pb.Commit()
    bad.CopyFrom(msg)
    bad.delta.absent.append(9)
    with pytest.raises(P.Rejected, match="machine 9 is absent but not an active member"):
        wire.commit_from_pb(bad, base, 4)
    bad.CopyFrom(msg)
    bad.delta.removed.append(9)
    with pytest.raises(P.Rejected, match="removes machine 9, not a member"):
        wire.commit_from_pb(bad, base, 4)
    bad.CopyFrom(msg)
    bad.contributors.add(machine=1, count=4)
    with pytest.raises(P.Rejected, match="no contributors or next_view of its own"):
        wire.commit_from_pb(bad, base, 4)


def test_a_commit_answered_send_whole_is_sent_again_whole_and_a_failed_one_is_retried_as_it_went():
    import grpc

    from zeroth.net import runtime
    from zeroth.net.proto import peer_pb2 as pb

    class Sender:
        def __init__(self):
            self.sent, self.events = [], []
            self._stop = __import__("threading").Event()

        def _send_async(self, inc, eff, attempt=0, whole=False):
            self.sent.append((attempt, whole))

        def _event(self, inc, fn, **kw):
            self.events.append(fn.__name__)

    base = _view(3)
    eff = P.Send(1, "10.0.0.1:7000", _commit(base, [(0, 4)], base._replace(iteration=5)))
    s = Sender()
    runtime.Node._answered(s, 1, eff, 0, False, pb.CommitAck(send_whole=True), None)
    assert s.sent == [(0, True)] and s.events == []
    runtime.Node._answered(s, 1, eff, 0, True, pb.CommitAck(), None)
    assert s.events == ["on_commit_acked"]

    class Unavailable(grpc.RpcError):
        def code(self):
            return grpc.StatusCode.UNAVAILABLE

        def details(self):
            return "gone"

    runtime.Node._answered(s, 1, eff, 1, True, None, Unavailable())
    assert s.sent[-1] == (2, True)  # retried, still whole
    runtime.Node._answered(s, 1, eff, 2, True, None, Unavailable())
    assert s.events[-1] == "on_commit_failed"


# --------------------------------------------------------------------------- pushes to the leader
#
# peers.pushes: leader. A member sends its push to the committer only, which relays the payloads
# and their authors' signatures inside its commit: 2·(M−1) messages an iteration instead of
# M·(M−1) + (M−1), the same decisions, every payload still checked against its author's key.


def test_pushes_to_the_leader_cost_two_messages_a_member_and_decide_with_everyone():
    from zeroth.bench import peers as bench

    for m in (4, 16):
        r = bench.measure(m, iterations=2, budget_s=60, pushes="leader")
        assert r["ran"] and r["contributors"] == [m, m]
        assert r["messages"] == 2 * (m - 1)  # a push to the leader, a commit back, per member
        # every member checks the commit and each of the m payloads' signatures
        assert r["sig_checks_max"] == m + 1
    net = SimNet(params(pushes="leader", founders=5))
    net.start(5)
    assert net.run_until(lambda: net.all_finished(), limit=60.0)
    fin = done(net)
    assert len(fin) == 5
    assert len({tuple(p.chain()) for p in fin}) == 1
    assert all(len(c) == 5 for _, c, _ in fin[0].chain())


def test_with_pushes_to_the_leader_a_killed_leader_is_replaced_and_its_iteration_keeps_the_pushes():
    net = SimNet(params(pushes="leader", founders=4))
    net.start(4)
    assert net.run_until(lambda: all(p.state is not None and p.state.it >= 4 for p in net.peers.values()), limit=30.0)
    leader = net.peers["sim:1000"]
    leader.stall = 30.0  # from its next iteration on, it takes the pushes, then never decides
    t = leader.state.it + 1
    assert net.run_until(lambda: {(t, m) for m in (1, 2, 3)} <= set(leader.state.inbox), limit=net.now + 5)
    net.kill("sim:1000")
    assert net.run_until(lambda: net.all_finished(), limit=net.now + 120)
    fin = done(net)
    assert len(fin) == 3
    chains = {tuple(p.chain()) for p in fin}
    assert len(chains) == 1
    # The takeover decided the leader's last iteration from the pushes its promises carried.
    decided = {e.commit.iteration: e for e in fin[0].log}
    assert {m for m, _ in decided[t].commit.contributors} == {1, 2, 3}
    assert decided[t].commit.ballot.round >= 1


def _relay_case():
    """Machine 1 of a signed run of 3 members at iteration t, and the signed decision of t by the
    leader 0 with the payloads of 0 and 2, which machine 1 never received as pushes."""
    from test_net_protocol import KEYS, signed, signed_member, signed_view

    pp, st = signed_member(me=1)
    pp = dataclasses.replace(pp, pushes="leader")
    t = st.it
    pushes = [signed(m, P.Push("run", m, t, 2, bytes([m, m]), previous=st.chain or b"")) for m in (0, 2)]
    contrib = tuple((p.sender, p.count) for p in pushes)
    payloads = tuple(p.payload for p in pushes)
    commit = signed(
        0,
        P.Commit(
            "run",
            0,
            t,
            P.Ballot(0, 0),
            contrib,
            P.updates_digest(contrib, payloads),
            signed_view(t + 1),
            previous=st.chain or b"",
        ),
    )
    return pp, st, commit, payloads, tuple(p.signature for p in pushes), KEYS


def test_a_relayed_decision_is_applied_only_with_every_payload_signed_by_its_author():
    pp, st, commit, payloads, sigs, keys = _relay_case()
    t = st.it
    step = P.on_commit(pp, st, commit, 10.0, payloads=payloads, signatures=sigs)
    applied = [e for e in step.effects if isinstance(e, P.Apply)]
    assert step.state.it == t + 1 and len(applied) == 1 and applied[0].entry.payloads == payloads
    assert applied[0].entry.signatures == sigs
    # A relayed payload signed by another member's key, a payload changed, a signature missing: the
    # commit is held, the relay is not taken, and the payloads are fetched.
    forged = (sigs[0], keys[0].sign(P.signed_bytes(P.Push("run", 2, t, 2, payloads[1], previous=st.chain or b""))))
    changed = (payloads[0], b"\x00\x00")
    for bad_payloads, bad_sigs in ((payloads, forged), (changed, sigs), (payloads, sigs[:1])):
        step = P.on_commit(pp, st, commit, 10.0, payloads=bad_payloads, signatures=bad_sigs)
        assert step.state.it == t and step.reply.stored
        assert any(isinstance(e, P.Fetch) for e in step.effects)
        notes = [e.text for e in step.effects if isinstance(e, P.Note)]
        assert any("relayed pushes not taken" in n for n in notes), notes


def test_a_relay_forwards_down_the_order_it_was_sent_and_its_next_push_reports_how_long_it_took():
    pp, st, commit, payloads, sigs, _ = _relay_case()
    pp = dataclasses.replace(pp, relay_fanout=1)
    t = st.it
    # relays (1,): the tree is 0 -> 1 -> 2, so machine 1 forwards to 2, with the same order
    step = P.on_commit(pp, st, commit, 10.0, payloads=payloads, signatures=sigs, relays=(1,))
    sent = [e for e in step.effects if isinstance(e, P.Send)]
    assert [(e.machine, type(e.message)) for e in sent] == [(2, P.LogEntry)]
    assert sent[0].message.relays == (1,) and sent[0].message.payloads == payloads
    assert step.state.decided[t].relays == ()  # what is held and logged carries no order
    # relays (2,): the tree is 0 -> 2 -> 1, machine 1 a leaf
    leaf = P.on_commit(pp, st, commit, 10.0, payloads=payloads, signatures=sigs, relays=(2,))
    assert not [e for e in leaf.effects if isinstance(e, P.Send)] and leaf.state.relay_us == 0
    # machine 2 answers 250 ms later: 250,000 us per child, reported (unsigned) in the next push
    st = P.on_commit_acked(pp, step.state, iteration=t, machine=2, now=10.25, reply=P.CommitReply(True)).state
    assert st.relay_us == 250_000
    push = P.on_local_gradients(pp, st, iteration=t + 1, count=2, payload=b"\x01\x02", now=10.3)
    (out,) = [e.message for e in push.effects if isinstance(e, P.Send)]
    assert out.relay_us == 250_000
    assert P.signed_bytes(out) == P.signed_bytes(out._replace(relay_us=0))  # a hint outside the signature


def test_a_relay_checks_and_forwards_each_part_as_it_comes_and_applies_once_all_are_in():
    """``Params.relay_parts``: a part of the payloads (from contributor ``first``) is checked against
    its authors' keys and forwarded at once, before the others arrive; the decision is applied
    when every part is in; a forged part is neither forwarded nor held."""
    pp, st, commit, payloads, sigs, keys = _relay_case()
    pp = dataclasses.replace(pp, relay_fanout=1, relay_parts=2)
    t = st.it
    # the tree 0 -> 1 -> 2: machine 1 forwards to 2; the second part comes first
    step = P.on_commit(pp, st, commit, 10.0, payloads=payloads[1:], signatures=sigs[1:], relays=(1,), first=1)
    sent = [e.message for e in step.effects if isinstance(e, P.Send)]
    assert [(m.first, m.payloads, m.relays) for m in sent] == [(1, payloads[1:], (1,))]
    assert step.state.it == t and step.reply.stored and not any(isinstance(e, P.Apply) for e in step.effects)
    again = P.on_commit(pp, step.state, commit, 10.1, payloads=payloads[1:], signatures=sigs[1:], relays=(1,), first=1)
    assert not [e for e in again.effects if isinstance(e, P.Send)]  # a part again: not forwarded twice
    done = P.on_commit(pp, again.state, commit, 10.2, payloads=payloads[:1], signatures=sigs[:1], relays=(1,), first=0)
    assert [(e.message.first, e.message.payloads) for e in done.effects if isinstance(e, P.Send)] == [(0, payloads[:1])]
    (applied,) = [e.entry for e in done.effects if isinstance(e, P.Apply)]
    assert (applied.payloads, applied.signatures, done.state.it, done.state.parts) == (payloads, sigs, t + 1, {})
    # A part that runs past the contributors: not taken.
    stray = P.on_commit(pp, st, commit, 10.0, payloads=payloads, signatures=sigs, relays=(1,), first=1)
    assert stray.state.it == t and any(
        "a relayed part not taken" in e.text for e in stray.effects if isinstance(e, P.Note)
    )
    # A part signed by another member's key: a note, nothing forwarded, nothing held.
    forged = keys[0].sign(P.signed_bytes(P.Push("run", 2, t, 2, payloads[1], previous=st.chain or b"")))
    bad = P.on_commit(pp, st, commit, 10.0, payloads=payloads[1:], signatures=(forged,), relays=(1,), first=1)
    assert not [e for e in bad.effects if isinstance(e, P.Send)] and bad.state.parts == {}
    assert any("a relayed part not taken" in e.text for e in bad.effects if isinstance(e, P.Note))
    with pytest.raises(P.Rejected, match="relayed part from contributor"):
        from zeroth.net import wire

        wire.relay_first_from_pb(wire.pb.Commit(relay_first=P.MAX_MEMBERS))


def test_relayed_parts_give_the_same_decisions_and_shorten_a_hop_over_like_uplinks():
    """The committer sends the relays their parts one after another and each relay forwards a part
    before the next arrives: the same decisions as one relay of everything, and over uplinks alike
    (100 ms round trips, 20 Mbit/s) an iteration of 256 members takes a part's upload per hop
    instead of the whole."""
    from zeroth.bench import peers as bench

    runs = []
    for parts in (1, 3):
        net = SimNet(params(pushes="leader", relay_fanout=3, relay_parts=parts, founders=20))
        net.start(20)
        assert net.run_until(lambda: net.all_finished(), limit=120.0)
        fin = done(net)
        assert len(fin) == 20 and len({tuple(p.chain()) for p in fin}) == 1
        runs.append(fin[0].chain())
    assert runs[0] == runs[1] and all(len(c) == 20 for _, c, _ in runs[0][:-1])
    whole, parts = (
        bench.measure(256, iterations=2, warmup=2, pushes="leader", relay_fanout=8, relay_parts=k, spread=0.0)
        for k in (1, 4)
    )
    assert whole["contributors"] == parts["contributors"] == [256, 256]
    assert parts["iteration_s"] < 0.9 * whole["iteration_s"], (parts["iteration_s"], whole["iteration_s"])
    assert parts["c"] < 1.1 * whole["c"]  # each part's call repeats the commit: a few percent more bytes


def test_the_leader_puts_the_fastest_relays_where_the_tree_forwards_and_the_wan_iteration_gets_shorter(
    monkeypatch,
):
    from zeroth.bench import peers as bench

    v = P.View(3, tuple(P.Member(m, f"h:{m}", True) for m in range(10)), 10)
    p = params(pushes="leader", relay_fanout=3)
    # 9 members below the root: positions 0 and 1 forward (to 3..5 and 6..8); unknown (0) ranks at
    # the median of the known, a member that did not push (no report) last
    reports = {1: 0, 2: 50, 3: 900, 4: 10, 5: 0, 6: 700, 7: 300, 8: 20}
    assert P.relay_order(p, v, 0, reports) == (4, 8)
    assert P.relay_order(p, v, 0, {}) == (1, 2)
    assert [m.machine for m in P.relay_children(p, v, 0, 0, (4, 8))] == [4, 8, 1]
    # Over the simulated WAN (64 members, fan-out 8) the order learnt from the relays' reports
    # shortens the iteration against the tree in id order.
    learnt = bench.measure(64, iterations=3, warmup=12, pushes="leader", relay_fanout=8, budget_s=120)
    monkeypatch.setattr(P, "relay_order", lambda *a: ())
    by_id = bench.measure(64, iterations=3, warmup=12, pushes="leader", relay_fanout=8, budget_s=120)
    assert learnt["contributors"] == by_id["contributors"] == [64, 64, 64]
    assert learnt["iteration_s"] < 0.9 * by_id["iteration_s"], (learnt["iteration_s"], by_id["iteration_s"])


def test_relayed_payloads_travel_beside_the_commit_and_an_oversized_relay_is_refused():
    from zeroth.net import wire

    pp, st, commit, payloads, sigs, _ = _relay_case()
    entry = P.LogEntry(commit, payloads, sigs)
    msg = wire.relay_to_pb(wire.commit_to_pb(commit), entry)
    again = wire.pb.Commit.FromString(msg.SerializeToString())
    assert wire.commit_from_pb(again) == commit
    assert wire.relay_from_pb(again) == (payloads, sigs)
    assert wire.relay_from_pb(wire.commit_to_pb(commit)) == (None, None)
    assert wire.relay_order_from_pb(wire.relay_to_pb(wire.commit_to_pb(commit), entry._replace(relays=(2, 1)))) == (
        2,
        1,
    )
    big = wire.pb.Commit()
    big.CopyFrom(msg)
    big.relayed_signatures[0] = b"x" * 65
    with pytest.raises(P.Rejected, match="relayed signature"):
        wire.relay_from_pb(big)
    big.relayed_payloads.extend([b""] * P.MAX_MEMBERS)
    with pytest.raises(P.Rejected, match="relays more than"):
        wire.relay_from_pb(big)
    big.relay_order.extend(range(P.MAX_MEMBERS + 1))
    with pytest.raises(P.Rejected, match="a relay order of"):
        wire.relay_order_from_pb(big)


def test_the_relay_tree_bounds_what_any_peer_sends_and_a_dead_relay_costs_its_children_a_fetch():
    from zeroth.bench import peers as bench

    m, k = 16, 4
    direct = bench.measure(m, iterations=2, budget_s=60, pushes="leader")
    tree = bench.measure(m, iterations=2, budget_s=60, pushes="leader", relay_fanout=k)
    assert tree["ran"] and tree["contributors"] == [m, m]
    # a push and a commit per member, and one relay to each member below the leader's k children
    assert tree["messages"] == 2 * (m - 1) + (m - 1 - k)
    assert tree["bytes_busiest"] < direct["bytes_busiest"] / 1.5
    # Machine 1 relays to machines 5 to 8; killed, its children get the commit alone, wait a
    # barrier timeout for the relay, fetch the payloads, and the run goes on in agreement.
    net = SimNet(params(pushes="leader", relay_fanout=k, founders=9))
    net.start(9)
    assert net.run_until(lambda: all(p.state is not None and p.state.it >= 3 for p in net.peers.values()), limit=30.0)
    net.kill("sim:1001")
    assert net.run_until(lambda: net.all_finished(), limit=net.now + 120)
    fin = done(net)
    assert len(fin) == 8
    assert len({tuple(p.chain()) for p in fin}) == 1
    assert all(len(c) == 8 for _, c, _ in fin[0].chain()[-3:])


def _cut_and_time(measured: float, victim: str) -> tuple[float, SimNet]:
    """8 members, pushes to the leader down a tree of 4, 20 ms each way: the seconds the run takes
    for 3 decisions once ``victim`` is cut off (silent, not refused: its timeouts are what end it)."""
    net = SimNet(
        params(
            founders=8,
            iterations=40,
            iteration_timeout_s=3.0,
            barrier_timeout_s=2.0,
            pushes="leader",
            relay_fanout=4,
            measured_timeouts=measured,
        ),
        latency=0.02,
        tick=0.01,
    )
    net.start(8)
    watch = net.peers["sim:1001"] if victim == "sim:1000" else net.peers["sim:1000"]
    assert net.run_until(lambda: len(watch.log) >= 12, limit=60.0)
    t0, at = net.now, len(watch.log)
    net.partition([victim], [a for a in net.peers if a != victim])
    assert net.run_until(lambda: len(watch.log) >= at + 3, limit=net.now + 60)
    return net.now - t0, net


@pytest.mark.parametrize("victim", ["sim:1005", "sim:1000"], ids=["silent-member", "lost-leader"])
def test_measured_timeouts_end_a_silent_member_or_a_lost_leader_in_a_few_iterations_time(victim):
    fixed, _ = _cut_and_time(0.0, victim)
    measured, net = _cut_and_time(4.0, victim)
    # fixed: the barrier waits the iteration and barrier timeouts (5 s), a takeover 3 s + 2 x 2 s
    assert fixed > 5.0
    assert measured < fixed / 3, (measured, fixed)
    assert net.run_until(
        lambda: all(p.finished for p in net.peers.values() if p.address != victim), limit=net.now + 200
    )
    assert len({tuple(p.chain()) for p in net.peers.values() if p.address != victim}) == 1
