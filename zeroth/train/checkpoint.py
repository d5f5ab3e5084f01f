"""Orbax checkpoints of a training run: parameters, optimizer state, step and data cursor.

A checkpoint at step ``s`` (steps completed) is the folder ``checkpoints/<s>/`` holding the
items ``params`` (pytree), ``opt_state`` (backprop only) and ``meta`` (JSON: step, data cursor,
cumulative counters, parameter digest, config digest). Saves are synchronous and atomic (orbax
writes a temporary folder and renames it), so a process killed mid-save leaves the previous
checkpoints intact; leftover temporary folders are removed when the next run opens the folder.

Once a step is finalized, ``checkpoints/<s>/files.json`` records the size and CRC-32 of every
file of its items. A restore checks them before orbax reads anything, so a truncated or damaged
file is named with its size or checksum against the saved one (a step without the list, saved
before it existed or by a process killed between finalizing and writing it, is read as it is).
The digest of the restored parameters must then equal the one stored in ``meta``. Either way a
bad checkpoint raises :class:`CheckpointError`, which names the folder and the older steps that
can be resumed instead. Nothing is deleted on error; :func:`quarantine`
moves a bad step aside (to ``checkpoints_quarantine/``) when an older one is resumed.

Example:
  >>> import tempfile, numpy as np
  >>> ck = Checkpointer(tempfile.mkdtemp())
  >>> p = {"w": np.ones(3, np.float32)}
  >>> ck.save(5, p, None, {"step": 5, "digest": checksum(p)})
  >>> ck.restore(5, p, None).meta["step"]
  5
"""

from __future__ import annotations

import json
import os
import shutil
import zlib
from pathlib import Path
from typing import Any, NamedTuple

import jax
import numpy as np

from zeroth.replay import checksum, host_tree

__all__ = ["FILES", "file_crc32", "Checkpointer", "Restored", "CheckpointError", "checksum"]


class CheckpointError(RuntimeError):
    """A checkpoint could not be restored (missing, truncated, corrupted or inconsistent)."""


def _dtype(a) -> np.dtype:
    """The dtype of an array, a ``jax.ShapeDtypeStruct`` or a scalar."""
    return np.dtype(a.dtype) if hasattr(a, "dtype") else np.asarray(a).dtype


FILES = "files.json"  # the list of a finalized step's files: {relative path: [size, crc32]}
_ITEMS = ("params", "opt_state", "meta")


def file_crc32(path: str | os.PathLike) -> int:
    """The CRC-32 (zlib's) of a file's bytes, read in 16 MiB pieces."""
    crc = 0
    with open(path, "rb") as fh:
        while chunk := fh.read(1 << 24):
            crc = zlib.crc32(chunk, crc)
    return crc


def _item_files(folder: Path) -> dict[str, list[int]]:
    """``{path relative to folder: [size, crc32]}`` of every file under the items of a step folder."""
    out = {}
    for item in _ITEMS:
        for root, _, names in os.walk(folder / item):
            for name in names:
                f = Path(root) / name
                out[f.relative_to(folder).as_posix()] = [f.stat().st_size, file_crc32(f)]
    return dict(sorted(out.items()))


def _check_files(folder: Path) -> str | None:
    """What differs between a step folder's files and its ``files.json`` (None: nothing, or no list)."""
    listed = folder / FILES
    if not listed.is_file():
        return None
    try:
        saved = json.loads(listed.read_text())
        saved = {str(k): (int(v[0]), int(v[1])) for k, v in saved.items()}
    except (ValueError, TypeError, IndexError, AttributeError) as e:
        return f"its {FILES} is not a valid list of files ({type(e).__name__}: {e})"
    for rel, (size, crc) in saved.items():
        f = folder / rel
        if not f.is_file():
            return f"{rel} is missing"
        if (got := f.stat().st_size) != size:
            return f"{rel} is {got:,} bytes, {size:,} when saved"
        if (got := file_crc32(f)) != crc:
            return f"{rel} has CRC-32 {got:08x}, {crc:08x} when saved"
    return None


class Restored(NamedTuple):
    """What :meth:`Checkpointer.restore` returns."""

    params: Any  # pytree of np.ndarray, same structure as the template
    opt_state: Any  # optimizer state pytree, or None
    meta: dict  # JSON metadata saved with the checkpoint


def _ocp():
    import orbax.checkpoint as ocp

    return ocp


class Checkpointer:
    """Saves and restores training checkpoints under ``directory`` with an orbax ``CheckpointManager``.

    Args:
      directory: the checkpoint folder (created if missing).
      keep: how many most recent checkpoints to keep; 0 = all.
    """

    def __init__(self, directory: str | os.PathLike, keep: int = 0):
        ocp = _ocp()
        self.directory = Path(directory).absolute()
        self.directory.mkdir(parents=True, exist_ok=True)
        options = ocp.CheckpointManagerOptions(
            max_to_keep=keep or None,
            enable_async_checkpointing=False,
            create=True,
            cleanup_tmp_directories=True,
        )
        self._manager = ocp.CheckpointManager(
            self.directory, options=options, item_names=("params", "opt_state", "meta")
        )

    def steps(self) -> list[int]:
        """Steps with a finalized checkpoint, ascending."""
        self._manager.reload()
        return sorted(int(s) for s in self._manager.all_steps())

    def latest_step(self) -> int | None:
        """The newest finalized step, or None."""
        steps = self.steps()
        return steps[-1] if steps else None

    def save(self, step: int, params: Any, opt_state: Any, meta: dict) -> None:
        """Save a checkpoint at ``step`` (blocks until it is written and finalized). ``params`` may
        be a :class:`zeroth.replay.Flat`: its tree is saved, so the files do not depend on how a
        method held the parameters."""
        ocp = _ocp()
        items = {
            "params": ocp.args.StandardSave(host_tree(params)),
            "meta": ocp.args.JsonSave(dict(meta)),
        }
        if opt_state is not None:
            items["opt_state"] = ocp.args.StandardSave(jax.device_get(opt_state))
        self._manager.save(int(step), args=ocp.args.Composite(**items), force=True)
        self._manager.wait_until_finished()
        folder = self.directory / str(int(step))
        tmp = folder / f"{FILES}.tmp"
        with tmp.open("w") as fh:
            json.dump(_item_files(folder), fh)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, folder / FILES)

    def _error(self, step: int, why: str) -> CheckpointError:
        older = [s for s in self.steps() if s < step]
        hint = (
            f"older checkpoints: {older}; resume one with `zeroth run CONFIG --resume --resume-step {older[-1]}`"
            if older
            else "there is no older checkpoint; start the run again in a fresh --out folder"
        )
        return CheckpointError(
            f"checkpoint {self.directory / str(step)} cannot be restored: {why}. Nothing was deleted; {hint}"
        )

    def restore(self, step: int, params_template: Any, opt_template: Any) -> Restored:
        """Restore the checkpoint at ``step`` into the structures of the templates and verify it.

        Raises:
          CheckpointError: no such step, unreadable/truncated files, a structure or dtype that
            does not match the templates, or a parameter digest different from the saved one.
        """
        ocp = _ocp()
        if step not in self.steps():
            raise CheckpointError(f"no checkpoint at step {step} in {self.directory}; available steps: {self.steps()}")
        if (why := _check_files(self.directory / str(step))) is not None:
            raise self._error(step, why)
        as_np = lambda t: jax.tree_util.tree_map(lambda a: np.zeros(np.shape(a), _dtype(a)), t)  # noqa: E731
        items = {"params": ocp.args.StandardRestore(as_np(params_template)), "meta": ocp.args.JsonRestore()}
        if opt_template is not None:
            items["opt_state"] = ocp.args.StandardRestore(as_np(opt_template))
        try:
            out = self._manager.restore(int(step), args=ocp.args.Composite(**items))
        except Exception as e:  # orbax/tensorstore raise many types for damaged files
            raise self._error(step, f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}") from e
        meta = dict(out["meta"] or {})
        params = out["params"]
        if jax.tree_util.tree_structure(params) != jax.tree_util.tree_structure(params_template):
            raise self._error(step, "its parameter tree does not match the model")
        for a, b in zip(jax.tree_util.tree_leaves(params), jax.tree_util.tree_leaves(params_template)):
            if np.shape(a) != np.shape(b) or _dtype(a) != _dtype(b):
                raise self._error(
                    step,
                    f"a parameter has shape/dtype {np.shape(a)}/{_dtype(a)}, the model needs {np.shape(b)}/{_dtype(b)}",
                )
        digest = checksum(params)
        if meta.get("digest") != digest:
            raise self._error(
                step, f"parameter digest {digest[:16]}... differs from the saved {str(meta.get('digest'))[:16]}..."
            )
        opt_state = out["opt_state"] if opt_template is not None else None
        if opt_template is not None:
            leaves = jax.tree_util.tree_leaves(opt_state)
            treedef = jax.tree_util.tree_structure(opt_template)
            if len(leaves) != treedef.num_leaves:
                raise self._error(step, "its optimizer state does not match the optimizer")
            opt_state = jax.tree_util.tree_unflatten(treedef, leaves)
        return Restored(params, opt_state, meta)

    def restore_saved(self, step: int) -> Restored:
        """Restore the parameters and meta of ``step`` as saved (numpy arrays, no model needed), digest checked.

        For reading a run back (:func:`zeroth.train.runs.load_run`); a resumed run uses
        :meth:`restore`, which also checks the structure against the model.
        """
        ocp = _ocp()
        if step not in self.steps():
            raise CheckpointError(f"no checkpoint at step {step} in {self.directory}; available steps: {self.steps()}")
        if (why := _check_files(self.directory / str(step))) is not None:
            raise self._error(step, why)
        try:
            out = self._manager.restore(
                int(step), args=ocp.args.Composite(params=ocp.args.StandardRestore(), meta=ocp.args.JsonRestore())
            )
        except Exception as e:  # orbax/tensorstore raise many types for damaged files
            raise self._error(step, f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}") from e
        meta = dict(out["meta"] or {})
        params = jax.tree_util.tree_map(np.asarray, out["params"])
        digest = checksum(params)
        if meta.get("digest") != digest:
            raise self._error(
                step, f"parameter digest {digest[:16]}... differs from the saved {str(meta.get('digest'))[:16]}..."
            )
        return Restored(params, None, meta)

    def quarantine(self, step: int) -> Path:
        """Move the checkpoint of ``step`` to ``<parent>/checkpoints_quarantine/<step>`` (kept, not deleted)."""
        src = self.directory / str(step)
        dst_root = self.directory.parent / f"{self.directory.name}_quarantine"
        dst_root.mkdir(parents=True, exist_ok=True)
        dst = dst_root / str(step)
        n = 1
        while dst.exists():
            dst = dst_root / f"{step}.{n}"
            n += 1
        shutil.move(str(src), str(dst))
        self._manager.reload()
        return dst

    def close(self) -> None:
        """Release the manager."""
        self._manager.close()
