"""The package root: ``zeroth.__all__`` names every public module, each imports and says what it is."""

import importlib
import pkgutil
import subprocess
import sys
from pathlib import Path

import zeroth

ROOT = Path(zeroth.__file__).parent


def test_every_name_in_all_is_a_documented_module():
    for name in zeroth.__all__:
        module = importlib.import_module(f"zeroth.{name}")
        assert module.__doc__ and module.__doc__.strip(), f"zeroth.{name} has no docstring"
    assert len(set(zeroth.__all__)) == len(zeroth.__all__)


def test_all_lists_every_module_of_the_root():
    found = {m.name for m in pkgutil.iter_modules([str(ROOT)])} - {"__main__"}
    assert set(zeroth.__all__) == found, (found - set(zeroth.__all__), set(zeroth.__all__) - found)


def test_import_zeroth_imports_nothing_and_star_import_imports_the_modules():
    code = ("import sys, zeroth; before = {m for m in sys.modules if m.startswith('zeroth.')}; "
            "assert not before and 'jax' not in sys.modules, before; "
            "from zeroth import *; "
            "missing = [n for n in zeroth.__all__ if f'zeroth.{n}' not in sys.modules]; assert not missing, missing; "
            "print(len(zeroth.__all__))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip() == str(len(zeroth.__all__))
