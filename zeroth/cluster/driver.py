"""One node's event loop, whatever carries its messages: the in-process clusters and the node processes run this.

:func:`run_node` feeds an :class:`~zeroth.cluster.engine.AsyncStage` from a :class:`NodeIO`:

* ``get(kind, batch)`` blocks until the activation (from the previous stage) or the gradient (from
  the next stage) of ``batch`` is in the node's buffer (:class:`Inbox`: one forward and one backward
  buffer, keyed by batch; a duplicate is dropped);
* ``send(kind, batch, array)``: an activation goes to the next stage, a gradient to the previous one;
* ``average(flat, round_id)``: this node's slice of the parameters averaged with the nodes of the
  other clusters that hold the same indices (the multi-ring all-reduce), every
  ``average_every`` updates.

The time a node spends blocked in ``get`` (its buffers empty) is its **idle time**; the time in the
averaging rounds is counted apart. The data of cluster ``c`` (of ``C``) for its batch ``b`` is the
example set's batch of step ``b·C + c`` (:func:`batch_ids`), so clusters see different data and a
cluster's stages all read the same examples (by id, no tokens travel).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any, Protocol

import numpy as np

from zeroth.cluster import engine as _engine
from zeroth.cluster import schedule as _schedule
from zeroth.stages import examples as _examples

__all__ = ["ACTIVATION", "GRADIENT", "Inbox", "NodeIO", "NodeResult", "batch_ids", "run_node"]

ACTIVATION, GRADIENT = "activation", "gradient"


def batch_ids(seed: int, cluster: int, n_clusters: int, batch: int, batch_size: int, n_examples: int) -> np.ndarray:
    """Example ids of cluster ``cluster``'s batch ``batch``: the example set's batch of step ``batch · C + cluster``."""
    return _examples.batch_ids(seed, batch * n_clusters + cluster, batch_size, n_examples)


class Inbox:
    """A node's forward and backward buffers: ``(kind, batch) -> array``, duplicates dropped, waits bounded."""

    def __init__(self):
        self._cv = threading.Condition()
        self._items: dict[tuple[str, int], Any] = {}
        self._seen: set[tuple[str, int]] = set()
        self._error: BaseException | None = None

    def put(self, kind: str, batch: int, value) -> bool:
        """Store a message; False (and nothing stored) when ``(kind, batch)`` came before."""
        key = (kind, int(batch))
        with self._cv:
            if key in self._seen:
                return False
            self._seen.add(key)
            self._items[key] = value
            self._cv.notify_all()
            return True

    def fail(self, error: BaseException) -> None:
        """Wake every waiter with ``error`` (a link broke, a message was refused)."""
        with self._cv:
            self._error = error
            self._cv.notify_all()

    def snapshot(self) -> tuple[dict, set]:
        """``(waiting messages, every key ever put)``: what a joining backup must start from."""
        with self._cv:
            return dict(self._items), set(self._seen)

    def restore(self, items: dict, seen: set) -> None:
        """Merge a snapshot: its messages are waiting, its keys count as seen (re-sent copies are dropped)."""
        with self._cv:
            for k, v in items.items():
                if k not in self._seen:
                    self._items[k] = v
            self._seen |= set(seen) | set(items)
            self._cv.notify_all()

    def has(self, kind: str, batch: int) -> bool:
        with self._cv:
            return (kind, batch) in self._items

    def get(self, kind: str, batch: int, timeout_s: float):
        """Take the message ``(kind, batch)``, waiting at most ``timeout_s``.

        Raises:
          TimeoutError: it did not come; the error given to :meth:`fail`, if any.
        """
        key = (kind, batch)
        deadline = time.monotonic() + timeout_s
        with self._cv:
            while key not in self._items:
                if self._error is not None:
                    raise self._error
                left = deadline - time.monotonic()
                if left <= 0:
                    raise TimeoutError(f"no {kind} for batch {batch} within {timeout_s:g}s")
                self._cv.wait(left)
            return self._items.pop(key)

    def wait(self, timeout_s: float) -> None:
        """Block until any message arrives (or ``timeout_s``)."""
        with self._cv:
            if self._error is not None:
                raise self._error
            self._cv.wait(timeout_s)


class NodeIO(Protocol):
    """What :func:`run_node` needs from a transport."""

    inbox: Inbox

    def send(self, kind: str, batch: int, array: np.ndarray) -> None: ...

    def average(self, flat: np.ndarray, round_id: int) -> np.ndarray: ...


class NodeResult(dict):
    """A node's totals: ``updates``, ``compute_s``, ``idle_s``, ``average_s``, ``wall_s``, ``losses``, ``staleness``."""


def run_node(
    stage: _engine.AsyncStage,
    data: Callable[[int], tuple[np.ndarray, np.ndarray]],
    io: NodeIO,
    *,
    n_batches: int,
    units,
    order: str = "fixed",
    max_in_flight: int = 0,
    average_every: int = 0,
    timeout_s: float = 600.0,
    on_record: Callable[[dict], None] | None = None,
    first_batch: int = 0,
    after_average: Callable[[int], None] | None = None,
) -> NodeResult:
    """Run ``n_batches`` batches through this node's stage; returns its totals.

    Args:
      stage: this node's stage; data: ``batch -> (tokens, labels)`` of this cluster.
      io: the node's transport; units: :func:`zeroth.cluster.engine.model_units` (for the flat slice).
      order: ``fixed`` or ``arrival`` (:mod:`zeroth.cluster.schedule`).
      max_in_flight: the delay bound ``D`` (0 = pipeline depth).
      average_every: ``R``: average with the other clusters after every ``R``-th update (0 = never).
      on_record: receives one record per update, after its averaging round if it has one: ``kind``
        ``"train"``, ``step`` (the stage's update count after it), ``batch``, ``loss`` (last stage;
        else None), ``staleness``, ``idle_s`` and ``compute_s`` (of this update), ``forward_passes``
        (batches this stage has forwarded in this run: updates since ``first_batch`` plus those in
        flight) and, when it averaged, ``average_round`` and ``average_s``; the node process adds
        the other fields of the metrics schema (:mod:`zeroth.cluster.node`).
      first_batch: where a late cluster starts (its stage then counts updates from there, so that
        the averaging rounds line up with the other clusters').
      after_average: called with the round after each averaging round, parameters set (a primary
        hands its state to a joining backup there).

    A stage restored from a snapshot (``stage.version`` past ``first_batch``) resumes after its
    last update: in the ``fixed`` order at the operation after the one that made it.
    """
    if order not in _schedule.ORDERS:
        raise ValueError(f"unknown order {order!r}; expected one of {list(_schedule.ORDERS)}")
    S, s = stage.n_stages, stage.index
    w = _schedule.in_flight(s, S, max_in_flight)
    stage.version = max(stage.version, first_batch)
    done = stage.version - first_batch  # updates made before this call (a restored stage)
    res = NodeResult(updates=0, compute_s=0.0, idle_s=0.0, average_s=0.0, losses=[], staleness=[])
    t_start = time.perf_counter()

    def get(kind, b):
        t0 = time.perf_counter()
        x = io.inbox.get(kind, b, timeout_s)
        res["idle_s"] += time.perf_counter() - t0
        return x

    def after_update(b, loss, idle0, compute0):
        res["updates"] += 1
        if loss is not None:
            res["losses"].append(loss)
        res["staleness"].append(stage.staleness[-1])
        rec = {
            "kind": "train",
            "step": stage.version,
            "batch": b,
            "loss": loss,
            "staleness": stage.staleness[-1],
            "idle_s": res["idle_s"] - idle0,
            "compute_s": stage.compute_s - compute0,
            "forward_passes": stage.version - first_batch + stage.in_flight(),
        }
        if average_every and stage.version % average_every == 0:
            r = stage.version // average_every
            t0 = time.perf_counter()
            flat = io.average(_engine.flat_of(stage.params, units), r)
            stage.params = _engine.with_flat(stage.params, units, flat)
            dt = time.perf_counter() - t0
            res["average_s"] += dt
            rec.update(average_round=r, average_s=dt)
            if after_average is not None:
                after_average(r)
        if on_record is not None:
            on_record(rec)

    def op_forward(b):
        idle0, compute0 = res["idle_s"], stage.compute_s
        tokens, labels = data(b)
        x = None if stage.first else get(ACTIVATION, b)
        out = stage.forward(b, tokens, labels, x)
        if stage.last:
            loss, gx = out
            if gx is not None:
                io.send(GRADIENT, b, gx)
            after_update(b, loss, idle0, compute0)
        else:
            io.send(ACTIVATION, b, out)

    def op_backward(b):
        idle0, compute0 = res["idle_s"], stage.compute_s
        tokens, _ = data(b)
        g = get(GRADIENT, b)
        gx = stage.backward(b, tokens, g)
        if gx is not None:
            io.send(GRADIENT, b, gx)
        after_update(b, None, idle0, compute0)

    if order == "fixed":
        ops = _schedule.fixed_order(s, S, n_batches - first_batch, max_in_flight)
        if done:
            made = [i for i, (kind, _) in enumerate(ops) if kind != "F"]
            ops = ops[made[done - 1] + 1 :]
        for kind, b in ops:
            op_backward(first_batch + b) if kind == "B" else op_forward(first_batch + b)
    else:
        next_b = first_batch + done
        next_f = next_b + stage.in_flight()
        progress = time.monotonic()
        while next_b < n_batches:
            if stage.last:
                op_forward(next_f)
                next_f += 1
                next_b += 1
            elif next_b < next_f and io.inbox.has(GRADIENT, next_b):
                op_backward(next_b)
                next_b += 1
            elif next_f < n_batches and next_f - next_b < w and (stage.first or io.inbox.has(ACTIVATION, next_f)):
                op_forward(next_f)
                next_f += 1
            else:
                if time.monotonic() - progress > timeout_s:
                    raise TimeoutError(f"stage {s}: nothing arrived within {timeout_s:g}s")
                t0 = time.perf_counter()
                io.inbox.wait(min(timeout_s, 0.5))
                res["idle_s"] += time.perf_counter() - t0
                continue
            progress = time.monotonic()
    res["compute_s"] = stage.compute_s
    res["wall_s"] = time.perf_counter() - t_start
    res["staleness_max"] = max(res["staleness"], default=0)
    return res
