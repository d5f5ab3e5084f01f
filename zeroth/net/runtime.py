"""A Just One Byte peer process: a thin driver running the pure protocol
(:mod:`zeroth.net.protocol`) over gRPC, a timer and a :class:`zeroth.net.work.Worker`.

The pieces of a :class:`Node`, each in its own module:

* :mod:`zeroth.net.transport` — channels, calls, size limits, byte accounting, signed requests;
* :mod:`zeroth.net.transfer` — snapshots, the decided log, digests, the joiner's download and replay;
* :mod:`zeroth.net.repair` — checksum exchange with a rotating partner and repair after a mismatch;
* :mod:`zeroth.net.updatelog` — ``OUT/updates.log``: every state taken and every decided iteration
  applied, with the digest after it (what ``zeroth verify`` replays);
* this module — the driver: it feeds events to the protocol under one lock and carries out its
  effects: :class:`~P.Send` messages (pushes and commits as gRPC futures that hold no thread while
  they travel, commits as deltas of their iteration's view; prepares and leaves in a pool of sender
  threads) and :class:`~P.Fetch` log entries (in that pool), answers fed back to the protocol,
  and, in order in the *driver* thread, :class:`~P.Apply` a decided iteration (exact replay,
  digest, snapshot, metrics, checksum exchange, evaluation), :class:`~P.Compute` projected gradients, rejoin after :class:`~P.Dropped`, the end after
  :class:`~P.Finished` or :class:`~P.Failed` (which saves the state to restart from); a ticker
  calls :func:`P.on_tick` every ``tick_s``; gRPC server threads (:mod:`zeroth.net.service`)
  authenticate each request and call the ``handle_*`` methods.

Security: a node needs the run ``secret`` (or ``insecure=True``). Every process has its own
Ed25519 identity (:mod:`zeroth.transport.identity`) whose public key the commit admitting it puts into
the view; every message it sends is signed with it.

Example (one peer, in-process):
  >>> from zeroth.config import load_config_dict
  >>> cfg = load_config_dict({"train": {"steps": 3}, "peers": {"count": 1}})  # doctest: +SKIP
  >>> node = Node(cfg, NodeOptions(out_dir="/tmp/peer0", insecure=True))       # doctest: +SKIP
  >>> node.start(); node.wait(60)                                              # doctest: +SKIP
"""

from __future__ import annotations

import dataclasses
import json
import queue
import shutil
import socket
import sys
import threading
import time
import traceback
import uuid
from concurrent import futures
from pathlib import Path
from typing import Any, NamedTuple

import grpc

from zeroth import replay as _replay
from zeroth.config import Config, config_digest, to_dict
from zeroth.transport import identity as _id
from zeroth.net import protocol as P
from zeroth.net.counters import BarrierCounters, is_late
from zeroth.transport import security as _sec
from zeroth.net import service as _service
from zeroth.net import state as _state
from zeroth.net import updatelog as _updatelog
from zeroth.net.state import load_state, save_state
from zeroth.net import wire
from zeroth.net.proto import peer_pb2 as pb
from zeroth.net.repair import Checksums, Repair
from zeroth.net.transfer import StateTransfer
from zeroth.net.transport import MAX_MESSAGE_BYTES, Traffic, Transport, request_signed_bytes, server_limits
from zeroth.net.work import Worker
from zeroth.train.metrics import MetricsWriter
from zeroth.train.metrics import clear as clear_metrics

__all__ = [
    "JOIN_DIGEST_EXCLUDE",
    "MAX_MESSAGE_BYTES",
    "join_digest",
    "config_fields",
    "config_differences",
    "RUN_CONFIG_MARK",
    "Traffic",
    "NodeOptions",
    "Repair",
    "Node",
    "RateLimitedLog",
    "save_state",
    "load_state",
]

# Config fields that may differ between the peers of one run (deployment, not training).
JOIN_DIGEST_EXCLUDE = (
    "run.name",
    "run.out_dir",
    "run.tensorboard",
    "peers.count",
    "peers.token",
    "peers.insecure",
    "peers.tls",
    "peers.host",
    "peers.base_port",
    "peers.join_at",
    "peers.kill_at",
    "peers.stall_timeout_s",
    "peers.startup_timeout_s",
)


RUN_CONFIG_MARK = "the run's config: "  # in a refused join: the fields joiners must match, as JSON


def config_fields(cfg: Config) -> dict[str, Any]:
    """``{"section.field": value}`` of the fields a joiner must match (all but :data:`JOIN_DIGEST_EXCLUDE`)."""
    out = {}
    for section, values in to_dict(cfg).items():
        for name, value in (values or {}).items() if isinstance(values, dict) else [("", values)]:
            path = f"{section}.{name}" if name else section
            if not any(path == f or path.startswith(f + ".") for f in JOIN_DIGEST_EXCLUDE):
                out[path] = value
    return out


def config_differences(mine: Config, theirs: dict[str, Any]) -> str:
    """``"train.lr (the run: 0.03, this peer: 0.05); ..."``: the fields where ``mine`` differs from the run's."""
    own = config_fields(mine)
    keys = sorted(k for k in set(own) | set(theirs) if own.get(k) != theirs.get(k))
    return "; ".join(f"{k} (the run: {theirs.get(k)!r}, this peer: {own.get(k)!r})" for k in keys)


def join_digest(cfg: Config) -> str:
    """The digest joiners must present: the config without its deployment fields (:data:`JOIN_DIGEST_EXCLUDE`)."""
    return config_digest(cfg, exclude=JOIN_DIGEST_EXCLUDE)


@dataclasses.dataclass(frozen=True)
class NodeOptions:
    """How one peer runs (its config is the run's; these may differ between peers).

    Attributes:
      out_dir: where metrics.jsonl, summary.json and peer.log go.
      listen: ``host:port`` to serve on (port 0: any free port).
      advertise: the address others use to reach this peer (default: ``listen`` with the bound port).
      join: addresses of peers of the run to join through (``@PATH``: the address written in the
        file PATH, waited for: the ``address`` file of a peer started at the same time); empty =
        found the run (machine 0).
      founders: peers the founder waits for before iteration 0 (itself included).
      secret: the run secret (:mod:`zeroth.transport.identity`); required unless ``insecure``.
      insecure: run without a secret: anyone who reaches a port may join (messages are still
        signed by their senders, so nobody can speak for a member).
      tls: TLS files (None: plaintext).
      rejoin: rejoin automatically after being dropped (at most ``max_rejoins`` times).
      linger_s: keep serving this long after finishing (for the others' last checksums and fetches).
      snapshot_every: keep a snapshot of the parameters every this many iterations (the last two).
      chunk_bytes: bytes per streamed snapshot chunk.
      forming_timeout_s: the founder's start-up window: fewer than ``founders`` joined by then fails
        the run (one line, exit 1) with ``require_founders``, else it starts with whoever joined.
      join_timeout_s: give up joining after this long.
      join_members: with ``join``: ask to join only once a peer of ``join`` reports this many
        members. Machine ids are given in the order joins arrive; a launcher starting founders at
        once gives ``p<i>`` ``join_members=i`` so that ``p<i>`` is machine ``i``.
      join_at: with ``join``: start up (and compile) at once, but join only once the run has
        reached this iteration (a peer of ``join`` reports it through ``Status``).
      leave_at: leave the run on purpose after applying this iteration (None: never).
      resume: a folder written by :func:`save_state` (founder only): start from that state and iteration.
      tick_s: timer period.
      log: print protocol notes and progress to stderr (rate-limited).
      progress_every: print a progress line every this many iterations (0: never).
    """

    out_dir: str
    listen: str = "127.0.0.1:0"
    advertise: str | None = None
    join: tuple[str, ...] = ()
    founders: int = 1
    secret: str | None = None
    insecure: bool = False
    tls: _sec.TLSFiles | None = None
    rejoin: bool = True
    max_rejoins: int = 3
    linger_s: float = 2.0
    snapshot_every: int = 10
    chunk_bytes: int = 256 * 1024
    forming_timeout_s: float = 120.0
    require_founders: bool = True
    join_timeout_s: float = 120.0
    join_at: int | None = None
    join_members: int | None = None
    leave_at: int | None = None
    resume: str | None = None
    tick_s: float = 0.02
    log: bool = True
    progress_every: int = 0

    def __post_init__(self):
        if not self.secret and not self.insecure:
            raise ValueError("a peer needs the run secret (NodeOptions.secret) or insecure=True")


class _Call(NamedTuple):
    """Driver work: run ``fn(params) -> params``."""

    fn: Any
    done: futures.Future


class _Fatal(Exception):
    """A join or catch-up that cannot succeed: end with this one-line reason."""


class RateLimitedLog:
    """Lines to ``stream`` at most ``rate`` per second (bursts of ``burst``); the rest are counted
    and reported with the next line that passes."""

    def __init__(self, stream=sys.stderr, rate: float = 20.0, burst: int = 60):
        self.stream, self.rate, self.burst = stream, rate, burst
        self._tokens = float(burst)
        self._last = time.monotonic()
        self._dropped = 0
        self._lock = threading.Lock()

    def __call__(self, line: str) -> bool:
        with self._lock:
            now = time.monotonic()
            self._tokens = min(self.burst, self._tokens + (now - self._last) * self.rate)
            self._last = now
            if self._tokens < 1:
                self._dropped += 1
                return False
            self._tokens -= 1
            if self._dropped:
                line = f"{line}  ({self._dropped} log lines suppressed)"
                self._dropped = 0
        print(line, file=self.stream, flush=True)
        return True


def _refuse_join(waiter: futures.Future | None, reason: str) -> None:
    """End a waiting Join call (if still waiting) with UNAVAILABLE and ``reason``: the joiner asks again."""
    if waiter is not None and not waiter.done():
        waiter.set_exception(P.Rejected("UNAVAILABLE", reason))


class Node:
    """One peer of a Just One Byte run (see the module docstring).

    Args:
      cfg: the run's config (must have a ``peers`` section).
      options: this peer's :class:`NodeOptions`.
      worker: the model/data worker (default: built from ``cfg``).
    """

    def __init__(self, cfg: Config, options: NodeOptions, *, worker: Worker | None = None):
        if cfg.peers is None:
            raise ValueError("the config has no 'peers' section")
        self.cfg = cfg
        self.options = options
        self.out_dir = Path(options.out_dir)
        self.out_dir.mkdir(parents=True, exist_ok=True)
        self.worker = worker if worker is not None else Worker(cfg)
        self.join_digest = join_digest(cfg)
        self.iterations = cfg.peers.iterations or cfg.train.steps
        self.traffic = Traffic()
        self.secret = options.secret or None
        self.transport = Transport(
            token=_id.access_token(self.secret) if self.secret else None, tls=options.tls, traffic=self.traffic
        )
        self.identity = _id.Identity.generate()
        self._replays = _id.ReplayGuard()
        self._lock = threading.RLock()
        self._st: P.PeerState | None = None
        self._pp: P.Params | None = None
        self.incarnation = 0
        self._work: queue.Queue = queue.Queue()
        self._pool = futures.ThreadPoolExecutor(max_workers=16, thread_name_prefix="zeroth-send")
        self._join_waiters: dict[int, futures.Future] = {}
        self._rid = 0
        self._stop = threading.Event()
        self._finished = threading.Event()
        self.finish_reason: str | None = None
        self.error: str | None = None
        self._log = RateLimitedLog()
        # Driver-owned state.
        self.params: Any = None
        self.applied = 0  # the parameters are the state at the start of this iteration
        self._losses: dict[int, float] = {}
        self._own_payload: dict[int, int] = {}
        self._forward_passes = 0
        self._payload_total = 0  # this peer's projected-gradient bytes, cumulative
        self._last_apply = time.monotonic()
        self._last_traffic = self.traffic.snapshot()
        self.member_stats: dict[int, dict] = {}
        self.transfer = StateTransfer(self)
        self.checksums = Checksums(self)
        self.barrier = BarrierCounters()  # contributors, late pushes, wasted forward passes, barrier wait
        self._commit_pbs: tuple | None = None  # (commit, whole, delta): the latest commit on the wire
        self.counters = {
            "checksum_comparisons": 0,
            "checksum_mismatches": 0,
            "repairs": 0,
            "rejoins": 0,
            "refused_requests": 0,
        }
        self.machines: list[int] = []
        self.last_eval: dict = {}
        self.started = time.monotonic()
        self._server: grpc.Server | None = None
        self.address = ""
        for stale in ("summary.json", "address", "machine"):  # a new process is a new peer
            (self.out_dir / stale).unlink(missing_ok=True)
        clear_metrics(self.out_dir / "metrics.jsonl")
        self._metrics = MetricsWriter(self.out_dir / "metrics.jsonl", tensorboard=cfg.run.tensorboard)
        # every decided iteration this peer applies, appended as it applies it (zeroth verify replays it)
        self._updates = _updatelog.Writer(self.out_dir / _updatelog.FILENAME)
        self._threads: list[threading.Thread] = []
        self._warming: threading.Thread | None = None

    # ------------------------------------------------------------------ lifecycle

    def start(self) -> str:
        """Serve, then found or join the run in the background; returns this peer's address."""
        self._server, port = _service.serve(
            self,
            self.options.listen,
            tls=self.options.tls,
            token=self.transport.token,
            limits=server_limits(max(self.options.founders, self.cfg.peers.count)),
        )
        host = self.options.listen.rpartition(":")[0]
        self.address = self.options.advertise or f"{host}:{port}"
        tmp = self.out_dir / "address.tmp"
        tmp.write_text(self.address + "\n")
        tmp.replace(self.out_dir / "address")
        for target, name in ((self._drive, "zeroth-driver"), (self._tick, "zeroth-ticker")):
            th = threading.Thread(target=target, name=name, daemon=True)
            th.start()
            self._threads.append(th)
        return self.address

    def wait(self, timeout: float | None = None) -> bool:
        """Wait until this peer finished (done, left, or failed); True if it did within ``timeout``."""
        return self._finished.wait(timeout)

    def stop(self, grace: float = 0.0) -> None:
        """Stop serving and every thread (without leaving the run: like a crash, but clean). The
        Join calls this peer holds end at once with UNAVAILABLE: a handler waiting for a decision
        would keep its thread, and the process, alive for up to the join's wait (forming, iteration
        and four barrier timeouts: 4.5 minutes with the defaults)."""
        self._stop.set()
        self._work.put((None, None))
        with self._lock:
            waiters, self._join_waiters = self._join_waiters, {}
        for fut in waiters.values():
            _refuse_join(fut, "this peer is stopping; ask another peer of the run")
        if self._server is not None:
            self._server.stop(grace).wait(5.0)  # no handler runs after this
        self._pool.shutdown(wait=False, cancel_futures=True)
        self.transport.close()
        self._metrics.close()
        self._updates.close()
        if self._warming is not None:  # a compilation killed at interpreter exit aborts the process
            self._warming.join(30.0)

    def leave(self) -> None:
        """Leave the run: stop contributing; :meth:`wait` returns once a decision removed this peer."""
        with self._lock:
            if self._st is not None and self._st.phase == P.MEMBER and not self._st.leaving:
                step = P.request_leave(self._pp, self._st, time.monotonic())
                self._st = step.state
                self._dispatch(step.effects)
                return
        if self._st is None or self._st.phase != P.MEMBER:
            self._finish("left")

    def fail(self, reason: str) -> None:
        """Give up: record ``reason`` as the error and finish (``finish_reason == "failed"``)."""
        self.error = reason
        self._finish("failed")

    def call(self, fn) -> Any:
        """Run ``fn(params) -> params`` in the driver between two iterations and wait for it (inspection, edits)."""
        fut: futures.Future = futures.Future()
        self._work.put((self.incarnation, _Call(fn, fut)))
        return fut.result()

    @property
    def machine(self) -> int | None:
        with self._lock:
            return self._st.me if self._st is not None else None

    @property
    def me(self) -> int:
        return self._st.me

    @property
    def run_id(self) -> str:
        return self._pp.run_id

    @property
    def phase(self) -> str:
        with self._lock:
            return self._st.phase if self._st is not None else "joining"

    def digests(self) -> dict[int, str]:
        """``{iteration: SHA-256 hex of the state at its start}`` held by this peer."""
        store = self.transfer.store
        with store.lock:
            return dict(store.digests)

    def current_view(self) -> tuple[P.View | None, int | None]:
        with self._lock:
            if self._st is None or self._st.phase != P.MEMBER:
                return None, None
            return self._st.view, self._st.me

    def view_and_sources(self) -> tuple[P.View, list[str]]:
        with self._lock:
            view = self._st.view
            sources = [m.address for m in view.members if m.active and m.address != self.address]
        return view, [self.address] + sources

    def log_start(self, iteration: int, digest: str, reason: str) -> None:
        """Open a segment of the update log: this process now holds the state at the start of ``iteration``
        and signs with its identity's key, which the segment names with the proof that it holds the run secret."""
        run_id, key = self._pp.run_id, self.identity.public
        self._updates.start(
            run_id=run_id,
            iteration=iteration,
            digest=digest,
            reason=reason,
            config=to_dict(self.cfg),
            key=key,
            proof=_id.log_proof(self.secret, run_id, key) if self.secret else b"",
        )

    def queue_repair(self, rep: Repair) -> None:
        self._work.put((self.incarnation, rep))

    # ------------------------------------------------------------------ protocol plumbing

    def say(self, text: str) -> None:
        if self.options.log:
            m = self._st.me if self._st is not None else "-"
            self._log(f"[machine {m} {time.monotonic() - self.started:7.2f}s] {text}")

    def _protocol_params(self, run_id: str) -> P.Params:
        p = self.cfg.peers
        return P.Params(
            run_id=run_id,
            config_digest=self.join_digest,
            bytes_per_value=self.worker.codec.bytes_per_value,
            max_count=p.inferences_per_iteration,
            iterations=self.iterations,
            iteration_timeout_s=p.iteration_timeout_s,
            barrier_timeout_s=p.barrier_timeout_s,
            founders=max(1, self.options.founders),
            forming_timeout_s=self.options.forming_timeout_s,
            require_founders=self.options.require_founders,
            payload_check=self.worker.check_payload,
            sign=self.identity.sign,
            verify=_id.verify,
            stall_timeout_s=p.stall_timeout_s,
            max_members=max(p.max_members, max(1, self.options.founders)),
            idle_timeout_s=p.idle_timeout_s,
            pushes=p.pushes,
            relay_fanout=p.relay_fanout,
            relay_parts=p.relay_parts,
            measured_timeouts=p.measured_timeouts,
        )

    def _step(self, fn, *args, **kwargs):
        """Run a protocol handler on the current state under the lock; dispatch its effects; return its reply."""
        with self._lock:
            if self._st is None or self._pp is None:
                raise P.Rejected("UNAVAILABLE", "this peer has not joined a run yet")
            step = fn(self._pp, self._st, *args, now=time.monotonic(), **kwargs)
            old, self._st = self._st, step.state
            if step.state.view is not old.view:
                self._renew_channels(old.view, step.state.view)
            self._dispatch(step.effects)
            return step.reply

    def _renew_channels(self, old: P.View, new: P.View) -> None:
        """Calls to a member newly seated at an address go through a new channel (:meth:`renew
        <zeroth.net.transport.Transport.renew>`): the channel to a peer killed there, then restarted
        and admitted again, may still be waiting out its reconnection back-off, and three failed
        commits would remove the new member as unreachable (a fresh address has no channel yet)."""
        before = {m.address: m.machine for m in old.members}
        for m in new.members:
            if before.get(m.address) != m.machine:
                self.transport.renew(m.address)

    def _dispatch(self, effects) -> None:
        inc = self.incarnation
        for eff in effects:
            if isinstance(eff, P.Send) and isinstance(eff.message, P.Push | P.Commit | P.LogEntry):
                self._send_async(inc, eff)
            elif isinstance(eff, P.Send):
                self._submit(self._send, inc, eff)
            elif isinstance(eff, P.Probe):
                self._submit(self._probe, inc, eff)
            elif isinstance(eff, P.Fetch):
                self._submit(self._fetch, inc, eff)
            elif isinstance(eff, P.Admit):
                fut = self._join_waiters.pop(eff.request_id, None)
                if fut is not None and not fut.done():
                    fut.set_result(eff.answer)
            elif isinstance(eff, P.JoinRefused):
                _refuse_join(self._join_waiters.pop(eff.request_id, None), eff.reason)
            elif isinstance(eff, P.Note):
                self.say(eff.text)
            else:  # Apply, Compute, Dropped, Finished, Failed: in order, in the driver
                self._work.put((inc, eff))

    def _submit(self, fn, *args) -> None:
        if self._stop.is_set():
            return
        try:
            self._pool.submit(fn, *args)
        except RuntimeError:  # the pool is shut down: we are stopping
            pass

    def _event(self, inc: int, fn, **kwargs) -> None:
        """Feed an answer back to the protocol if it still concerns the current incarnation."""
        with self._lock:
            if inc != self.incarnation or self._st is None or self._stop.is_set():
                return
            try:
                self._step(fn, **kwargs)
            except P.Rejected as e:
                self.say(f"{fn.__name__}: {e.message}")

    def _send_async(self, inc: int, eff: P.Send, attempt: int = 0, whole: bool = False) -> None:
        """A push or a commit, sent without holding a thread while it travels (every member's at
        once: an iteration costs a few round trips whatever the number of members); its answer is
        taken by the sender pool, as a blocking call's answer is. A commit goes as a delta
        of the view of its iteration (:func:`zeroth.net.wire.commit_to_pb`; encoded once for all
        members), or ``whole`` to a member that answered that it lacks that view; a decided entry
        (``peers.pushes: leader``) goes as its commit with the payloads relayed. A commit that
        finds the member unavailable or out of time is sent again twice, 50 and 100 ms later."""
        if self._stop.is_set():
            return
        msg = eff.message
        b = self.cfg.peers.barrier_timeout_s

        def done(response, error) -> None:
            self._submit(self._answered, inc, eff, attempt, whole, response, error)

        try:
            if isinstance(msg, P.Push):
                self.transport.rpc_async(
                    eff.address, "PushGradients", wire.push_to_pb(msg), b, done, payload=len(msg.payload)
                )
            else:
                relayed = sum(map(len, msg.payloads)) if isinstance(msg, P.LogEntry) else 0
                self.transport.rpc_async(
                    eff.address, "CommitIteration", self._commit_pb(msg, whole), b, done, payload=relayed
                )
        except grpc.RpcError as e:  # stopping (Closed)
            done(None, e)

    def _commit_pb(self, msg: P.Commit | P.LogEntry, whole: bool):
        """``msg`` on the wire, as a delta of the view of its iteration (else whole), encoded once per
        commit; an entry's commit with its payloads relayed (:func:`zeroth.net.wire.relay_to_pb`)."""
        with self._lock:
            cached = self._commit_pbs
            if cached is None or cached[0] is not msg:
                commit = msg.commit if isinstance(msg, P.LogEntry) else msg
                base = P.view_at(self._st, commit.iteration) if self._st is not None else None
                full = wire.commit_to_pb(commit)
                delta = wire.commit_to_pb(commit, base, self._pp.max_count) if base is not None else full
                if isinstance(msg, P.LogEntry):  # the payloads copied into each form once
                    relayed = wire.relay_to_pb(full, msg)
                    delta = relayed if delta is full else wire.relay_to_pb(delta, msg)
                    full = relayed
                cached = self._commit_pbs = (msg, full, delta)
        return cached[1] if whole else cached[2]

    def commit_from_pb(self, request) -> P.Commit | None:
        """The commit a ``CommitIteration`` request carries, a delta rebuilt from this peer's view of
        its iteration; None when it is a delta of a view this peer does not hold (the sender then
        sends it whole). The payloads relayed with it: :func:`zeroth.net.wire.relay_from_pb`."""
        if not request.HasField("delta"):
            return wire.commit_from_pb(request)
        with self._lock:
            if self._st is None or self._pp is None:
                return None
            base = P.view_at(self._st, int(request.iteration))
            max_count = self._pp.max_count
        try:
            return wire.commit_from_pb(request, base, max_count)
        except wire.NoBase:
            return None

    def _answered(self, inc: int, eff: P.Send, attempt: int, whole: bool, response, error) -> None:
        """The answer to :meth:`_send_async`'s call, fed to the protocol (in a sender thread)."""
        msg = eff.message
        if isinstance(msg, P.LogEntry):
            msg = msg.commit  # its answer is a commit's
        if error is None:
            if isinstance(msg, P.Commit) and response.send_whole and not whole:
                self._send_async(inc, eff, attempt, whole=True)
            elif isinstance(msg, P.Commit):
                reply = P.CommitReply(not response.not_held, bytes(response.previous))
                self._event(inc, P.on_commit_acked, iteration=msg.iteration, machine=eff.machine, reply=reply)
            return
        code, details = error.code(), error.details()
        if isinstance(msg, P.Commit):
            if attempt < 2 and code in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED):
                if not self._stop.wait(0.05 * (attempt + 1)):
                    self._send_async(inc, eff, attempt + 1, whole)
                return
            self._event(
                inc, P.on_commit_failed, iteration=msg.iteration, machine=eff.machine, message=f"{code.name}: {details}"
            )
            return
        if code not in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.CANCELLED):
            self.say(f"push of iteration {msg.iteration} to machine {eff.machine} refused: {code.name}: {details}")
        if code == grpc.StatusCode.UNAVAILABLE:
            # nothing listens at its address: the committer need not wait for its push
            self._event(inc, P.on_push_refused, iteration=msg.iteration, machine=eff.machine)

    def _send(self, inc: int, eff: P.Send) -> None:
        """A prepare or a leave, a blocking call in a sender thread (pushes and commits: :meth:`_send_async`)."""
        msg = eff.message
        b = self.cfg.peers.barrier_timeout_s
        rpc = self.transport.rpc
        try:
            if isinstance(msg, P.Prepare):
                reply = rpc(eff.address, "Prepare", wire.prepare_to_pb(msg), b)
                try:
                    decoded = wire.prepare_reply_from_pb(reply)
                except P.Rejected as e:
                    self.say(f"bad prepare reply from machine {eff.machine}: {e.message}")
                    decoded = None
                self._event(inc, P.on_prepare_reply, sender=eff.machine, reply=decoded)
            elif isinstance(msg, P.Leave):
                rpc(eff.address, "Leave", wire.leave_to_pb(msg), b)
            else:
                raise TypeError(f"_send carries prepares and leaves, not {type(msg).__name__}")
        except grpc.RpcError as e:
            code, details = e.code(), e.details()
            if isinstance(msg, P.Leave) and code not in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.CANCELLED):
                self.say(f"leave of iteration {msg.iteration} to machine {eff.machine} refused: {code.name}: {details}")
            elif isinstance(msg, P.Prepare):
                if code in (grpc.StatusCode.FAILED_PRECONDITION, grpc.StatusCode.OUT_OF_RANGE):
                    self._event(inc, P.on_prepare_rejected, sender=eff.machine, message=details or "")
                else:
                    self._event(inc, P.on_prepare_reply, sender=eff.machine, reply=None)

    def _probe(self, inc: int, eff: P.Probe) -> None:
        """Whether anything listens at the address of a peer this one waits for (a member's push, the
        committer's decision): a
        TCP connection refused there is :func:`zeroth.net.protocol.on_push_refused`; a connection
        made, a timeout (an eighth of the barrier timeout) or any other error says nothing. The
        connection is one of its own, closed at once, not the member's gRPC channel: the question is
        whether the port is open now, whatever state the channel's reconnection is in."""
        try:
            with socket.create_connection(
                P.split_address(eff.address), timeout=self.cfg.peers.barrier_timeout_s * P.PROBE_FIRST
            ):
                return
        except ConnectionRefusedError:
            self._event(inc, P.on_push_refused, iteration=eff.iteration, machine=eff.machine)
        except (OSError, P.Rejected):
            return

    def _fetch(self, inc: int, eff: P.Fetch) -> None:
        try:
            entries = self.transfer.fetch_log(eff.address, eff.first, eff.last)
        except grpc.RpcError as e:
            self._event(inc, P.on_fetch_failed, message=f"{e.code().name}: {e.details()}", code=e.code().name)
            return
        except P.Rejected as e:
            self._event(inc, P.on_fetch_failed, message=e.message)
            return
        with self._lock:
            if inc != self.incarnation or self._st is None:
                return
            try:
                self._step(P.on_fetched, entries)
            except P.Rejected as e:
                self._step(P.on_fetch_failed, message=e.message)

    def _tick(self) -> None:
        while not self._stop.wait(self.options.tick_s):
            with self._lock:
                if self._st is None or self._st.phase not in (P.FORMING, P.MEMBER):
                    continue
                try:
                    self._step(P.on_tick)
                except Exception as e:  # noqa: BLE001  (a tick must never kill the peer)
                    self.say(f"tick failed: {e!r}")

    # ------------------------------------------------------------------ the driver

    def _drive(self) -> None:
        try:
            if self.options.join:
                self._join(list(self.options.join))
            else:
                self._found()
            while not self._stop.is_set():
                inc, eff = self._work.get()
                if eff is None:
                    break
                if isinstance(eff, _Call):
                    try:
                        self.params = eff.fn(self.params)
                        eff.done.set_result(None)
                    except Exception as e:  # noqa: BLE001
                        eff.done.set_exception(e)
                    continue
                if inc != self.incarnation:
                    continue
                if isinstance(eff, P.Apply):
                    self.apply(eff.entry)
                elif isinstance(eff, P.Compute):
                    self._compute(eff)
                elif isinstance(eff, Repair):
                    self.checksums.repair(eff)
                elif isinstance(eff, P.Dropped):
                    self._dropped(eff.reason)
                elif isinstance(eff, P.Finished):
                    self._finish(eff.reason)
                elif isinstance(eff, P.Failed):
                    self._failed(eff.reason)
        except _Fatal as e:
            self.error = str(e)
            self.say(f"giving up: {e}")
            self._finish("failed")
        except Exception as e:  # noqa: BLE001
            if self._stop.is_set():
                return
            self.error = f"{type(e).__name__}: {e}"
            traceback.print_exc()
            self._finish("failed")

    def _found(self) -> None:
        if self.options.resume:
            try:
                params, start, digest = load_state(self.options.resume, self.worker.template())
            except ValueError as e:  # a damaged state, another model's, a digest that differs: one line
                raise _Fatal(f"cannot resume: {e}") from None
            self.say(f"resuming from {self.options.resume}: iteration {start}, digest {digest[:12]}")
        else:
            params, start = self.worker.initial_params(), 0
        self._warm_up()
        run_id = f"{self.cfg.run.name}-{uuid.uuid4().hex[:12]}"
        self._pp = self._protocol_params(run_id)
        self.transfer.load(params, start, None, "resumed" if self.options.resume else "initial")
        with self._lock:
            self.incarnation += 1
            step = P.founder(
                self._pp, address=self.address, now=time.monotonic(), key=self.identity.public, iteration=start
            )
            self._st = step.state
            self.machines.append(0)
            self._write_machine(0)
            self.say(f"founded run {run_id} at {self.address}; waiting for {self.options.founders} founders")
            self._dispatch(step.effects)

    def _warm_up(self) -> None:
        """Compile, before taking part, the estimator and every replay length a run of the founders'
        size meets (1 .. founders + 2 contributors) and the evaluation: compiled later, in the
        background, they starved the first iterations of many peers starting on a few cores."""
        self.worker.warm_up(max(1, self.options.founders))
        self.worker.warm_up_more(max(1, self.options.founders))

    def _warm_more(self, members: int) -> None:
        """Compile, in the background, the replay lengths a view of ``members`` would need beyond
        those :meth:`_warm_up` compiled for the founders (none when it is not larger)."""
        if self._warming is None and members > max(1, self.options.founders):
            self._warming = threading.Thread(
                target=self.worker.warm_up_more, args=(members,), daemon=True, name="zeroth-warm"
            )
            self._warming.start()

    def _write_machine(self, machine: int) -> None:
        """``OUT/machine``: this peer's machine id (the latest, after a rejoin), written atomically."""
        tmp = self.out_dir / "machine.tmp"
        tmp.write_text(f"{machine}\n")
        tmp.replace(self.out_dir / "machine")

    def _statuses(self, addresses: list[str]):
        """``(address, Status)`` of every peer that answers; a peer that refuses this one is fatal."""
        for address in addresses:
            try:
                yield address, self.transport.rpc(address, "Status", pb.StatusRequest(), 5)
            except grpc.RpcError as e:
                if e.code() == grpc.StatusCode.UNAUTHENTICATED:
                    raise _Fatal(f"{address} refused this peer: {e.details()}") from None

    def _wait_for_members(self, addresses: list[str], members: int) -> None:
        """Poll the peers' ``Status`` until one reports ``members`` members (or the join timeout).

        A peer far from its turn polls less often (50 ms per member still to come, at most 2 s), so
        that founders started together do not all call the founder 20 times a second while it
        admits them one by one.
        """
        deadline = time.monotonic() + self.options.join_timeout_s
        while not self._stop.is_set():
            behind = members
            for _, st in self._statuses(addresses):
                if st.members >= members:
                    return
                behind = min(behind, members - st.members)
            if time.monotonic() > deadline:
                raise _Fatal(f"no peer of {addresses} reported {members} members within {self.options.join_timeout_s}s")
            self._stop.wait(min(2.0, 0.05 * behind))

    def _resolve(self, addresses: list[str]) -> list[str]:
        """Addresses with every ``@PATH`` replaced by the address in that file (waited for)."""
        out = []
        deadline = time.monotonic() + self.options.join_timeout_s
        for a in addresses:
            if not a.startswith("@"):
                out.append(a)
                continue
            path = Path(a[1:])
            while not (path.exists() and path.read_text().strip()):
                if time.monotonic() > deadline or self._stop.is_set():
                    raise _Fatal(f"no address appeared in {path} within {self.options.join_timeout_s}s")
                time.sleep(0.1)
            out.append(path.read_text().strip())
        return out

    def _join_request(self) -> pb.JoinRequest:
        key = self.identity.public
        proof = _id.join_proof(self.secret, self.join_digest, self.address, key) if self.secret else b""
        return pb.JoinRequest(config_digest=self.join_digest, address=self.address, key=key, proof=proof)

    def _ask_to_join(self, addresses: list[str]) -> tuple[Any, str]:
        """Send ``Join`` through ``addresses`` (following redirects) until admitted: ``(answer, sponsor)``."""
        p = self.cfg.peers
        # The leader holds a Join until a decision admits the joiner (or releases it); no call
        # outlives the join timeout, which bounds the whole join.
        longest = self.options.forming_timeout_s + p.iteration_timeout_s + 4 * p.barrier_timeout_s
        deadline = time.monotonic() + self.options.join_timeout_s
        while True:
            if time.monotonic() > deadline or self._stop.is_set():
                raise _Fatal(f"could not join the run through {addresses} within {self.options.join_timeout_s}s")
            for first in addresses:
                address, hops = first, 0
                while hops < 8:
                    left = deadline - time.monotonic()
                    if left <= 0:
                        break
                    try:
                        resp = self.transport.rpc(address, "Join", self._join_request(), min(longest, left))
                    except grpc.RpcError as e:
                        details = e.details() or ""
                        if RUN_CONFIG_MARK in details:
                            theirs = json.loads(details.split(RUN_CONFIG_MARK, 1)[1])
                            raise _Fatal(
                                f"join refused by {address}: this peer's config differs from the run's in "
                                f"{config_differences(self.cfg, theirs)}; start it with the run's config"
                            ) from None
                        if e.code() in (grpc.StatusCode.FAILED_PRECONDITION, grpc.StatusCode.UNAUTHENTICATED):
                            raise _Fatal(f"join refused by {address}: {e.code().name}: {details}") from None
                        self.say(f"join via {address}: {e.code().name}: {e.details()}")
                        break
                    if resp.redirect:
                        address, hops = resp.redirect, hops + 1
                        continue
                    return resp, address
            if self._stop.wait(0.5):
                raise _Fatal("stopped while joining")

    def _join(self, addresses: list[str]) -> None:
        """Join through ``addresses``, download the state, replay the log, take part (retried on failure)."""
        self._warm_up()
        addresses = self._resolve(addresses)
        if self.options.join_at is not None and not self._st:
            self._wait_for_iteration(addresses, self.options.join_at)
        if self.options.join_members and not self._st:
            self._wait_for_members(addresses, self.options.join_members)
        deadline = time.monotonic() + self.options.join_timeout_s
        while True:
            answer, sponsor = self._ask_to_join(addresses)
            view = wire.view_from_pb(answer.view)
            with self._lock:
                self._pp = self._protocol_params(answer.run_id)
                self.incarnation += 1
                self._st = P.joined(
                    self._pp, me=answer.machine_id, view=view, now=time.monotonic(), chain=bytes(answer.chain)
                )
                self.machines.append(answer.machine_id)
            self._write_machine(answer.machine_id)
            self.say(
                f"joined run {answer.run_id} as machine {answer.machine_id} from iteration {view.iteration} via {sponsor}"
            )
            try:
                iteration, ready_view = self.transfer.catch_up(sponsor, view)
                self._step(P.on_ready, iteration=iteration, view=ready_view, chain=self._chain_at(iteration, view))
                break
            except (grpc.RpcError, P.Rejected, RuntimeError) as e:
                msg = f"{e.code().name}: {e.details()}" if isinstance(e, grpc.RpcError) else str(e)
                if time.monotonic() > deadline or self._stop.is_set():
                    raise _Fatal(f"could not catch up with the run: {msg}") from None
                self.say(f"catching up from {sponsor} failed ({msg}); joining again with a new identity")
                with self._lock:
                    self.incarnation += 1
                    self._st = None
                    self.identity = _id.Identity.generate()
                self.transfer.store.clear()
                self._stop.wait(0.5)
        self._warm_more(len(view.members))

    def _chain_at(self, iteration: int, view: P.View) -> bytes | None:
        """The chain digest of the decision of ``iteration - 1`` for :func:`P.on_ready`: the join
        answer's when the state is that of the joined view, else that of the log entry replayed last
        (None when the state came from a newer snapshot without it: learned from the next decision)."""
        if iteration == view.iteration:
            return None
        with self.transfer.store.lock:
            entry = self.transfer.store.log.get(iteration - 1)
        return P.chain_digest(entry.commit) if entry is not None else None

    def _wait_for_iteration(self, addresses: list[str], iteration: int) -> None:
        """Poll the peers' ``Status`` until one reports ``iteration`` (or finished, or the join timeout)."""
        deadline = time.monotonic() + self.options.join_timeout_s + self.options.forming_timeout_s
        while not self._stop.is_set():
            for address, st in self._statuses(addresses):
                if st.phase == P.DONE:
                    raise _Fatal(f"the run at {address} has finished (iteration {st.iteration}); nothing to join")
                if st.iteration >= iteration or st.phase == P.LEFT:
                    return
                deadline = max(deadline, time.monotonic() + self.options.join_timeout_s)
            if time.monotonic() > deadline:
                raise _Fatal(f"no peer of {addresses} reached iteration {iteration} in time")
            self._stop.wait(0.1)

    def apply(self, entry: P.LogEntry, *, catching_up: bool = False) -> None:
        """Apply a decided iteration: exact replay, digest, snapshot, metrics, checksum, evaluation."""
        c = entry.commit
        t = c.iteration
        if t < self.applied:
            return  # included in a snapshot loaded meanwhile
        if t > self.applied:
            raise RuntimeError(f"asked to apply iteration {t} but the parameters are at iteration {self.applied}")
        self.params, stats = self.worker.apply(self.params, t, c.contributors, entry.payloads, self.cfg.peers.clip)
        self._count_stats(stats)
        digest = _replay.checksum(self.params)
        self._updates.applied(entry, digest)
        n_total = sum(n for _, n in c.contributors)
        self._forward_passes += 2 * n_total
        store = self.transfer.store
        with store.lock:
            store.log[t] = entry
            store.digests[t + 1] = digest
            self.applied = t + 1
            pending = store.pending_checks.pop(t + 1, [])
        if (t + 1) % self.options.snapshot_every == 0:
            self.transfer.snapshot(t + 1, c.next_view, digest)
        for sender, address, theirs in pending:
            self.checksums.compare(t + 1, digest, sender, address, theirs)
        me = self._st.me if self._st is not None else None
        own = self._own_payload.pop(t, 0)
        self._payload_total += own
        now_s = time.monotonic()
        record: dict[str, Any] = {
            **self._row("train", t + 1, digest),
            "machine": me,
            "loss": self._losses.pop(t, None),
            "lr": self.worker.schedule(t),
            "step_time_s": now_s - self._last_apply,
            "payload_bytes": own,
            "peers": len(c.contributors),
            "members": len(c.next_view.members),
            "contributors": [m for m, _ in c.contributors],
            "gradients": n_total,
            "clipped": int(sum(s[3] for s in stats.values())),
            "catching_up": catching_up,
        }
        self._last_apply = now_s
        now = self.traffic.snapshot()
        for k in ("payload_sent", "payload_received", "wire_sent", "wire_received"):
            record[f"{k.split('_')[0]}_bytes_{k.split('_')[1]}"] = now[k] - self._last_traffic[k]
        record["wire_bytes"] = record["wire_bytes_sent"] + record["wire_bytes_received"]
        self._last_traffic = now
        record.update(self.counters)
        record.update(self.barrier.decided(t, contributors=[m for m, _ in c.contributors], me=me, now=now_s))
        record.update(self.barrier.totals)
        self._metrics.write(record)
        view = c.next_view
        if not catching_up and me is not None:
            ev = self.cfg.train.eval_every
            if view.leader() == me and (ev and (t + 1) % ev == 0):
                self.last_eval = {"step": t + 1, **self.worker.evaluate(self.params)}
                record.update(self.last_eval)  # for the progress line
                self._metrics.write({**self._row("eval", t + 1, digest), "machine": me, **self.last_eval})
            partner = P.checksum_partner(view, me, t + 1, self.cfg.peers.checksum_every)
            if partner is not None:
                self._submit(self.checksums.send, self.incarnation, t + 1, digest, partner, view.address_of(partner))
        ce = self.cfg.train.checkpoint_every
        if ce and (t + 1) % ce == 0 and not catching_up:
            self._checkpoint(t + 1, digest, "checkpoint_every")
        every = self.options.progress_every
        if every and (t + 1) % every == 0:
            loss = record["loss"]
            self.say(
                f"iteration {t + 1}/{self.iterations} peers {len(c.contributors)} "
                f"loss {'-' if loss is None else f'{loss:.4f}'} digest {digest[:12]}"
                + (f" accuracy {self.last_eval['eval_accuracy']:.4f}" if "eval_accuracy" in record else "")
            )
        if self.options.leave_at is not None and t + 1 >= self.options.leave_at and not catching_up:
            self.leave()

    def _row(self, kind: str, step: int, digest: str) -> dict[str, Any]:
        """The fields every metrics row has (:mod:`zeroth.train.metrics`, schema v1)."""
        return {
            "kind": kind,
            "step": step,
            "time_unix_s": time.time(),
            "wall_time_s": time.monotonic() - self.started,
            "digest": digest,
            "forward_passes": self._forward_passes,
            "payload_bytes_total": self._payload_total,
        }

    def _count_stats(self, stats: dict[int, tuple]) -> None:
        """Accumulate per-member statistics of the decoded projected gradients: count, sum |g|, max |g|, clipped."""
        for m, (n, total, top, clipped) in stats.items():
            s = self.member_stats.setdefault(m, {"count": 0, "sum_abs": 0.0, "max_abs": 0.0, "clipped": 0})
            s["count"] += int(n)
            s["sum_abs"] += float(total)
            s["max_abs"] = max(s["max_abs"], float(top))
            s["clipped"] += int(clipped)

    def _compute(self, eff: P.Compute) -> None:
        if eff.iteration != self.applied:
            return  # stale: the parameters moved on
        me = self._st.me
        count, payload, loss = self.worker.compute(self.params, me, eff.iteration, eff.deadline)
        self._losses[eff.iteration] = loss
        self._own_payload[eff.iteration] = len(payload)
        self.barrier.pushed(eff.iteration, count=count, now=time.monotonic())
        try:
            self._step(P.on_local_gradients, iteration=eff.iteration, count=count, payload=payload)
        except P.Rejected:
            pass  # no longer a member (dropped meanwhile)

    # ------------------------------------------------------------------ endings

    def _dropped(self, reason: str) -> None:
        self.say(f"dropped from the run: {reason}")
        if not self.options.rejoin or self.counters["rejoins"] >= self.options.max_rejoins:
            self.error = f"dropped: {reason}"
            self._save_final(self.error)
            self._finish("dropped")
            return
        with self._lock:
            self.counters["rejoins"] += 1
            addresses = [m.address for m in self._st.view.members if m.address != self.address]
            self.incarnation += 1
            self._st = None
            self.identity = _id.Identity.generate()  # a new member: a new id and a new key
        self.transfer.store.clear()  # what this incarnation held may have diverged: serve none of it
        for a in self._resolve(list(self.options.join)):
            if a not in addresses:
                addresses.append(a)
        self._join(addresses)

    def _failed(self, reason: str) -> None:
        self.error = reason
        where = self._save_final(reason)
        self.say(f"the run cannot go on: {reason}; state of iteration {self.applied} saved to {where}")
        self._finish("failed")

    def _checkpoint(self, iteration: int, digest: str, reason: str) -> Path:
        """Save the parameters at the start of ``iteration`` to ``OUT/checkpoints/<iteration>/`` (driver thread only).

        ``zeroth run --resume`` starts the founder of a new run from the newest one
        (:func:`zeroth.net.launch.newest_checkpoint`); the oldest beyond ``train.keep_checkpoints`` go.
        """
        root = self.out_dir / "checkpoints"
        where = save_state(
            root / str(iteration),
            self.params,
            iteration=iteration,
            run_id=self._pp.run_id,
            digest=digest,
            reason=reason,
        )
        keep = self.cfg.train.keep_checkpoints
        steps = sorted(int(p.name) for p in root.iterdir() if p.name.isdigit())
        for old in steps[:-keep] if keep else []:
            shutil.rmtree(root / str(old), ignore_errors=True)
        return where

    def checkpoint_now(self, reason: str, timeout: float = 10.0) -> Path | None:
        """Save a checkpoint of the iteration the driver is at, between two iterations (any thread).

        Returns its folder, or None when there is nothing to save yet (not started, still joining)
        or the driver did not get to it within ``timeout`` seconds.
        """
        if self.params is None or self._pp is None or self.phase != P.MEMBER:
            return None
        saved: list[Path] = []

        def save(params):
            digest = self.transfer.store.digest(self.applied) or _replay.checksum(params)
            saved.append(self._checkpoint(self.applied, digest, reason))
            return params

        fut: futures.Future = futures.Future()
        self._work.put((self.incarnation, _Call(save, fut)))
        try:
            fut.result(timeout)
        except futures.TimeoutError:
            return None
        return saved[0] if saved else None

    def _save_final(self, reason: str) -> Path | None:
        """Save the current state (to restart from with ``--resume``)."""
        if self.params is None or self._pp is None:
            return None
        digest = self.transfer.store.digest(self.applied) or _replay.checksum(self.params)
        return save_state(
            self.out_dir / "checkpoint",
            self.params,
            iteration=self.applied,
            run_id=self._pp.run_id,
            digest=digest,
            reason=reason,
        )

    def _finish(self, reason: str) -> None:
        if self._finished.is_set():
            return
        self.finish_reason = reason
        if reason == "done" and self.params is not None and self._pp is not None:
            self._checkpoint(
                self.applied, self.transfer.store.digest(self.applied) or _replay.checksum(self.params), "done"
            )
        if reason in ("done", "left") and self.params is not None:
            try:
                self.last_eval = {"step": self.applied, **self.worker.evaluate(self.params)}
                digest = self.transfer.store.digest(self.applied) or _replay.checksum(self.params)
                self._metrics.write(
                    {**self._row("eval", self.applied, digest), "machine": self.machine, **self.last_eval}
                )
            except Exception as e:  # noqa: BLE001
                self.say(f"final evaluation failed: {e!r}")
        self._write_summary()
        self.say(f"finished ({reason}) after iteration {self.applied}" + (f": {self.error}" if self.error else ""))
        self._finished.set()

    def summary(self) -> dict:
        """This peer's totals: machine ids, reason, iterations, digest, evaluation, counters, traffic, member statistics."""
        digest = self.transfer.store.digest(self.applied)
        members = {
            str(m): {
                "count": s["count"],
                "mean_abs": s["sum_abs"] / s["count"] if s["count"] else 0.0,
                "max_abs": s["max_abs"],
                "clipped": s["clipped"],
            }
            for m, s in sorted(self.member_stats.items())
        }
        return {
            "address": self.address,
            "machines": list(self.machines),
            "finish_reason": self.finish_reason,
            "error": self.error,
            "iterations": self.applied,
            "digest": digest,
            "eval": dict(self.last_eval),
            "forward_passes": self._forward_passes,
            "parameters": self.worker.d,
            "leaf_shapes": {leaf.path: list(leaf.shape) for leaf in _state.flatten(self.worker.template())[1]},
            "codec": self.worker.codec.name,
            "gradient_clip": self.cfg.peers.clip,
            "member_stats": members,
            **self.counters,
            **self.barrier.summary(),
            **self.traffic.snapshot(),
            "wall_time_s": time.monotonic() - self.started,
        }

    def _write_summary(self) -> None:
        path = self.out_dir / "summary.json"
        path.write_text(json.dumps(self.summary(), indent=2, sort_keys=True) + "\n")

    # ------------------------------------------------------------------ serving (called by zeroth.net.service)

    def status(self) -> dict:
        """``run_id, phase, machine, iteration, members, active`` (the ``Status`` reply)."""
        with self._lock:
            st = self._st
            return {
                "run_id": self._pp.run_id if self._pp is not None and st is not None else "",
                "phase": st.phase if st is not None else "joining",
                "machine": st.me if st is not None else -1,
                "iteration": st.it if st is not None else 0,
                "members": len(st.view.members) if st is not None else 0,
                "active": len(st.view.active_ids()) if st is not None else 0,
            }

    def status_view(self) -> P.View | None:
        """The view of the iteration this peer is at (None before it joined)."""
        with self._lock:
            return self._st.view if self._st is not None else None

    def refused(self, code: str) -> None:
        """Count a request refused as unauthenticated (forged or unsigned)."""
        if code == "UNAUTHENTICATED":
            with self._lock:
                self.counters["refused_requests"] += 1

    def authenticate(self, method: str, request) -> str | None:
        """Check a signed request (log, checksum, state): this run, a known member's key, a fresh
        sequence number. Returns the sender's address in the current view (None if it has none).

        Raises:
          Rejected: ``FAILED_PRECONDITION`` (other run), ``PERMISSION_DENIED`` (no such member),
            ``UNAUTHENTICATED`` (bad signature or a replay).
        """
        sender = int(request.sender)
        with self._lock:
            if self._pp is None or self._st is None:
                raise P.Rejected("UNAVAILABLE", "this peer has not joined a run yet")
            if request.run_id != self._pp.run_id:
                raise P.Rejected(
                    "FAILED_PRECONDITION",
                    f"run id {request.run_id[: P.MAX_RUN_ID]!r} is not this run's {self._pp.run_id!r}",
                )
            key = P.member_key(self._st, sender)
            address = self._st.view.address_of(sender)
        if not key:
            raise P.Rejected("PERMISSION_DENIED", f"machine {sender} is not a member of this run's recent views")
        if not request.HasField("auth") or not _id.verify(
            key, request_signed_bytes(method, request), request.auth.signature
        ):
            raise P.Rejected("UNAUTHENTICATED", f"{method} request is not signed by machine {sender}")
        if not self._replays.accept(self._pp.run_id, sender, int(request.auth.seq)):
            raise P.Rejected(
                "UNAUTHENTICATED",
                f"{method} request of machine {sender}: sequence number {request.auth.seq} was already used",
            )
        return address

    def handle_push(self, msg: P.Push) -> None:
        """A member's push; one for an iteration this peer already decided is counted as late
        (:meth:`BarrierCounters.late <zeroth.net.counters.BarrierCounters.late>`) unless it is refused for another reason."""
        with self._lock:
            late = is_late(self._st, msg.iteration)
            try:
                self._step(P.on_push, msg)
            except P.Rejected as e:
                if late and e.code == "FAILED_PRECONDITION":
                    self.barrier.late()
                raise
            if late:
                self.barrier.late()

    def handle_commit(self, msg: P.Commit, payloads=None, signatures=None, relays=(), first=0) -> P.CommitReply:
        """Whether this peer now holds the commit, and more (:func:`zeroth.net.protocol.on_commit`'s
        reply); ``payloads``, ``signatures``, ``relays`` and ``first``: those relayed with it."""
        return self._step(P.on_commit, msg, payloads=payloads, signatures=signatures, relays=relays, first=first)

    def handle_prepare(self, msg: P.Prepare) -> P.PrepareReply:
        """A takeover's prepare; one that says the leader is gone has the leader probed here first
        (:func:`zeroth.net.protocol.prepare_probe`: a refusal is recorded before the prepare is taken)."""
        with self._lock:
            probe = (
                None
                if self._st is None or self._pp is None
                else P.prepare_probe(self._pp, self._st, msg, time.monotonic())
            )
            inc = self.incarnation
        if probe is not None:
            self._probe(inc, probe)
        return self._step(P.on_prepare, msg)

    def handle_leave(self, msg: P.Leave) -> int:
        return self._step(P.on_leave, msg)

    def handle_join(self, request) -> tuple[str, P.JoinAnswer | P.Redirect]:
        """Check the joiner's proof of the run secret, queue the join and wait for its answer (or a redirect)."""
        address, digest, key = request.address, request.config_digest, bytes(request.key)
        if self.secret is not None and not _id.check_join_proof(
            self.secret, bytes(request.proof), digest, address, key
        ):
            raise P.Rejected(
                "UNAUTHENTICATED",
                "the join proof does not match this run's secret (start the peer with the run's --secret-file)",
            )
        if digest != self.join_digest:  # the joiner holds the secret: tell it which fields to fix
            raise P.Rejected(
                "FAILED_PRECONDITION",
                f"config digest {digest[:16]}... differs from this run's {self.join_digest[:16]}...; "
                f"{RUN_CONFIG_MARK}{json.dumps(config_fields(self.cfg), sort_keys=True, default=str)}",
            )
        self.transport.renew(address)  # it just called us: a channel it had may be in back-off
        fut: futures.Future = futures.Future()
        with self._lock:
            self._rid += 1
            rid = self._rid
            self._join_waiters[rid] = fut
            try:
                reply = self._step(P.on_join, P.JoinRequest(rid, address, digest, key))
            except P.Rejected:
                self._join_waiters.pop(rid, None)
                raise
            run_id = self._pp.run_id
        if isinstance(reply, P.Redirect):
            self._join_waiters.pop(rid, None)
            return run_id, reply
        p = self.cfg.peers
        try:
            return run_id, fut.result(
                timeout=self.options.forming_timeout_s + p.iteration_timeout_s + 4 * p.barrier_timeout_s
            )
        except futures.TimeoutError:
            with self._lock:
                self._join_waiters.pop(rid, None)
            raise P.Rejected("UNAVAILABLE", "the join was not decided in time (leader change?); retry") from None

    def handle_fetch_log(self, request) -> list[P.LogEntry]:
        self.authenticate("FetchLog", request)
        first, last = int(request.first_iteration), int(request.last_iteration)
        if last < first:
            raise P.Rejected("INVALID_ARGUMENT", f"last_iteration {last} is before first_iteration {first}")
        with self._lock:  # decided and handed to Apply, perhaps not applied yet: final all the same
            window = (
                {e.commit.iteration: e for e in P.log_entries(self._st, first, last)} if self._st is not None else {}
            )
        return self.transfer.store.entries(first, last, self.applied, window)

    def handle_checksum(self, request) -> bytes:
        address = self.authenticate("Checksum", request)
        return self.checksums.serve(int(request.sender), address, int(request.iteration), bytes(request.digest))

    def handle_manifest(self, request) -> tuple[_state.Snapshot, P.View, list[str]]:
        self.authenticate("GetManifest", request)
        return self.transfer.manifest()

    def handle_state(self, request):
        """Chunks ``(offset, bytes)`` of the snapshot of ``request.iteration``."""
        self.authenticate("FetchState", request)
        return self.transfer.chunks(int(request.iteration), int(request.offset), int(request.length))
