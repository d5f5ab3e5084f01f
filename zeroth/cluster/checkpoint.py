"""A Ravnest node's checkpoints: everything it needs to continue from an update count, one file each.

A node writes ``OUT/nodes/<name>/checkpoints/<k>.npz`` after its ``k``-th update (every
``train.checkpoint_every`` updates, or at each averaging round when that is 0, and at the end),
atomically (a temporary file, fsynced, renamed). It holds:

* the stage (:meth:`zeroth.cluster.engine.AsyncStage.snapshot`: parameters, optimizer state, update
  count, the batches in flight with their stashed parameters and inputs);
* what the node's transport had received and not used yet, and the keys of every message it has
  seen (:meth:`zeroth.cluster.transport.ClusterTransport.state_arrays`);
* what it had sent that a receiver restarted from update ``k`` may still need
  (:meth:`~zeroth.cluster.transport.ClusterTransport.unreceived`): a message in flight when a node
  died is in its sender's checkpoint;
* ``meta``: run id, node, slot, ``k``, the node's totals so far.

``zeroth run CONFIG --out OUT --resume`` restarts every node from the newest ``k`` all of them
hold (:func:`common_step`); each sends its kept messages again (signed with its new key) and
receivers drop the copies they have, so in the ``fixed`` order the resumed run ends on the digests
of the uninterrupted one. A damaged file is refused in one line naming it (:class:`CheckpointError`).
"""

from __future__ import annotations

import json
import os
import zipfile
from pathlib import Path

import numpy as np

__all__ = ["CheckpointError", "common_step", "folder_of", "load", "save", "steps"]


class CheckpointError(ValueError):
    """A checkpoint that cannot be used; ``str`` names the file and what to do."""


def folder_of(node_dir: Path) -> Path:
    """``<node dir>/checkpoints``."""
    return Path(node_dir) / "checkpoints"


def steps(folder: Path) -> list[int]:
    """The update counts of the checkpoints in ``folder`` (complete files only), ascending."""
    folder = Path(folder)
    if not folder.is_dir():
        return []
    return sorted(int(p.stem) for p in folder.glob("*.npz") if p.stem.isdigit())


def common_step(folders: list[Path]) -> int | None:
    """The newest update count every folder of ``folders`` holds a checkpoint of, or None."""
    common = None
    for f in folders:
        have = set(steps(f))
        common = have if common is None else common & have
    return max(common) if common else None


def save(
    folder: Path,
    step: int,
    arrays: dict[str, np.ndarray],
    sent: list[tuple[tuple[int, int], bytes]],
    meta: dict,
    keep: int = 0,
) -> Path:
    """Write checkpoint ``step`` atomically; keep the ``keep`` newest (0: all). Returns its path."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    out = dict(arrays)
    for i, (slot, data) in enumerate(sent):
        out[f"sent/{i}"] = np.frombuffer(data, np.uint8)
        out[f"sent_to/{i}"] = np.asarray(slot, np.int64)
    meta = {**meta, "step": int(step), "sent": len(sent)}
    out["meta"] = np.frombuffer(json.dumps(meta).encode(), np.uint8)
    path = folder / f"{step}.npz"
    tmp = folder / f".{step}.npz.tmp"
    with open(tmp, "wb") as fh:
        np.savez(fh, **out)
        fh.flush()
        os.fsync(fh.fileno())
    os.replace(tmp, path)
    if keep:
        for old in steps(folder)[:-keep]:
            (folder / f"{old}.npz").unlink(missing_ok=True)
    return path


def load(folder: Path, step: int, run_id: str, name: str) -> tuple[dict[str, np.ndarray], list, dict]:
    """``(arrays, sent messages, meta)`` of checkpoint ``step`` of node ``name`` of run ``run_id``.

    Raises:
      CheckpointError: the file is missing, damaged (truncated, a changed byte), or another run's or node's.
    """
    path = Path(folder) / f"{step}.npz"
    if not path.is_file():
        raise CheckpointError(f"checkpoint {path} does not exist (steps there: {steps(folder)})")
    try:
        with np.load(path, allow_pickle=False) as z:
            arrays = {k: z[k] for k in z.files}  # reads every member: the zip's CRCs catch a changed byte
        meta = json.loads(arrays.pop("meta").tobytes().decode())
    except (zipfile.BadZipFile, OSError, ValueError, KeyError, EOFError) as e:
        raise CheckpointError(
            f"checkpoint {path} is damaged ({type(e).__name__}: {e}); delete it to resume from "
            "an earlier one, or start a new run"
        ) from None
    if meta.get("run_id") != run_id or meta.get("node") != name or meta.get("step") != step:
        raise CheckpointError(
            f"checkpoint {path} is of node {meta.get('node')!r} at update {meta.get('step')} of run "
            f"{meta.get('run_id')!r}, not of node {name!r} at update {step} of run {run_id!r}"
        )
    sent = [
        (tuple(int(v) for v in arrays.pop(f"sent_to/{i}")), arrays.pop(f"sent/{i}").tobytes())
        for i in range(int(meta["sent"]))
    ]
    return arrays, sent, meta
