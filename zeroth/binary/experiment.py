"""The binary learning experiment behind ``zeroth run`` with a ``binary:`` section (seed 002).

For each weight kind (binary, ternary) and binary method (flips, evolution, ste) it trains the
conv stack greedily, layer by layer (:func:`zeroth.binary.layerwise.train_layerwise`), and
reports each layer's test accuracy (its auxiliary head; the last layer's head is the classifier),
the flips per step and the wall-clock. Next to them: a float32 network of the same conv shapes
(ReLU, the same pooling and head, end-to-end backprop with Adam), the speed of the binary ops
against float32 on this machine (:mod:`zeroth.binary.speed`), and a sparse-mutation run over
gRPC with worker processes (:mod:`zeroth.binary.launch`): bytes per round per worker of the
sparse lists next to a dense float32 gradient.

Writes ``config.yaml``, ``results.json`` and ``metrics.jsonl`` (the metrics schema, :class:`Rows`:
a ``train`` row per training step of every model and layer, an ``eval`` row per frozen layer) to
the output folder. SIGINT/SIGTERM (the ``stop`` flag of :func:`run_config`) finish the training
step under way and save ``checkpoint/`` (the models done, the current model's frozen layers and
the training state of its layer under way); ``--resume`` continues to the uninterrupted run's
results. The float network (a few seconds), the speed measurement and the sparse-mutation run are
not cut: a signal during one is handled when it ends.
"""

from __future__ import annotations

import json
import os
import pathlib
import shutil
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax

from zeroth import config as _config
from zeroth import data as zdata
from zeroth.binary import launch, speed
from zeroth.binary import layers as L
from zeroth.binary import layerwise as LW
from zeroth.binary import train as T
from zeroth.binary import worker as W
from zeroth.replay import checksum
from zeroth.train import interrupt
from zeroth.train.checkpoint import CheckpointError
from zeroth.train.metrics import MetricsWriter, truncate_after
from zeroth.train.metrics import clear as clear_metrics

__all__ = [
    "PHASES",
    "RESUME_INVARIANT",
    "Rows",
    "run_config",
    "float_baseline",
    "plan_for",
    "save_checkpoint",
    "finish_checkpoint_swap",
]


def plan_for(b, weights: str, method: str, batch_size: int, seed: int) -> list:
    """The layer plan ``[(ConvSpec, TrainConfig), ...]`` of one weight kind and method."""
    plan, c_in = [], b.levels
    for c in b.channels:
        spec = L.ConvSpec(c_in=c_in, c_out=c, ternary=weights == "ternary", pool=True)
        cfg = T.TrainConfig(
            method=method,
            steps=b.steps,
            batch_size=batch_size,
            k=b.evolution_k if method == "evolution" else b.k,
            min_gain=b.min_gain,
            thresh_k=b.thresh_k if method == "flips" else 0,
            head_lr=b.head_lr,
            ste_lr=b.ste_lr,
            grid=b.grid,
            seed=seed,
        )
        plan.append((spec, cfg))
        c_in = c
    return plan


def _maxpool(x):
    return jax.lax.reduce_window(x, -jnp.inf, jax.lax.max, (1, 2, 2, 1), (1, 2, 2, 1), "VALID")


def float_baseline(
    xtr,
    ytr,
    xte,
    yte,
    *,
    channels,
    levels: int,
    grid: int,
    steps: int,
    batch_size: int,
    lr: float,
    seed: int,
    classes: int = 10,
    log=None,
) -> dict:
    """float32 conv stack of the same shapes (3x3 convs, ReLU, 2x2 max-pools, the region-mean head), backprop + Adam.

    Inputs are the same packed thermometer bits, read as ±1 floats. ``log(step_index, loss, params)``
    is called after each step. Returns the test accuracy and mean cross-entropy (``test_loss``),
    the seconds, the losses and the number of conv weights.
    """
    rng = np.random.default_rng([seed, 99])
    params, c_in = [], levels
    for c in channels:
        params.append(
            (
                jnp.asarray(
                    rng.standard_normal((3, 3, c_in, c)).astype(np.float32) * np.float32(np.sqrt(2 / (9 * c_in)))
                ),
                jnp.zeros((c,), jnp.float32),
            )
        )
        c_in = c
    h = xtr.shape[1] // 2 ** (len(channels) - 1)
    reg = L.regions(h, h, grid)
    head = L.init_head(c_in, len(reg.counts), classes)
    all_params = (params, head)

    def features(ps, xb):
        x = L.unpack_pm1(xb, levels)
        for i, (k, bias) in enumerate(ps):
            x = jax.lax.conv_general_dilated(x, k, (1, 1), "SAME", dimension_numbers=("NHWC", "HWIO", "NHWC"))
            x = jax.nn.relu(x + bias[None, None, None, :])
            if i < len(ps) - 1:
                x = _maxpool(x)
        return x.reshape(x.shape[0], -1, x.shape[-1])

    def loss_fn(p, xb, yb):
        z = L.head_logits(p[1], features(p[0], xb), reg)
        return jnp.mean(jax.nn.logsumexp(z, axis=-1) - jnp.take_along_axis(z, yb[:, None], axis=-1)[:, 0])

    opt = optax.adam(lr)
    state = opt.init(all_params)

    @jax.jit
    def step(p, s, xb, yb):
        loss, g = jax.value_and_grad(loss_fn)(p, xb, yb)
        with jax.numpy_dtype_promotion("standard"):
            upd, s = opt.update(g, s, p)
        return optax.apply_updates(p, upd), s, loss

    logits = jax.jit(lambda p, xb: L.head_logits(p[1], features(p[0], xb), reg))
    t0, losses = time.perf_counter(), []
    for i in range(steps):
        idx = np.random.default_rng([seed, 98, i]).choice(len(ytr), size=min(batch_size, len(ytr)), replace=False)
        all_params, state, loss = step(all_params, state, jnp.asarray(xtr[idx]), jnp.asarray(ytr[idx]))
        losses.append(float(loss))
        if log is not None:
            log(i, losses[-1], all_params)
    seconds = time.perf_counter() - t0
    z = np.concatenate([np.asarray(logits(all_params, jnp.asarray(xte[i : i + 500]))) for i in range(0, len(xte), 500)])
    z64 = z.astype(np.float64)
    ce = (
        np.log(np.sum(np.exp(z64 - z64.max(axis=1, keepdims=True)), axis=1))
        + z64.max(axis=1)
        - z64[np.arange(len(yte)), yte]
    )
    return {
        "test_accuracy": float(np.mean(np.argmax(z, axis=1) == yte)),
        "test_loss": float(np.mean(ce)),
        "seconds": seconds,
        "losses": losses,
        "weights": int(sum(k.size for k, _ in params)),
    }


def _load(cfg):
    b = cfg.binary
    tr, te = zdata.load(cfg.data.dataset, "train"), zdata.load(cfg.data.dataset, "test")
    n = len(tr.y) if b.train_size == 0 else min(b.train_size, len(tr.y))
    m = len(te.y) if cfg.data.eval_size == 0 else min(cfg.data.eval_size, len(te.y))
    if tr.x.ndim != 4 or tr.x.shape[-1] != 1:
        raise ValueError(
            f"binary learning needs grey images f32[N, H, W, 1]; {cfg.data.dataset!r} has shape {tr.x.shape}"
        )
    xtr, xte = L.encode_thermometer(tr.x[:n], b.levels), L.encode_thermometer(te.x[:m], b.levels)
    return xtr, np.asarray(tr.y[:n], np.int32), xte, np.asarray(te.y[:m], np.int32), tr.num_classes


class Rows:
    """The rows of a binary run's ``metrics.jsonl`` (the schema of :mod:`zeroth.train.metrics`).

    One ``step`` counts every training step of the run, over every model and layer in the order
    they train (so it never decreases); each ``train`` row names its ``model`` (``binary/flips``,
    ..., ``float32/backprop``), ``layer`` and ``layer_step`` (steps done in that layer), and adds
    ``flips`` (weights changed by the step). ``digest`` is the checksum of the weights being trained
    (:func:`zeroth.binary.layers.layer_checksum` of the packed layer; the float network:
    :func:`zeroth.replay.checksum` of its parameters). ``forward_passes`` and ``backward_passes``
    count batch passes (:func:`zeroth.binary.train.step_cost`); no bytes travel (``payload_bytes``
    0). An ``eval`` row follows each frozen layer: its auxiliary head on the test set.
    """

    def __init__(
        self,
        writer: MetricsWriter,
        step: int = 0,
        forward_passes: int = 0,
        backward_passes: int = 0,
        wall_time_s: float = 0.0,
    ):
        self.writer, self.step, self.fwd, self.bwd = writer, step, forward_passes, backward_passes
        self.t0 = time.perf_counter() - wall_time_s
        self.last = time.perf_counter()

    def counters(self) -> dict:
        """What a resumed run starts its rows from."""
        return {
            "step": self.step,
            "forward_passes": self.fwd,
            "backward_passes": self.bwd,
            "wall_time_s": time.perf_counter() - self.t0,
        }

    def _common(self, kind: str, digest: str) -> dict:
        return {
            "kind": kind,
            "step": self.step,
            "time_unix_s": time.time(),
            "wall_time_s": time.perf_counter() - self.t0,
            "digest": digest,
            "forward_passes": self.fwd,
            "backward_passes": self.bwd,
            "payload_bytes_total": 0,
        }

    def start(self) -> None:
        """Mark the start of a layer's training (the next step's ``step_time_s`` counts from here)."""
        self.last = time.perf_counter()

    def train(
        self,
        *,
        model: str,
        layer: int,
        layer_step: int,
        loss: float,
        lr: float,
        flips: int,
        digest: str,
        cost: tuple[int, int],
    ) -> None:
        now = time.perf_counter()
        self.step, self.fwd, self.bwd = self.step + 1, self.fwd + cost[0], self.bwd + cost[1]
        self.writer.write(
            {
                **self._common("train", digest),
                "loss": loss,
                "lr": lr,
                "step_time_s": now - self.last,
                "payload_bytes": 0,
                "model": model,
                "layer": layer,
                "layer_step": layer_step,
                "flips": flips,
            }
        )
        self.last = now

    def eval(self, *, model: str, layer: int, loss: float, accuracy: float, digest: str) -> None:
        self.writer.write(
            {
                **self._common("eval", digest),
                "eval_loss": loss,
                "eval_accuracy": accuracy,
                "model": model,
                "layer": layer,
            }
        )
        self.last = time.perf_counter()


def _layer_log(rows: Rows, name: str, plan: list):
    """The ``log`` of :func:`zeroth.binary.layerwise.train_layerwise` that writes a model's rows."""

    def log(i, rec, obj):
        spec, tcfg = plan[i]
        if rec is None:
            rows.eval(
                model=name,
                layer=i,
                loss=obj.test_loss,
                accuracy=obj.test_accuracy,
                digest=L.layer_checksum(obj.layer, spec),
            )
            return
        if rec["step"] == 0:
            rows.start()
        rows.train(
            model=name,
            layer=i,
            layer_step=rec["step"] + 1,
            loss=rec["loss"],
            lr=tcfg.ste_lr if tcfg.method == "ste" else tcfg.head_lr,
            flips=rec["flips"],
            digest=L.layer_checksum(obj, spec),
            cost=T.step_cost(tcfg),
        )

    return log


PHASES = ("models", "float32", "speed", "distributed")
RESUME_INVARIANT = ("run.out_dir", "run.name", "run.tensorboard")  # fields a resumed run may change


def _model_result(name: str, weights: str, method: str, frozen: list, wall_s: float) -> dict:
    return {
        "name": name,
        "weights": weights,
        "method": method,
        "test_accuracy": frozen[-1].test_accuracy,
        "layer_test_accuracy": [f.test_accuracy for f in frozen],
        "flips_per_step": [float(np.mean([r["flips"] for r in f.history])) for f in frozen],
        "final_loss": [float(np.mean([r["loss"] for r in f.history[-10:]])) for f in frozen],
        "train_seconds": [f.seconds for f in frozen],
        "wall_s": wall_s,
        "checksums": [L.layer_checksum(f.layer, f.spec) for f in frozen],
        "loss_curves": [[round(r["loss"], 5) for r in f.history] for f in frozen],
        "flip_curves": [[r["flips"] for r in f.history] for f in frozen],
    }


def save_checkpoint(
    folder: pathlib.Path, state: dict, done: list = (), layer: T.LayerState | None = None
) -> pathlib.Path:
    """Write the checkpoint of an interrupted run to ``folder`` (replaced atomically) and return it.

    ``state.json``: the phase to resume, the model index, the results so far, the layer cache's
    counters and the metrics counters; ``frozen/<key>.npz``: the current model's frozen layers;
    ``layer.npz``: the state of the layer in training (:func:`zeroth.binary.train.save_state`).
    """
    tmp = folder.with_name(folder.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    cache = LW.LayerCache(tmp / "frozen")
    for fr in done:
        cache.put(fr)
    if layer is not None:
        T.save_state(tmp / "layer.npz", layer)
    (tmp / "state.json").write_text(
        json.dumps({**state, "frozen": [fr.key for fr in done], "layer": layer is not None})
    )
    old = folder.with_name(folder.name + ".old")
    if folder.exists():
        os.replace(folder, old)
    os.replace(tmp, folder)
    shutil.rmtree(old, ignore_errors=True)
    return folder


def finish_checkpoint_swap(folder: pathlib.Path) -> bool:
    """Complete a :func:`save_checkpoint` cut between its two renames: ``folder`` is gone, its
    previous contents are ``<folder>.old`` and the new checkpoint, written whole before the first
    rename, is ``<folder>.tmp``. The new one takes its place; returns whether there was one to finish."""
    tmp, old = folder.with_name(folder.name + ".tmp"), folder.with_name(folder.name + ".old")
    if folder.exists() or not old.is_dir() or not (tmp / "state.json").is_file():
        return False
    os.replace(tmp, folder)
    shutil.rmtree(old, ignore_errors=True)
    return True


def _check_start(cfg, out: pathlib.Path, resume: bool) -> dict | None:
    """Refuse to overwrite a run or to resume nothing; the saved state of a run to resume."""
    ck = out / "checkpoint"
    finish_checkpoint_swap(ck)
    held = [n for n in ("results.json", "checkpoint", "metrics.jsonl") if (out / n).exists()]
    if not resume:
        if held:
            raise ValueError(
                f"output folder {out} already holds a run ({', '.join(held)}); "
                "pass --resume to continue it or choose another --out"
            )
        return None
    if not (ck / "state.json").is_file():
        if (out / "results.json").exists():
            raise ValueError(f"output folder {out} holds a finished binary run (results.json): nothing to resume")
        raise CheckpointError(f"no checkpoint in {out}; run without --resume to start")
    state = json.loads((ck / "state.json").read_text())
    if state["config_digest"] != _config.config_digest(cfg, exclude=RESUME_INVARIANT):
        saved = _config.load_config(out / "config.yaml")
        fields = [f for f in _config.diff(saved, cfg) if f not in RESUME_INVARIANT]
        raise ValueError(
            f"--resume: the config differs from the interrupted run's ({out / 'config.yaml'}) in {fields}; "
            "resume with the same config or choose another --out"
        )
    return state


def run_config(cfg, out_dir, argv=None, *, progress: bool = True, resume: bool = False, stop=None) -> dict:
    """Run the experiment of a config with a ``binary`` section; returns (and writes) the results.

    Args:
      resume: continue the interrupted run in ``out_dir`` from its checkpoint.
      stop: called before every training step (and before the float network, the speed
        measurement and the sparse-mutation run); when it returns True the step under way
        finishes, a checkpoint is saved to ``out_dir/checkpoint/`` and
        :class:`zeroth.train.interrupt.Interrupted` is raised. A resumed run ends on the results
        (checksums, accuracies, losses) of the uninterrupted run.

    Raises:
      ValueError: ``out_dir`` holds a run and ``resume`` is False, or the config differs from
        the interrupted run's; CheckpointError: ``resume`` without a checkpoint.
    """
    b = cfg.binary
    out = pathlib.Path(out_dir)
    saved = _check_start(cfg, out, resume)
    stop = stop or (lambda: False)
    xtr, ytr, xte, yte, classes = _load(cfg)
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.yaml").write_text(_config.to_yaml(cfg))
    ck = out / "checkpoint"
    seed, bs = cfg.run.seed, cfg.data.batch_size
    say = print if progress else (lambda *a, **k: None)
    say(
        f"binary learning: {cfg.data.dataset}, {len(ytr)} train / {len(yte)} test examples, layers {list(b.channels)}"
        + (f"; resumed at step {saved['rows']['step']} ({saved['phase']})" if saved else "")
    )
    models = [(w, m) for w in b.weights for m in b.methods if m != "float32"]
    total = len(models) * len(b.channels) * b.steps + (b.float_steps if "float32" in b.methods else 0)
    if saved is None:
        results = {
            "dataset": cfg.data.dataset,
            "train_size": len(ytr),
            "test_size": len(yte),
            "channels": list(b.channels),
            "levels": b.levels,
            "steps_per_layer": b.steps,
            "batch_size": bs,
            "models": [],
        }
        clear_metrics(out / "metrics.jsonl")
    else:
        results = saved["results"]
        truncate_after(out / "metrics.jsonl", saved["rows"]["step"])
    cache = LW.LayerCache()
    cache.trained, cache.hits = saved["cache"] if saved else (0, 0)
    phase = PHASES.index(saved["phase"]) if saved else 0
    t_start = time.perf_counter() - (saved["elapsed_s"] if saved else 0.0)

    def interrupted(phase_name: str, model: int = 0, done=(), layer=None, model_s: float = 0.0):
        state = {
            "phase": phase_name,
            "model": model,
            "model_elapsed_s": model_s,
            "results": results,
            "cache": [cache.trained, cache.hits],
            "rows": rows.counters(),
            "elapsed_s": time.perf_counter() - t_start,
            "config_digest": _config.config_digest(cfg, exclude=RESUME_INVARIANT),
        }
        return interrupt.Interrupted(rows.step, total, save_checkpoint(ck, state, done, layer))

    with MetricsWriter(
        out / "metrics.jsonl", tensorboard=cfg.run.tensorboard, resumed_after=saved["rows"]["step"] if saved else None
    ) as writer:
        rows = Rows(writer, **saved["rows"]) if saved else Rows(writer)
        if phase == 0:
            first = saved["model"] if saved else 0
            for m, (weights, method) in enumerate(models[first:], first):
                name = f"{weights}/{method}"
                plan = plan_for(b, weights, method, bs, seed)
                done, layer, t0 = [], None, time.perf_counter()
                if saved is not None and m == first:
                    done, layer = _restore_layers(ck, saved, plan, xtr, classes)
                    t0 -= saved["model_elapsed_s"]
                try:
                    frozen = LW.train_layerwise(
                        plan,
                        xtr,
                        ytr,
                        xte,
                        yte,
                        classes=classes,
                        cache=cache,
                        log=_layer_log(rows, name, plan),
                        done=done,
                        state=layer,
                        stop=stop,
                    )
                except LW.Interrupted as e:
                    raise interrupted("models", m, e.done, e.state, time.perf_counter() - t0) from None
                model = _model_result(name, weights, method, frozen, time.perf_counter() - t0)
                results["models"].append(model)
                say(
                    f"  {name:<18} test accuracy {model['test_accuracy']:.4f} (layers {model['layer_test_accuracy']}), "
                    f"{model['wall_s']:.1f} s"
                )
            phase = 1
        results["layer_cache"] = {"trained": cache.trained, "hits": cache.hits}
        if phase == 1:
            if "float32" in b.methods:
                if stop():
                    raise interrupted("float32")
                results["float32"] = _float32(cfg, rows, xtr, ytr, xte, yte, classes)
                say(
                    f"  float32/backprop   test accuracy {results['float32']['test_accuracy']:.4f}, "
                    f"{results['float32']['wall_s']:.1f} s"
                )
            phase = 2
        if phase == 2:
            if stop():
                raise interrupted("speed")
            results["speed"] = speed.binary_rows(
                batch=256,
                features=1024,
                channels=b.channels[0],
                image=xtr.shape[1],
                conv_batch=bs,
                repeats=b.speed_repeats,
                warmup=1,
                host=False,
            )
            for r in results["speed"]:
                if r["kind"] == "binary":
                    say(
                        f"  speed {r['layer']:<8} {r['shape']:<24} binary {r['ops_per_s']:.3g} op/s, "
                        f"{r['speedup_vs_float32']:.2f}x float32"
                    )
            phase = 3
        if b.workers > 0:
            if stop():
                raise interrupted("distributed")
            results["distributed"] = _distributed(cfg, out, len(yte), classes, say)
    results["wall_s"] = time.perf_counter() - t_start
    (out / "results.json").write_text(json.dumps(results, indent=1))
    shutil.rmtree(ck, ignore_errors=True)
    say(f"wrote {out / 'results.json'} ({results['wall_s']:.0f} s)")
    return results


def _restore_layers(ck: pathlib.Path, saved: dict, plan: list, xtr, classes: int) -> tuple[list, T.LayerState | None]:
    """The frozen layers and the layer state of the model the checkpoint stopped in."""
    cache = LW.LayerCache(ck / "frozen")
    done = []
    for i, key in enumerate(saved["frozen"]):
        fr = cache.get(key, plan[i][0])
        if fr is None:
            raise CheckpointError(f"checkpoint {ck} lists frozen layer {key[:16]} but holds no frozen/{key}.npz")
        done.append(fr)
    if not saved["layer"]:
        return done, None
    i = len(done)
    spec, tcfg = plan[i]
    template = T.init_state(spec, done[-1].out_train if done else xtr, tcfg, classes=classes, layer_index=i)
    try:
        return done, T.load_state(ck / "layer.npz", template)
    except (OSError, ValueError, KeyError) as e:
        raise CheckpointError(f"checkpoint {ck}: layer {i}'s state cannot be restored ({e})") from None


def _float32(cfg, rows: Rows, xtr, ytr, xte, yte, classes: int) -> dict:
    """The float32 baseline, its rows written (a train row per step, then its eval row)."""
    b = cfg.binary
    t0 = time.perf_counter()
    rows.start()
    last = {"digest": ""}

    def float_log(i, loss, p):
        last["digest"] = checksum(p)
        rows.train(
            model="float32/backprop",
            layer=len(b.channels) - 1,
            layer_step=i + 1,
            loss=loss,
            lr=b.float_lr,
            flips=0,
            digest=last["digest"],
            cost=(1, 1),
        )

    fl = float_baseline(
        xtr,
        ytr,
        xte,
        yte,
        channels=b.channels,
        levels=b.levels,
        grid=b.grid,
        steps=b.float_steps,
        batch_size=cfg.data.batch_size,
        lr=b.float_lr,
        seed=cfg.run.seed,
        classes=classes,
        log=float_log,
    )
    rows.eval(
        model="float32/backprop",
        layer=len(b.channels) - 1,
        loss=fl["test_loss"],
        accuracy=fl["test_accuracy"],
        digest=last["digest"],
    )
    fl.update(name="float32/backprop", wall_s=time.perf_counter() - t0)
    return fl


def dist_config(cfg, test_size: int | None = None, classes: int | None = None) -> W.DistConfig:
    """The sparse-mutation run of a config with a ``binary`` section (the server and every worker
    derive the same one); ``test_size`` and ``classes`` default to the dataset's (it is loaded)."""
    b, seed = cfg.binary, cfg.run.seed
    if test_size is None or classes is None:
        _, _, xte, _, classes = _load(cfg)
        test_size = len(xte)
    return W.DistConfig(
        run_id=f"{cfg.run.name}-{seed}",
        dataset=cfg.data.dataset,
        train_size=b.dist_train_size,
        test_size=test_size,
        levels=b.levels,
        c_out=b.dist_channels,
        ternary=False,
        grid=b.grid,
        batch_size=cfg.data.batch_size,
        shards=b.workers,
        threshold=b.threshold,
        max_entries=b.max_entries,
        k=b.dist_k,
        rounds=b.rounds,
        seed=seed,
        founders=b.workers,
        min_workers=b.min_workers or b.workers // 2 + 1,
        head="trained" if b.dist_head_steps else "votes",
        head_steps=b.dist_head_steps,
        classes=classes,
    )


def _distributed(cfg, out: pathlib.Path, test_size: int, classes: int, say) -> dict:
    """The sparse-mutation run over gRPC with worker processes (:mod:`zeroth.binary.launch`)."""
    b = cfg.binary
    dcfg = dist_config(cfg, test_size, classes)
    dist = launch.run(dcfg, workers=b.workers, kill_at=tuple(b.kill_at), out_dir=out / "distributed")
    say(
        f"  sparse mutations: {b.workers} workers, {b.rounds} rounds, test accuracy "
        f"{dist['test_accuracy_before']:.4f} -> {dist['test_accuracy']:.4f}; bytes/round/worker up "
        f"{dist['bytes_up_per_round_per_worker']:.0f} vs dense float32 {dist['dense_float32_bytes_per_round_per_worker']}; "
        f"checksum mismatches {dist['checksum_mismatches']}"
    )
    return {k: v for k, v in dist.items() if k != "config"}
