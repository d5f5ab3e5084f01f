"""Offline datasets with deterministic splits and batches.

``load(name, split)`` returns a :class:`Dataset` of NumPy arrays (read-only). Every random choice
is a threefry permutation of a key derived from named integers, never a global RNG, so splits
depend on the dataset name only and batches on ``(seed, step)`` only (:mod:`zeroth.data.base`,
the registry). The datasets register themselves there:

* :mod:`zeroth.data.images`: ``digits``, ``mnist5k``, ``fashion_mnist``;
* :mod:`zeroth.data.text`: ``sentiment`` (and its SmolLM2 / MiniLM token versions), ``sotu``.

The tokenizers the token datasets use live here too: :mod:`zeroth.data.bpe` (SmolLM2's
byte-level BPE, from the GGUF metadata :mod:`zeroth.data.gguf` reads) and
:mod:`zeroth.data.wordpiece` (MiniLM's WordPiece); :mod:`zeroth.data.resources` finds the files
inside installed packages. ``zeroth datasets`` lists every dataset with its status
(:func:`cli_main`).

Example:
  >>> ds = load("digits", "train")
  >>> ds.x.shape, ds.x.dtype, ds.num_classes
  ((1437, 8, 8, 1), dtype('float32'), 10)
"""

from __future__ import annotations

from zeroth.data import base as _base
from zeroth.data import images, text
from zeroth.data.base import (
    BATCH_TAG,
    REGISTRY,
    SPLITS,
    Dataset,
    DatasetSpec,
    DatasetUnavailable,
    batch_at,
    batch_indices,
    cli_main,
    load,
    make_splits,
    missing_reason,
    names,
    permutation,
    register,
    split_indices,
    split_key,
    status,
)

__all__ = [*_base.__all__, "images", "text"]
