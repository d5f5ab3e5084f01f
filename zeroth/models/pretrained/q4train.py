"""The fixed 4-bit grids of SmolLM2's weights, and the projection onto them (4-bit forward-only training).

The trained state is the GGUF file's quantized weights: every Q4_1 matrix (the 210 linear
layers of SmolLM2) and the Q8_0 embedding keep their per-block grid ``(d, m)`` from the file,
and after every update each weight is put back on its grid. One MeZO step:

1. *dequantize*: the forward passes run on float32 weights ``W = q·d + m`` (exact, see
   :mod:`.quant`);
2. *perturb*: ``L(W ± εz)`` with zeroth's exact noise, in float32 (the perturbation is not
   quantized, as in the seed: noise is added to the dequantized weights);
3. update ``W' = replay(W, [(k_i, c_i)])`` exactly as the float method does, then
4. *requantize* onto the fixed grid: ``q' = clip(round((W' − m)/d))`` (``rounding="nearest"``)
   or ``clip(floor(t) + [u < t − floor(t)])``, ``t = (W' − m)/d``, ``u ~ U[0, 1)`` (``"stochastic"``, unbiased:
   ``E[q'·d + m] = W'`` inside the range), and ``W ← q'·d + m``.

Float tensors of the file (the RMSNorm weights) are trained in float32 as usual. The state is
held as float32 values that lie exactly on the grids, so it packs losslessly back into the
file's own bytes (:func:`zeroth.models.pretrained.quant.pack_q4_1`); holding it as packed bytes
(1/8 of the memory) is a storage choice that does not change a single update.

What it does to training: a MeZO update moves a weight by ``|Δ| = |c·z|``, usually a small
fraction of its grid step ``d``. With *nearest* rounding such a move rounds back to the same code,
so the quantized weights need not change at all (measured with
``experiments/smollm2_mezo_q4_sentiment.yaml``: the docs' measurement pages). *Stochastic*
rounding keeps each update unbiased by moving a weight a whole step with probability ``|Δ|/d``,
at the price of rounding noise (variance ``d·|Δ|`` per weight). :func:`changed_fraction` reports how many codes change per step.

Stochastic rounding draws ``u`` from threefry bits of the key
``fold_in(fold_in(fold_in(root_key(seed), REQUANT_TAG), step), leaf_id)`` (integer bits,
``u = (bits >> 8)·2⁻²⁴``), so every peer draws the same ``u``; ``(W' − m)/d`` is an IEEE
division, deterministic on IEEE backends but not part of zeroth's proven replay contract.

The training method built on them is :mod:`zeroth.methods.q4` (``train.requantize``).

Example:
  >>> grids = smollm2_grids()                                              # doctest: +SKIP
  >>> project = make_projection(grids, "nearest")                          # doctest: +SKIP
  >>> params = project(params, run_seed=0, step=0)  # dict params: keys "['attn_q']", ...  # doctest: +SKIP
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from zeroth import reference as _ref
from zeroth import rng as _rng
from zeroth.models.pretrained import gguf_file as _gguf
from zeroth.models.pretrained import llama as _llama
from zeroth.models.pretrained import quant as _quant

__all__ = [
    "largest_move",
    "ROUNDINGS",
    "REQUANT_TAG",
    "smollm2_grids",
    "requant_key",
    "make_projection",
    "changed_fraction",
    "check_rounding",
]

ROUNDINGS = ("nearest", "stochastic")
REQUANT_TAG = 0x71347471  # "q4tq": names the stochastic-rounding stream of the run


def check_rounding(rounding: str) -> str:
    """``rounding`` if it is one of :data:`ROUNDINGS`, else a ``ValueError`` naming the valid ones."""
    if rounding not in ROUNDINGS:
        raise ValueError(f"unknown rounding {rounding!r}; expected one of {list(ROUNDINGS)}")
    return rounding


@functools.lru_cache(maxsize=1)
def _grids_cached(path: str) -> dict[str, _quant.Grid]:
    f = _gguf.read_gguf(path)
    cfg = _llama.config_from_gguf(f.metadata)
    out: dict[str, _quant.Grid] = {}
    for name, pattern in _llama.GGUF_NAMES.items():
        layers = [pattern] if "{i}" not in pattern else [pattern.format(i=i) for i in range(cfg.n_layers)]
        tensors = [f.tensors[n] for n in layers]
        if tensors[0].ggml_type not in _gguf.QUANT_FORMATS:
            continue
        grids = []
        for t in tensors:
            g = _gguf.grid(t)
            d, m = g.d, g.m
            if name == "attn_q":
                d, m = _llama.unpermute_qk(d, cfg.n_heads), _llama.unpermute_qk(m, cfg.n_heads)
            elif name == "attn_k":
                d, m = _llama.unpermute_qk(d, cfg.n_kv_heads), _llama.unpermute_qk(m, cfg.n_kv_heads)
            grids.append(_quant.Grid(d, m, g.qmin, g.qmax))
        if "{i}" in pattern:
            d = np.stack([g.d for g in grids])
            m = np.stack([g.m for g in grids])
        else:
            d, m = grids[0].d, grids[0].m
        out[name] = _quant.Grid(np.ascontiguousarray(d), np.ascontiguousarray(m), grids[0].qmin, grids[0].qmax)
    return out


def smollm2_grids(package: str | None = None, *, scan_layers: bool = True) -> dict[str, _quant.Grid]:
    """The grid of every quantized SmolLM2 parameter, keyed by leaf path (``"['attn_q']"``).

    In the :mod:`.llama` layout (Q/K rows un-permuted like the weights): the nine linear weights
    (Q4_1, ``d, m: f32[L, out, in/32]``) and ``embed`` (Q8_0, ``f32[V, d/32]``); the norm
    weights (F32 in the file) have no grid. ``scan_layers=False``: the per-layer layout
    (``"['layers_07']['attn_q']"``, ``d, m: f32[out, in/32]``).
    """
    path = _gguf.smollm2_path() if package is None else _gguf.smollm2_path(package)
    grids = _grids_cached(str(path))
    if scan_layers:
        return {_leaf_key(name): g for name, g in grids.items()}
    out = {}
    for name, g in grids.items():
        if name not in _llama.LAYER_PARAMS:
            out[_leaf_key(name)] = g
            continue
        for i in range(g.d.shape[0]):
            out[_leaf_key(_llama.layer_key(i), name)] = _quant.Grid(g.d[i], g.m[i], g.qmin, g.qmax)
    return out


def _leaf_key(*names: str) -> str:
    return jax.tree_util.keystr(tuple(jax.tree_util.DictKey(n) for n in names))


def requant_key(run_seed: int, step: int) -> np.ndarray:
    """``u32[2]`` key of step ``step``'s stochastic rounding: ``fold_in(fold_in(root_key(seed), REQUANT_TAG), step)``."""
    return _ref.fold_in(_ref.fold_in(_ref.root_key(run_seed), REQUANT_TAG), step)


def _uniform(key: jax.Array, n: int) -> jax.Array:
    calls = (n + 1) // 2
    x0, x1 = _rng.threefry2x32((key[0], key[1]), (jnp.zeros(calls, jnp.uint32), jnp.arange(calls, dtype=jnp.uint32)))
    bits = jnp.stack([x0, x1], axis=-1).reshape(-1)[:n]
    return (bits >> jnp.uint32(8)).astype(jnp.float32) * jnp.float32(2.0**-24)


def make_projection(grids: dict[str, _quant.Grid], rounding: str = "nearest"):
    """``project(params, run_seed, step) -> params`` putting every gridded leaf back on its grid.

    Args:
      grids: ``{leaf path (jax.tree_util.keystr): Grid}``; the grid of a leaf ``f32[..., n]`` has
        ``d, m: f32[..., n/32]`` (blocks of 32 along the last axis).
      rounding: ``"nearest"`` or ``"stochastic"`` (uniforms from :func:`requant_key` folded with
        the leaf id of the path).

    Leaves without a grid pass through unchanged; the function is jitted once per structure.
    """
    check_rounding(rounding)
    # the grids' scales and minima are arguments of the program, not constants folded into it
    # (folding them made the first projection compile several times as long)
    dev = {k: (jnp.asarray(g.d), jnp.asarray(g.m)) for k, g in grids.items()}
    bounds = {k: (g.qmin, g.qmax) for k, g in grids.items()}

    @jax.jit
    def _project(params, key, scales):
        def leaf(path, x):
            p = _rng.leaf_path(path)
            if p not in scales:
                return x
            (d, m), (qmin, qmax) = scales[p], bounds[p]
            x32 = x.astype(jnp.float32)
            u = None
            if rounding == "stochastic":
                lk = _rng.fold_in(key, np.uint32(_rng.leaf_id(path)))
                u = _uniform(lk, int(np.prod(x.shape))).reshape(x.shape)
            return _quant.project_to_grid(x32, d, m, qmin, qmax, uniform=u).astype(x.dtype)

        return jax.tree_util.tree_map_with_path(leaf, params)

    def project(params, run_seed: int = 0, step: int = 0):
        paths = {_rng.leaf_path(p) for p, _ in jax.tree_util.tree_flatten_with_path(params)[0]}
        missing = sorted(set(dev) - paths)
        if missing:
            raise ValueError(f"grids for {missing} match no parameter; parameters are {sorted(paths)}")
        return _project(params, jnp.asarray(requant_key(run_seed, step)), dev)

    return project


def largest_move(before, after, grids: dict[str, _quant.Grid]) -> float:
    """The largest ``|after - before|`` of a gridded weight, in units of that weight's grid step ``d``.

    Nearest rounding puts a weight that lies on its grid back on the same code unless it moved
    by half a step or more; below 0.5 no code can change.
    """
    a = {_rng.leaf_path(p): x for p, x in jax.tree_util.tree_flatten_with_path(before)[0]}
    b = {_rng.leaf_path(p): x for p, x in jax.tree_util.tree_flatten_with_path(after)[0]}
    out = 0.0
    for k, g in grids.items():
        d = jnp.asarray(g.d)
        delta = jnp.abs(b[k].astype(jnp.float32) - a[k].astype(jnp.float32))
        blocks = delta.reshape(delta.shape[:-1] + (d.shape[-1], -1))
        safe = jnp.where(d > 0, d, jnp.float32(jnp.inf))[..., None]
        out = max(out, float(jnp.max(blocks / safe)))
    return out


@jax.jit
def _changed(a, b):
    n = sum(x.size for x in jax.tree_util.tree_leaves(a))
    diff = sum(
        jnp.sum((x != y).astype(jnp.float32))
        for x, y in zip(jax.tree_util.tree_leaves(a), jax.tree_util.tree_leaves(b))
    )
    return diff / jnp.float32(n)


def changed_fraction(before, after, paths=None) -> float:
    """Fraction of the weights (of the leaves at ``paths``, default all) that differ between two pytrees."""
    a = {_rng.leaf_path(p): x for p, x in jax.tree_util.tree_flatten_with_path(before)[0]}
    b = {_rng.leaf_path(p): x for p, x in jax.tree_util.tree_flatten_with_path(after)[0]}
    keys = sorted(a) if paths is None else sorted(paths)
    return float(_changed([a[k] for k in keys], [b[k] for k in keys]))
