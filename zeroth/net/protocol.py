"""The Just One Byte protocol as a pure state machine: membership, barrier, takeover, joins.

No sockets, no clocks, no threads: every handler takes the protocol parameters, an immutable
:class:`PeerState`, one event and the current time ``now`` (seconds, any monotonic origin) and
returns a :class:`Step` ``(state, effects, reply)``::

    on_push :: Params -> PeerState -> Push -> float -> Step        (likewise on_commit, on_prepare, ...)
    on_tick :: Params -> PeerState -> float -> Step

Effects are instructions for the runtime (:class:`Send` a message, :class:`Probe` a member's address, :class:`Apply` a decided iteration, :class:`Compute` projected gradients,
:class:`Fetch` log entries, :class:`Admit` a joiner or :class:`JoinRefused` (ask again), :class:`Dropped`, :class:`Finished`,
:class:`Note`). A message that is malformed, stale, duplicated with other content, from an
unknown sender or outside the iteration window raises :class:`Rejected` (a status code name and
a message saying what was wrong); the caller's state is then untouched, because states are
never mutated.

The iteration, agreement (a single-decree Paxos per iteration), the decision chain, closing and
authentication are described in the docs (Systems, Just One Byte: "The protocol's design").

Example (one peer, one iteration):
  >>> p = Params(run_id="r", config_digest="c", bytes_per_value=1, max_count=4, iterations=1,
  ...            iteration_timeout_s=1.0, barrier_timeout_s=1.0)
  >>> step = founder(p, address="127.0.0.1:1", now=0.0)
  >>> [type(e).__name__ for e in step.effects]
  ['Note', 'Compute']
  >>> step = on_local_gradients(p, step.state, iteration=0, count=2, payload=b"ab", now=0.1)
  >>> [type(e).__name__ for e in step.effects], step.state.phase
  (['Apply', 'Finished'], 'done')
"""

from __future__ import annotations

import dataclasses
import hashlib
import struct
from collections.abc import Callable, Mapping
from typing import Any, NamedTuple

from zeroth.transport.identity import canonical
from zeroth.net.inbox import Inbox

__all__ = [
    "FORMING",
    "CATCHING_UP",
    "MEMBER",
    "DROPPED",
    "DONE",
    "LEFT",
    "FAILED",
    "PHASES",
    "MAX_ROUND",
    "MAX_ROUND_STEP",
    "MAX_MEMBERS",
    "MAX_ADDRESS",
    "MAX_RUN_ID",
    "UNREACHABLE_AFTER",
    "PROBE_FIRST",
    "Rejected",
    "Params",
    "Member",
    "View",
    "Ballot",
    "Push",
    "Commit",
    "CommitReply",
    "LogEntry",
    "Prepare",
    "PrepareReply",
    "Leave",
    "JoinRequest",
    "JoinAnswer",
    "Redirect",
    "Send",
    "Apply",
    "Compute",
    "Fetch",
    "Admit",
    "JoinRefused",
    "Dropped",
    "Finished",
    "Failed",
    "Note",
    "Probe",
    "Recovery",
    "Admission",
    "FetchState",
    "PeerState",
    "Step",
    "updates_digest",
    "decision_digest",
    "view_digest",
    "view_at",
    "canonical",
    "signed_bytes",
    "sign",
    "member_key",
    "committer",
    "split_address",
    "checksum_partner",
    "founder",
    "joined",
    "on_ready",
    "on_join",
    "on_leave",
    "request_leave",
    "on_local_gradients",
    "on_push",
    "on_commit",
    "on_commit_acked",
    "on_commit_failed",
    "on_push_refused",
    "prepare_probe",
    "on_prepare",
    "on_prepare_reply",
    "on_prepare_rejected",
    "on_fetched",
    "on_fetch_failed",
    "on_tick",
    "log_entries",
]

# Phases of a peer.
FORMING = "forming"  # the founder, waiting for the founding peers before iteration 0
CATCHING_UP = "catching_up"  # a joiner loading state; decisions are buffered
MEMBER = "member"  # taking part
DROPPED = "dropped"  # excluded from the run: must rejoin with a new id
DONE = "done"  # all iterations decided and applied
LEFT = "left"  # left the run on its own request
FAILED = "failed"  # gave up: no decision for two stall periods (the run lost its majority)
PHASES = (FORMING, CATCHING_UP, MEMBER, DROPPED, DONE, LEFT, FAILED)

MAX_MEMBERS = 4096  # members of one view
MAX_RELAY_US = 2**32 - 1  # a push's relay_us (uint32 on the wire)
MAX_ADDRESS = 255  # characters of a host:port address
MAX_RUN_ID = 128
UNREACHABLE_AFTER = 3  # failed commit deliveries after which a non-contributing member is removed
MAX_ROUND = 2**32  # ballot rounds are below this (a round near 2**63 is refused up front)
MAX_ROUND_STEP = 16  # a prepare's round is at most this far above the highest one promised for its iteration
KEY_BYTES = 32  # Ed25519 public key
READY_LAG = 8  # a late push (up to this many iterations) of an inactive member marks it ready to be active
_NO_BALLOT = (-1, -1)
PUSHES = ("all", "leader")  # Params.pushes: every member, or the committer (which relays them)


class Rejected(Exception):
    """A message refused: ``code`` names a gRPC status (``"INVALID_ARGUMENT"``, ...), ``message`` says why."""

    def __init__(self, code: str, message: str):
        super().__init__(f"{code}: {message}")
        self.code = code
        self.message = message


@dataclasses.dataclass(frozen=True)
class Params:
    """The fixed parameters of a run's protocol (every peer holds the same).

    Attributes:
      run_id: the run's id; messages of other runs are refused.
      config_digest: SHA-256 hex of the run's config; joiners must present the same.
      bytes_per_value: payload bytes per projected gradient (1 for onebyte, 4 for float32).
      max_count: most projected gradients of one (machine, iteration) (inferences per iteration).
      iterations: the run decides iterations ``0 .. iterations - 1`` (with gradients), then the
        closing iteration ``iterations`` (none: it confirms the last decision's chain).
      iteration_timeout_s: a member stops evaluating perturbations after this long.
      barrier_timeout_s: the committer waits this long after the iteration timeout for pushes;
        a member waits this long again for the commit before suspecting the committer.
      founders: peers the founder waits for before iteration 0 (itself included).
      forming_timeout_s: the founder starts with whoever joined after this long (or, with
        ``require_founders``, fails the run when fewer than ``founders`` joined).
      window: decided iterations kept (for late commits, takeovers and pushes ahead).
      max_pending_joins: joins the leader queues at once.
      payload_check: ``f(payload) -> error message or None``: codec-level validation of a payload
        (e.g. float32 values must be finite).
      sign: ``f(data) -> signature``: this peer's signer (Ed25519: deterministic); None = unsigned.
      verify: ``f(public_key, data, signature) -> bool``; None = signatures are not checked
        (simulations); a peer that serves others always sets it.
      stall_timeout_s: an iteration without a decision for this long is re-synchronised, and after
        as long again the peer fails (None: ``iteration_timeout_s + 6 * barrier_timeout_s``).
      max_members: joins are refused (``RESOURCE_EXHAUSTED``) while the view and the joins queued
        for the next decision hold this many members (a rejoin on a member's address replaces it
        and is not refused); at most :data:`MAX_MEMBERS`.
      idle_timeout_s: a member that stays inactive (contributes nothing: a silent member, or one
        catching up for that long) for this many seconds, as the committer saw it, is removed by
        the next decision (it must rejoin with a new id), so members that never push do not
        count toward the majority for ever; None: never (only unreachable ones are removed).
      pushes: where a member sends its push. ``"all"``: to every member (a takeover finds every
        push already in place; M·(M−1) messages an iteration). ``"leader"``: to the committer
        only, which relays the payloads and their authors' signatures inside its commit
        (:data:`PUSHES`; 2·(M−1) messages an iteration; a takeover gathers the pushes from the
        promises).
      relay_fanout: with ``pushes="leader"``, the committer sends the payloads to this many
        members and each member that takes them forwards them to as many more
        (:func:`relay_children`), so that no peer sends more than ``relay_fanout`` copies of the
        O(M) payloads; every other member gets the commit alone from the committer, as always,
        and fetches the payloads if its parent's relay does not come within the barrier timeout.
        The committer places the members whose last relay was fastest where the tree forwards
        (:func:`relay_order`; each member's push reports it). 0: the committer sends the payloads
        to every member itself.
      relay_parts: with ``relay_fanout``, the committer splits the relayed payloads into this many
        parts (in contributors order) and sends each as it goes; a relay checks and forwards a part
        as soon as it arrives, before the next, so a hop costs about one part's upload instead of
        the whole (the parts' last one still crosses every hop). 1: one relay of all of them.
      measured_timeouts: 0: the iteration and barrier timeouts above hold throughout. ``k`` (at
        least 2): each peer shortens both to ``k`` times the median of the durations of its last
        :data:`PACE_SAMPLES` iterations once it measured :data:`PACE_MIN` (never above the
        configured values), so a silent member or a lost committer costs a few iterations' time
        rather than seconds; pauses longer than ``k`` iterations (an evaluation, a compilation)
        then count as failures.
    """

    run_id: str
    config_digest: str
    bytes_per_value: int
    max_count: int
    iterations: int
    iteration_timeout_s: float
    barrier_timeout_s: float
    founders: int = 1
    forming_timeout_s: float = 60.0
    window: int = 64
    max_pending_joins: int = 64
    payload_check: Callable[[bytes], str | None] | None = None
    sign: Callable[[bytes], bytes] | None = None
    verify: Callable[[bytes, bytes, bytes], bool] | None = None
    stall_timeout_s: float | None = None
    require_founders: bool = False
    max_members: int = MAX_MEMBERS
    idle_timeout_s: float | None = None
    pushes: str = "all"
    relay_fanout: int = 0
    measured_timeouts: float = 0.0
    relay_parts: int = 1

    @property
    def stall_s(self) -> float:
        """Seconds without a decision after which the iteration is re-synchronised (then the peer fails)."""
        if self.stall_timeout_s is not None:
            return self.stall_timeout_s
        return self.iteration_timeout_s + 6 * self.barrier_timeout_s

    def __post_init__(self):
        for name in ("bytes_per_value", "max_count", "iterations", "founders", "window", "max_pending_joins"):
            v = getattr(self, name)
            if not isinstance(v, int) or v < 1:
                raise ValueError(f"Params.{name} must be an integer >= 1, got {v!r}")
        if self.stall_timeout_s is not None and not self.stall_timeout_s > 0:
            raise ValueError(f"Params.stall_timeout_s must be > 0 seconds or None, got {self.stall_timeout_s!r}")
        if self.idle_timeout_s is not None and not self.idle_timeout_s > 0:
            raise ValueError(f"Params.idle_timeout_s must be > 0 seconds or None, got {self.idle_timeout_s!r}")
        if not isinstance(self.max_members, int) or not self.founders <= self.max_members <= MAX_MEMBERS:
            raise ValueError(
                f"Params.max_members must be an integer from founders ({self.founders}) to {MAX_MEMBERS}, "
                f"got {self.max_members!r}"
            )
        if not isinstance(self.relay_fanout, int) or self.relay_fanout < 0:
            raise ValueError(f"Params.relay_fanout must be an integer >= 0, got {self.relay_fanout!r}")
        if not isinstance(self.relay_parts, int) or not 1 <= self.relay_parts <= MAX_MEMBERS:
            raise ValueError(f"Params.relay_parts must be an integer from 1 to {MAX_MEMBERS}, got {self.relay_parts!r}")
        if not (self.measured_timeouts == 0 or self.measured_timeouts >= 2):
            raise ValueError(
                f"Params.measured_timeouts must be 0 (fixed timeouts) or at least 2, got {self.measured_timeouts!r}"
            )
        if self.pushes not in PUSHES:
            raise ValueError(f"Params.pushes must be one of {PUSHES}, got {self.pushes!r}")
        for name in ("iteration_timeout_s", "barrier_timeout_s", "forming_timeout_s"):
            v = getattr(self, name)
            if not v > 0:
                raise ValueError(f"Params.{name} must be > 0 seconds, got {v!r}")


# --------------------------------------------------------------------------- values


class Member(NamedTuple):
    """A participant: ``machine`` id, ``address`` (host:port), ``active`` (expected at the barrier),
    ``key`` (its Ed25519 public key, 32 bytes; empty in unsigned simulations)."""

    machine: int
    address: str
    active: bool = True
    key: bytes = b""


class View(NamedTuple):
    """The membership of one iteration; ``members`` sorted by machine id.

    Its lookups (:meth:`ids`, :meth:`active_ids`, :meth:`leader`, :meth:`address_of`,
    :meth:`key_of`) cost O(1) after the first on a view object: the sets and the index by machine
    id are built once per view (:func:`_index`), not once per message."""

    iteration: int
    members: tuple[Member, ...]
    next_machine_id: int

    def ids(self) -> frozenset[int]:
        return _index(self)[1]

    def active_ids(self) -> frozenset[int]:
        return _index(self)[2]

    def leader(self) -> int | None:
        """The regular leader: the lowest active machine id (None without active members)."""
        return _index(self)[4]

    def address_of(self, machine: int) -> str | None:
        m = _index(self)[3].get(machine)
        return None if m is None else m.address

    def key_of(self, machine: int) -> bytes | None:
        """The public key of ``machine`` (None if it is not a member)."""
        m = _index(self)[3].get(machine)
        return None if m is None else m.key


_VIEW_INDEX: dict[int, tuple] = {}
_VIEW_INDEX_SIZE = 256  # views indexed at once (a peer uses a few: its window's; tests run several peers)


def _index(v: View) -> tuple:
    """``(view, ids, active ids, {machine: Member}, leader)`` of ``v``, built once per view object
    (held by identity; the view is kept with it, so its id is not reused while it is held)."""
    got = _VIEW_INDEX.get(id(v))
    if got is None or got[0] is not v:
        by = {m.machine: m for m in reversed(v.members)}  # the first member of an id, as a scan finds it
        active = frozenset(m.machine for m in v.members if m.active)
        got = (v, frozenset(by), active, by, min(active) if active else None)
        if len(_VIEW_INDEX) >= _VIEW_INDEX_SIZE:
            _VIEW_INDEX.clear()
        _VIEW_INDEX[id(v)] = got
    return got


class Ballot(NamedTuple):
    """Orders proposals for one iteration: ``(round, leader)``, compared as a tuple."""

    round: int
    leader: int


class Push(NamedTuple):
    """The encoded projected gradients of one (machine, iteration). ``previous``: the
    :func:`chain_digest` of the decision of ``iteration - 1`` its sender applied (the state its
    gradients were computed on; signed with the rest): a decision takes only pushes that continue
    its own chain. ``relay_us``: outside the signature, a hint for the committer's
    :func:`relay_order`: microseconds per child its sender's last relay took (0: none yet)."""

    run_id: str
    sender: int
    iteration: int
    count: int
    payload: bytes
    signature: bytes = b""
    previous: bytes = b""
    relay_us: int = 0


class Commit(NamedTuple):
    """The decision of one iteration (the barrier). ``contributors``: ``((machine, count), ...)`` sorted.
    ``previous``: the :func:`chain_digest` of the decision of ``iteration - 1`` it continues (b"" for
    the first iteration of a run or of a resumed run): decisions form a hash chain, and a member
    takes only a decision that continues the one it applied."""

    run_id: str
    sender: int
    iteration: int
    ballot: Ballot
    contributors: tuple[tuple[int, int], ...]
    updates_digest: bytes
    next_view: View
    signature: bytes = b""
    previous: bytes = b""


class LogEntry(NamedTuple):
    """A decided iteration; ``payloads`` aligned with ``commit.contributors`` (None while missing),
    ``signatures``: each contributor's signature of its push (relayed so any peer can verify them).
    ``relays``: only on an entry relayed down the tree (:func:`relay_children`), the members placed
    first in it (:func:`relay_order`); () in every entry held, logged or fetched. ``first``: only on
    a relayed part (``Params.relay_parts``), the index in ``commit.contributors`` of its first
    payload (its payloads are the contributors' from there); 0 in every entry held, logged or fetched."""

    commit: Commit
    payloads: tuple[bytes, ...] | None
    signatures: tuple[bytes, ...] | None = None
    relays: tuple[int, ...] = ()
    first: int = 0


class Prepare(NamedTuple):
    """A takeover of ``iteration`` with ``ballot``, continuing the chain ``previous`` (the candidate's
    :func:`chain_digest` of the decision of ``iteration - 1``): a member on another chain does not
    promise, so a takeover never counts members whose decisions it cannot continue. ``gone``: the
    regular leader of the iteration refused the candidate's connection (its process is gone): a
    member that finds it gone too promises before its iteration timeout (:func:`prepare_probe`)."""

    run_id: str
    sender: int
    iteration: int
    ballot: Ballot
    signature: bytes = b""
    previous: bytes = b""
    gone: bool = False


class PrepareReply(NamedTuple):
    """A promise: the responder's iteration, its decision of the iteration if any, else its pushes;
    ``previous``: :func:`decision_digest` of the decision of ``iteration - 1`` it applied (b"": none)."""

    iteration: int
    decided: LogEntry | None
    pushes: tuple[Push, ...]
    previous: bytes = b""


class Leave(NamedTuple):
    """``sender`` stops contributing from ``iteration`` on."""

    run_id: str
    sender: int
    iteration: int
    signature: bytes = b""


class JoinRequest(NamedTuple):
    """A peer at ``address`` asks to join; ``request_id`` is the runtime's handle for the answer;
    ``key`` its public key (the runtime checked its proof of the run secret)."""

    request_id: int
    address: str
    config_digest: str
    key: bytes = b""


class JoinAnswer(NamedTuple):
    """The id given to a joiner, the view of its first iteration and the :func:`chain_digest` of the
    decision that handed that view on (b"" before the first decision): its first push continues it."""

    machine: int
    view: View
    chain: bytes = b""


class Redirect(NamedTuple):
    """Reply to a join sent to a peer that is not the committer: ask ``address``."""

    address: str


# --------------------------------------------------------------------------- effects


class Send(NamedTuple):
    """Send ``message`` (:class:`Push`, :class:`Commit`, :class:`Prepare`, :class:`Leave`) to a member."""

    machine: int
    address: str
    message: Any


class Apply(NamedTuple):
    """Apply a decided iteration (complete payloads), in order."""

    entry: LogEntry


class Compute(NamedTuple):
    """Evaluate projected gradients for ``iteration`` until the count is reached or ``deadline``."""

    iteration: int
    deadline: float


class Fetch(NamedTuple):
    """Fetch decided iterations ``first..last`` (inclusive) from ``address`` (then :func:`on_fetched`)."""

    address: str
    first: int
    last: int


class Admit(NamedTuple):
    """Answer the join ``request_id``."""

    request_id: int
    answer: JoinAnswer


class JoinRefused(NamedTuple):
    """Answer the join ``request_id`` with ``UNAVAILABLE: reason``: it was queued here, but this peer
    no longer decides (a takeover or a leader change); the joiner asks again."""

    request_id: int
    reason: str


class Dropped(NamedTuple):
    """This peer is out of the run (it must rejoin with a new id)."""

    reason: str


class Finished(NamedTuple):
    """This peer stopped: ``reason`` is ``"done"`` (all iterations) or ``"left"``."""

    iteration: int
    reason: str


class Failed(NamedTuple):
    """This peer gives up (the run cannot go on, e.g. it lost its majority): ``reason`` is one line."""

    iteration: int
    reason: str


class Note(NamedTuple):
    """A line for the log."""

    text: str


class Probe(NamedTuple):
    """Ask whether anything still listens at ``address`` (``machine``'s): a connection refused there
    is :func:`on_push_refused` for ``iteration`` (the runtime tries a TCP connection of its own).
    The committer of ``iteration`` sends it to the members whose push it still waits for, and the
    other active members to the committer whose decision they wait for (:func:`_probe_waits`): a
    peer killed after it took our push, before it pushed its own or decided, refuses nothing else,
    and we would wait for the deadline (the barrier's, or the commit's before a takeover)."""

    machine: int
    address: str
    iteration: int


# --------------------------------------------------------------------------- state


class Recovery(NamedTuple):
    """A takeover in progress: our ballot, the promises received, the deadline."""

    ballot: Ballot
    replies: Mapping[int, PrepareReply]
    deadline: float


class Admission(NamedTuple):
    """Joiners admitted by our commit, answered once members that hold it meet every majority of ``base``."""

    base: frozenset[int]
    acks: frozenset[int]
    joins: tuple[tuple[int, Member], ...]
    view: View
    chain: bytes = b""


class FetchState(NamedTuple):
    """A log fetch in flight (``attempt`` counts the fetches of this peer, to rotate sources).

    ``address``: the source; ``check``: compare the fetched past entries with the applied ones
    (a conflicting past commit arrived); ``failed``: the fetch failed and this is its back-off
    (nothing in flight until ``deadline``)."""

    first: int
    last: int
    deadline: float
    attempt: int
    address: str = ""
    check: bool = False
    failed: bool = False


class PeerState(NamedTuple):
    """Everything a peer knows about the run (immutable; handlers return a new one).

    Attributes:
      me: this peer's machine id.
      phase: one of :data:`PHASES`.
      it: the next iteration to apply (all before it are decided and handed to :class:`Apply`).
      view: the view of ``it``.
      started_at: when ``it`` started here.
      deadline: the barrier deadline (committer) or the commit deadline (others).
      waits: expired waits for a decision of a member that cannot take over (an inactive one).
      inbox: ``{(iteration, machine): Push}`` for iterations >= ``it`` (an :class:`Inbox`: a push adds
        to it without copying it).
      decided: ``{iteration: LogEntry}``: applied ones (the last ``window``) and buffered ones.
      promised: ``{iteration: Ballot}``: the highest ballot seen per iteration of the window (applied ones too).
      suspected: committers of ``it`` this peer gave up on.
      recovery: our takeover of ``it``, if any.
      joins: ``((request_id, address, key), ...)`` waiting for our next commit.
      admissions: ``{iteration: Admission}`` of our commits not yet answered.
      ready: catching-up members that showed they are ready to contribute.
      leaves: members that asked to leave.
      leaving: this peer asked to leave.
      failures: consecutive failed commit deliveries per member.
      computed: the last iteration a :class:`Compute` was issued for.
      fetch: the log fetch in flight.
      fetches: fetches issued so far (the source rotates with it).
      forming_deadline: when the founder stops waiting for founders.
      resynced_at: when this peer last re-synchronised a stuck iteration.
      denials: sources that refused this peer's log requests as a non-member (reset by a fetch that works).
      ahead: the newest iteration an unverifiable commit (a hint) named: fetched up to it once.
      refused: members whose connection refused our push of ``it`` (:func:`on_push_refused`).
      probe_at: when this peer's next :class:`Probe` round for ``it`` is due (:func:`_probe_waits`).
      chosen: the newest applied iteration whose decision this peer knows is chosen (members that
        meet every majority of its view applied that same commit, ballot included, its signer among
        them: no later ballot can decide otherwise), -1 if none.
      last_takeover: ``(iteration, round)`` of this peer's latest takeover ballot: a takeover never
        uses one of its ballots twice (a second proposal under a ballot could carry another value).
      chain: the :func:`chain_digest` of the decision of ``it - 1`` this peer applied (b"" before a
        run's first decision; None: not known, a joiner that loaded a newer snapshot, until it
        applies a decision); its pushes and decisions of ``it`` continue it.
      strays: members whose push of ``it`` continues another decision of ``it - 1`` (signed
        evidence that this peer's chain is not theirs; a majority of them drops this peer).
      floor: ``{iteration: Ballot}``: promises a re-synchronisation set aside. They no longer name
        who is expected to decide (the lowest unsuspected member takes over again, so two
        candidates do not duel on their own old ballots), but as an acceptor this peer still
        refuses any ballot below them (:func:`_bound`).
      idle: ``{machine: time}``: when this peer first started an iteration whose view had that
        member inactive (it is removed once inactive for ``Params.idle_timeout_s``; an active
        member, or one no longer in the view, has no entry).
      relay_wait: ``(iteration, until)``: this peer holds the commit of ``iteration`` without its
        payloads and waits until ``until`` for its relay parent to forward them
        (``Params.relay_fanout``) before it fetches them.
      relaying: ``(iteration, since, waiting, answered, last)`` of this peer's latest relay: when
        it forwarded the payloads, the children yet to answer, how many answered and when the
        last did (:func:`on_commit_acked`).
      relay_us: microseconds per child its latest relay took (0: none yet), reported in its pushes.
      parts: ``{iteration: {first: (payloads, signatures)}}``: relayed parts of a decision's
        payloads (``Params.relay_parts``), each checked, held until they are all in.
      prev_view: the view of ``it - 1`` (None before the first decision applied here), for
        :func:`view_at` where no decision of ``it - 2`` is held to hand it on.
      paces: the durations of its last :data:`PACE_SAMPLES` iterations, from starting one to
        applying its decision (``Params.measured_timeouts``).
    """

    me: int
    phase: str
    it: int
    view: View
    started_at: float
    deadline: float
    waits: int
    inbox: Inbox
    decided: Mapping[int, LogEntry]
    promised: Mapping[int, Ballot]
    suspected: frozenset[int]
    recovery: Recovery | None
    joins: tuple[tuple[int, str, bytes], ...]
    admissions: Mapping[int, Admission]
    ready: frozenset[int]
    leaves: frozenset[int]
    leaving: bool
    failures: Mapping[int, int]
    computed: int
    fetch: FetchState | None
    fetches: int
    forming_deadline: float
    resynced_at: float = float("-inf")
    denials: frozenset = frozenset()
    ahead: int = -1
    refused: frozenset[int] = frozenset()
    probe_at: float = 0.0
    chosen: int = -1
    last_takeover: tuple[int, int] = (-1, 0)
    chain: bytes | None = b""
    strays: frozenset[int] = frozenset()
    floor: Mapping[int, Ballot] = {}
    idle: Mapping[int, float] = {}
    relay_wait: tuple[int, float] = (-1, 0.0)
    relaying: tuple[int, float, frozenset, int, float] = (-1, 0.0, frozenset(), 0, 0.0)
    relay_us: int = 0
    paces: tuple[float, ...] = ()
    parts: Mapping[int, Mapping[int, tuple]] = {}
    prev_view: View | None = None


class CommitReply(NamedTuple):
    """What a member answers a commit (:func:`on_commit`).

    Attributes:
      stored: it holds that commit (that decision at that ballot). False: it took it only as a hint
        (it is behind and fetches the log), or it holds another decision of that iteration.
      previous: :func:`decision_digest` of its decision of the iteration before, when that one
        admitted members (b"" otherwise): a member that missed that commit and fetched it tells the
        committer that it holds it now.
    """

    stored: bool
    previous: bytes = b""


class Step(NamedTuple):
    """What a handler returns: the new state, effects in order, and a direct reply (or None)."""

    state: PeerState
    effects: tuple
    reply: Any = None


# --------------------------------------------------------------------------- helpers


def updates_digest(contributors, payloads) -> bytes:
    """SHA-256 over ``(machine, count, len, payload)`` of each contributor, in order (32 bytes)."""
    h = hashlib.sha256(b"zeroth-updates-v1\n")
    for (machine, count), payload in zip(contributors, payloads, strict=True):
        h.update(struct.pack("<IIQ", machine, count, len(payload)))
        h.update(payload)
    return h.digest()


_COMMIT_DIGESTS: dict[tuple[str, int], tuple[Commit, bytes]] = {}


def _per_commit(kind: str, commit: Commit, fn) -> bytes:
    """``fn(commit)``, computed once per commit object (its encoding is O(members)): held by identity,
    the commit kept with it so that its id is not reused while it is held."""
    key = (kind, id(commit))
    got = _COMMIT_DIGESTS.get(key)
    if got is None or got[0] is not commit:
        got = (commit, fn(commit))
        if len(_COMMIT_DIGESTS) >= 1024:
            _COMMIT_DIGESTS.clear()
        _COMMIT_DIGESTS[key] = got
    return got[1]


def decision_digest(commit: Commit) -> bytes:
    """SHA-256 of :func:`signed_bytes` of a decision: equal digests mean the same iteration, ballot and value."""
    return _per_commit("decision", commit, lambda c: hashlib.sha256(signed_bytes(c)).digest())


def chain_digest(commit: Commit) -> bytes:
    """SHA-256 of a decision's value and of the chain it continues (``commit.previous``): equal
    digests mean the same decisions of this iteration and of every one before it. The ballot and
    the signer are left out: a takeover that re-issues a decision keeps its chain."""
    return _per_commit(
        "chain",
        commit,
        lambda c: hashlib.sha256(
            canonical(
                "zeroth-chain-v1",
                c.run_id,
                c.iteration,
                c.previous,
                c.contributors,
                c.updates_digest,
                _view_fields(c.next_view),
            )
        ).digest(),
    )


def _view_fields(v: View) -> tuple:
    return (v.iteration, tuple((m.machine, m.address, m.active, m.key) for m in v.members), v.next_machine_id)


def signed_bytes(msg) -> bytes:
    """The bytes a sender signs for a :class:`Push`, :class:`Commit`, :class:`Prepare` or :class:`Leave`:
    :func:`canonical` of a domain tag and every field but the signature (run id, sender, iteration
    and, for commits and prepares, the ballot: a signature never fits another run, iteration or
    ballot; for pushes, commits and prepares, the chain they continue; for prepares, whether the
    candidate found the leader gone)."""
    if isinstance(msg, Push):
        return canonical("zeroth-push-v2", msg.run_id, msg.sender, msg.iteration, msg.count, msg.payload, msg.previous)
    if isinstance(msg, Commit):
        return canonical(
            "zeroth-commit-v2",
            msg.run_id,
            msg.sender,
            msg.iteration,
            tuple(msg.ballot),
            msg.contributors,
            msg.updates_digest,
            _view_fields(msg.next_view),
            msg.previous,
        )
    if isinstance(msg, Prepare):
        return canonical(
            "zeroth-prepare-v3", msg.run_id, msg.sender, msg.iteration, tuple(msg.ballot), msg.previous, bool(msg.gone)
        )
    if isinstance(msg, Leave):
        return canonical("zeroth-leave-v1", msg.run_id, msg.sender, msg.iteration)
    raise TypeError(f"signed_bytes() takes Push, Commit, Prepare or Leave, got {type(msg).__name__}")


def sign(params: Params, msg):
    """``msg`` with this peer's signature (``params.sign``), or unchanged without a signer."""
    if params.sign is None:
        return msg
    return msg._replace(signature=params.sign(signed_bytes(msg)))


def _verify(params: Params, view: View | None, msg, what: str, key: bytes | None = None) -> None:
    """Refuse ``msg`` unless the key ``view`` gives its sender (or ``key``) signed it (no-op without ``params.verify``)."""
    if params.verify is None:
        return
    if key is None:
        key = view.key_of(msg.sender) if view is not None else None
    if key is None:
        raise Rejected(
            "PERMISSION_DENIED",
            f"{what}: machine {msg.sender} is not a member of iteration {view.iteration if view else '?'}",
        )
    if len(key) != KEY_BYTES or not msg.signature:
        raise Rejected("UNAUTHENTICATED", f"{what}: not signed by machine {msg.sender}")
    if not params.verify(key, signed_bytes(msg), msg.signature):
        raise Rejected("UNAUTHENTICATED", f"{what}: the signature is not machine {msg.sender}'s")


_VIEW_DIGESTS: dict[int, tuple[View, bytes]] = {}


def view_digest(v: View) -> bytes:
    """SHA-256 of a view's fields (iteration, members, next id): what a commit sent as a delta
    names as the view it changes (``zeroth.v1.CommitDelta.base``). Computed once per view object."""
    got = _VIEW_DIGESTS.get(id(v))
    if got is None or got[0] is not v:
        got = (v, hashlib.sha256(canonical("zeroth-view-v1", *_view_fields(v))).digest())
        if len(_VIEW_DIGESTS) >= _VIEW_INDEX_SIZE:
            _VIEW_DIGESTS.clear()
        _VIEW_DIGESTS[id(v)] = got
    return got[1]


def view_at(st: PeerState, t: int) -> View | None:
    """The view of iteration ``t`` as far as this peer has verified it (None: not known): its current
    one, or the one the decision of ``t - 1`` it holds handed on."""
    return _view_at(st, t)


def _view_at(st: PeerState, t: int) -> View | None:
    """The view of iteration ``t`` as far as this peer has verified it (None: not known)."""
    if t == st.it:
        return st.view
    prev = st.decided.get(t - 1)
    if prev is not None:
        return prev.commit.next_view
    # The view this peer decided or applied ``it - 1`` in (a run's first decision has no decision
    # before it to hand its view on): without it the first commit would travel whole, O(M) bytes
    # to each of M members.
    return st.prev_view if st.prev_view is not None and st.prev_view.iteration == t else None


def member_key(st: PeerState, machine: int) -> bytes | None:
    """The public key of ``machine`` in the current view, a view of the window, or a view being admitted.

    Log, checksum and state requests are verified with it: a member removed a few iterations ago
    can still fetch the log (and so learn that it was removed); a joiner admitted by a commit can
    download the state at once.
    """
    key = st.view.key_of(machine)
    if key is not None:
        return key
    for t in sorted(st.decided, reverse=True):
        key = st.decided[t].commit.next_view.key_of(machine)
        if key is not None:
            return key
    for adm in st.admissions.values():
        key = adm.view.key_of(machine)
        if key is not None:
            return key
    return None


def _check_succession(view: View, nxt: View, what: str) -> None:
    """The view a commit of ``view.iteration`` hands on: members keep their address and key (nobody,
    not even a committer, can re-key another member), new members get fresh ids and join inactive."""
    if nxt.members is view.members and nxt.next_machine_id >= view.next_machine_id:
        return  # the very same members (O(1) a commit while the membership holds)
    old = {m.machine: m for m in view.members}
    for m in nxt.members:
        o = old.get(m.machine)
        if o is not None:
            if o.key != m.key or o.address != m.address:
                raise Rejected(
                    "INVALID_ARGUMENT", f"{what}: the next view changes the address or key of machine {m.machine}"
                )
        elif m.machine < view.next_machine_id or m.active:
            raise Rejected(
                "INVALID_ARGUMENT", f"{what}: machine {m.machine} is neither a member nor a new (inactive) joiner"
            )
    if nxt.next_machine_id < view.next_machine_id:
        raise Rejected(
            "INVALID_ARGUMENT",
            f"{what}: next_machine_id goes back from {view.next_machine_id} to {nxt.next_machine_id}",
        )


def _verify_entry(params: Params, view: View | None, e: LogEntry, what: str, keys: Callable | None = None) -> None:
    """A decided entry: its commit signed by its sender in ``view`` (or ``keys(machine)``), every payload
    signed by its contributor, and (with ``view``) a next view that follows from it."""
    _verify(params, view, e.commit, what, key=keys(e.commit.sender) if keys else None)
    if view is not None:
        _check_succession(view, e.commit.next_view, what)
    _verify_payloads(params, view, e, what, keys)


def _verify_payloads(params: Params, view: View | None, e: LogEntry, what: str, keys: Callable | None = None) -> None:
    """Every payload of a decided entry signed by its contributor (in ``view``, or ``keys(machine)``)."""
    if params.verify is None or e.payloads is None:
        return
    sigs = e.signatures
    if sigs is None or len(sigs) != len(e.payloads):
        raise Rejected("UNAUTHENTICATED", f"{what}: the payloads carry no signatures of their senders")
    c = e.commit
    for (m, n), payload, sig in zip(c.contributors, e.payloads, sigs, strict=True):
        push = Push(c.run_id, m, c.iteration, n, payload, sig, c.previous)
        _verify(params, view, push, f"{what} payload of machine {m}", key=keys(m) if keys else None)


def committer(state: PeerState) -> int | None:
    """Who is expected to decide ``state.it``: a promised takeover leader, else the lowest unsuspected active id."""
    b = state.promised.get(state.it)
    if b is not None and b.round > 0 and b.leader not in state.suspected:
        return b.leader
    if not state.suspected:
        return state.view.leader()  # O(1): the view's lowest active id, computed once per view
    cands = state.view.active_ids() - state.suspected
    return min(cands) if cands else None


def checksum_partner(view: View, me: int, iteration: int, every: int = 1) -> int | None:
    """The active member ``me`` compares its state digest with at ``iteration`` (rotating), or None.

    Members sorted by id; partner = the member ``1 + (iteration // every) % (n - 1)`` places after
    ``me``, so over ``n - 1`` comparisons a member meets every other one. None when ``every`` is 0,
    ``iteration`` is not a multiple of it, ``me`` is not active or it is alone.
    """
    if every <= 0 or iteration % every:
        return None
    act = sorted(view.active_ids())
    if me not in act or len(act) < 2:
        return None
    n = len(act)
    shift = 1 + (iteration // every) % (n - 1)
    return act[(act.index(me) + shift) % n]


def _majority(responders, base) -> bool:
    base = frozenset(base)
    return len(frozenset(responders) & base) * 2 > len(base)


def _commit_reply(st: PeerState, commit: Commit, stored: bool) -> CommitReply:
    """Our answer to ``commit``: whether we hold it, and our decision of the iteration before when
    it admitted members (its next view holds an id its own view lacks)."""
    t = commit.iteration - 1
    before = st.decided.get(t)
    if before is None:
        return CommitReply(stored)
    view = _view_at(st, t)
    if view is not None and before.commit.next_view.ids() <= view.ids():
        return CommitReply(stored)  # it admitted no one
    return CommitReply(stored, decision_digest(before.commit))


def _meets_every_majority(holders, base) -> bool:
    """Whether ``holders`` share a member with every majority of ``base``: at least
    ``len(base) - majority + 1`` of its members (a majority of an odd ``base``, half of an even one).

    A value held at one ballot by such a set is the only one any later ballot can decide: a
    takeover needs the promises of a majority, one of them reports the value, and the takeover
    re-issues the highest-ballot value it is shown (two quorums that intersect, as in Flexible
    Paxos). Answering a joiner needs no more than that: its admission stays in every decision."""
    base = frozenset(base)
    return bool(base) and len(frozenset(holders) & base) >= len(base) - len(base) // 2


def _put(mapping: Mapping, key, value) -> dict:
    out = dict(mapping)
    out[key] = value
    return out


def _check_run(params: Params, run_id: str) -> None:
    if run_id != params.run_id:
        raise Rejected("FAILED_PRECONDITION", f"run id {run_id[:MAX_RUN_ID]!r} is not this run's {params.run_id!r}")


def _check_uint(name: str, v, limit: int = 2**32) -> None:
    if not isinstance(v, int) or isinstance(v, bool) or not 0 <= v < limit:
        raise Rejected("INVALID_ARGUMENT", f"{name} must be an integer in [0, {limit}), got {v!r}")


def _check_in_run(params: Params, t: int, what: str) -> None:
    if t > params.iterations:
        raise Rejected(
            "OUT_OF_RANGE",
            f"{what} of iteration {t}: the run decides iterations 0..{params.iterations} "
            f"({params.iterations}: the closing one)",
        )


def _check_payload(params: Params, count: int, payload: bytes, what: str, iteration: int) -> None:
    _check_uint(f"{what} count", count)
    if iteration >= params.iterations:
        if count != 0 or payload != b"":
            raise Rejected(
                "INVALID_ARGUMENT",
                f"{what}: the closing iteration {params.iterations} carries no gradients (count 0, an empty payload), "
                f"got count {count} and {len(payload) if isinstance(payload, bytes) else type(payload).__name__} byte(s)",
            )
        return
    if not 1 <= count <= params.max_count:
        raise Rejected(
            "INVALID_ARGUMENT", f"{what}: count {count} is outside [1, {params.max_count}] (inferences per iteration)"
        )
    if not isinstance(payload, bytes):
        raise Rejected("INVALID_ARGUMENT", f"{what}: payload must be bytes, got {type(payload).__name__}")
    want = count * params.bytes_per_value
    if len(payload) != want:
        raise Rejected(
            "INVALID_ARGUMENT",
            f"{what}: payload has {len(payload)} bytes; {count} values of {params.bytes_per_value} byte(s) need {want}",
        )
    if params.payload_check is not None:
        err = params.payload_check(payload)
        if err:
            raise Rejected("INVALID_ARGUMENT", f"{what}: {err}")


def _check_previous(previous, what: str) -> None:
    if not isinstance(previous, bytes) or len(previous) not in (0, 32):
        n = len(previous) if isinstance(previous, bytes) else type(previous).__name__
        raise Rejected(
            "INVALID_ARGUMENT",
            f"{what}: previous must be a 32-byte chain digest (or empty before the first decision), got {n}",
        )


def split_address(address) -> tuple[str, int]:
    """``(host, port)`` of a member's ``host:port`` address (an IPv6 host without its brackets).

    Example:
      >>> split_address("127.0.0.1:5000"), split_address("[::1]:7")
      (('127.0.0.1', 5000), ('::1', 7))

    Raises:
      Rejected: ``INVALID_ARGUMENT``, not ``host:port`` of 3 to :data:`MAX_ADDRESS` characters
        with a port in 1..65535.
    """
    if not isinstance(address, str) or not 3 <= len(address) <= MAX_ADDRESS or ":" not in address:
        raise Rejected(
            "INVALID_ARGUMENT", f"address must be 'host:port' (3..{MAX_ADDRESS} characters), got {address!r:.80}"
        )
    host, _, port = address.rpartition(":")
    if not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise Rejected("INVALID_ARGUMENT", f"address {address!r:.80} has no valid port (1..65535)")
    return (host[1:-1] if host.startswith("[") and host.endswith("]") else host), int(port)


def _check_address(address) -> None:
    split_address(address)


def _check_view(params: Params, view: View, what: str, known: View | None = None) -> None:
    """Raises :class:`Rejected` unless ``view`` is well formed; its members are not checked again
    when they are the very tuple of ``known``, a view this peer holds (O(1) a commit while the
    membership holds, instead of O(M))."""
    _check_uint(f"{what} iteration", view.iteration, 2**63)
    _check_uint(f"{what} next_machine_id", view.next_machine_id, 2**32 + 1)
    if known is None or view.members is not known.members:
        if len(view.members) > MAX_MEMBERS:
            raise Rejected("INVALID_ARGUMENT", f"{what} has {len(view.members)} members; at most {MAX_MEMBERS}")
        ids = [m.machine for m in view.members]
        for m in view.members:
            _check_uint(f"{what} member id", m.machine)
            _check_address(m.address)
            if not isinstance(m.key, bytes) or len(m.key) not in (0, KEY_BYTES):
                raise Rejected(
                    "INVALID_ARGUMENT", f"{what} member {m.machine} key must be {KEY_BYTES} bytes, got {len(m.key)}"
                )
        if ids != sorted(set(ids)):
            raise Rejected(
                "INVALID_ARGUMENT", f"{what} members must be sorted by machine id without repeats, got {ids[:16]}"
            )
    last = view.members[-1].machine if view.members else None
    if last is not None and view.next_machine_id <= last:
        raise Rejected(
            "INVALID_ARGUMENT",
            f"{what} next_machine_id {view.next_machine_id} must exceed every member id (max {last})",
        )


def _check_commit(params: Params, c: Commit, known: View | None = None) -> None:
    """Raises :class:`Rejected` unless ``c`` is well formed (``known``: see :func:`_check_view`)."""
    _check_run(params, c.run_id)
    _check_uint("commit sender", c.sender)
    _check_uint("commit iteration", c.iteration, 2**63)
    _check_in_run(params, c.iteration, "commit")
    _check_uint("ballot round", c.ballot.round, 2**63)
    _check_uint("ballot leader", c.ballot.leader)
    if c.ballot.leader != c.sender:
        raise Rejected(
            "INVALID_ARGUMENT", f"commit from machine {c.sender} carries the ballot of machine {c.ballot.leader}"
        )
    ids = [m for m, _ in c.contributors]
    if ids != sorted(set(ids)):
        raise Rejected(
            "INVALID_ARGUMENT", f"commit contributors must be sorted by machine id without repeats, got {ids[:16]}"
        )
    if len(ids) > MAX_MEMBERS:
        raise Rejected("INVALID_ARGUMENT", f"commit names {len(ids)} contributors; at most {MAX_MEMBERS}")
    closing = c.iteration >= params.iterations
    for m, n in c.contributors:
        _check_uint("contributor id", m)
        if closing and n != 0:
            raise Rejected(
                "INVALID_ARGUMENT",
                f"contributor {m} count {n} in the closing iteration {c.iteration}; it carries no gradients (0)",
            )
        if not closing and not 1 <= n <= params.max_count:
            raise Rejected("INVALID_ARGUMENT", f"contributor {m} count {n} is outside [1, {params.max_count}]")
    if not isinstance(c.updates_digest, bytes) or len(c.updates_digest) != 32:
        raise Rejected("INVALID_ARGUMENT", f"updates_digest must be 32 bytes (SHA-256), got {len(c.updates_digest)}")
    _check_previous(c.previous, f"commit of iteration {c.iteration}")
    _check_uint("ballot round", c.ballot.round, MAX_ROUND)
    _check_view(params, c.next_view, "commit next_view", known)
    if c.next_view.iteration != c.iteration + 1:
        raise Rejected(
            "INVALID_ARGUMENT",
            f"commit of iteration {c.iteration} carries the view of iteration {c.next_view.iteration}",
        )


def _same_value(a: Commit, b: Commit) -> bool:
    return (
        a.contributors == b.contributors
        and a.updates_digest == b.updates_digest
        and a.next_view == b.next_view
        and a.previous == b.previous
    )


def _bound(st: PeerState, t: int) -> Ballot | None:
    """The lowest ballot this peer may still accept for ``t`` as an acceptor: its promise, or a
    promise a re-synchronisation set aside (:attr:`PeerState.floor`), whichever is higher."""
    bounds = [b for b in (st.promised.get(t), st.floor.get(t)) if b is not None]
    return max(bounds) if bounds else None


def _check_continues(st: PeerState, t: int, previous: bytes, what: str) -> None:
    """Refuse ``what`` (a message of iteration ``t``) unless it continues the decision of ``t - 1``
    this peer holds (when it holds one): a commit, a push or a takeover on another chain."""
    before = _chain_before(st, t)
    if before is not None and previous != before:
        raise Rejected(
            "FAILED_PRECONDITION",
            f"{what} continues another decision of iteration {t - 1} (chain {previous.hex()[:16] or 'none'}) "
            f"than the one this peer holds ({before.hex()[:16] or 'none'})",
        )


def _chain_before(st: PeerState, t: int) -> bytes | None:
    """The chain a decision, push or prepare of ``t`` must continue here: ours for ``it``, else that
    of the decision of ``t - 1`` held (applied in the window, or buffered); None: not known."""
    if t == st.it:
        return st.chain
    prev = st.decided.get(t - 1)
    return chain_digest(prev.commit) if prev is not None else None


def _assemble(state: PeerState, commit: Commit) -> tuple[tuple[bytes, ...], tuple[bytes, ...]] | None:
    """``(payloads, signatures)`` of ``commit`` from the (verified) inbox, if all present and matching its digest."""
    payloads, sigs = [], []
    for m, n in commit.contributors:
        push = state.inbox.get((commit.iteration, m))
        if push is None or push.count != n:
            return None
        payloads.append(push.payload)
        sigs.append(push.signature)
    if updates_digest(commit.contributors, payloads) != commit.updates_digest:
        return None
    return tuple(payloads), tuple(sigs)


def _blank(me: int, phase: str, view: View, now: float) -> PeerState:
    return PeerState(
        me=me,
        phase=phase,
        it=view.iteration,
        view=view,
        started_at=now,
        deadline=now,
        waits=0,
        inbox=Inbox(),
        decided={},
        promised={},
        suspected=frozenset(),
        recovery=None,
        joins=(),
        admissions={},
        ready=frozenset(),
        leaves=frozenset(),
        leaving=False,
        failures={},
        computed=-1,
        fetch=None,
        fetches=0,
        forming_deadline=now,
    )


def log_entries(state: PeerState, first: int, last: int) -> list[LogEntry]:
    """Complete decided entries ``first..last`` held in the state's window, consecutive from ``first``."""
    out = []
    for t in range(first, last + 1):
        e = state.decided.get(t)
        if e is None or e.payloads is None or t >= state.it:
            break
        out.append(e)
    return out


# --------------------------------------------------------------------------- iteration flow


PACE_SAMPLES = 16
"""Iteration durations a peer keeps (:attr:`PeerState.paces`) for ``Params.measured_timeouts``."""
PACE_MIN = 4
"""Durations measured before ``Params.measured_timeouts`` shortens a timeout."""


def _pace(st: PeerState) -> float | None:
    """The median of this peer's last iterations' durations (None: fewer than :data:`PACE_MIN`)."""
    if len(st.paces) < PACE_MIN:
        return None
    return sorted(st.paces)[len(st.paces) // 2]


def _measured(params: Params, st: PeerState, configured: float) -> float:
    """``configured``, or with ``Params.measured_timeouts`` = k at most k times this peer's :func:`_pace`."""
    pace = _pace(st) if params.measured_timeouts else None
    return configured if pace is None else min(configured, params.measured_timeouts * pace)


def _iteration_s(params: Params, st: PeerState) -> float:
    """The iteration timeout this peer uses now."""
    return _measured(params, st, params.iteration_timeout_s)


def _barrier_s(params: Params, st: PeerState) -> float:
    """The barrier timeout this peer uses now."""
    return _measured(params, st, params.barrier_timeout_s)


def _start_iteration(params: Params, st: PeerState, now: float, effects: list) -> PeerState:
    """Arm the deadline of ``st.it`` and ask for its projected gradients."""
    ids = st.view.ids()
    if params.idle_timeout_s is not None:
        st = st._replace(idle={m.machine: st.idle.get(m.machine, now) for m in st.view.members if not m.active})
    st = st._replace(
        started_at=now,
        suspected=frozenset(),
        refused=frozenset(),
        probe_at=now + _barrier_s(params, st) * PROBE_FIRST,
        recovery=None,
        waits=0,
        leaves=st.leaves & ids,
        ready=st.ready & (ids - st.view.active_ids()),
        strays=frozenset(),
    )
    # Pushes of ``it`` that arrived before we applied ``it - 1`` are checked now: those on another
    # chain leave the inbox, and those naming one are evidence against ours.
    off = [] if st.chain is None else [p for _, p in sorted(st.inbox.at(st.it)) if p.previous != st.chain]
    if off:
        st = st._replace(inbox=st.inbox.without((p.iteration, p.sender) for p in off))
        for push in off:
            if push.previous:
                st = _elsewhere(st, push.sender, push.previous, "push", effects)
                if st.phase != MEMBER:
                    return st
    lead = committer(st) == st.me
    if st.joins and not lead:
        st = _refuse_joins(st, effects)
    slack = _barrier_s(params, st) if lead else 2 * _barrier_s(params, st)
    st = st._replace(deadline=now + _iteration_s(params, st) + slack)
    if not st.leaving and st.computed < st.it and st.it not in st.decided:
        st = st._replace(computed=st.it)
        if st.it >= params.iterations:
            # The closing iteration: nothing to compute, an empty push that names our chain.
            return _push(params, st, 0, b"", now, effects)
        effects.append(Compute(st.it, now + _iteration_s(params, st)))
    if lead:
        st = _try_commit(params, st, now, effects)
    return st


def _advance(params: Params, st: PeerState, now: float, effects: list) -> PeerState:
    """Hand every consecutive complete decision from ``st.it`` on to :class:`Apply`, then start the next iteration."""
    if st.phase != MEMBER:
        return st
    moved = False
    while True:
        entry = st.decided.get(st.it)
        if entry is None:
            later = [t for t in st.decided if t > st.it]
            if st.fetch is None and (later or st.ahead >= st.it):
                st = _fetch(params, st, now, effects, st.it, max(min(later) - 1 if later else -1, st.ahead))
            break
        if entry.payloads is None:
            got = _assemble(st, entry.commit)
            if got is None:
                if params.relay_fanout and params.pushes == "leader" and st.relay_wait[0] != st.it:
                    # its payloads come down the relay tree: a barrier timeout before fetching them
                    st = st._replace(relay_wait=(st.it, now + _barrier_s(params, st)))
                if st.fetch is None and not (st.relay_wait[0] == st.it and now < st.relay_wait[1]):
                    st = _fetch(params, st, now, effects, st.it, st.it)
                break
            entry = entry._replace(payloads=got[0], signatures=got[1])
            st = st._replace(decided=_put(st.decided, st.it, entry))
        closing = st.it >= params.iterations
        if not closing:
            effects.append(Apply(entry))
        if not moved:  # the iteration this peer started (the others it only catches up with)
            st = st._replace(paces=(*st.paces, now - st.started_at)[-PACE_SAMPLES:])
        moved = True
        nxt = entry.commit.next_view
        it = st.it + 1
        st = st._replace(
            it=it,
            view=nxt,
            prev_view=st.view,
            chain=chain_digest(entry.commit),
            inbox=st.inbox.since(it),
            promised={k: v for k, v in st.promised.items() if k >= it - params.window},
            floor={k: v for k, v in st.floor.items() if k >= it - params.window},
            decided={k: v for k, v in st.decided.items() if k >= it - params.window},
            parts={k: v for k, v in st.parts.items() if k >= it} if st.parts else st.parts,
            fetch=st.fetch if st.fetch is not None and st.fetch.last >= it else None,
        )
        if closing:
            # The closing decision continues the chain of the last one, so the barrier's members
            # hold that decision: finished, whatever view it hands on.
            effects.append(Finished(params.iterations, "left" if st.leaving else "done"))
            return st._replace(phase=LEFT if st.leaving else DONE)
        if st.me not in nxt.ids():
            if st.leaving:
                effects.append(Finished(it, "left"))
                return st._replace(phase=LEFT)
            effects.append(
                Dropped(f"not a member of the view of iteration {it} (unreachable, or replaced by a rejoin)")
            )
            return st._replace(phase=DROPPED)
    if moved:
        st = _start_iteration(params, st, now, effects)
    return st


def _fetch(
    params: Params,
    st: PeerState,
    now: float,
    effects: list,
    first: int,
    last: int,
    prefer: int | None = None,
    check: bool = False,
) -> PeerState:
    """Ask a member for decided iterations: ``prefer``, the commit's sender, then the others in turn."""
    order = [] if prefer is None else [prefer]
    entry = st.decided.get(first)
    if entry is not None:
        order.append(entry.commit.sender)
    lead = committer(st)
    if lead is not None:
        order.append(lead)
    order += sorted(st.view.ids())
    sources = []
    for m in order:
        address = st.view.address_of(m)
        if m != st.me and address is not None and address not in sources:
            sources.append(address)
    if not sources:
        return st
    sources = [a for a in sources if a not in st.denials] or sources  # not those that refused us
    preferred = st.view.address_of(prefer) if prefer is not None else None
    address = preferred if preferred in sources else sources[st.fetches % len(sources)]
    effects.append(Fetch(address, first, last))
    fetch = FetchState(first, last, now + _barrier_s(params, st), st.fetches, address, check)
    return st._replace(fetch=fetch, fetches=st.fetches + 1)


def _try_commit(params: Params, st: PeerState, now: float, effects: list) -> PeerState:
    """The committer's barrier: decide ``st.it`` once our own push is in and every expected push is,
    or once every member still missing refused our push at the connection (its process is gone),
    or at the deadline; in the last two cases only if a majority of the members answered (else
    keep waiting: a minority never decides, so a partitioned run cannot split). Any other member:
    :func:`_replace_gone`."""
    if st.phase != MEMBER or st.it in st.decided or st.recovery is not None:
        return st
    if committer(st) != st.me:
        return _replace_gone(params, st, now, effects)
    b = _bound(st, st.it)
    if b is not None and b > Ballot(0, st.me):
        return st
    view = st.view
    if now < st.deadline:
        # O(1) a push: fewer pushes held than members expected (those held may include inactive
        # members'), more than have refused ours: some active member is still missing.
        active = view.active_ids()
        if len(st.refused) < len(active) - len(st.leaves & active) - st.inbox.count(st.it):
            return st
    have = _pushed(st)
    if st.me not in have and st.me not in st.leaves:
        return st  # our own projected gradients are still being computed
    missing = _missing(st, have)
    if missing:
        # Evidence of life: pushes (in time, or one iteration late from inactive members), leaves, us.
        if (now < st.deadline and not missing <= st.refused) or not _majority(
            have | st.ready | st.leaves | {st.me}, view.ids()
        ):
            return st
    ballot = Ballot(0, st.me)
    entry, admitted = _decide(params, st, ballot, have, have | st.ready | {st.me}, now)
    return _publish(params, st, now, effects, entry, admitted)


def _pushed(st: PeerState) -> frozenset[int]:
    """The members of ``st.view`` whose push of ``st.it`` this peer holds (itself included)."""
    ids = st.view.ids()
    return frozenset(m for m in st.inbox.machines(st.it) if m in ids)


def _missing(st: PeerState, have: frozenset[int]) -> frozenset[int]:
    """The active members (none leaving) whose push of ``st.it`` the committer waits for."""
    return st.view.active_ids() - st.leaves - have


PROBE_FIRST = 1 / 8
"""The first :class:`Probe` round of an iteration is due this fraction of the barrier timeout after
the iteration started; each later one twice as long after the start as the last."""


def _probe_waits(params: Params, st: PeerState, now: float, effects: list) -> PeerState:
    """:class:`Probe` the peers this one waits for, once its own push of ``st.it`` is in, when the
    next round is due and before the deadline: the committer probes every active member whose push
    it still waits for; any other active member probes the committer whose decision it waits for,
    and once that one refused, the members whose push it would need to take over
    (:func:`_replace_gone`). None already refused. A peer that is only slow answers and costs one
    small call per round; rounds double their time since the start, so an iteration sends it at
    most ``1 + log2(8 · (iteration timeout + slack) / barrier timeout)`` rounds before the deadline
    (the slack: the barrier timeout for the committer, twice it for the others; five rounds either
    way with timeouts of 3 s and 2 s)."""
    if st.phase != MEMBER or st.it in st.decided or st.recovery is not None:
        return st
    if now >= st.deadline or now < st.probe_at:
        return st
    have = _pushed(st)
    if st.me not in have:
        return st  # our own push is still being computed: the others may be too
    who = committer(st)
    if who == st.me:
        targets = _missing(st, have)
    elif who is None or st.me not in st.view.active_ids():
        return st  # an inactive member never takes over: nothing to learn
    else:
        targets = _missing(st, have) if who in st.refused else frozenset({who})
    targets -= st.refused
    if not targets:
        return st
    effects += [Probe(m.machine, m.address, st.it) for m in st.view.members if m.machine in targets]
    return st._replace(probe_at=now + max(now - st.started_at, _barrier_s(params, st) * PROBE_FIRST))


def _leader_gone(st: PeerState) -> bool:
    """The regular leader of ``st.it`` refused our connection in this iteration (its process is gone)."""
    return st.view.leader() in st.refused


def _replace_gone(params: Params, st: PeerState, now: float, effects: list) -> PeerState:
    """An active member whose committer refused its connection (:func:`on_push_refused`: the
    committer's process is gone) suspects it without waiting for the commit deadline, once its own
    push is in and every other active member's is too, or refused (so a takeover now decides what
    the committer would have: a member still computing is waited for, up to the deadline). The
    takeover's :class:`Prepare` says the leader is gone, which members promise before their
    iteration timeout (:func:`on_prepare`)."""
    who = committer(st)
    if who is None or who == st.me or who not in st.refused or st.me not in st.view.active_ids():
        return st
    have = _pushed(st)
    if st.me not in have:
        return st
    if params.pushes == "leader":
        # The others' pushes went to the committer only: once every member stopped computing
        # (the iteration timeout), the takeover's promises carry them.
        if now < st.started_at + _iteration_s(params, st):
            return st
    elif _missing(st, have) - st.refused - {who}:
        return st
    return _suspect(params, st, who, now, effects, f"machine {who} refused our connection")


def _decide(params: Params, st: PeerState, ballot: Ballot, contributors, alive, now: float) -> tuple[LogEntry, tuple]:
    """Build the decision of ``st.it`` from the pushes of ``contributors``; ``alive`` may stay active.
    Members unreachable, or inactive for ``Params.idle_timeout_s`` (:attr:`PeerState.idle`), are removed."""
    view = st.view
    contributors = sorted(contributors)
    pushes = [st.inbox[(st.it, m)] for m in contributors]
    contrib = tuple((p.sender, p.count) for p in pushes)
    payloads = tuple(p.payload for p in pushes)
    signatures = tuple(p.signature for p in pushes)
    next_active = ((frozenset(contributors) & frozenset(alive)) | (st.ready & frozenset(alive))) - st.leaves
    next_id = view.next_machine_id
    admitted = []
    joiner_addresses = set()
    for rid, address, key in st.joins[: params.max_pending_joins]:
        if address in joiner_addresses:
            continue
        joiner_addresses.add(address)
        admitted.append((rid, Member(next_id, address, False, key)))
        next_id += 1
    members = []
    for m in view.members:
        if m.machine in st.leaves or m.address in joiner_addresses:
            continue
        if st.failures.get(m.machine, 0) >= UNREACHABLE_AFTER and m.machine not in next_active:
            continue  # unreachable: removed (it must rejoin with a new id)
        if (
            params.idle_timeout_s is not None
            and m.machine not in next_active
            and m.machine != st.me
            and now - st.idle.get(m.machine, now) >= params.idle_timeout_s
        ):
            continue  # silent for too long: removed, so it no longer counts toward the majority
        # An active member that missed the barrier is out of this iteration and inactive from the
        # next: it is no longer waited for, and becomes active again by pushing again.
        active = m.machine in next_active
        members.append(m if m.active == active else m._replace(active=active))
    members += [m for _, m in admitted]
    members = tuple(sorted(members))
    if members == view.members:
        members = view.members  # the same tuple: a receiver holding it checks none of it again
    next_view = View(st.it + 1, members, next_id)
    commit = Commit(
        params.run_id,
        st.me,
        st.it,
        ballot,
        contrib,
        updates_digest(contrib, payloads),
        next_view,
        previous=st.chain or b"",
    )
    return LogEntry(sign(params, commit), payloads, signatures), tuple(admitted)


def _publish(params: Params, st: PeerState, now: float, effects: list, entry: LogEntry, admitted) -> PeerState:
    """Record our decision, send it to every member of the iteration, answer joins once enough hold it, apply."""
    t = entry.commit.iteration
    # Pushes that went to us only travel on inside the decision: the entry, payloads and signatures,
    # to every member or down the relay tree (the others get the commit alone).
    # The relayed copies go out first, in the tree's order: a peer's uplink sends one call after
    # another, so the commits alone (the rest) do not delay the relays below it.
    relay = params.pushes == "leader" and entry.payloads is not None
    first: frozenset[int] = frozenset()
    if relay:
        reports = {m: st.inbox[(t, m)].relay_us for m, _ in entry.commit.contributors if (t, m) in st.inbox}
        order = relay_order(params, st.view, st.me, reports)
        children, forwarding = _relay_split(params, st.view, st.me, st.me, order)
        first = frozenset(m.machine for m in children)
        sent = entry._replace(relays=order)
        for part in _parts(params, sent) if forwarding else ():  # parts to the relays, as they can forward
            effects += [Send(m.machine, m.address, part) for m in children[:forwarding]]
        effects += [Send(m.machine, m.address, sent) for m in children[forwarding:]]  # the rest whole
        st = st._replace(relaying=(t, now, first, 0, now))
    for m in st.view.members:
        if m.machine != st.me and m.machine not in first:
            effects.append(Send(m.machine, m.address, entry.commit))
    admissions = dict(st.admissions)
    if admitted:
        admissions[t] = Admission(
            st.view.ids(), frozenset({st.me}), tuple(admitted), entry.commit.next_view, chain_digest(entry.commit)
        )
    st = st._replace(
        decided=_put(st.decided, t, entry),
        promised=_put(st.promised, t, entry.commit.ballot),
        joins=st.joins[len(admitted) :] if admitted else st.joins,
        admissions=admissions,
        recovery=None,
        ready=frozenset(),
    )
    if admitted:
        st = _answer_admissions(st, t, effects)
    return _advance(params, st, now, effects)


def _refuse_joins(st: PeerState, effects: list) -> PeerState:
    """Release the joins queued here (they will not be decided here): each joiner asks again."""
    for rid, address, _ in st.joins:
        effects.append(
            JoinRefused(
                rid,
                f"machine {st.me} queued the join of {address} but no longer decides iteration {st.it} "
                f"(a leader change); ask again",
            )
        )
    return st._replace(joins=())


def _answer_admissions(st: PeerState, t: int, effects: list) -> PeerState:
    adm = st.admissions.get(t)
    if adm is None or not _meets_every_majority(adm.acks, adm.base):
        return st
    for rid, member in adm.joins:
        effects.append(Admit(rid, JoinAnswer(member.machine, adm.view, adm.chain)))
        effects.append(
            Note(f"admitted machine {member.machine} ({member.address}) from iteration {adm.view.iteration}")
        )
    return st._replace(admissions={k: v for k, v in st.admissions.items() if k != t})


# --------------------------------------------------------------------------- constructors


def founder(params: Params, *, address: str, now: float, key: bytes = b"", iteration: int = 0) -> Step:
    """The first peer of a run: machine 0 (public key ``key``), alone in the view of ``iteration``
    (0, or the iteration of a saved state the run resumes from).

    With ``params.founders > 1`` it waits (phase ``forming``) until that many peers joined or
    ``forming_timeout_s`` passed; they all start iteration 0 as active members.
    """
    _check_address(address)
    _check_uint("iteration", iteration, 2**63)
    view = View(iteration, (Member(0, address, True, key),), 1)
    st = _blank(0, FORMING, view, now)._replace(
        forming_deadline=now + params.forming_timeout_s, admissions={-1: Admission(frozenset(), frozenset(), (), view)}
    )
    if params.founders <= 1:
        return _finish_forming(params, st, now)
    return Step(st, ())


def _finish_forming(params: Params, st: PeerState, now: float) -> Step:
    adm = st.admissions.get(-1)
    effects: list = []
    have = len(st.view.members)
    if params.require_founders and have < params.founders:
        reason = (
            f"only {have} of {params.founders} founders joined within the start-up window of "
            f"{params.forming_timeout_s:g}s (machines {sorted(st.view.ids())}); raise the window "
            "(peers.startup_timeout_s, --startup-timeout) or start fewer peers"
        )
        effects.append(Failed(st.it, reason))
        return Step(st._replace(phase=FAILED, admissions={}), tuple(effects))
    for rid, member in adm.joins if adm else ():
        effects.append(Admit(rid, JoinAnswer(member.machine, st.view, st.chain or b"")))
    effects.append(Note(f"formed with machines {sorted(st.view.ids())}"))
    st = st._replace(phase=MEMBER, admissions={})
    if st.it >= params.iterations:
        effects.append(Finished(st.it, "done"))
        return Step(st._replace(phase=DONE), tuple(effects))
    st = _start_iteration(params, st, now, effects)
    return Step(st, tuple(effects))


def joined(params: Params, *, me: int, view: View, now: float, chain: bytes = b"") -> PeerState:
    """The state of a joiner right after its :class:`JoinAnswer` (``chain``: the answer's): catching
    up, decisions buffered."""
    if me not in view.ids():
        raise ValueError(f"machine {me} is not a member of the view it was given ({sorted(view.ids())})")
    _check_previous(chain, "join answer")
    return _blank(me, CATCHING_UP, view, now)._replace(chain=chain)


def on_ready(
    params: Params, st: PeerState, *, iteration: int, view: View, now: float, chain: bytes | None = None
) -> Step:
    """The runtime loaded the state at the start of ``iteration`` (view ``view``): start taking part.

    ``iteration`` may be past ``st.it`` (a newer snapshot, or log entries replayed): the buffered
    decisions before it are skipped, and ``chain`` is the :func:`chain_digest` of the decision of
    ``iteration - 1`` (the join answer's is that of ``st.it - 1``), or None if the runtime does not
    hold that decision: the chain is then learned from the first decision applied.
    """
    if st.phase != CATCHING_UP:
        raise ValueError(f"on_ready needs phase {CATCHING_UP!r}, the peer is {st.phase!r}")
    if iteration < st.it:
        raise ValueError(
            f"loaded state of iteration {iteration} is older than the first iteration {st.it} of this member"
        )
    if chain is not None:
        _check_previous(chain, "loaded state")
        st = st._replace(chain=chain)
    if iteration > st.it:
        st = st._replace(
            it=iteration,
            view=view,
            chain=chain,
            inbox=st.inbox.since(iteration),
            decided={k: v for k, v in st.decided.items() if k >= iteration},
        )
    effects: list = []
    st = st._replace(phase=MEMBER)
    if st.me not in st.view.ids():
        effects.append(Dropped(f"not a member of the view of iteration {st.it}"))
        return Step(st._replace(phase=DROPPED), tuple(effects))
    if st.it >= params.iterations:
        effects.append(Finished(st.it, "done"))
        return Step(st._replace(phase=DONE), tuple(effects))
    before = st.it
    st = _advance(params, st, now, effects)
    if st.phase == MEMBER and st.it == before:
        st = _start_iteration(params, st, now, effects)
    return Step(st, tuple(effects))


# --------------------------------------------------------------------------- joining and leaving


def on_join(params: Params, st: PeerState, req: JoinRequest, now: float) -> Step:
    """A peer asks to join. Answered later by :class:`Admit`, or at once by a :class:`Redirect` reply.

    Raises:
      Rejected: wrong config digest, bad address, or this peer cannot admit anyone now.
    """
    if req.config_digest != params.config_digest:
        raise Rejected(
            "FAILED_PRECONDITION",
            f"config digest {str(req.config_digest)[:64]!r} differs from this run's {params.config_digest!r}; "
            f"start the peer with the run's config",
        )
    _check_address(req.address)
    if not isinstance(req.key, bytes) or (params.verify is not None and len(req.key) != KEY_BYTES):
        raise Rejected("INVALID_ARGUMENT", f"a joiner's public key must be {KEY_BYTES} bytes, got {len(req.key)}")
    if st.phase == DONE or st.it >= params.iterations:
        raise Rejected(
            "FAILED_PRECONDITION",
            f"the run has finished (all {params.iterations} iterations are decided); nothing to join",
        )
    if st.phase == FORMING:
        if req.address in {m.address for m in st.view.members}:
            raise Rejected("ALREADY_EXISTS", f"a founding peer already listens at {req.address}")
        member = Member(st.view.next_machine_id, req.address, True, req.key)
        view = st.view._replace(members=st.view.members + (member,), next_machine_id=member.machine + 1)
        adm = st.admissions[-1]
        adm = adm._replace(joins=adm.joins + ((req.request_id, member),), view=view)
        st = st._replace(view=view, admissions={-1: adm})
        if len(view.members) >= params.founders:
            return _finish_forming(params, st, now)
        return Step(st, ())
    if st.phase != MEMBER:
        raise Rejected("UNAVAILABLE", f"this peer is {st.phase} and admits no one; try another peer of the run")
    seat = _seat(st, req.address, req.key)
    if seat is not None:  # admitted by a chosen decision whose leader did not answer it
        return Step(st, tuple(_answer_seat(req.request_id, *seat)))
    lead = committer(st)
    if lead != st.me:
        address = st.view.address_of(lead) if lead is not None else None
        if address is None:
            raise Rejected("UNAVAILABLE", "the run has no leader right now; retry shortly")
        return Step(st, (), Redirect(address))
    if len(st.joins) >= params.max_pending_joins:
        raise Rejected("RESOURCE_EXHAUSTED", f"{len(st.joins)} joins already wait for the next commit; retry shortly")
    if len(st.view.members) + len(st.joins) >= params.max_members and req.address not in {
        m.address for m in st.view.members
    }:
        raise Rejected(
            "RESOURCE_EXHAUSTED",
            f"the run holds its most members ({params.max_members}, peers.max_members) "
            f"with the joins queued; retry once a member left or raise peers.max_members",
        )
    if any(rid == req.request_id for rid, _, _ in st.joins):
        raise Rejected("ALREADY_EXISTS", f"join request {req.request_id} is already queued")
    for m in st.view.members:
        # A member that is alive keeps its address: a join naming it is refused (it would evict it).
        # An inactive or unreachable one is replaced (a restarted peer rejoining on its old port).
        if m.address == req.address and m.machine != st.me and m.active and not st.failures.get(m.machine, 0):
            raise Rejected(
                "ALREADY_EXISTS",
                f"machine {m.machine} is an active member at {req.address}; retry once it stopped contributing",
            )
        if m.address == req.address and m.machine == st.me:
            raise Rejected("ALREADY_EXISTS", f"{req.address} is this peer's own address")
    return Step(st._replace(joins=st.joins + ((req.request_id, req.address, req.key),)), ())


def on_leave(params: Params, st: PeerState, msg: Leave, now: float) -> Step:
    """A member leaves: it is no longer waited for and the next decision removes it. Reply: the iteration."""
    _check_run(params, msg.run_id)
    _check_uint("sender", msg.sender)
    if st.phase not in (MEMBER, CATCHING_UP):
        raise Rejected("UNAVAILABLE", f"this peer is {st.phase}")
    if msg.sender not in st.view.ids():
        raise Rejected("PERMISSION_DENIED", f"machine {msg.sender} is not a member of iteration {st.it}")
    _verify(params, st.view, msg, f"leave of machine {msg.sender}")
    if msg.sender == st.me:
        raise Rejected("INVALID_ARGUMENT", f"a leave claims to come from this peer's own id {st.me}")
    st = st._replace(leaves=st.leaves | {msg.sender})
    effects: list = []
    st = _try_commit(params, st, now, effects)
    return Step(st, tuple(effects), st.it)


def request_leave(params: Params, st: PeerState, now: float) -> Step:
    """This peer leaves: it stops contributing, tells every member, and finishes once a decision removes it."""
    if st.phase != MEMBER:
        raise ValueError(f"only a member can leave; this peer is {st.phase}")
    st = st._replace(leaving=True, leaves=st.leaves | {st.me})
    leave = sign(params, Leave(params.run_id, st.me, st.it))
    effects: list = [Send(m.machine, m.address, leave) for m in st.view.members if m.machine != st.me]
    st = _try_commit(params, st, now, effects)
    return Step(st, tuple(effects))


# --------------------------------------------------------------------------- gradients


def on_local_gradients(
    params: Params, st: PeerState, *, iteration: int, count: int, payload: bytes, now: float
) -> Step:
    """Our projected gradients of ``iteration`` are encoded: push them to every member (stale results are dropped)."""
    if (
        st.phase != MEMBER
        or iteration != st.it
        or (iteration, st.me) in st.inbox
        or iteration in st.decided
        or st.leaving
    ):
        return Step(st, ())
    try:
        _check_payload(params, count, payload, "local gradients", iteration)
    except Rejected as e:
        raise ValueError(e.message) from None
    effects: list = []
    st = _push(params, st, count, payload, now, effects)
    return Step(st, tuple(effects))


def _push(params: Params, st: PeerState, count: int, payload: bytes, now: float, effects: list) -> PeerState:
    """Sign our push of ``st.it`` (on our chain), send it (:func:`_push_targets`), and try the barrier."""
    push = sign(params, Push(params.run_id, st.me, st.it, count, payload, previous=st.chain or b""))
    push = push._replace(relay_us=min(st.relay_us, MAX_RELAY_US))
    st = st._replace(inbox=st.inbox.put((st.it, st.me), push))
    effects += [Send(m.machine, m.address, push) for m in _push_targets(params, st)]
    return _try_commit(params, st, now, effects)


def relay_children(params: Params, view: View, root: int, me: int, relays: tuple[int, ...] = ()) -> list[Member]:
    """The members ``me`` forwards the payloads of a decision by ``root`` to (``Params.pushes ==
    "leader"``): the view's members other than ``root``, those ``relays`` names first in its order,
    then the others in id order, form a tree of fan-out ``Params.relay_fanout`` below ``root``
    (``root``'s children are the first ``k``, the children of the ``i``-th are the ``k`` from
    ``k·(i + 1)``). Fan-out 0: ``root`` sends to every member.

      >>> v = View(3, tuple(Member(m, f"h:{m}", True) for m in range(8)), 8)
      >>> p = Params("r", "c", 1, 1, 5, 1.0, 1.0, pushes="leader", relay_fanout=2)
      >>> [[m.machine for m in relay_children(p, v, 0, me)] for me in range(8)]
      [[1, 2], [3, 4], [5, 6], [7], [], [], [], []]
      >>> [[m.machine for m in relay_children(p, v, 0, me, (6, 7))] for me in (0, 6, 7, 1)]
      [[6, 7], [1, 2], [3, 4], [5]]
    """
    return _relay_split(params, view, root, me, relays)[0]


def _relay_split(
    params: Params, view: View, root: int, me: int, relays: tuple[int, ...] = ()
) -> tuple[list[Member], int]:
    """``(children, forwarding)``: ``me``'s children of the relay tree (:func:`relay_children`), and
    how many of the first of them forward to children of their own (they come first)."""
    others = [m for m in view.members if m.machine != root]
    if relays:
        first = {m: i for i, m in enumerate(dict.fromkeys(relays)) if m != root}
        others.sort(key=lambda m: first.get(m.machine, len(first)))  # stable: the rest keep id order
    k = params.relay_fanout
    if not k:
        return (others, 0) if me == root else ([], 0)
    if me == root:
        pos = -1
    else:
        pos = next((i for i, m in enumerate(others) if m.machine == me), None)
        if pos is None:
            return [], 0
    lo = k * (pos + 1)
    interior = -(-len(others) // k) - 1  # the positions with children
    children = others[lo : lo + k]
    return children, max(0, min(len(children), interior - lo))


def relay_order(params: Params, view: View, root: int, reports: Mapping[int, int]) -> tuple[int, ...]:
    """The members ``root`` places where its relay tree forwards (:func:`relay_children`), fastest
    first: ``reports`` gives the microseconds per child of each contributor's last relay (its push's
    ``relay_us``; 0: it has not relayed, ranked at the median of the others so that the tree tries
    it; a member without a report, which did not push, comes last).

      >>> v = View(3, tuple(Member(m, f"h:{m}", True) for m in range(8)), 8)
      >>> p = Params("r", "c", 1, 1, 5, 1.0, 1.0, pushes="leader", relay_fanout=2)
      >>> relay_order(p, v, 0, {1: 900, 2: 0, 3: 100, 4: 0, 5: 500, 6: 0, 7: 700})
      (3, 5, 2)
    """
    k = params.relay_fanout
    others = [m.machine for m in view.members if m.machine != root]
    interior = -(-len(others) // k) - 1 if k else 0  # the positions with children
    if interior <= 0:
        return ()
    known = sorted(us for m, us in reports.items() if us > 0 and m != root)
    tried = known[len(known) // 2] if known else 0

    def rank(m: int) -> tuple[float, int]:
        us = reports.get(m)
        return (float("inf") if us is None else us or tried, m)

    return tuple(sorted(others, key=rank)[:interior])


def _push_targets(params: Params, st: PeerState) -> list[Member]:
    """The members our push of ``st.it`` goes to: every other member, or (``Params.pushes ==
    "leader"``) the committer of ``st.it`` (none when that is us)."""
    if params.pushes == "leader":
        who = committer(st)
        return [m for m in st.view.members if m.machine == who and who != st.me]
    return [m for m in st.view.members if m.machine != st.me]


def _horizon(st: PeerState) -> int:
    return max([st.it, *st.decided]) + 1


def on_push(params: Params, st: PeerState, push: Push, now: float) -> Step:
    """A member's projected gradients of one iteration.

    Accepted for iterations from ``it`` to one past the newest decision known (a member may be
    one iteration ahead); stored once (an identical copy is accepted again, a different one is
    refused). An inactive member's push up to :data:`READY_LAG` iterations late (a joiner that
    caught up while the others ran ahead) marks it ready to become active: the next decision makes
    it active, and the barrier then waits for it. A push of ``it`` continuing another chain than
    ours is not taken but kept as evidence (:func:`_elsewhere`).

    Raises:
      Rejected: other run, unknown sender, stale or too far ahead, bad count or size, conflicting
        duplicate, or on another chain than ours one iteration ahead or naming no chain.
    """
    _check_run(params, push.run_id)
    _check_uint("sender", push.sender)
    _check_uint("iteration", push.iteration, 2**63)
    _check_in_run(params, push.iteration, "push")
    if st.phase not in (MEMBER, CATCHING_UP):
        raise Rejected("UNAVAILABLE", f"this peer is {st.phase}; it takes no gradients")
    if push.sender == st.me:
        raise Rejected("INVALID_ARGUMENT", f"a push claims to come from this peer's own id {st.me}")
    if push.sender not in st.view.ids():
        raise Rejected("PERMISSION_DENIED", f"machine {push.sender} is not a member of iteration {st.it}")
    _check_payload(
        params, push.count, push.payload, f"push of machine {push.sender} iteration {push.iteration}", push.iteration
    )
    _verify(params, st.view, push, f"push of machine {push.sender} iteration {push.iteration}")
    t = push.iteration
    if t < st.it:
        mem = _index(st.view)[3].get(push.sender)  # O(1): a late push costs no scan of the members
        if t >= st.it - READY_LAG and mem is not None and not mem.active and st.phase == MEMBER:
            return Step(st._replace(ready=st.ready | {push.sender}), ())
        raise Rejected("FAILED_PRECONDITION", f"stale push: iteration {t} is already decided (this peer is at {st.it})")
    if t > _horizon(st) or t > st.it + params.window:
        raise Rejected("OUT_OF_RANGE", f"push for iteration {t} is too far ahead (this peer is at {st.it})")
    _check_previous(push.previous, f"push of machine {push.sender} iteration {t}")
    before = _chain_before(st, t)
    if before is not None and push.previous != before:
        if t != st.it or not push.previous:
            # Another chain's push one iteration ahead, or one whose sender does not know its chain
            # (a joiner that loaded a newer snapshot): refused, and no evidence.
            _check_continues(st, t, push.previous, f"push of machine {push.sender} iteration {t}")
        effects = []
        st = _elsewhere(st, push.sender, push.previous, "push", effects)
        return Step(st, tuple(effects))
    old = st.inbox.get((t, push.sender))
    if old is not None:
        if old._replace(relay_us=0) == push._replace(relay_us=0):  # the same push again (the hint aside)
            return Step(st, ())
        raise Rejected("ALREADY_EXISTS", f"machine {push.sender} already pushed different gradients for iteration {t}")
    st = st._replace(inbox=st.inbox.put((t, push.sender), push))
    effects: list = []
    if t == st.it:
        st = _advance(params, st, now, effects) if st.it in st.decided else _try_commit(params, st, now, effects)
    elif t == st.it + 1:
        st = _fetch_from_ahead(params, st, now, effects)
    return Step(st, tuple(effects))


def _elsewhere(st: PeerState, machine: int, previous: bytes, what: str, effects: list) -> PeerState:
    """Signed evidence (``what``: its push, or a log it served) that ``machine`` continues another
    decision of ``it - 1`` than ours (a push on another chain is not taken: its gradients were
    computed on another state). When a majority of the view's members do, ours was replaced (a
    decision we applied was not chosen, and the majority went on without it): :class:`Dropped`, and
    the peer rejoins from the majority's state."""
    if machine not in st.strays:
        effects.append(
            Note(
                f"iteration {st.it}: machine {machine}'s {what} continues another decision of iteration {st.it - 1} "
                f"(chain {previous.hex()[:16]}, ours {(st.chain or b'').hex()[:16]}); not taken"
            )
        )
    st = st._replace(strays=st.strays | {machine})
    if _majority(st.strays, st.view.ids()):
        effects.append(
            Dropped(
                f"iteration {st.it}: machines {sorted(st.strays)} of {sorted(st.view.ids())} continue another decision "
                f"of iteration {st.it - 1} than the one this peer applied, which was replaced"
            )
        )
        return st._replace(phase=DROPPED, fetch=None, recovery=None)
    return st


# --------------------------------------------------------------------------- decisions


def on_commit(
    params: Params,
    st: PeerState,
    commit: Commit,
    now: float,
    *,
    payloads: tuple[bytes, ...] | None = None,
    signatures: tuple[bytes, ...] | None = None,
    relays: tuple[int, ...] = (),
    first: int = 0,
) -> Step:
    """A decision of one iteration (the barrier release). Reply: a :class:`CommitReply`, whether this
    peer now holds it (that commit, at its ballot; not a commit only taken as a hint, a later
    iteration whose view this peer cannot verify, for which it fetches the log instead) and which
    decision of the iteration before it holds when that one admitted members. The committer counts
    only holders as having accepted it (:func:`on_commit_acked`).

    Buffered until applicable; its payloads come from the pushes received, from ``payloads`` and
    ``signatures`` relayed with it (``Params.pushes == "leader"``: taken only when each is signed
    by its contributor and they match the commit's digest, else ignored; forwarded to this peer's
    children of the tree ``relays`` orders, :func:`relay_children`; a part of them from
    contributor ``first``, ``Params.relay_parts``, is checked and forwarded at once and held until
    the others come, :func:`_gather`), or are fetched. A decision that conflicts with one this
    peer already applied (signed, higher ballot) makes it fetch that iteration from the leader; it
    drops out only if the leader's log differs too.

    Raises:
      Rejected: malformed, other run, not signed by its sender, ballot below one promised (or a
        takeover's ballot this peer did not promise), too far ahead, a round-0 commit not
        sent by the leader of the iteration, or a decision continuing another chain than ours.
    """
    _check_commit(params, commit, st.view)
    if st.phase not in (MEMBER, CATCHING_UP, DONE):
        raise Rejected("UNAVAILABLE", f"this peer is {st.phase}; it takes no commits")
    t = commit.iteration
    effects: list = []
    if t < st.it:
        old = st.decided.get(t)
        if old is None:
            return Step(st, (), _commit_reply(st, commit, False))
        if _same_value(old.commit, commit):
            # A takeover re-issued our decision with the ballot we promised it: hold it at that ballot
            # (a Paxos acceptor's accept), so that the promises of a later takeover show one ballot.
            if commit.ballot > old.commit.ballot and st.promised.get(t) == commit.ballot:
                _verify(params, None, commit, f"commit of iteration {t}", key=member_key(st, commit.sender))
                st = st._replace(decided=_put(st.decided, t, old._replace(commit=commit)))
            return Step(st, (), _commit_reply(st, commit, st.decided[t].commit.ballot == commit.ballot))
        # Ids are never reused and keep their key: any view that holds the sender has its key.
        _verify(params, None, commit, f"commit of iteration {t}", key=member_key(st, commit.sender))
        if commit.ballot <= old.commit.ballot or commit.previous != old.commit.previous:
            # Not a later ballot of our chain's iteration (a decision continuing another chain says
            # nothing about ours; its pushes tell, :func:`_elsewhere`).
            return Step(st, (), _commit_reply(st, commit, False))
        # A later ballot decided differently? Only the leader's log can say: fetch it and compare.
        effects.append(
            Note(
                f"iteration {t}: a commit of ballot {tuple(commit.ballot)} differs from the applied one; checking the leader's log"
            )
        )
        if st.phase == MEMBER and (st.fetch is None or st.fetch.failed):
            st = _fetch(params, st, now, effects, t, t, prefer=st.view.leader(), check=True)
        return Step(st, tuple(effects), _commit_reply(st, commit, False))
    if st.phase == DONE:
        raise Rejected("UNAVAILABLE", f"this peer is {st.phase}; it takes no commits of iteration {t}")
    if t > st.it + params.window:
        raise Rejected("OUT_OF_RANGE", f"commit of iteration {t} is too far ahead (this peer is at {st.it})")
    view = _view_at(st, t)
    if view is None or (t > st.it and commit.ballot.round > 0):
        # A later iteration whose view this peer cannot verify yet: never stored (it could wedge
        # the iteration), only a hint that this peer is behind: fetch the decided log.
        _verify(params, st.view, commit, f"commit of iteration {t}")
        st = st._replace(ahead=max(st.ahead, t))
        if st.phase == MEMBER and st.fetch is None:
            st = _fetch(params, st, now, effects, st.it, t)
        return Step(st, tuple(effects), _commit_reply(st, commit, False))
    if commit.sender not in view.ids():
        raise Rejected("PERMISSION_DENIED", f"machine {commit.sender} is not a member of iteration {t}")
    _verify(params, view, commit, f"commit of iteration {t}")
    _check_succession(view, commit.next_view, f"commit of iteration {t}")
    promised = st.promised.get(t)
    bound = _bound(st, t)
    if commit.ballot.round == 0:
        if commit.ballot.leader != view.leader():
            raise Rejected(
                "INVALID_ARGUMENT",
                f"round-0 commit of iteration {t} from machine {commit.sender}; the leader is {view.leader()}",
            )
        if bound is not None and commit.ballot < bound:
            raise Rejected(
                "FAILED_PRECONDITION",
                f"commit of iteration {t} has ballot {tuple(commit.ballot)} below the promised {tuple(bound)}",
            )
    elif commit.ballot != (promised if promised is not None else st.floor.get(t)):
        # (A promise made since a re-synchronisation is never below the floor: on_prepare refuses that.)
        raise Rejected(
            "FAILED_PRECONDITION",
            f"commit of iteration {t} has ballot {tuple(commit.ballot)}; this peer promised "
            f"{'nothing' if promised is None else tuple(promised)} (a takeover commits only after its prepare)",
        )
    _check_continues(st, t, commit.previous, f"commit of iteration {t}")
    old = st.decided.get(t)
    if old is not None and _same_value(old.commit, commit):
        entry = old._replace(commit=commit)
    else:
        entry = LogEntry(commit, None)
    if entry.payloads is None and payloads is not None:
        if first or len(payloads) != len(commit.contributors):  # a part (Params.relay_parts)
            st, payloads, signatures = _gather(
                params, st, view, commit, first, payloads, signatures, relays, now, effects
            )
            if payloads is not None:  # every part in, each checked and forwarded as it came
                entry = _relayed(params, view, entry, payloads, signatures, effects, verified=True)
        else:
            entry = _relayed(params, view, entry, payloads, signatures, effects)
            if entry.payloads is not None and params.relay_fanout:
                st = _forward(params, st, view, commit.sender, entry, relays, now, effects)
    st = st._replace(decided=_put(st.decided, t, entry), promised=_put(st.promised, t, commit.ballot))
    if st.recovery is not None and st.recovery.ballot < commit.ballot and t == st.it:
        st = st._replace(recovery=None)
    st = _advance(params, st, now, effects)
    return Step(st, tuple(effects), _commit_reply(st, commit, True))


def _forward(
    params: Params,
    st: PeerState,
    view: View,
    root: int,
    entry: LogEntry,
    relays: tuple[int, ...],
    now: float,
    effects: list,
) -> PeerState:
    """Relay ``entry`` (its payloads taken here) to our children of the tree below ``root`` that
    ``relays`` orders, and time the relay until they answer (:func:`on_commit_acked`)."""
    relays = tuple(relays)[:MAX_MEMBERS]
    children, _ = _relay_split(params, view, root, st.me, relays)  # those that forward come first
    if not children:
        return st
    t = entry.commit.iteration
    sent = entry._replace(relays=relays)
    effects += [Send(m.machine, m.address, sent) for m in children]
    since = st.relaying[1] if st.relaying[0] == t else now  # a later part: the relay began at the first
    return st._replace(relaying=(t, since, frozenset(m.machine for m in children), 0, now))


def _parts(params: Params, entry: LogEntry) -> list[LogEntry]:
    """``entry`` relayed in ``Params.relay_parts`` parts of its payloads (in contributors order)."""
    n = len(entry.payloads or ())
    size = -(-n // params.relay_parts)
    if size >= n:
        return [entry]
    return [
        entry._replace(payloads=entry.payloads[a : a + size], signatures=entry.signatures[a : a + size], first=a)
        for a in range(0, n, size)
    ]


def _gather(
    params: Params,
    st: PeerState,
    view: View,
    commit: Commit,
    first: int,
    payloads: tuple[bytes, ...],
    signatures: tuple[bytes, ...] | None,
    relays: tuple[int, ...],
    now: float,
    effects: list,
) -> tuple[PeerState, tuple | None, tuple | None]:
    """A relayed part of ``commit``'s payloads from ``first`` (``Params.relay_parts``): checked
    against its contributors' keys, forwarded at once to our children of the relay tree, and held;
    ``(state, payloads, signatures)``, the last two all of them once every part is in, else None.
    A part that fails its checks is ignored (the payloads are then fetched)."""
    t, n = commit.iteration, len(commit.contributors)
    try:
        if not 0 <= first < n or first + len(payloads) > n or signatures is None or len(signatures) != len(payloads):
            raise Rejected(
                "INVALID_ARGUMENT",
                f"a part of {len(payloads)} payloads from contributor {first} of {n} (signatures "
                f"{'none' if signatures is None else len(signatures)})",
            )
        contributors = commit.contributors[first : first + len(payloads)]
        for (m, count), payload in zip(contributors, payloads, strict=True):
            _check_payload(params, count, payload, f"relayed push of machine {m}", t)
        part = LogEntry(commit._replace(contributors=contributors), tuple(payloads), tuple(signatures))
        _verify_payloads(params, view, part, f"relayed pushes of iteration {t}")
    except Rejected as e:
        effects.append(Note(f"iteration {t}: a relayed part not taken ({e.message}); fetching the payloads"))
        return st, None, None
    held = dict(st.parts.get(t, {}))
    if first in held:
        return st, None, None  # a part again
    held[first] = (tuple(payloads), tuple(signatures))
    if params.relay_fanout:
        st = _forward(
            params, st, view, commit.sender, LogEntry(commit, *held[first], relays, first), relays, now, effects
        )
    at, got, sigs = 0, [], []
    while at in held and held[at][0]:  # the parts end to end from the first (overlapping strays aside)
        got += held[at][0]
        sigs += held[at][1]
        at += len(held[at][0])
    if len(got) == n:
        return st._replace(parts={k: v for k, v in st.parts.items() if k != t}), tuple(got), tuple(sigs)
    return st._replace(parts={**st.parts, t: held}), None, None


def _relayed(
    params: Params, view: View, entry: LogEntry, payloads, signatures, effects: list, *, verified: bool = False
) -> LogEntry:
    """``entry`` with the payloads relayed beside its commit, if each is its contributor's, signed
    (``verified``: their signatures were checked already, part by part), and together they are the
    commit's (else ``entry`` unchanged: they are fetched)."""
    c = entry.commit
    try:
        if len(payloads) != len(c.contributors) or signatures is None or len(signatures) != len(payloads):
            raise Rejected("INVALID_ARGUMENT", f"{len(payloads)} payloads for {len(c.contributors)} contributors")
        for (m, n), payload in zip(c.contributors, payloads, strict=True):
            _check_payload(params, n, payload, f"relayed push of machine {m}", c.iteration)
        if updates_digest(c.contributors, payloads) != c.updates_digest:
            raise Rejected("INVALID_ARGUMENT", "the payloads are not the ones the commit names")
        relayed = LogEntry(c, tuple(payloads), tuple(signatures))
        # the commit itself was checked by on_commit: its contributors' signatures remain
        if not verified:
            _verify_payloads(params, view, relayed, f"relayed pushes of iteration {c.iteration}")
    except Rejected as e:
        effects.append(Note(f"iteration {c.iteration}: relayed pushes not taken ({e.message}); fetching them"))
        return entry
    return relayed


def on_commit_acked(
    params: Params, st: PeerState, *, iteration: int, machine: int, now: float, reply: CommitReply
) -> Step:
    """A member answered our commit of ``iteration`` with ``reply`` (:func:`on_commit`'s). The
    delivery worked (its failed deliveries are forgotten); a member that holds the commit counts
    toward answering the joiners it admitted,
    and one whose reply names our decision of ``iteration - 1`` (admitting members) counts toward
    that one's: a member that missed a commit, and fetched it, vouches for it with the next.
    Joiners are answered once the holders meet every majority of the iteration's view
    (:func:`_answer_admissions`); a member that only took the commit as a hint counts for nothing."""
    st = st._replace(failures={k: v for k, v in st.failures.items() if k != machine})
    st = _relay_answered(st, iteration, machine, now, ok=True)
    effects: list = []
    if reply.stored:
        st = _admission_acked(st, iteration, machine, effects)
    before = st.decided.get(iteration - 1)
    if reply.previous and before is not None and reply.previous == decision_digest(before.commit):
        st = _admission_acked(st, iteration - 1, machine, effects)
    return Step(st, tuple(effects))


def _relay_answered(st: PeerState, iteration: int, machine: int, now: float, *, ok: bool) -> PeerState:
    """``machine``, a child of our relay of ``iteration``, answered (or failed): once every child
    did, the relay's time per child that answered is what our next pushes report."""
    it, since, waiting, answered, last = st.relaying
    if it != iteration or machine not in waiting:
        return st
    waiting = waiting - {machine}
    answered, last = (answered + 1, now) if ok else (answered, last)
    st = st._replace(relaying=(it, since, waiting, answered, last))
    if not waiting and answered:
        st = st._replace(relay_us=max(1, round(1e6 * (last - since) / answered)))
    return st


def _admission_acked(st: PeerState, iteration: int, machine: int, effects: list) -> PeerState:
    adm = st.admissions.get(iteration)
    if adm is None:
        return st
    st = st._replace(admissions=_put(st.admissions, iteration, adm._replace(acks=adm.acks | {machine})))
    return _answer_admissions(st, iteration, effects)


def on_commit_failed(params: Params, st: PeerState, *, iteration: int, machine: int, message: str, now: float) -> Step:
    """Our decision could not be delivered to ``machine`` (counted; after :data:`UNREACHABLE_AFTER` it is removed)."""
    st = st._replace(failures=_put(st.failures, machine, st.failures.get(machine, 0) + 1))
    st = _relay_answered(st, iteration, machine, now, ok=False)
    return Step(st, (Note(f"commit of iteration {iteration} to machine {machine} failed: {message}"),))


def on_push_refused(params: Params, st: PeerState, *, iteration: int, machine: int, now: float) -> Step:
    """The connection to ``machine`` refused our push of ``iteration``, or our :class:`Probe` sent
    while we waited for it (gRPC ``UNAVAILABLE``: nothing listens at its address, its process is
    gone).

    The committer stops waiting for that member's push in this iteration: a killed peer costs the
    run no barrier timeout. The decision still needs a majority of the members (a partitioned
    committer whose pushes all fail keeps waiting), the member becomes inactive as if it had
    missed the barrier, and pushing again makes it active (a refusal that was only a restart).
    A push that arrives after all is counted as usual. Any other member that finds its committer
    gone takes over (:func:`_replace_gone`) without waiting for the commit deadline. Refusals of
    another iteration are ignored.
    """
    if st.phase != MEMBER or iteration != st.it or machine == st.me or machine not in st.view.ids():
        return Step(st, ())
    st = st._replace(refused=st.refused | {machine})
    effects: list = []
    st = _try_commit(params, st, now, effects)
    return Step(st, tuple(effects))


# --------------------------------------------------------------------------- takeover


def _start_recovery(params: Params, st: PeerState, now: float, effects: list) -> PeerState:
    prev = _bound(st, st.it)
    used = st.last_takeover[1] if st.last_takeover[0] == st.it else 0  # never a ballot of ours twice
    ballot = Ballot(max(prev.round if prev is not None else 0, used) + 1, st.me)
    if ballot.round >= MAX_ROUND:
        effects.append(Note(f"iteration {st.it}: no takeover possible (ballot round {ballot.round} at the bound)"))
        return st._replace(deadline=now + 2 * _barrier_s(params, st))
    st = st._replace(
        promised=_put(st.promised, st.it, ballot),
        recovery=Recovery(ballot, {}, now + _barrier_s(params, st)),
        last_takeover=(st.it, ballot.round),
    )
    effects.append(
        Note(f"iteration {st.it}: taking over with ballot {tuple(ballot)} (suspected {sorted(st.suspected)})")
    )
    prepare = sign(
        params, Prepare(params.run_id, st.me, st.it, ballot, previous=st.chain or b"", gone=_leader_gone(st))
    )
    effects += [Send(m.machine, m.address, prepare) for m in st.view.members if m.machine != st.me]
    if len(st.view.members) == 1:
        st = _finish_recovery(params, st, now, effects)
    return st


def _applied_digest(st: PeerState, t: int) -> bytes:
    """:func:`decision_digest` of the decision of ``t`` this peer applied (b"" if it applied none)."""
    e = st.decided.get(t)
    return decision_digest(e.commit) if e is not None and 0 <= t < st.it else b""


def _learn_chosen(st: PeerState, effects: list) -> PeerState:
    """Our takeover's promises show members that meet every majority of the view of ``it - 1``
    (:func:`_meets_every_majority`) holding the decision of ``it - 1`` we applied (same ballot, same
    value): that decision is chosen (no later ballot can decide otherwise), and with it the view of
    ``it``. Joiners holding a seat in that view can
    then be told their ids by this peer (the leader that admitted them may have died before it
    answered): queued joins from them are answered now (:func:`_seat`).

    The peer that signed the decision counts as a holder without a reply: it accepted its own
    proposal when it issued it (:func:`_publish` records and applies it in the same step, and a
    promise it makes later reports it), as a Paxos leader is one of its acceptors. So a leader that
    died after deciding, with one member removed, still leaves its decision chosen by the others'
    copies (leader + 2 of 4)."""
    t = st.it - 1
    if st.chosen >= t or st.recovery is None:
        return st
    base = _view_at(st, t)
    mine = _applied_digest(st, t)
    if base is None or not mine:
        return st
    proposer = st.decided[t].commit.sender
    holders = {st.me, proposer} | {m for m, r in st.recovery.replies.items() if r is not None and r.previous == mine}
    if not _meets_every_majority(holders, base.ids()):
        return st
    st = st._replace(chosen=t)
    effects.append(
        Note(
            f"iteration {t}: machines {sorted(holders & base.ids())} of {sorted(base.ids())} hold its decision: it is chosen"
        )
    )
    joins = []
    for rid, address, key in st.joins:
        seat = _seat(st, address, key)
        if seat is None:
            joins.append((rid, address, key))
        else:
            effects += _answer_seat(rid, *seat)
    return st._replace(joins=tuple(joins))


def _seat(st: PeerState, address: str, key: bytes) -> tuple[Member, View, bytes] | None:
    """The inactive member at ``address`` with ``key`` (a joiner admitted but not told so: a process's
    key is its own, new at each start or rejoin), the view to tell it and that view's chain: the view
    of ``chosen + 1``, handed on by the newest decision this peer knows is chosen, when that view and
    the current one both hold the seat (else None).

    That view, not the current one: the decision of ``it - 1`` may not be known chosen yet, and the
    takeover that would learn it may need this very joiner's promise (five founders, a joiner
    admitted, two founders dead: three of the six members are left to answer). The joiner starts
    from the chosen view and fetches the decisions after it like any member that fell behind."""
    if st.phase != MEMBER or st.chosen < 0 or st.chain is None:
        return None
    chosen_view = _view_at(st, st.chosen + 1)
    if chosen_view is None:
        return None

    def find(view: View) -> Member | None:
        return next((m for m in view.members if m.address == address and m.key == key and not m.active), None)

    seat = find(chosen_view)
    if seat is None or find(st.view) != seat:
        return None
    return seat, chosen_view, _chain_before(st, st.chosen + 1)


def _answer_seat(rid: int, seat: Member, view: View, chain: bytes) -> list:
    return [
        Admit(rid, JoinAnswer(seat.machine, view, chain)),
        Note(
            f"told machine {seat.machine} ({seat.address}) its id: the chosen view of iteration {view.iteration} holds it"
        ),
    ]


def prepare_probe(params: Params, st: PeerState, msg: Prepare, now: float) -> Probe | None:
    """The :class:`Probe` the runtime makes before :func:`on_prepare` takes ``msg`` (None: nothing to
    check). A takeover of our current iteration that says the leader is gone (:attr:`Prepare.gone`)
    is promised before our iteration timeout only if the leader refused our connection too: a
    member holding valid credentials could otherwise claim it to take every iteration from a live
    leader. Where this peer has no such evidence yet, the runtime tries the connection at once and
    reports a refusal (:func:`on_push_refused`) before it hands the prepare on."""
    if not msg.gone or st.phase != MEMBER or msg.iteration != st.it or now >= st.started_at + _iteration_s(params, st):
        return None
    leader = st.view.leader()
    if leader is None or leader == st.me or _leader_gone(st):
        return None
    return Probe(leader, st.view.address_of(leader), st.it)


def on_prepare(params: Params, st: PeerState, msg: Prepare, now: float) -> Step:
    """A takeover asks for our promise. Reply: our :class:`PrepareReply`.

    Raises:
      Rejected: other run, unknown sender, ballot below one already promised, iteration out of the
        window or past the closing one, a takeover continuing another chain than ours, or one of
        our current iteration before its iteration timeout, unless it says the leader is gone and
        the leader refused our connection too (:func:`prepare_probe`; premature: the leader may
        only be slow).
    """
    _check_run(params, msg.run_id)
    _check_uint("sender", msg.sender)
    _check_uint("iteration", msg.iteration, 2**63)
    _check_in_run(params, msg.iteration, "prepare")
    _check_uint("ballot round", msg.ballot.round, MAX_ROUND)
    if msg.ballot.leader != msg.sender or msg.ballot.round < 1:
        raise Rejected("INVALID_ARGUMENT", f"prepare from machine {msg.sender} with ballot {tuple(msg.ballot)}")
    if st.phase in (FORMING, DROPPED):
        raise Rejected("UNAVAILABLE", f"this peer is {st.phase}")
    _verify(params, st.view, msg, f"prepare of machine {msg.sender}")
    t = msg.iteration
    _check_previous(msg.previous, f"prepare of machine {msg.sender}")
    if t < st.it:
        if t < st.it - params.window:
            raise Rejected("OUT_OF_RANGE", f"iteration {t} is older than this peer's window (at {st.it})")
        # No promise to a takeover on another chain, for an applied iteration either: its answer is
        # our decision, which another chain's takeover must not take for its own.
        _check_continues(st, t, msg.previous, f"the takeover of iteration {t} by machine {msg.sender}")
        # Applied already: the reply is our decision. The promise is kept, so that a takeover re-issuing
        # that same decision with this ballot moves our copy to its ballot (see on_commit).
        if msg.ballot > st.promised.get(t, Ballot(*_NO_BALLOT)):
            st = st._replace(promised=_put(st.promised, t, msg.ballot))
        return Step(st, (), PrepareReply(st.it, st.decided.get(t), (), _applied_digest(st, t - 1)))
    if st.phase not in (MEMBER, CATCHING_UP):
        raise Rejected("UNAVAILABLE", f"this peer is {st.phase}")
    if t > st.it + params.window:
        raise Rejected("OUT_OF_RANGE", f"prepare for iteration {t} is too far ahead (this peer is at {st.it})")
    if msg.sender not in st.view.ids():
        raise Rejected("PERMISSION_DENIED", f"machine {msg.sender} is not a member of iteration {st.it}")
    _check_continues(st, t, msg.previous, f"the takeover of iteration {t} by machine {msg.sender}")
    promised = st.promised.get(t)
    bound = _bound(st, t)
    if bound is not None and msg.ballot < bound:
        raise Rejected(
            "FAILED_PRECONDITION", f"ballot {tuple(msg.ballot)} for iteration {t} is below the promised {tuple(bound)}"
        )
    top = bound.round if bound is not None else 0
    if msg.ballot.round > top + MAX_ROUND_STEP:
        raise Rejected(
            "OUT_OF_RANGE",
            f"ballot round {msg.ballot.round} for iteration {t} jumps more than {MAX_ROUND_STEP} above the highest promised ({top})",
        )
    if (
        t == st.it
        and now < st.started_at + _iteration_s(params, st)
        and (promised is None or promised.round == 0)
        and not (msg.gone and _leader_gone(st))
    ):
        raise Rejected(
            "FAILED_PRECONDITION",
            f"iteration {t} started {now - st.started_at:.1f}s ago here; a takeover is premature before the "
            f"iteration timeout ({_iteration_s(params, st):.3g}s)",
        )
    st = st._replace(promised=_put(st.promised, t, msg.ballot))
    effects: list = []
    if t > st.it and st.phase == MEMBER and st.fetch is None:
        # The candidate is ahead: fetch the decisions we missed from it.
        st = _fetch(params, st, now, effects, st.it, t - 1, prefer=msg.sender)
    if t == st.it:
        st = st._replace(deadline=now + 2 * _barrier_s(params, st), suspected=st.suspected - {msg.sender})
        if st.recovery is not None and st.recovery.ballot < msg.ballot:
            st = st._replace(recovery=None)
    pushes = tuple(p for _, p in sorted(st.inbox.at(t)))
    return Step(st, tuple(effects), PrepareReply(st.it, st.decided.get(t), pushes, _applied_digest(st, t - 1)))


def on_prepare_reply(params: Params, st: PeerState, *, sender: int, reply: PrepareReply | None, now: float) -> Step:
    """A promise for our takeover (``None``: the member could not be reached); once every member answered, decide."""
    if st.recovery is None or st.phase != MEMBER or st.promised.get(st.it) != st.recovery.ballot:
        return Step(st, ())
    if sender not in st.view.ids() or sender == st.me:
        return Step(st, ())
    rec = st.recovery._replace(replies=_put(st.recovery.replies, sender, reply))
    st = st._replace(recovery=rec)
    effects: list = []
    st = _learn_chosen(st, effects)
    if set(rec.replies) >= st.view.ids() - {st.me}:
        st = _finish_recovery(params, st, now, effects)
    return Step(st, tuple(effects))


def on_prepare_rejected(params: Params, st: PeerState, *, sender: int, message: str, now: float) -> Step:
    """A member promised a higher ballot: give our takeover up and wait for that one."""
    if st.recovery is None:
        return Step(st, ())
    st = st._replace(recovery=None, deadline=now + 2 * _barrier_s(params, st))
    return Step(st, (Note(f"iteration {st.it}: takeover abandoned, machine {sender}: {message}"),))


def _finish_recovery(params: Params, st: PeerState, now: float, effects: list) -> PeerState:
    rec = st.recovery
    if rec is None or st.it in st.decided:
        return st._replace(recovery=None)
    responders = frozenset(m for m, r in rec.replies.items() if r is not None) | {st.me}
    active = st.view.active_ids()
    members = st.view.ids()
    if not _majority(responders, members):
        if now < rec.deadline:
            return st
        effects.append(
            Note(
                f"iteration {st.it}: takeover got promises from {sorted(responders & members)} of {sorted(members)}; "
                f"no majority, waiting"
            )
        )
        return st._replace(recovery=None, deadline=now + 2 * _barrier_s(params, st))
    # Pushes the responders hold (validated) complete our inbox.
    inbox = st.inbox
    replies = [r for r in rec.replies.values() if r is not None]
    for reply in replies:
        for p in reply.pushes:
            try:
                _check_run(params, p.run_id)
                _check_payload(params, p.count, p.payload, "takeover push", p.iteration)
                _verify(params, st.view, p, "takeover push")
            except Rejected:
                continue  # a push its sender did not sign is ignored
            if (
                p.iteration == st.it
                and p.sender in st.view.ids()
                and (p.iteration, p.sender) not in inbox
                and p.previous == (st.chain or b"")
            ):
                inbox = inbox.put((p.iteration, p.sender), p)
    st = st._replace(inbox=inbox)
    held = []
    for r in replies:
        if r.decided is None or r.decided.commit.iteration != st.it or r.decided.commit.previous != (st.chain or b""):
            continue  # none, or a decision continuing another chain than ours
        try:
            _check_commit(params, r.decided.commit)
            _verify_entry(params, st.view, r.decided, f"decision of iteration {st.it} in a promise")
        except Rejected:
            continue  # a malformed or unsigned decision in a promise is ignored
        held.append(r.decided)
    if held:
        best = max(held, key=lambda e: tuple(e.commit.ballot))
        commit = sign(params, best.commit._replace(sender=st.me, ballot=rec.ballot, signature=b""))
        payloads, sigs = best.payloads, best.signatures
        if payloads is not None and updates_digest(commit.contributors, payloads) != commit.updates_digest:
            payloads = None
        if payloads is None:
            payloads, sigs = _assemble(st, commit) or (None, None)
        entry = LogEntry(commit, payloads, sigs)
        effects.append(
            Note(f"iteration {st.it}: takeover re-issues the decision of ballot {tuple(best.commit.ballot)}")
        )
        return _publish(params, _refuse_joins(st, effects), now, effects, entry, ())
    have = frozenset(m for m in st.inbox.machines(st.it) if m in st.view.ids())
    # Members that promised are alive: they stay active even if their push for this iteration
    # was not in yet (they may have been waiting for the silent leader's previous commit).
    alive = responders & active
    entry, admitted = _decide(params, st._replace(joins=(), ready=st.ready | alive), rec.ballot, have, responders, now)
    effects.append(
        Note(f"iteration {st.it}: takeover decides contributors {[m for m, _ in entry.commit.contributors]}")
    )
    return _publish(params, _refuse_joins(st, effects), now, effects, entry, admitted)


# --------------------------------------------------------------------------- fetching


def on_fetched(params: Params, st: PeerState, entries, now: float) -> Step:
    """Decided iterations fetched from a member: each is checked (structure, payload digest,
    signatures along the chain of views from ``st.it``) and buffered; past entries are compared
    with the applied ones when the fetch checks a conflicting commit (a difference drops this peer).

    Raises:
      Rejected: an entry is malformed, unsigned, or its payloads do not match its digest.
    """
    decided = dict(st.decided)
    check = st.fetch is not None and st.fetch.check
    effects: list = []
    for e in sorted(entries, key=lambda e: e.commit.iteration):
        _check_commit(params, e.commit)
        if e.payloads is None or len(e.payloads) != len(e.commit.contributors):
            raise Rejected("INVALID_ARGUMENT", f"log entry of iteration {e.commit.iteration} lacks payloads")
        for (m, n), p in zip(e.commit.contributors, e.payloads, strict=True):
            _check_payload(params, n, p, f"log entry {e.commit.iteration} machine {m}", e.commit.iteration)
        if updates_digest(e.commit.contributors, e.payloads) != e.commit.updates_digest:
            raise Rejected(
                "INVALID_ARGUMENT", f"log entry of iteration {e.commit.iteration}: payloads do not match the digest"
            )
        t = e.commit.iteration
        if t < st.it:
            old = decided.get(t)
            if (
                check
                and old is not None
                and not _same_value(old.commit, e.commit)
                and e.commit.previous == old.commit.previous
            ):
                _verify_entry(params, None, e, f"log entry of iteration {t}", keys=lambda m: member_key(st, m))
                effects.append(
                    Dropped(
                        f"iteration {t}: the leader's log holds a decision (ballot {tuple(e.commit.ballot)}) that differs from the one this peer applied"
                    )
                )
                return Step(st._replace(phase=DROPPED, fetch=None), tuple(effects))
            continue
        view = st.view if t == st.it else (decided[t - 1].commit.next_view if t - 1 in decided else None)
        if view is None or t > st.it + params.window:
            continue  # not on the chain of views this peer knows: cannot be verified
        before = st.chain if t == st.it else chain_digest(decided[t - 1].commit)
        if before is not None and e.commit.previous != before:
            source = next(
                (m.machine for m in st.view.members if st.fetch is not None and m.address == st.fetch.address), None
            )
            try:
                _verify_entry(params, view, e, f"log entry of iteration {t}")
                signed_here = True
            except Rejected:
                signed_here = False  # not even signed by a member of our view: no evidence
            if t == st.it and signed_here and source is not None and source != st.me:
                st = _elsewhere(st._replace(decided=decided), source, e.commit.previous, "log", effects)
                if st.phase != MEMBER:
                    return Step(st, tuple(effects))
            else:
                effects.append(
                    Note(
                        f"the log of {st.fetch.address if st.fetch else '?'} continues another decision of iteration {t - 1}; not taken"
                    )
                )
            break
        _verify_entry(params, view, e, f"log entry of iteration {t}")
        old = decided.get(t)
        if (
            old is None
            or old.payloads is None
            and (_same_value(old.commit, e.commit) or e.commit.ballot >= old.commit.ballot)
        ):
            decided[t] = LogEntry(e.commit, tuple(e.payloads), e.signatures)
    # A hint the source could not confirm (it has no decision of st.it yet) is dropped: one fetch per hint.
    ahead = st.ahead if st.it in decided else -1
    st = st._replace(decided=decided, fetch=None, denials=frozenset(), ahead=ahead)
    st = _advance(params, st, now, effects)
    return Step(st, tuple(effects))


def on_fetch_failed(params: Params, st: PeerState, *, message: str, now: float, code: str = "") -> Step:
    """A log fetch failed: the next source is tried after a short back-off. ``PERMISSION_DENIED``
    or ``NOT_FOUND`` from two sources (or from every other member) means this peer is no longer
    part of the run (removed, or too far behind the others' logs): :class:`Dropped`."""
    if st.fetch is None or st.fetch.failed:
        return Step(st, ())
    f = st.fetch
    effects: list = [Note(f"fetch of iterations {f.first}..{f.last} from {f.address or '?'} failed: {message}")]
    if code in ("PERMISSION_DENIED", "NOT_FOUND"):
        denials = st.denials | {f.address}
        others = len(st.view.ids() - {st.me})
        if len(denials) >= min(2, max(1, others)):
            effects.append(
                Dropped(
                    f"iteration {st.it}: the members refuse this peer's log requests ({code}): it was removed from the run"
                )
            )
            return Step(st._replace(phase=DROPPED, fetch=None, denials=denials), tuple(effects))
        st = st._replace(denials=denials)
    backoff = min(_barrier_s(params, st), 0.05 * 2 ** min(f.attempt, 6))
    st = st._replace(fetch=f._replace(deadline=now + backoff, failed=True, check=False))
    return Step(st, tuple(effects))


# --------------------------------------------------------------------------- time


def _resync(params: Params, st: PeerState, now: float, effects: list) -> tuple[PeerState, tuple]:
    """A stuck iteration: forget what may wedge it (an undecidable entry, our takeover, who we expect
    to decide), fetch the decided log from the others (the majority moved on, or it is gone), and
    push our gradients of the iteration again (:func:`_push_again`): a push is sent once, and a
    committer that lost it (a failed call is not retried) may lack exactly that member for its
    majority (three members, one dead, the third's push lost).

    Promises are set aside, not forgotten (:attr:`PeerState.floor`): an acceptor that forgot one
    could accept a lower ballot's commit after a takeover counted on its promise, and two decisions
    of one iteration could both be taken."""
    entry = st.decided.get(st.it)
    decided = (
        st.decided
        if entry is None or entry.payloads is not None
        else {k: v for k, v in st.decided.items() if k != st.it}
    )
    st = st._replace(
        decided=decided,
        promised={k: v for k, v in st.promised.items() if k < st.it},
        floor={**st.floor, **{k: max(v, st.floor.get(k, v)) for k, v in st.promised.items() if k >= st.it}},
        recovery=None,
        suspected=frozenset(),
        resynced_at=now,
        deadline=now + 2 * _barrier_s(params, st),
        fetch=None,
    )
    effects.append(
        Note(f"iteration {st.it}: no decision for {now - st.started_at:.0f}s; re-synchronising with the others")
    )
    st = _fetch(params, st, now, effects, st.it, st.it + params.window)
    _push_again(params, st, effects)
    return st, tuple(effects)


def _push_again(params: Params, st: PeerState, effects: list) -> None:
    """Our push of ``it``, if we made one, sent again (:func:`_push_targets`): the same signed
    bytes, which a member that has them accepts again as an identical copy."""
    mine = st.inbox.get((st.it, st.me))
    if mine is not None:
        effects += [Send(m.machine, m.address, mine) for m in _push_targets(params, st)]


def on_tick(params: Params, st: PeerState, now: float) -> Step:
    """Time passed: forming ends, barriers expire, silent committers are suspected, fetches are retried."""
    effects: list = []
    if st.phase == FORMING:
        if now >= st.forming_deadline:
            return _finish_forming(params, st, now)
        return Step(st, ())
    if st.phase != MEMBER:
        return Step(st, ())
    if st.fetch is not None and now >= st.fetch.deadline:
        f = st.fetch
        if not f.failed:
            effects.append(Note(f"fetch of iterations {f.first}..{f.last} from {f.address} timed out"))
        st = _advance(params, st._replace(fetch=None), now, effects)
        if st.phase != MEMBER:
            return Step(st, tuple(effects))
        if st.fetch is None and f.last >= st.it:
            st = _fetch(params, st, now, effects, st.it, f.last)  # the back-off is over: the next source
    if now >= st.started_at + params.stall_s:
        if st.resynced_at < st.started_at:
            return Step(*_resync(params, st, now, effects))
        if now >= st.resynced_at + params.stall_s:
            members = sorted(st.view.ids())
            reason = (
                f"iteration {st.it}: no decision for {now - st.started_at:.0f}s, even after re-synchronising with the others; "
                f"the run has lost its majority (members {members}, a majority is {len(members) // 2 + 1}), "
                f"or it went on without this peer"
            )
            effects.append(Failed(st.it, reason))
            return Step(st._replace(phase=FAILED, fetch=None, recovery=None), tuple(effects))
    if st.it in st.decided:
        if st.relay_wait[0] == st.it and now >= st.relay_wait[1] and st.fetch is None:
            st = _advance(params, st, now, effects)  # the relay did not come: fetch
        return Step(st, tuple(effects))
    if st.recovery is not None:
        if now >= st.recovery.deadline:
            st = _finish_recovery(params, st, now, effects)
        return Step(st, tuple(effects))
    who = committer(st)
    if who == st.me:
        ours = st.promised.get(st.it)
        if ours is not None and ours.round > 0 and now >= st.deadline:
            # Our takeover found no majority (or was abandoned): try again with the next ballot (a
            # member that could not promise may since have come back, or learned its seat).
            st = _start_recovery(params, st, now, effects)
        else:
            st = _try_commit(params, st, now, effects)
            st = _probe_waits(params, st, now, effects)
        return Step(st, tuple(effects))
    if params.pushes == "leader" and who in st.refused:
        st = _replace_gone(params, st, now, effects)  # no push of another member tells us: time does
        if st.recovery is not None or committer(st) != who:
            return Step(st, tuple(effects))
    st = _probe_waits(params, st, now, effects)
    if now < st.deadline:
        return Step(st, tuple(effects))
    active = st.view.active_ids()
    if st.me not in active:
        # An inactive member cannot take over: it keeps waiting and promising (a takeover may need
        # its promise for a majority) and pushes again (the committer's majority may need its
        # push, and a lost one is never retried); the stall timer re-synchronises it (a removal
        # shows in the log, or as refused log requests) and ends a run that cannot go on.
        st = st._replace(waits=st.waits + 1, deadline=now + 2 * _barrier_s(params, st))
        _push_again(params, st, effects)
        return Step(st, tuple(effects))
    return Step(_suspect(params, st, who, now, effects, f"no decision from machine {who}"), tuple(effects))


def _fetch_from_ahead(params: Params, st: PeerState, now: float, effects: list) -> PeerState:
    """A member whose committer of ``it`` is gone (suspected, and it refused our connection) and
    that holds a push of ``it + 1`` (its sender applied a decision of ``it``: the committer reached
    it before it died) fetches that decision from it at once: no takeover of ``it`` comes from a
    member past it. (A committer that is only slow to reach us is waited for as before.)"""
    if not st.suspected & st.refused or st.it in st.decided or st.fetch is not None or st.phase != MEMBER:
        return st
    ahead = sorted(m for m in st.inbox.machines(st.it + 1) if m in st.view.ids())
    if not ahead:
        return st
    effects.append(Note(f"iteration {st.it}: machine {ahead[0]} is past it; fetching its decision"))
    return _fetch(params, st, now, effects, st.it, st.it, prefer=ahead[0])


def _suspect(params: Params, st: PeerState, who: int | None, now: float, effects: list, why: str) -> PeerState:
    """An active member gives up on the committer ``who``: the lowest unsuspected active member
    takes over; the others wait for it (twice the barrier timeout), or fetch the decision from a
    member already past it (:func:`_fetch_from_ahead`)."""
    st = st._replace(suspected=st.suspected | ({who} if who is not None else frozenset()))
    effects.append(Note(f"iteration {st.it}: {why}; suspecting it"))
    cands = st.view.active_ids() - st.suspected
    if not cands:
        # Every active member is suspected: start over (the stall timeout ends a run without a majority).
        effects.append(Note(f"iteration {st.it}: every active member is suspected; waiting"))
        return st._replace(suspected=frozenset(), deadline=now + 2 * _barrier_s(params, st))
    st = _fetch_from_ahead(params, st, now, effects)
    if min(cands) == st.me:
        return _start_recovery(params, st, now, effects)
    return st._replace(deadline=now + 2 * _barrier_s(params, st))
