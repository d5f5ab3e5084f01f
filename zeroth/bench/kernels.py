"""``zeroth bench kernels [--json] [--size N] [--ks 1,16,64] [--sections ...]``: the kernels' speed.

**Fused replay** (:mod:`zeroth.kernels.perturb`). For every implementation available here
(``jnp`` always; ``native`` on CPU when it builds; ``pallas`` natively on GPU/TPU only) and each
exact distribution, on one float32 leaf of N elements (default 2**24), donated:

* **fused K**: one call applying K updates (K = 1, 16, 64 by default);
* **K passes**: K consecutive single-update calls of the same implementation, and of the
  ``jnp`` reference (what a replay without the fused kernels costs), timed as one unit;

as elements/s (``N / t``) and element-updates/s (``N K / t``), the speedups, and on an
accelerator the fraction of memory bandwidth the call reaches (bytes read + written / time)
against the device's vendor peak (:data:`PEAK_BANDWIDTH_GBS`, by device kind) and against a
measured copy (``x + 1``, donated: the practical peak).

**Pallas tiles** (:func:`tile_rows`): the Pallas kernel under each tiling of
:data:`TILE_CANDIDATES` at K = 1 and the largest K, natively on GPU and TPU, with the fractions of
the peak and of the copy, and the best tiling per distribution and K in the ratios (how the
default tiling of a platform is chosen and checked); elsewhere in interpret mode on a small leaf.

**Baselines**, side by side: the copy (memory floor), ``jax.random.normal`` + add and, when
torch is installed, ``torch.randn`` + ``add_``.

**Instruction sets** (CPU): the native kernel built for each x86-64 level this CPU can run
(``x86-64-v4``: AVX-512; ``x86-64-v3``: AVX2; ``x86-64``: the plain loops) beside the default
``-march=native`` build, each a fused replay at K = 1 and the largest K
(:func:`instruction_set_rows`; ratios ``isa_<level>_<distribution>_K<k>_over_native``).

The benchmark is a list of sections (:data:`SECTIONS`), each a function
``(Context) -> list[dict]`` of rows; a kernel adds its rows by adding a section. The sign-bit
rows are :func:`zeroth.bench.signbits.signbits_rows`.

Example:
  $ zeroth bench kernels --size 4194304 --ks 1,16 --json
"""

from __future__ import annotations

import dataclasses
import functools
import importlib.util
import sys
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np

from zeroth import replay, rng
from zeroth.bench import _common
from zeroth.bench.signbits import signbits_rows
from zeroth.kernels import cpu_native
from zeroth.kernels import perturb as kp
from zeroth.rule import default_platform, platform_name

__all__ = ["Context", "SECTIONS", "TILE_CANDIDATES", "PEAK_BANDWIDTH_GBS", "peak_bandwidth", "run", "main"]

# Peak memory bandwidth in GB/s by device kind (vendor figures), for the bandwidth fraction.
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
_COEFF = 1e-3


def peak_bandwidth(device_kind: str) -> float | None:
    """Vendor peak memory bandwidth (GB/s) of a ``device.device_kind``: the longest matching name."""
    matches = [k for k in PEAK_BANDWIDTH_GBS if k.lower() in device_kind.lower()]
    return PEAK_BANDWIDTH_GBS[max(matches, key=len)] if matches else None


@dataclasses.dataclass(frozen=True)
class Context:
    """What a section needs.

    Attributes:
      size: elements of the benchmarked leaf.
      ks: update counts K for the fused replay.
      repeats: timed calls per row (the best is kept, the median shown).
      warmup: untimed calls first.
      backend: where the rows' arrays go (:func:`zeroth.rule.default_platform`: ``"cpu"``, ``"gpu"``, ``"tpu"``).
      device_kind: that platform's first device's ``device_kind``.
    """

    size: int
    ks: tuple[int, ...]
    repeats: int
    warmup: int
    backend: str
    device_kind: str


def _time_donated(step: Callable, state, ctx: Context, repeats: int | None = None) -> _common.Timing:
    """Time ``state = step(state)``, the state's buffers donated on every call."""
    box = [state]

    def call():
        box[0] = jax.block_until_ready(step(box[0]))

    return _common.timeit(call, warmup=ctx.warmup, repeats=ctx.repeats if repeats is None else repeats)


def _leaf(n: int) -> jax.Array:
    return jnp.asarray(np.random.default_rng(0).normal(size=n).astype(np.float32))


def _row(section: str, name: str, impl: str, n: int, t: _common.Timing | None, **extra) -> dict:
    row = {"section": section, "name": name, "impl": impl, "elements": n, **extra}
    k = extra.get("k", 1)
    if t is not None:
        row.update(
            seconds_min=t.min_s,
            seconds_median=t.median_s,
            repeats=t.repeats,
            elements_per_s=n / t.min_s,
            updates_per_s=n * k / t.min_s,
        )
    return row


def _updates(dist: str, k: int) -> tuple[jax.Array, jax.Array]:
    """The leaf keys ``u32[K, 2]`` and scales ``f32[K]`` of the K updates every replay row applies."""
    keys = rng.sample_keys(0, [(0, 1, s) for s in range(k)])
    scales = replay.update_scales(dist, [_COEFF * (1 + s % 3) for s in range(k)])
    return kp.leaf_keys(keys, 0x5EED), jnp.asarray(scales)


def _copy_timing(ctx: Context) -> _common.Timing:
    step = jax.jit(lambda x: x + jnp.float32(1.0), donate_argnums=0)
    return _time_donated(step, _leaf(ctx.size), ctx)


# --------------------------------------------------------------------------- sections


def baseline_rows(ctx: Context) -> list[dict]:
    """The memory floor and the Gaussian perturbations of jax and torch."""
    n = ctx.size
    rows = [_row("baseline", "copy x + 1 (memory floor)", "xla", n, _copy_timing(ctx))]

    @functools.partial(jax.jit, donate_argnums=0)
    def normal(x, key):
        return x + jnp.float32(_COEFF) * jax.random.normal(key, x.shape, jnp.float32)

    key = jax.random.key(0)
    rows.append(
        _row(
            "baseline",
            "jax.random.normal + add",
            "xla",
            n,
            _time_donated(lambda x: normal(x, key), _leaf(n), ctx),
            note="backend-dependent",
        )
    )
    if importlib.util.find_spec("torch") is None:
        rows.append(_row("baseline", "torch.randn + add_", "torch", n, None, note="torch not installed"))
        return rows
    import torch

    gen = torch.Generator().manual_seed(0)
    p = torch.zeros(n, dtype=torch.float32)
    t = _common.timeit(
        lambda: p.add_(torch.randn(n, generator=gen, dtype=torch.float32), alpha=_COEFF),
        warmup=ctx.warmup,
        repeats=ctx.repeats,
    )
    rows.append(_row("baseline", "torch.randn + add_", "torch", n, t, note=f"{torch.get_num_threads()} threads"))
    return rows


def _impls(ctx: Context) -> list[str]:
    impls = ["jnp"]
    if ctx.backend == "cpu" and cpu_native.available():
        impls.append("native")
    if platform_name(ctx.backend) in ("gpu", "tpu"):
        impls.append("pallas")
    return impls


def fused_replay_rows(ctx: Context) -> list[dict]:
    """Fused replay of K updates against K single-update passes, per implementation.

    The K passes are timed as what they are, K consecutive single-update calls (not K times the
    best single call), so both sides of a speedup run for comparable wall time and meet
    comparable interference on a shared machine.
    """
    n = ctx.size
    accel = ctx.backend != "cpu"
    peak = peak_bandwidth(ctx.device_kind) if accel else None
    copy_s = _copy_timing(ctx).min_s if accel else None

    def step(impl: str, dist: str, k: int):
        lk, scales = _updates(dist, k)
        return jax.jit(
            lambda x: kp.perturb_leaf(x, lk, scales, distribution=dist, impl=impl, inplace=True), donate_argnums=0
        )

    def passes(impl: str, dist: str, k: int) -> _common.Timing:
        one = step(impl, dist, 1)

        def k_calls(x):
            for _ in range(k):
                x = one(x)
            return x

        return _time_donated(k_calls, _leaf(n), ctx, max(1, ctx.repeats // 2) if k >= 16 else None)

    jnp_passes: dict[tuple[str, int], float] = {}
    rows = []
    for impl in _impls(ctx):  # "jnp" first: its passes are every row's second baseline
        for dist in ("binomial", "rademacher"):
            for k in ctx.ks:
                t = _time_donated(step(impl, dist, k), _leaf(n), ctx, max(1, ctx.repeats // 2) if k >= 16 else None)
                t_passes = t.min_s if k == 1 else passes(impl, dist, k).min_s
                jnp_passes.setdefault((dist, k), t_passes)
                rows.append(
                    _row(
                        "fused replay",
                        f"{dist} fused K={k}",
                        impl,
                        n,
                        t,
                        distribution=dist,
                        k=k,
                        passes_seconds=t_passes,
                        speedup_vs_passes=t_passes / t.min_s,
                        speedup_vs_jnp_passes=jnp_passes[(dist, k)] / t.min_s,
                        bandwidth_fraction=(2 * 4 * n / t.min_s / 1e9 / peak) if peak else None,
                        copy_fraction=(copy_s / t.min_s) if copy_s else None,
                    )
                )
    return rows


def instruction_set_rows(ctx: Context) -> list[dict]:
    """On a CPU, the native kernel built for each x86-64 level of
    :data:`zeroth.kernels.cpu_native.INSTRUCTION_SETS` this CPU can run (AVX-512, AVX2, the
    baseline's plain loops) beside the default ``-march=native`` build: fused replay at K = 1 and
    the largest K, in place, donated. What an older CPU's path costs, measured on this one (the
    same bits: ``tests/test_kernels_perturb.py``); a level this CPU cannot run, or a build that
    fails, gets a row naming why."""
    if ctx.backend != "cpu" or not cpu_native.available():
        return []
    ks = sorted({1, max(ctx.ks)})
    builds: list[tuple[str, cpu_native.BuildConfig | None, str | None]] = [("native", cpu_native.DEFAULT_BUILD, None)]
    for march in cpu_native.INSTRUCTION_SETS:
        try:
            builds.append((march, cpu_native.build_for(march), None))
        except ValueError as exc:
            builds.append((march, None, str(exc)))
    rows = []
    for march, build, why in builds:
        if build is not None and not cpu_native.available(build):
            build, why = None, cpu_native.unavailable_reason(build)
        for dist in ("binomial", "rademacher"):
            for k in ks:
                t = None
                if build is not None:
                    lk, scales = _updates(dist, k)
                    step = jax.jit(
                        lambda x, lk=lk, scales=scales, dist=dist, build=build: kp.perturb_native(
                            x, lk, scales, distribution=dist, inplace=True, build=build
                        ),
                        donate_argnums=0,
                    )
                    t = _time_donated(step, _leaf(ctx.size), ctx)
                rows.append(
                    _row(
                        "instruction sets",
                        f"{dist} K={k}, -march={march}",
                        f"native:{march}",
                        ctx.size,
                        t,
                        distribution=dist,
                        k=k,
                        march=march,
                        note=why,
                    )
                )
    return rows


# The Pallas tilings ``tile_rows`` times, by platform: grouped rows (one threefry call per row) of
# growing tiles and lane-dense rows on GPU (Triton), lane-dense tiles of 8 to 256 rows on TPU
# (Mosaic); elsewhere two small tilings in interpret mode (the sweep's own check, not a speed).
TILE_CANDIDATES: dict[str, tuple[kp.BlockSizes, ...]] = {
    "gpu": (
        *(kp.BlockSizes(tile=1 << t, lanes=None) for t in range(10, 17)),
        kp.BlockSizes(tile=8192, lanes=128),
        kp.BlockSizes(tile=32768, lanes=256),
    ),
    "tpu": (
        *(kp.BlockSizes(tile=rows * 1024, lanes=1024) for rows in (8, 32, 128, 256)),
        kp.BlockSizes(tile=64 * 512, lanes=512),
    ),
    "cpu": (kp.BlockSizes(tile=256, lanes=None), kp.BlockSizes(tile=512, lanes=128)),
}
# Interpret mode runs a grid step as many small ops: the sweep there uses a leaf of at most this.
_INTERPRET_MAX_SIZE = 4096


def tile_rows(ctx: Context) -> list[dict]:
    """The Pallas kernel under each tiling of :data:`TILE_CANDIDATES` for this platform, at K = 1
    and the largest K, donated: elements/s, and on an accelerator the fractions of the vendor peak
    and of a measured copy. Natively on GPU and TPU (where the default tiling is to be chosen);
    elsewhere in interpret mode on a leaf of at most 4,096 elements, which checks the sweep, not
    the speed. A tiling the platform refuses gets a row naming why."""
    platform = platform_name(ctx.backend)
    native = platform in ("gpu", "tpu")
    n = ctx.size if native else min(ctx.size, _INTERPRET_MAX_SIZE)
    peak = peak_bandwidth(ctx.device_kind) if native else None
    copy_s = _copy_timing(dataclasses.replace(ctx, size=n)).min_s if native else None
    default = kp.default_block_sizes(platform)
    rows = []
    for dist in ("binomial", "rademacher"):
        for k in sorted({1, max(ctx.ks)}):
            lk, scales = _updates(dist, k)
            for blocks in TILE_CANDIDATES.get(platform, TILE_CANDIDATES["cpu"]):
                name = f"{dist} K={k} tile={blocks.tile} lanes={blocks.lanes}"
                extra = {
                    "distribution": dist,
                    "k": k,
                    "tile": blocks.tile,
                    "lanes": blocks.lanes,
                    "default": blocks == default,
                    "interpret": not native,
                }
                try:
                    kp.check_block_sizes(blocks, platform, dist)
                except ValueError as exc:
                    rows.append(_row("pallas tiles", name, "pallas", n, None, note=str(exc), **extra))
                    continue
                step = jax.jit(
                    functools.partial(
                        kp.perturb_pallas,
                        leaf_keys_=lk,
                        scales=scales,
                        distribution=dist,
                        block_sizes=blocks,
                        interpret=not native,
                        inplace=True,
                    ),
                    donate_argnums=0,
                )
                t = _time_donated(step, _leaf(n), ctx)
                rows.append(
                    _row(
                        "pallas tiles",
                        name,
                        "pallas",
                        n,
                        t,
                        **extra,
                        bandwidth_fraction=(2 * 4 * n / t.min_s / 1e9 / peak) if peak else None,
                        copy_fraction=(copy_s / t.min_s) if copy_s else None,
                        note="interpret mode: checks the sweep, not a speed"
                        if not native
                        else ("the default tiling" if blocks == default else None),
                    )
                )
    return rows


# Each section: (name, function). Add a kernel's rows by adding a section here.
SECTIONS: list[tuple[str, Callable[[Context], list[dict]]]] = [
    ("baseline", baseline_rows),
    ("fused", fused_replay_rows),
    ("tiles", tile_rows),
    ("signbits", signbits_rows),
    ("isa", instruction_set_rows),
]


# --------------------------------------------------------------------------- output


def _ratios(rows: list[dict]) -> dict:
    rate = {r["name"]: r.get("elements_per_s") for r in rows if r["section"] == "baseline"}
    out = {}
    for r in rows:
        if r["section"] == "pallas tiles" and r.get("elements_per_s") is not None:
            key = f"pallas_tiles_{r['distribution']}_K{r['k']}"
            if r["elements_per_s"] > out.get(f"{key}_best_elements_per_s", 0.0):
                out[f"{key}_best_elements_per_s"] = r["elements_per_s"]
                out[f"{key}_best_tile"] = r["tile"]
                out[f"{key}_best_lanes"] = r["lanes"]
                if r.get("copy_fraction") is not None:
                    out[f"{key}_best_copy_fraction"] = r["copy_fraction"]
            continue
        if r["section"] == "instruction sets" and r.get("elements_per_s") is not None:
            if r["march"] != "native":
                native = next(
                    n
                    for n in rows
                    if n["section"] == r["section"]
                    and n["march"] == "native"
                    and n["distribution"] == r["distribution"]
                    and n["k"] == r["k"]
                )
                out[f"isa_{r['march']}_{r['distribution']}_K{r['k']}_over_native"] = (
                    r["elements_per_s"] / native["elements_per_s"]
                )
            continue
        if r["section"] != "fused replay" or r.get("elements_per_s") is None:
            continue
        key = f"{r['impl']}_{r['distribution']}"
        if r["k"] == 1:
            for base, label in (
                ("torch.randn + add_", "torch"),
                ("jax.random.normal + add", "jax_normal"),
                ("copy x + 1 (memory floor)", "copy"),
            ):
                if rate.get(base):
                    out[f"{key}_perturb_over_{label}"] = r["elements_per_s"] / rate[base]
        else:
            out[f"{key}_K{r['k']}_over_{r['k']}_passes"] = r["speedup_vs_passes"]
            out[f"{key}_K{r['k']}_over_{r['k']}_jnp_passes"] = r["speedup_vs_jnp_passes"]
    return out


def run(
    size: int = 2**24,
    *,
    ks: tuple[int, ...] = (1, 16, 64),
    repeats: int = 5,
    warmup: int = 1,
    sections: tuple[str, ...] | None = None,
) -> dict:
    """Run the named sections (all by default); returns ``{"environment", "rows", "ratios", ...}``."""
    known = [name for name, _ in SECTIONS]
    sections = tuple(known) if sections is None else sections
    if unknown := [s for s in sections if s not in known]:
        raise ValueError(f"unknown section(s) {unknown}; expected some of {known}")
    if size < 1 or any(k < 1 for k in ks):
        raise ValueError(f"size and every K must be >= 1, got size={size}, ks={ks}")
    platform = default_platform()  # where the rows' arrays go: a jax.default_device too
    dev = jax.devices(platform)[0]
    ctx = Context(size, tuple(ks), repeats, warmup, platform, dev.device_kind)
    rows = [row for name, fn in SECTIONS if name in sections for row in fn(ctx)]
    return {
        "benchmark": "kernels",
        "size": size,
        "dtype": "float32",
        "device_kind": ctx.device_kind,
        "peak_bandwidth_gbs": peak_bandwidth(ctx.device_kind),
        "environment": _common.environment(),
        "rows": rows,
        "ratios": _ratios(rows),
    }


def _pct(v: float | None) -> str | None:
    return None if v is None else f"{100 * v:.1f}%"


def _x(v: float | None) -> str | None:
    return None if v is None else f"{v:.2f}x"


def _render(result: dict) -> None:
    env = result["environment"]
    table = [
        {
            **r,
            "dist": r.get("distribution"),
            "best": _common.fmt_seconds(r.get("seconds_min")),
            "median": _common.fmt_seconds(r.get("seconds_median")),
            "rate": _common.fmt_rate(r.get("elements_per_s")),
            "urate": _common.fmt_rate(r.get("updates_per_s"), "upd/s") if r.get("k", 1) > 1 else None,
            "sp": _x(r.get("speedup_vs_passes")),
            "spj": _x(r.get("speedup_vs_jnp_passes")),
            "bw": _pct(r.get("bandwidth_fraction")),
            "copy": _pct(r.get("copy_fraction")),
        }
        for r in result["rows"]
    ]
    _common.print_table(
        [
            ("name", "row"),
            ("impl", "impl"),
            ("best", "best"),
            ("median", "median"),
            ("rate", "elements/s"),
            ("urate", "element-updates/s"),
            ("sp", "vs K passes"),
            ("spj", "vs K jnp passes"),
            ("bw", "BW peak"),
            ("copy", "of copy"),
            ("note", "note"),
        ],
        table,
        title=f"zeroth bench kernels: N = {result['size']:,} float32, donated ({_common.machine_line(env)}, "
        f"{result['device_kind']})",
    )
    print(
        "vs K passes: K consecutive single-update calls of the same impl; vs K jnp passes: of the jnp "
        "reference; BW peak: bytes read+written / time over the vendor peak; of copy: over a measured x + 1"
    )
    print()
    for name, value in result["ratios"].items():
        shown = "-" if value is None else (f"{value:8d}" if isinstance(value, int) else f"{value:8.3g}")
        print(f"  {name:<48} {shown:>8}")


def main(argv: list[str] | None = None) -> int:
    """``zeroth bench kernels``: returns 0 (the numbers are printed, never judged), 2 on bad flags."""
    p = _common.base_parser("zeroth bench kernels", "Fused replay vs K passes per implementation, next to baselines.")
    p.add_argument("--size", type=int, default=2**24, help="elements of the float32 leaf (default 2**24)")
    p.add_argument("--ks", default="1,16,64", help="comma-separated update counts K (default 1,16,64)")
    p.add_argument(
        "--sections",
        default=",".join(name for name, _ in SECTIONS),
        help=f"comma-separated sections (default all: {', '.join(name for name, _ in SECTIONS)})",
    )
    known = [name for name, _ in SECTIONS]
    try:
        args = p.parse_args(sys.argv[1:] if argv is None else argv)
        ks = _common.parse_ks(args.ks)
        sections = tuple(s for s in args.sections.split(",") if s)
        if args.size < 1:
            raise ValueError(f"--size must be a positive number of elements, got {args.size}")
        if unknown := [s for s in sections if s not in known]:
            raise ValueError(f"unknown section(s) {unknown}; expected some of {known}")
    except SystemExit as exc:
        return int(exc.code or 0)
    except ValueError as exc:
        print(f"zeroth bench kernels: {exc}", file=sys.stderr)
        return 2
    result = run(args.size, ks=ks, repeats=args.repeats, warmup=args.warmup, sections=sections)
    _common.emit(result, as_json=args.json, render=_render)
    return 0


if __name__ == "__main__":
    sys.exit(main())
