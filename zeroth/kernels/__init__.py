"""Pallas kernels of zeroth. Each module holds one op: the kernel, its wrapper and a plain ``jnp`` reference.

Import the module you need (``zeroth.kernels.signbits``, ...); this package imports nothing itself,
so importing one kernel never pays for another.
"""

__all__: list[str] = []
