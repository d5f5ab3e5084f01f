"""Per-layer views of parameters, and the trace-time hook through which an estimator serves them.

A model reads the parts of a leaf it needs through two functions instead of indexing the leaf:

* :func:`layer_view` for layers stacked on a leading axis (``[L, ...]`` leaves run by
  ``lax.scan``): called outside the scan, it returns a :class:`LayerView` whose ``xs`` the
  model scans over and whose ``layer(i, xs_i)`` gives layer ``i``'s weights inside the body;
* :func:`rows` for a gather of rows (``table[ids]``, an embedding lookup).

With nothing installed they are exactly ``xs = stacked``, ``layer(i, xs_i) = xs_i`` and
``rows(table, ids) = table[ids]``. An estimator that passes the model computed leaves (a ZO step's
``θ ± εz``, :func:`zeroth.zo.projected_gradients_and_losses`) may install a :class:`Provider`
while it traces ``loss_fn(params, batch)`` (:func:`provide`); for a leaf it recognises (by
identity: the very array it passed in) the provider computes the slice or the rows *on demand*
from what the leaf was made of. The contract of a provider is that its answer is bit-identical
to slicing or gathering the leaf itself, so a model that uses these functions computes the same
values with or without one, and a model that does not use them is unaffected. What changes is
the program: a leaf whose every use goes through the provider is never built whole (XLA drops
it as dead code), so a ZO step over a stacked model builds one perturbed layer at a time inside
the scan body, just before it runs, instead of a whole perturbed copy of the layers before the
scan; and an embedding lookup perturbs only the rows it reads.

The hook is a trace-time context (like ``flax.linen.intercept_methods``): it is consulted while
``loss_fn`` is traced, so ``loss_fn(params, batch)`` keeps its signature for every model. A
``jax.jit`` inside ``loss_fn`` gets fresh tracers for its arguments, which no provider
recognises: it falls back to the plain behaviour (correct, just without the saving).

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

__all__ = ["Provider", "LayerView", "provide", "active", "layer_view", "rows"]


class Provider(NamedTuple):
    """What an estimator installs with :func:`provide`.

    ``layer(leaf) -> f | None``: for a stacked leaf ``[L, ...]`` it recognises, ``f(i)`` returns
    ``leaf[i]`` (``i`` an int32 scalar, traced inside a scan), bit for bit; None otherwise.
    ``rows(leaf, ids) -> array | None``: ``leaf[ids]`` for a leaf it recognises (ids already in
    ``[0, leaf.shape[0])``), bit for bit; None otherwise.
    """

    layer: Callable[[Any], Callable[[jax.Array], jax.Array] | None]
    rows: Callable[[Any, jax.Array], jax.Array | None]


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
