"""``zeroth bench NAME``: benchmark programs that print a table (or ``--json``), baselines side by side."""

from __future__ import annotations

import importlib
import sys

__all__ = ["main", "BENCHMARKS"]

BENCHMARKS: dict[str, tuple[str, str]] = {
    "perturb": (
        "zeroth.bench.perturb:main",
        "perturbation throughput vs jax.random.normal, torch.randn and a memory pass",
    ),
    "zo": ("zeroth.bench.zo:main", "ZO step time / two forwards and peak memory / inference, next to a backprop step"),
    "memory": (
        "zeroth.bench.memory:main",
        "compiled memory of the ZO program / inference, for this machine or an H100 it lacks",
    ),
    "kernels": ("zeroth.bench.kernels:main", "fused replay vs K passes; sign pack/unpack/merge throughput"),
    "signbits": ("zeroth.bench.signbits:main", "sign-bit pack/unpack/merge/majority throughput alone"),
    "binary": ("zeroth.bench.binary:main", "XOR-popcount dense/conv in binary ops/s next to float32 of the same shape"),
    "ravnest": (
        "zeroth.bench.ravnest:main",
        "idle time per stage: Ravnest's asynchronous pipeline next to the synchronous fill-and-drain one",
    ),
    "peers": (
        "zeroth.bench.peers:main",
        "Just One Byte at M peers on the simulator: messages, wire bytes, CPU, iteration time over a WAN",
    ),
    "hosts": ("zeroth.bench.hosts:main", "an AQ-SGD pipeline over two namespace hosts at limited link rates (root)"),
}


def main(argv: list[str]) -> int:
    if not argv or argv[0] in ("-h", "--help"):
        print("usage: zeroth bench NAME [--json] [...]\n\nbenchmarks:")
        for name, (_, help_) in BENCHMARKS.items():
            print(f"  {name:<9} {help_}")
        return 0
    name = argv[0]
    if name not in BENCHMARKS:
        print(f"zeroth bench: unknown benchmark {name!r}; expected one of {sorted(BENCHMARKS)}", file=sys.stderr)
        return 2
    module, func = BENCHMARKS[name][0].split(":")
    return int(getattr(importlib.import_module(module), func)(argv[1:]) or 0)
