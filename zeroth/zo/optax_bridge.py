"""The optax bridge: ZO estimates as an optax ``GradientTransformation``.

It materializes a dense gradient estimate and keeps optax state (float math whose rounding differs
between backends), so it is outside the determinism contract; the exact path is :func:`zeroth.zo.mezo_step`.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax

from zeroth import noise as _noise
from zeroth import rng as _rng
from zeroth.zo import update as _update
from zeroth.zo import estimator as _estimator

__all__ = [
    "ZOGrads",
    "zo_value_and_grad",
    "zo_estimate",
    "dense_gradient",
    "ZOOptaxState",
    "ZOOptax",
    "zo_optax",
]


def dense_gradient(params: Any, keys, coefficients, *, distribution: str = "binomial") -> Any:
    """``Σ_i c_i z_i`` as a float32 pytree of the parameters' structure (traceable).

    OUTSIDE the determinism contract (a float sum) and one extra parameter-sized buffer; ``z_i``
    are the same noise values the exact replay uses.

    Args:
      params: pytree (only structure and shapes are used).
      keys: ``u32[n, 2]``; coefficients: ``f32[n]``.
    """
    _noise.check_distribution(distribution)
    keys = jnp.asarray(keys, jnp.uint32).reshape(-1, 2)
    coefficients = jnp.asarray(coefficients, jnp.float32).reshape(-1)
    with_path, treedef = jax.tree_util.tree_flatten_with_path(params)
    out = []
    for path, leaf in with_path:
        lid = np.uint32(_rng.leaf_id(path))
        shape = jnp.shape(leaf)

        def body(i, acc, lid=lid, shape=shape):
            z = _noise.sample(distribution, _rng.fold_in(keys[i], lid), shape, jnp.float32)
            return acc + coefficients[i] * z

        out.append(jax.lax.fori_loop(0, keys.shape[0], body, jnp.zeros(shape, jnp.float32)))
    return jax.tree_util.tree_unflatten(treedef, out)


class ZOGrads(NamedTuple):
    """A zeroth-order gradient: what ``jax.grad`` is to optax, the input of :func:`zo_estimate`.

    Perturbation ``i`` is named by ``keys[i]`` (its noise ``z_i`` is regenerated from it) and
    ``grads[i]`` is its projected gradient ``(L(θ+εz_i) − L(θ−εz_i)) / (2ε)``, as computed by
    :func:`projected_gradients` (or decoded from a peer's bytes).
    """

    keys: Any  # u32[n, 2] sample keys (zeroth.rng.sample_keys)
    grads: Any  # f32[n] projected gradients


def zo_value_and_grad(loss_fn: Callable[[Any, Any], jax.Array], *, eps: float, distribution: str = "binomial"):
    """The ZO analogue of ``jax.value_and_grad``: ``fn(params, batch, keys) -> (loss f32[], ZOGrads)``.

    ``loss`` is the mean over the pairs of ``(L(θ+εz_i) + L(θ−εz_i)) / 2``; ε is host-rounded.
    Called with concrete arrays it runs :func:`projected_gradients_fn` (compiled once per shape
    with the memory-saving options); inside a ``jax.jit`` it traces
    :func:`projected_gradients` into the caller's program (jit that with
    ``compiler_options=compiler_options()`` to keep a step's memory at that of inference).

    Example:
      >>> from zeroth.rng import sample_keys
      >>> fn = zo_value_and_grad(lambda p, b: jnp.sum(p["w"] ** 2), eps=1e-2)
      >>> loss, g = fn({"w": jnp.ones(3)}, None, sample_keys(0, [(0, 0, 0), (0, 0, 1)]))
      >>> g.grads.shape
      (2,)
    """
    estimator = _estimator.projected_gradients_fn(loss_fn, distribution=distribution)
    eps_scale = _estimator.round_eps(eps)

    def fn(params, batch, keys):
        keys = jnp.asarray(keys, jnp.uint32).reshape(-1, 2)
        if any(isinstance(x, jax.core.Tracer) for x in jax.tree_util.tree_leaves((params, batch, keys))):
            g, losses = _estimator.projected_gradients(
                loss_fn, params, batch, keys, eps_scale, distribution=distribution
            )
        else:
            g, losses = estimator(params, batch, keys, eps_scale)
        return jnp.mean(losses), ZOGrads(keys, g)

    return fn


@functools.partial(jax.jit, static_argnames=("distribution",))
def _estimate(params, keys, grads, denom, *, distribution):
    c = jnp.asarray(grads, jnp.float32).reshape(-1) / jnp.asarray(denom, jnp.float32)
    est = dense_gradient(params, keys, c, distribution=distribution)
    return jax.tree_util.tree_map(lambda e, p: e.astype(jnp.asarray(p).dtype), est, params)


def zo_estimate(*, distribution: str = "binomial", scaling: str = "sqrt") -> optax.GradientTransformationExtraArgs:
    """The ZO estimator as the first link of an optax chain: :class:`ZOGrads` in, a dense gradient out.

    ``update(updates, state, params, *, n_total=None)`` takes ``updates = ZOGrads(keys, grads)``
    (``n`` perturbations) and returns the dense estimate of ``∇L``

        ĝ = Σ_i g_i z_i / s,    s = √N ("sqrt") or N ("linear"),  N = n_total (default n),

    a pytree of the parameters' structure and dtypes (``z_i`` are the replay's own noise values,
    :func:`dense_gradient`). Everything after it in the chain sees an ordinary gradient: clipping,
    schedules, momentum, Adam, the learning rate (``optax.sgd(η)`` then gives ZO-SGD, the update
    ``−η ĝ`` that :func:`mezo_step` applies exactly). ``params`` is required (its leaf paths name
    the noise); ``n_total`` (an extra argument that ``optax.chain`` forwards) is the number of
    projected gradients of the iteration across all machines when ``updates`` holds a subset. The
    state is ``optax.EmptyState()``.

    OUTSIDE THE DETERMINISM CONTRACT: the dense sum and optax's float math (clipping norms,
    schedules evaluated on the device, optimizer moments) round differently on different
    backends, so peers running it drift apart; and the estimate is one parameter-sized buffer
    more. The exact path is :func:`mezo_step` / :func:`canonical_updates` with a host schedule
    (:mod:`zeroth.schedules`).

    Example:
      >>> import optax
      >>> from zeroth.rng import sample_keys
      >>> loss = lambda p, b: jnp.sum((p["w"] - 1.0) ** 2)
      >>> opt = optax.chain(zo_estimate(), optax.clip_by_global_norm(1.0),
      ...                   optax.sgd(optax.warmup_cosine_decay_schedule(0.0, 0.5, 5, 40)))
      >>> params = {"w": jnp.zeros(8)}
      >>> state = opt.init(params)
      >>> value_and_grad = zo_value_and_grad(loss, eps=1e-2)
      >>> for t in range(40):
      ...     loss_t, grads = value_and_grad(params, None, sample_keys(0, [(0, t, i) for i in range(4)]))
      ...     updates, state = opt.update(grads, state, params)
      ...     params = optax.apply_updates(params, updates)
      >>> float(loss(params, None)) < 0.01 * 8.0  # from 8.0
      True
    """
    _noise.check_distribution(distribution)
    _update._check_scaling(scaling)

    def init_fn(params):
        del params
        return optax.EmptyState()

    def update_fn(updates, state, params=None, *, n_total=None, **extra_args):
        del extra_args
        if params is None:
            raise ValueError(
                "zo_estimate needs params (opt.update(grads, state, params)): their leaf paths name the noise"
            )
        if not isinstance(updates, ZOGrads):
            raise TypeError(
                f"zo_estimate takes updates=ZOGrads(keys, grads) (see zo_value_and_grad), got {type(updates).__name__}"
            )
        keys = jnp.asarray(updates.keys, jnp.uint32).reshape(-1, 2)
        n = keys.shape[0]
        if n_total is None:
            n_total = n
        if isinstance(n_total, jax.core.Tracer):
            total = jnp.asarray(n_total, jnp.float32)
            denom = total if scaling == "linear" else jnp.sqrt(total)
        else:
            if isinstance(n_total, bool) or not isinstance(n_total, (int, np.integer)) or n_total < max(1, n):
                raise ValueError(f"n_total must be an integer >= max(1, number of keys) = {max(1, n)}, got {n_total!r}")
            denom = np.float32(n_total if scaling == "linear" else math.sqrt(n_total))
        return _estimate(params, keys, updates.grads, denom, distribution=distribution), state

    return optax.GradientTransformationExtraArgs(init_fn, update_fn)


class ZOOptaxState(NamedTuple):
    """State of :func:`zo_optax`: the wrapped optimizer's state (float math, not exact)."""

    inner: Any  # optax state of the wrapped optimizer, e.g. momentum / Adam moments (param-sized)


class ZOOptax(NamedTuple):
    """``init(params) -> state``; ``update(params, state, keys, grads, n_total) -> (params, state)``."""

    init: Callable[[Any], ZOOptaxState]
    update: Callable[..., tuple[Any, ZOOptaxState]]


def zo_optax(optimizer, *, distribution: str = "binomial", scaling: str = "sqrt") -> ZOOptax:
    """ZO-momentum / ZO-Adam: ``optimizer`` after :func:`zo_estimate`, and the update applied.

    ``update(params, state, keys, grads, n_total)`` is ``ĝ = zo_estimate(...)(ZOGrads(keys,
    grads), n_total=n_total)``, then ``optimizer.update(ĝ, ...)`` and ``optax.apply_updates``, in
    one compiled program; the learning rate (and its optax schedule) lives in ``optimizer``.
    The same as ``optax.chain(zo_estimate(...), optimizer)`` with the parameters updated for you.
    OUTSIDE THE DETERMINISM CONTRACT (see :func:`zo_estimate`); it costs the dense estimate (one
    copy of the parameters) plus the optimizer state (one for momentum, two for Adam).
    Use :func:`mezo_step` / :func:`canonical_updates` where bit-exactness is needed.

    Example:
      >>> import optax
      >>> opt = zo_optax(optax.adam(1e-2))
      >>> state = opt.init({"w": jnp.zeros(3)})
    """
    estimate = zo_estimate(distribution=distribution, scaling=scaling)

    def init(params):
        return ZOOptaxState(optimizer.init(params))

    @functools.partial(jax.jit, static_argnums=(4,))
    def _update(params, state, keys, grads, n_total):
        est, _ = estimate.update(ZOGrads(keys, grads), optax.EmptyState(), params, n_total=n_total)
        with jax.numpy_dtype_promotion("standard"):  # optax's internals mix Python floats and int32 counts
            updates, inner = optimizer.update(est, state.inner, params)
            return optax.apply_updates(params, updates), ZOOptaxState(inner)

    def update(params, state, keys, grads, n_total):
        if isinstance(n_total, bool) or not isinstance(n_total, (int, np.integer)) or n_total < 1:
            raise ValueError(f"n_total must be an integer >= 1, got {n_total!r}")
        return _update(params, state, keys, grads, int(n_total))

    return ZOOptax(init, update)
