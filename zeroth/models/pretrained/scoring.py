"""Log-likelihood scoring with a causal LM: per-token log-probabilities, perplexity, continuations,
and the label-word logits of prompt-based classification.

* :func:`sequence_logprobs`: ``log p(x_{t+1} | x_{≤t})`` of each token after the first.
* :func:`perplexity`: ``exp(−mean log p)`` over those tokens.
* :func:`continuation_logprob`: ``Σ log p`` of a continuation's tokens given a prompt.
* :func:`label_logits`: for right-padded prompts, the logits of a few label words at each
  prompt's last token (MeZO's prompt classification: "<sentence> It was" -> " great" / " terrible";
  the cross-entropy over these logits is the loss on the label words only).

Example:
  >>> lm = smollm2.load()                                                        # doctest: +SKIP
  >>> perplexity(lm.params, lm.config, lm.tokenizer.encode("Fellow-Citizens of the Senate"))  # doctest: +SKIP
"""

from __future__ import annotations

import functools
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from zeroth.models.pretrained import llama as _llama

__all__ = ["PAD", "pad_right", "sequence_logprobs", "perplexity", "continuation_logprob", "label_logits"]

PAD = -1  # padding marker of right-padded token arrays


def pad_right(seqs: Sequence[Sequence[int]], length: int | None = None, pad: int = PAD) -> np.ndarray:
    """``int32[N, T]`` of the sequences, right-padded with ``pad`` to ``length`` (default the longest).

    Raises:
      ValueError: a sequence is empty or longer than ``length``.
    """
    if any(len(s) == 0 for s in seqs):
        raise ValueError("sequences must be non-empty")
    T = max(len(s) for s in seqs) if length is None else int(length)
    out = np.full((len(seqs), T), pad, np.int32)
    for i, s in enumerate(seqs):
        if len(s) > T:
            raise ValueError(f"sequence {i} has {len(s)} tokens, more than the length {T}")
        out[i, : len(s)] = np.asarray(s, np.int32)
    return out


@functools.lru_cache(maxsize=8)
def _logprob_fn(cfg: _llama.LlamaConfig):
    return jax.jit(lambda params, tokens: _llama.token_logprobs(params, cfg, tokens))


def sequence_logprobs(params: dict, cfg: _llama.LlamaConfig, seqs: Sequence[Sequence[int]]) -> list[np.ndarray]:
    """``[f32[len(s) − 1] for s in seqs]``: log-probability of every token given its prefix (one batch)."""
    tokens = pad_right(seqs)
    lp = np.asarray(_logprob_fn(cfg)(params, np.maximum(tokens, 0)))
    return [lp[i, : len(s) - 1].copy() for i, s in enumerate(seqs)]


def perplexity(params: dict, cfg: _llama.LlamaConfig, tokens: Sequence[int]) -> float:
    """``exp(−mean_t log p(x_{t+1} | x_{≤t}))`` of one token sequence (at least 2 tokens)."""
    if len(tokens) < 2:
        raise ValueError(f"perplexity needs at least 2 tokens, got {len(tokens)}")
    lp = sequence_logprobs(params, cfg, [tokens])[0]
    return float(np.exp(-np.mean(lp.astype(np.float64))))


def continuation_logprob(
    params: dict, cfg: _llama.LlamaConfig, prompt: Sequence[int], continuation: Sequence[int]
) -> float:
    """``Σ_j log p(c_j | prompt, c_{<j})`` of the continuation tokens."""
    if not prompt or not continuation:
        raise ValueError("prompt and continuation must be non-empty")
    lp = sequence_logprobs(params, cfg, [list(prompt) + list(continuation)])[0]
    return float(np.sum(lp[len(prompt) - 1 :].astype(np.float64)))


def label_logits(params: dict, cfg: _llama.LlamaConfig, x: jax.Array, label_ids: Sequence[int]) -> jax.Array:
    """Logits of the label tokens after each prompt: ``f32[B, C]`` (traceable).

    Args:
      params: model parameters.
      cfg: model config.
      x: ``int32[B, T]`` prompts right-padded with :data:`PAD` (every row non-empty).
      label_ids: the C label token ids (static).

    Causal attention makes the padding invisible to the real tokens, so only the hidden state of
    each row's last real token is read; the output layer is evaluated for the C labels only.
    """
    x = jnp.asarray(x)
    lengths = jnp.sum((x != PAD).astype(jnp.int32), axis=1)
    tokens = jnp.where(x == PAD, 0, x).astype(jnp.int32)
    hidden, _ = _llama.forward(params, cfg, tokens)
    last = jnp.take_along_axis(hidden, (lengths - 1)[:, None, None], axis=1)[:, 0]
    return _llama.logits(params, cfg, last, np.asarray(label_ids, np.int32))
