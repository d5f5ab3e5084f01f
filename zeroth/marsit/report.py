"""Tables of the sign-bit experiments next to seed 004's numbers: ``python -m zeroth.marsit.report DIR ...``.

Reads the run folders written by ``zeroth run experiments/marsit_*.yaml`` (``summary.json``: one
summary per run; ``metrics.jsonl``: the eval rows) and builds the shapes
of the seed's Table 1 (cascading compression vs none), Table 2 (final accuracy per method) and
Figure 3(b) (K: time, accuracy, bits per element). Runs of one ``group`` are alternatives (a
step-size grid); each table keeps the group's best final accuracy, as the seed keeps the best of
its grid.

Example::

    python -m zeroth.marsit.report runs/marsit_table1 runs/marsit_table2 runs/marsit_fig3b
"""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

import numpy as np

from zeroth.train.metrics import read_metrics

__all__ = [
    "SEED_TABLE1",
    "SEED_TABLE2",
    "SEED_FIGURE3B",
    "load",
    "best_by_group",
    "table1_rows",
    "table2_rows",
    "figure3b_rows",
    "ring_comm_seconds",
    "markdown",
    "main",
]

# Seed 004, Table 1 (MNIST, AlexNet; best of step sizes {0.03, 0.01, 0.005}).
SEED_TABLE1 = {
    ("cascading", 3): {"rounds": "187", "accuracy": "87.2 ± 2.31", "time_min": "11.2"},
    ("cascading", 8): {"rounds": "1K+", "accuracy": "divergence", "time_min": "NA"},
    ("none", 3): {"rounds": "129", "accuracy": "99.1 ± 0.13", "time_min": "20.7"},
    ("none", 8): {"rounds": "76", "accuracy": "99.2 ± 0.07", "time_min": "10.6"},
}
# Seed 004, Table 2, Top-1 accuracy (%) per model/dataset.
SEED_TABLE2_COLUMNS = ("PSGD", "signSGD", "EF-signSGD", "SSDM", "Marsit-100", "Marsit")
SEED_TABLE2 = {
    "AlexNet / CIFAR-10": (82.38, 80.74, 82.25, 81.89, 82.30, 81.58),
    "ResNet-20 / CIFAR-10": (93.42, 88.92, 91.85, 89.18, 92.18, 90.15),
    "ResNet-18 / ImageNet": (69.18, 67.17, 68.14, 68.10, 68.96, 68.40),
    "ResNet-50 / ImageNet": (74.87, 72.74, 73.89, 73.35, 74.35, 74.10),
    "DistilBERT / IMDb": (92.16, 89.12, 90.57, 91.41, 90.13, 90.26),
}
# Seed 004, Figure 3(b) (CIFAR-10, AlexNet, 400 rounds): K -> time (min), accuracy (%), bits.
SEED_FIGURE3B = {
    1: (40.18, 93.42, 32.0),
    50: (22.05, 92.28, 1.62),
    100: (21.34, 91.73, 1.31),
    200: (22.38, 92.00, 1.16),
    None: (18.78, 90.75, 1.0),
}


def load(folder: str | Path) -> tuple[list[dict], list[dict]]:
    """``(eval rows of metrics.jsonl, the finished runs' summaries of summary.json)`` of a run folder."""
    folder = Path(folder)
    path = folder / "summary.json"
    if not path.exists():
        raise FileNotFoundError(f"{path} not found; run zeroth run experiments/marsit_<name>.yaml --out {folder}")
    summaries = json.loads(path.read_text())["runs"]
    return read_metrics(folder / "metrics.jsonl", kind="eval"), summaries


def best_by_group(summaries: list[dict]) -> dict[str, dict]:
    """Group name (or run label when no group) -> the summary with the best final accuracy.

    A diverged run ranks below every run that did not diverge.
    """
    out: dict[str, dict] = {}
    for s in summaries:
        g = s.get("group") or s["run"]
        acc = s["eval_accuracy"]
        score = (not s["diverged"], acc if acc is not None and math.isfinite(acc) else -1.0)
        if g not in out or score > out[g]["_score"]:
            out[g] = {**s, "_score": score}
    return out


def _pct(x) -> str:
    return "-" if x is None or not math.isfinite(x) else f"{100 * x:.1f}"


def table1_rows(summaries: list[dict]) -> list[dict]:
    """Table 1: groups ``"cascading M=<m>"`` (SSDM, l2 norm: the seed's "cascading compression"),
    ``"cascading-linf M=<m>"`` and ``"cascading-bucket M=<m>"`` (max-norm and per-bucket-norm
    variants, no seed number) and ``"none M=<m>"``."""
    best = best_by_group(summaries)
    rows = []
    for kind in ("cascading", "cascading-linf", "cascading-bucket", "none"):
        for m in (3, 8):
            s = best.get(f"{kind} M={m}")
            if s is None:
                continue
            seed = SEED_TABLE1.get((kind, m), {"rounds": "-", "accuracy": "-", "time_min": "-"})
            reached = s["rounds_to_target"]
            rows.append(
                {
                    "setting": f"{kind} compression, M={m}",
                    "rounds": (
                        f"diverged by round {s['rounds']}"
                        if s["diverged"]
                        else str(reached)
                        if reached
                        else f"{s['rounds']}+ (not reached)"
                    ),
                    "accuracy_%": "divergence" if s["diverged"] else _pct(s["eval_accuracy"]),
                    "best_accuracy_%": _pct(s["best_eval_accuracy"]),
                    "diverged": s["diverged"],
                    "step_size": s["eta_l"],
                    "compute_time_s": f"{s['compute_time_s']:.1f}",
                    "bits_per_element": f"{s['bits_per_element']:.3f}",
                    "seed_rounds": seed["rounds"],
                    "seed_accuracy_%": seed["accuracy"],
                    "seed_time_min": seed["time_min"],
                }
            )
    return rows


def table2_rows(summaries: list[dict]) -> list[dict]:
    """Table 2: one row per method group, best final accuracy, next to the seed's ResNet-20 row
    (group ``Marsit-K``, a shortened run's Marsit-100, sits beside the seed's Marsit-100)."""
    best = best_by_group(summaries)
    seed = dict(zip(SEED_TABLE2_COLUMNS, SEED_TABLE2["ResNet-20 / CIFAR-10"]))
    seed["Marsit-K"] = seed["Marsit-100"]
    order = [
        "PSGD",
        "signSGD",
        "signSGD-MV",
        "EF-signSGD",
        "SSDM",
        "SSDM (bucket norms)",
        "Marsit-100",
        "Marsit-K",
        "Marsit",
    ]
    rows = []
    for g in order + [g for g in best if g not in order]:
        if g not in best:
            continue
        s = best[g]
        rows.append(
            {
                "method": g if g != "Marsit-K" else f"Marsit-{s['K']}",
                "final_accuracy_%": "divergence" if s["diverged"] else _pct(s["eval_accuracy"]),
                "best_accuracy_%": _pct(s["best_eval_accuracy"]),
                "rounds": s["rounds"],
                "step_sizes": f"eta_l={s['eta_l']}"
                + (f", eta_s={s['eta_s']}" if s.get("eta_s") else "")
                + (f", /{1 / s['lr_decay']:.0f} every {s['lr_decay_every']}" if s.get("lr_decay_every") else ""),
                "bits_per_element": f"{s['bits_per_element']:.3f}",
                "seed_resnet20_cifar10_%": seed.get(g, "-"),
            }
        )
    return rows


def ring_comm_seconds(bits_per_element: float, workers: int, params: float, gbps: float) -> float:
    """Modeled seconds of one ring all-reduce round of ``params`` elements at ``bits_per_element``
    on links of ``gbps``: each worker sends ``2 (M-1)/M * params`` elements (bandwidth term only)."""
    return bits_per_element * 2 * (workers - 1) / workers * params / (gbps * 1e9)


# The seed's Figure 3 model (AlexNet on CIFAR-10) and a data-centre link, for the extrapolated column.
SEED_MODEL_PARAMS = 23e6
SEED_LINK_GBPS = 10.0


def figure3b_rows(summaries: list[dict]) -> list[dict]:
    """Figure 3(b): one row per K (``K: null`` = infinity).

    ``comm_23M_10Gbps_s`` extrapolates the measured bits per element to the seed's model size
    (23M parameters) on 10 Gbit/s links over the same number of rounds (a model, not a measurement).
    """
    by_k: dict = {}
    for s in summaries:
        by_k.setdefault(s["K"], []).append(s)
    rows = []
    for k in sorted(by_k, key=lambda k: float("inf") if k is None else k):
        runs = by_k[k]
        seed = SEED_FIGURE3B.get(k)
        s = runs[0]
        extrapolated = s["rounds"] * ring_comm_seconds(
            s["bits_per_element"], s["workers"], SEED_MODEL_PARAMS, SEED_LINK_GBPS
        )
        accs = [100 * r["eval_accuracy"] for r in runs if not r["diverged"]]
        acc = "divergence" if not accs else f"{np.mean(accs):.1f}" + (f" ± {np.std(accs):.1f}" if len(accs) > 1 else "")
        rows.append(
            {
                "K": "inf" if k is None else str(k),
                "runs": len(runs),
                "time_est_s": f"{np.mean([r['time_est_s'] for r in runs]):.1f}",
                "comm_model_s": f"{s['comm_model_s']:.2f}",
                "comm_23M_10Gbps_s": f"{extrapolated:.1f}",
                "accuracy_%": acc,
                "bits_per_element": f"{s['bits_per_element']:.3f}",
                "seed_time_min": "-" if seed is None else seed[0],
                "seed_accuracy_%": "-" if seed is None else seed[1],
                "seed_bits": "-" if seed is None else seed[2],
            }
        )
    return rows


def markdown(rows: list[dict]) -> str:
    """A markdown table of row dicts (columns of the first row)."""
    if not rows:
        return "(no runs)"
    cols = list(rows[0])
    lines = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    lines += ["| " + " | ".join(str(r.get(c, "")) for c in cols) + " |" for r in rows]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    """Print every table whose runs are found in the given folders."""
    folders = sys.argv[1:] if argv is None else argv
    if not folders:
        print("usage: python -m zeroth.marsit.report DIR [DIR ...]", file=sys.stderr)
        return 2
    try:
        summaries = [s for f in folders for s in load(f)[1]]
    except FileNotFoundError as e:
        print(f"python -m zeroth.marsit.report: error: {e}", file=sys.stderr)
        return 2
    groups = {s.get("group", "") for s in summaries}
    if any(g.startswith(("cascading", "none")) for g in groups):
        print("Table 1 (shape): cascading compression vs none\n" + markdown(table1_rows(summaries)) + "\n")
    t2 = [
        s
        for s in summaries
        if s.get("group")
        in (
            "PSGD",
            "signSGD",
            "signSGD-MV",
            "EF-signSGD",
            "SSDM",
            "SSDM (bucket norms)",
            "Marsit-100",
            "Marsit-K",
            "Marsit",
        )
    ]
    if t2:
        print("Table 2 (shape): final accuracy per method\n" + markdown(table2_rows(t2)) + "\n")
    f3 = [s for s in summaries if s.get("group") == "K"]
    if f3:
        print("Figure 3(b) (shape): K vs time, accuracy, bits per element\n" + markdown(figure3b_rows(f3)) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
