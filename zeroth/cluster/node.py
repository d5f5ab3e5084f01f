"""``zeroth node``: run one Ravnest node (one per machine, or several on one machine).

  zeroth node --config CONFIG --name NAME --out DIR [--addresses DIR] [--listen HOST:PORT] [--advertise HOST]
              [--tls-cert PEM --tls-key PEM --tls-ca PEM [--tls-mutual]]
              [--set SECTION.FIELD=VALUE ...] [--resume-step K] [--insecure] [--quiet]

Every node reads the same config and derives the same plan (:func:`zeroth.cluster.build.plan_of`:
clusters, stages, rings, backups). It listens on ``--listen`` (port 0 = any) and writes its
address to ``ADDRESSES/<NAME>``, where it also finds the others' (a shared folder; default
``DIR/../addresses``). Calls carry the access token derived from the run secret in
``ZEROTH_SECRET`` (``--insecure``: none, loopback experiments only).

It writes into ``DIR``: ``metrics.jsonl`` (metrics schema v1, :mod:`zeroth.train.metrics`, with
TensorBoard event files beside it when ``run.tensorboard``: one ``train`` row per update of this
node's stage, see :func:`row_of`), ``params.npz`` (its
final slice of the flat parameter vector) and ``summary.json`` (totals: idle, compute, averaging,
wall seconds, bytes sent per receiver, the slice's digest, whether it took over as a backup) and
``checkpoints/<k>.npz`` after its ``k``-th update every ``train.checkpoint_every`` updates (0: at
every averaging round) and at the end (:mod:`zeroth.cluster.checkpoint`). ``--resume-step K``
continues from checkpoint ``K`` (every node of the run from the same ``K``: ``zeroth run --resume``);
its rows after update ``K`` are dropped from ``metrics.jsonl`` and written again.

Exit codes: 0 done; 1 a node it depends on went away without a backup, or a wait timed out;
2 a bad command line, config or checkpoint.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

__all__ = ["build_parser", "main", "row_of", "run_node_process"]


def row_of(
    rec: dict,
    *,
    node: str,
    cluster: int,
    stage: int,
    digest: str,
    lr: float,
    time_unix_s: float,
    wall_time_s: float,
    step_time_s: float,
    payload_bytes: int,
    payload_bytes_total: int,
) -> dict:
    """One ``train`` row of the metrics schema from an update record of :func:`zeroth.cluster.driver.run_node`.

    ``step`` is the stage's update count after the update (a late cluster's count starts at its
    first batch), ``digest`` :func:`zeroth.replay.checksum` of the stage's parameters after it (and
    after its averaging round, if it had one), ``forward_passes`` the batches this stage has
    forwarded, ``loss`` the last stage's batch loss (None on the other stages), ``step_time_s`` the
    seconds since the node's previous row, ``payload_bytes`` (``_total``) the bytes this node sent
    since its previous row (since it started): activations, gradients, averaging-ring chunks and a
    handed state. Ravnest's own fields: ``node``, ``cluster``, ``stage``, ``batch``, ``staleness``
    (updates between the batch's forward and its update), ``idle_s`` and ``compute_s`` (of this
    update), and where they happened ``average_round`` and ``average_s`` (the averaging round this
    update ended with) and ``handover_backup``, ``handover_round``, ``state_bytes`` (this primary
    handed its state to a backup joining late, after that round).
    """
    extra = {k: v for k, v in rec.items() if k not in ("kind", "step", "loss", "forward_passes")}
    return {
        "kind": "train",
        "step": rec["step"],
        "time_unix_s": time_unix_s,
        "wall_time_s": wall_time_s,
        "digest": digest,
        "forward_passes": rec["forward_passes"],
        "payload_bytes_total": payload_bytes_total,
        "loss": rec["loss"],
        "lr": lr,
        "step_time_s": step_time_s,
        "payload_bytes": payload_bytes,
        "node": node,
        "cluster": cluster,
        "stage": stage,
        **extra,
    }


def build_parser() -> argparse.ArgumentParser:
    """The argument parser of ``zeroth node``."""
    p = argparse.ArgumentParser(prog="zeroth node", description="Run one Ravnest node (seed 003).")
    p.add_argument("--config", required=True, help="experiment YAML with a ravnest: section (the same on every node)")
    p.add_argument("--name", required=True, help="this node's name in ravnest.nodes")
    p.add_argument("--out", required=True, help="this node's output folder")
    p.add_argument(
        "--addresses", default=None, help="folder where every node writes its address (default: OUT/../addresses)"
    )
    p.add_argument("--listen", default=None, help="HOST:PORT to serve on (default: ravnest.host, any port)")
    p.add_argument(
        "--advertise",
        default=None,
        metavar="HOST",
        help="the host the other nodes reach this one at, written to ADDRESSES/NAME (default: the --listen host)",
    )
    p.add_argument(
        "--set", dest="overrides", action="append", default=[], metavar="SECTION.FIELD=VALUE", help="config override"
    )
    p.add_argument(
        "--resume-step",
        type=int,
        default=None,
        metavar="K",
        help="continue from this node's checkpoint after update K (every node of the run from the same K)",
    )
    p.add_argument("--insecure", action="store_true", help="no access token (loopback experiments only)")
    p.add_argument("--quiet", action="store_true", help="no progress lines")
    from zeroth.transport import security

    security.add_tls_arguments(p)
    return p


def run_node_process(
    cfg,
    name: str,
    out: Path,
    addresses: Path,
    listen: str | None,
    token: str | None,
    progress: bool = False,
    advertise: str | None = None,
    tls=None,
    secret: str | None = None,
    resume_step: int | None = None,
) -> dict:
    """Run node ``name`` of the run of ``cfg`` to the end; returns its summary. ``advertise``: the host
    the other nodes reach this one at (written to ``ADDRESSES/<name>`` with the bound port; default
    the ``listen`` host). ``tls``: every link over TLS (:class:`zeroth.transport.security.TLSFiles`).
    ``secret``: the run secret (this node proves it holds it with its key and checks the others' proofs).
    ``resume_step``: continue from this node's checkpoint of that update count."""
    import numpy as np

    from zeroth.cluster import build, driver, engine, transport
    from zeroth.cluster import checkpoint as _ckpt
    from zeroth.replay import checksum
    from zeroth.train import metrics as _metrics

    r = cfg.ravnest
    ex = build.examples_of(cfg)
    model = build.model_of(cfg, ex)
    plan = build.plan_of(cfg, ex, model)
    if name not in plan.slots:
        raise ValueError(f"--name {name!r} is not a node of ravnest.nodes ({[n['name'] for n in plan.pool]})")
    c, s = plan.slots[name]
    out.mkdir(parents=True, exist_ok=True)
    stage = build.stage_of(cfg, plan, name, ex, model)
    units = plan.units
    bw = {n["name"]: float(n["bandwidth_mbps"]) for n in plan.pool}
    t = transport.ClusterTransport(
        name,
        plan.slots,
        plan.primaries,
        plan.backups,
        run_id=plan.run_id,
        token=token,
        address_dir=addresses,
        bandwidth_mbps=bw,
        enforce=r.enforce_bandwidth,
        latency_s=r.latency_ms / 1e3,
        timeout_s=r.timeout_s,
        node_latency_s={n["name"]: float(n.get("latency_ms", 0.0)) / 1e3 for n in plan.pool},
        backup_round=plan.backup_round,
        tls=tls,
        secret=secret,
        sizes=build.sizes_of(cfg, plan),
    )
    metrics = out / "metrics.jsonl"
    folder = _ckpt.folder_of(out)
    wall0, payload0, kept = 0.0, 0, []
    if resume_step is not None:
        if any(plan.join_round) or any(plan.backup_round.values()):
            raise _ckpt.CheckpointError("--resume-step: a run with nodes joining later (join_round) cannot resume yet")
        arrays, kept, meta = _ckpt.load(folder, resume_step, plan.run_id, name)
        stage.restore(t.restore_arrays(arrays), units)
        wall0, payload0 = float(meta["wall_time_s"]), int(meta["payload_bytes_total"])
        _metrics.truncate_after(metrics, resume_step)
        if stage.version != resume_step:
            raise _ckpt.CheckpointError(
                f"checkpoint {folder / f'{resume_step}.npz'} holds update {stage.version}, not {resume_step}"
            )
    else:
        _metrics.clear(metrics)
    every = cfg.train.checkpoint_every or r.average_every
    t.serve(listen or f"{r.host}:0", advertise=advertise)
    t.wait_for_nodes([n["name"] for n in plan.pool], r.timeout_s)  # every node serves before any sends
    t.resend(kept)  # what the others may not have received before the run stopped
    io = transport.NodeLink(t, plan, r.timeout_s)
    writer = _metrics.MetricsWriter(metrics, tensorboard=cfg.run.tensorboard, resumed_after=resume_step)
    role = "backup" if plan.primaries[(c, s)] != name else "primary"
    handed: dict = {}
    last = {"t": time.perf_counter(), "sent": payload0}
    t_wall = last["t"]

    def save_checkpoint(row: dict) -> None:
        k = stage.version
        arrays = t.state_arrays(stage.snapshot(units))
        sent = t.unreceived(k, k // r.average_every if r.average_every else 0)
        meta = {
            "run_id": plan.run_id,
            "node": name,
            "slot": [c, s],
            "wall_time_s": row["wall_time_s"],
            "payload_bytes_total": row["payload_bytes_total"],
        }
        _ckpt.save(folder, k, arrays, sent, meta, keep=cfg.train.keep_checkpoints)

    def record(rec: dict) -> None:
        now, sent = time.perf_counter(), sum(dict(t.bytes_sent).values()) + payload0
        if handed and "handover_round" not in last:  # the handover happened in this update's averaging round
            last["handover_round"] = handed["round"]
            rec = {
                **rec,
                "handover_backup": late_backup,
                "handover_round": handed["round"],
                "state_bytes": handed["bytes"],
            }
        row = row_of(
            rec,
            node=name,
            cluster=c,
            stage=s,
            digest=checksum(stage.params),
            lr=cfg.train.lr,
            time_unix_s=time.time(),
            wall_time_s=wall0 + now - t_wall,
            step_time_s=now - last["t"],
            payload_bytes=sent - last["sent"],
            payload_bytes_total=sent,
        )
        last.update(t=now, sent=sent)
        writer.write(row)
        if (every and stage.version % every == 0) or stage.version == cfg.train.steps:
            save_checkpoint(row)
        if progress:
            loss = f" loss {row['loss']:.4f}" if row.get("loss") is not None else ""
            print(
                f"node {name} (cluster {c} stage {s}, {role}) update {row['step']}/{cfg.train.steps}{loss}", flush=True
            )

    late_backup = plan.backups.get((c, s))
    joins_at = plan.backup_round.get(late_backup, 0) if late_backup is not None and role == "primary" else 0

    def after_average(round_id: int) -> None:  # a backup arriving by this round gets this node's state
        if joins_at and round_id >= joins_at and not handed:
            handed["bytes"] = t.attach(late_backup, stage.snapshot(units))
            handed["round"] = round_id
            if progress:
                print(f"node {name}: handed its state ({handed['bytes']} bytes) to backup {late_backup}", flush=True)

    t0 = time.time()
    try:
        restored = role == "backup" and plan.backup_round.get(name, 0) > 0
        if resume_step is not None:
            pass  # the checkpoint holds the stage
        elif restored:  # a late backup starts from its primary's state (at its first round after join_round)
            stage.restore(t.wait_state(r.timeout_s), units)
        elif build.join_pieces(plan, (c, s)):  # a late cluster starts from the last averaged parameters
            stage.params = engine.with_flat(stage.params, units, io.fetch_start(engine.flat_of(stage.params, units)))
        res = driver.run_node(
            stage,
            build.data_of(cfg, ex, c, len(plan.stages)),
            io,
            n_batches=cfg.train.steps,
            units=units,
            order=r.order,
            max_in_flight=r.max_in_flight,
            average_every=r.average_every,
            timeout_s=r.timeout_s,
            on_record=record,
            first_batch=build.first_batch(plan, c),
            after_average=after_average,
        )
    finally:
        writer.close()
        t.close(r.timeout_s)
    flat = engine.flat_of(stage.params, units)
    np.savez(out / "params.npz", flat=flat, start=plan.layouts[c][s][0])
    summary = {
        "node": name,
        "cluster": c,
        "stage": s,
        "role": role,
        "took_over": t.promoted_at is not None,
        "updates": res["updates"],
        "compute_s": res["compute_s"],
        "idle_s": res["idle_s"],
        "average_s": res["average_s"],
        "wall_s": res["wall_s"],
        "seconds": time.time() - t0,
        "staleness_max": res["staleness_max"],
        "final_loss": res["losses"][-1] if res["losses"] else None,
        "bytes_sent": t.bytes_sent,
        "messages_received": t.received,
        "messages_refused": t.refused,
        "layout": list(plan.layouts[c][s]),
        "digest": engine.flat_digest(flat),
        "run_id": plan.run_id,
        "state_handed_bytes": handed.get("bytes"),
        "state_handed_round": handed.get("round"),
    }
    (out / "summary.json").write_text(json.dumps(summary, indent=1))
    return summary


def main(argv: list[str]) -> int:
    """Entry point of ``zeroth node``; returns the exit code."""
    args = build_parser().parse_args(argv)
    from zeroth import config as _config
    from zeroth.transport import identity, security

    try:
        cfg = _config.load_config(args.config, args.overrides)
        if cfg.ravnest is None:
            raise ValueError(f"config {args.config} has no ravnest: section")
        token = identity.token_from_env(args.insecure)
        secret = None if args.insecure else identity.secret_from_env()
        tls = security.tls_from_args(args)
        out = Path(args.out)
        addresses = Path(args.addresses) if args.addresses else out.parent / "addresses"
        run_node_process(
            cfg,
            args.name,
            out,
            addresses,
            args.listen,
            token,
            progress=not args.quiet,
            advertise=args.advertise,
            tls=tls,
            secret=secret,
            resume_step=args.resume_step,
        )
    except (ConnectionError, TimeoutError) as e:
        print(f"zeroth node {args.name}: error: {e}", file=sys.stderr)
        return 1
    except (ValueError, FileNotFoundError) as e:
        print(f"zeroth node {args.name}: error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
