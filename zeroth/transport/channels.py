"""The gRPC options of every channel and server of a networked system: message limits, one port
per server, keepalive pings so that a call to a peer that stopped answering ends, and reconnection
attempts at most :data:`MAX_RECONNECT_BACKOFF_S` apart so that a peer restarted on its address is
reached again within about that long.

A call can wait a long time without data and be right to: a ``Join`` held until it is decided, a
state transfer, a pipeline or cluster stream between frames. Without keepalive, such a call to a
peer whose process froze or whose host vanished (the TCP connection still open, nothing read)
waits for its deadline, minutes. With :func:`channel_options`, a channel with an open call sends
an HTTP/2 ping after :data:`KEEPALIVE_S` without news and, if the ping is not answered within
:data:`KEEPALIVE_TIMEOUT_S`, drops the connection: its calls end with ``UNAVAILABLE`` ("ping
timeout"), and the caller's usual retry takes over. The pings are answered by gRPC's own threads,
so a peer that is busy (compiling, holding the GIL for a while) still answers them. An idle
channel sends none. The pings (HTTP/2 frames of 17 bytes) are not in any byte count.

Servers made with :func:`server_options` accept a ping every :data:`MIN_PING_INTERVAL_S` or slower
from a client with an open call (with gRPC's default, one per 5 minutes, a server answers a few
early pings with ``GOAWAY`` "too many pings" and the call fails) and never share a port (``SO_REUSEPORT`` off).

A channel whose peer went away fails its calls at once with ``UNAVAILABLE`` and tries to connect
again after a back-off that gRPC doubles (about 1.6x) per failed attempt, up to two minutes by
default; until the next attempt, every call fails with the last error, even once a new process
serves the address. Measured on 127.0.0.1 (a channel making calls while its server was down 15 s,
then a new server on the same port): calls went on failing for 0.2–12.3 s (8 runs; it depends on
where the back-off stood) with gRPC's default, 0.03–1.1 s (11 runs) with these options. A Just One
Byte joiner restarted on its port was removed again as unreachable in that window (three failed
commits); the peers' transport also renews its channel to an address where a peer (re)joins
(:meth:`zeroth.net.transport.Transport.renew`), whose next call then goes through at once.

Example:
  >>> opts = dict(channel_options(4 * 1024 * 1024))
  >>> opts["grpc.keepalive_time_ms"], opts["grpc.http2.ping_timeout_ms"]
  (10000, 10000)
  >>> opts["grpc.max_reconnect_backoff_ms"]
  1000
  >>> dict(server_options(4 * 1024 * 1024))["grpc.so_reuseport"]
  0
"""

from __future__ import annotations

__all__ = [
    "KEEPALIVE_S",
    "KEEPALIVE_TIMEOUT_S",
    "MIN_PING_INTERVAL_S",
    "MAX_RECONNECT_BACKOFF_S",
    "channel_options",
    "server_options",
]

KEEPALIVE_S = 10.0  # a channel with an open call pings its peer after this long without news
KEEPALIVE_TIMEOUT_S = 10.0  # ... and ends the call with UNAVAILABLE if the ping is not answered within this
MIN_PING_INTERVAL_S = 0.5  # servers accept pings this often, no more
MAX_RECONNECT_BACKOFF_S = 1.0  # a channel whose peer went away tries to connect again at least this often


def _message_options(max_message_bytes: int) -> tuple:
    if not (isinstance(max_message_bytes, int) and max_message_bytes > 0):
        raise ValueError(f"max_message_bytes={max_message_bytes!r}: must be a positive number of bytes")
    return (
        ("grpc.max_send_message_length", max_message_bytes),
        ("grpc.max_receive_message_length", max_message_bytes),
    )


def channel_options(
    max_message_bytes: int, *, keepalive_s: float = KEEPALIVE_S, keepalive_timeout_s: float = KEEPALIVE_TIMEOUT_S
) -> tuple:
    """A client channel's options: messages up to ``max_message_bytes`` each way (larger ones end the
    call with ``RESOURCE_EXHAUSTED``), and while a call is open a ping after ``keepalive_s`` without
    news, answered within ``keepalive_timeout_s`` or the connection is dropped (its calls end
    ``UNAVAILABLE``); a lost connection is attempted again at least every
    :data:`MAX_RECONNECT_BACKOFF_S` (gRPC's own back-off, capped).

    Raises:
      ValueError: ``keepalive_s`` below :data:`MIN_PING_INTERVAL_S` (servers would refuse the pings)
        or a timeout that is not positive.
    """
    if not (keepalive_s >= MIN_PING_INTERVAL_S and keepalive_timeout_s > 0):
        raise ValueError(
            f"keepalive_s={keepalive_s}, keepalive_timeout_s={keepalive_timeout_s}: the ping interval must be at "
            f"least MIN_PING_INTERVAL_S={MIN_PING_INTERVAL_S} s (servers refuse pings more often) and the timeout positive"
        )
    return (
        *_message_options(max_message_bytes),
        ("grpc.keepalive_time_ms", round(keepalive_s * 1000)),
        ("grpc.keepalive_timeout_ms", round(keepalive_timeout_s * 1000)),
        # What bounds the wait for a ping's answer in gRPC's HTTP/2 transport (default 60 s).
        ("grpc.http2.ping_timeout_ms", round(keepalive_timeout_s * 1000)),
        ("grpc.keepalive_permit_without_calls", 0),  # no pings on an idle channel
        ("grpc.http2.max_pings_without_data", 0),  # a call held for minutes keeps pinging (default: 2 pings)
        ("grpc.max_reconnect_backoff_ms", round(MAX_RECONNECT_BACKOFF_S * 1000)),  # default 120 s
        # Each channel its own connections (gRPC shares them between channels to one address by
        # default): a new channel to a restarted peer does not inherit the old one's back-off.
        ("grpc.use_local_subchannel_pool", 1),
    )


def server_options(max_message_bytes: int, *, max_receive_bytes: int | None = None) -> tuple:
    """A server's options: messages up to ``max_message_bytes`` sent and ``max_receive_bytes``
    (default the same) received, larger ones refused (``RESOURCE_EXHAUSTED``), its own port, and
    the pings of :func:`channel_options` accepted."""
    send = _message_options(max_message_bytes)[0]
    receive = _message_options(max_message_bytes if max_receive_bytes is None else max_receive_bytes)[1]
    return (
        send,
        receive,
        ("grpc.so_reuseport", 0),
        ("grpc.http2.min_ping_interval_without_data_ms", round(MIN_PING_INTERVAL_S * 1000)),
    )
