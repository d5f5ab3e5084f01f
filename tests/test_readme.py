"""The README's examples run: every ```python block executes, every `zeroth` subcommand it names exists."""

import re
import subprocess
import sys
from pathlib import Path

import jax

README = Path(__file__).resolve().parent.parent / "README.md"


def _blocks(lang: str) -> list[str]:
    return re.findall(rf"```{lang}\n(.*?)```", README.read_text(), flags=re.S)


def test_python_blocks_run(capsys):
    blocks = _blocks("python")
    assert blocks, "the README has no python example"
    # A reader's Python runs under jax's default (standard) dtype promotion, which optax's
    # schedules need (they mix Python floats and int32 counts); the suite's default is strict.
    with jax.numpy_dtype_promotion("standard"):
        for code in blocks:
            exec(compile(code, str(README), "exec"), {"__name__": "readme"})
    out = capsys.readouterr().out
    assert re.search(r"\b[0-9a-f]{64}\b", out), f"the replay example should print a SHA-256 checksum, got {out!r}"


def test_named_subcommands_exist():
    named = set()
    for block in _blocks("bash"):
        for line in block.splitlines():
            m = re.match(r"^(?:[A-Z_]+=\S+ )*zeroth (\w+)(?: (\w+))?", line.strip())
            if m:
                named.add((m.group(1), m.group(2)))
    assert named, "the README names no zeroth command"
    top = subprocess.run([sys.executable, "-m", "zeroth", "--help"], capture_output=True, text=True, check=True).stdout
    bench = subprocess.run(
        [sys.executable, "-m", "zeroth", "bench", "--help"], capture_output=True, text=True, check=True
    ).stdout
    listed = set(re.findall(r"^  (\w+)\s", top, flags=re.M))
    listed_bench = set(re.findall(r"^  (\w+)\s", bench, flags=re.M))
    for cmd, sub in sorted(named, key=str):
        assert cmd in listed, f"README names `zeroth {cmd}`, which `zeroth --help` does not list"
        if cmd == "bench":
            assert sub in listed_bench, f"README names `zeroth bench {sub}`, which `zeroth bench --help` does not list"
