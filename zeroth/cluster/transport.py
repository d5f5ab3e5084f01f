"""A node's gRPC transport: its server, one paced stream per receiver, the ring exchange, backups.

Every node serves ``ClusterNode.Deliver`` (``protos/zeroth/v1/cluster.proto``) behind the run's
access token (:func:`zeroth.transport.guard.make_server`). To send, a node opens one
client stream per receiver, fed by a :class:`zeroth.transport.pacing.Pacer` at the pair's
bandwidth ``min(b_sender, b_receiver)`` and latency ``base + l_sender + l_receiver`` (each node's
access latency): the emulation acts on the bytes sent.

Messages are addressed to **slots** ``(cluster, stage)``, not to processes. A slot has a primary
and possibly a backup (seed 003 §3.5: a new node shadows the least reliable node of a cluster):

* every message for a slot goes to its primary *and* a copy to its backup ("an extra pair of
  channels that shares a copy of the forward/backward traffic"), ring messages included, so the
  backup runs the same computation on the same inputs as its primary;
* a backup that arrives later (``join_round``) gets, after that averaging round, its primary's
  whole state (parameters, optimizer, stashed batches in flight, waiting messages, what it has
  seen: :meth:`ClusterTransport.attach`), and from then on the primary relays it every message
  it receives;
* a backup sends nothing while it shadows: what it would send is kept in its outbox (the last
  :data:`OUTBOX` messages);
* when a sender's stream to a primary breaks (the process died), the sender routes that slot to
  its backup, tells it (``PROMOTE``) and re-sends it the last :data:`OUTBOX` messages it sent to
  the slot; the backup becomes the primary and re-sends its outbox.
  Receivers drop what they already have (buffers and ring boxes are keyed by batch or ring tag),
  so the primary's last messages are delivered exactly once whether or not it sent them.

In the ``fixed`` order every node's computation is a function of its inputs, so a run in which a
primary is killed and its backup takes over ends on the digests of the uninterrupted run.

**Who sends.** Every node process makes a fresh Ed25519 key (:class:`zeroth.transport.identity.Identity`)
and signs every message it sends (:func:`zeroth.cluster.wire.sign`), naming the slot it is for. At
the start-up barrier (:meth:`ClusterTransport.wait_for_nodes`) every node asks every other node, at
its address-book address, for its key (``Identify``; the answer carries a proof that the process
holds the run secret, :func:`zeroth.transport.identity.join_proof`); the first key learned for a name
is kept for the run. A message is taken only if it is for this node's slot, verifies under its
sender's key, and comes from the slot that sends such messages (an activation from the previous
stage, a gradient from the next, a handed state from the slot's primary): a holder of the run secret
cannot speak for a node, and a refused message never becomes "the first copy" of its batch. The
server's message limit is the run's largest message (:class:`zeroth.cluster.wire.Sizes`), not 256 MiB.
"""

from __future__ import annotations

import io
import json
import threading
import time
from collections import deque
from collections.abc import Callable, Mapping
from pathlib import Path

import grpc
import numpy as np

from zeroth.cluster import build as _build
from zeroth.cluster import driver as _driver
from zeroth.cluster import wire
from zeroth.cluster.proto import cluster_pb2 as pb
from zeroth.cluster.proto import cluster_pb2_grpc as pb_grpc
from zeroth.transport import channels, guard, identity, pacing, security

__all__ = ["OUTBOX", "ClusterTransport", "CHANNEL_OPTIONS", "MAX_MESSAGE_BYTES", "SERVER_OPTIONS", "resolve_address"]

OUTBOX = 4096
MAX_MESSAGE_BYTES = 256 * 1024 * 1024  # a node's activations, gradients or handed-over state
CHANNEL_OPTIONS = channels.channel_options(MAX_MESSAGE_BYTES)  # with keepalive: a frozen node ends the stream
SERVER_OPTIONS = channels.server_options(MAX_MESSAGE_BYTES)


def _key_label(name: str) -> str:
    """What a node's key proof binds besides the run and the key (:func:`zeroth.transport.identity.join_proof`)."""
    return f"ravnest-node:{name}"


def resolve_address(address_dir: Path, name: str, timeout_s: float) -> str:
    """The address node ``name`` wrote to ``address_dir/<name>`` (waited for)."""
    path = Path(address_dir) / name
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if path.is_file():
            text = path.read_text().strip()
            if text:
                return text
        time.sleep(0.05)
    raise TimeoutError(f"node {name!r} wrote no address to {path} within {timeout_s:g}s")


class _Sender:
    """One paced client stream to one node; ``on_failure`` is called once if the stream breaks."""

    def __init__(
        self,
        name: str,
        address: str,
        bandwidth_bps,
        latency_s: float,
        token: str | None,
        on_failure: Callable[[str, BaseException], None],
        tls: security.TLSFiles | None = None,
    ):
        self.name = name
        self.pacer = pacing.Pacer(bandwidth_bps, latency_s)
        self.channel = security.open_channel(address, CHANNEL_OPTIONS, tls)
        self._stub = pb_grpc.ClusterNodeStub(self.channel)
        self._md = security.token_metadata(token)
        self._on_failure, self.closing = on_failure, False
        self.thread = threading.Thread(target=self._run, daemon=True, name=f"send-{name}")
        self.thread.start()

    def _run(self) -> None:
        try:
            self._stub.Deliver(self.pacer.frames(), metadata=self._md)
        except grpc.RpcError as e:
            if not self.closing:
                self._on_failure(self.name, e)

    def close(self, timeout_s: float) -> None:
        self.closing = True
        self.pacer.close()
        self.thread.join(timeout_s)
        self.channel.close()


class ClusterTransport:
    """Node ``me``'s transport.

    Args:
      me: this node's name. slots: ``{node name: (cluster, stage)}`` of every node, backups included.
      primaries: ``{(cluster, stage): primary name}``; backups: ``{(cluster, stage): backup name}``.
      run_id: the run's id (every message carries it). token: the access token (None: no check).
      address_dir: where every node writes ``<name>`` holding its ``HOST:PORT``.
      bandwidth_mbps: ``{name: steady bandwidth}``; enforce: pace at the pair's bandwidth.
      latency_s: the base one-way latency of every message; node_latency_s: ``{name: access latency}``
        added at both ends. timeout_s: bound on every wait. tls: serve and call over TLS (mutual
        when ``tls.mutual``; None: plaintext).
      me_key: this process's signing key (default: a fresh one). secret: the run secret, to prove
        this process holds it when asked for its key and to check the others' proofs (None: no proofs).
      keys: ``{name: public key}`` already known (the others are asked for at their addresses).
      sizes: what one message of the run can hold (None: the 256 MiB limit).
    """

    def __init__(
        self,
        me: str,
        slots: Mapping[str, tuple[int, int]],
        primaries: Mapping,
        backups: Mapping,
        *,
        run_id: str,
        token: str | None,
        address_dir: Path,
        bandwidth_mbps: Mapping[str, float],
        enforce: bool = True,
        latency_s: float = 0.0,
        node_latency_s: Mapping[str, float] | None = None,
        timeout_s: float = 300.0,
        backup_round: Mapping[str, int] | None = None,
        tls: security.TLSFiles | None = None,
        me_key: identity.Identity | None = None,
        secret: str | None = None,
        keys: Mapping[str, bytes] | None = None,
        sizes: wire.Sizes | None = None,
    ):
        self.me, self.run_id, self.token, self.tls = me, run_id, token, tls
        self.identity = me_key if me_key is not None else identity.Identity.generate()
        self.secret, self.sizes = secret, sizes
        self.keys: dict[str, bytes] = {str(k): bytes(v) for k, v in (keys or {}).items()}
        self.keys[me] = self.identity.public
        self._key_lock = threading.Lock()
        self.slots = {k: tuple(v) for k, v in slots.items()}
        self.slot = self.slots[me]
        self.primary = {tuple(k): v for k, v in primaries.items()}
        self.first_primary = dict(self.primary)  # who may hand a joining backup its state
        self.backup = {tuple(k): v for k, v in backups.items()}
        self.shadow = self.primary[self.slot] != me
        self.address_dir, self.bw, self.enforce = Path(address_dir), dict(bandwidth_mbps), enforce
        self.latency_s, self.timeout_s = latency_s, timeout_s
        self.node_latency_s = dict(node_latency_s or {})
        self.backup_round = dict(backup_round or {})
        self.sent_log: dict[tuple, deque] = {}
        self.relay_to: str | None = None
        self._relay_lock = threading.Lock()
        self._state: bytes | None = None
        self._state_event = threading.Event()
        self.inbox = _driver.Inbox()
        self.outbox: deque = deque(maxlen=OUTBOX)
        self._senders: dict[str, _Sender] = {}
        self._dead: set[str] = set()
        self._lock = threading.RLock()
        self._ring_cv = threading.Condition()
        self._ring: dict[tuple, np.ndarray] = {}
        self._ring_seen: set[tuple] = set()
        self.received = self.refused = 0
        self.bytes_sent: dict[str, int] = {}
        self.promoted_at: float | None = None
        self.server: grpc.Server | None = None

    # ------------------------------------------------------------------ serving

    def serve(self, listen: str, advertise: str | None = None) -> str:
        """Start the server on ``listen`` (port 0 = any); writes and returns ``HOST:PORT`` with the bound
        port and ``advertise`` as the host (default: the ``listen`` host)."""
        # Every other node may hold a stream to this one (plus a few for a backup's handover).
        calls = max(16, len(self.slots) + 4)
        most = MAX_MESSAGE_BYTES if self.sizes is None else min(MAX_MESSAGE_BYTES, self.sizes.message_bytes())
        bounds = guard.Limits(most, max_calls=calls, max_calls_per_caller=calls, idle_s=self.timeout_s)
        self.server = guard.make_server(bounds, self.token, name="zeroth-node")
        pb_grpc.add_ClusterNodeServicer_to_server(_Servicer(self), self.server)
        port = security.bind(self.server, listen, self.tls)
        self.server.start()
        address = f"{advertise or listen.rsplit(':', 1)[0]}:{port}"
        self.address_dir.mkdir(parents=True, exist_ok=True)
        tmp = self.address_dir / f".{self.me}.tmp"
        tmp.write_text(address + "\n")
        tmp.replace(self.address_dir / self.me)
        return address

    def wait_for_nodes(self, names, timeout_s: float) -> None:
        """Return once every node of ``names`` (but this one) answers at its address with its key
        (:meth:`key_of`); every node of a run is started at once, and a stream opened to a node not
        serving yet would read as the node gone (``zeroth launch`` hands every host the whole address
        book before any node serves).

        Raises:
          TimeoutError: a node did not answer within ``timeout_s`` (named, with its address).
          ConnectionError: a node answered with a key that is not its own (wrong name, run or proof).
        """
        deadline = time.monotonic() + timeout_s
        for name in names:
            if name != self.me:
                self.key_of(name, max(0.0, deadline - time.monotonic()))

    def key_of(self, name: str, timeout_s: float) -> bytes:
        """Node ``name``'s public key: the one learned first, or asked of the node at its address
        (waiting up to ``timeout_s`` for it to serve) and kept for the run.

        Raises:
          TimeoutError: no answer within ``timeout_s``. ConnectionError: the answer is not ``name``'s
          of this run, or its proof does not match the run secret.
        """
        with self._key_lock:
            if name in self.keys:
                return self.keys[name]
        address = resolve_address(self.address_dir, name, timeout_s)
        channel = security.open_channel(address, CHANNEL_OPTIONS, self.tls)
        try:
            reply = pb_grpc.ClusterNodeStub(channel).Identify(
                pb.IdentifyRequest(run_id=self.run_id, name=name),
                metadata=security.token_metadata(self.token),
                timeout=max(0.1, timeout_s),
                wait_for_ready=True,
            )
        except grpc.RpcError as e:
            if e.code() == grpc.StatusCode.DEADLINE_EXCEEDED:
                raise TimeoutError(f"node {name!r} at {address} did not answer within {timeout_s:g}s") from None
            raise ConnectionError(
                f"node {name!r} at {address} did not give its key ({e.code().name}: {e.details()})"
            ) from None
        finally:
            channel.close()
        if reply.name != name or reply.run_id != self.run_id or len(reply.key) != 32:
            raise ConnectionError(
                f"the node at {address} answered as {reply.name!r} of run {reply.run_id!r} "
                f"(expected {name!r} of {self.run_id!r}); check the address book {self.address_dir}"
            )
        if self.secret is not None and not identity.check_join_proof(
            self.secret, reply.proof, self.run_id, _key_label(name), reply.key
        ):
            raise ConnectionError(
                f"node {name!r} at {address} does not prove it holds the run secret; "
                "give every node the same ZEROTH_SECRET"
            )
        with self._key_lock:
            return self.keys.setdefault(name, bytes(reply.key))

    def node_key(self) -> pb.NodeKey:
        """This node's answer to ``Identify``."""
        proof = (
            b""
            if self.secret is None
            else identity.join_proof(self.secret, self.run_id, _key_label(self.me), self.identity.public)
        )
        return pb.NodeKey(run_id=self.run_id, name=self.me, key=self.identity.public, proof=proof)

    def receive(self, msg: pb.Message) -> None:
        """Check one message (its form, its slot, its signature, its sender's slot), put it where its
        reader waits and relay it to a joined backup (raises :class:`wire.MessageError`)."""
        wire.check_message(msg, self.run_id, self.slots, self.sizes)
        to = (int(msg.to_cluster), int(msg.to_stage))
        if to != self.slot:
            raise wire.MessageError(f"to slot {list(to)}: this node ({self.me}) holds slot {list(self.slot)}")
        try:
            key = self.key_of(msg.sender, self.timeout_s)
        except (TimeoutError, ConnectionError) as e:
            raise wire.MessageError(f"no key for sender {msg.sender!r}: {e}") from None
        wire.check_signature(msg, key)
        c, s = self.slot
        src = self.slots[msg.sender]
        expected = {pb.ACTIVATION: (c, s - 1), pb.GRADIENT: (c, s + 1)}.get(msg.kind)
        if expected is not None and src != expected:
            raise wire.MessageError(
                f"sender {msg.sender!r} holds slot {list(src)}; this slot's "
                f"{'activations' if msg.kind == pb.ACTIVATION else 'gradients'} come from {list(expected)}"
            )
        if msg.kind == pb.STATE and msg.sender != self.first_primary.get(self.slot):
            raise wire.MessageError(
                f"sender {msg.sender!r} is not the primary of slot {list(self.slot)}: only it hands a state"
            )
        if msg.kind == pb.STATE:
            self._state = msg.blob
            self._state_event.set()
            return
        if msg.kind == pb.PROMOTE:
            self._promote()
            return
        with self._relay_lock:
            self._receive(msg)
            if self.relay_to is not None:
                self._submit(self.relay_to, msg)

    def _receive(self, msg: pb.Message) -> None:
        self.received += 1
        array = wire.from_message(msg)
        src = self.slots[msg.sender]
        if msg.kind == pb.RING:
            key = (src, (msg.ring, msg.round, msg.phase, msg.step))
            with self._ring_cv:
                if key in self._ring_seen:
                    return
                self._ring_seen.add(key)
                self._ring[key] = array.reshape(-1)
                self._ring_cv.notify_all()
            return
        self.inbox.put(_driver.ACTIVATION if msg.kind == pb.ACTIVATION else _driver.GRADIENT, msg.batch, array)

    # ------------------------------------------------------------------ sending

    def _sender(self, name: str) -> _Sender:
        with self._lock:
            if name not in self._senders:
                address = resolve_address(self.address_dir, name, self.timeout_s)
                bps = min(self.bw[self.me], self.bw[name]) * 1e6 if self.enforce else None
                lat = self.latency_s + self.node_latency_s.get(self.me, 0.0) + self.node_latency_s.get(name, 0.0)
                self._senders[name] = _Sender(name, address, bps, lat, self.token, self._failed, self.tls)
            return self._senders[name]

    def _submit(self, name: str, msg: pb.Message) -> None:
        n = self._sender(name).pacer.submit(msg)
        self.bytes_sent[name] = self.bytes_sent.get(name, 0) + n

    def _deliver(self, slot: tuple[int, int], msg: pb.Message) -> None:
        with self._lock:
            if self.shadow:
                self.outbox.append((slot, msg))
                return
            self.sent_log.setdefault(slot, deque(maxlen=OUTBOX)).append(msg)
            b = self.backup.get(slot)
            names = [self.primary[slot]] + ([b] if b is not None and self.backup_round.get(b, 0) == 0 else [])
            for name in names:
                if name in self._dead or name == self.me:
                    continue
                self._submit(name, msg)

    def _failed(self, name: str, error: BaseException) -> None:
        """A stream to ``name`` broke: route its slot to the backup, or fail this node."""
        with self._lock:
            if name in self._dead:
                return
            self._dead.add(name)
            slot = self.slots[name]
            b = self.backup.get(slot)
            if self.primary.get(slot) == name and b is not None and b not in self._dead:
                self.primary[slot] = b
                del self.backup[slot]
                self._submit(b, wire.sign(wire.promote_message(self.run_id, self.me, slot), self.identity))
                for m in self.sent_log.get(slot, ()):  # what the dead primary may not have passed on
                    self._submit(b, m)
                return
            if self.primary.get(slot) == name:
                code = error.code().name if isinstance(error, grpc.RpcError) else type(error).__name__
                self.inbox.fail(
                    ConnectionError(
                        f"node {name!r} (cluster {slot[0]}, stage {slot[1]}) went away ({code}) and has no backup"
                    )
                )
            elif self.backup.get(slot) == name:
                del self.backup[slot]

    def _promote(self) -> None:
        with self._lock:
            if not self.shadow:
                return
            self.shadow = False
            self.promoted_at = time.time()
            self.primary[self.slot] = self.me
            self.backup.pop(self.slot, None)  # this node was the slot's backup; the slot has none now
            for name, slot in self.slots.items():
                if slot == self.slot and name != self.me:
                    self._dead.add(name)
            pending = list(self.outbox)
            self.outbox.clear()
        for slot, msg in pending:
            self._deliver(slot, msg)

    # ------------------------------------------------------------------ a backup joining later

    def attach(self, backup: str, stage_snapshot: dict[str, np.ndarray]) -> int:
        """Hand ``backup`` this node's state (the stage's snapshot, the waiting messages and what was
        seen) and relay it every message received from now on. Returns the state's bytes."""
        with self._relay_lock:
            buf = io.BytesIO()
            np.savez(buf, **self.state_arrays(stage_snapshot))
            blob = buf.getvalue()
            with self._lock:
                self._submit(
                    backup, wire.sign(wire.state_message(self.run_id, self.me, blob, self.slot), self.identity)
                )
                self.relay_to = backup
        return len(blob)

    def state_arrays(self, stage_snapshot: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        """This node's state as named arrays: the stage's snapshot (``s/…``), the waiting messages and
        ring chunks, and the keys of every message seen (``manifest``, JSON bytes)."""
        items, seen = self.inbox.snapshot()
        with self._ring_cv:
            ring_items, ring_seen = dict(self._ring), set(self._ring_seen)
        arrays = {f"s/{k}": v for k, v in stage_snapshot.items()}
        manifest = {
            "inbox": [],
            "inbox_seen": sorted([list(k) for k in seen]),
            "ring": [],
            "ring_seen": sorted([[*src, *tag] for src, tag in ring_seen], key=str),
        }
        for i, (k, v) in enumerate(sorted(items.items())):
            manifest["inbox"].append(list(k))
            arrays[f"in/{i}"] = np.asarray(v)
        for i, ((src, tag), v) in enumerate(sorted(ring_items.items(), key=str)):
            manifest["ring"].append([*src, *tag])
            arrays[f"ring/{i}"] = np.asarray(v)
        arrays["manifest"] = np.frombuffer(json.dumps(manifest).encode(), np.uint8)
        return arrays

    def wait_state(self, timeout_s: float) -> dict[str, np.ndarray]:
        """A joining backup: wait for its primary's state, take its messages; returns the stage's snapshot."""
        if not self._state_event.wait(timeout_s):
            raise TimeoutError(f"node {self.me}: no state from its primary within {timeout_s:g}s")
        with np.load(io.BytesIO(self._state), allow_pickle=False) as z:
            return self.restore_arrays(z)

    def restore_arrays(self, z) -> dict[str, np.ndarray]:
        """Take the messages and seen keys of :meth:`state_arrays` (``z``: a mapping of its arrays);
        returns the stage's snapshot."""
        manifest = json.loads(z["manifest"].tobytes().decode())
        items = {(k, int(b)): z[f"in/{i}"] for i, (k, b) in enumerate(manifest["inbox"])}
        self.inbox.restore(items, {(k, int(b)) for k, b in manifest["inbox_seen"]})
        with self._ring_cv:
            for i, (c, s, ring, rnd, phase, step) in enumerate(manifest["ring"]):
                key = ((c, s), (ring, rnd, phase, step))
                if key not in self._ring_seen:
                    self._ring[key] = z[f"ring/{i}"]
            for c, s, ring, rnd, phase, step in manifest["ring_seen"]:
                self._ring_seen.add(((c, s), (ring, rnd, phase, step)))
            self._ring_cv.notify_all()
        return {k[2:]: z[k] for k in list(z.keys()) if k.startswith("s/")}

    def unreceived(self, batch_from: int, round_from: int) -> list[tuple[tuple[int, int], bytes]]:
        """``(slot, message bytes)`` of what this node sent that a receiver restarted from the same
        update count may still need: activations and gradients of batches from ``batch_from`` on,
        ring chunks and join pieces of rounds from ``round_from`` on (a checkpoint keeps them)."""
        with self._lock:
            sent = [(slot, m) for slot, log in self.sent_log.items() for m in log] + list(self.outbox)
        keep = [
            (slot, m)
            for slot, m in sent
            if (m.kind in (pb.ACTIVATION, pb.GRADIENT) and m.batch >= batch_from)
            or (m.kind == pb.RING and m.round >= round_from)
        ]
        return [(tuple(slot), m.SerializeToString()) for slot, m in keep]

    def resend(self, messages) -> int:
        """Send again what :meth:`unreceived` kept (before a restart), signed with this process's key;
        receivers drop what they have already. Returns how many."""
        n = 0
        for slot, data in messages:
            msg = pb.Message.FromString(bytes(data))
            if msg.sender != self.me or msg.run_id != self.run_id:
                raise ValueError(
                    f"a kept message of {msg.sender!r} (run {msg.run_id!r}) is not node {self.me!r}'s of this run"
                )
            msg.signature = b""
            self._deliver(tuple(slot), wire.sign(msg, self.identity))
            n += 1
        return n

    def send(self, kind: str, batch: int, array: np.ndarray) -> None:
        """An activation to the next stage, a gradient to the previous one (NodeIO)."""
        c, s = self.slot
        dest = (c, s + 1) if kind == _driver.ACTIVATION else (c, s - 1)
        self._deliver(
            dest, wire.sign(wire.to_message(self.run_id, self.me, kind, array, batch=batch, to=dest), self.identity)
        )

    # ------------------------------------------------------------------ rings

    def ring_send(self, peer: tuple[int, int], tag: tuple, array: np.ndarray) -> None:
        ring, round_id, phase, step = tag
        peer = tuple(peer)
        msg = wire.to_message(
            self.run_id, self.me, "ring", array, ring=ring, round_id=round_id, phase=phase, step=step, to=peer
        )
        self._deliver(peer, wire.sign(msg, self.identity))

    def ring_recv(self, peer: tuple[int, int], tag: tuple, timeout_s: float) -> np.ndarray:
        key = (tuple(peer), tuple(tag))
        with self._ring_cv:
            if not self._ring_cv.wait_for(lambda: key in self._ring, timeout=timeout_s):
                raise TimeoutError(f"no ring message {tag} from slot {peer} within {timeout_s:g}s")
            return self._ring.pop(key)

    def close(self, timeout_s: float = 30.0) -> None:
        """Flush every stream (the receivers have all the messages), then stop the server."""
        with self._lock:
            senders = list(self._senders.values())
        for snd in senders:
            snd.close(timeout_s)
        if self.server is not None:
            self.server.stop(grace=1.0).wait()


class _RingExchange:
    """The :class:`zeroth.cluster.rings.Exchange` of a node: peers are slots ``(cluster, stage)``."""

    def __init__(self, t: ClusterTransport):
        self.t = t

    def send(self, peer, tag, array) -> None:
        self.t.ring_send(peer, tag, array)

    def recv(self, peer, tag, timeout_s):
        return self.t.ring_recv(peer, tag, timeout_s)


class _Servicer(pb_grpc.ClusterNodeServicer):
    def __init__(self, t: ClusterTransport):
        self.t = t

    def Deliver(self, request_iterator, context):
        n = 0
        for msg in request_iterator:
            try:
                self.t.receive(msg)
            except wire.MessageError as e:
                self.t.refused += 1
                context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"node {self.t.me} refused a message: {e}")
            n += 1
        return pb.Ack(received=n)

    def Identify(self, request, context):
        if request.run_id != self.t.run_id or request.name != self.t.me:
            context.abort(
                grpc.StatusCode.NOT_FOUND,
                f"this is node {self.t.me!r} of run {self.t.run_id!r}, not {request.name!r} of {request.run_id!r}",
            )
        return self.t.node_key()


class NodeLink:
    """The :class:`zeroth.cluster.driver.NodeIO` of a node process: sends, buffers and averaging over its transport."""

    def __init__(self, t: ClusterTransport, plan, timeout_s: float):
        self.t, self.plan, self.timeout_s = t, plan, timeout_s
        self.inbox = t.inbox
        self.exchange = _RingExchange(t)

    def send(self, kind, batch, array) -> None:
        self.t.send(kind, batch, array)

    def average(self, flat, round_id):
        return _build.average_round(self.plan, self.t.slot, flat, round_id, self.exchange, self.timeout_s)

    def fetch_start(self, flat):
        """A late stage's starting slice (:func:`zeroth.cluster.build.fetch_start`)."""
        return _build.fetch_start(self.plan, self.t.slot, flat, self.exchange, self.timeout_s)
