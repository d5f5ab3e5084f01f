"""Worker topologies of multi-hop all-reduce: a ring and a 2D torus, as device meshes.

A topology names the mesh axes and the *stages* of its all-reduce. Each stage is a ring over one
mesh axis; the all-reduce reduce-scatters stage by stage, then all-gathers in reverse:

* :class:`Ring` (``M`` workers, axis ``"w"``): one stage, the ring all-reduce (reduce-scatter then
  all-gather, ``2 (M - 1)`` hops).
* :class:`Torus` (``rows x cols`` workers, axes ``("row", "col")``): the 2D-torus all-reduce:
  reduce-scatter along each row (horizontal ring), all-reduce along each column (vertical ring) on
  the scattered piece, all-gather along each row. ``2 (cols - 1) + 2 (rows - 1)`` hops.

Worker ``k`` (row-major over the mesh axes) holds row ``k`` of every per-worker array, whose
leading axis is sharded with :meth:`spec`.

Example:
  >>> t = Torus(2, 2)
  >>> t.size, t.stages
  (4, (('col', 2), ('row', 2)))
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import numpy as np

__all__ = ["Ring", "Torus", "Topology", "make_topology"]


def _check_pos(name: str, v) -> int:
    if not isinstance(v, int) or isinstance(v, bool) or v < 1:
        raise ValueError(f"{name} must be an int >= 1, got {v!r}")
    return v


@dataclasses.dataclass(frozen=True)
class Ring:
    """``size`` workers on a ring over mesh axis ``axis``."""

    size: int
    axis: str = "w"

    def __post_init__(self):
        _check_pos("Ring.size", self.size)

    @property
    def axes(self) -> tuple[str, ...]:
        """Mesh axis names, in mesh order."""
        return (self.axis,)

    @property
    def shape(self) -> tuple[int, ...]:
        """Mesh shape."""
        return (self.size,)

    @property
    def stages(self) -> tuple[tuple[str, int], ...]:
        """``((axis, ring size), ...)`` in reduce-scatter order."""
        return ((self.axis, self.size),)

    def spec(self):
        """``PartitionSpec`` of a per-worker array (leading axis = worker)."""
        from jax.sharding import PartitionSpec as P

        return P(self.axis)

    def mesh(self, devices: Sequence | None = None):
        """A ``jax.sharding.Mesh`` over the first ``size`` devices (default: those of the platform
        ``jit`` puts arrays on, :func:`zeroth.rule.default_devices`)."""
        return _mesh(self, devices)


@dataclasses.dataclass(frozen=True)
class Torus:
    """``rows x cols`` workers on a 2D torus over mesh axes ``axes = (row axis, col axis)``."""

    rows: int
    cols: int
    axes: tuple[str, str] = ("row", "col")

    def __post_init__(self):
        _check_pos("Torus.rows", self.rows)
        _check_pos("Torus.cols", self.cols)
        if len(self.axes) != 2 or self.axes[0] == self.axes[1]:
            raise ValueError(f"Torus.axes must be two distinct names, got {self.axes!r}")

    @property
    def size(self) -> int:
        """Number of workers."""
        return self.rows * self.cols

    @property
    def shape(self) -> tuple[int, ...]:
        """Mesh shape ``(rows, cols)``."""
        return (self.rows, self.cols)

    @property
    def stages(self) -> tuple[tuple[str, int], ...]:
        """Horizontal ring (along a row, over the column axis) first, then the vertical ring."""
        return ((self.axes[1], self.cols), (self.axes[0], self.rows))

    def spec(self):
        """``PartitionSpec`` of a per-worker array: the leading axis over both mesh axes."""
        from jax.sharding import PartitionSpec as P

        return P(tuple(self.axes))

    def mesh(self, devices: Sequence | None = None):
        """A ``jax.sharding.Mesh`` of shape ``(rows, cols)`` over the first ``size`` devices (default:
        :func:`zeroth.rule.default_devices`)."""
        return _mesh(self, devices)


Topology = Ring | Torus


def _mesh(topo, devices):
    from jax.sharding import Mesh

    from zeroth import rule as _rule

    devices = list(_rule.default_devices() if devices is None else devices)
    if len(devices) < topo.size:
        raise ValueError(
            f"{topo} needs {topo.size} devices but {len(devices)} are available; on CPU set "
            f"XLA_FLAGS=--xla_force_host_platform_device_count={topo.size} before importing jax"
        )
    return Mesh(np.array(devices[: topo.size], dtype=object).reshape(topo.shape), topo.axes)


def make_topology(kind: str, workers: int, rows: int | None = None) -> Topology:
    """``"ring"`` of ``workers``, or ``"torus"`` with ``rows`` rows (default: the most square split).

    Example:
      >>> make_topology("torus", 8)
      Torus(rows=2, cols=4, axes=('row', 'col'))
    """
    _check_pos("workers", workers)
    if kind == "ring":
        return Ring(workers)
    if kind == "torus":
        if rows is None:
            rows = max(r for r in range(1, int(workers**0.5) + 1) if workers % r == 0)
        if workers % rows:
            raise ValueError(f"torus rows={rows} must divide workers={workers}")
        return Torus(rows, workers // rows)
    raise ValueError(f"unknown topology {kind!r}; expected 'ring' or 'torus'")
