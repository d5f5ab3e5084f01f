"""Pallas kernels of zeroth. Each module holds one op: the kernel, its wrapper and a plain ``jnp`` reference.

Import the module you need (``zeroth.kernels.perturb`` for the fused exact replay,
``zeroth.kernels.signbits``, ...); this package imports nothing itself (``triton_params`` imports Triton's Pallas module when called), so importing one kernel
never pays for another. ``zeroth.kernels.cpu_native`` builds and caches the native CPU replay
kernel (``cpu_perturb.cc``, an XLA FFI custom call).
"""

__all__ = ["triton_params"]


def triton_params():
    """The Triton compiler parameters of zeroth's element-wise GPU kernels (4 warps, no pipelining).

    Every GPU ``pallas_call`` of zeroth passes them: without Triton parameters jax lowers a GPU
    kernel through Mosaic GPU, whose async copies take at most 256 elements per dimension.
    """
    from jax.experimental.pallas import triton as pltriton

    return pltriton.CompilerParams(num_warps=4, num_stages=1)
