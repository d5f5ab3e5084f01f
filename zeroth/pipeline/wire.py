"""Frames between pipeline stages: :class:`zeroth.compress.Encoded` <-> ``TensorFrame``, and the checks.

:func:`check_frame` is a pure function of the frame and what the receiver expects
(:class:`Expected`); it raises :class:`FrameError` carrying the gRPC status a servicer aborts with:

* ``INVALID_ARGUMENT``: another run, link or kind; a dtype other than float32; a shape that is not
  ``(micro-batch size, *row shape)``; other bits than the link's codec; first-sight flags that are
  not one 0/1 byte per example; payload sizes that do not match the shape and bits; a quantizer
  (grid and scale axis) other than the link's; example ids other than the micro-batch's.
* ``FAILED_PRECONDITION``: a frame out of order (another step or micro-batch than the next one).

:func:`frame_nbytes` is the serialized size of a frame: the bytes counted per link.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np

from zeroth.compress import Encoded, quantizer_id, scales_per_example
from zeroth.pipeline.proto import pipeline_pb2 as pb

__all__ = ["KINDS", "Expected", "FrameError", "check_frame", "frame_nbytes", "from_frame", "to_frame"]

KINDS = {"activation": pb.ACTIVATION, "gradient": pb.GRADIENT}
INVALID = "INVALID_ARGUMENT"
PRECONDITION = "FAILED_PRECONDITION"


class FrameError(ValueError):
    """A frame the receiver refuses; ``code`` is the gRPC status name to answer with."""

    def __init__(self, code: str, message: str):
        super().__init__(message)
        self.code = code


class Expected(NamedTuple):
    """What the receiver of one link and direction expects next.

    Attributes:
      run_id: the run's id (both ends derive it from the config).
      link: the link index.
      kind: ``"activation"`` or ``"gradient"``.
      step, micro_batch: the position in the schedule.
      example_ids: ``int64[b]``: the micro-batch's examples, in order.
      row_shape: shape of one example's tensor, e.g. ``(T, d)``.
      bits: bits of the link's codec in this direction at this step (0 = float32: an fp32 link, or
        the uncompressed warm-up).
      axis: the codec's scale axis (``channel`` or ``row``), which sets the number of scales and the
        frame's ``quantizer`` (:func:`zeroth.compress.quantizer_id`).
    """

    run_id: str
    link: int
    kind: str
    step: int
    micro_batch: int
    example_ids: np.ndarray
    row_shape: tuple[int, ...]
    bits: int
    axis: str = "channel"


def to_frame(enc: Encoded, *, run_id: str, link: int, kind: str, step: int, micro_batch: int, ids) -> pb.TensorFrame:
    """The frame carrying ``enc`` for the examples ``ids``."""
    return pb.TensorFrame(
        run_id=run_id,
        link=int(link),
        kind=KINDS[kind],
        step=int(step),
        micro_batch=int(micro_batch),
        example_ids=[int(i) for i in np.asarray(ids).reshape(-1)],
        shape=[int(d) for d in enc.shape],
        dtype="float32",
        bits=int(enc.bits),
        fresh=np.asarray(enc.fresh, np.uint8).tobytes(),
        full=enc.full,
        packed=enc.packed,
        scales=enc.scales,
        quantizer=enc.quantizer,
    )


def from_frame(frame: pb.TensorFrame) -> tuple[Encoded, np.ndarray]:
    """``(Encoded, example ids int64[b])`` of a frame (check it first with :func:`check_frame`)."""
    fresh = np.frombuffer(frame.fresh, np.uint8).astype(bool)
    enc = Encoded(
        tuple(int(d) for d in frame.shape),
        int(frame.bits),
        fresh,
        bytes(frame.full),
        bytes(frame.packed),
        bytes(frame.scales),
        frame.quantizer,
    )
    return enc, np.asarray(list(frame.example_ids), np.int64)


def frame_nbytes(frame: pb.TensorFrame) -> int:
    """Serialized size of the frame in bytes (what crosses the link, gRPC framing aside)."""
    return frame.ByteSize()


def check_frame(frame: pb.TensorFrame, exp: Expected) -> None:
    """Raise :class:`FrameError` unless ``frame`` is the well-formed next frame ``exp`` describes."""
    if frame.run_id != exp.run_id:
        raise FrameError(INVALID, f"frame of run {frame.run_id!r}; this link belongs to run {exp.run_id!r}")
    if frame.link != exp.link:
        raise FrameError(INVALID, f"frame for link {frame.link}; this is link {exp.link}")
    if frame.kind != KINDS[exp.kind]:
        got = pb.FrameKind.Name(frame.kind) if frame.kind in pb.FrameKind.values() else str(frame.kind)
        raise FrameError(INVALID, f"frame of kind {got}; expected {pb.FrameKind.Name(KINDS[exp.kind])}")
    if (frame.step, frame.micro_batch) != (exp.step, exp.micro_batch):
        raise FrameError(
            PRECONDITION,
            f"out-of-order {exp.kind}: got step {frame.step} micro-batch {frame.micro_batch}, "
            f"expected step {exp.step} micro-batch {exp.micro_batch}",
        )
    if frame.dtype != "float32":
        raise FrameError(INVALID, f"dtype {frame.dtype!r}; pipeline tensors are 'float32'")
    ids = np.asarray(list(frame.example_ids), np.int64)
    n = int(np.asarray(exp.example_ids).size)
    shape = tuple(int(d) for d in frame.shape)
    want_shape = (n, *exp.row_shape)
    if shape != want_shape:
        raise FrameError(INVALID, f"shape {list(shape)}; expected {list(want_shape)} (micro-batch size, row shape)")
    if ids.size != n or not np.array_equal(ids, np.asarray(exp.example_ids, np.int64)):
        raise FrameError(
            INVALID,
            f"example ids {ids.tolist()} differ from the micro-batch's {np.asarray(exp.example_ids).tolist()} "
            f"(step {exp.step}, micro-batch {exp.micro_batch})",
        )
    if frame.bits != exp.bits:
        raise FrameError(INVALID, f"bits {frame.bits}; this link's codec uses {exp.bits} in this direction")
    want_q = quantizer_id(exp.axis) if exp.bits else ""
    if frame.quantizer != want_q:
        raise FrameError(
            INVALID,
            f"quantizer {frame.quantizer!r}; this link expects {want_q!r} (both stages must run "
            f"the same zeroth and scale axis)",
        )
    fresh = np.frombuffer(frame.fresh, np.uint8)
    if fresh.size != n or np.any(fresh > 1):
        raise FrameError(
            INVALID, f"fresh must hold one 0/1 byte per example ({n}), got {fresh.size} bytes {fresh[:8].tolist()}"
        )
    per = int(np.prod(exp.row_shape, dtype=np.int64)) if exp.row_shape else 1
    n_full = int(fresh.sum())
    n_q = n - n_full
    want = {
        "full": 4 * n_full * per,
        "packed": (n_q * per * frame.bits + 7) // 8 if frame.bits else 0,
        "scales": 4 * n_q * scales_per_example(tuple(exp.row_shape), exp.axis) if frame.bits else 0,
    }
    if frame.bits == 0 and n_q:
        raise FrameError(INVALID, f"{n_q} example(s) flagged as quantized in a float32 frame (bits 0)")
    for name, size in want.items():
        got = len(getattr(frame, name))
        if got != size:
            raise FrameError(
                INVALID,
                f"{name} holds {got} bytes; {n_full} full and {n_q} quantized example(s) of shape {list(exp.row_shape)} need {size}",
            )
