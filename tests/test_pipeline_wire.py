"""Pipeline frames: stubs match the proto, malformed or out-of-order frames are refused (as pure
checks and over a real gRPC stream on 127.0.0.1), the token bucket paces the bytes it is given."""

import queue

import grpc
import numpy as np
import pytest

from zeroth import compress as C
from zeroth import protogen
from zeroth.pipeline import link, wire
from zeroth.pipeline.proto import pipeline_pb2 as pb
from zeroth.pipeline.proto import pipeline_pb2_grpc as pb_grpc
from zeroth.transport import pacing


def test_checked_in_stubs_are_what_protoc_generates(tmp_path):
    for p in protogen.generate("pipeline", tmp_path):
        checked_in = protogen.stub_dir("pipeline") / p.name
        assert checked_in.read_text() == p.read_text(), (
            f"{checked_in} is stale: run `python -m zeroth.protogen pipeline` after editing protos/zeroth/v1/pipeline.proto"
        )
    assert (
        "from zeroth.pipeline.proto import pipeline_pb2"
        in (protogen.stub_dir("pipeline") / "pipeline_pb2_grpc.py").read_text()
    )


ROW = (3, 4)
IDS = np.array([5, 1])


def _expected(step=2, micro=1, bits=2):
    return wire.Expected("run-a", 0, "activation", step, micro, IDS, ROW, bits)


def _frame(codec=None, step=2, micro=1, ids=IDS):
    codec = codec or C.aqsgd(2)
    x = np.arange(24, dtype=np.float32).reshape(2, *ROW)
    keys = C.example_keys(0, link=0, direction=0, step=step, ids=ids)
    _, enc, _ = codec.encode(codec.init(8, ROW), x, ids, keys)
    return wire.to_frame(enc, run_id="run-a", link=0, kind="activation", step=step, micro_batch=micro, ids=ids)


def test_a_well_formed_frame_passes_and_round_trips():
    f = _frame()
    wire.check_frame(f, _expected())
    enc, ids = wire.from_frame(pb.TensorFrame.FromString(f.SerializeToString()))
    np.testing.assert_array_equal(ids, IDS)
    assert enc.shape == (2, *ROW) and enc.fresh.all() and len(enc.full) == 4 * 24
    assert wire.frame_nbytes(f) == len(f.SerializeToString())


@pytest.mark.parametrize(
    "mutate, code, message",
    [
        (lambda f: setattr(f, "run_id", "run-b"), "INVALID_ARGUMENT", "frame of run 'run-b'"),
        (lambda f: setattr(f, "kind", pb.GRADIENT), "INVALID_ARGUMENT", "kind GRADIENT; expected ACTIVATION"),
        (
            lambda f: setattr(f, "step", 3),
            "FAILED_PRECONDITION",
            "got step 3 micro-batch 1, expected step 2 micro-batch 1",
        ),
        (lambda f: setattr(f, "micro_batch", 0), "FAILED_PRECONDITION", "out-of-order activation"),
        (lambda f: setattr(f, "dtype", "float16"), "INVALID_ARGUMENT", "dtype 'float16'"),
        (lambda f: f.shape.__setitem__(2, 5), "INVALID_ARGUMENT", r"shape \[2, 3, 5\]; expected \[2, 3, 4\]"),
        (lambda f: f.example_ids.__setitem__(0, 6), "INVALID_ARGUMENT", r"example ids \[6, 1\] differ"),
        (lambda f: setattr(f, "bits", 4), "INVALID_ARGUMENT", "bits 4; this link's codec uses 2"),
        (lambda f: setattr(f, "fresh", b"\x01"), "INVALID_ARGUMENT", "one 0/1 byte per example"),
        (lambda f: setattr(f, "full", f.full[:-1]), "INVALID_ARGUMENT", "full holds 95 bytes"),
    ],
)
def test_malformed_or_out_of_order_frames_are_refused(mutate, code, message):
    f = _frame()
    mutate(f)
    with pytest.raises(wire.FrameError, match=message) as e:
        wire.check_frame(f, _expected())
    assert e.value.code == code


def test_quantized_payload_sizes_are_checked():
    codec = C.directq(2)  # channel scales: 4 per example of shape (3, 4)
    f = _frame(codec)
    wire.check_frame(f, _expected())
    assert len(f.packed) == (24 * 2 + 7) // 8 and len(f.scales) == 4 * 8 and f.quantizer == "zero-level/channel"
    f.scales = f.scales[:-4]
    with pytest.raises(wire.FrameError, match="scales holds 28 bytes"):
        wire.check_frame(f, _expected())
    row = _frame(C.directq(2, "row"))  # 3 scales per example
    wire.check_frame(row, _expected()._replace(axis="row"))
    assert len(row.scales) == 4 * 6


def test_a_frame_of_another_quantizer_or_a_warm_up_frame_is_refused_where_not_expected():
    f = _frame(C.directq(2, "row"))
    with pytest.raises(
        wire.FrameError, match="quantizer 'zero-level/row'; this link expects 'zero-level/channel'"
    ) as e:
        wire.check_frame(f, _expected())  # another grid or axis than the link's: refused before decoding
    assert e.value.code == "INVALID_ARGUMENT"
    f.quantizer = ""  # a frame of a build before the zero-level grid
    with pytest.raises(wire.FrameError, match="quantizer ''"):
        wire.check_frame(f, _expected()._replace(axis="row"))
    x = np.arange(24, dtype=np.float32).reshape(2, *ROW)
    _, enc, _ = C.aqsgd(2).encode(C.aqsgd(2).init(8, ROW), x, IDS, full=True)  # the uncompressed warm-up
    warm = wire.to_frame(enc, run_id="run-a", link=0, kind="activation", step=2, micro_batch=1, ids=IDS)
    wire.check_frame(warm, _expected(bits=0))
    assert warm.bits == 0 and warm.quantizer == "" and warm.packed == b"" and len(warm.full) == 4 * 24
    with pytest.raises(wire.FrameError, match="bits 0; this link's codec uses 2"):
        wire.check_frame(warm, _expected())
    back, _ = wire.from_frame(pb.TensorFrame.FromString(warm.SerializeToString()))
    np.testing.assert_array_equal(C.aqsgd(2).decode(C.aqsgd(2).init(8, ROW), back, IDS, full=True)[1], x)


def test_token_bucket_waits_for_the_bytes_beyond_the_burst():
    now = [0.0]
    slept = []

    def sleep(s):
        slept.append(s)
        now[0] += s

    bucket = pacing.TokenBucket(8e6, burst=1000, clock=lambda: now[0], sleep=sleep)  # 1 MB/s
    assert bucket.take(1000) == 0.0
    assert bucket.take(500_000) == pytest.approx(0.5)
    now[0] += 0.25  # idle time refills at most one burst
    assert bucket.take(500_000) == pytest.approx(0.499)
    assert sum(slept) == pytest.approx(0.999)
    assert pacing.TokenBucket(None).take(10**9) == 0.0
    with pytest.raises(ValueError, match="bandwidth must be > 0"):
        pacing.TokenBucket(0.0)


def test_pacer_enforces_bandwidth_and_latency_on_real_frames():
    import time

    f = _frame()
    n = wire.frame_nbytes(f)
    pacer = pacing.Pacer(bandwidth_bps=8 * n * 10, latency_s=0.05)  # 10 frames per second
    pacer.bucket.burst = pacer.bucket.tokens = 0.0  # no burst: every frame waits for its own bytes
    t0 = time.monotonic()
    for _ in range(3):
        pacer.submit(f)
    pacer.close()
    got = list(pacer.frames())
    elapsed = time.monotonic() - t0
    assert len(got) == 3 and pacer.bytes == 3 * n
    assert elapsed >= 0.3 + 0.05 - 0.01  # three frames at 0.1 s each, then the latency
    assert pacer.transfer_s >= 0.29  # slept at least 8·bytes/bandwidth per frame (a lower bound, load only adds)


def test_servicer_aborts_the_stream_on_a_bad_frame_over_grpc():
    """A real server on 127.0.0.1: a good frame is accepted, an out-of-order one aborts with
    FAILED_PRECONDITION, a malformed one (on a fresh stream) with INVALID_ARGUMENT."""

    def serve_one():
        inbox = queue.Queue()
        pacer = pacing.Pacer(None)
        schedule = iter([(2, 0), (2, 1), (3, 0)])
        servicer = link.LinkServicer(lambda t, j: _expected(t, j), schedule, inbox, pacer)
        server, port = link.serve(servicer, "127.0.0.1:0")
        return server, port, inbox

    server, port, inbox = serve_one()
    try:
        with grpc.insecure_channel(f"127.0.0.1:{port}") as ch:
            stub = pb_grpc.PipelineLinkStub(ch)
            with pytest.raises(grpc.RpcError) as e:
                list(stub.Link(iter([_frame(micro=0), _frame(step=3, micro=0)]), timeout=20))
            assert e.value.code() == grpc.StatusCode.FAILED_PRECONDITION
            assert "expected step 2 micro-batch 1" in e.value.details()
        assert inbox.get(timeout=5).micro_batch == 0  # the good frame went through
        assert isinstance(inbox.get(timeout=5), link.LinkClosed)
    finally:
        server.stop(0)

    server, port, _ = serve_one()
    try:
        bad = _frame(micro=0)
        bad.dtype = "bfloat16"
        with grpc.insecure_channel(f"127.0.0.1:{port}") as ch:
            with pytest.raises(grpc.RpcError) as e:
                list(pb_grpc.PipelineLinkStub(ch).Link(iter([bad]), timeout=20))
            assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert "dtype 'bfloat16'" in e.value.details()
    finally:
        server.stop(0)


def test_a_stage_serving_with_the_run_token_refuses_streams_without_it():
    """A real server on 127.0.0.1 with the run's access token: a stream with no token or another
    run's token is refused with UNAUTHENTICATED before any frame reaches the stage; ``connect``
    with the token delivers the frame and gets the gradient back."""
    from zeroth.transport import identity, security

    token = identity.access_token(identity.new_secret())
    inbox = queue.Queue()
    down = pacing.Pacer(None)
    servicer = link.LinkServicer(lambda t, j: _expected(t, j), iter([(2, 0), (2, 1)]), inbox, down)
    server, port = link.serve(servicer, "127.0.0.1:0", token)
    try:
        with grpc.insecure_channel(f"127.0.0.1:{port}") as ch:
            stub = pb_grpc.PipelineLinkStub(ch)
            other_run = security.token_metadata(identity.access_token(identity.new_secret()))
            for metadata in (None, other_run):
                with pytest.raises(grpc.RpcError) as e:
                    list(stub.Link(iter([_frame(micro=0)]), timeout=20, metadata=metadata))
                assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED, metadata
        assert inbox.empty() and not servicer.connected.is_set()

        up, replies, readers = pacing.Pacer(None), queue.Queue(), []
        channel = link.connect(f"127.0.0.1:{port}", up, replies, 20.0, readers, token)
        up.submit(_frame(micro=0))
        assert inbox.get(timeout=10).micro_batch == 0  # the frame went through the token check
        down.submit(_frame(micro=0))
        assert replies.get(timeout=10).micro_batch == 0
        up.close()
        down.close()
        channel.close()
    finally:
        server.stop(0)
    link.join_readers(readers)


def test_a_stage_answers_its_link_while_outsiders_hold_calls_and_send_oversized_frames():
    """40 calls without the token that never send a body (to a method the stage does not serve,
    which a unary refusal would wait on in one of the stage's threads) are refused at once, and
    the real upstream's link goes through promptly; four unauthenticated 64 MiB messages are
    refused without being read (the stage accepts frames of 256 MiB from the token holder)."""
    import time

    from slowloris import Held, oversized_growth

    from zeroth.transport import identity

    token = identity.access_token(identity.new_secret())
    inbox = queue.Queue()
    down = pacing.Pacer(None)
    servicer = link.LinkServicer(lambda t, j: _expected(t, j), iter([(2, 0), (2, 1)]), inbox, down)
    server, port = link.serve(servicer, "127.0.0.1:0", token)
    address, readers = f"127.0.0.1:{port}", []
    try:
        with (
            Held(address, "/zeroth.v1.PipelineLink/Nothing", 40) as held,
            Held(address, "/zeroth.v1.PipelineLink/Link", 40) as streams,
        ):
            assert held.codes(timeout_s=5.0) == [grpc.StatusCode.UNAUTHENTICATED] * 40
            assert streams.codes(timeout_s=5.0) == [grpc.StatusCode.UNAUTHENTICATED] * 40
            t0 = time.perf_counter()
            up, replies = pacing.Pacer(None), queue.Queue()
            channel = link.connect(address, up, replies, 20.0, readers, token)
            up.submit(_frame(micro=0))
            assert inbox.get(timeout=10).micro_batch == 0
            assert time.perf_counter() - t0 < 2.0
        growth, codes = oversized_growth(address, "/zeroth.v1.PipelineLink/Link", 4, 64 << 20)
        assert codes == ["UNAUTHENTICATED"] * 4 and growth < 32 << 20, growth
        up.close()
        down.close()
        channel.close()
    finally:
        server.stop(0)
    link.join_readers(readers)


def test_a_stage_refuses_a_frame_larger_than_a_micro_batch_even_from_the_token_holder():
    from slowloris import send_raw

    from zeroth.transport import identity

    token = identity.access_token(identity.new_secret())
    bound = link.frame_bytes(2, (3, 4))
    assert bound == 2 * 2 * 3 * 4 * 4 + (64 << 10)
    inbox = queue.Queue()
    servicer = link.LinkServicer(lambda t, j: _expected(t, j), iter([(2, 0)]), inbox, pacing.Pacer(None))
    server, port = link.serve(servicer, "127.0.0.1:0", token, bounds=link.limits(5.0, bound))
    try:
        code = send_raw(f"127.0.0.1:{port}", "/zeroth.v1.PipelineLink/Link", b"\0" * (bound + 1), token=token)
        assert code == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert not any(isinstance(x, pb.TensorFrame) for x in list(inbox.queue))  # no frame reached the stage
    finally:
        server.stop(0)


def test_only_the_upstream_stages_key_holds_the_link_and_it_replaces_a_stale_stream():
    """A real server with the run's token and the upstream stage's public key: a token holder that
    connects first (its own key, no key, or the upstream's public key without its signature) is
    refused before any frame is read; the upstream's stream is served, and the upstream opening
    a newer stream replaces the stale one without closing the stage's inbox: the next frame the
    stage expects arrives on the new stream and the gradient goes back on it."""
    from zeroth.transport import identity, security

    token = identity.access_token(identity.new_secret())
    upstream, impostor = identity.Identity.generate(), identity.Identity.generate()
    known: list[bytes] = []  # the upstream's key, once "published"
    inbox, down = queue.Queue(), pacing.Pacer(None)
    servicer = link.LinkServicer(
        lambda t, j: _expected(t, j),
        iter([(2, 0), (2, 1)]),
        inbox,
        down,
        upstream_key=lambda: known[0] if known else None,
        run_id="run-a",
        link=0,
    )
    server, port = link.serve(servicer, "127.0.0.1:0", token)
    md = security.token_metadata(token)
    fields = link.link_fields("run-a", 0)
    readers = []
    try:
        with grpc.insecure_channel(f"127.0.0.1:{port}") as ch:
            stub = pb_grpc.PipelineLinkStub(ch)
            with pytest.raises(grpc.RpcError) as e:  # before the upstream's key is known: nobody
                list(
                    stub.Link(
                        iter([_frame(micro=0)]), timeout=20, metadata=md + identity.call_metadata(upstream, 1, *fields)
                    )
                )
            assert e.value.code() == grpc.StatusCode.UNAVAILABLE
            known.append(upstream.public)
            forged = dict(identity.call_metadata(impostor, 5, *fields))
            forged[identity.CALL_KEY] = upstream.public.hex()  # the upstream's public key, the impostor's signature
            for extra in (
                (),
                identity.call_metadata(impostor, 5, *fields),
                tuple(forged.items()),
                identity.call_metadata(upstream, 5, *link.link_fields("run-b", 0)),
                identity.call_metadata(upstream, 5, *link.link_fields("run-a", 1)),
            ):
                with pytest.raises(grpc.RpcError) as e:
                    list(stub.Link(iter([_frame(micro=0)]), timeout=20, metadata=md + tuple(extra)))
                assert e.value.code() == grpc.StatusCode.PERMISSION_DENIED, extra
                assert "only from stage 0" in e.value.details()
        assert inbox.empty() and not servicer.connected.is_set()

        stale_up, stale_replies = pacing.Pacer(None), queue.Queue()
        stale = link.connect(
            f"127.0.0.1:{port}",
            stale_up,
            stale_replies,
            20.0,
            readers,
            token,
            me=upstream,
            run_id="run-a",
            link=0,
            seq=10,
        )
        stale_up.submit(_frame(micro=0))
        assert inbox.get(timeout=10).micro_batch == 0
        up, replies = pacing.Pacer(None), queue.Queue()
        fresh = link.connect(
            f"127.0.0.1:{port}", up, replies, 20.0, readers, token, me=upstream, run_id="run-a", link=0, seq=11
        )
        assert isinstance(stale_replies.get(timeout=10), link.LinkClosed)  # the stale stream was cancelled
        up.submit(_frame(micro=1))
        assert inbox.get(timeout=10).micro_batch == 1  # the stage's inbox never saw the stale stream end
        down.submit(_frame(micro=0))
        assert replies.get(timeout=10).micro_batch == 0
        with pytest.raises(grpc.RpcError) as e:  # an older stream of the upstream does not take the link back
            with grpc.insecure_channel(f"127.0.0.1:{port}") as ch:
                list(
                    pb_grpc.PipelineLinkStub(ch).Link(
                        iter([]), timeout=20, metadata=md + identity.call_metadata(upstream, 10, *fields)
                    )
                )
        assert e.value.code() == grpc.StatusCode.FAILED_PRECONDITION
        up.close()
        down.close()
        assert inbox.get(timeout=10) is link.END
        for ch, p in ((stale, stale_up), (fresh, None)):
            if p is not None:
                p.close()
            ch.close()
    finally:
        server.stop(0)
    link.join_readers(readers)
