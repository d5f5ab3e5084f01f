"""``zeroth bench hosts``: an AQ-SGD pipeline over two hosts whose link is limited to a rate, next
to the same pipeline in float32 on a fast link; the hosts are network namespaces on this machine
(root only), each stage started by ``zeroth launch`` as on real hosts.

  zeroth bench hosts [--config experiments/aqsgd_transformer_sotu.yaml] [--rates 100,500,10000]
                     [--compressions fp32,aqsgd] [--steps N] [--json]

For every compression and rate (Mbit/s, ``tc tbf`` on both ends of each host's link) it runs the
config's pipeline (its emulated bandwidth and latency switched off: the real link limits it) and
prints the run's wall time, the median step after the first epoch (AQ-SGD sends every example in
full precision the first time it sees it), the bytes on the wire from the kernel's interface
counters, and the frames' payload; the baseline row is float32 at the highest rate.
"""

from __future__ import annotations

import argparse
import json
import secrets
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

__all__ = ["main", "measure"]

PORT = 29400


def measure(config: str, compression: str, rate_mbit: float, steps: int | None, work: Path) -> dict:
    """One run of ``config``'s pipeline over two namespaces at ``rate_mbit``: its measurements."""
    from zeroth import config as _config
    from zeroth.bench import netns

    sets = [
        f"pipeline.compression={compression}",
        "pipeline.bandwidth_bps=null",
        "pipeline.latency_ms=0",
        "pipeline.emulate_bandwidths_bps=[]",
        *([f"train.steps={steps}"] if steps else []),
    ]
    cfg = _config.load_config(config, sets)
    if cfg.pipeline is None or cfg.pipeline.stages != 2:
        raise ValueError(f"{config}: zeroth bench hosts runs a pipeline: config of 2 stages")
    work.mkdir(parents=True, exist_ok=True)
    path = work / "config.yaml"
    path.write_text(_config.to_yaml(cfg))
    secret = work / "run.secret"
    secret.write_text(secrets.token_hex(32) + "\n")
    secret.chmod(0o600)
    with netns.hosts(2) as hosts:
        for h in hosts:
            h.limit(rate_mbit)
        before = [h.bytes() for h in hosts]
        t0 = time.monotonic()
        procs = []
        for i, h in enumerate(hosts):
            cmd = [
                sys.executable,
                "-m",
                "zeroth",
                "launch",
                str(path),
                "--rendezvous",
                f"{hosts[0].address}:{PORT}",
                "--nnodes",
                "2",
                "--node-rank",
                str(i),
                "--out",
                str(work / f"h{i}"),
                "--secret-file",
                str(secret),
                "--quiet",
            ]
            with (work / f"h{i}.log").open("w") as log:
                procs.append(subprocess.Popen(h.command(cmd), stdout=log, stderr=subprocess.STDOUT))
        codes = [p.wait(timeout=3600) for p in procs]
        wall = time.monotonic() - t0
        after = [h.bytes() for h in hosts]
    if any(codes):
        raise RuntimeError(f"the pipeline failed (exit codes {codes}); see {work}/h*.log")
    rows = [json.loads(x) for x in (work / "h1" / "stage_1" / "metrics.jsonl").read_text().splitlines() if x.strip()]
    first = [json.loads(x) for x in (work / "h0" / "stage_0" / "metrics.jsonl").read_text().splitlines() if x.strip()]
    per_epoch = max(1, cfg.pipeline.examples // cfg.data.batch_size)
    later = [r["step_time_s"] for r in rows if r.get("kind") == "train" and r["step"] > per_epoch] or [
        r["step_time_s"] for r in rows if r.get("kind") == "train"
    ]
    wire = sum(a[0] - b[0] for a, b in zip(after, before))  # every byte either host sent, headers included
    payload = sum(r.get("fw_bytes", 0) for r in first) + sum(r.get("bw_bytes", 0) for r in rows)
    return {
        "compression": compression,
        "fw_bits": cfg.pipeline.fw_bits,
        "bw_bits": cfg.pipeline.bw_bits,
        "rate_mbit": rate_mbit,
        "steps": cfg.train.steps,
        "wall_s": wall,
        "step_s_median_after_epoch0": statistics.median(later),
        "final_loss": rows[-1].get("loss"),
        "wire_bytes": wire,
        "payload_bytes": payload,
    }


def main(argv: list[str]) -> int:
    """Entry point of ``zeroth bench hosts``; returns the exit code."""
    p = argparse.ArgumentParser(prog="zeroth bench hosts", description=__doc__.split("\n")[0])
    p.add_argument("--config", default="experiments/aqsgd_transformer_sotu.yaml", help="a 2-stage pipeline config")
    p.add_argument("--rates", default="100,500,10000", help="link rates in Mbit/s, comma-separated")
    p.add_argument("--compressions", default="fp32,aqsgd", help="pipeline.compression values, comma-separated")
    p.add_argument("--steps", type=int, default=None, help="train.steps (default: the config's)")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of the table")
    args = p.parse_args(argv)
    from zeroth.bench import netns

    why = netns.unavailable()
    if why:
        print(f"zeroth bench hosts: error: {why}", file=sys.stderr)
        return 2
    try:
        rates = [float(r) for r in args.rates.split(",")]
    except ValueError:
        print(
            f"zeroth bench hosts: error: --rates {args.rates!r}: expected numbers (Mbit/s) separated by commas",
            file=sys.stderr,
        )
        return 2
    results = []
    with tempfile.TemporaryDirectory(prefix="zeroth-bench-hosts-") as tmp:
        for comp in args.compressions.split(","):
            for rate in rates:
                r = measure(args.config, comp, rate, args.steps, Path(tmp) / f"{comp}-{rate:g}")
                results.append(r)
                if not args.json:
                    print(f"  ... {comp} at {rate:g} Mbit/s: {r['wall_s']:.1f} s", file=sys.stderr, flush=True)
    base = max((r for r in results if r["compression"] == "fp32"), key=lambda r: r["rate_mbit"], default=results[0])
    for r in results:
        r["wall_vs_baseline"] = r["wall_s"] / base["wall_s"]
    out = {
        "config": args.config,
        "baseline": {"compression": base["compression"], "rate_mbit": base["rate_mbit"]},
        "runs": results,
    }
    if args.json:
        print(json.dumps(out, indent=1))
        return 0
    print(
        f"{'compression':<12}{'Mbit/s':>8}{'run s':>9}{'vs base':>9}{'step s (after epoch 0)':>24}"
        f"{'wire MB':>10}{'payload MB':>12}{'final loss':>12}"
    )
    for r in results:
        print(
            f"{r['compression']:<12}{r['rate_mbit']:>8g}{r['wall_s']:>9.1f}{r['wall_vs_baseline']:>9.2f}"
            f"{r['step_s_median_after_epoch0']:>24.3f}{r['wire_bytes'] / 1e6:>10.2f}{r['payload_bytes'] / 1e6:>12.2f}"
            f"{r['final_loss']:>12.4f}"
        )
    print(f"baseline: {base['compression']} at {base['rate_mbit']:g} Mbit/s; wire bytes from the interfaces' counters")
    print(json.dumps(out))
    return 0
