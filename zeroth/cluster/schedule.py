"""The order of one node's work in a zero-bubble asynchronous pipeline (seed 003, §3.1, Algorithm 1).

A cluster of ``S`` nodes is a pipeline: node ``s`` holds stage ``s``. A node never waits for the
backward pass of a batch before the forward pass of the next one: stage ``s`` keeps up to

    w_s = min(D, S − s)

batches in flight (forwarded, gradient not yet back), where ``D`` is the delay bound
(``ravnest.max_in_flight``; ``0`` = no bound beyond the pipeline depth, ``D = S``). ``S − s`` is
what keeps every stage busy (the round trip of a batch from stage ``s`` to the last stage and back);
``D < S`` throttles the first stages and bounds the staleness. The last stage (``w = 1``) does the
forward and backward of a batch at once. Each gradient is applied as soon as it is computed, so the
gradient of batch ``b`` at stage ``s`` is computed at the parameters its forward pass used (weight
stashing, eq. 2) and applied to parameters that have since taken

    staleness_s = w_s − 1

other updates (largest at the first stage, zero at the last).

Two orders:

* ``fixed`` (:func:`fixed_order`): one-forward-one-backward after a warm-up of ``w_s`` forwards:
  ``F0 … F(w−1), B0, Fw, B1, F(w+1), …, B(n−1)``. Every stage's work is a function of the
  messages it receives, so a run is bit-reproducible and a process run equals the in-process one.
  It is free of deadlock for FIFO links: stage ``s`` performs ``B(k − w_{s−1})`` before ``F(k)``,
  and ``w_{s−1} ≥ w_s``.
* ``arrival``: whatever is ready, backward first (the paper's event loop): a forward only when
  fewer than ``w_s`` batches are in flight. Timing decides the interleaving; the staleness bound
  still holds, the digest may differ from run to run.

Example:
  >>> fixed_order(stage=0, n_stages=3, n_batches=4)
  [('F', 0), ('F', 1), ('F', 2), ('B', 0), ('F', 3), ('B', 1), ('B', 2), ('B', 3)]
  >>> fixed_order(stage=2, n_stages=3, n_batches=2)
  [('FB', 0), ('FB', 1)]
  >>> [in_flight(s, 3, 2) for s in range(3)], [staleness(s, 3, 2) for s in range(3)]
  ([2, 2, 1], [1, 1, 0])
"""

from __future__ import annotations

__all__ = ["ORDERS", "fixed_order", "in_flight", "staleness"]

ORDERS = ("fixed", "arrival")


def in_flight(stage: int, n_stages: int, max_in_flight: int = 0) -> int:
    """``w_s = min(D, S − s)`` batches stage ``s`` may hold forwarded and not yet back (``D = 0``: ``S``)."""
    if not 0 <= stage < n_stages:
        raise ValueError(f"stage {stage} is outside 0..{n_stages - 1}")
    if max_in_flight < 0:
        raise ValueError(f"max_in_flight must be >= 0 (0 = the pipeline depth), got {max_in_flight}")
    depth = n_stages - stage
    return depth if max_in_flight == 0 else max(1, min(max_in_flight, depth))


def staleness(stage: int, n_stages: int, max_in_flight: int = 0) -> int:
    """Updates applied between the forward and the backward of a batch at stage ``s``: ``w_s − 1``."""
    return in_flight(stage, n_stages, max_in_flight) - 1


def fixed_order(stage: int, n_stages: int, n_batches: int, max_in_flight: int = 0) -> list[tuple[str, int]]:
    """Stage ``s``'s operations in the ``fixed`` order: ``('F', b)``, ``('B', b)``, or ``('FB', b)`` on the last stage."""
    if stage == n_stages - 1:
        return [("FB", b) for b in range(n_batches)]
    w = in_flight(stage, n_stages, max_in_flight)
    ops = [("F", b) for b in range(min(w, n_batches))]
    for b in range(n_batches):
        ops.append(("B", b))
        if b + w < n_batches:
            ops.append(("F", b + w))
    return ops
