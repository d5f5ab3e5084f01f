"""``zeroth peer``: run one Just One Byte peer (one per machine, or several on one machine).

  zeroth peer --config CONFIG --listen HOST:PORT [--join HOST:PORT ...] --out DIR
              [--secret-file FILE | --insecure] [--set SECTION.FIELD=VALUE ...] [--founders N]
              [--advertise HOST:PORT] [--join-at K] [--resume DIR] [--tls-cert PEM --tls-key PEM --tls-ca PEM [--tls-mutual]]

Without ``--join`` the peer founds the run (machine 0) and waits for ``--founders`` peers
(default ``peers.count``) before iteration 0; with ``--join`` it joins a running run through any
of its peers, at any iteration. Every peer must use the same config (training fields; the
deployment fields of :data:`zeroth.net.runtime.JOIN_DIGEST_EXCLUDE` may differ).

Secure by default: the run secret is ``--secret-file``'s content (``--token-file`` is the same),
else ``$ZEROTH_SECRET`` / ``$ZEROTH_TOKEN``, else ``peers.token``. A founder without one generates
it, writes it to ``OUT/run.secret`` (mode 0600) and prints the command that joins the run; a
joiner without one is refused at the command line. ``--insecure`` (or ``peers.insecure: true``)
runs without a secret: anyone who reaches the port may join; messages are signed by their senders
all the same. TLS needs all three files (``--tls-ca`` is the CA that signed the other peers' certificates);
``--tls-mutual`` makes every peer present its certificate too (``zeroth certs`` makes them).

The peer writes ``metrics.jsonl`` (one record per iteration), ``summary.json``, ``address`` and
``checkpoints/<iteration>/`` (every ``train.checkpoint_every`` iterations, at the end, and on
SIGINT / SIGTERM) into ``--out``. SIGINT / SIGTERM save a checkpoint and make it leave the run
cleanly (a second one exits at once). Exit code: 0 when all iterations
are done (or it left), 1 when it failed (one line says why; when the run lost its majority the
state is saved to ``OUT/checkpoint``, which ``--resume`` starts a new run from) or was dropped for
good, 2 on a bad command line.

Example (two machines):
  host-a$ zeroth peer --config experiments/job_digits.yaml --listen 0.0.0.0:7000 --advertise host-a:7000 --out runs/a --founders 2
  (prints: join with  zeroth peer --config experiments/job_digits.yaml --join host-a:7000 --secret-file runs/a/run.secret ...)
  host-b$ zeroth peer --config experiments/job_digits.yaml --listen 0.0.0.0:7000 --advertise host-b:7000 --join host-a:7000 \
            --secret-file run.secret --out runs/b        (run.secret copied from host-a over a private channel, e.g. scp)
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import threading
import time

__all__ = ["build_parser", "main"]


def build_parser() -> argparse.ArgumentParser:
    """The argument parser of ``zeroth peer``."""
    from zeroth.transport import security as _sec

    p = argparse.ArgumentParser(prog="zeroth peer", description="Run one Just One Byte peer.")
    p.add_argument("--config", required=True, help="experiment YAML with a peers: section (same on every peer)")
    p.add_argument("--listen", required=True, help="HOST:PORT to serve on (port 0: any free port)")
    p.add_argument(
        "--join",
        action="append",
        default=[],
        metavar="HOST:PORT",
        help="a peer of the run to join through (repeatable); @FILE: the address written in FILE (waited for)",
    )
    p.add_argument("--out", required=True, help="output folder (metrics.jsonl, summary.json, address)")
    p.add_argument(
        "--set", dest="overrides", action="append", default=[], metavar="SECTION.FIELD=VALUE", help="config override"
    )
    p.add_argument(
        "--founders",
        type=int,
        default=None,
        help="founder only: peers to wait for before iteration 0 (default peers.count)",
    )
    p.add_argument(
        "--advertise", default=None, help="HOST:PORT the other peers use to reach this one (default: --listen)"
    )
    p.add_argument(
        "--secret-file", "--token-file", dest="secret_file", default=None, help="file holding the run secret"
    )
    p.add_argument(
        "--insecure", action="store_true", help="run without a secret (anyone who reaches the port may join)"
    )
    p.add_argument(
        "--resume",
        default=None,
        metavar="DIR",
        help="founder: start from a saved state (OUT/checkpoint of a failed run)",
    )
    _sec.add_tls_arguments(p)
    p.add_argument("--no-rejoin", action="store_true", help="exit instead of rejoining after being dropped")
    p.add_argument(
        "--join-at", type=int, default=None, help="with --join: start now, join once the run reaches this iteration"
    )
    p.add_argument(
        "--join-members",
        type=int,
        default=None,
        metavar="N",
        help="with --join: ask to join once the run has N members (founders started at once: p<i> gets N=i, machine id i)",
    )
    p.add_argument("--leave-at", type=int, default=None, help="leave the run after applying this iteration")
    p.add_argument("--linger", type=float, default=2.0, help="seconds to keep serving after finishing")
    p.add_argument(
        "--snapshot-every", type=int, default=10, help="keep a parameter snapshot every N iterations (for joiners)"
    )
    p.add_argument(
        "--chunk-bytes", type=int, default=256 * 1024, help="bytes per streamed state chunk (and per download range)"
    )
    p.add_argument("--progress-every", type=int, default=0, help="print a progress line every N iterations")
    p.add_argument("--timeout", type=float, default=None, help="give up after this many seconds (default: none)")
    p.add_argument(
        "--startup-timeout",
        type=float,
        default=None,
        metavar="S",
        help="seconds the founder waits for --founders peers (then the run fails) and a joiner tries to join "
        "(default: peers.startup_timeout_s, else 60 + 4 per founder)",
    )
    p.add_argument(
        "--join-timeout",
        type=float,
        default=None,
        help="give up joining after this many seconds (default: the start-up window)",
    )
    p.add_argument("--quiet", action="store_true", help="no protocol notes on stderr")
    return p


def main(argv: list[str]) -> int:
    """Entry point of ``zeroth peer``; returns the exit code."""
    args = build_parser().parse_args(argv)
    from zeroth.config import load_config
    from zeroth.data import DatasetUnavailable
    from zeroth.net import state as _state
    from zeroth.transport import identity as _id
    from zeroth.transport import rendezvous as _rdv
    from zeroth.transport import security as _sec

    try:
        cfg = load_config(args.config, args.overrides)
        if cfg.peers is None:
            raise ValueError(f"config {args.config!r} has no peers: section")
        if args.resume and args.join:
            raise ValueError("--resume is for the founder (without --join)")
        if args.resume:
            _state.check_state(
                args.resume
            )  # a state missing, cut short or changed: one line, before anything is written
        secret = _id.read_secret(args.secret_file) if args.secret_file else None
        secret = secret or _id.secret_from_env() or cfg.peers.token
        insecure = args.insecure or cfg.peers.insecure
        if insecure and secret:
            raise ValueError("--insecure (or peers.insecure) and a run secret were both given; choose one")
        generated = None
        if not secret and not insecure:
            if args.join:
                raise ValueError(
                    "joining needs the run's secret: --secret-file FILE (the founder wrote it to its OUT/run.secret), "
                    "or $ZEROTH_SECRET; or --insecure for a run without one"
                )
            secret = _id.new_secret()
            generated = _id.write_secret(os.path.join(args.out, "run.secret"), secret)
        tls = _sec.tls_from_args(args)
        founders = args.founders or cfg.peers.count
        window = args.startup_timeout or cfg.peers.startup_timeout_s or _rdv.startup_window(founders)
        if not window > 0:
            raise ValueError(f"--startup-timeout {window}: must be positive seconds")
    except (ValueError, OSError, DatasetUnavailable) as e:
        print(f"zeroth peer: error: {e}", file=sys.stderr)
        return 2

    from zeroth.net.runtime import Node, NodeOptions

    options = NodeOptions(
        out_dir=args.out,
        listen=args.listen,
        advertise=args.advertise,
        join=tuple(args.join),
        founders=founders,
        secret=secret,
        insecure=insecure,
        tls=tls,
        resume=args.resume,
        rejoin=not args.no_rejoin,
        linger_s=args.linger,
        snapshot_every=args.snapshot_every,
        chunk_bytes=args.chunk_bytes,
        join_at=args.join_at,
        join_members=args.join_members,
        leave_at=args.leave_at,
        join_timeout_s=args.join_timeout or window,
        forming_timeout_s=window,
        log=not args.quiet,
        progress_every=args.progress_every,
    )
    node = Node(cfg, options)
    address = node.start()
    print(f"zeroth peer: serving on {address}", file=sys.stderr, flush=True)
    if not args.join:
        print(f"zeroth peer: {join_command(args, address, generated, insecure)}", file=sys.stderr, flush=True)

    leaving = threading.Event()

    def on_signal(signum, frame):
        if leaving.is_set():
            node.stop()
            os._exit(130)
        leaving.set()

        def checkpoint_and_leave():
            node.checkpoint_now("interrupted")  # the iteration reached, for `zeroth run --resume`
            node.leave()

        threading.Thread(target=checkpoint_and_leave, daemon=True).start()

    signal.signal(signal.SIGINT, on_signal)
    signal.signal(signal.SIGTERM, on_signal)
    deadline = None if args.timeout is None else time.monotonic() + args.timeout
    while not node.wait(0.5):
        if deadline is not None and time.monotonic() > deadline:
            node.fail(f"timed out after {args.timeout}s")
            break
        if leaving.is_set() and node.phase not in ("member", "joining", "catching_up"):
            break
    time.sleep(max(0.0, args.linger))
    node.stop()
    summary = node.summary()
    print(
        f"zeroth peer: {summary['finish_reason']} machines {summary['machines']} iterations {summary['iterations']} "
        f"digest {str(summary['digest'])[:16]} accuracy {summary['eval'].get('eval_accuracy')}",
        file=sys.stderr,
        flush=True,
    )
    if summary["finish_reason"] not in ("done", "left"):
        print(f"zeroth peer: error: {summary['error'] or summary['finish_reason']}", file=sys.stderr, flush=True)
        return 1
    return 0


def join_command(args, address: str, secret_file, insecure: bool) -> str:
    """The line a founder prints: how another machine joins this run."""
    cmd = f"zeroth peer --config {args.config} --join {address} --listen HOST:PORT --out DIR"
    for o in args.overrides:
        cmd += f" --set {o}"
    if insecure:
        return f"INSECURE run (anyone who reaches {address} may join); join with:  {cmd} --insecure"
    if secret_file is not None:
        return (
            f"run secret written to {secret_file} (mode 0600; copy it to the joining machine over a private channel); "
            f"join with:  {cmd} --secret-file {secret_file}"
        )
    src = (
        f"--secret-file {args.secret_file}"
        if args.secret_file
        else "with the same secret ($ZEROTH_SECRET or peers.token)"
    )
    return f"join with:  {cmd} {src}"


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
