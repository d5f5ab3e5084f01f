"""Conversions between the protobuf messages of ``protos/zeroth/v1/peer.proto`` and the protocol values.

Decoding checks what protobuf cannot (string and list sizes, digest lengths) and raises
:class:`zeroth.net.protocol.Rejected` with ``INVALID_ARGUMENT``; the protocol checks the rest.
Encoding is total. ``decode(encode(x)) == x`` for every protocol value (tested).

A commit sent to a member (``CommitIteration``) may be a *delta* (:func:`commit_to_pb` with
``base``): its contributors and next view as changes of the view of its iteration, which every
member at that iteration holds, so a commit costs O(1) bytes instead of O(M) while the membership
holds and every member pushes its most projected gradients in time. :func:`commit_from_pb` rebuilds
the whole commit from the receiver's view (:class:`NoBase` when it does not hold that view: the
sender then sends it whole); the signature is over the whole commit, so a commit rebuilt otherwise
than it was signed is refused as any forged one.

Wire bytes: :func:`wire_size` is the serialized size of a message plus the HTTP/2 + gRPC framing
it costs on a warm connection without TLS (:data:`REQUEST_OVERHEAD`, :data:`RESPONSE_OVERHEAD`,
measured by :mod:`zeroth.net.calibrate` through a byte-counting TCP relay).
"""

from __future__ import annotations

from zeroth.net import protocol as P
from zeroth.net.proto import peer_pb2 as pb

__all__ = [
    "pb",
    "NoBase",
    "REQUEST_OVERHEAD",
    "RESPONSE_OVERHEAD",
    "TOKEN_OVERHEAD",
    "STREAM_MESSAGE_OVERHEAD",
    "MAX_CONFIG_DIGEST",
    "MAX_SIGNATURE",
    "wire_size",
    "member_to_pb",
    "member_from_pb",
    "view_to_pb",
    "view_from_pb",
    "ballot_to_pb",
    "ballot_from_pb",
    "push_to_pb",
    "push_from_pb",
    "commit_to_pb",
    "commit_from_pb",
    "relay_to_pb",
    "relay_from_pb",
    "relay_order_from_pb",
    "relay_first_from_pb",
    "entry_to_pb",
    "entry_from_pb",
    "prepare_to_pb",
    "prepare_from_pb",
    "prepare_reply_to_pb",
    "prepare_reply_from_pb",
    "leave_to_pb",
    "leave_from_pb",
]

# Framing bytes of one unary call on a warm HTTP/2 connection without TLS, measured by
# `python -m zeroth.net.calibrate` (grpcio 1.85, loopback; HPACK-indexed headers, 9-byte DATA frame
# header, 5-byte gRPC length prefix, response headers and trailers, flow-control and BDP-ping frames
# averaged in): 58 bytes around a request, 64 around a response. The shared token is sent
# literally in every request (gRPC never indexes it): 17 + len(token) more. TLS adds 22-29 bytes
# per record on top (not counted).
REQUEST_OVERHEAD = 58
RESPONSE_OVERHEAD = 64
TOKEN_OVERHEAD = 17
# One more message of a server stream: DATA frame header + gRPC length prefix.
STREAM_MESSAGE_OVERHEAD = 14
MAX_CONFIG_DIGEST = 128
MAX_SIGNATURE = 64  # Ed25519
MAX_DIGEST = 32  # SHA-256 (a chain digest)


def wire_size(message, *, kind: str, token: str | None = None) -> int:
    """Estimated bytes on the wire of one message: serialized size + framing.

    ``kind`` is ``"request"`` (plus the token when the run has one), ``"response"`` or
    ``"stream"`` (a later message of a server stream).
    """
    size = message.ByteSize()
    if kind == "request":
        return size + REQUEST_OVERHEAD + (TOKEN_OVERHEAD + len(token) if token else 0)
    if kind == "response":
        return size + RESPONSE_OVERHEAD
    if kind == "stream":
        return size + STREAM_MESSAGE_OVERHEAD
    raise ValueError(f"kind must be 'request', 'response' or 'stream', got {kind!r}")


def _str(name: str, value: str, limit: int) -> str:
    if len(value) > limit:
        raise P.Rejected("INVALID_ARGUMENT", f"{name} has {len(value)} characters; at most {limit}")
    return value


def _bytes(name: str, value: bytes, limit: int) -> bytes:
    if len(value) > limit:
        raise P.Rejected("INVALID_ARGUMENT", f"{name} has {len(value)} bytes; at most {limit}")
    return bytes(value)


def member_to_pb(m: P.Member) -> pb.Member:
    return pb.Member(machine=m.machine, address=m.address, active=m.active, key=m.key)


def member_from_pb(m: pb.Member) -> P.Member:
    return P.Member(
        int(m.machine),
        _str("member address", m.address, P.MAX_ADDRESS),
        bool(m.active),
        _bytes("member key", m.key, P.KEY_BYTES),
    )


def view_to_pb(v: P.View) -> pb.View:
    return pb.View(
        iteration=v.iteration, members=[member_to_pb(m) for m in v.members], next_machine_id=v.next_machine_id
    )


def view_from_pb(v: pb.View) -> P.View:
    if len(v.members) > P.MAX_MEMBERS:
        raise P.Rejected("INVALID_ARGUMENT", f"view has {len(v.members)} members; at most {P.MAX_MEMBERS}")
    return P.View(int(v.iteration), tuple(member_from_pb(m) for m in v.members), int(v.next_machine_id))


def ballot_to_pb(b: P.Ballot) -> pb.Ballot:
    return pb.Ballot(round=b.round, leader=b.leader)


def ballot_from_pb(b: pb.Ballot) -> P.Ballot:
    return P.Ballot(int(b.round), int(b.leader))


def push_to_pb(p: P.Push) -> pb.GradientPush:
    return pb.GradientPush(
        run_id=p.run_id,
        sender=p.sender,
        iteration=p.iteration,
        count=p.count,
        payload=p.payload,
        signature=p.signature,
        previous=p.previous,
        relay_us=p.relay_us,
    )


def push_from_pb(p: pb.GradientPush) -> P.Push:
    return P.Push(
        _str("run_id", p.run_id, P.MAX_RUN_ID),
        int(p.sender),
        int(p.iteration),
        int(p.count),
        bytes(p.payload),
        _bytes("signature", p.signature, MAX_SIGNATURE),
        _bytes("previous", p.previous, MAX_DIGEST),
        int(p.relay_us),
    )


class NoBase(Exception):
    """A commit sent as a delta of a view the receiver does not hold (or holds otherwise): it must be sent whole."""


def _delta(c: P.Commit, base: P.View, max_count: int) -> pb.CommitDelta | None:
    """``c``'s contributors and next view as changes of ``base``, the view of its iteration (None
    when ``base`` is not that view or the next view is not the one after it)."""
    if base.iteration != c.iteration or c.next_view.iteration != c.iteration + 1:
        return None
    active = base.active_ids()
    given = {m for m, _ in c.contributors}
    before = {m.machine: m for m in base.members}
    after = c.next_view.ids()
    return pb.CommitDelta(
        base=P.view_digest(base),
        absent=sorted(active - given),
        other=[pb.Contribution(machine=m, count=n) for m, n in c.contributors if m not in active or n != max_count],
        changed=[member_to_pb(m) for m in c.next_view.members if before.get(m.machine) != m],
        removed=sorted(set(before) - after),
        next_machine_id=c.next_view.next_machine_id,
    )


def _undelta(c: pb.Commit, base: P.View | None, max_count: int) -> tuple[tuple[tuple[int, int], ...], P.View]:
    """The contributors and next view of a delta commit, rebuilt from ``base`` (:class:`NoBase`)."""
    d = c.delta
    if base is None or base.iteration != c.iteration or P.view_digest(base) != bytes(d.base):
        raise NoBase(f"commit of iteration {c.iteration} changes a view this peer does not hold")
    if max(len(d.absent), len(d.other), len(d.changed), len(d.removed)) > P.MAX_MEMBERS:
        raise P.Rejected("INVALID_ARGUMENT", f"commit delta lists more than {P.MAX_MEMBERS} members")
    counts = {m: max_count for m in base.active_ids()}
    for m in d.absent:
        if counts.pop(int(m), None) is None:
            raise P.Rejected(
                "INVALID_ARGUMENT", f"commit delta: machine {m} is absent but not an active member of the view"
            )
    for x in d.other:
        counts[int(x.machine)] = int(x.count)
    members = {m.machine: m for m in base.members}
    for m in d.removed:
        if members.pop(int(m), None) is None:
            raise P.Rejected("INVALID_ARGUMENT", f"commit delta removes machine {m}, not a member of the view")
    for x in d.changed:
        m = member_from_pb(x)
        members[m.machine] = m
    # Unchanged members keep the base's very tuple, so the receiver does not check them again.
    kept = base.members if not d.removed and not d.changed else tuple(members[k] for k in sorted(members))
    view = P.View(int(c.iteration) + 1, kept, int(d.next_machine_id))
    return tuple(sorted(counts.items())), view


def commit_to_pb(c: P.Commit, base: P.View | None = None, max_count: int = 0) -> pb.Commit:
    """``c`` on the wire: whole, or with ``base`` (the view of its iteration) and ``max_count`` (the
    run's most projected gradients per member) as a delta of ``base`` (see the module docstring)."""
    delta = _delta(c, base, max_count) if base is not None else None
    if delta is not None:
        return pb.Commit(
            run_id=c.run_id,
            sender=c.sender,
            iteration=c.iteration,
            ballot=ballot_to_pb(c.ballot),
            updates_digest=c.updates_digest,
            signature=c.signature,
            previous=c.previous,
            delta=delta,
        )
    return pb.Commit(
        run_id=c.run_id,
        sender=c.sender,
        iteration=c.iteration,
        ballot=ballot_to_pb(c.ballot),
        contributors=[pb.Contribution(machine=m, count=n) for m, n in c.contributors],
        updates_digest=c.updates_digest,
        next_view=view_to_pb(c.next_view),
        signature=c.signature,
        previous=c.previous,
    )


def relay_to_pb(c: pb.Commit, entry: P.LogEntry) -> pb.Commit:
    """A copy of ``c`` (``entry``'s commit on the wire) carrying ``entry``'s payloads and their
    authors' signatures (``peers.pushes: leader``), and the relay tree's order (``entry.relays``)."""
    out = pb.Commit()
    out.CopyFrom(c)
    out.relayed_payloads.extend(entry.payloads or ())
    out.relayed_signatures.extend(entry.signatures or ())
    out.relay_order.extend(entry.relays)
    out.relay_first = entry.first
    return out


def relay_from_pb(c: pb.Commit) -> tuple[tuple[bytes, ...], tuple[bytes, ...]] | tuple[None, None]:
    """The payloads and signatures relayed with a commit (``(None, None)``: none; raises
    :class:`P.Rejected` when there are more than :data:`P.MAX_MEMBERS` or a signature is oversized)."""
    if not c.relayed_payloads and not c.relayed_signatures:
        return None, None
    if len(c.relayed_payloads) > P.MAX_MEMBERS or len(c.relayed_signatures) > P.MAX_MEMBERS:
        raise P.Rejected("INVALID_ARGUMENT", f"a commit relays more than {P.MAX_MEMBERS} payloads")
    payloads = tuple(bytes(x) for x in c.relayed_payloads)
    signatures = tuple(_bytes("relayed signature", x, MAX_SIGNATURE) for x in c.relayed_signatures)
    return payloads, signatures


def relay_order_from_pb(c: pb.Commit) -> tuple[int, ...]:
    """The relay tree's order a commit carries with its relayed payloads (:func:`P.relay_children`;
    raises :class:`P.Rejected` when it names more than :data:`P.MAX_MEMBERS` members)."""
    if len(c.relay_order) > P.MAX_MEMBERS:
        raise P.Rejected("INVALID_ARGUMENT", f"a relay order of {len(c.relay_order)} members; at most {P.MAX_MEMBERS}")
    return tuple(int(m) for m in c.relay_order)


def relay_first_from_pb(c: pb.Commit) -> int:
    """The index in the contributors of the first payload a relayed part carries (``peers.relay_parts``;
    raises :class:`P.Rejected` past :data:`P.MAX_MEMBERS`)."""
    if c.relay_first >= P.MAX_MEMBERS:
        raise P.Rejected(
            "INVALID_ARGUMENT", f"a relayed part from contributor {c.relay_first}; at most {P.MAX_MEMBERS}"
        )
    return int(c.relay_first)


def commit_from_pb(c: pb.Commit, base: P.View | None = None, max_count: int = 0) -> P.Commit:
    """The commit ``c`` carries; a delta is rebuilt from ``base``, the receiver's view of its
    iteration, and ``max_count`` (raises :class:`NoBase` without it, :class:`P.Rejected` when malformed)."""
    if len(c.contributors) > P.MAX_MEMBERS:
        raise P.Rejected(
            "INVALID_ARGUMENT", f"commit names {len(c.contributors)} contributors; at most {P.MAX_MEMBERS}"
        )
    if c.HasField("delta"):
        if not c.HasField("ballot") or c.HasField("next_view") or len(c.contributors):
            raise P.Rejected(
                "INVALID_ARGUMENT", "a delta commit has its ballot and no contributors or next_view of its own"
            )
        contributors, view = _undelta(c, base, max_count)
    else:
        if not c.HasField("ballot") or not c.HasField("next_view"):
            raise P.Rejected("INVALID_ARGUMENT", "commit lacks its ballot or next_view")
        contributors, view = tuple((int(x.machine), int(x.count)) for x in c.contributors), view_from_pb(c.next_view)
    return P.Commit(
        _str("run_id", c.run_id, P.MAX_RUN_ID),
        int(c.sender),
        int(c.iteration),
        ballot_from_pb(c.ballot),
        contributors,
        bytes(c.updates_digest),
        view,
        _bytes("signature", c.signature, MAX_SIGNATURE),
        _bytes("previous", c.previous, MAX_DIGEST),
    )


def entry_to_pb(e: P.LogEntry) -> pb.LogEntry:
    """A log entry; its payloads travel as one push per contributor (none when missing)."""
    c = e.commit
    grads = []
    if e.payloads is not None:
        sigs = e.signatures if e.signatures is not None else (b"",) * len(e.payloads)
        grads = [
            pb.GradientPush(run_id=c.run_id, sender=m, iteration=c.iteration, count=n, payload=p, signature=sig)
            for (m, n), p, sig in zip(c.contributors, e.payloads, sigs, strict=True)
        ]
    return pb.LogEntry(commit=commit_to_pb(c), gradients=grads)


def entry_from_pb(e: pb.LogEntry) -> P.LogEntry:
    commit = commit_from_pb(e.commit)
    if len(e.gradients) != len(commit.contributors):
        if len(e.gradients):
            raise P.Rejected(
                "INVALID_ARGUMENT",
                f"log entry of iteration {commit.iteration} has {len(e.gradients)} payloads for "
                f"{len(commit.contributors)} contributors",
            )
        return P.LogEntry(commit, None)
    payloads, sigs = [], []
    for (m, n), g in zip(commit.contributors, e.gradients, strict=True):
        if g.sender != m or g.count != n or g.iteration != commit.iteration:
            raise P.Rejected(
                "INVALID_ARGUMENT",
                f"log entry of iteration {commit.iteration}: payload of machine {g.sender} (count {g.count}, iteration "
                f"{g.iteration}) does not match contributor {m} (count {n})",
            )
        payloads.append(bytes(g.payload))
        sigs.append(_bytes("signature", g.signature, MAX_SIGNATURE))
    return P.LogEntry(commit, tuple(payloads), tuple(sigs))


def prepare_to_pb(p: P.Prepare) -> pb.PrepareRequest:
    return pb.PrepareRequest(
        run_id=p.run_id,
        sender=p.sender,
        iteration=p.iteration,
        ballot=ballot_to_pb(p.ballot),
        signature=p.signature,
        previous=p.previous,
        gone=p.gone,
    )


def prepare_from_pb(p: pb.PrepareRequest) -> P.Prepare:
    return P.Prepare(
        _str("run_id", p.run_id, P.MAX_RUN_ID),
        int(p.sender),
        int(p.iteration),
        ballot_from_pb(p.ballot),
        _bytes("signature", p.signature, MAX_SIGNATURE),
        _bytes("previous", p.previous, MAX_DIGEST),
        bool(p.gone),
    )


def prepare_reply_to_pb(r: P.PrepareReply) -> pb.PrepareReply:
    out = pb.PrepareReply(iteration=r.iteration, gradients=[push_to_pb(p) for p in r.pushes], previous=r.previous)
    if r.decided is not None:
        out.decided.CopyFrom(entry_to_pb(r.decided))
    return out


def prepare_reply_from_pb(r: pb.PrepareReply) -> P.PrepareReply:
    if len(r.gradients) > P.MAX_MEMBERS:
        raise P.Rejected("INVALID_ARGUMENT", f"prepare reply holds {len(r.gradients)} pushes; at most {P.MAX_MEMBERS}")
    decided = entry_from_pb(r.decided) if r.HasField("decided") else None
    previous = bytes(r.previous)
    if len(previous) not in (0, 32):
        raise P.Rejected(
            "INVALID_ARGUMENT",
            f"prepare reply's previous decision digest has {len(previous)} bytes; SHA-256 has 32 (or none)",
        )
    return P.PrepareReply(int(r.iteration), decided, tuple(push_from_pb(p) for p in r.gradients), previous)


def leave_to_pb(m: P.Leave) -> pb.LeaveRequest:
    return pb.LeaveRequest(run_id=m.run_id, sender=m.sender, iteration=m.iteration, signature=m.signature)


def leave_from_pb(m: pb.LeaveRequest) -> P.Leave:
    return P.Leave(
        _str("run_id", m.run_id, P.MAX_RUN_ID),
        int(m.sender),
        int(m.iteration),
        _bytes("signature", m.signature, MAX_SIGNATURE),
    )
