"""The rendezvous of ``zeroth launch``: hosts meet at one address, get a rank each and read the
roster (every host's advertised address) once the run is formed.

It is a small store in the manner of torch elastic's: the launcher that can listen on the
rendezvous address serves it (:func:`serve`), every launcher (that one included) calls it
(:class:`Client`). The rules live in :class:`Store`, a pure object with time passed in:

* a host joins with the digest of its config and zeroth's version; one that differs from the
  serving host's is refused, naming both;
* ranks are the scheduler's (``node_rank``, every host gives one) or given in order of arrival;
  a host asking again with its nonce gets its rank back;
* the run is **formed** when ``max_nodes`` hosts joined, or ``min_nodes`` did and ``last_call_s``
  passed without another; it **fails** when ``timeout_s`` passes first: every host reads why;
* a host arriving after the run formed is refused, or admitted as ``late`` where the system takes
  joiners (Just One Byte peers);
* a host may bring the public key of the process it will start (hex in :class:`Member`): the
  roster carries it to the others, which then take that rank's messages only signed by it (a
  pipeline stage from the stage before it).

Every call carries the run's access token, TLS is optional (mutual with client certificates), and
the server is guarded as every zeroth server is (:mod:`.guard`: a call without the token is refused
before its body is read, messages are capped at :data:`MAX_MESSAGE_BYTES`, concurrent calls at
:data:`MAX_CONCURRENT_CALLS`); no call waits on another (``Roster`` is polled).

Example:
  >>> s = Store(min_nodes=2, max_nodes=2, timeout_s=60, config_digest="d", version="1")
  >>> s.join(0.0, config_digest="d", version="1", advertise="10.0.0.1:7000", node_rank=-1, hostname="a", nonce=b"a")
  (0, False)
  >>> s.roster(1.0).formed
  False
  >>> s.join(2.0, config_digest="d", version="1", advertise="10.0.0.2:7000", node_rank=-1, hostname="b", nonce=b"b")
  (1, False)
  >>> [m.advertise for m in s.roster(2.0).members]
  ['10.0.0.1:7000', '10.0.0.2:7000']
"""

from __future__ import annotations

import dataclasses
import secrets
import socket
import threading
import time
import grpc

from zeroth.transport import channels, guard, security
from zeroth.transport.proto import rendezvous_pb2 as pb
from zeroth.transport.proto import rendezvous_pb2_grpc as pb_grpc

__all__ = [
    "Store",
    "Roster",
    "Member",
    "Refused",
    "Client",
    "serve",
    "startup_window",
]

MAX_MESSAGE_BYTES = 64 * 1024  # a roster of 1,000 hosts fits in well under this
MAX_CONCURRENT_CALLS = 64  # every call is answered from memory at once: a few threads serve hundreds of hosts
# Hosts on one machine are one caller; a call's request is read within 5 s or it is dropped.
_LIMITS = guard.Limits(
    MAX_MESSAGE_BYTES, max_calls=MAX_CONCURRENT_CALLS, max_calls_per_caller=MAX_CONCURRENT_CALLS, body_s=5.0, idle_s=5.0
)


def startup_window(processes: int) -> float:
    """The default start-up window in seconds of a run of ``processes`` processes: it grows with the
    count, since many processes importing and compiling at once on a small machine start slowly.

    Example:
      >>> startup_window(3), startup_window(48)
      (72.0, 252.0)
    """
    return 60.0 + 4.0 * processes


@dataclasses.dataclass(frozen=True)
class Member:
    """One host of the run: its rank, the ``HOST:PORT`` its process serves on, its host name and
    its process's Ed25519 public key (hex; empty: none given)."""

    rank: int
    advertise: str
    hostname: str
    key: str = ""


@dataclasses.dataclass(frozen=True)
class Roster:
    """What a host reads while it waits: ``formed`` with the ``members`` by rank, or ``failed`` (why)."""

    formed: bool
    members: tuple[Member, ...]
    joined: int
    min_nodes: int
    max_nodes: int
    waited_s: float
    failed: str = ""
    nodes: int = 0  # hosts the run formed with (ranks 0..nodes-1); late hosts follow them in ``members``


class Refused(Exception):
    """A join the store refuses: ``code`` is the gRPC status name, the message says why and what to do."""

    def __init__(self, code: str, message: str):
        super().__init__(message)
        self.code = code


class Store:
    """The rendezvous rules (see the module docstring); ``now`` is any monotonic clock in seconds.

    Args:
      min_nodes, max_nodes: the run forms with at least ``min_nodes`` hosts, at most ``max_nodes``.
      timeout_s: seconds from the first join within which ``min_nodes`` must have joined.
      config_digest, version: what every host must run (the serving host's).
      last_call_s: with ``min_nodes <= joined < max_nodes``, the run forms after this long without a join.
      late_joins: a host arriving after the run formed is admitted as ``late`` (up to ``max_nodes``).
    """

    def __init__(
        self,
        *,
        min_nodes: int,
        max_nodes: int,
        timeout_s: float,
        config_digest: str,
        version: str,
        last_call_s: float = 10.0,
        late_joins: bool = False,
    ):
        if not 1 <= min_nodes <= max_nodes:
            raise ValueError(f"min_nodes={min_nodes}, max_nodes={max_nodes}: need 1 <= min <= max")
        if not timeout_s > 0:
            raise ValueError(f"timeout_s={timeout_s}: must be positive")
        self.min_nodes, self.max_nodes, self.timeout_s = min_nodes, max_nodes, float(timeout_s)
        self.config_digest, self.version = config_digest, version
        self.last_call_s, self.late_joins = float(last_call_s), late_joins
        self._members: dict[bytes, Member] = {}  # nonce -> member
        self._late: set[bytes] = set()
        self._ranked: bool | None = None  # whether the hosts bring their ranks (decided by the first)
        self._first: float | None = None
        self._last_join: float | None = None
        self._formed: tuple[Member, ...] | None = None
        self._failed = ""
        self._lock = threading.Lock()

    def join(
        self,
        now: float,
        *,
        config_digest: str,
        version: str,
        advertise: str,
        node_rank: int,
        hostname: str,
        nonce: bytes,
        key: bytes = b"",
    ) -> tuple[int, bool]:
        """Admit a host (``key``: its process's public key, 32 bytes, or empty); returns ``(rank, late)``.
        Raises :class:`Refused`."""
        if len(key) not in (0, 32):
            raise Refused(
                "INVALID_ARGUMENT", f"host {hostname} gives a key of {len(key)} bytes: an Ed25519 public key has 32"
            )
        with self._lock:
            self._tick(now)
            if nonce in self._members:
                m = self._members[nonce]
                return m.rank, nonce in self._late
            if config_digest != self.config_digest:
                raise Refused(
                    "FAILED_PRECONDITION",
                    f"host {hostname} runs a different config (digest {config_digest[:16]}) "
                    f"than the run's (digest {self.config_digest[:16]}): give every host the same config and --set",
                )
            if version != self.version:
                raise Refused(
                    "FAILED_PRECONDITION",
                    f"host {hostname} runs zeroth {version}, the run zeroth {self.version}: "
                    "install the same version on every host",
                )
            if self._failed:
                raise Refused("FAILED_PRECONDITION", self._failed)
            if not split_address(advertise)[1]:
                raise Refused(
                    "INVALID_ARGUMENT", f"host {hostname} advertises {advertise!r}: expected HOST:PORT with a port"
                )
            ranked = node_rank >= 0
            if self._ranked is None:
                self._ranked = ranked
            elif ranked != self._ranked:
                raise Refused(
                    "FAILED_PRECONDITION",
                    f"host {hostname} {'gives' if ranked else 'does not give'} a node rank "
                    f"but the first host {'did not' if ranked else 'did'}: give --node-rank on every host or on none",
                )
            late = self._formed is not None
            if late and not self.late_joins:
                raise Refused(
                    "FAILED_PRECONDITION",
                    f"the run formed with {len(self._formed)} hosts before host {hostname} "
                    "arrived and its system takes no late host: start every host within the start-up window",
                )
            if len(self._members) >= self.max_nodes:
                raise Refused(
                    "RESOURCE_EXHAUSTED",
                    f"the run has {self.max_nodes} hosts already (--nnodes); host {hostname} is one too many",
                )
            taken = {m.rank for m in self._members.values()}
            if ranked:
                if not node_rank < self.max_nodes:
                    raise Refused(
                        "INVALID_ARGUMENT",
                        f"host {hostname} has node rank {node_rank}; the ranks are 0..{self.max_nodes - 1}",
                    )
                if node_rank in taken:
                    other = next(m.hostname for m in self._members.values() if m.rank == node_rank)
                    raise Refused(
                        "ALREADY_EXISTS",
                        f"node rank {node_rank} is taken by host {other}; host {hostname} asked for it too",
                    )
                rank = node_rank
            else:
                rank = min(set(range(self.max_nodes)) - taken)
            self._members[nonce] = Member(rank, advertise, hostname, bytes(key).hex())
            if late:
                self._late.add(nonce)
            if self._first is None:
                self._first = now
            self._last_join = now
            self._tick(now)
            return rank, late

    def roster(self, now: float) -> Roster:
        """The roster as it stands at ``now`` (forming it, or failing it, when its time has come)."""
        with self._lock:
            self._tick(now)
            members = (
                self._formed
                if self._formed is not None
                else tuple(sorted(self._members.values(), key=lambda m: m.rank))
            )
            if self._formed is not None:  # late hosts are listed after the run's own
                members = members + tuple(sorted((self._members[n] for n in self._late), key=lambda m: m.rank))
            return Roster(
                self._formed is not None,
                members,
                len(self._members),
                self.min_nodes,
                self.max_nodes,
                0.0 if self._first is None else now - self._first,
                self._failed,
                len(self._formed) if self._formed is not None else 0,
            )

    def _tick(self, now: float) -> None:
        if self._formed is not None or self._failed:
            return
        n = len(self._members)
        ranks = {m.rank for m in self._members.values()}
        if n == self.max_nodes or (
            n >= self.min_nodes
            and now - self._last_join >= self.last_call_s
            and (not self._ranked or ranks == set(range(n)))
        ):
            self._formed = tuple(sorted(self._members.values(), key=lambda m: m.rank))
        elif self._first is not None and now - self._first > self.timeout_s:
            have = ", ".join(f"{m.rank}:{m.hostname}" for m in sorted(self._members.values(), key=lambda m: m.rank))
            self._failed = (
                f"only {n} of {self.min_nodes}{'' if self.min_nodes == self.max_nodes else '+'} hosts joined "
                f"within the start-up window of {self.timeout_s:g}s (joined: {have}); start the missing hosts, "
                "check they reach the rendezvous, or raise --startup-timeout"
            )


class _Servicer(pb_grpc.RendezvousServicer):
    def __init__(self, store: Store, clock=time.monotonic):
        self.store, self.clock = store, clock

    def Join(self, request, context):
        try:
            rank, late = self.store.join(
                self.clock(),
                config_digest=request.config_digest,
                version=request.version,
                advertise=request.advertise,
                node_rank=request.node_rank,
                hostname=request.hostname[:128],
                nonce=bytes(request.nonce[:32]),
                key=bytes(request.key),
            )
        except Refused as e:
            context.abort(getattr(grpc.StatusCode, e.code), str(e))
        return pb.HostRank(rank=rank, late=late)

    def Roster(self, request, context):
        r = self.store.roster(self.clock())
        return pb.RosterReply(
            formed=r.formed,
            joined=r.joined,
            min_nodes=r.min_nodes,
            max_nodes=r.max_nodes,
            waited_s=r.waited_s,
            failed=r.failed,
            nodes=r.nodes,
            members=[
                pb.Host(rank=m.rank, advertise=m.advertise, hostname=m.hostname, key=bytes.fromhex(m.key))
                for m in r.members
            ],
        )


def serve(store: Store, listen: str, *, token: str | None, tls: security.TLSFiles | None = None) -> grpc.Server | None:
    """Serve ``store`` on ``listen``; None when this host cannot listen there (another host serves it).

    ``token``: the run's access token (None: an insecure run); ``tls``: serve over TLS, requiring
    client certificates signed by ``tls.ca`` when ``tls.mutual``.
    """
    if not _can_bind(listen):  # asked first, so that gRPC logs no error for the hosts that only call it
        return None
    server = guard.make_server(_LIMITS, token, name="zeroth-rendezvous")
    pb_grpc.add_RendezvousServicer_to_server(_Servicer(store), server)
    port = security.add_port(server, listen, tls)
    if port == 0:
        server.stop(0)
        return None
    server.start()
    return server


def _can_bind(listen: str) -> bool:
    host, port = split_address(listen)
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    try:
        with socket.socket(family, socket.SOCK_STREAM) as s:
            s.bind((host, port))
    except OSError:  # not this host's address, or already served
        return False
    return True


class Client:
    """Calls to the rendezvous at ``address`` (``HOST:PORT``) with the run's access ``token``."""

    def __init__(self, address: str, *, token: str | None, tls: security.TLSFiles | None = None):
        self.address = address
        self._channel = security.open_channel(address, channels.channel_options(MAX_MESSAGE_BYTES), tls)
        self._stub = pb_grpc.RendezvousStub(self._channel)
        self._metadata = security.token_metadata(token)
        self.nonce = secrets.token_bytes(16)

    def join(
        self,
        *,
        config_digest: str,
        version: str,
        advertise: str,
        node_rank: int,
        hostname: str,
        deadline: float,
        poll_s: float = 0.5,
        key: bytes = b"",
    ) -> tuple[int, bool]:
        """Join, retrying while the rendezvous cannot be reached, until ``deadline`` (``time.monotonic``);
        ``key``: the public key of the process this host starts (the roster carries it).

        Raises:
          Refused: the store refused this host (its reason), or the rendezvous could not be reached
            before ``deadline`` (code ``UNAVAILABLE``, with gRPC's last error).
        """
        req = pb.HostJoin(
            config_digest=config_digest,
            version=version,
            advertise=advertise,
            node_rank=node_rank,
            hostname=hostname,
            nonce=self.nonce,
            key=key,
        )
        reply = self._call(self._stub.Join, req, deadline, poll_s)
        return reply.rank, reply.late

    def roster(self, deadline: float, poll_s: float = 0.5) -> Roster:
        """One read of the roster (retrying an unreachable rendezvous until ``deadline``)."""
        r = self._call(self._stub.Roster, pb.RosterQuery(nonce=self.nonce), deadline, poll_s)
        return Roster(
            r.formed,
            tuple(Member(m.rank, m.advertise, m.hostname, bytes(m.key).hex()) for m in r.members),
            r.joined,
            r.min_nodes,
            r.max_nodes,
            r.waited_s,
            r.failed,
            r.nodes,
        )

    def wait_formed(self, deadline: float, poll_s: float = 0.5, progress=None) -> Roster:
        """Poll the roster until it is formed or failed; ``progress(roster)`` is called on each change of ``joined``.

        Raises:
          Refused: the run failed to form (``FAILED_PRECONDITION`` with the store's reason), or the
            rendezvous stopped answering until ``deadline``.
        """
        seen = -1
        while True:
            r = self.roster(deadline, poll_s)
            if r.failed:
                raise Refused("FAILED_PRECONDITION", r.failed)
            if r.formed:
                return r
            if progress is not None and r.joined != seen:
                seen = r.joined
                progress(r)
            if time.monotonic() > deadline:
                raise Refused(
                    "DEADLINE_EXCEEDED",
                    f"the rendezvous at {self.address} formed no run by the deadline "
                    f"({r.joined} of {r.min_nodes} hosts joined)",
                )
            time.sleep(poll_s)

    def _call(self, method, request, deadline: float, poll_s: float):
        last = None
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                raise Refused(
                    "UNAVAILABLE",
                    f"cannot reach the rendezvous at {self.address}: "
                    f"{last.code().name + ': ' + str(last.details()) if last else 'no answer'}; check the "
                    "address, that the rendezvous host's launcher runs, and that its port is open",
                )
            try:
                return method(request, metadata=self._metadata, timeout=min(10.0, max(0.5, left)))
            except grpc.RpcError as e:
                if e.code() in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED):
                    last = e
                    time.sleep(min(poll_s, max(0.0, deadline - time.monotonic())))
                    continue
                raise Refused(e.code().name, str(e.details())) from None

    def close(self) -> None:
        self._channel.close()


def split_address(address: str) -> tuple[str, int]:
    """``("host", port)`` of ``HOST:PORT`` (``[v6]:PORT`` too); port 0 when there is none.

    Example:
      >>> split_address("10.0.0.1:7000"), split_address("[::1]:80"), split_address("host")
      (('10.0.0.1', 7000), ('::1', 80), ('host', 0))
    """
    host, sep, port = address.rpartition(":")
    if not sep or not port.isdigit() or (host.count(":") and not host.startswith("[")):
        return address, 0
    return host.strip("[]"), int(port)


def route_source(address: str) -> str:
    """This host's address on the route to ``address`` (``HOST:PORT``): what the others reach it at.

    Nothing is sent: a UDP socket is connected, which only asks the kernel for the route.
    """
    host, port = split_address(address)
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    info = socket.getaddrinfo(host, port or 1, family, socket.SOCK_DGRAM)
    with socket.socket(family, socket.SOCK_DGRAM) as s:
        s.connect(info[0][4])
        return s.getsockname()[0]
