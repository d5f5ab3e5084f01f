"""The Ravnest notebook executes on the committed results (experiments/results/ravnest_*)."""

from pathlib import Path

import pytest

from notebook_util import committed_outputs_match

REPO = Path(__file__).resolve().parent.parent
NOTEBOOK = REPO / "notebooks" / "ravnest.ipynb"


@pytest.mark.slow
def test_ravnest_notebook_executes_on_the_committed_results(monkeypatch):
    monkeypatch.setenv("RAVNEST_RESULTS", str(REPO / "experiments" / "results"))
    monkeypatch.setenv("MPLBACKEND", "Agg")
    text, _ = committed_outputs_match(NOTEBOOK, REPO / "notebooks")  # the committed outputs are this run's
    assert "cluster 2 (joins at round 4)" in text and "clusters agree at the end: True" in text
    assert "took over: True" in text and "steady-state wall: fill-and-drain" in text
    assert "j0 handed its state" in text and "to backup b1 after round 4" in text
