"""Fused exact replay: K ``(key, scale)`` updates applied to a leaf in one read and one write.

One op in three implementations that give the same bits (the tests hold them to
``assert_array_equal`` against each other and against :mod:`zeroth.reference`):

* ``"pallas"``: a Pallas kernel. Each tile is loaded once, widened to float32 and flushed, gets
  all K updates in canonical order, and is cast and stored once. Every element regenerates its
  noise from its *global* flat index, so any tiling (and any shard, through ``offset``) gives
  the same bits. The default on GPU and TPU (but for float16 leaves on TPU, which Mosaic cannot
  load: :data:`zeroth.rule.MOSAIC_REFUSES`); on CPU it runs in interpret mode, for tests only.
* ``"native"``: a C++ XLA FFI custom call for CPU (:mod:`zeroth.kernels.cpu_native` builds and
  caches it with the machine's compiler): cache-resident tiles, 16 threefry calls per SIMD
  vector, XLA's thread pool. The default on CPU when it builds.
* ``"jnp"``: the plain ``jnp`` reference, :func:`perturb_reference` (one pass over the leaf
  per update). The fallback on CPU when no compiler is available.

The rule is the contract's (see :mod:`zeroth.replay`): with ``k_u`` the integer noise of update
``u`` (:func:`zeroth.noise.noise_int` of the leaf key ``fold_in(key_u, leaf_id(path))``),

    p32 = flush(float32(x));   p32 = flush(p32 + s_u * k_u)  for u = 0..K-1;   out = flush_cast(p32)

``s_u`` are host-rounded scales (:func:`zeroth.replay.update_scales`), so ``s_u * k_u`` is exact
and the add rounds once, identically everywhere. Every implementation flushes in halves with the
same bits (:mod:`zeroth.rule`): the zeros after the load and after each update
(:func:`zeroth.rule.flush_tiny`), the NaNs once, when the result is stored.

The package is laid out by concern, as jax's Pallas ops are: :mod:`~zeroth.kernels.perturb.plans`
(block sizes, tile plans, which implementation runs where), :mod:`~zeroth.kernels.perturb.common`
(the leaves' keys, one block's updates, the ``jnp`` rule), the kernels
(:mod:`~zeroth.kernels.perturb.pallas`, :mod:`~zeroth.kernels.perturb.mosaic`,
:mod:`~zeroth.kernels.perturb.native`), :mod:`~zeroth.kernels.perturb.slices` (a layer or rows
chosen at run time) and :mod:`~zeroth.kernels.perturb.dispatch`.

Entry points: :func:`perturb_leaf` (one array, leaf keys given), :func:`apply_updates` (a pytree,
traceable, same arguments as :func:`zeroth.replay.apply_updates`),
:func:`fused_apply_updates` (the host entry: jitted, optionally donating) and
:func:`apply_updates_flat` (leaves laid out as segments of flat buffers, one launch per buffer:
the op behind :class:`zeroth.replay.Flat`; on GPU and TPU :func:`perturb_pallas_flat`: on GPU a
grid over the tiles of every segment, loaded by element index; on TPU a grid over fixed blocks of
the buffer, each segment masked inside the blocks it touches).

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
