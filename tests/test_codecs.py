"""zeroth.codecs: the float32 codec and the one-byte signed-log codec (exact table, round trip,
error bound, sign and zero, refusals)."""

import hashlib
import math

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from zeroth import codecs

ONEBYTE = codecs.get_codec("onebyte")
FLOAT32 = codecs.get_codec("float32")
ALL_CODES = bytes(range(256))


def test_get_codec_names_and_unknown():
    assert codecs.get_codec("float32") == codecs.Codec("float32", FLOAT32.encode, FLOAT32.decode, 4)
    assert ONEBYTE.name == "onebyte" and ONEBYTE.bytes_per_value == 1
    with pytest.raises(ValueError, match=r"unknown codec 'int4'; expected one of \['float32', 'onebyte'\]"):
        codecs.get_codec("int4")


def test_table_is_the_committed_one():
    t = codecs.ONEBYTE_TABLE
    assert t.dtype == np.float32 and t.shape == (256,) and not t.flags.writeable
    assert hashlib.sha256(t.astype("<f4").tobytes()).hexdigest() == codecs.ONEBYTE_TABLE_SHA256
    assert codecs.ONEBYTE_TABLE_SHA256 == "a5e6e559bd73bfa72f72227bfcd597054e87277d328a9b3628d3feced571f97c"


def test_table_values_are_nearest_float32_of_exp_q_over_16():
    t = codecs.ONEBYTE_TABLE
    assert t[0x80] == 0.0 and not np.signbit(t[0x80])
    for b in range(256):
        if b == 0x80:
            continue
        m = abs(b - 0x80)
        q = m - 64
        assert codecs.onebyte_level(b) == q
        exact = math.exp(q / 16)  # float64, within 1 ulp(f64) of the truth: far inside half an ulp(f32)
        assert t[b] == np.copysign(np.float32(exact), b - 0x80), (b, t[b], exact)
        # and it is the nearest float32: neighbours are farther from exp(q/16)
        mag = abs(t[b])
        lo, hi = np.nextafter(mag, np.float32(0)), np.nextafter(mag, np.float32(np.inf))
        assert abs(float(mag) - exact) <= min(abs(float(lo) - exact), abs(float(hi) - exact))
    assert np.all(np.diff(t.astype(np.float64)) > 0), "bytes sort like their values"
    np.testing.assert_array_equal(t[0x81:], -t[0x7F:0:-1])  # symmetric for m = 1..127
    assert t[0] == -np.float32(math.exp(4.0))  # the one extra negative level


def test_every_code_round_trips_exactly():
    decoded = ONEBYTE.decode(ALL_CODES)
    assert decoded.dtype == np.float32 and decoded.shape == (256,)
    assert ONEBYTE.encode(decoded) == ALL_CODES
    np.testing.assert_array_equal(codecs.quantize(decoded), decoded)


def test_sign_and_zero_encoding():
    g = np.array([0.0, -0.0, 1.0, -1.0, 2.0**-149, -(2.0**-149), 1e-30, -1e-30], np.float32)
    p = ONEBYTE.encode(g)
    assert p[0] == p[1] == 0x80
    assert p[2] == 0xC0 and p[3] == 0x40  # q = 0: byte 128 ± 64
    assert p[4] == p[6] == 0x81 and p[5] == p[7] == 0x7F  # tiny magnitudes clip to the smallest level
    d = ONEBYTE.decode(p)
    assert d[0] == 0.0 and not np.signbit(d[0]) and d[1] == 0.0
    assert np.all(np.sign(d[2:]) == np.sign(g[2:]))


def test_large_magnitudes_clip_to_the_range():
    g = np.array([1e30, -1e30, 3.4e38, -3.4e38, 60.0, -60.0], np.float32)
    p = ONEBYTE.encode(g)
    assert list(p) == [0xFF, 0x00, 0xFF, 0x00, 0xFF, 0x00]
    lo, hi = codecs.ONEBYTE_RANGE
    assert lo == pytest.approx(math.exp(-63 / 16), rel=1e-7) and hi == pytest.approx(math.exp(63 / 16), rel=1e-7)


def _in_range_values(n: int, seed: int) -> np.ndarray:
    r = np.random.default_rng(seed)
    lo, hi = codecs.ONEBYTE_RANGE
    mags = np.exp(r.uniform(math.log(lo) - 1 / 32, math.log(hi) + 1 / 32, n))
    return (mags * r.choice([-1.0, 1.0], n)).astype(np.float32)


def test_relative_error_bound_inside_the_range():
    g = _in_range_values(20000, 0)
    d = ONEBYTE.decode(ONEBYTE.encode(g))
    assert np.all(np.sign(d) == np.sign(g))
    rel = np.abs(d.astype(np.float64) / g.astype(np.float64) - 1)
    bound = codecs.ONEBYTE_MAX_REL_ERROR * (1 + 2.0**-22)
    assert codecs.ONEBYTE_MAX_REL_ERROR == pytest.approx(math.exp(1 / 32) - 1)
    assert rel.max() <= bound
    # the log-domain error is at most half a level (plus the float32 rounding of the table)
    assert np.max(np.abs(np.log(d.astype(np.float64) / g.astype(np.float64)))) <= 1 / 32 + 2.0**-22


def test_encode_is_round_of_16_log_away_from_ties():
    g = _in_range_values(5000, 1)
    a = np.abs(g.astype(np.float64))
    x = 16 * np.log(a)
    far = np.abs(x - np.floor(x) - 0.5) > 1e-6
    q = np.clip(np.round(x), -63, np.where(g < 0, 64, 63)).astype(np.int64)
    m = q + 64
    expected = np.where(g < 0, 128 - m, 128 + m).astype(np.uint8)
    got = np.frombuffer(ONEBYTE.encode(g), np.uint8)
    np.testing.assert_array_equal(got[far], expected[far])


def test_boundaries_split_adjacent_levels():
    for q in (-63, -1, 0, 1, 40, 62):
        b = math.exp((q + 0.5) / 16)
        below = np.float32(b) if float(np.float32(b)) < b else np.nextafter(np.float32(b), np.float32(0))
        above = np.nextafter(below, np.float32(np.inf))
        assert float(below) < b < float(above)
        lv = [codecs.onebyte_level(c) for c in ONEBYTE.encode(np.array([below, above], np.float32))]
        assert lv == [q, q + 1]


@given(st.lists(st.floats(allow_nan=False, allow_infinity=False, width=32), min_size=0, max_size=50))
def test_onebyte_properties(values):
    g = np.array(values, np.float32)
    p = ONEBYTE.encode(g)
    assert len(p) == g.size
    d = ONEBYTE.decode(p)
    assert ONEBYTE.encode(d) == p  # decode is a right inverse: a quantized value is re-sent unchanged
    assert np.all((d == 0) == (g == 0))
    assert np.all(np.sign(d) == np.sign(g))


@given(st.lists(st.floats(allow_nan=False, allow_infinity=False, width=32), min_size=0, max_size=50))
def test_float32_round_trips_bit_for_bit(values):
    g = np.array(values, np.float32)
    p = FLOAT32.encode(g)
    assert len(p) == 4 * g.size and p == g.astype("<f4").tobytes()
    np.testing.assert_array_equal(FLOAT32.decode(p).view(np.uint32), g.view(np.uint32))


@pytest.mark.parametrize("codec", ["float32", "onebyte"])
@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
def test_non_finite_values_are_refused(codec, bad):
    g = np.array([1.0, 2.0, bad], np.float32)
    with pytest.raises(ValueError, match=r"cannot encode non-finite projected gradient\(s\): index 2 is"):
        codecs.get_codec(codec).encode(g)


@pytest.mark.parametrize("codec", ["float32", "onebyte"])
def test_bad_shapes_types_and_payloads(codec):
    c = codecs.get_codec(codec)
    with pytest.raises(ValueError, match="must be 1-D"):
        c.encode(np.zeros((2, 2), np.float32))
    with pytest.raises(TypeError, match="must be a real array"):
        c.encode(np.array(["a"]))
    with pytest.raises(TypeError, match="payload must be bytes"):
        c.decode([1, 2, 3, 4])
    assert c.decode(b"").shape == (0,)


def test_float32_payload_length_and_overflow():
    with pytest.raises(ValueError, match="7 bytes is not a multiple of 4"):
        FLOAT32.decode(b"\0" * 7)
    with pytest.raises(ValueError, match="overflows float32"):
        FLOAT32.encode(np.array([1e300]))


def test_decode_is_a_writable_copy():
    d = ONEBYTE.decode(b"\x80\xc0")
    d[0] = 5.0  # does not touch the table
    assert codecs.ONEBYTE_TABLE[0x80] == 0.0
    with pytest.raises(ValueError, match=r"integer in \[0, 255\]"):
        codecs.onebyte_level(256)


def test_integer_one_byte_codes_are_the_host_encoders_on_numpy_and_in_a_program():
    # onebyte_codes compares float32 bit patterns with the boundaries' (rounded up to float32):
    # the codes of encode's float64 comparisons, with no float operation a backend could flush or
    # round otherwise. Every boundary and its float32 neighbours, zeros, subnormals, the range's
    # ends and random magnitudes over twenty decades, of both signs.
    import jax
    import jax.numpy as jnp

    vals = [0.0, 1e-45, 1e-40, 1.1754942e-38, 3.4e38]
    for b in codecs._BOUNDS.tolist():
        f = np.float32(b)
        for step in (-2, -1, 0, 1, 2):
            v = f
            for _ in range(abs(step)):
                v = np.nextafter(v, np.float32(np.inf if step > 0 else -np.inf))
            vals.append(float(v))
    r = np.random.default_rng(0)
    mags = np.concatenate(
        [
            np.abs(np.array(vals, np.float32)),
            (10.0 ** r.uniform(-10, 10, 20000)).astype(np.float32),
            r.integers(0, 0x7F800000, 20000, dtype=np.uint32).view(np.float32),
        ]
    )
    g = np.concatenate([mags, -mags])
    want = np.frombuffer(codecs.ONEBYTE.encode(g), np.uint8)
    np.testing.assert_array_equal(codecs.onebyte_codes(g.view(np.uint32)), want)
    on_device = jax.jit(lambda x: codecs.onebyte_codes(jax.lax.bitcast_convert_type(x, jnp.uint32), jnp))(g)
    np.testing.assert_array_equal(np.asarray(on_device), want)
    # each boundary's float32 pattern is the smallest float32 at or above it
    bits = codecs.ONEBYTE_BOUND_BITS.view(np.float32).astype(np.float64)
    below = np.nextafter(codecs.ONEBYTE_BOUND_BITS.view(np.float32), np.float32(0)).astype(np.float64)
    assert np.all(bits >= codecs._BOUNDS) and np.all(below < codecs._BOUNDS)
