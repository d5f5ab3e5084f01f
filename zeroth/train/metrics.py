"""``metrics.jsonl``: one JSON object per line, appended and flushed as training goes.

Record kinds (field ``kind``):

* ``"train"``: every ``train.log_every`` steps: ``loss``, the objective on that step's batch
  before its update (ZO: mean over the perturbation pairs of ``(L(θ+εz) + L(θ−εz)) / 2``).
* ``"eval"``: every ``train.eval_every`` steps, at step 0 and at the end: ``eval_loss``
  (cross-entropy) and ``eval_accuracy`` on the test split.

Every record also holds ``step`` (steps completed), ``forward_passes`` (cumulative training
forward passes over a batch; a ZO step costs ``2 * n_perturbations``, a backprop step 1),
``backward_passes`` (cumulative; backprop only), ``passes`` (forward-pass equivalents,
``forward + 2 * backward``), ``examples`` (cumulative training examples per forward pass),
``payload_bytes`` (cumulative projected-gradient bytes a peer would send; 0 for backprop),
``wall_time`` (seconds since the run started, summed over resumes), ``train_time`` (seconds
spent in training steps only) and ``digest`` (:func:`zeroth.replay.checksum` of the parameters).

Example:
  >>> import tempfile, os
  >>> path = os.path.join(tempfile.mkdtemp(), "metrics.jsonl")
  >>> with MetricsWriter(path) as w:
  ...     w.write({"kind": "train", "step": 1, "loss": 0.5})
  >>> read_metrics(path)[0]["loss"]
  0.5
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

__all__ = ["MetricsWriter", "read_metrics", "truncate_after", "series", "final_eval", "summarize"]


def _clean(v: Any) -> Any:
    if isinstance(v, float) and not math.isfinite(v):
        return str(v)
    if hasattr(v, "item") and callable(v.item):
        return _clean(v.item())
    return v


class MetricsWriter:
    """Appends records to a JSON-lines file; each line is flushed (and fsynced) when written."""

    def __init__(self, path: str | os.PathLike):
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._fh = self.path.open("a", encoding="utf-8")

    def write(self, record: Mapping[str, Any]) -> None:
        """Append one record (a mapping of JSON-able scalars)."""
        line = json.dumps({k: _clean(v) for k, v in record.items()}, sort_keys=False, allow_nan=False)
        self._fh.write(line + "\n")
        self._fh.flush()
        os.fsync(self._fh.fileno())

    def close(self) -> None:
        """Close the file."""
        if not self._fh.closed:
            self._fh.close()

    def __enter__(self) -> MetricsWriter:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


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
    """The headline numbers of a run: final accuracy/loss, steps, passes, bytes, time, digest."""
    last = final_eval(read_metrics(path))
    keys = (
        "step",
        "eval_accuracy",
        "eval_loss",
        "forward_passes",
        "backward_passes",
        "passes",
        "payload_bytes",
        "wall_time",
        "train_time",
        "digest",
    )
    return {k: last.get(k) for k in keys}
