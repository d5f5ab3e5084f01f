"""Ravnest messages (``protos/zeroth/v1/cluster.proto``): built from arrays, checked before they reach a buffer.

:func:`check_message` refuses, with :class:`MessageError` naming the field: another run's id, a
sender that is not in the run, an unspecified kind, a ring message without its phase, a shape
whose element count does not match the payload, and a payload larger than :data:`MAX_VALUES`.
"""

from __future__ import annotations

from collections.abc import Collection

import numpy as np

from zeroth.cluster.proto import cluster_pb2 as pb

__all__ = ["KINDS", "MAX_BLOB", "MAX_VALUES", "MessageError", "check_message", "from_message", "promote_message", "state_message",
           "to_message"]

KINDS = {"activation": pb.ACTIVATION, "gradient": pb.GRADIENT, "ring": pb.RING, "state": pb.STATE, "promote": pb.PROMOTE}
MAX_BLOB = 255 * 2**20  # under the gRPC message limit (256 MiB)
MAX_VALUES = 64 * 1024 * 1024  # float32 values in one message (256 MiB)
PHASES = ("reduce", "gather", "join")  # join: the pieces a late cluster starts from


class MessageError(ValueError):
    """A message the receiver refuses; ``str`` names the field and what was expected."""


def to_message(run_id: str, sender: str, kind: str, array: np.ndarray, *, batch: int = 0, ring: int = 0,
               round_id: int = 0, phase: str = "", step: int = 0) -> pb.Message:
    """One message carrying ``array`` (float32, little-endian)."""
    a = np.ascontiguousarray(array, dtype="<f4")
    return pb.Message(run_id=run_id, sender=sender, kind=KINDS[kind], batch=batch, ring=ring, round=round_id,
                      phase=phase, step=step, shape=list(a.shape), data=a.tobytes())


def check_message(msg: pb.Message, run_id: str, senders: Collection[str]) -> None:
    """Raise :class:`MessageError` unless ``msg`` is a well-formed message of run ``run_id`` from a known sender."""
    if msg.run_id != run_id:
        raise MessageError(f"run_id {msg.run_id!r} is not this run's {run_id!r}")
    if msg.sender not in senders:
        raise MessageError(f"sender {msg.sender!r} is not a node of this run (nodes: {sorted(senders)})")
    if msg.kind not in KINDS.values() or msg.kind == pb.KIND_UNSPECIFIED:
        raise MessageError(f"kind {msg.kind} is not one of {sorted(KINDS)}")
    if msg.kind == pb.RING and msg.phase not in PHASES:
        raise MessageError(f"phase {msg.phase!r} of a ring message is not one of {list(PHASES)}")
    if msg.kind == pb.STATE:
        if not 0 < len(msg.blob) <= MAX_BLOB or msg.data or msg.shape:
            raise MessageError(f"a state message carries a blob of 1 byte to {MAX_BLOB} bytes and no data; got "
                               f"{len(msg.blob)} bytes of blob, {len(msg.data)} of data")
        return
    if msg.blob:
        raise MessageError("blob is only for state messages")
    if msg.kind == pb.PROMOTE:
        if msg.data or msg.shape:
            raise MessageError("a promote message carries no data")
        return
    n = int(np.prod(msg.shape, dtype=np.int64)) if len(msg.shape) else 1
    if n > MAX_VALUES:
        raise MessageError(f"shape {list(msg.shape)} holds {n} values, more than the limit {MAX_VALUES}")
    if len(msg.data) != 4 * n:
        raise MessageError(f"data has {len(msg.data)} bytes, shape {list(msg.shape)} needs {4 * n} (float32)")


def promote_message(run_id: str, sender: str) -> pb.Message:
    """To a backup: its primary is gone, it takes over."""
    return pb.Message(run_id=run_id, sender=sender, kind=pb.PROMOTE)


def state_message(run_id: str, sender: str, blob: bytes) -> pb.Message:
    """A primary's state for its joining backup."""
    return pb.Message(run_id=run_id, sender=sender, kind=pb.STATE, blob=blob)


def from_message(msg: pb.Message) -> np.ndarray:
    """The float32 array of a checked message."""
    return np.frombuffer(msg.data, dtype="<f4").reshape(tuple(msg.shape)).astype(np.float32)
