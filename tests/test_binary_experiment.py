"""The binary learning experiment: config validation, `zeroth run` end to end on a tiny config, the notebook."""

import json
from pathlib import Path

import pytest
import yaml
from notebook_util import execute
from tb_util import assert_mirrors

from zeroth import config as C
from zeroth import run as zrun
from zeroth.train.metrics import check_schema, read_metrics
from zeroth.train.runs import load_run

REPO = Path(__file__).resolve().parent.parent


@pytest.mark.parametrize(
    "raw,match",
    [
        ({"binary": {"methods": ["flips", "sgd"]}}, "binary.methods: bad value 'sgd'; expected one of"),
        ({"binary": {"weights": ["quaternary"]}}, "binary.weights: bad value 'quaternary'"),
        ({"binary": {"chanels": [8]}}, "unknown config key 'chanels' in section 'binary'"),
        ({"binary": {"channels": []}}, "binary.channels: empty"),
        ({"binary": {"k": 0}}, "binary.k: bad value 0; expected >= 1"),
        ({"binary": {}, "peers": {}}, "'binary' and 'peers' cannot be combined"),
    ],
)
def test_binary_section_is_validated(raw, match):
    with pytest.raises(ValueError, match=match):
        C.load_config_dict(raw)


def test_committed_experiments_load():
    for path in sorted((REPO / "experiments").glob("binary_*.yaml")):
        cfg = C.load_config(path)
        assert cfg.binary is not None and cfg.data.dataset in ("digits", "mnist5k", "fashion_mnist"), path


def test_zeroth_run_binary_config_end_to_end(tmp_path):
    raw = {
        "run": {"name": "tiny", "seed": 1},
        "data": {"dataset": "digits", "batch_size": 16, "eval_size": 100},
        "binary": {
            "methods": ["flips", "evolution", "float32"],
            "weights": ["ternary"],
            "channels": [8],
            "levels": 4,
            "train_size": 200,
            "steps": 4,
            "k": 2,
            "grid": 2,
            "float_steps": 3,
            "workers": 0,
            "speed_repeats": 1,
        },
    }
    path = tmp_path / "tiny.yaml"
    path.write_text(yaml.safe_dump(raw))
    assert zrun.main([str(path), "--out", str(tmp_path / "out"), "--quiet"]) == 0
    res = json.loads((tmp_path / "out" / "results.json").read_text())
    assert [m["name"] for m in res["models"]] == ["ternary/flips", "ternary/evolution"]
    for m in res["models"]:
        assert 0.0 <= m["test_accuracy"] <= 1.0 and len(m["loss_curves"][0]) == 4 and len(m["checksums"][0]) == 64
    assert res["layer_cache"] == {"trained": 2, "hits": 0}
    assert 0.0 <= res["float32"]["test_accuracy"] <= 1.0
    assert {r["kind"] for r in res["speed"]} == {"binary", "float32"}
    rows = read_metrics(tmp_path / "out" / "metrics.jsonl")
    # 2 models x 4 steps and their frozen layer, then the float network's 3 steps and its evaluation
    assert check_schema(rows) == len(rows) == 2 * (4 + 1) + 3 + 1
    assert [r["step"] for r in rows] == [1, 2, 3, 4, 4, 5, 6, 7, 8, 8, 9, 10, 11, 11]
    evals = [r for r in rows if r["kind"] == "eval"]
    assert [(r["model"], r["eval_accuracy"]) for r in evals] == [
        *((m["name"], m["test_accuracy"]) for m in res["models"]),
        ("float32/backprop", res["float32"]["test_accuracy"]),
    ]
    assert evals[0]["digest"] == res["models"][0]["checksums"][0] == rows[3]["digest"]
    assert [r["forward_passes"] for r in rows if r["kind"] == "train"][:5] == [
        2,
        4,
        6,
        8,
        11,
    ]  # flips 2, evolution 3 per step
    assert_mirrors(tmp_path / "out", rows, ("loss", "eval_accuracy", "eval_loss", "forward_passes"))
    run = load_run(tmp_path / "out")  # the folder reads back: its kind, metrics and results
    assert run.kind == "binary" and run.metrics == rows and run.summary == res and run.params is None


@pytest.mark.slow
def test_binary_notebook_executes_on_the_committed_results(tmp_path, monkeypatch):
    monkeypatch.setenv("MPLBACKEND", "Agg")
    monkeypatch.setenv("ZEROTH_FIGURES", str(tmp_path))
    text = execute(REPO / "notebooks" / "binary.ipynb", REPO / "notebooks")
    assert "fashion_mnist" in text and "mnist5k" in text
    assert "float32/backprop" in text and "binary/flips" in text and "ternary/ste" in text
    assert "checksum mismatches: 0" in text
    for png in ("binary_accuracy.png", "binary_curves.png", "binary_bytes.png"):
        assert (tmp_path / png).stat().st_size > 10_000


def test_a_checkpoint_save_cut_between_its_renames_is_finished_with_the_new_checkpoint(tmp_path):
    import os

    from zeroth.binary.experiment import finish_checkpoint_swap, save_checkpoint

    ck = tmp_path / "checkpoint"
    save_checkpoint(ck, {"phase": "layers", "model": 0})
    assert not finish_checkpoint_swap(ck)  # a whole checkpoint: nothing to do
    # the second save wrote its .tmp whole, moved the first aside, and was killed before the last rename
    save_checkpoint(tmp_path / "next", {"phase": "layers", "model": 1})
    os.replace(tmp_path / "next", tmp_path / "checkpoint.tmp")
    os.replace(ck, tmp_path / "checkpoint.old")
    assert finish_checkpoint_swap(ck)
    assert json.loads((ck / "state.json").read_text())["model"] == 1
    assert sorted(p.name for p in tmp_path.iterdir()) == ["checkpoint"]
    # a .tmp cut short (no state.json) beside a whole checkpoint is not taken
    (tmp_path / "checkpoint.tmp").mkdir()
    assert not finish_checkpoint_swap(ck) and json.loads((ck / "state.json").read_text())["model"] == 1
