"""The analysis notebook executes on small real runs produced here (nbclient, kernel python3)."""

from pathlib import Path

import pytest

from notebook_util import execute

REPO = Path(__file__).resolve().parent.parent
NOTEBOOK = REPO / "notebooks" / "analysis.ipynb"


def _runs(root: Path) -> None:
    from zeroth.config import load_config_dict
    from zeroth.train import trainer

    base = {
        "data": {"dataset": "digits", "batch_size": 32, "eval_size": 200},
        "model": {"name": "mlp", "kwargs": {"hidden": [16]}},
        "train": {"method": "zo", "lr": 0.02, "n_perturbations": 8, "steps": 12, "eval_every": 4, "log_every": 4},
    }
    for codec in ("onebyte", "float32"):
        for seed in (0, 1):
            raw = {**base, "run": {"name": f"{codec}_s{seed}", "seed": seed}, "train": {**base["train"], "codec": codec}}
            trainer.train(load_config_dict(raw), root / "codec" / f"{codec}_s{seed}", progress=False)
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
    assert "codec/onebyte_s0" in text and "backprop" in text
    lines = [line.split() for line in text.splitlines()]
    codec_rows = {row[1]: row for row in lines if len(row) >= 7 and row[0] == "0" and row[1] in ("onebyte", "float32")}
    assert codec_rows["onebyte"][2] == "2" and codec_rows["float32"][2] == "2"
    # the same forward passes; the one-byte codec sends a quarter of the bytes
    assert codec_rows["onebyte"][-1] == codec_rows["float32"][-1] == str(12 * 2 * 8)
    assert int(codec_rows["float32"][-2]) == 4 * int(codec_rows["onebyte"][-2]) == 4 * 12 * 8
    for png in ("accuracy_vs_forward_passes.png", "codec_comparison_0.png"):
        assert (figures / png).stat().st_size > 10_000
