"""``python -m zeroth.pipeline.compare CONFIG --out RESULTS.json``: one config, several link compressions.

Runs the pipeline of ``CONFIG`` once per setting (default: fp32, directq and aqsgd at fw2/bw4,
fw3/bw6 and fw4/bw8), either in this process (``--local``, :func:`zeroth.pipeline.sim.run_local`) or as stage
processes over loopback gRPC (:func:`zeroth.pipeline.launch.run_config`, the link emulation of the
config enforced live). Writes a JSON with every step's record per setting, rewritten after each
setting so a partial result is usable, and prints a table: final loss, the last epoch's mean loss
and its gap to fp32's, ``c_Q`` per link and direction (the seed's condition is ``c_Q < 1/√2``;
``cq_init``: DirectQ of link 0's activations at initialization), bytes per step per link,
measured seconds per step and the emulated seconds per step at each bandwidth of
``pipeline.emulate_bandwidths_bps`` (computed from measured compute and bytes, not enforced), then
the emulated time to fp32's loss over its next-to-last epoch at each bandwidth (from the measured
compute, and again with one compute time per step for every setting, :func:`time_to_target`).

With ``pipeline.replicas`` > 1, a setting may end in ``+fp32`` or ``+onebit_adam``: how the
replicas average (``pipeline.replica_sync``); the table adds the averaging bytes per step.

Example:
  $ python -m zeroth.pipeline.compare experiments/aqsgd_transformer_sotu.yaml --local --out /tmp/r.json
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
from pathlib import Path

CQ_LIMIT = 0.5**0.5  # the seed's condition c_Q < 1/√2 (zeroth.pipeline.engine.CQ_LIMIT)

__all__ = [
    "CQ_LIMIT",
    "DEFAULT_SETTINGS",
    "cq_of",
    "apply_setting",
    "epoch_means",
    "load_results",
    "main",
    "parse_setting",
    "median_compute",
    "replica_sync_of",
    "summarize",
    "time_to_target",
    "upgrade_record",
]

DEFAULT_SETTINGS = ("fp32", "directq:2:4", "aqsgd:2:4", "directq:3:6", "aqsgd:3:6", "directq:4:8", "aqsgd:4:8")


_AXES = ("channel", "row")
_ROUNDINGS = ("stochastic", "nearest")


def replica_sync_of(text: str) -> str | None:
    """The replicas' averaging a setting names after ``+`` (``"aqsgd:2:4+onebit_adam"`` -> ``"onebit_adam"``), or None."""
    if "+" not in text:
        return None
    sync = text.split("+", 1)[1]
    if sync not in ("fp32", "onebit_adam"):
        raise ValueError(f"setting {text!r}: the replicas' averaging after '+' is fp32 or onebit_adam, got {sync!r}")
    return sync


def parse_setting(text: str) -> tuple[str, int, int, str | None, str | None]:
    """``"aqsgd:2:4"`` -> ``("aqsgd", 2, 4, None, None)``; ``"aqsgd:2:4:row"`` names the scale axis,
    ``"aqsgd:2:4:nearest"`` the rounding, ``"aqsgd:2:4:row:nearest"`` both; ``"fp32"``. A suffix
    ``+fp32`` or ``+onebit_adam`` names the data-parallel replicas' averaging (:func:`replica_sync_of`)."""
    replica_sync_of(text)
    parts = text.split("+", 1)[0].split(":")
    if parts[0] == "fp32" and len(parts) == 1:
        return "fp32", 0, 0, None, None
    extra = parts[3:]
    axis = next((e for e in extra if e in _AXES), None)
    rounding = next((e for e in extra if e in _ROUNDINGS), None)
    if (
        len(parts) < 3
        or parts[0] not in ("directq", "aqsgd")
        or len(extra) > 2
        or len(extra) != (axis is not None) + (rounding is not None)
        or not (parts[1].isdigit() and parts[2].isdigit())
    ):
        raise ValueError(
            f"setting {text!r}: expected fp32, directq:FW:BW[:AXIS][:ROUNDING] or aqsgd:FW:BW[:AXIS][:ROUNDING] "
            f"(AXIS {'/'.join(_AXES)}, ROUNDING {'/'.join(_ROUNDINGS)}; e.g. aqsgd:2:4:row:nearest)"
        )
    return parts[0], int(parts[1]), int(parts[2]), axis, rounding


def setting_name(text: str) -> str:
    """``"aqsgd:2:4"`` -> ``"aqsgd fw2/bw4"``; ``"aqsgd:2:4:row:nearest"`` -> ``"aqsgd fw2/bw4 row nearest"``."""
    name, fw, bw, axis, rounding = parse_setting(text)
    sync = replica_sync_of(text)
    base = name if name == "fp32" else f"{name} fw{fw}/bw{bw}" + "".join(f" {e}" for e in (axis, rounding) if e)
    return base + (f" + {sync}" if sync else "")


def apply_setting(cfg, text: str):
    """The config with ``pipeline.compression`` / ``fw_bits`` / ``bw_bits`` / ``scale_axis`` / ``rounding`` of the setting."""
    name, fw, bw, axis, rounding = parse_setting(text)
    p = cfg.pipeline
    p = dataclasses.replace(
        p,
        compression=name,
        fw_bits=fw or p.fw_bits,
        bw_bits=bw or p.bw_bits,
        scale_axis=axis or p.scale_axis,
        rounding=rounding or p.rounding,
        replica_sync=replica_sync_of(text) or p.replica_sync,
    )
    return dataclasses.replace(cfg, pipeline=p)


def _mean(values) -> float | None:
    v = [x for x in values if x is not None]
    return sum(v) / len(v) if v else None


def cq_of(records: list[dict], key: str, link: int = 0) -> dict:
    """``c_Q`` of one link and direction (``key``: ``fw_cq`` or ``bw_cq``) over a run: ``init``, the
    quantizer on the tensors of step 0 (logged as ``<key>_init``), ``first``, the
    mean of the first step that quantized anything (its step in ``first_step``), ``last_epoch``, the
    mean over the last epoch's steps, and ``max``, the largest per-example value of the run (None
    where nothing was quantized, or in records written before ``c_Q`` was logged)."""
    init = records[0]["links"][link].get(key + "_init") if records else None
    vals = [(r["step"], r["epoch"], r["links"][link].get(key), r["links"][link].get(key + "_max")) for r in records]
    seen = [v for v in vals if v[2] is not None]
    if not seen:
        return {"init": init, "first": None, "first_step": None, "last_epoch": None, "max": None}
    last = max(v[1] for v in vals)
    return {
        "init": init,
        "first": seen[0][2],
        "first_step": seen[0][0],
        "last_epoch": _mean(v[2] for v in seen if v[1] == last),
        "max": max(v[3] for v in seen),
    }


def summarize(records: list[dict], bandwidths: tuple[float, ...], latency_s: float = 0.0) -> dict:
    """Final loss, mean loss of every epoch, ``c_Q`` per link and direction (:func:`cq_of`), mean
    bytes per step per link, measured and emulated seconds per step."""
    from zeroth.pipeline.sim import emulated_seconds

    n = len(records)
    links = len(records[0]["links"]) if records else 0
    epochs = sorted({r["epoch"] for r in records})
    out = {
        "steps": n,
        "final_loss": records[-1]["loss"] if records else None,
        "epoch_losses": [_mean(r["loss"] for r in records if r["epoch"] == e) for e in epochs],
        "cq": [{"fw": cq_of(records, "fw_cq", k), "bw": cq_of(records, "bw_cq", k)} for k in range(links)],
        "bytes_per_step_per_link": [
            sum(r["links"][k]["fw_bytes"] + r["links"][k]["bw_bytes"] for r in records) / max(n, 1)
            for k in range(links)
        ],
        "sync_bytes_per_step": sum(r.get("sync_bytes", 0) for r in records) / max(n, 1),
        "payload_bytes_per_step": sum(
            r.get("payload_bytes", sum(lk["fw_bytes"] + lk["bw_bytes"] for lk in r["links"])) for r in records
        )
        / max(n, 1),
        "wall_s_per_step": sum(r["step_time_s"] for r in records) / max(n, 1),
        "emulated_s_per_step": {
            f"{bw:g}": sum(emulated_seconds(r, bw, latency_s) for r in records) / max(n, 1) for bw in bandwidths
        },
    }
    return out


def epoch_means(records: list[dict]) -> dict[int, float]:
    """The mean loss of every epoch (the same examples every epoch)."""
    out: dict[int, list] = {}
    for r in records:
        out.setdefault(r["epoch"], []).append(r["loss"])
    return {e: sum(v) / len(v) for e, v in sorted(out.items())}


def median_compute(records: list[dict], key: str = "compute_s") -> float:
    """The median over the steps of the stages' summed ``compute_s`` (or ``codec_s``) per step."""
    import statistics

    return statistics.median(sum(s[key] for s in r["stages"]) for r in records)


def time_to_target(
    records: list[dict], target: float, bandwidth_bps: float, latency_s: float = 0.0, compute_s: float | None = None
) -> float | None:
    """Emulated seconds (:func:`zeroth.pipeline.sim.emulated_seconds`, summed over the steps) to the
    end of the first epoch whose mean loss is at most ``target``; None if none reaches it.

    ``compute_s``: every step's compute seconds replaced by this (e.g. one median for every setting
    of a comparison, so the compilations of the first steps and the pauses of a shared machine do
    not weigh on one setting more than another) and its codec seconds by their median over the run;
    the bytes are unchanged.
    """
    from zeroth.pipeline.sim import emulated_seconds

    ep = epoch_means(records)
    hit = [e for e, v in ep.items() if v <= target]
    if not hit:
        return None
    steady = None if compute_s is None else compute_s + median_compute(records, "codec_s")
    return sum(
        emulated_seconds(r, bandwidth_bps, latency_s)
        - (0.0 if steady is None else sum(s["compute_s"] + s["codec_s"] for s in r["stages"]) - steady)
        for r in records
        if r["epoch"] <= hit[0]
    )


def upgrade_record(rec: dict) -> dict:
    """A step record as the metrics schema writes it (:func:`zeroth.pipeline.sim.step_record`).

    Records written before the schema had no ``kind``, counted ``step`` from 0 (the step's index,
    not the steps completed) and called the step's seconds ``wall_s``; they are converted, and a
    record of the schema is returned unchanged. Fields the old records lack are left out.
    """
    if "kind" in rec:
        return rec
    out = {k: v for k, v in rec.items() if k != "wall_s"}
    return {"kind": "train", **out, "step": rec["step"] + 1, "step_time_s": rec["wall_s"]}


def load_results(path) -> dict:
    """A results JSON written by this program, every setting's records in the schema of :func:`upgrade_record`."""
    results = json.loads(Path(path).read_text())
    for res in results["settings"].values():
        res["records"] = [upgrade_record(r) for r in res["records"]]
    return results


def quantization_error(cfg, bits=(2, 3, 4, 8), axes=("channel", "row")) -> list[dict]:
    """``E‖x − Q(x)‖ / ‖x‖`` of DirectQ (zero-level grid, the config's ``pipeline.rounding``) on
    stage 0's output at initialization, per bits and scale axis.

    ``x`` is each example's activation on link 0 for the first batch (Frobenius norms per example,
    averaged); the seed's convergence theorem asks for ``c_Q < 1/√2 ≈ 0.707``.
    """
    import numpy as np

    from zeroth import compress as C
    from zeroth.pipeline import build

    ex = build.examples_of(cfg)
    part = build.partition_of(cfg, ex)
    ids = np.concatenate([m for m, _, _ in build.plan_of(cfg, ex, 0)])
    x = np.asarray(part.fns[0](part.params[0], ex.tokens[ids]), np.float32)
    keys = C.example_keys(cfg.run.seed, link=0, direction=0, step=0, ids=ids)
    out = []
    for axis in axes:
        for b in bits:
            _, _, xq = C.directq(b, axis, cfg.pipeline.rounding).encode(None, x, ids, keys)
            out.append({"axis": axis, "bits": b, "relative_error": float(C.relative_errors(x, xq - x).mean())})
    return out


def _release() -> None:
    """Drop the finished setting's engines and compiled functions before the next one (memory)."""
    import gc

    gc.collect()
    if "jax" in sys.modules:
        sys.modules["jax"].clear_caches()


def _fmt(v, spec=".3f") -> str:
    return "-" if v is None else format(v, spec)


def _table(results: dict) -> str:
    """One line per setting: final loss, last epoch's mean loss and its gap to fp32's, ``c_Q`` of
    link 0 (forward and backward: at initialization | at the first quantized step -> over the last
    epoch), bytes and seconds per step."""
    rows = []
    ref = (_reference(results) or {}).get("summary", {}).get("epoch_losses")
    for name, res in results["settings"].items():
        s = res["summary"]
        last = (s.get("epoch_losses") or [None])[-1]
        gap = (last - ref[-1]) / ref[-1] if ref and last is not None else None
        cq = (s.get("cq") or [{}])[0]
        fw, bw = cq.get("fw", {}), cq.get("bw", {})
        emu = "  ".join(f"{float(k) / 1e6:>7g}Mb/s {v:7.3f}s" for k, v in s["emulated_s_per_step"].items())
        rows.append(
            f"{name:<22} loss {s['final_loss']:.4f}  last epoch {_fmt(last, '.4f')} ({_fmt(gap, '+.1%')} vs fp32)  "
            f"c_Q fw {_fmt(fw.get('init', res.get('cq_init')))}|{_fmt(fw.get('first'))}->{_fmt(fw.get('last_epoch'))} "
            f"bw {_fmt(bw.get('init'))}|{_fmt(bw.get('first'))}->{_fmt(bw.get('last_epoch'))}  "
            f"bytes/step/link {s['bytes_per_step_per_link'][0]:>10.0f}  "
            + (f"averaging bytes/step {s['sync_bytes_per_step']:>9.0f}  " if s.get("sync_bytes_per_step") else "")
            + f"measured {s['wall_s_per_step']:.3f}s/step  emulated {emu}"
        )
    return "\n".join(rows + _target_table(results))


def _reference(results: dict) -> dict | None:
    """The uncompressed setting: ``fp32`` (``fp32 + fp32`` with replicas), None if it did not run."""
    st = results["settings"]
    return st.get("fp32") or st.get("fp32 + fp32")


def _target_table(results: dict) -> list[str]:
    """Time to fp32's mean loss over its next-to-last epoch (:func:`time_to_target`), per setting
    and bandwidth of ``pipeline.emulate_bandwidths_bps``, and the ratio to fp32 at the fastest one;
    then the same for the loosest target every setting reaches (the highest last-epoch mean)."""
    ref = _reference(results)
    if ref is None or len(epoch_means(ref["records"])) < 2:
        return []
    bws = sorted(float(b) for b in results["config"]["pipeline"]["emulate_bandwidths_bps"])
    lat = results["config"]["pipeline"]["latency_ms"] / 1e3
    ep = epoch_means(ref["records"])
    loosest = max(list(epoch_means(res["records"]).values())[-1] for res in results["settings"].values())
    targets = [(ep[max(ep) - 1], f"fp32's mean over epoch {max(ep) - 1}")]
    if loosest > targets[0][0]:
        targets.append((loosest, "the highest last-epoch mean of the settings"))
    rows = []
    common = min(median_compute(res["records"]) for res in results["settings"].values())
    for (target, what), steady in [(t, c) for t in targets for c in (None, common)]:
        base = time_to_target(ref["records"], target, bws[-1], lat, steady)
        rows.append(
            f"time to loss {target:.4f} ({what}), emulated"
            + (
                f" with {steady:.3f}s of compute per step (the least median of the settings) + each one's median codec"
                if steady is not None
                else " from the measured compute"
            )
            + f"; x = fp32 at {bws[-1] / 1e9:g} Gbit/s / it"
        )
        for name, res in results["settings"].items():
            ts = [time_to_target(res["records"], target, bw, lat, steady) for bw in bws]
            rows.append(
                f"  {name:<28}"
                + "  ".join(
                    f"{bw / 1e6:>6g}Mb/s {_fmt(t, '8.2f')}s (x{_fmt(None if t is None else base / t, '.2f')})"
                    for bw, t in zip(bws, ts)
                )
            )
    return rows


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m zeroth.pipeline.compare", description=__doc__.splitlines()[0])
    p.add_argument("config")
    p.add_argument("--out", default=None, help="results JSON (required unless --quant-error)")
    p.add_argument(
        "--settings",
        nargs="+",
        default=list(DEFAULT_SETTINGS),
        help="fp32, directq:FW:BW[:AXIS], aqsgd:FW:BW[:AXIS]; +fp32 or +onebit_adam: the replicas' averaging",
    )
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="SECTION.FIELD=VALUE")
    p.add_argument("--local", action="store_true", help="run the stages in this process (no transport)")
    p.add_argument("--append", action="store_true", help="keep the settings already in --out (same config)")
    p.add_argument(
        "--quant-error",
        action="store_true",
        help="only print DirectQ's relative error on stage 0's output at initialization (the seed's c_Q)",
    )
    p.add_argument("--runs", default=None, help="with processes: folder for the runs (default: next to --out)")
    args = p.parse_args(argv)

    from zeroth import config as _config

    base = _config.load_config(args.config, args.overrides)
    if base.pipeline is None:
        print(f"{args.config} has no pipeline: section", file=sys.stderr)
        return 2
    if not args.quant_error and not args.out:
        print("--out RESULTS.json is required", file=sys.stderr)
        return 2
    if args.quant_error:
        for row in quantization_error(base):
            print(f"scale per {row['axis']:<8} {row['bits']} bits: E|x - Q(x)| / |x| = {row['relative_error']:.4f}")
        return 0
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    results = {"config": _config.to_dict(base), "mode": "local" if args.local else "processes", "settings": {}}
    if out.is_file() and args.append:
        results["settings"] = load_results(out)["settings"]
    bws = tuple(base.pipeline.emulate_bandwidths_bps)
    for text in args.settings:
        cfg = apply_setting(base, text)
        name = setting_name(text)
        t0 = time.time()
        if args.local:
            from zeroth.pipeline import sim

            records, _ = sim.run_local(
                cfg,
                on_step=lambda r, name=name: print(
                    f"  {name} step {r['step']} loss {r['loss']:.4f} c_Q fw {_fmt(r['links'][0]['fw_cq'])} "
                    f"bw {_fmt(r['links'][0]['bw_cq'])}",
                    flush=True,
                ),
            )
        else:
            from zeroth.pipeline import launch

            runs = Path(args.runs) if args.runs else out.with_suffix("") / "runs"
            run_dir = runs / name.replace(" ", "_").replace("/", "_")
            code = launch.run_config(cfg, run_dir, [], progress=True)
            if code != 0:
                print(f"setting {name}: the pipeline exited with code {code}", file=sys.stderr)
                return code
            records = launch.read_records(run_dir)
        seconds = time.time() - t0
        p = cfg.pipeline
        cq_init = (
            None
            if p.compression == "fp32"
            else quantization_error(cfg, (p.fw_bits,), (p.scale_axis,))[0]["relative_error"]
        )
        results["settings"][name] = {
            "setting": text,
            "seconds": seconds,
            "cq_init": cq_init,
            "summary": summarize(records, bws, base.pipeline.latency_ms / 1e3),
            "records": records,
        }
        out.write_text(json.dumps(results, indent=1))
        print(f"{name}: done in {time.time() - t0:.1f}s", flush=True)
        for k, c in enumerate(results["settings"][name]["summary"]["cq"]):
            for d in ("fw", "bw"):
                if c[d]["max"] is not None and c[d]["last_epoch"] is not None and c[d]["last_epoch"] >= CQ_LIMIT:
                    print(
                        f"  {name}: c_Q {d} on link {k} is {c[d]['last_epoch']:.3f} in the last epoch, >= 1/sqrt(2): "
                        f"outside the AQ-SGD theorem's condition",
                        flush=True,
                    )
        _release()
    print(_table(results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
