"""Run folders: the checks made before a run writes anything into its output folder.

:func:`check_out_dir` is called once by ``zeroth run`` before it dispatches a config to any
system, so every kind of run (single machine, peers, pipeline, binary) refuses a bad ``--out``
the same way: with one line naming the path and what is wrong with it
(:class:`OutDirError`, a ``ValueError``), instead of an ``OSError`` traceback from deep inside
a run. Nothing is created by the check.

Example:
  >>> import tempfile, pathlib
  >>> f = pathlib.Path(tempfile.mkdtemp()) / "a-file"
  >>> _ = f.write_text("x")
  >>> check_out_dir(f / "run")  # doctest: +ELLIPSIS
  Traceback (most recent call last):
  ...
  zeroth.train.runs.OutDirError: output folder ...a-file/run cannot be created: ...a-file is a file, not a folder
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

__all__ = ["OutDirError", "check_out_dir"]


class OutDirError(ValueError):
    """The output folder cannot hold a run (the message names the path and the problem)."""


def check_out_dir(out: str | os.PathLike) -> Path:
    """Check that ``out`` is, or can be created as, a folder this process can write in; returns it.

    Raises:
      OutDirError: ``out`` is a file; a folder above it is a file; or the folder (or the nearest
        existing folder above it, where ``out`` would be created) refuses a new file.
    """
    out = Path(out)
    if out.exists() and not out.is_dir():
        raise OutDirError(f"output folder {out} is a file, not a folder; choose another --out")
    anc = out
    while not anc.exists() and anc != anc.parent:
        anc = anc.parent
    if not anc.is_dir():
        raise OutDirError(f"output folder {out} cannot be created: {anc} is a file, not a folder")
    try:
        fd, probe = tempfile.mkstemp(prefix=".zeroth-write-test-", dir=anc)
    except OSError as e:
        what = "output folder" if anc == out else f"output folder {out} cannot be created: folder"
        raise OutDirError(f"{what} {anc} is not writable ({e.strerror or e}); choose another --out") from None
    os.close(fd)
    os.unlink(probe)
    return out
