"""The gRPC face of a peer: thin servicers over :class:`zeroth.net.runtime.Node`.

Each method decodes the request (:mod:`zeroth.net.wire`), calls the node (which runs the pure
protocol under its lock) and encodes the answer. A refusal of the protocol
(:class:`zeroth.net.protocol.Rejected`) becomes ``context.abort(StatusCode.<code>, message)``;
any other exception becomes ``INTERNAL`` with its message, and the peer carries on. The shared
token is checked by :class:`zeroth.net.security.TokenInterceptor` before any method runs.
Every message received and sent is counted in the node's :class:`~zeroth.net.runtime.Traffic`.
"""

from __future__ import annotations

import sys
import traceback
from concurrent import futures

import grpc

from zeroth.net import protocol as P
from zeroth.net import security as _sec
from zeroth.net import wire
from zeroth.net.proto import peer_pb2 as pb
from zeroth.net.proto import peer_pb2_grpc as pb_grpc

__all__ = ["PeerService", "serve", "response_payload", "SERVER_THREADS", "MAX_MESSAGE_BYTES"]

SERVER_THREADS = 32
MAX_MESSAGE_BYTES = 4 * 1024 * 1024  # larger messages are refused by gRPC (RESOURCE_EXHAUSTED)


class PeerService(pb_grpc.PeerServicer):
    """``zeroth.v1.Peer`` over a node (see the module docstring)."""

    def __init__(self, node):
        self.node = node

    # -- helpers

    def _received(self, request, payload: int = 0) -> None:
        self.node.traffic.received(wire.wire_size(request, kind="request", token=self.node.options.token), payload)

    def _answer(self, response):
        self.node.traffic.sent(wire.wire_size(response, kind="response"), response_payload(response))
        return response

    def _run(self, context, fn, *args):
        try:
            return fn(*args)
        except P.Rejected as e:
            self.node.traffic.sent(wire.RESPONSE_OVERHEAD)
            context.abort(getattr(grpc.StatusCode, e.code, grpc.StatusCode.INVALID_ARGUMENT), e.message)
        except Exception as e:  # noqa: BLE001  (a bad request must never take the peer down)
            traceback.print_exc(file=sys.stderr)
            context.abort(grpc.StatusCode.INTERNAL, f"{type(e).__name__}: {e}")

    # -- methods (names are the proto's)

    def Join(self, request, context):  # noqa: N802
        self._received(request)

        def go():
            if len(request.config_digest) > wire.MAX_CONFIG_DIGEST:
                raise P.Rejected("INVALID_ARGUMENT", f"config_digest has {len(request.config_digest)} characters")
            run_id, answer = self.node.handle_join(request.address, request.config_digest)
            if isinstance(answer, P.Redirect):
                return pb.JoinResponse(run_id=run_id, redirect=answer.address)
            return pb.JoinResponse(
                run_id=run_id,
                config_digest=self.node.join_digest,
                iteration=answer.view.iteration,
                machine_id=answer.machine,
                view=wire.view_to_pb(answer.view),
            )

        return self._answer(self._run(context, go))

    def Leave(self, request, context):  # noqa: N802
        self._received(request)
        it = self._run(context, lambda: self.node.handle_leave(wire.leave_from_pb(request)))
        return self._answer(pb.LeaveResponse(iteration=it))

    def PushGradients(self, request, context):  # noqa: N802
        self._received(request, len(request.payload))
        self._run(context, lambda: self.node.handle_push(wire.push_from_pb(request)))
        return self._answer(pb.PushAck())

    def CommitIteration(self, request, context):  # noqa: N802
        self._received(request)
        self._run(context, lambda: self.node.handle_commit(wire.commit_from_pb(request)))
        return self._answer(pb.CommitAck())

    def Prepare(self, request, context):  # noqa: N802
        self._received(request)
        reply = self._run(context, lambda: self.node.handle_prepare(wire.prepare_from_pb(request)))
        return self._answer(wire.prepare_reply_to_pb(reply))

    def FetchLog(self, request, context):  # noqa: N802
        self._received(request)

        def go():
            self.node.check_run(request.run_id)
            entries = self.node.handle_fetch_log(int(request.sender), int(request.first_iteration), int(request.last_iteration))
            return pb.FetchLogReply(entries=[wire.entry_to_pb(e) for e in entries])

        return self._answer(self._run(context, go))

    def Checksum(self, request, context):  # noqa: N802
        self._received(request)

        def go():
            self.node.check_run(request.run_id)
            digest = self.node.handle_checksum(int(request.sender), int(request.iteration), bytes(request.digest))
            return pb.ChecksumReply(iteration=request.iteration, digest=digest)

        return self._answer(self._run(context, go))

    def GetManifest(self, request, context):  # noqa: N802
        self._received(request)

        def go():
            self.node.check_run(request.run_id)
            snap, view, sources = self.node.handle_manifest(int(request.sender))
            return pb.StateManifest(
                run_id=request.run_id,
                iteration=snap.iteration,
                digest=bytes.fromhex(snap.digest),
                total_bytes=len(snap.blob),
                leaves=[
                    pb.LeafInfo(path=lf.path, dtype=lf.dtype, shape=list(lf.shape), offset=lf.offset, nbytes=lf.nbytes)
                    for lf in snap.leaves
                ],
                view=wire.view_to_pb(view),
                sources=sources,
            )

        return self._answer(self._run(context, go))

    def FetchState(self, request, context):  # noqa: N802
        self._received(request)

        def go():
            self.node.check_run(request.run_id)
            return self.node.handle_state(int(request.sender), int(request.iteration), int(request.offset), int(request.length))

        chunks = self._run(context, go)
        for i, (offset, data) in enumerate(chunks):
            msg = pb.StateChunk(offset=offset, data=data)
            self.node.traffic.sent(wire.wire_size(msg, kind="response" if i == 0 else "stream"))
            yield msg

    def Status(self, request, context):  # noqa: N802
        self._received(request)
        return self._answer(pb.StatusReply(**self.node.status()))


def response_payload(response) -> int:  # noqa: N802
    """Projected-gradient bytes a response carries (log entries and takeover replies)."""
    if isinstance(response, pb.FetchLogReply):
        return sum(len(g.payload) for e in response.entries for g in e.gradients)
    if isinstance(response, pb.PrepareReply):
        return sum(len(g.payload) for g in response.gradients) + sum(len(g.payload) for g in response.decided.gradients)
    return 0


def serve(node, listen: str, *, tls: _sec.TLSFiles | None = None, token: str | None = None) -> tuple[grpc.Server, int]:
    """Start a gRPC server for ``node`` on ``listen`` (``host:port``; port 0 picks one). Returns ``(server, port)``.

    Messages above :data:`MAX_MESSAGE_BYTES` are refused (``RESOURCE_EXHAUSTED``);
    ``SO_REUSEPORT`` is off so two peers can never share a port by accident.
    """
    interceptors = [_sec.TokenInterceptor(token)] if token else []
    server = grpc.server(
        futures.ThreadPoolExecutor(max_workers=SERVER_THREADS, thread_name_prefix="zeroth-serve"),
        interceptors=interceptors,
        options=[
            ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
            ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
            ("grpc.so_reuseport", 0),
        ],
    )
    pb_grpc.add_PeerServicer_to_server(PeerService(node), server)
    if tls is not None:
        port = server.add_secure_port(listen, _sec.server_credentials(tls))
    else:
        port = server.add_insecure_port(listen)
    if port == 0:
        raise RuntimeError(f"could not listen on {listen}")
    server.start()
    return server, port
