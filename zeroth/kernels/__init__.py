"""Pallas kernels of zeroth. Each module holds one op: the kernel, its wrapper and a plain ``jnp`` reference.

Import the module you need (``zeroth.kernels.perturb`` for the fused exact replay,
``zeroth.kernels.signbits``, ...); this package imports nothing itself (``triton_params`` imports Triton's Pallas module when called), so importing one kernel
never pays for another. ``zeroth.kernels.cpu_native`` builds and caches the native CPU replay
kernel (``cpu_perturb.cc``, an XLA FFI custom call).
"""

__all__ = ["triton_params", "out_struct"]


def triton_params():
    """The Triton compiler parameters of zeroth's element-wise GPU kernels (4 warps, no pipelining).

    Every GPU ``pallas_call`` of zeroth passes them: without Triton parameters jax lowers a GPU
    kernel through Mosaic GPU, whose async copies take at most 256 elements per dimension.
    """
    from jax.experimental.pallas import triton as pltriton

    return pltriton.CompilerParams(num_warps=4, num_stages=1)


def out_struct(shape, dtype, *like):
    """``jax.ShapeDtypeStruct(shape, dtype)`` for the output of a ``pallas_call`` whose inputs are
    ``like``: varying over every manual mesh axis some input varies over.

    Every ``pallas_call`` of zeroth declares its output so. Inside ``jax.shard_map`` (where
    ``check_vma=True`` is the default), Pallas refuses an output without ``manual_axis_type``: on a
    GPU, Marsit's sign-bit kernels inside its ``shard_map`` round stopped every run with "When
    `check_vma=True` on `jax.shard_map`, `manual_axis_type` on `jax.ShapeDtypeStruct` must not be
    `None`". Outside ``shard_map`` the inputs vary over no axis and the output is the plain struct.
    """
    import jax

    mats = [m for m in (getattr(jax.typeof(x), "manual_axis_type", None) for x in like) if m is not None]
    if not mats:
        return jax.ShapeDtypeStruct(shape, dtype)
    varying = frozenset().union(*(m.varying for m in mats))
    return jax.ShapeDtypeStruct(shape, dtype, manual_axis_type=type(mats[0])(varying=varying))
