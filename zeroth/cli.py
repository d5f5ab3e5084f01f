"""The ``zeroth`` command line: a tiny dispatcher; each command lives in its own module.

Commands are imported lazily, so ``zeroth --help`` stays fast and a command's heavy imports
are paid only when it runs.
"""

from __future__ import annotations

import importlib
import sys

from zeroth import __version__
from zeroth.train import interrupt

__all__ = ["main", "COMMANDS"]

# name -> ("module:function", one-line help). Each function takes argv (list[str]) and returns an exit code.
COMMANDS: dict[str, tuple[str, str]] = {
    "doctor": ("zeroth.doctor:main", "check this machine reproduces the golden replay digest"),
    "bench": ("zeroth.bench:main", "benchmarks: perturb, zo, kernels, binary, ravnest, peers (tables and --json)"),
    "datasets": ("zeroth.data:cli_main", "list datasets, their status and how to install each"),
    "run": (
        "zeroth.run:main",
        "run an experiment config (one machine, or peers, pipeline stages, Ravnest nodes on loopback, Marsit workers as CPU devices)",
    ),
    "verify": (
        "zeroth.net.verify:main",
        "replay a Just One Byte run's update logs on this machine and check every digest its peers recorded",
    ),
    "peer": ("zeroth.net.peer:main", "run one Just One Byte peer (multi-machine use)"),
    "stage": ("zeroth.pipeline.stage:main", "run one pipeline stage (AQ-SGD, multi-machine use)"),
    "node": (
        "zeroth.cluster.node:main",
        "run one Ravnest node (clusters of asynchronous pipelines, multi-machine use)",
    ),
    "launch": (
        "zeroth.launch:main",
        "start this host's process of a run across hosts (the same command on every host, a rendezvous)",
    ),
    "certs": ("zeroth.transport.certs:main", "make a CA and per-host certificates for mutual TLS"),
}


def _usage() -> str:
    lines = ["usage: zeroth COMMAND [ARGS...]", "", "commands:"]
    lines += [f"  {name:<10} {help_}" for name, (_, help_) in COMMANDS.items()]
    lines += ["", "Run 'zeroth COMMAND --help' for a command's options."]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv:  # a command is required: say which exist, and fail like any usage error
        print(f"zeroth: no command given\n\n{_usage()}", file=sys.stderr)
        return 2
    if argv[0] in ("-h", "--help", "help"):
        print(_usage())
        return 0
    name, rest = argv[0], argv[1:]
    if name in ("--version", "version"):
        print(__version__)
        return 0
    if name not in COMMANDS:
        print(f"zeroth: unknown command {name!r}; expected one of {sorted(COMMANDS)}\n\n{_usage()}", file=sys.stderr)
        return 2
    target, _ = COMMANDS[name]
    module, func = target.split(":")
    # Importing a command (jax, among others) takes seconds; a signal meanwhile only sets a flag: a
    # KeyboardInterrupt raised there can land in a garbage-collector callback and be dropped.
    with interrupt.catch() as flag:
        command = getattr(importlib.import_module(module), func)
    if flag.is_set():
        print(
            f"zeroth {name}: interrupted by {flag.signal_name()} while starting; nothing was written", file=sys.stderr
        )
        return interrupt.EXIT_CODE
    try:
        return int(command(rest) or 0)
    except KeyboardInterrupt:  # a command that leaves Ctrl-C to Python's default handling
        print(f"zeroth {name}: interrupted", file=sys.stderr)
        return interrupt.EXIT_CODE


if __name__ == "__main__":
    sys.exit(main())
