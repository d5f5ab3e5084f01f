"""``zeroth bench binary``: XOR-popcount dense and 3x3 conv throughput next to float32 of the same shape.

The rows come from :func:`zeroth.binary.speed.binary_rows` (the binary experiment reports the same).

Each shape runs as the bit-packed binary layer (``zeroth.kernels.binary``: jnp on XLA, Pallas
natively on GPU/TPU, the NumPy reference on the host) and as a float32 matmul / convolution
of the same shape (``jnp.dot``, ``lax.conv_general_dilated``). Rates are **binary operations per
second**: a layer with ``M`` multiply-accumulates over ±1 values does ``2 M`` operations (one
XOR-and-count pair per weight and input, like a float multiply-add counts 2 FLOPs), so the
binary and float rows are directly comparable; ``speed-up`` is float time / binary time. The
binary rows include the integer threshold and the packing of the output bits; the float rows
produce float32 outputs and nothing else.

As a program: ``python -m zeroth.bench.binary [--json] [--batch B] [--features N] [--channels C]``.

Example:
  >>> rows = binary_rows(batch=8, features=64, channels=32, image=6, repeats=1, warmup=1, host=False)
  >>> sorted({r["layer"] for r in rows})
  ['conv3x3', 'dense']
"""

from __future__ import annotations

import sys

from zeroth.bench import _common
from zeroth.binary.speed import binary_rows

__all__ = ["binary_rows", "main"]


def main(argv: list[str] | None = None) -> int:
    """Print the rows as a table (or ``--json``)."""
    p = _common.base_parser("zeroth bench binary", "Bit-packed XOR-popcount dense/conv vs float32 of the same shape.")
    p.add_argument("--batch", type=int, default=256, help="dense batch rows (default 256)")
    p.add_argument("--features", type=int, default=1024, help="dense inputs = outputs (default 1024)")
    p.add_argument("--channels", type=int, default=64, help="conv input = output channels (default 64)")
    p.add_argument("--image", type=int, default=28, help="conv image side (default 28)")
    p.add_argument("--conv-batch", type=int, default=8, help="conv batch (default 8)")
    try:
        args = p.parse_args(sys.argv[1:] if argv is None else argv)
    except SystemExit as exc:
        return int(exc.code or 0)
    for name in ("batch", "features", "channels", "image", "conv_batch"):
        if getattr(args, name) < 1:
            print(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}", file=sys.stderr)
            return 2
    rows = binary_rows(
        batch=args.batch,
        features=args.features,
        channels=args.channels,
        image=args.image,
        conv_batch=args.conv_batch,
        repeats=args.repeats,
        warmup=args.warmup,
    )
    result = {"benchmark": "binary", "environment": _common.environment(), "rows": rows}

    def render(res):
        table = [
            {
                **r,
                "best": _common.fmt_seconds(r["seconds_min"]),
                "rate": _common.fmt_rate(r["ops_per_s"], "op/s"),
                "speedup": f"{r['speedup_vs_float32']:.2f}x" if "speedup_vs_float32" in r else "",
            }
            for r in res["rows"]
        ]
        _common.print_table(
            [
                ("layer", "layer"),
                ("shape", "shape"),
                ("kind", "kind"),
                ("impl", "impl"),
                ("best", "best"),
                ("rate", "binary ops/s"),
                ("speedup", "vs float32"),
                ("note", "note"),
            ],
            table,
            title="binary XOR-popcount layers vs float32 (ops = 2 x multiply-accumulates)",
        )

    _common.emit(result, as_json=args.json, render=render)
    return 0


if __name__ == "__main__":
    sys.exit(main())
