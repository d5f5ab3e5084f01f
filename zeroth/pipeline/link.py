"""The gRPC link between two stages, and the link emulation enforced on the bytes actually sent.

Stage ``s`` opens one bidirectional stream (``PipelineLink.Link``) to stage ``s + 1``: its
activation frames go out on the request stream, the gradient frames come back on the response
stream. Each direction has a :class:`Pacer`: frames are queued, a :class:`TokenBucket` releases
them at the link's bandwidth (``8 · serialized bytes / bandwidth`` seconds each, bursts of at most
:data:`BURST_BYTES`), then each frame is held for the link's latency before it is written to the
stream. This is the emulation: it happens in the sending process, on the real frames, so the
receiver cannot use a frame before a link of that bandwidth and latency would have delivered it.

The servicer (:class:`LinkServicer`) runs on the downstream stage. It checks every incoming
activation frame against the schedule (:func:`zeroth.pipeline.wire.check_frame`, the expected
frames come from ``expect(step, micro)``) before handing it to the stage, and aborts the stream
with ``INVALID_ARGUMENT`` or ``FAILED_PRECONDITION`` and the reason when a frame is malformed or
out of order.

Server and channel options (message size limits) are defined here for the pipeline's own use.
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable, Iterator

import grpc

from zeroth.pipeline import wire
from zeroth.pipeline.proto import pipeline_pb2 as pb
from zeroth.pipeline.proto import pipeline_pb2_grpc as pb_grpc

__all__ = [
    "BURST_BYTES",
    "END",
    "GRPC_OPTIONS",
    "MAX_MESSAGE_BYTES",
    "LinkClosed",
    "LinkServicer",
    "Pacer",
    "TokenBucket",
    "connect",
    "serve",
]

BURST_BYTES = 64 * 1024
MAX_MESSAGE_BYTES = 256 * 1024 * 1024
GRPC_OPTIONS = [("grpc.max_send_message_length", MAX_MESSAGE_BYTES), ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES)]
END = object()  # end of a stream, in inbox queues


class LinkClosed(RuntimeError):
    """The other end of a link went away, or refused a frame (the message says which and why)."""


class TokenBucket:
    """Bytes leave at ``bandwidth_bps / 8`` bytes per second, with bursts of at most ``burst`` bytes.

    ``take(n)`` removes ``n`` tokens (the bucket may go negative) and sleeps until the balance is
    back to zero: ``max(0, (n − tokens) / rate)`` seconds. ``bandwidth_bps=None`` never waits.
    """

    def __init__(self, bandwidth_bps: float | None, burst: int = BURST_BYTES, clock=time.monotonic, sleep=time.sleep):
        if bandwidth_bps is not None and not bandwidth_bps > 0:
            raise ValueError(f"bandwidth must be > 0 bits/s or None (unlimited), got {bandwidth_bps!r}")
        self.rate = None if bandwidth_bps is None else float(bandwidth_bps) / 8.0
        self.burst = float(burst)
        self.tokens = float(burst)
        self._clock, self._sleep = clock, sleep
        self._t = clock()

    def take(self, nbytes: int) -> float:
        """Spend ``nbytes``; returns the seconds slept."""
        if self.rate is None:
            return 0.0
        now = self._clock()
        self.tokens = min(self.burst, self.tokens + (now - self._t) * self.rate)
        self._t = now
        self.tokens -= nbytes
        if self.tokens >= 0:
            return 0.0
        wait = -self.tokens / self.rate
        self._sleep(wait)
        return wait


class Pacer:
    """One direction of a link: a queue of frames released at the bandwidth, each held for the latency.

    ``submit(frame)`` returns at once; ``frames()`` yields the frames when the emulated link
    delivers them (the generator a gRPC stream consumes); ``close()`` ends it after the queued frames.
    ``transfer_s`` accumulates the seconds the token bucket held frames back.
    """

    def __init__(self, bandwidth_bps: float | None, latency_s: float = 0.0):
        self.bucket = TokenBucket(bandwidth_bps)
        self.latency_s = float(latency_s)
        self._in: queue.Queue = queue.Queue()
        self._out: queue.Queue = queue.Queue()
        self.transfer_s = 0.0
        self.bytes = 0
        self.frames_sent = 0
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while True:
            item = self._in.get()
            if item is END or isinstance(item, BaseException):
                self._out.put(item)
                return
            self.transfer_s += self.bucket.take(wire.frame_nbytes(item))
            self._out.put((time.monotonic() + self.latency_s, item))

    def submit(self, frame: pb.TensorFrame) -> int:
        """Queue ``frame``; returns its serialized size in bytes."""
        n = wire.frame_nbytes(frame)
        self.bytes += n
        self.frames_sent += 1
        self._in.put(frame)
        return n

    def fail(self, error: BaseException) -> None:
        """End the stream with ``error`` (a servicer aborts with it)."""
        self._in.put(error)

    def close(self) -> None:
        """End the stream after the queued frames."""
        self._in.put(END)

    def frames(self) -> Iterator[pb.TensorFrame]:
        """The frames as the emulated link delivers them; raises the error given to :meth:`fail`."""
        while True:
            item = self._out.get()
            if item is END:
                return
            if isinstance(item, BaseException):
                raise item
            ready, frame = item
            delay = ready - time.monotonic()
            if delay > 0:
                time.sleep(delay)
            yield frame


class LinkServicer(pb_grpc.PipelineLinkServicer):
    """The downstream end of a link: checks activation frames into ``inbox``, streams gradients back.

    Args:
      expect: ``expect(step, micro) -> wire.Expected`` for the next activation.
      schedule: iterator of the ``(step, micro)`` pairs the stage will consume, in order.
      inbox: queue receiving the checked frames, then :data:`END` (or a :class:`LinkClosed`).
      pacer: the gradient direction's pacer (its frames are the response stream).
    """

    def __init__(self, expect: Callable[[int, int], wire.Expected], schedule: Iterator[tuple[int, int]],
                 inbox: queue.Queue, pacer: Pacer):
        self.expect, self.schedule, self.inbox, self.pacer = expect, schedule, inbox, pacer
        self.connected = threading.Event()
        self.done = threading.Event()
        self._busy = threading.Lock()

    def _read(self, request_iterator) -> None:
        try:
            for frame in request_iterator:
                nxt = next(self.schedule, None)
                if nxt is None:
                    raise wire.FrameError(wire.PRECONDITION, f"frame for step {frame.step} after the last step of the run")
                wire.check_frame(frame, self.expect(*nxt))
                self.inbox.put(frame)
            self.inbox.put(END)
        except wire.FrameError as e:
            self.inbox.put(LinkClosed(f"stage refused a frame from upstream: {e}"))
            self.pacer.fail(e)
        except grpc.RpcError as e:
            self.inbox.put(LinkClosed(f"the upstream stage's stream broke: {e.code().name}"))
            self.pacer.close()
        except Exception as e:  # noqa: BLE001 - any other failure must reach the stage, not vanish with the thread
            self.inbox.put(LinkClosed(f"reading the upstream stream failed: {type(e).__name__}: {e}"))
            self.pacer.fail(wire.FrameError(wire.INVALID, f"the stage could not take the frame: {e}"))

    def Link(self, request_iterator, context):
        if not self._busy.acquire(blocking=False):
            context.abort(grpc.StatusCode.FAILED_PRECONDITION, "this stage already has an upstream link")
        self.connected.set()
        reader = threading.Thread(target=self._read, args=(request_iterator,), daemon=True)
        reader.start()
        try:
            yield from self.pacer.frames()
        except wire.FrameError as e:
            context.abort(getattr(grpc.StatusCode, e.code), str(e))
        finally:
            self.done.set()


def serve(servicer: LinkServicer, listen: str) -> tuple[grpc.Server, int]:
    """Start a gRPC server for ``servicer`` on ``listen`` (``HOST:PORT``, port 0 = any); returns it and its port."""
    from concurrent import futures

    server = grpc.server(futures.ThreadPoolExecutor(max_workers=4), options=GRPC_OPTIONS)
    pb_grpc.add_PipelineLinkServicer_to_server(servicer, server)
    port = server.add_insecure_port(listen)
    if port == 0:
        raise OSError(f"cannot listen on {listen}")
    server.start()
    return server, port


def connect(address: str, pacer: Pacer, inbox: queue.Queue, timeout_s: float) -> grpc.Channel:
    """Open the stream to the downstream stage at ``address``: ``pacer``'s frames go out, gradients land in ``inbox``.

    Raises:
      LinkClosed: the stage at ``address`` did not answer within ``timeout_s``.
    """
    channel = grpc.insecure_channel(address, options=GRPC_OPTIONS)
    try:
        grpc.channel_ready_future(channel).result(timeout=timeout_s)
    except grpc.FutureTimeoutError:
        channel.close()
        raise LinkClosed(f"the next stage at {address} did not answer within {timeout_s:g}s") from None
    responses = pb_grpc.PipelineLinkStub(channel).Link(pacer.frames())

    def read():
        try:
            for frame in responses:
                inbox.put(frame)
            inbox.put(END)
        except grpc.RpcError as e:
            inbox.put(LinkClosed(f"the link to the next stage at {address} closed: {e.code().name}: {e.details()}"))

    threading.Thread(target=read, daemon=True).start()
    return channel
