"""The lifecycle of a loopback run's child processes (peers, stages, nodes, workers), shared by the systems'
launchers: start each with its log in the run folder, watch them, stop them, say why one failed.

A launcher keeps what is its own (the command lines, the kill and join schedule, the summary) and
hands the rest here: :func:`start` a process with its log, :func:`watch` the processes until they
exit, one fails, the time is up or the launcher's own ``tick`` says the run is over (every process
is stopped when the watch ends on a failure, a timeout or an exception, Ctrl-C included),
:func:`stop` the ones left, and :func:`exit_line` names a failed one with the end of its log.
"""

from __future__ import annotations

import signal
import subprocess
import time
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import NamedTuple

__all__ = ["Watched", "due", "exit_line", "log_tail", "start", "stop", "watch"]


def start(
    cmd: Sequence[str], log: Path, *, env: dict | None = None, append: bool = False, own_session: bool = False
) -> subprocess.Popen:
    """Start ``cmd`` with its stdout and stderr in the file ``log`` (``append``: after what it holds).

    ``own_session``: the child runs in a session of its own, so a Ctrl-C on the terminal reaches only
    the launcher, which then stops it.
    """
    with open(log, "a" if append else "w") as fh:  # the child holds its own copy of the descriptor
        return subprocess.Popen(list(cmd), stdout=fh, stderr=subprocess.STDOUT, env=env, start_new_session=own_session)


def stop(procs: Iterable[subprocess.Popen], grace_s: float = 10.0) -> None:
    """SIGTERM every live process, wait ``grace_s`` seconds in all, then SIGKILL the ones still alive
    (``grace_s`` 0: SIGKILL at once)."""
    live = [p for p in procs if p.poll() is None]
    if grace_s <= 0:
        for p in live:
            p.kill()
        for p in live:
            p.wait()
        return
    for p in live:
        p.send_signal(signal.SIGTERM)
    end = time.monotonic() + grace_s
    for p in live:
        try:
            p.wait(max(0.1, end - time.monotonic()))
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()


class Watched(NamedTuple):
    """How a :func:`watch` ended: ``reason`` (``"exited"``, ``"failed"``, ``"timeout"``, or the string
    the launcher's ``tick`` returned) and, for ``"failed"``, the ``index`` of the failed process."""

    reason: str
    index: int | None = None


def watch(
    procs: Sequence[subprocess.Popen],
    tick: Callable[[], str | None] | None = None,
    *,
    failed: Callable[[int, subprocess.Popen], bool] | None = None,
    timeout_s: float | None = None,
    interval_s: float = 0.05,
    pause: Callable[[float], object] = time.sleep,
    until_exited: bool = True,
    grace_s: float = 10.0,
) -> Watched:
    """Watch a run's processes until it ends; returns how it ended (:class:`Watched`).

    Every ``interval_s`` seconds (``pause`` waits; a signal flag's ``wait`` wakes at once): the watch
    ends ``"exited"`` once no process is alive (``until_exited``; without it only ``tick`` or the time
    ends it), ``"timeout"`` once ``timeout_s`` seconds have passed; then ``tick()`` runs (the
    launcher's kills, pauses and joins on cue, its progress) and a string it returns ends the watch
    with that reason; then the first process ``failed(index, process)`` counts as failed ends it
    ``"failed"`` (without ``failed``, no process's exit ends it).

    On ``"failed"``, ``"timeout"`` or an exception (raised by ``tick``, or Ctrl-C), every process still
    alive is stopped (:func:`stop` with ``grace_s``) before the watch returns or re-raises.
    """
    deadline = None if timeout_s is None else time.monotonic() + timeout_s
    try:
        while True:
            if until_exited and not any(p.poll() is None for p in procs):
                return Watched("exited")
            if deadline is not None and time.monotonic() > deadline:
                stop(procs, grace_s)
                return Watched("timeout")
            why = tick() if tick is not None else None
            if why is not None:
                return Watched(why)
            bad = next((i for i, p in enumerate(procs) if failed(i, p)), None) if failed is not None else None
            if bad is not None:
                stop(procs, grace_s)
                return Watched("failed", bad)
            pause(interval_s)
    except BaseException:
        stop(procs, grace_s)
        raise


def due(schedule: list, now) -> int:
    """How many events of the ascending ``schedule`` (iterations, rounds, update counts) are due at
    ``now``; they are taken off it, so each is acted on once.

    Example:
      >>> kill_at = [2, 5, 5, 9]
      >>> due(kill_at, 5), kill_at
      (3, [9])
    """
    n = 0
    while schedule and now >= schedule[0]:
        schedule.pop(0)
        n += 1
    return n


def log_tail(path: Path, lines: int = 3) -> str:
    """The last ``lines`` lines of a process log, joined by `` | `` (empty when there is none)."""
    path = Path(path)
    return " | ".join(path.read_text().strip().splitlines()[-lines:]) if path.is_file() else ""


def exit_line(what: str, code: int, log: Path, lines: int = 3) -> str:
    """``"<what> exited with code <code>: <the last lines of its log>"``."""
    return f"{what} exited with code {code}: " + log_tail(log, lines)
