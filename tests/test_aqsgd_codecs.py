"""Activation codecs (zeroth.compress): a zero-level grid that never clips, unbiased, within one level,
packed for real, within the theorem's c_Q at 4 bits, both ends agree (also in the float32 warm-up)."""

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from zeroth import compress as C


@given(bits=st.integers(1, 8), n=st.integers(0, 200), seed=st.integers(0, 2**32 - 1))
@settings(max_examples=60, deadline=None)
def test_pack_unpack_round_trip(bits, n, seed):
    q = (np.random.default_rng(seed).integers(0, 1 << bits, n)).astype(np.uint8)
    data = C.pack_bits(q, bits)
    assert len(data) == (n * bits + 7) // 8
    np.testing.assert_array_equal(C.unpack_bits(data, bits, n), q)


def test_pack_is_little_endian_and_refuses_wrong_sizes():
    assert C.pack_bits(np.array([1, 2, 3, 0], np.uint8), 2) == bytes([0b00111001])
    assert C.pack_bits(np.array([5, 2, 7], np.uint8), 3) == bytes([0b11010101, 0b1])
    with pytest.raises(ValueError, match="does not fit in 2 bits"):
        C.pack_bits(np.array([4], np.uint8), 2)
    with pytest.raises(ValueError, match="need 2 packed bytes, got 1"):
        C.unpack_bits(b"\x00", 3, 4)
    with pytest.raises(ValueError, match=r"bits must be an integer in \[1, 8\]"):
        C.pack_bits(np.zeros(1, np.uint8), 9)


def _level(s, bits):
    """The level spacing ``|s| / 2^(b−1)`` of each scale."""
    return np.abs(s) / (1 << (bits - 1))


@given(
    bits=st.integers(2, 8),
    row=st.lists(st.floats(-100, 100, allow_nan=False, width=32), min_size=1, max_size=16),
    zeros=st.lists(st.integers(0, 15), max_size=6),
    rounding=st.sampled_from(["stochastic", "nearest"]),
)
@settings(max_examples=60, deadline=None)
def test_zero_is_a_level_and_no_value_clips(bits, row, zeros, rounding):
    """Q(0) = 0 exactly; every level is inside the grid; the row's largest magnitude maps to a level
    (no clipping); the error is below one level (half a level when rounding to the nearest)."""
    x = np.array(row, np.float32)
    x[[z for z in zeros if z < x.size]] = 0.0
    x = np.stack([x, np.zeros_like(x), -3 * x])
    u = (
        C.uniforms(C.example_keys(1, link=0, direction=0, step=7, ids=[0, 1, 2]), x.shape[1])
        if rounding == "stochastic"
        else None
    )
    q, s = C.quantize_rows(x, bits, u)
    h = 1 << (bits - 1)
    assert q.dtype == np.int8 and q.min() >= -h and q.max() <= h - 1
    xhat = C.dequantize_rows(q, s, bits)
    np.testing.assert_array_equal(xhat[x == 0], 0.0)
    np.testing.assert_array_equal(xhat[1], 0.0)
    step = _level(s, bits)[:, None]
    bound = step * (0.5 if rounding == "nearest" else 1.0)
    assert np.all(np.abs(xhat - x) <= bound * (1 + 1e-5) + 1e-30)
    m = np.max(np.abs(x), axis=1)
    assert np.all(step[:, 0] <= m / (h - 1) * (1 + 1e-6))  # the grid is no coarser than max|x| / (h - 1)
    for r in (0, 2):
        if s[r] == 0:
            continue
        v = x[r].astype(np.float64) * h / float(s[r])  # the real-valued level of every value: none beyond the grid
        assert v.min() >= -h * (1 + 1e-6) and v.max() <= (h - 1) * (1 + 1e-6)
        ends = [x[r].max(), x[r].min()]  # the extreme that sets the scale is a level itself
        assert min(abs(float(xhat[r][np.argmax(x[r] == e)]) - float(e)) for e in ends) <= 2e-6 * m[r]


@given(
    bits=st.sampled_from([2, 3, 4, 6, 8]),
    row=st.lists(st.floats(-100, 100, allow_nan=False, width=32), min_size=1, max_size=16),
    step=st.integers(0, 1000),
    axis=st.sampled_from(["channel", "row"]),
)
@settings(max_examples=40, deadline=None)
def test_directq_is_within_one_level_and_packed(bits, row, step, axis):
    x = np.array([[row, [2.0 * v for v in row]]], np.float32)  # one example of 2 tokens
    ids = np.array([4])
    keys = C.example_keys(3, link=1, direction=0, step=step, ids=ids)
    codec = C.directq(bits, axis)
    _, enc, xhat = codec.encode(None, x, ids, keys)
    s = np.frombuffer(enc.scales, "<f4")
    if axis == "row":
        assert np.all(np.abs(xhat - x)[0] <= _level(s, bits)[:, None] * (1 + 1e-5) + 1e-30)
    else:
        assert np.all(np.abs(xhat - x)[0] <= _level(s, bits)[None, :] * (1 + 1e-5) + 1e-30)
    _, back = codec.decode(None, enc, ids)
    np.testing.assert_array_equal(back, xhat)
    assert enc.quantizer == f"zero-level/{axis}"
    assert enc.nbytes == (x.size * bits + 7) // 8 + 4 * C.scales_per_example(x.shape[1:], axis)
    codes = C.unpack_bits(enc.packed, bits, x.size)  # the wire holds q + 2^(b-1)
    q = C.codes_to_levels(codes, bits)
    np.testing.assert_array_equal(C.levels_to_codes(q, bits), codes)


@given(
    bits=st.sampled_from([2, 3, 4]),
    value=st.floats(-1, 1, allow_nan=False, width=32),
    other=st.sampled_from([1.0, -1.0, 0.25]),
)
@settings(max_examples=20, deadline=None)
def test_directq_is_unbiased(bits, value, other):
    """Mean of n = 4096 independently keyed roundings of a row (value, other, −0.5·other): each
    rounding is a two-point distribution on adjacent levels Δ apart, so its standard deviation is
    at most Δ/2 and the mean's at most Δ/(2√n); it lies within 5 of them of the value (a false
    failure has probability below 6e-7 per value by the normal tail; the uniforms' 2^−24
    resolution adds a bias below 2^−24 Δ). ``other = 1`` puts ``value`` next to the top level
    h − 1 that a clipping quantizer would bias."""
    n = 4096
    x = np.tile(np.array([[value, other, -0.5 * other]], np.float32), (n, 1))
    ids = np.arange(n)
    keys = C.example_keys(7, link=0, direction=1, step=0, ids=ids)
    _, enc, xhat = C.directq(bits, "row").encode(None, x, ids, keys)
    delta = float(_level(np.frombuffer(enc.scales, "<f4")[:1], bits)[0])
    sd = delta / 2
    assert abs(xhat[:, 0].astype(np.float64).mean() - value) <= 5 * sd / np.sqrt(n) + 1e-6
    assert abs(xhat[:, 2].astype(np.float64).mean() + 0.5 * other) <= 5 * sd / np.sqrt(n) + 1e-6


def test_nearest_rounding_is_deterministic_and_needs_no_keys():
    x = np.random.default_rng(2).normal(size=(3, 4, 6)).astype(np.float32)
    ids = np.arange(3)
    near = C.directq(3, rounding="nearest")
    _, enc, xhat = near.encode(None, x, ids)
    _, enc2, xhat2 = near.encode(None, x, ids, C.example_keys(0, link=0, direction=0, step=0, ids=ids))
    assert enc.packed == enc2.packed and enc.scales == enc2.scales
    np.testing.assert_array_equal(xhat, xhat2)
    s = np.frombuffer(enc.scales, "<f4").reshape(3, 6)
    assert np.all(np.abs(xhat - x) <= _level(s, 3)[:, None, :] / 2 * (1 + 1e-5))
    _, stoch = C.directq(3).encode(None, x, ids, C.example_keys(0, link=0, direction=0, step=0, ids=ids))[1:]
    assert not np.array_equal(stoch, xhat)
    with pytest.raises(ValueError, match="rounding must be one of"):
        C.directq(3, rounding="up")
    with pytest.raises(ValueError, match="stochastic rounding needs the examples' keys"):
        C.directq(3).encode(None, x, ids)
    with pytest.raises(ValueError, match=r"quantizer bits must be an integer in \[2, 8\]"):
        C.directq(1)


def _representative(rng):
    """Tensors ``f32[8, 32, 64]`` (8 examples of 32 tokens, 64 channels) as pipeline links carry them."""
    g = rng.normal(size=(8, 32, 64))
    lm = g * 0.5
    lm[..., [3, 40]] += rng.normal(20.0, 2.0, size=(8, 32, 2))  # a residual stream's outlier channels
    delta = rng.normal(size=(8, 32, 64)) * 1e-3  # an AQ-SGD change a − m: mostly small,
    delta[rng.random(delta.shape) < 0.02] += 0.05  # a few larger moves
    grad = rng.standard_t(3, size=(8, 32, 64)) * 1e-4  # heavy-tailed activation gradients
    post_relu = np.maximum(g, 0.0)
    return {"gaussian": g, "lm residual": lm, "aqsgd delta": delta, "gradient": grad, "relu": post_relu}


def test_relative_error_is_within_the_theorems_condition_at_4_bits_channel_scales():
    """c_Q = E‖Q(x) − x‖ / ‖x‖ (per example, averaged) is below 1/√2 on representative tensors at
    4 bits with channel scales, both roundings (the seed's theorem needs c_Q < 1/√2)."""
    rng = np.random.default_rng(0)
    ids = np.arange(8)
    keys = C.example_keys(0, link=0, direction=0, step=0, ids=ids)
    for name, x in _representative(rng).items():
        x = x.astype(np.float32)
        for rounding in ("stochastic", "nearest"):
            _, _, xhat = C.directq(4, "channel", rounding).encode(None, x, ids, keys)
            cq = C.relative_errors(x, xhat - x)
            assert cq.shape == (8,) and cq.mean() < 0.25 < np.sqrt(0.5), (name, rounding, cq.mean())


def test_relative_errors_and_quantizer_input_measure_c_q():
    x = np.array([[3.0, 4.0], [0.0, 0.0]], np.float32)
    np.testing.assert_allclose(C.relative_errors(x, np.array([[0.0, 0.5], [0.0, 0.0]])), [0.1, 0.0])
    assert C.relative_errors(x, np.array([[0.0, 0.0], [1.0, 0.0]]))[1] == np.inf
    codec = C.aqsgd(3)
    state = codec.init(4, (2, 5))
    rng = np.random.default_rng(1)
    a = rng.normal(size=(2, 2, 5)).astype(np.float32)
    ids = np.array([1, 3])
    mask, v = C.quantizer_input(codec, state, a, ids)
    assert not mask.any() and v.shape[0] == 0  # first sight: nothing quantized
    state, _, _ = codec.encode(state, a, ids, C.example_keys(0, link=0, direction=0, step=0, ids=ids))
    b = a + np.float32(0.01) * rng.normal(size=a.shape).astype(np.float32)
    mask, v = C.quantizer_input(codec, state, b, ids)
    np.testing.assert_array_equal(v, b - a)
    old = np.array(state.m[ids])
    state, enc, xhat = codec.encode(state, b, ids, C.example_keys(0, link=0, direction=0, step=1, ids=ids))
    dq = C.directq(3).decode(None, enc._replace(fresh=np.zeros(2, bool)), ids)[1]
    np.testing.assert_allclose(C.relative_errors(v, xhat - b), C.relative_errors(v, dq - v), rtol=1e-4)
    np.testing.assert_array_equal(xhat, old + dq)
    assert not C.quantizer_input(codec, state, b, ids, full=True)[0].any()
    assert C.quantizer_input(C.directq(3), None, b, ids)[0].all()


def test_uniforms_are_exact_and_keyed():
    keys = C.example_keys(0, link=0, direction=0, step=5, ids=[3, 4])
    u = C.uniforms(keys, 1000)
    assert u.dtype == np.float32 and u.min() >= 0 and u.max() < 1
    np.testing.assert_array_equal(u, C.uniforms(keys, 1000))
    assert not np.array_equal(u[0], u[1])
    other = C.example_keys(0, link=0, direction=1, step=5, ids=[3, 4])
    assert not np.array_equal(C.uniforms(other, 1000), u)
    assert np.all((u * 2**24) == np.floor(u * 2**24))


@pytest.mark.parametrize("rows, n", [(0, 3), (1, 1), (3, 0), (5, 7), (700, 513), (3, 300_001)])
def test_uniforms_of_many_keys_are_each_keys_word_stream(rows, n):
    """The rows, computed many keys per threefry call (and in chunks: 700 rows of 513 words are two
    chunks, a row of 300,001 words a chunk of its own), are each key's own word stream, bit for bit."""
    from zeroth import reference

    keys = np.random.default_rng(rows * 1000 + n).integers(0, 1 << 32, (rows, 2), dtype=np.uint64).astype(np.uint32)
    u = C.uniforms(keys, n)
    assert u.shape == (rows, n) and u.dtype == np.float32
    for b in range(rows):
        want = (reference.noise_words(keys[b], n) >> np.uint32(8)).astype(np.float32) * np.float32(2.0**-24)
        np.testing.assert_array_equal(u[b].view(np.uint32), want.view(np.uint32))
    rowwise = np.array([reference.noise_words(k, n) for k in keys], np.uint32).reshape(rows, n)
    np.testing.assert_array_equal(reference.noise_words(keys, n), rowwise)


def _walk(codec, steps, n=6, batch=3, row=(4, 5), seed=0):
    """Send drifting activations through one link for several epochs; return (sender, receiver, bytes)."""
    rng = np.random.default_rng(seed)
    base = rng.normal(size=(n, *row)).astype(np.float32)
    send, recv = codec.init(n, row), codec.init(n, row)
    sent = []
    for t in range(steps):
        ids = np.array([(t * batch + j) % n for j in range(batch)])
        x = base[ids] * np.float32(1 + 0.01 * t)
        keys = C.example_keys(seed, link=0, direction=0, step=t, ids=ids)
        send, enc, xs = codec.encode(send, x, ids, keys)
        recv, xr = codec.decode(recv, enc, ids)
        np.testing.assert_array_equal(xs, xr)
        assert C.buffer_digest(send) == C.buffer_digest(recv)
        sent.append((enc, x, xs))
    return send, recv, sent


def test_aqsgd_first_sight_is_full_precision_then_differences():
    codec = C.aqsgd(2)
    send, recv, sent = _walk(codec, steps=8)
    first, second = sent[0], sent[2]
    assert first[0].fresh.all() and first[0].bits == 2 and first[0].packed == b""
    np.testing.assert_array_equal(first[2], first[1])  # exact at first sight
    assert not second[0].fresh.any() and second[0].full == b""
    assert second[0].nbytes == (3 * 20 * 2 + 7) // 8 + 4 * 3 * 5 < first[0].nbytes  # 5 channel scales per example
    # the buffers track the slowly drifting activations far better than direct 2-bit quantization
    err_aq = np.mean([np.abs(xs - x).mean() for _, x, xs in sent[4:]])
    _, _, direct = _walk(C.directq(2), steps=8)
    err_dq = np.mean([np.abs(xs - x).mean() for _, x, xs in direct[4:]])
    assert err_aq < 0.2 * err_dq
    assert C.buffer_nbytes(send) == 6 * 20 * 4 + 6


def test_uncompressed_warm_up_fills_the_buffers_in_float32():
    """full=True: every example in float32 (bits 0), both ends set m = a, also for examples seen
    before; the messages after it are differences from those buffers."""
    codec = C.aqsgd(2)
    rng = np.random.default_rng(3)
    send, recv = codec.init(4, (3, 2)), codec.init(4, (3, 2))
    ids = np.array([2, 0])
    for t in range(2):  # two warm-up visits of the same examples
        x = rng.normal(size=(2, 3, 2)).astype(np.float32)
        send, enc, xs = codec.encode(send, x, ids, full=True)
        assert enc.bits == 0 and enc.fresh.all() and enc.packed == b"" and enc.quantizer == ""
        np.testing.assert_array_equal(xs, x)
        with pytest.raises(C.CodecMismatch, match="quantized to 0 bits; this link.s codec uses 2"):
            codec.decode(codec.init(4, (3, 2)), enc, ids)  # a receiver not in its warm-up refuses it
        recv, xr = codec.decode(recv, enc, ids, full=True)
        np.testing.assert_array_equal(xr, x)
        np.testing.assert_array_equal(send.m[ids], x)
        assert C.buffer_digest(send) == C.buffer_digest(recv)
    y = x + np.float32(0.01)
    send, enc, ys = codec.encode(send, y, ids, C.example_keys(0, link=0, direction=0, step=2, ids=ids))
    assert not enc.fresh.any() and enc.bits == 2
    recv, yr = codec.decode(recv, enc, ids)
    np.testing.assert_array_equal(ys, yr)
    with pytest.raises(C.CodecMismatch, match="carries every example in full precision"):
        codec.decode(recv, enc, ids, full=True)
    _, dq_enc, _ = C.directq(4).encode(None, y, ids, full=True)
    assert dq_enc.bits == 0
    np.testing.assert_array_equal(C.directq(4).decode(None, dq_enc, ids, full=True)[1], y)


def test_aqsgd_rerun_is_bit_identical_and_buffers_checkpoint(tmp_path):
    a, _, _ = _walk(C.aqsgd(3), steps=5)
    b, _, _ = _walk(C.aqsgd(3), steps=5)
    assert C.buffer_digest(a) == C.buffer_digest(b)
    digest = C.save_buffers(a, tmp_path / "b.npz")
    fresh = C.load_buffers(C.aqsgd(3).init(6, (4, 5)), tmp_path / "b.npz", digest)
    assert C.buffer_digest(fresh) == digest
    with pytest.raises(ValueError, match="digest"):
        C.load_buffers(C.aqsgd(3).init(6, (4, 5)), tmp_path / "b.npz", "0" * 64)
    mm = C.aqsgd(3).init(6, (4, 5), path=tmp_path / "m.npy")
    assert isinstance(mm.m, np.memmap)


def test_receiver_refuses_messages_its_buffers_cannot_take():
    codec = C.aqsgd(2)
    x = np.ones((2, 3), np.float32)
    ids = np.array([0, 1])
    keys = C.example_keys(0, link=0, direction=0, step=0, ids=ids)
    send, enc, _ = codec.encode(codec.init(4, (3,)), x, ids, keys)
    recv = codec.init(4, (3,))
    recv, _ = codec.decode(recv, enc, ids)
    with pytest.raises(C.CodecMismatch, match="out of step"):
        codec.decode(recv, enc, ids)  # the same first-sight message twice
    with pytest.raises(C.CodecMismatch, match="quantized to 2 bits; this link.s codec uses 4"):
        C.aqsgd(4).decode(C.aqsgd(4).init(4, (3,)), enc, ids)
    bad = enc._replace(full=enc.full[:-4])
    with pytest.raises(C.CodecMismatch, match="need 24 bytes, got 20"):
        codec.decode(codec.init(4, (3,)), bad, ids)
    with pytest.raises(C.CodecMismatch, match="outside the buffers"):
        codec.decode(codec.init(4, (3,)), enc, np.array([0, 9]))
    with pytest.raises(C.CodecMismatch, match="grid 'zero-level/row'; this link's codec uses 'zero-level/channel'"):
        codec.decode(codec.init(4, (3,)), enc._replace(quantizer="zero-level/row"), ids)
    with pytest.raises(ValueError, match="unknown activation codec"):
        C.make_codec("topk", 2)


def test_channel_scales_isolate_an_outlier_channel():
    """One scale per channel: an outlier channel no longer sets the step of every other value."""
    x = np.random.default_rng(0).normal(size=(4, 64, 5)).astype(np.float32) * 0.1
    x[:, :, 3] += 50.0  # an outlier channel, as in a language model's residual stream
    ids = np.arange(4)
    keys = C.example_keys(0, link=0, direction=0, step=0, ids=ids)
    errs = {}
    for axis in ("row", "channel"):
        codec = C.directq(2, axis)
        _, enc, xhat = codec.encode(None, x, ids, keys)
        assert len(enc.scales) == 4 * 4 * C.scales_per_example((64, 5), axis)
        _, back = codec.decode(None, enc, ids)
        np.testing.assert_array_equal(back, xhat)
        errs[axis] = float(np.sqrt(np.mean(np.delete(xhat - x, 3, axis=2) ** 2)))
    assert errs["channel"] < 0.2 * errs["row"]
    assert C.scales_per_example((8, 5), "row") == 8 and C.scales_per_example((8, 5), "channel") == 5
