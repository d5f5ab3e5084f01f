"""Peers over real gRPC on 127.0.0.1, in this process: authentication, bad messages, TLS, repair.

A small run (digits, a tiny MLP) keeps going in the background while requests that are
unauthenticated, malformed, stale, duplicated or oversized are thrown at a member; each must
get a clear status and the run must go on with every digest in agreement.
"""

import dataclasses
import threading
import time
from concurrent import futures

import grpc
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from zeroth import replay, schedules, zo
from zeroth.config import apply_overrides, load_config_dict
from zeroth.net import launch, wire
from zeroth.transport import channels, identity, security
from zeroth.net import protocol as P
from zeroth.net.chaos import HostileMember
from zeroth.net.proto import peer_pb2 as pb
from zeroth.net.proto import peer_pb2_grpc as pb_grpc
from zeroth.net.runtime import Node, NodeOptions
from zeroth.net.work import Worker, padded_size
from zeroth.train.metrics import read_metrics

TOKEN = "test-token-0123"


def config(iterations, **peers):
    p = dict(
        count=2,
        inferences_per_iteration=4,
        iteration_timeout_s=3.0,
        barrier_timeout_s=2.0,
        iterations=iterations,
        token=TOKEN,
    )
    p.update(peers)
    return load_config_dict(
        {
            "run": {"name": "grpc-test", "seed": 3},
            "data": {"dataset": "digits", "batch_size": 32, "eval_size": 200},
            "model": {"name": "mlp", "kwargs": {"hidden": [16]}},
            "train": {"lr": 0.05, "eps": 1e-3, "codec": "onebyte", "eval_every": 1000},
            "peers": p,
        }
    )


@pytest.fixture(scope="module")
def worker():
    return Worker(config(10))


def start_nodes(cfg, worker, tmp_path, n, **options):
    first = Node(
        cfg,
        NodeOptions(out_dir=str(tmp_path / "p0"), founders=n, secret=cfg.peers.token, log=False, **options),
        worker=worker,
    )
    nodes = [first]
    address = first.start()
    for i in range(1, n):
        node = Node(
            cfg,
            NodeOptions(out_dir=str(tmp_path / f"p{i}"), join=(address,), secret=cfg.peers.token, log=False, **options),
            worker=worker,
        )
        node.start()
        nodes.append(node)
    return nodes


def run_alone(node, timeout=60.0):
    """Start ``node`` and wait for it to finish (stopped whatever happens)."""
    node.start()
    try:
        assert node.wait(timeout)
    finally:
        node.stop()


def wait_for(cond, timeout=120.0):
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if cond():
            return True
        time.sleep(0.05)
    return False


@pytest.fixture(scope="module")
def running(worker, tmp_path_factory):
    """Two peers in an endless run (stopped at teardown); decoded projected gradients clipped to 8."""
    cfg = config(10**6, clip=8.0)
    nodes = start_nodes(cfg, worker, tmp_path_factory.mktemp("running"), 2)
    assert wait_for(lambda: all(n.applied >= 3 for n in nodes))
    yield nodes
    for n in nodes:
        n.stop()


@pytest.fixture(scope="module")
def hostile(running):
    """A client holding valid credentials for ONE member: it joined with the secret and its own key."""
    h = HostileMember(secret=TOKEN, config_digest=running[0].join_digest)
    h.join(running[0].address)
    assert wait_for(lambda: all(h.machine in n.status_view().ids() for n in running))
    yield h
    h.close()


ACCESS = identity.access_token(TOKEN)


def stub(node, token=ACCESS):
    channel = grpc.insecure_channel(node.address)
    metadata = security.token_metadata(token)
    return pb_grpc.PeerStub(channel), metadata


def status_of(call):
    try:
        call()
    except grpc.RpcError as e:
        return e.code(), e.details()
    return grpc.StatusCode.OK, ""


def run_id(node):
    return node.status()["run_id"]


def test_a_peer_without_the_token_is_refused(running):
    member = running[1]
    for token in (None, "wrong", TOKEN):  # the secret itself is not the access token either
        s, md = stub(member, token)
        req = pb.GradientPush(run_id=run_id(member), sender=0, iteration=member.applied, count=1, payload=b"\x80")
        code, details = status_of(lambda: s.PushGradients(req, metadata=md, timeout=10))
        assert code == grpc.StatusCode.UNAUTHENTICATED and "token" in details
        code, _ = status_of(
            lambda: s.Join(
                pb.JoinRequest(config_digest=member.join_digest, address="127.0.0.1:9"), metadata=md, timeout=10
            )
        )
        assert code == grpc.StatusCode.UNAUTHENTICATED
        code, _ = status_of(lambda: list(s.FetchState(pb.StateRequest(run_id=run_id(member)), metadata=md, timeout=10)))
        assert code == grpc.StatusCode.UNAUTHENTICATED
        code, _ = status_of(lambda: s.Status(pb.StatusRequest(), metadata=md, timeout=10))
        assert code == grpc.StatusCode.UNAUTHENTICATED  # not even the run id for outsiders


REFUSALS = {
    grpc.StatusCode.INVALID_ARGUMENT,
    grpc.StatusCode.FAILED_PRECONDITION,
    grpc.StatusCode.PERMISSION_DENIED,
    grpc.StatusCode.OUT_OF_RANGE,
    grpc.StatusCode.ALREADY_EXISTS,
    grpc.StatusCode.UNAUTHENTICATED,
}


@settings(max_examples=30, deadline=None)
@given(
    run=st.sampled_from(["own", "other", ""]),
    sender=st.integers(0, 2**32 - 1),
    offset=st.integers(-3, 3),
    count=st.integers(0, 2**32 - 1),
    payload=st.binary(max_size=10),
)
def test_garbage_pushes_get_a_clear_status(running, run, sender, offset, count, payload):
    member = running[1]
    s, md = stub(member)
    rid = run_id(member) if run == "own" else run
    req = pb.GradientPush(
        run_id=rid, sender=sender, iteration=max(0, member.applied + offset), count=count, payload=payload
    )
    code, details = status_of(lambda: s.PushGradients(req, metadata=md, timeout=10))
    assert code in REFUSALS and details  # unsigned: never accepted, whatever it claims


def test_a_member_cannot_speak_for_another(running, hostile):
    """Valid credentials for one member (machine h) do not let it speak for machines 0 and 1."""
    leader, member = running
    before = [dict(n.counters) for n in running]
    t = member.status()["iteration"]
    view = member.status_view()
    for victim in (0, 1):
        target = running[1 - victim].address
        assert (
            hostile.send(target, "PushGradients", hostile.push(victim, iteration=t, payload=b"\xff" * 4))[0]
            == "UNAUTHENTICATED"
        )
        forged = hostile.commit(victim, iteration=t - 1, ballot=P.Ballot(0, victim), view=view._replace(iteration=t))
        assert hostile.send(target, "CommitIteration", forged)[0] == "UNAUTHENTICATED"
        assert hostile.send(target, "Leave", hostile.leave(victim, iteration=t))[0] == "UNAUTHENTICATED"
        assert hostile.send(target, "Prepare", hostile.prepare(victim, iteration=t, round=1))[0] == "UNAUTHENTICATED"
        rid = hostile.run_id
        check = hostile.signed(
            "Checksum", pb.ChecksumRequest(run_id=rid, sender=victim, iteration=t, digest=b"\x01" * 32)
        )
        assert hostile.send(target, "Checksum", check)[0] == "UNAUTHENTICATED"
        manifest = hostile.signed("GetManifest", pb.ManifestRequest(run_id=rid, sender=victim))
        assert hostile.send(target, "GetManifest", manifest)[0] == "UNAUTHENTICATED"
        state = hostile.signed(
            "FetchState", pb.StateRequest(run_id=rid, sender=victim, iteration=0, offset=0, length=8)
        )
        assert hostile.send(target, "FetchState", state)[0] == "UNAUTHENTICATED"
        log = hostile.signed(
            "FetchLog", pb.FetchLogRequest(run_id=rid, sender=victim, first_iteration=t - 1, last_iteration=t)
        )
        assert hostile.send(target, "FetchLog", log)[0] == "UNAUTHENTICATED"
        # A join naming a live member's address is refused: it would evict that member.
        code, details = hostile.send(leader.address, "Join", hostile.join_request(running[victim].address))
        assert code == "ALREADY_EXISTS", details
    unsigned = pb.StateRequest(run_id=hostile.run_id, sender=0, iteration=0, offset=0, length=8)
    assert hostile.send(member.address, "FetchState", unsigned)[0] == "UNAUTHENTICATED"
    # Its own identity works where the rules allow it: a signed state request as itself.
    own = hostile.signed("GetManifest", pb.ManifestRequest(run_id=hostile.run_id, sender=hostile.machine))
    assert hostile.send(member.address, "GetManifest", own)[0] == "OK"
    # ... but a replayed one (same sequence number) is refused.
    assert hostile.send(member.address, "GetManifest", own)[0] == "UNAUTHENTICATED"
    outsider = HostileMember(secret="not-the-secret", config_digest=leader.join_digest)
    try:
        outsider.token = identity.access_token(TOKEN)  # even with the access token, joining needs the secret
        outsider.metadata = security.token_metadata(outsider.token)
        code, details = outsider.send(leader.address, "Join", outsider.join_request(outsider.address))
        assert code == "UNAUTHENTICATED" and "secret" in details
    finally:
        outsider.close()
    for n, b in zip(running, before, strict=True):
        assert n.counters["checksum_mismatches"] == b["checksum_mismatches"] == 0
        assert n.phase == "member"


def test_rule_breaking_messages_of_a_member_are_refused_or_harmless(running, hostile):
    leader, member = running
    h = hostile.machine
    t = member.status()["iteration"]
    view = member.status_view()
    # Ballots near overflow are refused up front, and so is a jump of the round.
    for rnd in (2**63 - 1, 2**32):
        assert (
            hostile.send(member.address, "Prepare", hostile.prepare(h, iteration=t, round=rnd))[0] == "INVALID_ARGUMENT"
        )
    # (8 iterations ahead of a fresh reading: a prepare for an iteration the member has already left is
    # answered OK, and fast iterations can pass t + 1 during the messages above)
    t = member.status()["iteration"]
    code, details = hostile.send(member.address, "Prepare", hostile.prepare(h, iteration=t + 8, round=1000))
    assert code == "OUT_OF_RANGE" and "jumps" in details, details
    # A takeover commit without a promise, and round-0 commits from a non-leader, are refused.
    now = member.status()["iteration"]
    code, _ = hostile.send(
        member.address,
        "CommitIteration",
        hostile.commit(h, iteration=now, ballot=P.Ballot(5, h), view=view._replace(iteration=now + 1)),
    )
    assert code in ("FAILED_PRECONDITION", "OK")  # OK only if the iteration moved on meanwhile (then it is a mere hint)
    # Commits for future iterations (the wedge of a whole run) are hints only, never stored, and the
    # answer says so (a leader counts it for nothing when it answers joiners).
    hints = 0
    for ahead in (1, 2, 5):
        it = member.status()["iteration"] + ahead
        forged = hostile.commit(h, iteration=it, ballot=P.Ballot(7, h), view=view._replace(iteration=it + 1))
        for n in running:
            try:
                ack = hostile.stub(n.address).CommitIteration(forged, metadata=hostile.metadata, timeout=10)
            except grpc.RpcError:
                continue  # refused outright (e.g. the run moved past it meanwhile): not stored either
            assert ack.not_held, n.address
            hints += 1
    assert hints >= 1
    # Outlier bytes as itself: accepted, clipped to peers.clip, and visible in the statistics.
    accepted = 0
    for _ in range(200):
        it = leader.status()["iteration"]
        outlier = hostile.push(h, iteration=it, payload=b"\xff" * 4, previous=hostile.chain(leader.address, it))
        code, _ = hostile.send(leader.address, "PushGradients", outlier)
        accepted += code == "OK"
        if accepted >= 3:
            break
        time.sleep(0.02)
    assert accepted >= 3
    assert wait_for(lambda: str(h) in leader.summary()["member_stats"])
    stats = leader.summary()["member_stats"][str(h)]
    assert stats["max_abs"] > 50 and stats["clipped"] >= 4 and stats["count"] >= 4


def test_stale_duplicate_oversized_and_undecodable_messages(running, hostile):
    leader, member = running
    h = hostile.machine
    s, md = stub(member)
    rid = run_id(member)
    stale = hostile.push(h, iteration=max(0, member.applied - 3), payload=b"\x80")
    code, details = hostile.send(member.address, "PushGradients", stale)
    assert code == "FAILED_PRECONDITION" and "stale" in details
    huge = pb.GradientPush(run_id=rid, sender=0, iteration=member.applied, count=1, payload=b"\x80" * (5 << 20))
    code, _ = status_of(lambda: s.PushGradients(huge, metadata=md, timeout=30))
    assert code == grpc.StatusCode.RESOURCE_EXHAUSTED
    raw = grpc.insecure_channel(member.address).unary_unary("/zeroth.v1.Peer/CommitIteration")
    code, _ = status_of(lambda: raw(b"\xff\xfe garbage \x00", metadata=md, timeout=10))
    assert code != grpc.StatusCode.OK
    bad_digest = hostile.signed("Checksum", pb.ChecksumRequest(run_id=rid, sender=h, iteration=1, digest=b"12345"))
    code, details = hostile.send(member.address, "Checksum", bad_digest)
    assert code == "INVALID_ARGUMENT" and "32 bytes" in details
    join = hostile.join_request("127.0.0.1:9")
    join.config_digest = "not-this-run"
    code, details = hostile.send(leader.address, "Join", join)
    assert code == "UNAUTHENTICATED"  # the proof covers the config digest
    code, _ = hostile.send(
        member.address, "FetchState", hostile.signed("FetchState", pb.StateRequest(run_id=rid, sender=77, iteration=0))
    )
    assert code == "PERMISSION_DENIED"
    manifest = s.GetManifest(
        hostile.signed("GetManifest", pb.ManifestRequest(run_id=rid, sender=h)), metadata=md, timeout=10
    )
    bad_range = hostile.signed(
        "FetchState",
        pb.StateRequest(run_id=rid, sender=h, iteration=manifest.iteration, offset=manifest.total_bytes, length=10),
    )
    code, _ = hostile.send(member.address, "FetchState", bad_range)
    assert code in ("OUT_OF_RANGE", "NOT_FOUND")


def test_a_commit_delta_of_a_view_the_member_lacks_is_answered_send_whole_and_changes_nothing(running, hostile):
    leader, member = running
    h = hostile.machine
    view = member.status_view()
    before = member.status()
    forged = hostile.commit(
        h, iteration=view.iteration, ballot=P.Ballot(0, h), view=view._replace(iteration=view.iteration + 1)
    )
    forged.ClearField("next_view")
    forged.delta.base = b"\x00" * 32  # not the digest of any view the member holds
    forged.delta.next_machine_id = view.next_machine_id
    ack = hostile.stub(member.address).CommitIteration(forged, metadata=hostile.metadata, timeout=10)
    assert ack.send_whole and not ack.not_held
    assert member.status()["phase"] == before["phase"] == "member"


def test_the_run_survives_all_that_and_stays_in_agreement(running):
    before = [n.applied for n in running]
    assert wait_for(lambda: all(n.applied >= b + 5 for n, b in zip(running, before, strict=True)))
    common = set(running[0].digests()) & set(running[1].digests())
    assert len(common) >= 5
    for t in common:
        assert running[0].digests()[t] == running[1].digests()[t]
    assert all(n.phase == "member" for n in running)
    assert all(n.counters["checksum_mismatches"] == 0 for n in running)
    assert all(n.counters["refused_requests"] > 0 for n in running)  # the forged requests above
    assert sum(n.counters["checksum_comparisons"] for n in running) > 0


def test_a_peer_answers_and_trains_while_outsiders_hold_calls_without_a_body(running):
    """40 calls without the token that never send their body (more than the peer's threads) are
    refused at once, before the body is read; the peer answers its token holders at once and the
    run goes on (a token holder's calls are capped and timed out: tests/test_guard.py)."""
    from slowloris import Held, timed

    member = running[1]
    with (
        Held(member.address, "/zeroth.v1.Peer/PushGradients", 40) as held,
        Held(member.address, "/zeroth.v1.Peer/Nothing", 40) as unknown,
    ):
        assert held.codes(timeout_s=5.0) == [grpc.StatusCode.UNAUTHENTICATED] * 40
        assert unknown.codes(timeout_s=5.0) == [grpc.StatusCode.UNAUTHENTICATED] * 40
        s, md = stub(member)
        applied = member.applied
        seconds, reply = timed(lambda: s.Status(pb.StatusRequest(), metadata=md, timeout=10))
        assert reply.phase == "member" and seconds < 2.0
        assert wait_for(lambda: member.applied >= applied + 3, timeout=60)


def test_a_corrupted_peer_is_detected_and_repaired(worker, tmp_path):
    cfg = config(60, count=3)
    nodes = start_nodes(cfg, worker, tmp_path, 3, snapshot_every=5)
    try:
        assert wait_for(lambda: nodes[2].applied >= 10)

        def flip_one_bit(params):
            leaf = params["Dense_0"]["bias"]
            bits = np.asarray(leaf).view(np.uint32).copy()
            bits[0] ^= 1 << 22  # a high mantissa bit: a change later rounding cannot absorb
            return {**params, "Dense_0": {**params["Dense_0"], "bias": jnp.asarray(bits.view(np.float32))}}

        nodes[2].call(flip_one_bit)
        assert all(n.wait(120) for n in nodes)
        assert [n.finish_reason for n in nodes] == ["done"] * 3
        finals = {n.digests()[60] for n in nodes}
        assert len(finals) == 1
        assert sum(n.counters["checksum_mismatches"] for n in nodes) >= 1
        assert nodes[2].counters["repairs"] >= 1
        assert nodes[0].counters["repairs"] == 0 and nodes[1].counters["repairs"] == 0
    finally:
        for n in nodes:
            n.stop()


@pytest.mark.skipif(
    not security.can_make_certificates(), reason="needs the openssl command or the cryptography package"
)
def test_tls_run_and_a_plaintext_client_is_refused(worker, tmp_path):
    tls = security.self_signed(tmp_path / "tls")
    cfg = config(8)
    nodes = start_nodes(cfg, worker, tmp_path, 2, tls=tls)
    try:
        s, md = stub(nodes[0])  # plaintext channel to a TLS server
        code, _ = status_of(lambda: s.Status(pb.StatusRequest(), metadata=md, timeout=5))
        assert code == grpc.StatusCode.UNAVAILABLE
        secure = grpc.secure_channel(nodes[0].address, security.channel_credentials(tls))
        reply = pb_grpc.PeerStub(secure).Status(pb.StatusRequest(), metadata=md, timeout=10)
        assert reply.phase in ("joining", "forming", "member", "done")
        assert all(n.wait(120) for n in nodes)
        assert [n.finish_reason for n in nodes] == ["done", "done"]
        assert nodes[0].digests()[8] == nodes[1].digests()[8]
    finally:
        for n in nodes:
            n.stop()


def test_padding_a_replay_with_zero_coefficients_changes_no_bit(worker):
    params = jax.tree_util.tree_map(jnp.array, worker.initial_params())
    grads = {0: np.array([0.5, -1.25, 3.0], np.float32), 4: np.array([0.02, -7.0], np.float32)}
    ups = zo.canonical_updates(worker.seed, 11, grads, 0.05, "sqrt")
    plain = replay.replay(params, ups, distribution=worker.distribution)
    payloads = tuple(worker.codec.encode(g) for g in grads.values())
    keys, coeffs, stats = worker.updates(11, ((0, 3), (4, 2)), payloads)
    assert stats[0][0] == 3 and stats[4][0] == 2 and stats[0][3] == 0
    assert keys.shape[0] == padded_size(5) == 8
    decoded = {m: worker.codec.decode(p) for m, p in zip(grads, payloads, strict=True)}
    plain = replay.replay(
        params, zo.canonical_updates(worker.seed, 11, decoded, 0.05, "sqrt"), distribution=worker.distribution
    )
    padded = replay.replay(params, (keys, coeffs), distribution=worker.distribution)
    assert replay.checksum(plain) == replay.checksum(padded)
    assert replay.checksum(plain) != replay.checksum(params)


def test_a_probe_refused_at_the_connection_is_a_refused_push(running, monkeypatch):
    # The committer's Probe is a TCP connection attempt: refused (nothing listens there, as after
    # a SIGKILL), it reaches the protocol as a refused push of that iteration; a live port does not.
    node, other = running
    seen = []
    event = node._event

    def spy(inc, fn, **kwargs):
        if kwargs.get("machine") == 99:  # no member has this id: only the probes below name it
            seen.append((fn, kwargs))
        else:
            event(inc, fn, **kwargs)

    monkeypatch.setattr(node, "_event", spy)
    (port,) = launch.free_ports(1)
    node._probe(node.incarnation, P.Probe(99, f"127.0.0.1:{port}", 41))
    assert seen == [(P.on_push_refused, {"iteration": 41, "machine": 99})]
    node._probe(node.incarnation, P.Probe(99, other.address, 42))
    assert seen == [(P.on_push_refused, {"iteration": 41, "machine": 99})]


def test_a_member_cannot_take_a_live_leaders_iteration_by_saying_it_is_gone(running, hostile):
    # A takeover that says the leader is gone is promised before the iteration timeout only if the
    # leader refused the member's own connection: the member probes the leader before it answers,
    # the leader is alive, so the claim of a member holding valid credentials is premature.
    leader, member = running
    h, premature = hostile.machine, 0
    for _ in range(50):
        t = member.status()["iteration"]
        try:
            request = hostile.prepare(h, iteration=t, round=1, previous=hostile.chain(member.address, t), gone=True)
            reply = hostile.stub(member.address).Prepare(request, metadata=hostile.metadata, timeout=10)
        except grpc.RpcError as e:
            assert e.code() == grpc.StatusCode.FAILED_PRECONDITION, (e.code(), e.details())
            premature += "premature" in e.details()
        else:
            assert reply.iteration > t  # promised only for an iteration the member had left meanwhile
        if premature >= 3:
            break
    assert premature >= 3
    assert leader.phase == member.phase == "member"


def test_wire_bytes_are_counted_for_every_message(running):
    t = running[1].traffic.snapshot()
    assert t["messages_sent"] > 0 and t["messages_received"] > 0
    assert t["wire_sent"] > t["messages_sent"] * wire.RESPONSE_OVERHEAD // 2
    assert t["payload_sent"] > 0 and t["payload_received"] > 0


def test_timeout_based_end_of_an_iteration_sends_what_was_computed():
    worker = Worker(config(10), chunk=1)
    params = jax.tree_util.tree_map(jnp.array, worker.initial_params())
    count, payload, loss = worker.compute(params, 0, 0, deadline=time.monotonic() - 1.0)
    assert count == 1 < worker.n  # the deadline had passed: one chunk, then stop
    assert len(payload) == 1 and np.isfinite(loss)
    full, payload_full, _ = worker.compute(params, 0, 0)  # count-based end
    assert full == worker.n == 4 and payload_full[:1] == payload  # same keys, same batch: same first value


def test_a_peer_that_leaves_is_removed_and_the_others_finish(worker, tmp_path):
    cfg = config(20, count=3)
    nodes = start_nodes(cfg, worker, tmp_path, 3)
    try:
        assert wait_for(lambda: nodes[2].applied >= 3)
        nodes[2].leave()
        assert all(n.wait(120) for n in nodes)
        assert [n.finish_reason for n in nodes] == ["done", "done", "left"]
        assert nodes[0].digests()[20] == nodes[1].digests()[20]
        assert nodes[2].applied < 20
        # A joiner reaching the finished run (its peers still serving) is told so at once.
        late = Node(
            cfg,
            NodeOptions(out_dir=str(tmp_path / "late"), join=(nodes[1].address,), secret=TOKEN, log=False),
            worker=worker,
        )
        started = time.monotonic()
        late.start()
        try:
            assert late.wait(30) and late.finish_reason == "failed"
            assert "finished" in late.error and time.monotonic() - started < 30
        finally:
            late.stop()
    finally:
        for n in nodes:
            n.stop()


def test_a_joiner_whose_leader_died_before_answering_is_told_its_id_by_the_takeover(worker, tmp_path):
    """The leader crashes the moment it would answer a joiner: its commit admitting it reached a
    majority, so the joiner holds a seat of the view that the two survivors need for a majority.
    The joiner asks again through a survivor, whose takeover learned from the promises that the
    admitting decision is chosen: it is told its id (3, not a new one), catches up and promises, and
    the run goes on over real gRPC."""
    cfg = config(10**6, iteration_timeout_s=2.0, barrier_timeout_s=1.0, stall_timeout_s=60.0)
    nodes = start_nodes(cfg, worker, tmp_path, 3)
    leader = nodes[0]
    crashed = threading.Event()
    dispatch = leader._dispatch

    def crash_instead_of_answering(effects):
        if any(isinstance(e, P.Admit) for e in effects) and not crashed.is_set():
            crashed.set()
            threading.Thread(target=leader.stop).start()
            effects = [e for e in effects if not isinstance(e, P.Admit)]
        dispatch(effects)

    joiner = None
    try:
        assert wait_for(lambda: all(n.applied >= 2 for n in nodes))
        leader._dispatch = crash_instead_of_answering
        joiner = Node(
            cfg,
            NodeOptions(out_dir=str(tmp_path / "j"), join=(nodes[1].address,), secret=TOKEN, log=False),
            worker=worker,
        )
        joiner.start()
        assert wait_for(crashed.is_set, 60)
        # The commit admitting machine 3 reached a majority (the leader and one of the others); the
        # view the survivors are in holds the seat, and they cannot decide without it (3 of 4).
        assert wait_for(lambda: all(3 in n.status_view().ids() for n in nodes[1:]), 30)
        crashed_at = min(n.applied for n in nodes[1:])
        survivors = [nodes[1], nodes[2], joiner]
        assert wait_for(lambda: all(n.phase == P.MEMBER and n.applied >= crashed_at + 3 for n in survivors), 90), [
            (n.phase, n.applied, n.error) for n in survivors
        ]
        assert joiner.machines == [3]  # the seat it was admitted to, not a new id
        common = set(nodes[1].digests()) & set(nodes[2].digests()) & set(joiner.digests())
        assert len(common) >= 2 and all(len({n.digests()[t] for n in survivors}) == 1 for t in common)
    finally:
        for n in [*nodes, *([joiner] if joiner else [])]:
            n.stop()


def test_a_stopping_peer_ends_the_join_calls_it_holds(worker, tmp_path):
    """A leader holding a joiner's Join call (the decision admitting it not yet answered) stops:
    the call ends at once with UNAVAILABLE. Its handler waited for the join's whole deadline
    (forming, iteration and four barrier timeouts), its thread keeping the stopped peer's process
    alive: a test process outlived its last test by two minutes."""
    cfg = config(10**6, iteration_timeout_s=2.0, barrier_timeout_s=1.0)
    nodes = start_nodes(cfg, worker, tmp_path, 2)
    leader = nodes[0]
    held = threading.Event()
    dispatch = leader._dispatch

    def hold_admissions(effects):
        if any(isinstance(e, P.Admit) for e in effects):
            held.set()
        dispatch([e for e in effects if not isinstance(e, P.Admit)])

    joiner = HostileMember(secret=TOKEN, config_digest=leader.join_digest)
    result: dict = {}

    def handle():
        try:
            result["answer"] = leader.handle_join(joiner.join_request(joiner.address))
        except P.Rejected as e:
            result["error"] = e

    handler = threading.Thread(target=handle, daemon=True)
    try:
        assert wait_for(lambda: all(n.applied >= 2 for n in nodes))
        leader._dispatch = hold_admissions
        handler.start()
        assert wait_for(held.is_set, 30)  # decided, and the call still waits
        assert handler.is_alive()
        leader.stop()
        handler.join(10.0)
        assert not handler.is_alive(), "the Join handler still waits after its peer stopped"
        err = result["error"]
        assert err.code == "UNAVAILABLE" and "stopping" in err.message, err
    finally:
        joiner.close()
        for n in nodes:
            n.stop()


def test_a_join_the_protocol_releases_is_answered_unavailable_at_once(running):
    """A join queued at a peer that then stops deciding (a takeover, a leader change) is released:
    the waiting Join call ends with UNAVAILABLE and the protocol's reason, and the joiner asks again."""
    node = running[0]
    waiter: futures.Future = futures.Future()
    with node._lock:
        node._join_waiters[-1] = waiter
        node._dispatch(
            [P.JoinRefused(-1, "machine 0 queued the join of a:1 but no longer decides iteration 9; ask again")]
        )
    err = waiter.exception(timeout=5)
    assert isinstance(err, P.Rejected) and err.code == "UNAVAILABLE" and err.message.endswith("ask again")
    assert -1 not in node._join_waiters


def test_the_command_line_needs_a_secret_to_join_and_refuses_two_choices(tmp_path, capsys):
    from zeroth.config import to_yaml
    from zeroth.net import peer

    path = tmp_path / "job.yaml"
    path.write_text(to_yaml(config(5, token=None)))
    base = ["--config", str(path), "--listen", "127.0.0.1:0", "--out", str(tmp_path / "o")]
    assert peer.main([*base, "--join", "127.0.0.1:9"]) == 2
    assert "needs the run's secret" in capsys.readouterr().err
    secret = tmp_path / "s"
    identity.write_secret(secret, "x")
    assert secret.stat().st_mode & 0o777 == 0o600
    assert peer.main([*base, "--join", "127.0.0.1:9", "--secret-file", str(secret), "--insecure"]) == 2
    assert "choose one" in capsys.readouterr().err


def test_a_joiner_with_another_config_is_told_which_field_differs(running, worker, tmp_path):
    cfg = config(10**6, clip=8.0)
    other = dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, lr=0.07))
    node = Node(
        other,
        NodeOptions(
            out_dir=str(tmp_path / "other"), join=(running[0].address,), secret=TOKEN, log=False, join_timeout_s=30.0
        ),
        worker=worker,
    )
    run_alone(node)
    assert node.finish_reason == "failed"
    assert "this peer's config differs from the run's in train.lr (the run: 0.05, this peer: 0.07);" in node.error, (
        node.error
    )
    assert "digest" not in node.error


def test_the_join_timeout_bounds_a_join_call_that_is_never_answered(worker, tmp_path):
    """A peer that takes the Join call and holds it (a leader waiting for a decision that never
    comes, alive enough to answer gRPC's keepalive pings): the joiner gives up after its join
    timeout, 2 s here. Before, one call could run for the forming timeout plus the iteration timeout
    plus four barrier timeouts (4.5 minutes with the defaults; 17 with these)."""
    release = threading.Event()

    def hold(request, context):
        release.wait(300)
        context.abort(grpc.StatusCode.UNAVAILABLE, "released")

    server = grpc.server(futures.ThreadPoolExecutor(max_workers=4), options=channels.server_options(4 * 1024 * 1024))
    server.add_generic_rpc_handlers(
        (
            grpc.method_handlers_generic_handler(
                "zeroth.v1.Peer",
                {
                    "Join": grpc.unary_unary_rpc_method_handler(
                        hold,
                        request_deserializer=pb.JoinRequest.FromString,
                        response_serializer=pb.JoinResponse.SerializeToString,
                    ),
                },
            ),
        )
    )
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    cfg = config(10, iteration_timeout_s=300.0, barrier_timeout_s=150.0)
    node = Node(
        cfg,
        NodeOptions(
            out_dir=str(tmp_path / "j"), join=(f"127.0.0.1:{port}",), secret=TOKEN, log=False, join_timeout_s=2.0
        ),
        worker=worker,
    )
    try:
        started = time.monotonic()
        run_alone(node, timeout=120.0)
        took = time.monotonic() - started
    finally:
        release.set()
        server.stop(0)
    assert node.finish_reason == "failed"
    assert node.error == f"could not join the run through ['127.0.0.1:{port}'] within 2.0s", node.error
    assert took < 60.0, took  # the call's own deadline would be 1,020 s


def test_a_founder_resuming_a_state_that_does_not_fit_gives_up_in_one_line(worker, tmp_path, capsys):
    from zeroth.net.state import save_state

    other = {"w": np.ones(3, np.float32)}  # another model's parameters, intact
    state = save_state(
        tmp_path / "state", other, iteration=4, run_id="r", digest=replay.checksum(other), reason="failed"
    )
    node = Node(
        config(10),
        NodeOptions(out_dir=str(tmp_path / "p0"), founders=2, secret=TOKEN, log=False, resume=str(state)),
        worker=worker,
    )
    run_alone(node)
    assert node.finish_reason == "failed"
    assert node.error.startswith(
        f"cannot resume: the state in {state} does not fit the model: snapshot leaves do not match"
    ), node.error
    assert "Traceback" not in capsys.readouterr().err


def test_peers_apply_a_warmup_cosine_schedule_and_agree(tmp_path):
    cfg = apply_overrides(
        config(8), ["train.schedule={name: cosine, warmup_steps: 2, decay_steps: 8, final_ratio: 0.1}"]
    )
    own = Worker(cfg)  # the schedule is the worker's: every peer derives it from the shared config
    nodes = start_nodes(cfg, own, tmp_path, 2)
    try:
        assert all(n.wait(120) for n in nodes)
        assert [n.finish_reason for n in nodes] == ["done", "done"]
        digests = [n.digests() for n in nodes]
        assert all(digests[0][t] == digests[1][t] for t in range(1, 9))  # bit-identical at every iteration
        lrs = [[r["lr"] for r in read_metrics(tmp_path / f"p{i}" / "metrics.jsonl", "train")] for i in range(2)]
        s = schedules.from_train(cfg.train)
        assert lrs[0] == lrs[1] == [s(t) for t in range(8)]
        assert lrs[0][:3] == [0.0, 0.025, 0.05] and lrs[0][-1] < 0.05
        # eta_0 = 0: iteration 0 leaves the founder's parameters bit for bit; iteration 1 moves them
        assert digests[0][1] == replay.checksum(own.initial_params()) != digests[0][2]
    finally:
        for n in nodes:
            n.stop()


def test_the_transport_makes_one_stub_per_address_and_none_once_closed():
    # a stub builds a callable per method of the service; a peer calls a few addresses thousands of times
    from zeroth.net.transport import Closed, Traffic, Transport

    t = Transport(token=None, tls=None, traffic=Traffic())
    a = t.stub("127.0.0.1:1")
    assert t.stub("127.0.0.1:1") is a and isinstance(a, pb_grpc.PeerStub)
    assert t.stub("127.0.0.1:2") is not a
    t.close()
    with pytest.raises(Closed, match="127.0.0.1:1"):
        t.stub("127.0.0.1:1")
    with pytest.raises(Closed):
        t.rpc("127.0.0.1:1", "PushGradients", pb.GradientPush(), 1.0)


def test_forty_founders_on_one_host_all_join_while_the_founder_holds_their_joins(worker, tmp_path):
    """A founder holds each founder's Join until the run forms, and peers on one host are one caller:
    the server's per-caller cap is raised with the run's size (at the default, 32 held Joins let 33
    of 48 peers form, and the rest timed out)."""
    n = 40
    cfg = config(2, count=n, iteration_timeout_s=30.0, barrier_timeout_s=20.0)  # 40 peers in one busy process
    nodes = start_nodes(cfg, worker, tmp_path, n, forming_timeout_s=40.0, join_timeout_s=40.0)
    try:
        assert wait_for(lambda: all(node.wait(0) for node in nodes), timeout=120.0), [nd.phase for nd in nodes][:5]
        summaries = [node.summary() for node in nodes]
        assert [s["finish_reason"] for s in summaries] == ["done"] * n, {
            (s["finish_reason"], s.get("error")) for s in summaries
        }
        assert len({s["digest"] for s in summaries}) == 1
        assert sorted(m for s in summaries for m in s["machines"]) == list(range(n))
    finally:
        for node in nodes:
            node.stop()


def test_pushes_to_the_leader_relayed_in_its_commits_give_the_same_parameters(worker, tmp_path):
    """peers.pushes: leader over real gRPC, with a relay tree of fan-out 1 (0 relays to 1, 1 to 2):
    every member's push goes to the leader only, every member applies the payloads relayed to it
    (each checked against its author's key; with peers.relay_parts 2, in two calls, the relay
    forwarding the first before the second comes), and the parameters are bit for bit those of
    all-to-all pushes when every member contributed."""
    runs = {}
    for pushes, parts in (("all", 1), ("leader", 1), ("parts", 2)):
        cfg = config(
            8,
            count=3,
            iteration_timeout_s=10.0,
            barrier_timeout_s=5.0,
            pushes="all" if pushes == "all" else "leader",
            relay_fanout=1,
            relay_parts=parts,
        )
        nodes = start_nodes(cfg, worker, tmp_path / pushes, 3)
        try:
            assert all(n.wait(120) for n in nodes)
            assert [n.finish_reason for n in nodes] == ["done"] * 3
            runs[pushes] = (
                {n.digests()[8] for n in nodes},
                [list(n.barrier.contributors) for n in nodes],
                nodes[2].traffic.snapshot()["messages_sent"],
                nodes[1].traffic.snapshot()["messages_sent"],
            )
        finally:
            for n in nodes:
                n.stop()
    (all_digests, all_contributors, all_sent, _), (digests, contributors, sent, relay_sent) = (
        runs["all"],
        runs["leader"],
    )
    assert len(digests) == 1 and digests == all_digests
    assert contributors == all_contributors and all(c == [3] * 8 for c in contributors)
    assert sent <= all_sent - 8  # machine 2, a leaf: one push an iteration instead of two
    part_digests, part_contributors, _, part_relay_sent = runs["parts"]
    assert part_digests == all_digests and part_contributors == all_contributors
    assert part_relay_sent >= relay_sent + 7  # machine 1 relayed each decision in two calls
