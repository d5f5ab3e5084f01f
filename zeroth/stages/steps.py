"""A stage's compiled computations: forward, backward (VJP) and the loss at the last stage, and the
optimizer step. Shared by the pipeline's GPipe stages and the clusters' asynchronous stages.

For a stage function of :mod:`zeroth.stages.partition` (``first(p, tok)``, ``middle(p, h, tok)``,
``last(p, h, tok, lab)``; a lone stage ``(p, tok, lab)``):

* ``fwd(p, [h,] tok) -> h`` (not on the last stage);
* ``bwd(p, [h,] tok, g) -> grads of p`` on the first stage, ``(grads of p, grad of h)`` on a middle one;
* ``loss_grad(p, [h,] tok, lab) -> (loss, grads)``: on the last stage, with ``grads = (of p, of h)``
  when it has an input; the loss is multiplied by ``scale`` when given (GPipe's ``1/M``);
* ``update(params, opt_state, grads) -> (params, opt_state)``: one ``optax`` step.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import optax

__all__ = ["StageFns", "compile_stage", "compile_update"]


class StageFns(NamedTuple):
    """The jitted computations of one stage (``None`` where the stage has none)."""

    fwd: Callable | None
    bwd: Callable | None
    loss_grad: Callable | None


def compile_stage(fn: Callable, first: bool, last: bool, scale: Any = None) -> StageFns:
    """The stage's jitted ``fwd``, ``bwd`` and ``loss_grad`` (see the module docstring)."""
    loss = fn if scale is None else (lambda *a: fn(*a) * scale)
    if last:
        return StageFns(None, None, jax.jit(jax.value_and_grad(loss, argnums=0 if first else (0, 1))))
    if first:
        return StageFns(jax.jit(fn), jax.jit(lambda p, tok, g: jax.vjp(lambda q: fn(q, tok), p)[1](g)[0]), None)
    return StageFns(jax.jit(fn), jax.jit(lambda p, h, tok, g: jax.vjp(lambda q, x: fn(q, x, tok), p, h)[1](g)), None)


def compile_update(optimizer: optax.GradientTransformation) -> Callable:
    """``update(params, opt_state, grads) -> (params, opt_state)``, jitted."""

    def update(params, opt_state, grads):
        updates, opt_state = optimizer.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state

    return jax.jit(update)
