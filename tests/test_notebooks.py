"""The analysis notebook: committed with the outputs of the runs in notebooks/data/analysis_small, which it
reproduces when executed again; and it executes on small real runs made here with the current trainer."""

import json
from pathlib import Path

import pytest

from notebook_util import committed_outputs_match, execute
from zeroth.train.metrics import check_schema, read_metrics

REPO = Path(__file__).resolve().parent.parent
NOTEBOOK = REPO / "notebooks" / "analysis.ipynb"
DATA = REPO / "notebooks" / "data" / "analysis_small"
PNGS = ("accuracy_vs_forward_passes.png", "codec_comparison_0.png", "bytes_on_the_wire.png")


def _runs(root: Path) -> None:
    """The layout of scripts/make_notebook_runs.sh, tiny: two seeds per codec, one MeZO and one backprop run."""
    from zeroth.config import load_config_dict
    from zeroth.train import trainer

    base = {
        "data": {"dataset": "digits", "batch_size": 32, "eval_size": 200},
        "model": {"name": "mlp", "kwargs": {"hidden": [16]}},
        "train": {"method": "zo", "lr": 0.02, "n_perturbations": 8, "steps": 12, "eval_every": 4, "log_every": 4},
    }
    for codec in ("onebyte", "float32"):
        for seed in (0, 1):
            raw = {
                **base,
                "run": {"name": f"{codec}_s{seed}", "seed": seed},
                "train": {**base["train"], "codec": codec},
            }
            trainer.train(load_config_dict(raw), root / "codec" / codec / f"seed_{seed}", progress=False)
    bp = {**base, "run": {"name": "bp"}, "train": {"method": "backprop", "lr": 1e-2, "steps": 48, "eval_every": 8}}
    trainer.train(load_config_dict(bp), root / "backprop", progress=False)


@pytest.mark.slow
def test_analysis_notebook_executes_on_real_runs(tmp_path, monkeypatch):
    _runs(tmp_path / "runs")
    figures = tmp_path / "figures"
    monkeypatch.setenv("ZEROTH_RUNS", str(tmp_path / "runs"))
    monkeypatch.setenv("ZEROTH_FIGURES", str(figures))
    monkeypatch.setenv("MPLBACKEND", "Agg")
    text = execute(NOTEBOOK, REPO / "notebooks")
    assert "5 runs under" in text and "1 codec comparison(s)" in text
    assert (
        "codec/onebyte/seed_0" in text and "setting codec/onebyte: MeZO n=8 onebyte (lr 0.02): 2 seed(s) [0, 1]" in text
    )
    lines = [line.split() for line in text.splitlines()]
    codec_rows = {row[1]: row for row in lines if len(row) >= 7 and row[0] == "0" and row[1] in ("onebyte", "float32")}
    assert codec_rows["onebyte"][2] == "2" and codec_rows["float32"][2] == "2"
    # the same forward passes; the one-byte codec sends a quarter of the bytes
    assert codec_rows["onebyte"][-1] == codec_rows["float32"][-1] == str(12 * 2 * 8)
    assert int(codec_rows["float32"][-2]) == 4 * int(codec_rows["onebyte"][-2]) == 4 * 12 * 8
    # backprop's bytes are its float32 gradient per step: d = 64*16 + 16 + 16*10 + 10
    assert f"{4 * 1210:,}" in text and "computed, d = 1210" in text
    for png in PNGS:
        assert (figures / png).stat().st_size > 10_000


def test_committed_analysis_runs_are_real_and_consistent():
    """The committed runs hold the schema, and the codec runs are the first 600 steps of the MeZO runs."""
    folders = sorted(p.parent for p in DATA.glob("**/metrics.jsonl"))
    assert len(folders) == 12, folders
    for f in folders:
        rows = read_metrics(f / "metrics.jsonl")
        assert check_schema(rows, str(f)) == len(rows)
        assert json.loads((f / "summary.json").read_text())["digest"] == rows[-1]["digest"]
    for seed in (0, 1, 2):
        mezo = {r["step"]: r for r in read_metrics(DATA / "mezo_digits" / f"seed_{seed}" / "metrics.jsonl")}
        onebyte = read_metrics(DATA / "codec" / "onebyte" / f"seed_{seed}" / "metrics.jsonl")
        float32 = read_metrics(DATA / "codec" / "float32" / f"seed_{seed}" / "metrics.jsonl")
        # mezo_digits.yaml and onebyte_vs_float32.yaml are the same training, 1000 vs 600 steps: equal digests
        assert onebyte[-1]["step"] == 600 and onebyte[-1]["digest"] == mezo[600]["digest"]
        assert float32[-1]["digest"] != onebyte[-1]["digest"]
        assert onebyte[-1]["payload_bytes_total"] * 4 == float32[-1]["payload_bytes_total"] == 600 * 16 * 4


@pytest.mark.slow
def test_committed_analysis_notebook_reproduces_its_outputs(tmp_path, monkeypatch):
    monkeypatch.delenv("MPLBACKEND", raising=False)
    monkeypatch.delenv("ZEROTH_RUNS", raising=False)
    monkeypatch.setenv("ZEROTH_FIGURES", str(tmp_path))
    text, _ = committed_outputs_match(NOTEBOOK, REPO / "notebooks")
    assert "12 runs under data/analysis_small" in text and "1 codec comparison(s)" in text
    for png in PNGS:
        assert (tmp_path / png).stat().st_size > 10_000
    # the printed finals are the runs' last evaluations
    for f in sorted(p.parent for p in DATA.glob("**/metrics.jsonl")):
        last = read_metrics(f / "metrics.jsonl", kind="eval")[-1]
        name = f.relative_to(DATA).as_posix()
        row = next(line.split() for line in text.splitlines() if line.startswith(name + " "))
        assert row[4:10] == [
            str(last["step"]),
            str(last["forward_passes"]),
            str(last["passes"]),
            str(last["payload_bytes_total"]),
            row[8],
            f"{last['eval_accuracy']:.4f}",
        ], row
