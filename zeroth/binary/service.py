"""gRPC servicer of the sparse-mutation parameter server: decode, call :mod:`zeroth.binary.protocol`, encode.

The server is :func:`zeroth.transport.guard.make_server`'s, bounded by :func:`limits`; with the
run's access token, a call without it is refused before anything of it is read. With the run
secret, a first ``Join`` must also prove that the joiner holds it, bound to the key it commits
(:func:`zeroth.transport.identity.join_proof` over the run id and :data:`JOIN_ADDRESS`). Signed
requests that are not lists (rejoins, result requests) carry a sequence number; a number seen
before is refused (:class:`zeroth.transport.identity.ReplayGuard`).

:class:`Server` owns the state and a lock; each RPC decodes its message, calls the pure function
with ``time.monotonic()``, and encodes the reply. :class:`zeroth.binary.protocol.Rejected`
becomes ``context.abort(StatusCode.<code>, message)``.

Example:
  >>> import numpy as np
  >>> from zeroth.binary import protocol as P
  >>> cfg = P.ServerConfig(run_id="r", c_in=2, c_out=1, ternary=False, k=1, rounds=1)
  >>> srv = Server(cfg, np.ones((1, 18), np.int8), np.zeros(1, np.int32))
  >>> port = srv.start("127.0.0.1:0"); srv.stop()
"""

from __future__ import annotations

import threading
import time

import grpc
import numpy as np

from zeroth.binary import protocol as P
from zeroth.binary.proto import binary_pb2 as pb
from zeroth.binary.proto import binary_pb2_grpc as pbg
from zeroth.transport import channels, guard, identity, security

__all__ = [
    "JOIN_ADDRESS",
    "MAX_MESSAGE_BYTES",
    "CHANNEL_OPTIONS",
    "SERVER_OPTIONS",
    "Server",
    "limits",
    "encode_deltas",
    "decode_deltas",
    "encode_result",
    "decode_result",
]

MAX_MESSAGE_BYTES = 64 << 20  # a model or a round's mutations; larger messages are refused (RESOURCE_EXHAUSTED)
CHANNEL_OPTIONS = channels.channel_options(MAX_MESSAGE_BYTES)  # with keepalive: a frozen server ends a worker's call
SERVER_OPTIONS = channels.server_options(MAX_MESSAGE_BYTES)
JOIN_ADDRESS = "zeroth-binary-worker"  # what a worker's join proof binds besides the run id and its key


def encode_deltas(d: P.DeltaList) -> pb.DeltaList:
    return pb.DeltaList(
        run_id=d.run_id,
        worker_id=d.worker_id,
        round=d.round,
        index=[int(i) for i in d.index],
        delta=[float(x) for x in d.delta],
        checksum=d.checksum,
        examples=d.examples,
        loss=d.loss,
        signature=d.signature,
    )


def decode_deltas(m: pb.DeltaList) -> P.DeltaList:
    return P.DeltaList(
        m.run_id,
        m.worker_id,
        m.round,
        np.asarray(m.index, np.int64),
        np.asarray(m.delta, np.float32),
        m.checksum,
        m.examples,
        m.loss,
        bytes(m.signature),
    )


def encode_result(r: P.RoundResult) -> pb.RoundResult:
    return pb.RoundResult(
        ready=r.ready,
        round=r.round,
        mutations=list(r.mutations),
        checksum=r.checksum,
        contributors=list(r.contributors),
        dropped=list(r.dropped),
        finished=r.finished,
    )


def decode_result(m: pb.RoundResult) -> P.RoundResult:
    return P.RoundResult(
        m.ready, m.round, tuple(m.mutations), m.checksum, tuple(m.contributors), tuple(m.dropped), m.finished
    )


def limits(cfg: P.ServerConfig) -> guard.Limits:
    """The server's bounds: messages sent up to :data:`MAX_MESSAGE_BYTES` (the model), received up
    to a list of ``cfg.max_entries`` mutations (an int64 varint and a float32 each, and the
    header); calls from every worker at once."""
    receive = min(MAX_MESSAGE_BYTES, 14 * cfg.max_entries + 4096)
    return guard.Limits(MAX_MESSAGE_BYTES, max_calls=32, max_calls_per_caller=32, max_receive_bytes=receive)


class Server(pbg.BinaryMutationsServicer):
    """The parameter server: state + lock + the three RPCs.

    ``on_round(r)``, if given, is called under the lock each time round ``r`` opens, before any
    worker can learn of it (the launcher kills and releases workers there, at an exact round).
    ``token``: the run's access token (:func:`zeroth.transport.identity.access_token`), which every
    call must carry (``UNAUTHENTICATED`` at once otherwise); None serves anyone (loopback tests).
    ``secret``: the run secret; a first join must then carry a proof of it bound to its key
    (``PERMISSION_DENIED`` otherwise). Without it, any caller that passes the token may join.
    """

    def __init__(
        self,
        cfg: P.ServerConfig,
        w,
        thresh,
        head=None,
        *,
        on_round=None,
        token: str | None = None,
        secret: str | None = None,
    ):
        self.cfg = cfg
        self.token = token
        self.secret = secret
        self._replays = identity.ReplayGuard()
        self._lock = threading.Lock()
        self.state = P.init_state(cfg, w, thresh, head=head, now=time.monotonic())
        self._grpc: grpc.Server | None = None
        self._on_round = on_round

    def _call(self, context, fn, replay: tuple | None = None):
        """``fn(state) -> (state, reply)`` under the lock; ``replay``: ``(worker, seq)`` of a signed
        request, refused if seen before (checked once ``fn`` accepted its signature)."""
        with self._lock:
            before = self.state.round
            try:
                state, reply = fn(self.state)
            except P.Rejected as e:
                context.abort(getattr(grpc.StatusCode, e.code), e.message)
            if replay is not None and not self._replays.accept(self.cfg.run_id, *replay):
                context.abort(
                    grpc.StatusCode.PERMISSION_DENIED,
                    f"worker {replay[0]}'s request number {replay[1]} was seen before (a replay)",
                )
            self.state = state
            if self._on_round is not None:
                for r in range(before + 1, self.state.round + 1):
                    self._on_round(r)
        return reply

    def Join(self, request, context):
        def fn(st):
            if request.rejoin:
                st, r = P.rejoin(
                    st,
                    self.cfg,
                    request.run_id,
                    request.worker_id,
                    request.seq,
                    request.signature,
                    now=time.monotonic(),
                )
            else:
                if self.secret is not None and not identity.check_join_proof(
                    self.secret, request.proof, self.cfg.run_id, JOIN_ADDRESS, request.key
                ):
                    raise P.Rejected(
                        "PERMISSION_DENIED",
                        "the join carries no valid proof of the run secret "
                        "(every process of the run needs the same ZEROTH_SECRET)",
                    )
                st, r = P.join(st, self.cfg, request.run_id, request.key, now=time.monotonic())
            return st, pb.JoinReply(
                worker_id=r.worker_id,
                round=r.round,
                model=r.model,
                checksum=r.checksum,
                n_mutations=r.n_mutations,
                max_entries=r.max_entries,
                finished=r.finished,
                model_round=r.model_round,
            )

        return self._call(context, fn, (request.worker_id, request.seq) if request.rejoin else None)

    def Submit(self, request, context):
        msg = decode_deltas(request)
        return self._call(
            context, lambda st: (P.submit(st, self.cfg, msg, now=time.monotonic()), pb.SubmitReply(accepted=True))
        )

    def Result(self, request, context):
        def fn(st):
            st, r = P.result(
                st,
                self.cfg,
                request.run_id,
                request.worker_id,
                request.round,
                request.seq,
                request.signature,
                now=time.monotonic(),
            )
            return st, encode_result(r)

        return self._call(context, fn, (request.worker_id, request.seq))

    def snapshot(self) -> P.ServerState:
        with self._lock:
            return self.state

    def start(self, address: str, tls: security.TLSFiles | None = None) -> int:
        """Serve on ``address`` (``host:0`` picks a port), over TLS with ``tls``; returns the port.

        Raises:
          OSError: ``address`` cannot be bound.
        """
        self._grpc = guard.make_server(limits(self.cfg), self.token, name="zeroth-binary")
        pbg.add_BinaryMutationsServicer_to_server(self, self._grpc)
        port = security.bind(self._grpc, address, tls)
        self._grpc.start()
        return port

    def stop(self) -> None:
        if self._grpc is not None:
            self._grpc.stop(grace=0.5).wait()
