"""Run folders: a bad --out, a --resume with nothing to resume, a model that cannot be built and a
dataset that fails to load each end in one line naming the problem (exit 2), for every kind of run,
and leave nothing behind."""

import json
import os
import tempfile
from pathlib import Path

import pytest
import yaml

from zeroth import data as _data
from zeroth.run import main as run_main
from zeroth.train.runs import OutDirError, check_out_dir

REPO = Path(__file__).resolve().parent.parent
SINGLE = {
    "run": {"name": "f", "seed": 0},
    "data": {"dataset": "digits", "batch_size": 32, "eval_size": 100},
    "model": {"name": "mlp", "kwargs": {"hidden": [8]}},
    "train": {"method": "zo", "steps": 2, "eval_every": 2, "n_perturbations": 2},
}
KINDS = {  # one config of every kind of run; the --out check comes before any of them starts
    "single": None,
    "peers": REPO / "experiments" / "job_digits.yaml",
    "pipeline": REPO / "experiments" / "aqsgd_transformer_sotu.yaml",
    "binary": REPO / "experiments" / "binary_digits_smoke.yaml",
}


def _single(tmp_path) -> Path:
    path = tmp_path / "single.yaml"
    path.write_text(yaml.safe_dump(SINGLE))
    return path


def _unwritable(tmp_path) -> Path:
    """A folder this process cannot create files in (as root, permissions do not stop it: /sys does)."""
    d = tmp_path / "locked"
    d.mkdir()
    d.chmod(0o500)
    try:
        fd, probe = tempfile.mkstemp(dir=d)
    except OSError:
        return d
    os.close(fd)
    os.unlink(probe)
    return Path("/sys")


def _one_error_line(capsys) -> str:
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("zeroth run: error: "), err
    return err[0]


@pytest.mark.parametrize("kind", list(KINDS))
def test_a_bad_out_folder_is_one_line_naming_the_path(tmp_path, capsys, kind):
    config = str(KINDS[kind] or _single(tmp_path))
    a_file = tmp_path / "a-file"
    a_file.write_text("not a folder")
    locked = _unwritable(tmp_path)
    cases = [
        (a_file, f"output folder {a_file} is a file, not a folder"),
        (a_file / "run", f"output folder {a_file / 'run'} cannot be created: {a_file} is a file, not a folder"),
        (locked / "run", f"output folder {locked / 'run'} cannot be created: folder {locked} is not writable"),
    ]
    if locked != Path("/sys"):
        cases.append((locked, f"output folder {locked} is not writable"))
    for out, expected in cases:
        assert run_main([config, "--out", str(out), "--quiet"]) == 2
        assert expected in _one_error_line(capsys)
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(
        ["a-file", "locked", "single.yaml"][: 3 if kind == "single" else 2]
    )


def test_check_out_dir_accepts_a_new_or_existing_folder_and_creates_nothing(tmp_path):
    assert check_out_dir(tmp_path / "new" / "deeper") == tmp_path / "new" / "deeper"
    assert check_out_dir(tmp_path) == tmp_path
    assert list(tmp_path.iterdir()) == []
    (tmp_path / "f").write_text("")
    with pytest.raises(OutDirError, match="is a file"):
        check_out_dir(tmp_path / "f")


def test_resume_with_nothing_to_resume(tmp_path, capsys):
    config = str(_single(tmp_path))
    for out in (tmp_path / "missing", tmp_path / "empty"):
        if out.name == "empty":
            out.mkdir()
        assert run_main([config, "--out", str(out), "--resume", "--quiet"]) == 2
        assert _one_error_line(capsys) == f"zeroth run: error: no checkpoint in {out}; run without --resume to start"
    assert not (tmp_path / "missing").exists() and list((tmp_path / "empty").iterdir()) == []


def test_model_kwargs_of_the_wrong_type_name_the_field(tmp_path, capsys):
    out = tmp_path / "o"
    assert run_main([str(_single(tmp_path)), "--out", str(out), "--set", "model.kwargs={hidden: [a]}", "--quiet"]) == 2
    line = _one_error_line(capsys)
    assert "config field model.kwargs" in line and "'a'" in line, line
    assert not out.exists()


def test_a_dataset_that_fails_to_load_leaves_no_folder(tmp_path, capsys, monkeypatch):
    def unavailable(name, split):
        raise _data.DatasetUnavailable(f"dataset {name!r} needs a package that is not installed")

    monkeypatch.setattr(_data, "load", unavailable)
    out = tmp_path / "o"
    assert run_main([str(_single(tmp_path)), "--out", str(out), "--quiet"]) == 2
    assert "dataset 'digits' needs" in _one_error_line(capsys)
    assert not out.exists()


def test_a_seed_sweep_runs_each_seed_into_its_folder_and_resumes_the_unfinished(tmp_path, capsys):
    from zeroth import run

    out = tmp_path / "sweep"
    cfg = REPO / "experiments" / "mezo_digits.yaml"
    small = ["--set", "train.steps=3", "--set", "train.eval_every=3", "--set", "train.checkpoint_every=3", "--quiet"]
    assert run.main([str(cfg), *small, "--out", str(out), "--seeds", "0,1"]) == 0
    sweep = json.loads((out / "sweep.json").read_text())
    assert [r["seed"] for r in sweep["runs"]] == [0, 1] and all(r["exit_code"] == 0 for r in sweep["runs"])
    digests = [r["summary"]["digest"] for r in sweep["runs"]]
    assert digests[0] != digests[1]  # different seeds, different models
    assert yaml.safe_load((out / "seed_1" / "config.yaml").read_text())["run"]["seed"] == 1
    # a third seed added later: --resume keeps the finished ones and runs the new one
    assert run.main([str(cfg), *small, "--out", str(out), "--seeds", "0,1,2", "--resume"]) == 0
    again = json.loads((out / "sweep.json").read_text())["runs"]
    assert [r["summary"]["digest"] for r in again[:2]] == digests and again[2]["exit_code"] == 0
    # bad seed lists are one line
    assert run.main([str(cfg), "--out", str(out), "--seeds", "0,x"]) == 2
    assert "--seeds '0,x': expected integers" in capsys.readouterr().err
