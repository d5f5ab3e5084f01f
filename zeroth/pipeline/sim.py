"""The pipeline in one process: the same engines and frames as the stage processes, no transport.

:func:`run_local` drives every :class:`~zeroth.pipeline.engine.StageEngine` through the GPipe
schedule by direct calls, counting the serialized size of every frame per link; it is what the
stage processes compute, bit for bit on one machine, and the quick way to compare compressions.
:func:`reference_run` is the single-process model (one ``jax.value_and_grad`` over the whole
chain and the whole batch, the same optimizer): a pipeline with float32 links must match it up to
float reassociation. :func:`emulated_seconds` turns measured compute and bytes into an emulated
wall-clock for a bandwidth that was not enforced.
"""

from __future__ import annotations

import hashlib
import time
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np

from zeroth import config as _config
from zeroth.pipeline import build as _build
from zeroth.pipeline import wire
from zeroth.replay import checksum
from zeroth.stages import partition as _partition

__all__ = ["emulated_seconds", "pipeline_digest", "reference_run", "run_local", "step_record"]


def pipeline_digest(stage_digests: list[str]) -> str:
    """The digest of the whole pipeline's parameters: SHA-256 (hex) of the stages' parameter
    checksums (:func:`zeroth.replay.checksum` of each stage's parameters), in stage order, joined by ``,``.

    Each stage process knows only its own parameters; this combines their digests into one that
    the in-process pipeline (:func:`run_local`) and the stage processes compute alike.
    """
    return hashlib.sha256(",".join(stage_digests).encode()).hexdigest()


def step_record(
    step: int,
    *,
    epoch: int,
    loss: float | None,
    lr: float,
    links: list[dict],
    stages: list[dict],
    step_time_s: float,
    wall_time_s: float,
    payload_bytes_total: int,
    time_unix_s: float | None = None,
    **replica_extra,
) -> dict:
    """One step's ``train`` row of the metrics schema (:mod:`zeroth.train.metrics`).

    Args:
      step: steps completed (the row of the step with index ``t`` has ``step = t + 1``).
      epoch: the epoch the step belongs to, ``t · batch_size // examples``.
      loss: the batch loss (the mean over the micro-batches, from the last stage).
      lr: the learning rate of the step.
      links: per link ``{link, fw_bytes, fw_frames, bw_bytes, bw_frames, send_digest, recv_digest, fw_cq,
        fw_cq_max, fw_cq_init, bw_cq, bw_cq_max, bw_cq_init}`` (``c_Q``: the step's mean and maximum relative
        quantization error per example, activations forward and gradients backward, None where nothing was
        quantized; ``_init``: at step 0, the quantizer applied to the tensors themselves, see
        :mod:`zeroth.pipeline.engine`).
      stages: per stage ``{stage, compute_s, codec_s, wait_s, transfer_s, buffer_bytes, digest}``
        (``digest``: the checksum of the stage's parameters after the step).
      step_time_s: seconds of the step (the slowest stage); wall_time_s: seconds since the run started.
      payload_bytes_total: link bytes sent since the run began, this step included.

    The row's ``digest`` is :func:`pipeline_digest` of the stages' digests; ``payload_bytes`` is
    every frame byte of the step on every link, both directions; ``forward_passes`` and
    ``backward_passes`` count the batch passes (one each per step).

    With data-parallel replicas, ``links``, ``stages`` and ``digest`` are replica 0's, ``loss`` the
    whole batch's, ``payload_bytes`` every replica's link bytes plus the averaging bytes, and
    ``replica_extra`` holds the other fields of :func:`replica_fields`.
    """
    rec = {
        "kind": "train",
        "step": step,
        "time_unix_s": time.time() if time_unix_s is None else time_unix_s,
        "wall_time_s": wall_time_s,
        "digest": pipeline_digest([s["digest"] for s in stages]),
        "forward_passes": step,
        "backward_passes": step,
        "payload_bytes_total": payload_bytes_total,
        "loss": loss,
        "lr": lr,
        "step_time_s": step_time_s,
        "payload_bytes": sum(lk["fw_bytes"] + lk["bw_bytes"] for lk in links),
        "epoch": epoch,
        "links": links,
        "stages": stages,
    }
    if replica_extra:
        rec.update(replica_extra)
        rec["payload_bytes"] = sum(r["link_bytes"] for r in rec["replicas"]) + rec["sync_bytes"]
    return rec


def emulated_seconds(rec: dict, bandwidth_bps: float, latency_s: float = 0.0) -> float:
    """Emulated seconds of one step: ``Σ_stages (compute + codec) + Σ_links (8·bytes / bandwidth + frames · latency)``.

    No overlap between stages or between compute and transfer is assumed (an upper bound for
    GPipe's fill and drain); waiting is not counted since it is what the transfers cause. With
    data-parallel replicas (the replicas run side by side: replica 0's compute and links stand for
    all), each stage's averaging adds ``8·(up + down bytes) / bandwidth + 2 · latency`` for every
    link to replica 0 of the stage (the star's centre sends and receives them one after another),
    summed over the stages.
    """
    compute = sum(s["compute_s"] + s["codec_s"] for s in rec["stages"])
    transfer = sum(
        8.0 * (lk["fw_bytes"] + lk["bw_bytes"]) / bandwidth_bps + (lk["fw_frames"] + lk["bw_frames"]) * latency_s
        for lk in rec["links"]
    )
    sync = sum(8.0 * (x["up_bytes"] + x["down_bytes"]) / bandwidth_bps + 2 * latency_s for x in rec.get("sync", ()))
    return compute + transfer + sync


def _pass(cfg: _config.Config, ex, engines: list, step: int, replica: int = 0) -> list[dict]:
    """One replica's forward and backward of ``step`` through its ``engines``; returns its links' bytes and frames."""
    S = len(engines)
    links = [{"link": k, "fw_bytes": 0, "fw_frames": 0, "bw_bytes": 0, "bw_frames": 0} for k in range(S - 1)]
    plan = _build.plan_of(cfg, ex, step, replica)
    for j, (ids, tok, lab) in enumerate(plan):
        frame = None
        for s, e in enumerate(engines):
            frame = e.forward(j, ids, tok, lab, frame)
            if frame is not None:
                links[s]["fw_bytes"] += wire.frame_nbytes(frame)
                links[s]["fw_frames"] += 1
    for j, (ids, tok, _) in enumerate(plan):
        frame = None
        for s in reversed(range(S)):
            frame = engines[s].backward(j, ids, tok, frame)
            if frame is not None:
                links[s - 1]["bw_bytes"] += wire.frame_nbytes(frame)
                links[s - 1]["bw_frames"] += 1
    for k in range(S - 1):
        links[k]["send_digest"] = engines[k].buffer_digests()["send"]
        links[k]["recv_digest"] = engines[k + 1].buffer_digests()["recv"]
    return links


def _finish(engines: list, links: list[dict], updates=None) -> tuple[float | None, list[dict]]:
    """``finish_step`` of every stage (``updates[s]``: stage ``s``'s averaging update, or None);
    fills the links' ``c_Q``; returns the loss and the stages' rows."""
    loss = None
    stages = []
    for e in engines:
        out = e.finish_step(None if updates is None else updates[e.index])
        for d, k, send in (("fw", e.index, not e.last), ("bw", e.index - 1, not e.first)):
            if send:
                links[k].update({f"{d}_cq{x}": e.last_cq[f"{d}_cq{x}"] for x in ("", "_max", "_init")})
        loss = out if e.last else loss
        stages.append(
            {
                "stage": e.index,
                **e.last_times,
                "wait_s": 0.0,
                "transfer_s": 0.0,
                "buffer_bytes": e.buffer_nbytes(),
                "digest": checksum(e.params),
            }
        )
    return loss, stages


def run_local(
    cfg: _config.Config, steps: int | None = None, on_step: Callable[[dict], None] | None = None, engines=None
) -> tuple[list[dict], list]:
    """Train ``steps`` (default ``train.steps``) steps of the pipeline in this process.

    Returns ``(records, engines)``: one :func:`step_record` per step and the final engines. With
    ``pipeline.replicas`` R > 1, ``engines`` is a list of R lists of stage engines, and each stage
    averages over its replicas (:mod:`zeroth.pipeline.replicas`) with the same frames the stage
    processes send, counted per replica link (:func:`replica_fields`).
    """
    ex = _build.examples_of(cfg)
    R = cfg.pipeline.replicas
    if engines is None:
        part = _build.partition_of(cfg, ex)
        engines = [[_build.engine_of(cfg, s, part, ex) for s in range(cfg.pipeline.stages)] for _ in range(R)]
        engines = engines[0] if R == 1 else engines
    reps = [engines] if R == 1 else engines
    syncs = (
        None
        if R == 1
        else [[_build.replica_sync_of(cfg, r, s, e.params) for s, e in enumerate(es)] for r, es in enumerate(reps)]
    )
    records = []
    t_run = time.perf_counter()
    payload_total = 0
    for _ in range(cfg.train.steps if steps is None else steps):
        step = reps[0][0].step
        t0 = time.perf_counter()
        all_links = [_pass(cfg, ex, es, step, r) for r, es in enumerate(reps)]
        sync_rows = []
        if syncs is None:
            losses_stages = [_finish(reps[0], all_links[0])]
        else:
            lr = _build.lr_at(cfg, step)
            updates = [[None] * len(reps[0]) for _ in range(R)]
            for s in range(len(reps[0])):
                ts = time.perf_counter()
                frames = [syncs[r][s].contribution(step, reps[r][s].grads) for r in range(R)]
                avg = syncs[0][s].reduce(step, frames[1:])
                for r in range(R):
                    updates[r][s] = lambda p, o, g, upd, r=r, s=s, avg=avg: syncs[r][s].apply(step, p, o, avg, upd, lr)
                    if r > 0:
                        sync_rows.append(
                            {
                                "stage": s,
                                "replica": r,
                                "bits": int(frames[r].bits),
                                "up_bytes": wire.frame_nbytes(frames[r]),
                                "down_bytes": wire.frame_nbytes(avg),
                                "sync_s": 0.0,
                            }
                        )
                sync_rows_s = time.perf_counter() - ts
                for row in sync_rows[-(R - 1) :]:
                    row["sync_s"] = sync_rows_s
            losses_stages = [_finish(es, all_links[r], updates[r]) for r, es in enumerate(reps)]
        links = all_links[0]
        loss, stages = losses_stages[0]
        extra = {}
        if syncs is not None:
            extra = replica_fields(
                sync_rows,
                [
                    {
                        "replica": r,
                        "loss": ls[0],
                        "link_bytes": sum(lk["fw_bytes"] + lk["bw_bytes"] for lk in all_links[r]),
                        "digest": pipeline_digest([st["digest"] for st in ls[1]]),
                    }
                    for r, ls in enumerate(losses_stages)
                ],
            )
            loss = extra.pop("loss")
        step_bytes = sum(lk["fw_bytes"] + lk["bw_bytes"] for ls in all_links for lk in ls) + extra.get("sync_bytes", 0)
        payload_total += step_bytes
        now = time.perf_counter()
        rec = step_record(
            step + 1,
            epoch=step * cfg.data.batch_size // cfg.pipeline.examples,
            loss=loss,
            lr=_build.lr_at(cfg, step),
            links=links,
            stages=stages,
            step_time_s=now - t0,
            wall_time_s=now - t_run,
            payload_bytes_total=payload_total,
            **extra,
        )
        records.append(rec)
        if on_step is not None:
            on_step(rec)
    return records, engines


def replica_fields(sync: list[dict], replicas: list[dict]) -> dict:
    """The fields a step row of R > 1 replicas adds: ``sync`` (per stage and replica r > 0, the
    link to replica 0 of that stage: ``bits``, ``up_bytes`` sent to replica 0, ``down_bytes`` received,
    ``sync_s``), ``replicas`` (per replica: its batch share's ``loss``, its pipeline ``link_bytes`` and
    the :func:`pipeline_digest` of its stages), ``sync_bytes`` (all the step's averaging bytes),
    ``replicas_agree`` (every replica's digest equal) and ``loss`` (the mean of the replicas' losses,
    in replica order: the whole batch's loss)."""
    losses = [r["loss"] for r in replicas]
    return {
        "sync": sync,
        "replicas": replicas,
        "sync_bytes": sum(x["up_bytes"] + x["down_bytes"] for x in sync),
        "replicas_agree": len({r["digest"] for r in replicas}) == 1,
        "loss": None if any(v is None for v in losses) else float(np.mean(np.asarray(losses, np.float64))),
    }


def reference_run(cfg: _config.Config, steps: int) -> tuple[list[float], list]:
    """The single-process model: ``steps`` steps of value_and_grad over the whole chain and batch.

    Returns ``(losses, stage parameters)`` (the parameters split as the stages hold them).
    """
    import optax

    ex = _build.examples_of(cfg)
    part = _build.partition_of(cfg, ex)
    opt = _build.optimizer_of(cfg)
    params = [jax.tree_util.tree_map(jnp.asarray, p) for p in part.params]
    with jax.numpy_dtype_promotion("standard"):
        state = opt.init(params)

    @jax.jit
    def step_fn(params, state, tokens, labels):
        loss, g = jax.value_and_grad(lambda ps: _partition.reference_loss(part, ps, tokens, labels))(params)
        updates, state = opt.update(g, state, params)
        return optax.apply_updates(params, updates), state, loss

    losses = []
    for t in range(steps):
        ids = np.concatenate([m for m, _, _ in _build.plan_of(cfg, ex, t)])
        with jax.numpy_dtype_promotion("standard"):
            params, state, loss = step_fn(params, state, jnp.asarray(ex.tokens[ids]), jnp.asarray(ex.labels[ids]))
        losses.append(float(loss))
    return losses, params
