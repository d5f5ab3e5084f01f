"""Pieces every implementation shares: the leaves' keys, one block's updates, the ``jnp`` rule."""

from __future__ import annotations


import jax
import jax.numpy as jnp
import numpy as np

from zeroth import noise as _noise
from zeroth import rng as _rng
from zeroth import rule as _rule


def leaf_keys(keys, lid: int) -> jax.Array:
    """``u32[K, 2]`` leaf keys ``fold_in(keys[u], lid)`` of the sample keys ``u32[K, 2]``."""
    return _all_leaf_keys(keys, [lid])[0]


def leaf_key_table(keys, ids) -> jax.Array:
    """``u32[L, K, 2]``: :func:`leaf_keys` of the sample keys ``u32[K, 2]`` for each leaf id of
    ``ids`` (in one computation), what :func:`apply_updates` takes as ``leaf_keys``."""
    return _all_leaf_keys(keys, [int(i) for i in ids])


def _check_args(x, keys, scales, distribution: str):
    _noise.check_distribution(distribution)
    x = jnp.asarray(x)
    _rule.check_dtype(x.dtype, "leaf")
    keys = jnp.asarray(keys)
    scales = jnp.asarray(scales)
    if keys.dtype != jnp.uint32 or keys.ndim != 2 or keys.shape[1] != 2:
        raise ValueError(f"leaf keys must be u32[K, 2], got dtype {keys.dtype} shape {keys.shape}")
    if scales.dtype != jnp.float32 or scales.shape != (keys.shape[0],):
        raise ValueError(
            f"scales must be f32[K] with K = {keys.shape[0]} (one per key), got dtype {scales.dtype} shape {scales.shape}"
        )
    return x, keys, scales


def _check_offset(offset, n: int):
    if isinstance(offset, jax.Array) and not isinstance(offset, np.ndarray):  # known at run time (traced)
        if offset.dtype != jnp.uint32 or offset.shape != ():
            raise ValueError(f"a run-time offset must be a u32[] scalar, got dtype {offset.dtype} shape {offset.shape}")
        return offset
    if not isinstance(offset, (int, np.integer)) or isinstance(offset, bool) or offset < 0:
        raise ValueError(f"offset must be a non-negative int (a global flat index), got {offset!r}")
    if int(offset) + n > _noise.MAX_LEAF_SIZE:
        raise ValueError(
            f"offset {offset} + {n} elements exceeds the supported {_noise.MAX_LEAF_SIZE} elements per leaf"
        )
    return int(offset)


def _update_block(p32, call, within, k0, k1, scale, distribution: str):
    """One exact update on a block: ``flush(p32 + scale * k)``, NaNs left to the store
    (:func:`zeroth.rule.flush_tiny`).

    ``call`` (threefry counter) and ``within`` (position inside the call) broadcast to ``p32``.
    """
    x0, x1 = _rng.threefry2x32((k0, k1), (jnp.zeros_like(call), call))
    if distribution == "binomial":
        delta = scale * _noise.binomial_from_words(x0, x1, within).astype(jnp.float32)
    else:
        delta = jnp.where(_noise.rademacher_from_words(x0, x1, within) == 1, scale, -scale)
    return _rule.flush_tiny(p32 + delta)


def perturb_reference(x, leaf_keys_, scales, *, distribution: str = "binomial", offset: int = 0) -> jax.Array:
    """Plain ``jnp`` reference: one pass of :func:`zeroth.noise.noise_int` per update.

    Args:
      x: the leaf (any shape; f32, bf16 or f16).
      leaf_keys_: ``u32[K, 2]`` *leaf* keys (see :func:`leaf_keys`).
      scales: ``f32[K]`` host-rounded scales.
      distribution: ``"binomial"`` or ``"rademacher"``.
      offset: global flat index of ``x``'s first element (0 for a whole leaf); an int, or a
        ``u32[]`` known only at run time (a slice chosen inside a loop, :func:`perturb_slice`).

    Returns:
      The updated array, same shape and dtype.
    """
    x, keys, scales = _check_args(x, leaf_keys_, scales, distribution)
    offset = _check_offset(offset, x.size)
    p32 = _rule.flush_tiny(x.astype(jnp.float32))

    def body(u, p):
        k = _noise.noise_int(distribution, keys[u], x.shape, offset)
        return _rule.flush_tiny(p + scales[u] * k.astype(jnp.float32))

    if keys.shape[0] == 1:
        p32 = body(0, p32)
    elif keys.shape[0] > 1:
        p32 = jax.lax.fori_loop(0, keys.shape[0], body, p32)
    return _rule.cast_flushed(p32, x.dtype)


def _segment_update(x, call, within, keys_ref, scales_ref, segment, *, n_updates: int, distribution: str):
    """The K updates of one segment on a block ``x`` of a flat kernel: flush, the updates in
    order with the segment's leaf keys (``keys_ref[2K * segment :]``, word pairs), cast once."""
    p32 = _rule.flush_tiny(x.astype(jnp.float32))
    first_key = segment * (2 * n_updates)

    def body(u, p):
        k = first_key + 2 * u
        return _update_block(p, call, within, keys_ref[k], keys_ref[k + 1], scales_ref[u], distribution)

    if n_updates:
        p32 = jax.lax.fori_loop(0, n_updates, body, p32)
    return _rule.cast_flushed(p32, x.dtype)


def _check_segments(segments, n: int, what: str) -> tuple[tuple[int, int, int], ...]:
    """``segments`` as a tuple of ``(offset, size, leaf_id)`` int triples, each inside ``[0, n)``,
    not overlapping one another, with fewer than 2**32 elements and a 32-bit leaf id."""
    out = tuple((int(o), int(z), int(lid)) for o, z, lid in segments)
    end = 0
    for o, z, lid in sorted(out):
        if o < end or z < 0 or o + z > n or z > _noise.MAX_LEAF_SIZE or not 0 <= lid < 2**32:
            raise ValueError(
                f"{what}: segment (offset {o}, size {z}, leaf id {lid}) must lie in [0, {n}) after the previous "
                f"one (which ends at {end}), hold fewer than 2**32 elements and have a 32-bit leaf id"
            )
        end = o + z
    return out


def _all_leaf_keys(keys, ids: list[int]) -> jax.Array:
    """``u32[L, K, 2]``: :func:`leaf_keys` of the sample keys ``u32[K, 2]`` for every leaf id at once."""
    keys = jnp.asarray(keys, jnp.uint32).reshape(-1, 2)
    lid = jnp.asarray(np.asarray(ids, np.uint32))[:, None]
    k0 = jnp.broadcast_to(keys[None, :, 0], (len(ids), keys.shape[0]))
    k1 = jnp.broadcast_to(keys[None, :, 1], (len(ids), keys.shape[0]))
    x0, x1 = _rng.threefry2x32((k0, k1), (jnp.zeros_like(k0), jnp.broadcast_to(lid, k0.shape)))
    return jnp.stack([x0, x1], axis=-1)
