"""Checksum exchange and repair.

After applying iteration ``t`` a member sends the SHA-256 of its whole state
(:func:`zeroth.replay.checksum`) to a rotating partner (:func:`zeroth.net.protocol.checksum_partner`),
every ``peers.checksum_every`` iterations; both sides compare (the partner as soon as it reaches
the same iteration). Only *authenticated* comparisons count: a checksum request is signed by its
sender's key and carries a fresh sequence number (:mod:`zeroth.net.transport`), so nobody can
inflate another peer's counters. On a mismatch the peer asks the leader for its digest of that
iteration; the one that differs from the leader downloads the leader's snapshot and replays the
log since (:meth:`Checksums.repair`), and the mismatch is counted. It never happens in a correct run.
"""

from __future__ import annotations

import threading
from typing import NamedTuple

import grpc

from zeroth.net import protocol as P
from zeroth.net.proto import peer_pb2 as pb

__all__ = ["Repair", "Checksums"]


class Repair(NamedTuple):
    """Driver work: our digest of ``iteration`` differed from machine ``other``'s."""

    iteration: int
    other: int
    other_address: str


class Checksums:
    """Comparisons, mismatches and repairs of one peer; ``node`` is its :class:`zeroth.net.runtime.Node`."""

    def __init__(self, node):
        self.node = node
        self.lock = threading.Lock()

    def _request(self, iteration: int, digest: str | None) -> pb.ChecksumRequest:
        node = self.node
        req = pb.ChecksumRequest(
            run_id=node.run_id, sender=node.me, iteration=iteration, digest=bytes.fromhex(digest) if digest else b""
        )
        return node.transport.signed(node.identity, "Checksum", req)

    def send(self, inc: int, iteration: int, digest: str, partner: int, address: str) -> None:
        """Send our digest of ``iteration`` to ``partner`` and compare with its answer."""
        node = self.node
        try:
            reply = node.transport.rpc(
                address, "Checksum", self._request(iteration, digest), node.cfg.peers.barrier_timeout_s
            )
        except grpc.RpcError:
            return
        if reply.digest and len(reply.digest) == 32 and inc == node.incarnation:
            self.compare(iteration, digest, partner, address, reply.digest.hex())

    def compare(self, iteration: int, mine: str, other: int, address: str, theirs: str) -> None:
        node = self.node
        with self.lock:
            node.counters["checksum_comparisons"] += 1
            if mine == theirs:
                return
            node.counters["checksum_mismatches"] += 1
        node.say(f"CHECKSUM MISMATCH at iteration {iteration}: mine {mine[:16]}, machine {other}'s {theirs[:16]}")
        node.queue_repair(Repair(iteration, other, address))

    def serve(self, sender: int, address: str | None, iteration: int, digest: bytes) -> bytes:
        """Our digest of ``iteration`` (empty if not held); compares with ``digest`` (authenticated) when given."""
        if digest and len(digest) != 32:
            raise P.Rejected("INVALID_ARGUMENT", f"digest must be 32 bytes (SHA-256), got {len(digest)}")
        store = self.node.transfer.store
        with store.lock:
            mine = store.digests.get(iteration)
            if digest and mine is None and iteration >= self.node.applied and address is not None:
                if iteration <= self.node.applied + 64 and len(store.pending_checks[iteration]) < 64:
                    if all(s != sender for s, _, _ in store.pending_checks[iteration]):
                        store.pending_checks[iteration].append((sender, address, digest.hex()))
        if digest and mine is not None and address is not None:
            self.compare(iteration, mine, sender, address, digest.hex())
        return bytes.fromhex(mine) if mine else b""

    def repair(self, rep: Repair) -> None:
        """Settle a mismatch against the leader: the one that differs from it reloads the leader's state."""
        node = self.node
        view, me = node.current_view()
        if view is None:
            return
        leader = view.leader()
        mine = node.transfer.store.digest(rep.iteration)
        if leader is None or mine is None:
            return
        if leader != me:
            address = view.address_of(leader)
            try:
                reply = node.transport.rpc(address, "Checksum", self._request(rep.iteration, None), 10)
            except grpc.RpcError as e:
                node.say(f"repair: the leader did not answer ({e.code().name})")
                return
            if reply.digest and reply.digest.hex() != mine:
                node.say(f"repair: reloading the state of machine {leader} (ours differs at iteration {rep.iteration})")
                self.reload(address, view)
                return
            if not reply.digest:
                return
        # We agree with the leader: tell the other peer, which will settle it with the leader.
        if rep.other != me:
            try:
                node.transport.rpc(rep.other_address, "Checksum", self._request(rep.iteration, mine), 10)
            except grpc.RpcError:
                pass

    def reload(self, address: str, view: P.View) -> None:
        node = self.node
        target = node.applied
        try:
            node.transfer.catch_up(address, view._replace(iteration=target), target=target)
        except (grpc.RpcError, P.Rejected, RuntimeError) as e:
            node.say(f"repair failed: {e}")
            return
        with self.lock:
            node.counters["repairs"] += 1
        node.say(
            f"repair done: state of iteration {node.applied} reloaded, digest {str(node.transfer.store.digest(node.applied))[:16]}"
        )
