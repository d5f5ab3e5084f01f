"""zeroth: exact, low-bandwidth decentralized training in JAX.

The package root imports nothing: ``import zeroth`` is instant and ``zeroth.reference`` stays
importable without jax (it only sets gRPC's log level to ``ERROR`` where ``GRPC_VERBOSITY`` is
unset). Import the modules you need (``zeroth.rng``, ``zeroth.replay``, ``zeroth.train.runs``,
...); ``from zeroth import *`` imports every public module of :data:`__all__`, listed by layer,
lowest first (a module imports only from layers below its own):

1. the exact core: ``reference`` (NumPy, no jax), ``rng``, ``noise``, ``rule``, ``schedules``
   (host learning-rate schedules), ``layerwise`` (per-layer views an estimator can serve);
2. ``kernels`` (Pallas), ``replay`` (the exact update rule, checksums);
3. ``codecs``, ``compress``, ``zo``, ``collectives``;
4. ``models``, ``data``;
5. ``methods``, ``objectives``, ``schema`` (config fields and their decoder), ``config`` (the
   systems' own config sections sit here too: ``net.config``, ``pipeline.config``, ...);
6. ``train`` (the loop, metrics, checkpoints, run folders), ``stages``, ``transport``;
7. the systems: ``net`` (Just One Byte), ``pipeline`` (AQ-SGD), ``cluster`` (Ravnest),
   ``binary`` (binary learning), ``marsit`` (one-bit all-reduce experiments);
8. the programs: ``bench``, ``doctor``, ``run`` (``zeroth run``), ``launch`` (``zeroth launch``), ``cli``,
   ``protogen``.
"""

import os as _os

# gRPC's C core logs transport events at INFO on stderr unless told otherwise: when one peer,
# stage or node shuts down, the others would print "Got goaway ... Cancelling all calls" after
# their own last line. zeroth reports what matters itself; a GRPC_VERBOSITY the user set is kept.
# (An environment default only: it takes effect where grpc is imported after zeroth.)
_os.environ.setdefault("GRPC_VERBOSITY", "ERROR")
del _os

__version__ = "0.1.0"
__all__ = [
    "reference",
    "rng",
    "noise",
    "rule",
    "schedules",
    "layerwise",
    "kernels",
    "replay",
    "codecs",
    "compress",
    "zo",
    "collectives",
    "models",
    "data",
    "methods",
    "objectives",
    "schema",
    "config",
    "train",
    "stages",
    "transport",
    "net",
    "pipeline",
    "cluster",
    "binary",
    "marsit",
    "bench",
    "doctor",
    "run",
    "launch",
    "cli",
    "protogen",
]
