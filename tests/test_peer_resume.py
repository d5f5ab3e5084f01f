"""Peer runs resume and never overwrite: `zeroth run` on a folder holding a peer run is refused,
peers save checkpoints (periodically, at the end, and on SIGINT/SIGTERM), and a run interrupted
with SIGINT and resumed with `--resume` ends on the uninterrupted run's digest (two founding
peers, no joins or kills: the contributors of every iteration are fixed)."""

import json
import os
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from zeroth.net import launch
from zeroth.replay import checksum
from zeroth.run import main as run_main
from zeroth.train.metrics import check_schema
from zeroth.train.runs import load_run

REPO = Path(__file__).resolve().parent.parent
JOB = str(REPO / "experiments" / "job_digits.yaml")
# An iteration takes a few milliseconds here: the cut run's SIGINT lands around iteration 10, and the
# iterations after it leave room for a loaded machine's delays before the peers stop.
ITERATIONS = 150
SETS = ["--set", "peers.count=2", "--set", "peers.join_at=[]", "--set", "peers.kill_at=[]", "--set", "train.eval_every=10",
        "--set", "train.checkpoint_every=5", "--set", f"peers.iterations={ITERATIONS}", "--quiet"]


def _err_line(capsys) -> str:
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1, err
    return err[0]


def test_a_folder_holding_a_peer_run_is_refused_and_resume_needs_a_checkpoint(tmp_path, capsys):
    out = tmp_path / "run"
    (out / "peers" / "p0").mkdir(parents=True)
    (out / "peers" / "p0" / "metrics.jsonl").write_text('{"kind": "iteration", "step": 1}\n')
    assert run_main([JOB, "--out", str(out), *SETS]) == 2
    assert _err_line(capsys) == (
        f"zeroth run: error: output folder {out} already holds a run (summary.json, peers/); "
        "pass --resume to continue it or choose another --out"
    )
    assert run_main([JOB, "--out", str(out), *SETS, "--resume"]) == 2
    assert _err_line(capsys) == f"zeroth run: error: no checkpoint in {out}; run without --resume to start"
    assert sorted(p.name for p in out.iterdir()) == ["peers"]  # nothing written, nothing moved


def test_newest_checkpoint_takes_the_newest_iteration_and_checks_the_digests(tmp_path):
    from zeroth.net.runtime import save_state
    import numpy as np

    p = {"w": np.ones(3, np.float32)}
    save_state(tmp_path / "peers.1" / "p0" / "checkpoints" / "5", p, iteration=5, run_id="r", digest="a" * 64, reason="t")
    save_state(tmp_path / "peers" / "p1" / "checkpoints" / "9", p, iteration=9, run_id="r", digest="b" * 64, reason="t")
    assert launch.newest_checkpoint(tmp_path) == (9, tmp_path / "peers" / "p1" / "checkpoints" / "9")
    save_state(tmp_path / "peers" / "p0" / "checkpoints" / "9", p, iteration=9, run_id="r", digest="c" * 64, reason="t")
    with pytest.raises(ValueError, match="checkpoints of iteration 9 .* differ"):
        launch.newest_checkpoint(tmp_path)


def test_after_an_interrupt_only_iterations_decided_before_the_first_leave_count(tmp_path):
    from zeroth.net.runtime import save_state
    import numpy as np

    p = {"w": np.ones(3, np.float32)}
    for peer, stopped in (("p0", 14), ("p1", 13)):
        for it, reason in ((10, "checkpoint_every"), (stopped, "interrupted"), (15, "checkpoint_every")):
            save_state(tmp_path / "peers" / peer / "checkpoints" / str(it), p, iteration=it, run_id="r",
                       digest=f"{it:064d}", reason=reason)
    # iteration 15 was decided after p1 asked to leave, and so, maybe, was 14: 13 is the newest safe one
    assert launch.newest_checkpoint(tmp_path) == (13, tmp_path / "peers" / "p1" / "checkpoints" / "13")


@pytest.mark.slow
def test_a_peer_run_interrupted_and_resumed_reaches_the_uninterrupted_digest(tmp_path):
    env = {**os.environ, "PYTHONPATH": str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    cut = tmp_path / "cut"
    cmd = [sys.executable, "-m", "zeroth", "run", JOB, "--out", str(cut), *SETS]
    with (tmp_path / "cut.err").open("w") as err:
        proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.DEVNULL, stderr=err)
    try:
        deadline = time.monotonic() + 120
        def reached_10() -> bool:  # older checkpoints are pruned: any of iteration 10 or later will do
            return any(d.name.isdigit() and int(d.name) >= 10 for d in (cut / "peers" / "p0" / "checkpoints").glob("*"))

        while not reached_10():
            assert proc.poll() is None, (tmp_path / "cut.err").read_text()
            assert time.monotonic() < deadline, "no checkpoint of iteration 10 in time"
            time.sleep(0.02)
        proc.send_signal(signal.SIGINT)
        proc.wait(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    lines = (tmp_path / "cut.err").read_text().strip().splitlines()
    assert proc.returncode == 130 and len(lines) == 1, lines
    assert lines[0].startswith("zeroth run: interrupted by SIGINT; checkpoint of iteration "), lines
    k = int(lines[0].split("checkpoint of iteration ")[1].split()[0])
    assert 10 <= k < ITERATIONS

    resume = shlex.split(lines[0].split("resume with: ")[1])
    resumed = subprocess.run([sys.executable, "-m", "zeroth", *resume[1:]], cwd=REPO, env=env, capture_output=True,
                             text=True, timeout=180)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    whole = subprocess.run([sys.executable, "-m", "zeroth", "run", JOB, "--out", str(tmp_path / "whole"), *SETS],
                           cwd=REPO, env=env, capture_output=True, text=True, timeout=180)
    assert whole.returncode == 0, whole.stderr[-3000:]
    a = json.loads((cut / "summary.json").read_text())
    b = json.loads((tmp_path / "whole" / "summary.json").read_text())
    assert a["resumed_from"] == k and a["iterations"] == b["iterations"] == ITERATIONS
    assert a["digests_agree"] and a["final_digest"] == b["final_digest"]
    assert (cut / "peers.1" / "p0" / "metrics.jsonl").exists()  # the first attempt's folders are kept
    # the peers' rows follow the one metrics schema; load_run reads the folder back, final parameters included
    for folder in (cut / "peers.1", cut / "peers", tmp_path / "whole" / "peers"):
        for peer in ("p0", "p1"):
            check_schema(launch.read_records(folder / peer / "metrics.jsonl")[0], f"{folder}/{peer}")
    run = load_run(cut)
    assert run.kind == "peers" and run.step == ITERATIONS and checksum(run.params) == b["final_digest"]
    assert run.config["peers"]["count"] == 2 and run.summary["final_digest"] == b["final_digest"]
    assert [r["step"] for r in run.metrics if r["kind"] == "train"] == list(range(k + 1, ITERATIONS + 1))
