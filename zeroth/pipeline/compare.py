"""``python -m zeroth.pipeline.compare CONFIG --out RESULTS.json``: one config, several link compressions.

Runs the pipeline of ``CONFIG`` once per setting (default: fp32, directq and aqsgd at fw2/bw4 and
fw4/bw8), either in this process (``--local``, :func:`zeroth.pipeline.sim.run_local`) or as stage
processes over loopback gRPC (:func:`zeroth.pipeline.launch.run_config`, the link emulation of the
config enforced live). Writes a JSON with every step's record per setting, rewritten after each
setting so a partial result is usable, and prints a table: final loss, bytes per step per link,
measured seconds per step and the emulated seconds per step at each bandwidth of
``pipeline.emulate_bandwidths_bps`` (computed from measured compute and bytes, not enforced).

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

__all__ = ["DEFAULT_SETTINGS", "apply_setting", "load_results", "main", "parse_setting", "summarize", "upgrade_record"]

DEFAULT_SETTINGS = ("fp32", "directq:2:4", "aqsgd:2:4", "directq:4:8", "aqsgd:4:8")


def parse_setting(text: str) -> tuple[str, int, int, str | None]:
    """``"aqsgd:2:4"`` -> ``("aqsgd", 2, 4, None)``; ``"aqsgd:2:4:channel"`` names the scale axis; ``"fp32"``."""
    parts = text.split(":")
    if parts[0] == "fp32" and len(parts) == 1:
        return "fp32", 0, 0, None
    if len(parts) not in (3, 4) or parts[0] not in ("directq", "aqsgd") or (len(parts) == 4 and parts[3] not in ("row", "channel")):
        raise ValueError(f"setting {text!r}: expected fp32, directq:FW:BW[:AXIS] or aqsgd:FW:BW[:AXIS] (e.g. aqsgd:2:4:channel)")
    return parts[0], int(parts[1]), int(parts[2]), parts[3] if len(parts) == 4 else None


def setting_name(text: str) -> str:
    """``"aqsgd:2:4"`` -> ``"aqsgd fw2/bw4"``; ``"aqsgd:2:4:channel"`` -> ``"aqsgd fw2/bw4 channel"``."""
    name, fw, bw, axis = parse_setting(text)
    return name if name == "fp32" else f"{name} fw{fw}/bw{bw}" + (f" {axis}" if axis else "")


def apply_setting(cfg, text: str):
    """The config with ``pipeline.compression`` / ``fw_bits`` / ``bw_bits`` / ``scale_axis`` of the setting."""
    name, fw, bw, axis = parse_setting(text)
    p = cfg.pipeline
    p = dataclasses.replace(p, compression=name, fw_bits=fw or p.fw_bits, bw_bits=bw or p.bw_bits,
                            scale_axis=axis or p.scale_axis)
    return dataclasses.replace(cfg, pipeline=p)


def summarize(records: list[dict], bandwidths: tuple[float, ...], latency_s: float = 0.0) -> dict:
    """Final loss, mean bytes per step per link, measured and emulated seconds per step."""
    from zeroth.pipeline.sim import emulated_seconds

    n = len(records)
    links = len(records[0]["links"]) if records else 0
    out = {
        "steps": n,
        "final_loss": records[-1]["loss"] if records else None,
        "bytes_per_step_per_link": [sum(r["links"][k]["fw_bytes"] + r["links"][k]["bw_bytes"] for r in records) / max(n, 1)
                                    for k in range(links)],
        "wall_s_per_step": sum(r["step_time_s"] for r in records) / max(n, 1),
        "emulated_s_per_step": {f"{bw:g}": sum(emulated_seconds(r, bw, latency_s) for r in records) / max(n, 1)
                                for bw in bandwidths},
    }
    return out


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


def quantization_error(cfg, bits=(2, 4, 8), axes=("row", "channel")) -> list[dict]:
    """``E‖x − Q(x)‖ / ‖x‖`` of DirectQ on stage 0's output at initialization, per bits and scale axis.

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
            _, _, xq = C.directq(b, axis).encode(None, x, ids, keys)
            err = np.linalg.norm((xq - x).reshape(len(ids), -1), axis=1) / np.linalg.norm(x.reshape(len(ids), -1), axis=1)
            out.append({"axis": axis, "bits": b, "relative_error": float(err.mean())})
    return out


def _release() -> None:
    """Drop the finished setting's engines and compiled functions before the next one (memory)."""
    import gc

    gc.collect()
    if "jax" in sys.modules:
        sys.modules["jax"].clear_caches()


def _table(results: dict) -> str:
    rows = []
    for name, res in results["settings"].items():
        s = res["summary"]
        emu = "  ".join(f"{float(k) / 1e6:>7g}Mb/s {v:7.3f}s" for k, v in s["emulated_s_per_step"].items())
        rows.append(f"{name:<18} loss {s['final_loss']:.4f}  bytes/step/link {s['bytes_per_step_per_link'][0]:>10.0f}  "
                    f"measured {s['wall_s_per_step']:.3f}s/step  emulated {emu}")
    return "\n".join(rows)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m zeroth.pipeline.compare", description=__doc__.splitlines()[0])
    p.add_argument("config")
    p.add_argument("--out", default=None, help="results JSON (required unless --quant-error)")
    p.add_argument("--settings", nargs="+", default=list(DEFAULT_SETTINGS), help="fp32, directq:FW:BW[:AXIS], aqsgd:FW:BW[:AXIS]")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="SECTION.FIELD=VALUE")
    p.add_argument("--local", action="store_true", help="run the stages in this process (no transport)")
    p.add_argument("--append", action="store_true", help="keep the settings already in --out (same config)")
    p.add_argument("--quant-error", action="store_true",
                   help="only print DirectQ's relative error on stage 0's output at initialization (the seed's c_Q)")
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

            records, _ = sim.run_local(cfg, on_step=lambda r, name=name: print(f"  {name} step {r['step']} loss {r['loss']:.4f}", flush=True))
        else:
            from zeroth.pipeline import launch

            runs = Path(args.runs) if args.runs else out.with_suffix("") / "runs"
            run_dir = runs / name.replace(" ", "_").replace("/", "_")
            code = launch.run_config(cfg, run_dir, [], progress=True)
            if code != 0:
                print(f"setting {name}: the pipeline exited with code {code}", file=sys.stderr)
                return code
            records = launch.read_records(run_dir)
        results["settings"][name] = {
            "setting": text,
            "seconds": time.time() - t0,
            "summary": summarize(records, bws, base.pipeline.latency_ms / 1e3),
            "records": records,
        }
        out.write_text(json.dumps(results, indent=1))
        print(f"{name}: done in {time.time() - t0:.1f}s", flush=True)
        _release()
    print(_table(results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
