"""``zeroth run CONFIG [--set k=v ...] [--out DIR] [--resume [--resume-step N]] [--seeds S1,S2,...]``.

Loads an experiment config (:mod:`zeroth.config`), applies ``--set`` overrides and chooses how
to run it: on this machine (:func:`zeroth.train.trainer.train`); with a ``peers`` section as
Just One Byte peers on loopback (``zeroth.net.launch.run_config(cfg, out_dir, argv)``); with a
``pipeline`` section as pipeline stages on loopback (``zeroth.pipeline.launch.run_config``,
AQ-SGD, seed 001); with a ``binary`` section as binary learning
(``zeroth.binary.experiment.run_config``, seed 002); with a ``ravnest`` section as Ravnest nodes on
loopback (``zeroth.cluster.launch.run_config``, seed 003); a config with a top-level ``runs``
list is a Marsit experiment (:mod:`zeroth.marsit`, seed 004: its own schema, every run of the list
trained with M CPU devices as M workers, the device count set before jax starts its backend;
``--set`` merges into every run; ``--resume`` keeps the finished runs and trains the others again).
The dispatcher sits above every system it chooses between.
``--help-config`` prints every config field with its type, default and description.
``--seeds 0,1,2`` is a sweep: the config once per seed, into ``OUT/seed_<s>/``, and
``OUT/sweep.json`` listing each run's folder, exit code and summary.

Exit codes: 0 done; 2 a bad command line, config, output folder, dataset or checkpoint (one line
says which); 130 interrupted by SIGINT or SIGTERM (a single-machine, peer, pipeline or binary
learning run finishes the step under way, saves a checkpoint and prints the command that resumes
it).

Example:
  $ zeroth run experiments/mezo_digits.yaml --set train.steps=200 --out runs/quick
"""

from __future__ import annotations

import argparse
import dataclasses
import sys

import zeroth.net.launch
from zeroth import config as _config
from zeroth import marsit
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
    p.add_argument(
        "--seeds",
        default=None,
        metavar="S1,S2,...",
        help="a sweep: run the config once per seed (run.seed), into OUT/seed_<s>/, and write OUT/sweep.json; "
        "with --resume, finished seeds are kept and the others resumed or started",
    )
    p.add_argument("--help-config", action="store_true", help="describe every config field and exit")
    return p


def main(argv: list[str]) -> int:
    """Entry point of ``zeroth run``; returns the exit code."""
    args = build_parser().parse_args(argv)
    if args.help_config:
        print(_config.describe())
        print(
            "\nA Marsit experiment (a config with a top-level `runs:` list) has instead a base of the fields below "
            "and `runs:`, a list of partial overrides of them, one per run (each entry needs its `label`):"
        )
        print(_config.describe(marsit.config.RunSpec))
        return 0
    if not args.config:
        print("zeroth run: error: CONFIG is required (or --help-config)", file=sys.stderr)
        return 2
    if args.resume_step is not None and not args.resume:
        print("zeroth run: error: --resume-step needs --resume", file=sys.stderr)
        return 2

    try:
        if args.seeds is not None:
            return _sweep(args)
        with interrupt.catch() as flag:  # a signal here only sets the flag (see _dispatch)
            raw = marsit.config.read_config(args.config)
        if flag.is_set():
            print(f"zeroth run: interrupted by {flag.signal_name()} before the run started", file=sys.stderr)
            return interrupt.EXIT_CODE
        if marsit.is_config(raw):
            return _marsit(args, argv, raw)
        return _dispatch(args, argv)
    except (ValueError, FileNotFoundError, CheckpointError, DatasetUnavailable, MissingPackage) as e:
        print(f"zeroth run: error: {e}", file=sys.stderr)
        return 2
    except OSError as e:  # a file the run needs could not be read or written
        print(f"zeroth run: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:  # Ctrl-C where no stop flag was installed (Ravnest runs)
        print("zeroth run: interrupted", file=sys.stderr)
        return interrupt.EXIT_CODE


def _dispatch(args: argparse.Namespace, argv: list[str]) -> int:
    # SIGINT/SIGTERM only set a flag from here on: a single-machine, pipeline or binary learning run
    # finishes its step, saves a checkpoint and exits 130; peers and Ravnest handle signals themselves.
    with interrupt.catch() as flag:
        cfg = _config.load_config(args.config, args.overrides)
        if args.out:
            cfg = dataclasses.replace(cfg, run=dataclasses.replace(cfg.run, out_dir=args.out))
        out = check_out_dir(trainer.out_dir_of(cfg))
        if cfg.system is None:  # the config holds one system section at most (zeroth.config.SYSTEMS)
            return _train(cfg, out, args, argv, flag)
        if cfg.system == "binary":
            return _binary(cfg, out, args, argv, flag)
        if cfg.system == "pipeline":
            return _pipeline(cfg, out, args, argv, flag)
    if flag.is_set():
        print(f"zeroth run: interrupted by {flag.signal_name()} before the run started", file=sys.stderr)
        return interrupt.EXIT_CODE
    if cfg.system == "peers":
        return int(zeroth.net.launch.run_config(cfg, out, argv) or 0)
    if cfg.system == "ravnest":  # Ravnest nodes as processes on loopback
        return int(ravnest_launch.run_config(cfg, out, argv, progress=not args.quiet) or 0)
    raise ValueError(f"the config's system {cfg.system!r} is not one zeroth run can launch")


def _marsit(args: argparse.Namespace, argv: list[str], raw: dict) -> int:
    """A Marsit config (``runs:`` list): every run into one folder (:func:`zeroth.marsit.run_config`)."""
    if args.resume_step is not None:
        raise ValueError("--resume-step: a Marsit run resumes by run (the finished ones are kept), not by step")
    with interrupt.catch() as flag:
        runs = marsit.load_runs_dict(raw, args.overrides, where=args.config)
        name = str(raw.get("name") or "marsit")
        out = check_out_dir(args.out or f"runs/{name}")
        try:
            result = marsit.run_config(
                runs, out, name=name, resume=args.resume, stop=flag.is_set, progress=None if args.quiet else print
            )
        except marsit.Stopped as e:
            print(
                f"zeroth run: interrupted by {flag.signal_name()} in run {e.label!r} after round {e.step} of {e.total}; "
                f"{e.finished} of {e.runs} runs finished and kept in {out}; resume with: "
                f"{interrupt.resume_command(argv, out)}",
                file=sys.stderr,
                flush=True,
            )
            return interrupt.EXIT_CODE
    if not args.quiet:
        print(marsit.table(result["runs"]))
    print(f"zeroth run: {result['finished']} of {result['total']} Marsit runs done; {out / 'summary.json'}")
    return 0


def _parse_seeds(text: str) -> list[int]:
    try:
        seeds = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise ValueError(f"--seeds {text!r}: expected integers separated by commas, e.g. --seeds 0,1,2") from None
    if not seeds or len(set(seeds)) != len(seeds):
        raise ValueError(f"--seeds {text!r}: expected distinct integers, e.g. --seeds 0,1,2")
    return seeds


def _sweep(args: argparse.Namespace) -> int:
    """``--seeds``: one run per seed into ``OUT/seed_<s>``, then ``OUT/sweep.json`` (seed, folder, exit code, summary)."""
    import json
    from pathlib import Path

    seeds = _parse_seeds(args.seeds)
    if args.resume_step is not None:
        raise ValueError("--resume-step names one run's checkpoint; a sweep resumes each seed from its newest")
    raw = marsit.config.read_config(args.config)
    if marsit.is_config(raw):  # every run of the list gets the seed
        seed_key = "seed"
        runs = marsit.load_runs_dict(raw, args.overrides, where=args.config)
        default_out = Path("runs") / str(raw.get("name") or "marsit")
        if len({r.seed for r in runs}) > 1:
            raise ValueError(
                f"--seeds: the runs of {args.config} set their own seeds ({sorted({r.seed for r in runs})}); "
                "a sweep would give them all one seed"
            )
    else:
        seed_key = "run.seed"
        default_out = trainer.out_dir_of(_config.load_config(args.config, args.overrides))
    base = check_out_dir(Path(args.out) if args.out else default_out)
    rows = []
    for seed in seeds:
        out = base / f"seed_{seed}"
        summary = out / "summary.json"
        if args.resume and summary.is_file():
            code = 0
            print(f"zeroth run: seed {seed}: finished earlier in {out}")
        else:
            argv = [
                args.config,
                *[a for o in args.overrides for a in ("--set", o)],
                "--set",
                f"{seed_key}={seed}",
                "--out",
                str(out),
            ]
            argv += ["--resume"] if args.resume and out.is_dir() else []
            argv += ["--quiet"] if args.quiet else []
            if not args.quiet:
                print(f"zeroth run: seed {seed} ({seeds.index(seed) + 1} of {len(seeds)}) -> {out}", flush=True)
            code = main(argv)
        rows.append(
            {
                "seed": seed,
                "out": str(out),
                "exit_code": code,
                "summary": json.loads(summary.read_text()) if summary.is_file() else None,
            }
        )
        base.mkdir(parents=True, exist_ok=True)
        (base / "sweep.json").write_text(
            json.dumps({"config": args.config, "overrides": args.overrides, "runs": rows}, indent=1)
        )
        if code != 0:
            print(
                f"zeroth run: seed {seed} ended with exit code {code}; the sweep stops (resume it with --resume)",
                file=sys.stderr,
            )
            return code
    print(f"zeroth run: sweep of {len(seeds)} seeds done; {base / 'sweep.json'}")
    return 0


def _interrupted(flag: interrupt.StopFlag, e: interrupt.Interrupted, argv: list[str], out) -> int:
    """The one line an interrupted run prints (how to resume it); the exit code 130."""
    saved = f"checkpoint saved in {e.checkpoint}" if e.checkpoint is not None else "no checkpoint saved"
    print(
        f"zeroth run: interrupted by {flag.signal_name()} after step {e.step} of {e.total}; {saved}; "
        f"resume with: {interrupt.resume_command(argv, out)}",
        file=sys.stderr,
        flush=True,
    )
    return interrupt.EXIT_CODE


def _binary(cfg: _config.Config, out, args: argparse.Namespace, argv: list[str], flag: interrupt.StopFlag) -> int:
    if args.resume_step is not None:
        raise ValueError("--resume-step: a binary learning run keeps one checkpoint; resume it with --resume alone")
    try:
        binary_experiment.run_config(cfg, out, argv, progress=not args.quiet, resume=args.resume, stop=flag.is_set)
    except interrupt.Interrupted as e:
        return _interrupted(flag, e, argv, out)
    if flag.is_set():  # a signal during the last phase: the run finished anyway
        print(
            f"zeroth run: {flag.signal_name()} arrived as the run finished; its results are complete", file=sys.stderr
        )
    return 0


def _pipeline(cfg: _config.Config, out, args: argparse.Namespace, argv: list[str], flag: interrupt.StopFlag) -> int:
    try:  # the stages as processes on loopback
        return int(
            pipeline_launch.run_config(
                cfg, out, argv, progress=not args.quiet, stop=flag.is_set, resume_step=args.resume_step
            )
            or 0
        )
    except interrupt.Interrupted as e:
        return _interrupted(flag, e, argv, out)


def _train(cfg: _config.Config, out, args: argparse.Namespace, argv: list[str], flag: interrupt.StopFlag) -> int:
    try:
        result = trainer.train(
            cfg, out, resume=args.resume, resume_step=args.resume_step, progress=not args.quiet, stop=flag.is_set
        )
    except interrupt.Interrupted as e:
        return _interrupted(flag, e, argv, out)
    print(trainer.summary_line(result))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
