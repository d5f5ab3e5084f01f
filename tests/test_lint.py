"""The tree passes `ruff check` with the rules of pyproject.toml's [tool.ruff] and is laid out as `ruff format`
writes it (as the pre-commit hooks run them)."""

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def _ruff(*args: str, cwd: Path = ROOT) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "ruff", "check", "--no-cache", *args],
        capture_output=True,
        text=True,
        cwd=cwd,
        timeout=120,
    )


def test_the_tree_passes_ruff():
    result = _ruff(".")
    assert result.returncode == 0, (
        f"ruff check found problems (fix them, or `ruff check --fix`):\n{result.stdout}{result.stderr}"
    )


def test_the_rules_are_in_force(tmp_path):
    # The project's configuration on a file with an unused import and an undefined name: both found.
    bad = tmp_path / "bad.py"
    bad.write_text("import os\n\n\ndef f():\n    return undefined_name\n")
    result = _ruff("--config", str(ROOT / "pyproject.toml"), str(bad), cwd=tmp_path)
    assert result.returncode == 1, result.stdout + result.stderr
    assert "F401" in result.stdout and "F821" in result.stdout, result.stdout


def test_the_tree_is_formatted():
    result = subprocess.run(
        [sys.executable, "-m", "ruff", "format", "--check", "--no-cache", "."],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=120,
    )
    assert result.returncode == 0, (
        f"files not laid out as `ruff format` writes them (run `make format`):\n{result.stdout}{result.stderr}"
    )


def test_the_format_check_fails_on_a_badly_laid_out_file(tmp_path):
    bad = tmp_path / "bad.py"
    bad.write_text("x = {  'a':1 }\n")
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "ruff",
            "format",
            "--check",
            "--no-cache",
            "--config",
            str(ROOT / "pyproject.toml"),
            str(bad),
        ],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        timeout=120,
    )
    assert result.returncode == 1 and "bad.py" in result.stdout, result.stdout + result.stderr
