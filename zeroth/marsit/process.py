"""One process of a Marsit experiment over several processes (hosts): ``zeroth launch`` starts it.

  python -m zeroth.marsit.process --config CONFIG --out DIR --coordinator HOST:PORT
         --num-processes N --process-id R [--hostname ADDRESS] [--set FIELD=VALUE ...]

Every process joins one ``jax.distributed`` job (:func:`zeroth.collectives.distributed.initialize`,
gloo on CPU bound to ``--hostname``) with ``workers / N`` CPU devices of its own, so the runs' ring
or torus spans every process's devices; then it trains every run of the config as ``zeroth run``
does on one machine (:func:`zeroth.marsit.run_config`), the same ``shard_map`` programs, and writes
its own run folder ``DIR``. Every worker of every process holds the same bits after each round
(``checksums_equal`` compares them across processes).

Exit codes: 0 done; 2 a bad config (workers not divisible by N, runs with different worker
counts); 130 interrupted (the finished runs are kept).
"""

from __future__ import annotations

import argparse
import os
import sys

__all__ = ["build_parser", "main", "local_devices"]


def local_devices(runs, processes: int) -> int:
    """Devices each of ``processes`` holds: every run's workers split evenly.

    Raises:
      ValueError: runs with different worker counts, or a count ``processes`` does not divide.
    """
    counts = sorted({r.topology.workers for r in runs})
    if len(counts) != 1:
        raise ValueError(
            f"the runs have {counts} workers; over several processes every run needs the same count "
            "(each process's devices are fixed when it starts)"
        )
    if counts[0] % processes:
        raise ValueError(
            f"topology.workers {counts[0]} cannot be split over {processes} processes; give a divisor "
            f"of {counts[0]} hosts"
        )
    return counts[0] // processes


def build_parser() -> argparse.ArgumentParser:
    """The argument parser."""
    p = argparse.ArgumentParser(prog="python -m zeroth.marsit.process", description=__doc__.split("\n")[0])
    p.add_argument("--config", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--coordinator", required=True, help="HOST:PORT of process 0's jax coordinator")
    p.add_argument("--num-processes", type=int, required=True)
    p.add_argument("--process-id", type=int, required=True)
    p.add_argument("--hostname", default=None, help="the address the others reach this process's collectives at")
    p.add_argument("--timeout", type=int, default=300, help="seconds to wait for the other processes")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="FIELD=VALUE")
    return p


def main(argv: list[str]) -> int:
    """Entry point; returns the exit code."""
    args = build_parser().parse_args(argv)
    from zeroth.marsit import config as _config

    try:
        raw = _config.read_config(args.config)
        runs = _config.load_runs_dict(raw, args.overrides, where=args.config)
        per = local_devices(runs, args.num_processes)
    except (ValueError, OSError) as e:
        print(f"zeroth marsit process {args.process_id}: error: {e}", file=sys.stderr)
        return 2
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    from zeroth.collectives import distributed

    distributed.initialize(
        args.coordinator,
        args.num_processes,
        args.process_id,
        local_devices=per,
        timeout_s=args.timeout,
        hostname=args.hostname,
    )
    from zeroth import marsit
    from zeroth.train import interrupt

    with interrupt.catch() as flag:
        try:
            result = marsit.run_config(
                runs,
                args.out,
                name=str(raw.get("name") or "marsit"),
                stop=flag.is_set,
                progress=print if args.process_id == 0 else None,
            )
        except marsit.Stopped as e:
            print(
                f"zeroth marsit process {args.process_id}: interrupted in run {e.label!r} after round {e.step}; "
                f"{e.finished} of {e.runs} runs finished and kept in {args.out}",
                file=sys.stderr,
                flush=True,
            )
            return interrupt.EXIT_CODE
    if args.process_id == 0:
        print(marsit.table(result["runs"]))
    import jax

    jax.distributed.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
