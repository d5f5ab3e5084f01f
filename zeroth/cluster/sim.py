"""Every node of a Ravnest run in one process: the same stages and event loops, threads for processes.

:func:`run_local` builds the plan and every node's stage, and runs each node's
:func:`~zeroth.cluster.driver.run_node` in a thread; activations and gradients go through the
nodes' :class:`~zeroth.cluster.driver.Inbox` directly, the rings through a
:class:`~zeroth.cluster.rings.QueueExchange`. In the ``fixed`` order this is what the node
processes compute, bit for bit; it is the reference the end-to-end tests compare against.
Late clusters fetch their start over the same exchange. Backups are not simulated (they compute
what their primary computes).
"""

from __future__ import annotations

import threading

import numpy as np

from zeroth import config as _config
from zeroth.cluster import build as _build
from zeroth.cluster import driver as _driver
from zeroth.cluster import engine as _engine
from zeroth.cluster import rings as _rings
from zeroth.replay import checksum

__all__ = ["run_local"]


class _LocalIO:
    def __init__(self, slot, inboxes, hub, plan, timeout_s):
        self.slot, self.inboxes, self.plan, self.timeout_s = slot, inboxes, plan, timeout_s
        self.inbox = inboxes[slot]
        self.endpoint = hub.endpoint(slot)
        self.averaged: dict[int, np.ndarray] = {}

    def send(self, kind, batch, array):
        c, s = self.slot
        dest = (c, s + 1) if kind == _driver.ACTIVATION else (c, s - 1)
        self.inboxes[dest].put(kind, batch, np.array(array, copy=True))

    def average(self, flat, round_id):
        avg = _build.average_round(self.plan, self.slot, flat, round_id, self.endpoint, self.timeout_s)
        self.averaged[round_id] = avg
        return avg


def run_local(cfg: _config.Config, steps: int | None = None) -> dict:
    """Run the whole pool in this process for ``steps`` batches per cluster (default ``train.steps``).

    Returns ``{"plan", "results": {name: NodeResult}, "records": {name: [...]}, "flat": {name: float32[...]},
    "digests": {name: str}, "checksums": {name: str}, "averaged": {name: {round: float32[...]}}, "starts": {late name:
    float32[...]}}`` (``checksums``: :func:`zeroth.replay.checksum` of each node's final stage parameters); the
    first exception of any node is raised.
    """
    r = cfg.ravnest
    n = cfg.train.steps if steps is None else steps
    ex = _build.examples_of(cfg)
    model = _build.model_of(cfg, ex)
    plan = _build.plan_of(cfg, ex, model)
    hub = _rings.QueueExchange()
    inboxes = {slot: _driver.Inbox() for slot in plan.primaries}
    units = plan.units
    out = {
        "plan": plan,
        "results": {},
        "records": {},
        "flat": {},
        "digests": {},
        "checksums": {},
        "averaged": {},
        "starts": {},
    }
    errors: list[BaseException] = []

    def node(name, slot):
        try:
            stage = _build.stage_of(cfg, plan, name, ex, model)
            recs: list = []
            io = _LocalIO(slot, inboxes, hub, plan, r.timeout_s)
            if _build.join_pieces(plan, slot):
                start = _build.fetch_start(plan, slot, _engine.flat_of(stage.params, units), io.endpoint, r.timeout_s)
                stage.params = _engine.with_flat(stage.params, units, start)
                out["starts"][name] = start
            res = _driver.run_node(
                stage,
                _build.data_of(cfg, ex, slot[0], len(plan.stages)),
                io,
                n_batches=n,
                units=units,
                order=r.order,
                max_in_flight=r.max_in_flight,
                average_every=r.average_every,
                timeout_s=r.timeout_s,
                on_record=recs.append,
                first_batch=_build.first_batch(plan, slot[0]),
            )
            flat = _engine.flat_of(stage.params, units)
            out["results"][name], out["records"][name], out["flat"][name] = res, recs, flat
            out["digests"][name] = _engine.flat_digest(flat)
            out["checksums"][name] = checksum(stage.params)
            out["averaged"][name] = io.averaged
        except BaseException as e:  # noqa: BLE001 - re-raised below after the other threads stop
            errors.append(e)
            for ib in inboxes.values():
                ib.fail(RuntimeError(f"node {name} failed: {e}"))

    threads = [threading.Thread(target=node, args=(name, slot), daemon=True) for slot, name in plan.primaries.items()]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]
    return out
