"""A link's emulated bandwidth and latency, enforced on the bytes actually sent.

A :class:`Pacer` is one direction of a link: messages are queued, a :class:`TokenBucket`
releases them at the link's bandwidth (``8 · serialized bytes / bandwidth`` seconds each, bursts
of at most :data:`BURST_BYTES`), then each message is held for the link's latency before the
consumer (a gRPC stream, a sender thread) gets it. The emulation happens in the sending process,
on the real messages, so the receiver cannot use a message before a link of that bandwidth and
latency would have delivered it. Shared by the pipeline (AQ-SGD) and the clusters (Ravnest).
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

__all__ = ["BURST_BYTES", "END", "Pacer", "TokenBucket"]

BURST_BYTES = 64 * 1024
END = object()  # end of a stream, in inbox queues


def _nbytes(message) -> int:
    return message.ByteSize()


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

    def __init__(self, bandwidth_bps: float | None, latency_s: float = 0.0, nbytes: Callable[[Any], int] = _nbytes):
        self.bucket = TokenBucket(bandwidth_bps)
        self._nbytes = nbytes
        self.latency_s = float(latency_s)
        self._in: queue.Queue = queue.Queue()
        self._out: queue.Queue = queue.Queue()
        self._held = None  # an item taken by a consumer that stopped before delivering it
        self._take = threading.Lock()
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
            self.transfer_s += self.bucket.take(self._nbytes(item))
            self._out.put((time.monotonic() + self.latency_s, item))

    def submit(self, frame) -> int:
        """Queue ``frame`` (a protobuf message); returns its serialized size in bytes."""
        n = self._nbytes(frame)
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

    def _next(self, stop: threading.Event | None):
        item = None
        while item is None:
            with self._take:  # an item a stopped consumer took and left for us comes first
                item, self._held = self._held, None
            if item is None:
                if stop is not None and stop.is_set():
                    return None
                try:
                    item = self._out.get(timeout=0.05)
                except queue.Empty:
                    continue
        if stop is not None and stop.is_set():  # the next consumer delivers it
            with self._take:
                self._held = item
            return None
        return item

    def frames(self, stop: threading.Event | None = None) -> Iterator[Any]:
        """The frames as the emulated link delivers them; raises the error given to :meth:`fail`.

        ``stop``: once set, the generator ends without taking another frame (a later call of
        ``frames`` delivers the rest: how a replaced stream hands over to its successor).
        """
        while True:
            item = self._next(stop)
            if item is None:
                return
            if item is END:
                return
            if isinstance(item, BaseException):
                raise item
            ready, frame = item
            delay = ready - time.monotonic()
            if delay > 0:
                time.sleep(delay)
            yield frame
