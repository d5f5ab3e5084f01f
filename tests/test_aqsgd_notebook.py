"""The AQ-SGD notebook executes on the committed experiment results (experiments/results/aqsgd_*.json)."""

from pathlib import Path

import pytest

from notebook_util import execute

REPO = Path(__file__).resolve().parent.parent
NOTEBOOK = REPO / "notebooks" / "aqsgd.ipynb"


@pytest.mark.slow
def test_aqsgd_notebook_executes_on_the_committed_results(monkeypatch):
    monkeypatch.setenv("AQSGD_RESULTS", str(REPO / "experiments" / "results"))
    monkeypatch.setenv("MPLBACKEND", "Agg")
    text = execute(NOTEBOOK, REPO / "notebooks")
    assert "aqsgd_smollm2_sotu: mode local" in text and "aqsgd_transformer_sotu: mode processes" in text
    assert "aqsgd fw2/bw4" in text and "break-even bandwidth" in text
    assert "measured with the link enforced live at 100 Mbit/s" in text
