"""``zeroth bench ravnest``: idle time per stage, asynchronous (Ravnest) next to fill-and-drain (GPipe).

Both run as real processes on 127.0.0.1 on the same model, data and link emulation:

* **fill-and-drain**: the AQ-SGD pipeline (:mod:`zeroth.pipeline`) with float32 links,
  ``S`` stages, ``M`` micro-batches of ``B/M`` examples per step, one update per step;
* **asynchronous**: one Ravnest cluster (:mod:`zeroth.cluster`) of ``S`` nodes, one
  batch of ``B/M`` examples per update, ``steps·M`` batches (the same examples seen, the same
  number of forward and backward passes), no averaging.

A stage's idle time is what it spent blocked waiting for an activation or a gradient (``wait_s``
of the pipeline's stages, ``idle_s`` of the nodes), as a fraction of its wall time, in the steady
state: after ``--warmup`` pipeline steps (``warmup · M`` Ravnest batches), which hold the
compilations and the first fill. The nodes'
RAM is set in proportion to the pipeline stages' parameter bytes, so Ravnest's RAM-proportional
split cuts the model where the pipeline does (both splits are printed).

  zeroth bench ravnest [--stages 2] [--steps 8] [--micro-batches 4] [--bandwidth-mbps 100] [--slowdown 4] [--json]
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

from zeroth import config as _config
from zeroth.cluster import build as cbuild
from zeroth.cluster import engine
from zeroth.cluster import launch as ravnest_launch
from zeroth.pipeline import launch as pipeline_launch
from zeroth.stages import partition

__all__ = ["main"]


def _base(args) -> dict:
    return {
        "run": {"name": "bench_ravnest", "seed": 0},
        "data": {"dataset": "sentiment", "batch_size": args.batch_size},
        "model": {"name": "transformer", "kwargs": {"layers": args.blocks}},
        "train": {"method": "backprop", "lr": 1e-3, "optimizer": {"name": "adamw"}},
    }


def _json(path: Path) -> list[dict]:
    return [json.loads(ln) for ln in path.read_text().splitlines() if ln.strip()]


def run(args) -> dict:
    S, M, B = args.stages, args.micro_batches, args.batch_size
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        raw = _base(args)
        raw["train"]["steps"] = args.steps
        raw["pipeline"] = {
            "stages": S,
            "micro_batches": M,
            "objective": "classify",
            "examples": 64,
            "seq_len": 32,
            "compression": "fp32",
            "bandwidth_bps": args.bandwidth_mbps * 1e6,
            "latency_ms": args.latency_ms,
            "slowdown": args.slowdown,
        }
        pcfg = _config.load_config_dict(raw)
        if pipeline_launch.run_config(pcfg, tmp / "gpipe", [], progress=False) != 0:
            raise RuntimeError("the fill-and-drain pipeline failed; see its stage logs")
        gp = []
        for i in range(S):
            # train rows of schema v1: ``step`` counts the steps completed, so the warm-up rows are steps 1..warmup
            recs = [
                r
                for r in _json(pipeline_launch.stage_dir(tmp / "gpipe", i) / "metrics.jsonl")
                if r["kind"] == "train" and r["step"] > args.warmup
            ]
            wall = sum(r["step_time_s"] for r in recs)
            gp.append(
                {
                    "stage": i,
                    "idle_s": sum(r["wait_s"] for r in recs),
                    "wall_s": wall,
                    "compute_s": sum(r["compute_s"] for r in recs),
                }
            )
        raw = _base(args)
        raw["data"]["batch_size"] = B // M
        raw["train"]["steps"] = args.steps * M
        raw["ravnest"] = {
            "clusters": 1,
            "examples": 64,
            "seq_len": 32,
            "average_every": 0,
            "latency_ms": args.latency_ms,
            "nodes": [
                {"name": f"s{i}", "ram_mb": 64, "bandwidth_mbps": args.bandwidth_mbps, "speed": 1.0 / args.slowdown}
                for i in range(S)
            ],
        }
        rcfg = _config.load_config_dict(raw)
        # RAM in proportion to the fill-and-drain stages' loads: the RAM-proportional split then cuts where they cut
        _, params = cbuild.model_of(rcfg, cbuild.examples_of(rcfg))
        ub = engine.unit_bytes(params, engine.model_units(args.blocks))
        loads = [
            sum(ub[(0 if i == 0 else lo + 1) : (hi + 1 if i < S - 1 else len(ub))])
            for i, (lo, hi) in enumerate(partition.block_ranges(args.blocks, S))
        ]
        for node, load in zip(raw["ravnest"]["nodes"], loads):
            node["ram_mb"] = 3 * cbuild.STATE_PER_PARAM_BYTE * load / cbuild.MB
        rcfg = _config.load_config_dict(raw)
        if ravnest_launch.run_config(rcfg, tmp / "ravnest", [], progress=False) != 0:
            raise RuntimeError("the Ravnest cluster failed; see its node logs")
        summary = json.loads((tmp / "ravnest" / "summary.json").read_text())
        plan = summary["plan"]
        rv = []
        for i, name in enumerate(plan["clusters"][0]):
            n = summary["nodes"][name]
            recs = [
                r
                for r in _json(ravnest_launch.node_dir(tmp / "ravnest", name) / "metrics.jsonl")
                if r["kind"] == "train"
            ]
            # the window: from the end of the warm-up batch to the last update
            t0 = next(r["time_unix_s"] for r in recs if r["step"] == args.warmup * M)
            steady = [r for r in recs if r["step"] > args.warmup * M]
            rv.append(
                {
                    "stage": i,
                    "idle_s": sum(r["idle_s"] for r in steady),
                    "wall_s": steady[-1]["time_unix_s"] - t0,
                    "compute_s": sum(r["compute_s"] for r in steady),
                    "staleness_max": n["staleness_max"],
                }
            )
    rows = []
    for g, r in zip(gp, rv):
        rows.append(
            {
                "stage": g["stage"],
                "gpipe_idle_fraction": g["idle_s"] / g["wall_s"],
                "gpipe_idle_s": g["idle_s"],
                "gpipe_wall_s": g["wall_s"],
                "ravnest_idle_fraction": r["idle_s"] / r["wall_s"],
                "ravnest_idle_s": r["idle_s"],
                "ravnest_wall_s": r["wall_s"],
                "ravnest_staleness_max": r["staleness_max"],
            }
        )
    return {
        "stages": S,
        "micro_batches": M,
        "batch_size": B,
        "steps": args.steps,
        "bandwidth_mbps": args.bandwidth_mbps,
        "slowdown": args.slowdown,
        "warmup_steps": args.warmup,
        "latency_ms": args.latency_ms,
        "gpipe_blocks": partition.block_ranges(args.blocks, S),
        "ravnest_blocks": plan["block_ranges"][0],
        "rows": rows,
        "gpipe_wall_s": max(g["wall_s"] for g in gp),
        "ravnest_wall_s": max(r["wall_s"] for r in rv),
    }


def main(argv: list[str]) -> int:
    """Entry point of ``zeroth bench ravnest``."""
    p = argparse.ArgumentParser(prog="zeroth bench ravnest", description=__doc__.splitlines()[0])
    p.add_argument("--stages", type=int, default=2)
    p.add_argument("--blocks", type=int, default=2, help="transformer blocks (model.kwargs.layers)")
    p.add_argument("--steps", type=int, default=16, help="pipeline steps (Ravnest runs steps x micro-batches batches)")
    p.add_argument("--micro-batches", type=int, default=4)
    p.add_argument("--batch-size", type=int, default=64)
    p.add_argument("--bandwidth-mbps", type=float, default=100.0)
    p.add_argument("--latency-ms", type=float, default=1.0)
    p.add_argument(
        "--slowdown",
        type=float,
        default=4.0,
        help="emulated compute speed of every stage (sleep (k-1)x each computation): the stages then do not "
        "compete for this machine's cores, which would otherwise count as waiting",
    )
    p.add_argument(
        "--warmup", type=int, default=2, help="pipeline steps left out of the idle fractions (compilation, first fill)"
    )
    p.add_argument("--json", action="store_true", help="print the JSON only")
    args = p.parse_args(argv)
    if args.batch_size % args.micro_batches:
        print(
            f"zeroth bench ravnest: error: --micro-batches {args.micro_batches} must divide --batch-size {args.batch_size}",
            file=sys.stderr,
        )
        return 2
    res = run(args)
    if args.json:
        print(json.dumps(res, indent=1))
        return 0
    print(
        f"idle time per stage: {args.stages} stages, {args.steps} steps of {args.batch_size} examples "
        f"({args.micro_batches} micro-batches) vs {args.steps * args.micro_batches} asynchronous batches of "
        f"{args.batch_size // args.micro_batches}, {args.bandwidth_mbps:g} Mbit/s, {args.latency_ms:g} ms, "
        f"compute slowed {args.slowdown:g}x"
    )
    print(f"blocks per stage: fill-and-drain {res['gpipe_blocks']}, Ravnest {res['ravnest_blocks']}")
    print(f"{'stage':>5}  {'fill-and-drain idle':>20}  {'Ravnest idle':>14}  {'Ravnest staleness':>17}")
    for r in res["rows"]:
        print(
            f"{r['stage']:>5}  {r['gpipe_idle_fraction']:>13.1%} of {r['gpipe_wall_s']:4.1f}s"
            f"  {r['ravnest_idle_fraction']:>7.1%} of {r['ravnest_wall_s']:4.1f}s  {r['ravnest_staleness_max']:>17}"
        )
    print(
        f"steady-state wall (after the warm-up): fill-and-drain {res['gpipe_wall_s']:.2f}s, Ravnest {res['ravnest_wall_s']:.2f}s"
    )
    print(json.dumps(res))
    return 0
