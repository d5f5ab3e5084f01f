"""``zeroth bench kernels [--json]``: fused replay against K separate passes, per implementation.

For every implementation available here (``jnp`` always; ``native`` on CPU when it builds;
``pallas`` natively on GPU/TPU only) and each exact distribution, it times

* **fused**: one call applying K updates (K = 1, 16, 64 by default), the leaf donated;
* **K passes**: K calls of one update each (what a replay without the fused kernel costs);

and prints elements/s (``n / t`` for the call; ``n*K / t`` as element-updates/s), the speedup of
fused over K passes, and on an accelerator the fraction of memory bandwidth the fused call
reaches (bytes read + written / time) against the device's peak from a table of device kinds
*and* against a measured copy (``x + 1``, donated: the practical peak). Side by side, the
baselines a perturbation is judged by: the copy (memory floor), ``jax.random.normal`` + add and,
when torch is installed, ``torch.randn`` + ``add_``.

The table is a list of sections, each a function ``(Context) -> list[Row]`` in :data:`SECTIONS`;
other kernels add their own section function there (the sign-bit rows come from
:mod:`zeroth.kernels.signbits` when it is present).

Example:
  $ zeroth bench kernels --size 4194304 --ks 1,16 --json
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import json
import math
import sys
import time
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

__all__ = ["Context", "Row", "SECTIONS", "PEAK_BANDWIDTH_GBS", "peak_bandwidth", "main"]

# Peak HBM bandwidth in GB/s by device kind (vendor figures), for the bandwidth fraction.
PEAK_BANDWIDTH_GBS: dict[str, float] = {
    "H100 SXM": 3350.0,
    "H100 80GB HBM3": 3350.0,
    "H100 PCIe": 2000.0,
    "H100 NVL": 3900.0,
    "H200": 4800.0,
    "GH200": 4000.0,
    "A100-SXM4-80GB": 2039.0,
    "A100-SXM4-40GB": 1555.0,
    "A100 80GB PCIe": 1935.0,
    "A100-PCIE-40GB": 1555.0,
    "L4": 300.0,
    "A10G": 600.0,
    "V100": 900.0,
    "TPU v4": 1200.0,
    "TPU v5 lite": 819.0,
    "TPU v5e": 819.0,
    "TPU v5p": 2765.0,
    "TPU v6 lite": 1640.0,
    "TPU v6e": 1640.0,
}


def peak_bandwidth(device_kind: str) -> float | None:
    """Vendor peak memory bandwidth (GB/s) for a ``device.device_kind``, longest matching name."""
    matches = [k for k in PEAK_BANDWIDTH_GBS if k.lower() in device_kind.lower()]
    return PEAK_BANDWIDTH_GBS[max(matches, key=len)] if matches else None


@dataclasses.dataclass(frozen=True)
class Context:
    """What a section needs: array size, update counts, timing repeats and the device."""

    size: int
    ks: tuple[int, ...]
    repeats: int
    backend: str
    device_kind: str


@dataclasses.dataclass
class Row:
    """One measured line of the table."""

    section: str
    name: str
    impl: str
    distribution: str = ""
    k: int = 1
    seconds: float = float("nan")
    elements_per_s: float = float("nan")  # n / seconds
    updates_per_s: float = float("nan")  # n * k / seconds
    speedup: float | None = None  # fused over K single-update passes of the same impl
    speedup_vs_jnp: float | None = None  # fused over K single-update passes of the jnp reference
    bandwidth_fraction: float | None = None  # of the vendor peak
    copy_fraction: float | None = None  # of the measured copy
    note: str = ""


# --------------------------------------------------------------------------- timing


def _best_time(fn: Callable[[Any], Any], x: Any, repeats: int) -> tuple[float, Any]:
    """Best wall time of ``x = fn(x)`` (chained, so donated buffers are reused), after one warm-up."""
    x = fn(x)
    jax.block_until_ready(x)
    best = math.inf
    for _ in range(repeats):
        t0 = time.perf_counter()
        x = fn(x)
        jax.block_until_ready(x)
        best = min(best, time.perf_counter() - t0)
    return best, x


def _leaf(ctx: Context, dtype=jnp.float32) -> jax.Array:
    return jnp.asarray(np.random.default_rng(0).normal(size=ctx.size).astype(np.float32), dtype)


def _updates(dist: str, k: int):
    from zeroth import replay, rng

    keys = rng.sample_keys(0, [(0, 0, s) for s in range(k)])
    scales = replay.update_scales(dist, list(np.linspace(-1e-3, 1e-3, k)))
    return jnp.asarray(keys), jnp.asarray(scales)


def _copy_time(ctx: Context) -> float:
    copy = jax.jit(lambda x: x + jnp.float32(1.0), donate_argnums=0)
    t, _ = _best_time(copy, _leaf(ctx), ctx.repeats)
    return t


# --------------------------------------------------------------------------- sections


def _available_impls(ctx: Context) -> list[str]:
    from zeroth.kernels import cpu_native

    impls = ["jnp"]
    if ctx.backend == "cpu" and cpu_native.available():
        impls.append("native")
    if ctx.backend in ("gpu", "cuda", "rocm", "tpu"):
        impls.append("pallas")
    return impls


def baseline_rows(ctx: Context) -> list[Row]:
    """The memory floor and the Gaussian perturbations of other frameworks."""
    n = ctx.size
    rows = []
    t_copy = _copy_time(ctx)
    rows.append(Row("baseline", "copy x + 1 (memory floor)", "xla", seconds=t_copy, elements_per_s=n / t_copy))
    key = jax.random.key(0)
    normal = jax.jit(lambda x, k: x + jnp.float32(1e-3) * jax.random.normal(k, x.shape, x.dtype), donate_argnums=0)
    t, _ = _best_time(lambda x: normal(x, key), _leaf(ctx), ctx.repeats)
    rows.append(Row("baseline", "jax.random.normal + add", "xla", "gaussian", seconds=t, elements_per_s=n / t))
    if importlib.util.find_spec("torch") is not None:
        import torch

        x = torch.zeros(n, dtype=torch.float32)
        g = torch.Generator().manual_seed(0)

        def step(x):
            return x.add_(torch.randn(n, generator=g, dtype=torch.float32), alpha=1e-3)

        best = math.inf
        step(x)
        for _ in range(ctx.repeats):
            t0 = time.perf_counter()
            step(x)
            best = min(best, time.perf_counter() - t0)
        rows.append(
            Row(
                "baseline",
                f"torch.randn + add_ ({torch.get_num_threads()} threads)",
                "torch",
                "gaussian",
                seconds=best,
                elements_per_s=n / best,
            )
        )
    return rows


def fused_replay_rows(ctx: Context) -> list[Row]:
    """Fused replay of K updates against K single-update passes, per implementation."""
    from zeroth.kernels import perturb as kp

    n = ctx.size
    rows = []
    accel = ctx.backend != "cpu"
    peak = peak_bandwidth(ctx.device_kind) if accel else None
    t_copy = _copy_time(ctx) if accel else None
    t_jnp_one: dict[str, float] = {}
    for impl in _available_impls(ctx):  # "jnp" first: its single pass is every impl's baseline
        for dist in ("binomial", "rademacher"):
            lid = 0x5EED

            def make(k, impl=impl, dist=dist):
                keys, scales = _updates(dist, k)
                lk = kp.leaf_keys(keys, lid)
                fn = jax.jit(
                    lambda x, lk, s: kp.perturb_leaf(x, lk, s, distribution=dist, impl=impl, inplace=True),
                    donate_argnums=0,
                )
                return fn, lk, scales

            one, lk1, s1 = make(1)
            t_one, _ = _best_time(lambda x: one(x, lk1, s1), _leaf(ctx), ctx.repeats)
            t_jnp_one.setdefault(dist, t_one)
            for k in ctx.ks:
                if k == 1:
                    t_fused = t_one
                else:
                    fused, lk, s = make(k)
                    t_fused, _ = _best_time(lambda x: fused(x, lk, s), _leaf(ctx), max(1, ctx.repeats // 2))
                t_passes = k * t_one
                bytes_moved = 2 * n * 4
                rows.append(
                    Row(
                        "fused replay",
                        f"fused K={k}",
                        impl,
                        dist,
                        k,
                        seconds=t_fused,
                        elements_per_s=n / t_fused,
                        updates_per_s=n * k / t_fused,
                        speedup=t_passes / t_fused,
                        speedup_vs_jnp=k * t_jnp_one[dist] / t_fused,
                        bandwidth_fraction=(bytes_moved / t_fused / 1e9 / peak) if peak else None,
                        copy_fraction=(t_copy / t_fused) if t_copy else None,
                        note=f"vs {k} passes of {t_one * 1e3:.2f} ms",
                    )
                )
    return rows


def signbits_rows(ctx: Context) -> list[Row]:
    """Sign-bit pack / unpack / merge rows, when :mod:`zeroth.kernels.signbits` provides them."""
    if importlib.util.find_spec("zeroth.kernels.signbits") is None:
        return []
    from zeroth.kernels import signbits

    producer = getattr(signbits, "bench_rows", None)
    if producer is None:
        return []
    return [Row(**r) if isinstance(r, dict) else r for r in producer(ctx)]


# Each section: (name, function). Add a kernel's rows by appending here.
SECTIONS: list[tuple[str, Callable[[Context], list[Row]]]] = [
    ("baseline", baseline_rows),
    ("fused", fused_replay_rows),
    ("signbits", signbits_rows),
]


# --------------------------------------------------------------------------- output


def _fmt(v: float | None, spec: str) -> str:
    return "-" if v is None or (isinstance(v, float) and math.isnan(v)) else format(v, spec)


def _table(rows: list[Row]) -> str:
    head = f"{'section':<13} {'name':<36} {'impl':<7} {'dist':<10} {'ms':>9} {'M elem/s':>9} {'M upd/s':>9} {'speedup':>8} {'vs jnp':>8} {'BW':>6} {'copy':>6}  note"
    lines = [head, "-" * len(head)]
    for r in rows:
        lines.append(
            f"{r.section:<13} {r.name:<36} {r.impl:<7} {r.distribution:<10} {_fmt(r.seconds * 1e3, '9.2f')} "
            f"{_fmt(r.elements_per_s / 1e6, '9.1f')} {_fmt(r.updates_per_s / 1e6, '9.1f')} "
            f"{_fmt(r.speedup, '7.2f') + ('x' if r.speedup is not None else ''):>8} "
            f"{_fmt(r.speedup_vs_jnp, '7.2f') + ('x' if r.speedup_vs_jnp is not None else ''):>8} "
            f"{_fmt(None if r.bandwidth_fraction is None else 100 * r.bandwidth_fraction, '5.1f'):>6} "
            f"{_fmt(None if r.copy_fraction is None else 100 * r.copy_fraction, '5.1f'):>6}  {r.note}"
        )
    return "\n".join(lines)


def _ratios(rows: list[Row]) -> list[str]:
    base = {r.name.split(" (")[0]: r.elements_per_s for r in rows if r.section == "baseline"}
    out = []
    for r in rows:
        if r.section == "fused replay" and r.k == 1:
            parts = [f"{r.impl} {r.distribution} perturb: {r.elements_per_s / 1e6:.0f} M elem/s"]
            for name, label in (
                ("torch.randn + add_", "torch"),
                ("jax.random.normal + add", "jax normal"),
                ("copy x + 1", "copy"),
            ):
                if name in base:
                    parts.append(f"{r.elements_per_s / base[name]:.2f}x {label}")
            out.append(", ".join(parts))
    return out


def _json_row(r: Row) -> dict:
    return {k: (None if isinstance(v, float) and not math.isfinite(v) else v) for k, v in dataclasses.asdict(r).items()}


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(prog="zeroth bench kernels", description=__doc__.split("\n\n")[0])
    ap.add_argument("--json", action="store_true", help="print JSON instead of a table")
    ap.add_argument("--size", type=int, default=1 << 24, help="elements of the float32 leaf (default 2**24)")
    ap.add_argument("--ks", default="1,16,64", help="comma-separated update counts (default 1,16,64)")
    ap.add_argument("--repeats", type=int, default=5, help="timed repetitions, best kept (default 5)")
    ap.add_argument(
        "--sections", default=",".join(name for name, _ in SECTIONS), help="comma-separated sections to run"
    )
    args = ap.parse_args(argv)
    try:
        ks = tuple(int(k) for k in args.ks.split(","))
    except ValueError:
        ap.error(f"--ks must be comma-separated integers, got {args.ks!r}")
    if args.size < 1 or args.repeats < 1 or any(k < 1 for k in ks):
        ap.error(f"--size, --repeats and every K must be >= 1 (got {args.size}, {args.repeats}, {ks})")
    known = {name for name, _ in SECTIONS}
    wanted = [s for s in args.sections.split(",") if s]
    if unknown := [s for s in wanted if s not in known]:
        ap.error(f"unknown section(s) {unknown}; expected some of {sorted(known)}")
    dev = jax.devices()[0]
    ctx = Context(args.size, ks, args.repeats, jax.default_backend(), dev.device_kind)
    rows: list[Row] = []
    for name, fn in SECTIONS:
        if name in wanted:
            rows.extend(fn(ctx))
    info = {
        "benchmark": "kernels",
        "backend": ctx.backend,
        "device_kind": ctx.device_kind,
        "size": ctx.size,
        "ks": list(ctx.ks),
        "jax": jax.__version__,
        "peak_bandwidth_gbs": peak_bandwidth(ctx.device_kind),
    }
    if args.json:
        print(json.dumps({**info, "rows": [_json_row(r) for r in rows]}, indent=2, allow_nan=False))
    else:
        print(f"zeroth bench kernels: {ctx.backend} ({ctx.device_kind}), n = {ctx.size} float32, jax {jax.__version__}")
        print(_table(rows))
        for line in _ratios(rows):
            print(line)
        print(
            "speedup: fused call vs K single-update passes (K x one measured pass) of the same impl; vs jnp: of the "
            "jnp reference; BW: % of the vendor peak bandwidth; copy: % of a measured x + 1 (practical peak)"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
