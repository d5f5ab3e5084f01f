"""Model registry: build flax modules by name, initialize float32 parameters, apply them.

Models are registered as ``"module:attribute"`` targets and imported only when built, so
``import zeroth.models`` (and config validation) stays light. Built-in names: ``mlp``, ``cnn``,
``transformer`` (see :mod:`zeroth.models.classifiers`). Other packages register more with
:func:`register`; the module ``zeroth.models.pretrained``, when present, is imported on a lookup
of an unknown name so it can register its own.

Initialization is ``flax`` ``Module.init`` with the key ``init_key(run_seed) = fold_in(root_key(
run_seed), INIT_TAG)``; parameters are cast to float32.

Example:
  >>> import numpy as np
  >>> model = build("mlp", num_classes=10, hidden=(16,))
  >>> params = init(model, init_key(0), np.zeros((1, 8, 8, 1), np.float32))
  >>> apply(model, params, np.zeros((2, 8, 8, 1), np.float32)).shape
  (2, 10)
"""

from __future__ import annotations

import dataclasses
import importlib
import importlib.util
from typing import Any, NamedTuple

import numpy as np

from zeroth import reference as _ref

__all__ = [
    "ModelSpec",
    "REGISTRY",
    "INIT_TAG",
    "register",
    "names",
    "build",
    "init_key",
    "init",
    "apply",
    "param_count",
]

INIT_TAG = 0x696E6974  # "init": folded into the run key to name the initialization key
_PLUGIN = "zeroth.models.pretrained"


class ModelSpec(NamedTuple):
    """A registered model: ``target`` is ``"module:attribute"`` of a flax module class or factory."""

    name: str
    target: str
    description: str


REGISTRY: dict[str, ModelSpec] = {
    "mlp": ModelSpec("mlp", "zeroth.models.classifiers:MLP", "multi-layer perceptron on flattened inputs"),
    "cnn": ModelSpec("cnn", "zeroth.models.classifiers:CNN", "small conv net (3x3 conv + max pool blocks, dense head)"),
    "transformer": ModelSpec(
        "transformer", "zeroth.models.classifiers:Transformer", "small pre-LN transformer encoder classifier"
    ),
}


def register(name: str, target: str, description: str = "") -> ModelSpec:
    """Register a model factory ``"module:attribute"`` (called with keyword arguments) under ``name``."""
    if ":" not in target:
        raise ValueError(f"model target must be 'module:attribute', got {target!r}")
    spec = ModelSpec(name, target, description)
    REGISTRY[name] = spec
    return spec


def _load_plugin() -> None:
    try:
        found = importlib.util.find_spec(_PLUGIN) is not None
    except ImportError:
        found = False
    if found:
        importlib.import_module(_PLUGIN)


def names() -> tuple[str, ...]:
    """Registered model names (the optional pretrained plugin included when present)."""
    _load_plugin()
    return tuple(REGISTRY)


def build(name: str, **kwargs: Any):
    """The flax module registered as ``name``, constructed with ``kwargs``.

    Raises:
      ValueError: unknown name, or a keyword the model does not take (the valid ones are named).
    """
    if name not in REGISTRY:
        _load_plugin()
    if name not in REGISTRY:
        raise ValueError(f"unknown model {name!r}; registered models are {list(REGISTRY)}")
    module, attr = REGISTRY[name].target.split(":")
    factory = getattr(importlib.import_module(module), attr)
    if dataclasses.is_dataclass(factory):
        valid = [f.name for f in dataclasses.fields(factory) if f.init and f.name not in ("parent", "name")]
        unknown = [k for k in kwargs if k not in valid]
        if unknown:
            raise ValueError(f"model {name!r} has no argument {unknown[0]!r}; valid arguments are {sorted(valid)}")
        kwargs = {k: tuple(v) if isinstance(v, list) else v for k, v in kwargs.items()}
    return factory(**kwargs)


def init_key(run_seed: int) -> np.ndarray:
    """``u32[2]`` key of the model initialization of run ``run_seed``: ``fold_in(root_key(seed), INIT_TAG)``."""
    return _ref.fold_in(_ref.root_key(run_seed), INIT_TAG)


def init(model, key, sample_x, **kwargs: Any) -> dict:
    """Initialize parameters: a pytree (nested dict) of float32 arrays.

    Args:
      model: a flax module, or a registered name (then built with ``kwargs``).
      key: ``u32[2]`` raw key (e.g. :func:`init_key`).
      sample_x: an input batch with the real shape/dtype (only shapes are used).

    Returns:
      The ``params`` collection, every leaf float32.
    """
    import jax
    import jax.numpy as jnp

    if isinstance(model, str):
        model = build(model, **kwargs)
    rng = jax.random.wrap_key_data(jnp.asarray(np.asarray(key, np.uint32)))
    variables = jax.jit(model.init)(rng, jnp.asarray(sample_x))
    if set(variables) != {"params"}:
        raise ValueError(f"model has variable collections {sorted(variables)}; only 'params' is supported")
    return jax.tree_util.tree_map(lambda p: jnp.asarray(p, jnp.float32), dict(variables["params"]))


def apply(model, params, x):
    """Logits ``f32[B, num_classes]`` of ``model`` with ``params`` on inputs ``x`` (jittable)."""
    return model.apply({"params": params}, x)


def param_count(params) -> int:
    """Total number of parameters."""
    import jax

    return int(sum(np.size(p) for p in jax.tree_util.tree_leaves(params)))
