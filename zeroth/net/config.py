"""The ``peers`` section of a config: Just One Byte peers on loopback gRPC (:mod:`zeroth.net`).

One member of :data:`zeroth.config.SYSTEMS`, the union of the systems' sections: the section's key
is its tag. It sits at the config's layer (it imports :mod:`zeroth.schema` only), so
:mod:`zeroth.config` can decode it without importing the system.
"""

from __future__ import annotations

import dataclasses
from typing import Any, ClassVar

from zeroth.schema import MAX_PERTURBATIONS, MAX_PROCESSES, field

__all__ = ["PeersConfig"]


@dataclasses.dataclass(frozen=True)
class PeersConfig:
    """Several Just One Byte peers on one machine (loopback gRPC), launched by `zeroth run`."""

    count: int = field(2, "Number of peers started at iteration 0.", min=1, max=MAX_PROCESSES)
    inferences_per_iteration: int = field(
        4, "Projected gradients each peer computes per iteration (its n_perturbations).", min=1, max=MAX_PERTURBATIONS
    )
    iteration_timeout_s: float = field(
        30.0, "An iteration ends when every peer has sent its inferences or after this many seconds.", gt=0.0
    )
    barrier_timeout_s: float = field(
        30.0, "How long a peer waits for the others to confirm they applied the iteration's updates.", gt=0.0
    )
    iterations: int | None = field(None, "Iterations to run; null = train.steps.", min=1)
    checksum_every: int = field(
        1, "Compare the parameter checksum with a peer every this many iterations; 0 = never.", min=0
    )
    token: str | None = field(
        None,
        "The run secret: whoever holds it may join (every call carries a token derived from it; every message is "
        "signed by its sender's own key). null = `zeroth run` generates one into OUT/run.secret and `zeroth peer` "
        "takes --secret-file / $ZEROTH_SECRET, or generates one when founding.",
    )
    insecure: bool = field(
        False,
        "Run without a secret: anyone who reaches a port may join (messages stay signed by their senders). "
        "Needed explicitly to run without one.",
    )
    clip: float | None = field(
        None,
        "Clip every decoded projected gradient to [-clip, clip] before the replay (bounds what one member can do "
        "with outlier bytes); null = no clip.",
        gt=0.0,
    )
    stall_timeout_s: float | None = field(
        None,
        "An iteration without a decision for this long is re-synchronised with the others; after as long again "
        "the peer ends the run (exit 1, state saved). null = iteration_timeout_s + 6 * barrier_timeout_s.",
        gt=0.0,
    )
    max_members: int = field(
        1024,
        "Most members a run holds: further joins are refused (RESOURCE_EXHAUSTED, the joiner retries) until a "
        "member leaves or is removed; at least peers.count.",
        min=1,
        max=4096,
    )
    idle_timeout_s: float | None = field(
        120.0,
        "A member that contributes nothing (admitted but silent, or still catching up) for this many seconds is "
        "removed from the run and must rejoin, so members that never push do not hold the majority; null = never.",
        gt=0.0,
    )
    pushes: str = field(
        "leader",
        "Where a peer sends its projected gradients: leader = to the iteration's committer only, which relays "
        "them, signed by their authors, with its decision (down a tree of relay_fanout; about 3 messages per "
        "member an iteration); all = to every member (M*(M-1) messages an iteration; a takeover finds every push "
        "in place and need not wait for the iteration timeout).",
        choices=("all", "leader"),
    )
    relay_fanout: int = field(
        8,
        "With pushes: leader, the committer sends the relayed gradients to this many members, each of which "
        "forwards them to as many more (a tree: no peer sends more than this many copies); the others get the "
        "decision alone and fetch the gradients if the relay is late. 0 = the committer sends them to everyone.",
        min=0,
        max=4096,
    )
    relay_parts: int = field(
        1,
        "With relay_fanout, the committer splits the relayed gradients into this many parts and a relay forwards "
        "each as it arrives, before the next, so a hop costs about one part's upload instead of all of them "
        "(helps where uplinks are alike; over very unequal uplinks one part can be faster). 1 = all at once.",
        min=1,
        max=4096,
    )
    measured_timeouts: float = field(
        0.0,
        "0 = iteration_timeout_s and barrier_timeout_s hold throughout. k >= 2: each peer shortens both to k times "
        "the median duration of its last 16 iterations (once it measured 4; never above the configured ones), so "
        "a silent member or a lost committer costs a few iterations' time, not seconds; a pause longer than k "
        "iterations (an evaluation, a compilation) then counts as a failure.",
        min=0.0,
    )
    startup_timeout_s: float | None = field(
        None,
        "Seconds for every founder to join before iteration 0; fewer by then fails the run (exit 1). "
        "null = 60 + 4 per peer (many processes starting at once on a small machine are slow).",
        gt=0.0,
    )
    tls: bool = field(False, "Use TLS between peers (self-signed certificates are generated for loopback runs).")
    host: str = field("127.0.0.1", "Address the peers listen on.")
    base_port: int = field(0, "First port; peer i listens on base_port + i. 0 = pick free ports.", min=0, max=65535)
    join_at: tuple[int, ...] = field(
        (), "Iterations at which one extra peer joins the run (demonstrates joining mid-run).", factory=tuple, min=0
    )
    kill_at: tuple[int, ...] = field(
        (), "Iterations at which one running peer is killed (demonstrates leaving mid-run).", factory=tuple, min=0
    )

    applies_schedule: ClassVar[bool] = True  # every peer replays train.schedule's rate at each iteration

    def check(self, cfg: Any) -> None:
        """What this section asks of the rest of ``cfg`` (a :class:`zeroth.config.Config`)."""
        if self.count + len(self.join_at) > MAX_PROCESSES:
            raise ValueError(
                f"config field peers.join_at: peers.count={self.count} plus {len(self.join_at)} joiners "
                f"exceed MAX_PROCESSES={MAX_PROCESSES} peer processes; start fewer"
            )
        if self.count > self.max_members:
            raise ValueError(
                f"config field peers.max_members: {self.max_members} is below peers.count={self.count}; "
                f"raise it to at least {self.count}"
            )
        if 0 < self.measured_timeouts < 2:
            raise ValueError(
                f"config field peers.measured_timeouts: {self.measured_timeouts} is below 2 (a timeout shorter than "
                f"two iterations fires in every slow one); use 0 for fixed timeouts or at least 2"
            )
        if cfg.train.method != "zo":
            raise ValueError(
                f"config section 'peers' needs train.method='zo' (peers exchange projected gradients); "
                f"got {cfg.train.method!r}"
            )
        if cfg.train.requantize is not None:
            raise ValueError(
                f"config field train.requantize: {cfg.train.requantize!r} is not supported with a 'peers' section "
                f"(peers apply float32 updates); remove one of them"
            )
        if cfg.train.layout == "flat":
            raise ValueError(
                f"config field train.layout: {cfg.train.layout!r} applies to train.method='zo' on one machine "
                f"(the peers hold trees); use layout 'tree' or 'auto'"
            )
