"""The guarded gRPC server every system uses (zeroth.transport.guard), on 127.0.0.1.

Calls opened without the token that never send their body are refused at once and the legitimate
call is answered promptly; token holders' calls are capped per caller and cancelled when their body
does not come; an oversized message without the token is never read into memory.
"""

import grpc
import pytest
from slowloris import Held, oversized_growth, send_raw, timed

from zeroth.transport import guard, security
from zeroth.transport.security import TokenInterceptor

TOKEN = "guard-test-token"
UNARY = "/test.Echo/Unary"
STREAM = "/test.Echo/Stream"


def _echo_handler():
    return grpc.method_handlers_generic_handler(
        "test.Echo",
        {
            "Unary": grpc.unary_unary_rpc_method_handler(lambda req, ctx: req),
            "Stream": grpc.stream_unary_rpc_method_handler(lambda it, ctx: b"".join(it)),
        },
    )


@pytest.fixture
def serve():
    servers = []

    def start(limits=None, token=TOKEN, server=None):
        server = server or guard.make_server(limits, token)
        server.add_generic_rpc_handlers((_echo_handler(),))
        port = server.add_insecure_port("127.0.0.1:0")
        server.start()
        servers.append(server)
        return f"127.0.0.1:{port}"

    yield start
    for s in servers:
        s.stop(None).wait()


def legit(address, method=UNARY, token=TOKEN, timeout_s=10.0):
    return send_raw(address, method, b"hello", token=token, timeout_s=timeout_s)


def test_calls_without_the_token_that_send_no_body_are_refused_at_once(serve):
    address = serve(guard.Limits(1 << 20, max_calls=4, max_calls_per_caller=4))
    with Held(address, UNARY, 40) as held:  # ten times the server's calls
        codes = held.codes(timeout_s=5.0)
        assert codes == [grpc.StatusCode.UNAUTHENTICATED] * 40
        with Held(address, UNARY, 40):
            seconds, code = timed(lambda: legit(address))
    assert code == grpc.StatusCode.OK
    assert seconds < 2.0


def test_token_interceptor_alone_refuses_without_reading_the_body(serve):
    # The interceptor without the guard's bounds: 4 threads, 40 calls without a body; a unary
    # refusal would wait for each body in a thread and the legitimate call would stall.
    from concurrent import futures

    server = grpc.server(futures.ThreadPoolExecutor(max_workers=4), interceptors=[TokenInterceptor(TOKEN)])
    address = serve(server=server)
    with Held(address, UNARY, 40) as held:
        assert held.codes(timeout_s=5.0) == [grpc.StatusCode.UNAUTHENTICATED] * 40
        seconds, code = timed(lambda: legit(address, timeout_s=5.0))
    assert (code, seconds < 2.0) == (grpc.StatusCode.OK, True)


def test_a_token_holder_is_capped_per_caller_and_its_bodyless_calls_cancelled(serve):
    address = serve(guard.Limits(1 << 20, max_calls=8, max_calls_per_caller=4, body_s=0.5))
    with Held(address, UNARY, 6, token=TOKEN) as held:
        codes = held.codes(timeout_s=5.0)
    assert sorted(c.name for c in codes) == ["CANCELLED"] * 4 + ["RESOURCE_EXHAUSTED"] * 2
    assert legit(address) == grpc.StatusCode.OK
    # a stream that stops sending is cancelled after idle_s in the same way
    address = serve(guard.Limits(1 << 20, max_calls=4, max_calls_per_caller=4, idle_s=0.5))
    with Held(address, STREAM, 4, token=TOKEN) as held:
        seconds, codes = timed(lambda: held.codes(timeout_s=5.0))
    assert codes == [grpc.StatusCode.CANCELLED] * 4 and seconds < 3.0


def test_unknown_methods_are_refused_without_a_thread(serve):
    address = serve(guard.Limits(1 << 20, max_calls=1, max_calls_per_caller=1))
    with Held(address, "/test.Echo/Nothing", 10) as held:
        assert held.codes(timeout_s=5.0) == [grpc.StatusCode.UNAUTHENTICATED] * 10
    with Held(address, "/test.Echo/Nothing", 10, token=TOKEN) as held:
        assert held.codes(timeout_s=5.0) == [grpc.StatusCode.UNIMPLEMENTED] * 10
    assert legit(address) == grpc.StatusCode.OK


def test_limits_name_the_bad_value():
    with pytest.raises(ValueError, match=r"max_calls_per_caller=9 exceeds max_calls=8"):
        guard.Limits(1 << 20, max_calls=8, max_calls_per_caller=9)
    with pytest.raises(ValueError, match=r"body_s=0"):
        guard.Limits(1 << 20, body_s=0)
    with pytest.raises(ValueError, match=r"max_message_bytes=0"):
        guard.Limits(1 << 20, max_receive_bytes=0)


def test_an_oversized_message_without_the_token_is_not_read(serve):
    # A server that accepts messages of 256 MiB from token holders (a stage's, a node's).
    address = serve(guard.Limits(256 << 20, max_calls=4, max_calls_per_caller=4))
    growth, codes = oversized_growth(address, UNARY, 4, 64 << 20)
    assert codes == ["UNAUTHENTICATED"] * 4
    assert growth < 32 << 20, f"RSS grew by {growth / 2**20:.0f} MiB for 4 refused messages of 64 MiB"


def test_the_guards_thread_ends_once_no_call_is_waited_for(serve):
    import threading
    import time

    address = serve(guard.Limits(1 << 20, max_calls=4, max_calls_per_caller=4, idle_s=300.0))
    for _ in range(3):
        assert legit(address, STREAM) == grpc.StatusCode.OK  # each message waited for under a 300 s deadline
    end = time.monotonic() + 5.0
    while any(t.name == "zeroth-guard" for t in threading.enumerate()) and time.monotonic() < end:
        time.sleep(0.01)
    assert not any(t.name == "zeroth-guard" for t in threading.enumerate())


def test_a_caller_that_does_not_take_its_responses_holds_the_thread_at_most_idle_s(serve):
    import threading
    import time

    ended = threading.Event()

    def many(request, context):
        try:
            for _ in range(200):
                yield b"x" * (1 << 20)
        finally:
            ended.set()

    server = guard.make_server(guard.Limits(4 << 20, max_calls=4, max_calls_per_caller=4, idle_s=1.0), TOKEN)
    server.add_generic_rpc_handlers(
        (grpc.method_handlers_generic_handler("test.Many", {"Many": grpc.unary_stream_rpc_method_handler(many)}),)
    )
    address = serve(server=server)
    with grpc.insecure_channel(address, options=[("grpc.max_receive_message_length", 8 << 20)]) as ch:
        t0 = time.monotonic()
        call = ch.unary_stream("/test.Many/Many")(b"go", metadata=security.token_metadata(TOKEN))  # never read
        assert ended.wait(10.0)
        assert time.monotonic() - t0 < 5.0
        call.cancel()
