"""Split a model into S contiguous stages: pure stage functions and the parameters of each stage.

Two families:

* ``transformer``: zeroth's own :class:`zeroth.models.classifiers.Transformer` parameters
  (``Embed_0``, ``pos_embedding``, ``_Block_i``, ``LayerNorm_0``, ``Dense_0``). Stage 0 holds the
  embeddings, the last stage the final LayerNorm and the head, the blocks are dealt out in
  contiguous runs. Objective ``classify``: the model itself (pad mask, mean pooling,
  ``num_classes`` logits); objective ``lm``: the same blocks with a causal mask and the head
  applied to every position (``num_classes = vocab_size``), next-token cross-entropy.
* ``smollm2``: SmolLM2-135M (:mod:`zeroth.models.pretrained.llama`, stacked layers). Stage 0 holds
  ``embed``, the last ``final_norm`` and ``head``, an *untied* copy of the embedding initialised
  from it (the two ends of the pipeline cannot share one matrix without an extra exchange).
  Objective ``lm`` only.

Every stage function takes the micro-batch's tokens (each stage reads them from the data by the
example ids a message carries), so masks need no extra traffic:

* ``first(params, tokens) -> h f32[B, T, d]``
* ``middle(params, h, tokens) -> h``
* ``last(params, h, tokens, labels) -> loss f32[]`` (mean over the micro-batch)

:func:`reference_loss` chains them in one process: the single-process model a pipeline with
float32 links must match.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import NamedTuple

import flax.linen as nn
import jax
import jax.numpy as jnp

__all__ = [
    "FAMILIES",
    "OBJECTIVES",
    "Partition",
    "block_ranges",
    "check_ranges",
    "even_split",
    "reference_loss",
    "smollm2_partition",
    "transformer_partition",
]

FAMILIES = ("transformer", "smollm2")
OBJECTIVES = ("lm", "classify")


class Partition(NamedTuple):
    """A model cut into stages.

    Attributes:
      params: one parameter pytree per stage (float32).
      fns: one stage function per stage (see the module docstring for the signatures).
      width: the activation row width ``d`` (the last axis of what crosses a link).
      objective: ``lm`` or ``classify``.
    """

    params: list
    fns: list
    width: int
    objective: str


def even_split(n: int, parts: int) -> list[tuple[int, int]]:
    """``[0, n)`` cut into ``parts`` contiguous ``[start, stop)`` ranges whose sizes differ by at most one,
    the larger first (some empty when ``n < parts``)."""
    base, extra = divmod(n, parts)
    out, start = [], 0
    for s in range(parts):
        stop = start + base + (1 if s < extra else 0)
        out.append((start, stop))
        start = stop
    return out


def block_ranges(n_blocks: int, stages: int) -> list[tuple[int, int]]:
    """Contiguous ``[start, stop)`` block ranges, sizes differing by at most one (earlier stages larger).

    Raises:
      ValueError: fewer blocks than stages.
    """
    if stages < 1 or n_blocks < stages:
        raise ValueError(f"cannot split {n_blocks} blocks into {stages} stages (each stage needs at least one block)")
    return even_split(n_blocks, stages)


def check_ranges(ranges, n_blocks: int) -> list[tuple[int, int]]:
    """Explicit ``[start, stop)`` block ranges, checked to tile ``[0, n_blocks)`` in order.

    A range may be empty (a first stage holding only the embeddings, a last one only the head).

    Raises:
      ValueError: the ranges leave a gap, overlap, or do not cover every block.
    """
    out = [(int(a), int(b)) for a, b in ranges]
    if not out:
        raise ValueError("no stages: give at least one block range")
    at = 0
    for i, (a, b) in enumerate(out):
        if a != at or b < a:
            raise ValueError(
                f"stage {i} range [{a}, {b}) does not continue from block {at}: ranges must tile "
                f"[0, {n_blocks}) in order, e.g. {block_ranges(n_blocks, len(out)) if n_blocks >= len(out) else [(0, n_blocks)]}"
            )
        at = b
    if at != n_blocks:
        raise ValueError(
            f"the stage ranges end at block {at}, the model has {n_blocks}: the last range must stop at {n_blocks}"
        )
    return out


def _ranges_of(stages, n_blocks: int) -> list[tuple[int, int]]:
    return block_ranges(n_blocks, stages) if isinstance(stages, int) else check_ranges(stages, n_blocks)


def _cross_entropy(logits: jax.Array, labels: jax.Array) -> jax.Array:
    logp = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
    return -jnp.mean(jnp.take_along_axis(logp, labels[..., None].astype(jnp.int32), axis=-1))


# --------------------------------------------------------------------------- zeroth's transformer


def _block(p: dict, h: jax.Array, mask, heads: int, d_model: int, mlp_dim: int) -> jax.Array:
    """One pre-LN block with the parameter names of ``zeroth.models.classifiers``'s blocks."""
    a = nn.LayerNorm().apply({"params": p["LayerNorm_0"]}, h)
    attn = nn.MultiHeadDotProductAttention(num_heads=heads, qkv_features=d_model)
    a = attn.apply({"params": p["MultiHeadDotProductAttention_0"]}, a, a, mask=mask)
    h = h + a
    m = nn.LayerNorm().apply({"params": p["LayerNorm_1"]}, h)
    m = nn.gelu(nn.Dense(mlp_dim).apply({"params": p["Dense_0"]}, m))
    return h + nn.Dense(d_model).apply({"params": p["Dense_1"]}, m)


def transformer_partition(
    params: dict,
    stages: int | Sequence[tuple[int, int]],
    *,
    objective: str,
    heads: int,
    mlp_dim: int,
    pad_id: int | None = None,
) -> Partition:
    """Cut the parameters of a token-input ``Transformer`` into ``stages`` (see the module docstring).

    Args:
      params: ``zeroth.models.init`` of ``Transformer(vocab_size=V, num_classes=C, ...)``.
      stages: number of stages S (at most the number of blocks; sizes as :func:`block_ranges`), or
        the stages' block ranges (:func:`check_ranges`; a Ravnest cluster splits by its nodes' RAM).
      objective: ``classify`` (labels ``int32[B]``) or ``lm`` (``C = V``; labels are the tokens).
      heads, mlp_dim: the model's attention heads and MLP width.
      pad_id: padding token masked out of attention and pooling (classify only).
    """
    if objective not in OBJECTIVES:
        raise ValueError(f"unknown pipeline objective {objective!r}; expected one of {list(OBJECTIVES)}")
    n_blocks = sum(1 for k in params if k.startswith("_Block_"))
    d_model = int(params["Embed_0"]["embedding"].shape[1])
    ranges = _ranges_of(stages, n_blocks)
    stages = len(ranges)

    def mask_of(tokens):
        if objective == "lm":
            return nn.make_causal_mask(tokens)
        if pad_id is None:
            return None
        keep = tokens != pad_id
        return nn.make_attention_mask(keep, keep)

    def run_blocks(p, lo, hi, h, tokens):
        mask = mask_of(tokens)
        for i in range(lo, hi):
            h = _block(p[f"_Block_{i}"], h, mask, heads, d_model, mlp_dim)
        return h

    def head_loss(p, h, tokens, labels):
        h = nn.LayerNorm().apply({"params": p["LayerNorm_0"]}, h)
        dense = nn.Dense(int(p["Dense_0"]["kernel"].shape[1]))
        if objective == "lm":
            logits = dense.apply({"params": p["Dense_0"]}, h[:, :-1])
            return _cross_entropy(logits, tokens[:, 1:])
        if pad_id is None:
            pooled = jnp.mean(h, axis=1)
        else:
            w = (tokens != pad_id).astype(h.dtype)[:, :, None]
            pooled = jnp.sum(h * w, axis=1) / jnp.maximum(jnp.sum(w, axis=1), jnp.float32(1.0))
        return _cross_entropy(dense.apply({"params": p["Dense_0"]}, pooled), labels)

    stage_params, fns = [], []
    for s, (lo, hi) in enumerate(ranges):
        p = {f"_Block_{i}": params[f"_Block_{i}"] for i in range(lo, hi)}
        first, last = s == 0, s == stages - 1
        if first:
            p["Embed_0"], p["pos_embedding"] = params["Embed_0"], params["pos_embedding"]
        if last:
            p["LayerNorm_0"], p["Dense_0"] = params["LayerNorm_0"], params["Dense_0"]
        stage_params.append(p)
        fns.append(_transformer_fn(first, last, lo, hi, run_blocks, head_loss))
    return Partition(stage_params, fns, d_model, objective)


def _transformer_fn(first: bool, last: bool, lo: int, hi: int, run_blocks, head_loss) -> Callable:
    def embed(p, tokens):
        h = nn.Embed(p["Embed_0"]["embedding"].shape[0], p["Embed_0"]["embedding"].shape[1]).apply(
            {"params": p["Embed_0"]}, tokens
        )
        return h + p["pos_embedding"][None, : tokens.shape[1], :]

    if first and last:
        return lambda p, tokens, labels: head_loss(p, run_blocks(p, lo, hi, embed(p, tokens), tokens), tokens, labels)
    if first:
        return lambda p, tokens: run_blocks(p, lo, hi, embed(p, tokens), tokens)
    if last:
        return lambda p, h, tokens, labels: head_loss(p, run_blocks(p, lo, hi, h, tokens), tokens, labels)
    return lambda p, h, tokens: run_blocks(p, lo, hi, h, tokens)


# --------------------------------------------------------------------------- SmolLM2


def smollm2_partition(params: dict, cfg, stages: int | Sequence[tuple[int, int]]) -> Partition:
    """Cut SmolLM2 (stacked ``llama`` parameters, ``cfg`` its ``LlamaConfig``) into ``stages`` (lm only).

    ``stages``: a count or explicit layer ranges, as in :func:`transformer_partition`.
    """
    from zeroth.models.pretrained import llama

    ranges = _ranges_of(stages, cfg.n_layers)
    stages = len(ranges)

    def run_layers(lp, h):
        B, T, _ = h.shape
        positions = jnp.broadcast_to(jnp.arange(T, dtype=jnp.int32), (B, T))
        mask = jnp.broadcast_to(jnp.tril(jnp.ones((T, T), bool))[None], (B, T, T))

        def body(h, layer):
            h, _ = llama._layer(cfg, h, layer, positions, mask, None, 0)
            return h, None

        h, _ = jax.lax.scan(body, h, lp)
        return h

    def head_loss(p, h, tokens):
        lg = llama.logits({"final_norm": p["final_norm"], "embed": p["head"]}, cfg, h[:, :-1])
        return _cross_entropy(lg, tokens[:, 1:])

    stage_params, fns = [], []
    for s, (lo, hi) in enumerate(ranges):
        p = {"layers": {name: jnp.asarray(params[name][lo:hi], jnp.float32) for name in llama.LAYER_PARAMS}}
        first, last = s == 0, s == stages - 1
        if first:
            p["embed"] = jnp.asarray(params["embed"], jnp.float32)
        if last:
            p["final_norm"] = jnp.asarray(params["final_norm"], jnp.float32)
            p["head"] = jnp.asarray(params["embed"], jnp.float32)
        stage_params.append(p)
        if first and last:
            fns.append(lambda p, tokens, labels: head_loss(p, run_layers(p["layers"], p["embed"][tokens]), tokens))
        elif first:
            fns.append(lambda p, tokens: run_layers(p["layers"], p["embed"][tokens]))
        elif last:
            fns.append(lambda p, h, tokens, labels: head_loss(p, run_layers(p["layers"], h), tokens))
        else:
            fns.append(lambda p, h, tokens: run_layers(p["layers"], h))
    return Partition(stage_params, fns, cfg.dim, "lm")


# --------------------------------------------------------------------------- the single-process model


def reference_loss(part: Partition, params: list, tokens: jax.Array, labels: jax.Array) -> jax.Array:
    """The loss of the whole chain in one process: ``last(..., middle(..., first(p0, tokens)))``."""
    fns = part.fns
    if len(fns) == 1:
        return fns[0](params[0], tokens, labels)
    h = fns[0](params[0], tokens)
    for s in range(1, len(fns) - 1):
        h = fns[s](params[s], h, tokens)
    return fns[-1](params[-1], h, tokens, labels)
