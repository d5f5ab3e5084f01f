"""Calls that open and never send their body, and oversized messages, against a real server.

``Held(address, method, n, token)`` opens ``n`` calls to ``method`` (a full name,
``/zeroth.v1.Peer/Status``) whose request stream sends nothing until :meth:`Held.release`; on the
wire a unary call waiting for its body looks the same. :func:`send_raw` sends one message of
raw bytes, :func:`rss_bytes` reads a process's resident memory.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import threading
import time

import grpc

from zeroth.transport import security


class Held:
    """``n`` calls without a body, open until :meth:`release` (use as a context manager)."""

    def __init__(self, address: str, method: str, n: int, token: str | None = None):
        self._event = threading.Event()
        self.channel = grpc.insecure_channel(address)
        call = self.channel.stream_unary(method)  # no serializers: raw bytes
        md = security.token_metadata(token)
        self.futures = [call.future(self._nothing(), metadata=md) for _ in range(n)]

    def _nothing(self):
        self._event.wait(60.0)  # bounded even if the test forgets to release
        return
        yield  # a generator that yields nothing

    def codes(self, timeout_s: float) -> list:
        """Each call's status code once it ended, None for those still open after ``timeout_s``."""
        end = time.monotonic() + timeout_s
        out = []
        for f in self.futures:
            try:
                f.result(timeout=max(0.0, end - time.monotonic()))
                out.append(grpc.StatusCode.OK)
            except grpc.FutureTimeoutError:
                out.append(None)
            except grpc.RpcError as e:
                out.append(e.code())
        return out

    def release(self) -> None:
        self._event.set()
        for f in self.futures:
            f.cancel()
        self.channel.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.release()


def send_raw(address: str, method: str, data: bytes, token: str | None = None, timeout_s: float = 30.0):
    """Send ``data`` as one request message; the call's status code."""
    with grpc.insecure_channel(address, options=[("grpc.max_send_message_length", len(data) + 1024)]) as ch:
        try:
            ch.unary_unary(method)(data, metadata=security.token_metadata(token), timeout=timeout_s)
        except grpc.RpcError as e:
            return e.code()
    return grpc.StatusCode.OK


def rss_bytes(pid: str | int = "self") -> int:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("no VmRSS line")


def timed(fn) -> tuple[float, object]:
    t0 = time.perf_counter()
    out = fn()
    return time.perf_counter() - t0, out


_SENDER = textwrap.dedent(
    """
    import sys, grpc
    address, method, n, size = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
    data = b"x" * size
    with grpc.insecure_channel(address, options=[("grpc.max_send_message_length", size + 1024)]) as ch:
        call = ch.unary_unary(method)
        for _ in range(n):
            try:
                call(data, timeout=60)
                print("OK")
            except grpc.RpcError as e:
                print(e.code().name)
    """
)


def oversized_growth(address, method, n, size) -> tuple[int, list[str]]:
    """This process's RSS growth while another sends ``n`` unauthenticated messages of ``size`` bytes."""
    before = rss_bytes()
    out = subprocess.run(
        [sys.executable, "-c", _SENDER, address, method, str(n), str(size)],
        capture_output=True,
        text=True,
        check=False,
        timeout=120,
        env={**os.environ, "PYTHONPATH": ""},
    )
    return rss_bytes() - before, out.stdout.split()
