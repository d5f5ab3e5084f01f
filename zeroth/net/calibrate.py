"""Measure the bytes gRPC puts on the wire around our messages: ``python -m zeroth.net.calibrate [--json]``.

A TCP relay on 127.0.0.1 counts every byte between a client and a ``Peer`` server in each
direction while the client makes ``--calls`` unary ``PushGradients`` calls with a 16-byte payload
(after ``--warmup`` calls, so HPACK tables and flow-control windows are warm, as in a run).
The framing overhead per message is ``(bytes counted - serialized sizes) / calls`` per direction;
:data:`zeroth.net.wire.REQUEST_OVERHEAD` and :data:`~zeroth.net.wire.RESPONSE_OVERHEAD` are these
numbers, rounded. The second row shows the cost of the shared token in the metadata.

Example:
  $ python -m zeroth.net.calibrate
"""

from __future__ import annotations

import argparse
import json
import math
import socket
import sys
import threading
from concurrent import futures

import grpc

from zeroth.net.proto import peer_pb2 as pb
from zeroth.net.proto import peer_pb2_grpc as pb_grpc
from zeroth.net.transport import CHANNEL_OPTIONS, SERVER_OPTIONS

__all__ = ["ByteRelay", "measure", "main"]


class ByteRelay:
    """A TCP relay ``127.0.0.1:port -> target`` that counts the bytes in each direction."""

    def __init__(self, target_port: int):
        self.target_port = target_port
        self.up = 0  # client -> server
        self.down = 0  # server -> client
        self._lock = threading.Lock()
        self._sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self._sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._sock.bind(("127.0.0.1", 0))
        self._sock.listen(8)
        self.port = self._sock.getsockname()[1]
        self._stop = False
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self):
        while not self._stop:
            try:
                client, _ = self._sock.accept()
            except OSError:
                return
            server = socket.create_connection(("127.0.0.1", self.target_port))
            threading.Thread(target=self._pipe, args=(client, server, "up"), daemon=True).start()
            threading.Thread(target=self._pipe, args=(server, client, "down"), daemon=True).start()

    def _pipe(self, src, dst, direction):
        try:
            while True:
                data = src.recv(65536)
                if not data:
                    break
                with self._lock:
                    setattr(self, direction, getattr(self, direction) + len(data))
                dst.sendall(data)
        except OSError:
            pass
        finally:
            for s in (src, dst):
                try:
                    s.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass

    def snapshot(self) -> tuple[int, int]:
        with self._lock:
            return self.up, self.down

    def close(self):
        self._stop = True
        self._sock.close()


class _Echo(pb_grpc.PeerServicer):
    def PushGradients(self, request, context):  # noqa: N802 (gRPC method name)
        return pb.PushAck()


def measure(calls: int = 200, warmup: int = 20, payload: int = 16, token: str | None = None) -> dict:
    """Per-message framing bytes of unary ``PushGradients`` calls (see the module docstring)."""
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2), options=list(SERVER_OPTIONS))  # the peers' options
    pb_grpc.add_PeerServicer_to_server(_Echo(), server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    relay = ByteRelay(port)
    channel = grpc.insecure_channel(f"127.0.0.1:{relay.port}", options=list(CHANNEL_OPTIONS))
    stub = pb_grpc.PeerStub(channel)
    req = pb.GradientPush(
        run_id="calibrate-0123456789abcdef", sender=3, iteration=1234, count=payload, payload=b"\x81" * payload
    )
    metadata = (("x-zeroth-token", token),) if token else None
    try:
        for _ in range(warmup):
            stub.PushGradients(req, timeout=10, metadata=metadata)
        up0, down0 = relay.snapshot()
        for _ in range(calls):
            stub.PushGradients(req, timeout=10, metadata=metadata)
        up1, down1 = relay.snapshot()
    finally:
        channel.close()
        server.stop(0)
        relay.close()
    req_size = req.ByteSize()
    resp_size = pb.PushAck().ByteSize()
    up = (up1 - up0) / calls
    down = (down1 - down0) / calls
    return {
        "calls": calls,
        "token": bool(token),
        "request_serialized": req_size,
        "response_serialized": resp_size,
        "request_on_wire": up,
        "response_on_wire": down,
        "request_overhead": up - req_size,
        "response_overhead": down - resp_size,
        "mean_overhead": math.ceil(((up - req_size) + (down - resp_size)) / 2),
    }


def main(argv: list[str] | None = None) -> int:
    """Print the measured overheads (table, or JSON with ``--json``)."""
    ap = argparse.ArgumentParser(prog="python -m zeroth.net.calibrate", description=__doc__.splitlines()[0])
    ap.add_argument("--calls", type=int, default=200)
    ap.add_argument("--warmup", type=int, default=20)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)
    rows = [measure(args.calls, args.warmup), measure(args.calls, args.warmup, token="t" * 32)]
    if args.json:
        print(json.dumps(rows, indent=2))
        return 0
    print(
        f"{'token':>6} {'req ser':>8} {'req wire':>9} {'resp ser':>9} {'resp wire':>10} {'req ovh':>8} {'resp ovh':>9} {'mean':>6}"
    )
    for r in rows:
        print(
            f"{str(r['token']):>6} {r['request_serialized']:>8} {r['request_on_wire']:>9.1f} {r['response_serialized']:>9}"
            f" {r['response_on_wire']:>10.1f} {r['request_overhead']:>8.1f} {r['response_overhead']:>9.1f} {r['mean_overhead']:>6}"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
