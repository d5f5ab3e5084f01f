"""The processes of a loopback run (peers, stages, nodes): stopping them and reading why one failed."""

from __future__ import annotations

import signal
import subprocess
import time
from collections.abc import Iterable
from pathlib import Path

__all__ = ["log_tail", "stop"]


def stop(procs: Iterable[subprocess.Popen], grace_s: float = 10.0) -> None:
    """SIGTERM every live process, wait ``grace_s`` seconds in all, then SIGKILL the ones still alive."""
    live = [p for p in procs if p.poll() is None]
    for p in live:
        p.send_signal(signal.SIGTERM)
    end = time.monotonic() + grace_s
    for p in live:
        try:
            p.wait(max(0.1, end - time.monotonic()))
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()


def log_tail(path: Path, lines: int = 3) -> str:
    """The last ``lines`` lines of a process log, joined by `` | `` (empty when there is none)."""
    path = Path(path)
    return " | ".join(path.read_text().strip().splitlines()[-lines:]) if path.is_file() else ""
