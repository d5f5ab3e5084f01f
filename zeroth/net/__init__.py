"""Just One Byte over gRPC: decentralized peers that exchange one byte per projected gradient.

Modules (import the one you need; this package imports nothing heavy):

* :mod:`zeroth.net.protocol` — the protocol as a pure state machine: membership, the barrier,
  leader takeover, joins and leaves, message validation. No sockets, no clocks.
* :mod:`zeroth.net.sim` — a deterministic in-memory network driving protocol state machines.
* :mod:`zeroth.net.wire` — protobuf <-> protocol values; wire-size accounting.
* :mod:`zeroth.net.service` — the thin gRPC servicers; token and TLS come from :mod:`zeroth.transport.security`.
* :mod:`zeroth.transport.identity` — the run secret, per-peer Ed25519 keys, join proofs, replay guard.
* :mod:`zeroth.net.work` — what a peer computes: projected gradients (clipped), the exact replay, evaluation.
* :mod:`zeroth.net.state` — parameters as bytes for chunked state transfer.
* :mod:`zeroth.net.transport` — channels, calls, gRPC options and size limits, signed requests, byte counts.
* :mod:`zeroth.net.transfer` — snapshots, the decided log, a joiner's download and replay.
* :mod:`zeroth.net.repair` — checksum exchange with a rotating partner, repair after a mismatch.
* :mod:`zeroth.net.runtime` — a peer (:class:`~zeroth.net.runtime.Node`): the thin driver of the
  protocol over the pieces above, metrics, endings.
* :mod:`zeroth.net.chaos` — a hostile member and peer processes to kill, pause and restart (tests, chaos table).
* :mod:`zeroth.net.peer` — ``zeroth peer`` (one peer per process / machine).
* :mod:`zeroth.net.config` — the ``peers:`` section of a config (:class:`~zeroth.net.config.PeersConfig`);
  it sits at the config's layer, below this package: it imports only :mod:`zeroth.schema`.
* :mod:`zeroth.net.launch` — ``zeroth run CONFIG`` for configs with ``peers:`` (loopback processes).
* :mod:`zeroth.net.calibrate` — measures gRPC's framing bytes; :mod:`zeroth.protogen` (``python -m
  zeroth.protogen net``) regenerates the checked-in stubs of ``protos/zeroth/v1/peer.proto``.
"""

__all__: list[str] = []
