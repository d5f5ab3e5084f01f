"""The native CPU kernel (an XLA FFI custom call) on a leaf, a tree and a flat buffer."""

from __future__ import annotations


import jax
import jax.numpy as jnp
import numpy as np

from zeroth import noise as _noise
from zeroth import rule as _rule
from zeroth.kernels import cpu_native
from zeroth.kernels.perturb import common as _common
from zeroth.kernels.perturb import plans as _plans


def perturb_native(
    x,
    leaf_keys_,
    scales,
    *,
    distribution: str = "binomial",
    offset: int = 0,
    inplace: bool = False,
    build: cpu_native.BuildConfig = cpu_native.DEFAULT_BUILD,
) -> jax.Array:
    """The native CPU kernel on one leaf (see :func:`perturb_reference` for the arguments).

    Args:
      inplace: alias the output to ``x``'s buffer (under ``jit`` with ``x`` donated: no copy;
        without donation XLA would insert one, so leave it False there).
      build: which compiled variant to call (tests compare the portable and native builds).

    Raises:
      RuntimeError: the kernel cannot be built (``cpu_native.available()`` says so without raising).
    """
    x, keys, scales = _common._check_args(x, leaf_keys_, scales, distribution)
    offset = _common._check_offset(offset, x.size)
    name = cpu_native.register(build)
    call = jax.ffi.ffi_call(
        name,
        jax.ShapeDtypeStruct(x.shape, x.dtype),
        input_output_aliases={0: 0} if inplace else None,
    )
    return call(x, keys, scales, distribution=np.int32(_plans._DIST_CODE[distribution]), offset=np.int64(offset))


def perturb_native_tree(
    leaves: list,
    keys,
    scales,
    leaf_ids: list[int],
    *,
    distribution: str = "binomial",
    inplace: bool = False,
    build: cpu_native.BuildConfig = cpu_native.DEFAULT_BUILD,
) -> list[jax.Array]:
    """The native CPU kernel on every leaf of a replay in **one launch** (one custom call): the
    leaf keys ``fold_in(keys[u], leaf_ids[i])`` are derived inside it, the tiles of all leaves
    are shared out to the threads together. Same bits as :func:`perturb_native` leaf by leaf.

    Args:
      leaves: the arrays (f32 / bf16 / f16, any shapes).
      keys: ``u32[K, 2]`` *sample* keys; scales: ``f32[K]`` host-rounded scales.
      leaf_ids: one 32-bit id per leaf (:func:`zeroth.rng.leaf_id` of its path).
      inplace: alias every output to its leaf's buffer (under ``jit`` with the leaves donated).
    """
    _noise.check_distribution(distribution)
    if len(leaf_ids) != len(leaves):
        raise ValueError(f"{len(leaves)} leaves but {len(leaf_ids)} leaf ids")
    leaves = [jnp.asarray(x) for x in leaves]
    for i, x in enumerate(leaves):
        _rule.check_dtype(x.dtype, f"leaf {i}")
        _common._check_offset(0, x.size)
    keys = jnp.asarray(keys, jnp.uint32).reshape(-1, 2)
    scales = jnp.asarray(scales, jnp.float32).reshape(-1)
    if scales.shape[0] != keys.shape[0]:
        raise ValueError(f"{keys.shape[0]} keys but {scales.shape[0]} scales")
    if not leaves:
        return []
    cpu_native.register(build)
    call = jax.ffi.ffi_call(
        cpu_native.target_name(build, tree=True),
        [jax.ShapeDtypeStruct(x.shape, x.dtype) for x in leaves],
        input_output_aliases={i + 2: i for i in range(len(leaves))} if inplace else None,
    )
    return list(
        call(
            keys,
            scales,
            *leaves,
            leaf_ids=np.asarray(leaf_ids, np.int64),
            distribution=np.int32(_plans._DIST_CODE[distribution]),
        )
    )


def perturb_native_flat(
    buffer,
    keys,
    scales,
    segments,
    *,
    distribution: str = "binomial",
    inplace: bool = False,
    build: cpu_native.BuildConfig = cpu_native.DEFAULT_BUILD,
) -> jax.Array:
    """The native CPU kernel on every segment of one flat buffer in **one launch** (one custom
    call): segment ``(offset, size, leaf_id)`` is a whole leaf of ``size`` elements stored at
    ``buffer[offset : offset + size]``, its noise counters start at 0 there, and its leaf keys
    ``fold_in(keys[u], leaf_id)`` are derived inside the kernel. Same bits as
    :func:`perturb_native_tree` on the leaves; elements outside every segment keep their bits.

    Args:
      buffer: a 1-D f32 / bf16 / f16 array.
      keys: ``u32[K, 2]`` *sample* keys; scales: ``f32[K]`` host-rounded scales.
      segments: ``(offset, size, leaf_id)`` int triples (static; not overlapping).
      inplace: alias the output to ``buffer`` (under ``jit`` with the buffer donated: no copy).
    """
    _noise.check_distribution(distribution)
    buffer = jnp.asarray(buffer)
    _rule.check_dtype(buffer.dtype, "flat buffer")
    if buffer.ndim != 1:
        raise ValueError(f"the flat buffer must be 1-D, got shape {buffer.shape}")
    segments = _common._check_segments(segments, buffer.shape[0], "perturb_native_flat")
    keys = jnp.asarray(keys, jnp.uint32).reshape(-1, 2)
    scales = jnp.asarray(scales, jnp.float32).reshape(-1)
    if scales.shape[0] != keys.shape[0]:
        raise ValueError(f"{keys.shape[0]} keys but {scales.shape[0]} scales")
    cpu_native.register(build)
    call = jax.ffi.ffi_call(
        cpu_native.target_name(build, flat=True),
        jax.ShapeDtypeStruct(buffer.shape, buffer.dtype),
        input_output_aliases={2: 0} if inplace else None,
    )
    column = lambda j: np.asarray([seg[j] for seg in segments], np.int64)  # noqa: E731
    return call(
        keys,
        scales,
        buffer,
        offsets=column(0),
        sizes=column(1),
        leaf_ids=column(2),
        distribution=np.int32(_plans._DIST_CODE[distribution]),
    )
