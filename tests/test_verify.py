"""The update log and ``zeroth verify``: a run's log, replayed on this machine, reproduces every digest.

The logs here are written by a small in-process driver that does what a peer does for each
decided iteration (real projected gradients from :class:`zeroth.net.work.Worker`, Ed25519-signed
pushes and commits, the exact replay, the digest), so the tests need no sockets; the end-to-end
tests (``test_e2e_job.py``, ``test_peer_resume.py``) verify the logs of real peer processes.
"""

import json
import shutil
import struct

import jax
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from zeroth.config import load_config_dict, to_dict
from zeroth.net import protocol as P
from zeroth.net import updatelog, verify, wire
from zeroth.net.proto import peer_pb2 as pb
from zeroth.net.state import save_state
from zeroth.net.work import Worker
from zeroth.replay import checksum
from zeroth.transport.identity import Identity, log_proof

RUN = "verify-0123456789ab"
SECRET = "the-run-secret-of-these-tests"
HEADER = 12  # a record's header: length, CRC-32 of the body, CRC-32 of the first 8 bytes
CONFIG = {
    "run": {"name": "verify", "seed": 3},
    "data": {"dataset": "digits", "batch_size": 16, "eval_size": 50},
    "model": {"name": "mlp", "kwargs": {"hidden": [8]}},
    "train": {"method": "zo", "lr": 0.05, "eps": 1e-3, "codec": "onebyte"},
    "peers": {"count": 2, "inferences_per_iteration": 3, "iterations": 6},
}


@pytest.fixture(scope="module")
def worker():
    return Worker(load_config_dict(CONFIG))


def _own(params):
    return jax.tree_util.tree_map(lambda x: jax.numpy.array(x, copy=True), params)


def write_run(
    root,
    worker,
    *,
    iterations=6,
    machines=(0, 1),
    run_id=RUN,
    start=0,
    params=None,
    previous=b"",
    secret=SECRET,
    missed=(),
):
    """What each peer of ``machines`` logs over ``iterations`` decided iterations from ``start``
    (each START naming the peer's key with its proof of ``secret``, none if None); returns the
    state reached and the chain digest of the last decision. ``missed``: ``(iteration, machine)``
    pairs left out of that iteration's decision (the member stays active in the views)."""
    cfg = to_dict(worker.cfg)
    ids = {m: Identity.generate() for m in machines}
    members = tuple(P.Member(m, f"127.0.0.1:{7000 + m}", True, ids[m].public) for m in machines)
    params = _own(worker.initial_params() if params is None else params)
    writers = {m: updatelog.Writer(root / "peers" / f"p{m}" / updatelog.FILENAME) for m in machines}
    for m, w in writers.items():
        key = ids[m].public
        w.start(
            run_id=run_id,
            iteration=start,
            digest=checksum(params),
            reason="initial" if start == 0 else "resumed",
            config=cfg,
            key=key,
            proof=log_proof(secret, run_id, key) if secret else b"",
        )
    for t in range(start, start + iterations):
        pushed = [(m, *worker.compute(params, m, t)[:2]) for m in machines if (t, m) not in missed]
        contributors = tuple((m, n) for m, n, _ in pushed)
        payloads = tuple(p for _, _, p in pushed)
        view = P.View(t + 1, members, len(machines))
        c = P.Commit(
            run_id,
            machines[0],
            t,
            P.Ballot(0, machines[0]),
            contributors,
            P.updates_digest(contributors, payloads),
            view,
            b"",
            previous,
        )
        c = c._replace(signature=ids[machines[0]].sign(P.signed_bytes(c)))
        sigs = tuple(ids[m].sign(P.signed_bytes(P.Push(run_id, m, t, n, p, b"", previous))) for m, n, p in pushed)
        params, _ = worker.apply(params, t, contributors, payloads)
        digest = checksum(params)
        for w in writers.values():
            w.applied(P.LogEntry(c, payloads, sigs), digest)
        previous = P.chain_digest(c)
    for w in writers.values():
        w.close()
    write_run.ids = ids  # the identities that signed, for tests that sign more
    return params, previous


def records(data: bytes):
    """The raw records of a log's bytes: [(kind, body without the kind byte)]."""
    data = data[len(updatelog.MAGIC) :]
    out, o = [], 0
    while o < len(data):
        (n,) = struct.unpack_from("<I", data, o)
        out.append((data[o + HEADER], data[o + HEADER + 1 : o + HEADER + n]))
        o += HEADER + n
    return out


def rewrite(path, recs):
    body = b"".join(updatelog._header(bytes([k]) + b) + bytes([k]) + b for k, b in recs)
    path.write_bytes(updatelog.MAGIC + body)


def edit_entry(path, iteration, fn):
    """Rewrite the ENTRY of ``iteration`` in ``path`` as ``fn(digest_bytes, pb.LogEntry)`` leaves it (with valid CRCs)."""
    recs = records(path.read_bytes())
    for i, (kind, body) in enumerate(recs):
        if kind == updatelog.DECISION:
            msg = pb.LogEntry()
            msg.ParseFromString(body[33:])
            if msg.commit.iteration == iteration:
                digest = fn(bytearray(body[:32]), msg)
                recs[i] = (kind, bytes(digest) + body[32:33] + msg.SerializeToString())
    rewrite(path, recs)


# --------------------------------------------------------------------------- the log itself


def test_a_log_reads_back_what_was_written_and_a_second_process_appends_its_own_segment(tmp_path, worker):
    write_run(tmp_path, worker, iterations=3)
    path = tmp_path / "peers" / "p0" / updatelog.FILENAME
    log = updatelog.read(path)
    assert log.truncated == 0 and len(log.segments) == 1
    seg = log.segments[0]
    assert seg.start["run_id"] == RUN and seg.start["iteration"] == 0 and seg.start["reason"] == "initial"
    assert seg.start["config"] == to_dict(worker.cfg)
    assert [a.iteration for a in seg.applied] == [0, 1, 2]
    assert all(len(a.entry.payloads) == 2 and len(a.entry.signatures) == 2 for a in seg.applied)
    # a second process in the same folder (a resumed run) appends after a START of its own
    with updatelog.Writer(path) as w:
        w.start(run_id="other", iteration=3, digest=seg.applied[-1].digest, reason="resumed", config={})
    again = updatelog.read(path)
    assert [s.start["run_id"] for s in again.segments] == [RUN, "other"] and again.segments[0] == seg


def _entry(t, members, contributors=((0, 16), (2, 16))):
    """A log entry of iteration ``t`` whose next view has ``members`` (signatures are not checked by the log)."""
    payloads = tuple(bytes([t, m]) * 8 for m, _ in contributors)
    view = P.View(t + 1, members, 1 + max(m.machine for m in members))
    commit = P.Commit(
        RUN,
        0,
        t,
        P.Ballot(0, 0),
        contributors,
        P.updates_digest(contributors, payloads),
        view,
        bytes([t]) * 64,
        bytes([t]) * 32 if t else b"",
    )
    return P.LogEntry(commit, payloads, tuple(bytes([m]) * 64 for m, _ in contributors))


def test_a_decision_leaves_out_what_the_commit_and_the_record_before_say_and_reads_back_whole(tmp_path):
    two = tuple(P.Member(m, f"127.0.0.1:{7000 + m}", True, bytes([m]) * 32) for m in (0, 2))
    three = (*two, P.Member(3, "127.0.0.1:7003", False, b"\3" * 32))  # a joiner admitted at 2
    entries = [_entry(0, two), _entry(1, two), _entry(2, three), _entry(3, three), _entry(4, two)]
    path = tmp_path / updatelog.FILENAME
    with updatelog.Writer(path) as w:
        w.start(run_id=RUN, iteration=0, digest="00" * 32, reason="initial", config={})
        for e in entries[:4]:
            w.applied(e, "11" * 32)
        w.start(
            run_id=RUN, iteration=4, digest="11" * 32, reason="downloaded", config={}
        )  # a new segment: members again
        w.applied(entries[4], "22" * 32)
    recs = records(path.read_bytes())
    assert [(k, b[32] if k == updatelog.DECISION else None) for k, b in recs] == [
        (updatelog.START, None),
        (updatelog.DECISION, 0),
        (updatelog.DECISION, updatelog.SAME_MEMBERS),
        (updatelog.DECISION, 0),
        (updatelog.DECISION, updatelog.SAME_MEMBERS),
        (updatelog.START, None),
        (updatelog.DECISION, 0),
    ]
    log = updatelog.read(path)
    assert [a.entry for s in log.segments for a in s.applied] == entries  # every field, members and payloads
    full = [len(wire.entry_to_pb(e).SerializeToString()) for e in entries]
    compact = [len(b) - 33 for k, b in recs if k == updatelog.DECISION]
    assert all(c < f for c, f in zip(compact, full, strict=True))
    # a record that repeats members its segment never named is damage, not an entry
    rewrite(path, [recs[0], recs[2]])
    with pytest.raises(ValueError, match="repeats the members of a DECISION before it, and its segment holds none"):
        updatelog.read(path)
    rewrite(path, [recs[0], (updatelog.DECISION, recs[1][1][:32] + b"\x80" + recs[1][1][33:])])
    with pytest.raises(ValueError, match="unknown flags 0x80"):
        updatelog.read(path)


def test_a_log_of_whole_entries_the_format_before_decisions_still_reads_and_verifies(tmp_path, worker):
    write_run(tmp_path, worker, iterations=3)
    for peer in ("p0", "p1"):
        path = tmp_path / "peers" / peer / updatelog.FILENAME
        (seg,) = updatelog.read(path).segments
        recs = records(path.read_bytes())[:1]
        recs += [
            (updatelog.ENTRY, bytes.fromhex(a.digest) + wire.entry_to_pb(a.entry).SerializeToString())
            for a in seg.applied
        ]
        rewrite(path, recs)
        assert updatelog.read(path).segments == (seg,)
    report = verify.verify(tmp_path, secret=SECRET)
    assert report.ok and report.runs[0].last == 3, verify.format_report(report)


def test_a_record_cut_short_at_the_end_is_left_out_and_a_damaged_one_before_it_is_named(tmp_path, worker):
    write_run(tmp_path, worker, iterations=3)
    path = tmp_path / "peers" / "p0" / updatelog.FILENAME
    whole = path.read_bytes()
    path.write_bytes(whole[:-7])  # a crash while the last record was written
    log = updatelog.read(path)
    assert [a.iteration for a in log.segments[0].applied] == [0, 1] and log.truncated > 0
    # one byte changed inside the second record: its CRC fails with records after it, so it is damage, not a crash
    second = len(updatelog.MAGIC) + HEADER + 1 + len(records(whole)[0][1])
    bad = bytearray(whole)
    bad[second + 20] ^= 0x01
    path.write_bytes(bytes(bad))
    with pytest.raises(ValueError, match=rf"record 2 at byte {second}: its CRC-32 does not match"):
        updatelog.read(path)
    other = tmp_path / "notes.txt"
    other.write_text("not a log\n")
    with pytest.raises(ValueError, match="is not a zeroth update log"):
        updatelog.read(other)
    with pytest.raises(ValueError, match="exists and is not a zeroth update log"):
        updatelog.Writer(other)
    assert other.read_text() == "not a log\n"  # refused without writing


@pytest.fixture(scope="module")
def a_log(worker, tmp_path_factory):
    """The bytes of one peer's log of 4 iterations, and what it holds, record by record."""
    root = tmp_path_factory.mktemp("a_log")
    write_run(root, worker, iterations=4)
    path = root / "peers" / "p0" / updatelog.FILENAME
    return path.read_bytes(), flat(updatelog.read(path))


def flat(log):
    out = []
    for seg in log.segments:
        out.append(("start", seg.start["iteration"], seg.start["digest"]))
        out += [("entry", a.iteration, a.digest, a.entry.payloads, a.entry.signatures) for a in seg.applied]
    return out


def ends(data: bytes) -> list[int]:
    """The byte offset after each record."""
    out, o = [], len(updatelog.MAGIC)
    while o < len(data):
        o += HEADER + struct.unpack_from("<I", data, o)[0]
        out.append(o)
    return out


@settings(max_examples=60)
@given(cut=st.integers(min_value=0, max_value=10**6))
def test_a_log_cut_anywhere_reads_as_the_records_before_the_cut(a_log, tmp_path_factory, cut):
    data, want = a_log
    cut = len(updatelog.MAGIC) + cut % (len(data) - len(updatelog.MAGIC) + 1)
    path = tmp_path_factory.mktemp("cut") / updatelog.FILENAME
    path.write_bytes(data[:cut] + bytes(cut % 3 * 40))  # some cuts leave a tail of zeros, as a power loss can
    log = updatelog.read(path)
    whole = sum(e <= cut for e in ends(data))
    assert flat(log) == want[:whole]
    assert log.truncated == (cut % 3 * 40) + cut - ([len(updatelog.MAGIC), *ends(data)][whole])


@pytest.mark.parametrize("into", [1, HEADER - 1, HEADER + 1, 200])
def test_a_record_cut_short_then_zeros_reaching_past_its_end_is_a_crash_not_damage(a_log, tmp_path, into):
    # a power loss in the middle of a record: its first bytes on disk, then zeros the file system
    # left, more of them than the record was long (its length, read from a whole header, lies inside them)
    data, want = a_log
    start = [len(updatelog.MAGIC), *ends(data)][1]  # the second record
    path = tmp_path / updatelog.FILENAME
    path.write_bytes(data[: start + into] + bytes(8192))
    log = updatelog.read(path)
    assert flat(log) == want[:1] and log.truncated == into + 8192


@settings(max_examples=60)
@given(at=st.integers(min_value=0, max_value=10**6), bit=st.integers(min_value=0, max_value=7))
def test_a_changed_byte_is_never_read_as_a_record(a_log, tmp_path_factory, at, bit):
    data, want = a_log
    at = len(updatelog.MAGIC) + at % (len(data) - len(updatelog.MAGIC))
    bad = bytearray(data)
    bad[at] ^= 1 << bit
    path = tmp_path_factory.mktemp("flip") / updatelog.FILENAME
    path.write_bytes(bytes(bad))
    try:
        log = updatelog.read(path)
    except ValueError as e:  # named damage
        assert "the file is damaged" in str(e) or "does not decode" in str(e), e
        return
    # read without an error only when the change lies in the last record's body: it is then left out
    assert at >= ends(data)[-2] + HEADER and flat(log) == want[:-1] and log.truncated == len(data) - ends(data)[-2]


def test_an_entry_without_payloads_is_not_logged(tmp_path):
    commit = P.Commit(RUN, 0, 0, P.Ballot(0, 0), ((0, 1),), b"\0" * 32, P.View(1, (P.Member(0, "127.0.0.1:1"),), 1))
    with updatelog.Writer(tmp_path / "u.log") as w, pytest.raises(ValueError, match="has no payloads"):
        w.applied(P.LogEntry(commit, None), "00" * 32)


# --------------------------------------------------------------------------- verify


@pytest.mark.parametrize("impl", ["auto", "jnp", "reference"])
def test_every_recorded_digest_is_reproduced_by_the_replay(tmp_path, worker, impl):
    final, _ = write_run(tmp_path, worker)
    report = verify.verify(tmp_path, impl=impl)
    assert report.ok, verify.format_report(report)
    (run,) = report.runs
    assert run.first == 0 and run.last == 6 and run.final_digest == checksum(final)
    assert [(p.log, p.checked, p.agreed, p.first_mismatch, p.replaced) for p in run.peers] == [
        ("peers/p0", 7, 7, None, 0),
        ("peers/p1", 7, 7, None, 0),
    ]
    assert run.commits_signed == 6 and run.pushes_signed == 12
    text = verify.format_report(report)
    assert "7/7 digests, every digest reproduced" in text and text.endswith("follows from the log on this machine")


def test_verify_prints_the_contributors_and_missed_barriers_of_the_decisions_and_what_peers_reported(
    tmp_path, worker, capsys
):
    write_run(tmp_path, worker, iterations=5, machines=(0, 1, 2), missed={(2, 1), (3, 1), (3, 2)})
    totals = {"pushes_late": 2, "forward_passes_wasted": 12, "barrier_wait_s_total": 0.75, "late_pushes_received": 0}
    (tmp_path / "peers" / "p1" / "metrics.jsonl").write_text(
        json.dumps({"kind": "train", "step": 4, **{k: 0 for k in totals}})
        + "\nnot json\n"
        + json.dumps({"kind": "train", "step": 5, **totals})
        + "\n"
        + json.dumps({"kind": "eval", "step": 5})
        + "\n"
    )
    report = verify.verify(tmp_path)
    assert report.ok, verify.format_report(report)
    (run,) = report.runs
    b = run.barrier
    assert b["contributors_per_iteration"] == [3, 3, 2, 1, 3]
    assert (b["contributors_min"], b["contributors_median"], b["contributors_max"]) == (1, 3, 3)
    assert b["missed_barrier"] == 3 and b["iterations_with_missed"] == 2
    assert b["forward_passes_applied"] == 2 * 3 * 12  # 3 projected gradients each (inferences_per_iteration)
    assert report.reported == (("peers/p1", totals),)
    text = verify.format_report(report)
    assert (
        "contributors per iteration min 1 median 3 max 3 over 5 decisions; 3 active member(s) missed it in 2 iteration(s)"
        in text
    )
    assert (
        "reported by peers/p1: 2 own push(es) late, 12 forward passes wasted, 0 late push(es) received, 0.75s at the barrier"
        in text
    )
    assert verify.main([str(tmp_path), "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["runs"][0]["barrier"]["missed_barrier"] == 3 and out["reported"]["peers/p1"] == totals


def test_a_changed_payload_is_caught_by_its_digest_its_signature_and_the_replay(tmp_path, worker):
    write_run(tmp_path, worker)
    path = tmp_path / "peers" / "p0" / updatelog.FILENAME

    def flip(digest, msg):
        g = msg.gradients[1].payload
        msg.gradients[1].payload = bytes([g[0] ^ 0x40]) + g[1:]
        return digest

    edit_entry(path, 2, flip)
    alone = verify.verify(path)  # the changed log on its own
    (run,) = alone.runs
    assert not alone.ok
    assert any("iteration 2 (p0): the payloads do not match the commit's updates_digest" in p for p in run.problems), (
        run.problems
    )
    assert any("iteration 2 (p0): the payload of machine 1 is not signed by it" in p for p in run.problems), (
        run.problems
    )
    assert run.peers[0].first_mismatch == 3  # the state after iteration 2 is not the one p0 recorded
    both = verify.verify(tmp_path)  # beside the other peer's log, which holds the decision as it was
    assert any("logged different payloads for one decision of iteration 2" in p for p in both.runs[0].problems)


@pytest.mark.parametrize("what", ["commit", "payload"])
def test_a_changed_signature_in_one_of_three_logs_is_caught_beside_the_others(tmp_path, worker, what):
    write_run(tmp_path, worker, machines=(0, 1, 2))
    path = tmp_path / "peers" / "p2" / updatelog.FILENAME

    def flip(digest, msg):
        holder = msg.commit if what == "commit" else msg.gradients[1]
        sig = holder.signature
        holder.signature = sig[:5] + bytes([sig[5] ^ 0x01]) + sig[6:]
        return digest

    edit_entry(path, 2, flip)  # CRCs recomputed: the log reads back whole
    expected = (
        "iteration 2 (peers/p2): the commit's signature is not machine 0's"
        if what == "commit"
        else "iteration 2 (peers/p2): the payload of machine 1 is not signed by it"
    )
    report = verify.verify(tmp_path)  # the changed log beside two logs holding the decision as it was
    (run,) = report.runs
    assert not report.ok and list(run.problems) == [expected], run.problems
    assert run.commits_signed == 7  # the six decisions and the changed copy
    alone = verify.verify(path)
    assert not alone.ok and [p.replace("(p2)", "(peers/p2)") for p in alone.runs[0].problems] == [expected], alone.runs[
        0
    ].problems


def test_a_peer_whose_recorded_state_differs_is_named_with_the_first_iteration(tmp_path, worker):
    write_run(tmp_path, worker)

    def wrong(digest, msg):
        digest[0] ^= 0xFF
        return digest

    edit_entry(tmp_path / "peers" / "p1" / updatelog.FILENAME, 3, wrong)
    report = verify.verify(tmp_path)
    (run,) = report.runs
    assert not report.ok and not run.problems
    assert [(p.log, p.agreed, p.first_mismatch) for p in run.peers] == [("peers/p0", 7, None), ("peers/p1", 6, 4)]
    assert (
        "peers/p1     iterations 0-6 (initial at 0): 6/7 digests, 1 differ, first at iteration 4"
        in verify.format_report(report)
    )


def test_a_peer_that_applied_a_decision_the_run_replaced_and_recovered_does_not_fail_the_run(tmp_path, worker):
    write_run(tmp_path, worker, machines=(0, 1, 2))
    ids = write_run.ids
    (seg,) = updatelog.read(tmp_path / "peers" / "p0" / updatelog.FILENAME).segments
    params = _own(worker.initial_params())
    for a in seg.applied[:3]:
        params, _ = worker.apply(params, a.iteration, a.entry.commit.contributors, a.entry.payloads)
    # p2 applied a decision of iteration 3 that machine 1 took over with and no majority took
    # (machine 0's push only), then dropped out and downloaded the run's state of iteration 5
    run = seg.applied[3].entry
    c = run.commit
    contributors, payloads = c.contributors[:1], run.payloads[:1]
    fork = c._replace(
        sender=1,
        ballot=P.Ballot(1, 1),
        contributors=contributors,
        updates_digest=P.updates_digest(contributors, payloads),
        signature=b"",
    )
    fork = fork._replace(signature=ids[1].sign(P.signed_bytes(fork)))
    forked, _ = worker.apply(params, 3, contributors, payloads)
    path = tmp_path / "peers" / "p2" / updatelog.FILENAME
    path.unlink()
    with updatelog.Writer(path) as w:
        w.start(**{k: seg.start[k] for k in ("run_id", "iteration", "digest", "reason", "config")})
        for a in seg.applied[:3]:
            w.applied(a.entry, a.digest)
        w.applied(P.LogEntry(fork, payloads, run.signatures[:1]), checksum(forked))
        w.start(run_id=RUN, iteration=5, digest=seg.applied[4].digest, reason="downloaded", config=seg.start["config"])
        w.applied(seg.applied[5].entry, seg.applied[5].digest)
    report = verify.verify(tmp_path)
    assert report.ok, verify.format_report(report)
    (run_check,) = report.runs
    p2 = {p.log: p for p in run_check.peers}["peers/p2"]
    assert (p2.checked, p2.agreed, p2.replaced, p2.replaced_at) == (6, 6, 1, 3)
    assert run_check.commits_signed == 7  # the replaced decision's signatures are checked too
    assert "1 state(s) after a decision of iteration 3 that the run replaced" in verify.format_report(report)


def test_a_resumed_run_starts_from_the_state_the_first_run_reached(tmp_path, worker):
    params, previous = write_run(tmp_path, worker, iterations=4)
    write_run(tmp_path / "second", worker, iterations=2, run_id="verify-resumed", start=4, params=params)
    report = verify.verify(tmp_path)
    assert report.ok, verify.format_report(report)
    first, second = report.runs
    assert (first.run_id, first.last) == (RUN, 4) and second.run_id == "verify-resumed"
    assert second.source.startswith("the state another run of") and (second.first, second.last) == (4, 6)
    # on its own, the resumed run has nothing to start from ...
    alone = verify.verify(tmp_path / "second")
    assert not alone.ok and "nothing to replay from" in alone.runs[0].problems[0]
    # ... but a saved state of that iteration beside it will do (a damaged copy is passed over)
    for name in ("a", "b"):
        save_state(
            tmp_path / "second" / "checkpoints" / name,
            params,
            iteration=4,
            run_id=RUN,
            digest=checksum(params),
            reason="checkpoint_every",
        )
    (tmp_path / "second" / "checkpoints" / "a" / "state.bin").write_bytes(b"damaged")
    alone = verify.verify(tmp_path / "second")
    assert alone.ok, verify.format_report(alone)
    assert alone.runs[0].source == f"the checkpoint {tmp_path / 'second' / 'checkpoints' / 'b'}"


def test_every_saved_state_of_the_run_is_compared_with_the_replay(tmp_path, worker):
    final, _ = write_run(tmp_path, worker, iterations=4)
    middle, _ = write_run(tmp_path / "elsewhere", worker, iterations=2)  # the state at the start of iteration 2
    for peer in ("p0", "p1"):
        save_state(
            tmp_path / "peers" / peer / "checkpoints" / "4",
            final,
            iteration=4,
            run_id=RUN,
            digest=checksum(final),
            reason="done",
        )
    save_state(
        tmp_path / "peers" / "p0" / "checkpoints" / "2",
        middle,
        iteration=2,
        run_id=RUN,
        digest=checksum(middle),
        reason="checkpoint_every",
    )
    save_state(
        tmp_path / "other-run", middle, iteration=2, run_id="another-run", digest=checksum(middle), reason="done"
    )
    shutil.rmtree(tmp_path / "elsewhere")
    report = verify.verify(tmp_path)
    assert report.ok and report.runs[0].states_agreed == 3, verify.format_report(report)
    assert "saved states 3 (checkpoints), each the replay's state at its iteration" in verify.format_report(report)
    # a model file that is not what the log gives at its iteration: named, and the run does not verify
    save_state(
        tmp_path / "peers" / "p1" / "checkpoints" / "3",
        middle,
        iteration=3,
        run_id=RUN,
        digest=checksum(middle),
        reason="checkpoint_every",
    )
    bad = verify.verify(tmp_path)
    assert not bad.ok and bad.runs[0].states_agreed == 3
    assert [p for p in bad.runs[0].problems if "saved state" in p] == [
        f"the saved state peers/p1/checkpoints/3 (iteration 3) has digest {checksum(middle)[:16]}, "
        f"the replay's state there {_replay_digest(tmp_path, 3)[:16]}"
    ]
    # ... and one beyond the replay's end, or whose files do not read back (a note, not a failure)
    save_state(
        tmp_path / "peers" / "p1" / "checkpoints" / "3",
        final,
        iteration=9,
        run_id=RUN,
        digest=checksum(final),
        reason="done",
    )
    (tmp_path / "peers" / "p0" / "checkpoints" / "2" / "state.bin").write_bytes(b"cut")
    again = verify.verify(tmp_path)
    assert (
        "the saved state peers/p1/checkpoints/3 (iteration 9) lies outside what the replay reached"
        in again.runs[0].problems
    )
    assert any(n.startswith("peers/p0/checkpoints/2: a saved state that does not read back") for n in again.notes)
    assert again.runs[0].states_agreed == 2


def _replay_digest(root, iteration):
    """The digest p0 recorded for the state at the start of ``iteration``."""
    (seg,) = updatelog.read(root / "peers" / "p0" / updatelog.FILENAME).segments
    return seg.applied[iteration - 1].digest


def test_the_command_exits_0_when_verified_1_when_not_and_2_on_a_bad_path(tmp_path, worker, capsys):
    write_run(tmp_path, worker, iterations=2)
    assert verify.main([str(tmp_path), "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["ok"] and out["runs"][0]["peers"][0]["checked"] == 3
    edit_entry(tmp_path / "peers" / "p0" / updatelog.FILENAME, 1, lambda d, m: bytes(32))
    assert verify.main([str(tmp_path)]) == 1
    assert "NOT verified" in capsys.readouterr().out
    assert verify.main([str(tmp_path / "missing")]) == 2
    assert "is neither an update log nor a folder" in capsys.readouterr().err
    empty = tmp_path / "empty"
    empty.mkdir()
    assert verify.main([str(empty)]) == 2
    assert "no updates.log under" in capsys.readouterr().err
    updatelog.Writer(empty / "p9" / updatelog.FILENAME).close()  # a peer that stopped before it took any state
    assert verify.main([str(empty)]) == 2
    assert "hold no records: no peer of it took a state" in capsys.readouterr().err


def test_the_run_secret_proves_that_the_runs_own_processes_signed_every_decision(tmp_path, worker):
    write_run(tmp_path, worker)
    report = verify.verify(tmp_path, secret=SECRET)
    assert report.ok and report.runs[0].keys_proven == 2, verify.format_report(report)
    assert (
        "authorship  2 signing keys, each proven to be held by a process with the run secret"
        in verify.format_report(report)
    )
    # another secret: no START's proof matches it, and no signing key is proven
    other = verify.verify(tmp_path, secret="another-secret")
    assert not other.ok and other.runs[0].keys_proven == 0
    problems = other.runs[0].problems
    assert sum("with a proof that does not match the run secret" in p for p in problems) == 2
    assert {p.split(" signs")[0] for p in problems if "no log proves" in p} == {"machine 0", "machine 1"}
    # without the secret, authorship is left unchecked and said to be
    plain = verify.verify(tmp_path)
    assert plain.ok and plain.runs[0].keys_proven is None
    assert "authorship  not checked" in verify.format_report(plain)


def test_a_log_made_up_with_keys_of_its_makers_own_verifies_only_without_the_secret(tmp_path, worker):
    # consistent in every respect (signatures, digests, replay), made by someone without the secret
    write_run(tmp_path, worker, secret=None)
    assert verify.verify(tmp_path).ok
    forged = verify.verify(tmp_path, secret=SECRET)
    assert not forged.ok and forged.runs[0].keys_proven == 0
    assert sum("without a proof of the run secret" in p for p in forged.runs[0].problems) == 2
    # ... and a real run's log with a proof copied from another START: the proof is bound to its key
    real = tmp_path / "real"
    write_run(real, worker)
    path = real / "peers" / "p1" / updatelog.FILENAME
    recs = records(path.read_bytes())
    p0_start = json.loads(records((real / "peers" / "p0" / updatelog.FILENAME).read_bytes())[0][1])
    start = json.loads(recs[0][1])
    recs[0] = (updatelog.START, json.dumps({**start, "proof": p0_start["proof"]}, sort_keys=True).encode())
    rewrite(path, recs)
    copied = verify.verify(real, secret=SECRET)
    assert not copied.ok and copied.runs[0].keys_proven == 1
    assert any(p.startswith("machine 1 signs from iteration 0") for p in copied.runs[0].problems)


def test_a_signing_peer_whose_log_is_missing_is_named(tmp_path, worker):
    write_run(tmp_path, worker)
    (tmp_path / "peers" / "p1" / updatelog.FILENAME).unlink()
    report = verify.verify(tmp_path, secret=SECRET)
    assert not report.ok and report.runs[0].keys_proven == 1
    assert [p for p in report.runs[0].problems if "no log proves" in p] == [
        "machine 1 signs from iteration 0 with a key that no log proves to be held by a process with the run secret: "
        "its decisions are not shown to be this run's"
    ]
    assert verify.verify(tmp_path).ok  # the remaining log alone still reproduces


def test_the_command_reads_the_secret_file(tmp_path, worker, capsys):
    write_run(tmp_path, worker)
    (tmp_path / "run.secret").write_text(SECRET + "\n")
    (tmp_path / "wrong.secret").write_text("wrong\n")
    assert verify.main([str(tmp_path), "--secret-file", str(tmp_path / "run.secret")]) == 0
    assert "2 signing keys, each proven" in capsys.readouterr().out
    assert verify.main([str(tmp_path), "--secret-file", str(tmp_path / "wrong.secret")]) == 1
    assert verify.main([str(tmp_path), "--secret-file", str(tmp_path / "missing.secret")]) == 2
    assert "missing.secret" in capsys.readouterr().err


@pytest.mark.parametrize("impl", ["auto", "reference"])
def test_a_run_with_weight_decay_verifies_with_the_kernels_and_the_numpy_specification(tmp_path, impl):
    # d = 1 - 0.05 * 0.5 = 0.975 changes every nonzero weight: a replay without the decay (or
    # with it at another iteration's rate) reproduces no digest after the first iteration
    cfg = {
        **CONFIG,
        "train": {
            **CONFIG["train"],
            "weight_decay": 0.5,
            "schedule": {"name": "cosine", "warmup_steps": 2, "init_ratio": 0.5, "decay_steps": 4, "final_ratio": 0.2},
        },
    }
    final, _ = write_run(tmp_path, Worker(load_config_dict(cfg)), iterations=4)
    report = verify.verify(tmp_path, impl=impl)
    assert report.ok, verify.format_report(report)
    (run,) = report.runs
    assert run.final_digest == checksum(final)
    assert [(p.checked, p.agreed) for p in run.peers] == [(5, 5), (5, 5)]


def test_wire_round_trip_keeps_what_verify_checks(worker, tmp_path):
    # the signatures and payloads of a logged entry come back as the peers signed them
    write_run(tmp_path, worker, iterations=1)
    (a,) = updatelog.read(tmp_path / "peers" / "p1" / updatelog.FILENAME).segments[0].applied
    again = wire.entry_from_pb(wire.entry_to_pb(a.entry))
    assert again == a.entry and np.all([len(s) == 64 for s in again.signatures])
