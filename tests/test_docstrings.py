"""Every example in zeroth's docstrings runs and shows what it says: each module with a ``>>>``
example is run through :func:`doctest.testmod`, so a changed signature, value or message fails
here instead of in a reader's session."""

import doctest
import importlib
from pathlib import Path

import jax
import pytest

PACKAGE = Path(__file__).resolve().parent.parent / "zeroth"


def _modules_with_examples() -> list[str]:
    names = []
    for path in sorted(PACKAGE.rglob("*.py")):
        lines = path.read_text().splitlines()
        if path.name == "__main__.py" or not any(">>> " in line and "+SKIP" not in line for line in lines):
            continue  # no example, or every one marked to skip (it needs a peer, a package, a download)
        parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
        names.append(".".join(parts[:-1] if parts[-1] == "__init__" else parts))
    return names


MODULES = _modules_with_examples()


def test_the_package_has_examples_to_run():
    assert len(MODULES) >= 30, MODULES  # a path mistake would otherwise leave nothing parametrized
    assert {"zeroth.replay", "zeroth.zo", "zeroth.net.protocol", "zeroth.kernels.perturb"} <= set(MODULES)


@pytest.mark.parametrize("name", MODULES)
def test_the_examples_of_each_module_run(name):
    module = importlib.import_module(name)
    # A reader's Python runs under jax's default (standard) dtype promotion, which optax's
    # schedules in some examples need (a Python float times an int32 count); the suite's own
    # default is strict.
    with jax.numpy_dtype_promotion("standard"):
        result = doctest.testmod(module, optionflags=doctest.ELLIPSIS, report=False)
    assert result.attempted > 0, f"{name}: its '>>> ' lines are not examples doctest finds"
    assert result.failed == 0, f"{name}: {result.failed} of {result.attempted} examples failed (printed above)"
