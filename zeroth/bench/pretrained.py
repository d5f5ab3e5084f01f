"""Benchmark setups of the pretrained models, in the form ``zeroth bench zo`` uses.

:func:`setup` returns ``(kwargs, params, (x, y), loss_fn)`` like the bench's own model setups:
the pretrained parameters (fresh float32 jax arrays), a batch of real prompts and labels, and
the training objective (cross-entropy over the model's logits, i.e. over the label words for
SmolLM2). The prompts are built from a fixed list of sentences (no dataset needed), tiled to the
batch size and padded to ``seq_len`` tokens.

Example:
  >>> kwargs, params, batch, loss_fn = setup("smollm2", batch=8)       # doctest: +SKIP
  >>> float(jax.jit(loss_fn)(params, batch))                           # doctest: +SKIP
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

import zeroth.models.pretrained  # noqa: F401  (registers smollm2_prompt, minilm_classifier)
from zeroth import models
from zeroth.data import bpe as _bpe
from zeroth.data import text as _text
from zeroth.data import wordpiece as _wp
from zeroth.models.pretrained import llama as _llama

__all__ = ["MODELS", "SENTENCES", "WEIGHTS", "setup"]

MODELS = ("smollm2", "smollm2_unrolled", "minilm")
WEIGHTS = ("pretrained", "random")  # setup's choices: the package's weights, or SmolLM2's architecture with random ones
# (sentence, label): 0 negative, 1 positive
SENTENCES = (
    ("The food was cold and the waiter was rude.", 0),
    ("Wonderful service and delicious food, I will be back!", 1),
    ("The battery died after two days.", 0),
    ("This phone is a great value for the price.", 1),
    ("A slow, aimless movie with a silly plot.", 0),
    ("The acting was superb and the story moved me.", 1),
    ("I would not recommend this place to anyone.", 0),
    ("Best purchase I have made all year.", 1),
)


def _cross_entropy(model):
    def loss_fn(p, b):
        xb, yb = b
        logits = models.apply(model, p, xb).astype(jnp.float32)
        logp = jax.nn.log_softmax(logits, axis=-1)
        return -jnp.mean(jnp.take_along_axis(logp, yb[:, None], axis=-1))

    return loss_fn


def setup(name: str, batch: int = 8, seq_len: int | None = None, weights: str = "pretrained"):
    """``(kwargs, params, (x, y), loss_fn)`` of a pretrained model for ``zeroth bench zo``.

    Args:
      name: ``"smollm2"`` (``smollm2_prompt``, prompts ``"<sentence> It was"``, default 40 tokens),
        ``"smollm2_unrolled"`` (the same with ``scan_layers=False``: one leaf per layer) or
        ``"minilm"`` (``minilm_classifier``, default 64 tokens).
      batch: number of examples (the sentence list is tiled).
      seq_len: padded length of the token arrays.
      weights: ``"pretrained"``, or ``"random"`` for SmolLM2's architecture
        (:data:`zeroth.models.pretrained.llama.SMOLLM2_135M`) with random weights and random token
        ids of ``seq_len`` (no package needed): the same programs, shapes and work, for time and
        memory where the weights are not installed; its losses mean nothing. ``smollm2_unrolled``'s
        are ``smollm2``'s, one leaf per layer (:func:`zeroth.models.pretrained.llama.unstack_layers`).
    """
    if name not in MODELS:
        raise ValueError(f"unknown pretrained benchmark model {name!r}; expected one of {list(MODELS)}")
    if weights not in WEIGHTS:
        raise ValueError(f"weights must be one of {list(WEIGHTS)}, got {weights!r}")
    if weights == "random" and not name.startswith("smollm2"):
        raise ValueError(
            f"random weights are available for smollm2 and smollm2_unrolled (SmolLM2's architecture "
            f"is known without its package), not for {name!r}"
        )
    if batch < 1:
        raise ValueError(f"batch must be a positive integer, got {batch}")
    sentences = [SENTENCES[i % len(SENTENCES)][0] for i in range(batch)]
    y = np.array([SENTENCES[i % len(SENTENCES)][1] for i in range(batch)], np.int32)
    if weights == "random":
        kwargs = {"num_classes": 2, "scan_layers": name == "smollm2"}
        cfg = _llama.SMOLLM2_135M
        # any two tokens serve as label words: the same work as the real ones'
        model = models.build("smollm2_prompt", **kwargs, architecture=cfg, label_ids=(0, 1))
        rng = np.random.default_rng(0)
        x = jnp.asarray(rng.integers(0, cfg.vocab_size, (batch, seq_len or _text.SMOLLM2_PROMPT_TOKENS)), jnp.int32)
        # Drawn by the stacked model's initializer, then cut into one leaf per layer for the unrolled
        # layout: the unrolled model's own initializer is one program drawing its 272 leaves apart,
        # several times as long to compile as the stacked one's, on a CPU and for a GPU alike.
        params = models.init(model.clone(scan_layers=True), models.init_key(0), x[:1], pretrained=False, exact=False)
        if not model.scan_layers:
            params = _llama.unstack_layers(params, cfg.n_layers)
        return {**kwargs, "weights": "random"}, params, (x, jnp.asarray(y)), _cross_entropy(model)
    if name.startswith("smollm2"):
        kwargs = {"num_classes": 2, "label_words": _text.LABEL_WORDS, "scan_layers": name == "smollm2"}
        model = models.build("smollm2_prompt", **kwargs)
        x = _text.smollm2_prompts(sentences, _bpe.smollm2_tokenizer(), seq_len or _text.SMOLLM2_PROMPT_TOKENS)
    else:
        kwargs = {"num_classes": 2}
        model = models.build("minilm_classifier", **kwargs)
        x = _wp.minilm_tokenizer().batch(sentences, seq_len or _text.MINILM_TOKENS)
    params = model.pretrained_params(models.init_key(0), x[:1])
    return kwargs, params, (jnp.asarray(x), jnp.asarray(y)), _cross_entropy(model)
