"""Single-machine training from a config: the method, batches and hooks handed to :func:`zeroth.train.loop.train`.

:func:`train` builds the model and its initial parameters (:func:`zeroth.objectives.build_model`),
the method of ``train.method`` (:func:`zeroth.methods.make_method`: MeZO / Just One Byte with
exact replay, backprop, or 4-bit MeZO with ``train.requantize``), the batch stream
``t -> batch_at(train split, run.seed, t)`` and the hooks, each with its cadence:

* progress (every step): a tqdm bar on a terminal, else a line on stderr every ~5% and at each eval;
* training records (``train.log_every``): loss, the learning rate of the step (``train.schedule``),
  the method's metrics (``changed`` for 4-bit training), counters and the parameter digest, to
  ``metrics.jsonl``;
* evaluation (``train.eval_every``, and at step 0): loss and accuracy on the test split;
* checkpoints (``train.checkpoint_every``; 0 = at the end only): orbax, with the counters and
  the digests that a resumed run checks.

Batches are a pure function of ``(run.seed, step)`` (:func:`zeroth.data.batch_at`), so a run
resumed from a checkpoint retraces the uninterrupted run bit for bit.

Example:
  >>> from zeroth.config import load_config_dict
  >>> cfg = load_config_dict({"train": {"steps": 20, "eval_every": 10}})
  >>> result = train(cfg, "/tmp/zeroth-doc-run", progress=False)  # doctest: +SKIP
"""

from __future__ import annotations

import dataclasses
import json
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import NamedTuple

import jax
import jax.numpy as jnp

from zeroth import data as _data
from zeroth import methods as _methods
from zeroth import objectives as _objectives
from zeroth import reference as _ref
from zeroth import replay as _replay
from zeroth import schedules as _schedules
from zeroth.config import Config, config_digest, diff, load_config, to_yaml
from zeroth.train import loop as _loop
from zeroth.train.checkpoint import Checkpointer, CheckpointError
from zeroth.train.interrupt import Interrupted
from zeroth.train.loop import Counters
from zeroth.train.metrics import MetricsWriter, read_metrics, truncate_after

__all__ = [
    "Counters",
    "RunResult",
    "RESUME_INVARIANT",
    "out_dir_of",
    "train",
    "summary_line",
    "run_summary",
    "saved_steps",
    "check_resumable",
]

# Fields that may change between a run and its resumption (they do not affect the parameters).
RESUME_INVARIANT = (
    "run.out_dir",
    "run.name",
    "run.tensorboard",
    "train.steps",
    "train.eval_every",
    "train.log_every",
    "train.checkpoint_every",
    "train.keep_checkpoints",
    "train.layout",
    "data.eval_size",
    "data.eval_batch_size",
)


class RunResult(NamedTuple):
    """What :func:`train` returns."""

    out_dir: Path
    step: int  # steps completed
    digest: str  # checksum of the final parameters
    eval: dict  # the final eval record
    resumed_from: int | None  # the checkpoint step the run resumed from, if any
    load_time: float = 0.0  # seconds to load the data and build the model and its initial parameters


# --------------------------------------------------------------------------- progress


# The first steps whose time the progress shows, one line each (the steps that compile).
_TIMED_STEPS = 2


class _Progress:
    """A tqdm bar on a terminal (each eval also printed as a line above it); otherwise a line on
    stderr every ~5% of the run and at each eval, with the time left (from the steps done since
    the first one, compilation excluded). The first steps of a process compile the method's
    programs (a ZO step's first two: the projected gradients, then the same with the held update
    applied; a large model's take minutes to compile for a GPU): a
    line says so before them, and one line each how long the first :data:`_TIMED_STEPS` took."""

    def __init__(self, total: int, initial: int, enabled: bool, name: str):
        self.total, self.enabled, self.name = total, enabled, name
        self.origin: tuple[float, int] | None = None  # (time, step) after the first step: the ETA's origin
        self.bar = None
        self.every = max(1, total // 20)
        if enabled and sys.stderr.isatty():
            from tqdm import tqdm

            self.bar = tqdm(total=total, initial=initial, file=sys.stderr, desc=name)
        self.last: dict = {}
        self.timed = 0  # the first steps whose time was shown
        if enabled and initial < total:
            self._line(f"[{name}] step {initial + 1}/{total}: the first steps compile the method's programs")

    def _line(self, text: str) -> None:
        if self.bar is not None:
            self.bar.write(text, file=sys.stderr)
        else:
            print(text, file=sys.stderr, flush=True)

    def update(self, step: int, rec: dict) -> None:
        if not self.enabled:
            return
        if "loss" in rec:
            self.last["loss"] = f"{rec['loss']:.4f}"
        if "eval_accuracy" in rec:
            self.last["acc"] = f"{rec['eval_accuracy']:.4f}@{step}"
        self.last["fwd"] = str(rec["forward_passes"])
        self.last["bytes"] = str(rec["payload_bytes_total"])
        self.last["time"] = f"{rec['wall_time_s']:.1f}s"
        if rec["kind"] == "eval":
            fields = f"eval_loss {rec['eval_loss']:.4f} eval_accuracy {rec['eval_accuracy']:.4f}"
        elif step % self.every == 0:
            fields = f"loss {rec['loss']:.4f}"
        else:
            fields = None
        if self.bar is not None:
            self.bar.set_postfix(self.last, refresh=False)
            if rec["kind"] == "eval":
                self.bar.write(f"[{self.name}] step {step}/{self.total} eval: {fields}", file=sys.stderr)
            return
        if fields is None:
            return
        print(
            f"[{self.name}] step {step}/{self.total} {rec['kind']}: {fields} forward_passes {rec['forward_passes']} "
            f"payload_bytes_total {rec['payload_bytes_total']} time {rec['wall_time_s']:.1f}s{self.eta(step)}",
            file=sys.stderr,
            flush=True,
        )

    def eta(self, step: int) -> str:
        """`` eta 12s``: the time left at the pace of the steps since the first (empty before there is one)."""
        if self.origin is None or step <= self.origin[1]:
            return ""
        t, s0 = self.origin
        left = (time.perf_counter() - t) / (step - s0) * (self.total - step)
        return f" eta {left:.0f}s"

    def tick(self, step: int, seconds: float) -> None:
        """Step ``step`` done in ``seconds`` (the bar redraws at most ~10 times a second)."""
        if self.origin is None:
            self.origin = (time.perf_counter(), step)
        if self.enabled and self.timed < _TIMED_STEPS:
            self.timed += 1
            self._line(f"[{self.name}] step {step}/{self.total} took {seconds:.1f}s")
        if self.bar is not None:
            self.bar.update(1)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


# --------------------------------------------------------------------------- the run


def out_dir_of(cfg: Config, out_dir: str | Path | None = None) -> Path:
    """The output folder: ``out_dir`` if given, else ``run.out_dir``, else ``runs/<run.name>``."""
    return Path(out_dir or cfg.run.out_dir or Path("runs") / cfg.run.name)


def check_resumable(cfg: Config, out: Path, invariant=RESUME_INVARIANT) -> None:
    """Refuse to resume ``out`` with a config that differs from its ``config.yaml`` beyond ``invariant``
    (the fields that may change on resume); the message names the differing fields."""
    saved_path = out / "config.yaml"
    if not saved_path.exists():
        return
    saved = load_config(saved_path)
    if config_digest(saved, exclude=invariant) != config_digest(cfg, exclude=invariant):
        changed = [d for d in diff(saved, cfg) if not any(d == f or d.startswith(f + ".") for f in invariant)]
        raise ValueError(
            f"cannot resume {out}: the config differs from the one the run started with in {changed}; "
            f"only {list(invariant)} may change on resume"
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
    checkpoints: bool = True,
    stop: Callable[[], bool] | None = None,
) -> RunResult:
    """Train as configured, writing ``config.yaml``, ``metrics.jsonl``, ``checkpoints/`` and ``summary.json`` to the output folder.

    Args:
      cfg: a validated config (``cfg.peers`` must be None: peers are launched by ``zeroth run``).
      out_dir: output folder (default :func:`out_dir_of`).
      resume: continue from the newest checkpoint (or ``resume_step``); without a checkpoint the
        run starts from step 0.
      resume_step: resume from this checkpoint step instead of the newest (newer ones are moved
        to ``checkpoints_quarantine/``, not deleted).
      progress: show a progress bar (a terminal) or periodic lines (otherwise) on stderr.
      checkpoints: register the checkpoint hook (without it nothing is saved and the run
        cannot be resumed; the pretrained fine-tuning driver saves none).
      stop: checked before each step (a signal flag of :func:`zeroth.train.interrupt.catch`);
        when it says stop, the step under way finishes, a checkpoint of it is saved and
        :class:`~zeroth.train.interrupt.Interrupted` is raised.

    Returns:
      :class:`RunResult` with the final digest and eval record.

    Raises:
      ValueError: a bad config, an output folder that already holds a run (without ``resume``),
        or a resumed config that differs in a field that changes the parameters.
      CheckpointError: the checkpoint to resume is missing, truncated or corrupted.
      Interrupted: ``stop`` said stop before the last step (the checkpoint is saved).
    """
    if cfg.peers is not None:
        raise ValueError("train() runs one machine; configs with a 'peers' section are run by zeroth.net.launch")
    if resume and not checkpoints:
        raise ValueError("resume needs checkpoints=True")
    out = out_dir_of(cfg, out_dir)
    cfg = dataclasses.replace(cfg, run=dataclasses.replace(cfg.run, out_dir=str(out)))
    metrics_path = out / "metrics.jsonl"
    _check_start(cfg, out, metrics_path, resume, resume_step)
    t_load = time.perf_counter()
    loaded = _load(cfg)  # before any folder is created: a dataset that fails to load leaves nothing behind
    loaded = loaded._replace(load_time=time.perf_counter() - t_load)
    out.mkdir(parents=True, exist_ok=True)
    ckpt = Checkpointer(out / "checkpoints", keep=cfg.train.keep_checkpoints) if checkpoints else None
    try:
        return _train(cfg, out, metrics_path, ckpt, loaded, resume, resume_step, progress, stop)
    finally:
        if ckpt is not None:
            ckpt.close()


def saved_steps(out: Path) -> list[int]:
    """Steps of the finalized checkpoints in ``out/checkpoints`` (read without creating anything), ascending."""
    ck = out / "checkpoints"
    if not ck.is_dir():
        return []
    return sorted(int(p.name) for p in ck.iterdir() if p.name.isdigit() and p.is_dir())


def _check_start(cfg: Config, out: Path, metrics_path: Path, resume: bool, resume_step: int | None) -> None:
    """Refuse to overwrite a run, to resume nothing, or to resume with a config that changes the parameters."""
    if resume_step is not None and not resume:
        raise ValueError("resume_step needs resume=True")
    steps = saved_steps(out)
    has_metrics = metrics_path.is_file() and metrics_path.stat().st_size > 0
    if not resume and (steps or has_metrics):
        raise ValueError(
            f"output folder {out} already holds a run (checkpoints {steps}, metrics.jsonl); "
            f"pass --resume to continue it or choose another --out"
        )
    if resume and not steps:
        also = " in another --out folder" if has_metrics else ""
        raise CheckpointError(f"no checkpoint in {out}; run without --resume{also} to start")
    if resume:
        check_resumable(cfg, out)


class _Loaded(NamedTuple):
    train_ds: object
    eval_x: object
    eval_y: object
    model: object
    params: object
    load_time: float = 0.0


def _load(cfg: Config) -> _Loaded:
    """The datasets (train split, the eval slice of the test split), the model and its initial parameters."""
    train_ds = _data.load(cfg.data.dataset, "train")
    test_ds = _data.load(cfg.data.dataset, "test")
    eval_n = cfg.data.eval_size or test_ds.x.shape[0]
    try:
        model, params = _objectives.build_model(cfg, train_ds.num_classes, train_ds.x[:1])
    except (TypeError, ValueError) as e:  # a kwarg of the wrong type fails deep inside the model's __call__
        raise ValueError(
            f"config field model.kwargs: model {cfg.model.name!r} cannot be built with {cfg.model.kwargs!r} ({e})"
        ) from None
    return _Loaded(train_ds, test_ds.x[:eval_n], test_ds.y[:eval_n], model, params)


def _train(cfg, out, metrics_path, ckpt, loaded, resume, resume_step, progress, stop) -> RunResult:
    t = cfg.train
    train_ds, eval_x, eval_y, model, params, load_time = loaded
    method = _methods.make_method(cfg, model)
    schedule = _schedules.from_train(t)
    template = jax.eval_shape(lambda p: p, params)  # shapes and dtypes, to restore a checkpoint into
    state = method.init(params, _ref.root_key(cfg.run.seed))  # a method may take the parameters over
    del params
    evaluate = _objectives.make_eval_fn(model, cfg.data.eval_batch_size)

    counters, resumed_from, restart = Counters(), None, None
    if resume:
        steps = ckpt.steps()
        target = resume_step if resume_step is not None else (steps[-1] if steps else None)
        if target is not None:
            restored = ckpt.restore(target, template, state.opt_state)  # saved as the tree, whatever the method holds
            if restored.meta.get("step") != target:
                raise CheckpointError(
                    f"checkpoint {ckpt.directory / str(target)} says step {restored.meta.get('step')}"
                )
            for newer in [s for s in steps if s > target]:
                ckpt.quarantine(newer)
            # the method lays the restored parameters out as its init does
            state = method.init(jax.tree_util.tree_map(jnp.asarray, restored.params), state.key)._replace(
                step=target,
                opt_state=None
                if restored.opt_state is None
                else jax.tree_util.tree_map(jnp.asarray, restored.opt_state),
            )
            counters, resumed_from = _counters_from_meta(restored.meta), target
        # a step-0 checkpoint (a run stopped before its first step) writes its step-0 eval again
        restart = state.step if target else -1
        truncate_after(metrics_path, restart)
    (out / "config.yaml").write_text(to_yaml(cfg))
    start = state.step

    t0 = time.perf_counter() - counters.wall_time
    bar = _Progress(t.steps, start, progress, cfg.run.name)
    writer = MetricsWriter(metrics_path, tensorboard=cfg.run.tensorboard, resumed_after=restart)
    evals: list[dict] = []

    step_time = {"prev": counters.train_time, "last": 0.0}  # train_time before the step, and the step's seconds

    def tick(e: _loop.Event) -> None:
        step_time["last"], step_time["prev"] = e.counters.train_time - step_time["prev"], e.counters.train_time
        bar.tick(e.step, step_time["last"])

    def record(kind: str, step: int, extra: dict, params, c: Counters) -> dict:
        rec = {
            "kind": kind,
            "step": step,
            "time_unix_s": time.time(),
            "wall_time_s": time.perf_counter() - t0,
            **extra,
            "forward_passes": c.forward_passes,
            "backward_passes": c.backward_passes,
            "passes": c.forward_passes + 2 * c.backward_passes,
            "examples": c.examples,
            "payload_bytes_total": c.payload_bytes,
            "train_time_s": c.train_time,
            "digest": _replay.checksum(params),
        }
        writer.write(rec)
        bar.update(step, rec)
        return rec

    def log_hook(e: _loop.Event) -> None:
        # the learning rate of the step just done (step e.step - 1 of the schedule)
        extra = {
            "loss": float(e.info.loss),
            "lr": schedule(e.step - 1),
            "step_time_s": step_time["last"],
            "payload_bytes": e.info.payload_bytes,
        }
        record("train", e.step, {**extra, **(e.info.metrics or {})}, e.state.params, e.counters)

    def eval_hook(e: _loop.Event) -> None:
        evals.append(record("eval", e.step, evaluate(e.state.params, eval_x, eval_y), e.state.params, e.counters))

    def checkpoint_hook(e: _loop.Event) -> None:
        meta = {
            "step": e.step,
            "data_cursor": {"seed": cfg.run.seed, "batch_size": cfg.data.batch_size, "next_step": e.step},
            **e.counters._replace(wall_time=time.perf_counter() - t0)._asdict(),
            "digest": _replay.checksum(e.state.params),
            "config_digest": config_digest(cfg, exclude=RESUME_INVARIANT),
        }
        ckpt.save(e.step, e.state.params, e.state.opt_state, meta)

    hooks = [
        _loop.hook(tick, every=1, reads_params=False),
        _loop.hook(log_hook, every=t.log_every),
        _loop.hook(eval_hook, every=t.eval_every),
    ]
    if ckpt is not None:
        hooks.append(_loop.hook(checkpoint_hook, every=t.checkpoint_every))

    def batches(step: int):
        return _data.batch_at(train_ds, cfg.run.seed, step, cfg.data.batch_size)

    try:
        if start == 0:
            evals.append(record("eval", 0, evaluate(state.params, eval_x, eval_y), state.params, counters))
        state, counters = _loop.train(state, method, batches, hooks, steps=t.steps, counters=counters, stop=stop)
        if state.step < t.steps:  # stopped by `stop` between two steps
            saved = None
            if ckpt is not None:
                if ckpt.latest_step() != state.step:
                    checkpoint_hook(_loop.Event(state.step, state, None, counters, False))
                saved = ckpt.directory / str(state.step)
            raise Interrupted(state.step, t.steps, saved)
    finally:
        writer.close()
        bar.close()
    last_eval = evals[-1] if evals else None
    if last_eval is None:  # resumed at the final step: report the saved final eval
        saved = [r for r in read_metrics(metrics_path, "eval") if r["step"] == t.steps]
        last_eval = saved[-1] if saved else _record_final(evaluate, state.params, eval_x, eval_y)
    result = RunResult(out, max(start, t.steps), _replay.checksum(state.params), last_eval, resumed_from, load_time)
    (out / "summary.json").write_text(json.dumps(run_summary(cfg, result), indent=2) + "\n")
    return result


def run_summary(cfg: Config, result: RunResult) -> dict:
    """``summary.json`` of a single-machine run: the final eval, the run's totals and the final digest."""
    e = result.eval
    return {
        "kind": "single",
        "run": cfg.run.name,
        "steps": result.step,
        "eval_accuracy": e.get("eval_accuracy"),
        "eval_loss": e.get("eval_loss"),
        "forward_passes": e.get("forward_passes"),
        "backward_passes": e.get("backward_passes"),
        "passes": e.get("passes"),
        "payload_bytes": e.get("payload_bytes_total"),
        "wall_time_s": e.get("wall_time_s"),
        "train_time_s": e.get("train_time_s"),
        "load_time_s": result.load_time,
        "resumed_from": result.resumed_from,
        "digest": result.digest,
    }


def _record_final(evaluate, params, x, y) -> dict:
    """An eval record of ``params`` that is not written to metrics (used when nothing is left to train)."""
    return {"kind": "eval", **evaluate(params, x, y), "digest": _replay.checksum(params)}


def summary_line(result: RunResult) -> str:
    """One JSON line with the final numbers of a run."""
    keys = ("step", "eval_accuracy", "eval_loss", "forward_passes", "backward_passes", "wall_time_s", "train_time_s")
    s = {k: result.eval.get(k) for k in keys}
    return json.dumps(
        {
            "out_dir": str(result.out_dir),
            **s,
            "payload_bytes": result.eval.get("payload_bytes_total"),
            "digest": result.digest,
        }
    )
