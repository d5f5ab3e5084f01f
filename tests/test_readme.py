"""The README's and the docs' examples run: every ```python block executes, every `zeroth`
subcommand a ```bash block names exists."""

import re
import subprocess
import sys
from pathlib import Path

import jax
import pytest

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
DOCS = ROOT / "docs"
PAGES = [README] + sorted(p for p in DOCS.rglob("*.md") if "_build" not in p.parts)


def _blocks(path: Path, lang: str) -> list[str]:
    return re.findall(rf"^```{lang}\n(.*?)^```", path.read_text(), flags=re.S | re.M)


def _name(path: Path) -> str:
    return str(path.relative_to(ROOT))


def _run(path: Path) -> None:
    # A reader's Python runs under jax's default (standard) dtype promotion, which optax's
    # schedules need (they mix Python floats and int32 counts); the suite's default is strict.
    with jax.numpy_dtype_promotion("standard"):
        for code in _blocks(path, "python"):
            exec(compile(code, _name(path), "exec"), {"__name__": "readme"})


def test_python_blocks_run(capsys):
    assert _blocks(README, "python"), "the README has no python example"
    _run(README)
    out = capsys.readouterr().out
    assert re.search(r"\b[0-9a-f]{64}\b", out), f"the replay example should print a SHA-256 checksum, got {out!r}"


DOC_PAGES = [p for p in PAGES if p != README and _blocks(p, "python")]


def test_the_docs_have_python_examples():
    names = {_name(p) for p in DOC_PAGES}
    assert {"docs/getting_started.md", "docs/guides/schedules_and_optax.md", "docs/systems/just_one_byte.md"} <= names


@pytest.mark.parametrize("page", DOC_PAGES, ids=_name)
def test_docs_python_blocks_run(page, capsys):
    _run(page)
    assert capsys.readouterr().out, f"{_name(page)}: its examples print nothing to compare with the page"


def test_named_subcommands_exist():
    named = {}
    for page in PAGES:
        for block in _blocks(page, "bash"):
            for line in block.splitlines():
                m = re.match(r"^(?:[A-Z_]+=\S+ )*zeroth (\w+)(?: (\w+))?", line.strip())
                if m:
                    named.setdefault((m.group(1), m.group(2)), _name(page))
    assert any(page == "README.md" for page in named.values()), "the README names no zeroth command"
    top = subprocess.run([sys.executable, "-m", "zeroth", "--help"], capture_output=True, text=True, check=True).stdout
    bench = subprocess.run(
        [sys.executable, "-m", "zeroth", "bench", "--help"], capture_output=True, text=True, check=True
    ).stdout
    listed = set(re.findall(r"^  (\w+)\s", top, flags=re.M))
    listed_bench = set(re.findall(r"^  (\w+)\s", bench, flags=re.M))
    for (cmd, sub), page in sorted(named.items(), key=str):
        assert cmd in listed, f"{page} names `zeroth {cmd}`, which `zeroth --help` does not list"
        if cmd == "bench":
            assert sub in listed_bench, f"{page} names `zeroth bench {sub}`, which `zeroth bench --help` does not list"
