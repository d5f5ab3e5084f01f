"""Model registry: build flax modules by name, initialize float32 parameters, apply them.

Models are registered as ``"module:attribute"`` targets of this package and imported only when
built, so ``import zeroth.models`` stays light. Built-in names: ``mlp``, ``cnn``, ``transformer``
(see :mod:`zeroth.models.classifiers`). Other packages register more with :func:`register`:
importing :mod:`zeroth.models.pretrained` registers ``smollm2_prompt`` and ``minilm_classifier``
(the config and the objectives import it, so every configured name is known).

Initialization (:func:`init`) is *exact* by default: the parameter shapes come from flax
(``jax.eval_shape`` of ``Module.init``, nothing is compiled) and each leaf is filled on the host
from zeroth's integer noise, so every process and backend gets the same bits (peers can each
initialize and compare checksums at iteration 0). Leaf ``path`` of run key ``K =
init_key(run_seed) = fold_in(root_key(run_seed), INIT_TAG)`` gets ``z = k / 2`` with ``k`` the
binomial stream of ``fold_in(K, leaf_id(path))`` (variance 1, as in :mod:`zeroth.noise`), and

* ``kernel``: ``z / sqrt(fan_in)`` (LeCun scaling), ``fan_in = shape[0]`` for the query/key/value
  kernels of attention (``(in, heads, head_dim)``), else ``prod(shape[:-1])`` (Dense, Conv,
  attention output);
* ``embedding``: ``z / sqrt(features)``; ``pos_embedding``: ``0.02 z``;
* ``bias``: 0; ``scale``: 1.

Other leaf names raise ``ValueError``; ``init(..., exact=False)`` uses flax's own (jax.random,
backend-dependent) initializers instead.

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
    "exact_leaf",
    "apply",
    "param_count",
]

INIT_TAG = 0x696E6974  # "init": folded into the run key to name the initialization key


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


def names() -> tuple[str, ...]:
    """Registered model names (the pretrained ones once :mod:`zeroth.models.pretrained` is imported)."""
    return tuple(REGISTRY)


def build(name: str, **kwargs: Any):
    """The flax module registered as ``name``, constructed with ``kwargs``.

    Raises:
      ValueError: unknown name, or a keyword the model does not take (the valid ones are named).
    """
    if name not in REGISTRY:
        raise ValueError(
            f"unknown model {name!r}; registered models are {list(REGISTRY)} "
            f"(import zeroth.models.pretrained to register the pretrained ones)"
        )
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


def _binomial_z(leaf_key: np.ndarray, n: int) -> np.ndarray:
    """``f32[n]``: ``z = k / 2`` of the leaf's binomial stream (``reference.binomial_int / 2``)."""
    return _ref.binomial_int(leaf_key, n).astype(np.float32) * np.float32(0.5)


_ATTENTION_INPUTS = ("query", "key", "value")


def exact_leaf(path: str, shape: tuple[int, ...], key) -> np.ndarray:
    """The exact initial value (f32) of the leaf at ``path`` (a ``keystr``) with ``shape`` (see module docstring)."""
    parts = [p.strip("[]'\"") for p in path.replace("][", "]|[").split("|")]
    name = parts[-1]
    n = int(np.prod(shape, dtype=np.int64))
    if name == "bias":
        return np.zeros(shape, np.float32)
    if name == "scale":
        return np.ones(shape, np.float32)
    if name == "kernel":
        attention_in = len(parts) >= 2 and parts[-2] in _ATTENTION_INPUTS and len(shape) == 3
        fan_in = shape[0] if attention_in else int(np.prod(shape[:-1], dtype=np.int64))
        std = 1.0 / np.sqrt(max(fan_in, 1))
    elif name == "embedding":
        std = 1.0 / np.sqrt(shape[-1])
    elif name == "pos_embedding":
        std = 0.02
    else:
        raise ValueError(
            f"no exact initializer for parameter {path} (known leaf names: kernel, bias, scale, embedding, "
            f"pos_embedding); use init(..., exact=False) for flax's initializers"
        )
    z = _binomial_z(_ref.leaf_key(np.asarray(key, np.uint32), path), n).reshape(shape)
    return z * np.float32(std)


def init(model, key, sample_x, *, exact: bool = True, pretrained: bool = True, **kwargs: Any) -> dict:
    """Initialize parameters: a pytree (nested dict) of float32 arrays.

    A model with a ``pretrained_params(key, sample_x)`` method (the pretrained models) starts
    from what it returns, unless ``pretrained=False``.

    Args:
      model: a flax module, or a registered name (then built with ``kwargs``).
      key: ``u32[2]`` raw key (e.g. :func:`init_key`).
      sample_x: an input batch with the real shape/dtype (only shapes are used).
      exact: fill the leaves with zeroth's integer noise on the host (bit-identical everywhere,
        no compilation); ``False`` = flax's initializers (``jax.random``, backend-dependent).
      pretrained: use the model's ``pretrained_params`` when it has one.

    Returns:
      The ``params`` collection, every leaf float32.
    """
    import jax
    import jax.numpy as jnp

    if isinstance(model, str):
        model = build(model, **kwargs)
    elif kwargs:
        raise ValueError(f"keyword arguments {sorted(kwargs)} are only accepted with a model name")
    if pretrained and callable(getattr(model, "pretrained_params", None)):
        params = model.pretrained_params(key, sample_x)
        return jax.tree_util.tree_map(lambda p: jnp.asarray(p, jnp.float32), dict(params))
    sample = jnp.asarray(sample_x)
    if not exact:
        rng = jax.random.wrap_key_data(jnp.asarray(np.asarray(key, np.uint32)))
        variables = jax.jit(model.init)(rng, sample)
    else:
        variables = jax.eval_shape(model.init, jax.random.key(0), sample)
    if set(variables) != {"params"}:
        raise ValueError(f"model has variable collections {sorted(variables)}; only 'params' is supported")
    params = dict(variables["params"])
    if not exact:
        return jax.tree_util.tree_map(lambda p: jnp.asarray(p, jnp.float32), params)
    from zeroth.rng import leaf_path

    return jax.tree_util.tree_map_with_path(
        lambda path, sds: jnp.asarray(exact_leaf(leaf_path(path), tuple(sds.shape), key)), params
    )


def apply(model, params, x):
    """Logits ``f32[B, num_classes]`` of ``model`` with ``params`` on inputs ``x`` (jittable)."""
    return model.apply({"params": params}, x)


def param_count(params) -> int:
    """Total number of parameters."""
    import jax

    return int(sum(np.size(p) for p in jax.tree_util.tree_leaves(params)))
