"""``metrics.jsonl``: one JSON object per line, appended and flushed as training goes; its schema.

The schema (``zeroth metrics v1``) is shared by every writer (the trainer, the peers, the pipeline
stages, the Ravnest nodes, binary learning, Marsit) and checked by :func:`check_schema`; its
fields are described in the docs (``docs/guides/run_folders.md``, "The metrics schema").
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

from zeroth.train.tensorboard import EventWriter, event_files

__all__ = [
    "SCHEMA",
    "MetricsWriter",
    "check_schema",
    "clear",
    "read_metrics",
    "truncate_after",
    "series",
    "final_eval",
    "summarize",
]

# kind -> {field: allowed JSON types} every row of that kind holds (docs/guides/run_folders.md).
_COMMON = {
    "kind": (str,),
    "step": (int,),
    "time_unix_s": (int, float),
    "wall_time_s": (int, float),
    "digest": (str,),
    "forward_passes": (int,),
    "payload_bytes_total": (int,),
}
SCHEMA: dict[str, dict[str, tuple[type, ...]]] = {
    "train": {
        **_COMMON,
        "loss": (int, float, str, type(None)),
        "lr": (int, float),
        "step_time_s": (int, float),
        "payload_bytes": (int,),
    },
    "eval": {**_COMMON, "eval_loss": (int, float, str), "eval_accuracy": (int, float)},
}


def _clean(v: Any) -> Any:
    if isinstance(v, float) and not math.isfinite(v):
        return str(v)
    if hasattr(v, "item") and callable(v.item):
        return _clean(v.item())
    return v


class MetricsWriter:
    """Appends records to a JSON-lines file; each line is flushed (and fsynced) when written.

    Args:
      path: the ``metrics.jsonl`` file (its folder is created if missing).
      tensorboard: also write each record to a TensorBoard event file in the same folder
        (:class:`zeroth.train.tensorboard.EventWriter`: the row's numbers as scalars
        ``<kind>/<name>`` at its step and time); the writers of ``zeroth run`` pass
        ``run.tensorboard`` (on by default).
      resumed_after: the step a resumed run restarts from: TensorBoard then drops the points
        the earlier event files hold after it (the rows the run writes again).

    Example:
      >>> import tempfile, os
      >>> path = os.path.join(tempfile.mkdtemp(), "metrics.jsonl")
      >>> with MetricsWriter(path) as w:
      ...     w.write({"kind": "train", "step": 1, "loss": 0.5})
      >>> read_metrics(path)[0]["loss"]
      0.5
    """

    def __init__(self, path: str | os.PathLike, *, tensorboard: bool = False, resumed_after: int | None = None):
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._fh = self.path.open("a", encoding="utf-8")
        self._events = EventWriter(self.path.parent) if tensorboard else None
        if self._events is not None and resumed_after is not None:
            self._events.restart(resumed_after + 1)

    def write(self, record: Mapping[str, Any]) -> None:
        """Append one record (a mapping of JSON-able scalars)."""
        row = {k: _clean(v) for k, v in record.items()}
        self._fh.write(json.dumps(row, sort_keys=False, allow_nan=False) + "\n")
        self._fh.flush()
        os.fsync(self._fh.fileno())
        if self._events is not None:
            self._events.write_row(row)

    def close(self) -> None:
        """Close the file."""
        if not self._fh.closed:
            self._fh.close()
        if self._events is not None:
            self._events.close()

    def __enter__(self) -> MetricsWriter:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def clear(path: str | os.PathLike) -> None:
    """Remove a ``metrics.jsonl`` and the TensorBoard event files beside it (a run that starts over)."""
    path = Path(path)
    path.unlink(missing_ok=True)
    for f in event_files(path.parent):
        f.unlink()


def check_schema(records: Iterable[Mapping[str, Any]], where: str = "metrics") -> int:
    """Check rows against :data:`SCHEMA`; returns how many were checked.

    Raises:
      ValueError: naming the row (1-based) and the field: an unknown ``kind``, a missing field,
        a value of the wrong type (``bool`` is not an ``int``), a negative or decreasing ``step``,
        or two train rows of one step (both within the rows of one ``run`` label and one ``node``,
        when rows carry them).
    """
    last: dict = {}
    trained: set = set()
    n = 0
    for n, r in enumerate(records, 1):
        kind = r.get("kind")
        if kind not in SCHEMA:
            raise ValueError(f"{where}: row {n} has kind {kind!r}; expected one of {sorted(SCHEMA)}")
        for field, types in SCHEMA[kind].items():
            if field not in r:
                raise ValueError(f"{where}: row {n} ({kind}, step {r.get('step')}) has no field {field!r}")
            v = r[field]
            if isinstance(v, bool) or not isinstance(v, types):
                raise ValueError(
                    f"{where}: row {n} field {field!r} is {v!r}; expected {'/'.join(t.__name__ for t in types)}"
                )
        run, node = r.get("run"), r.get("node")
        if run is not None and not isinstance(run, str):
            raise ValueError(f"{where}: row {n} field 'run' is {run!r}; expected str (the run's label)")
        if node is not None and not isinstance(node, str):
            raise ValueError(f"{where}: row {n} field 'node' is {node!r}; expected str (the node's name)")
        stream = (run, node)
        step, before = r["step"], last.get(stream, -1)
        if step < 0 or step < before:
            of = "".join(f" of {k} {v!r}" for k, v in (("run", run), ("node", node)) if v is not None)
            raise ValueError(f"{where}: row {n} has step {step} after step {before}{of}; steps never decrease")
        if kind == "train":
            if (stream, step) in trained:
                raise ValueError(f"{where}: row {n} is a second train row of step {step}")
            trained.add((stream, step))
        last[stream] = step
    return n


def read_metrics(path: str | os.PathLike, kind: str | None = None) -> list[dict]:
    """All records of a ``metrics.jsonl`` (optionally only those of one ``kind``).

    A final line cut short (a process killed while writing it) is ignored; a malformed line
    elsewhere raises ``ValueError`` naming the file and line number.
    """
    path = Path(path)
    lines = path.read_text(encoding="utf-8").split("\n")
    out = []
    for i, line in enumerate(lines):
        if not line.strip():
            continue
        try:
            rec = json.loads(line)
        except json.JSONDecodeError as e:
            is_last = all(not rest.strip() for rest in lines[i + 1 :])
            if is_last:
                break
            raise ValueError(f"{path}: line {i + 1} is not valid JSON ({e})") from None
        if kind is None or rec.get("kind") == kind:
            out.append(rec)
    return out


def truncate_after(path: str | os.PathLike, step: int) -> int:
    """Rewrite ``path`` keeping only complete records with ``step <= step``; returns how many were dropped.

    Used on resume: records written after the restored checkpoint are produced again.
    """
    path = Path(path)
    if not path.exists():
        return 0
    records = read_metrics(path)
    keep = [r for r in records if int(r.get("step", 0)) <= step]
    tmp = path.with_suffix(".jsonl.tmp")
    with tmp.open("w", encoding="utf-8") as fh:
        for r in keep:
            fh.write(json.dumps(r) + "\n")
        fh.flush()
        os.fsync(fh.fileno())
    os.replace(tmp, path)
    return len(records) - len(keep)


def series(records: Iterable[Mapping[str, Any]], x: str, y: str, kind: str | None = None) -> tuple[list, list]:
    """Two lists ``(xs, ys)`` of the records (of ``kind``) that hold both fields."""
    xs, ys = [], []
    for r in records:
        if (kind is None or r.get("kind") == kind) and x in r and y in r:
            xs.append(r[x])
            ys.append(r[y])
    return xs, ys


def final_eval(records: Iterable[Mapping[str, Any]]) -> dict:
    """The last ``eval`` record (raises ``ValueError`` if there is none)."""
    evals = [r for r in records if r.get("kind") == "eval"]
    if not evals:
        raise ValueError("no eval record in these metrics")
    return dict(evals[-1])


def summarize(path: str | os.PathLike) -> dict:
    """The headline numbers of a run: final accuracy/loss, steps, passes, bytes (``payload_bytes``: the run's total), time, digest."""
    last = final_eval(read_metrics(path))
    keys = (
        "step",
        "eval_accuracy",
        "eval_loss",
        "forward_passes",
        "backward_passes",
        "passes",
        "wall_time_s",
        "train_time_s",
        "digest",
    )
    return {**{k: last.get(k) for k in keys}, "payload_bytes": last.get("payload_bytes_total")}
