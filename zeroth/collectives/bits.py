"""Bit accounting: what actually crosses ``ppermute``, read from the traced program.

:func:`ppermute_bits` traces a function (``jax.make_jaxpr``), walks its jaxpr and every nested one
(``shard_map``, ``jit``, custom derivatives, ``scan`` bodies times their length) and adds, for each
``ppermute``, ``size x dtype bits`` of every operand times the number of workers that send it
(the permutation's pairs, in every group of the mesh axes it does not run over). Scales, norms and
count planes are counted like everything else, because they are operands of ``ppermute`` too.
A ``ppermute`` under ``cond`` or ``while`` has no static count and is refused.

Bits per element per synchronization (the seed's Figure 3(b) column) is the bits one round moves
divided by the elements a full-precision all-reduce of the same vector moves on the same topology
(``PSGD bits / 32``): PSGD is 32, a one-bit method about 1, and Marsit with a full-precision round
every K rounds averages ``(32 + (K - 1)) / K``.

Example::

    bits = ppermute_bits(step_fn, *example_args)      # total over all workers, one call
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from typing import Any

import jax
import numpy as np

__all__ = ["ppermute_bits", "ppermute_report", "bits_per_element", "average_bits_per_element"]

_REFUSED = ("cond", "while")


def _sub_jaxprs(params: Mapping[str, Any]):
    for name, v in params.items():
        items = v if isinstance(v, (tuple, list)) else (v,)
        for item in items:
            if hasattr(item, "eqns"):
                yield name, item
            elif hasattr(item, "jaxpr") and hasattr(item.jaxpr, "eqns"):
                yield name, item.jaxpr


def _walk(jaxpr, axis_sizes: dict[str, int], total_workers: int, mult: int, out: list) -> None:
    for eqn in jaxpr.eqns:
        prim = eqn.primitive.name
        if prim == "ppermute":
            axes = eqn.params["axis_name"]
            axes = axes if isinstance(axes, tuple) else (axes,)
            missing = [a for a in axes if a not in axis_sizes]
            if missing:
                raise ValueError(f"ppermute over axes {missing} outside any shard_map; cannot count its senders")
            ring = math.prod(axis_sizes[a] for a in axes)
            groups = total_workers // ring
            senders = len(eqn.params["perm"]) * groups
            per_send = sum(int(np.prod(v.aval.shape)) * np.dtype(v.aval.dtype).itemsize * 8 for v in eqn.invars)
            out.append({"axes": axes, "per_send_bits": per_send, "senders": senders, "bits": per_send * senders * mult})
            continue
        subs = list(_sub_jaxprs(eqn.params))
        if not subs:
            continue
        sizes, workers, m = axis_sizes, total_workers, mult
        if prim == "shard_map":
            mesh = eqn.params["mesh"]
            sizes = {**axis_sizes, **dict(zip(mesh.axis_names, mesh.axis_sizes))}
            workers = math.prod(mesh.axis_sizes)
        elif prim == "scan":
            m = mult * int(eqn.params["length"])
        for _, sub in subs:
            found: list = []
            _walk(sub, sizes, workers, m, found)
            if found and prim in _REFUSED:
                raise ValueError(f"ppermute inside {prim!r}: its number of executions is not static; unroll it")
            out.extend(found)


def ppermute_report(fn: Callable, *args, **kwargs) -> list[dict]:
    """Every ``ppermute`` of one call of ``fn(*args, **kwargs)``: axes, bits per sender, senders, bits."""
    closed = jax.make_jaxpr(fn)(*args, **kwargs)
    out: list = []
    _walk(closed.jaxpr, {}, 1, 1, out)
    return out


def ppermute_bits(fn: Callable, *args, **kwargs) -> int:
    """Total bits all workers send through ``ppermute`` in one call of ``fn(*args, **kwargs)``."""
    return int(sum(r["bits"] for r in ppermute_report(fn, *args, **kwargs)))


def bits_per_element(bits: int, reference_bits: int) -> float:
    """``32 * bits / reference_bits``: bits per element, ``reference_bits`` being a full-precision
    all-reduce of the same vector on the same topology (so that one is 32.0)."""
    if reference_bits <= 0:
        raise ValueError(f"reference_bits must be > 0, got {reference_bits}")
    return 32.0 * bits / reference_bits


def average_bits_per_element(phase_bits: Mapping[str, int], phases: list[str], reference_bits: int) -> float:
    """Mean bits per element over rounds whose phases are ``phases`` (``phase_bits[phase]`` per round)."""
    if not phases:
        raise ValueError("no rounds to average over")
    total = sum(phase_bits[p] for p in phases)
    return bits_per_element(total, reference_bits * len(phases))
