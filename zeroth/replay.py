"""The exact update rule of zeroth's determinism contract, canonical replay and checksums.

An update is a pair ``(key, c)``: a sample key (see :func:`zeroth.rng.sample_key`) and a
coefficient. Applying it to a leaf ``p`` with path ``path`` computes, in float32,

    p <- flush(p + s * k),   k = noise_int(fold_in(key, leaf_id(path)), p.shape),
                             s = round_coefficient(c)        (Rademacher, z = k)
                             s = round_coefficient(c) / 2    (binomial,  z = k / 2)

``s`` has at most 20 significant bits and ``|k| <= 8`` so ``s * k`` is exact in float32; the add
is then rounded once, identically with or without FMA. ``flush`` maps subnormals and -0 to +0
and every NaN to the canonical quiet NaN ``0x7fc00000``; infinities propagate. A leaf is widened
to float32 once, all updates of a :func:`replay` call are applied in the given (canonical) order,
and the result is cast once to the leaf dtype (whose subnormals are flushed again).

Cost: :func:`perturb` and :func:`replay` hold at most one float32 temporary of one leaf at a
time beyond the parameters when called with ``donate=True`` (the input buffers are reused);
with ``donate=False`` the result is a second copy of the parameters. :func:`replay` dispatches to
the fused kernels of :mod:`zeroth.kernels.perturb`, which read and write each leaf once for all
K updates; :func:`apply_updates` (the traceable jnp rule) reads and writes it once per update.
"""

from __future__ import annotations

import math
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from zeroth import reference as _ref
from zeroth import rng as _rng
from zeroth.kernels import host_memory as _host_memory
from zeroth.kernels import perturb as _fused
from zeroth.rule import COEFF_BITS, SUPPORTED_DTYPES, flush, flush_cast, update_scale, update_scales

__all__ = [
    "COEFF_BITS",
    "round_coefficient",
    "update_scale",
    "update_scales",
    "flush",
    "flush_cast",
    "apply_updates",
    "perturb",
    "replay",
    "checksum",
    "SUPPORTED_DTYPES",
]


def round_coefficient(c: float, bits: int = COEFF_BITS) -> float:
    """Round a coefficient on the host to ``bits`` (<= 20) significant bits, half to even.

    Deterministic (pure Python integer arithmetic on the float64 value); magnitudes below
    2**-120 become 0.0; non-finite values and magnitudes >= 2**100 raise ``ValueError``.

    Example:
      >>> round_coefficient(0.1)
      0.10000002384185791
    """
    if not 1 <= bits <= COEFF_BITS:
        raise ValueError(f"bits must be in [1, {COEFF_BITS}] so that c * z is exact in float32, got {bits}")
    return _ref.round_coefficient(c, bits)


def apply_updates(params: Any, keys: jax.Array, scales: jax.Array, *, distribution: str = "binomial") -> Any:
    """Traceable core: apply K updates with *already rounded* scales, in order (the plain jnp
    rule, :func:`zeroth.kernels.perturb.perturb_reference` on every leaf).

    Args:
      params: pytree of f32 / bf16 / f16 arrays.
      keys: ``u32[K, 2]`` sample keys (may be traced).
      scales: ``f32[K]`` from :func:`update_scales` (host-rounded; may be traced).
      distribution: ``"binomial"`` or ``"rademacher"``.

    Returns:
      The updated pytree (same structure, dtypes and shapes).
    """
    return _fused.apply_updates(params, keys, scales, distribution=distribution, impl="jnp")


def _as_keys(keys) -> np.ndarray:
    arr = np.asarray(keys)
    if arr.dtype != np.uint32 or arr.ndim < 1 or arr.shape[-1] != 2:
        raise ValueError(f"keys must be uint32 of shape (2,) or (K, 2), got dtype {arr.dtype} shape {arr.shape}")
    return arr.reshape(-1, 2)


def _is_key_matrix(x) -> bool:
    """Whether ``x`` is a ``(K, 2)`` key array (the ``(keys, coefficients)`` form of ``updates``),
    rather than one ``(key, coefficient)`` pair (whose ``np.ndim`` is not even defined)."""
    try:
        return np.ndim(x) == 2
    except ValueError:  # a ragged (key, coefficient) pair
        return False


def replay(params: Any, updates, *, distribution: str = "binomial", donate: bool = False) -> Any:
    """Apply ``updates``, a sequence of ``(key, coefficient)`` in canonical order, exactly.

    Coefficients are rounded on the host (:func:`round_coefficient`). The result is bit-identical
    on every backend and to :func:`zeroth.reference.replay_leaf`.

    Args:
      params: pytree of f32 / bf16 / f16 arrays (flax params included).
      updates: sequence of ``(u32[2] key, float coefficient)``; or a pair ``(u32[K,2], f[K])``.
      distribution: ``"binomial"`` (default) or ``"rademacher"``; ``"gaussian"`` is refused.
      donate: reuse the input buffers (the input ``params`` must not be used afterwards). The
        copy path (``False``) allocates a new set of buffers; on a CPU the first such call keeps
        freed host memory for reuse (:mod:`zeroth.kernels.host_memory`), so later copies do not
        pay page faults again.

    Example:
      >>> from zeroth.rng import sample_key
      >>> p = {"w": jnp.zeros(3)}
      >>> q = replay(p, [(sample_key(0, 0, 0, 0), 0.5)])
    """
    if isinstance(updates, tuple) and len(updates) == 2 and _is_key_matrix(updates[0]):
        keys, coefficients = _as_keys(updates[0]), list(np.asarray(updates[1], np.float64).reshape(-1))
    else:
        updates = list(updates)
        keys = _as_keys([k for k, _ in updates]) if updates else np.zeros((0, 2), np.uint32)
        coefficients = [c for _, c in updates]
    if len(coefficients) != keys.shape[0]:
        raise ValueError(f"{keys.shape[0]} keys but {len(coefficients)} coefficients")
    scales = update_scales(distribution, coefficients)
    if not donate and not _host_memory.decided() and _fused.platform_of(params) == "cpu":
        _host_memory.reuse_freed_host_memory()
    # The fused kernels pick the fastest exact path for the platform the parameters live on
    # (native CPU kernel, Pallas on GPU/TPU, the jnp rule otherwise); every path is held
    # bit-identical to zeroth.reference by the tests.
    return _fused.fused_apply_updates(params, keys, scales, distribution=distribution, donate=donate)


def perturb(params: Any, key, scale: float, *, distribution: str = "binomial", donate: bool = False) -> Any:
    """``params + round(scale) * z`` with the exact rule: one update, ``replay(params, [(key, scale)])``."""
    return replay(params, [(np.asarray(key, np.uint32), scale)], distribution=distribution, donate=donate)


def checksum(params: Any) -> str:
    """SHA-256 (hex) over the whole state: for every leaf, in order of its path string,
    the path, dtype, shape and every value's bytes (little endian, row-major)
    (:func:`zeroth.reference.checksum_leaves` of the leaves, fetched to the host one at a time).
    """
    with_path, _ = jax.tree_util.tree_flatten_with_path(params)
    return _ref.checksum_leaves({_rng.leaf_path(p): np.asarray(jax.device_get(leaf)) for p, leaf in with_path})


def _nbytes(tree) -> int:  # used by benchmarks and docs
    return sum(math.prod(np.shape(x)) * jnp.dtype(x.dtype).itemsize for x in jax.tree_util.tree_leaves(tree))
