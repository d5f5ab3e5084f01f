"""The ``ravnest`` section of a config: Ravnest (seed 003, :mod:`zeroth.cluster`).

One member of :data:`zeroth.config.SYSTEMS`, the union of the systems' sections: the section's key
is its tag. It sits at the config's layer (it imports :mod:`zeroth.schema` only), so
:mod:`zeroth.config` can decode it without importing the system.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any, ClassVar

from zeroth.schema import (
    MAX_BATCH,
    MAX_PROCESSES,
    MAX_WIDTH,
    PIPELINE_DATASETS,
    PIPELINE_OBJECTIVES,
    bad,
    check_name,
    coerce_scalar,
    field,
)

__all__ = ["RavnestConfig", "RAVNEST_ORDERS", "RAVNEST_NODE_KEYS"]

# The orders of a node's work, the keys of a node description.
RAVNEST_ORDERS = ("fixed", "arrival")
RAVNEST_NODE_KEYS = {
    "name": str,
    "ram_mb": float,
    "bandwidth_mbps": float,
    "speed": float,
    "backup": bool,
    "join_round": int,
    "latency_ms": float,
}


def _default_nodes() -> tuple[dict, ...]:
    return (
        {"name": "n0", "ram_mb": 6.0, "bandwidth_mbps": 200.0, "speed": 1.0},
        {"name": "n1", "ram_mb": 3.0, "bandwidth_mbps": 100.0, "speed": 1.0},
        {"name": "n2", "ram_mb": 4.0, "bandwidth_mbps": 150.0, "speed": 1.0},
        {"name": "n3", "ram_mb": 5.0, "bandwidth_mbps": 150.0, "speed": 1.0},
    )


@dataclasses.dataclass(frozen=True)
class RavnestConfig:
    """Ravnest (seed 003): clusters of nodes formed by a genetic algorithm, each an asynchronous pipeline,
    averaged with each other by parallel rings; one process per node on loopback gRPC, launched by `zeroth run`."""

    nodes: tuple[dict, ...] = field(
        (),
        "The node pool: one mapping per node, {name, ram_mb (usable RAM), bandwidth_mbps (steady bandwidth), "
        "speed (compute speed relative to this machine, <= 1: a node of speed 0.5 sleeps as long as it computes; the "
        "formation reads it as given), backup with join_round r: the spare arrives at round r and receives its "
        "primary's state then, backup (true: a "
        "spare that shadows the least reliable node of a cluster and takes over when it dies), join_round (r >= 1: the "
        "node arrives late; the nodes with the same join_round form a new cluster that starts from the parameters "
        "averaged at round r - 1 and joins the rings at round r), latency_ms (the node's access latency: a message between two nodes takes "
        "ravnest.latency_ms plus both nodes' latency_ms)}.",
        factory=_default_nodes,
    )
    clusters: int = field(2, "Number of clusters the genetic algorithm forms from the non-backup nodes.", min=1)
    objective: str = field(
        "classify",
        "lm: next-token loss on SOTU windows (data.dataset = sotu); classify: sentiment sentences (sentiment).",
        choices=PIPELINE_OBJECTIVES,
    )
    examples: int = field(64, "Size of the fixed example set; data.batch_size must divide it.", min=1, max=MAX_BATCH)
    seq_len: int = field(32, "Tokens per example.", min=2, max=MAX_WIDTH)
    order: str = field(
        "fixed",
        "fixed: one-forward-one-backward after a warm-up (bit-reproducible); arrival: whatever is ready, "
        "backward first (the seed's event loop; timing decides the interleaving).",
        choices=RAVNEST_ORDERS,
    )
    max_in_flight: int = field(
        0,
        "The delay bound D: batches a stage may hold forwarded and not yet back (min(D, S - stage)); "
        "0 = the pipeline depth (no throttling). Staleness of stage s is min(D, S - s) - 1.",
        min=0,
    )
    average_every: int = field(
        4, "R: every node averages its parameters with the other clusters after every R-th update (0 = never).", min=0
    )
    latency_ms: float = field(
        0.0, "Enforced one-way latency of every message between two nodes, in milliseconds.", min=0.0
    )
    enforce_bandwidth: bool = field(True, "Pace every message at min(bandwidth of sender, bandwidth of receiver).")
    population: int = field(64, "Genetic algorithm: chromosomes per generation.", min=4)
    generations: int = field(
        200, "Genetic algorithm: most generations (it stops earlier when the best stops improving).", min=1
    )
    kill_at: tuple[int, ...] = field(
        (),
        "Batches at which the launcher SIGKILLs the primary shadowed by each backup (one entry per backup, in "
        "pool order); the backup takes over.",
        factory=tuple,
        min=1,
    )
    host: str = field("127.0.0.1", "Address the nodes listen on.")
    timeout_s: float = field(
        300.0, "A node gives up when a message it waits for does not come within this many seconds.", gt=0.0
    )

    applies_schedule: ClassVar[bool] = False  # its optimizers keep a constant rate

    def check(self, cfg: Any) -> None:
        """What this section asks of itself and the rest of ``cfg`` (a :class:`zeroth.config.Config`)."""
        r = self
        if len(r.nodes) > MAX_PROCESSES:
            raise ValueError(
                f"config field ravnest.nodes: {len(r.nodes)} nodes exceed MAX_PROCESSES={MAX_PROCESSES} "
                "node processes; list fewer"
            )
        for i, node in enumerate(r.nodes):
            name = node.get("name") if isinstance(node, Mapping) else None
            if isinstance(name, str):
                check_name(f"ravnest.nodes[{i}].name", name, "the node's folder and address file")
        if cfg.train.method != "backprop":
            raise ValueError(f"config section 'ravnest' needs train.method='backprop'; got {cfg.train.method!r}")
        if cfg.model.name != "transformer":
            raise ValueError(
                f"config field model.name: Ravnest splits zeroth's transformer into stages; got {cfg.model.name!r}, expected 'transformer'"
            )
        want = PIPELINE_DATASETS[r.objective]
        if cfg.data.dataset != want:
            raise ValueError(
                f"config field data.dataset: ravnest.objective {r.objective!r} trains on {want!r}, got {cfg.data.dataset!r}"
            )
        if r.examples % cfg.data.batch_size:
            raise ValueError(
                f"config field ravnest.examples: data.batch_size={cfg.data.batch_size} must divide {r.examples}"
            )
        names = []
        for i, node in enumerate(r.nodes):
            where = f"ravnest.nodes[{i}]"
            unknown = [k for k in node if k not in RAVNEST_NODE_KEYS]
            if unknown:
                raise ValueError(
                    f"config field {where}: unknown key {unknown[0]!r}; valid keys are {sorted(RAVNEST_NODE_KEYS)}"
                )
            for key in ("name", "ram_mb", "bandwidth_mbps"):
                if key not in node:
                    raise ValueError(
                        f"config field {where}: missing {key!r} (a node is {{name, ram_mb, bandwidth_mbps, speed, backup}})"
                    )
            for key, tp in RAVNEST_NODE_KEYS.items():
                if key not in node:
                    continue
                v = node[key]
                if tp is float:
                    coerce_scalar(f"{where}.{key}", float, v)
                    if key == "latency_ms" and float(v) < 0:
                        raise bad(f"{where}.{key}", v, ">= 0")
                    if key != "latency_ms" and not float(v) > 0:
                        raise bad(f"{where}.{key}", v, "> 0")
                elif tp is int:
                    coerce_scalar(f"{where}.{key}", int, v)
                    if v < 1:
                        raise bad(f"{where}.{key}", v, ">= 1 (the averaging round at which the node's cluster joins)")
                else:
                    coerce_scalar(f"{where}.{key}", tp, v)
            names.append(node["name"])
        dup = sorted({n for n in names if names.count(n) > 1})
        if dup:
            raise ValueError(f"config field ravnest.nodes: node name {dup[0]!r} appears twice; names must be unique")
        for i, node in enumerate(r.nodes):
            if "join_round" not in node:
                continue
            if r.average_every == 0:
                raise ValueError(
                    f"config field ravnest.nodes[{i}].join_round: a late cluster joins at an averaging round; set ravnest.average_every > 0"
                )
            if (node["join_round"] - 1) * r.average_every >= cfg.train.steps:
                raise ValueError(
                    f"config field ravnest.nodes[{i}].join_round: {node['join_round']} starts after the run's last batch "
                    f"(train.steps={cfg.train.steps}, average_every={r.average_every})"
                )
        workers = [n for n in r.nodes if not n.get("backup", False) and "join_round" not in n]
        if len(workers) < r.clusters:
            raise ValueError(
                f"config field ravnest.clusters: {r.clusters} clusters need at least {r.clusters} non-backup nodes, the pool has {len(workers)}"
            )
        backups = len(r.nodes) - len(workers)
        if len(r.kill_at) > backups:
            raise ValueError(
                f"config field ravnest.kill_at: {len(r.kill_at)} kills but {backups} backup nodes; each kill is taken over by one backup"
            )
        late_backups = [n for n in r.nodes if n.get("backup", False)]
        for n, at in zip(late_backups, r.kill_at):
            joined = n.get("join_round", 0) * r.average_every
            if at <= joined:
                raise ValueError(
                    f"config field ravnest.kill_at: backup {n['name']!r} joins after update {joined}; "
                    f"its primary can be killed only after that (got {at})"
                )
        if any(k >= cfg.train.steps for k in r.kill_at):
            raise ValueError(
                f"config field ravnest.kill_at: {list(r.kill_at)} must be below train.steps={cfg.train.steps}"
            )
