"""Every networked system's gRPC server, guarded: no caller, with the run's token or without, can
hold one of its threads.

:func:`make_server` builds a ``grpc.Server`` with :class:`Limits` and :class:`GuardInterceptor`:

* a call without the run's token (or to a method the server does not serve) is refused at once,
  ``UNAUTHENTICATED`` (``UNIMPLEMENTED``), by a handler that reads nothing: its request body, however
  large, is never read into memory;
* at most ``max_calls`` calls at a time per server, with one thread each, and at most
  ``max_calls_per_caller`` per caller (the address a call comes from; processes on one host are
  one caller); beyond, ``RESOURCE_EXHAUSTED`` at once, before reading the request;
* a call waits for its caller at most ``body_s`` for a unary request's message and ``idle_s`` for
  each message of a stream, either way (the next request message, or the caller taking a
  response); past that the call is cancelled and its thread is free. Unary requests are read by
  the guard (the method is served as a stream of one message), so that the wait is bounded too;
* messages above ``max_receive_bytes`` are refused by gRPC (``RESOURCE_EXHAUSTED``); responses
  up to ``max_message_bytes``.

What a method does with its request (a ``Join`` held until a decision, a wait for a frame) is
bounded by its system's own timeouts.

Example:
  >>> limits = Limits(max_message_bytes=1 << 20, max_calls=8, max_calls_per_caller=4)
  >>> server = make_server(limits, token="t0ken")
  >>> server.stop(None).wait()
  True
"""

from __future__ import annotations

import contextlib
import dataclasses
import heapq
import itertools
import threading
import time
from concurrent import futures

import grpc

from zeroth.transport import channels, security

__all__ = ["GuardInterceptor", "Limits", "caller_of", "make_server"]


@dataclasses.dataclass(frozen=True)
class Limits:
    """A server's bounds (see the module docstring).

    Attributes:
      max_message_bytes: largest message sent (and received unless ``max_receive_bytes``).
      max_calls: concurrent calls per server (one thread each).
      max_calls_per_caller: concurrent calls from one caller address.
      body_s: longest wait for a unary request's message.
      idle_s: longest wait for each message of a stream (request or response).
      max_receive_bytes: largest message received (default: ``max_message_bytes``).
    """

    max_message_bytes: int
    max_calls: int = 64
    max_calls_per_caller: int = 32
    body_s: float = 10.0
    idle_s: float = 300.0
    max_receive_bytes: int | None = None

    def __post_init__(self):
        for name in ("max_calls", "max_calls_per_caller"):
            v = getattr(self, name)
            if not (isinstance(v, int) and v > 0):
                raise ValueError(f"Limits.{name}={v!r}: must be a positive number of calls")
        if self.max_calls_per_caller > self.max_calls:
            raise ValueError(
                f"Limits.max_calls_per_caller={self.max_calls_per_caller} exceeds max_calls={self.max_calls}: "
                "one caller can hold at most the server's calls"
            )
        for name in ("body_s", "idle_s"):
            v = getattr(self, name)
            if not v > 0:
                raise ValueError(f"Limits.{name}={v!r}: must be a positive number of seconds")
        channels.server_options(self.max_message_bytes, max_receive_bytes=self.max_receive_bytes)  # checks both


def caller_of(context) -> str:
    """The caller's address without its port (``ipv4:127.0.0.1:5123`` -> ``ipv4:127.0.0.1``)."""
    peer = context.peer() or ""
    head, sep, tail = peer.rpartition(":")
    return head if sep and tail.isdigit() else peer


class _Watchdog:
    """Cancels the calls whose armed deadline passed; one thread, alive while something is armed."""

    def __init__(self):
        self._cv = threading.Condition()
        self._heap: list = []
        self._live: dict[int, object] = {}
        self._ids = itertools.count()
        self._thread: threading.Thread | None = None

    def arm(self, seconds: float, context) -> int:
        with self._cv:
            key = next(self._ids)
            self._live[key] = context
            heapq.heappush(self._heap, (time.monotonic() + seconds, key))
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, daemon=True, name="zeroth-guard")
                self._thread.start()
            else:
                self._cv.notify()
            return key

    def disarm(self, key: int) -> None:
        with self._cv:
            self._live.pop(key, None)
            if not self._live:
                self._cv.notify()  # the thread ends

    def _run(self) -> None:
        while True:
            with self._cv:
                if not self._live:
                    self._heap.clear()  # only disarmed deadlines left
                while self._heap and self._heap[0][1] not in self._live:
                    heapq.heappop(self._heap)
                if not self._heap:
                    self._thread = None
                    return
                when, key = self._heap[0]
                wait = when - time.monotonic()
                if wait > 0:
                    self._cv.wait(wait)
                    continue
                heapq.heappop(self._heap)
                context = self._live.pop(key)
            context.cancel()  # wakes the thread blocked on this caller; the call ends CANCELLED

    @contextlib.contextmanager
    def armed(self, seconds: float, context):
        key = self.arm(seconds, context)
        try:
            yield
        finally:
            self.disarm(key)


def _deny(code: grpc.StatusCode, details: str) -> grpc.RpcMethodHandler:
    # A stream-stream handler: gRPC calls it without reading a request message (a unary handler
    # would first wait for the whole body in a server thread), and it ends the call at once.
    def deny(request_iterator, context):
        context.abort(code, details)

    return grpc.stream_stream_rpc_method_handler(deny)


class GuardInterceptor(grpc.ServerInterceptor):
    """Checks the token, refuses unknown methods, caps calls per caller and bounds waits on callers."""

    def __init__(self, limits: Limits, token: str | None = None):
        self.limits = limits
        self._token = token.encode() if token else None
        self._watchdog = _Watchdog()
        self._lock = threading.Lock()
        self._calls: dict[str, int] = {}
        self._open = 0
        self._unauthenticated = _deny(grpc.StatusCode.UNAUTHENTICATED, security.DENIED)

    def intercept_service(self, continuation, handler_call_details):
        if self._token is not None and not security.token_matches(
            handler_call_details.invocation_metadata, self._token
        ):
            return self._unauthenticated
        handler = continuation(handler_call_details)
        if handler is None:
            return None  # gRPC answers UNIMPLEMENTED from its own thread, reading nothing
        return self._wrap(handler)

    # -- per caller

    @contextlib.contextmanager
    def _admitted(self, context):
        who = caller_of(context)
        with self._lock:
            n = self._calls.get(who, 0)
            if n >= self.limits.max_calls_per_caller:
                refused = (
                    f"{who} already has {n} calls open on this server (at most {self.limits.max_calls_per_caller})"
                )
            elif self._open >= self.limits.max_calls:
                refused = f"this server already has {self._open} calls open (at most {self.limits.max_calls})"
            else:
                self._calls[who] = n + 1
                self._open += 1
                refused = None
        if refused is not None:
            context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, refused + ": try again when one ended")
        try:
            yield
        finally:
            with self._lock:
                self._open -= 1
                left = self._calls[who] - 1
                if left:
                    self._calls[who] = left
                else:
                    del self._calls[who]

    # -- bounded waits

    def _one_request(self, request_iterator, context):
        with self._watchdog.armed(self.limits.body_s, context):
            try:
                return next(request_iterator)
            except StopIteration:
                context.abort(grpc.StatusCode.INVALID_ARGUMENT, "this method takes exactly one request message")
            except grpc.RpcError:
                return None  # cancelled (no message within body_s) or the caller went away

    def _requests(self, request_iterator, context):
        while True:
            with self._watchdog.armed(self.limits.idle_s, context):
                try:
                    request = next(request_iterator)
                except StopIteration:
                    return
            yield request

    def _responses(self, responses, context):
        for response in responses:
            # The thread sends the response after the yield: resumed once the caller took it.
            with self._watchdog.armed(self.limits.idle_s, context):
                yield response

    def _wrap(self, handler: grpc.RpcMethodHandler) -> grpc.RpcMethodHandler:
        kw = {"request_deserializer": handler.request_deserializer, "response_serializer": handler.response_serializer}
        if handler.request_streaming:
            if handler.response_streaming:
                behavior = handler.stream_stream

                def stream_stream(request_iterator, context):
                    with self._admitted(context):
                        yield from self._responses(
                            behavior(self._requests(request_iterator, context), context), context
                        )

                return grpc.stream_stream_rpc_method_handler(stream_stream, **kw)
            behavior = handler.stream_unary

            def stream_unary(request_iterator, context):
                with self._admitted(context):
                    return behavior(self._requests(request_iterator, context), context)

            return grpc.stream_unary_rpc_method_handler(stream_unary, **kw)
        if handler.response_streaming:
            behavior = handler.unary_stream

            def unary_stream(request_iterator, context):
                with self._admitted(context):
                    request = self._one_request(request_iterator, context)
                    if request is None:
                        return
                    yield from self._responses(behavior(request, context), context)

            return grpc.stream_stream_rpc_method_handler(unary_stream, **kw)
        behavior = handler.unary_unary

        def unary_unary(request_iterator, context):
            with self._admitted(context):
                request = self._one_request(request_iterator, context)
                if request is None:
                    return None
                return behavior(request, context)

        return grpc.stream_unary_rpc_method_handler(unary_unary, **kw)


REFUSERS = 4  # threads beyond max_calls, for the refusals (each ends at once)


def make_server(limits: Limits, token: str | None = None, *, name: str = "zeroth-serve") -> grpc.Server:
    """A ``grpc.Server`` (not started) bounded by ``limits``; with ``token``, every call must carry it."""
    # One thread per admitted call and a few for refusals: a call refused (no token, over a cap)
    # runs a handler that ends at once, so a flood of them queues briefly and never fills the pool.
    return grpc.server(
        futures.ThreadPoolExecutor(max_workers=limits.max_calls + REFUSERS, thread_name_prefix=name),
        interceptors=[GuardInterceptor(limits, token)],
        options=list(channels.server_options(limits.max_message_bytes, max_receive_bytes=limits.max_receive_bytes)),
    )
