"""``zeroth run CONFIG [--set k=v ...] [--out DIR] [--resume [--resume-step N]]``.

Loads an experiment config (:mod:`zeroth.config`), applies ``--set`` overrides and chooses how
to run it: on this machine (:func:`zeroth.train.trainer.train`); with a ``peers`` section as
Just One Byte peers on loopback (``zeroth.net.launch.run_config(cfg, out_dir, argv)``); with a
``pipeline`` section as pipeline stages on loopback (``zeroth.pipeline.launch.run_config``,
AQ-SGD, seed 001); with a ``binary`` section as binary learning
(``zeroth.binary.experiment.run_config``, seed 002); with a ``ravnest`` section as Ravnest nodes on
loopback (``zeroth.cluster.launch.run_config``, seed 003). The dispatcher sits above every system it
chooses between.
``--help-config`` prints every config field with its type, default and description.

Exit codes: 0 done; 2 a bad command line, config, output folder, dataset or checkpoint (one line
says which); 130 interrupted by SIGINT or SIGTERM (a single-machine run finishes the step under
way, saves a checkpoint and prints the command that resumes it).

Example:
  $ zeroth run experiments/mezo_digits.yaml --set train.steps=200 --out runs/quick
"""

from __future__ import annotations

import argparse
import dataclasses
import sys

import zeroth.net.launch
from zeroth import config as _config
from zeroth.binary import experiment as binary_experiment
from zeroth.cluster import launch as ravnest_launch
from zeroth.pipeline import launch as pipeline_launch
from zeroth.data import DatasetUnavailable
from zeroth.data.resources import MissingPackage
from zeroth.train import interrupt, trainer
from zeroth.train.checkpoint import CheckpointError
from zeroth.train.runs import check_out_dir

__all__ = ["main", "build_parser"]


def build_parser() -> argparse.ArgumentParser:
    """The argument parser of ``zeroth run``."""
    p = argparse.ArgumentParser(
        prog="zeroth run",
        description="Train as an experiment config says (ZO with exact replay, or backprop); "
        "writes config.yaml, metrics.jsonl and checkpoints/ to the output folder.",
    )
    p.add_argument("config", nargs="?", help="experiment YAML (see experiments/)")
    p.add_argument(
        "--set",
        dest="overrides",
        action="append",
        default=[],
        metavar="SECTION.FIELD=VALUE",
        help="override a config field; the value is parsed as YAML (repeatable), e.g. --set train.lr=0.01",
    )
    p.add_argument("--out", default=None, help="output folder (default: run.out_dir or runs/<run.name>)")
    p.add_argument("--resume", action="store_true", help="continue from the newest checkpoint in the output folder")
    p.add_argument(
        "--resume-step",
        type=int,
        default=None,
        help="with --resume: continue from this checkpoint step (newer ones are moved aside, not deleted)",
    )
    p.add_argument("--quiet", action="store_true", help="no progress output")
    p.add_argument("--help-config", action="store_true", help="describe every config field and exit")
    return p


def main(argv: list[str]) -> int:
    """Entry point of ``zeroth run``; returns the exit code."""
    args = build_parser().parse_args(argv)
    if args.help_config:
        print(_config.describe())
        return 0
    if not args.config:
        print("zeroth run: error: CONFIG is required (or --help-config)", file=sys.stderr)
        return 2
    if args.resume_step is not None and not args.resume:
        print("zeroth run: error: --resume-step needs --resume", file=sys.stderr)
        return 2

    try:
        return _dispatch(args, argv)
    except (ValueError, FileNotFoundError, CheckpointError, DatasetUnavailable, MissingPackage) as e:
        print(f"zeroth run: error: {e}", file=sys.stderr)
        return 2
    except OSError as e:  # a file the run needs could not be read or written
        print(f"zeroth run: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:  # Ctrl-C where no stop flag was installed (the pipeline and binary runs)
        print("zeroth run: interrupted", file=sys.stderr)
        return interrupt.EXIT_CODE


def _dispatch(args: argparse.Namespace, argv: list[str]) -> int:
    # SIGINT/SIGTERM only set a flag from here on: a single-machine run finishes its step, saves a
    # checkpoint and exits 130; the other systems get the default handling back once chosen.
    with interrupt.catch() as flag:
        cfg = _config.load_config(args.config, args.overrides)
        if args.out:
            cfg = dataclasses.replace(cfg, run=dataclasses.replace(cfg.run, out_dir=args.out))
        out = check_out_dir(trainer.out_dir_of(cfg))
        if cfg.binary is None and cfg.peers is None and cfg.pipeline is None and cfg.ravnest is None:
            return _train(cfg, out, args, argv, flag)
    if flag.is_set():
        print(f"zeroth run: interrupted by {flag.signal_name()} before the run started", file=sys.stderr)
        return interrupt.EXIT_CODE
    if cfg.binary is not None:
        binary_experiment.run_config(cfg, out, argv, progress=not args.quiet)
        return 0
    if cfg.peers is not None:
        return int(zeroth.net.launch.run_config(cfg, out, argv) or 0)
    if cfg.ravnest is not None:  # Ravnest nodes as processes on loopback
        return int(ravnest_launch.run_config(cfg, out, argv, progress=not args.quiet) or 0)
    return int(pipeline_launch.run_config(cfg, out, argv, progress=not args.quiet) or 0)  # stages on loopback


def _train(cfg: _config.Config, out, args: argparse.Namespace, argv: list[str], flag: interrupt.StopFlag) -> int:
    try:
        result = trainer.train(
            cfg, out, resume=args.resume, resume_step=args.resume_step, progress=not args.quiet, stop=flag.is_set
        )
    except interrupt.Interrupted as e:
        saved = f"checkpoint saved in {e.checkpoint}" if e.checkpoint is not None else "no checkpoint saved"
        print(
            f"zeroth run: interrupted by {flag.signal_name()} after step {e.step} of {e.total}; {saved}; "
            f"resume with: {interrupt.resume_command(argv, out)}",
            file=sys.stderr,
            flush=True,
        )
        return interrupt.EXIT_CODE
    print(trainer.summary_line(result))
    return 0

if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
