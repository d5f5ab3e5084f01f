"""Binary learning (seed 002): bit-packed binary/ternary layers, bit-flip training, greedy layer-wise training, sparse top-k mutations.

Modules:

* :mod:`zeroth.binary.reference`: NumPy reference of the XOR-popcount ops (no jax).
* :mod:`zeroth.kernels.binary` (layer 2): the ``jnp`` version and the Pallas kernel.
* :mod:`zeroth.binary.layers`: a binary/ternary conv layer as a pytree, its packed forward, init.
* :mod:`zeroth.binary.flips`: exact loss deltas of every single-weight mutation, top-k flips.
* :mod:`zeroth.binary.train`: one layer's trainer (bit flips, evolutionary search, STE) and the
  greedy layer-wise driver with its cache.
* :mod:`zeroth.binary.server`: the sparse-mutation parameter server (pure state machine, gRPC).
"""

__all__: list[str] = []
