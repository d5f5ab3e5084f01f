"""Binary/ternary 3x3 conv layers as pytrees, their packed forward, input encoding, pooling and the auxiliary head.

A layer holds its weights as values ``w: int8[O, 9 C]`` in {-1, +1} (binary) or {-1, 0, +1}
(ternary), in im2col order (column ``k * C + c`` = tap ``k = 3 (dy + 1) + (dx + 1)``, channel
``c``), and an integer threshold per output. The forward pass packs them (:func:`packed_weights`)
and runs the XOR-popcount conv of :mod:`zeroth.kernels.binary`: ``dot = sum x w`` as integers,
output ``+1`` where ``dot >= thresh`` else ``-1`` (a set bit).

The **auxiliary head** (Belilovsky et al. 2018) is linear in the ±1 activations: the image is
split into a ``grid x grid`` array of regions, each region's activations are averaged, and a
float matrix maps them to class logits::

    logits[b, k] = bias[k] + sum_{p, o} act[b, p, o] * V[p, o, k],   V[p, o, k] = A[r(p), o, k] / |r(p)|.

Linearity is what makes the loss change of a weight flip computable exactly (:mod:`zeroth.binary.flips`).

Inputs are grey images in [0, 1], encoded as ``levels`` thermometer channels: channel ``i`` is
-1 (a set bit) where ``x < (i + 1) / (levels + 1)``.

Example:
  >>> import numpy as np
  >>> spec = ConvSpec(c_in=8, c_out=4)
  >>> x = encode_thermometer(np.random.default_rng(0).random((2, 5, 5, 1)), 8)
  >>> layer = init_layer(spec, x, seed=0)
  >>> forward(layer, x, spec).shape
  (2, 5, 5, 1)
"""

from __future__ import annotations

import hashlib
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from zeroth.binary import reference as R
from zeroth.kernels import binary as kb

__all__ = [
    "ConvSpec",
    "ConvLayer",
    "Head",
    "init_layer",
    "init_head",
    "forward",
    "head_logits",
    "encode_thermometer",
    "layer_checksum",
]


class ConvSpec(NamedTuple):
    """Static description of one binary layer.

    Attributes:
      c_in: input channels (bits per pixel).
      c_out: output channels.
      ternary: weights in {-1, 0, +1} (two bit-planes) instead of {-1, +1}.
      pool: 2x2 max-pool of the output before the next layer (an AND of set bits).
    """

    c_in: int
    c_out: int
    ternary: bool = False
    pool: bool = True

    @property
    def n_weights(self) -> int:
        return self.c_out * 9 * self.c_in

    @property
    def step(self) -> int:
        """How far one mutation moves a dot product per unit of input: 2 (a sign flip) or 1 (ternary)."""
        return 1 if self.ternary else 2


class ConvLayer(NamedTuple):
    """A binary/ternary 3x3 conv layer (a pytree)."""

    w: jax.Array  # int8[O, 9 * C], im2col order, values in {-1, +1} or {-1, 0, +1}
    thresh: jax.Array  # int32[O]


class Head(NamedTuple):
    """Auxiliary linear head over region-averaged ±1 activations (a pytree)."""

    a: jax.Array  # f32[R, O, K]
    b: jax.Array  # f32[K]


class Regions(NamedTuple):
    """Region of every pixel (``int32[H W]``) and pixels per region (``f32[R]``)."""

    index: np.ndarray
    counts: np.ndarray


def encode_thermometer(images, levels: int = 8) -> np.ndarray:
    """Grey images ``f[N, H, W, 1]`` in [0, 1] -> packed ``u32[N, H, W, words(levels)]`` thermometer bits."""
    x = np.asarray(images, np.float32)
    if x.ndim != 4 or x.shape[-1] != 1:
        raise ValueError(f"images must be f32[N, H, W, 1], got shape {x.shape}")
    if levels < 1:
        raise ValueError(f"levels must be >= 1, got {levels}")
    cuts = np.arange(1, levels + 1, dtype=np.float32) / np.float32(levels + 1)
    return R.pack(x < cuts)  # (N, H, W, levels) bools, True = -1


def packed_weights(w, c_in: int, ternary: bool):
    """``int8[O, 9 C]`` values -> ``(sign, mask)`` planes ``u32[O, 9 words(C)]`` (mask None for binary)."""
    w = jnp.asarray(w)
    o = w.shape[0]
    v = w.reshape(o, 9, c_in)
    wc = kb.n_words(c_in)
    lanes = jnp.arange(wc * 32, dtype=jnp.uint32) % 32

    def pack(bits):  # (o, 9, c) bool -> (o, 9 * wc) u32
        bits = jnp.pad(bits, ((0, 0), (0, 0), (0, wc * 32 - c_in))).astype(jnp.uint32) << lanes[None, None, :]
        words = bits.reshape(o, 9, wc, 32)
        as_int = jax.lax.bitcast_convert_type(words, jnp.int32).sum(axis=-1, dtype=jnp.int32)
        return jax.lax.bitcast_convert_type(as_int, jnp.uint32).reshape(o, 9 * wc)

    sign = pack(v < 0)
    return (sign, pack(v != 0)) if ternary else (sign, None)


def dots(layer: ConvLayer, x, spec: ConvSpec) -> jax.Array:
    """``int32[B, H, W, O]`` pre-activations of ``layer`` on packed ``x: u32[B, H, W, words(C)]`` (XOR-popcount)."""
    sign, mask = packed_weights(layer.w, spec.c_in, spec.ternary)
    return kb.conv3x3_dots(x, sign, mask, c=None if spec.ternary else spec.c_in)


def forward(layer: ConvLayer, x, spec: ConvSpec, *, impl: str = "jnp", interpret: bool = False) -> jax.Array:
    """Packed output ``u32[B, H, W, words(O)]`` (before pooling)."""
    sign, mask = packed_weights(layer.w, spec.c_in, spec.ternary)
    return kb.conv3x3(
        x,
        sign,
        jnp.asarray(layer.thresh, jnp.int32),
        mask,
        c=None if spec.ternary else spec.c_in,
        impl=impl,
        interpret=interpret,
    )


def maxpool2(x) -> jax.Array:
    """2x2 max-pool (stride 2, odd edges dropped) of packed ±1 maps: the max is -1 only if all four are -1 (AND)."""
    x = jnp.asarray(x)
    h, w = x.shape[1] // 2 * 2, x.shape[2] // 2 * 2
    x = x[:, :h, :w]
    return x[:, 0::2, 0::2] & x[:, 1::2, 0::2] & x[:, 0::2, 1::2] & x[:, 1::2, 1::2]


def unpack_pm1(x, c: int) -> jax.Array:
    """Packed ``u32[..., words]`` -> ``f32[..., c]`` of ±1."""
    x = jnp.asarray(x)
    lanes = jnp.arange(32, dtype=jnp.uint32).reshape((1,) * x.ndim + (32,))
    bits = ((x[..., :, None] >> lanes) & jnp.uint32(1)).reshape(x.shape[:-1] + (-1,))[..., :c]
    return 1.0 - 2.0 * bits.astype(jnp.float32)


def im2col_pm1(x, c: int) -> jax.Array:
    """Packed ``u32[B, H, W, words(C)]`` -> ``f32[B, H W, 9 C]`` ±1 patches in the weights' order (outside = +1)."""
    cols = kb.im2col3x3(x)  # (B, H, W, 9 * wc)
    b, h, w, _ = cols.shape
    v = unpack_pm1(cols.reshape(b, h, w, 9, -1), c)  # (B, H, W, 9, C)
    return v.reshape(b, h * w, 9 * c)


def regions(h: int, w: int, grid: int) -> Regions:
    """Split an ``h x w`` map into ``grid x grid`` regions (``min(grid, side)`` per side)."""
    gh, gw = min(grid, h), min(grid, w)
    rows = np.arange(h) * gh // h
    cols = np.arange(w) * gw // w
    index = (rows[:, None] * gw + cols[None, :]).reshape(-1).astype(np.int32)
    counts = np.bincount(index, minlength=gh * gw).astype(np.float32)
    return Regions(index, counts)


def head_matrix(head: Head, reg: Regions) -> jax.Array:
    """``V: f32[H W, O, K]``, the per-pixel weights of the head."""
    return head.a[reg.index] / jnp.asarray(reg.counts)[reg.index][:, None, None]


def head_logits(head: Head, act, reg: Regions) -> jax.Array:
    """``f32[B, K]`` logits from ±1 activations ``f32[B, H W, O]``: region means times ``A``, plus bias."""
    r = len(reg.counts)
    pooled = jax.ops.segment_sum(jnp.moveaxis(act, 1, 0), jnp.asarray(reg.index), num_segments=r)  # (R, B, O)
    pooled = pooled / jnp.asarray(reg.counts)[:, None, None]
    return jnp.einsum("rbo,rok->bk", pooled, head.a) + head.b[None, :]


def _rng(seed: int, *names: int) -> np.random.Generator:
    return np.random.default_rng([int(seed), *[int(n) for n in names]])


def init_layer(spec: ConvSpec, x_sample, *, seed: int, layer_index: int = 0, zero_fraction: float = 1 / 3) -> ConvLayer:
    """Random weights from ``(seed, layer_index)``; thresholds = per-channel median of the dots on ``x_sample``.

    Ternary weights are 0 with probability ``zero_fraction``. Medians make every channel start
    balanced (about half its outputs -1).
    """
    rng = _rng(seed, layer_index, 1)
    shape = (spec.c_out, 9 * spec.c_in)
    w = rng.choice(np.array([-1, 1], np.int8), shape)
    if spec.ternary:
        w = np.where(rng.random(shape) < zero_fraction, 0, w).astype(np.int8)
    layer = ConvLayer(jnp.asarray(w), jnp.zeros((spec.c_out,), jnp.int32))
    d = np.asarray(dots(layer, x_sample, spec)).reshape(-1, spec.c_out)
    med = np.floor(np.median(d, axis=0)).astype(np.int32)
    return ConvLayer(jnp.asarray(w), jnp.asarray(med))


def init_head(c_out: int, n_regions: int, classes: int) -> Head:
    """A zero head (the first steps train it from the layer's initial activations)."""
    return Head(jnp.zeros((n_regions, c_out, classes), jnp.float32), jnp.zeros((classes,), jnp.float32))


def votes_head(c_out: int, n_regions: int, classes: int, scale: float) -> Head:
    """A fixed head: channel ``o`` votes for class ``o % classes`` with weight ``scale`` in every region."""
    own = (np.arange(c_out)[:, None] % classes == np.arange(classes)[None, :]).astype(np.float32)
    a = np.broadcast_to(own * np.float32(scale) / n_regions, (n_regions, c_out, classes))
    return Head(jnp.asarray(np.array(a)), jnp.zeros((classes,), jnp.float32))


def layer_checksum(layer: ConvLayer, spec: ConvSpec) -> str:
    """SHA-256 of the packed layer: sign plane, mask plane (ternary) and thresholds, little-endian."""
    sign, mask = packed_weights(layer.w, spec.c_in, spec.ternary)
    h = hashlib.sha256()
    for a in (sign, mask, layer.thresh):
        if a is not None:
            h.update(np.asarray(a).astype("<u4" if a.dtype == jnp.uint32 else "<i4").tobytes())
    return h.hexdigest()
