"""Per-layer views of parameters, and the trace-time hook through which an estimator serves them.

A model reads the parts of a leaf it needs through two functions instead of indexing the leaf:

How an estimator serves these views, and what it saves, is in the docs (Concepts, ZO memory:
"Layers perturbed where they are read").

Example:
  >>> import jax, jax.numpy as jnp
  >>> w = jnp.arange(6.0).reshape(3, 2)
  >>> view = layer_view({"w": w})
  >>> def body(h, xs):
  ...     i, lp = xs
  ...     return h + view.layer(i, lp)["w"].sum(), None
  >>> float(jax.lax.scan(body, 0.0, (jnp.arange(3), view.xs))[0])
  15.0
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Callable, Iterator, Mapping
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

__all__ = [
    "LayerView",
    "layer_view",
    "rows",
    "dot_general",
]

BLOCKS = 8
"""How many blocks of rows :func:`dot_general` multiplies a served kernel in (at most; one more
holds the rows that do not divide evenly): a perturbed copy of one block, an eighth of the leaf,
is what the product holds at a time."""


class Provider(NamedTuple):
    """What an estimator installs with :func:`provide`.

    ``layer(leaf) -> f | None``: for a stacked leaf ``[L, ...]`` it recognises, ``f(i)`` returns
    ``leaf[i]`` (``i`` an int32 scalar, traced inside a scan), bit for bit; None otherwise.
    ``rows(leaf, ids) -> array | None``: ``leaf[ids]`` for a leaf it recognises (ids already in
    ``[0, leaf.shape[0])``), bit for bit; None otherwise.
    ``blocks(leaf) -> f | None``: for a 2-D leaf it serves in blocks of rows, ``f(start, n)``
    returns ``leaf[start : start + n]`` (``start`` an int32 scalar, traced inside a loop; ``n``
    static), bit for bit; None otherwise (the provider decides which leaves are worth it).
    """

    layer: Callable[[Any], Callable[[jax.Array], jax.Array] | None]
    rows: Callable[[Any, jax.Array], jax.Array | None]
    blocks: Callable[[Any], Callable[[jax.Array, int], jax.Array] | None] | None = None


class LayerView(NamedTuple):
    """Stacked layers as a model scans them (:func:`layer_view`)."""

    xs: dict  # the stacked leaves to pass to lax.scan as xs (those no provider serves)
    layer: Callable[[jax.Array, dict], dict]  # (i int32[], xs sliced at i) -> every weight of layer i


_PROVIDERS: contextvars.ContextVar[tuple[Provider, ...]] = contextvars.ContextVar("zeroth_layerwise", default=())


@contextlib.contextmanager
def provide(provider: Provider) -> Iterator[None]:
    """Install ``provider`` while the body runs (trace ``loss_fn`` inside it); nests, innermost first."""
    token = _PROVIDERS.set((provider, *_PROVIDERS.get()))
    try:
        yield
    finally:
        _PROVIDERS.reset(token)


def active() -> bool:
    """Whether some provider is installed."""
    return bool(_PROVIDERS.get())


def _served_layer(leaf) -> Callable[[jax.Array], jax.Array] | None:
    for p in _PROVIDERS.get():
        f = p.layer(leaf)
        if f is not None:
            return f
    return None


def _served_blocks(leaf) -> Callable[[jax.Array, int], jax.Array] | None:
    for p in _PROVIDERS.get():
        f = None if p.blocks is None else p.blocks(leaf)
        if f is not None:
            return f
    return None


def layer_view(stacked: Mapping[str, Any]) -> LayerView:
    """The per-layer view of stacked leaves ``{name: [L, ...]}`` (call it outside the scan).

    The model scans over ``(jnp.arange(L), view.xs)`` and calls ``view.layer(i, xs_i)`` in the
    body, which returns ``{name: stacked[name][i]}`` for every name: the leaves a provider serves
    are computed there from ``i`` (and are not in ``xs``), the others are the scan's slices.
    """
    served = {name: f for name, f in ((n, _served_layer(v)) for n, v in stacked.items()) if f is not None}
    xs = {name: v for name, v in stacked.items() if name not in served}

    def layer(i: jax.Array, xs_i: dict) -> dict:
        out = dict(xs_i)
        for name, f in served.items():
            out[name] = f(i)
        return {name: out[name] for name in stacked}

    return LayerView(xs, layer)


def rows(table, ids) -> jax.Array:
    """``table[ids]`` (rows of a ``[V, ...]`` leaf), served by a provider where one recognises ``table``.

    Indices follow ``jnp`` indexing: negative ids count from the end, out-of-range ids are clamped.
    """
    ids = jnp.asarray(ids)
    providers = _PROVIDERS.get()
    if providers:
        n = jnp.shape(table)[0]
        safe = jnp.clip(jnp.where(ids < 0, ids + n, ids), 0, n - 1)  # what table[ids] reads
        for p in providers:
            out = p.rows(table, safe)
            if out is not None:
                return out
    return jnp.asarray(table)[ids]


def dot_general(lhs, rhs, dimension_numbers, precision=None, preferred_element_type=None) -> jax.Array:
    """``lax.dot_general``, where a provider may serve the kernel of a dense layer in blocks of rows.

    For flax: ``nn.Dense(features, dot_general=layerwise.dot_general)``. A product that contracts
    ``lhs``'s last axis with the first axis of a 2-D ``rhs`` that a provider serves in blocks
    (:class:`Provider` ``blocks``) is computed as the sum over :data:`BLOCKS` blocks of rows,
    ``Σ_b lhs[..., rows_b] @ rhs[rows_b]``, in a loop whose body asks the provider for block
    ``b`` just before its product: the provider's whole ``rhs`` is then unused and never built.
    It does so where that saves memory: where ``rhs`` is larger than ``lhs`` (which the loop
    reads as one buffer) by more than ``BLOCKS / (BLOCKS - 1)``; a dense head whose input is the
    larger (a CNN's, at a large batch) keeps the plain product.
    The sum is accumulated in float32 (at least) and has the dtype the plain product would. Any
    other product, or one with no provider serving ``rhs``, is ``lax.dot_general`` itself.
    """
    plain = lambda: jax.lax.dot_general(
        lhs,
        rhs,
        dimension_numbers,
        precision=precision,  # noqa: E731
        preferred_element_type=preferred_element_type,
    )
    providers = _PROVIDERS.get()
    if not providers or jnp.ndim(rhs) != 2 or jnp.ndim(lhs) < 1:
        return plain()
    if tuple(map(tuple, dimension_numbers[0])) != ((jnp.ndim(lhs) - 1,), (0,)) or any(dimension_numbers[1]):
        return plain()
    # The loop reads lhs as one buffer; the blocks save 1 - 1/BLOCKS of the kernel's perturbed copy.
    if _nbytes(rhs) * (BLOCKS - 1) <= _nbytes(lhs) * BLOCKS:
        return plain()
    serve = _served_blocks(rhs)
    if serve is None:
        return plain()
    out_dtype = jax.eval_shape(plain).dtype
    acc_dtype = jnp.promote_types(out_dtype, jnp.float32)
    n = jnp.shape(rhs)[0]
    per = -(-n // BLOCKS)
    whole, rest = divmod(n, per)
    dims = (((jnp.ndim(lhs) - 1,), (0,)), ((), ()))

    def product(start, count):
        x = jax.lax.dynamic_slice_in_dim(lhs, start, count, axis=jnp.ndim(lhs) - 1)
        return jax.lax.dot_general(
            x, serve(start, count), dims, precision=precision, preferred_element_type=acc_dtype
        ).astype(acc_dtype)

    acc = jax.lax.fori_loop(1, whole, lambda b, a: a + product(b * per, per), product(jnp.int32(0), per))
    if rest:
        acc = acc + product(jnp.int32(whole * per), rest)
    return acc.astype(out_dtype)


def _nbytes(x) -> int:
    return int(jnp.size(x)) * jnp.dtype(jnp.result_type(x)).itemsize
