"""Keepalive on real gRPC channels on 127.0.0.1 (:mod:`zeroth.transport.channels`).

A peer server in another process holds a ``Join`` as a leader does until the join is decided
(``tests/held_call_server.py``). While it is alive, a call it holds for many ping intervals is
answered; once it is frozen (SIGSTOP: the TCP connection open, nothing read, as a process paused or
a host gone), the call ends with ``UNAVAILABLE`` at once instead of waiting for its deadline, so
the joiner asks another peer. The options add nothing to the bytes around a call that the
peers count (:mod:`zeroth.net.calibrate`'s relay).
"""

import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import grpc
import pytest

from zeroth.net.proto import peer_pb2 as pb
from zeroth.net.transport import MAX_MESSAGE_BYTES, Traffic, Transport
from zeroth.transport.channels import MIN_PING_INTERVAL_S, channel_options

KEEPALIVE_S, KEEPALIVE_TIMEOUT_S = 0.6, 0.5  # short, so that the test takes seconds
DEADLINE_S = 60.0  # each call's own deadline, which the frozen server's call must not wait for


@pytest.fixture
def held():
    proc = subprocess.Popen(
        [sys.executable, str(Path(__file__).with_name("held_call_server.py"))], stdout=subprocess.PIPE, text=True
    )
    try:
        yield proc, f"127.0.0.1:{int(proc.stdout.readline())}"
    finally:
        proc.send_signal(signal.SIGCONT)
        proc.kill()
        proc.wait(timeout=30)


def test_a_held_call_is_answered_while_the_server_lives_and_ends_unavailable_once_it_freezes(held):
    proc, address = held
    options = channel_options(MAX_MESSAGE_BYTES, keepalive_s=KEEPALIVE_S, keepalive_timeout_s=KEEPALIVE_TIMEOUT_S)
    transport = Transport(token=None, tls=None, traffic=Traffic(), options=options)
    try:
        # 1. Held 8 s, 13 ping intervals without data: answered (a server with gRPC's default ping
        # policy sends GOAWAY "too many pings" about 5 s into such a call).
        reply = transport.rpc(address, "Join", pb.JoinRequest(address="8"), timeout=DEADLINE_S)
        assert reply.redirect == "answered"
        assert proc.stdout.readline() == "held\n"

        # 2. Held for longer than the deadline; the server freezes after three ping intervals.
        out = {}

        def call():
            try:
                out["reply"] = transport.rpc(address, "Join", pb.JoinRequest(address="100"), timeout=DEADLINE_S)
            except grpc.RpcError as e:
                out["error"] = e

        caller = threading.Thread(target=call, daemon=True)
        caller.start()
        assert proc.stdout.readline() == "held\n"
        time.sleep(3 * KEEPALIVE_S + 0.2)
        proc.send_signal(signal.SIGSTOP)
        caller.join(timeout=DEADLINE_S / 2)
        assert not caller.is_alive(), "the call to the frozen server still waits for its deadline"
        assert "error" in out and out["error"].code() == grpc.StatusCode.UNAVAILABLE, out
    finally:
        transport.close()


def test_keepalive_options_refuse_pings_more_often_than_servers_accept():
    with pytest.raises(ValueError, match=r"keepalive_s=0.1.*MIN_PING_INTERVAL_S=0.5"):
        channel_options(MAX_MESSAGE_BYTES, keepalive_s=0.1)
    with pytest.raises(ValueError, match=r"keepalive_timeout_s=0"):
        channel_options(MAX_MESSAGE_BYTES, keepalive_timeout_s=0)
    with pytest.raises(ValueError, match=r"max_message_bytes=-1"):
        channel_options(-1)
    assert dict(channel_options(MAX_MESSAGE_BYTES, keepalive_s=MIN_PING_INTERVAL_S))["grpc.keepalive_time_ms"] == 500


def test_the_framing_grpc_puts_around_a_peer_call_is_what_the_byte_counts_add():
    """Through a byte-counting relay, with the peers' options: the bytes around a unary call are the
    framing constants of :mod:`zeroth.net.wire` (within a byte: flow-control and BDP pings averaged
    in), and the token costs ``TOKEN_OVERHEAD + len(token)`` more per request."""
    from zeroth.net import calibrate, wire

    plain, token = calibrate.measure(calls=100), calibrate.measure(calls=100, token="t" * 32)
    assert abs(plain["request_overhead"] - wire.REQUEST_OVERHEAD) <= 1, plain
    assert abs(plain["response_overhead"] - wire.RESPONSE_OVERHEAD) <= 1, plain
    assert abs(token["request_overhead"] - (wire.REQUEST_OVERHEAD + wire.TOKEN_OVERHEAD + 32)) <= 1, token
    assert abs(token["response_overhead"] - wire.RESPONSE_OVERHEAD) <= 1, token


def test_a_peer_restarted_on_its_port_is_reached_at_once_through_a_renewed_channel():
    # A channel whose server was killed fails its calls with UNAVAILABLE and backs off between
    # attempts to connect; a new server on the same port is not reached before the next attempt
    # (with gRPC's default back-off, up to 12 s after 15 s down). The Just One Byte runtime renews the
    # channel to an address where a peer joins or is seated again, and the next call goes through.
    first = subprocess.Popen(
        [sys.executable, str(Path(__file__).with_name("held_call_server.py"))], stdout=subprocess.PIPE, text=True
    )
    port = int(first.stdout.readline())
    address = f"127.0.0.1:{port}"
    transport = Transport(token=None, tls=None, traffic=Traffic(), options=channel_options(MAX_MESSAGE_BYTES))
    second = None
    try:
        assert transport.rpc(address, "Join", pb.JoinRequest(address="0"), timeout=DEADLINE_S).redirect == "answered"
        first.kill()
        first.wait(timeout=30)
        failures = 0
        end = time.monotonic() + 3.0  # attempts fail, the back-off grows
        while time.monotonic() < end:
            with pytest.raises(grpc.RpcError) as e:
                transport.rpc(address, "Join", pb.JoinRequest(address="0"), timeout=DEADLINE_S)
            assert e.value.code() == grpc.StatusCode.UNAVAILABLE
            failures += 1
            time.sleep(0.05)
        second = subprocess.Popen(
            [sys.executable, str(Path(__file__).with_name("held_call_server.py")), str(port)],
            stdout=subprocess.PIPE,
            text=True,
        )
        assert int(second.stdout.readline()) == port
        transport.renew(address)
        assert transport.rpc(address, "Join", pb.JoinRequest(address="0"), timeout=DEADLINE_S).redirect == "answered"
        assert failures > 10
    finally:
        transport.close()
        for proc in (first, second):
            if proc is not None:
                proc.kill()
                proc.wait(timeout=30)
