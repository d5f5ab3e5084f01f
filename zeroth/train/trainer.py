"""Single-machine training: MeZO / Just One Byte (forward passes only, exact replay) or backprop.

A *method* is a pair of functions (optax style): ``init(params) -> opt_state`` and
``step(params, opt_state, batch, step) -> (params, opt_state, StepInfo)``.

ZO step ``t`` (:func:`zo_method`), with ``n = train.n_perturbations`` and machine 0:

1. keys ``k_i = sample_key(run.seed, 0, t, i)`` for ``i < n``;
2. projected gradients ``g_i = (L(θ+εz_i) − L(θ−εz_i)) / (2ε)`` on the step's batch
   (:func:`zeroth.zo.projected_gradients`, ε host-rounded);
3. ``payload = codec.encode(g)``; ``ĝ = codec.decode(payload)``: the *decoded* values are applied,
   exactly what a peer would receive;
4. coefficients ``c_i = −η ĝ_i / √n`` (or ``/ n``) (:func:`zeroth.zo.update_coefficients`);
5. ``θ ← replay(θ, [(k_i, c_i)])``: the exact, backend-independent update of
   :mod:`zeroth.replay`; then the optional exact weight-decay step of :mod:`zeroth.zo`.

With ``train.requantize`` (:func:`requantize_method`), the same ZO step is followed by putting
every quantized weight back on its fixed 4-bit grid from the model file (4-bit forward-only
training, :mod:`zeroth.models.pretrained.q4train`); training records then carry ``changed``, the
fraction of quantized weights whose code changed in the step.

Backprop step (:func:`backprop_method`): ``jax.value_and_grad`` of the cross-entropy and an optax
optimizer (:data:`OPTIMIZERS`) on the same model, batches and evaluation.

Batches are a pure function of ``(run.seed, step)`` (:func:`zeroth.data.batch_at`), so a run
resumed from a checkpoint retraces the uninterrupted run bit for bit.

Example:
  >>> from zeroth.config import load_config_dict
  >>> cfg = load_config_dict({"train": {"steps": 20, "eval_every": 10}})
  >>> result = train(cfg, "/tmp/zeroth-doc-run", progress=False)  # doctest: +SKIP
"""

from __future__ import annotations

import dataclasses
import functools
import json
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from zeroth import data as _data
from zeroth import models as _models
from zeroth import replay as _replay
from zeroth.config import Config, config_digest, diff, load_config, to_yaml
from zeroth.train.checkpoint import Checkpointer, CheckpointError
from zeroth.train.metrics import MetricsWriter, read_metrics, truncate_after

__all__ = [
    "MACHINE",
    "StepInfo",
    "Method",
    "Counters",
    "RunResult",
    "OBJECTIVES",
    "OPTIMIZERS",
    "RESUME_INVARIANT",
    "make_objective",
    "make_eval_fn",
    "zo_method",
    "backprop_method",
    "requantize_method",
    "make_method",
    "build_model",
    "out_dir_of",
    "train",
    "summary_line",
]

MACHINE = 0  # machine id of a single-machine run in sample_key(seed, machine, iteration, sample)

# Fields that may change between a run and its resumption (they do not affect the parameters).
RESUME_INVARIANT = (
    "run.out_dir",
    "run.name",
    "train.steps",
    "train.eval_every",
    "train.log_every",
    "train.checkpoint_every",
    "train.keep_checkpoints",
    "data.eval_size",
    "data.eval_batch_size",
)


class StepInfo(NamedTuple):
    """What one training step cost and produced."""

    forward_passes: int  # forward passes over a batch
    backward_passes: int  # backward passes over a batch (backprop)
    payload_bytes: int  # projected-gradient bytes a peer would send (zo)
    loss: Any  # f32[] objective on the step's batch before the update (zo: mean over the pairs)
    grads: np.ndarray | None  # f32[n] decoded projected gradients (zo), else None


class Method(NamedTuple):
    """A training method.

    ``init(params) -> opt_state``; ``step(params, opt_state, batch, step) -> (params, opt_state, StepInfo)``.
    """

    init: Callable[[Any], Any]
    step: Callable[[Any, Any, tuple, int], tuple[Any, Any, StepInfo]]


class Counters(NamedTuple):
    """Cumulative counters of a run (saved in checkpoints)."""

    forward_passes: int = 0
    backward_passes: int = 0
    examples: int = 0
    payload_bytes: int = 0
    train_time: float = 0.0
    wall_time: float = 0.0


class RunResult(NamedTuple):
    """What :func:`train` returns."""

    out_dir: Path
    step: int  # steps completed
    digest: str  # checksum of the final parameters
    eval: dict  # the final eval record
    resumed_from: int | None  # the checkpoint step the run resumed from, if any


# --------------------------------------------------------------------------- objectives


def _cross_entropy(logits: jax.Array, y: jax.Array) -> jax.Array:
    logp = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
    picked = jnp.take_along_axis(logp, y.astype(jnp.int32)[:, None], axis=-1)[:, 0]
    return -jnp.mean(picked)


def _error_rate(logits: jax.Array, y: jax.Array) -> jax.Array:
    correct = (jnp.argmax(logits, axis=-1) == y.astype(jnp.int32)).astype(jnp.float32)
    return jnp.float32(1.0) - jnp.mean(correct)


OBJECTIVES: dict[str, Callable[[jax.Array, jax.Array], jax.Array]] = {
    "cross_entropy": _cross_entropy,
    "error_rate": _error_rate,  # 1 - accuracy: piecewise constant, no useful gradient
}


@functools.lru_cache(maxsize=64)
def make_objective(name: str, model) -> Callable[[Any, tuple], jax.Array]:
    """``loss(params, (x, y)) -> f32[]``: the named objective of ``model``'s logits on a batch.

    ``cross_entropy`` is the mean softmax cross-entropy; ``error_rate`` is ``1 - accuracy``
    (not differentiable: only the ZO method can train on it). Cached per (name, model), so
    the compiled estimator of :mod:`zeroth.zo` is reused by later runs in the same process.
    """
    if name not in OBJECTIVES:
        raise ValueError(f"unknown objective {name!r}; expected one of {sorted(OBJECTIVES)}")
    fn = OBJECTIVES[name]

    def loss(params, batch):
        x, y = batch
        return fn(_models.apply(model, params, x), y)

    return loss


@functools.lru_cache(maxsize=64)
def make_eval_fn(model, batch_size: int) -> Callable[[Any, np.ndarray, np.ndarray], dict]:
    """``evaluate(params, x, y) -> {"eval_loss", "eval_accuracy"}`` over all of ``x`` in chunks."""

    @jax.jit
    def chunk(params, x, y):
        logits = _models.apply(model, params, x).astype(jnp.float32)
        logp = jax.nn.log_softmax(logits, axis=-1)
        nll = -jnp.sum(jnp.take_along_axis(logp, y[:, None], axis=-1))
        correct = jnp.sum((jnp.argmax(logits, axis=-1) == y).astype(jnp.int32))
        return nll, correct

    def evaluate(params, x, y):
        n = x.shape[0]
        total, correct = 0.0, 0
        for start in range(0, n, batch_size):
            nll, c = chunk(params, x[start : start + batch_size], y[start : start + batch_size])
            total += float(nll)
            correct += int(c)
        return {"eval_loss": total / n, "eval_accuracy": correct / n}

    return evaluate


# --------------------------------------------------------------------------- methods


def zo_method(cfg: Config, model) -> Method:
    """The MeZO / Just One Byte step on one machine: :func:`zeroth.zo.mezo_step` with machine 0.

    keys ``sample_key(run.seed, 0, step, i)`` -> projected gradients -> ``codec`` encode/decode ->
    canonical coefficients -> ``replay(..., donate=True)`` -> optional exact weight decay. The
    loss reported is the mean over the pairs of ``(L(θ+εz) + L(θ−εz)) / 2``, before the update.
    """
    from zeroth import codecs as _codecs
    from zeroth import zo as _zo

    t = cfg.train
    loss_fn = make_objective(t.objective, model)
    bytes_per_value = _codecs.get_codec(t.codec).bytes_per_value
    _zo.round_eps(t.eps)  # validate early

    def init(params):
        return None

    def step(params, opt_state, batch, step_idx):
        out = _zo.mezo_step(
            loss_fn,
            params,
            batch,
            run_seed=cfg.run.seed,
            iteration=step_idx,
            lr=t.lr,
            eps=t.eps,
            n_perturbations=t.n_perturbations,
            machine=MACHINE,
            scaling=t.lr_scaling,
            distribution=t.distribution,
            codec=t.codec,
            weight_decay=t.weight_decay,
            donate=True,
        )
        if len(out.payload) != t.n_perturbations * bytes_per_value:
            raise RuntimeError(f"codec {t.codec!r} produced {len(out.payload)} bytes for {t.n_perturbations} values")
        return out.params, None, StepInfo(2 * t.n_perturbations, 0, len(out.payload), out.loss, out.grads)

    return Method(init, step)


def _sgd(o, lr):
    import optax

    return optax.sgd(lr)


def _momentum(o, lr):
    import optax

    return optax.sgd(lr, momentum=o.momentum)


def _adam(o, lr):
    import optax

    return optax.adam(lr, b1=o.b1, b2=o.b2)


def _adamw(o, lr):
    import optax

    return optax.adamw(lr, b1=o.b1, b2=o.b2, weight_decay=o.weight_decay)


# name -> (OptimizerConfig, lr) -> optax.GradientTransformation
OPTIMIZERS: dict[str, Callable[[Any, float], Any]] = {"sgd": _sgd, "momentum": _momentum, "adam": _adam, "adamw": _adamw}


@functools.lru_cache(maxsize=64)
def _backprop_update(model, optimizer, lr: float):
    import optax

    if optimizer.name not in OPTIMIZERS:
        raise ValueError(f"unknown optimizer {optimizer.name!r}; expected one of {sorted(OPTIMIZERS)}")
    opt = OPTIMIZERS[optimizer.name](optimizer, lr)
    loss_fn = make_objective("cross_entropy", model)

    @jax.jit
    def update(params, opt_state, batch):
        loss, grads = jax.value_and_grad(loss_fn)(params, batch)
        updates, opt_state = opt.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    return opt, update


def backprop_method(cfg: Config, model) -> Method:
    """``jax.value_and_grad`` of the cross-entropy + the optax optimizer of ``train.optimizer``."""
    t = cfg.train
    if t.objective != "cross_entropy":
        raise ValueError(f"backprop needs a differentiable objective; train.objective is {t.objective!r}")
    opt, update = _backprop_update(model, t.optimizer, t.lr)

    def step(params, opt_state, batch, step_idx):
        # optax's Adam bias correction mixes a Python float with an int32 count: allow the
        # standard promotion while tracing it, whatever the process-wide setting.
        with jax.numpy_dtype_promotion("standard"):
            params, opt_state, loss = update(params, opt_state, batch)
        return params, opt_state, StepInfo(1, 1, 0, loss, None)

    return Method(opt.init, step)


def requantize_method(cfg: Config, model) -> Method:
    """4-bit forward-only ZO (``train.requantize``): the ZO step, then every quantized weight back on its grid.

    :func:`zeroth.models.pretrained.q4train.zo_q4_method` with the grids of ``model.quant_grids()``
    and the rounding of ``train.requantize``. ``step.last_changed[0]`` is the fraction of quantized
    weights whose code changed in the last step.

    Raises:
      ValueError: the model has no 4-bit weight grids, or its parameters do not start on them.
    """
    r = cfg.train.requantize
    if not callable(getattr(model, "quant_grids", None)):
        raise ValueError(
            f"config field train.requantize: {r!r} needs a model whose weights have 4-bit grids "
            f"(smollm2_prompt); model {cfg.model.name!r} has none, set train.requantize to null"
        )
    from zeroth.models.pretrained import q4train

    return q4train.zo_q4_method(cfg, model, rounding=r)


def make_method(cfg: Config, model) -> Method:
    """The method named by ``train.method`` (with ``train.requantize``: :func:`requantize_method`)."""
    if cfg.train.requantize is not None:
        return requantize_method(cfg, model)
    return {"zo": zo_method, "backprop": backprop_method}[cfg.train.method](cfg, model)


def build_model(cfg: Config, num_classes: int, sample_x: np.ndarray):
    """``(model, params)``: the configured model and its float32 initial parameters (key ``init_key(run.seed)``)."""
    model = _models.build(cfg.model.name, num_classes=num_classes, **cfg.model.kwargs)
    params = _models.init(model, _models.init_key(cfg.run.seed), sample_x)
    return model, params


# --------------------------------------------------------------------------- progress


class _Progress:
    """A tqdm bar on a terminal; otherwise a line on stderr every ~5% of the run and at each eval."""

    def __init__(self, total: int, initial: int, enabled: bool, name: str):
        self.total, self.enabled, self.name = total, enabled, name
        self.bar = None
        self.every = max(1, total // 20)
        if enabled and sys.stderr.isatty():
            from tqdm import tqdm

            self.bar = tqdm(total=total, initial=initial, file=sys.stderr, desc=name)
        self.last: dict = {}

    def update(self, step: int, rec: dict) -> None:
        if not self.enabled:
            return
        if "loss" in rec:
            self.last["loss"] = f"{rec['loss']:.4f}"
        if "eval_accuracy" in rec:
            self.last["acc"] = f"{rec['eval_accuracy']:.4f}@{step}"
        self.last["fwd"] = str(rec["forward_passes"])
        self.last["bytes"] = str(rec["payload_bytes"])
        self.last["time"] = f"{rec['wall_time']:.1f}s"
        if self.bar is not None:
            self.bar.set_postfix(self.last, refresh=False)
            return
        if rec["kind"] == "eval":
            fields = f"eval_loss {rec['eval_loss']:.4f} eval_accuracy {rec['eval_accuracy']:.4f}"
        elif step % self.every == 0:
            fields = f"loss {rec['loss']:.4f}"
        else:
            return
        print(
            f"[{self.name}] step {step}/{self.total} {rec['kind']}: {fields} forward_passes {rec['forward_passes']} "
            f"payload_bytes {rec['payload_bytes']} time {rec['wall_time']:.1f}s",
            file=sys.stderr,
            flush=True,
        )

    def tick(self) -> None:
        """One step done (the bar redraws at most ~10 times a second)."""
        if self.bar is not None:
            self.bar.update(1)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


# --------------------------------------------------------------------------- the loop


def out_dir_of(cfg: Config, out_dir: str | Path | None = None) -> Path:
    """The output folder: ``out_dir`` if given, else ``run.out_dir``, else ``runs/<run.name>``."""
    return Path(out_dir or cfg.run.out_dir or Path("runs") / cfg.run.name)


def _check_resumable(cfg: Config, out: Path) -> None:
    saved_path = out / "config.yaml"
    if not saved_path.exists():
        return
    saved = load_config(saved_path)
    if config_digest(saved, exclude=RESUME_INVARIANT) != config_digest(cfg, exclude=RESUME_INVARIANT):
        changed = [d for d in diff(saved, cfg) if not any(d == f or d.startswith(f + ".") for f in RESUME_INVARIANT)]
        raise ValueError(
            f"cannot resume {out}: the config differs from the one the run started with in {changed}; "
            f"only {list(RESUME_INVARIANT)} may change on resume"
        )


def _counters_from_meta(meta: dict) -> Counters:
    return Counters(**{f: type(getattr(Counters(), f))(meta.get(f, getattr(Counters(), f))) for f in Counters._fields})


def train(
    cfg: Config,
    out_dir: str | Path | None = None,
    *,
    resume: bool = False,
    resume_step: int | None = None,
    progress: bool = True,
) -> RunResult:
    """Train as configured, writing ``config.yaml``, ``metrics.jsonl`` and ``checkpoints/`` to the output folder.

    Args:
      cfg: a validated config (``cfg.peers`` must be None: peers are launched by ``zeroth run``).
      out_dir: output folder (default :func:`out_dir_of`).
      resume: continue from the newest checkpoint (or ``resume_step``); without a checkpoint the
        run starts from step 0.
      resume_step: resume from this checkpoint step instead of the newest (newer ones are moved
        to ``checkpoints_quarantine/``, not deleted).
      progress: show a progress bar (a terminal) or periodic lines (otherwise) on stderr.

    Returns:
      :class:`RunResult` with the final digest and eval record.

    Raises:
      ValueError: a bad config, an output folder that already holds a run (without ``resume``),
        or a resumed config that differs in a field that changes the parameters.
      CheckpointError: the checkpoint to resume is missing, truncated or corrupted.
    """
    if cfg.peers is not None:
        raise ValueError("train() runs one machine; configs with a 'peers' section are run by zeroth.net.launch")
    out = out_dir_of(cfg, out_dir)
    out.mkdir(parents=True, exist_ok=True)
    cfg = dataclasses.replace(cfg, run=dataclasses.replace(cfg.run, out_dir=str(out)))
    metrics_path = out / "metrics.jsonl"
    ckpt = Checkpointer(out / "checkpoints", keep=cfg.train.keep_checkpoints)
    try:
        return _train(cfg, out, metrics_path, ckpt, resume, resume_step, progress)
    finally:
        ckpt.close()


def _train(cfg, out, metrics_path, ckpt, resume, resume_step, progress) -> RunResult:
    t = cfg.train
    if not resume and (ckpt.steps() or (metrics_path.exists() and metrics_path.stat().st_size)):
        raise ValueError(
            f"output folder {out} already holds a run (checkpoints {ckpt.steps()}, metrics.jsonl); "
            f"pass --resume to continue it or choose another --out"
        )
    if resume:
        _check_resumable(cfg, out)
    if resume_step is not None and not resume:
        raise ValueError("resume_step needs resume=True")

    train_ds = _data.load(cfg.data.dataset, "train")
    test_ds = _data.load(cfg.data.dataset, "test")
    eval_n = cfg.data.eval_size or test_ds.x.shape[0]
    eval_x, eval_y = test_ds.x[:eval_n], test_ds.y[:eval_n]
    model, params = build_model(cfg, train_ds.num_classes, train_ds.x[:1])
    method = make_method(cfg, model)
    opt_state = method.init(params)
    evaluate = make_eval_fn(model, cfg.data.eval_batch_size)

    start, counters, resumed_from = 0, Counters(), None
    if resume:
        steps = ckpt.steps()
        target = resume_step if resume_step is not None else (steps[-1] if steps else None)
        if target is not None:
            restored = ckpt.restore(target, params, opt_state)
            if restored.meta.get("step") != target:
                raise CheckpointError(f"checkpoint {ckpt.directory / str(target)} says step {restored.meta.get('step')}")
            for newer in [s for s in steps if s > target]:
                ckpt.quarantine(newer)
            params = jax.tree_util.tree_map(jnp.asarray, restored.params)
            opt_state = None if restored.opt_state is None else jax.tree_util.tree_map(jnp.asarray, restored.opt_state)
            start, counters, resumed_from = target, _counters_from_meta(restored.meta), target
        truncate_after(metrics_path, start if target is not None else -1)
    (out / "config.yaml").write_text(to_yaml(cfg))

    t0 = time.perf_counter() - counters.wall_time
    bar = _Progress(t.steps, start, progress, cfg.run.name)
    writer = MetricsWriter(metrics_path)

    def record(kind: str, step: int, extra: dict) -> dict:
        c = counters
        rec = {
            "kind": kind,
            "step": step,
            **extra,
            "forward_passes": c.forward_passes,
            "backward_passes": c.backward_passes,
            "passes": c.forward_passes + 2 * c.backward_passes,
            "examples": c.examples,
            "payload_bytes": c.payload_bytes,
            "wall_time": time.perf_counter() - t0,
            "train_time": c.train_time,
            "digest": _replay.checksum(params),
        }
        writer.write(rec)
        bar.update(step, rec)
        return rec

    def save(step: int) -> None:
        meta = {
            "step": step,
            "data_cursor": {"seed": cfg.run.seed, "batch_size": cfg.data.batch_size, "next_step": step},
            **counters._replace(wall_time=time.perf_counter() - t0)._asdict(),
            "digest": _replay.checksum(params),
            "config_digest": config_digest(cfg, exclude=RESUME_INVARIANT),
        }
        ckpt.save(step, params, opt_state, meta)

    last_eval = None
    try:
        if start == 0:
            last_eval = record("eval", 0, evaluate(params, eval_x, eval_y))
        for s in range(start, t.steps):
            t_step = time.perf_counter()
            batch = _data.batch_at(train_ds, cfg.run.seed, s, cfg.data.batch_size)
            params, opt_state, info = method.step(params, opt_state, batch, s)
            jax.block_until_ready(params)
            counters = counters._replace(
                forward_passes=counters.forward_passes + info.forward_passes,
                backward_passes=counters.backward_passes + info.backward_passes,
                examples=counters.examples + info.forward_passes * cfg.data.batch_size,
                payload_bytes=counters.payload_bytes + info.payload_bytes,
                train_time=counters.train_time + (time.perf_counter() - t_step),
            )
            done = s + 1
            bar.tick()
            if done % t.log_every == 0 or done == t.steps:
                extra = {"loss": float(info.loss)}
                if hasattr(method.step, "last_changed"):
                    extra["changed"] = method.step.last_changed[0]
                record("train", done, extra)
            if done % t.eval_every == 0 or done == t.steps:
                last_eval = record("eval", done, evaluate(params, eval_x, eval_y))
            if (t.checkpoint_every and done % t.checkpoint_every == 0) or done == t.steps:
                save(done)
    finally:
        writer.close()
        bar.close()
    if last_eval is None:  # resumed at the final step: report the saved final eval
        evals = [r for r in read_metrics(metrics_path, "eval") if r["step"] == t.steps]
        last_eval = evals[-1] if evals else _record_final(evaluate, params, eval_x, eval_y)
    return RunResult(out, max(start, t.steps), _replay.checksum(params), last_eval, resumed_from)


def _record_final(evaluate, params, x, y) -> dict:
    """An eval record of ``params`` that is not written to metrics (used when nothing is left to train)."""
    return {"kind": "eval", **evaluate(params, x, y), "digest": _replay.checksum(params)}


def summary_line(result: RunResult) -> str:
    """One JSON line with the final numbers of a run."""
    keys = ("step", "eval_accuracy", "eval_loss", "forward_passes", "backward_passes", "payload_bytes", "wall_time", "train_time")
    return json.dumps({"out_dir": str(result.out_dir), **{k: result.eval.get(k) for k in keys}, "digest": result.digest})
