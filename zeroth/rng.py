"""Counter-based keys for zeroth: threefry-2x32, key derivation and stable leaf ids.

A perturbation is named by ``sample_key(run_seed, machine, iteration, sample)``; the noise of
each pytree leaf is drawn from ``fold_in(sample_key, leaf_id(path))``. Everything is integer
arithmetic on uint32 and bit-identical to ``jax.random`` (partitionable threefry) and to the
NumPy reference in :mod:`zeroth.reference`.

Types, as in ``jax.random``:

* ``threefry2x32 :: (u32[], u32[]) -> (u32[...], u32[...]) -> (u32[...], u32[...])``
* ``fold_in :: K -> u32[] -> K`` where ``K = u32[2]``
* ``sample_key :: int -> int -> int -> int -> K`` (host; validated)
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from zeroth import reference as _ref

__all__ = [
    "threefry2x32",
    "fold_in",
    "root_key",
    "sample_key",
    "sample_keys",
    "leaf_id",
    "leaf_ids",
    "leaf_path",
]

_ROTATIONS = _ref.ROTATIONS
_PARITY = _ref.PARITY


def _rotl(x: jax.Array, r: int) -> jax.Array:
    return jax.lax.shift_left(x, np.uint32(r)) | jax.lax.shift_right_logical(x, np.uint32(32 - r))


def threefry2x32(key, counter) -> tuple[jax.Array, jax.Array]:
    """Random123 threefry-2x32 (20 rounds), unrolled.

    Args:
      key: ``(k0, k1)``, uint32 scalars (or a ``u32[2]`` array).
      counter: ``(c0, c1)``, uint32 arrays of one shape (broadcastable).

    Returns:
      ``(x0, x1)``: uint32 arrays of the counters' shape. ``x0 ^ x1`` at counter ``(hi(i), lo(i))``
      is ``jax.random.bits(key, (n,), jnp.uint32)[i]``.

    Example:
      >>> x0, x1 = threefry2x32((jnp.uint32(0), jnp.uint32(7)), (jnp.zeros(4, jnp.uint32), jnp.arange(4, dtype=jnp.uint32)))
    """
    k0 = jnp.asarray(key[0], jnp.uint32)
    k1 = jnp.asarray(key[1], jnp.uint32)
    k2 = k0 ^ k1 ^ np.uint32(_PARITY)
    ks = (k0, k1, k2)
    x0 = jnp.asarray(counter[0], jnp.uint32) + k0
    x1 = jnp.asarray(counter[1], jnp.uint32) + k1
    for block in range(5):
        for r in _ROTATIONS[block % 2]:
            x0 = x0 + x1
            x1 = _rotl(x1, r)
            x1 = x0 ^ x1
        x0 = x0 + ks[(block + 1) % 3]
        # x1 + key word + constant, left to right (uint32 adds are associative: the same bits as
        # x1 + (key word + constant)). Compiled for a GPU, each scalar ``key word + constant`` was a
        # one-thread kernel of its own (a one-leaf replay at K = 1 launched 6 kernels, now 2), and
        # the GPU adds all three in one instruction.
        x1 = x1 + ks[(block + 2) % 3] + np.uint32(block + 1)
    return x0, x1


def fold_in(key: jax.Array, data) -> jax.Array:
    """``fold_in(k, d) = threefry2x32(k, (0, d))``: equal to ``jax.random.fold_in`` on raw keys.

    ``data`` may be traced (a uint32 scalar), so folding in an iteration does not recompile.
    """
    key = jnp.asarray(key, jnp.uint32)
    x0, x1 = threefry2x32((key[0], key[1]), (jnp.uint32(0), jnp.asarray(data, jnp.uint32)))
    return jnp.stack([x0, x1])


def root_key(run_seed: int) -> np.ndarray:
    """The key of a run, ``u32[2] = (0, run_seed)`` (``jax.random.PRNGKey(run_seed)``). Host-side."""
    return _ref.root_key(run_seed)


def sample_key(run_seed: int, machine: int, iteration: int, sample: int) -> np.ndarray:
    """The key of one perturbation, computed on the host (NumPy, exact).

    ``fold_in(fold_in(fold_in(root_key(run_seed), machine), iteration), sample)``. Each fold is a
    bijection of the folded integer for a fixed key, so tuples that differ in their last differing
    argument never collide structurally (unlike concatenated decimal seeds); a collision needs a
    64-bit coincidence.

    Raises:
      ValueError: an argument is not an integer in ``[0, 2**32)`` (the message names it).

    Example:
      >>> sample_key(0, 1, 2, 3).dtype
      dtype('uint32')
    """
    seed = _ref._check_u32("run_seed", run_seed)
    m, it, s = (
        _ref._check_u32(name, v) for name, v in (("machine", machine), ("iteration", iteration), ("sample", sample))
    )
    return _sample_keys_ints(seed, [m], [it], [s])[0]


def sample_keys(run_seed: int, triples) -> np.ndarray:
    """Keys of many perturbations at once: ``triples`` is a sequence of ``(machine, iteration, sample)``.

    Returns ``u32[len(triples), 2]``, row r equal to ``sample_key(run_seed, *triples[r])``. Up to
    :data:`SCALAR_ROWS` rows, the fold_in chains run on Python integers, each ``(machine,
    iteration)`` prefix folded once (NumPy's fixed cost per operation dominates a few keys); more rows run vectorized over NumPy arrays, with
    the prefixes still folded once on integers where there are at most that many of them (an
    iteration's 48 keys of 3 peers: one NumPy chain instead of three). The arithmetic is the
    same (uint32, mod 2**32) and the tests hold every path to the reference.

    Raises:
      ValueError: a value is not an integer in ``[0, 2**32)`` (the message names it and its row).
    """
    rows = [tuple(t) for t in triples]
    cols: tuple[list[int], ...] = ([], [], [])
    for r, t in enumerate(rows):
        if len(t) != 3:
            raise ValueError(f"triple {r} must be (machine, iteration, sample), got {t!r}")
        if type(t[0]) is type(t[1]) is type(t[2]) is int and 0 <= min(t) and max(t) < _ref.U32_LIMIT:
            for j in range(3):  # the common case, checked without building three error names
                cols[j].append(t[j])
            continue
        for j, name in enumerate(("machine", "iteration", "sample")):
            cols[j].append(_ref._check_u32(f"{name} (row {r})", t[j]))
    seed = _ref._check_u32("run_seed", run_seed)
    if len(rows) <= SCALAR_ROWS:
        return _sample_keys_ints(seed, *cols)
    return _sample_keys_numpy(seed, *cols)


SCALAR_ROWS = 16  # sample_keys derives up to this many keys on Python integers
_M32 = 0xFFFFFFFF


def _fold_in_ints(k0: int, k1: int, data: int) -> tuple[int, int]:
    """``fold_in((k0, k1), data)`` = ``threefry2x32((k0, k1), (0, data))`` on Python integers
    (:func:`zeroth.reference.threefry2x32`'s rounds, each sum taken mod 2**32)."""
    ks = (k0, k1, k0 ^ k1 ^ _ref.PARITY)
    x0, x1 = k0, (data + k1) & _M32
    for block in range(5):
        for r in _ref.ROTATIONS[block % 2]:
            x0 = (x0 + x1) & _M32
            x1 = ((x1 << r) & _M32) | (x1 >> (32 - r))
            x1 ^= x0
        x0 = (x0 + ks[(block + 1) % 3]) & _M32
        x1 = (x1 + ks[(block + 2) % 3] + block + 1) & _M32
    return x0, x1


def _prefix_keys(seed: int, pairs) -> dict[tuple[int, int], tuple[int, int]]:
    """``{(machine, iteration): fold_in(fold_in(root_key(seed), machine), iteration)}`` on Python
    integers, each distinct pair folded once."""
    return {(m, it): _fold_in_ints(*_fold_in_ints(0, seed, m), it) for m, it in dict.fromkeys(pairs)}


def _sample_keys_ints(seed: int, machines, iterations, samples) -> np.ndarray:
    prefixes = _prefix_keys(seed, zip(machines, iterations))
    out = [_fold_in_ints(*prefixes[(m, it)], s) for m, it, s in zip(machines, iterations, samples)]
    return np.array(out, dtype=np.uint32).reshape(len(out), 2)


def _sample_keys_numpy(seed: int, machines, iterations, samples) -> np.ndarray:
    n = len(machines)
    pairs = list(zip(machines, iterations))
    if len(set(pairs)) <= SCALAR_ROWS:
        # an iteration's keys share a few (machine, iteration) prefixes: fold each once on
        # integers, and only the samples over NumPy rows (one chain of three)
        prefixes = _prefix_keys(seed, pairs)
        k0, k1 = np.array([prefixes[p] for p in pairs], np.uint32).reshape(n, 2).T
        cols = (samples,)
    else:
        k0, k1 = np.zeros(n, np.uint32), np.full(n, seed, np.uint32)  # root_key(seed) on every row
        cols = (machines, iterations, samples)
    for col in cols:
        k0, k1 = _ref.threefry2x32((k0, k1), (np.zeros(n, np.uint32), np.array(col, dtype=np.uint32)))
    return np.stack([k0, k1], axis=1)


def leaf_path(path) -> str:
    """The canonical string of a pytree key path (``jax.tree_util.keystr``)."""
    return jax.tree_util.keystr(tuple(path))


def leaf_id(path) -> int:
    """Stable 32-bit id of a leaf from its pytree path (a key path or its string).

    First four bytes of SHA-256 of ``keystr(path)``: independent of the order of leaves in memory,
    of the process and of the backend.
    """
    return _ref.leaf_id(path if isinstance(path, str) else leaf_path(path))


def leaf_ids(tree: Any) -> Any:
    """A pytree of the same structure holding each leaf's :func:`leaf_id` (Python ints).

    Raises:
      ValueError: two leaves share an id (a 32-bit hash collision of their paths).
    """
    with_path, treedef = jax.tree_util.tree_flatten_with_path(tree)
    ids = [leaf_id(p) for p, _ in with_path]
    if len(set(ids)) != len(ids):
        paths = [leaf_path(p) for p, _ in with_path]
        raise ValueError(f"leaf id collision among paths {paths}; rename a parameter")
    return jax.tree_util.tree_unflatten(treedef, ids)
