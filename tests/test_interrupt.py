"""Clean interrupts: SIGINT / SIGTERM finish the step under way, save a checkpoint, exit 130 with one
line saying how to resume, and the resumed run ends on the uninterrupted run's digest.

The signal is sent at several moments of a real `zeroth run` subprocess: while Python imports the
command (nothing to save yet), during the compilation of the first step, and mid-run (SIGTERM).
"""

import os
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import yaml

from zeroth.config import load_config_dict
from zeroth.methods.base import Method, StepInfo, TrainState
from zeroth.train import interrupt, loop, trainer
from zeroth.train.metrics import read_metrics

REPO = Path(__file__).resolve().parent.parent

RAW = {
    "run": {"name": "sig", "seed": 0},
    "data": {"dataset": "digits", "batch_size": 32, "eval_size": 200},
    "model": {"name": "mlp", "kwargs": {"hidden": [16]}},
    "train": {
        "method": "zo",
        "lr": 0.02,
        "eps": 1.0e-3,
        "n_perturbations": 8,
        "codec": "onebyte",
        "steps": 300,
        "eval_every": 100,
        "log_every": 20,
        "checkpoint_every": 50,
    },
}


def test_the_loop_stops_before_a_step_when_asked():
    count = Method(
        lambda p, k: TrainState(0, p, None, k),
        lambda s, b: (s._replace(step=s.step + 1, params=s.params + 1), StepInfo(1, 0, 0, 0.0, None)),
    )
    calls = []
    stop = lambda: len(calls) >= 3  # noqa: E731
    state, counters = loop.train(
        count.init(np.float32(0), None),
        count,
        lambda t: (np.ones((2, 1)),),
        [loop.hook(lambda e: calls.append(e.step), every=1)],
        steps=10,
        stop=stop,
    )
    assert state.step == 3 and calls == [1, 2, 3] and counters.forward_passes == 3
    state, _ = loop.train(state, count, lambda t: (np.ones((2, 1)),), steps=10, stop=lambda: True)
    assert state.step == 3  # asked before the first step: no step at all


def test_catch_sets_a_flag_and_restores_the_handlers():
    before = signal.getsignal(signal.SIGTERM)
    with interrupt.catch() as flag:
        assert not flag.is_set()
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(0.01)
        assert flag.is_set() and flag.signal_name() == "SIGTERM"
    assert signal.getsignal(signal.SIGTERM) is before


def test_waiting_on_the_flag_ends_when_a_signal_arrives_not_at_the_timeout():
    import threading

    with interrupt.catch() as flag:
        assert flag.wait(0.05) is False  # nothing sent: the whole timeout passes
        threading.Timer(0.1, os.kill, (os.getpid(), signal.SIGINT)).start()
        start = time.monotonic()
        assert flag.wait(60.0) is True
        assert time.monotonic() - start < 30.0  # woken by the signal, long before the timeout
        assert flag.signal_name() == "SIGINT" and flag.wait(60.0) is True  # set: returns at once


def test_resume_command_keeps_the_arguments_and_names_the_folder():
    argv = ["e.yaml", "--set", "train.lr=0.1", "--out", "a b", "--resume-step", "3", "--quiet"]
    cmd = interrupt.resume_command(argv, "a b")
    assert shlex.split(cmd) == [
        "zeroth",
        "run",
        "e.yaml",
        "--set",
        "train.lr=0.1",
        "--quiet",
        "--out",
        "a b",
        "--resume",
    ]


def _env(tmp_path):
    return {
        **os.environ,
        "PYTHONPATH": str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""),
        "JAX_COMPILATION_CACHE_DIR": str(tmp_path / "jax_cache"),
        "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0",
    }


def _handlers_installed(proc) -> bool:
    """Whether ``proc`` handles SIGTERM (zeroth's handlers are installed; Python leaves SIGTERM at SIG_DFL).

    Read from the caught-signals mask of ``/proc/PID/status``; where there is no ``/proc``, half a
    second after the start stands in for it.
    """
    try:
        status = Path(f"/proc/{proc.pid}/status").read_text()
    except FileNotFoundError:
        return time.monotonic() - proc.started > 0.5
    caught = int(next(line.split()[1] for line in status.splitlines() if line.startswith("SigCgt:")), 16)
    return bool(caught >> (signal.SIGTERM - 1) & 1)


def _interrupt(cmd, env, err_path: Path, ready, sig=signal.SIGINT, timeout=120.0):
    """Start ``cmd``, send ``sig`` once ``ready(proc)`` is true, return (exit code, stderr)."""
    with err_path.open("w") as err:
        proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.DEVNULL, stderr=err)
    proc.started = time.monotonic()
    try:
        deadline = time.monotonic() + timeout
        while not ready(proc):
            assert proc.poll() is None, f"the run ended before the signal: {err_path.read_text()[-2000:]}"
            assert time.monotonic() < deadline, "the moment to interrupt never came"
            time.sleep(0.01)
        proc.send_signal(sig)
        proc.wait(timeout=timeout)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    return proc.returncode, err_path.read_text()


@pytest.mark.slow
@pytest.mark.e2e
def test_sigint_and_sigterm_at_several_moments_leave_a_resumable_checkpoint(tmp_path):
    cfg_path = tmp_path / "sig.yaml"
    cfg_path.write_text(yaml.safe_dump(RAW))
    env = _env(tmp_path)

    def cmd(out, *extra):
        return [sys.executable, "-m", "zeroth", "run", str(cfg_path), "--out", str(out), *extra]

    # 1. while the command is still importing jax: nothing written, no traceback. The signal goes
    # once zeroth's handlers are in place (the first few ms of the interpreter's own start-up are
    # Python's default handling, a KeyboardInterrupt traceback and exit -2).
    out0 = tmp_path / "starting"
    code, err = _interrupt(cmd(out0), env, tmp_path / "0.err", _handlers_installed)
    assert code == 130 and err.strip().splitlines() == [
        "zeroth run: interrupted by SIGINT while starting; nothing was written"
    ], err
    assert not out0.exists()

    # 2. during the compilation of the first step (the step-0 eval line is printed just before it)
    out1 = tmp_path / "compiling"
    err1 = tmp_path / "1.err"
    code, err = _interrupt(cmd(out1), env, err1, lambda _: "step 0/300 eval" in err1.read_text())
    last = err.strip().splitlines()[-1]
    assert code == 130 and "Traceback" not in err and "KeyboardInterrupt" not in err, err
    assert last.startswith("zeroth run: interrupted by SIGINT after step ") and last.endswith(" --resume"), last
    step1 = int(last.split("after step ")[1].split()[0])
    assert step1 < 50 and trainer.saved_steps(out1) == [step1]
    assert f"checkpoint saved in {out1 / 'checkpoints' / str(step1)}" in last

    # 3. mid-run, SIGTERM, --quiet: the one line is all of stderr
    out2 = tmp_path / "midrun"
    code, err = _interrupt(
        cmd(out2, "--quiet"),
        env,
        tmp_path / "2.err",
        lambda _: max(trainer.saved_steps(out2) or [0]) >= 50,
        sig=signal.SIGTERM,
    )
    lines = err.strip().splitlines()
    assert code == 130 and len(lines) == 1 and lines[0].startswith("zeroth run: interrupted by SIGTERM after step "), (
        err
    )
    step2 = int(lines[0].split("after step ")[1].split()[0])
    assert 50 <= step2 < 300 and max(trainer.saved_steps(out2)) == step2

    # each resumes (with the command it printed) to the uninterrupted run's digest and metrics
    reference = trainer.train(load_config_dict(RAW), tmp_path / "uninterrupted", progress=False)
    ref_metrics = [
        (r["kind"], r["step"], r["digest"]) for r in read_metrics(tmp_path / "uninterrupted" / "metrics.jsonl")
    ]
    for out, line in ((out1, last), (out2, lines[0])):
        resume = shlex.split(line.split("resume with: ")[1])
        assert resume[:2] == ["zeroth", "run"]
        done = subprocess.run(
            [sys.executable, "-m", "zeroth", *resume[1:]],
            cwd=REPO,
            env=env,
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert done.returncode == 0, done.stderr[-3000:]
        final = yaml.safe_load(done.stdout.strip().splitlines()[-1])
        assert final["step"] == 300 and final["digest"] == reference.digest
        assert [(r["kind"], r["step"], r["digest"]) for r in read_metrics(out / "metrics.jsonl")] == ref_metrics


BINARY = {
    "run": {"name": "bsig", "seed": 3},
    "data": {"dataset": "digits", "batch_size": 16, "eval_size": 100},
    "binary": {
        "methods": ["evolution", "flips"],
        "weights": ["binary"],
        "channels": [8, 8],
        "levels": 4,
        "train_size": 200,
        "steps": 60,
        "k": 2,
        "grid": 2,
        "workers": 0,
        "speed_repeats": 1,
    },
}


def _comparable(rows):
    """The rows without their times (every other field is a function of the config)."""
    return [{k: v for k, v in r.items() if not k.endswith("_s")} for r in rows]


@pytest.mark.slow
@pytest.mark.e2e
def test_binary_run_interrupted_mid_layer_resumes_to_the_uninterrupted_results(tmp_path):
    from zeroth import run as zrun

    cfg_path = tmp_path / "b.yaml"
    cfg_path.write_text(yaml.safe_dump(BINARY))
    env = _env(tmp_path)
    out = tmp_path / "cut"
    metrics = out / "metrics.jsonl"

    def mid_layer(_):  # some steps of the first model's second layer are done
        return metrics.is_file() and len(metrics.read_text().splitlines()) >= 70

    code, err = _interrupt(
        [sys.executable, "-m", "zeroth", "run", str(cfg_path), "--out", str(out), "--quiet"],
        env,
        tmp_path / "b.err",
        mid_layer,
    )
    lines = err.strip().splitlines()
    assert code == 130 and len(lines) == 1 and "Traceback" not in err, err
    assert lines[0].startswith("zeroth run: interrupted by SIGINT after step ") and lines[0].endswith(" --resume"), err
    step = int(lines[0].split("after step ")[1].split()[0])
    assert 61 < step < 240 and f"checkpoint saved in {out / 'checkpoint'}" in lines[0]
    assert [r["step"] for r in read_metrics(metrics)][-1] == step and not (out / "results.json").exists()
    # the same folder without --resume is refused; with it, the run goes on from the checkpoint
    assert zrun.main([str(cfg_path), "--out", str(out), "--quiet"]) == 2
    resume = shlex.split(lines[0].split("resume with: ")[1])
    assert zrun.main(resume[2:]) == 0 and not (out / "checkpoint").exists()

    assert zrun.main([str(cfg_path), "--out", str(tmp_path / "whole"), "--quiet"]) == 0
    import json

    a, b = (json.loads((tmp_path / d / "results.json").read_text()) for d in ("cut", "whole"))
    for key in ("checksums", "test_accuracy", "layer_test_accuracy", "loss_curves", "flip_curves"):
        assert [m[key] for m in a["models"]] == [m[key] for m in b["models"]], key
    assert a["layer_cache"] == b["layer_cache"] == {"trained": 4, "hits": 0}
    rows_a, rows_b = read_metrics(metrics), read_metrics(tmp_path / "whole" / "metrics.jsonl")
    assert _comparable(rows_a) == _comparable(rows_b)  # every step's loss, flips and digest, bit for bit
