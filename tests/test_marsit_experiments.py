"""Marsit through ``zeroth run``: one run folder (schema-v1 rows labelled by run, summary.json, final
parameters), ``load_run``, the report's table shapes, ``--set`` / ``--out`` / ``--resume``, SIGINT in a
fresh process (which also sets the device count before jax starts), and the notebook on the results."""

import json
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from notebook_util import execute

from zeroth import run as zrun
from zeroth.marsit import config as C
from zeroth.marsit import report
from zeroth.replay import checksum
from zeroth.train.metrics import check_schema, read_metrics
from zeroth.train.runs import load_run

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
        {
            "label": "marsit-k2",
            "group": "K",
            "topology": {"kind": "torus", "workers": 4},
            "sync": {"method": "marsit", "eta_s": 0.01, "K": 2},
        },
        {
            "label": "marsit-kinf",
            "group": "Marsit",
            "topology": {"workers": 4},
            "sync": {"method": "marsit", "eta_s": 0.01, "K": "inf"},
        },
    ],
}
LABELS = [r["label"] for r in TINY["runs"]]


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    root = tmp_path_factory.mktemp("marsit_results")
    cfg = root / "tiny.yaml"
    cfg.write_text(yaml.safe_dump(TINY))
    out = root / "marsit_tiny"
    assert zrun.main([str(cfg), "--out", str(out), "--quiet"]) == 0
    return root, cfg, out


def test_run_folder_follows_the_schema_and_counts_bits(results):
    _, _, out = results
    rows = read_metrics(out / "metrics.jsonl")
    assert check_schema(rows) == len(rows)
    assert [r["step"] for r in rows if r["run"] == "none" and r["kind"] == "train"] == [1, 2, 3, 4]
    assert [r["step"] for r in rows if r["run"] == "none" and r["kind"] == "eval"] == [2, 4]
    evals, summaries = report.load(out)
    assert [(r["run"], r["step"]) for r in evals][:2] == [("none", 2), ("none", 4)]
    assert [s["run"] for s in summaries] == LABELS
    by = {s["run"]: s for s in summaries}
    for s in summaries:
        assert s["checksums_equal"] is True and s["rounds"] == 4
    assert by["none"]["bits_per_element"] == 32.0
    # K = 2 over rounds 0..3: rounds 0 and 2 full precision, 1 and 3 one bit (+ padding)
    phases = by["marsit-k2"]["bits_per_element_by_phase"]
    assert phases["full"] == 32.0 and 1.0 <= phases["sync"] < 1.2
    assert by["marsit-k2"]["bits_per_element"] == pytest.approx((2 * 32.0 + 2 * phases["sync"]) / 4)
    k2 = [r for r in rows if r["run"] == "marsit-k2" and r["kind"] == "train"]
    assert [r["phase"] for r in k2] == ["full", "sync", "full", "sync"]
    assert (
        k2[-1]["payload_bytes_total"] == sum(r["payload_bytes"] for r in k2) == by["marsit-k2"]["payload_bytes_total"]
    )
    assert k2[0]["payload_bytes"] > 20 * k2[1]["payload_bytes"]  # 32 bits vs about one bit per element
    assert by["marsit-kinf"]["K"] is None and by["marsit-kinf"]["bits_per_element"] < 1.2
    assert by["cascading"]["bits_per_element_by_phase"]["sync"] > 1.0  # the norms are counted too
    assert all(s["comm_model_s"] > 0 for s in summaries)
    summary = json.loads((out / "summary.json").read_text())
    assert summary["finished"] == summary["total"] == 4


def test_schema_checks_steps_run_by_run():
    row = {
        "kind": "train",
        "step": 1,
        "time_unix_s": 1.0,
        "wall_time_s": 0.1,
        "digest": "d",
        "forward_passes": 1,
        "payload_bytes_total": 8,
        "loss": 0.5,
        "lr": 0.1,
        "step_time_s": 0.01,
        "payload_bytes": 8,
    }
    two = [{**row, "run": "a"}, {**row, "run": "a", "step": 2}, {**row, "run": "b"}, {**row, "run": "b", "step": 2}]
    assert check_schema(two) == 4
    with pytest.raises(ValueError, match="row 3 has step 1 after step 2 of run 'a'"):
        check_schema(two[:2] + [{**row, "run": "a"}])
    with pytest.raises(ValueError, match="second train row of step 1"):
        check_schema(two[:1] + [{**row, "run": "a"}])
    with pytest.raises(ValueError, match="field 'run' is 3"):
        check_schema([{**row, "run": 3}])


def test_load_run_gives_every_runs_parameters(results):
    _, _, out = results
    run = load_run(out)
    assert run.kind == "marsit" and [r["label"] for r in run.config["runs"]] == LABELS
    assert sorted(run.params) == sorted(LABELS)
    for s in run.summary["runs"]:
        last_train = [r for r in run.metrics if r["run"] == s["run"] and r["kind"] == "train"][-1]
        assert checksum(run.params[s["run"]]) == s["digest"] == last_train["digest"]


def test_report_builds_the_three_table_shapes(results):
    _, _, out = results
    _, summaries = report.load(out)
    t1 = report.table1_rows(summaries)
    assert [r["setting"] for r in t1] == ["cascading compression, M=3", "none compression, M=3"]
    assert t1[1]["seed_accuracy_%"] == "99.1 ± 0.13"
    t2 = report.table2_rows([s for s in summaries if s["group"] == "Marsit"])
    assert t2[0]["method"] == "Marsit" and t2[0]["seed_resnet20_cifar10_%"] == 90.15
    f3 = report.figure3b_rows([s for s in summaries if s["group"] == "K"])
    assert f3[0]["K"] == "2" and f3[0]["seed_bits"] == "-"


def test_out_set_and_resume(results, tmp_path, capsys):
    _, cfg, out = results
    assert zrun.main([str(cfg), "--out", str(out), "--quiet"]) == 2
    assert "already holds a run" in capsys.readouterr().err
    assert zrun.main([str(cfg), "--out", str(tmp_path / "x"), "--set", "train.lr=0.1"]) == 2
    assert "unknown config key train.lr; valid keys are" in capsys.readouterr().err
    assert zrun.main([str(cfg), "--out", str(tmp_path / "x"), "--set", "topology.workers=64"]) == 2
    assert "needs 64 CPU devices" in capsys.readouterr().err
    assert zrun.main([str(cfg), "--out", str(tmp_path / "none"), "--resume"]) == 2
    assert "holds no Marsit run to resume" in capsys.readouterr().err
    # an interrupted folder: the last run unfinished, two of its rows written
    cut = tmp_path / "cut"
    shutil.copytree(out, cut)
    summary = json.loads((cut / "summary.json").read_text())
    (cut / "summary.json").write_text(json.dumps({**summary, "runs": summary["runs"][:-1], "finished": 3}))
    rows = read_metrics(out / "metrics.jsonl")
    last = [r for r in rows if r["run"] == "marsit-kinf"]
    (cut / "metrics.jsonl").write_text(
        "".join(json.dumps(r) + "\n" for r in rows if r["run"] != "marsit-kinf")
        + "".join(json.dumps(r) + "\n" for r in last[:2])
    )
    assert zrun.main([str(cfg), "--out", str(cut), "--resume", "--set", "train.rounds=5"]) == 2
    assert "run 'none' finished" in capsys.readouterr().err
    assert zrun.main([str(cfg), "--out", str(cut), "--resume", "--quiet"]) == 0
    again = read_metrics(cut / "metrics.jsonl")
    assert check_schema(again) == len(rows)
    assert [r for r in again if r["run"] != "marsit-kinf"] == [r for r in rows if r["run"] != "marsit-kinf"]
    key = [(r["kind"], r["step"], r["digest"]) for r in last]
    assert [(r["kind"], r["step"], r["digest"]) for r in again if r["run"] == "marsit-kinf"] == key
    assert json.loads((cut / "summary.json").read_text())["runs"][-1]["digest"] == summary["runs"][-1]["digest"]


@pytest.mark.slow
@pytest.mark.e2e
def test_sigint_in_a_fresh_process_exits_130_keeping_finished_runs(tmp_path):
    cfg = tmp_path / "two.yaml"
    cfg.write_text(
        yaml.safe_dump(
            {
                **TINY,
                "topology": {"kind": "ring", "workers": 4},
                "train": {**TINY["train"], "rounds": 3, "eval_every": 3},
                "runs": [
                    {"label": "a", "sync": {"method": "psgd"}},
                    {
                        "label": "b",
                        "sync": {"method": "marsit", "eta_s": 0.01},
                        "train": {"rounds": 5000, "eval_every": 1000},
                    },
                ],
            }
        )
    )
    out = tmp_path / "out"
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}  # one CPU device unless the run asks for more
    env.update(PYTHONPATH=str(ROOT), PYTHONUNBUFFERED="1")
    proc = subprocess.Popen(
        [sys.executable, "-m", "zeroth.cli", "run", str(cfg), "--out", str(out)],
        cwd=tmp_path,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        for line in proc.stdout:
            if line.startswith("[a] round     3"):
                break
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=120)
    finally:
        proc.kill()
    assert proc.returncode == 130, err
    lines = [x for x in err.splitlines() if x.strip()]
    assert lines[-1].startswith("zeroth run: interrupted by SIGINT in run 'b' after round ")
    assert "1 of 2 runs finished and kept" in lines[-1] and lines[-1].endswith(f"--out {out} --resume")
    summary = json.loads((out / "summary.json").read_text())
    assert [s["run"] for s in summary["runs"]] == ["a"] and summary["runs"][0]["workers"] == 4
    check_schema(read_metrics(out / "metrics.jsonl"))


@pytest.mark.slow
def test_notebook_executes_on_the_results(results, tmp_path, monkeypatch):
    pytest.importorskip("nbclient")
    root, _, _ = results
    monkeypatch.setenv("MARSIT_RESULTS", str(root))
    monkeypatch.setenv("MARSIT_FIGURES", str(tmp_path / "figures"))
    monkeypatch.setenv("MPLBACKEND", "Agg")
    text = execute(ROOT / "notebooks" / "marsit.ipynb", ROOT / "notebooks")
    assert "1 result folders, 4 runs" in text
    assert "runs with differing workers: none" in text
    assert "marsit-k2: 4 rounds, 2 full-precision" in text
    for png in ("table1_accuracy.png", "table2_accuracy.png", "fig3b_k.png"):
        assert (tmp_path / "figures" / png).stat().st_size > 10_000


def test_committed_notebook_holds_the_small_runs_outputs():
    """notebooks/marsit.ipynb is committed executed on notebooks/data/marsit_small (config.yaml,
    metrics.jsonl, summary.json of `zeroth run notebooks/data/marsit_small.yaml`), figures included."""
    nbformat = pytest.importorskip("nbformat")
    small = ROOT / "notebooks" / "data" / "marsit_small"
    run = load_run(small)
    assert run.kind == "marsit" and run.params == {} and run.summary["finished"] == run.summary["total"]
    assert check_schema(run.metrics) == len(run.metrics)
    assert [s["run"] for s in run.summary["runs"]] == [r.label for r in C.load_runs(small.with_suffix(".yaml"))]
    nb = nbformat.read(ROOT / "notebooks" / "marsit.ipynb", as_version=4)
    outputs = [o for c in nb.cells if c.cell_type == "code" for o in c.get("outputs", [])]
    assert sum("image/png" in o.get("data", {}) for o in outputs) == 3
    assert f"1 result folders, {run.summary['total']} runs: ['marsit_small']" in "".join(
        o.get("text", "") for o in outputs
    )


def test_config_errors_name_the_key(tmp_path):
    bad = dict(TINY, runs=[{"label": "x", "sync": {"method": "psgd", "lr": 0.1}}])
    path = tmp_path / "bad.yaml"
    path.write_text(yaml.safe_dump(bad))
    with pytest.raises(ValueError, match="unknown config key sync.lr; valid keys are"):
        C.load_runs(path)
    bad = dict(TINY, runs=[{"label": "x", "sync": {"method": "qsgd"}}])
    path.write_text(yaml.safe_dump(bad))
    with pytest.raises(ValueError, match="unknown sync.method 'qsgd'"):
        C.load_runs(path)
    path.write_text(yaml.safe_dump(dict(TINY, runs=[])))
    with pytest.raises(ValueError, match="at least one run"):
        C.load_runs(path)
    with pytest.raises(ValueError, match="'runs' cannot be set"):
        C.parse_overrides(["runs=[]"])


def test_experiment_configs_in_the_repo_parse():
    files = sorted((ROOT / "experiments").glob("marsit_*.yaml"))
    assert len(files) >= 3
    for f in files:
        runs = C.load_runs(f)
        want = "fashion_mnist" if f.stem.endswith("_fashion") else "mnist5k"
        assert runs and all(r.data.dataset == want for r in runs)


def test_protocol_options_are_checked_and_the_step_size_falls_after_each_full_round():
    from zeroth.collectives import sync as S
    from zeroth.collectives.topology import Ring
    from zeroth.marsit.experiment import lr_scales

    def runs(**train):
        return C.load_runs_dict(
            dict(TINY, runs=[{"label": "m", "sync": {"method": "marsit", "eta_s": 0.01, "K": 3}, "train": train}])
        )

    with pytest.raises(ValueError, match="train.local_steps must be an int >= 1, got 0"):
        runs(local_steps=0)
    with pytest.raises(ValueError, match="train.momentum must be a number in \\[0, 1\\), got 1.5"):
        runs(momentum=1.5)
    with pytest.raises(ValueError, match="train.lr_decay_every must be null, an int >= 1 or 'full', got 'half'"):
        runs(lr_decay=0.1, lr_decay_every="half")
    with pytest.raises(ValueError, match="needs sync.method marsit with K > 1 \\(got psgd, K=None\\)"):
        C.load_runs_dict(
            dict(
                TINY,
                runs=[{"label": "p", "sync": {"method": "psgd"}, "train": {"lr_decay": 0.1, "lr_decay_every": "full"}}],
            )
        )
    spec = runs(lr_decay=0.1, lr_decay_every="full")[0]
    scale = lr_scales(spec, S.marsit(Ring(3), 0.01, K=3).phase)
    # full rounds at t = 0, 3, 6: a round after the full round at 3 (and 6) runs at a tenth of the step before
    assert [scale(t) for t in range(9)] == pytest.approx([1, 1, 1, 1, 0.1, 0.1, 0.1, 0.01, 0.01])
    every = lr_scales(runs(lr_decay=0.5, lr_decay_every=4)[0], lambda t: "sync")
    assert [every(t) for t in (0, 3, 4, 8)] == [1, 1, 0.5, 0.25]
    assert lr_scales(runs()[0], lambda t: "full")(100) == 1.0


def test_committed_short_runs_end_on_the_digests_of_their_equivalents():
    """K = 1 is PSGD and K = inf is Marsit, bit for bit, in the committed runs of the seed's protocol
    (4 local steps with momentum): the Figure 3(b) runs end on the Table 2 runs' digests."""
    res = ROOT / "experiments" / "results"

    def digests(name):
        return {r["run"]: r["digest"] for r in json.loads((res / name / "summary.json").read_text())["runs"]}

    t2, f3 = digests("marsit_table2_short"), digests("marsit_fig3b_short")
    assert f3["K=1"] == t2["psgd"]
    assert f3["K=inf"] == t2["marsit-3e-3"]
    assert f3["K=25"] == t2["marsit25-3e-3"]
    assert len({f3["K=1"], f3["K=25"], f3["K=inf"]}) == 3


def test_committed_full_runs_end_on_the_digests_of_their_equivalents():
    """The same in the committed runs at the configured rounds (lists stopped early keep their first runs):
    every Figure 3(b) run at seed 0 whose Table 2 equivalent finished ends on its digest."""
    res = ROOT / "experiments" / "results"

    def digests(name):
        return {r["run"]: r["digest"] for r in json.loads((res / name / "summary.json").read_text())["runs"]}

    t2, f3 = digests("marsit_table2"), digests("marsit_fig3b")
    pairs = [
        (k, r)
        for k, r in (("K=1", "psgd"), ("K=100", "marsit100-3e-3"), ("K=inf", "marsit-3e-3"))
        if k in f3 and r in t2
    ]
    assert pairs  # at least one equivalent pair finished
    for k, run in pairs:
        assert f3[k] == t2[run], (k, run)
    # Figure 3(b) at eta_s 0.01: K = 1 (PSGD) does not use eta_s, the other K do
    f3e = digests("marsit_fig3b_eta_s_1e-2")
    assert f3e["K=1"] == f3["K=1"]
    assert all(f3e[k] != f3[k] for k in ("K=50", "K=100", "K=200", "K=inf"))
    assert len({f3[k] for k, _ in pairs}) == len(pairs)
