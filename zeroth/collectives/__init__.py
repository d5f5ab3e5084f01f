"""Multi-hop all-reduce over JAX device meshes and the sign-bit synchronization family (seed 004).

* :mod:`~zeroth.collectives.topology`: ``Ring`` and ``Torus`` worker topologies as meshes.
* :mod:`~zeroth.collectives.ring`: ring reduce-scatter / all-gather from ``ppermute``, multi-stage
  (2D-torus) all-reduce, full-precision sums.
* :mod:`~zeroth.collectives.schemes`: hop schemes: Marsit merge, bit-sliced counts, SSDM cascade.
* :mod:`~zeroth.collectives.sync`: PSGD, signSGD, majority vote, EF-signSGD, SSDM, Marsit as
  composable optax-style transformations.
* :mod:`~zeroth.collectives.bits`: bits that cross ``ppermute``, read from the traced program.
* :mod:`~zeroth.collectives.train`: data-parallel training loop with per-worker checksums.
* :mod:`~zeroth.collectives.distributed`: the same programs over several processes
  (``jax.distributed``), e.g. two on loopback with the CPU collectives.

The experiment that trains models on data with them is the system :mod:`zeroth.marsit`, launched
by ``zeroth run experiments/marsit_<name>.yaml --out DIR``.
"""

from zeroth.collectives.ring import allreduce_mean, allreduce_sum
from zeroth.collectives.sync import (
    METHODS,
    RoundCtx,
    SyncTransform,
    build,
    ef_signsgd,
    majority_vote,
    marsit,
    psgd,
    signsgd,
    ssdm,
)
from zeroth.collectives.topology import Ring, Torus, make_topology

__all__ = [
    "Ring",
    "Torus",
    "make_topology",
    "allreduce_sum",
    "allreduce_mean",
    "RoundCtx",
    "SyncTransform",
    "METHODS",
    "build",
    "psgd",
    "signsgd",
    "majority_vote",
    "ef_signsgd",
    "ssdm",
    "marsit",
]
