"""Parameters as one byte string and back: what a snapshot is when a joiner downloads it in chunks.

Layout: the leaves sorted by their path string (:func:`zeroth.rng.leaf_path`), each stored as its
raw little-endian, row-major bytes, one after the other. :class:`Leaf` records each leaf's path,
dtype, shape, offset and size; :func:`unflatten` rebuilds the pytree into the structure of a
template (the joiner builds its own model) and refuses any mismatch by name.

On disk (a peer's checkpoints and its saved state): :func:`save_state` writes a folder of
``state.bin`` (the bytes) and ``state.json`` (iteration, run id, digest, reason, the layout, and the
size and CRC-32 of ``state.bin``); :func:`check_state` checks a folder without the model (a file
missing, cut short or changed is named), :func:`load_state` rebuilds the parameters and checks
their digest.

Example:
  >>> import numpy as np
  >>> blob, leaves = flatten({"b": np.ones(2, np.float32), "a": np.zeros((1, 2), np.float32)})
  >>> [l.path for l in leaves], len(blob)
  (["['a']", "['b']"], 16)
  >>> unflatten({"a": np.zeros((1, 2), np.float32), "b": np.zeros(2, np.float32)}, blob, leaves)["b"].tolist()
  [1.0, 1.0]
"""

from __future__ import annotations

import json
import math
import os
import zlib
from pathlib import Path
from typing import Any, NamedTuple

import jax
import ml_dtypes  # noqa: F401  (registers bfloat16 with NumPy)
import numpy as np

from zeroth import replay as _replay
from zeroth import rng as _rng
from zeroth.train.checkpoint import file_crc32

__all__ = ["Leaf", "Snapshot", "flatten", "unflatten", "save_state", "check_state", "load_state"]


class Leaf(NamedTuple):
    """One leaf of a flattened state: ``path``, ``dtype`` name, ``shape``, byte ``offset`` and ``nbytes``."""

    path: str
    dtype: str
    shape: tuple[int, ...]
    offset: int
    nbytes: int


class Snapshot(NamedTuple):
    """The state at the start of ``iteration``: its view, digest (hex), bytes and layout."""

    iteration: int
    view: Any  # zeroth.net.protocol.View
    digest: str
    blob: bytes
    leaves: tuple[Leaf, ...]


def _le(arr: np.ndarray) -> np.ndarray:
    arr = np.ascontiguousarray(arr)
    if arr.dtype.byteorder == ">":
        arr = arr.astype(arr.dtype.newbyteorder("<"))
    return arr


def flatten(params: Any) -> tuple[bytes, tuple[Leaf, ...]]:
    """``(blob, leaves)``: every leaf's bytes in path order and their layout."""
    with_path, _ = jax.tree_util.tree_flatten_with_path(params)
    items = sorted(((_rng.leaf_path(p), np.asarray(jax.device_get(x))) for p, x in with_path), key=lambda t: t[0])
    parts, leaves, offset = [], [], 0
    for path, arr in items:
        arr = _le(arr)
        parts.append(arr.tobytes())
        leaves.append(Leaf(path, arr.dtype.name, tuple(int(s) for s in arr.shape), offset, arr.nbytes))
        offset += arr.nbytes
    return b"".join(parts), tuple(leaves)


def unflatten(template: Any, blob: bytes, leaves) -> Any:
    """Rebuild a pytree shaped like ``template`` from ``blob`` laid out as ``leaves`` (NumPy arrays).

    Raises:
      ValueError: the layout does not match the template (paths, dtypes, shapes) or the blob's size.
    """
    with_path, treedef = jax.tree_util.tree_flatten_with_path(template)
    want = {_rng.leaf_path(p): np.asarray(jax.device_get(x)) for p, x in with_path}
    got = {leaf.path: leaf for leaf in leaves}
    if set(want) != set(got):
        missing, extra = sorted(set(want) - set(got)), sorted(set(got) - set(want))
        raise ValueError(f"snapshot leaves do not match the model: missing {missing[:5]}, unexpected {extra[:5]}")
    total = sum(leaf.nbytes for leaf in leaves)
    if total != len(blob):
        raise ValueError(f"snapshot layout covers {total} bytes but {len(blob)} were received")
    out = []
    for p, _ in with_path:
        path = _rng.leaf_path(p)
        leaf, ref = got[path], want[path]
        if leaf.dtype != ref.dtype.name or tuple(leaf.shape) != tuple(ref.shape):
            raise ValueError(
                f"snapshot leaf {path} is {leaf.dtype}{list(leaf.shape)}; the model has {ref.dtype.name}{list(ref.shape)}"
            )
        if leaf.nbytes != math.prod(ref.shape) * ref.dtype.itemsize or leaf.offset + leaf.nbytes > len(blob):
            raise ValueError(f"snapshot leaf {path} has a bad size or offset ({leaf.offset}+{leaf.nbytes})")
        arr = np.frombuffer(blob, dtype=ref.dtype.newbyteorder("<"), count=math.prod(ref.shape), offset=leaf.offset)
        out.append(arr.astype(ref.dtype).reshape(ref.shape))
    return jax.tree_util.tree_unflatten(treedef, out)


def save_state(
    directory: str | os.PathLike, params: Any, *, iteration: int, run_id: str, digest: str, reason: str
) -> Path:
    """Write the state at the start of ``iteration`` to ``directory`` (``state.bin`` + ``state.json``).

    ``state.json`` is written last and atomically (a temporary file renamed), so a folder with a
    ``state.json`` holds a complete state; it records the size and CRC-32 of ``state.bin``.
    """
    d = Path(directory)
    d.mkdir(parents=True, exist_ok=True)
    blob, leaves = flatten(params)
    (d / "state.bin").write_bytes(blob)
    meta = {
        "iteration": iteration,
        "run_id": run_id,
        "digest": digest,
        "reason": reason,
        "bytes": len(blob),
        "crc32": zlib.crc32(blob),
        "leaves": [lf._asdict() for lf in leaves],
    }
    tmp = d / "state.json.tmp"
    tmp.write_text(json.dumps(meta, indent=2) + "\n")
    tmp.replace(d / "state.json")
    return d


def _checked(directory: str | os.PathLike, blob: bytes | None = None) -> tuple[dict, tuple[Leaf, ...]]:
    """The ``state.json`` of a folder written by :func:`save_state`, its ``state.bin`` checked
    against it (size and CRC-32; a state saved before they were recorded: the size its layout
    covers). Nothing is changed.

    Also returns the layout it read (:class:`Leaf` each). ``blob``: ``state.bin``'s bytes, where
    the caller has read them already (checked as they are, not read again).

    Raises:
      ValueError: naming the file: missing, not a state's JSON, or ``state.bin`` of another size
        or checksum than when it was saved.
    """
    d = Path(directory)
    listed, data = d / "state.json", d / "state.bin"
    for f in (listed, data):
        if not f.is_file():
            raise ValueError(f"{f} is missing: {d} is not a saved state")
    try:
        meta = json.loads(listed.read_text())
        if not isinstance(meta, dict):
            raise TypeError(f"a JSON object is expected, not a {type(meta).__name__}")
        if missing := [f for f in ("iteration", "digest", "leaves") if f not in meta]:
            raise KeyError(f"no field {', '.join(missing)}")
        leaves = tuple(
            Leaf(lf["path"], lf["dtype"], tuple(lf["shape"]), int(lf["offset"]), int(lf["nbytes"]))
            for lf in meta["leaves"]
        )
    except (ValueError, TypeError, KeyError) as e:
        raise ValueError(f"{listed} is not a saved state's description ({type(e).__name__}: {e})") from None
    size = int(meta.get("bytes", max((lf.offset + lf.nbytes for lf in leaves), default=0)))
    if (got := data.stat().st_size if blob is None else len(blob)) != size:
        raise ValueError(f"{data} is {got:,} bytes, {size:,} when saved")
    if "crc32" in meta:
        if (crc := file_crc32(data) if blob is None else zlib.crc32(blob)) != int(meta["crc32"]):
            raise ValueError(f"{data} has CRC-32 {crc:08x}, {int(meta['crc32']):08x} when saved")
    return meta, leaves


def check_state(directory: str | os.PathLike) -> dict:
    """The ``state.json`` of a folder written by :func:`save_state`, its files checked (see
    :func:`_checked`, whose errors it raises). Nothing is changed."""
    return _checked(directory)[0]


def load_state(directory: str | os.PathLike, template: Any) -> tuple[Any, int, str]:
    """``(params, iteration, digest)`` from a folder written by :func:`save_state`: its files
    checked (:func:`check_state`), the parameters rebuilt into ``template``'s structure and their
    digest checked.

    Raises:
      ValueError: naming the folder or file: see :func:`check_state`; a layout that does not fit
        the model; a digest other than the saved one.
    """
    d = Path(directory)
    blob = (d / "state.bin").read_bytes() if (d / "state.bin").is_file() else None
    meta, leaves = _checked(d, blob)
    try:
        params = unflatten(template, blob, leaves)
    except ValueError as e:
        raise ValueError(f"the state in {d} does not fit the model: {e}") from None
    digest = _replay.checksum(params)
    if digest != meta["digest"]:
        raise ValueError(f"state in {d} has digest {digest[:16]}, its state.json says {meta['digest'][:16]}")
    return params, int(meta["iteration"]), digest
