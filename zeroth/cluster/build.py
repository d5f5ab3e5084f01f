"""From a config with a ``ravnest:`` section to the plan every node computes the same way.

:func:`plan_of` is a pure function of the config (the genetic algorithm is seeded by
``run.seed``), so every node process derives the same clusters, stages, rings and backups without
a coordinator:

1. the pool's non-backup nodes are clustered by :func:`zeroth.cluster.formation.form_clusters`:
   every cluster's RAM must hold the model's peak memory ``M = 4·P + A`` (parameters, their
   gradient and AdamW's two moments, plus one batch's activations ``A``), and the clusters' sums of
   per-node transfer times ``8·m / b_i`` (``m``: one batch's activation message) are balanced;
2. inside a cluster the model's units (:func:`zeroth.cluster.engine.model_units`: embeddings,
   blocks, head) are split in proportion to the nodes' RAM (:func:`~zeroth.cluster.formation.plan_stages`,
   loads counted as 4 bytes of state per parameter byte), in pool order;
3. each node's stage is a range of the model's flat parameter vector; the rings
   (:func:`zeroth.cluster.rings.plan_rings`) average every range across the clusters;
4. each backup (``backup: true``) shadows the least reliable primary (lowest bandwidth, then pool
   order) that has no backup yet and whose stage fits in the backup's RAM; with ``join_round: r``
   it arrives later: after round ``r`` its primary sends it its whole state and relays to it
   every message it receives from then on;
5. the late nodes with the same ``join_round: r`` form one more cluster (split by RAM as above).
   It starts at batch ``(r − 1)·R`` from the parameters the clusters averaged at round ``r − 1``
   (the first cluster's nodes send each of its nodes the part it holds), trains ``R`` batches and
   joins the rings at round ``r`` (:func:`rings_at` plans the rings of the clusters active at a
   round). A cluster's batch ``b`` is the example set's batch of step ``b·C + c`` for the run's
   final number of clusters ``C``.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import numpy as np

from zeroth import config as _config
from zeroth.cluster import driver as _driver
from zeroth.cluster import engine as _engine
from zeroth.cluster import formation as _formation
from zeroth.cluster import rings as _rings
from zeroth.cluster import wire as _wire
from zeroth.stages import build as _sbuild
from zeroth.stages import examples as _examples
from zeroth.stages import partition as _partition

__all__ = [
    "MB",
    "Plan",
    "RUN_ID_EXCLUDE",
    "active_clusters",
    "data_of",
    "examples_of",
    "first_batch",
    "join_pieces",
    "holder",
    "model_of",
    "plan_of",
    "push_pieces",
    "rings_at",
    "run_id_of",
    "sizes_of",
    "stage_of",
]

MB = 2**20
STATE_PER_PARAM_BYTE = 4  # parameters, gradient, two AdamW moments
RUN_ID_EXCLUDE = (
    "run.out_dir",
    "run.name",
    "run.tensorboard",
    "ravnest.host",
    "ravnest.timeout_s",
    "ravnest.kill_at",
    "train.checkpoint_every",
    "train.keep_checkpoints",
    "train.log_every",
    "train.eval_every",
)


class Plan(NamedTuple):
    """Everything the nodes of a run agree on.

    Attributes:
      run_id: the id every message carries.
      pool: the config's node mappings, in pool order.
      workers: the non-backup nodes as :class:`~zeroth.cluster.formation.Node` (formation indices).
      formation: the clusters (indices into ``workers``).
      stages: per cluster, per stage, its :class:`~zeroth.cluster.formation.Stage` (unit range).
      block_ranges: per cluster, per stage, its transformer block range.
      layouts: per cluster, per stage, its ``[start, stop)`` in the flat parameter vector.
      rings: the rings of the multi-ring averaging.
      slots: ``{name: (cluster, stage)}`` of every node, backups included.
      primaries, backups: ``{(cluster, stage): name}``.
      peak_bytes, message_bytes, n_params: the numbers the formation used.
      slowdown: ``{name: factor ≥ 1}``: compute emulated at ``1 / speed`` (a speed above 1 runs at this machine's).
      join_round: per cluster, the averaging round it joins at (0: from the start).
      average_every: ``R``.
      units: the model's parameter groups in flat order (:func:`zeroth.cluster.engine.model_units`).
      backup_round: ``{backup name: round}``: 0 for a backup that shadows from the start, ``r`` for
        one that joins after round ``r`` (its primary hands it its state then).
    """

    run_id: str
    pool: tuple[dict, ...]
    workers: tuple[_formation.Node, ...]
    formation: _formation.Formation
    stages: tuple
    block_ranges: tuple
    layouts: tuple
    rings: tuple
    slots: dict
    primaries: dict
    backups: dict
    peak_bytes: int
    message_bytes: int
    n_params: int
    slowdown: dict
    join_round: tuple = ()
    average_every: int = 0
    backup_round: dict = {}
    units: tuple = ()


def run_id_of(cfg: _config.Config) -> str:
    """First 16 hex digits of the config digest without the deployment fields."""
    return _config.config_digest(cfg, exclude=RUN_ID_EXCLUDE)[:16]


def examples_of(cfg: _config.Config) -> _examples.Examples:
    """The fixed example set (byte tokens)."""
    r = cfg.ravnest
    return _sbuild.examples_of(cfg.data.dataset, r.examples, r.seq_len, "bytes")


def model_of(cfg: _config.Config, ex: _examples.Examples) -> tuple[Any, dict]:
    """``(model, params)`` of the whole transformer, exactly initialised from ``run.seed``."""
    return _sbuild.transformer_of(cfg, ex, cfg.ravnest.objective, cfg.ravnest.seq_len)


def _node(d: dict) -> _formation.Node:
    return _formation.Node(
        d["name"], float(d["ram_mb"]) * MB, float(d["bandwidth_mbps"]) * 1e6, float(d.get("speed", 1.0))
    )


def plan_of(cfg: _config.Config, ex: _examples.Examples | None = None, model: tuple[Any, dict] | None = None) -> Plan:
    """The run's plan (see the module docstring); ``model``: :func:`model_of` when the caller has it already.

    Raises:
      zeroth.cluster.formation.InfeasibleError: the pool cannot hold ``ravnest.clusters`` copies of the model.
      ValueError: a backup fits no primary's stage.
    """
    r = cfg.ravnest
    ex = examples_of(cfg) if ex is None else ex
    _, params = model_of(cfg, ex) if model is None else model
    n_blocks = sum(1 for k in params if k.startswith("_Block_"))
    units = tuple(_engine.model_units(n_blocks))
    ubytes = _engine.unit_bytes(params, units)
    n_params = sum(ubytes) // 4
    d = int(params["Embed_0"]["embedding"].shape[1])
    message = cfg.data.batch_size * r.seq_len * d * 4
    peak = _formation.peak_memory_bytes(sum(ubytes), message * (4 * n_blocks + 2))
    pool = tuple(dict(n) for n in r.nodes)
    initial = [_node(n) for n in pool if not n.get("backup", False) and "join_round" not in n]
    max_nodes = len(units)
    form = _formation.form_clusters(
        initial,
        r.clusters,
        peak,
        message,
        seed=cfg.run.seed,
        population=r.population,
        generations=r.generations,
        max_cluster_nodes=max_nodes,
    )
    layer_bytes = [STATE_PER_PARAM_BYTE * b for b in ubytes]
    stages = list(_formation.plan_stages(form, initial, layer_bytes))
    join_round = [0] * len(stages)
    workers = list(initial)
    for rnd in sorted({n["join_round"] for n in pool if "join_round" in n and not n.get("backup", False)}):
        group = [_node(n) for n in pool if n.get("join_round") == rnd and not n.get("backup", False)]
        ram = sum(g.ram_bytes for g in group)
        if ram < peak:
            raise _formation.InfeasibleError(
                f"the nodes joining at round {rnd} ({', '.join(g.name for g in group)}) have {ram / MB:.2f} MB of RAM, "
                f"a cluster needs the model's peak memory {peak / MB:.2f} MB: {(peak - ram) / MB:.2f} MB short"
            )
        try:
            ranges = _formation.split_layers([g.ram_bytes for g in group], layer_bytes, names=[g.name for g in group])
        except ValueError as err:
            raise ValueError(f"the cluster joining at round {rnd}: {err}") from err
        stages.append(tuple(_formation.Stage(len(workers) + i, a, b) for i, (a, b) in enumerate(ranges)))
        workers += group
        join_round.append(rnd)
    stages, workers = tuple(stages), tuple(workers)
    offsets = np.concatenate([[0], np.cumsum(np.asarray(ubytes) // 4)]).astype(int)
    layouts = tuple(tuple((int(offsets[st.start]), int(offsets[st.stop])) for st in cl) for cl in stages)
    block_ranges = tuple(
        tuple(_engine.unit_ranges_to_blocks([(st.start, st.stop) for st in cl], n_blocks)) for cl in stages
    )
    rings = tuple(_rings.plan_rings([layouts[c] for c in range(len(stages)) if join_round[c] == 0]))
    slots = {workers[st.node].name: (c, s) for c, cl in enumerate(stages) for s, st in enumerate(cl)}
    primaries = {v: k for k, v in slots.items()}
    backups: dict = {}
    by_name = {w.name: w for w in workers}
    for n in pool:
        if not n.get("backup", False):
            continue
        ram = float(n["ram_mb"]) * MB
        order = sorted(
            primaries.items(), key=lambda kv: (by_name[kv[1]].bandwidth_bps, [w.name for w in workers].index(kv[1]))
        )
        for slot, name in order:
            c, s = slot
            st = stages[c][s]
            need = STATE_PER_PARAM_BYTE * sum(ubytes[st.start : st.stop])
            if slot not in backups and need <= ram:
                backups[slot] = n["name"]
                slots[n["name"]] = slot
                break
        else:
            raise ValueError(
                f"config field ravnest.nodes: backup {n['name']!r} ({n['ram_mb']} MB) fits no stage without a backup; "
                f"give it more RAM or remove it"
            )
    speeds = {n["name"]: float(n.get("speed", 1.0)) for n in pool}
    return Plan(
        run_id_of(cfg),
        pool,
        workers,
        form,
        stages,
        block_ranges,
        layouts,
        rings,
        slots,
        primaries,
        backups,
        int(peak),
        int(message),
        int(n_params),
        {k: max(1.0, 1.0 / v) for k, v in speeds.items()},
        tuple(join_round),
        r.average_every,
        {n["name"]: int(n.get("join_round", 0)) for n in pool if n.get("backup", False)},
        units,
    )


def sizes_of(cfg: _config.Config, plan: Plan) -> _wire.Sizes:
    """What one message of the run can hold: an activation or gradient is ``(batch_size, seq_len, width)``,
    a ring chunk or join piece at most the largest stage's slice ``L``, a handed state at most
    ``4 L (STATE_PER_PARAM_BYTE + S + 1)`` bytes (parameters, optimizer state, up to ``S`` stashed
    parameter copies and a ring box, ``S`` the longest pipeline) plus ``3 S`` activations and 1 MiB."""
    b, t = cfg.data.batch_size, cfg.ravnest.seq_len
    width = plan.message_bytes // (4 * b * t)
    slice_values = max(hi - lo for cl in plan.layouts for lo, hi in cl)
    depth = max(len(cl) for cl in plan.stages)
    state = 4 * slice_values * (STATE_PER_PARAM_BYTE + depth + 1) + 3 * depth * plan.message_bytes + MB
    return _wire.Sizes((b, t, width), int(slice_values), int(state))


def active_clusters(plan: Plan, round_id: int) -> list[int]:
    """The clusters that average at round ``round_id`` (joined at or before it), in cluster order."""
    return [c for c, j in enumerate(plan.join_round) if j <= round_id]


def rings_at(plan: Plan, round_id: int) -> tuple[list[int], list[_rings.Ring]]:
    """``(active clusters, their rings)`` at averaging round ``round_id``; a ring's ``members[i]`` is
    the stage of cluster ``active[i]``."""
    active = active_clusters(plan, round_id)
    return active, _rings.plan_rings([plan.layouts[c] for c in active])


def first_batch(plan: Plan, cluster: int) -> int:
    """The first batch of ``cluster``: 0, or ``(r − 1)·R`` for a cluster joining at round ``r``."""
    r = plan.join_round[cluster]
    return 0 if r == 0 else (r - 1) * plan.average_every


def join_pieces(plan: Plan, slot: tuple[int, int]) -> list[tuple[tuple[int, int], int, int]]:
    """What stage ``slot`` of a late cluster fetches before its first batch: ``[(provider slot, start, stop), ...]``.

    The providers are the first cluster's stages; a late cluster joining at round 1 starts from the
    initial parameters and fetches nothing.
    """
    c, s = slot
    if plan.join_round[c] <= 1:
        return []
    a, b = plan.layouts[c][s]
    out = []
    for s0, (a0, b0) in enumerate(plan.layouts[0]):
        lo, hi = max(a, a0), min(b, b0)
        if lo < hi:
            out.append(((0, s0), lo, hi))
    return out


def push_pieces(plan: Plan, slot: tuple[int, int], round_id: int) -> list[tuple[tuple[int, int], int, int]]:
    """What stage ``slot`` sends after averaging round ``round_id``: ``[(late slot, start, stop), ...]`` for the
    clusters joining at round ``round_id + 1`` (only the first cluster provides)."""
    if slot[0] != 0:
        return []
    out = []
    for c, j in enumerate(plan.join_round):
        if j == round_id + 1 and j > 1:
            for s in range(len(plan.layouts[c])):
                out += [((c, s), lo, hi) for prov, lo, hi in join_pieces(plan, (c, s)) if prov == slot]
    return out


def holder(plan: Plan, slot: tuple[int, int], killed=()) -> str:
    """The node that ends holding ``slot``: its primary, or the backup that took over when it was killed."""
    name = plan.primaries[slot]
    return plan.backups[slot] if name in killed else name


def stage_of(
    cfg: _config.Config, plan: Plan, name: str, ex: _examples.Examples, model: tuple[Any, dict] | None = None
) -> _engine.AsyncStage:
    """Node ``name``'s stage: its slice of the initial parameters, its optimizer, its emulated speed
    (``model``: :func:`model_of`, when the caller has it already)."""
    c, s = plan.slots[name]
    model, params = model_of(cfg, ex) if model is None else model
    part = _partition.transformer_partition(
        params,
        list(plan.block_ranges[c]),
        objective=cfg.ravnest.objective,
        heads=model.heads,
        mlp_dim=model.mlp_dim,
        pad_id=ex.pad_id,
    )
    return _engine.AsyncStage(
        s,
        len(plan.block_ranges[c]),
        part.fns[s],
        part.params[s],
        _sbuild.optimizer_of(cfg),
        slowdown=plan.slowdown[name],
    )


def data_of(cfg: _config.Config, ex: _examples.Examples, cluster: int, n_clusters: int):
    """``batch -> (tokens, labels)`` of cluster ``cluster``."""

    def data(b: int):
        ids = _driver.batch_ids(cfg.run.seed, cluster, n_clusters, b, cfg.data.batch_size, cfg.ravnest.examples)
        return ex.tokens[ids], ex.labels[ids]

    return data


def average_round(
    plan: Plan, slot: tuple[int, int], flat: np.ndarray, round_id: int, exchange: _rings.Exchange, timeout_s: float
) -> np.ndarray:
    """Stage ``slot``'s part of averaging round ``round_id`` over ``exchange`` (peers are slots): its rings
    among the active clusters, then the pieces the clusters joining next round fetch. Returns its averaged slice."""
    c, s = slot
    active, rings = rings_at(plan, round_id)
    start = plan.layouts[c][s][0]
    avg = _rings.average_node(
        flat,
        start,
        rings,
        active.index(c),
        s,
        exchange,
        round_id=round_id,
        timeout_s=timeout_s,
        peer_of=lambda ci, node: (active[ci], node),
    )
    for dest, lo, hi in push_pieces(plan, slot, round_id):
        exchange.send(dest, (0, round_id, "join", s), avg[lo - start : hi - start])
    return avg


def fetch_start(
    plan: Plan, slot: tuple[int, int], flat: np.ndarray, exchange: _rings.Exchange, timeout_s: float
) -> np.ndarray:
    """A late stage's starting slice: ``flat`` (its initial parameters) with every piece of :func:`join_pieces`
    replaced by what the first cluster averaged at the round before it joins."""
    c, s = slot
    a = plan.layouts[c][s][0]
    out = np.array(flat, np.float32, copy=True)
    r = plan.join_round[c] - 1
    for prov, lo, hi in join_pieces(plan, slot):
        piece = np.asarray(exchange.recv(prov, (0, r, "join", prov[1]), timeout_s), np.float32)
        if piece.shape != (hi - lo,):
            raise ValueError(f"join piece from stage {prov} has {piece.size} values, expected {hi - lo}")
        out[lo - a : hi - a] = piece
    return out
