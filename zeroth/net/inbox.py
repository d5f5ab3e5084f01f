"""A persistent map ``{(iteration, machine): value}`` whose update shares structure with the old one.

A peer's protocol state is immutable (each handler returns a new one), so a dict of the pushes
held would be copied whole at each push: O(M) per message, O(M²) per iteration for the committer
that receives every member's push. :class:`Inbox` keeps, per iteration, a two-level trie on the
machine id (:data:`WIDTH` slots a level, a small dict at the leaves), so :meth:`Inbox.put` copies
two tuples of :data:`WIDTH` references and one leaf (ids that agree in their low 12 bits, one per
leaf up to 4,096 members), whatever the number of pushes held, and the old map is unchanged.

Example:
  >>> a = Inbox().put((3, 1001), "p")
  >>> b = a.put((3, 1002), "q").put((4, 1001), "r")
  >>> sorted(a), sorted(b.items()), b.count(3), a.count(3)
  ([(3, 1001)], [((3, 1001), 'p'), ((3, 1002), 'q'), ((4, 1001), 'r')], 2, 1)
  >>> sorted(b.machines(3)), sorted(b.since(4)), len(b.without([(3, 1001)]))
  ([1001, 1002], [(4, 1001)], 2)
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping
from typing import Any

__all__ = ["WIDTH", "Inbox"]

BITS = 6
WIDTH = 1 << BITS
"""Slots per level of an iteration's trie."""
_MASK = WIDTH - 1
_EMPTY: tuple = (None,) * WIDTH


def _slots(m: int) -> tuple[int, int]:
    return m & _MASK, (m >> BITS) & _MASK


class Inbox(Mapping):
    """Persistent ``{(iteration, machine): value}`` (see the module docstring). Iteration follows
    the iterations in order, and each iteration's machines in trie order (sort where it matters)."""

    __slots__ = ("_its", "_len")

    def __init__(self, items: Iterable[tuple[tuple[int, int], Any]] | Mapping = ()):
        self._its: dict[int, tuple[int, tuple]] = {}  # iteration: (count, root)
        self._len = 0
        pairs = items.items() if isinstance(items, Mapping) else items
        out = self
        for key, value in pairs:
            out = out.put(key, value)
        self._its, self._len = out._its, out._len

    @classmethod
    def _of(cls, its: dict, n: int) -> Inbox:
        out = cls.__new__(cls)
        out._its, out._len = its, n
        return out

    # ------------------------------------------------------------------ Mapping

    def __getitem__(self, key: tuple[int, int]) -> Any:
        t, m = key
        got = self._its.get(t)
        if got is not None:
            a, b = _slots(m)
            mid = got[1][a]
            if mid is not None:
                leaf = mid[b]
                if leaf is not None and m in leaf:
                    return leaf[m]
        raise KeyError(key)

    def __len__(self) -> int:
        return self._len

    def __iter__(self) -> Iterator[tuple[int, int]]:
        for t in sorted(self._its):
            for m in self.machines(t):
                yield (t, m)

    def __repr__(self) -> str:
        return f"Inbox({dict(self.items())!r})"

    # ------------------------------------------------------------------ queries

    def count(self, iteration: int) -> int:
        """How many values ``iteration`` holds (O(1))."""
        got = self._its.get(iteration)
        return got[0] if got is not None else 0

    def machines(self, iteration: int) -> Iterator[int]:
        """The machines ``iteration`` holds a value of (trie order; O(values + occupied slots))."""
        for m, _ in self.at(iteration):
            yield m

    def at(self, iteration: int) -> Iterator[tuple[int, Any]]:
        """``(machine, value)`` of ``iteration`` (trie order)."""
        got = self._its.get(iteration)
        if got is None:
            return
        for mid in got[1]:
            if mid is not None:
                for leaf in mid:
                    if leaf is not None:
                        yield from leaf.items()

    # ------------------------------------------------------------------ updates (new maps)

    def put(self, key: tuple[int, int], value: Any) -> Inbox:
        """A map with ``key`` set to ``value``; this one is unchanged."""
        t, m = key
        a, b = _slots(m)
        count, root = self._its.get(t, (0, _EMPTY))
        mid = root[a] or _EMPTY
        leaf = mid[b]
        new_leaf = {m: value} if leaf is None else {**leaf, m: value}
        added = leaf is None or m not in leaf
        mid = (*mid[:b], new_leaf, *mid[b + 1 :])
        root = (*root[:a], mid, *root[a + 1 :])
        its = dict(self._its)
        its[t] = (count + added, root)
        return Inbox._of(its, self._len + added)

    def since(self, iteration: int) -> Inbox:
        """The map without the iterations before ``iteration`` (O(iterations held))."""
        its = {t: v for t, v in self._its.items() if t >= iteration}
        return Inbox._of(its, sum(c for c, _ in its.values()))

    def without(self, keys: Iterable[tuple[int, int]]) -> Inbox:
        """The map without ``keys`` (those it lacks are ignored)."""
        drop = {k for k in keys if k in self}
        if not drop:
            return self
        return Inbox(((k, v) for k, v in self.items() if k not in drop))
