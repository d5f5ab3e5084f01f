"""Greedy decoding with a key/value cache, compiled once per (batch, prompt bucket, length).

The prompts of a batch are left-padded to a multiple of ``bucket`` tokens (so prompts of
similar length share one compiled program); a padded slot is never attended to, and RoPE
positions count real tokens only, so a padded prompt decodes exactly like the unpadded one.
One jitted program runs the prefill and then ``max_new_tokens − 1`` single-token steps in a
``lax.fori_loop``, each step attending over the cache.

Example:
  >>> lm = smollm2.load()                                                  # doctest: +SKIP
  >>> greedy(lm.params, lm.config, [lm.tokenizer.encode("The capital of France is")], 3)  # doctest: +SKIP
  [[7042, 30, 378]]
"""

from __future__ import annotations

import functools
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from zeroth.models.pretrained import llama as _llama

__all__ = ["greedy", "greedy_tokens_fn"]


@functools.lru_cache(maxsize=16)
def greedy_tokens_fn(cfg: _llama.LlamaConfig, max_new_tokens: int):
    """Jitted ``fn(params, tokens int32[B, P], valid bool[B, P]) -> int32[B, max_new_tokens]``.

    ``tokens`` are left-padded prompts (``valid`` marks real tokens); the output holds the greedy
    continuation of each prompt (no stopping: callers cut at the end-of-sequence token).
    """
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")

    def run(params, tokens, valid):
        B, P = tokens.shape
        S = P + max_new_tokens
        kv_valid = jnp.concatenate([valid, jnp.ones((B, max_new_tokens), bool)], axis=1)
        positions = jnp.maximum(jnp.cumsum(valid.astype(jnp.int32), axis=1) - 1, 0)
        lengths = jnp.sum(valid.astype(jnp.int32), axis=1)
        cache = _llama.init_cache(cfg, B, S)
        hidden, cache = _llama.forward(
            params, cfg, tokens, positions=positions, kv_valid=kv_valid, cache=cache, cache_index=0
        )
        first = jnp.argmax(_llama.logits(params, cfg, hidden[:, -1]), axis=-1).astype(jnp.int32)
        out = jnp.zeros((B, max_new_tokens), jnp.int32).at[:, 0].set(first)

        def step(i, carry):
            out, cache = carry
            prev = jax.lax.dynamic_slice_in_dim(out, i - 1, 1, axis=1)
            pos = (lengths + i - 1)[:, None]
            h, cache = _llama.forward(
                params, cfg, prev, positions=pos, kv_valid=kv_valid, cache=cache, cache_index=P + i - 1
            )
            nxt = jnp.argmax(_llama.logits(params, cfg, h[:, 0]), axis=-1).astype(jnp.int32)
            out = jax.lax.dynamic_update_slice_in_dim(out, nxt[:, None], i, axis=1)
            return out, cache

        out, _ = jax.lax.fori_loop(1, max_new_tokens, step, (out, cache))
        return out

    return jax.jit(run)


def greedy(
    params: dict,
    cfg: _llama.LlamaConfig,
    prompts: Sequence[Sequence[int]],
    max_new_tokens: int,
    *,
    eos_id: int | None = None,
    bucket: int = 16,
) -> list[list[int]]:
    """Greedy continuations of token-id prompts.

    Args:
      params: the model parameters (NumPy or jax arrays).
      cfg: its config.
      prompts: one list of token ids per prompt (each non-empty).
      max_new_tokens: tokens to generate per prompt.
      eos_id: stop token; a continuation is cut after its first ``eos_id`` (kept).
      bucket: prompts are left-padded to a multiple of this length.

    Returns:
      One list of new token ids per prompt.
    """
    if not prompts or any(len(p) == 0 for p in prompts):
        raise ValueError("every prompt needs at least one token")
    longest = max(len(p) for p in prompts)
    P = -(-longest // bucket) * bucket
    if P + max_new_tokens > cfg.max_seq_len:
        raise ValueError(
            f"prompt ({longest}) + max_new_tokens ({max_new_tokens}) exceeds the context ({cfg.max_seq_len})"
        )
    tokens = np.zeros((len(prompts), P), np.int32)
    valid = np.zeros((len(prompts), P), bool)
    for i, p in enumerate(prompts):
        tokens[i, P - len(p) :] = np.asarray(p, np.int32)
        valid[i, P - len(p) :] = True
    out = np.asarray(greedy_tokens_fn(cfg, int(max_new_tokens))(params, tokens, valid))
    result = []
    for row in out.tolist():
        if eos_id is not None and eos_id in row:
            row = row[: row.index(eos_id) + 1]
        result.append(row)
    return result
