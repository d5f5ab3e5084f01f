"""Forged Ravnest messages for tests and the chaos table (``scripts/chaos_systems.py``): what a holder
of the run secret sends in other nodes' names, and each answer's status."""

from __future__ import annotations

from pathlib import Path

import grpc
import numpy as np

from zeroth.cluster import build, transport, wire
from zeroth.cluster.proto import cluster_pb2_grpc as pb_grpc
from zeroth.transport import identity

__all__ = ["forged_messages", "deliver"]


def forged_messages(cfg, plan, rounds, chunk_divisor: int = 1) -> list[tuple[str, object]]:
    """``(destination node, message)`` for every primary: an activation and a gradient of every batch
    in its neighbours' names, and a ring chunk of every ring, round of ``rounds`` and phase in the
    name of its peer in the other cluster (``ring size // chunk_divisor`` values)."""
    sizes = build.sizes_of(cfg, plan)
    forged = []
    for (c, s), name in plan.primaries.items():
        for b in range(cfg.train.steps):
            x = np.full(sizes.activation, 3.0, np.float32)
            if s > 0:
                prev = plan.primaries[(c, s - 1)]
                forged.append((name, wire.to_message(plan.run_id, prev, "activation", x, batch=b, to=(c, s))))
            if s + 1 < len(plan.stages[c]):
                nxt = plan.primaries[(c, s + 1)]
                forged.append((name, wire.to_message(plan.run_id, nxt, "gradient", x, batch=b, to=(c, s))))
        other = plan.primaries[(1 - c, s)]
        for ring in plan.rings:
            values = np.full((ring.stop - ring.start) // chunk_divisor, 9.0, np.float32)
            for rnd in rounds:
                for phase in ("reduce", "gather"):
                    msg = wire.to_message(
                        plan.run_id,
                        other,
                        "ring",
                        values,
                        ring=ring.ring_id,
                        round_id=rnd,
                        phase=phase,
                        step=0,
                        to=(c, s),
                    )
                    forged.append((name, msg))
    return forged


def deliver(forged, out: Path, metadata, resolve_timeout_s: float) -> list[str]:
    """Send each forged message to its node (every other one signed with a fresh key of the
    attacker's own, the rest unsigned); the status name of each answer (``"OK"``: accepted)."""
    mallory = identity.Identity.generate()
    codes = []
    for i, (dest, msg) in enumerate(forged):
        msg = wire.sign(msg, mallory) if i % 2 else msg
        address = transport.resolve_address(out / "addresses", dest, resolve_timeout_s)
        with grpc.insecure_channel(address) as ch:
            try:
                pb_grpc.ClusterNodeStub(ch).Deliver(iter([msg]), metadata=metadata, timeout=30)
                codes.append("OK")
            except grpc.RpcError as e:
                codes.append(e.code().name)
    return codes
