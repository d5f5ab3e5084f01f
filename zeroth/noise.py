"""Noise from counter-based bits, with integer operations only.

Every exact distribution maps element ``i`` of a leaf (its flat, global, row-major index) to bits
of one threefry-2x32 call on the leaf's key, so any tile, shard or slice regenerates exactly its
own part from ``offset`` alone:

* ``rademacher``: element i is bit ``i % 32`` of word ``i // 32`` of the leaf's word stream
  (word ``2j`` = x0, ``2j+1`` = x1 of call j): set -> +1, clear -> -1. 64 elements per call.
* ``binomial``: ``z = (popcount(h) - 8) / 2`` where h is the 16-bit half ``i % 2`` of word
  ``i // 2``: variance 1, values k/2 with ``|k| <= 8``, four elements per call.
* ``gaussian``: ``jax.random.normal``. **Backend-dependent** (erf_inv, log1p, FMA contraction):
  refused wherever exactness is asked for.

The ``*_int`` functions return the integer k (int8) that the exact update multiplies by a
host-rounded float32 scale (see :mod:`zeroth.replay`).
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp

from zeroth.rng import threefry2x32

__all__ = [
    "DISTRIBUTIONS",
    "EXACT",
    "BACKEND_DEPENDENT",
    "MAX_LEAF_SIZE",
    "check_distribution",
    "noise_int",
    "rademacher",
    "binomial",
    "gaussian",
    "sample",
]

EXACT = ("binomial", "rademacher")
BACKEND_DEPENDENT = ("gaussian",)
DISTRIBUTIONS = EXACT + BACKEND_DEPENDENT
MAX_LEAF_SIZE = 2**32 - 1


def check_distribution(name: str, *, exact: bool = True) -> str:
    """Validate a distribution name; with ``exact=True`` refuse backend-dependent ones."""
    if name not in DISTRIBUTIONS:
        raise ValueError(f"unknown noise distribution {name!r}; expected one of {list(DISTRIBUTIONS)}")
    if exact and name not in EXACT:
        raise ValueError(
            f"noise distribution {name!r} is backend-dependent (it uses erf_inv/log1p, whose float results "
            f"differ between CPUs with and without FMA, fast-math and GPUs) and is refused where the "
            f"determinism contract is asked for; use one of {list(EXACT)}"
        )
    return name


def _global_index(shape, offset) -> jax.Array:
    n = math.prod(shape)
    if isinstance(offset, int) and offset < 0:
        raise ValueError(f"offset must be a non-negative element index, got {offset}")
    if isinstance(offset, int) and offset + n > MAX_LEAF_SIZE:
        raise ValueError(f"leaf of {offset + n} elements exceeds the supported {MAX_LEAF_SIZE} elements per leaf")
    return jax.lax.iota(jnp.uint32, n).reshape(shape) + jnp.asarray(offset, jnp.uint32)


def _key_pair(key):
    key = jnp.asarray(key, jnp.uint32)
    return key[0], key[1]


# --------------------------------------------------------------------------- block functions
# Bits -> noise for one threefry call, shared by every implementation (the jnp paths below, the
# Pallas and native kernels' references, model initialisation, collectives): ``x0``, ``x1`` are the
# two output words of ``threefry2x32(key, (0, call))`` and ``within`` an element's position inside
# that call (all broadcast against each other, uint32).


def popcount(v: jax.Array) -> jax.Array:
    """Bits set in each ``uint32``, as ``int32``, counted as ``int32`` (the same bits).

    Kernels count this way: Pallas lowers an ``int32`` count for a GPU to libdevice's
    ``__nv_popc`` (the ``popc`` instruction) and for a TPU to Mosaic's ``ctpop``, where Triton
    cannot compile a ``uint32`` count (on an NVIDIA H100, jax 0.11.2: "failed to legalize
    operation 'math.ctpop'")."""
    return jax.lax.population_count(jax.lax.bitcast_convert_type(v, jnp.int32))


def binomial_from_words(x0: jax.Array, x1: jax.Array, within: jax.Array) -> jax.Array:
    """``int32`` binomial integer ``k = popcount(h) - 8`` of element ``within`` (0..3) of a call:
    ``h`` is the 16-bit half ``within & 1`` (0: low) of word ``x0`` (``within & 2 == 0``) or ``x1``.

    The bits are counted by :func:`popcount`, which every kernel backend compiles."""
    word = jnp.where((within & jnp.uint32(2)) == 0, x0, x1)
    half = (word >> ((within & jnp.uint32(1)) * jnp.uint32(16))) & jnp.uint32(0xFFFF)
    return popcount(half) - jnp.int32(8)


def rademacher_from_words(x0: jax.Array, x1: jax.Array, within: jax.Array) -> jax.Array:
    """``uint32`` bit (1 -> +1, 0 -> -1) of element ``within`` (0..63) of a call: bit
    ``within & 31`` of word ``x0`` (``within & 32 == 0``) or ``x1``."""
    word = jnp.where((within & jnp.uint32(32)) == 0, x0, x1)
    return (word >> (within & jnp.uint32(31))) & jnp.uint32(1)


def bernoulli_bits(x0: jax.Array, x1: jax.Array, threshold) -> tuple[jax.Array, jax.Array]:
    """``(uint32, uint32)`` Bernoulli draws ``x0 < t`` and ``x1 < t`` (probability ``t / 2**32``)
    of one call's two words: the integer-only coin of stochastic rounding and sign merging."""
    t = jnp.asarray(threshold, jnp.uint32)
    return (x0 < t).astype(jnp.uint32), (x1 < t).astype(jnp.uint32)


def rademacher_int(key, shape, offset=0) -> jax.Array:
    """``int8[shape]`` in {-1, +1}: elements ``offset ..`` of the leaf's Rademacher stream.

    Args:
      key: the leaf key, ``u32[2]``.
      shape: output shape (0-D allowed).
      offset: global flat index of the first element (a Python int or a traced uint32).
    """
    shape = tuple(shape)
    i = _global_index(shape, offset)
    x0, x1 = threefry2x32(_key_pair(key), (jnp.zeros_like(i), i >> 6))
    bit = rademacher_from_words(x0, x1, i & jnp.uint32(63))
    return (bit.astype(jnp.int8) * 2 - 1).astype(jnp.int8)


def binomial_int(key, shape, offset=0) -> jax.Array:
    """``int8[shape]``: ``k = popcount(16 bits) - 8`` for elements ``offset ..`` of the leaf; z = k / 2."""
    shape = tuple(shape)
    i = _global_index(shape, offset)
    x0, x1 = threefry2x32(_key_pair(key), (jnp.zeros_like(i), i >> 2))
    return binomial_from_words(x0, x1, i & jnp.uint32(3)).astype(jnp.int8)


def noise_int(distribution: str, key, shape, offset=0) -> jax.Array:
    """The integer noise of an exact distribution (see module docstring)."""
    check_distribution(distribution)
    fn = rademacher_int if distribution == "rademacher" else binomial_int
    return fn(key, shape, offset)


def rademacher(key, shape, dtype=jnp.float32, offset=0) -> jax.Array:
    """Rademacher ±1 noise as ``dtype`` (exact)."""
    return rademacher_int(key, shape, offset).astype(dtype)


def binomial(key, shape, dtype=jnp.float32, offset=0) -> jax.Array:
    """Centred binomial noise ``(popcount(16 bits) - 8) / 2`` as ``dtype`` (exact; variance 1)."""
    return (binomial_int(key, shape, offset).astype(jnp.float32) * 0.5).astype(dtype)


def gaussian(key, shape, dtype=jnp.float32, offset=0) -> jax.Array:
    """Standard normal noise via ``jax.random.normal``. BACKEND-DEPENDENT: not for replay.

    ``offset`` is accepted for signature compatibility and must be 0.
    """
    if not (isinstance(offset, int) and offset == 0):
        raise ValueError("gaussian noise cannot be generated by slices (offset must be 0)")
    return jax.random.normal(jax.random.wrap_key_data(jnp.asarray(key, jnp.uint32)), tuple(shape), dtype)


def sample(distribution: str, key, shape, dtype=jnp.float32, offset=0, *, exact: bool = True) -> jax.Array:
    """Noise of the named distribution as floats. ``exact=True`` refuses backend-dependent ones."""
    check_distribution(distribution, exact=exact)
    return {"rademacher": rademacher, "binomial": binomial, "gaussian": gaussian}[distribution](
        key, shape, dtype, offset
    )
