"""A Just One Byte peer process: the pure protocol (:mod:`zeroth.net.protocol`) driven by gRPC,
a timer and a :class:`zeroth.net.work.Worker`.

Threads of a :class:`Node`:

* gRPC server threads decode each request (:mod:`zeroth.net.service`), call the protocol under
  the node's lock and answer (or abort with the protocol's status);
* the *driver* runs, in order, what the protocol asks of the parameters: :class:`~P.Apply` a
  decided iteration (exact replay, digest, snapshot, metrics, checksum exchange, evaluation),
  :class:`~P.Compute` projected gradients, rejoin after :class:`~P.Dropped`, repair after a
  checksum mismatch, and joining itself (download the snapshot in chunks from several peers,
  replay the log since it, then take part);
* a ticker calls :func:`P.on_tick` every ``tick_s``;
* a pool sends messages (pushes, commits, takeover prepares, log fetches, checksums) and feeds
  the answers back to the protocol.

Accounting (:class:`Traffic`): payload bytes are the projected-gradient bytes of the pushes
(and of log entries) sent and received; wire bytes are every message sent and received, each its
serialized size plus the framing of :func:`zeroth.net.wire.wire_size`.

Checksums: after applying iteration ``t`` a member sends the SHA-256 of its whole state
(:func:`zeroth.replay.checksum`) to a rotating partner (:func:`P.checksum_partner`), every
``peers.checksum_every`` iterations; both sides compare (the partner as soon as it reaches the
same iteration). On a mismatch the peer asks the leader for its digest of that iteration; the
one that differs from the leader downloads the leader's snapshot and replays the log since
(:meth:`Node._repair`), and the mismatch is counted. It never happens in a correct run.

Example (one peer, in-process):
  >>> from zeroth.config import load_config_dict
  >>> cfg = load_config_dict({"train": {"steps": 3}, "peers": {"count": 1}})  # doctest: +SKIP
  >>> node = Node(cfg, NodeOptions(out_dir="/tmp/peer0"))                     # doctest: +SKIP
  >>> node.start(); node.wait(60)                                              # doctest: +SKIP
"""

from __future__ import annotations

import collections
import dataclasses
import json
import queue
import sys
import threading
import time
import uuid
from concurrent import futures
from pathlib import Path
from typing import Any, NamedTuple

import grpc
import jax
import jax.numpy as jnp

from zeroth import replay as _replay
from zeroth.config import Config, config_digest
from zeroth.net import protocol as P
from zeroth.net import security as _sec
from zeroth.net import service as _service
from zeroth.net import state as _state
from zeroth.net import wire
from zeroth.net.proto import peer_pb2 as pb
from zeroth.net.proto import peer_pb2_grpc as pb_grpc
from zeroth.net.work import Worker
from zeroth.train.metrics import MetricsWriter

__all__ = [
    "JOIN_DIGEST_EXCLUDE",
    "MAX_MESSAGE_BYTES",
    "MAX_LOG_ENTRIES",
    "join_digest",
    "Traffic",
    "NodeOptions",
    "Repair",
    "Node",
]

# Config fields that may differ between the peers of one run (deployment, not training).
JOIN_DIGEST_EXCLUDE = (
    "run.name",
    "run.out_dir",
    "peers.count",
    "peers.token",
    "peers.tls",
    "peers.host",
    "peers.base_port",
    "peers.join_at",
    "peers.kill_at",
)
MAX_MESSAGE_BYTES = _service.MAX_MESSAGE_BYTES
MAX_LOG_ENTRIES = 256  # per FetchLog reply


def join_digest(cfg: Config) -> str:
    """The digest joiners must present: the config without its deployment fields (:data:`JOIN_DIGEST_EXCLUDE`)."""
    return config_digest(cfg, exclude=JOIN_DIGEST_EXCLUDE)


class Traffic:
    """Thread-safe byte counters: payload and wire bytes sent and received, and messages."""

    FIELDS = ("payload_sent", "payload_received", "wire_sent", "wire_received", "messages_sent", "messages_received")

    def __init__(self):
        self._lock = threading.Lock()
        self._c = dict.fromkeys(self.FIELDS, 0)

    def sent(self, wire_bytes: int, payload: int = 0) -> None:
        with self._lock:
            self._c["wire_sent"] += wire_bytes
            self._c["payload_sent"] += payload
            self._c["messages_sent"] += 1

    def received(self, wire_bytes: int, payload: int = 0) -> None:
        with self._lock:
            self._c["wire_received"] += wire_bytes
            self._c["payload_received"] += payload
            self._c["messages_received"] += 1

    def snapshot(self) -> dict[str, int]:
        with self._lock:
            return dict(self._c)


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
      token: the shared token (None: none).
      tls: TLS files (None: plaintext).
      rejoin: rejoin automatically after being dropped (at most ``max_rejoins`` times).
      linger_s: keep serving this long after finishing (for the others' last checksums and fetches).
      snapshot_every: keep a snapshot of the parameters every this many iterations (the last two).
      chunk_bytes: bytes per streamed snapshot chunk.
      forming_timeout_s: the founder starts with whoever joined after this long.
      join_timeout_s: give up joining after this long.
      join_at: with ``join``: start up (and compile) at once, but join only once the run has
        reached this iteration (a peer of ``join`` reports it through ``Status``).
      leave_at: leave the run on purpose after applying this iteration (None: never).
      tick_s: timer period.
      log: print protocol notes and progress to stderr.
      progress_every: print a progress line every this many iterations (0: never).
    """

    out_dir: str
    listen: str = "127.0.0.1:0"
    advertise: str | None = None
    join: tuple[str, ...] = ()
    founders: int = 1
    token: str | None = None
    tls: _sec.TLSFiles | None = None
    rejoin: bool = True
    max_rejoins: int = 3
    linger_s: float = 2.0
    snapshot_every: int = 10
    chunk_bytes: int = 256 * 1024
    forming_timeout_s: float = 120.0
    join_timeout_s: float = 120.0
    join_at: int | None = None
    leave_at: int | None = None
    tick_s: float = 0.02
    log: bool = True
    progress_every: int = 0


class Repair(NamedTuple):
    """Driver work: our digest of ``iteration`` differed from machine ``other``'s."""

    iteration: int
    other: int
    other_address: str


class _Call(NamedTuple):
    """Driver work: run ``fn(params) -> params``."""

    fn: Any
    done: futures.Future


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
        self._metadata = _sec.token_metadata(options.token)
        self._lock = threading.RLock()
        self._data_lock = threading.Lock()
        self._st: P.PeerState | None = None
        self._pp: P.Params | None = None
        self._incarnation = 0
        self._work: queue.Queue = queue.Queue()
        self._pool = futures.ThreadPoolExecutor(max_workers=16, thread_name_prefix="zeroth-send")
        self._channels: dict[str, grpc.Channel] = {}
        self._join_waiters: dict[int, futures.Future] = {}
        self._rid = 0
        self._stop = threading.Event()
        self._finished = threading.Event()
        self.finish_reason: str | None = None
        self.error: str | None = None
        # Driver-owned state.
        self._params: Any = None
        self._applied = 0  # the parameters are the state at the start of this iteration
        self._losses: dict[int, float] = {}
        self._own_payload: dict[int, int] = {}
        self._forward_passes = 0
        self._last_traffic = self.traffic.snapshot()
        # Shared with server threads (under _data_lock).
        self._log: dict[int, P.LogEntry] = {}
        self._snapshots: collections.OrderedDict[int, _state.Snapshot] = collections.OrderedDict()
        self._digests: dict[int, str] = {}
        self._pending_checks: dict[int, list[tuple[int, str, str]]] = collections.defaultdict(list)
        self.counters = {"checksum_comparisons": 0, "checksum_mismatches": 0, "repairs": 0, "rejoins": 0}
        self.machines: list[int] = []
        self.last_eval: dict = {}
        self.started = time.monotonic()
        self._server: grpc.Server | None = None
        self.address = ""
        for stale in ("metrics.jsonl", "summary.json", "address"):  # a new process is a new peer
            (self.out_dir / stale).unlink(missing_ok=True)
        self._metrics = MetricsWriter(self.out_dir / "metrics.jsonl")
        self._threads: list[threading.Thread] = []
        self._warming: threading.Thread | None = None
        self._sources_used = 0

    # ------------------------------------------------------------------ lifecycle

    def start(self) -> str:
        """Serve, then found or join the run in the background; returns this peer's address."""
        self._server, port = _service.serve(self, self.options.listen, tls=self.options.tls, token=self.options.token)
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
        """Stop serving and every thread (without leaving the run: like a crash, but clean)."""
        self._stop.set()
        self._work.put((None, None))
        if self._server is not None:
            self._server.stop(grace)
        self._pool.shutdown(wait=False, cancel_futures=True)
        for ch in list(self._channels.values()):
            ch.close()
        self._metrics.close()

    def leave(self) -> None:
        """Leave the run: stop contributing; :meth:`wait` returns once a decision removed this peer."""
        with self._lock:
            if self._st is not None and self._st.phase == P.MEMBER and not self._st.leaving:
                step = P.request_leave(self._pp, self._st, time.monotonic())
                self._st = step.state
                self._dispatch(step.effects)
            elif self._st is None or self._st.phase != P.MEMBER:
                self._finish("left")

    def fail(self, reason: str) -> None:
        """Give up: record ``reason`` as the error and finish (``finish_reason == "failed"``)."""
        self.error = reason
        self._finish("failed")

    def call(self, fn) -> Any:
        """Run ``fn(params) -> params`` in the driver between two iterations and wait for it (inspection, edits)."""
        fut: futures.Future = futures.Future()
        self._work.put((self._incarnation, _Call(fn, fut)))
        return fut.result()

    @property
    def machine(self) -> int | None:
        with self._lock:
            return self._st.me if self._st is not None else None

    @property
    def phase(self) -> str:
        with self._lock:
            return self._st.phase if self._st is not None else "joining"

    @property
    def applied(self) -> int:
        """Iterations applied to this peer's parameters."""
        return self._applied

    def digests(self) -> dict[int, str]:
        """``{iteration: SHA-256 hex of the state at its start}`` held by this peer."""
        with self._data_lock:
            return dict(self._digests)

    # ------------------------------------------------------------------ protocol plumbing

    def _say(self, text: str) -> None:
        if self.options.log:
            m = self._st.me if self._st is not None else "-"
            print(f"[peer {m} {time.monotonic() - self.started:7.2f}s] {text}", file=sys.stderr, flush=True)

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
            payload_check=self.worker.check_payload,
        )

    def _step(self, fn, *args, **kwargs):
        """Run a protocol handler on the current state under the lock; dispatch its effects; return its reply."""
        with self._lock:
            if self._st is None or self._pp is None:
                raise P.Rejected("UNAVAILABLE", "this peer has not joined a run yet")
            step = fn(self._pp, self._st, *args, now=time.monotonic(), **kwargs)
            self._st = step.state
            self._dispatch(step.effects)
            return step.reply

    def _dispatch(self, effects) -> None:
        inc = self._incarnation
        for eff in effects:
            if isinstance(eff, P.Send):
                self._submit(self._send, inc, eff)
            elif isinstance(eff, P.Fetch):
                self._submit(self._fetch, inc, eff)
            elif isinstance(eff, P.Admit):
                fut = self._join_waiters.pop(eff.request_id, None)
                if fut is not None and not fut.done():
                    fut.set_result(eff.answer)
            elif isinstance(eff, P.Note):
                self._say(eff.text)
            else:  # Apply, Compute, Dropped, Finished: in order, in the driver
                self._work.put((inc, eff))

    def _submit(self, fn, *args) -> None:
        try:
            self._pool.submit(fn, *args)
        except RuntimeError:  # the pool is shut down: we are stopping
            pass

    def _event(self, inc: int, fn, **kwargs) -> None:
        """Feed an answer back to the protocol if it still concerns the current incarnation."""
        with self._lock:
            if inc != self._incarnation or self._st is None:
                return
            try:
                self._step(fn, **kwargs)
            except P.Rejected as e:
                self._say(f"{fn.__name__}: {e.message}")

    def _channel(self, address: str) -> grpc.Channel:
        with self._lock:
            ch = self._channels.get(address)
            if ch is None:
                opts = [
                    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
                    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
                ]
                if self.options.tls is not None:
                    ch = grpc.secure_channel(address, _sec.channel_credentials(self.options.tls), options=opts)
                else:
                    ch = grpc.insecure_channel(address, options=opts)
                self._channels[address] = ch
            return ch

    def _rpc(self, address: str, method: str, request, timeout: float, payload: int = 0):
        """One unary call with accounting; raises ``grpc.RpcError``."""
        stub = pb_grpc.PeerStub(self._channel(address))
        try:
            response = getattr(stub, method)(request, timeout=timeout, metadata=self._metadata)
        except grpc.RpcError as e:
            if e.code() != grpc.StatusCode.UNAVAILABLE:
                self.traffic.sent(wire.wire_size(request, kind="request", token=self.options.token), payload)
                self.traffic.received(wire.RESPONSE_OVERHEAD)
            raise
        self.traffic.sent(wire.wire_size(request, kind="request", token=self.options.token), payload)
        self.traffic.received(wire.wire_size(response, kind="response"), _service.response_payload(response))
        return response

    def _send(self, inc: int, eff: P.Send) -> None:
        msg = eff.message
        b = self.cfg.peers.barrier_timeout_s
        try:
            if isinstance(msg, P.Push):
                self._rpc(eff.address, "PushGradients", wire.push_to_pb(msg), b, payload=len(msg.payload))
            elif isinstance(msg, P.Commit):
                request = wire.commit_to_pb(msg)
                for attempt in range(3):
                    try:
                        self._rpc(eff.address, "CommitIteration", request, b)
                        break
                    except grpc.RpcError as e:
                        if attempt == 2 or e.code() not in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED):
                            raise
                        time.sleep(0.05 * (attempt + 1))
                self._event(inc, P.on_commit_acked, iteration=msg.iteration, machine=eff.machine)
            elif isinstance(msg, P.Prepare):
                reply = self._rpc(eff.address, "Prepare", wire.prepare_to_pb(msg), b)
                try:
                    decoded = wire.prepare_reply_from_pb(reply)
                except P.Rejected as e:
                    self._say(f"bad prepare reply from machine {eff.machine}: {e.message}")
                    decoded = None
                self._event(inc, P.on_prepare_reply, sender=eff.machine, reply=decoded)
            elif isinstance(msg, P.Leave):
                self._rpc(eff.address, "Leave", wire.leave_to_pb(msg), b)
        except grpc.RpcError as e:
            code, details = e.code(), e.details()
            if isinstance(msg, P.Commit):
                self._event(inc, P.on_commit_failed, iteration=msg.iteration, machine=eff.machine, message=f"{code.name}: {details}")
            elif isinstance(msg, P.Prepare):
                if code == grpc.StatusCode.FAILED_PRECONDITION:
                    self._event(inc, P.on_prepare_rejected, sender=eff.machine, message=details or "")
                else:
                    self._event(inc, P.on_prepare_reply, sender=eff.machine, reply=None)

    def _fetch(self, inc: int, eff: P.Fetch) -> None:
        try:
            entries = self._fetch_log(eff.address, eff.first, eff.last)
        except (grpc.RpcError, P.Rejected) as e:
            msg = e.message if isinstance(e, P.Rejected) else f"{e.code().name}: {e.details()}"
            self._event(inc, P.on_fetch_failed, message=msg)
            return
        with self._lock:
            if inc != self._incarnation or self._st is None:
                return
            try:
                self._step(P.on_fetched, entries)
            except P.Rejected as e:
                self._step(P.on_fetch_failed, message=e.message)

    def _fetch_log(self, address: str, first: int, last: int) -> list[P.LogEntry]:
        """Decided iterations ``first..last`` from ``address`` (paged)."""
        out: list[P.LogEntry] = []
        t = first
        while t <= last:
            req = pb.FetchLogRequest(run_id=self._pp.run_id, sender=self._st.me, first_iteration=t, last_iteration=last)
            reply = self._rpc(address, "FetchLog", req, 2 * self.cfg.peers.barrier_timeout_s + 5)
            got = [wire.entry_from_pb(e) for e in reply.entries]
            if not got:
                break
            for e in got:
                if e.commit.iteration != t:
                    raise P.Rejected("INVALID_ARGUMENT", f"log reply skipped from iteration {t} to {e.commit.iteration}")
                out.append(e)
                t += 1
        return out

    def _tick(self) -> None:
        while not self._stop.wait(self.options.tick_s):
            with self._lock:
                if self._st is None or self._st.phase not in (P.FORMING, P.MEMBER):
                    continue
                try:
                    self._step(P.on_tick)
                except Exception as e:  # noqa: BLE001  (a tick must never kill the peer)
                    self._say(f"tick failed: {e!r}")

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
                        self._params = eff.fn(self._params)
                        eff.done.set_result(None)
                    except Exception as e:  # noqa: BLE001
                        eff.done.set_exception(e)
                    continue
                if inc != self._incarnation:
                    continue
                if isinstance(eff, P.Apply):
                    self._apply(eff.entry)
                elif isinstance(eff, P.Compute):
                    self._compute(eff)
                elif isinstance(eff, Repair):
                    self._repair(eff)
                elif isinstance(eff, P.Dropped):
                    self._dropped(eff.reason)
                elif isinstance(eff, P.Finished):
                    self._finish(eff.reason)
        except Exception as e:  # noqa: BLE001
            import traceback

            self.error = f"{type(e).__name__}: {e}"
            traceback.print_exc()
            self._finish("failed")

    def _found(self) -> None:
        params = self.worker.initial_params()
        self.worker.warm_up(max(1, self.options.founders))
        run_id = f"{self.cfg.run.name}-{uuid.uuid4().hex[:12]}"
        self._pp = self._protocol_params(run_id)
        self._load(params, 0, None)
        with self._lock:
            self._incarnation += 1
            step = P.founder(self._pp, address=self.address, now=time.monotonic())
            self._st = step.state
            self.machines.append(0)
            self._say(f"founded run {run_id} at {self.address}; waiting for {self.options.founders} founders")
            self._dispatch(step.effects)
        self._warm_more(self.options.founders)

    def _warm_more(self, members: int) -> None:
        """Compile, in the background, the replay lengths a change of membership would need (and the evaluation)."""
        if self._warming is None:
            self._warming = threading.Thread(target=self.worker.warm_up_more, args=(members,), daemon=True, name="zeroth-warm")
            self._warming.start()

    def _load(self, params, iteration: int, view: P.View | None) -> None:
        """Install parameters that are the state at the start of ``iteration``."""
        self._params = jax.tree_util.tree_map(lambda x: jnp.array(x, copy=True), params)
        self._applied = iteration
        digest = _replay.checksum(self._params)
        with self._data_lock:
            self._digests[iteration] = digest
        self._snapshot(iteration, view, digest)

    def _snapshot(self, iteration: int, view: P.View | None, digest: str) -> None:
        blob, leaves = _state.flatten(self._params)
        with self._data_lock:
            self._snapshots[iteration] = _state.Snapshot(iteration, view, digest, blob, leaves)
            while len(self._snapshots) > 2:
                self._snapshots.popitem(last=False)
            oldest = next(iter(self._snapshots))
            for t in [t for t in self._log if t < oldest]:
                del self._log[t]
            for t in [t for t in self._digests if t < iteration - 512]:
                del self._digests[t]

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
                    raise RuntimeError(f"no address appeared in {path} within {self.options.join_timeout_s}s")
                time.sleep(0.1)
            out.append(path.read_text().strip())
        return out

    def _join(self, addresses: list[str]) -> None:
        """Join through ``addresses`` (following redirects), download the state, replay the log, take part."""
        self.worker.warm_up(max(1, self.options.founders))
        addresses = self._resolve(addresses)
        p = self.cfg.peers
        timeout = self.options.forming_timeout_s + p.iteration_timeout_s + 4 * p.barrier_timeout_s
        if self.options.join_at is not None and not self._st:
            self._wait_for_iteration(addresses, self.options.join_at)
        deadline = time.monotonic() + self.options.join_timeout_s
        answer = sponsor = None
        while answer is None:
            if time.monotonic() > deadline or self._stop.is_set():
                raise RuntimeError(f"could not join the run through {addresses} within {self.options.join_timeout_s}s")
            for first in addresses:
                address, hops = first, 0
                while hops < 8:
                    req = pb.JoinRequest(config_digest=self.join_digest, address=self.address)
                    try:
                        resp = self._rpc(address, "Join", req, timeout)
                    except grpc.RpcError as e:
                        if e.code() in (grpc.StatusCode.FAILED_PRECONDITION, grpc.StatusCode.UNAUTHENTICATED):
                            raise RuntimeError(f"join refused by {address}: {e.code().name}: {e.details()}") from None
                        self._say(f"join via {address}: {e.code().name}: {e.details()}")
                        break
                    if resp.redirect:
                        address, hops = resp.redirect, hops + 1
                        continue
                    answer, sponsor = resp, address
                    break
                if answer is not None:
                    break
            if answer is None:
                time.sleep(0.5)
        view = wire.view_from_pb(answer.view)
        with self._lock:
            self._pp = self._protocol_params(answer.run_id)
            self._incarnation += 1
            self._st = P.joined(self._pp, me=answer.machine_id, view=view, now=time.monotonic())
            self.machines.append(answer.machine_id)
        self._say(f"joined run {answer.run_id} as machine {answer.machine_id} from iteration {view.iteration} via {sponsor}")
        iteration, ready_view = self._catch_up(sponsor, view)
        self._step(P.on_ready, iteration=iteration, view=ready_view)
        self._warm_more(len(view.members))

    def _wait_for_iteration(self, addresses: list[str], iteration: int) -> None:
        """Poll the peers' ``Status`` until one reports ``iteration`` (or finished, or the join timeout)."""
        deadline = time.monotonic() + self.options.join_timeout_s + self.options.forming_timeout_s
        while not self._stop.is_set():
            for address in addresses:
                try:
                    st = self._rpc(address, "Status", pb.StatusRequest(), 5)
                except grpc.RpcError:
                    continue
                if st.iteration >= iteration or st.phase in (P.DONE, P.LEFT):
                    return
                deadline = max(deadline, time.monotonic() + self.options.join_timeout_s)
            if time.monotonic() > deadline:
                raise RuntimeError(f"no peer of {addresses} reached iteration {iteration} in time")
            time.sleep(0.1)

    def _catch_up(self, sponsor: str, view: P.View, *, target: int | None = None) -> tuple[int, P.View]:
        """Download the sponsor's newest snapshot (in chunks, from several peers) and replay the log up to ``view.iteration``."""
        me = self._st.me
        manifest = self._rpc(sponsor, "GetManifest", pb.ManifestRequest(run_id=self._pp.run_id, sender=me), 30)
        leaves = tuple(_state.Leaf(lf.path, lf.dtype, tuple(lf.shape), lf.offset, lf.nbytes) for lf in manifest.leaves)
        blob = self._download(sponsor, manifest)
        params = _state.unflatten(self.worker.template(), blob, leaves)
        digest = _replay.checksum(params)
        if digest != manifest.digest.hex():
            raise RuntimeError(f"downloaded snapshot of iteration {manifest.iteration} has digest {digest[:16]}, expected {manifest.digest.hex()[:16]}")
        mview = wire.view_from_pb(manifest.view)
        self._load(params, int(manifest.iteration), mview)
        self._say(
            f"loaded snapshot of iteration {manifest.iteration} ({len(blob)} bytes in chunks from "
            f"{self._sources_used} peer(s), digest {digest[:12]})"
        )
        goal = view.iteration if target is None else target
        deadline = time.monotonic() + 4 * self.cfg.peers.barrier_timeout_s
        while self._applied < goal:
            for e in self._fetch_log(sponsor, self._applied, goal - 1):
                self._apply(e, catching_up=True)
            if self._applied < goal:
                if time.monotonic() > deadline:
                    raise RuntimeError(f"the log from {sponsor} stops at iteration {self._applied}, short of {goal}")
                time.sleep(0.05)
        if self._applied > view.iteration:
            return self._applied, self._view_at(self._applied, mview)
        return view.iteration, view

    def _view_at(self, iteration: int, fallback: P.View) -> P.View:
        with self._data_lock:
            entry = self._log.get(iteration - 1)
        return entry.commit.next_view if entry is not None else fallback

    def _download(self, sponsor: str, manifest) -> bytes:
        """The snapshot's bytes: one range per source, in parallel; a failed range is fetched from the sponsor."""
        total = int(manifest.total_bytes)
        sources = [sponsor] + [s for s in manifest.sources if s != sponsor and s != self.address]
        chunk = self.options.chunk_bytes
        n_ranges = max(1, min(len(sources), -(-total // chunk)))
        per = -(-total // n_ranges)
        ranges = [(i * per, min(per, total - i * per)) for i in range(n_ranges) if i * per < total]
        buf = bytearray(total)

        def fetch(src: str, offset: int, length: int) -> None:
            req = pb.StateRequest(run_id=self._pp.run_id, sender=self._st.me, iteration=manifest.iteration, offset=offset, length=length)
            stub = pb_grpc.PeerStub(self._channel(src))
            self.traffic.sent(wire.wire_size(req, kind="request", token=self.options.token))
            got = 0
            for i, ch in enumerate(stub.FetchState(req, timeout=120, metadata=self._metadata)):
                self.traffic.received(wire.wire_size(ch, kind="response" if i == 0 else "stream"))
                if ch.offset != offset + got or got + len(ch.data) > length:
                    raise RuntimeError(f"state chunk from {src} at offset {ch.offset} does not continue {offset + got}")
                buf[ch.offset : ch.offset + len(ch.data)] = ch.data
                got += len(ch.data)
            if got != length:
                raise RuntimeError(f"state range {offset}+{length} from {src} ended after {got} bytes")

        def fetch_with_fallback(i: int, offset: int, length: int) -> None:
            src = sources[i % len(sources)]
            try:
                fetch(src, offset, length)
            except (grpc.RpcError, RuntimeError) as e:
                if src == sponsor:
                    raise
                self._say(f"state range {offset}+{length} from {src} failed ({e}); using {sponsor}")
                fetch(sponsor, offset, length)

        with futures.ThreadPoolExecutor(max_workers=len(ranges)) as ex:
            list(ex.map(lambda a: fetch_with_fallback(*a), [(i, o, n) for i, (o, n) in enumerate(ranges)]))
        self._sources_used = len(ranges)
        return bytes(buf)

    def _apply(self, entry: P.LogEntry, *, catching_up: bool = False) -> None:
        c = entry.commit
        t = c.iteration
        if t < self._applied:
            return  # included in a snapshot loaded meanwhile
        if t > self._applied:
            raise RuntimeError(f"asked to apply iteration {t} but the parameters are at iteration {self._applied}")
        self._params = self.worker.apply(self._params, t, c.contributors, entry.payloads)
        digest = _replay.checksum(self._params)
        n_total = sum(n for _, n in c.contributors)
        self._forward_passes += 2 * n_total
        with self._data_lock:
            self._log[t] = entry
            self._digests[t + 1] = digest
            self._applied = t + 1
            pending = self._pending_checks.pop(t + 1, [])
        if (t + 1) % self.options.snapshot_every == 0:
            self._snapshot(t + 1, c.next_view, digest)
        for sender, address, theirs in pending:
            self._compare(t + 1, digest, sender, address, theirs)
        me = self._st.me if self._st is not None else None
        record: dict[str, Any] = {
            "kind": "iteration",
            "iteration": t,
            "step": t + 1,
            "machine": me,
            "digest": digest,
            "loss": self._losses.pop(t, None),
            "peers": len(c.contributors),
            "members": len(c.next_view.members),
            "contributors": [m for m, _ in c.contributors],
            "gradients": n_total,
            "forward_passes": self._forward_passes,
            "payload_bytes": self._own_payload.pop(t, 0),
            "catching_up": catching_up,
        }
        now = self.traffic.snapshot()
        for k in ("payload_sent", "payload_received", "wire_sent", "wire_received"):
            record[f"{k.split('_')[0]}_bytes_{k.split('_')[1]}"] = now[k] - self._last_traffic[k]
        record["wire_bytes"] = record["wire_bytes_sent"] + record["wire_bytes_received"]
        self._last_traffic = now
        record.update(self.counters)
        record["wall_time"] = time.monotonic() - self.started
        view = c.next_view
        if not catching_up and me is not None:
            ev = self.cfg.train.eval_every
            if view.leader() == me and (ev and (t + 1) % ev == 0):
                self.last_eval = {"step": t + 1, **self.worker.evaluate(self._params)}
                record.update(self.last_eval)
                self._metrics.write({"kind": "eval", "iteration": t, "step": t + 1, "machine": me, **self.last_eval})
            partner = P.checksum_partner(view, me, t + 1, self.cfg.peers.checksum_every)
            if partner is not None:
                self._submit(self._checksum, self._incarnation, t + 1, digest, partner, view.address_of(partner))
        self._metrics.write(record)
        every = self.options.progress_every
        if every and (t + 1) % every == 0:
            loss = record["loss"]
            self._say(
                f"iteration {t + 1}/{self.iterations} peers {len(c.contributors)} "
                f"loss {'-' if loss is None else f'{loss:.4f}'} digest {digest[:12]}"
                + (f" accuracy {self.last_eval['eval_accuracy']:.4f}" if "eval_accuracy" in record else "")
            )
        if self.options.leave_at is not None and t + 1 >= self.options.leave_at and not catching_up:
            self.leave()

    def _compute(self, eff: P.Compute) -> None:
        if eff.iteration != self._applied:
            return  # stale: the parameters moved on
        me = self._st.me
        count, payload, loss = self.worker.compute(self._params, me, eff.iteration, eff.deadline)
        self._losses[eff.iteration] = loss
        self._own_payload[eff.iteration] = len(payload)
        self._step(P.on_local_gradients, iteration=eff.iteration, count=count, payload=payload)

    # ------------------------------------------------------------------ checksums and repair

    def _checksum(self, inc: int, iteration: int, digest: str, partner: int, address: str) -> None:
        req = pb.ChecksumRequest(run_id=self._pp.run_id, sender=self._st.me, iteration=iteration, digest=bytes.fromhex(digest))
        try:
            reply = self._rpc(address, "Checksum", req, self.cfg.peers.barrier_timeout_s)
        except grpc.RpcError:
            return
        if reply.digest and inc == self._incarnation:
            self._compare(iteration, digest, partner, address, reply.digest.hex())

    def _compare(self, iteration: int, mine: str, other: int, address: str, theirs: str) -> None:
        with self._lock:
            self.counters["checksum_comparisons"] += 1
            if mine == theirs:
                return
            self.counters["checksum_mismatches"] += 1
        self._say(f"CHECKSUM MISMATCH at iteration {iteration}: mine {mine[:16]}, machine {other}'s {theirs[:16]}")
        self._work.put((self._incarnation, Repair(iteration, other, address)))

    def _repair(self, rep: Repair) -> None:
        """Settle a mismatch against the leader: the one that differs from it reloads the leader's state."""
        with self._lock:
            if self._st is None or self._st.phase != P.MEMBER:
                return
            view, me = self._st.view, self._st.me
        leader = view.leader()
        with self._data_lock:
            mine = self._digests.get(rep.iteration)
        if leader is None or mine is None:
            return
        if leader != me:
            address = view.address_of(leader)
            try:
                reply = self._rpc(
                    address, "Checksum", pb.ChecksumRequest(run_id=self._pp.run_id, sender=me, iteration=rep.iteration), 10
                )
            except grpc.RpcError as e:
                self._say(f"repair: the leader did not answer ({e.code().name})")
                return
            if reply.digest and reply.digest.hex() != mine:
                self._say(f"repair: reloading the state of machine {leader} (ours differs at iteration {rep.iteration})")
                self._reload(address)
                return
            if not reply.digest:
                return
        # We agree with the leader: tell the other peer, which will settle it with the leader.
        if rep.other != me:
            try:
                self._rpc(
                    rep.other_address,
                    "Checksum",
                    pb.ChecksumRequest(run_id=self._pp.run_id, sender=me, iteration=rep.iteration, digest=bytes.fromhex(mine)),
                    10,
                )
            except grpc.RpcError:
                pass

    def _reload(self, address: str) -> None:
        target = self._applied
        with self._lock:
            view = self._st.view
        self._catch_up(address, view._replace(iteration=target), target=target)
        with self._lock:
            self.counters["repairs"] += 1
        with self._data_lock:
            mine = self._digests.get(self._applied)
        self._say(f"repair done: state of iteration {self._applied} reloaded, digest {str(mine)[:16]}")

    # ------------------------------------------------------------------ endings

    def _dropped(self, reason: str) -> None:
        self._say(f"dropped from the run: {reason}")
        if not self.options.rejoin or self.counters["rejoins"] >= self.options.max_rejoins:
            self.error = f"dropped: {reason}"
            self._finish("dropped")
            return
        with self._lock:
            self.counters["rejoins"] += 1
            addresses = [m.address for m in self._st.view.members if m.address != self.address]
            self._incarnation += 1
            self._st = None
        with self._data_lock:  # what this incarnation held may have diverged: serve none of it
            self._snapshots.clear()
            self._log.clear()
            self._digests.clear()
            self._pending_checks.clear()
        for a in self._resolve(list(self.options.join)):
            if a not in addresses:
                addresses.append(a)
        self._join(addresses)

    def _finish(self, reason: str) -> None:
        if self._finished.is_set():
            return
        self.finish_reason = reason
        if reason in ("done", "left") and self._params is not None:
            try:
                self.last_eval = {"step": self._applied, **self.worker.evaluate(self._params)}
                self._metrics.write({"kind": "eval", "step": self._applied, "machine": self.machine, **self.last_eval})
            except Exception as e:  # noqa: BLE001
                self._say(f"final evaluation failed: {e!r}")
        self._write_summary()
        self._say(f"finished ({reason}) after iteration {self._applied}")
        self._finished.set()

    def summary(self) -> dict:
        """This peer's totals: machine ids, reason, iterations, digest, evaluation, counters, traffic."""
        with self._data_lock:
            digest = self._digests.get(self._applied)
        return {
            "address": self.address,
            "machines": list(self.machines),
            "finish_reason": self.finish_reason,
            "error": self.error,
            "iterations": self._applied,
            "digest": digest,
            "eval": dict(self.last_eval),
            "forward_passes": self._forward_passes,
            "parameters": self.worker.d,
            "leaf_shapes": {leaf.path: list(leaf.shape) for leaf in self._layout()},
            "codec": self.worker.codec.name,
            **self.counters,
            **self.traffic.snapshot(),
            "wall_time": time.monotonic() - self.started,
        }

    def _layout(self):
        return _state.flatten(self.worker.template())[1]

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

    def check_run(self, run_id: str) -> None:
        with self._lock:
            if self._pp is None:
                raise P.Rejected("UNAVAILABLE", "this peer has not joined a run yet")
            if run_id != self._pp.run_id:
                raise P.Rejected("FAILED_PRECONDITION", f"run id {run_id[:P.MAX_RUN_ID]!r} is not this run's {self._pp.run_id!r}")

    def check_sender(self, sender: int) -> None:
        """A state or log request must come from a member of the current view."""
        with self._lock:
            if self._st is None or sender not in self._st.view.ids():
                raise P.Rejected("PERMISSION_DENIED", f"machine {sender} is not a member of this run's current view")

    def handle_push(self, msg: P.Push) -> None:
        self._step(P.on_push, msg)

    def handle_commit(self, msg: P.Commit) -> None:
        self._step(P.on_commit, msg)

    def handle_prepare(self, msg: P.Prepare) -> P.PrepareReply:
        return self._step(P.on_prepare, msg)

    def handle_leave(self, msg: P.Leave) -> int:
        return self._step(P.on_leave, msg)

    def handle_join(self, address: str, digest: str) -> tuple[str, P.JoinAnswer | P.Redirect]:
        """Queue a join and wait for its answer (or a redirect); returns ``(run_id, answer)``."""
        fut: futures.Future = futures.Future()
        with self._lock:
            self._rid += 1
            rid = self._rid
            self._join_waiters[rid] = fut
            try:
                reply = self._step(P.on_join, P.JoinRequest(rid, address, digest))
            except P.Rejected:
                self._join_waiters.pop(rid, None)
                raise
            run_id = self._pp.run_id
        if isinstance(reply, P.Redirect):
            self._join_waiters.pop(rid, None)
            return run_id, reply
        p = self.cfg.peers
        try:
            return run_id, fut.result(timeout=self.options.forming_timeout_s + p.iteration_timeout_s + 4 * p.barrier_timeout_s)
        except futures.TimeoutError:
            with self._lock:
                self._join_waiters.pop(rid, None)
            raise P.Rejected("UNAVAILABLE", "the join was not decided in time (leader change?); retry") from None

    def handle_fetch_log(self, sender: int, first: int, last: int) -> list[P.LogEntry]:
        self.check_sender(sender)
        if last < first:
            raise P.Rejected("INVALID_ARGUMENT", f"last_iteration {last} is before first_iteration {first}")
        with self._lock:  # decided and handed to Apply, perhaps not applied yet: final all the same
            window = {e.commit.iteration: e for e in P.log_entries(self._st, first, last)} if self._st is not None else {}
        with self._data_lock:
            if first < self._applied and first not in self._log and first not in window:
                start = min(self._log) if self._log else self._applied
                raise P.Rejected("NOT_FOUND", f"this peer's log starts at iteration {start}; iteration {first} is gone")
            out, size = [], 0
            for t in range(first, min(last, first + MAX_LOG_ENTRIES - 1) + 1):
                e = self._log.get(t) or window.get(t)
                if e is None:
                    break
                size += sum(len(p) for p in e.payloads) + 128 * (len(e.commit.contributors) + len(e.commit.next_view.members))
                if out and size > MAX_MESSAGE_BYTES // 2:
                    break
                out.append(e)
        return out

    def handle_checksum(self, sender: int, iteration: int, digest: bytes) -> bytes:
        """Our digest of ``iteration`` (empty if not held); compares with ``digest`` when given."""
        if digest and len(digest) != 32:
            raise P.Rejected("INVALID_ARGUMENT", f"digest must be 32 bytes (SHA-256), got {len(digest)}")
        with self._lock:
            if self._st is None:
                raise P.Rejected("UNAVAILABLE", "this peer has not joined a run yet")
            address = self._st.view.address_of(sender)
        with self._data_lock:
            mine = self._digests.get(iteration)
            if digest and mine is None and iteration >= self._applied and address is not None:
                if iteration <= self._applied + 64 and len(self._pending_checks[iteration]) < 64:
                    self._pending_checks[iteration].append((sender, address, digest.hex()))
        if digest and mine is not None and address is not None:
            self._compare(iteration, mine, sender, address, digest.hex())
        return bytes.fromhex(mine) if mine else b""

    def handle_manifest(self, sender: int) -> tuple[_state.Snapshot, P.View, list[str]]:
        self.check_sender(sender)
        with self._data_lock:
            if not self._snapshots:
                raise P.Rejected("UNAVAILABLE", "no snapshot yet")
            snap = next(reversed(self._snapshots.values()))
        with self._lock:
            view = snap.view if snap.view is not None else self._st.view
            sources = [m.address for m in self._st.view.members if m.active and m.address != self.address]
        return snap, view, [self.address] + sources

    def handle_state(self, sender: int, iteration: int, offset: int, length: int):
        """Chunks ``(offset, bytes)`` of the snapshot of ``iteration``."""
        self.check_sender(sender)
        with self._data_lock:
            snap = self._snapshots.get(iteration)
        if snap is None:
            raise P.Rejected("NOT_FOUND", f"no snapshot of iteration {iteration} here (held: {list(self._snapshots)})")
        total = len(snap.blob)
        if offset > total or length > total - offset:
            raise P.Rejected("OUT_OF_RANGE", f"range {offset}+{length} is outside the snapshot's {total} bytes")
        chunk = self.options.chunk_bytes
        out = []
        for start in range(offset, offset + length, chunk):
            out.append((start, snap.blob[start : min(start + chunk, offset + length)]))
        return out

