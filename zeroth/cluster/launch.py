"""``zeroth run CONFIG`` with a ``ravnest:`` section: every node of the pool as a process on 127.0.0.1.

:func:`run_config` prints the clusters the genetic algorithm formed and the stages inside each,
writes ``OUT/config.yaml`` and ``OUT/plan.json``, makes a fresh run secret (passed to the nodes in
``ZEROTH_SECRET``) and starts ``zeroth node`` (``python -m zeroth.cluster.node``) for every node,
backups included, into ``OUT/nodes/<name>/``. ``ravnest.kill_at[i]``: when the primary shadowed by
the ``i``-th backup has reached that update count (and, for a backup that joins later, has handed it
its state), the launcher SIGKILLs it and the backup takes over. A primary that stops answering
(its process frozen, its host gone) is dropped by the others once their streams to it break
(keepalive, :mod:`zeroth.transport.channels`) and its backup takes over; if it is still running
once every other node finished, its backup in its place, the launcher SIGKILLs it too
(:func:`wait_nodes`) and the run ends normally.
When a node fails otherwise the others are stopped and the exit code is 1.

At the end it merges the nodes' rows (metrics schema v1, one ``train`` row per update of each node,
:func:`zeroth.cluster.node.row_of`) into ``OUT/metrics.jsonl`` in time order (with TensorBoard event
files beside it when ``run.tensorboard``; :func:`merge_records`) and writes ``OUT/summary.json``:
per cluster its last stage's final loss and its model's digest (the stages' final slices laid end
to end), whether every cluster ends on the same parameters (they do when the last update is an
averaging round), the loss of the first cluster's model on the whole example set before and after
training, per node its idle fraction, and the formation.

Every node checkpoints (:mod:`zeroth.cluster.checkpoint`); ``zeroth run CONFIG --out OUT --resume``
restarts every node from the newest update count all of them hold (``--resume-step K``: from ``K``)
after a run stopped, a node without a backup killed included, and ends where the uninterrupted run
would. Runs with nodes joining later (``join_round``) do not resume yet.
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

from zeroth import config as _config
from zeroth.cluster import build as _build
from zeroth.cluster import checkpoint as _ckpt
from zeroth.cluster import engine as _engine
from zeroth.cluster import formation as _formation
from zeroth.stages import partition
from zeroth.train.metrics import MetricsWriter, read_metrics
from zeroth.train.metrics import clear as clear_metrics
from zeroth.transport import identity, processes

__all__ = ["cluster_models", "evaluate", "merge_records", "node_dir", "run_config", "start_nodes", "wait_nodes"]


def node_dir(out: Path, name: str) -> Path:
    """``OUT/nodes/<name>``."""
    return Path(out) / "nodes" / name


def _plan_json(plan: _build.Plan) -> dict:
    return {
        "run_id": plan.run_id,
        "clusters": [[plan.workers[st.node].name for st in cl] for cl in plan.stages],
        "unit_ranges": [[[st.start, st.stop] for st in cl] for cl in plan.stages],
        "block_ranges": [[list(b) for b in cl] for cl in plan.block_ranges],
        "layouts": [[list(x) for x in cl] for cl in plan.layouts],
        "rings": [
            {"ring": r.ring_id, "start": r.start, "stop": r.stop, "members": list(r.members)} for r in plan.rings
        ],
        "backups": {plan.primaries[k]: v for k, v in plan.backups.items()},
        "join_round": list(plan.join_round),
        "average_every": plan.average_every,
        "peak_bytes": plan.peak_bytes,
        "message_bytes": plan.message_bytes,
        "n_params": plan.n_params,
        "formation": {
            "fitness": plan.formation.fitness,
            "spread_s": plan.formation.spread_s,
            "ram_bytes": list(plan.formation.ram_bytes),
            "transfer_s": list(plan.formation.transfer_s),
            "generations": plan.formation.generations,
        },
    }


def start_nodes(
    cfg: _config.Config,
    out: Path,
    plan: _build.Plan,
    *,
    quiet: bool = True,
    insecure: bool = False,
    resume_step: int | None = None,
) -> dict[str, subprocess.Popen]:
    """Start one ``zeroth node`` process per node of the pool (from their checkpoints of ``resume_step``);
    returns them by name."""
    out = Path(out)
    cfg_path = out / "config.yaml"
    env = identity.launch_env(insecure)
    procs = {}
    for n in plan.pool:
        name = n["name"]
        d = node_dir(out, name)
        d.mkdir(parents=True, exist_ok=True)
        cmd = [
            sys.executable,
            "-m",
            "zeroth.cluster.node",
            "--config",
            str(cfg_path),
            "--name",
            name,
            "--out",
            str(d),
            "--addresses",
            str(out / "addresses"),
        ]
        cmd += ["--quiet"] if quiet else []
        cmd += ["--insecure"] if insecure else []
        cmd += ["--resume-step", str(resume_step)] if resume_step is not None else []
        procs[name] = processes.start(cmd, d / "node.log", env=env, append=resume_step is not None)
    return procs


def _progress(out: Path, name: str) -> tuple[int, bool]:
    """``(its update count, handed its state to a backup)`` of node ``name`` so far (the count of a late
    cluster's stage starts where the cluster does)."""
    path = node_dir(out, name) / "metrics.jsonl"
    if not path.is_file():
        return 0, False
    recs = read_metrics(path, kind="train")
    return max((r["step"] for r in recs), default=0), any("handover_backup" in r for r in recs)


def merge_records(out: Path, names: list[str]) -> list[dict]:
    """Every node's rows (``OUT/nodes/<name>/metrics.jsonl``) in one list ordered by ``time_unix_s`` (ties:
    the nodes' order, then each node's own order); each row names its ``node``, so the steps of every
    node still never decrease (the metrics schema's rule for merged rows)."""
    records = []
    for i, name in enumerate(names):
        path = node_dir(out, name) / "metrics.jsonl"
        if path.is_file():
            records += [(r["time_unix_s"], i, j, r) for j, r in enumerate(read_metrics(path))]
    return [r for *_, r in sorted(records, key=lambda x: x[:3])]


def _took_over(out: Path, backup: str) -> bool:
    """Backup ``backup`` finished holding its primary's slot (its summary says so)."""
    path = node_dir(out, backup) / "summary.json"
    try:
        return bool(json.loads(path.read_text()).get("took_over"))
    except (OSError, ValueError):
        return False


def _superseded(procs: dict, out: Path, backup_of: dict[str, str], killed=()) -> list[str]:
    """The nodes still running once every other node exited with code 0 (or was ``killed`` on cue),
    each a primary whose backup finished holding its slot (the others stopped talking to it: it
    froze, or its host went away, and the streams to it broke). Empty unless all the running nodes
    are such primaries."""
    running = [n for n, p in procs.items() if p.poll() is None]
    if not running or any(p.poll() not in (None, 0) for n, p in procs.items() if n not in killed):
        return []
    ok = all(n in backup_of and procs[backup_of[n]].poll() == 0 and _took_over(out, backup_of[n]) for n in running)
    return running if ok else []


def wait_nodes(
    procs: dict,
    out: Path,
    kills: dict[str, tuple[int, bool]],
    timeout_s: float,
    progress: bool,
    backup_of: dict[str, str] | None = None,
) -> tuple[int, list[str]]:
    """Wait for every node, killing ``{primary: (updates, after its handover)}`` on cue, and the primaries
    of ``backup_of`` (``{primary: backup}``) left running after their backups finished in their place
    (:func:`_superseded`). Returns (code, killed names)."""
    killed: list[str] = []
    names = list(procs)

    def tick() -> None:
        for name, (at, handover) in kills.items():
            done, handed = _progress(out, name) if name not in killed else (0, False)
            if name not in killed and procs[name].poll() is None and done >= at and (handed or not handover):
                procs[name].send_signal(signal.SIGKILL)
                killed.append(name)
                if progress:
                    print(f"killed node {name} after {at} updates; its backup takes over", flush=True)
        for name in _superseded(procs, out, backup_of or {}, killed):
            procs[name].send_signal(signal.SIGKILL)  # SIGKILL ends a stopped (SIGSTOP) process too
            procs[name].wait()
            killed.append(name)
            if progress:
                print(
                    f"killed node {name}: it did not finish, and its backup {backup_of[name]} finished in its place",
                    flush=True,
                )

    processes.watch(
        list(procs.values()),
        tick,
        failed=lambda i, p: names[i] not in killed and p.poll() not in (None, 0),
        timeout_s=timeout_s,
    )
    bad = [n for n, p in procs.items() if n not in killed and p.wait() != 0]
    for n in bad:
        print(processes.exit_line(f"node {n}", procs[n].returncode, node_dir(out, n) / "node.log"), file=sys.stderr)
    return (1 if bad else 0), killed


def cluster_models(out: Path, plan: _build.Plan, killed=()) -> list[np.ndarray]:
    """Each cluster's final model: its stages' final slices (from the node that ended holding each) end to end."""
    models = []
    for c, cl in enumerate(plan.stages):
        parts = []
        for s in range(len(cl)):
            parts.append(np.load(node_dir(out, _build.holder(plan, (c, s), killed)) / "params.npz")["flat"])
        models.append(np.concatenate(parts))
    return models


def evaluate(cfg: _config.Config, plan: _build.Plan, ex, model: tuple, flat: np.ndarray | None) -> float:
    """Mean loss over the whole example set ``ex`` of ``model`` (:func:`zeroth.cluster.build.model_of`) with the
    flat parameters ``flat`` (None: its initial parameters)."""
    import jax.numpy as jnp

    model, params = model
    n_blocks = len(plan.units) - 2
    if flat is not None:
        params = _engine.with_flat(params, plan.units, flat)
    part = partition.transformer_partition(
        params,
        [(0, n_blocks)],
        objective=cfg.ravnest.objective,
        heads=model.heads,
        mlp_dim=model.mlp_dim,
        pad_id=ex.pad_id,
    )
    return float(partition.reference_loss(part, part.params, jnp.asarray(ex.tokens), jnp.asarray(ex.labels)))


def _resume_step(out: Path, plan: _build.Plan, argv: list[str]) -> int:
    """The update count ``--resume`` restarts from: ``--resume-step K`` in ``argv``, or the newest every node
    holds a checkpoint of (raises ValueError naming what is missing)."""
    if any(plan.join_round) or any(plan.backup_round.values()):
        raise ValueError(
            "--resume: a Ravnest run with nodes joining later (join_round) cannot resume yet; start a new run"
        )
    folders = [_ckpt.folder_of(node_dir(out, n["name"])) for n in plan.pool]
    given = [a.split("=", 1)[1] for a in argv if a.startswith("--resume-step=")]
    given += [argv[i + 1] for i, a in enumerate(argv[:-1]) if a == "--resume-step"]
    if given:
        k = int(given[-1])
        missing = [f.parent.name for f in folders if k not in _ckpt.steps(f)]
        if missing:
            raise ValueError(f"--resume-step {k}: nodes {missing} hold no checkpoint of update {k} in {out}")
        return k
    k = _ckpt.common_step(folders)
    if k is None:
        raise ValueError(
            f"--resume: no checkpoint update count common to every node of {out} "
            f"({', '.join(f'{f.parent.name}: {_ckpt.steps(f)}' for f in folders)})"
        )
    return k


def run_config(cfg: _config.Config, out: Path, argv: list[str], progress: bool = True) -> int:
    """Run the Ravnest pool of ``cfg`` as node processes into ``out``. Exit code."""
    out = Path(out)
    r = cfg.ravnest
    resume = "--resume" in argv
    if not resume and (out / "nodes").is_dir() and any((out / "nodes").iterdir()):
        print(
            f"zeroth run: error: {out} already holds a Ravnest run; choose another --out, or --resume it",
            file=sys.stderr,
        )
        return 2
    try:
        ex = _build.examples_of(cfg)
        model = _build.model_of(cfg, ex)
        plan = _build.plan_of(cfg, ex, model)
        resume_step = _resume_step(out, plan, argv) if resume else None
    except ValueError as e:
        print(f"zeroth run: error: {e}", file=sys.stderr)
        return 2
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.yaml").write_text(_config.to_yaml(cfg))
    plan_json = _plan_json(plan)
    (out / "plan.json").write_text(json.dumps(plan_json, indent=1))
    if progress:
        print(_formation.describe(plan.formation, list(plan.workers)))
        for c, cl in enumerate(plan.stages):
            print(
                f"cluster {c}"
                + (f" (joins at round {plan.join_round[c]})" if plan.join_round[c] else "")
                + ": "
                + " -> ".join(
                    f"{plan.workers[st.node].name} blocks {list(b)}" for st, b in zip(cl, plan.block_ranges[c])
                )
            )
        print(
            f"{len(plan.rings)} rings average every {r.average_every} updates; backups: "
            + (", ".join(f"{v} shadows {plan.primaries[k]}" for k, v in plan.backups.items()) or "none"),
            flush=True,
        )
    backups = [n["name"] for n in plan.pool if n.get("backup", False)]
    kills = {}
    for b, at in zip(backups, r.kill_at):
        slot = plan.slots[b]
        if resume_step is None or at > resume_step:
            kills[plan.primaries[slot]] = (at, plan.backup_round.get(b, 0) > 0)
    if resume_step is not None:
        for f in (out / "addresses").glob("*"):  # the stopped run's addresses: every node writes its new one
            f.unlink()
        if progress:
            print(f"resuming every node from its checkpoint after update {resume_step}", flush=True)
    t0 = time.time()
    procs = start_nodes(cfg, out, plan, quiet=not progress, resume_step=resume_step)
    backup_of = {plan.primaries[slot]: b for slot, b in plan.backups.items()}
    code, killed = wait_nodes(procs, out, kills, timeout_s=r.timeout_s * 4, progress=progress, backup_of=backup_of)
    if code != 0:
        k = _ckpt.common_step([_ckpt.folder_of(node_dir(out, n["name"])) for n in plan.pool])
        if k is not None and not any(plan.join_round) and not any(plan.backup_round.values()):
            again = [
                a
                for i, a in enumerate(argv)
                if a != "--resume" and not a.startswith("--resume-step") and (i == 0 or argv[i - 1] != "--resume-step")
            ]
            print(
                f"zeroth run: every node holds a checkpoint after update {k}; continue with "
                f"`zeroth run {' '.join(again)} --resume`",
                file=sys.stderr,
            )
        return code
    records = merge_records(out, [n["name"] for n in plan.pool])
    clear_metrics(out / "metrics.jsonl")
    with MetricsWriter(out / "metrics.jsonl", tensorboard=cfg.run.tensorboard) as writer:
        for rec in records:
            writer.write(rec)
    nodes = {
        n["name"]: json.loads((node_dir(out, n["name"]) / "summary.json").read_text())
        for n in plan.pool
        if n["name"] not in killed and (node_dir(out, n["name"]) / "summary.json").is_file()
    }
    models = cluster_models(out, plan, killed)
    agree = all(np.array_equal(models[0], m) for m in models[1:])
    last = {c: _build.holder(plan, (c, len(cl) - 1), killed) for c, cl in enumerate(plan.stages)}
    summary = {
        "steps": cfg.train.steps,
        "seconds": time.time() - t0,
        "run_id": plan.run_id,
        "clusters": [
            {
                "cluster": c,
                "nodes": [plan.workers[st.node].name for st in cl],
                "final_loss": nodes[last[c]]["final_loss"],
                "digest": _engine.flat_digest(models[c]),
            }
            for c, cl in enumerate(plan.stages)
        ],
        "clusters_agree": agree,
        "killed": killed,
        "initial_eval_loss": evaluate(cfg, plan, ex, model, None),
        "eval_loss": evaluate(cfg, plan, ex, model, models[0]),
        "idle_fraction": {k: v["idle_s"] / max(v["wall_s"], 1e-9) for k, v in nodes.items()},
        "nodes": nodes,
        "plan": plan_json,
    }
    (out / "summary.json").write_text(json.dumps(summary, indent=1))
    if progress:
        losses = ", ".join(f"cluster {x['cluster']} {x['final_loss']:.4f}" for x in summary["clusters"])
        print(
            f"ravnest done: {cfg.train.steps} batches per cluster, final loss {losses}, clusters agree: {agree}, "
            f"loss on all {cfg.ravnest.examples} examples {summary['initial_eval_loss']:.4f} -> {summary['eval_loss']:.4f} "
            f"(first cluster's model), {summary['seconds']:.1f}s"
        )
    return 0
