"""Train one binary/ternary conv layer with its auxiliary head: bit flips, evolutionary search, or STE.

Every method sees the same batches (a pure function of ``(seed, layer_index, step)``) and trains
the same float auxiliary head with Adam on the softmax cross-entropy of the layer's current
±1 activations (or keeps it fixed, ``head="votes"``). They differ in how the weights move:

* ``flips`` (seed 002): the exact loss change of every single mutation from one forward pass
  (:func:`zeroth.binary.flips.mutation_deltas`); apply the ``k`` that lower the loss most (at
  least ``min_gain`` each, one per weight). With ``thresh_k > 0`` (not in the seed, whose
  thresholds stay at their initial per-channel medians) the same forward pass also gives the exact
  loss change of moving each channel's threshold by one step (:func:`zeroth.binary.flips.threshold_deltas`),
  and the ``thresh_k`` channels whose move lowers the loss most move too.
* ``evolution``: mutate ``k`` random weights; keep the mutations if the batch loss fell,
  else revert ("flip, keep if the loss fell").
* ``ste``: a straight-through-estimator BNN: float shadow weights (starting at ``STE_INIT`` times
  the initial weights) trained with optax Adam through ``sign`` (binary) or
  ``sign * [|w| > STE_ZERO]`` (ternary) and a sign activation whose gradient is
  that of ``hardtanh((dot - t) / sqrt(n))``; the result is quantized and evaluated packed.
* ``head``: the control: the random initial weights never move, only the head trains.

Evaluation always runs the packed XOR-popcount layer.

Example:
  >>> cfg = TrainConfig(method="flips", steps=2, batch_size=4, k=2)
  >>> cfg.method
  'flips'
"""

from __future__ import annotations

import functools
import json
import os
import time
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax

from zeroth.binary import flips as F
from zeroth.binary import layers as L

__all__ = [
    "METHODS",
    "HEADS",
    "ADAM",
    "TrainConfig",
    "LayerResult",
    "LayerState",
    "LayerInterrupted",
    "init_state",
    "features",
    "fit_head",
    "step_cost",
    "step_functions",
    "train_layer",
    "save_state",
    "load_state",
    "predict",
    "accuracy",
    "evaluate",
    "layer_outputs",
]

METHODS = ("flips", "evolution", "ste", "head")
STE_INIT = 0.1  # STE shadow weights start at STE_INIT * (the initial {-1, 0, +1} weights)
STE_ZERO = 0.05  # ternary STE: |shadow| <= STE_ZERO quantizes to 0
HEADS = ("linear", "votes")


class TrainConfig(NamedTuple):
    """How one layer is trained (see the module docstring)."""

    method: str = "flips"
    steps: int = 100
    batch_size: int = 64
    k: int = 8  # flips applied per step (flips) / mutations tried per step (evolution)
    min_gain: float = 0.0  # flips: a mutation must lower the summed batch loss by more than this
    head_lr: float = 1e-2  # Adam learning rate of the auxiliary head
    ste_lr: float = 1e-2  # Adam learning rate of the STE shadow weights
    grid: int = 4  # the head averages activations over grid x grid regions
    head: str = "linear"  # linear (trained) or votes (fixed)
    votes_scale: float = 8.0  # logit scale of the votes head
    seed: int = 0
    accept_batch: int = 0  # flips: > 0 applies a step's flips only if they lower the loss on this many other examples
    refit_every: int = (
        0  # flips: > 0 refits the head to convergence (fit_head) every this many steps, on refit_size examples
    )
    refit_size: int = 1024
    thresh_k: int = 0  # flips: > 0 also moves this many channel thresholds per step (the best exact loss changes)

    def check(self) -> "TrainConfig":
        if self.method not in METHODS:
            raise ValueError(f"binary method {self.method!r} unknown; expected one of {list(METHODS)}")
        if self.head not in HEADS:
            raise ValueError(f"binary head {self.head!r} unknown; expected one of {list(HEADS)}")
        for name in ("steps", "batch_size", "k", "grid"):
            if getattr(self, name) < 1:
                raise ValueError(f"binary {name} must be >= 1, got {getattr(self, name)}")
        if self.refit_every < 0 or (self.refit_every and self.method != "flips") or self.refit_size < 1:
            raise ValueError(
                f"binary refit_every must be 0, or > 0 with method 'flips' and refit_size >= 1 (got "
                f"{self.refit_every}, {self.refit_size} with {self.method!r})"
            )
        if self.thresh_k < 0 or (self.thresh_k and self.method != "flips"):
            raise ValueError(
                f"binary thresh_k must be 0, or > 0 with method 'flips' (got {self.thresh_k} with {self.method!r})"
            )
        if self.accept_batch < 0 or (self.accept_batch and self.method != "flips"):
            raise ValueError(
                f"binary accept_batch must be 0, or > 0 with method 'flips' (got {self.accept_batch} "
                f"with {self.method!r})"
            )
        return self


class LayerResult(NamedTuple):
    layer: L.ConvLayer
    head: L.Head
    history: list  # dicts per step: step, loss, flips (weights changed), seconds
    seconds: float


def _batch(n: int, cfg: TrainConfig, layer_index: int, step: int, tag: int = 2) -> np.ndarray:
    rng = np.random.default_rng([cfg.seed, layer_index, tag, step])
    return rng.choice(n, size=min(cfg.batch_size, n), replace=False)


def _acts(layer: L.ConvLayer, x, spec: L.ConvSpec) -> jax.Array:
    d = L.dots(layer, x, spec)
    b = d.shape[0]
    return jnp.where(d >= layer.thresh[None, None, None, :], 1.0, -1.0).reshape(b, -1, spec.c_out)


def _head_loss(head: L.Head, act, labels, reg) -> jax.Array:
    return jnp.mean(F.cross_entropy(L.head_logits(head, act, reg), labels))


class _Fns(NamedTuple):
    head_step: object
    deltas: object
    loss: object
    ste_step: object
    thresh_deltas: object


ADAM = optax.scale_by_adam()  # the learning rate is an argument: one compilation serves every rate


@functools.lru_cache(maxsize=32)
def step_functions(spec: L.ConvSpec, h: int, w: int, grid: int) -> _Fns:
    """Jitted step functions, built once per (layer shape, head grid)."""
    reg = L.regions(h, w, grid)

    @jax.jit
    def head_step(layer, head, opt_state, x, y, lr):
        act = _acts(layer, x, spec)
        loss, g = jax.value_and_grad(_head_loss)(head, act, y, reg)
        with jax.numpy_dtype_promotion("standard"):  # optax mixes Python floats and int32 counts
            upd, opt_state = ADAM.update(g, opt_state, head)
        return jax.tree.map(lambda p, u: p - lr * u, head, upd), opt_state, loss

    deltas = jax.jit(lambda layer, head, x, y: F.mutation_deltas(layer, head, x, y, spec, reg))
    loss = jax.jit(lambda layer, head, x, y: F.batch_loss(layer, head, x, y, spec, reg))

    def quant(w):
        if spec.ternary:
            return jnp.where(jnp.abs(w) > STE_ZERO, jnp.sign(w), 0.0)
        return jnp.where(w < 0, -1.0, 1.0)

    def ste_loss(params, thresh, xcol, y):
        w, head = params
        wq = w + jax.lax.stop_gradient(quant(w) - w)
        dot = jnp.einsum("bpj,oj->bpo", xcol, wq)
        z = (dot - thresh[None, None, :].astype(jnp.float32) + 0.5) / jnp.sqrt(jnp.float32(9 * spec.c_in))
        soft = jnp.clip(z, -1.0, 1.0)
        act = soft + jax.lax.stop_gradient(jnp.where(z >= 0, 1.0, -1.0) - soft)
        return _head_loss(head, act, y, reg)

    @jax.jit
    def ste_step(params, opt_state, thresh, x, y, lrs):
        xcol = L.im2col_pm1(x, spec.c_in)
        loss, g = jax.value_and_grad(ste_loss)(params, thresh, xcol, y)
        with jax.numpy_dtype_promotion("standard"):
            upd, opt_state = ADAM.update(g, opt_state, params)
        w, head = params[0] - lrs[0] * upd[0], jax.tree.map(lambda p, u: p - lrs[1] * u, params[1], upd[1])
        return (jnp.clip(w, -1.0, 1.0), head), opt_state, loss

    thresh_deltas = jax.jit(lambda layer, head, x, y: F.threshold_deltas(layer, head, x, y, spec, reg))
    return _Fns(head_step, deltas, loss, ste_step, thresh_deltas)


def _quantize_np(w: np.ndarray, ternary: bool) -> np.ndarray:
    if ternary:
        return np.where(np.abs(w) > STE_ZERO, np.sign(w), 0).astype(np.int8)
    return np.where(w < 0, -1, 1).astype(np.int8)


def _random_mutations(rng: np.random.Generator, w: np.ndarray, k: int, ternary: bool) -> np.ndarray:
    widx = rng.choice(w.size, size=min(k, w.size), replace=False)
    cur = w.reshape(-1)[widx].astype(np.int64)
    if ternary:
        d = np.where(cur == 1, 0, np.where(cur == -1, 1, rng.integers(0, 2, widx.size)))
    else:
        d = (cur < 0).astype(np.int64)
    return np.sort(2 * widx + d)


class LayerState(NamedTuple):
    """Everything :func:`train_layer` carries from one step to the next (saved to resume a layer)."""

    step: int  # steps done
    layer: L.ConvLayer
    head: L.Head
    head_state: Any  # Adam state of the head (flips, evolution, head)
    shadow: Any  # (f32[O, 9C] shadow weights, head): the STE's float parameters
    ste_state: Any  # Adam state of the shadow parameters
    rng: dict  # the state of the evolution's mutation generator (numpy PCG64, JSON-able)
    history: list  # one dict per step done (see LayerResult)
    seconds: float  # training seconds so far


class LayerInterrupted(Exception):
    """``stop`` said stop before a step of :func:`train_layer`; ``state`` resumes the layer there."""

    def __init__(self, state: LayerState):
        self.state = state
        super().__init__(f"layer training stopped after step {state.step}")


def init_state(spec: L.ConvSpec, x, cfg: TrainConfig, *, classes: int, layer_index: int = 0) -> LayerState:
    """The state of a layer before its first step: initial weights (thresholds from a first batch), head, Adam states."""
    cfg = cfg.check()
    x = np.asarray(x)
    n, h, w = x.shape[:3]
    reg = L.regions(h, w, cfg.grid)
    first = _batch(n, cfg, layer_index, 0, tag=4)
    layer = L.init_layer(spec, x[first], seed=cfg.seed, layer_index=layer_index)
    if cfg.head == "votes":
        head = L.votes_head(spec.c_out, len(reg.counts), classes, cfg.votes_scale)
    else:
        head = L.init_head(spec.c_out, len(reg.counts), classes)
    shadow = (jnp.asarray(layer.w, jnp.float32) * jnp.float32(STE_INIT), head)
    rng = np.random.default_rng([cfg.seed, layer_index, 3]).bit_generator.state
    return LayerState(0, layer, head, ADAM.init(head), shadow, ADAM.init(shadow), rng, [], 0.0)


def step_cost(cfg: TrainConfig) -> tuple[int, int]:
    """``(forward, backward)`` passes over the batch one step of ``cfg.method`` makes.

    flips: the head's Adam step (one of each; with the votes head, one loss forward instead) and
    the forward pass that gives every mutation's loss change; evolution: the head step plus the
    loss before and after the trial mutations; ste: one of each; head: the head step.
    """
    head = (1, 1) if cfg.head == "linear" else (1, 0)
    if cfg.method == "ste":
        return 1, 1
    extra = {"flips": 1 + (2 if cfg.accept_batch else 0), "evolution": 2, "head": 0}[cfg.method]
    return head[0] + extra, head[1]


def train_layer(
    spec: L.ConvSpec,
    x,
    y,
    cfg: TrainConfig,
    *,
    classes: int,
    layer_index: int = 0,
    log=None,
    state: LayerState | None = None,
    stop=None,
) -> LayerResult:
    """Train one layer on packed inputs ``x: u32[N, H, W, words(C)]`` with labels ``y: int32[N]``.

    Args:
      state: continue from this state (from :class:`LayerInterrupted`); default :func:`init_state`.
      log: called after each step with its record ``{step, loss, flips, seconds}`` (``step``: the
        step's index) and the layer after it.
      stop: called before each step; when it returns True, :class:`LayerInterrupted` is raised
        with the state after the steps done (the step under way always finishes).

    Returns the trained layer, its head and the per-step history.
    """
    cfg = cfg.check()
    x, y = np.asarray(x), np.asarray(y, np.int32)
    n, h, w = x.shape[:3]
    st = init_state(spec, x, cfg, classes=classes, layer_index=layer_index) if state is None else state
    layer, head, head_state, shadow, ste_state = st.layer, st.head, st.head_state, st.shadow, st.ste_state
    fns = step_functions(spec, h, w, cfg.grid)
    head_lr = jnp.float32(cfg.head_lr)
    ste_lrs = (jnp.float32(cfg.ste_lr), jnp.float32(cfg.head_lr))
    rng = np.random.default_rng()
    rng.bit_generator.state = st.rng
    history, t0 = list(st.history), time.perf_counter() - st.seconds
    for step in range(st.step, cfg.steps):
        if stop is not None and stop():
            raise LayerInterrupted(
                LayerState(
                    step,
                    layer,
                    head,
                    head_state,
                    shadow,
                    ste_state,
                    rng.bit_generator.state,
                    history,
                    time.perf_counter() - t0,
                )
            )
        idx = _batch(n, cfg, layer_index, step)
        xb, yb = jnp.asarray(x[idx]), jnp.asarray(y[idx])
        applied = 0
        if cfg.method == "ste":
            shadow, ste_state, loss = fns.ste_step(shadow, ste_state, layer.thresh, xb, yb, ste_lrs)
            wq = _quantize_np(np.asarray(shadow[0]), spec.ternary)
            applied = int(np.sum(wq != np.asarray(layer.w)))  # quantized weights that changed this step
            layer = L.ConvLayer(jnp.asarray(wq), layer.thresh)
            head = shadow[1]
        else:
            if cfg.head == "linear":
                head, head_state, loss = fns.head_step(layer, head, head_state, xb, yb, head_lr)
            else:
                loss = fns.loss(layer, head, xb, yb) / len(idx)
            wnp = np.asarray(layer.w)
            moved = 0
            if cfg.method == "flips" and cfg.refit_every and step % cfg.refit_every == 0:
                ridx = np.random.default_rng([cfg.seed, layer_index, 6, step]).choice(
                    n, size=min(cfg.refit_size, n), replace=False
                )
                w_fit, b_fit, _ = fit_head(features(layer, x[ridx], spec, cfg.grid), y[ridx], head.b.shape[0])
                head = L.Head(jnp.asarray(w_fit.reshape(head.a.shape)), jnp.asarray(b_fit))
            if cfg.method == "flips":
                chosen = F.select(fns.deltas(layer, head, xb, yb), k=cfg.k, min_gain=cfg.min_gain)
                trial = layer
                if chosen.size:
                    trial = L.ConvLayer(jnp.asarray(F.apply_mutations_np(wnp, chosen, spec.ternary)), layer.thresh)
                if cfg.thresh_k:  # scored on the layer before this step's flips, like the flips themselves
                    moves = F.select_thresholds(
                        fns.thresh_deltas(layer, head, xb, yb), k=cfg.thresh_k, min_gain=cfg.min_gain
                    )
                    moved = int(np.count_nonzero(moves))
                    if moved:
                        trial = L.ConvLayer(trial.w, jnp.asarray(F.apply_thresholds(layer.thresh, moves, spec)))
                if (
                    chosen.size or moved
                ) and cfg.accept_batch:  # kept only if the loss falls on examples the flips were not scored on
                    hidx = np.random.default_rng([cfg.seed, layer_index, 5, step]).choice(
                        n, size=min(cfg.accept_batch, n), replace=False
                    )
                    xh, yh = jnp.asarray(x[hidx]), jnp.asarray(y[hidx])
                    if float(fns.loss(trial, head, xh, yh)) >= float(fns.loss(layer, head, xh, yh)):
                        trial, chosen, moved = layer, chosen[:0], 0
                layer, applied = trial, int(chosen.size)
            elif cfg.method == "evolution":
                before = float(fns.loss(layer, head, xb, yb))
                trial = L.ConvLayer(
                    jnp.asarray(
                        F.apply_mutations_np(wnp, _random_mutations(rng, wnp, cfg.k, spec.ternary), spec.ternary)
                    ),
                    layer.thresh,
                )
                if float(fns.loss(trial, head, xb, yb)) < before:
                    layer, applied = trial, cfg.k
        rec = {"step": step, "loss": float(loss), "flips": applied, "seconds": time.perf_counter() - t0}
        if cfg.thresh_k:
            rec["thresholds"] = moved
        history.append(rec)
        if log is not None:
            log(rec, layer)
    return LayerResult(layer, head, history, time.perf_counter() - t0)


def save_state(path: str | os.PathLike, state: LayerState) -> None:
    """Write ``state`` to ``path`` (``.npz``: the arrays, and the step, generator state and history as JSON)."""
    leaves = jax.tree_util.tree_leaves((state.layer, state.head, state.head_state, state.shadow, state.ste_state))
    meta = {"step": state.step, "rng": state.rng, "history": state.history, "seconds": state.seconds}
    with open(path, "wb") as fh:
        np.savez(fh, meta=np.array(json.dumps(meta)), **{f"leaf{i}": np.asarray(a) for i, a in enumerate(leaves)})


def load_state(path: str | os.PathLike, template: LayerState) -> LayerState:
    """Read a state written by :func:`save_state` into the structure of ``template`` (from :func:`init_state`).

    Raises:
      ValueError: the file holds another number of arrays, or arrays of other shapes or dtypes.
    """
    trees = (template.layer, template.head, template.head_state, template.shadow, template.ste_state)
    leaves, treedef = jax.tree_util.tree_flatten(trees)
    with np.load(path, allow_pickle=False) as z:
        got = [z[f"leaf{i}"] for i in range(sum(k.startswith("leaf") for k in z.files))]
        meta = json.loads(str(z["meta"]))
    if len(got) != len(leaves) or any(
        a.shape != np.shape(b) or a.dtype != np.asarray(b).dtype for a, b in zip(got, leaves)
    ):
        raise ValueError(f"{path}: the saved layer state does not match this layer's config (other shapes or dtypes)")
    layer, head, head_state, shadow, ste_state = jax.tree_util.tree_unflatten(treedef, [jnp.asarray(a) for a in got])
    return LayerState(
        meta["step"], layer, head, head_state, shadow, ste_state, meta["rng"], meta["history"], meta["seconds"]
    )


@functools.partial(jax.jit, static_argnames=("spec",))
def _out(layer, x, spec):
    out = L.forward(layer, x, spec)
    return L.maxpool2(out) if spec.pool else out


def _chunks(x: np.ndarray, chunk: int):
    """Equal-size chunks (the last one padded with zero rows), so one compilation serves every dataset size."""
    for i in range(0, len(x), chunk):
        part = x[i : i + chunk]
        yield len(part), jnp.asarray(np.concatenate([part, np.zeros((chunk - len(part),) + x.shape[1:], x.dtype)]))


def layer_outputs(layer: L.ConvLayer, x, spec: L.ConvSpec, *, chunk: int = 256) -> np.ndarray:
    """Packed outputs of the frozen layer (pooled if ``spec.pool``) for a whole dataset, in chunks."""
    x = np.asarray(x)
    return np.concatenate([np.asarray(_out(layer, xb, spec))[:m] for m, xb in _chunks(x, chunk)], axis=0)


def predict(layer: L.ConvLayer, head: L.Head, x, spec: L.ConvSpec, grid: int, *, chunk: int = 256) -> np.ndarray:
    """Class predictions ``int[N]`` of the layer's head on packed inputs."""
    x = np.asarray(x)
    return np.concatenate([np.asarray(_predict(layer, head, xb, spec, grid))[:m] for m, xb in _chunks(x, chunk)])


@functools.partial(jax.jit, static_argnames=("spec", "grid"))
def _predict(layer, head, xb, spec, grid):
    reg = L.regions(xb.shape[1], xb.shape[2], grid)
    return jnp.argmax(L.head_logits(head, _acts(layer, xb, spec), reg), axis=-1)


def accuracy(layer, head, x, y, spec, grid) -> float:
    """The fraction of ``x`` the layer's head classifies as ``y``."""
    return float(np.mean(predict(layer, head, x, spec, grid) == np.asarray(y)))


@functools.partial(jax.jit, static_argnames=("spec", "grid"))
def _eval_chunk(layer, head, xb, yb, valid, spec, grid):
    reg = L.regions(xb.shape[1], xb.shape[2], grid)
    z = L.head_logits(head, _acts(layer, xb, spec), reg)
    ce = F.cross_entropy(z, yb)
    return jnp.sum(jnp.where(valid, ce, 0.0)), jnp.sum(valid & (jnp.argmax(z, axis=-1) == yb))


def evaluate(layer, head, x, y, spec, grid, *, chunk: int = 256) -> tuple[float, float]:
    """``(mean cross-entropy, accuracy)`` of the layer's head on packed inputs ``x`` with labels ``y``."""
    x, y = np.asarray(x), np.asarray(y, np.int32)
    loss, right = 0.0, 0
    for i, (m, xb) in enumerate(_chunks(x, chunk)):
        yb = np.zeros(chunk, np.int32)
        yb[:m] = y[i * chunk : i * chunk + m]
        l_sum, r = _eval_chunk(layer, head, xb, jnp.asarray(yb), jnp.arange(chunk) < m, spec, grid)
        loss, right = loss + float(l_sum), right + int(r)
    return loss / len(y), right / len(y)


@functools.partial(jax.jit, static_argnames=("spec", "grid"))
def _features_chunk(layer, xb, spec, grid):
    act = _acts(layer, xb, spec)  # f32[B, H W, O], ±1
    reg = L.regions(xb.shape[1], xb.shape[2], grid)
    pooled = jax.ops.segment_sum(jnp.moveaxis(act, 1, 0), jnp.asarray(reg.index), num_segments=len(reg.counts))
    pooled = pooled / jnp.asarray(reg.counts)[:, None, None]  # (R, B, O)
    return jnp.moveaxis(pooled, 1, 0).reshape(xb.shape[0], -1)


def features(layer: L.ConvLayer, x, spec: L.ConvSpec, grid: int, *, chunk: int = 256) -> np.ndarray:
    """``f32[N, R * O]``: the region means of the layer's ±1 activations (what its head reads)."""
    x = np.asarray(x)
    return np.concatenate([np.asarray(_features_chunk(layer, xb, spec, grid))[:m] for m, xb in _chunks(x, chunk)])


def fit_head(
    f_train: np.ndarray, y_train: np.ndarray, classes: int, *, l2: float = 1e-4, tol: float = 1e-5, max_iter: int = 2000
) -> tuple[np.ndarray, np.ndarray, dict]:
    """A converged multinomial logistic regression ``(W f32[D, K], b f32[K], info)`` on ``f_train``.

    Minimises mean cross-entropy + ``l2 * ||W||^2`` (features standardised first, folded back into
    ``W, b``) with L-BFGS until the gradient's max norm is below ``tol`` or ``max_iter``
    iterations; ``info`` says which (``converged``), the iterations and the final loss.
    """
    f = jnp.asarray(f_train, jnp.float32)
    mu, sd = f.mean(0), f.std(0) + 1e-6
    p, value, gmax, it = _lbfgs(
        (f - mu[None, :]) / sd[None, :],
        jnp.asarray(y_train, jnp.int32),
        classes,
        jnp.float32(l2),
        jnp.float32(tol),
        max_iter,
    )
    w = p[0] / sd[:, None]
    b = p[1] - mu @ w
    gmax = float(gmax)
    return (
        np.asarray(w),
        np.asarray(b),
        {"converged": gmax <= tol, "iterations": int(it), "loss": float(value), "grad_max": gmax},
    )


@functools.partial(jax.jit, static_argnames=("classes", "max_iter"))
def _lbfgs(z, y, classes: int, l2, tol, max_iter: int):
    def loss(p):
        logits = z @ p[0] + p[1][None, :]
        return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean() + l2 * jnp.sum(p[0] ** 2)

    opt = optax.lbfgs()
    vg = optax.value_and_grad_from_state(loss)

    def body(c):
        p, s, _, _, it = c
        value, grad = vg(p, state=s)
        upd, s = opt.update(grad, s, p, value=value, grad=grad, value_fn=loss)
        gmax = jnp.maximum(jnp.max(jnp.abs(grad[0])), jnp.max(jnp.abs(grad[1])))
        return optax.apply_updates(p, upd), s, value, gmax, it + 1

    p0 = (jnp.zeros((z.shape[1], classes), jnp.float32), jnp.zeros((classes,), jnp.float32))
    c0 = (p0, opt.init(p0), jnp.float32(jnp.nan), jnp.float32(jnp.inf), jnp.int32(0))
    p, _, value, gmax, it = jax.lax.while_loop(lambda c: (c[4] < max_iter) & (c[3] > tol), body, c0)
    return p, value, gmax, it
