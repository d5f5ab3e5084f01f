"""The gRPC link between two stages, and the link emulation enforced on the bytes actually sent.

Stage ``s`` opens one bidirectional stream (``PipelineLink.Link``) to stage ``s + 1``: its
activation frames go out on the request stream, the gradient frames come back on the response
stream. Each direction has a :class:`zeroth.transport.pacing.Pacer` that releases the frames at the
link's bandwidth and holds each for its latency (the emulation, in the sending process, on the
real frames).

The servicer (:class:`LinkServicer`) runs on the downstream stage. It checks every incoming
activation frame against the schedule (:func:`zeroth.pipeline.wire.check_frame`, the expected
frames come from ``expect(step, micro)``) before handing it to the stage, and aborts the stream
with ``INVALID_ARGUMENT`` or ``FAILED_PRECONDITION`` and the reason when a frame is malformed or
out of order.

**Who the upstream is.** Every stage process has an Ed25519 key pair
(:class:`zeroth.transport.identity.Identity`). The stream a stage opens is signed
(:func:`zeroth.transport.identity.call_metadata` over :func:`link_fields`: the run and the link);
a servicer given the upstream stage's public key (``upstream_key``) refuses, before it reads
any frame, a stream not signed by that key (``PERMISSION_DENIED``; ``UNAVAILABLE`` while the key is
not known yet): a holder of the run secret that connects first cannot take the upstream slot.
A stream signed by that key with a higher sequence number replaces the link held (the real
upstream reconnecting over a stale connection): the old stream is cancelled, its reader stops
without closing the stage's inbox, and the new one carries on with the frames the stage expects
next. Without ``upstream_key`` the first authenticated stream holds the link and the others are
refused.

Server and channel options (message size limits) are defined here for the pipeline's own use.
"""

from __future__ import annotations

import math
import queue
import threading
import time
from collections.abc import Callable, Iterator

import grpc

from zeroth.pipeline import wire
from zeroth.pipeline.proto import pipeline_pb2_grpc as pb_grpc
from zeroth.transport import channels, guard, identity, security
from zeroth.transport.pacing import END, Pacer

__all__ = [
    "END",
    "CHANNEL_OPTIONS",
    "SERVER_OPTIONS",
    "MAX_MESSAGE_BYTES",
    "LinkClosed",
    "LinkServicer",
    "connect",
    "frame_bytes",
    "limits",
    "link_fields",
    "serve",
]

MAX_MESSAGE_BYTES = 256 * 1024 * 1024
CHANNEL_OPTIONS = channels.channel_options(MAX_MESSAGE_BYTES)  # with keepalive: a frozen stage ends the stream
SERVER_OPTIONS = channels.server_options(MAX_MESSAGE_BYTES)


class LinkClosed(RuntimeError):
    """The other end of a link went away, or refused a frame (the message says which and why)."""


def link_fields(run_id: str, link: int) -> tuple:
    """What the upstream stage of ``link`` signs when it opens the stream (:func:`connect`)."""
    return ("zeroth-pipeline-link-v1", run_id, int(link))


class _Stream:
    """One upstream stream the servicer accepted: its sequence number, context and stop flag."""

    def __init__(self, seq: int, context):
        self.seq, self.context = seq, context
        self.replaced = threading.Event()


class LinkServicer(pb_grpc.PipelineLinkServicer):
    """The downstream end of a link: checks activation frames into ``inbox``, streams gradients back.

    Args:
      expect: ``expect(step, micro) -> wire.Expected`` for the next activation.
      schedule: iterator of the ``(step, micro)`` pairs the stage will consume, in order.
      inbox: queue receiving the checked frames, then :data:`END` (or a :class:`LinkClosed`).
      pacer: the gradient direction's pacer (its frames are the response stream).
      upstream_key: ``upstream_key() -> bytes | None``, the public key of the upstream stage (None:
        not known yet); with it, only a stream signed by that key for ``link_fields(run_id, link)``
        is served (see the module docstring). None: the first authenticated stream is served.
      run_id, link: this link's run and index (the stage before this one).
    """

    def __init__(
        self,
        expect: Callable[[int, int], wire.Expected],
        schedule: Iterator[tuple[int, int]],
        inbox: queue.Queue,
        pacer: Pacer,
        *,
        upstream_key: Callable[[], bytes | None] | None = None,
        run_id: str = "",
        link: int = 0,
    ):
        self.expect, self.schedule, self.inbox, self.pacer = expect, schedule, inbox, pacer
        self.upstream_key, self.run_id, self.link = upstream_key, run_id, link
        self.connected = threading.Event()
        self.done = threading.Event()
        self.readers: list[threading.Thread] = []  # the stream readers: join them before the process exits
        self.refused: list[str] = []  # why streams were refused or replaced (for the stage's log)
        self._lock = threading.Lock()  # the current stream, and each frame's turn in the schedule
        self._current: _Stream | None = None

    def _accept(self, context) -> _Stream:
        """The stream of this call if it may be the link (the upstream's, or the first); aborts otherwise."""
        seq = 0
        if self.upstream_key is not None:
            try:
                want = self.upstream_key()
            except (OSError, ValueError) as e:
                context.abort(grpc.StatusCode.FAILED_PRECONDITION, f"stage {self.link}'s key cannot be read: {e}")
            if want is None:
                context.abort(grpc.StatusCode.UNAVAILABLE, f"stage {self.link}'s key is not known yet: try again")
            signer = identity.call_signer(context.invocation_metadata(), *link_fields(self.run_id, self.link))
            if signer is None or signer[0] != bytes(want):
                self.refused.append(f"a stream not signed by stage {self.link}'s key from {context.peer()}")
                context.abort(
                    grpc.StatusCode.PERMISSION_DENIED,
                    f"this stage takes its upstream link only from stage {self.link}: the stream must be "
                    f"signed by that stage's key",
                )
            seq = signer[1]
        with self._lock:
            old = self._current
            if old is not None:
                if self.upstream_key is None or seq <= old.seq:
                    context.abort(grpc.StatusCode.FAILED_PRECONDITION, "this stage already has an upstream link")
                old.replaced.set()  # the real upstream again, newer: it replaces the stale stream
                self.refused.append(f"stream {old.seq} replaced by stream {seq} of stage {self.link}")
            self._current = stream = _Stream(seq, context)
        if old is not None:
            old.context.cancel()
        return stream

    def _read(self, request_iterator, stream: _Stream) -> None:
        try:
            for frame in request_iterator:
                with self._lock:
                    if stream.replaced.is_set():
                        return
                    nxt = next(self.schedule, None)
                    if nxt is None:
                        raise wire.FrameError(
                            wire.PRECONDITION, f"frame for step {frame.step} after the last step of the run"
                        )
                    wire.check_frame(frame, self.expect(*nxt))
                    self.inbox.put(frame)
            if stream.replaced.is_set():
                return
            self.inbox.put(END)
        except wire.FrameError as e:
            self.inbox.put(LinkClosed(f"stage refused a frame from upstream: {e}"))
            self.pacer.fail(e)
        except grpc.RpcError as e:  # on the server side a cancelled stream raises a bare RpcError, without code()
            if stream.replaced.is_set():
                return  # its successor carries on
            code = e.code().name if callable(getattr(e, "code", None)) else "CANCELLED"
            self.inbox.put(LinkClosed(f"the upstream stage's stream broke: {code}"))
            self.pacer.close()
        except Exception as e:  # noqa: BLE001 - any other failure must reach the stage, not vanish with the thread
            if stream.replaced.is_set():
                return
            self.inbox.put(LinkClosed(f"reading the upstream stream failed: {type(e).__name__}: {e}"))
            self.pacer.fail(wire.FrameError(wire.INVALID, f"the stage could not take the frame: {e}"))

    def Link(self, request_iterator, context):
        stream = self._accept(context)
        self.connected.set()
        reader = threading.Thread(target=self._read, args=(request_iterator, stream), daemon=True)
        self.readers.append(reader)
        reader.start()
        try:
            yield from self.pacer.frames(stop=stream.replaced)
        except wire.FrameError as e:
            context.abort(getattr(grpc.StatusCode, e.code), str(e))
        finally:
            if not stream.replaced.is_set():
                self.done.set()


def frame_bytes(rows: int, row_shape: tuple[int, ...]) -> int:
    """A bound on one frame of ``rows`` examples of ``row_shape``: their values as float32 (the
    widest codec) twice over, for the ids, scales and header, and 64 KiB; at most
    :data:`MAX_MESSAGE_BYTES`.

    Example:
      >>> frame_bytes(4, (32, 64))
      131072
    """
    values = rows * math.prod(row_shape) * 4
    return min(MAX_MESSAGE_BYTES, 2 * values + (64 << 10))


def limits(idle_s: float, max_message_bytes: int = MAX_MESSAGE_BYTES) -> guard.Limits:
    """A stage's server bounds: one link is served (a few calls at most, all from one caller), each
    frame waited for at most ``idle_s`` (the stage's own wait for a frame), frames of at most
    ``max_message_bytes``."""
    return guard.Limits(max_message_bytes, max_calls=4, max_calls_per_caller=4, idle_s=idle_s)


def serve(
    servicer: LinkServicer,
    listen: str,
    token: str | None = None,
    *,
    bounds: guard.Limits | None = None,
    tls: security.TLSFiles | None = None,
) -> tuple[grpc.Server, int]:
    """Start a gRPC server for ``servicer`` on ``listen`` (``HOST:PORT``, port 0 = any); returns it and its port.

    With ``token`` (the run's access token, :func:`zeroth.transport.identity.access_token`), a
    stream that does not carry it is refused with ``UNAUTHENTICATED`` at once, before anything of
    it is read (:func:`zeroth.transport.guard.make_server`). ``bounds``: the server's
    :class:`~zeroth.transport.guard.Limits` (default :func:`limits` with a 300 s wait per frame);
    ``tls``: serve over TLS (mutual when ``tls.mutual``).
    """
    server = guard.make_server(bounds or limits(300.0), token, name="zeroth-link")
    pb_grpc.add_PipelineLinkServicer_to_server(servicer, server)
    port = security.bind(server, listen, tls)
    server.start()
    return server, port


def connect(
    address: str,
    pacer: Pacer,
    inbox: queue.Queue,
    timeout_s: float,
    readers: list[threading.Thread] | None = None,
    token: str | None = None,
    tls: security.TLSFiles | None = None,
    me: identity.Identity | None = None,
    run_id: str = "",
    link: int = 0,
    seq: int | None = None,
) -> grpc.Channel:
    """Open the stream to the downstream stage at ``address``: ``pacer``'s frames go out, gradients land in ``inbox``.

    ``token``: the run's access token, sent with the stream (a stage serving with a token refuses a
    stream without it: the reader then puts a :class:`LinkClosed` naming ``UNAUTHENTICATED``).
    ``me``: this stage's identity, which signs the stream for ``link_fields(run_id, link)`` with
    sequence number ``seq`` (default: the clock in nanoseconds, so a reconnection is newer).

    The thread reading the responses is appended to ``readers`` when given: a process should join
    it (:func:`join_readers`) after closing the channel and before it exits, since a daemon thread
    still inside gRPC's C++ code when the interpreter finalizes aborts the process.

    Raises:
      LinkClosed: the stage at ``address`` did not answer within ``timeout_s``.
    """
    channel = security.open_channel(address, CHANNEL_OPTIONS, tls)
    try:
        grpc.channel_ready_future(channel).result(timeout=timeout_s)
    except grpc.FutureTimeoutError:
        channel.close()
        raise LinkClosed(f"the next stage at {address} did not answer within {timeout_s:g}s") from None
    metadata = tuple(security.token_metadata(token) or ())
    if me is not None:
        metadata += identity.call_metadata(me, time.time_ns() if seq is None else seq, *link_fields(run_id, link))
    responses = pb_grpc.PipelineLinkStub(channel).Link(pacer.frames(), metadata=metadata or None)

    def read():
        try:
            for frame in responses:
                inbox.put(frame)
            inbox.put(END)
        except grpc.RpcError as e:
            inbox.put(LinkClosed(f"the link to the next stage at {address} closed: {e.code().name}: {e.details()}"))

    reader = threading.Thread(target=read, daemon=True)
    if readers is not None:
        readers.append(reader)
    reader.start()
    return channel


def join_readers(readers: list[threading.Thread], timeout_s: float = 5.0) -> None:
    """Wait (at most ``timeout_s`` in all) for the stream readers to end: call it once the server is
    stopped and the channel closed, which end their streams. Python's finalization would otherwise
    stop a reader still blocked in gRPC by unwinding its C++ frames, and the process aborts
    ("terminate called after throwing an instance of ''")."""
    deadline = time.monotonic() + timeout_s
    for t in readers:
        t.join(max(0.0, deadline - time.monotonic()))
