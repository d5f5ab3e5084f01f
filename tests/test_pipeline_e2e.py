"""Pipelines of real stage processes on 127.0.0.1 (zeroth's tiny transformer, a few steps).

* float32 links: 2 and 3 stages give the single-process model's losses and parameters;
* AQ-SGD: both ends of every link hold the same buffers at every step; a stage killed mid-run
  and restarted resumes from its checkpoint with its buffers, and the run ends bit for bit where
  an uninterrupted run (the same engines in one process) ends.
"""

import signal
import time

import jax
import numpy as np
import pytest
from tb_util import assert_mirrors

from zeroth import compress as C
from zeroth.config import load_config_dict
from zeroth.pipeline import build, launch, link, sim
from zeroth.train.checkpoint import CheckpointError, Checkpointer, checksum
from zeroth.train.metrics import check_schema, read_metrics
from zeroth.train.runs import load_run

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

TINY = {"d_model": 16, "heads": 2, "layers": 3, "mlp_dim": 32}


def _cfg(stages, objective, compression="fp32", steps=3, **pipeline):
    dataset = "sotu" if objective == "lm" else "sentiment"
    return load_config_dict(
        {
            "run": {"name": f"pl{stages}", "seed": 0},
            "data": {"dataset": dataset, "batch_size": 4},
            "model": {"name": "transformer", "kwargs": TINY},
            "train": {
                "method": "backprop",
                "lr": 1e-2,
                "steps": steps,
                "optimizer": {"name": "adamw"},
                "keep_checkpoints": 0,
            },
            "pipeline": {
                "stages": stages,
                "micro_batches": 2,
                "examples": 8,
                "seq_len": 16,
                "objective": objective,
                "compression": compression,
                "fw_bits": 2,
                "bw_bits": 4,
                **pipeline,
            },
        }
    )


def _logs(out) -> str:
    """The tail of every stage's log, for assertion messages."""
    parts = []
    for log in sorted(out.glob("stage_*/stage.log")):
        parts.append(f"{log.parent.name}: " + " | ".join(log.read_text().strip().splitlines()[-4:]))
    return "\n".join(parts)


def _stage_params(cfg, out, steps):
    ex = build.examples_of(cfg)
    part = build.partition_of(cfg, ex)
    params = []
    for s in range(cfg.pipeline.stages):
        ck = Checkpointer(launch.stage_dir(out, s) / "checkpoints")
        params.append(ck.restore(steps, part.params[s], None).params)
        ck.close()
    return params


@pytest.mark.parametrize("stages, objective", [(2, "lm"), (3, "classify")])
def test_fp32_pipeline_equals_the_single_process_model(tmp_path, stages, objective):
    cfg = _cfg(stages, objective)
    assert launch.run_config(cfg, tmp_path, [], progress=False) == 0, _logs(tmp_path)
    records = launch.read_records(tmp_path)
    run = load_run(tmp_path)  # the folder reads back: its kind, config, merged metrics and summary
    assert (
        run.kind == "pipeline" and run.metrics == records and run.summary and run.config["pipeline"]["stages"] == stages
    )
    # every writer's rows pass the schema: the merged rows and each stage's own
    assert check_schema(records) == 3 and [r["step"] for r in records] == [1, 2, 3]
    for s in range(stages):
        rows = read_metrics(launch.stage_dir(tmp_path, s) / "metrics.jsonl")
        assert check_schema(rows, f"stage {s}") == 3
        assert_mirrors(launch.stage_dir(tmp_path, s), rows, ("loss", "payload_bytes", "step_time_s"))
        assert [r["payload_bytes"] for r in rows] == [r["fw_bytes"] + r["bw_bytes"] for r in rows]
    assert records[-1]["payload_bytes_total"] == sum(r["payload_bytes"] for r in records)
    assert_mirrors(tmp_path, records, ("loss", "payload_bytes_total", "step_time_s"))
    assert records[-1]["digest"] == sim.pipeline_digest([checksum(p) for p in _stage_params(cfg, tmp_path, 3)])
    losses, ref = sim.reference_run(cfg, 3)
    np.testing.assert_allclose([r["loss"] for r in records], losses, rtol=1e-5)
    got = _stage_params(cfg, tmp_path, 3)
    for s in range(stages):
        flat_got = dict(jax.tree_util.tree_flatten_with_path(got[s])[0])
        for path, want in jax.tree_util.tree_flatten_with_path(ref[s])[0]:
            name = jax.tree_util.keystr(path)
            # the exact gradient of an attention key bias is zero (softmax ignores a shift), so
            # AdamW turns float rounding into steps of up to lr; every other parameter must agree
            atol = 3 * cfg.train.lr if "['key']['bias']" in name else 1e-5
            np.testing.assert_allclose(np.asarray(flat_got[path]), np.asarray(want), atol=atol, err_msg=name)
    for r in records:  # float32 links: every frame is 4 bytes per value plus a small header
        for lk in r["links"]:
            assert 4 * 2 * 16 * 16 * 2 < lk["fw_bytes"] < 4 * 2 * 16 * 16 * 2 + 200
            assert lk["fw_frames"] == lk["bw_frames"] == 2


@pytest.fixture(scope="module")
def uninterrupted():
    """The 5-step AQ-SGD run of the tests below in one process: ``(records, engines)`` (deployment
    fields such as the link latency and the checkpoint cadence do not change it)."""
    return sim.run_local(_cfg(2, "lm", "aqsgd", steps=5))


def test_aqsgd_stage_killed_and_restarted_resumes_with_its_buffers(tmp_path, uninterrupted):
    cfg = _cfg(2, "lm", "aqsgd", steps=5, latency_ms=150.0)
    cfg = cfg.__class__(
        **{**cfg.__dict__, "train": cfg.train.__class__(**{**cfg.train.__dict__, "checkpoint_every": 1})}
    )
    procs = launch.start_stages(cfg, tmp_path)
    ck_dir = launch.stage_dir(tmp_path, 1) / "checkpoints"
    deadline = time.monotonic() + 120
    while not (ck_dir / "2").is_dir() and time.monotonic() < deadline and procs[1].poll() is None:
        time.sleep(0.05)
    assert (ck_dir / "2").is_dir(), f"stage 1 never wrote its step-2 checkpoint:\n{_logs(tmp_path)}"
    procs[1].send_signal(signal.SIGKILL)
    assert launch.wait_stages(procs, tmp_path, timeout_s=120) == 1, _logs(tmp_path)
    resume_at = launch.common_step(tmp_path, 2)
    assert resume_at is not None and 1 <= resume_at < 5, (resume_at, _logs(tmp_path))  # the newest step both hold
    newest_1 = max(int(p.name) for p in ck_dir.iterdir() if p.name.isdigit())
    assert launch.run_config(cfg, tmp_path, ["--resume"], progress=False) == 0, _logs(tmp_path)

    if newest_1 > resume_at:  # stage 1's later checkpoints were moved aside, not overwritten or lost
        assert (launch.stage_dir(tmp_path, 1) / "checkpoints_quarantine" / str(newest_1)).is_dir()
    records = launch.read_records(tmp_path)
    assert check_schema(records) == 5 and [r["step"] for r in records] == [1, 2, 3, 4, 5]
    for r in records:  # both ends of the link hold the same buffers after every step
        assert r["links"][0]["send_digest"] == r["links"][0]["recv_digest"] is not None
    # epoch 0 (steps 0-1) sends every example in float32, later epochs 2-bit differences
    assert records[0]["links"][0]["fw_bytes"] > 4 * records[3]["links"][0]["fw_bytes"]

    local, engines = uninterrupted  # the uninterrupted run, same engines in one process
    import json

    summaries = [json.loads((launch.stage_dir(tmp_path, s) / "summary.json").read_text()) for s in range(2)]
    assert summaries[1]["start"] == resume_at
    for s, e in enumerate(engines):
        assert summaries[s]["param_digest"] == checksum(e.params)
        assert summaries[s]["send_digest"] == C.buffer_digest(e.send_state)
        assert summaries[s]["recv_digest"] == C.buffer_digest(e.recv_state)
    assert [r["loss"] for r in records] == [r["loss"] for r in local]
    assert [r["digest"] for r in records] == [r["digest"] for r in local]  # every step's parameters, bit for bit

    # a damaged buffer file of the newest step is named in one line, before any stage starts, with
    # the step to resume instead; resuming from that step (--resume-step) ends on the same run
    bad = launch.stage_dir(tmp_path, 1) / "buffers" / "5_recv.npz"
    bad.write_bytes(bad.read_bytes()[:100])
    with pytest.raises(CheckpointError) as e:
        launch.run_config(cfg, tmp_path, ["--resume"], progress=False)
    assert "\n" not in str(e.value) and str(bad) in str(e.value) and "--resume --resume-step 4" in str(e.value)
    assert launch.run_config(cfg, tmp_path, ["--resume"], progress=False, resume_step=4) == 0, _logs(tmp_path)
    summaries = [json.loads((launch.stage_dir(tmp_path, s) / "summary.json").read_text()) for s in range(2)]
    assert [sm["start"] for sm in summaries] == [4, 4]
    for s, e in enumerate(engines):
        assert summaries[s]["param_digest"] == checksum(e.params)
        assert summaries[s]["recv_digest"] == C.buffer_digest(e.recv_state)


def test_ctrl_c_stops_every_stage_at_one_step_and_resume_ends_on_the_uninterrupted_run(tmp_path, uninterrupted):
    import os
    import shlex
    import subprocess
    import sys
    from pathlib import Path

    from zeroth import config as _config
    from zeroth import run as zrun

    cfg = _cfg(2, "lm", "aqsgd", steps=5, latency_ms=50.0)  # checkpoints only at the end: the stop saves its own
    cfg_path = tmp_path / "p.yaml"
    cfg_path.write_text(_config.to_yaml(cfg))
    out = tmp_path / "cut"
    repo = Path(__file__).resolve().parent.parent
    env = {**os.environ, "PYTHONPATH": str(repo) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    rows = launch.stage_dir(out, 1) / "metrics.jsonl"
    with (tmp_path / "err").open("w") as err:  # its own process group: Ctrl-C reaches the launcher and every stage
        proc = subprocess.Popen(
            [sys.executable, "-m", "zeroth", "run", str(cfg_path), "--out", str(out), "--quiet"],
            cwd=repo,
            env=env,
            stdout=subprocess.DEVNULL,
            stderr=err,
            start_new_session=True,
        )
    try:
        deadline = time.monotonic() + 120
        while not (rows.is_file() and len(rows.read_text().splitlines()) >= 1):
            assert proc.poll() is None and time.monotonic() < deadline, (tmp_path / "err").read_text()[-2000:]
            time.sleep(0.02)
        os.killpg(proc.pid, signal.SIGINT)
        assert proc.wait(timeout=120) == 130, (tmp_path / "err").read_text()[-2000:]
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    lines = (tmp_path / "err").read_text().strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("zeroth run: interrupted by SIGINT after step "), lines
    step = int(lines[0].split("after step ")[1].split()[0])
    assert 1 <= step < 5 and launch.common_step(out, 2) == step, _logs(out)
    for s in range(2):  # every stage stopped at that step, its checkpoint saved there, its rows up to it
        assert [r["step"] for r in read_metrics(launch.stage_dir(out, s) / "metrics.jsonl")][-1] == step

    resume = shlex.split(lines[0].split("resume with: ")[1])
    assert zrun.main(resume[2:]) == 0, _logs(out)
    records = launch.read_records(out)
    assert check_schema(records) == 5 and [r["step"] for r in records] == [1, 2, 3, 4, 5]
    local, engines = uninterrupted
    assert [r["digest"] for r in records] == [r["digest"] for r in local]
    assert [r["loss"] for r in records] == [r["loss"] for r in local]
    assert records[-1]["digest"] == sim.pipeline_digest([checksum(e.params) for e in engines])


def test_a_secret_holder_connecting_first_cannot_take_the_upstream_slot(tmp_path, uninterrupted):
    """Stage 1 alone, listening; a process holding the run secret opens the upstream stream first
    (before stage 0 exists) and again while stage 0 trains: refused both times, no frame of it
    read; the run ends on the uninterrupted run's parameters (stage 0's activations trained it)."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    import grpc

    from zeroth import config as _config
    from zeroth.pipeline.proto import pipeline_pb2_grpc as pb_grpc
    from zeroth.transport import identity, security

    cfg = _cfg(2, "lm", "aqsgd", steps=5, latency_ms=100.0)
    cfg_path = tmp_path / "config.yaml"
    cfg_path.write_text(_config.to_yaml(cfg))
    repo = Path(__file__).resolve().parent.parent
    env = identity.launch_env(
        False, {**os.environ, "PYTHONPATH": str(repo) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    )
    d0, d1 = launch.stage_dir(tmp_path, 0), launch.stage_dir(tmp_path, 1)
    stage = [sys.executable, "-m", "zeroth.pipeline.stage", "--config", str(cfg_path), "--quiet"]
    procs = []

    def start(i, *args):
        launch.stage_dir(tmp_path, i).mkdir(parents=True, exist_ok=True)
        with (launch.stage_dir(tmp_path, i) / "stage.log").open("w") as log:
            procs.append(
                subprocess.Popen(
                    [*stage, "--stage", str(i), "--out", str(launch.stage_dir(tmp_path, i)), *args],
                    stdout=log,
                    stderr=subprocess.STDOUT,
                    env=env,
                )
            )

    md = security.token_metadata(identity.token_from_env(False, env))
    impostor = identity.Identity.generate()
    run_id = build.run_id_of(cfg)

    def intrude():
        with grpc.insecure_channel((d1 / "address").read_text().strip()) as ch:
            with pytest.raises(grpc.RpcError) as e:
                list(
                    pb_grpc.PipelineLinkStub(ch).Link(
                        iter([]),
                        timeout=30,
                        metadata=md + identity.call_metadata(impostor, 1 << 62, *link.link_fields(run_id, 0)),
                    )
                )
            return e.value.code()

    try:
        start(1, "--listen", "127.0.0.1:0", "--upstream-key", f"@{d0 / 'key.pub'}")
        deadline = time.monotonic() + 120
        while not (d1 / "address").is_file():
            assert procs[0].poll() is None and time.monotonic() < deadline, _logs(tmp_path)
            time.sleep(0.05)
        assert intrude() == grpc.StatusCode.UNAVAILABLE  # first to connect, and refused: stage 0's key is not known
        start(0, "--next", f"@{d1 / 'address'}")
        while not (d1 / "metrics.jsonl").is_file() or not (d1 / "metrics.jsonl").read_text().strip():
            assert all(p.poll() is None for p in procs) and time.monotonic() < deadline, _logs(tmp_path)
            time.sleep(0.05)
        assert intrude() == grpc.StatusCode.PERMISSION_DENIED  # stage 0's key is known now: not the impostor's
        assert launch.wait_stages([procs[1], procs[0]], tmp_path, timeout_s=120) == 0, _logs(tmp_path)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    import json

    local, engines = uninterrupted
    summaries = [json.loads((launch.stage_dir(tmp_path, s) / "summary.json").read_text()) for s in range(2)]
    assert [sm["param_digest"] for sm in summaries] == [checksum(e.params) for e in engines]
    assert [r["loss"] for r in read_metrics(d1 / "metrics.jsonl")] == [r["loss"] for r in local]
