"""The gRPC face of a peer: thin servicers over :class:`zeroth.net.runtime.Node`.

Each method decodes the request (:mod:`zeroth.net.wire`), calls the node (which authenticates
it and runs the pure protocol under its lock) and encodes the answer. A refusal
(:class:`zeroth.net.protocol.Rejected`) becomes ``context.abort(StatusCode.<code>, message)``;
any other exception becomes ``INTERNAL`` with its message, and the peer carries on. The run's
access token is checked by :func:`zeroth.transport.guard.make_server`'s interceptor before any method runs;
the sender's signature by the protocol (pushes, commits, prepares, leaves) or by
:meth:`Node.authenticate <zeroth.net.runtime.Node.authenticate>` (log, checksum and state requests).
Every message received and sent is counted in the node's :class:`~zeroth.net.transport.Traffic`.
The gRPC options and size limits are :mod:`zeroth.net.transport`'s.
"""

from __future__ import annotations

import sys
import traceback

import grpc

from zeroth.net import protocol as P
from zeroth.transport import security as _sec
from zeroth.net import wire
from zeroth.net.proto import peer_pb2 as pb
from zeroth.net.proto import peer_pb2_grpc as pb_grpc
from zeroth.net.transport import SERVER_LIMITS, response_payload
from zeroth.transport import guard

__all__ = ["PeerService", "serve"]


class PeerService(pb_grpc.PeerServicer):
    """``zeroth.v1.Peer`` over a node (see the module docstring)."""

    def __init__(self, node):
        self.node = node

    # -- helpers

    def _received(self, request, payload: int = 0) -> None:
        self.node.traffic.received(wire.wire_size(request, kind="request", token=self.node.transport.token), payload)

    def _answer(self, response):
        self.node.traffic.sent(wire.wire_size(response, kind="response"), response_payload(response))
        return response

    def _run(self, context, fn, *args):
        try:
            return fn(*args)
        except P.Rejected as e:
            self.node.traffic.sent(wire.RESPONSE_OVERHEAD)
            self.node.refused(e.code)
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
            if len(request.key) > P.KEY_BYTES or len(request.proof) > 64 or len(request.address) > P.MAX_ADDRESS:
                raise P.Rejected("INVALID_ARGUMENT", "join request key, proof or address is too long")
            run_id, answer = self.node.handle_join(request)
            if isinstance(answer, P.Redirect):
                return pb.JoinResponse(run_id=run_id, redirect=answer.address)
            return pb.JoinResponse(
                run_id=run_id,
                config_digest=self.node.join_digest,
                iteration=answer.view.iteration,
                machine_id=answer.machine,
                view=wire.view_to_pb(answer.view),
                chain=answer.chain,
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
        self._received(request, sum(len(p) for p in request.relayed_payloads))

        def go():
            commit = self.node.commit_from_pb(request)
            if commit is None:  # a delta of a view this peer does not hold
                return pb.CommitAck(send_whole=True)
            payloads, signatures = wire.relay_from_pb(request)
            relays = wire.relay_order_from_pb(request) if payloads is not None else ()
            first = wire.relay_first_from_pb(request) if payloads is not None else 0
            reply = self.node.handle_commit(commit, payloads, signatures, relays, first)
            return pb.CommitAck(not_held=not reply.stored, previous=reply.previous)

        return self._answer(self._run(context, go))

    def Prepare(self, request, context):  # noqa: N802
        self._received(request)
        reply = self._run(context, lambda: self.node.handle_prepare(wire.prepare_from_pb(request)))
        return self._answer(wire.prepare_reply_to_pb(reply))

    def FetchLog(self, request, context):  # noqa: N802
        self._received(request)

        def go():
            return pb.FetchLogReply(entries=[wire.entry_to_pb(e) for e in self.node.handle_fetch_log(request)])

        return self._answer(self._run(context, go))

    def Checksum(self, request, context):  # noqa: N802
        self._received(request)

        def go():
            return pb.ChecksumReply(iteration=request.iteration, digest=self.node.handle_checksum(request))

        return self._answer(self._run(context, go))

    def GetManifest(self, request, context):  # noqa: N802
        self._received(request)

        def go():
            snap, view, sources = self.node.handle_manifest(request)
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

        chunks = self._run(context, lambda: self.node.handle_state(request))
        for i, (offset, data) in enumerate(chunks):
            msg = pb.StateChunk(offset=offset, data=data)
            self.node.traffic.sent(wire.wire_size(msg, kind="response" if i == 0 else "stream"))
            yield msg

    def Status(self, request, context):  # noqa: N802
        self._received(request)
        return self._answer(pb.StatusReply(**self.node.status()))


def serve(
    node,
    listen: str,
    *,
    tls: _sec.TLSFiles | None = None,
    token: str | None = None,
    limits: guard.Limits = SERVER_LIMITS,
) -> tuple[grpc.Server, int]:
    """Start a gRPC server for ``node`` on ``listen`` (``host:port``; port 0 picks one). Returns ``(server, port)``.

    ``token``: the access token every call must carry. Bounds: ``limits`` (default
    :data:`zeroth.net.transport.SERVER_LIMITS`; :func:`zeroth.transport.guard.make_server`).
    """
    server = guard.make_server(limits, token)
    pb_grpc.add_PeerServicer_to_server(PeerService(node), server)
    port = _sec.add_port(server, listen, tls)
    if port == 0:
        raise RuntimeError(f"could not listen on {listen}")
    server.start()
    return server, port
