"""Training methods: each a factory ``(cfg, model) -> Method`` of :mod:`zeroth.methods.base`.

* ``zo`` (:func:`zeroth.methods.mezo.zo_method`): MeZO / Just One Byte, forward passes only,
  the update replayed exactly;
* ``backprop`` (:func:`zeroth.methods.backprop.backprop_method`): the optax baseline;
* with ``train.requantize`` (:func:`zeroth.methods.q4.requantize_method`): the ZO step on 4-bit
  weights, requantized after every update.

:func:`make_method` picks the one a config names; :data:`METHODS` is what ``train.method`` may say.

Example:
  >>> sorted(METHODS)
  ['backprop', 'zo']
"""

from __future__ import annotations

from collections.abc import Callable

from zeroth.methods.backprop import OPTIMIZERS, backprop_method
from zeroth.methods.base import MACHINE, Method, StepInfo, TrainState
from zeroth.methods.mezo import zo_method
from zeroth.methods.q4 import requantize_method, zo_q4_method

__all__ = [
    "METHODS",
    "OPTIMIZERS",
    "MACHINE",
    "Method",
    "StepInfo",
    "TrainState",
    "make_method",
    "zo_method",
    "backprop_method",
    "zo_q4_method",
    "requantize_method",
]

# train.method -> (cfg, model) -> Method
METHODS: dict[str, Callable[..., Method]] = {"zo": zo_method, "backprop": backprop_method}


def make_method(cfg, model) -> Method:
    """The method named by ``train.method`` (with ``train.requantize``: :func:`~zeroth.methods.q4.requantize_method`)."""
    if cfg.train.requantize is not None:
        return requantize_method(cfg, model)
    return METHODS[cfg.train.method](cfg, model)
