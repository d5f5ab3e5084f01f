"""Run folders: the checks made before a run writes into one, and :func:`load_run` to read one back.

Every kind of run writes one layout into its output folder: ``config.yaml``, ``metrics.jsonl``
(the schema of :mod:`zeroth.train.metrics`), ``summary.json`` and checkpoints. Where they sit:

=========  ================================================  ========================================
kind       metrics                                           final parameters
=========  ================================================  ========================================
single     ``metrics.jsonl``                                 ``checkpoints/<step>/`` (orbax)
peers      ``peers/p<i>/metrics.jsonl`` of the peer          ``peers*/p<i>/checkpoints/<iteration>/``
           that holds machine 0 (else the first done)        (``state.bin`` + ``state.json``)
pipeline   ``metrics.jsonl`` (merged from ``stage_i/``)      per stage, not merged: None
binary     ``metrics.jsonl`` (every model's layers)          not saved: None
           and ``results.json``
ravnest    ``metrics.jsonl`` (every node's ``train``         the first cluster's model: its stages'
           rows, labelled ``node``, in time order)           ``nodes/<name>/params.npz`` end to end
marsit     ``metrics.jsonl`` (every run of the config's      ``{label: worker 0's parameters}`` from
           ``runs`` list, rows labelled ``run``)             ``params/run_<i>.npz``, digests checked
=========  ================================================  ========================================

A Marsit folder's ``summary.json`` is ``{"name", "runs": [one summary per finished run],
"finished", "total"}``.

:func:`load_run` reads any of them and returns what is there (:class:`Run`).

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

import json
import os
import re
import tempfile
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np
import yaml

from zeroth.replay import checksum
from zeroth.train.checkpoint import Checkpointer, CheckpointError
from zeroth.train.metrics import read_metrics

__all__ = ["OutDirError", "check_out_dir", "Metrics", "Run", "load_run", "run_kind"]


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


# --------------------------------------------------------------------------- reading a run back


class Metrics(list):
    """The rows of ``metrics.jsonl`` (a list of dicts) with :meth:`frame`, a pandas ``DataFrame``."""

    def frame(self, kind: str | None = None):
        """The rows (of ``kind``, if given) as a ``pandas.DataFrame``, one column per field.

        pandas is imported here, on use (it is not a dependency of zeroth: ``pip install pandas``).
        """
        try:
            import pandas as pd
        except ImportError as e:  # pragma: no cover - pandas is in the dev extra
            raise ImportError("Metrics.frame() needs pandas: pip install pandas (or pip install -e '.[dev]')") from e
        return pd.DataFrame([r for r in self if kind is None or r.get("kind") == kind])


class Run(NamedTuple):
    """What :func:`load_run` returns."""

    path: Path
    kind: str  # "single", "peers", "pipeline", "binary", "ravnest" or "marsit"
    config: dict  # config.yaml as a dict ({} when the folder has none)
    metrics: Metrics  # the rows of the run's metrics.jsonl ([] when it has none)
    summary: dict  # summary.json (results.json of a binary run; {} when none)
    params: Any  # the final parameters (numpy pytree) from the newest checkpoint, or None (marsit: {label: pytree})
    step: int | None  # the step (iteration) of those parameters, or None (marsit: None, see summary["runs"])


def run_kind(path: str | os.PathLike) -> str:
    """The kind of run a folder holds: ``"peers"``, ``"pipeline"``, ``"binary"``, ``"ravnest"``, ``"marsit"`` or ``"single"``."""
    path = Path(path)
    cfg = _read_yaml(path / "config.yaml")
    if "runs" in cfg:
        return "marsit"
    if cfg.get("ravnest") is not None or (path / "plan.json").exists():
        return "ravnest"
    if cfg.get("peers") is not None or (path / "peers").is_dir():
        return "peers"
    if cfg.get("pipeline") is not None or (path / "stage_0").is_dir():
        return "pipeline"
    if cfg.get("binary") is not None or (path / "results.json").exists():
        return "binary"
    return "single"


def _read_yaml(path: Path) -> dict:
    return yaml.safe_load(path.read_text()) or {} if path.exists() else {}


def _read_json(path: Path) -> dict:
    return json.loads(path.read_text()) if path.exists() else {}


def _single_params(path: Path) -> tuple[Any, int | None]:
    ck = path / "checkpoints"
    if not ck.is_dir() or not any(p.name.isdigit() for p in ck.iterdir()):
        return None, None
    manager = Checkpointer(ck)
    try:
        step = manager.latest_step()
        if step is None:
            return None, None
        return manager.restore_saved(step).params, step
    finally:
        manager.close()


_KEY = re.compile(r"\['((?:[^'\\]|\\.)*)'\]")


def _unflatten_state(folder: Path) -> Any:
    """The parameters of a peer checkpoint (``state.json`` + ``state.bin``) as nested dicts, digest checked."""
    meta = json.loads((folder / "state.json").read_text())
    blob = (folder / "state.bin").read_bytes()
    params: dict = {}
    for leaf in meta["leaves"]:
        keys = _KEY.findall(leaf["path"])
        if not keys or "".join(f"['{k}']" for k in keys) != leaf["path"]:
            raise CheckpointError(f"{folder}: leaf path {leaf['path']!r} is not a path of dict keys")
        arr = (
            np.frombuffer(
                blob,
                dtype=np.dtype(leaf["dtype"]).newbyteorder("<"),
                count=int(np.prod(leaf["shape"], dtype=np.int64)),
                offset=leaf["offset"],
            )
            .reshape(leaf["shape"])
            .astype(np.dtype(leaf["dtype"]))
        )
        node = params
        for k in keys[:-1]:
            node = node.setdefault(k, {})
        node[keys[-1]] = arr
    digest = checksum(params)
    if digest != meta["digest"]:
        raise CheckpointError(
            f"{folder}: parameter digest {digest[:16]} differs from its state.json's {meta['digest'][:16]}"
        )
    return params


def _peer_params(path: Path) -> tuple[Any, int | None]:
    found = []
    for meta in path.glob("peers*/p*/checkpoints/*/state.json"):
        if meta.parent.name.isdigit():
            found.append((int(meta.parent.name), str(meta.parent)))
    if not found:
        return None, None
    step, folder = max(found)
    return _unflatten_state(Path(folder)), step


def _peer_metrics_folder(path: Path) -> Path | None:
    """The peer folder whose metrics stand for the run: the one that held machine 0, else the first that finished."""
    folders = sorted((p for p in (path / "peers").glob("p*") if p.is_dir()), key=lambda p: (len(p.name), p.name))
    summaries = {p: _read_json(p / "summary.json") for p in folders}
    done = [p for p in folders if summaries[p].get("finish_reason") == "done"]
    for p in folders:
        if 0 in (summaries[p].get("machines") or []):
            return p
    return (done or folders or [None])[0]


def _ravnest_params(path: Path, summary: dict) -> tuple[Any, int | None]:
    """The first cluster's final model as one float32 vector (its stages' slices end to end, taken from the
    backup where a primary was killed), and the number of batches; (None, None) if a slice is missing."""
    import numpy as np

    plan = summary.get("plan") or _read_json(path / "plan.json")
    if not plan:
        return None, None
    takeover = {p: b for p, b in plan.get("backups", {}).items() if p in summary.get("killed", [])}
    parts = []
    for name in plan["clusters"][0]:
        f = path / "nodes" / takeover.get(name, name) / "params.npz"
        if not f.is_file():
            return None, None
        with np.load(f) as z:
            parts.append(z["flat"])
    return np.concatenate(parts), summary.get("steps")


def _unflatten_npz(f: Path) -> dict:
    """A ``.npz`` whose keys are leaf paths ``a/b/c`` as nested dicts."""
    out: dict = {}
    with np.load(f) as z:
        for key in z.files:
            node = out
            *parents, last = key.split("/")
            for k in parents:
                node = node.setdefault(k, {})
            node[last] = z[key]
    return out


def _marsit_params(path: Path, summary: dict) -> dict:
    """``{label: worker 0's final parameters}`` of a Marsit folder's finished runs, each digest checked."""
    out = {}
    for s in summary.get("runs", []):
        if not s.get("params_file") or not (path / s["params_file"]).is_file():
            continue
        tree = _unflatten_npz(path / s["params_file"])
        digest = checksum(tree)
        if s.get("digest") and digest != s["digest"]:
            raise CheckpointError(
                f"{path / s['params_file']}: parameter digest {digest[:16]} differs from "
                f"summary.json's {s['digest'][:16]} (run {s['run']!r})"
            )
        out[s["run"]] = tree
    return out


def load_run(path: str | os.PathLike, *, params: bool = True) -> Run:
    """Read a run folder of any kind (see the module docstring) and return what is there.

    Args:
      path: the output folder of ``zeroth run`` (or of a pipeline or binary run).
      params: restore the final parameters from the newest checkpoint (single and peer runs).

    Raises:
      FileNotFoundError: ``path`` is not a folder, or holds no run (neither ``config.yaml``,
        ``metrics.jsonl``, ``summary.json`` nor ``results.json``).
      CheckpointError: the newest checkpoint cannot be restored.

    Example:
      >>> run = load_run("runs/quick")  # doctest: +SKIP
      >>> run.summary["eval_accuracy"], run.metrics.frame("eval")[["step", "eval_accuracy"]]  # doctest: +SKIP
    """
    path = Path(path)
    if not path.is_dir():
        raise FileNotFoundError(f"{path} is not a folder")
    markers = ("config.yaml", "metrics.jsonl", "summary.json", "results.json", "peers")
    if not any((path / m).exists() for m in markers):
        raise FileNotFoundError(f"{path} holds no run: none of {list(markers)}")
    kind = run_kind(path)
    config = _read_yaml(path / "config.yaml")
    metrics_path = path / "metrics.jsonl"
    summary = _read_json(path / "summary.json")
    final, step = None, None
    if kind == "peers":
        ref = _peer_metrics_folder(path)
        metrics_path = ref / "metrics.jsonl" if ref is not None else metrics_path
        if params:
            final, step = _peer_params(path)
    elif kind == "binary":
        summary = summary or _read_json(path / "results.json")
    elif kind == "ravnest" and params:
        final, step = _ravnest_params(path, summary)
    elif kind == "marsit" and params:
        final = _marsit_params(path, summary)
    elif kind == "single" and params:
        final, step = _single_params(path)
    metrics = Metrics(read_metrics(metrics_path) if metrics_path.exists() else [])
    return Run(path, kind, config, metrics, summary, final, step)
