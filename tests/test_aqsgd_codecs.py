"""Activation codecs (zeroth.compress): unbiased, within one level, packed for real, both ends agree."""

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


@given(
    bits=st.sampled_from([2, 3, 4, 6, 8]),
    row=st.lists(st.floats(-100, 100, allow_nan=False, width=32), min_size=1, max_size=16),
    step=st.integers(0, 1000),
)
@settings(max_examples=40, deadline=None)
def test_directq_is_within_one_level(bits, row, step):
    x = np.array([row, [2.0 * v for v in row]], np.float32)
    keys = C.example_keys(3, link=1, direction=0, step=step, ids=[0, 1])
    _, enc, xhat = C.directq(bits).encode(None, x, np.array([0, 1]), keys)
    s = np.max(np.abs(x), axis=1, keepdims=True)
    assert np.all(np.abs(xhat - x) <= 2 * s / ((1 << bits) - 1) * (1 + 1e-5) + 1e-30)
    _, back = C.directq(bits).decode(None, enc, np.array([0, 1]))
    np.testing.assert_array_equal(back, xhat)
    assert enc.nbytes == (x.size * bits + 7) // 8 + 4 * x.shape[0]


@given(bits=st.sampled_from([1, 2, 4]), value=st.floats(-1, 1, allow_nan=False, width=32))
@settings(max_examples=15, deadline=None)
def test_directq_is_unbiased(bits, value):
    """Mean of 4096 independent roundings of a row (value, 1): within 5 standard errors of value."""
    n = 4096
    x = np.tile(np.array([[value, 1.0]], np.float32), (n, 1))
    ids = np.arange(n)
    keys = C.example_keys(7, link=0, direction=1, step=0, ids=ids)
    _, _, xhat = C.directq(bits).encode(None, x, ids, keys)
    step = 2.0 / ((1 << bits) - 1)
    sd = step / 2  # a two-point distribution one level wide has standard deviation <= step/2
    assert abs(xhat[:, 0].mean() - value) <= 5 * sd / np.sqrt(n) + 1e-6
    np.testing.assert_array_equal(xhat[:, 1], 1.0)  # the maximum is a level: no noise


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
    assert second[0].nbytes == (3 * 20 * 2 + 7) // 8 + 4 * 3 * 4 < first[0].nbytes
    # the buffers track the slowly drifting activations far better than direct 2-bit quantization
    err_aq = np.mean([np.abs(xs - x).mean() for _, x, xs in sent[4:]])
    _, _, direct = _walk(C.directq(2), steps=8)
    err_dq = np.mean([np.abs(xs - x).mean() for _, x, xs in direct[4:]])
    assert err_aq < 0.2 * err_dq
    assert C.buffer_nbytes(send) == 6 * 20 * 4 + 6


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
    with pytest.raises(ValueError, match="unknown activation codec"):
        C.make_codec("topk", 2)


def test_channel_scales_isolate_an_outlier_channel():
    """One scale per channel: an outlier channel no longer sets the step of every other value."""
    x = np.random.default_rng(0).normal(size=(2, 8, 5)).astype(np.float32) * 0.1
    x[:, :, 3] += 50.0  # an outlier channel, as in a language model's residual stream
    ids = np.array([0, 1])
    keys = C.example_keys(0, link=0, direction=0, step=0, ids=ids)
    errs = {}
    for axis in ("row", "channel"):
        codec = C.directq(2, axis)
        _, enc, xhat = codec.encode(None, x, ids, keys)
        assert len(enc.scales) == 4 * 2 * C.scales_per_example((8, 5), axis)
        _, back = codec.decode(None, enc, ids)
        np.testing.assert_array_equal(back, xhat)
        errs[axis] = float(np.abs(np.delete(xhat - x, 3, axis=2)).max())
    assert errs["channel"] < 0.05 * errs["row"]
    assert C.scales_per_example((8, 5), "row") == 8 and C.scales_per_example((8, 5), "channel") == 5
