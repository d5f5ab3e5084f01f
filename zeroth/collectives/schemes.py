"""Hop schemes of the sign-bit family for :func:`zeroth.collectives.ring.allreduce`.

Each scheme says what crosses a hop and how the receiving worker combines it with its own piece:

* :func:`marsit_scheme`: one bit per element at every hop. The message is packed sign bits; hop
  ``h`` of a stage is the Marsit merge of the ``m = h + 1``-th contributor (seed 004, eq. (2)),
  keyed by ``hop_key(round, stage, group, hop, segment)``. On the torus's second stage every
  local piece already stands for ``cols`` workers, the same weight for all, so the same ``m``
  keeps the merge unbiased.
* :func:`count_scheme`: bit-sliced counts of positive signs, ``planes_for(contributors)`` bits per
  element: the bit length grows with the hop ("dynamically changing the bit length"). With
  ``vote=True`` the reduced count is thresholded to the 1-bit majority before the all-gather.
* :func:`ssdm_scheme`: cascading compression. The message is ``(norm, sign bits)`` of SSDM's
  stochastic sign ``Q(u) = ||u||_2 * sign~(u)``, ``P(sign~(u)_j = +1) = 1/2 + u_j / (2 ||u||_2)``;
  every hop decompresses, adds its own piece and recompresses. ``||Q(u)||_2 = sqrt(L) ||u||_2``
  for a segment of L elements, so the noise compounds by about ``sqrt(L)`` per hop (the seed's
  Theorem 2); ``norm="linf"`` uses the max norm instead, which does not compound.

Example (inside ``jax.shard_map`` over ``Ring(4)``)::

    words = allreduce(pack(g), marsit_scheme(), Ring(4).stages, round_key=k)   # u32[4, W/4]
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from zeroth.collectives.ring import Hop, Scheme, _split_rows
from zeroth.kernels import signbits as sb
from zeroth.rng import threefry2x32

__all__ = [
    "marsit_scheme",
    "count_scheme",
    "ssdm_scheme",
    "ssdm_compress",
    "ssdm_decompress",
    "NORMS",
    "check_norm",
    "norm_unit",
    "planes_to_counts",
    "uniforms",
]


def marsit_scheme(*, impl: str = "auto") -> Scheme:
    """Messages are packed sign bits ``u32[W]``; a hop is :func:`zeroth.kernels.signbits.merge`."""

    def combine(msg, seg, hop: Hop):
        if hop.key is None:
            raise ValueError("the Marsit merge needs a round key: pass round_key to allreduce")
        return sb.merge(msg, seg, hop.key, hop.m, impl=impl)

    return Scheme(split=_split_rows, first=lambda seg, hop: seg, combine=combine, to_local=lambda msg: msg)


def count_scheme(total: int, *, vote: bool = False) -> Scheme:
    """Bit-sliced counts of set bits; local values and messages are tuples of planes ``u32[W]``.

    Args:
      total: number of workers (the final count bound).
      vote: threshold the reduced count to ``2 * count >= total`` (one bit) before the all-gather.
    """

    def combine(msg, seg, hop: Hop):
        return tuple(sb.counts_add(list(msg), list(seg), hop.m * hop.weight))

    def finish(msg):
        return (sb.count_geq(list(msg), (total + 1) // 2),)

    return Scheme(
        split=_split_rows,
        first=lambda seg, hop: seg,
        combine=combine,
        to_local=lambda msg: msg,
        finish=finish if vote else None,
    )


def uniforms(key: jax.Array, n: int) -> jax.Array:
    """``u32[n]`` (``n`` even): the uniform integers of the Bernoulli stream of ``key``.

    Element ``i`` is word ``x0`` (even ``i``) or ``x1`` (odd ``i``) of ``threefry2x32(key, (0, i >> 1))``,
    the convention of :mod:`zeroth.kernels.signbits`.
    """
    if n % 2:
        raise ValueError(f"uniforms draws pairs; n must be even, got {n}")
    j = jnp.arange(n // 2, dtype=jnp.uint32)
    x0, x1 = threefry2x32((key[0], key[1]), (jnp.zeros_like(j), j))
    return jnp.stack([x0, x1], axis=1).reshape(-1)


NORMS = ("l2", "linf", "bucket")


def check_norm(norm: str, bucket: int = 256) -> None:
    """Refuse an unknown SSDM norm, or a ``bucket`` that is not a positive multiple of 32."""
    if norm not in NORMS:
        raise ValueError(f"unknown SSDM norm {norm!r}; expected one of {list(NORMS)}")
    if norm == "bucket" and (
        isinstance(bucket, bool) or not isinstance(bucket, int) or bucket < sb.WORD_BITS or bucket % sb.WORD_BITS
    ):
        raise ValueError(f"SSDM bucket must be a positive multiple of {sb.WORD_BITS} elements, got {bucket!r}")


def norm_unit(norm: str, bucket: int = 256) -> int:
    """The length every segment of an SSDM vector must be a multiple of (a word, or a bucket)."""
    return bucket if norm == "bucket" else sb.WORD_BITS


def _norm(u: jax.Array, norm: str, bucket: int = 256) -> jax.Array:
    if norm == "l2":
        return jnp.sqrt(jnp.sum(u * u))
    if norm == "linf":
        return jnp.max(jnp.abs(u))
    if norm == "bucket":
        check_norm(norm, bucket)
        if u.shape[0] % bucket:
            raise ValueError(f"SSDM bucket norms need a length that is a multiple of bucket={bucket}, got {u.shape[0]}")
        return jnp.sqrt(jnp.sum((u * u).reshape(-1, bucket), axis=1))
    raise ValueError(f"unknown SSDM norm {norm!r}; expected one of {list(NORMS)}")


def _per_element(norms: jax.Array, n: int) -> jax.Array:
    return norms if norms.ndim == 0 else jnp.repeat(norms, n // norms.shape[0])


def ssdm_compress(
    u: jax.Array, key: jax.Array, *, norm: str = "l2", bucket: int = 256, impl: str = "auto"
) -> tuple[jax.Array, jax.Array]:
    """SSDM's stochastic sign of ``u`` (``f32[L]``, ``L % 32 == 0``): ``(norm, bits u32[L/32])``.

    Bit ``j`` is 1 with probability ``1/2 + u_j / (2 ||u||)`` (to 24-bit resolution:
    ``(uniform >> 8) < p * 2**24``), so ``E[||u|| (2 bit - 1)] = u_j``. ``u = 0`` gives fair coins.
    ``norm="l2"`` is the seed's SSDM (``f32[]``); ``"linf"`` (the max norm, ``f32[]``) is a
    lower-variance variant whose decompressed vector keeps the max norm of its input, so cascading
    does not compound it; ``"bucket"`` takes the l2 norm of every ``bucket`` consecutive elements
    (``f32[L/bucket]``, 32 more bits per bucket on the wire).
    """
    norms = _norm(u, norm, bucket)
    safe = jnp.where(norms > 0, norms, jnp.float32(1.0))
    p = jnp.clip(jnp.float32(0.5) + u / (jnp.float32(2.0) * _per_element(safe, u.shape[0])), 0.0, 1.0)
    draw = (uniforms(key, u.shape[0]) >> np.uint32(8)).astype(jnp.float32)
    plus = draw < p * jnp.float32(2.0**24)
    return norms, sb.pack(jnp.where(plus, jnp.float32(1.0), jnp.float32(-1.0)), impl=impl)


def ssdm_decompress(msg, *, impl: str = "auto") -> jax.Array:
    """``(norm, bits)`` -> ``f32[32 W]``: ``+norm`` / ``-norm`` per bit (per bucket for bucket norms)."""
    norms, words = msg
    n = words.shape[0] * sb.WORD_BITS
    if norms.ndim == 0:
        return sb.unpack(words, (n,), scale=norms, impl=impl)
    return sb.unpack(words, (n,), impl=impl) * _per_element(norms, n)


def ssdm_scheme(*, norm: str = "l2", bucket: int = 256, impl: str = "auto") -> Scheme:
    """Cascading compression: local pieces are floats, messages ``(norm, bits)``; decompress-add-recompress."""
    check_norm(norm, bucket)

    def key_of(hop: Hop):
        if hop.key is None:
            raise ValueError("SSDM's stochastic signs need a round key: pass round_key to allreduce")
        return hop.key

    return Scheme(
        split=_split_rows,
        first=lambda seg, hop: ssdm_compress(seg, key_of(hop), norm=norm, bucket=bucket, impl=impl),
        combine=lambda msg, seg, hop: ssdm_compress(
            ssdm_decompress(msg, impl=impl) + seg, key_of(hop), norm=norm, bucket=bucket, impl=impl
        ),
        to_local=lambda msg: ssdm_decompress(msg, impl=impl),
    )


def planes_to_counts(planes) -> jax.Array:
    """Bit-sliced counts (planes ``u32[..., W]``) -> ``int32[..., 32 W]`` per element."""
    total = None
    for j, p in enumerate(planes):
        lanes = jnp.arange(sb.WORD_BITS, dtype=jnp.uint32).reshape((1,) * p.ndim + (sb.WORD_BITS,))
        bits = ((p[..., None] >> lanes) & jnp.uint32(1)).astype(jnp.int32)
        bits = bits.reshape(p.shape[:-1] + (p.shape[-1] * sb.WORD_BITS,))
        total = bits * (1 << j) if total is None else total + bits * (1 << j)
    return total
