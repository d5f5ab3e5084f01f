"""Pallas kernels of zeroth. Each module holds one op: the kernel, its wrapper and a plain ``jnp`` reference.

Import the module you need (``zeroth.kernels.perturb`` for the fused exact replay,
``zeroth.kernels.signbits``, ...); this package imports nothing itself, so importing one kernel
never pays for another. ``zeroth.kernels.cpu_native`` builds and caches the native CPU replay
kernel (``cpu_perturb.cc``, an XLA FFI custom call).
"""

__all__: list[str] = []
