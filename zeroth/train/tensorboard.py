"""TensorBoard event files, written offline without TensorFlow: ``tensorboard --logdir OUT`` opens them.

An event file (``events.out.tfevents.<unix time>.<host>.<pid>.<n>``, its time later than every
earlier file's of its folder, so that TensorBoard reads the files in the order they were made) is a sequence of records
(TFRecord framing), each::

    uint64 length | uint32 masked_crc32c(length) | data[length] | uint32 masked_crc32c(data)

little endian, where ``masked_crc32c(x) = ((c >> 15) | (c << 17)) + 0xa282ead8 (mod 2**32)`` and
``c`` is the CRC-32C (Castagnoli) of ``x``. Each ``data`` is a serialized ``tensorflow.Event``
protocol buffer, encoded here by hand (the wire format of the few fields used)::

    Event   { double wall_time = 1; int64 step = 2; string file_version = 3;
              Summary summary = 5; SessionLog session_log = 7; }
    Summary { repeated Value value = 1; }   Value { string tag = 1; float simple_value = 2; }
    SessionLog { Status status = 1; }       (START = 1)

The first record is ``file_version: "brain.Event:2"``. :class:`EventWriter` writes one event per
metrics row (:func:`row_scalars`): every number of the row is a scalar tagged ``<kind>/<name>``
(``train/loss``, ``train/step_time_s``, ``train/train_time_s``; ``eval/accuracy`` for
``eval_accuracy``: an eval row's ``eval_`` prefix is dropped), at the row's ``step`` and ``time_unix_s``. :meth:`EventWriter.restart` marks a
resumed run: TensorBoard drops the points at or after that step from the earlier files (the
rows the resumed run writes again).

Example:
  >>> f"{crc32c(b'123456789'):08x}"
  'e3069283'
  >>> row_scalars({"kind": "eval", "step": 4, "eval_accuracy": 0.5, "digest": "ab", "ok": True})
  {'eval/accuracy': 0.5}
"""

from __future__ import annotations

import itertools
import math
import os
import socket
import struct
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

__all__ = [
    "EventWriter",
    "event_files",
    "crc32c",
    "masked_crc32c",
    "encode_event",
    "record",
    "row_scalars",
    "FILE_VERSION",
]

FILE_VERSION = "brain.Event:2"
_POLY = 0x82F63B78  # CRC-32C, reflected
_MASK_DELTA = 0xA282EAD8
_M32 = 0xFFFFFFFF


def _table() -> tuple[int, ...]:
    out = []
    for i in range(256):
        c = i
        for _ in range(8):
            c = (c >> 1) ^ _POLY if c & 1 else c >> 1
        out.append(c)
    return tuple(out)


_TABLE = _table()


def crc32c(data: bytes) -> int:
    """CRC-32C (Castagnoli, the CRC of iSCSI and TFRecord) of ``data``, table-driven, one byte at a time."""
    c = _M32
    t = _TABLE
    for b in data:
        c = t[(c ^ b) & 0xFF] ^ (c >> 8)
    return c ^ _M32


def masked_crc32c(data: bytes) -> int:
    """TFRecord's masked CRC: the CRC rotated right by 15 bits plus ``0xa282ead8`` (mod 2**32)."""
    c = crc32c(data)
    return ((((c >> 15) | (c << 17)) & _M32) + _MASK_DELTA) & _M32


def record(data: bytes) -> bytes:
    """One TFRecord: length, masked CRC of the length, the data, masked CRC of the data."""
    length = struct.pack("<Q", len(data))
    return length + struct.pack("<I", masked_crc32c(length)) + data + struct.pack("<I", masked_crc32c(data))


def _varint(n: int) -> bytes:
    n &= (1 << 64) - 1  # int64 as protobuf sends it: two's complement in 64 bits
    out = bytearray()
    while True:
        b = n & 0x7F
        n >>= 7
        if n:
            out.append(b | 0x80)
        else:
            out.append(b)
            return bytes(out)


def _len_field(field: int, payload: bytes) -> bytes:
    return _varint(field << 3 | 2) + _varint(len(payload)) + payload


def encode_event(
    wall_time: float,
    step: int,
    *,
    scalars: Mapping[str, float] | None = None,
    file_version: str | None = None,
    session_start: bool = False,
) -> bytes:
    """A serialized ``Event``: wall time and step, and one of a file version, a summary of
    ``{tag: simple_value}`` scalars (float32), or a session log ``START``."""
    out = _varint(1 << 3 | 1) + struct.pack("<d", float(wall_time)) + _varint(2 << 3 | 0) + _varint(int(step))
    if file_version is not None:
        out += _len_field(3, file_version.encode())
    if scalars:
        values = b"".join(
            _len_field(1, _len_field(1, tag.encode()) + _varint(2 << 3 | 5) + struct.pack("<f", float(v)))
            for tag, v in scalars.items()
        )
        out += _len_field(5, values)
    if session_start:
        out += _len_field(7, _varint(1 << 3 | 0) + _varint(1))
    return out


def row_scalars(row: Mapping[str, Any]) -> dict[str, float]:
    """The scalars of a metrics row: ``{"<kind>/<name>": value}`` for every int or float field but
    ``step`` and ``time_unix_s`` (strings, booleans, nulls, lists and objects are left out; in an
    ``eval`` row a name that starts with ``eval_`` loses that prefix)."""
    kind = str(row.get("kind", "metrics"))
    out = {}
    for k, v in row.items():
        if k in ("kind", "step", "time_unix_s") or isinstance(v, bool) or not isinstance(v, (int, float)):
            continue
        name = k[5:] if kind == "eval" and k.startswith("eval_") else k
        out[f"{kind}/{name}"] = float(v)
    return out


_serial = itertools.count()


def event_files(folder: str | os.PathLike) -> list[Path]:
    """The TensorBoard event files in ``folder`` (``events.out.tfevents.*``)."""
    return list(Path(folder).glob("events.out.tfevents.*"))


def _stamps(folder: Path) -> list[int]:
    """The unix seconds in the names of the event files in ``folder``."""
    out = []
    for f in event_files(folder):
        field = f.name.split(".")[3]
        if field.isdigit():
            out.append(int(field))
    return out


class EventWriter:
    """Appends events to a new event file in ``folder`` (created if missing); each write is flushed.

    Args:
      folder: where the file goes (next to the ``metrics.jsonl`` it mirrors).
    """

    def __init__(self, folder: str | os.PathLike):
        folder = Path(folder)
        folder.mkdir(parents=True, exist_ok=True)
        now = time.time()
        # TensorBoard reads a folder's files in the order of their names: the new file's second
        # is later than every earlier file's, so that it sorts after them (a resumed run's restart
        # must be read after the points it drops) even when they were made within the same second
        stamp = max([int(now), *(s + 1 for s in _stamps(folder))])
        self.path = folder / f"events.out.tfevents.{stamp:010d}.{socket.gethostname()}.{os.getpid()}.{next(_serial)}"
        self._fh = self.path.open("ab")
        self._write(encode_event(now, 0, file_version=FILE_VERSION))

    def _write(self, event: bytes) -> None:
        self._fh.write(record(event))
        self._fh.flush()

    def write_row(self, row: Mapping[str, Any]) -> None:
        """One event holding the row's scalars (:func:`row_scalars`) at its step and time; nothing if it has none."""
        scalars = row_scalars(row)
        if not scalars:
            return
        wall = row.get("time_unix_s")
        wall = wall if isinstance(wall, (int, float)) and math.isfinite(wall) else time.time()
        step = row.get("step")
        self._write(
            encode_event(wall, step if isinstance(step, int) and not isinstance(step, bool) else 0, scalars=scalars)
        )

    def restart(self, step: int) -> None:
        """Mark a run resumed after ``step - 1``: TensorBoard discards earlier files' points at ``step`` and after."""
        self._write(encode_event(time.time(), step, session_start=True))

    def close(self) -> None:
        """Close the file."""
        if not self._fh.closed:
            self._fh.close()
