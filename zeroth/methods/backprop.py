"""The backprop baseline: ``jax.value_and_grad`` of the cross-entropy and an optax optimizer.

The same model, batches and evaluation as the ZO methods; the optimizer is one of
:data:`OPTIMIZERS` (``train.optimizer.name``), an optax ``GradientTransformation`` used as
optax composes them: ``updates, opt_state = opt.update(grads, opt_state, params)``, then
``optax.apply_updates``. The learning rate of step ``t`` is ``η_t`` of ``train.schedule``
(:func:`zeroth.schedules.from_train`, peak ``train.lr``), evaluated on the host like the ZO
methods' and passed to the compiled step: the optimizer is built with learning rate 1 and its
updates are multiplied by ``η_t``, which is what ``optax.<name>(learning_rate=schedule)`` computes
(each of these optimizers ends with ``scale_by_learning_rate``).

Example:
  >>> method = backprop_method(cfg, model)                           # doctest: +SKIP
  >>> state, info = method.step(method.init(params, key), batch)     # doctest: +SKIP
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import jax
import numpy as np
import optax

from zeroth import objectives as _objectives
from zeroth import schedules as _schedules
from zeroth.methods.base import Method, StepInfo, TrainState

__all__ = ["OPTIMIZERS", "backprop_method"]


def _sgd(o, lr):
    return optax.sgd(lr)


def _momentum(o, lr):
    return optax.sgd(lr, momentum=o.momentum)


def _adam(o, lr):
    return optax.adam(lr, b1=o.b1, b2=o.b2)


def _adamw(o, lr):
    return optax.adamw(lr, b1=o.b1, b2=o.b2, weight_decay=o.weight_decay)


# name -> (OptimizerConfig, lr) -> optax.GradientTransformation
OPTIMIZERS: dict[str, Callable[[Any, float], optax.GradientTransformation]] = {
    "sgd": _sgd,
    "momentum": _momentum,
    "adam": _adam,
    "adamw": _adamw,
}


@functools.lru_cache(maxsize=64)
def _backprop_update(model, optimizer):
    if optimizer.name not in OPTIMIZERS:
        raise ValueError(f"unknown optimizer {optimizer.name!r}; expected one of {sorted(OPTIMIZERS)}")
    opt = OPTIMIZERS[optimizer.name](optimizer, 1.0)
    loss_fn = _objectives.make_objective("cross_entropy", model)

    @jax.jit
    def update(params, opt_state, batch, lr):
        loss, grads = jax.value_and_grad(loss_fn)(params, batch)
        updates, opt_state = opt.update(grads, opt_state, params)
        updates = jax.tree_util.tree_map(lambda u: u * lr.astype(u.dtype), updates)
        return optax.apply_updates(params, updates), opt_state, loss

    return opt, update


def backprop_method(cfg, model) -> Method:
    """``jax.value_and_grad`` of the cross-entropy + the optax optimizer of ``train.optimizer`` at ``η_t`` of ``train.schedule``."""
    t = cfg.train
    if t.objective != "cross_entropy":
        raise ValueError(f"backprop needs a differentiable objective; train.objective is {t.objective!r}")
    opt, update = _backprop_update(model, t.optimizer)
    schedule = _schedules.from_train(t)

    def init(params, key):
        return TrainState(0, params, opt.init(params), key)

    def step(state, batch):
        # optax's Adam bias correction mixes a Python float with an int32 count: allow the
        # standard promotion while tracing it, whatever the process-wide setting.
        with jax.numpy_dtype_promotion("standard"):
            params, opt_state, loss = update(state.params, state.opt_state, batch, np.float32(schedule(state.step)))
        return TrainState(state.step + 1, params, opt_state, state.key), StepInfo(1, 1, 0, loss, None)

    return Method(init, step)
