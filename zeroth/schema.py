"""The building blocks of zeroth's config sections: fields with help and checks, and their decoder.

A section is a frozen dataclass whose fields are made by :func:`field` (a help text and the checks
``choices``, ``min``, ``max``, ``gt``). :func:`build` decodes a YAML-parsed mapping into one,
naming the first unknown key (with the valid keys) or bad value (with what would be valid) in a
one-line ``ValueError``. Fields declared with the same ``one_of`` tag form a tagged union: at
most one of them may be set, the set one's key is the tag, and two set keys are refused by name.
:func:`parse_yaml` reads YAML with bounded size and nesting; :func:`describe` lists the fields.

:mod:`zeroth.config` (the experiment config) and the systems' own sections
(``zeroth/<system>/config.py``) are built from these pieces; this module imports neither.
"""

from __future__ import annotations

import dataclasses
import json
import math
import re
import types
import typing
from collections.abc import Callable, Mapping
from typing import Any

import yaml

__all__ = [
    "field",
    "build",
    "describe",
    "parse_yaml",
    "bad",
    "coerce_scalar",
    "check_name",
    "MAX_PROCESSES",
    "MAX_BATCH",
    "MAX_PERTURBATIONS",
    "MAX_WIDTH",
    "SAFE_NAME",
    "MAX_YAML_NODES",
    "MAX_YAML_DEPTH",
    "PIPELINE_OBJECTIVES",
    "PIPELINE_DATASETS",
]

# Upper bounds, checked before any process starts: a config asking for more is refused in one line.
MAX_PROCESSES = 64  # peers (count + join_at), pipeline stages, binary workers, Ravnest nodes
MAX_BATCH = 1 << 16  # examples per batch, per example set
MAX_PERTURBATIONS = 1 << 12  # perturbations (projected gradients) per step or per peer iteration
MAX_WIDTH = 1 << 16  # every integer in model.kwargs (widths, layers, heads) and sequence lengths
# Names that become file and folder names (Ravnest nodes): letters, digits, '_', '-', '.', no '..'.
SAFE_NAME = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.-]{0,63}")

# The objectives of a model cut into stages and the dataset each trains on: the pipeline and
# Ravnest sections both choose one (two systems share them here, below both).
PIPELINE_OBJECTIVES = ("lm", "classify")
PIPELINE_DATASETS = {"lm": "sotu", "classify": "sentiment"}


def field(default: Any = dataclasses.MISSING, help: str = "", *, factory: Callable | None = None, **checks) -> Any:  # noqa: A002
    """A dataclass field with its ``help`` text and checks (``choices``, ``min``, ``max``, ``gt``).

    ``one_of=TAG`` makes the field a member of the tagged union ``TAG`` of its dataclass: an
    optional section, at most one member set (:func:`build` refuses two by name).
    """
    meta = {"help": help, **checks}
    if factory is not None:
        return dataclasses.field(default_factory=factory, metadata=meta)
    return dataclasses.field(default=default, metadata=meta)


def _hints(cls) -> dict[str, Any]:
    return typing.get_type_hints(cls)


def _unwrap_optional(tp) -> tuple[Any, bool]:
    args = typing.get_args(tp)
    if typing.get_origin(tp) in (typing.Union, types.UnionType) and type(None) in args:
        rest = [a for a in args if a is not type(None)]
        return rest[0], True
    return tp, False


def _type_name(tp) -> str:
    inner, optional = _unwrap_optional(tp)
    if typing.get_origin(inner) is tuple:
        name = f"list of {typing.get_args(inner)[0].__name__}"
    elif dataclasses.is_dataclass(inner):
        name = "mapping"
    else:
        name = getattr(inner, "__name__", str(inner))
    return name + (" or null" if optional else "")


def bad(where: str, value: Any, expected: str) -> ValueError:
    """The one-line error of a bad value: the field, the value, what would be valid."""
    return ValueError(f"config field {where}: bad value {value!r}; expected {expected}")


def coerce_scalar(where: str, tp, value: Any) -> Any:
    """``value`` as the scalar type ``tp`` (bool, int, float, str, dict), or :func:`bad` naming ``where``."""
    if tp is bool:
        if isinstance(value, bool):
            return value
        raise bad(where, value, "true or false")
    if tp is int:
        if isinstance(value, bool) or not isinstance(value, int):
            if isinstance(value, float) and value.is_integer():
                return int(value)
            raise bad(where, value, "an integer")
        return int(value)
    if tp is float:
        if isinstance(value, bool):
            raise bad(where, value, "a number")
        if isinstance(value, str):
            # YAML 1.1 reads 1e-3 (no dot) as a string: take it as the number it spells. A string
            # that YAML would have read as a number unquoted was quoted on purpose: refuse it.
            if isinstance(parse_yaml(value, f"config field {where}"), (int, float)):
                raise bad(where, value, "a number, not a quoted string (remove the quotes)")
            try:
                value = float(value)
            except ValueError:
                raise bad(where, value, "a number (e.g. 0.001 or 1e-3)") from None
        if not isinstance(value, (int, float)) or not math.isfinite(float(value)):
            raise bad(where, value, "a finite number")
        return float(value)
    if tp is str:
        if not isinstance(value, str):
            raise bad(where, value, "a string")
        return value
    if tp is dict:
        if not isinstance(value, Mapping):
            raise bad(where, value, "a mapping (e.g. {hidden: [64]})")
        return plain(dict(value))
    raise TypeError(f"config field {where}: unsupported field type {tp!r}")


def plain(x: Any) -> Any:
    """YAML-ish values as plain JSON-able Python (tuples -> lists, keys -> str)."""
    if isinstance(x, Mapping):
        return {str(k): plain(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [plain(v) for v in x]
    return x


def check_limits(where: str, f: dataclasses.Field, value: Any) -> None:
    """Refuse ``value`` (or any element of a tuple) outside the field's ``choices``, ``min``, ``max``, ``gt``."""
    meta = f.metadata
    choices = meta.get("choices")
    if choices is not None and value is not None:
        valid = tuple(choices() if callable(choices) else choices)
        if value not in valid:
            raise bad(where, value, f"one of {list(valid)}")
    values = value if isinstance(value, tuple) else (value,)
    for v in values:
        if v is None or isinstance(v, (str, bool, dict)):
            continue
        if "min" in meta and v < meta["min"]:
            raise bad(where, value, f">= {meta['min']}")
        if "max" in meta and v > meta["max"]:
            raise bad(where, value, f"<= {meta['max']}")
        if "gt" in meta and not v > meta["gt"]:
            raise bad(where, value, f"> {meta['gt']}")


def build(cls, raw: Any, where: str = ""):
    """Build dataclass ``cls`` from a mapping, validating every key and value.

    ``where`` is the dotted path of the section (``""`` at the top level), named in the errors.
    """
    if raw is None:
        raw = {}
    if isinstance(raw, cls):
        return raw
    if not isinstance(raw, Mapping):
        raise ValueError(f"config section {where or 'top level'}: expected a mapping, got {raw!r}")
    fields = {f.name: f for f in dataclasses.fields(cls)}
    unknown = [k for k in raw if k not in fields]
    if unknown:
        section = f"section {where!r}" if where else "the top level"
        raise ValueError(
            f"unknown config key {unknown[0]!r} in {section}; valid keys are {sorted(fields)}"
            + (f" (also unknown: {unknown[1:]})" if len(unknown) > 1 else "")
        )
    _check_unions(fields, raw, where)
    hints = _hints(cls)
    kwargs = {}
    for name, value in raw.items():
        f = fields[name]
        path = f"{where}.{name}" if where else name
        kwargs[name] = _convert(path, hints[name], f, value)
    return cls(**kwargs)


def _check_unions(fields: Mapping[str, dataclasses.Field], raw: Mapping, where: str) -> None:
    """Refuse two set members of one tagged union, naming both (in the order written) and the members."""
    chosen: dict[str, list[str]] = {}
    for name, value in raw.items():
        tag = fields[name].metadata.get("one_of")
        if tag is not None and value is not None:
            chosen.setdefault(tag, []).append(name)
    for tag, names in chosen.items():
        if len(names) > 1:
            members = [n for n, f in fields.items() if f.metadata.get("one_of") == tag]
            inside = f" of section {where!r}" if where else ""
            raise ValueError(
                f"config sections {names[0]!r} and {names[1]!r}{inside} cannot be combined: a config runs one "
                f"{tag}, named by its section (one of {members}); remove one of them"
                + (f" (also set: {names[2:]})" if len(names) > 2 else "")
            )


def _convert(path: str, tp, f: dataclasses.Field, value: Any) -> Any:
    inner, optional = _unwrap_optional(tp)
    if value is None:
        if optional:
            return None
        raise bad(path, value, _type_name(tp))
    if dataclasses.is_dataclass(inner):
        return build(inner, value, path)
    if typing.get_origin(inner) is tuple:
        elem = typing.get_args(inner)[0]
        if not isinstance(value, (list, tuple)):
            raise bad(path, value, f"a list of {elem.__name__}")
        out = tuple(coerce_scalar(f"{path}[{i}]", elem, v) for i, v in enumerate(value))
    else:
        out = coerce_scalar(path, inner, value)
    check_limits(path, f, out)
    return out


def validate_defaults(cfg: Any, where: str = "") -> None:
    """Check limits of every field, defaults included (choices registered later may be missing)."""
    for f in dataclasses.fields(cfg):
        value = getattr(cfg, f.name)
        path = f"{where}.{f.name}" if where else f.name
        if dataclasses.is_dataclass(value):
            validate_defaults(value, path)
        else:
            check_limits(path, f, value)


def check_name(where: str, name: str, becomes: str) -> None:
    """Refuse a ``name`` that becomes a file or folder name (``becomes``) unless it matches :data:`SAFE_NAME`."""
    if not SAFE_NAME.fullmatch(name) or ".." in name:
        raise bad(where, name, f"at most 64 letters, digits, '_', '-' or '.', no '..' (it names {becomes})")


MAX_YAML_NODES = 100_000  # values in a config once its aliases are expanded
MAX_YAML_DEPTH = 32  # nesting of mappings and lists


class _BoundedLoader(yaml.SafeLoader):
    """PyYAML's safe loader that measures the document before building it: the number of values
    it holds with every alias expanded, and its nesting (an alias is a reference, so a few lines
    of aliases can stand for billions of values: checked on the node graph, in linear time)."""

    def construct_document(self, node):
        sizes: dict[int, int] = {}
        _expanded_size(node, sizes, set(), 0)
        return super().construct_document(node)


def _expanded_size(node, sizes: dict, open_: set, depth: int) -> int:
    key = id(node)
    if key in sizes:
        return sizes[key]
    if key in open_:
        raise ValueError("it holds a recursive alias (an anchor used inside itself)")
    if depth > MAX_YAML_DEPTH:
        raise ValueError(f"it nests deeper than {MAX_YAML_DEPTH} levels")
    open_.add(key)
    n = 1
    if isinstance(node, yaml.SequenceNode):
        for child in node.value:
            n += _expanded_size(child, sizes, open_, depth + 1)
    elif isinstance(node, yaml.MappingNode):
        for k, v in node.value:
            n += _expanded_size(k, sizes, open_, depth + 1) + _expanded_size(v, sizes, open_, depth + 1)
    open_.discard(key)
    if n > MAX_YAML_NODES:
        raise ValueError(f"it expands to more than {MAX_YAML_NODES} values (aliases of aliases?); write the values out")
    sizes[key] = n
    return n


def parse_yaml(text, what: str) -> Any:
    """YAML ``text`` (a string or a file) as Python values, refused in one line (naming ``what``)
    when it is not YAML, holds more than :data:`MAX_YAML_NODES` values once its aliases are
    expanded, or nests deeper than :data:`MAX_YAML_DEPTH`."""
    try:
        return yaml.load(text, Loader=_BoundedLoader)  # a SafeLoader subclass
    except yaml.YAMLError as e:
        raise ValueError(f"{what} is not valid YAML: {' '.join(str(e).split())}") from None
    except RecursionError:
        raise ValueError(f"{what} is refused: it nests deeper than {MAX_YAML_DEPTH} levels") from None
    except ValueError as e:
        raise ValueError(f"{what} is refused: {e}") from None


def describe(cls, prefix: str = "") -> str:
    """Every field of dataclass ``cls``: dotted name, type, default and description (for ``--help-config``)."""
    lines = []
    hints = _hints(cls)
    for f in dataclasses.fields(cls):
        path = f"{prefix}.{f.name}" if prefix else f.name
        inner, _ = _unwrap_optional(hints[f.name])
        if dataclasses.is_dataclass(inner):
            tag = f.metadata.get("one_of")
            members = [g.name for g in dataclasses.fields(cls) if tag is not None and g.metadata.get("one_of") == tag]
            union = f" [one {tag} at most: {', '.join(members)}]" if tag is not None else ""
            lines.append(f"{path}:  {f.metadata.get('help', '')}{union}")
            lines.append(describe(inner, path))
            continue
        if f.default is not dataclasses.MISSING:
            default = f"default {json.dumps(plain(f.default))}"
        elif f.default_factory is not dataclasses.MISSING:
            default = f"default {json.dumps(plain(f.default_factory()))}"
        else:
            default = "required"
        choices = f.metadata.get("choices")
        extra = ""
        if choices is not None:
            extra = f" [choices: {', '.join(choices() if callable(choices) else choices)}]"
        lines.append(f"  {path} ({_type_name(hints[f.name])}, {default}){extra}\n      {f.metadata.get('help', '')}")
    return "\n".join(lines)
