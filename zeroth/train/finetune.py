"""``python -m zeroth.train.finetune CONFIG [--set k=v ...] [--out DIR] [--requantize R]``.

Fine-tunes a pretrained model of :mod:`zeroth.models.pretrained.modules` as an experiment config
says (the configs ``experiments/smollm2_*.yaml`` and ``experiments/minilm_*.yaml``, read by
:func:`zeroth.config.load_config`): one call to the trainer (:func:`zeroth.train.trainer.train`,
without checkpoints), then a summary. The parameters start from the model's pretrained weights
(the step-0 evaluation is the zero-shot accuracy). ``zeroth run CONFIG`` trains the same configs
the same way (same batches, keys and updates: the same digests); this driver adds
``summary.json``. ``--requantize nearest|stochastic`` is short for ``--set
train.requantize=...``: SmolLM2 trained in 4 bits (:func:`zeroth.methods.q4.requantize_method`).

Writes ``config.yaml``, ``metrics.jsonl`` (the trainer's records, with ``changed`` = fraction of
quantized weights whose code changed, with ``train.requantize``) and ``summary.json`` to the
output folder, and prints the summary as one JSON line: zero-shot and final accuracy, steps,
forward/backward passes, wall, load and training time, final digest.

Exit codes: 0 done; 2 a bad command line, config or dataset.

Example:
  $ python -m zeroth.train.finetune experiments/smollm2_mezo_sentiment.yaml --set train.steps=10
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from pathlib import Path

from zeroth import config as _config
from zeroth import data as _data
from zeroth import models as _models
from zeroth.data import DatasetUnavailable
from zeroth.data.resources import MissingPackage
from zeroth.train import trainer as _trainer
from zeroth.train.metrics import read_metrics

__all__ = ["main", "finetune", "build_parser"]


def build_parser() -> argparse.ArgumentParser:
    """The argument parser."""
    p = argparse.ArgumentParser(
        prog="python -m zeroth.train.finetune",
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
    """Run the config with the trainer (no checkpoints); returns the summary dict (also written to ``out_dir/summary.json``).

    Raises:
      ValueError: a config with peers, a model without pretrained parameters, or an output
        folder that already holds a run.
    """
    if cfg.peers is not None:
        raise ValueError("finetune runs one machine; remove the 'peers' section")
    train_ds = _data.load(cfg.data.dataset, "train")
    model = _models.build(cfg.model.name, num_classes=train_ds.num_classes, **cfg.model.kwargs)
    if not hasattr(model, "pretrained_params"):
        raise ValueError(
            f"model {cfg.model.name!r} has no pretrained parameters; use `zeroth run` for models trained from scratch"
        )
    result = _trainer.train(cfg, out_dir, progress=progress, checkpoints=False)
    out = Path(out_dir)
    evals = read_metrics(out / "metrics.jsonl", "eval")
    t = cfg.train
    counters = ("forward_passes", "backward_passes", "examples", "train_time_s")
    summary = {
        "run": cfg.run.name,
        "model": cfg.model.name,
        "dataset": cfg.data.dataset,
        "method": t.method if t.requantize is None else f"zo+requantize-{t.requantize}",
        "steps": t.steps,
        "batch_size": cfg.data.batch_size,
        "eval_examples": int(cfg.data.eval_size or _data.load(cfg.data.dataset, "test").x.shape[0]),
        "zero_shot_accuracy": evals[0]["eval_accuracy"],
        "final_accuracy": evals[-1]["eval_accuracy"],
        "best_accuracy": max(e["eval_accuracy"] for e in evals),
        "zero_shot_loss": evals[0]["eval_loss"],
        "final_loss": evals[-1]["eval_loss"],
        **{k: evals[-1][k] for k in counters},
        "payload_bytes": evals[-1]["payload_bytes_total"],
        "passes": evals[-1]["passes"],
        "wall_time_s": evals[-1]["wall_time_s"],
        "load_time": result.load_time,
        "digest": result.digest,
    }
    (out / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    return summary


def main(argv: list[str] | None = None) -> int:
    """Entry point; returns the exit code."""
    args = build_parser().parse_args(sys.argv[1:] if argv is None else argv)
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
