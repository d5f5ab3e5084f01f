"""Binary learning (seed 002): bit-packed binary/ternary layers, bit-flip training, greedy layer-wise training, sparse top-k mutations.

Modules:

* :mod:`zeroth.binary.reference`: NumPy reference of the XOR-popcount ops (no jax);
  :mod:`zeroth.kernels.binary` (layer 2) holds the ``jnp`` version and the Pallas kernel.
* :mod:`zeroth.binary.layers`: a binary/ternary 3x3 conv layer as a pytree, its packed forward,
  thermometer input bits, max-pool on bits, the linear auxiliary head.
* :mod:`zeroth.binary.flips`: the exact loss change of every single-weight mutation, top-k selection.
* :mod:`zeroth.binary.train`: one layer's trainer (bit flips, evolutionary search, STE).
* :mod:`zeroth.binary.layerwise`: greedy layer-wise training with a layer cache keyed by config and inputs.
* :mod:`zeroth.binary.protocol`, :mod:`~zeroth.binary.service`, :mod:`~zeroth.binary.worker`,
  :mod:`~zeroth.binary.launch`: the sparse-mutation parameter server (pure state machine, gRPC
  servicer over ``protos/zeroth/v1/binary.proto``, stubs in ``zeroth/binary/proto``), worker
  processes and a loopback launcher.
* :mod:`zeroth.binary.config`: the ``binary:`` section of a config; it sits at the config's layer,
  below this package: it imports only :mod:`zeroth.schema`.
* :mod:`zeroth.binary.speed`: binary vs float32 speed rows; :mod:`zeroth.binary.experiment`: what
  ``zeroth run`` does with a ``binary:`` config section.
"""

__all__: list[str] = []
