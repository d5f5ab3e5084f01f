"""The sparse-mutation server of a binary-learning config as a process of its own, for runs whose
workers are on other hosts (``zeroth launch`` starts it on rank 0, a worker on every other rank).

  python -m zeroth.binary.serve --config CONFIG --out DIR --listen HOST:PORT [--set FIELD=VALUE ...]
         [--insecure] [--tls-cert PEM --tls-key PEM --tls-ca PEM [--tls-mutual]]

It derives the run from the config's ``binary`` section (:func:`zeroth.binary.experiment.dist_config`,
as every worker does), starts from :func:`zeroth.binary.launch.initial_model`, serves until the last
round closes, keeps serving a few seconds so that every worker reads the last result, and writes
``DIR/summary.json`` (:func:`zeroth.binary.launch.server_summary`). Every call must carry the
access token of the run secret in ``ZEROTH_SECRET`` (``--insecure``: none).

Exit codes: 0 done; 1 the run did not finish in time; 2 a bad command line or config.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

__all__ = ["build_parser", "main"]


def build_parser() -> argparse.ArgumentParser:
    """The argument parser."""
    from zeroth.transport import security

    p = argparse.ArgumentParser(prog="python -m zeroth.binary.serve", description=__doc__.split("\n")[0])
    p.add_argument("--config", required=True, help="experiment YAML with a binary: section (the workers' too)")
    p.add_argument("--out", required=True, help="folder for summary.json")
    p.add_argument("--listen", required=True, help="HOST:PORT to serve on")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="SECTION.FIELD=VALUE")
    p.add_argument("--insecure", action="store_true", help="no run secret: anyone who reaches the port may take part")
    p.add_argument("--timeout", type=float, default=None, help="seconds for the whole run (default: from the rounds)")
    security.add_tls_arguments(p)
    return p


def main(argv: list[str]) -> int:
    """Entry point; returns the exit code."""
    args = build_parser().parse_args(argv)
    from zeroth import config as _config
    from zeroth.binary import experiment, launch
    from zeroth.binary import service as S
    from zeroth.transport import identity, security

    try:
        cfg = _config.load_config(args.config, args.overrides)
        if cfg.binary is None:
            raise ValueError(f"config {args.config} has no binary: section")
        token = identity.token_from_env(args.insecure)
        tls = security.tls_from_args(args)
        dcfg = experiment.dist_config(cfg)
    except (ValueError, OSError) as e:
        print(f"zeroth binary server: error: {e}", file=sys.stderr)
        return 2
    init = launch.initial_model(dcfg)
    server = S.Server(
        init.server_config,
        init.w,
        init.thresh,
        init.head,
        token=token,
        secret=None if args.insecure else identity.secret_from_env(),
    )
    try:
        port = server.start(args.listen, tls)
    except OSError as e:
        print(f"zeroth binary server: error: {e}", file=sys.stderr)
        return 2
    print(f"zeroth binary server: serving on port {port}; {dcfg.founders} workers, {dcfg.rounds} rounds", flush=True)
    limit = args.timeout or 300.0 + dcfg.rounds * (dcfg.round_timeout_s + 30.0)
    start = time.monotonic()
    code = 0
    try:
        while server.snapshot().round < dcfg.rounds:
            if time.monotonic() - start > limit:
                print(
                    f"zeroth binary server: error: the run did not finish {dcfg.rounds} rounds within {limit:g} s "
                    f"(at round {server.snapshot().round})",
                    file=sys.stderr,
                    flush=True,
                )
                code = 1
                break
            time.sleep(0.1)
        if code == 0:
            time.sleep(max(5.0, 2 * dcfg.round_timeout_s))  # the workers read the last round's result
    finally:
        server.stop()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    summary = {**launch.server_summary(dcfg, server, init), "wall_s": time.monotonic() - start}
    (out / "summary.json").write_text(json.dumps(summary, indent=1))
    print(
        f"zeroth binary server: {server.snapshot().round} rounds, test accuracy {summary['test_accuracy_before']:.4f} "
        f"-> {summary['test_accuracy']:.4f}, checksum {summary['final_checksum']}",
        flush=True,
    )
    return code


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
