"""One node's stage of a cluster: forward without waiting, each gradient applied on arrival (Algorithm 1).

:class:`AsyncStage` holds stage ``s`` of a cluster's ``S`` stages: its parameters, its optimizer
state and, per batch in flight, the parameters and input its forward pass used (weight stashing).
The backward pass of batch ``b`` is the VJP at those stashed parameters (the gradient of eq. 2 is
evaluated at the state of the forward pass), and the update is applied at once to the current
parameters. It knows nothing of the transport: :mod:`zeroth.cluster.driver` feeds it.

The parameters of a stage are also seen as a slice of the model's one flat float32 vector
(:func:`model_units`, :func:`flat_of`, :func:`with_flat`): the order is the model's, unit by
unit (embeddings, block 0, …, block L−1, final norm and head), leaves sorted by name within a unit,
so the stages of clusters cut at different places lay out the same indices the same way. The
multi-ring averaging (:mod:`zeroth.cluster.rings`) works on these slices.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from zeroth.stages import steps as _steps
from zeroth.stages import timing as _timing

__all__ = ["AsyncStage", "flat_digest", "flat_of", "model_units", "unit_bytes", "unit_ranges_to_blocks", "with_flat"]


def model_units(n_blocks: int) -> list[tuple[str, ...]]:
    """The transformer's parameter groups in model order: embeddings, one per block, final norm and head."""
    return [("Embed_0", "pos_embedding")] + [(f"_Block_{i}",) for i in range(n_blocks)] + [("LayerNorm_0", "Dense_0")]


def unit_bytes(params: dict, units: Sequence[tuple[str, ...]]) -> list[int]:
    """Bytes of each unit's parameters (``params``: the whole model's top-level dict)."""
    return [sum(int(np.asarray(x).nbytes) for k in u for x in jax.tree_util.tree_leaves(params[k])) for u in units]


def unit_ranges_to_blocks(unit_ranges: Sequence[tuple[int, int]], n_blocks: int) -> list[tuple[int, int]]:
    """Stages given as unit ranges ``[a, b)`` over :func:`model_units` -> their block ranges.

    Unit ``i`` (``1 ≤ i ≤ L``) is block ``i − 1``; unit 0 (embeddings) belongs to the first stage and
    unit ``L + 1`` (head) to the last, whatever their block ranges.
    """
    return [(max(a, 1) - 1, min(b, n_blocks + 1) - 1) for a, b in unit_ranges]


def _stage_units(params: dict, units: Sequence[tuple[str, ...]]) -> list[str]:
    return [k for u in units for k in u if k in params]


def flat_of(params: dict, units: Sequence[tuple[str, ...]]) -> np.ndarray:
    """This stage's parameters as one float32 vector, in model order (units in order, leaves sorted within)."""
    parts = [
        np.asarray(x, np.float32).ravel()
        for k in _stage_units(params, units)
        for x in jax.tree_util.tree_leaves(params[k])
    ]
    return np.concatenate(parts) if parts else np.zeros(0, np.float32)


def with_flat(params: dict, units: Sequence[tuple[str, ...]], flat: np.ndarray) -> dict:
    """``params`` with its leaves replaced by the values of ``flat`` (inverse of :func:`flat_of`)."""
    out, at = dict(params), 0
    for k in _stage_units(params, units):
        leaves, tree = jax.tree_util.tree_flatten(params[k])
        new = []
        for x in leaves:
            n = int(np.prod(x.shape))
            new.append(jnp.asarray(flat[at : at + n].reshape(x.shape), x.dtype))
            at += n
        out[k] = jax.tree_util.tree_unflatten(tree, new)
    if at != flat.size:
        raise ValueError(f"flat vector has {flat.size} values, the stage's parameters {at}")
    return out


def flat_digest(flat: np.ndarray) -> str:
    """SHA-256 (first 16 hex digits) of a float32 vector's little-endian bytes."""
    return hashlib.sha256(np.ascontiguousarray(flat, "<f4").tobytes()).hexdigest()[:16]


class AsyncStage:
    """Stage ``index`` of ``n_stages`` in one cluster: parameters, optimizer, stashed forward states.

    Args:
      index, n_stages: this stage and the cluster's pipeline length.
      fn: the stage function (:mod:`zeroth.stages.partition`).
      params: this stage's parameters (float32).
      optimizer: an ``optax.GradientTransformation``.
      slowdown: emulated compute speed (:class:`zeroth.stages.timing.SlowClock`; ``1`` = this machine).
    """

    def __init__(self, index: int, n_stages: int, fn, params, optimizer, *, slowdown: float = 1.0):
        self.index, self.n_stages = index, n_stages
        self.first, self.last = index == 0, index == n_stages - 1
        self.params = jax.tree_util.tree_map(jnp.asarray, params)
        self.optimizer, self.slowdown = optimizer, _timing.check_slowdown(slowdown)
        self._clock = _timing.SlowClock(self.slowdown)
        with jax.numpy_dtype_promotion("standard"):
            self.opt_state = optimizer.init(self.params)
        self.stash: dict[int, tuple[Any, Any, int]] = {}  # batch -> (params, input, version) of its forward
        self.version = 0  # updates applied
        self.compute_s = 0.0
        self.staleness: list[int] = []  # per backward: updates between its forward and its update
        self._compile(fn)

    def _compile(self, fn) -> None:
        fns = _steps.compile_stage(fn, self.first, self.last, None)
        self._fwd, self._bwd, self._loss_grad = fns.fwd, fns.bwd, fns.loss_grad
        self._update = _steps.compile_update(self.optimizer)

    def _run(self, f, *args):
        out, dt = self._clock.run(f, *args)
        self.compute_s += dt
        return out

    def _apply(self, grads) -> None:
        with jax.numpy_dtype_promotion("standard"):
            self.params, self.opt_state = self._run(self._update, self.params, self.opt_state, grads)
        self.version += 1

    def forward(self, batch: int, tokens, labels, x=None):
        """Forward of ``batch``: returns the activation for the next stage, or on the last stage ``(loss, input gradient)``.

        The last stage computes its loss and gradients at once, applies its update and returns the
        gradient of its input (None when the cluster has one stage).
        """
        tokens = jnp.asarray(tokens)
        if self.last:
            labels = jnp.asarray(labels)
            if self.first:
                loss, gp = self._run(self._loss_grad, self.params, tokens, labels)
                gx = None
            else:
                loss, (gp, gx) = self._run(self._loss_grad, self.params, jnp.asarray(x), tokens, labels)
            self.staleness.append(0)
            self._apply(gp)
            return float(loss), (None if gx is None else np.asarray(gx))
        if self.first:
            h = self._run(self._fwd, self.params, tokens)
            self.stash[batch] = (self.params, None, self.version)
        else:
            x = jnp.asarray(x)
            h = self._run(self._fwd, self.params, x, tokens)
            self.stash[batch] = (self.params, x, self.version)
        return np.asarray(h)

    def backward(self, batch: int, tokens, g):
        """Backward of ``batch`` with the gradient of its output: update at once; returns the input gradient (None on stage 0)."""
        if batch not in self.stash:
            raise KeyError(
                f"stage {self.index}: gradient for batch {batch}, which is not in flight (in flight: {sorted(self.stash)})"
            )
        params, x, born = self.stash.pop(batch)
        tokens, g = jnp.asarray(tokens), jnp.asarray(g)
        self.staleness.append(self.version - born)
        if self.first:
            gp = self._run(self._bwd, params, tokens, g)
            self._apply(gp)
            return None
        gp, gx = self._run(self._bwd, params, x, tokens, g)
        self._apply(gp)
        return np.asarray(gx)

    def snapshot(self, units) -> dict[str, np.ndarray]:
        """Everything a backup needs to continue as this stage: parameters, optimizer state, update
        count, and per batch in flight its stashed parameters and input (flat float32 arrays)."""
        out = {
            "params": flat_of(self.params, units),
            "version": np.int64(self.version),
            "staleness": np.asarray(self.staleness, np.int64),
            "stash": np.asarray(sorted(self.stash), np.int64),
        }
        for i, leaf in enumerate(jax.tree_util.tree_leaves(self.opt_state)):
            out[f"opt_{i}"] = np.asarray(leaf)
        for b, (p, x, born) in self.stash.items():
            out[f"stash_params_{b}"] = flat_of(p, units)
            out[f"born_{b}"] = np.int64(born)
            if x is not None:
                out[f"stash_x_{b}"] = np.asarray(x)
        return out

    def restore(self, snap: dict[str, np.ndarray], units) -> None:
        """Become the stage :meth:`snapshot` described (same stage of the same model)."""
        self.params = with_flat(self.params, units, snap["params"])
        leaves, tree = jax.tree_util.tree_flatten(self.opt_state)
        if any(f"opt_{i}" not in snap for i in range(len(leaves))):
            raise ValueError("the snapshot's optimizer state does not match this stage's optimizer")
        self.opt_state = jax.tree_util.tree_unflatten(
            tree, [jnp.asarray(snap[f"opt_{i}"], leaf.dtype) for i, leaf in enumerate(leaves)]
        )
        self.version = int(snap["version"])
        self.staleness = [int(v) for v in snap["staleness"]]
        self.stash = {}
        for b in (int(v) for v in snap["stash"]):
            x = snap.get(f"stash_x_{b}")
            self.stash[b] = (
                with_flat(self.params, units, snap[f"stash_params_{b}"]),
                None if x is None else jnp.asarray(x),
                int(snap[f"born_{b}"]),
            )

    def in_flight(self) -> int:
        """Batches forwarded whose gradient has not come back."""
        return len(self.stash)
