"""The canonical update of an iteration: host-rounded coefficients and exact weight decay.

Everything here is inside the determinism contract: the same projected gradients give the same
updates, and :func:`zeroth.replay.replay` applies them bit for bit on every backend.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from zeroth import reference as _ref
from zeroth import replay as _replay
from zeroth import rng as _rng
from zeroth import rule as _rule
from zeroth import schedules as _schedules

__all__ = [
    "SCALINGS",
    "DECAY_FLUSH",
    "lr_at",
    "update_coefficients",
    "canonical_updates",
    "decay_factor",
    "decay",
    "weight_decay",
]


SCALINGS = ("linear", "sqrt")
# Weight-decay results below this magnitude become +0 (see :func:`decay`): one binade above the
# smallest normal float32, so backends that flush subnormal products and backends that round
# them gradually agree.
DECAY_FLUSH = _ref.DECAY_FLUSH


def _check_scaling(scaling: str) -> str:
    if scaling not in SCALINGS:
        raise ValueError(f"unknown lr_scaling {scaling!r}; expected one of {list(SCALINGS)}")
    return scaling


def lr_at(lr: float | _schedules.Schedule, iteration: int) -> float:
    """The learning rate η_t of ``iteration`` on the exact path: ``lr`` itself, or a host schedule's value.

    Args:
      lr: a number, or a :class:`zeroth.schedules.Schedule` (evaluated on the host in float64).
      iteration: t, the step whose update it scales.

    Raises:
      TypeError: ``lr`` is another callable (an optax schedule is ``jnp`` math on a device, outside
        the determinism contract: use :mod:`zeroth.schedules`, or the optax transforms below).

    Example:
      >>> from zeroth import schedules
      >>> lr_at(0.1, 7), lr_at(schedules.linear(0.1, decay_steps=10), 5)
      (0.1, 0.05)
    """
    if isinstance(lr, _schedules.Schedule):
        return lr(iteration)
    if callable(lr):
        raise TypeError(
            f"lr is {lr!r}, a callable that is not a zeroth.schedules.Schedule: the exact update takes a number "
            f"or a host schedule (zeroth.schedules); optax schedules belong in zo_estimate's optax chains"
        )
    return float(lr)


def update_coefficients(grads, lr: float, n_total: int, scaling: str = "sqrt") -> list[float]:
    """Host-rounded update coefficients ``c_i = round(−η g_i / N)`` or ``round(−η g_i / √N)``.

    Computed in float64 on the host, ``(−η · g_i) / N`` or ``(−η · g_i) / sqrt(N)`` (each IEEE
    operation correctly rounded, so identical on every host), then rounded once by
    :func:`zeroth.replay.round_coefficient` (20 significant bits). ``replay`` rounds again, which
    is the identity on these values.

    Args:
      grads: the *decoded* projected gradients, ``f32[n]`` (any real sequence).
      lr: the learning rate η (finite).
      n_total: N, the number of projected gradients of the iteration across all machines (>= n).
      scaling: ``"sqrt"`` (η/√N, the seed's choice) or ``"linear"`` (η/N).

    Returns:
      ``list[float]`` of n coefficients.

    Raises:
      ValueError: a non-finite gradient or lr, N < n or N < 1, an unknown scaling.

    Example:
      >>> update_coefficients([2.0, -1.0], 0.5, 4, "sqrt")
      [-0.5, 0.25]
    """
    _check_scaling(scaling)
    # Python floats (float64): the coefficients are computed one by one below anyway, and a step's
    # few values cost less so than NumPy's fixed cost per operation
    if type(grads) is np.ndarray and grads.ndim == 1 and grads.dtype in (np.float32, np.float64):
        g = grads.tolist()
    else:
        g = np.asarray(grads, dtype=np.float64).reshape(-1).tolist()
    lr = float(lr)
    if not math.isfinite(lr):
        raise ValueError(f"lr must be finite, got {lr!r}")
    if isinstance(n_total, bool) or not isinstance(n_total, (int, np.integer)) or n_total < max(1, len(g)):
        raise ValueError(f"n_total must be an integer >= max(1, len(grads)) = {max(1, len(g))}, got {n_total!r}")
    bad = next((i for i, gi in enumerate(g) if not math.isfinite(gi)), None)
    if bad is not None:
        raise ValueError(f"projected gradient {bad} is {g[bad]!r}; only finite values can be applied")
    denom = _denominator(n_total, scaling)
    return [_replay.round_coefficient((-lr * float(gi)) / denom) for gi in g]


def _denominator(n_total: int, scaling: str) -> float:
    """N or √N in float64: what :func:`update_coefficients` divides ``−η g`` by."""
    return float(n_total) if scaling == "linear" else math.sqrt(float(n_total))


def canonical_updates(
    run_seed: int,
    iteration: int,
    grads_by_machine: Mapping[int, Sequence[float]],
    lr: float | _schedules.Schedule,
    scaling: str = "sqrt",
) -> list[tuple[np.ndarray, float]]:
    """The iteration's updates in canonical order: machine id ascending, then sample index.

    Every machine that holds the same ``grads_by_machine`` (decoded values) builds the same list,
    whatever the order of the mapping; ``replay(params, updates)`` then gives the same bits.

    Args:
      run_seed: the run's seed.
      iteration: the iteration t.
      grads_by_machine: ``{machine_id: [g_0, g_1, ...]}``, sample ``i`` of machine ``m`` having key
        ``sample_key(run_seed, m, iteration, i)``.
      lr: the learning rate η, or a host schedule (:func:`lr_at`: η_t of ``iteration``).
      scaling: ``"sqrt"`` or ``"linear"``; N is the total number of gradients in the mapping.

    Returns:
      ``[(u32[2] key, float coefficient), ...]`` ready for :func:`zeroth.replay.replay`.

    Example:
      >>> ups = canonical_updates(0, 5, {2: [1.0], 0: [0.5, -0.5]}, lr=0.1, scaling="linear")
      >>> [round(c, 6) for _, c in ups]
      [-0.016667, 0.016667, -0.033333]
    """
    _check_scaling(scaling)
    lr = lr_at(lr, iteration)
    machines = list(grads_by_machine)
    for m in machines:
        if isinstance(m, bool) or not isinstance(m, (int, np.integer)):
            raise ValueError(f"machine ids must be integers, got {m!r} ({type(m).__name__})")
    order = sorted(int(m) for m in machines)
    if len(set(order)) != len(order):
        raise ValueError(f"duplicate machine ids in {machines}")
    per = {int(m): np.asarray(grads_by_machine[m], dtype=np.float64).reshape(-1) for m in machines}
    n_total = sum(v.size for v in per.values())
    if n_total == 0:
        return []
    coeffs = [
        (m, i, c) for m in order if per[m].size for i, c in enumerate(update_coefficients(per[m], lr, n_total, scaling))
    ]
    # every key in one call (each (machine, iteration) prefix folded once): a peer builds this list
    # at every iteration, and one call per key pays NumPy's fixed cost per key
    keys = _rng.sample_keys(run_seed, [(m, iteration, i) for m, i, _ in coeffs])
    return [(keys[j], c) for j, (_, _, c) in enumerate(coeffs)]


def decay_factor(lr: float, weight_decay: float) -> np.float32:
    """``d = float32(1 − η·λ)``, computed in float64 on the host and rounded once to float32
    (:func:`zeroth.reference.decay_factor`).

    Raises:
      ValueError: non-finite values, or ``η·λ`` outside ``[0, 1)`` (d must lie in ``(0, 1]``).

    Example:
      >>> float(decay_factor(0.5, 0.5))
      0.75
    """
    return _ref.decay_factor(lr, weight_decay)


def decay(params: Any, factor) -> Any:
    """Traceable core of exact weight decay: ``p ← cast(flushd(flush(p32) · d))`` per leaf.

    ``flushd`` maps results with ``|x| < 2**-125`` (:data:`DECAY_FLUSH`) and -0 to +0 and NaN to
    the canonical NaN. Why this is exact across backends when it runs as its own program
    (:func:`weight_decay`): an IEEE float32 multiply is correctly rounded everywhere; the program
    has no add after the multiply, so no backend can contract it into an FMA; results in or near
    the subnormal range, where flush-to-zero hardware and gradual underflow disagree, are all
    below 2**-125 and become 0 on every backend (any product whose exact value is >= 2**-125
    rounds to the same normal number everywhere).

    Args:
      params: pytree of f32 / bf16 / f16 arrays.
      factor: ``f32[]`` from :func:`decay_factor` (may be traced).
    """
    d = jnp.asarray(factor, jnp.float32).reshape(())

    def leaf_fn(leaf):
        leaf = jnp.asarray(leaf)
        _rule.check_dtype(leaf.dtype, "a leaf given to weight decay")
        # the flushes in halves, as the replay kernels apply them (zeroth.rule): the zeros on
        # load, DECAY_FLUSH's threshold (which takes -0 and every subnormal with it), the NaNs on store
        x = _rule.flush_tiny(leaf.astype(jnp.float32)) * d
        x = jnp.where(jnp.abs(x) < DECAY_FLUSH, jnp.float32(0.0), x)
        return _rule.cast_flushed(x, leaf.dtype)

    return jax.tree_util.tree_map(leaf_fn, params)


_decay_copy = jax.jit(decay)
_decay_donated = jax.jit(decay, donate_argnums=(0,))


def weight_decay(params: Any, lr: float, weight_decay: float, *, donate: bool = False) -> Any:
    """Exact decoupled weight decay ``θ ← θ·(1 − ηλ)``, one canonical unit (its own program).

    In an iteration it comes after the replay of the iteration's updates. A no-op copy when
    ``weight_decay == 0``. See :func:`decay` for why every backend gives the same bits; the NumPy
    specification is :func:`zeroth.reference.decay_leaf`.

    Args:
      params: pytree of f32 / bf16 / f16 arrays.
      lr: learning rate η; weight_decay: λ (``η·λ`` in ``[0, 1)``).
      donate: reuse the input buffers (the input must not be used afterwards).

    Example:
      >>> weight_decay({"w": jnp.ones(2)}, 0.5, 0.5)["w"]
      Array([0.75, 0.75], dtype=float32)
    """
    return _weight_decay(params, lr, weight_decay, donate)


def _weight_decay(params, lr, wd, donate):
    d = decay_factor(lr, wd)
    return (_decay_donated if donate else _decay_copy)(params, d)
