"""Clean interrupts: SIGINT / SIGTERM set a flag that the training loop reads between steps.

A Python signal handler that raises ``KeyboardInterrupt`` fires at whatever bytecode runs when
the signal arrives: inside a garbage-collector callback (where the exception is printed and
dropped, so the run goes on), inside the tracing of a jitted function, or on return from XLA
compilation. :func:`catch` installs handlers that only set a flag; the loop
(:func:`zeroth.train.loop.train`, argument ``stop``) checks it before each step, so the current
step always finishes, the trainer writes a checkpoint and raises :class:`Interrupted`, and the
program prints one line saying how to resume and exits with :data:`EXIT_CODE` (130, the shell's
code for a process ended by SIGINT).

A second signal while the first is being handled ends the process at once (exit 130, no
checkpoint), for a run that is stuck.

Example:
  >>> import os, signal
  >>> with catch() as flag:
  ...     os.kill(os.getpid(), signal.SIGINT)
  ...     flag.is_set(), flag.signal_name()
  (True, 'SIGINT')
"""

from __future__ import annotations

import os
import shlex
import signal
import sys
import threading
import time
from collections.abc import Sequence
from pathlib import Path

__all__ = ["EXIT_CODE", "Interrupted", "StopFlag", "catch", "resume_command"]

EXIT_CODE = 130


class Interrupted(Exception):
    """A run stopped by a signal after finishing a step; ``checkpoint`` is where it was saved (or None)."""

    def __init__(self, step: int, total: int, checkpoint: Path | None):
        self.step, self.total, self.checkpoint = step, total, checkpoint
        where = f"checkpoint {checkpoint}" if checkpoint is not None else "no checkpoint"
        super().__init__(f"stopped after step {step} of {total}; {where}")


class StopFlag:
    """Set by the handlers of :func:`catch`; ``is_set()`` is what a loop's ``stop`` argument calls."""

    def __init__(self) -> None:
        self._event = threading.Event()
        self.signum: int | None = None

    def is_set(self) -> bool:
        return self._event.is_set()

    def set(self, signum: int = signal.SIGINT) -> None:
        self.signum = signum
        self._event.set()

    def wait(self, timeout: float, slice_s: float = 0.02) -> bool:
        """Sleep up to ``timeout`` seconds, returning early (True) once the flag is set.

        It sleeps in slices of ``slice_s`` rather than in ``threading.Event.wait``: the handler that
        sets the flag runs in this same (main) thread, and one that fired while ``Event.wait`` held
        the event's lock would block on that lock for ever.
        """
        end = time.monotonic() + timeout
        while not self.is_set():
            left = end - time.monotonic()
            if left <= 0:
                return False
            time.sleep(min(slice_s, left))
        return True

    def signal_name(self) -> str:
        return signal.Signals(self.signum).name if self.signum is not None else "a stop request"


class catch:
    """Context manager: while inside, ``signals`` (default SIGINT and SIGTERM) set a :class:`StopFlag`.

    The previous handlers are restored on exit. Only the main thread can install handlers;
    elsewhere the flag is returned without handlers (nothing sets it).
    """

    def __init__(self, signals: Sequence[int] = (signal.SIGINT, signal.SIGTERM)):
        self.signals = tuple(signals)
        self.flag = StopFlag()
        self._previous: dict[int, object] = {}

    def _handle(self, signum, frame) -> None:
        if self.flag.is_set():  # a second signal: the user insists
            print(
                f"{signal.Signals(signum).name} again: exiting at once, without a checkpoint",
                file=sys.stderr,
                flush=True,
            )
            os._exit(EXIT_CODE)
        self.flag.set(signum)

    def __enter__(self) -> StopFlag:
        if threading.current_thread() is threading.main_thread():
            for s in self.signals:
                self._previous[s] = signal.signal(s, self._handle)
        return self.flag

    def __exit__(self, *exc) -> None:
        for s, h in self._previous.items():
            signal.signal(s, h)
        self._previous.clear()


def resume_command(argv: Sequence[str], out: str | os.PathLike, program: str = "zeroth run") -> str:
    """The command that resumes a run started with ``argv``: ``--out OUT --resume``, other arguments kept.

    Example:
      >>> resume_command(["exp.yaml", "--set", "train.lr=0.1", "--resume-step", "4", "--resume"], "runs/a")
      'zeroth run exp.yaml --set train.lr=0.1 --out runs/a --resume'
    """
    kept: list[str] = []
    it = iter(argv)
    for a in it:
        if a == "--resume":
            continue
        if a in ("--out", "--resume-step"):
            next(it, None)
            continue
        if a.startswith(("--out=", "--resume-step=")):
            continue
        kept.append(a)
    return " ".join([program, *(shlex.quote(a) for a in kept), "--out", shlex.quote(str(out)), "--resume"])
