"""The experiment runner writes metrics.jsonl with identical workers and counted bits; the report and
the notebook turn a small set of runs into the seed's three tables."""

import json
import os
from pathlib import Path

import pytest
import yaml

from zeroth.bench import marsit as X
from zeroth.bench import marsit_report as report

ROOT = Path(__file__).resolve().parents[1]

TINY = {
    "name": "tiny",
    "seed": 3,
    "data": {"dataset": "digits", "batch_size": 8, "eval_size": 200},
    "model": {"name": "mlp", "kwargs": {"hidden": [16]}},
    "topology": {"kind": "ring", "workers": 3},
    "train": {"rounds": 4, "eta_l": 0.1, "eval_every": 2, "target_acc": 0.05},
    "runs": [
        {"label": "none", "group": "none M=3", "sync": {"method": "psgd"}},
        {"label": "cascading", "group": "cascading M=3", "sync": {"method": "ssdm"}, "train": {"eta_l": 0.001}},
        {"label": "marsit-k2", "group": "K", "topology": {"kind": "torus", "workers": 4},
         "sync": {"method": "marsit", "eta_s": 0.01, "K": 2}},
        {"label": "marsit-kinf", "group": "Marsit", "topology": {"workers": 4},
         "sync": {"method": "marsit", "eta_s": 0.01, "K": "inf"}},
    ],
}


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    root = tmp_path_factory.mktemp("marsit_results")
    cfg = root / "tiny.yaml"
    cfg.write_text(yaml.safe_dump(TINY))
    out = root / "marsit_tiny"
    assert X.main([str(cfg), "--out", str(out)]) == 0
    return root, out


def test_runner_writes_evals_and_summaries(results):
    _, out = results
    evals, summaries = report.load(out)
    assert [s["run"] for s in summaries] == ["none", "cascading", "marsit-k2", "marsit-kinf"]
    assert [r["round"] for r in evals if r["run"] == "none"] == [2, 4]
    by = {s["run"]: s for s in summaries}
    for s in summaries:
        assert s["checksums_equal"] is True and s["rounds"] == 4
    assert by["none"]["bits_per_element"] == 32.0
    # K = 2 over rounds 0..3: rounds 0 and 2 full precision, 1 and 3 one bit (+ padding)
    phases = by["marsit-k2"]["bits_per_element_by_phase"]
    assert phases["full"] == 32.0 and 1.0 <= phases["sync"] < 1.2
    assert by["marsit-k2"]["bits_per_element"] == pytest.approx((2 * 32.0 + 2 * phases["sync"]) / 4)
    assert by["marsit-kinf"]["K"] is None and by["marsit-kinf"]["bits_per_element"] < 1.2
    assert by["cascading"]["bits_per_element_by_phase"]["sync"] > 1.0  # the norms are counted too
    assert all(s["comm_model_s"] > 0 for s in summaries)
    assert json.loads((out / "metrics.jsonl").read_text().splitlines()[0])["kind"] == "eval"


def test_report_builds_the_three_table_shapes(results):
    _, out = results
    _, summaries = report.load(out)
    t1 = report.table1_rows(summaries)
    assert [r["setting"] for r in t1] == ["cascading compression, M=3", "none compression, M=3"]
    assert t1[1]["seed_accuracy_%"] == "99.1 ± 0.13"
    t2 = report.table2_rows([s for s in summaries if s["group"] == "Marsit"])
    assert t2[0]["method"] == "Marsit" and t2[0]["seed_resnet20_cifar10_%"] == 90.15
    f3 = report.figure3b_rows([s for s in summaries if s["group"] == "K"])
    assert f3[0]["K"] == "2" and f3[0]["seed_bits"] == "-"


def test_notebook_executes_on_the_results(results):
    nbformat = pytest.importorskip("nbformat")
    nbclient = pytest.importorskip("nbclient")
    root, _ = results
    nb = nbformat.read(ROOT / "notebooks" / "marsit.ipynb", as_version=4)
    old = os.environ.get("MARSIT_RESULTS")
    os.environ["MARSIT_RESULTS"] = str(root)
    try:
        nbclient.NotebookClient(nb, timeout=120, kernel_name="python3", resources={"metadata": {"path": str(ROOT)}}).execute()
    finally:
        if old is None:
            os.environ.pop("MARSIT_RESULTS")
        else:
            os.environ["MARSIT_RESULTS"] = old
    text = "".join(o.get("text", "") for c in nb.cells if c.cell_type == "code" for o in c.get("outputs", []))
    assert "1 result folders, 4 runs" in text
    assert "runs with differing workers: none" in text


def test_config_errors_name_the_key(tmp_path):
    bad = dict(TINY, runs=[{"label": "x", "sync": {"method": "psgd", "lr": 0.1}}])
    path = tmp_path / "bad.yaml"
    path.write_text(yaml.safe_dump(bad))
    with pytest.raises(ValueError, match="unknown key sync.lr; valid keys are"):
        X.load_runs(path)
    bad = dict(TINY, runs=[{"label": "x", "sync": {"method": "qsgd"}}])
    path.write_text(yaml.safe_dump(bad))
    with pytest.raises(ValueError, match="unknown sync.method 'qsgd'"):
        X.load_runs(path)
    path.write_text(yaml.safe_dump(dict(TINY, runs=[])))
    with pytest.raises(ValueError, match="at least one run"):
        X.load_runs(path)


def test_experiment_configs_in_the_repo_parse():
    files = sorted((ROOT / "experiments").glob("marsit_*.yaml"))
    assert len(files) >= 3
    for f in files:
        runs = X.load_runs(f)
        assert runs and all(r.data.dataset == "mnist5k" for r in runs)
