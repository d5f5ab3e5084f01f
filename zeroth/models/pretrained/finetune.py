"""``python -m zeroth.models.pretrained.finetune CONFIG [--set k=v ...] [--out DIR] [--requantize R]``.

Fine-tunes a pretrained model of :mod:`.modules` as an experiment config says (the configs
``experiments/smollm2_*.yaml`` and ``experiments/minilm_*.yaml``, read by
:func:`zeroth.config.load_config`), with the trainer's own pieces: the ZO method (MeZO / Just
One Byte, exact replay) or backprop of :func:`zeroth.train.trainer.make_method`, its batches
(:func:`zeroth.data.batch_at`) and its evaluation (:func:`zeroth.train.trainer.make_eval_fn`).
The parameters start from :meth:`pretrained_params` (the step-0 evaluation is the zero-shot
accuracy). ``zeroth run CONFIG`` trains the same configs the same way (same batches, keys and
updates: the same digests); this driver adds ``summary.json``. ``--requantize nearest|stochastic``
is short for ``--set train.requantize=...``: SmolLM2 trained in 4 bits
(:func:`zeroth.train.trainer.requantize_method`).

Writes ``config.yaml``, ``metrics.jsonl`` (the trainer's record format, plus ``changed`` =
fraction of quantized weights whose code changed, with ``train.requantize``) and ``summary.json``
to the output folder, and prints the summary as one JSON line: zero-shot and final accuracy,
steps, forward/backward passes, wall and training time, final digest.

Exit codes: 0 done; 2 a bad command line, config or dataset.

Example:
  $ python -m zeroth.models.pretrained.finetune experiments/smollm2_mezo_sentiment.yaml --set train.steps=10
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
from pathlib import Path

__all__ = ["main", "finetune", "build_parser"]


def build_parser() -> argparse.ArgumentParser:
    """The argument parser."""
    p = argparse.ArgumentParser(
        prog="python -m zeroth.models.pretrained.finetune",
        description="Fine-tune a pretrained model (smollm2_prompt, minilm_classifier) as a config says.",
    )
    p.add_argument("config", help="experiment YAML (experiments/smollm2_*.yaml, experiments/minilm_*.yaml)")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="SECTION.FIELD=VALUE",
                   help="override a config field (value parsed as YAML; repeatable)")  # fmt: skip
    p.add_argument("--out", default=None, help="output folder (default: run.out_dir or runs/<run.name>)")
    p.add_argument("--requantize", choices=("nearest", "stochastic"), default=None,
                   help="4-bit forward-only training of smollm2_prompt: requantize onto the GGUF grids after every step "
                        "(same as --set train.requantize=...)")  # fmt: skip
    p.add_argument("--quiet", action="store_true", help="no progress lines on stderr")
    return p


def finetune(cfg, out_dir: str | Path, *, progress: bool = True) -> dict:
    """Run the config; returns the summary dict (also written to ``out_dir/summary.json``)."""
    import jax

    from zeroth import data as _data
    from zeroth import models as _models
    from zeroth import replay as _replay
    from zeroth.config import to_yaml
    from zeroth.train import trainer as _trainer
    from zeroth.train.metrics import MetricsWriter

    if cfg.peers is not None:
        raise ValueError("finetune runs one machine; remove the 'peers' section")
    out = Path(out_dir)
    metrics_path = out / "metrics.jsonl"
    if metrics_path.exists() and metrics_path.stat().st_size:
        raise ValueError(f"output folder {out} already holds a run (metrics.jsonl); choose another --out")
    out.mkdir(parents=True, exist_ok=True)
    t = cfg.train
    train_ds = _data.load(cfg.data.dataset, "train")
    test_ds = _data.load(cfg.data.dataset, "test")
    eval_n = cfg.data.eval_size or test_ds.x.shape[0]
    eval_x, eval_y = test_ds.x[:eval_n], test_ds.y[:eval_n]
    model = _models.build(cfg.model.name, num_classes=train_ds.num_classes, **cfg.model.kwargs)
    if not hasattr(model, "pretrained_params"):
        raise ValueError(f"model {cfg.model.name!r} has no pretrained parameters; use `zeroth run` for models trained from scratch")
    t0 = time.perf_counter()
    params = model.pretrained_params(_models.init_key(cfg.run.seed), train_ds.x[:1])
    load_time = time.perf_counter() - t0
    method = _trainer.make_method(cfg, model)
    opt_state = method.init(params)
    evaluate = _trainer.make_eval_fn(model, cfg.data.eval_batch_size)
    (out / "config.yaml").write_text(to_yaml(cfg))

    counters = {"forward_passes": 0, "backward_passes": 0, "examples": 0, "payload_bytes": 0, "train_time": 0.0}
    start = time.perf_counter()
    evals = []

    def record(writer, kind, step, extra):
        rec = {"kind": kind, "step": step, **extra, **counters,
               "passes": counters["forward_passes"] + 2 * counters["backward_passes"],
               "wall_time": time.perf_counter() - start, "digest": _replay.checksum(params)}  # fmt: skip
        writer.write(rec)
        if progress:
            shown = {k: (round(v, 4) if isinstance(v, float) else v) for k, v in rec.items() if k != "digest"}
            print(f"[{cfg.run.name}] {json.dumps(shown)}", file=sys.stderr, flush=True)
        return rec

    with MetricsWriter(metrics_path) as writer:
        t_eval = time.perf_counter()
        evals.append(record(writer, "eval", 0, {**evaluate(params, eval_x, eval_y), "eval_time": time.perf_counter() - t_eval}))
        for s in range(t.steps):
            batch = _data.batch_at(train_ds, cfg.run.seed, s, cfg.data.batch_size)
            t_step = time.perf_counter()
            params, opt_state, info = method.step(params, opt_state, batch, s)
            jax.block_until_ready(params)
            counters["train_time"] += time.perf_counter() - t_step
            counters["forward_passes"] += info.forward_passes
            counters["backward_passes"] += info.backward_passes
            counters["examples"] += info.forward_passes * cfg.data.batch_size
            counters["payload_bytes"] += info.payload_bytes
            done = s + 1
            if done % t.log_every == 0 or done == t.steps:
                extra = {"loss": float(info.loss)}
                if hasattr(method.step, "last_changed"):
                    extra["changed"] = method.step.last_changed[0]
                record(writer, "train", done, extra)
            if done % t.eval_every == 0 or done == t.steps:
                t_eval = time.perf_counter()
                evals.append(record(writer, "eval", done, {**evaluate(params, eval_x, eval_y), "eval_time": time.perf_counter() - t_eval}))
    summary = {
        "run": cfg.run.name,
        "model": cfg.model.name,
        "dataset": cfg.data.dataset,
        "method": t.method if t.requantize is None else f"zo+requantize-{t.requantize}",
        "steps": t.steps,
        "batch_size": cfg.data.batch_size,
        "eval_examples": int(eval_n),
        "zero_shot_accuracy": evals[0]["eval_accuracy"],
        "final_accuracy": evals[-1]["eval_accuracy"],
        "best_accuracy": max(e["eval_accuracy"] for e in evals),
        "zero_shot_loss": evals[0]["eval_loss"],
        "final_loss": evals[-1]["eval_loss"],
        **counters,
        "passes": counters["forward_passes"] + 2 * counters["backward_passes"],
        "wall_time": time.perf_counter() - start,
        "load_time": load_time,
        "digest": evals[-1]["digest"],
    }
    (out / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    return summary


def main(argv: list[str] | None = None) -> int:
    """Entry point; returns the exit code."""
    args = build_parser().parse_args(sys.argv[1:] if argv is None else argv)
    from zeroth import config as _config
    from zeroth.data import DatasetUnavailable
    from zeroth.models.pretrained.resources import MissingPackage

    try:
        overrides = list(args.overrides) + ([f"train.requantize={args.requantize}"] if args.requantize else [])
        cfg = _config.load_config(args.config, overrides)
        if args.out:
            cfg = dataclasses.replace(cfg, run=dataclasses.replace(cfg.run, out_dir=args.out))
        out = Path(cfg.run.out_dir or Path("runs") / cfg.run.name)
        summary = finetune(cfg, out, progress=not args.quiet)
    except (ValueError, FileNotFoundError, DatasetUnavailable, MissingPackage) as e:
        print(f"finetune: error: {e}", file=sys.stderr)
        return 2
    print(json.dumps(summary))
    return 0


if __name__ == "__main__":
    sys.exit(main())
