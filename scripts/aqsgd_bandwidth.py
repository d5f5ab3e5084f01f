"""Time to a target loss of an AQ-SGD pipeline over bandwidth-limited links, measured and computed.

  nice -n 19 python scripts/aqsgd_bandwidth.py [--config experiments/aqsgd_replicas_transformer_sotu.yaml]
      [--runs fp32+fp32@10000 fp32+fp32@500 fp32+fp32@100 aqsgd:4:8+onebit_adam@500 ...]
      [--target LOSS] [--set SECTION.FIELD=VALUE ...] [--out results.json]

Every run is the config's pipeline (``pipeline.stages`` × ``pipeline.replicas`` processes) on as
many hosts, each a Linux network namespace on this machine (root only, :mod:`zeroth.bench.netns`),
every process started by ``zeroth launch`` as on real hosts. ``SETTING@RATE``: the setting as
``python -m zeroth.pipeline.compare --settings`` writes it (``fp32+fp32``,
``aqsgd:4:8+onebit_adam``, ...) and the rate in Mbit/s of every host's link (``tc tbf`` on both
ends of its veth pair: what a host sends and what it receives are each held to the rate). The
config's emulated bandwidth and latency are switched off: the links limit the run.

For every run it reports:

* ``measured_s``: the wall-clock from the end of step 1 (the last process to finish it; step 1
  compiles) to the end of the first epoch whose mean training loss reaches the target (the last
  process to finish that epoch's last step); ``train_s`` the same to the last step, ``launch_s``
  from starting the launchers to their exit (rendezvous, imports and compilation included);
* ``computed_s``: the model of ``python -m zeroth.pipeline.compare`` over the same steps
  (:func:`zeroth.pipeline.sim.emulated_seconds`: ``Σ compute + codec + 8·bytes / rate`` per step,
  no overlap) from this run's measured compute and bytes;
* the medians per step of the stages' summed compute and codec seconds and of the averaging's
  seconds (``sync_s``: exchange and QuantizedAdam's host arithmetic, which the computed time leaves out);
* the wire bytes (the kernel's counters of every host's interface, headers and retransmissions
  included) and the frames' payload bytes.

The target (default: the highest last-epoch mean of the runs, so that every run reaches it) is
the epoch-mean training loss, the replicas' mean. The losses do not depend on the rate (each
setting is deterministic), only the times do. Prints a table and one JSON object (``--out``: also
written there). Needs ``ip`` and ``tc`` (iproute2) and root; the namespaces it makes are removed
on exit.
"""

from __future__ import annotations

import argparse
import json
import secrets
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

PORT = 29400
DEFAULT_RUNS = [
    "fp32+fp32@10000",
    "fp32+fp32@500",
    "fp32+fp32@100",
    "aqsgd:4:8+onebit_adam@10000",
    "aqsgd:4:8+onebit_adam@500",
    "aqsgd:4:8+onebit_adam@100",
]


def _rows(path: Path) -> list[dict]:
    return [r for r in (json.loads(x) for x in path.read_text().splitlines() if x.strip()) if r.get("kind") == "train"]


def run_one(config: str, spec: str, work: Path, overrides: list[str] = ()) -> dict:
    """One run of ``spec`` (``SETTING@RATE``) across namespace hosts: its records and times."""
    from zeroth import config as _config
    from zeroth.bench import netns
    from zeroth.pipeline import compare, launch

    setting, sep, rate = spec.rpartition("@")
    try:
        rate_mbit = float(rate)
    except ValueError:
        rate_mbit = 0.0
    if not sep or not setting or rate_mbit <= 0:
        raise ValueError(f"run {spec!r}: expected SETTING@RATE with RATE in Mbit/s, e.g. fp32+fp32@100")
    cfg = _config.load_config(
        config,
        [*overrides, "pipeline.bandwidth_bps=null", "pipeline.latency_ms=0", "pipeline.emulate_bandwidths_bps=[]"],
    )
    if cfg.pipeline is None:
        raise ValueError(f"{config} has no pipeline: section")
    cfg = compare.apply_setting(cfg, setting)
    p = cfg.pipeline
    S, R = p.stages, p.replicas
    n = S * R
    work.mkdir(parents=True, exist_ok=True)
    path = work / "config.yaml"
    path.write_text(_config.to_yaml(cfg))
    secret = work / "run.secret"
    secret.write_text(secrets.token_hex(32) + "\n")
    secret.chmod(0o600)
    with netns.hosts(n) as hosts:
        for h in hosts:
            h.limit(rate_mbit)
        before = [h.bytes() for h in hosts]
        t0 = time.monotonic()
        procs = []
        for k, h in enumerate(hosts):
            cmd = [
                sys.executable,
                "-m",
                "zeroth",
                "launch",
                str(path),
                "--rendezvous",
                f"{hosts[0].address}:{PORT}",
                "--nnodes",
                str(n),
                "--node-rank",
                str(k),
                "--out",
                str(work / f"h{k}"),
                "--secret-file",
                str(secret),
                "--quiet",
            ]
            with (work / f"h{k}.log").open("w") as log:
                procs.append(subprocess.Popen(h.command(cmd), stdout=log, stderr=subprocess.STDOUT, cwd=ROOT))
        codes = [pr.wait(timeout=1800) for pr in procs]
        launch_s = time.monotonic() - t0
        after = [h.bytes() for h in hosts]
    if any(codes):
        raise RuntimeError(f"run {spec} failed (exit codes {codes}); see {work}/h*.log")
    run = work / "run"  # the hosts' folders collected into one run, laid out as `zeroth run` lays them out
    per_process = []
    for k in range(n):
        replica, stage = divmod(k, S)
        rel = Path(f"replica_{replica}" if replica else ".") / f"stage_{stage}"
        shutil.copytree(work / f"h{k}" / rel, run / rel, dirs_exist_ok=True)
        per_process.append(_rows(run / rel / "metrics.jsonl"))
    if R > 1:
        records = launch.merge_replicas(run, S, R, cfg.data.batch_size, p.examples)
    else:
        records = launch.merge_records(run, S, cfg.data.batch_size, p.examples)
    start = max(rows[0]["time_unix_s"] for rows in per_process)  # the end of step 1
    end_of = {t: max(rows[t - 1]["time_unix_s"] for rows in per_process) for t in range(1, len(records) + 1)}
    return {
        "spec": spec,
        "setting": setting,
        "rate_mbit": rate_mbit,
        "hosts": n,
        "stages": S,
        "replicas": R,
        "steps": len(records),
        "records": records,
        "start_unix_s": start,
        "end_unix_s": end_of,
        "launch_s": launch_s,
        "train_s": end_of[len(records)] - start,
        "wire_bytes": sum(a[0] - b[0] for a, b in zip(after, before)),
        "payload_bytes": sum(r["payload_bytes"] for r in records),
        "epoch_losses": list(compare.epoch_means(records).values()),
        "median_step_s": statistics.median(r["step_time_s"] for r in records),
        "median_compute_s": compare.median_compute(records),
        "median_codec_s": compare.median_compute(records, "codec_s"),
        # the averaging's seconds per step (QuantizedAdam's compression on the host included), the slowest replica link
        "median_sync_s": statistics.median(max((x["sync_s"] for x in r.get("sync", ())), default=0.0) for r in records),
    }


def times_to(run: dict, target: float) -> dict:
    """``measured_s`` and ``computed_s`` of ``run`` to ``target`` (None where it is not reached)."""
    from zeroth.pipeline import compare, sim

    ep = compare.epoch_means(run["records"])
    hit = [e for e, v in ep.items() if v <= target]
    if not hit:
        return {"target_epoch": None, "measured_s": None, "computed_s": None}
    last = max(r["step"] for r in run["records"] if r["epoch"] <= hit[0])
    return {
        "target_epoch": hit[0],
        "measured_s": run["end_unix_s"][last] - run["start_unix_s"],
        "computed_s": sum(
            sim.emulated_seconds(r, run["rate_mbit"] * 1e6) for r in run["records"] if 1 < r["step"] <= last
        ),
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--config", default="experiments/aqsgd_replicas_transformer_sotu.yaml")
    ap.add_argument("--runs", nargs="+", default=DEFAULT_RUNS, metavar="SETTING@RATE")
    ap.add_argument("--target", type=float, default=None, help="epoch-mean loss (default: the runs' highest last)")
    ap.add_argument("--set", dest="overrides", action="append", default=[], metavar="SECTION.FIELD=VALUE")
    ap.add_argument("--out", default=None, help="also write the JSON here")
    args = ap.parse_args(argv)
    from zeroth.bench import netns

    why = netns.unavailable()
    if why:
        print(f"aqsgd_bandwidth: error: {why}", file=sys.stderr)
        return 2
    runs = []
    with tempfile.TemporaryDirectory(prefix="zeroth-aqsgd-bandwidth-") as tmp:
        for i, spec in enumerate(args.runs):
            r = run_one(args.config, spec, Path(tmp) / f"run{i}", args.overrides)
            runs.append(r)
            print(f"  ... {spec}: {r['train_s']:.1f} s of training, {r['launch_s']:.1f} s in all", file=sys.stderr)
    target = args.target if args.target is not None else max(r["epoch_losses"][-1] for r in runs)
    for r in runs:
        r.update(times_to(r, target))
    base = [r for r in runs if r["setting"].startswith("fp32+") or r["setting"] == "fp32"]
    base = max(base, key=lambda r: r["rate_mbit"]) if base else None
    print(f"target: epoch-mean training loss {target:.4f}; x = the baseline's time / the run's (above 1: faster)")
    if base is not None:
        print(f"baseline: {base['setting']} at {base['rate_mbit']:g} Mbit/s")
    print(
        f"{'setting':<24}{'Mbit/s':>8}{'epoch':>7}{'measured s':>12}{'x':>7}{'computed s':>12}{'x':>7}"
        f"{'train s':>9}{'wire MB':>9}{'payload MB':>12}{'last loss':>11}"
    )

    def ratio(a, b):
        return f"{a / b:.2f}" if a and b else "-"

    for r in runs:
        m, c = r["measured_s"], r["computed_s"]
        print(
            f"{r['setting']:<24}{r['rate_mbit']:>8g}{r['target_epoch'] if r['target_epoch'] is not None else '-':>7}"
            f"{m if m is None else f'{m:.1f}':>12}{ratio(base and base['measured_s'], m):>7}"
            f"{c if c is None else f'{c:.1f}':>12}{ratio(base and base['computed_s'], c):>7}"
            f"{r['train_s']:>9.1f}{r['wire_bytes'] / 1e6:>9.1f}{r['payload_bytes'] / 1e6:>12.1f}"
            f"{r['epoch_losses'][-1]:>11.4f}"
        )
    out = {
        "config": args.config,
        "target": target,
        "baseline": None if base is None else {"setting": base["setting"], "rate_mbit": base["rate_mbit"]},
        "runs": [
            {
                k: (round(v, 4) if isinstance(v, float) else v)
                for k, v in r.items()
                if k not in ("records", "end_unix_s", "start_unix_s")
            }
            for r in runs
        ],
    }
    out_text = json.dumps(out)
    print(out_text)
    if args.out:
        Path(args.out).write_text(json.dumps(out, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
