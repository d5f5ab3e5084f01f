"""``zeroth run CONFIG`` with a ``pipeline:`` section: every stage as a process on 127.0.0.1.

:func:`run_config` writes ``OUT/config.yaml`` and starts ``zeroth stage`` (``python -m
zeroth.pipeline.stage``) for stages ``S−1 .. 0``
(each stage after the first listens on a free port and writes it to ``OUT/stage_<i>/address``;
the stage before it connects through ``--next @OUT/stage_<i+1>/address``). When a stage fails the
others are stopped (a synchronous pipeline cannot go on without it) and the exit code is 1. On
success the stages' rows are merged into ``OUT/metrics.jsonl`` (:func:`merge_records`, one
``train`` row of the metrics schema per step: loss, bytes, the digest of every stage's parameters,
per link bytes, frames and both ends' buffer digests, per stage times) and ``OUT/summary.json``.

With ``pipeline.replicas`` R > 1 it starts R × S processes: replica 0's in ``OUT/stage_<i>``, replica
``r``'s in ``OUT/replica_<r>/stage_<i>`` (:func:`process_dirs`); replica 0 of each stage serves the
averaging of that stage (:mod:`zeroth.pipeline.replicas`), and :func:`merge_replicas` adds the
averaging bytes of every replica link, the replicas' losses and digests to the merged rows
(``summary.json``: ``replicas_agree``, ``sync_bytes_per_step``, ``link_bytes_per_step``).

``zeroth run CONFIG --resume`` restarts every stage (of every replica) from the newest checkpoint
step that all of them hold (:func:`common_step`), AQ-SGD buffers and the replicas' averaging
state included; ``--resume --resume-step N`` from step
``N`` (every stage must hold it). Before any stage starts, every stage's buffer files of that step
are read (:func:`check_resume`): a missing, truncated or damaged one is named in one line, with
the older steps every stage holds. SIGINT/SIGTERM stop every stage at one
step boundary, each with its checkpoint of that step (:func:`wait_stages`), so the resumed run
ends where the uninterrupted one would. With replicas, replica 0 decides the step and the other
replicas stop in it without a checkpoint (:mod:`zeroth.pipeline.stage`): ``--resume`` then takes
the newest ``train.checkpoint_every`` step every process holds, and the resumed run ends on the
uninterrupted run's parameters bit for bit.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
import zipfile
from pathlib import Path

from zeroth import config as _config
from zeroth.pipeline import sim
from zeroth.train import interrupt
from zeroth.train.metrics import MetricsWriter, read_metrics
from zeroth.train.metrics import clear as clear_metrics
from zeroth.transport import identity, processes

__all__ = [
    "check_resume",
    "common_step",
    "common_steps",
    "merge_records",
    "merge_replicas",
    "process_dirs",
    "read_records",
    "replica_dir",
    "run_config",
    "stage_dir",
    "start_stages",
    "wait_stages",
]


def stage_dir(out: Path, index: int) -> Path:
    """``OUT/stage_<index>``."""
    return Path(out) / f"stage_{index}"


def replica_dir(out: Path, replica: int) -> Path:
    """The folder of replica ``replica``'s stages: ``OUT`` for replica 0, ``OUT/replica_<r>`` for the others."""
    return Path(out) if replica == 0 else Path(out) / f"replica_{replica}"


def process_dirs(out: Path, stages: int, replicas: int = 1) -> list[Path]:
    """Every stage process's folder, replica by replica, stage by stage."""
    return [stage_dir(replica_dir(out, r), i) for r in range(replicas) for i in range(stages)]


def common_steps(out: Path, stages: int, replicas: int = 1) -> list[int]:
    """The checkpoint steps every stage (of every replica) holds, ascending."""
    common = None
    for sd in process_dirs(out, stages, replicas):
        d = sd / "checkpoints"
        steps = {int(p.name) for p in d.iterdir() if p.name.isdigit()} if d.is_dir() else set()
        common = steps if common is None else common & steps
    return sorted(common or ())


def common_step(out: Path, stages: int, replicas: int = 1) -> int | None:
    """The newest checkpoint step every stage (of every replica) holds, or None."""
    steps = common_steps(out, stages, replicas)
    return steps[-1] if steps else None


def check_resume(out: Path, stages: int, step: int, replicas: int = 1) -> None:
    """Check that every stage (of every replica) holds checkpoint ``step`` and that its AQ-SGD buffer
    files of that step (where it has them) and its averaging state (with replicas) read back whole.

    Raises:
      CheckpointError: one line naming the stage folder or the damaged file, and the older
        steps every stage holds (the ``--resume-step`` to use instead).
    """
    from zeroth import compress as C
    from zeroth.train.checkpoint import CheckpointError

    held = common_steps(out, stages, replicas)
    dirs = process_dirs(out, stages, replicas)
    older = [s for s in held if s < step]
    hint = (
        f"older steps every stage holds: {older}; resume one with `zeroth run CONFIG --resume --resume-step "
        f"{older[-1]}`"
        if older
        else "no older step is held by every stage; start again in a fresh --out folder"
    )
    if step not in held:
        missing = [
            str(d.relative_to(out)) if replicas > 1 else str(i)
            for i, d in enumerate(dirs)
            if not (d / "checkpoints" / str(step)).is_dir()
        ]
        raise CheckpointError(
            f"--resume-step {step}: stage{'s' if len(missing) > 1 else ''} "
            f"{', '.join(missing)} hold{'' if len(missing) > 1 else 's'} no checkpoint "
            f"{step} in {out}; {hint}"
        )
    import numpy as np

    for d in dirs:
        for f in sorted((d / "buffers").glob(f"{step}_*.npz")):
            try:
                C.read_buffer_file(f)
            except ValueError as e:
                raise CheckpointError(f"cannot resume from step {step}: {e}. Nothing was deleted; {hint}") from None
        if replicas > 1:
            f = d / "sync" / f"{step}.npz"
            try:
                with np.load(f, allow_pickle=False) as z:
                    for k in z.files:
                        z[k]
            except (OSError, ValueError, EOFError, zipfile.BadZipFile) as e:
                raise CheckpointError(
                    f"cannot resume from step {step}: the averaging state {f} cannot be read ({e}). "
                    f"Nothing was deleted; {hint}"
                ) from None


def start_stages(
    cfg: _config.Config,
    out: Path,
    *,
    resume_step: int | None = None,
    quiet: bool = True,
    env: dict | None = None,
    insecure: bool = False,
) -> list[subprocess.Popen]:
    """Start one ``zeroth stage`` process per stage (last first) of every replica; returns them in
    the order of :func:`process_dirs` (replica by replica, stage by stage).

    With ``pipeline.replicas`` R > 1, replica ``r``'s stages live in :func:`replica_dir` and link to
    each other; replica 0 of each stage serves its averaging (``--sync-listen``, only to streams signed
    by the other replicas' keys, ``--replica-key``), the other
    replicas of the stage connect to it (``--sync-server @<its folder>/sync_address``).

    The stages share a fresh run secret (in their environment), so every link carries its access
    token and a process without it cannot feed or read a stage; ``insecure`` starts them without.
    Every stage after the first serves only a link signed by the previous stage's key (its
    ``key.pub``, ``--upstream-key``).
    """
    out = Path(out)
    env = identity.launch_env(insecure, env)
    out.mkdir(parents=True, exist_ok=True)
    cfg_path = out / "config.yaml"
    cfg_path.write_text(_config.to_yaml(cfg))
    p = cfg.pipeline
    procs: dict[tuple[int, int], subprocess.Popen] = {}
    R = p.replicas
    for r, i in [(r, i) for r in range(R) for i in reversed(range(p.stages))]:
        rd = replica_dir(out, r)
        d = stage_dir(rd, i)
        d.mkdir(parents=True, exist_ok=True)
        for f in ("address", "sync_address", "stop", "key.pub"):  # a previous run's key: every new stage writes its own
            (d / f).unlink(missing_ok=True)
    for r, i in [(r, i) for r in range(R) for i in reversed(range(p.stages))]:
        rd = replica_dir(out, r)
        d = stage_dir(rd, i)
        # `python -m zeroth.pipeline.stage` is `zeroth stage` (the launcher stays below the command layer)
        cmd = [
            sys.executable,
            "-m",
            "zeroth.pipeline.stage",
            "--config",
            str(cfg_path),
            "--stage",
            str(i),
            "--out",
            str(d),
        ]
        if i > 0:
            cmd += ["--listen", f"{p.host}:0", "--upstream-key", f"@{stage_dir(rd, i - 1) / 'key.pub'}"]
        if i < p.stages - 1:
            cmd += ["--next", f"@{stage_dir(rd, i + 1) / 'address'}"]
        if R > 1:
            cmd += ["--replica", str(r)]
            cmd += (
                ["--sync-listen", f"{p.host}:0"]
                if r == 0
                else ["--sync-server", f"@{stage_dir(out, i) / 'sync_address'}"]
            )
            if r == 0:  # replica 0 serves only the streams its replicas' keys signed
                for rr in range(1, R):
                    cmd += ["--replica-key", f"{rr}=@{stage_dir(replica_dir(out, rr), i) / 'key.pub'}"]
        if resume_step is not None:
            cmd += ["--resume-step", str(resume_step)]
        if quiet:
            cmd += ["--quiet"]
        if insecure:
            cmd += ["--insecure"]
        procs[r, i] = processes.start(cmd, d / "stage.log", env=env, append=True)
    return [procs[r, i] for r in range(R) for i in range(p.stages)]


def wait_stages(
    procs: list[subprocess.Popen],
    out: Path,
    timeout_s: float | None = None,
    stop=None,
    stop_grace_s: float = 120.0,
    dirs: list[Path] | None = None,
) -> int:
    """Wait for every stage; if one fails, stop the others. Returns 0, or 1 with the failures printed.

    When ``stop()`` turns true, ``stage_<i>/stop`` is written for every stage: the pipeline stops
    at a step boundary (:mod:`zeroth.pipeline.stage`) and each stage exits 130 with its
    checkpoint; then the result is 130 (0 if every stage had finished anyway). Stages still alive
    ``stop_grace_s`` seconds later are stopped. ``dirs``: the processes' folders (default
    ``OUT/stage_<i>``, one replica; :func:`process_dirs` with several).
    """
    dirs = dirs or [stage_dir(out, i) for i in range(len(procs))]
    deadline = None if timeout_s is None else time.monotonic() + timeout_s
    stopping = False

    def tick() -> str | None:
        nonlocal stopping, deadline
        if not stopping and stop is not None and stop():
            stopping = True
            for d in dirs:
                (d / "stop").touch()
            deadline = time.monotonic() + stop_grace_s
        if deadline is not None and time.monotonic() > deadline:
            processes.stop(procs)
            return "timeout"
        return None

    processes.watch(
        procs,
        tick,
        failed=lambda i, pr: pr.poll() not in ((None, 0, interrupt.EXIT_CODE) if stopping else (None, 0)),
        interval_s=0.1,
    )
    codes = [pr.wait() for pr in procs]
    if all(c == 0 for c in codes):
        return 0
    if stopping and all(c in (0, interrupt.EXIT_CODE) for c in codes):
        return interrupt.EXIT_CODE
    for i, c in enumerate(codes):
        if c != 0:
            print(processes.exit_line(f"stage {dirs[i].relative_to(out)}", c, dirs[i] / "stage.log"), file=sys.stderr)
    return 1


def merge_records(out: Path, stages: int, batch_size: int, examples: int) -> list[dict]:
    """One ``train`` row per step (:func:`zeroth.pipeline.sim.step_record`) from the stages' rows.

    Per link: the sender's forward bytes, frames, send-buffer digest and ``c_Q``
    (``fw_cq``, ``fw_cq_max``, ``fw_cq_init``), the receiver's backward bytes, frames, ``c_Q``
    (``bw_cq``, ``bw_cq_max``, ``bw_cq_init``) and receive-buffer digest; per stage: its times, buffer size and
    parameter digest. The row's time is the slowest stage's (``step_time_s``, ``wall_time_s``,
    ``time_unix_s``: the last to finish); its payload bytes are summed over the stages.
    """
    per = [{r["step"]: r for r in _read(stage_dir(out, i) / "metrics.jsonl")} for i in range(stages)]
    steps = sorted(set.intersection(*(set(p) for p in per))) if per else []
    records = []
    for t in steps:
        rs = [p[t] for p in per]
        links = []
        for k in range(stages - 1):
            links.append(
                {
                    "link": k,
                    "fw_bytes": rs[k]["fw_bytes"],
                    "fw_frames": rs[k]["fw_frames"],
                    "bw_bytes": rs[k + 1]["bw_bytes"],
                    "bw_frames": rs[k + 1]["bw_frames"],
                    "send_digest": rs[k]["send_digest"],
                    "recv_digest": rs[k + 1]["recv_digest"],
                    **{f: rs[k].get(f) for f in ("fw_cq", "fw_cq_max", "fw_cq_init")},
                    **{f: rs[k + 1].get(f) for f in ("bw_cq", "bw_cq_max", "bw_cq_init")},
                }
            )
        st = [
            {
                "stage": i,
                "compute_s": r["compute_s"],
                "codec_s": r["codec_s"],
                "wait_s": r["wait_s"],
                "transfer_s": r["transfer_s"],
                "buffer_bytes": r["buffer_bytes"],
                "digest": r["digest"],
            }
            for i, r in enumerate(rs)
        ]
        records.append(
            sim.step_record(
                t,
                epoch=(t - 1) * batch_size // examples,
                loss=rs[-1]["loss"],
                lr=rs[-1]["lr"],
                links=links,
                stages=st,
                step_time_s=max(r["step_time_s"] for r in rs),
                wall_time_s=max(r["wall_time_s"] for r in rs),
                payload_bytes_total=sum(r["payload_bytes_total"] for r in rs),
                time_unix_s=max(r["time_unix_s"] for r in rs),
            )
        )
    return records


def merge_replicas(out: Path, stages: int, replicas: int, batch_size: int, examples: int) -> list[dict]:
    """:func:`merge_records` of replica 0, each row with the fields of
    :func:`zeroth.pipeline.sim.replica_fields`: ``sync`` per stage and replica ``r > 0`` (its
    ``up_bytes`` sent to replica 0 of the stage and ``down_bytes`` received, ``bits``, ``sync_s``),
    ``replicas`` (each replica's loss, link bytes and digest), ``sync_bytes``, ``replicas_agree``;
    the row's ``loss`` is the replicas' mean and ``payload_bytes`` counts every replica's links and
    the averaging."""
    merged = [
        {r["step"]: r for r in merge_records(replica_dir(out, k), stages, batch_size, examples)}
        for k in range(replicas)
    ]
    raw = {
        (k, i): {r["step"]: r for r in _read(stage_dir(replica_dir(out, k), i) / "metrics.jsonl")}
        for k in range(1, replicas)
        for i in range(stages)
    }
    steps = sorted(set.intersection(*(set(m) for m in merged))) if merged else []
    records, total = [], 0
    for t in steps:
        sync = [
            {
                "stage": i,
                "replica": k,
                "bits": raw[k, i][t]["sync_bits"],
                "up_bytes": raw[k, i][t]["sync_sent_bytes"],
                "down_bytes": raw[k, i][t]["sync_recv_bytes"],
                "sync_s": raw[k, i][t]["sync_s"],
            }
            for i in range(stages)
            for k in range(1, replicas)
        ]
        reps = [
            {
                "replica": k,
                "loss": m[t]["loss"],
                "link_bytes": sum(lk["fw_bytes"] + lk["bw_bytes"] for lk in m[t]["links"]),
                "digest": m[t]["digest"],
            }
            for k, m in enumerate(merged)
        ]
        extra = sim.replica_fields(sync, reps)
        base = merged[0][t]
        loss = extra.pop("loss")
        rec = sim.step_record(
            t,
            epoch=base["epoch"],
            loss=loss,
            lr=base["lr"],
            links=base["links"],
            stages=base["stages"],
            step_time_s=max(m[t]["step_time_s"] for m in merged),
            wall_time_s=max(m[t]["wall_time_s"] for m in merged),
            payload_bytes_total=0,
            time_unix_s=max(m[t]["time_unix_s"] for m in merged),
            **extra,
        )
        total += rec["payload_bytes"]
        rec["payload_bytes_total"] = total
        records.append(rec)
    return records


def _read(path: Path) -> list[dict]:
    return read_metrics(path) if path.is_file() else []


def read_records(out: Path) -> list[dict]:
    """The merged rows of a finished run (``OUT/metrics.jsonl``)."""
    return _read(Path(out) / "metrics.jsonl")


def run_config(
    cfg: _config.Config, out: Path, argv: list[str], progress: bool = True, stop=None, resume_step: int | None = None
) -> int:
    """Run the pipeline of ``cfg`` as stage processes into ``out``; ``--resume`` in ``argv`` resumes
    (from ``resume_step`` when given, else the newest step every stage holds). Exit code.

    ``stop`` (a signal flag's ``is_set``) stops every stage at one step boundary with a checkpoint
    (:func:`wait_stages`); then :class:`zeroth.train.interrupt.Interrupted` is raised with that step.
    """
    out = Path(out)
    p = cfg.pipeline
    if resume_step is not None and "--resume" not in argv:
        raise ValueError("--resume-step needs --resume")
    if "--resume" in argv:
        resume_step = common_step(out, p.stages, p.replicas) if resume_step is None else resume_step
        if resume_step is None:
            print(
                f"zeroth run: error: --resume: no checkpoint step common to all {p.stages * p.replicas} stage "
                f"processes in {out}",
                file=sys.stderr,
            )
            return 2
        check_resume(out, p.stages, resume_step, p.replicas)
    t0 = time.time()
    procs = start_stages(cfg, out, resume_step=resume_step, quiet=not progress)
    code = wait_stages(procs, out, stop=stop, dirs=process_dirs(out, p.stages, p.replicas))
    if code == interrupt.EXIT_CODE:
        step = common_step(out, p.stages, p.replicas)
        raise interrupt.Interrupted(
            step or 0, cfg.train.steps, None if step is None else out / "stage_*" / "checkpoints" / str(step)
        )
    if code != 0:
        return code
    if p.replicas > 1:
        records = merge_replicas(out, p.stages, p.replicas, cfg.data.batch_size, p.examples)
    else:
        records = merge_records(out, p.stages, cfg.data.batch_size, p.examples)
    clear_metrics(out / "metrics.jsonl")
    with MetricsWriter(out / "metrics.jsonl", tensorboard=cfg.run.tensorboard) as writer:
        for r in records:
            writer.write(r)
    mismatched = [r["step"] for r in records for lk in r["links"] if lk["send_digest"] != lk["recv_digest"]]
    summary = {
        "steps": len(records),
        "final_loss": records[-1]["loss"] if records else None,
        "seconds": time.time() - t0,
        "buffers_agree": not mismatched,
        "mismatched_steps": mismatched,
        "stages": [json.loads((d / "summary.json").read_text()) for d in process_dirs(out, p.stages, p.replicas)],
    }
    if p.replicas > 1:
        disagree = [r["step"] for r in records if not r["replicas_agree"]]
        summary.update(
            {
                "replicas": p.replicas,
                "replica_sync": p.replica_sync,
                "replicas_agree": not disagree,
                "sync_bytes_per_step": sum(r["sync_bytes"] for r in records) / max(len(records), 1),
                "link_bytes_per_step": sum(r["payload_bytes"] - r["sync_bytes"] for r in records)
                / max(len(records), 1),
            }
        )
    (out / "summary.json").write_text(json.dumps(summary, indent=1))
    if progress:
        print(
            f"pipeline done: {len(records)} steps, final loss {summary['final_loss']}, "
            f"buffers agree on every link: {not mismatched}, {summary['seconds']:.1f}s"
        )
    if p.replicas > 1 and not summary["replicas_agree"]:
        print(f"zeroth run: error: the replicas' parameters differ at steps {disagree}", file=sys.stderr)
        return 1
    if mismatched:
        print(
            f"zeroth run: error: AQ-SGD buffers differ between the ends of a link at steps {mismatched}",
            file=sys.stderr,
        )
        return 1
    return 0
