"""The Just One Byte comparison notebook: committed with the outputs of the peer runs in
notebooks/data/job_small, which it reproduces when executed again; and it executes on small real peer
runs produced here."""

import json

from pathlib import Path

import pytest

from zeroth.config import load_config_dict, to_yaml
from zeroth.net.runtime import Node, NodeOptions
from zeroth.net.work import Worker

from notebook_util import committed_outputs_match, execute
from zeroth.train.metrics import check_schema, read_metrics

REPO = Path(__file__).resolve().parent.parent
NOTEBOOK = REPO / "notebooks" / "job_comparison.ipynb"
DATA = REPO / "notebooks" / "data" / "job_small"


def make_run(root: Path, name: str, peers: int, codec: str, iterations: int, worker_cache: dict) -> None:
    raw = {
        "run": {"name": name, "seed": 1},
        "data": {"dataset": "digits", "batch_size": 32, "eval_size": 200},
        "model": {"name": "mlp", "kwargs": {"hidden": [16]}},
        "train": {"lr": 0.05, "eps": 1e-3, "codec": codec, "eval_every": 4},
        "peers": {
            "count": peers,
            "inferences_per_iteration": 4,
            "iteration_timeout_s": 5.0,
            "barrier_timeout_s": 3.0,
            "iterations": iterations,
        },
    }
    cfg = load_config_dict(raw)
    out = root / name
    out.mkdir(parents=True)
    (out / "config.yaml").write_text(to_yaml(cfg))
    worker = worker_cache.setdefault(codec, Worker(cfg))
    nodes = [
        Node(
            cfg,
            NodeOptions(out_dir=str(out / "peers" / "p0"), founders=peers, secret="notebook-secret", log=False),
            worker=worker,
        )
    ]
    address = nodes[0].start()
    for i in range(1, peers):
        nodes.append(
            Node(
                cfg,
                NodeOptions(out_dir=str(out / "peers" / f"p{i}"), join=(address,), secret="notebook-secret", log=False),
                worker=worker,
            )
        )
        nodes[-1].start()
    try:
        assert all(n.wait(180) for n in nodes)
        assert [n.finish_reason for n in nodes] == ["done"] * peers
    finally:
        for n in nodes:
            n.stop()


@pytest.mark.slow
def test_job_notebook_executes_on_real_peer_runs(tmp_path, monkeypatch):

    runs = tmp_path / "runs"
    workers: dict = {}
    make_run(runs, "onebyte_2peers", 2, "onebyte", 8, workers)
    make_run(runs, "float32_2peers", 2, "float32", 8, workers)
    make_run(runs, "onebyte_1machine", 1, "onebyte", 16, workers)
    figures = tmp_path / "figures"
    monkeypatch.setenv("ZEROTH_JOB_RUNS", str(runs))
    monkeypatch.setenv("ZEROTH_FIGURES", str(figures))
    monkeypatch.setenv("MPLBACKEND", "Agg")
    text = execute(NOTEBOOK, REPO / "notebooks")
    assert "3 runs under" in text
    names = ("onebyte_2peers", "float32_2peers", "onebyte_1machine")
    lines = [line.split() for line in text.splitlines()]
    accuracy_rows = {row[0]: row for row in lines if len(row) == 12 and row[0] in names}
    bytes_rows = {row[0]: row for row in lines if len(row) == 11 and row[0] in names}
    assert set(accuracy_rows) == set(bytes_rows) == set(names), text
    for row in accuracy_rows.values():
        # the same 64 projected gradients (128 forward passes) in every run; no mismatch; one final digest
        assert row[4] == "64" and row[5] == "128" and row[10] == "0" and row[11] == "1", row
        assert row[7] == ("64" if row[2] == "onebyte" else "256")  # 1 (or 4) bytes per projected gradient
    for name, row in bytes_rows.items():
        d, payload, sent, wire, full = (int(x) for x in row[1:6])
        assert payload == (4 if "onebyte" in name else 16) and full == 4 * d
        if "2peers" in name:  # each projected gradient goes to the one other peer (and a few log fetches)
            assert payload <= sent < 2 * payload and wire > sent
        else:
            assert sent == wire == 0
    groups = [line for line in text.splitlines() if line.startswith("group ")]
    assert len(groups) == 3 and all("seeds=1 forward_passes=[128]" in g for g in groups), groups
    for png in ("job_accuracy_vs_forward_passes.png", "job_bytes_per_step.png"):
        assert (figures / png).stat().st_size > 10_000


def test_committed_job_runs_are_real_and_consistent():
    """Every peer's rows hold the schema; the peers of a run end on one digest; equal forward passes in every run."""
    names = sorted(p.name for p in DATA.iterdir() if (p / "config.yaml").exists())
    assert names == ["float32_2peers", "onebyte_1machine", "onebyte_2peers"]
    for name in names:
        summary = json.loads((DATA / name / "summary.json").read_text())
        assert (
            summary["digests_agree"] and summary["checksum_mismatches"] == 0 and summary["projected_gradients"] == 640
        )
        digests = set()
        for pdir in sorted((DATA / name / "peers").glob("p*")):
            rows = read_metrics(pdir / "metrics.jsonl")
            assert check_schema(rows, str(pdir)) == len(rows)
            digests.add(rows[-1]["digest"])
            assert rows[-1]["forward_passes"] == 2 * 640
        assert digests == {summary["final_digest"]}
        assert summary["payload_bytes"] == 640 * (4 if name.startswith("float32") else 1)


@pytest.mark.slow
def test_committed_job_notebook_reproduces_its_outputs(tmp_path, monkeypatch):
    monkeypatch.delenv("MPLBACKEND", raising=False)
    monkeypatch.delenv("ZEROTH_JOB_RUNS", raising=False)
    monkeypatch.setenv("ZEROTH_FIGURES", str(tmp_path))
    text, _ = committed_outputs_match(NOTEBOOK, REPO / "notebooks")
    assert "3 runs under data/job_small: float32_2peers, onebyte_1machine, onebyte_2peers" in text
    for name in ("float32_2peers", "onebyte_1machine", "onebyte_2peers"):
        accuracy = json.loads((DATA / name / "summary.json").read_text())["accuracy"]
        row = next(line.split() for line in text.splitlines() if line.split()[:1] == [name] and len(line.split()) == 12)
        assert row[6] == f"{accuracy:.4f}" and row[5] == "1280", row
    for png in ("job_accuracy_vs_forward_passes.png", "job_bytes_per_step.png"):
        assert (tmp_path / png).stat().st_size > 10_000
