"""The launchers' shared lifecycle (:mod:`zeroth.transport.processes`): start with a log, watch, stop, name a failure."""

import signal
import sys

import pytest

from zeroth.transport import processes


def _py(tmp_path, name, code):
    return processes.start([sys.executable, "-c", code], tmp_path / f"{name}.log")


def test_start_writes_the_childs_output_to_its_log_and_appends_when_asked(tmp_path):
    p = _py(tmp_path, "a", "import sys; print('out'); print('err', file=sys.stderr)")
    assert p.wait(30) == 0
    q = processes.start([sys.executable, "-c", "print('again')"], tmp_path / "a.log", append=True)
    assert q.wait(30) == 0
    assert (tmp_path / "a.log").read_text().split() == ["out", "err", "again"]


def test_a_failed_process_ends_the_watch_stops_the_others_and_is_named_with_its_log(tmp_path):
    slow = _py(tmp_path, "slow", "import time; time.sleep(60)")
    bad = _py(tmp_path, "bad", "import sys; print('line 1'); print('cannot bind 127.0.0.1:1'); sys.exit(3)")
    watched = processes.watch([slow, bad], failed=lambda i, p: p.poll() not in (None, 0), grace_s=5)
    assert watched == processes.Watched("failed", 1)
    assert slow.poll() == -signal.SIGTERM  # stopped, not left running
    line = processes.exit_line("stage 1", bad.returncode, tmp_path / "bad.log", lines=1)
    assert line == "stage 1 exited with code 3: cannot bind 127.0.0.1:1"


def test_the_watch_ends_when_every_process_exited_or_the_time_is_up(tmp_path):
    done = [_py(tmp_path, f"ok{i}", "pass") for i in range(2)]
    assert processes.watch(done, failed=lambda i, p: p.poll() not in (None, 0)) == processes.Watched("exited")
    slow = _py(tmp_path, "slow", "import time; time.sleep(60)")
    assert processes.watch([slow], timeout_s=0.2) == processes.Watched("timeout")
    assert slow.poll() is not None


def test_the_launchers_tick_ends_the_watch_and_an_error_in_it_stops_every_process(tmp_path):
    slow = _py(tmp_path, "slow", "import time; time.sleep(60)")
    ticks = []

    def tick():
        ticks.append(1)
        return "round 3 done" if len(ticks) == 3 else None

    assert processes.watch([slow], tick, interval_s=0.01) == processes.Watched("round 3 done")
    assert slow.poll() is None  # the launcher's own reason: it decides what becomes of the processes

    def broken():
        raise RuntimeError("no live worker left to kill at round 2")

    with pytest.raises(RuntimeError, match="no live worker left"):
        processes.watch([slow], broken, grace_s=0)
    assert slow.poll() == -signal.SIGKILL  # grace 0: killed at once


def test_without_until_exited_only_the_tick_or_the_time_ends_the_watch(tmp_path):
    gone = _py(tmp_path, "gone", "pass")
    gone.wait(30)
    seen = []
    watched = processes.watch([gone], lambda: seen.append(1) or ("done" if len(seen) > 1 else None), until_exited=False)
    assert watched == processes.Watched("done") and len(seen) == 2
