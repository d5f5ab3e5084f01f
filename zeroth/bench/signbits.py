"""Sign-bit kernel throughput: pack, unpack, Marsit merge, majority vote (rows for ``zeroth bench kernels``).

:func:`signbits_rows` returns one row per operation and implementation (``jnp`` everywhere,
``pallas`` natively on GPU/TPU), next to baselines: ``jnp.sign`` (one elementwise float pass,
what any sign compressor costs at least) and, on the host, ``np.packbits``. Rates are elements per
second (sign bits for the word operations: 32 per word). The merge includes drawing its
Bernoulli bits (one threefry call per two elements), which dominates it.

As a program: ``python -m zeroth.bench.signbits [--json] [--size N]``.

Example:
  >>> rows = signbits_rows(size=1 << 12, repeats=1, warmup=1)
  >>> sorted({r["name"].split()[0] for r in rows})[:3]
  ['jnp.sign', 'majority', 'merge']
"""

from __future__ import annotations

import sys
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from zeroth.bench import _common
from zeroth.kernels import signbits as sb
from zeroth.rule import default_platform, platform_name

__all__ = ["signbits_rows", "main"]

_SECTION = "signbits"
_VOTERS = 8


def _row(name: str, impl: str, n: int, t: _common.Timing | None, **extra) -> dict:
    row = {"section": _SECTION, "name": name, "impl": impl, "elements": n, **extra}
    if t is not None:
        row.update(
            seconds_min=t.min_s,
            seconds_median=t.median_s,
            repeats=t.repeats,
            elements_per_s=n / t.min_s,
            updates_per_s=n / t.min_s,
        )
    return row


def _impls(backend: str) -> list[str]:
    return ["jnp"] + (["pallas"] if platform_name(backend) in ("gpu", "tpu") else [])


def signbits_rows(
    ctx: Any = None, *, size: int | None = None, repeats: int | None = None, warmup: int | None = None
) -> list[dict]:
    """Throughput rows of the sign-bit kernels.

    Args:
      ctx: optional object with ``size``, ``repeats``, ``warmup`` (``zeroth.bench.kernels.Context``);
        keyword arguments override it. Defaults: ``2**24`` elements, 5 repeats, 1 warm-up.

    Returns:
      A list of row dicts (``section="signbits"``, ``name``, ``impl``, ``elements``,
      ``seconds_min``, ``seconds_median``, ``elements_per_s``, ``note``).
    """
    n = size or getattr(ctx, "size", None) or 1 << 24
    reps = repeats or getattr(ctx, "repeats", None) or 5
    warm = warmup if warmup is not None else getattr(ctx, "warmup", 1)
    backend = default_platform()  # where the rows' arrays go (a jax.default_device too)
    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.standard_normal(n).astype(np.float32))
    nw = sb.n_words(n)
    v = jnp.asarray(rng.integers(0, 2**32, nw, dtype=np.uint64).astype(np.uint32))
    vs = jnp.asarray(rng.integers(0, 2**32, nw, dtype=np.uint64).astype(np.uint32))
    stack = jnp.asarray(rng.integers(0, 2**32, (_VOTERS, nw), dtype=np.uint64).astype(np.uint32))
    key = jnp.asarray(np.array([0, 1], np.uint32))

    def timed(fn, *args):
        f = jax.jit(fn)
        return _common.timeit(lambda: jax.block_until_ready(f(*args)), warmup=warm, repeats=reps)

    rows = [_row("jnp.sign (float pass)", "xla", n, timed(jnp.sign, x), note="baseline")]
    host = np.asarray(x)
    rows.append(
        _row(
            "np.packbits(x >= 0)",
            "numpy",
            n,
            _common.timeit(lambda: np.packbits(host >= 0, bitorder="little"), warmup=warm, repeats=reps),
            note="baseline, host",
        )
    )
    for impl in _impls(backend):
        rows.append(_row("pack f32 -> u32", impl, n, timed(lambda a: sb.pack(a, impl=impl), x), note="32 signs/word"))
        rows.append(
            _row(
                "unpack u32 -> f32 (scaled)",
                impl,
                n,
                timed(lambda w: sb.unpack(w, (n,), scale=0.5, impl=impl), sb.pack(x)),
            )
        )
        rows.append(
            _row(
                "merge m=3 (eq. 2, with its Bernoulli bits)",
                impl,
                32 * nw,
                timed(lambda a, b, k: sb.merge(a, b, k, 3, impl=impl), v, vs, key),
            )
        )
        rows.append(
            _row(
                f"majority of {_VOTERS} packed vectors",
                impl,
                32 * nw,
                timed(lambda s: sb.majority(s, impl=impl), stack),
                note="bit-sliced counts",
            )
        )
    return rows


def main(argv: list[str] | None = None) -> int:
    """Print the rows as a table (or ``--json``)."""
    p = _common.base_parser("python -m zeroth.bench.signbits", "Sign-bit pack / unpack / merge / majority throughput.")
    p.add_argument("--size", type=int, default=1 << 24, help="elements (default 2**24)")
    try:
        args = p.parse_args(sys.argv[1:] if argv is None else argv)
    except SystemExit as exc:
        return int(exc.code or 0)
    if args.size < 1:
        print(f"--size must be >= 1, got {args.size}", file=sys.stderr)
        return 2
    rows = signbits_rows(size=args.size, repeats=args.repeats, warmup=args.warmup)
    result = {"benchmark": "signbits", "size": args.size, "environment": _common.environment(), "rows": rows}

    def render(res):
        table = [
            {**r, "best": _common.fmt_seconds(r.get("seconds_min")), "rate": _common.fmt_rate(r.get("elements_per_s"))}
            for r in res["rows"]
        ]
        _common.print_table(
            [("name", "row"), ("impl", "impl"), ("best", "best"), ("rate", "elements/s"), ("note", "note")],
            table,
            title=f"sign bits, N = {res['size']:,}",
        )

    _common.emit(result, as_json=args.json, render=render)
    return 0


if __name__ == "__main__":
    sys.exit(main())
