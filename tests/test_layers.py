"""zeroth's layers: every import runs downward, never sideways between systems, never in a cycle.

The layer order is written once, here (:data:`LAYERS`), lowest first. A module belongs to the
first entry naming it or one of its parent packages. An import of module ``a`` by module ``b``
is allowed when ``a``'s layer is below ``b``'s, or both are in the same layer and are not two
different systems (:data:`SYSTEMS`); the whole graph must have no cycle, inside a layer or a
package included (``data/__init__`` <-> ``data/images`` is a cycle).

Imports are read with :mod:`ast` from the whole file: top-level imports and imports inside
function bodies count the same. String targets (``"zeroth.bench.perturb:main"``,
``importlib.import_module("zeroth.x")``) are dynamic imports: they count as edges too, and are
allowed only in the programs' layer (the ``zeroth`` and ``zeroth bench`` dispatchers), or inside
the package that holds them (a registry naming its own submodules).
"""

from __future__ import annotations

import ast
import re
from collections.abc import Mapping
from pathlib import Path
from typing import NamedTuple

ROOT = Path(__file__).resolve().parent.parent / "zeroth"

# The layer order, lowest first: (name, modules). A module belongs to the entry naming it or the
# nearest package above it (the root "zeroth" names only zeroth/__init__.py). Two modules of one
# layer may import each other one way.
LAYERS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("0 package root (imports nothing)", ("zeroth",)),
    (
        "1 exact core: reference, rng, noise, rule, host learning-rate schedules; layerwise (the trace-time hook between estimators and models)",
        ("zeroth.reference", "zeroth.rng", "zeroth.noise", "zeroth.rule", "zeroth.schedules", "zeroth.layerwise"),
    ),
    ("2 kernels", ("zeroth.kernels",)),
    ("2 replay (above the kernels)", ("zeroth.replay",)),
    ("3 codecs, compress, zo, collectives", ("zeroth.codecs", "zeroth.compress", "zeroth.zo", "zeroth.collectives")),
    ("4 models, data (tokenizers included)", ("zeroth.models", "zeroth.data")),
    ("5 methods and objectives", ("zeroth.methods", "zeroth.objectives")),
    ("5 schema: config fields and their decoder (imports no zeroth module)", ("zeroth.schema",)),
    (
        "5 config (its allowed values come from layers 1-5) and the systems' own config sections",
        (
            "zeroth.config",
            "zeroth.net.config",
            "zeroth.pipeline.config",
            "zeroth.cluster.config",
            "zeroth.binary.config",
        ),
    ),
    ("6 train", ("zeroth.train",)),
    ("6 stages: a model cut into stages and its data (shared by pipeline and cluster)", ("zeroth.stages",)),
    (
        "6 transport: secret, identities, access tokens, TLS, pacing, gRPC options (shared by every networked system)",
        ("zeroth.transport",),
    ),
    ("7 systems", ("zeroth.net", "zeroth.pipeline", "zeroth.cluster", "zeroth.binary", "zeroth.marsit")),
    (
        "8 programs: bench, doctor, the zeroth run and zeroth launch dispatchers, cli",
        (
            "zeroth.bench",
            "zeroth.doctor",
            "zeroth.run",
            "zeroth.launch",
            "zeroth.cli",
            "zeroth.__main__",
            "zeroth.protogen",
        ),
    ),
)
SYSTEMS = ("zeroth.net", "zeroth.pipeline", "zeroth.cluster", "zeroth.binary", "zeroth.marsit")
PROGRAMS_LAYER = len(LAYERS) - 1

_TARGET = re.compile(r"^(zeroth(?:\.[A-Za-z_]\w*)*)(?::[A-Za-z_][\w.]*)?$")


class Import(NamedTuple):
    """One edge: ``module`` imports ``target`` at ``line``; ``dynamic`` for a string target."""

    module: str
    target: str
    line: int
    dynamic: bool


def module_names(root: Path = ROOT) -> dict[str, Path]:
    """``{dotted module name: path}`` of every ``.py`` file under ``root`` (the ``zeroth`` package)."""
    out = {}
    for path in sorted(root.rglob("*.py")):
        parts = list(path.relative_to(root.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out[".".join(parts)] = path
    return out


def _resolve(name: str, known) -> str | None:
    """The longest prefix of ``name`` that is a known module."""
    parts = name.split(".")
    for n in range(len(parts), 0, -1):
        cand = ".".join(parts[:n])
        if cand in known:
            return cand
    return None


def imports_of(module: str, source: str, known, *, is_package: bool = False) -> list[Import]:
    """Every import of a known ``zeroth`` module in ``source`` (the text of ``module``), anywhere in the file.

    ``import a.b`` -> ``a.b``; ``from a import b`` -> ``a.b`` when that is a module, else ``a``;
    relative imports are resolved against ``module``; a string constant ``"zeroth.x[:attr]"``
    naming a known module (a dispatch table, ``importlib.import_module("zeroth.x")``) is a
    dynamic import of it.
    """
    tree = ast.parse(source)
    package = module if is_package else module.rpartition(".")[0]
    out: list[Import] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                target = _resolve(alias.name, known)
                if target is not None:
                    out.append(Import(module, target, node.lineno, False))
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base_parts = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                base = ".".join(base_parts + ([node.module] if node.module else []))
            else:
                base = node.module or ""
            for alias in node.names:
                target = (
                    _resolve(f"{base}.{alias.name}", known)
                    if f"{base}.{alias.name}" in known
                    else _resolve(base, known)
                )
                if target is not None:
                    out.append(Import(module, target, node.lineno, False))
        elif isinstance(node, ast.Constant) and isinstance(node.value, str):
            m = _TARGET.match(node.value)
            if m and m.group(1) in known and m.group(1) != "zeroth":
                out.append(Import(module, m.group(1), node.lineno, True))
    return [i for i in out if i.target != module]


def layer_of(module: str) -> int:
    """Index in :data:`LAYERS` of the entry that holds ``module``."""
    best, best_len = None, -1
    for idx, (_, mods) in enumerate(LAYERS):
        for m in mods:
            inside = module == m or ("." in m and module.startswith(m + "."))
            if inside and len(m) > best_len:
                best, best_len = idx, len(m)
    if best is None:
        raise KeyError(f"module {module} is in no layer; add it (or its package) to LAYERS in tests/test_layers.py")
    return best


def _system_of(module: str) -> str | None:
    return next((s for s in SYSTEMS if module == s or module.startswith(s + ".")), None)


def _top_package(module: str) -> str:
    return ".".join(module.split(".")[:2])


def _cycles(edges: Mapping[str, set[str]]) -> list[list[str]]:
    """The strongly connected components with more than one module (Tarjan), each as a sorted list."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    out: list[list[str]] = []
    counter = [0]

    def visit(v: str) -> None:
        work = [(v, iter(sorted(edges.get(v, ()))))]
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        while work:
            node, it = work[-1]
            nxt = next(it, None)
            if nxt is not None:
                if nxt not in index:
                    index[nxt] = low[nxt] = counter[0]
                    counter[0] += 1
                    stack.append(nxt)
                    on.add(nxt)
                    work.append((nxt, iter(sorted(edges.get(nxt, ())))))
                elif nxt in on:
                    low[node] = min(low[node], index[nxt])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                comp = []
                while True:
                    w = stack.pop()
                    on.discard(w)
                    comp.append(w)
                    if w == node:
                        break
                if len(comp) > 1:
                    out.append(sorted(comp))

    for v in sorted(edges):
        if v not in index:
            visit(v)
    return sorted(out)


def violations(sources: Mapping[str, tuple[str, bool]]) -> list[str]:
    """Every layering violation of a module tree ``{module: (source text, is_package)}``, one line each."""
    known = set(sources)
    found: list[str] = []
    edges: dict[str, set[str]] = {m: set() for m in known}
    for module, (text, is_package) in sorted(sources.items()):
        try:
            lower = layer_of(module)
        except KeyError as e:
            found.append(str(e.args[0]))
            continue
        for imp in imports_of(module, text, known, is_package=is_package):
            edges[module].add(imp.target)
            where = f"{module}:{imp.line}"
            upper = layer_of(imp.target)
            kind = "dynamic import of" if imp.dynamic else "imports"
            if upper > lower:
                found.append(
                    f"{where} {kind} {imp.target}: upward, layer '{LAYERS[upper][0]}' is above '{LAYERS[lower][0]}'"
                )
            elif (
                upper == lower
                and _system_of(module)
                and _system_of(imp.target)
                and _system_of(module) != _system_of(imp.target)
            ):
                found.append(
                    f"{where} {kind} {imp.target}: sideways between two systems ({_system_of(module)}, {_system_of(imp.target)})"
                )
            elif imp.dynamic and lower != PROGRAMS_LAYER and _top_package(imp.target) != _top_package(module):
                found.append(
                    f"{where} {kind} {imp.target}: a string import outside the programs' layer reaches another package"
                )
    for comp in _cycles(edges):
        found.append(f"import cycle between {', '.join(comp)}")
    return found


def tree_sources(root: Path = ROOT) -> dict[str, tuple[str, bool]]:
    """``{module: (source, is_package)}`` of the real ``zeroth`` tree."""
    return {m: (p.read_text(), p.name == "__init__.py") for m, p in module_names(root).items()}


# --------------------------------------------------------------------------- tests


def test_zeroth_imports_only_downward_and_has_no_cycle():
    found = violations(tree_sources())
    assert not found, "layer violations:\n" + "\n".join(found)


def test_every_module_has_a_layer():
    for module in module_names():
        layer_of(module)


def _planted() -> dict[str, tuple[str, bool]]:
    """A small clean tree laid out like zeroth's."""
    return {
        "zeroth": ("", True),
        "zeroth.rng": ("import numpy as np\n", False),
        "zeroth.replay": ("from zeroth import rng\n", False),
        "zeroth.kernels": ("", True),
        "zeroth.kernels.perturb": ("from zeroth import rng\n", False),
        "zeroth.zo": ("from zeroth import replay\n", False),
        "zeroth.data": ("from zeroth.data import images\n", True),
        "zeroth.data.images": ("import numpy\n", False),
        "zeroth.train": ("", True),
        "zeroth.train.trainer": ("from zeroth import zo\nfrom zeroth import data\n", False),
        "zeroth.net": ("", True),
        "zeroth.net.work": ("from zeroth.train import trainer\n", False),
        "zeroth.pipeline": ("", True),
        "zeroth.bench": ("", True),
        "zeroth.bench.signbits": ("from zeroth.kernels import perturb\n", False),
        "zeroth.cli": ('COMMANDS = {"bench": "zeroth.bench:main"}\n', False),
    }


def test_the_planted_tree_is_clean():
    assert violations(_planted()) == []


def test_checker_fails_on_a_planted_upward_import():
    tree = _planted()
    # a kernel reaching up into the benchmarks, inside a function body
    tree["zeroth.kernels.perturb"] = (
        "from zeroth import rng\n\ndef rows():\n    from zeroth.bench import signbits\n",
        False,
    )
    found = violations(tree)
    assert "zeroth.kernels.perturb:4 imports zeroth.bench.signbits: upward" in found[0], found
    # the benchmark imports the kernel: the planted import also closes a cycle
    assert found[1:] == ["import cycle between zeroth.bench.signbits, zeroth.kernels.perturb"], found


def test_checker_fails_on_a_planted_cycle_inside_a_package():
    tree = _planted()
    tree["zeroth.data.images"] = ("def load():\n    import zeroth.data\n", False)
    found = violations(tree)
    assert found == ["import cycle between zeroth.data, zeroth.data.images"], found


def test_checker_fails_on_a_cycle_between_kernels_and_replay():
    tree = _planted()
    tree["zeroth.replay"] = ("from zeroth import rng\nfrom zeroth.kernels import perturb\n", False)
    tree["zeroth.kernels.perturb"] = ("from zeroth import replay\n", False)
    found = violations(tree)
    assert any("zeroth.kernels.perturb:1 imports zeroth.replay: upward" in f for f in found), found
    assert "import cycle between zeroth.kernels.perturb, zeroth.replay" in found, found


def test_checker_fails_on_systems_importing_each_other():
    tree = _planted()
    tree["zeroth.pipeline.stage"] = ("from zeroth.net import work\n", False)
    found = violations(tree)
    assert len(found) == 1 and "sideways between two systems (zeroth.pipeline, zeroth.net)" in found[0], found


def test_checker_reads_string_imports():
    tree = _planted()
    # the dispatcher of the programs' layer may name any module by string
    assert violations(tree) == []
    # below it, a string import of another package is a hidden dependency
    tree["zeroth.train.trainer"] = ('import importlib\nM = importlib.import_module("zeroth.net.work")\n', False)
    found = violations(tree)
    assert any("zeroth.train.trainer:2 dynamic import of zeroth.net.work: upward" in f for f in found), found
    # and a cycle through a string target is still a cycle
    tree = _planted()
    tree["zeroth.data.images"] = ('PARENT = "zeroth.data:register"\n', False)
    assert violations(tree) == ["import cycle between zeroth.data, zeroth.data.images"]


def test_relative_imports_are_resolved():
    tree = _planted()
    tree["zeroth.kernels.signbits"] = ("from ..bench import signbits\n", False)
    found = violations(tree)
    assert len(found) == 1 and "zeroth.kernels.signbits:1 imports zeroth.bench.signbits: upward" in found[0], found
