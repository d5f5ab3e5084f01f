"""Ravnest messages (``protos/zeroth/v1/cluster.proto``): built from arrays, signed, checked before they reach a buffer.

:func:`check_message` refuses, with :class:`MessageError` naming the field: another run's id, a
sender that is not in the run, an unspecified kind, a ring message without its phase, a shape
whose element count does not match the payload, and a payload larger than the run allows
(:class:`Sizes`: an activation or gradient has exactly the model's ``(batch, seq_len, width)``
shape, a ring chunk at most one stage's slice, a handed state at most a bound of a stage's whole
state; without :class:`Sizes`, :data:`MAX_VALUES`).

Every message is signed by its sender (:func:`sign`, Ed25519, :class:`zeroth.transport.identity.Identity`)
over :func:`signed_bytes`: the run, the sender, the kind, every tag, the receiving slot and the
SHA-256 of the payload. :func:`check_signature` verifies it under the sender's key.
"""

from __future__ import annotations

import hashlib
from collections.abc import Collection
from typing import NamedTuple

import numpy as np

from zeroth.cluster.proto import cluster_pb2 as pb
from zeroth.transport import identity

__all__ = [
    "KINDS",
    "MAX_BLOB",
    "MAX_VALUES",
    "MessageError",
    "Sizes",
    "check_message",
    "check_signature",
    "from_message",
    "promote_message",
    "sign",
    "signed_bytes",
    "state_message",
    "to_message",
]

KINDS = {
    "activation": pb.ACTIVATION,
    "gradient": pb.GRADIENT,
    "ring": pb.RING,
    "state": pb.STATE,
    "promote": pb.PROMOTE,
}
MAX_BLOB = 255 * 2**20  # under the gRPC message limit (256 MiB)
MAX_VALUES = 64 * 1024 * 1024  # float32 values in one message (256 MiB)
PHASES = ("reduce", "gather", "join")  # join: the pieces a late cluster starts from


class MessageError(ValueError):
    """A message the receiver refuses; ``str`` names the field and what was expected."""


class Sizes(NamedTuple):
    """What one message of a run can hold (:func:`zeroth.cluster.build.sizes_of`).

    Attributes:
      activation: the exact shape of every activation and gradient (``(batch, seq_len, width)``).
      ring_values: the most float32 values of one ring chunk or join piece (the largest stage's slice).
      state_bytes: the most bytes of a primary's handed state.
    """

    activation: tuple[int, ...]
    ring_values: int
    state_bytes: int

    def message_bytes(self) -> int:
        """The largest serialized message of the run: its largest payload plus room for the fields."""
        payload = max(4 * int(np.prod(self.activation)), 4 * self.ring_values, self.state_bytes)
        return payload + 64 * 1024


def to_message(
    run_id: str,
    sender: str,
    kind: str,
    array: np.ndarray,
    *,
    batch: int = 0,
    ring: int = 0,
    round_id: int = 0,
    phase: str = "",
    step: int = 0,
    to: tuple[int, int] = (0, 0),
) -> pb.Message:
    """One message carrying ``array`` (float32, little-endian) to slot ``to`` (unsigned: :func:`sign`)."""
    a = np.ascontiguousarray(array, dtype="<f4")
    return pb.Message(
        run_id=run_id,
        sender=sender,
        kind=KINDS[kind],
        batch=batch,
        ring=ring,
        round=round_id,
        phase=phase,
        step=step,
        shape=list(a.shape),
        data=a.tobytes(),
        to_cluster=to[0],
        to_stage=to[1],
    )


def signed_bytes(msg: pb.Message) -> bytes:
    """What a sender signs: every field of ``msg`` but the signature, the payloads as their SHA-256."""
    return identity.canonical(
        "zeroth-ravnest-v1",
        msg.run_id,
        msg.sender,
        int(msg.kind),
        int(msg.batch),
        int(msg.ring),
        int(msg.round),
        msg.phase,
        int(msg.step),
        tuple(int(x) for x in msg.shape),
        int(msg.to_cluster),
        int(msg.to_stage),
        hashlib.sha256(msg.data).digest(),
        hashlib.sha256(msg.blob).digest(),
    )


def sign(msg: pb.Message, me: identity.Identity) -> pb.Message:
    """``msg`` with its signature by ``me`` (set in place, returned)."""
    msg.signature = me.sign(signed_bytes(msg))
    return msg


def check_signature(msg: pb.Message, key: bytes) -> None:
    """Raise :class:`MessageError` unless ``msg`` is signed with the private key of ``key``."""
    if not identity.verify(key, signed_bytes(msg), msg.signature):
        raise MessageError(
            f"signature of a message in the name of {msg.sender!r} does not verify under its key "
            "(only that node can send in its name)"
        )


def check_message(msg: pb.Message, run_id: str, senders: Collection[str], sizes: Sizes | None = None) -> None:
    """Raise :class:`MessageError` unless ``msg`` is a well-formed message of run ``run_id`` from a known
    sender, within ``sizes`` (None: :data:`MAX_VALUES`, :data:`MAX_BLOB`)."""
    if msg.run_id != run_id:
        raise MessageError(f"run_id {msg.run_id!r} is not this run's {run_id!r}")
    if msg.sender not in senders:
        raise MessageError(f"sender {msg.sender!r} is not a node of this run (nodes: {sorted(senders)})")
    if msg.kind not in KINDS.values() or msg.kind == pb.KIND_UNSPECIFIED:
        raise MessageError(f"kind {msg.kind} is not one of {sorted(KINDS)}")
    if msg.kind == pb.RING and msg.phase not in PHASES:
        raise MessageError(f"phase {msg.phase!r} of a ring message is not one of {list(PHASES)}")
    if msg.kind == pb.STATE:
        most = MAX_BLOB if sizes is None else min(MAX_BLOB, sizes.state_bytes)
        if not 0 < len(msg.blob) <= most or msg.data or msg.shape:
            raise MessageError(
                f"a state message carries a blob of 1 byte to {most} bytes and no data; got "
                f"{len(msg.blob)} bytes of blob, {len(msg.data)} of data"
            )
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
    if sizes is not None and msg.kind in (pb.ACTIVATION, pb.GRADIENT) and tuple(msg.shape) != tuple(sizes.activation):
        raise MessageError(
            f"shape {list(msg.shape)} of an activation or gradient is not the model's {list(sizes.activation)}"
        )
    if sizes is not None and msg.kind == pb.RING and n > sizes.ring_values:
        raise MessageError(
            f"shape {list(msg.shape)} of a ring chunk holds {n} values, more than a stage's slice ({sizes.ring_values})"
        )
    if len(msg.data) != 4 * n:
        raise MessageError(f"data has {len(msg.data)} bytes, shape {list(msg.shape)} needs {4 * n} (float32)")


def promote_message(run_id: str, sender: str, slot: tuple[int, int]) -> pb.Message:
    """To the backup of ``slot``: its primary is gone, it takes over."""
    return pb.Message(run_id=run_id, sender=sender, kind=pb.PROMOTE, to_cluster=slot[0], to_stage=slot[1])


def state_message(run_id: str, sender: str, blob: bytes, slot: tuple[int, int]) -> pb.Message:
    """A primary's state for its joining backup (of ``slot``)."""
    return pb.Message(run_id=run_id, sender=sender, kind=pb.STATE, blob=blob, to_cluster=slot[0], to_stage=slot[1])


def from_message(msg: pb.Message) -> np.ndarray:
    """The float32 array of a checked message."""
    return np.frombuffer(msg.data, dtype="<f4").reshape(tuple(msg.shape)).astype(np.float32)
