"""Fused exact replay: K ``(key, scale)`` updates applied to a leaf in one read and one write.

One op in three implementations that give the same bits, ``"pallas"`` (GPU, TPU), ``"native"``
(a C++ XLA FFI call on CPU) and ``"jnp"`` (the reference), laid out by concern as jax's Pallas
ops are: plans, kernels, slices, dispatch. The rule, the implementations and the entry points are
described in the docs (``docs/kernels.md``, "The fused replay op").

Example:
  >>> import numpy as np, jax.numpy as jnp
  >>> from zeroth import rng, replay
  >>> keys = rng.sample_keys(0, [(0, 0, 0), (0, 0, 1)])
  >>> scales = replay.update_scales("binomial", [0.5, -0.25])
  >>> p = {"w": jnp.zeros((3, 5))}
  >>> q = fused_apply_updates(p, keys, scales, distribution="binomial")
  >>> bool((q["w"] == replay.apply_updates(p, keys, scales, distribution="binomial")["w"]).all())
  True
"""

from zeroth.kernels.perturb import common, dispatch, mosaic, native, pallas, plans, slices
from zeroth.kernels.perturb.common import leaf_key_table, leaf_keys, perturb_reference
from zeroth.kernels.perturb.dispatch import (
    APART_MIN_BYTES,
    apply_updates,
    apply_updates_flat,
    fused_apply_updates,
    perturb_leaf,
)
from zeroth.kernels.perturb.native import perturb_native
from zeroth.kernels.perturb.pallas import perturb_pallas, perturb_pallas_flat, perturb_pallas_segments
from zeroth.kernels.perturb.plans import (
    IMPLS,
    BlockSizes,
    check_block_sizes,
    default_block_sizes,
    platform_of,
    resolve_impl,
)

__all__ = [
    "IMPLS",
    "APART_MIN_BYTES",
    "BlockSizes",
    "default_block_sizes",
    "check_block_sizes",
    "resolve_impl",
    "platform_of",
    "leaf_keys",
    "leaf_key_table",
    "perturb_reference",
    "perturb_pallas",
    "perturb_pallas_flat",
    "perturb_pallas_segments",
    "perturb_native",
    "perturb_leaf",
    "apply_updates",
    "apply_updates_flat",
    "fused_apply_updates",
    # submodules
    "plans",
    "common",
    "pallas",
    "mosaic",
    "native",
    "slices",
    "dispatch",
]
