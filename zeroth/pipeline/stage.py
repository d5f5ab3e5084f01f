"""``zeroth stage``: run one pipeline stage (one per machine, or several on one machine).

  zeroth stage --config CONFIG --stage I --out DIR [--listen HOST:PORT] [--next HOST:PORT] ...

Stage ``I`` of ``pipeline.stages`` listens for the stage before it and connects to the one after,
trains its slice of the model and writes its rows, checkpoints and AQ-SGD buffers into ``DIR``.
The options, links, keys, replicas, stopping and exit codes are described in the docs
(``docs/systems/aqsgd.md``, "A stage process").
"""

from __future__ import annotations

import argparse
import json
import os
import queue
import sys
import time
from pathlib import Path

from zeroth.replay import checksum
from zeroth.train.metrics import MetricsWriter, read_metrics, truncate_after
from zeroth.train.metrics import clear as clear_metrics

__all__ = ["build_parser", "main", "run_stage", "stage_record"]


def build_parser() -> argparse.ArgumentParser:
    """The argument parser of ``zeroth stage``."""
    p = argparse.ArgumentParser(prog="zeroth stage", description="Run one pipeline stage (AQ-SGD).")
    p.add_argument("--config", required=True, help="experiment YAML with a pipeline: section (same on every stage)")
    p.add_argument("--stage", type=int, required=True, help="this stage's index, 0 .. pipeline.stages-1")
    p.add_argument("--out", required=True, help="this stage's output folder")
    p.add_argument("--listen", default=None, help="HOST:PORT to serve the link from the previous stage (stages > 0)")
    p.add_argument("--next", default=None, help="HOST:PORT of the next stage (stages < S-1); @FILE: read it from FILE")
    p.add_argument("--identity", default=None, help="this stage's private key file (default: a fresh key)")
    p.add_argument(
        "--upstream-key",
        default=None,
        help="the previous stage's public key (hex; @FILE: read from FILE, "
        "its key.pub): only a link signed by it is served (stages > 0)",
    )
    p.add_argument("--replica", type=int, default=0, help="this replica's index, 0 .. pipeline.replicas-1")
    p.add_argument(
        "--sync-listen",
        default=None,
        help="replica 0 with pipeline.replicas > 1: HOST:PORT to serve the other replicas' averaging (port 0 = any)",
    )
    p.add_argument(
        "--replica-key",
        dest="replica_keys",
        action="append",
        default=[],
        metavar="R=HEX|@FILE",
        help="replica 0: replica R's public key (hex; @FILE: read from FILE, its key.pub); only an averaging "
        "stream signed by it is served",
    )
    p.add_argument(
        "--sync-server",
        default=None,
        help="replicas > 0: HOST:PORT of replica 0 of this stage (its --sync-listen); @FILE: read it from FILE",
    )
    p.add_argument(
        "--set", dest="overrides", action="append", default=[], metavar="SECTION.FIELD=VALUE", help="config override"
    )
    p.add_argument(
        "--resume-step", type=int, default=None, help="restore this checkpoint step (with its buffers) and continue"
    )
    p.add_argument("--quiet", action="store_true", help="no progress lines")
    p.add_argument("--insecure", action="store_true", help="no access token on the links (loopback experiments only)")
    from zeroth.transport import security

    security.add_tls_arguments(p)
    return p


def upstream_key_of(spec: str | None):
    """``upstream_key()`` for :class:`zeroth.pipeline.link.LinkServicer` from ``--upstream-key``:
    None without it; the key of ``HEX``; the key read from ``@FILE`` when called (None while the
    file is absent or empty).

    Raises:
      ValueError: ``HEX`` (or, when called, the file's text) is not 64 hex digits.
    """
    if spec is None:
        return None

    def parse(text: str, where: str) -> bytes:
        try:
            key = bytes.fromhex(text.strip())
        except ValueError:
            key = b""
        if len(key) != 32:
            raise ValueError(f"--upstream-key: {where} holds {text.strip()[:80]!r}, not a public key of 64 hex digits")
        return key

    if not spec.startswith("@"):
        key = parse(spec, "the argument")
        return lambda: key
    path = Path(spec[1:])

    def read() -> bytes | None:
        text = path.read_text() if path.is_file() else ""
        return parse(text, str(path)) if text.strip() else None

    return read


def replica_keys_of(specs: list[str]) -> dict:
    """``{r: key()}`` from ``--replica-key R=HEX|@FILE`` flags (:func:`upstream_key_of` for each key).

    Raises:
      ValueError: a flag is not ``R=HEX`` or ``R=@FILE`` with an integer ``R``, or names ``R`` twice.
    """
    keys = {}
    for spec in specs:
        r, sep, key = spec.partition("=")
        if not sep or not r.strip().isdigit() or not key:
            raise ValueError(f"--replica-key {spec!r}: expected R=HEX or R=@FILE with R a replica index")
        if int(r) in keys:
            raise ValueError(f"--replica-key names replica {int(r)} twice")
        keys[int(r)] = upstream_key_of(key)
    return keys


def _resolve(address: str, timeout_s: float) -> str:
    if not address.startswith("@"):
        return address
    path = Path(address[1:])
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if path.is_file() and path.read_text().strip():
            return path.read_text().strip()
        time.sleep(0.05)
    raise TimeoutError(f"no address appeared in {path} within {timeout_s:g}s")


class _Stopped(Exception):
    """The pipeline stops at this step boundary (``docs/systems/aqsgd.md``, "A stage process")."""


class _StoppedMidStep(Exception):
    """A replica r > 0 found replica 0 stopped while it waited for a step's average: it stops without
    a checkpoint of that step (its AQ-SGD buffers already hold the step's messages)."""


def _stopped(stop, wait_s: float = 2.0) -> bool:
    """Whether the stage was asked to stop; waits up to ``wait_s`` for a signal that may trail the closed link."""
    deadline = time.monotonic() + wait_s
    while not stop():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.02)
    return True


def _get(inbox: queue.Queue, timeout_s: float, what: str):
    from zeroth.pipeline import link

    try:
        item = inbox.get(timeout=timeout_s)
    except queue.Empty:
        raise link.LinkClosed(f"no {what} within {timeout_s:g}s") from None
    if item is link.END:
        raise link.LinkClosed(f"the link closed before the {what}")
    if isinstance(item, BaseException):
        raise item
    return item


class _Checkpoints:
    """Orbax checkpoints of a stage plus its AQ-SGD buffers (``buffers/<step>_{send,recv}.npz``) and,
    with replicas, its averaging state (``sync/<step>.npz``: QuantizedAdam's moments and errors)."""

    def __init__(self, out: Path, keep: int):
        from zeroth.train.checkpoint import Checkpointer

        self.out = out
        self.ck = Checkpointer(out / "checkpoints", keep=keep)

    def save(self, engine, run_id: str, sync=None) -> None:
        from zeroth import compress as C
        from zeroth.train.checkpoint import checksum

        step = engine.step
        bdir = self.out / "buffers"
        digests = {
            "send": C.save_buffers(engine.send_state, bdir / f"{step}_send.npz"),
            "recv": C.save_buffers(engine.recv_state, bdir / f"{step}_recv.npz"),
        }
        meta = {"step": step, "digest": checksum(engine.params), "run_id": run_id, "buffers": digests}
        if sync is not None:
            meta["sync"] = sync.save_state(self.out / "sync" / f"{step}.npz")
        self.ck.save(step, engine.params, engine.opt_state, meta)
        kept = set(self.ck.steps())
        for f in [*bdir.glob("*.npz"), *(self.out / "sync").glob("*.npz")]:
            if int(f.name.split("_")[0].split(".")[0]) not in kept:
                f.unlink()

    def restore(self, engine, step: int, run_id: str, sync=None) -> None:
        import jax
        import jax.numpy as jnp

        from zeroth import compress as C
        from zeroth.train.checkpoint import CheckpointError

        r = self.ck.restore(step, engine.params, engine.opt_state)
        if r.meta.get("run_id") != run_id:
            raise CheckpointError(f"checkpoint {step} belongs to run {r.meta.get('run_id')!r}, not {run_id!r}")
        for side in ("send", "recv"):  # before anything is moved: a damaged buffer leaves the folder as it was
            state = getattr(engine, f"{side}_state")
            if state is not None:
                try:
                    C.load_buffers(state, self.out / "buffers" / f"{step}_{side}.npz", r.meta["buffers"][side])
                except ValueError as e:
                    raise self.ck._error(step, str(e)) from None
        if sync is not None:
            if "sync" not in r.meta:
                raise self.ck._error(step, "it holds no averaging state (saved by a run without replicas)")
            try:
                sync.load_state(self.out / "sync" / f"{step}.npz", r.meta["sync"])
            except ValueError as e:
                raise self.ck._error(step, str(e)) from None
        for newer in [s for s in self.ck.steps() if s > step]:  # this run will write them again
            self.ck.quarantine(newer)
        engine.params = jax.tree_util.tree_map(jnp.asarray, r.params)
        engine.opt_state = jax.tree_util.tree_map(jnp.asarray, r.opt_state)
        engine.step = step


def _resumed_totals(path: Path, step: int) -> tuple[float, int]:
    """Keep the rows of ``path`` up to ``step``; return the kept last row's ``(wall_time_s, payload_bytes_total)``."""
    truncate_after(path, step)
    rows = read_metrics(path, "train") if path.is_file() else []
    return (rows[-1]["wall_time_s"], rows[-1]["payload_bytes_total"]) if rows else (0.0, 0)


def stage_record(
    index: int,
    step: int,
    *,
    loss: float | None,
    lr: float,
    sent: dict,
    times: dict,
    wait_s: float,
    transfer_s: float,
    step_time_s: float,
    wall_time_s: float,
    payload_bytes_total: int,
    digest: str,
    buffer_digests: dict,
    buffer_bytes: int,
) -> dict:
    """A stage's ``train`` row (the schema of :mod:`zeroth.train.metrics`) after ``step`` steps.

    ``payload_bytes`` are the frame bytes this stage sent in the step (activations forward,
    gradients backward); ``loss`` is null except on the last stage; ``digest`` is the checksum
    of this stage's parameters. The rest: frames and bytes per direction, seconds in compute,
    codecs, waiting and the token bucket (``times`` also carries ``c_Q`` of what the stage sent:
    ``fw_cq``, ``fw_cq_max``, ``bw_cq``, ``bw_cq_max``, the step's mean and maximum relative
    quantization error per example, None where nothing was quantized, and ``fw_cq_init``,
    ``bw_cq_init`` at step 0, :mod:`zeroth.pipeline.engine`), the AQ-SGD buffers' digests and size.
    """
    return {
        "kind": "train",
        "step": step,
        "time_unix_s": time.time(),
        "wall_time_s": wall_time_s,
        "digest": digest,
        "forward_passes": step,
        "backward_passes": step,
        "payload_bytes_total": payload_bytes_total,
        "loss": loss,
        "lr": lr,
        "step_time_s": step_time_s,
        "payload_bytes": sent["fw_bytes"] + sent["bw_bytes"],
        "stage": index,
        **sent,
        **times,
        "wait_s": wait_s,
        "transfer_s": transfer_s,
        "send_digest": buffer_digests["send"],
        "recv_digest": buffer_digests["recv"],
        "buffer_bytes": buffer_bytes,
    }


def _average(sync, step: int, grads, replica: int, R: int, servicer, pacer, inbox, timeout_s: float, lr: float):
    """Exchange this replica's contribution of ``step`` (:mod:`zeroth.pipeline.replicas`); returns
    the engine's update and the row's ``sync_*`` fields (bytes sent and received by this process)."""
    from zeroth.pipeline import link, wire

    t0 = time.perf_counter()
    mine = sync.contribution(step, grads)
    sent = recv = 0
    try:
        if replica == 0:
            frames = [
                _get(servicer.inboxes[r], timeout_s, f"replica {r}'s gradient of step {step}") for r in range(1, R)
            ]
            recv = sum(wire.frame_nbytes(f) for f in frames)
            avg = sync.reduce(step, frames)
            for r in range(1, R):
                sent += servicer.outs[r].submit(avg)
        else:
            sent = pacer.submit(mine)
            avg = _get(inbox, timeout_s, f"average of step {step} from replica 0")
            recv = wire.frame_nbytes(avg)
            sync.check(avg, "average", step, 0)
    except ConnectionError as e:
        raise link.LinkClosed(str(e)) from None
    except wire.FrameError as e:
        raise link.LinkClosed(f"replica {replica} refused an averaging frame: {e}") from None
    row = {
        "sync_sent_bytes": sent,
        "sync_recv_bytes": recv,
        "sync_bits": int(mine.bits),
        "sync_s": time.perf_counter() - t0,
    }
    return (lambda params, opt_state, g, upd: sync.apply(step, params, opt_state, avg, upd, lr)), row


def run_stage(
    cfg,
    index: int,
    out: Path,
    listen: str | None,
    next_addr: str | None,
    resume_step: int | None = None,
    progress: bool = False,
    stop=None,
    token: str | None = None,
    tls=None,
    upstream_key=None,
    me=None,
    replica: int = 0,
    sync_listen: str | None = None,
    sync_server: str | None = None,
    replica_keys: dict | None = None,
) -> dict:
    """Run stage ``index`` of the pipeline of ``cfg`` to ``train.steps``; returns its summary.

    ``token``: the run's access token, required of the stream this stage serves and sent on the
    one it opens (None: links without one). ``tls``: both links over TLS
    (:class:`zeroth.transport.security.TLSFiles`; mutual when ``tls.mutual``).
    ``upstream_key``: ``upstream_key() -> bytes | None``, the previous stage's public key
    (:func:`upstream_key_of`); only a stream signed by it is served. ``me``: this stage's
    :class:`zeroth.transport.identity.Identity` (default: a fresh one).

    ``stop`` (called at step boundaries) asks the pipeline to stop (``docs/systems/aqsgd.md``);
    the summary then says ``"interrupted": true`` and ``steps_done``, and the checkpoint of that
    step is saved.

    Raises:
      LinkClosed: a link broke or a frame was refused; ValueError: bad arguments.
    """
    from zeroth.pipeline import build, link, replicas
    from zeroth.pipeline.engine import CQ_LIMIT
    from zeroth.transport import guard, identity, pacing

    p = cfg.pipeline
    S = p.stages
    if not 0 <= index < S:
        raise ValueError(f"--stage {index} is outside 0..{S - 1} (pipeline.stages = {S})")
    if (index > 0) != (listen is not None):
        raise ValueError(
            f"stage {index} {'needs' if index > 0 else 'takes no'} --listen (only stages after the first listen)"
        )
    if (index < S - 1) != (next_addr is not None):
        raise ValueError(
            f"stage {index} {'needs' if index < S - 1 else 'takes no'} --next (every stage but the last connects on)"
        )
    if upstream_key is not None and index == 0:
        raise ValueError("stage 0 has no upstream: --upstream-key is for stages after the first")
    R = p.replicas
    if not 0 <= replica < R:
        raise ValueError(f"--replica {replica} is outside 0..{R - 1} (pipeline.replicas = {R})")
    if (R > 1 and replica == 0) != (sync_listen is not None):
        raise ValueError(
            f"replica {replica} {'needs' if R > 1 and replica == 0 else 'takes no'} --sync-listen "
            f"(replica 0 serves the averaging when pipeline.replicas > 1; pipeline.replicas = {R})"
        )
    if (replica > 0) != (sync_server is not None):
        raise ValueError(
            f"replica {replica} {'needs' if replica > 0 else 'takes no'} --sync-server (replicas > 0 connect to replica 0)"
        )
    bad = sorted(r for r in (replica_keys or {}) if not (replica == 0 and 1 <= r < R))
    if bad:
        raise ValueError(
            f"--replica-key for replica {bad[0]}: only replica 0 checks keys, of replicas 1..{R - 1} "
            f"(pipeline.replicas = {R}, this is replica {replica})"
        )
    out.mkdir(parents=True, exist_ok=True)
    me = me or identity.Identity.generate()
    tmp = out / "key.pub.tmp"
    tmp.write_text(me.public.hex() + "\n")
    os.replace(tmp, out / "key.pub")
    ex = build.examples_of(cfg)
    part = build.partition_of(cfg, ex)
    buffer_dir = out / "memmap" if p.buffers == "memmap" else None
    if buffer_dir is not None:
        buffer_dir.mkdir(parents=True, exist_ok=True)
    engine = build.engine_of(cfg, index, part, ex, buffer_dir=buffer_dir)
    del part
    sync = build.replica_sync_of(cfg, replica, index, engine.params) if R > 1 else None
    run_id = build.run_id_of(cfg)
    ckpt = _Checkpoints(out, cfg.train.keep_checkpoints)
    metrics = out / "metrics.jsonl"
    wall0, payload_total = 0.0, 0
    if resume_step is not None:
        ckpt.restore(engine, resume_step, run_id, sync)
        wall0, payload_total = _resumed_totals(metrics, resume_step)
    else:
        clear_metrics(metrics)
    start, steps, M = engine.step, cfg.train.steps, p.micro_batches
    latency = p.latency_ms / 1e3
    fw_pacer = pacing.Pacer(p.bandwidth_bps, latency) if index < S - 1 else None
    bw_pacer = pacing.Pacer(p.bandwidth_bps, latency) if index > 0 else None
    fw_inbox: queue.Queue = queue.Queue()  # activations from the previous stage
    bw_inbox: queue.Queue = queue.Queue()  # gradients from the next stage
    server = servicer = channel = None
    readers: list = []  # the links' stream readers, joined before returning
    if index > 0:
        schedule = iter([(t, j) for t in range(start, steps) for j in range(M)])

        def expect(t, j):
            ids = build.plan_of(cfg, ex, t, replica)[j][0]
            return engine.expected("activation", j, ids, step=t)

        servicer = link.LinkServicer(
            expect, schedule, fw_inbox, bw_pacer, upstream_key=upstream_key, run_id=run_id, link=index - 1
        )
        # frames of one micro-batch each way: larger messages are refused by gRPC before they are read whole
        frames = link.frame_bytes(cfg.data.batch_size // M, engine.row_shape)
        server, port = link.serve(servicer, listen, token, bounds=link.limits(p.timeout_s, frames), tls=tls)
        host = listen.rsplit(":", 1)[0]
        tmp = out / "address.tmp"
        tmp.write_text(f"{host}:{port}\n")
        os.replace(tmp, out / "address")
    if index < S - 1:
        channel = link.connect(
            _resolve(next_addr, p.timeout_s),
            fw_pacer,
            bw_inbox,
            p.timeout_s,
            readers,
            token,
            tls,
            me=me,
            run_id=run_id,
            link=index,
        )
    sync_server_obj = sync_servicer = sync_channel = sync_pacer = None
    sync_inbox: queue.Queue = queue.Queue()
    if sync is not None and replica == 0:
        keys = replica_keys or {}
        sync_servicer = replicas.SyncServicer(
            R,
            p.bandwidth_bps,
            latency,
            replica_keys=(lambda r: keys[r]() if r in keys else None) if keys else None,
            run_id=run_id,
            stage=index,
        )
        sync_server_obj, sport = replicas.serve_sync(
            sync_servicer,
            sync_listen,
            token,
            guard.Limits(8 * sync.n + (64 << 10), max_calls=R + 2, max_calls_per_caller=R + 2, idle_s=p.timeout_s),
            tls,
        )
        tmp = out / "sync_address.tmp"
        tmp.write_text(f"{sync_listen.rsplit(':', 1)[0]}:{sport}\n")
        os.replace(tmp, out / "sync_address")
    elif sync is not None:
        sync_pacer = pacing.Pacer(p.bandwidth_bps, latency)
        sync_channel = replicas.connect_sync(
            _resolve(sync_server, p.timeout_s),
            sync_pacer,
            sync_inbox,
            p.timeout_s,
            readers,
            token,
            tls,
            link.CHANNEL_OPTIONS,
            me=me,
            run_id=run_id,
            stage=index,
            replica=replica,
        )
    t_run = time.time()
    t_wall = time.perf_counter() - wall0
    writer = MetricsWriter(metrics, tensorboard=cfg.run.tensorboard, resumed_after=resume_step)
    stop = stop or (lambda: False)
    ok = interrupted = mid_step = False
    cq_warned: set[str] = set()  # directions already warned of c_Q >= 1/sqrt(2) (once each)
    try:
        for step in range(start, steps):
            if index == 0 and replica == 0 and stop():  # the other replicas stop when replica 0 does
                raise _Stopped
            t0 = time.perf_counter()
            wait = 0.0
            sent = {"fw_bytes": 0, "fw_frames": 0, "bw_bytes": 0, "bw_frames": 0}
            transfer0 = (fw_pacer.transfer_s if fw_pacer else 0.0) + (bw_pacer.transfer_s if bw_pacer else 0.0)
            plan = build.plan_of(cfg, ex, step, replica)
            for j, (ids, tok, lab) in enumerate(plan):
                frame = None
                if index > 0:
                    tw = time.perf_counter()
                    try:
                        frame = _get(fw_inbox, p.timeout_s, f"activation of step {step} micro-batch {j}")
                    except link.LinkClosed:
                        if j == 0 and _stopped(stop):  # stage 0 stopped at this boundary
                            raise _Stopped from None
                        raise
                    wait += time.perf_counter() - tw
                out_frame = engine.forward(j, ids, tok, lab, frame)
                if out_frame is not None:
                    sent["fw_bytes"] += fw_pacer.submit(out_frame)
                    sent["fw_frames"] += 1
            for j, (ids, tok, _) in enumerate(plan):
                frame = None
                if index < S - 1:
                    tw = time.perf_counter()
                    try:
                        frame = _get(bw_inbox, p.timeout_s, f"gradient of step {step} micro-batch {j}")
                    except link.LinkClosed:
                        # the next stage of a replica r > 0 stopped in this step (replica 0 stopped at
                        # its boundary), its last gradients possibly unsent: stop in it as well
                        if replica > 0 and _stopped(stop):
                            raise _StoppedMidStep from None
                        raise
                    wait += time.perf_counter() - tw
                out_frame = engine.backward(j, ids, tok, frame)
                if out_frame is not None:
                    sent["bw_bytes"] += bw_pacer.submit(out_frame)
                    sent["bw_frames"] += 1
            update, sync_row = None, {}
            if sync is not None:
                try:
                    update, sync_row = _average(
                        sync,
                        step,
                        engine.grads,
                        replica,
                        R,
                        sync_servicer,
                        sync_pacer,
                        sync_inbox,
                        p.timeout_s,
                        build.lr_at(cfg, step),
                    )
                except link.LinkClosed:
                    if replica > 0 and _stopped(stop):  # replica 0 stopped at this step's boundary
                        raise _StoppedMidStep from None
                    raise
            loss = engine.finish_step(update)
            transfer = (
                (fw_pacer.transfer_s if fw_pacer else 0.0) + (bw_pacer.transfer_s if bw_pacer else 0.0) - transfer0
            )
            now = time.perf_counter()
            payload_total += sent["fw_bytes"] + sent["bw_bytes"]
            writer.write(
                stage_record(
                    index,
                    engine.step,
                    loss=loss,
                    lr=build.lr_at(cfg, step),
                    sent=sent,
                    times={**engine.last_times, **engine.last_cq, **sync_row},
                    wait_s=wait,
                    transfer_s=transfer,
                    step_time_s=now - t0,
                    wall_time_s=now - t_wall,
                    payload_bytes_total=payload_total,
                    digest=checksum(engine.params),
                    buffer_digests=engine.buffer_digests(),
                    buffer_bytes=engine.buffer_nbytes(),
                )
            )
            for d, link_k in (("fw", index), ("bw", index - 1)):
                cq = engine.last_cq[f"{d}_cq"]
                if cq is not None and cq >= CQ_LIMIT and d not in cq_warned:
                    cq_warned.add(d)
                    print(
                        f"stage {index} step {step}: c_Q of the {'activations' if d == 'fw' else 'gradients'} on link "
                        f"{link_k} is {cq:.3f} >= 1/sqrt(2) = {CQ_LIMIT:.3f}, outside the AQ-SGD theorem's condition "
                        f"(more bits, or scale_axis channel, lower it)",
                        file=sys.stderr,
                        flush=True,
                    )
            every = cfg.train.checkpoint_every
            if (every and engine.step % every == 0) or engine.step == steps:
                ckpt.save(engine, run_id, sync)
            if progress:
                print(
                    f"stage {index} step {step} "
                    + (f"loss {loss:.4f} " if loss is not None else "")
                    + f"wait {wait:.2f}s",
                    flush=True,
                )
        ok = True
    except _Stopped:
        interrupted = True
        if ckpt.ck.latest_step() != engine.step:
            ckpt.save(engine, run_id, sync)
    except _StoppedMidStep:
        interrupted = mid_step = True
    finally:
        writer.close()
        if sync_pacer is not None:
            sync_pacer.close()
        if sync_servicer is not None:
            sync_servicer.close()
            if ok:  # every worker's request stream ends once it has its last average
                for r in range(1, R):
                    try:
                        _get(sync_servicer.inboxes[r], p.timeout_s, f"end of replica {r}'s averaging stream")
                    except link.LinkClosed:
                        pass
        if sync_channel is not None:
            if ok:
                try:
                    _get(sync_inbox, p.timeout_s, "end of the averaging stream")
                except (link.LinkClosed, ConnectionError):
                    pass
            sync_channel.close()
        if sync_server_obj is not None:
            sync_server_obj.stop(grace=1.0 if ok else 0).wait()
            readers += sync_servicer.readers
        if fw_pacer is not None:
            fw_pacer.close()
        if bw_pacer is not None:
            bw_pacer.close()
        clean = ok or (
            interrupted and not mid_step
        )  # a stop at a step boundary ends the links as the end of the run does
        if clean and servicer is not None:
            servicer.done.wait(timeout=p.timeout_s if servicer.connected.is_set() else 0)
        if clean and index < S - 1:
            try:  # wait for the next stage to close the stream (all our frames delivered)
                _get(bw_inbox, p.timeout_s, "end of the link")
            except link.LinkClosed:  # the next stage went away after its last step: nothing left to receive
                pass
        if channel is not None:
            channel.close()
        if server is not None:
            server.stop(grace=1.0 if clean else 0).wait()
        link.join_readers(readers + (servicer.readers if servicer is not None else []))
    summary = {
        "stage": index,
        "replica": replica,
        "steps": steps,
        "start": start,
        "steps_done": engine.step,
        "interrupted": interrupted,
        "checkpoint_step": ckpt.ck.latest_step(),
        "seconds": time.time() - t_run,
        "run_id": run_id,
        "buffer_bytes": engine.buffer_nbytes(),
        **{f"{k}_digest": v for k, v in engine.buffer_digests().items()},
    }
    summary["param_digest"] = checksum(engine.params)
    (out / "summary.json").write_text(json.dumps(summary, indent=1))
    return summary


def main(argv: list[str]) -> int:
    """Entry point of ``zeroth stage``; returns the exit code."""
    args = build_parser().parse_args(argv)
    from zeroth import config as _config
    from zeroth.pipeline import link
    from zeroth.train import interrupt
    from zeroth.train.checkpoint import CheckpointError
    from zeroth.transport import identity, security

    out = Path(args.out)
    try:
        with interrupt.catch() as flag:
            token = identity.token_from_env(args.insecure)
            tls = security.tls_from_args(args)
            cfg = _config.load_config(args.config, args.overrides)
            if cfg.pipeline is None:
                raise ValueError(f"config {args.config} has no pipeline: section")
            summary = run_stage(
                cfg,
                args.stage,
                out,
                args.listen,
                args.next,
                args.resume_step,
                progress=not args.quiet,
                stop=lambda: flag.is_set() or (out / "stop").exists(),
                token=token,
                tls=tls,
                upstream_key=upstream_key_of(args.upstream_key),
                me=None if args.identity is None else identity.Identity.load(args.identity),
                replica=args.replica,
                sync_listen=args.sync_listen,
                sync_server=args.sync_server,
                replica_keys=replica_keys_of(args.replica_keys),
            )
        if summary["interrupted"]:
            why = flag.signal_name() if flag.is_set() else f"{out / 'stop'}"
            print(
                f"zeroth stage {args.stage}: stopped by {why} after step {summary['steps_done']}; "
                + (
                    f"newest checkpoint {out / 'checkpoints' / str(summary['checkpoint_step'])}; continue with "
                    f"--resume-step N, N a step every stage holds (`zeroth run CONFIG --resume` finds it)"
                    if summary["checkpoint_step"] is not None
                    else "no checkpoint was saved"
                ),
                file=sys.stderr,
                flush=True,
            )
            return interrupt.EXIT_CODE
    except (link.LinkClosed, TimeoutError, ConnectionError) as e:
        print(f"zeroth stage {args.stage}: error: {e}", file=sys.stderr)
        return 1
    except (ValueError, FileNotFoundError, CheckpointError) as e:
        print(f"zeroth stage {args.stage}: error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
