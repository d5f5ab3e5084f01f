"""Parameters as one byte string and back: what a snapshot is when a joiner downloads it in chunks.

Layout: the leaves sorted by their path string (:func:`zeroth.rng.leaf_path`), each stored as its
raw little-endian, row-major bytes, one after the other. :class:`Leaf` records each leaf's path,
dtype, shape, offset and size; :func:`unflatten` rebuilds the pytree into the structure of a
template (the joiner builds its own model) and refuses any mismatch by name.

Example:
  >>> import numpy as np
  >>> blob, leaves = flatten({"b": np.ones(2, np.float32), "a": np.zeros((1, 2), np.float32)})
  >>> [l.path for l in leaves], len(blob)
  (["['a']", "['b']"], 16)
  >>> unflatten({"a": np.zeros((1, 2), np.float32), "b": np.zeros(2, np.float32)}, blob, leaves)["b"].tolist()
  [1.0, 1.0]
"""

from __future__ import annotations

import math
from typing import Any, NamedTuple

import jax
import ml_dtypes  # noqa: F401  (registers bfloat16 with NumPy)
import numpy as np

from zeroth import rng as _rng

__all__ = ["Leaf", "Snapshot", "flatten", "unflatten"]


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
