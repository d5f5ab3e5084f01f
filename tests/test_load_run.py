"""One metrics schema and `load_run`: the trainer's rows pass the schema check, a single-machine run
writes summary.json, and `load_run` gives back its config, metrics (and a DataFrame with integer
columns), summary and final parameters. Peer, pipeline and binary folders are read back by their
own end-to-end tests (test_peer_resume, test_pipeline_e2e, test_binary_experiment)."""

import json

import numpy as np
import pytest
from tb_util import assert_mirrors

from zeroth.config import load_config_dict
from zeroth.replay import checksum
from zeroth.train import trainer
from zeroth.train.metrics import check_schema, read_metrics, summarize
from zeroth.train.runs import load_run

RAW = {
    "run": {"name": "lr", "seed": 0},
    "data": {"dataset": "digits", "batch_size": 32, "eval_size": 100},
    "model": {"name": "mlp", "kwargs": {"hidden": [16]}},
    "train": {
        "method": "zo",
        "lr": 0.02,
        "eps": 1.0e-3,
        "n_perturbations": 8,
        "codec": "onebyte",
        "steps": 8,
        "eval_every": 4,
        "log_every": 2,
        "checkpoint_every": 4,
    },
}


def test_check_schema_names_the_row_and_the_field():
    good = {
        "kind": "train",
        "step": 1,
        "time_unix_s": 1.0,
        "wall_time_s": 0.1,
        "digest": "d",
        "forward_passes": 2,
        "payload_bytes_total": 1,
        "loss": 0.5,
        "lr": 0.1,
        "step_time_s": 0.01,
        "payload_bytes": 1,
    }
    assert check_schema([good]) == 1
    with pytest.raises(ValueError, match="row 1 .* no field 'lr'"):
        check_schema([{k: v for k, v in good.items() if k != "lr"}])
    with pytest.raises(ValueError, match="row 2 has step 0 after step 1"):
        check_schema([good, {**good, "step": 0}])
    with pytest.raises(ValueError, match="second train row of step 1"):
        check_schema([good, good])
    with pytest.raises(ValueError, match="kind 'iteration'"):
        check_schema([{**good, "kind": "iteration"}])
    with pytest.raises(ValueError, match="field 'step' is 1.0"):
        check_schema([{**good, "step": 1.0}])
    # merged rows of several nodes (a Ravnest run): the step rules hold per node
    a, b = {**good, "node": "a"}, {**good, "node": "b"}
    assert check_schema([{**a, "step": 2}, b, {**b, "step": 2}, {**a, "step": 3}]) == 4
    with pytest.raises(ValueError, match="row 3 has step 1 after step 2 of node 'a'"):
        check_schema([{**a, "step": 2}, b, a])
    with pytest.raises(ValueError, match="row 2 is a second train row of step 1"):
        check_schema([b, b])
    with pytest.raises(ValueError, match="field 'node' is 3"):
        check_schema([{**good, "node": 3}])


def test_a_single_machine_run_loads_back_whole(tmp_path):
    result = trainer.train(load_config_dict(RAW), tmp_path / "run", progress=False)
    rows = read_metrics(tmp_path / "run" / "metrics.jsonl")
    assert check_schema(rows) == len(rows) == 3 + 4  # evals at 0, 4, 8; train rows at 2, 4, 6, 8
    train_rows = [r for r in rows if r["kind"] == "train"]
    assert [r["payload_bytes"] for r in train_rows] == [8] * 4  # this step's bytes: 8 one-byte projected gradients
    assert [r["payload_bytes_total"] for r in train_rows] == [16, 32, 48, 64]  # cumulative
    assert all(r["lr"] == 0.02 and r["step_time_s"] > 0 for r in train_rows)
    # the TensorBoard event file beside it holds the same numbers (run.tensorboard is on by default)
    tags = assert_mirrors(tmp_path / "run", rows, ("loss", "lr", "eval_accuracy", "eval_loss", "payload_bytes_total"))
    assert {"train/loss", "train/step_time_s", "eval/accuracy", "eval/loss"} <= set(tags)

    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["kind"] == "single" and summary["steps"] == 8 and summary["digest"] == result.digest
    assert summary["payload_bytes"] == 64 and summary["eval_accuracy"] == result.eval["eval_accuracy"]
    assert summarize(tmp_path / "run" / "metrics.jsonl")["payload_bytes"] == 64

    run = load_run(tmp_path / "run")
    assert run.kind == "single" and run.step == 8 and run.config["train"]["lr"] == 0.02
    assert run.metrics == rows and run.summary == summary
    assert checksum(run.params) == result.digest
    assert all(isinstance(a, np.ndarray) for a in __import__("jax").tree_util.tree_leaves(run.params))
    frame = run.metrics.frame()
    assert frame["step"].dtype.kind == "i" and frame["forward_passes"].dtype.kind == "i"
    evals = run.metrics.frame("eval")
    assert evals["step"].tolist() == [0, 4, 8] and evals["eval_accuracy"].notna().all()


def test_load_run_refuses_a_folder_without_a_run(tmp_path):
    with pytest.raises(FileNotFoundError, match="holds no run"):
        load_run(tmp_path)
    with pytest.raises(FileNotFoundError, match="is not a folder"):
        load_run(tmp_path / "missing")
