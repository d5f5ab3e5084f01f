"""State transfer between peers: what a peer keeps for the others (snapshots, the decided log,
digests) and how a joiner (or a repairing peer) downloads a snapshot and replays the log after it.

* :class:`StateStore` — shared between the driver and the server threads (its own lock): the last
  two snapshots (every ``snapshot_every`` iterations), the applied log since the oldest one, the
  state digest of every recent iteration, and checksums that arrived before their iteration.
* :func:`download` — the snapshot's bytes in ranges from several peers at once (a failed range is
  fetched from the sponsor), each range a ``FetchState`` stream of chunks.
* :class:`StateTransfer` — a peer's side of it: :meth:`~StateTransfer.catch_up` (manifest,
  download, digest check, load, log replay) and the serving handlers (manifest, chunks, log).

Every request it sends is signed by the peer's identity (:mod:`zeroth.net.transport`).
"""

from __future__ import annotations

import collections
import threading
import time
from concurrent import futures
from typing import Any

import grpc
import jax
import jax.numpy as jnp

from zeroth import replay as _replay
from zeroth.net import protocol as P
from zeroth.net import state as _state
from zeroth.net import wire
from zeroth.net.proto import peer_pb2 as pb
from zeroth.net.transport import MAX_MESSAGE_BYTES

__all__ = ["MAX_LOG_ENTRIES", "StateStore", "StateTransfer", "download"]

MAX_LOG_ENTRIES = 256  # per FetchLog reply


class StateStore:
    """Snapshots, the applied log and digests of one peer (thread-safe)."""

    def __init__(self):
        self.lock = threading.Lock()
        self.log: dict[int, P.LogEntry] = {}
        self.snapshots: collections.OrderedDict[int, _state.Snapshot] = collections.OrderedDict()
        self.digests: dict[int, str] = {}
        self.pending_checks: dict[int, list[tuple[int, str, str]]] = collections.defaultdict(list)

    def clear(self) -> None:
        """Forget everything (a rejoining peer serves nothing of its earlier incarnation)."""
        with self.lock:
            self.snapshots.clear()
            self.log.clear()
            self.digests.clear()
            self.pending_checks.clear()

    def digest(self, iteration: int) -> str | None:
        with self.lock:
            return self.digests.get(iteration)

    def put_snapshot(self, iteration: int, view: P.View | None, digest: str, params: Any) -> None:
        """Keep the state at the start of ``iteration`` (the last two), trim the log and digests."""
        blob, leaves = _state.flatten(params)
        with self.lock:
            self.snapshots[iteration] = _state.Snapshot(iteration, view, digest, blob, leaves)
            while len(self.snapshots) > 2:
                self.snapshots.popitem(last=False)
            oldest = next(iter(self.snapshots))
            for t in [t for t in self.log if t < oldest]:
                del self.log[t]
            for t in [t for t in self.digests if t < iteration - 512]:
                del self.digests[t]

    def latest_snapshot(self) -> _state.Snapshot | None:
        with self.lock:
            return next(reversed(self.snapshots.values())) if self.snapshots else None

    def entries(self, first: int, last: int, applied: int, window: dict[int, P.LogEntry]) -> list[P.LogEntry]:
        """Log entries ``first..last`` (consecutive, size-limited) from the log and ``window``.

        Raises:
          Rejected: ``NOT_FOUND`` when ``first`` is older than what this peer still holds.
        """
        with self.lock:
            if first < applied and first not in self.log and first not in window:
                start = min(self.log) if self.log else applied
                raise P.Rejected("NOT_FOUND", f"this peer's log starts at iteration {start}; iteration {first} is gone")
            out, size = [], 0
            for t in range(first, min(last, first + MAX_LOG_ENTRIES - 1) + 1):
                e = self.log.get(t) or window.get(t)
                if e is None:
                    break
                size += sum(len(p) + 64 for p in e.payloads) + 200 * (
                    len(e.commit.contributors) + len(e.commit.next_view.members)
                )
                if out and size > MAX_MESSAGE_BYTES // 2:
                    break
                out.append(e)
        return out

    def chunks(self, iteration: int, offset: int, length: int, chunk: int) -> list[tuple[int, bytes]]:
        """``(offset, bytes)`` chunks of the snapshot of ``iteration``."""
        with self.lock:
            snap = self.snapshots.get(iteration)
            held = list(self.snapshots)
        if snap is None:
            raise P.Rejected("NOT_FOUND", f"no snapshot of iteration {iteration} here (held: {held})")
        total = len(snap.blob)
        if offset > total or length > total - offset:
            raise P.Rejected("OUT_OF_RANGE", f"range {offset}+{length} is outside the snapshot's {total} bytes")
        return [(s, snap.blob[s : min(s + chunk, offset + length)]) for s in range(offset, offset + length, chunk)]


def download(fetch_range, sponsor: str, sources: list[str], total: int, chunk: int, say) -> tuple[bytes, int]:
    """The snapshot's ``total`` bytes: one range per source, in parallel; a failed range is fetched
    from the sponsor. ``fetch_range(source, offset, length) -> iterator of (offset, data)``.
    Returns ``(blob, sources used)``."""
    n_ranges = max(1, min(len(sources), -(-total // chunk)))
    per = -(-total // n_ranges)
    ranges = [(i * per, min(per, total - i * per)) for i in range(n_ranges) if i * per < total]
    buf = bytearray(total)

    def fetch(src: str, offset: int, length: int) -> None:
        got = 0
        for at, data in fetch_range(src, offset, length):
            if at != offset + got or got + len(data) > length:
                raise RuntimeError(f"state chunk from {src} at offset {at} does not continue {offset + got}")
            buf[at : at + len(data)] = data
            got += len(data)
        if got != length:
            raise RuntimeError(f"state range {offset}+{length} from {src} ended after {got} bytes")

    def fetch_with_fallback(i: int, offset: int, length: int) -> None:
        src = sources[i % len(sources)]
        try:
            fetch(src, offset, length)
        except (grpc.RpcError, RuntimeError) as e:
            if src == sponsor:
                raise
            say(f"state range {offset}+{length} from {src} failed ({e}); using {sponsor}")
            fetch(sponsor, offset, length)

    with futures.ThreadPoolExecutor(max_workers=len(ranges)) as ex:
        list(ex.map(lambda a: fetch_with_fallback(*a), [(i, o, n) for i, (o, n) in enumerate(ranges)]))
    return bytes(buf), len(ranges)


class StateTransfer:
    """A peer's state transfer (see the module docstring); ``node`` is its :class:`zeroth.net.runtime.Node`."""

    def __init__(self, node):
        self.node = node
        self.store = StateStore()
        self.sources_used = 0

    # -- local state

    def load(self, params, iteration: int, view: P.View | None, reason: str) -> None:
        """Install parameters that are the state at the start of ``iteration`` (and snapshot them);
        ``reason`` (``"initial"``, ``"resumed"``, ``"downloaded"``) goes into the update log's START record."""
        node = self.node
        node.params = jax.tree_util.tree_map(lambda x: jnp.array(x, copy=True), params)
        node.applied = iteration
        digest = _replay.checksum(node.params)
        with self.store.lock:
            self.store.digests[iteration] = digest
        self.store.put_snapshot(iteration, view, digest, node.params)
        node.log_start(iteration, digest, reason)

    def snapshot(self, iteration: int, view: P.View | None, digest: str) -> None:
        self.store.put_snapshot(iteration, view, digest, self.node.params)

    # -- a joiner's side

    def _signed(self, method: str, request):
        return self.node.transport.signed(self.node.identity, method, request)

    def fetch_log(self, address: str, first: int, last: int) -> list[P.LogEntry]:
        """Decided iterations ``first..last`` from ``address`` (paged); raises ``grpc.RpcError`` or ``Rejected``."""
        node = self.node
        out: list[P.LogEntry] = []
        t = first
        while t <= last:
            req = pb.FetchLogRequest(run_id=node.run_id, sender=node.me, first_iteration=t, last_iteration=last)
            reply = node.transport.rpc(
                address, "FetchLog", self._signed("FetchLog", req), 2 * node.cfg.peers.barrier_timeout_s + 5
            )
            got = [wire.entry_from_pb(e) for e in reply.entries]
            if not got:
                break
            for e in got:
                if e.commit.iteration != t:
                    raise P.Rejected(
                        "INVALID_ARGUMENT", f"log reply skipped from iteration {t} to {e.commit.iteration}"
                    )
                out.append(e)
                t += 1
        return out

    def catch_up(self, sponsor: str, view: P.View, *, target: int | None = None) -> tuple[int, P.View]:
        """Download the sponsor's newest snapshot (in chunks, from several peers) and replay the log
        up to ``view.iteration`` (or ``target``); returns the iteration and view reached.

        Raises ``grpc.RpcError`` (the sponsor failed), ``Rejected`` (a bad log) or ``RuntimeError``.
        """
        node = self.node
        manifest = node.transport.rpc(
            sponsor,
            "GetManifest",
            self._signed("GetManifest", pb.ManifestRequest(run_id=node.run_id, sender=node.me)),
            30,
        )
        leaves = tuple(_state.Leaf(lf.path, lf.dtype, tuple(lf.shape), lf.offset, lf.nbytes) for lf in manifest.leaves)
        sources = [sponsor] + [s for s in manifest.sources if s != sponsor and s != node.address]

        def fetch_range(src: str, offset: int, length: int):
            req = pb.StateRequest(
                run_id=node.run_id, sender=node.me, iteration=manifest.iteration, offset=offset, length=length
            )
            for ch in node.transport.stream(src, "FetchState", self._signed("FetchState", req), 120):
                yield ch.offset, ch.data

        blob, self.sources_used = download(
            fetch_range, sponsor, sources, int(manifest.total_bytes), node.options.chunk_bytes, node.say
        )
        params = _state.unflatten(node.worker.template(), blob, leaves)
        digest = _replay.checksum(params)
        if digest != manifest.digest.hex():
            raise RuntimeError(
                f"downloaded snapshot of iteration {manifest.iteration} has digest {digest[:16]}, expected {manifest.digest.hex()[:16]}"
            )
        mview = wire.view_from_pb(manifest.view)
        self.load(params, int(manifest.iteration), mview, "downloaded")
        node.say(
            f"loaded snapshot of iteration {manifest.iteration} ({len(blob)} bytes in chunks from "
            f"{self.sources_used} peer(s), digest {digest[:12]})"
        )
        goal = view.iteration if target is None else target
        deadline = time.monotonic() + 4 * node.cfg.peers.barrier_timeout_s
        while node.applied < goal:
            for e in self.fetch_log(sponsor, node.applied, goal - 1):
                node.apply(e, catching_up=True)
            if node.applied < goal:
                if time.monotonic() > deadline:
                    raise RuntimeError(f"the log from {sponsor} stops at iteration {node.applied}, short of {goal}")
                time.sleep(0.05)
        if node.applied > view.iteration:
            with self.store.lock:
                entry = self.store.log.get(node.applied - 1)
            return node.applied, entry.commit.next_view if entry is not None else mview
        return view.iteration, view

    # -- serving

    def manifest(self) -> tuple[_state.Snapshot, P.View, list[str]]:
        snap = self.store.latest_snapshot()
        if snap is None:
            raise P.Rejected("UNAVAILABLE", "no snapshot yet")
        view, members = self.node.view_and_sources()
        return snap, snap.view if snap.view is not None else view, members

    def chunks(self, iteration: int, offset: int, length: int) -> list[tuple[int, bytes]]:
        return self.store.chunks(iteration, offset, length, self.node.options.chunk_bytes)
