"""What every networked system shares: who may talk (the run secret, access tokens, TLS),
who a message comes from (Ed25519 identities), how fast a link carries it (pacing), and the
gRPC options that end a call to a peer that stopped answering (channels).

* :mod:`.identity`: the run secret, access tokens, per-process Ed25519 keys, join proofs, signed
  requests, replay guard, and :func:`~.identity.canonical` (the unambiguous byte encoding that
  is signed);
* :mod:`.security`: the access-token check, TLS credentials;
* :mod:`.guard`: every system's gRPC server: refusals that read nothing, calls capped per server
  and per caller, bounded waits on callers, message limits;
* :mod:`.pacing`: a link's emulated bandwidth and latency (token bucket), on the bytes sent;
* :mod:`.channels`: the gRPC options of every channel and server: message limits, one port per
  server, keepalive pings that end a call to a peer that stopped answering;
* :mod:`.processes`: stopping the processes of a loopback run, the tail of a failed one's log.

Used by the peers (:mod:`zeroth.net`), the pipeline stages (:mod:`zeroth.pipeline`), the
cluster nodes (:mod:`zeroth.cluster`) and the binary-learning server (:mod:`zeroth.binary`).
"""
