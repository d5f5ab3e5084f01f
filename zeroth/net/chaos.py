"""Fault injection for tests and the chaos table (``scripts/chaos_peers.py``): a hostile member
(:class:`HostileMember`) and peer processes to kill, stop and restart (:class:`Cluster`).

:class:`HostileMember` holds valid credentials for ONE member of a run: it knows the run secret,
joins with an Ed25519 key of its own (so the commit admitting it puts that key into the view) and
serves a peer that acknowledges everything (so it is never removed as unreachable). It then sends
whatever it likes, signed with its own key: messages claiming to come from another member (they
must be refused), and messages as itself that break the protocol's rules (commits for future
iterations, huge ballots, outlier gradients).

Example (needs a running peer at ``address``):
  >>> h = HostileMember(secret="s", config_digest=digest)            # doctest: +SKIP
  >>> h.join(address); h.send(address, "PushGradients", h.push(0, iteration=5, payload=b"\\xff"))  # doctest: +SKIP
  ('UNAUTHENTICATED', 'push of machine 0 iteration 5: the signature is not machine 0's')
"""

from __future__ import annotations

import json
import signal
import subprocess
import time
from concurrent import futures
from pathlib import Path

import grpc

from zeroth.transport import identity as _id
from zeroth.net import launch
from zeroth.net import protocol as P
from zeroth.transport import security as _sec
from zeroth.net import wire
from zeroth.net.proto import peer_pb2 as pb
from zeroth.net.proto import peer_pb2_grpc as pb_grpc
from zeroth.net.transport import CHANNEL_OPTIONS, SERVER_OPTIONS, sign_request

__all__ = ["HostileMember", "Cluster", "wait_for"]


class _Acks(pb_grpc.PeerServicer):
    """Acknowledges everything, holds nothing."""

    def PushGradients(self, request, context):  # noqa: N802
        return pb.PushAck()

    def CommitIteration(self, request, context):  # noqa: N802
        return pb.CommitAck()

    def Prepare(self, request, context):  # noqa: N802
        return pb.PrepareReply(iteration=request.iteration)

    def Leave(self, request, context):  # noqa: N802
        return pb.LeaveResponse(iteration=request.iteration)

    def FetchLog(self, request, context):  # noqa: N802
        return pb.FetchLogReply()

    def Checksum(self, request, context):  # noqa: N802
        return pb.ChecksumReply(iteration=request.iteration)

    def Status(self, request, context):  # noqa: N802
        return pb.StatusReply(phase="member")


def wait_for(cond, timeout: float, poll: float = 0.05) -> bool:
    """Poll ``cond()`` every ``poll`` seconds for at most ``timeout`` seconds; its last value."""
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if cond():
            return True
        time.sleep(poll)
    return cond()


class HostileMember:
    """See the module docstring. ``secret`` None: an outsider without the secret."""

    def __init__(self, *, secret: str | None, config_digest: str, listen: str = "127.0.0.1:0"):
        self.secret = secret
        self.config_digest = config_digest
        self.identity = _id.Identity.generate()
        self.token = _id.access_token(secret) if secret else None
        self.metadata = _sec.token_metadata(self.token)
        self._server = grpc.server(futures.ThreadPoolExecutor(max_workers=4), options=list(SERVER_OPTIONS))
        pb_grpc.add_PeerServicer_to_server(_Acks(), self._server)
        port = self._server.add_insecure_port(listen)
        self._server.start()
        self.address = f"{listen.rpartition(':')[0]}:{port}"
        self.machine: int | None = None
        self.run_id = ""
        self._seq = 0
        self._channels: dict[str, grpc.Channel] = {}

    def close(self) -> None:
        self._server.stop(0).wait(5)
        for ch in self._channels.values():
            ch.close()

    def stub(self, address: str) -> pb_grpc.PeerStub:
        if address not in self._channels:
            self._channels[address] = grpc.insecure_channel(address, options=list(CHANNEL_OPTIONS))
        return pb_grpc.PeerStub(self._channels[address])

    def send(self, address: str, method: str, request, timeout: float = 10.0) -> tuple[str, str]:
        """Call ``method``; returns ``(status code name, details)`` (``("OK", "")`` when accepted)."""
        try:
            call = getattr(self.stub(address), method)
            if method == "FetchState":
                list(call(request, metadata=self.metadata, timeout=timeout))
            else:
                call(request, metadata=self.metadata, timeout=timeout)
        except grpc.RpcError as e:
            return e.code().name, e.details() or ""
        return "OK", ""

    def join(self, address: str, *, key_address: str | None = None, timeout: float = 60.0) -> int:
        """Join through ``address`` (following redirects) as this member; returns the machine id."""
        for _ in range(8):
            key = self.identity.public
            addr = key_address or self.address
            proof = _id.join_proof(self.secret, self.config_digest, addr, key) if self.secret else b""
            resp = self.stub(address).Join(
                pb.JoinRequest(config_digest=self.config_digest, address=addr, key=key, proof=proof),
                metadata=self.metadata,
                timeout=timeout,
            )
            if resp.redirect:
                address = resp.redirect
                continue
            self.machine, self.run_id = int(resp.machine_id), resp.run_id
            return self.machine
        raise RuntimeError(f"too many redirects joining through {address}")

    def join_request(self, address: str) -> pb.JoinRequest:
        """A valid join request (this member's key, proof of the secret) naming ``address``."""
        key = self.identity.public
        proof = _id.join_proof(self.secret, self.config_digest, address, key) if self.secret else b""
        return pb.JoinRequest(config_digest=self.config_digest, address=address, key=key, proof=proof)

    # -- messages, signed with THIS member's key whatever `sender` they claim

    def _sign(self, msg):
        return msg._replace(signature=self.identity.sign(P.signed_bytes(msg)))

    def chain(self, address: str, iteration: int) -> bytes:
        """The chain digest a push or commit of ``iteration`` must continue: that of the decision of
        ``iteration - 1`` in the log of the peer at ``address`` (b"" for a run's first iteration)."""
        if iteration == 0:
            return b""
        req = self.signed(
            "FetchLog",
            pb.FetchLogRequest(
                run_id=self.run_id, sender=self.machine, first_iteration=iteration - 1, last_iteration=iteration - 1
            ),
        )
        reply = self.stub(address).FetchLog(req, metadata=self.metadata, timeout=10)
        if not reply.entries:
            raise RuntimeError(f"the peer at {address} holds no decision of iteration {iteration - 1}")
        return P.chain_digest(wire.entry_from_pb(reply.entries[0]).commit)

    def push(self, sender: int, *, iteration: int, payload: bytes, previous: bytes = b"") -> pb.GradientPush:
        return wire.push_to_pb(
            self._sign(P.Push(self.run_id, sender, iteration, len(payload), payload, previous=previous))
        )

    def commit(
        self,
        sender: int,
        *,
        iteration: int,
        ballot: P.Ballot,
        view: P.View,
        contributors=(),
        payloads=(),
        previous: bytes = b"",
    ) -> pb.Commit:
        digest = P.updates_digest(contributors, payloads)
        return wire.commit_to_pb(
            self._sign(
                P.Commit(self.run_id, sender, iteration, ballot, tuple(contributors), digest, view, previous=previous)
            )
        )

    def prepare(
        self, sender: int, *, iteration: int, round: int, previous: bytes = b"", gone: bool = False
    ) -> pb.PrepareRequest:  # noqa: A002
        return wire.prepare_to_pb(
            self._sign(P.Prepare(self.run_id, sender, iteration, P.Ballot(round, sender), previous=previous, gone=gone))
        )

    def leave(self, sender: int, *, iteration: int) -> pb.LeaveRequest:
        return wire.leave_to_pb(self._sign(P.Leave(self.run_id, sender, iteration)))

    def signed(self, method: str, request, *, seq: int | None = None):
        """``request`` (log, checksum, state) signed with this member's key (a fresh ``seq`` unless given)."""
        if seq is None:
            self._seq += 1
            seq = self._seq
        return sign_request(self.identity, seq, method, request)


# --------------------------------------------------------------------------- peer processes


class Cluster:
    """``zeroth peer`` processes on 127.0.0.1 sharing one run secret, with fault injection.

    Args:
      config: the run's YAML file.
      root: folder for the peers' outputs (``p0``, ``p1``, ...), logs (``p0.log``) and ``run.secret``.
      extra: arguments added to every peer's command line.
    """

    def __init__(self, config, root, *, extra: tuple[str, ...] = ()):
        self.config = Path(config)
        self.root = Path(root)
        self.root.mkdir(parents=True, exist_ok=True)
        self.secret_file = _id.write_secret(self.root / "run.secret", _id.new_secret())
        self.extra = ("--secret-file", str(self.secret_file), "--linger", "1", *extra)
        self.peers: dict[str, launch.PeerProcess] = {}
        self.ports: dict[str, int] = {}

    def start(
        self, name: str, *, join: str | None = None, founders: int | None = None, port: int | None = None, args=()
    ) -> launch.PeerProcess:
        """Start peer ``name`` (founder without ``join``; ``join`` names another peer) on ``port`` (default: a free one)."""
        port = port or launch.free_ports(1)[0]
        self.ports[name] = port
        target = f"127.0.0.1:{self.ports[join]}" if join else None
        p = launch.start_peer(
            self.config,
            self.root / name,
            f"127.0.0.1:{port}",
            index=len(self.peers),
            join=target,
            founders=founders,
            extra_args=(*self.extra, *args),
        )
        self.peers[name] = p
        return p

    def records(self, name: str) -> list[dict]:
        recs, _ = launch.read_records(self.root / name / "metrics.jsonl")
        return [r for r in recs if r.get("kind") == "train"]

    def iteration(self, name: str) -> int:
        recs = self.records(name)
        return recs[-1]["step"] if recs else 0

    def wait_for(self, cond, timeout: float, poll: float = 0.2) -> bool:
        return wait_for(cond, timeout, poll)

    def signal(self, name: str, sig: int) -> None:
        self.peers[name].proc.send_signal(sig)

    def wait_exit(self, names, timeout: float) -> dict[str, int | None]:
        """Exit codes of ``names`` (None: still running after ``timeout``)."""
        end = time.monotonic() + timeout
        out = {}
        for n in names:
            try:
                out[n] = self.peers[n].proc.wait(max(0.1, end - time.monotonic()))
            except subprocess.TimeoutExpired:
                out[n] = None
        return out

    def summary(self, name: str) -> dict:
        path = self.root / name / "summary.json"
        return json.loads(path.read_text()) if path.exists() else {}

    def log(self, name: str) -> str:
        return self.peers[name].log.read_text(errors="replace")

    def stall_seconds(self, name: str) -> float:
        """The longest wall-clock gap between two consecutive applied iterations of ``name``."""
        times = [r["wall_time_s"] for r in self.records(name)]
        return max((b - a for a, b in zip(times, times[1:], strict=False)), default=0.0)

    def stop(self) -> None:
        for p in self.peers.values():
            if p.alive():
                p.proc.send_signal(signal.SIGCONT)
                p.proc.kill()
                p.proc.wait()
