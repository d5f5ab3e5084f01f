"""Fashion-MNIST from the Debian package's IDX files: the real data, the reader's errors, the missing case."""

import gzip
import os
import subprocess
import sys

import numpy as np
import pytest

from zeroth import data
from zeroth.data import images


def test_real_files_official_split():
    tr, te = data.load("fashion_mnist", "train"), data.load("fashion_mnist", "test")
    assert tr.x.shape == (60000, 28, 28, 1) and te.x.shape == (10000, 28, 28, 1)
    assert tr.x.dtype == np.float32 and tr.y.dtype == np.int32
    assert float(tr.x.min()) == 0.0 and float(tr.x.max()) == 1.0
    # balanced classes, as published
    assert np.bincount(tr.y).tolist() == [6000] * 10 and np.bincount(te.y).tolist() == [1000] * 10
    # the files' own order: the published first labels of each split
    assert tr.y[:10].tolist() == [9, 0, 0, 3, 0, 2, 7, 2, 5, 5]
    assert te.y[:10].tolist() == [9, 2, 1, 1, 6, 1, 4, 6, 5, 7]
    # a grey level is k/255 exactly as the loader scales it
    assert np.array_equal(np.round(tr.x[:100] * 255), tr.x[:100] * np.float32(255))
    assert tr.info["classes"][9] == "Ankle boot"
    assert data.status("fashion_mnist") == "available"


def _write_idx(path, arr):
    header = bytes([0, 0, 8, arr.ndim]) + b"".join(int(d).to_bytes(4, "big") for d in arr.shape)
    with gzip.open(path, "wb") as f:
        f.write(header + arr.astype(np.uint8).tobytes())


def test_read_idx_round_trip_and_rejects_truncated(tmp_path):
    a = np.arange(2 * 3 * 4, dtype=np.uint8).reshape(2, 3, 4)
    _write_idx(tmp_path / "a.gz", a)
    assert np.array_equal(images.read_idx(tmp_path / "a.gz"), a)
    raw = gzip.open(tmp_path / "a.gz").read()
    with gzip.open(tmp_path / "cut.gz", "wb") as f:
        f.write(raw[:-5])
    with pytest.raises(ValueError, match=r"cut\.gz: 35 bytes, but its header \(2, 3, 4\) needs 40"):
        images.read_idx(tmp_path / "cut.gz")
    with gzip.open(tmp_path / "float.gz", "wb") as f:
        f.write(bytes([0, 0, 0x0D, 1, 0, 0, 0, 1]) + b"\0" * 4)
    with pytest.raises(ValueError, match=r"float\.gz is not an unsigned-byte IDX file"):
        images.read_idx(tmp_path / "float.gz")


def test_missing_files_name_the_install_command(tmp_path, monkeypatch):
    monkeypatch.setenv(images.FASHION_ENV_VAR, str(tmp_path))
    assert data.status("fashion_mnist") == "missing"
    assert "bash scripts/install_fashion_mnist.sh" in data.missing_reason("fashion_mnist")
    with pytest.raises(
        data.DatasetUnavailable, match=r"looked in .*install with: bash scripts/install_fashion_mnist\.sh"
    ):
        images.load_fashion_mnist("test")
    # through the command line too
    out = subprocess.run(
        [sys.executable, "-m", "zeroth", "datasets"],
        capture_output=True,
        text=True,
        check=True,
        env={**os.environ, images.FASHION_ENV_VAR: str(tmp_path)},
    ).stdout
    row = next(line for line in out.splitlines() if line.startswith("fashion_mnist "))
    assert "missing" in row and "install_fashion_mnist.sh" in out


def test_wrong_shapes_are_named(tmp_path, monkeypatch):
    for img, lab, n in images._FASHION_FILES.values():
        _write_idx(tmp_path / img, np.zeros((3, 28, 28), np.uint8))
        _write_idx(tmp_path / lab, np.zeros((3,), np.uint8))
    monkeypatch.setenv(images.FASHION_ENV_VAR, str(tmp_path))
    with pytest.raises(ValueError, match=r"expected \(10000, 28, 28\)"):
        images.load_fashion_mnist("test")
