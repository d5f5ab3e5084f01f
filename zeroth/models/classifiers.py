"""Small flax (linen) classifiers sized for CPU: MLP, CNN and a transformer encoder.

All return logits ``f32[B, num_classes]``. Images are ``f32[B, H, W, C]``; the transformer
also takes token ids ``int32[B, T]`` (set ``vocab_size``). Parameter names are flax's defaults
(``Dense_0/kernel`` ...), so a later loader can fill them with pretrained weights. The MLP's and
the CNN's dense layers multiply through :func:`zeroth.layerwise.dot_general`: inside a ZO step on
a CPU each kernel of at least :data:`zeroth.zo.estimator.BLOCKS_MIN_ELEMENTS` is perturbed a block of rows at
a time (the step keeps nearer the memory of inference); elsewhere the product is flax's own.
"""

from __future__ import annotations

from collections.abc import Sequence

import flax.linen as nn
import jax
import jax.numpy as jnp

from zeroth import layerwise as _layerwise

__all__ = ["MLP", "CNN", "Transformer", "ACTIVATIONS"]

ACTIVATIONS = {"relu": nn.relu, "gelu": nn.gelu, "tanh": jnp.tanh}


def _activation(name: str):
    if name not in ACTIVATIONS:
        raise ValueError(f"unknown activation {name!r}; expected one of {sorted(ACTIVATIONS)}")
    return ACTIVATIONS[name]


def _check_float_input(model: str, x: jax.Array) -> None:
    if not jnp.issubdtype(x.dtype, jnp.floating):
        raise TypeError(f"{model} takes float inputs f32[B, ...]; got dtype {x.dtype} (token ids need the transformer)")


class MLP(nn.Module):
    """Flatten, then ``Dense(h) -> activation`` for each ``h`` in ``hidden``, then ``Dense(num_classes)``.

    Attributes:
      num_classes: number of output logits.
      hidden: widths of the hidden layers (``()`` = a linear classifier).
      activation: ``relu``, ``gelu`` or ``tanh``.

    Example:
      >>> m = MLP(num_classes=10, hidden=(32,))
    """

    num_classes: int = 10
    hidden: Sequence[int] = (64,)
    activation: str = "relu"

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        _check_float_input("MLP", x)
        act = _activation(self.activation)
        h = x.reshape(x.shape[0], -1)
        for width in self.hidden:
            h = act(nn.Dense(int(width), dot_general=_layerwise.dot_general)(h))
        return nn.Dense(self.num_classes, dot_general=_layerwise.dot_general)(h)


class CNN(nn.Module):
    """``Conv(3x3, f) -> relu -> max_pool(2x2)`` for each ``f`` in ``features``, then a dense head.

    Attributes:
      num_classes: number of output logits.
      features: channels of each conv block (each halves H and W).
      dense: width of the hidden dense layer (0 = none).

    Example:
      >>> m = CNN(num_classes=10, features=(8, 16), dense=32)
    """

    num_classes: int = 10
    features: Sequence[int] = (8, 16)
    dense: int = 32

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        _check_float_input("CNN", x)
        if x.ndim != 4:
            raise ValueError(f"CNN takes images f32[B, H, W, C]; got shape {x.shape}")
        h = x
        for f in self.features:
            h = nn.relu(nn.Conv(int(f), (3, 3), padding="SAME")(h))
            h = nn.max_pool(h, (2, 2), strides=(2, 2), padding="SAME")
        h = h.reshape(h.shape[0], -1)
        if self.dense:
            h = nn.relu(nn.Dense(int(self.dense), dot_general=_layerwise.dot_general)(h))
        return nn.Dense(self.num_classes, dot_general=_layerwise.dot_general)(h)


class _Block(nn.Module):
    d_model: int
    heads: int
    mlp_dim: int

    @nn.compact
    def __call__(self, h: jax.Array, mask: jax.Array | None) -> jax.Array:
        a = nn.LayerNorm()(h)
        a = nn.MultiHeadDotProductAttention(num_heads=self.heads, qkv_features=self.d_model)(a, a, mask=mask)
        h = h + a
        m = nn.LayerNorm()(h)
        m = nn.Dense(self.mlp_dim)(m)
        m = nn.gelu(m)
        m = nn.Dense(self.d_model)(m)
        return h + m


class Transformer(nn.Module):
    """A pre-LayerNorm transformer encoder classifier with mean pooling.

    Images ``f32[B, H, W, C]`` become H tokens (one per row, ``W*C`` features, projected by a
    Dense); token ids ``int32[B, T]`` are embedded (``vocab_size`` required). Learned positional
    embeddings up to ``max_len``. With ``pad_id`` set, padding tokens are masked out of attention
    and pooling.

    Attributes:
      num_classes: number of output logits.
      d_model: width of the residual stream.
      heads: attention heads (must divide d_model).
      layers: number of blocks.
      mlp_dim: hidden width of each block's MLP.
      vocab_size: size of the token vocabulary (token inputs only).
      max_len: maximum number of tokens.
      pad_id: id of the padding token (token inputs only), or None.

    Example:
      >>> m = Transformer(num_classes=10, d_model=32, heads=2, layers=2)
    """

    num_classes: int = 10
    d_model: int = 32
    heads: int = 2
    layers: int = 2
    mlp_dim: int = 64
    vocab_size: int | None = None
    max_len: int = 128
    pad_id: int | None = None

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        if self.d_model % self.heads:
            raise ValueError(f"Transformer: heads={self.heads} must divide d_model={self.d_model}")
        keep = None
        if jnp.issubdtype(x.dtype, jnp.integer):
            if self.vocab_size is None:
                raise ValueError("Transformer: token-id inputs need vocab_size")
            h = nn.Embed(self.vocab_size, self.d_model)(x)
            if self.pad_id is not None:
                keep = x != self.pad_id
        else:
            if x.ndim < 3:
                raise ValueError(f"Transformer takes images f32[B, H, W, C] or tokens int32[B, T]; got shape {x.shape}")
            h = nn.Dense(self.d_model)(x.reshape(x.shape[0], x.shape[1], -1))
        t = h.shape[1]
        if t > self.max_len:
            raise ValueError(f"Transformer: {t} tokens exceed max_len={self.max_len}")
        pos = self.param("pos_embedding", nn.initializers.normal(0.02), (self.max_len, self.d_model), jnp.float32)
        h = h + pos[None, :t, :]
        mask = None if keep is None else nn.make_attention_mask(keep, keep)
        for _ in range(self.layers):
            h = _Block(self.d_model, self.heads, self.mlp_dim)(h, mask)
        h = nn.LayerNorm()(h)
        if keep is None:
            pooled = jnp.mean(h, axis=1)
        else:
            w = keep.astype(h.dtype)[:, :, None]
            pooled = jnp.sum(h * w, axis=1) / jnp.maximum(jnp.sum(w, axis=1), jnp.float32(1.0))
        return nn.Dense(self.num_classes)(pooled)
