"""Zeroth-order (SPSA / MeZO) estimators and steps over zeroth's exact perturbations.

A step evaluates the loss at ``θ ± εz`` for perturbations named by keys (:mod:`zeroth.rng`),
shares the projected gradients, and applies ``θ ← θ − η Σ g·z`` as one canonical replay. The
estimate is outside the determinism contract (only the scalars it produces are shared); the update
is inside it. The design, and how a step keeps the memory of inference, are in the docs (concepts:
ZO memory).

- :mod:`zeroth.zo.estimator`: :func:`projected_gradients` (traceable) and
  :func:`projected_gradients_fn` (compiled), both ``(g, ℓ)`` from a raw ε;
- :mod:`zeroth.zo.update`: coefficients, the canonical updates, exact weight decay;
- :mod:`zeroth.zo.step`: :func:`mezo_step`, one machine's step (held or deferred);
- :mod:`zeroth.zo.optax_bridge`: the estimate as an optax transformation (outside the contract);
- :mod:`zeroth.zo.autotune`: the compiler options the estimator chooses among.

Example:
  >>> import jax.numpy as jnp
  >>> loss = lambda p, b: jnp.sum((p["w"] - b) ** 2)
  >>> out = mezo_step(loss, {"w": jnp.zeros(4)}, jnp.ones(4), run_seed=0, iteration=0, lr=0.1, eps=1e-2,
  ...                 n_perturbations=2)
  >>> out.grads.shape, len(out.payload)
  ((2,), 8)
"""

from zeroth.zo import autotune, estimator, optax_bridge, step, update
from zeroth.zo.autotune import compiled_memory, compiler_options
from zeroth.zo.estimator import (
    PERTURB_IMPLS,
    ProjectedGradientsFn,
    projected_gradients,
    projected_gradients_fn,
    round_eps,
)
from zeroth.zo.optax_bridge import (
    ZOGrads,
    ZOOptax,
    ZOOptaxState,
    dense_gradient,
    zo_estimate,
    zo_optax,
    zo_value_and_grad,
)
from zeroth.zo.step import Deferred, Held, StepResult, mezo_step, settle
from zeroth.zo.update import SCALINGS, canonical_updates, decay_factor, lr_at, update_coefficients, weight_decay

__all__ = [
    # estimator
    "round_eps",
    "projected_gradients",
    "projected_gradients_fn",
    "ProjectedGradientsFn",
    "PERTURB_IMPLS",
    "compiler_options",
    "compiled_memory",
    # update
    "SCALINGS",
    "lr_at",
    "update_coefficients",
    "canonical_updates",
    "decay_factor",
    "weight_decay",
    # one machine
    "mezo_step",
    "StepResult",
    "Held",
    "Deferred",
    "settle",
    # optax
    "ZOGrads",
    "zo_value_and_grad",
    "zo_estimate",
    "dense_gradient",
    "ZOOptaxState",
    "ZOOptax",
    "zo_optax",
    # submodules
    "autotune",
    "estimator",
    "update",
    "step",
    "optax_bridge",
]
