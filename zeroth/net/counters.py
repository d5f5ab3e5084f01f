"""What each iteration's barrier kept and lost, counted the same way by a peer, the simulator and ``zeroth verify``.

A peer (:class:`zeroth.net.runtime.Node`) and a simulated peer (:class:`zeroth.net.sim.SimPeer`)
each hold a :class:`BarrierCounters`:

* :meth:`~BarrierCounters.pushed`: this peer computed ``count`` projected gradients of an
  iteration and pushed them (``2 * count`` forward passes); computed after it applied that
  iteration's decision (nothing is pushed then), they are late and wasted at once;
* :meth:`~BarrierCounters.late`: a push of another member arrived for an iteration this peer has
  already decided (:func:`is_late`): refused as stale, or taken only as a sign that an inactive
  member is ready again; its gradients are never applied;
* :meth:`~BarrierCounters.decided`: this peer applies the decision of an iteration. The row it
  returns (the peer's ``metrics.jsonl`` row of the iteration, with the totals so far) holds
  ``own_push_late`` (this peer pushed, the decision left it out: the ``2 * count`` forward passes
  of that push are wasted) and ``barrier_wait_s`` (seconds from this peer's push to the decision:
  the time it waited at the barrier). :attr:`~BarrierCounters.totals` (:data:`TOTALS`) sums them
  over the run and :attr:`~BarrierCounters.contributors` lists how many members' gradients each
  decision applied (:meth:`~BarrierCounters.summary`: a peer's ``summary.json`` fields).

:func:`from_decisions` counts what the signed decisions alone show (``zeroth verify`` prints it):
the contributors of every iteration and the active members each barrier went on without.

Example:
  >>> c = BarrierCounters()
  >>> c.pushed(0, count=4, now=1.0)
  >>> c.decided(0, contributors=(0, 1), me=1, now=1.25)["barrier_wait_s"]
  0.25
  >>> c.pushed(1, count=4, now=2.0)
  >>> c.decided(1, contributors=(0,), me=1, now=2.5)["own_push_late"]
  True
  >>> c.totals["pushes_late"], c.totals["forward_passes_wasted"], c.contributors
  (1, 8, [2, 1])
"""

from __future__ import annotations

import statistics
from typing import Any

__all__ = ["TOTALS", "BarrierCounters", "is_late", "from_decisions", "summarize_contributors"]

TOTALS = ("pushes_late", "forward_passes_wasted", "barrier_wait_s_total", "late_pushes_received")
"""The run-long counters of one peer (``summary.json`` fields; its ``metrics.jsonl`` train rows carry them, so far)."""


def is_late(state, iteration: int) -> bool:
    """Whether a push of ``iteration`` arrives after ``state`` (a :class:`zeroth.net.protocol.PeerState`)
    applied that iteration's decision (its gradients can no longer be used here)."""
    return state is not None and iteration < state.it


class BarrierCounters:
    """One peer's barrier counters (see the module docstring). Not thread-safe: the owner serialises calls."""

    def __init__(self) -> None:
        self._pushed: dict[int, tuple[float, int]] = {}
        self.totals: dict[str, Any] = {
            "pushes_late": 0,
            "forward_passes_wasted": 0,
            "barrier_wait_s_total": 0.0,
            "late_pushes_received": 0,
        }
        self.contributors: list[int] = []  # contributors of each decision applied, in order
        self._applied = -1  # the newest iteration whose decision this peer applied

    def pushed(self, iteration: int, *, count: int, now: float) -> None:
        """This peer pushed ``count`` projected gradients of ``iteration`` at ``now`` (seconds)."""
        if iteration <= self._applied:  # decided without them before they were ready
            self.totals["pushes_late"] += 1
            self.totals["forward_passes_wasted"] += 2 * count
            return
        self._pushed.setdefault(iteration, (now, count))

    def late(self) -> None:
        """A member's push arrived for an iteration this peer had already decided (:func:`is_late`)."""
        self.totals["late_pushes_received"] += 1

    def decided(self, iteration: int, *, contributors, me: int | None, now: float) -> dict[str, Any]:
        """This peer applies the decision of ``iteration`` whose contributors are the machine ids
        ``contributors``; returns the iteration's row (see the module docstring)."""
        contributors = tuple(contributors)
        self.contributors.append(len(contributors))
        self._applied = max(self._applied, iteration)
        row: dict[str, Any] = {"own_push_late": False, "barrier_wait_s": None}
        for t in [t for t in self._pushed if t < iteration]:
            del self._pushed[t]  # pushes of iterations decided before (this peer rejoined or caught up)
        mine = self._pushed.pop(iteration, None)
        if mine is not None:
            at, count = mine
            row["barrier_wait_s"] = max(0.0, now - at)
            self.totals["barrier_wait_s_total"] += row["barrier_wait_s"]
            if me not in contributors:
                row["own_push_late"] = True
                self.totals["pushes_late"] += 1
                self.totals["forward_passes_wasted"] += 2 * count
        return row

    def summary(self) -> dict[str, Any]:
        """The totals and the contributors of every decision applied (``summary.json`` fields)."""
        return {
            **self.totals,
            "contributors_per_iteration": list(self.contributors),
            **summarize_contributors(self.contributors),
        }


def summarize_contributors(counts) -> dict[str, Any]:
    """``contributors_min``, ``contributors_median``, ``contributors_max`` of a list of per-iteration counts (None when empty)."""
    counts = list(counts)
    if not counts:
        return {"contributors_min": None, "contributors_median": None, "contributors_max": None}
    return {
        "contributors_min": min(counts),
        "contributors_median": statistics.median(counts),
        "contributors_max": max(counts),
    }


def from_decisions(entries) -> dict[str, Any]:
    """What the decisions show, from consecutive :class:`zeroth.net.protocol.LogEntry` values in
    iteration order: the contributors of each iteration, and the members that were active in an
    iteration's view (the view the decision before it handed on) but are not among its
    contributors (``missed_barrier``: the barrier went on without them; their gradients of that
    iteration, if they computed any, were never applied). The first entry's view is not known
    (no decision before it): nothing is counted as missed there."""
    per: list[int] = []
    missed: list[int] = []
    forward = 0
    before = None
    for e in entries:
        c = e.commit
        ids = {m for m, _ in c.contributors}
        per.append(len(ids))
        forward += 2 * sum(n for _, n in c.contributors)
        if before is not None and before.commit.iteration == c.iteration - 1:
            active = {m.machine for m in before.commit.next_view.members if m.active}
            missed.append(len(active - ids))
        before = e
    return {
        "iterations": len(per),
        "contributors_per_iteration": per,
        **summarize_contributors(per),
        "missed_barrier": sum(missed),
        "iterations_with_missed": sum(1 for n in missed if n),
        "forward_passes_applied": forward,
    }
