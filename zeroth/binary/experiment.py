"""The binary learning experiment behind ``zeroth run`` with a ``binary:`` section (seed 002).

For each weight kind (binary, ternary) and binary method (flips, evolution, ste) it trains the
conv stack greedily, layer by layer (:func:`zeroth.binary.layerwise.train_layerwise`), and
reports each layer's test accuracy (its auxiliary head; the last layer's head is the classifier),
the flips per step and the wall-clock. Next to them: a float32 network of the same conv shapes
(ReLU, the same pooling and head, end-to-end backprop with Adam), the speed of the binary ops
against float32 on this machine (:mod:`zeroth.binary.speed`), and a sparse-mutation run over
gRPC with worker processes (:mod:`zeroth.binary.launch`): bytes per round per worker of the
sparse lists next to a dense float32 gradient.

Writes ``results.json`` and ``metrics.jsonl`` (the metrics schema, :class:`Rows`: a ``train`` row per
training step of every model and layer, an ``eval`` row per frozen layer) to the output folder.
"""

from __future__ import annotations

import json
import pathlib
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax

from zeroth import data as zdata
from zeroth.binary import launch
from zeroth.binary import layers as L
from zeroth.binary import layerwise as LW
from zeroth.binary import speed
from zeroth.binary import train as T
from zeroth.binary import worker as W
from zeroth.replay import checksum
from zeroth.train.metrics import MetricsWriter
from zeroth.train.metrics import clear as clear_metrics

__all__ = ["Rows", "run_config", "float_baseline", "plan_for"]


def plan_for(b, weights: str, method: str, batch_size: int, seed: int) -> list:
    """The layer plan ``[(ConvSpec, TrainConfig), ...]`` of one weight kind and method."""
    plan, c_in = [], b.levels
    for c in b.channels:
        spec = L.ConvSpec(c_in=c_in, c_out=c, ternary=weights == "ternary", pool=True)
        cfg = T.TrainConfig(method=method, steps=b.steps, batch_size=batch_size,
                            k=b.evolution_k if method == "evolution" else b.k, min_gain=b.min_gain,
                            head_lr=b.head_lr, ste_lr=b.ste_lr, grid=b.grid, seed=seed)
        plan.append((spec, cfg))
        c_in = c
    return plan


def _maxpool(x):
    return jax.lax.reduce_window(x, -jnp.inf, jax.lax.max, (1, 2, 2, 1), (1, 2, 2, 1), "VALID")


def float_baseline(xtr, ytr, xte, yte, *, channels, levels: int, grid: int, steps: int, batch_size: int, lr: float,
                   seed: int, classes: int = 10, log=None) -> dict:
    """float32 conv stack of the same shapes (3x3 convs, ReLU, 2x2 max-pools, the region-mean head), backprop + Adam.

    Inputs are the same packed thermometer bits, read as ±1 floats. ``log(step_index, loss, params)``
    is called after each step. Returns the test accuracy and mean cross-entropy (``test_loss``),
    the seconds, the losses and the number of conv weights.
    """
    rng = np.random.default_rng([seed, 99])
    params, c_in = [], levels
    for c in channels:
        params.append((jnp.asarray(rng.standard_normal((3, 3, c_in, c)).astype(np.float32) * np.float32(np.sqrt(2 / (9 * c_in)))),
                       jnp.zeros((c,), jnp.float32)))
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
    z = np.concatenate([np.asarray(logits(all_params, jnp.asarray(xte[i:i + 500]))) for i in range(0, len(xte), 500)])
    z64 = z.astype(np.float64)
    ce = np.log(np.sum(np.exp(z64 - z64.max(axis=1, keepdims=True)), axis=1)) + z64.max(axis=1) - z64[np.arange(len(yte)), yte]
    return {"test_accuracy": float(np.mean(np.argmax(z, axis=1) == yte)), "test_loss": float(np.mean(ce)),
            "seconds": seconds, "losses": losses, "weights": int(sum(k.size for k, _ in params))}


def _load(cfg):
    b = cfg.binary
    tr, te = zdata.load(cfg.data.dataset, "train"), zdata.load(cfg.data.dataset, "test")
    n = len(tr.y) if b.train_size == 0 else min(b.train_size, len(tr.y))
    m = len(te.y) if cfg.data.eval_size == 0 else min(cfg.data.eval_size, len(te.y))
    if tr.x.ndim != 4 or tr.x.shape[-1] != 1:
        raise ValueError(f"binary learning needs grey images f32[N, H, W, 1]; {cfg.data.dataset!r} has shape {tr.x.shape}")
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

    def __init__(self, writer: MetricsWriter, step: int = 0, forward_passes: int = 0, backward_passes: int = 0,
                 wall_time_s: float = 0.0):
        self.writer, self.step, self.fwd, self.bwd = writer, step, forward_passes, backward_passes
        self.t0 = time.perf_counter() - wall_time_s
        self.last = time.perf_counter()

    def counters(self) -> dict:
        """What a resumed run starts its rows from."""
        return {"step": self.step, "forward_passes": self.fwd, "backward_passes": self.bwd,
                "wall_time_s": time.perf_counter() - self.t0}

    def _common(self, kind: str, digest: str) -> dict:
        return {"kind": kind, "step": self.step, "time_unix_s": time.time(), "wall_time_s": time.perf_counter() - self.t0,
                "digest": digest, "forward_passes": self.fwd, "backward_passes": self.bwd, "payload_bytes_total": 0}

    def start(self) -> None:
        """Mark the start of a layer's training (the next step's ``step_time_s`` counts from here)."""
        self.last = time.perf_counter()

    def train(self, *, model: str, layer: int, layer_step: int, loss: float, lr: float, flips: int, digest: str,
              cost: tuple[int, int]) -> None:
        now = time.perf_counter()
        self.step, self.fwd, self.bwd = self.step + 1, self.fwd + cost[0], self.bwd + cost[1]
        self.writer.write({**self._common("train", digest), "loss": loss, "lr": lr, "step_time_s": now - self.last,
                           "payload_bytes": 0, "model": model, "layer": layer, "layer_step": layer_step, "flips": flips})
        self.last = now

    def eval(self, *, model: str, layer: int, loss: float, accuracy: float, digest: str) -> None:
        self.writer.write({**self._common("eval", digest), "eval_loss": loss, "eval_accuracy": accuracy,
                           "model": model, "layer": layer})
        self.last = time.perf_counter()


def _layer_log(rows: Rows, name: str, plan: list):
    """The ``log`` of :func:`zeroth.binary.layerwise.train_layerwise` that writes a model's rows."""

    def log(i, rec, obj):
        spec, tcfg = plan[i]
        if rec is None:
            rows.eval(model=name, layer=i, loss=obj.test_loss, accuracy=obj.test_accuracy,
                      digest=L.layer_checksum(obj.layer, spec))
            return
        if rec["step"] == 0:
            rows.start()
        rows.train(model=name, layer=i, layer_step=rec["step"] + 1, loss=rec["loss"],
                   lr=tcfg.ste_lr if tcfg.method == "ste" else tcfg.head_lr, flips=rec["flips"],
                   digest=L.layer_checksum(obj, spec), cost=T.step_cost(tcfg))

    return log


def run_config(cfg, out_dir, argv=None, *, progress: bool = True) -> dict:
    """Run the experiment of a config with a ``binary`` section; returns (and writes) the results."""
    b = cfg.binary
    out = pathlib.Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    t_start = time.perf_counter()
    xtr, ytr, xte, yte, classes = _load(cfg)
    seed, bs = cfg.run.seed, cfg.data.batch_size
    say = print if progress else (lambda *a, **k: None)
    say(f"binary learning: {cfg.data.dataset}, {len(ytr)} train / {len(yte)} test examples, layers {list(b.channels)}")
    results = {"dataset": cfg.data.dataset, "train_size": len(ytr), "test_size": len(yte), "channels": list(b.channels),
               "levels": b.levels, "steps_per_layer": b.steps, "batch_size": bs, "models": []}
    cache = LW.LayerCache()
    clear_metrics(out / "metrics.jsonl")
    with MetricsWriter(out / "metrics.jsonl", tensorboard=cfg.run.tensorboard) as writer:
        rows = Rows(writer)
        for weights in b.weights:
            for method in [m for m in b.methods if m != "float32"]:
                name = f"{weights}/{method}"
                plan = plan_for(b, weights, method, bs, seed)
                t0 = time.perf_counter()
                frozen = LW.train_layerwise(plan, xtr, ytr, xte, yte, classes=classes, cache=cache,
                                            log=_layer_log(rows, name, plan))
                model = {
                    "name": name, "weights": weights, "method": method,
                    "test_accuracy": frozen[-1].test_accuracy,
                    "layer_test_accuracy": [f.test_accuracy for f in frozen],
                    "flips_per_step": [float(np.mean([r["flips"] for r in f.history])) for f in frozen],
                    "final_loss": [float(np.mean([r["loss"] for r in f.history[-10:]])) for f in frozen],
                    "train_seconds": [f.seconds for f in frozen], "wall_s": time.perf_counter() - t0,
                    "checksums": [L.layer_checksum(f.layer, f.spec) for f in frozen],
                    "loss_curves": [[round(r["loss"], 5) for r in f.history] for f in frozen],
                    "flip_curves": [[r["flips"] for r in f.history] for f in frozen],
                }
                results["models"].append(model)
                say(f"  {name:<18} test accuracy {model['test_accuracy']:.4f} (layers {model['layer_test_accuracy']}), "
                    f"{model['wall_s']:.1f} s")
        if "float32" in b.methods:
            t0 = time.perf_counter()
            rows.start()
            last = {"digest": ""}

            def float_log(i, loss, p):
                last["digest"] = checksum(p)
                rows.train(model="float32/backprop", layer=len(b.channels) - 1, layer_step=i + 1, loss=loss,
                           lr=b.float_lr, flips=0, digest=last["digest"], cost=(1, 1))

            fl = float_baseline(xtr, ytr, xte, yte, channels=b.channels, levels=b.levels, grid=b.grid, steps=b.float_steps,
                                batch_size=bs, lr=b.float_lr, seed=seed, classes=classes, log=float_log)
            rows.eval(model="float32/backprop", layer=len(b.channels) - 1, loss=fl["test_loss"],
                      accuracy=fl["test_accuracy"], digest=last["digest"])
            fl.update(name="float32/backprop", wall_s=time.perf_counter() - t0)
            results["float32"] = fl
            say(f"  float32/backprop   test accuracy {fl['test_accuracy']:.4f}, {fl['wall_s']:.1f} s")
    results["layer_cache"] = {"trained": cache.trained, "hits": cache.hits}
    rows = speed.binary_rows(batch=256, features=1024, channels=b.channels[0], image=xtr.shape[1], conv_batch=bs,
                             repeats=b.speed_repeats, warmup=1, host=False)
    results["speed"] = rows
    for r in rows:
        if r["kind"] == "binary":
            say(f"  speed {r['layer']:<8} {r['shape']:<24} binary {r['ops_per_s']:.3g} op/s, "
                f"{r['speedup_vs_float32']:.2f}x float32")
    if b.workers > 0:
        dcfg = W.DistConfig(run_id=f"{cfg.run.name}-{seed}", dataset=cfg.data.dataset, train_size=b.dist_train_size,
                            test_size=len(yte), levels=b.levels, c_out=b.dist_channels, ternary=False, grid=b.grid,
                            batch_size=bs, shards=b.workers, threshold=b.threshold, max_entries=b.max_entries,
                            k=b.dist_k, rounds=b.rounds, seed=seed, founders=b.workers,
                            head="trained" if b.dist_head_steps else "votes", head_steps=b.dist_head_steps,
                            classes=classes)
        dist = launch.run(dcfg, workers=b.workers, kill_at=tuple(b.kill_at), out_dir=out / "distributed")
        results["distributed"] = {k: v for k, v in dist.items() if k != "config"}
        say(f"  sparse mutations: {b.workers} workers, {b.rounds} rounds, test accuracy "
            f"{dist['test_accuracy_before']:.4f} -> {dist['test_accuracy']:.4f}; bytes/round/worker up "
            f"{dist['bytes_up_per_round_per_worker']:.0f} vs dense float32 {dist['dense_float32_bytes_per_round_per_worker']}; "
            f"checksum mismatches {dist['checksum_mismatches']}")
    results["wall_s"] = time.perf_counter() - t_start
    (out / "results.json").write_text(json.dumps(results, indent=1))
    say(f"wrote {out / 'results.json'} ({results['wall_s']:.0f} s)")
    return results
