"""A peer's update log on disk: every decided iteration it applied, as it applied it.

A Just One Byte peer appends each record to ``OUT/updates.log`` and flushes it at once, so anyone
holding a run's folder can replay it on their own hardware and check every digest the peers
recorded (:mod:`zeroth.net.verify`). The record format and what counts as damage are described
in the docs (``docs/guides/proving_a_run.md``, "The update log's format").
"""

from __future__ import annotations

import json
import os
import struct
import threading
import zlib
from pathlib import Path
from typing import NamedTuple

from zeroth.net import protocol as P
from zeroth.net import wire
from zeroth.net.proto import peer_pb2 as pb

__all__ = [
    "FILENAME",
    "Log",
    "Writer",
    "Applied",
    "read",
]

MAGIC = b"zeroth-updates-v1\n"
START = 0x01
ENTRY = 0x02
DECISION = 0x03
SAME_MEMBERS = 0x01  # DECISION flag: the commit's next view has the previous DECISION's members
FILENAME = "updates.log"
_HEADER = struct.Struct("<III")  # length, CRC-32 of the body, CRC-32 of the first 8 bytes
_DIGEST_BYTES = 32
# A record is one decided iteration; the wire refuses messages above 64 MiB, so no valid record is larger.
_MAX_RECORD = 64 << 20
_START_FIELDS = ("run_id", "iteration", "digest", "reason", "config")


class Applied(NamedTuple):
    """One decided iteration as a peer applied it: the entry and the digest (hex) of the state after it."""

    entry: P.LogEntry
    digest: str

    @property
    def iteration(self) -> int:
        return self.entry.commit.iteration


class Segment(NamedTuple):
    """What one process appended: its START record (a dict) and the iterations it applied, in order."""

    start: dict
    applied: tuple[Applied, ...]


class Log(NamedTuple):
    """A log file read back: its segments, and ``truncated``, the bytes of a last record cut short (0 if none)."""

    path: Path
    segments: tuple[Segment, ...]
    truncated: int


class Writer:
    """Appends records to ``path`` (created with :data:`MAGIC` if new), each flushed at once.

    Thread-safe; :meth:`close` (or the context manager) closes the file. A file that exists but
    does not start with :data:`MAGIC` is refused (it is not an update log; nothing is written).

    Example:
      >>> import tempfile, pathlib
      >>> path = pathlib.Path(tempfile.mkdtemp()) / "updates.log"
      >>> with Writer(path) as w:
      ...     w.start(run_id="r", iteration=0, digest="00" * 32, reason="initial", config={})
      >>> [s.start["reason"] for s in read(path).segments]
      ['initial']
    """

    def __init__(self, path: str | os.PathLike):
        self.path = Path(path)
        self._lock = threading.Lock()
        self._members: tuple | None = None  # the next view's members of this segment's last DECISION
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._f = open(self.path, "ab")
        try:
            if self._f.tell() == 0:
                self._f.write(MAGIC)
                self._f.flush()
            else:
                with open(self.path, "rb") as r:
                    head = r.read(len(MAGIC))
                if head != MAGIC:
                    raise ValueError(
                        f"{self.path} exists and is not a zeroth update log (it starts {head[:24]!r}); "
                        f"move it away or choose another output folder"
                    )
        except BaseException:
            self._f.close()
            raise

    def start(
        self,
        *,
        run_id: str,
        iteration: int,
        digest: str,
        reason: str,
        config: dict,
        key: bytes = b"",
        proof: bytes = b"",
    ) -> None:
        """A START record: this process holds the state at the start of ``iteration`` (digest hex)
        and signs with ``key`` (``proof``: :func:`zeroth.transport.identity.log_proof` of it)."""
        body = json.dumps(
            {
                "run_id": run_id,
                "iteration": int(iteration),
                "digest": digest,
                "reason": reason,
                "config": config,
                "key": bytes(key).hex(),
                "proof": bytes(proof).hex(),
            },
            sort_keys=True,
        ).encode()
        with self._lock:
            self._write(bytes([START]) + body, None)

    def applied(self, entry: P.LogEntry, digest: str) -> None:
        """A DECISION record: ``entry`` was applied and the state after it has ``digest`` (hex)."""
        if entry.payloads is None:
            raise ValueError(
                f"the entry of iteration {entry.commit.iteration} has no payloads; only applied entries are logged"
            )
        raw = bytes.fromhex(digest)
        if len(raw) != _DIGEST_BYTES:
            raise ValueError(f"digest must be {_DIGEST_BYTES} bytes of hex, got {digest!r}")
        msg = wire.entry_to_pb(entry)
        for g in msg.gradients:  # the commit's contributor, run id and iteration: restored on reading
            for name in ("run_id", "sender", "iteration", "count"):
                g.ClearField(name)
        members = entry.commit.next_view.members
        with self._lock:  # the previous DECISION is read and replaced under the lock that orders records
            flags = 0
            if members == self._members:
                flags = SAME_MEMBERS
                del msg.commit.next_view.members[:]
            self._write(bytes([DECISION]) + raw + bytes([flags]) + msg.SerializeToString(), members)

    def _write(self, body: bytes, members: tuple | None) -> None:
        """Append one record (the lock held) and remember its next view's members (None: a START)."""
        if self._f.closed:
            raise ValueError(f"{self.path}: the update log is closed")
        self._f.write(_header(body) + body)
        self._f.flush()
        self._members = members

    def close(self) -> None:
        with self._lock:
            self._f.close()

    def __enter__(self) -> Writer:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _header(body: bytes) -> bytes:
    head = struct.pack("<II", len(body), zlib.crc32(body))
    return head + struct.pack("<I", zlib.crc32(head))


def _start(body: bytes, where: str) -> dict:
    try:
        start = json.loads(body.decode())
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ValueError(f"{where}: a START record that is not JSON ({e})") from None
    missing = [k for k in _START_FIELDS if not isinstance(start, dict) or k not in start]
    if missing:
        raise ValueError(f"{where}: a START record without {', '.join(missing)}")
    return start


def _entry(body: bytes, where: str, kind: int, members: list | None) -> tuple[Applied, list]:
    """An ENTRY or DECISION record's body (``members``: the ``pb.Member`` list of the segment's
    previous entry, for :data:`SAME_MEMBERS`): the entry as the wire carried it, and its own list."""
    name = "an ENTRY" if kind == ENTRY else "a DECISION"
    head = _DIGEST_BYTES + (kind == DECISION)
    if len(body) < head:
        raise ValueError(f"{where}: {name} record of {len(body)} bytes, shorter than its digest")
    flags = body[_DIGEST_BYTES] if kind == DECISION else 0
    if flags & ~SAME_MEMBERS:
        raise ValueError(f"{where}: a DECISION record with unknown flags {flags:#04x}")
    msg = pb.LogEntry()
    try:
        msg.ParseFromString(body[head:])
        if flags & SAME_MEMBERS:
            if members is None:
                raise ValueError("it repeats the members of a DECISION before it, and its segment holds none")
            msg.commit.next_view.members.extend(members)
        if kind == DECISION:
            c = msg.commit
            for g, who in zip(msg.gradients, c.contributors):  # a count mismatch is entry_from_pb's to name
                g.run_id, g.sender, g.iteration, g.count = c.run_id, who.machine, c.iteration, who.count
        entry = wire.entry_from_pb(msg)
    except Exception as e:  # noqa: BLE001  (protobuf's DecodeError, Rejected: one message either way)
        raise ValueError(f"{where}: {name} record that does not decode ({type(e).__name__}: {e})") from None
    if entry.payloads is None:
        raise ValueError(f"{where}: the entry of iteration {entry.commit.iteration} carries no payloads")
    return Applied(entry, body[:_DIGEST_BYTES].hex()), list(msg.commit.next_view.members)


def read(path: str | os.PathLike) -> Log:
    """Read an update log back (the format: ``docs/guides/proving_a_run.md``).

    Raises:
      ValueError: not an update log, a damaged record before the end, or an ENTRY before any START
        (each message names the file, the record's number and its byte offset).
    """
    path = Path(path)
    data = path.read_bytes()
    if not data.startswith(MAGIC):
        raise ValueError(f"{path} is not a zeroth update log: it starts {data[:24]!r}, expected {MAGIC!r}")
    segments: list[tuple[dict, list[Applied]]] = []
    members = None  # the next view's members (pb) of the current segment's last entry
    offset, n = len(MAGIC), 0
    truncated = 0
    # the end of the file's last nonzero byte: a record being written when the machine crashed
    # is a prefix of it followed by nothing or by zeros (space the file system left unwritten)
    written = len(data.rstrip(b"\0"))
    while offset < len(data):
        n += 1
        where = f"{path}: record {n} at byte {offset}"
        if offset + _HEADER.size > len(data):  # a header cut short: a crash while it was written
            truncated = len(data) - offset
            break
        length, crc, head_crc = _HEADER.unpack_from(data, offset)
        if zlib.crc32(data[offset : offset + 8]) != head_crc:
            if written < offset + _HEADER.size:  # a header cut short, or nothing, then zeros: a crash
                truncated = len(data) - offset
                break
            raise ValueError(f"{where}: its header's CRC-32 does not match; the file is damaged")
        end = offset + _HEADER.size + length
        if length == 0 or length > _MAX_RECORD:
            raise ValueError(
                f"{where}: a record length of {length} bytes (1 to {_MAX_RECORD} expected); the file is damaged"
            )
        if end > len(data):
            truncated = len(data) - offset
            break
        body = data[offset + _HEADER.size : end]
        if zlib.crc32(body) != crc:
            if end >= written:  # the last record, its bytes not all on disk: a crash while it was written
                truncated = len(data) - offset
                break
            raise ValueError(f"{where}: its CRC-32 does not match its {length} bytes; the file is damaged")
        kind = body[0]
        if kind == START:
            segments.append((_start(body[1:], where), []))
            members = None
        elif kind in (ENTRY, DECISION):
            if not segments:
                raise ValueError(f"{where}: an entry before any START record")
            applied, members = _entry(body[1:], where, kind, members)
            segments[-1][1].append(applied)
        else:
            raise ValueError(f"{where}: unknown record kind {kind} (expected {START}, {ENTRY} or {DECISION})")
        offset = end
    return Log(path, tuple(Segment(s, tuple(a)) for s, a in segments), truncated)
