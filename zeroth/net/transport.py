"""How a peer talks to the others: its gRPC options and size limits (the one place the peers' are
set), channels, unary and streaming calls with byte accounting, and signed requests.

* :data:`CHANNEL_OPTIONS` / :data:`SERVER_OPTIONS` (:mod:`zeroth.transport.channels`): messages
  above :data:`MAX_MESSAGE_BYTES` are refused by gRPC (``RESOURCE_EXHAUSTED``); servers never share
  a port; a call to a peer that stopped answering keepalive pings (a ``Join`` held by a frozen
  leader, a state transfer from a vanished host) ends with ``UNAVAILABLE`` after 10 + 10 s instead
  of waiting for its deadline, and the caller asks another peer.
* :class:`Traffic`: payload bytes are the projected-gradient bytes of pushes and log entries sent
  and received; wire bytes are every message sent and received, each its serialized size plus the
  framing of :func:`zeroth.net.wire.wire_size`.
* :class:`Transport`: one channel and one stub per address, every call carries the access token; requests
  that are not protocol messages are signed (:data:`SIGNED_REQUESTS`, :func:`sign_request`) and
  checked by the receiver (:func:`request_signed_bytes`).

Example:
  >>> t = Traffic(); t.sent(100, 16); t.snapshot()["payload_sent"]
  16
"""

from __future__ import annotations

import dataclasses

import threading

import grpc

from zeroth.transport import identity as _id
from zeroth.transport import security as _sec
from zeroth.transport.channels import channel_options, server_options
from zeroth.transport.guard import Limits
from zeroth.net import wire
from zeroth.net.proto import peer_pb2 as pb
from zeroth.net.proto import peer_pb2_grpc as pb_grpc

__all__ = [
    "MAX_MESSAGE_BYTES",
    "SERVER_THREADS",
    "CHANNEL_OPTIONS",
    "SERVER_OPTIONS",
    "SERVER_LIMITS",
    "server_limits",
    "SIGNED_REQUESTS",
    "Closed",
    "Traffic",
    "Transport",
    "request_signed_bytes",
    "sign_request",
    "response_payload",
]

MAX_MESSAGE_BYTES = 4 * 1024 * 1024  # larger messages are refused by gRPC (RESOURCE_EXHAUSTED)
SERVER_THREADS = 64  # a peer's concurrent calls served (one thread each); beyond: RESOURCE_EXHAUSTED
CHANNEL_OPTIONS = channel_options(MAX_MESSAGE_BYTES)
SERVER_OPTIONS = server_options(MAX_MESSAGE_BYTES)
# A peer's server: every call carries a small message (a state chunk at most MAX_MESSAGE_BYTES);
# one address (a host, all the peers of a loopback run) holds at most half the calls.
SERVER_LIMITS = Limits(
    MAX_MESSAGE_BYTES, max_calls=SERVER_THREADS, max_calls_per_caller=SERVER_THREADS // 2, idle_s=60.0
)


def server_limits(peers: int) -> Limits:
    """:data:`SERVER_LIMITS`, raised for a run of ``peers`` peers: a founder holds every founder's
    ``Join`` until the run forms, and on one host all of them are one caller, so a cap below the
    founders left the rest unable to join (48 peers on one host formed with 33: the per-caller cap
    of 32 held Joins, plus the founder).

    Example:
      >>> server_limits(3) == SERVER_LIMITS, server_limits(48).max_calls_per_caller
      (True, 56)
    """
    per_caller = max(SERVER_LIMITS.max_calls_per_caller, peers + 8)
    calls = max(SERVER_LIMITS.max_calls, 2 * per_caller)
    if (calls, per_caller) == (SERVER_LIMITS.max_calls, SERVER_LIMITS.max_calls_per_caller):
        return SERVER_LIMITS
    return dataclasses.replace(SERVER_LIMITS, max_calls=calls, max_calls_per_caller=per_caller)


# The fields each signed request covers besides (method, run_id, sender, seq).
SIGNED_REQUESTS = {
    "FetchLog": ("first_iteration", "last_iteration"),
    "Checksum": ("iteration", "digest"),
    "GetManifest": (),
    "FetchState": ("iteration", "offset", "length"),
}


def request_signed_bytes(method: str, request) -> bytes:
    """The bytes the sender of a :data:`SIGNED_REQUESTS` request signs (its ``auth.seq`` included)."""
    fields = tuple(getattr(request, f) for f in SIGNED_REQUESTS[method])
    fields = tuple(bytes(v) if isinstance(v, bytes) else int(v) for v in fields)
    return _id.request_bytes(method, request.run_id, int(request.sender), int(request.auth.seq), *fields)


def sign_request(me: _id.Identity, seq: int, method: str, request):
    """Set ``request.auth`` to ``me``'s signature with sequence number ``seq``; returns the request."""
    request.auth.seq = seq
    request.auth.signature = me.sign(request_signed_bytes(method, request))
    return request


def response_payload(response) -> int:
    """Projected-gradient bytes a response carries (log entries and takeover replies)."""
    if isinstance(response, pb.FetchLogReply):
        return sum(len(g.payload) for e in response.entries for g in e.gradients)
    if isinstance(response, pb.PrepareReply):
        return sum(len(g.payload) for g in response.gradients) + sum(len(g.payload) for g in response.decided.gradients)
    return 0


class Closed(grpc.RpcError):
    """A call attempted after :meth:`Transport.close` (the peer is stopping): ``CANCELLED``."""

    def code(self) -> grpc.StatusCode:
        return grpc.StatusCode.CANCELLED

    def details(self) -> str:
        return str(self)


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


class Transport:
    """Channels to the other peers and calls over them.

    Args:
      token: the access token every call carries (None: an insecure run).
      tls: TLS files (None: plaintext).
      traffic: where bytes are counted.
      options: the channels' gRPC options (default :data:`CHANNEL_OPTIONS`; another keepalive:
        :func:`zeroth.transport.channels.channel_options`).
    """

    def __init__(
        self, *, token: str | None, tls: _sec.TLSFiles | None, traffic: Traffic, options: tuple = CHANNEL_OPTIONS
    ):
        self.token = token
        self.options = list(options)
        self.tls = tls
        self.traffic = traffic
        self.metadata = _sec.token_metadata(token)
        self._lock = threading.Lock()
        self._channels: dict[str, grpc.Channel] = {}
        self._stubs: dict[str, pb_grpc.PeerStub] = {}
        self._seq = _id.Sequence()
        self._closed = False

    def _open(self, address: str) -> grpc.Channel:
        if self._closed:
            raise Closed(f"this peer is stopping (call to {address})")
        ch = self._channels.get(address)
        if ch is None:
            ch = _sec.open_channel(address, self.options, self.tls)
            self._channels[address] = ch
        return ch

    def stub(self, address: str) -> pb_grpc.PeerStub:
        """The stub of ``address``'s channel, made once (a stub builds a callable per method)."""
        with self._lock:
            stub = self._stubs.get(address)
            if stub is None:
                stub = self._stubs[address] = pb_grpc.PeerStub(self._open(address))
            return stub

    def renew(self, address: str) -> None:
        """Make later calls to ``address`` on a new channel: a peer (re)started there answered us, while
        the channel it had may still wait out gRPC's reconnection back-off and fail every call until
        then (up to :data:`zeroth.transport.channels.MAX_RECONNECT_BACKOFF_S`). Calls under way finish
        on the old channel, which is released with its last call."""
        with self._lock:
            self._channels.pop(address, None)
            self._stubs.pop(address, None)

    def signed(self, me: _id.Identity, method: str, request):
        """``request`` signed by ``me`` with a fresh sequence number."""
        return sign_request(me, self._seq.next(), method, request)

    def rpc(self, address: str, method: str, request, timeout: float, payload: int = 0):
        """One unary call with accounting; raises ``grpc.RpcError``."""
        stub = self.stub(address)
        size = wire.wire_size(request, kind="request", token=self.token)
        try:
            response = getattr(stub, method)(request, timeout=timeout, metadata=self.metadata)
        except grpc.RpcError as e:
            if e.code() != grpc.StatusCode.UNAVAILABLE:
                self.traffic.sent(size, payload)
                self.traffic.received(wire.RESPONSE_OVERHEAD)
            raise
        self.traffic.sent(size, payload)
        self.traffic.received(wire.wire_size(response, kind="response"), response_payload(response))
        return response

    def rpc_async(self, address: str, method: str, request, timeout: float, done, payload: int = 0) -> None:
        """One unary call that does not wait for its answer: ``done(response, error)`` gets it
        (``error`` a ``grpc.RpcError``, else None), on a gRPC thread, or in this call when it
        failed at once; ``done`` must not block. Accounted as :meth:`rpc`. Raises :class:`Closed`
        when this peer is stopping."""
        stub = self.stub(address)
        size = wire.wire_size(request, kind="request", token=self.token)

        def finished(fut) -> None:
            try:
                response = fut.result()
            except grpc.RpcError as e:
                if e.code() != grpc.StatusCode.UNAVAILABLE:
                    self.traffic.sent(size, payload)
                    self.traffic.received(wire.RESPONSE_OVERHEAD)
                done(None, e)
                return
            self.traffic.sent(size, payload)
            self.traffic.received(wire.wire_size(response, kind="response"), response_payload(response))
            done(response, None)

        getattr(stub, method).future(request, timeout=timeout, metadata=self.metadata).add_done_callback(finished)

    def stream(self, address: str, method: str, request, timeout: float):
        """The messages of a server-streaming call, counted as they arrive; raises ``grpc.RpcError``."""
        stub = self.stub(address)
        self.traffic.sent(wire.wire_size(request, kind="request", token=self.token))
        for i, msg in enumerate(getattr(stub, method)(request, timeout=timeout, metadata=self.metadata)):
            self.traffic.received(wire.wire_size(msg, kind="response" if i == 0 else "stream"))
            yield msg

    def close(self) -> None:
        with self._lock:
            self._closed = True
            channels, self._channels, self._stubs = list(self._channels.values()), {}, {}
        for ch in channels:
            ch.close()
