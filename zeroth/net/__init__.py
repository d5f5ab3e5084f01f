"""Just One Byte over gRPC: decentralized peers that exchange one byte per projected gradient.

Modules (import the one you need; this package imports nothing heavy):

* :mod:`zeroth.net.protocol` — the protocol as a pure state machine: membership, the barrier,
  leader takeover, joins and leaves, message validation. No sockets, no clocks.
* :mod:`zeroth.net.sim` — a deterministic in-memory network driving protocol state machines.
* :mod:`zeroth.net.wire` — protobuf <-> protocol values; wire-size accounting.
* :mod:`zeroth.net.service` — the thin gRPC servicers; :mod:`zeroth.net.security` — token, TLS.
* :mod:`zeroth.net.work` — what a peer computes: projected gradients, the exact replay, evaluation.
* :mod:`zeroth.net.state` — parameters as bytes for chunked state transfer.
* :mod:`zeroth.net.runtime` — a peer (:class:`~zeroth.net.runtime.Node`): threads, snapshots,
  the log, checksum exchange and repair, metrics.
* :mod:`zeroth.net.peer` — ``zeroth peer`` (one peer per process / machine).
* :mod:`zeroth.net.launch` — ``zeroth run CONFIG`` for configs with ``peers:`` (loopback processes).
* :mod:`zeroth.net.calibrate` — measures gRPC's framing bytes; :mod:`zeroth.net.proto_gen` —
  regenerates the checked-in stubs of ``protos/zeroth/v1/peer.proto``.
"""

__all__: list[str] = []
