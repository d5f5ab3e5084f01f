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
from zeroth.net.verify import format_report, verify
from zeroth.replay import checksum
from zeroth.run import main as run_main
from zeroth.train.metrics import check_schema
from zeroth.train.runs import load_run

REPO = Path(__file__).resolve().parent.parent
JOB = str(REPO / "experiments" / "job_digits.yaml")
# An iteration takes a few milliseconds here: the cut run's SIGINT lands around iteration 10, and the
# iterations after it leave room for a loaded machine's delays before the peers stop.
ITERATIONS = 150
SETS = [
    "--set",
    "peers.count=2",
    "--set",
    "peers.join_at=[]",
    "--set",
    "peers.kill_at=[]",
    "--set",
    "train.eval_every=10",
    "--set",
    "train.checkpoint_every=5",
    "--set",
    f"peers.iterations={ITERATIONS}",
    "--quiet",
]


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
    save_state(
        tmp_path / "peers.1" / "p0" / "checkpoints" / "5", p, iteration=5, run_id="r", digest="a" * 64, reason="t"
    )
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
            save_state(
                tmp_path / "peers" / peer / "checkpoints" / str(it),
                p,
                iteration=it,
                run_id="r",
                digest=f"{it:064d}",
                reason=reason,
            )
    # iteration 15 was decided after p1 asked to leave, and so, maybe, was 14: 13 is the newest safe one
    assert launch.newest_checkpoint(tmp_path) == (13, tmp_path / "peers" / "p1" / "checkpoints" / "13")


def test_a_saved_state_is_checked_against_its_size_and_crc_and_a_damaged_one_is_named(tmp_path):
    from zeroth.net.state import check_state, load_state, save_state
    import numpy as np

    p = {"w": np.arange(64, dtype=np.float32), "b": {"c": np.ones(3, np.float32)}}
    d = save_state(tmp_path / "s", p, iteration=7, run_id="r", digest=checksum(p), reason="t")
    meta = json.loads((d / "state.json").read_text())
    assert meta["bytes"] == (d / "state.bin").stat().st_size == 268 and check_state(d) == meta
    params, iteration, digest = load_state(d, p)
    assert iteration == 7 and digest == checksum(p) == checksum(params)
    blob = (d / "state.bin").read_bytes()
    # one flipped bit, same size: the CRC-32 names it (before the model or the digest are involved)
    (d / "state.bin").write_bytes(blob[:10] + bytes([blob[10] ^ 4]) + blob[11:])
    with pytest.raises(
        ValueError, match=rf"{d / 'state.bin'} has CRC-32 [0-9a-f]{{8}}, {meta['crc32']:08x} when saved"
    ):
        load_state(d, p)
    (d / "state.bin").write_bytes(blob[:100])
    with pytest.raises(ValueError, match=rf"{d / 'state.bin'} is 100 bytes, 268 when saved"):
        check_state(d)
    # a state saved before the size and CRC were recorded: its layout's size, and the digest
    legacy = {k: v for k, v in meta.items() if k not in ("bytes", "crc32")}
    (d / "state.json").write_text(json.dumps(legacy))
    with pytest.raises(ValueError, match=r"is 100 bytes, 268 when saved"):
        check_state(d)
    (d / "state.bin").write_bytes(blob)
    assert checksum(load_state(d, p)[0]) == checksum(p)
    # another model's template, a description that is not one, a missing file
    with pytest.raises(ValueError, match=rf"the state in {d} does not fit the model: snapshot leaves do not match"):
        load_state(d, {"w": np.zeros(64, np.float32)})
    (d / "state.json").write_text("[7]")
    with pytest.raises(ValueError, match=r"state.json is not a saved state's description \(TypeError: a JSON object"):
        check_state(d)
    (d / "state.json").write_text(json.dumps({"iteration": 7}))
    with pytest.raises(ValueError, match=r"\(KeyError: 'no field digest, leaves'\)"):
        check_state(d)
    (d / "state.bin").unlink()
    with pytest.raises(ValueError, match=rf"{d / 'state.bin'} is missing: {d} is not a saved state"):
        check_state(d)


def test_resume_takes_an_intact_copy_of_the_newest_checkpoint_and_names_damaged_ones(tmp_path, capsys):
    from zeroth.net import peer
    from zeroth.net.runtime import save_state
    import numpy as np

    out = tmp_path / "run"
    p = {"w": np.ones(3, np.float32)}
    folders = {}
    for name, it in (("p0", 5), ("p0", 9), ("p1", 9)):
        folders[name, it] = save_state(
            out / "peers" / name / "checkpoints" / str(it),
            p,
            iteration=it,
            run_id="r",
            digest="d" * 64,
            reason="checkpoint_every",
        )
    (out / "peers" / "p0" / "metrics.jsonl").write_text('{"kind": "iteration", "step": 1}\n')
    # p0's copy of iteration 9 is cut short: p1's, the same state, is taken
    bad = folders["p0", 9] / "state.bin"
    bad.write_bytes(b"\0")
    assert launch.newest_checkpoint(out) == (9, folders["p1", 9])
    # both copies damaged: one line naming each file, and nothing moved
    (folders["p1", 9] / "state.bin").write_bytes(b"\0" * 12)
    before = sorted(str(f.relative_to(out)) for f in out.rglob("*"))
    assert run_main([JOB, "--out", str(out), *SETS, "--resume"]) == 2
    line = _err_line(capsys)
    assert line.startswith("zeroth run: error: the newest checkpoint, of iteration 9, cannot be resumed: ")
    assert f"{bad} is 1 bytes, 12 when saved" in line and f"{folders['p1', 9] / 'state.bin'} has CRC-32" in line
    assert line.endswith("Nothing was moved or deleted; move them aside to resume from the one before")
    assert sorted(str(f.relative_to(out)) for f in out.rglob("*")) == before
    # zeroth peer --resume with that state: one line, before the peer writes anything
    assert peer.main(["--config", JOB, "--listen", "127.0.0.1:0", "--out", str(tmp_path / "o"), "--resume",
                      str(folders["p0", 9])]) == 2  # fmt: skip
    assert _err_line(capsys) == f"zeroth peer: error: {bad} is 1 bytes, 12 when saved"
    assert not (tmp_path / "o").exists()


@pytest.mark.slow
@pytest.mark.e2e
def test_a_peer_run_interrupted_and_resumed_reaches_the_uninterrupted_digest(tmp_path):
    env = {**os.environ, "PYTHONPATH": str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    cut = tmp_path / "cut"
    cmd = [sys.executable, "-m", "zeroth", "run", JOB, "--out", str(cut), *SETS]
    with (tmp_path / "cut.err").open("w") as err:
        proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.DEVNULL, stderr=err)
    try:
        deadline = time.monotonic() + 120

        def reached_10() -> bool:  # older checkpoints are pruned: any of iteration 10 or later will do
            # both peers: one a step behind when the signal comes saves iteration 9, which bounds the
            # resumable checkpoint (zeroth.net.launch.newest_checkpoint) even where the other saved 10
            return all(
                any(d.name.isdigit() and int(d.name) >= 10 for d in (cut / "peers" / p / "checkpoints").glob("*"))
                for p in ("p0", "p1")
            )

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
    resumed = subprocess.run(
        [sys.executable, "-m", "zeroth", *resume[1:]], cwd=REPO, env=env, capture_output=True, text=True, timeout=180
    )
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    whole = subprocess.run(
        [sys.executable, "-m", "zeroth", "run", JOB, "--out", str(tmp_path / "whole"), *SETS],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=180,
    )
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
    # the update logs of both attempts replay here to every digest: the resumed run from the state
    # the first attempt's log reached at its checkpoint
    report = verify(cut)
    assert report.ok, format_report(report)
    first, second = report.runs
    assert (first.first, second.first, second.last) == (0, k, ITERATIONS) and second.final_digest == b["final_digest"]
    assert second.source.startswith("the state another run of")
