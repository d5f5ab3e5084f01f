"""Objectives, evaluation and model construction: what every method, the trainer and the peers share.

* :data:`OBJECTIVES`: ``name -> fn(logits f32[B, C], labels int[B]) -> f32[]``;
  :func:`make_objective` closes one over a model: ``loss(params, (x, y)) -> f32[]``.
* :func:`make_eval_fn`: ``evaluate(params, x, y) -> {"eval_loss", "eval_accuracy"}`` over a whole
  split in chunks.
* :func:`build_model`: the configured model and its float32 initial parameters (exact
  initialisation from ``init_key(run.seed)``, or the model's pretrained weights).

They sit below the methods (:mod:`zeroth.methods`), the trainer (:mod:`zeroth.train`) and the
peers (:mod:`zeroth.net`), which all build the same model and loss from a config.

Example:
  >>> import numpy as np
  >>> from zeroth import models
  >>> model = models.build("mlp", num_classes=10, hidden=(8,))
  >>> params = models.init(model, models.init_key(0), np.zeros((1, 8, 8, 1), np.float32))
  >>> loss = make_objective("cross_entropy", model)
  >>> float(loss(params, (np.zeros((2, 8, 8, 1), np.float32), np.zeros(2, np.int32)))) > 0
  True
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

import zeroth.models.pretrained  # noqa: F401  (registers the pretrained models by name)
from zeroth import models as _models
from zeroth import replay as _replay

__all__ = ["OBJECTIVES", "make_objective", "make_eval_fn", "build_model"]


def _cross_entropy(logits: jax.Array, y: jax.Array) -> jax.Array:
    logp = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
    picked = jnp.take_along_axis(logp, y.astype(jnp.int32)[:, None], axis=-1)[:, 0]
    return -jnp.mean(picked)


def _error_rate(logits: jax.Array, y: jax.Array) -> jax.Array:
    correct = (jnp.argmax(logits, axis=-1) == y.astype(jnp.int32)).astype(jnp.float32)
    return jnp.float32(1.0) - jnp.mean(correct)


OBJECTIVES: dict[str, Callable[[jax.Array, jax.Array], jax.Array]] = {
    "cross_entropy": _cross_entropy,
    "error_rate": _error_rate,  # 1 - accuracy: piecewise constant, no useful gradient
}


@functools.lru_cache(maxsize=64)
def make_objective(name: str, model) -> Callable[[Any, tuple], jax.Array]:
    """``loss(params, (x, y)) -> f32[]``: the named objective of ``model``'s logits on a batch.

    ``cross_entropy`` is the mean softmax cross-entropy; ``error_rate`` is ``1 - accuracy``
    (not differentiable: only the ZO method can train on it). Cached per (name, model), so
    the compiled estimator of :mod:`zeroth.zo` is reused by later runs in the same process.
    """
    if name not in OBJECTIVES:
        raise ValueError(f"unknown objective {name!r}; expected one of {sorted(OBJECTIVES)}")
    fn = OBJECTIVES[name]

    def loss(params, batch):
        x, y = batch
        return fn(_models.apply(model, params, x), y)

    return loss


@functools.lru_cache(maxsize=64)
def make_eval_fn(model, batch_size: int) -> Callable[[Any, np.ndarray, np.ndarray], dict]:
    """``evaluate(params, x, y) -> {"eval_loss", "eval_accuracy"}`` over all of ``x`` in chunks of
    ``batch_size``. ``params`` may be a :class:`zeroth.replay.Flat` (unflattened inside the program)."""

    @jax.jit
    def chunk(params, x, y):
        if isinstance(params, _replay.Flat):
            params = _replay.unflatten(params)
        logits = _models.apply(model, params, x).astype(jnp.float32)
        logp = jax.nn.log_softmax(logits, axis=-1)
        nll = -jnp.sum(jnp.take_along_axis(logp, y[:, None], axis=-1))
        correct = jnp.sum((jnp.argmax(logits, axis=-1) == y).astype(jnp.int32))
        return nll, correct

    def evaluate(params, x, y):
        n = x.shape[0]
        total, correct = 0.0, 0
        for start in range(0, n, batch_size):
            nll, c = chunk(params, x[start : start + batch_size], y[start : start + batch_size])
            total += float(nll)
            correct += int(c)
        return {"eval_loss": total / n, "eval_accuracy": correct / n}

    return evaluate


def build_model(cfg, num_classes: int, sample_x: np.ndarray):
    """``(model, params)``: the model of ``cfg.model`` and its float32 initial parameters.

    The parameters are :func:`zeroth.models.init` with key ``init_key(cfg.run.seed)``: exact
    integer-noise initialisation, or the model's pretrained weights when it has them.
    """
    model = _models.build(cfg.model.name, num_classes=num_classes, **cfg.model.kwargs)
    params = _models.init(model, _models.init_key(cfg.run.seed), sample_x)
    return model, params
