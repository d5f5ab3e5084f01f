"""The declared public API: the modules of the docs' API reference, each with a curated ``__all__``.

``docs/api/public_api.txt`` lists every public name, module by module; a change of the public
surface is a change of that file, made on purpose (``python tests/test_public_api.py --write``).
Names a module keeps out of its ``__all__`` are internal: importable, undocumented, free to change.
"""

import importlib
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
INDEX = ROOT / "docs" / "api" / "index.md"
SNAPSHOT = ROOT / "docs" / "api" / "public_api.txt"


def public_modules() -> list[str]:
    """The modules of the API reference's toctree, in its order."""
    block = re.search(r"```\{toctree\}\n(.*?)```", INDEX.read_text(), re.S).group(1)
    pages = [line.strip() for line in block.splitlines() if line.strip() and not line.startswith(":")]
    return [f"zeroth.{page}" for page in pages]


def surface() -> str:
    lines = []
    for name in public_modules():
        names = importlib.import_module(name).__all__
        lines.append(f"{name}: {' '.join(names)}")
    return "\n".join(lines) + "\n"


def test_the_public_api_is_the_declared_one():
    assert SNAPSHOT.read_text() == surface(), (
        "the public API changed: review the change, then run `python tests/test_public_api.py --write`"
    )


def test_every_public_name_exists_and_says_what_it_is():
    for name in public_modules():
        module = importlib.import_module(name)
        assert module.__doc__ and module.__doc__.strip(), name
        assert len(set(module.__all__)) == len(module.__all__), name
        assert len(module.__all__) <= 30, f"{name} exports {len(module.__all__)} names: curate its __all__"
        for attr in module.__all__:
            obj = getattr(module, attr)  # AttributeError names a declared name that is not there
            if callable(obj) and not isinstance(obj, type(sys)):
                assert (getattr(obj, "__doc__", None) or "").strip(), f"{name}.{attr} has no docstring"


def test_every_public_module_has_its_page_in_the_reference():
    for name in public_modules():
        page = INDEX.parent / f"{name.removeprefix('zeroth.')}.md"
        assert f"automodule:: {name}" in page.read_text(), page


if __name__ == "__main__" and sys.argv[1:] == ["--write"]:
    sys.path.insert(0, str(ROOT))
    SNAPSHOT.write_text(surface())
    print(f"wrote {SNAPSHOT.relative_to(ROOT)}")
