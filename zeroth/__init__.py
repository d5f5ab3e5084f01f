"""zeroth: exact, low-bandwidth decentralized training in JAX.

The package root imports nothing heavy: ``zeroth.reference`` must stay importable without jax.
Import the submodules you need (``zeroth.rng``, ``zeroth.noise``, ``zeroth.replay``, ...).
"""

__version__ = "0.1.0"
__all__ = ["__version__"]
