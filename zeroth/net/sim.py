"""A deterministic in-memory network that drives :mod:`zeroth.net.protocol` state machines.

Used by the protocol tests (and handy to study the protocol): peers are addresses, messages
are delivered after a fixed latency in a deterministic order, peers can be killed (their state
freezes; messages to them fail), partitioned (messages across the cut fail), slowed down, made
to join or leave. "Applying" a decided iteration appends it to the peer's log; a joiner's
"state transfer" copies the sponsor's log up to its first iteration. As in the runtime, a joiner
has a new key at each join and asks again through a live member when its join is released, or
the peer holding it dies or does not answer in time. There is no jax here.

Example:
  >>> from zeroth.net import protocol as P
  >>> params = P.Params(run_id="r", config_digest="c", bytes_per_value=1, max_count=2, iterations=5,
  ...                   iteration_timeout_s=1.0, barrier_timeout_s=0.5, founders=3)
  >>> net = SimNet(params)
  >>> net.start(3)
  >>> net.run_until(lambda: net.all_finished(), limit=60.0)
  True
  >>> [len(p.log) for p in net.peers.values()]
  [5, 5, 5]
"""

from __future__ import annotations

import hashlib
import heapq
import itertools
from collections import deque
from collections.abc import Callable
from typing import Any

from zeroth.net import protocol as P
from zeroth.net.counters import BarrierCounters, is_late

__all__ = ["SimPeer", "SimNet"]


class SimPeer:
    """One simulated peer: its protocol state, applied log and fate."""

    def __init__(self, address: str):
        self.address = address
        self.state: P.PeerState | None = None
        self.log: list[P.LogEntry] = []  # applied decisions, in order, from iteration `base`
        self.base = 0
        self.alive = True
        self.compute_time = 0.05
        self.stall = 0.0  # extra seconds after the compute deadline (a starved or stuck machine)
        self.machines: list[int] = []  # ids this address held, in order
        self.events: list[tuple[float, str]] = []  # (time, text) of drops, finishes, notes
        self.finished: str | None = None
        self.dropped = 0
        self.pending_join: int | None = None
        self.join_attempts = 0  # retried joins (they go round the live members)
        self.key = b""  # this incarnation's public key (a new one per join, as the runtime's identity)
        self.incarnations = 0
        self.counters = BarrierCounters()  # contributors, late pushes, wasted forward passes, barrier wait
        self.promises = True  # False: a member that answers commits but no takeover's prepare (a hostile one)

    @property
    def phase(self) -> str:
        return self.state.phase if self.state is not None else "joining"

    def chain(self) -> list[tuple[int, tuple, bytes]]:
        """``(iteration, contributors, updates_digest)`` of every applied decision."""
        return [(e.commit.iteration, e.commit.contributors, e.commit.updates_digest) for e in self.log]


class SimNet:
    """The simulated network. ``latency`` seconds per message (:meth:`link_delay`: a subclass models
    links); ``tick`` seconds between timer events; ``call_slots``: calls (:class:`P.Send`) a peer
    has in flight at once, the others wait in order for a reply to free a slot, as in a runtime
    whose sends block a pool of that many threads (None: no limit)."""

    def __init__(
        self,
        params: P.Params,
        *,
        latency: float = 0.002,
        tick: float = 0.02,
        rejoin: bool = False,
        call_slots: int | None = None,
    ):
        self.params = params
        self.latency = latency
        self.call_slots = call_slots
        self._in_flight: dict[str, int] = {}
        self._waiting: dict[str, deque] = {}
        self.tick = tick
        self.rejoin = rejoin
        self.now = 0.0
        self.peers: dict[str, SimPeer] = {}
        self._queue: list = []
        self._seq = itertools.count()
        self._rids = itertools.count(1)
        self._cut: set[frozenset[str]] = set()
        self._drop_next: dict[tuple[str, str, type], int] = {}
        self.admitted: list[int] = []  # every machine id handed out, in order
        self.probes = 0  # Probe effects sent, all peers together
        self._next_tick = 0.0

    # ----------------------------------------------------------------- scheduling

    def _at(self, t: float, fn: Callable[[], None]) -> None:
        heapq.heappush(self._queue, (t, next(self._seq), fn))

    def run_until(self, cond: Callable[[], bool], *, limit: float) -> bool:
        """Process events until ``cond()`` or simulated time ``limit``; returns ``cond()``."""
        while not cond():
            nxt = self._queue[0][0] if self._queue else float("inf")
            if self._next_tick <= nxt:
                if self._next_tick > limit:
                    return cond()
                self.now = self._next_tick
                self._next_tick += self.tick
                for peer in list(self.peers.values()):
                    if peer.alive and peer.state is not None:
                        self._handle(peer, P.on_tick(self.params, peer.state, self.now))
                continue
            if nxt > limit:
                return cond()
            t, _, fn = heapq.heappop(self._queue)
            self.now = t
            fn()
        return True

    def all_finished(self) -> bool:
        live = [p for p in self.peers.values() if p.alive]
        return bool(live) and all(p.finished is not None for p in live)

    # ----------------------------------------------------------------- faults

    def kill(self, address: str) -> None:
        """The peer stops at once (like SIGKILL): no more messages in or out."""
        self.peers[address].alive = False
        self.peers[address].events.append((self.now, "killed"))

    def partition(self, group_a, group_b) -> None:
        """Messages between the two groups of addresses fail from now on."""
        for a in group_a:
            for b in group_b:
                self._cut.add(frozenset((a, b)))

    def heal(self) -> None:
        self._cut.clear()

    def drop_next(self, src: str, dst: str, kind: type, count: int = 1) -> None:
        """Lose the next ``count`` messages of type ``kind`` from ``src`` to ``dst``."""
        self._drop_next[(src, dst, kind)] = count

    def _reachable(self, a: str, b: str) -> bool:
        return b in self.peers and self.peers[b].alive and frozenset((a, b)) not in self._cut

    def _refuses(self, a: str, b: str) -> bool:
        """Whether ``b``'s address refuses ``a``'s connections: its process is gone (killed) while the
        network between them works (a partition or a lost message refuses nothing: it times out)."""
        return b in self.peers and not self.peers[b].alive and frozenset((a, b)) not in self._cut

    # ----------------------------------------------------------------- peers

    def start(self, founders: int) -> None:
        """Start machine 0 at ``sim:0`` and ``founders - 1`` joiners at ``sim:1``.."""
        first = self._new_peer("sim:1000")
        first.key = self._new_key(first)
        step = P.founder(self.params, address=first.address, now=self.now, key=first.key)
        first.machines.append(0)
        self.admitted.append(0)
        self._handle(first, step)
        for i in range(1, founders):
            self.join(f"sim:{1000 + i}", via=first.address)

    def _new_peer(self, address: str) -> SimPeer:
        peer = SimPeer(address)
        self.peers[address] = peer
        return peer

    def join(self, address: str, *, via: str) -> SimPeer:
        """A new peer at ``address`` asks ``via`` to join (following redirects)."""
        peer = self.peers.get(address) or self._new_peer(address)
        peer.state = None
        peer.finished = None
        peer.key = self._new_key(peer)
        self._send_join(peer, via)
        return peer

    @staticmethod
    def _new_key(peer: SimPeer) -> bytes:
        """A distinct 32-byte key per incarnation of an address (simulations do not check signatures)."""
        peer.incarnations += 1
        return hashlib.sha256(f"{peer.address}/{peer.incarnations}".encode()).digest()

    def _send_join(self, peer: SimPeer, via: str, hops: int = 0) -> None:
        rid = next(self._rids)
        peer.pending_join = rid

        def deliver():
            if not peer.alive or peer.pending_join != rid:
                return
            target = self.peers.get(via)
            if target is None or not self._reachable(peer.address, via) or target.state is None:
                self._at(self.now + 0.5, lambda: self._retry_join(peer))
                return
            req = P.JoinRequest(rid, peer.address, self.params.config_digest, peer.key)
            try:
                step = P.on_join(self.params, target.state, req, self.now)
            except P.Rejected:
                self._at(self.now + 0.5, lambda: self._retry_join(peer))
                return
            self._handle(target, step)
            if not isinstance(step.reply, P.Redirect):
                self._watch_join(peer, via, rid)
            elif hops < 8:
                self._at(self.now + self.latency, lambda: self._send_join(peer, step.reply.address, hops + 1))
            else:
                self._at(self.now + 0.5, lambda: self._retry_join(peer))

        self._at(self.now + self.latency, deliver)

    def _watch_join(self, peer: SimPeer, via: str, rid: int) -> None:
        """A queued join waits for its answer like the runtime's ``Join`` call: the call fails when the
        peer holding it dies (its connection closes) or after the runtime's answer timeout, and the
        joiner asks again through a live member."""
        p = self.params
        until = self.now + p.forming_timeout_s + p.iteration_timeout_s + 4 * p.barrier_timeout_s

        def check():
            if not peer.alive or peer.pending_join != rid:
                return
            holder = self.peers.get(via)
            if holder is not None and holder.alive and self.now < until:
                self._at(self.now + 0.5, check)
                return
            self._retry_join(peer)

        self._at(self.now + 0.5, check)

    def _retry_join(self, peer: SimPeer) -> None:
        """Ask again through the next live member (redirects are followed afresh, as the runtime does)."""
        if not peer.alive or peer.state is not None:
            return
        live = [p.address for p in self.peers.values() if p.alive and p.state is not None and p.phase == P.MEMBER]
        if live:
            peer.join_attempts += 1
            self._send_join(peer, live[peer.join_attempts % len(live)])

    def _joiner(self, rid: int) -> SimPeer | None:
        """The peer whose pending join is ``rid``."""
        return next((p for p in self.peers.values() if p.pending_join == rid), None)

    def _admit(self, answer: P.JoinAnswer, rid: int) -> None:
        peer = self._joiner(rid)
        if peer is None or not peer.alive:
            return
        peer.pending_join = None
        peer.machines.append(answer.machine)
        self.admitted.append(answer.machine)
        peer.state = P.joined(self.params, me=answer.machine, view=answer.view, now=self.now, chain=answer.chain)
        first = answer.view.iteration
        # State transfer: copy a live member's log up to `first` (the snapshot + log of the real runtime).
        sponsor = max(
            (p for p in self.peers.values() if p.alive and p is not peer and p.log and p.base == 0),
            key=lambda p: len(p.log),
            default=None,
        )

        def ready():
            if not peer.alive or peer.state is None or peer.state.phase != P.CATCHING_UP:
                return
            if first > 0:
                if sponsor is None or len(sponsor.log) < first:
                    self._at(self.now + 0.1, ready)
                    return
                peer.log = list(sponsor.log[:first])
            else:
                peer.log = []
            peer.base = 0
            self._handle(peer, P.on_ready(self.params, peer.state, iteration=first, view=answer.view, now=self.now))

        self._at(self.now + 0.05, ready)

    def leave(self, address: str) -> None:
        peer = self.peers[address]
        self._handle(peer, P.request_leave(self.params, peer.state, self.now))

    # ----------------------------------------------------------------- effects

    def _handle(self, peer: SimPeer, step: P.Step) -> None:
        peer.state = step.state
        for eff in step.effects:
            self._effect(peer, eff)

    def _effect(self, peer: SimPeer, eff: Any) -> None:
        if isinstance(eff, P.Send):
            self._deliver(peer, eff)
        elif isinstance(eff, P.Probe):
            self.probes += 1
            self._at(
                self.now + 2 * self.latency,
                lambda peer=peer, me=peer.state.me, eff=eff: self._probe_answer(peer, me, eff),
            )
        elif isinstance(eff, P.Apply):
            t = eff.entry.commit.iteration
            expected = peer.base + len(peer.log)
            if t != expected:
                raise AssertionError(f"{peer.address} applies iteration {t}, expected {expected}")
            if eff.entry.payloads is None:
                raise AssertionError(f"{peer.address} applies iteration {t} without payloads")
            peer.log.append(eff.entry)
            peer.counters.decided(
                t, contributors=[m for m, _ in eff.entry.commit.contributors], me=peer.state.me, now=self.now
            )
        elif isinstance(eff, P.Compute):
            it = eff.iteration
            done_at = self.now + peer.compute_time
            count = self.params.max_count if done_at <= eff.deadline else max(1, self.params.max_count // 2)
            me = peer.state.me
            payload = hashlib.sha256(f"{me}/{it}".encode()).digest()[: count * self.params.bytes_per_value]

            def finished(peer=peer, it=it, count=count, payload=payload, me=me):
                if peer.alive and peer.state is not None and peer.state.me == me:
                    peer.counters.pushed(it, count=count, now=self.now)
                    self._handle(
                        peer,
                        P.on_local_gradients(
                            self.params, peer.state, iteration=it, count=count, payload=payload, now=self.now
                        ),
                    )

            self._at(min(done_at, eff.deadline) + peer.stall, finished)
        elif isinstance(eff, P.Fetch):
            self._fetch(peer, eff)
        elif isinstance(eff, P.Admit):
            self._at(self.now + self.latency, lambda a=eff.answer, r=eff.request_id: self._admit(a, r))
        elif isinstance(eff, P.JoinRefused):
            joiner = self._joiner(eff.request_id)
            if joiner is not None:
                joiner.pending_join = None
                self._at(self.now + 0.5, lambda j=joiner: self._retry_join(j))
        elif isinstance(eff, P.Dropped):
            peer.dropped += 1
            peer.events.append((self.now, f"dropped: {eff.reason}"))
            if self.rejoin:
                live = [p.address for p in self.peers.values() if p.alive and p is not peer and p.phase == P.MEMBER]
                if live:
                    self._at(self.now + 0.1, lambda: self.join(peer.address, via=live[0]))
        elif isinstance(eff, P.Finished):
            peer.finished = eff.reason
            peer.events.append((self.now, f"finished: {eff.reason}"))
        elif isinstance(eff, P.Failed):
            peer.finished = "failed"
            peer.events.append((self.now, f"failed: {eff.reason}"))
        elif isinstance(eff, P.Note):
            peer.events.append((self.now, eff.text))
        else:
            raise AssertionError(f"unknown effect {eff!r}")

    def link_delay(self, src: str, dst: str, message, *, answer_to=None) -> float:
        """Seconds ``message`` (a :class:`P.Send`'s message, or the answer to ``answer_to``, one: a
        reply value, None, or the :class:`P.Rejected` raised) takes from ``src`` to ``dst``, counted
        from now: ``latency``. A subclass may model per-pair latency, bandwidth and count bytes."""
        return self.latency

    def _deliver(self, src: SimPeer, send: P.Send, sender_state_me: int | None = None) -> None:
        if sender_state_me is None:
            sender_state_me = src.state.me
        if self.call_slots is not None:
            if self._in_flight.get(src.address, 0) >= self.call_slots:
                self._waiting.setdefault(src.address, deque()).append((send, sender_state_me))
                return
            self._in_flight[src.address] = self._in_flight.get(src.address, 0) + 1
        msg = send.message
        key = (src.address, send.address, type(msg))
        lost = self._drop_next.get(key, 0) > 0
        if lost:
            self._drop_next[key] -= 1

        def arrive():
            dst = self.peers.get(send.address)
            ok = not lost and self._reachable(src.address, send.address) and dst.state is not None
            reply = None
            error = None
            if ok:
                late = isinstance(msg, P.Push) and is_late(dst.state, msg.iteration)
                try:
                    step = self._dispatch(dst, msg)
                    self._handle(dst, step)
                    reply = step.reply
                except P.Rejected as e:
                    error = e
                if late and (error is None or error.code == "FAILED_PRECONDITION"):
                    dst.counters.late()
            back = (
                self.link_delay(send.address, src.address, error if error is not None else reply, answer_to=msg)
                if ok
                else self.latency
            )
            self._at(self.now + back, lambda: self._replied(src, sender_state_me, send, ok, reply, error))

        self._at(self.now + (self.link_delay(src.address, send.address, msg) if not lost else self.latency), arrive)

    def _replied(self, src: SimPeer, me: int, send: P.Send, ok: bool, reply, error) -> None:
        """A call's answer is back: its slot frees (the next waiting call goes), then the answer is taken."""
        if self.call_slots is not None:
            self._in_flight[src.address] -= 1
            waiting = self._waiting.get(src.address)
            while waiting and self._in_flight[src.address] < self.call_slots:
                nxt, nxt_me = waiting.popleft()
                if src.alive and src.state is not None and src.state.me == nxt_me:
                    self._deliver(src, nxt, nxt_me)
        self._reply(src, me, send, ok, reply, error)

    def _dispatch(self, dst: SimPeer, msg) -> P.Step:
        p, st, now = self.params, dst.state, self.now
        if isinstance(msg, P.Push):
            return P.on_push(p, st, msg, now)
        if isinstance(msg, P.Commit):
            return P.on_commit(p, st, msg, now)
        if isinstance(msg, P.LogEntry):  # a commit with the payloads relayed (Params.pushes == "leader")
            return P.on_commit(
                p,
                st,
                msg.commit,
                now,
                payloads=msg.payloads,
                signatures=msg.signatures,
                relays=msg.relays,
                first=msg.first,
            )
        if isinstance(msg, P.Prepare):
            if not dst.promises:
                raise P.Rejected("UNAVAILABLE", f"{dst.address} answers no prepare")
            probe = P.prepare_probe(p, st, msg, now)
            if probe is not None:  # the runtime's probe before the prepare, answered at once
                self.probes += 1
                self._probe_answer(dst, st.me, probe)
            return P.on_prepare(p, dst.state, msg, now)
        if isinstance(msg, P.Leave):
            return P.on_leave(p, st, msg, now)
        raise AssertionError(f"unknown message {msg!r}")

    def _probe_answer(self, src: SimPeer, me: int, probe: P.Probe) -> None:
        """A probe's round trip: a refused connection (a killed peer) is a refused push."""
        if src.alive and src.state is not None and src.state.me == me and self._refuses(src.address, probe.address):
            self._handle(
                src,
                P.on_push_refused(
                    self.params, src.state, iteration=probe.iteration, machine=probe.machine, now=self.now
                ),
            )

    def _reply(self, src: SimPeer, me: int, send: P.Send, ok: bool, reply, error) -> None:
        if not src.alive or src.state is None or src.state.me != me:
            return
        p, st, now = self.params, src.state, self.now
        msg = send.message
        if isinstance(msg, P.LogEntry):
            msg = msg.commit  # its answer is a commit's
        if isinstance(msg, P.Push) and not ok and self._refuses(src.address, send.address):
            self._handle(src, P.on_push_refused(p, st, iteration=msg.iteration, machine=send.machine, now=now))
        if isinstance(msg, P.Commit):
            if ok and error is None:
                self._handle(
                    src, P.on_commit_acked(p, st, iteration=msg.iteration, machine=send.machine, now=now, reply=reply)
                )
            else:
                text = error.message if error else "unreachable"
                self._handle(
                    src, P.on_commit_failed(p, st, iteration=msg.iteration, machine=send.machine, message=text, now=now)
                )
        elif isinstance(msg, P.Prepare):
            if ok and error is None:
                self._handle(src, P.on_prepare_reply(p, st, sender=send.machine, reply=reply, now=now))
            elif error is not None and error.code == "FAILED_PRECONDITION":
                self._handle(src, P.on_prepare_rejected(p, st, sender=send.machine, message=error.message, now=now))
            else:
                self._handle(src, P.on_prepare_reply(p, st, sender=send.machine, reply=None, now=now))

    def _fetch(self, peer: SimPeer, eff: P.Fetch) -> None:
        me = peer.state.me

        def arrive():
            src = self.peers.get(eff.address)
            if not self._reachable(peer.address, eff.address) or src is None:
                entries = None
            else:
                # The applied log, then the decisions in the protocol's window (the closing one), as the runtime serves them.
                held = {e.commit.iteration: e for e in src.log}
                window = P.log_entries(src.state, eff.first, eff.last) if src.state is not None else []
                held.update((e.commit.iteration, e) for e in window if e.commit.iteration not in held)
                entries = []
                for t in range(eff.first, eff.last + 1):
                    if t not in held:
                        break
                    entries.append(held[t])

            def back():
                if not peer.alive or peer.state is None or peer.state.me != me:
                    return
                if entries is None:
                    self._handle(
                        peer,
                        P.on_fetch_failed(
                            self.params, peer.state, message="unreachable", now=self.now, code="UNAVAILABLE"
                        ),
                    )
                    return
                try:
                    step = P.on_fetched(self.params, peer.state, entries, self.now)
                except P.Rejected as e:  # a log this peer cannot take is a failed fetch, as in the runtime
                    step = P.on_fetch_failed(self.params, peer.state, message=e.message, now=self.now)
                self._handle(peer, step)

            self._at(self.now + self.latency, back)

        self._at(self.now + self.latency, arrive)
