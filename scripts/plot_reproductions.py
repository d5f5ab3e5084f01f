"""Figures of the reproduction runs: test accuracy per round of every Marsit run folder, and the
binary probe's converged-head accuracies with their 95% intervals (needs matplotlib, a dev extra).

    python scripts/plot_reproductions.py --marsit experiments/results/marsit_table2_short \
        --binary experiments/results/binary_probe/mnist5k.json experiments/results/binary_probe/fashion_mnist.json \
        --out experiments/results
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

from zeroth.marsit.report import best_by_group, load  # noqa: E402


def plot_marsit(folder: Path, out: Path) -> Path:
    evals, summaries = load(folder)
    groups = best_by_group(summaries)
    # one group (Figure 3(b)'s K) draws every run; several draw the best run of each
    best = {s["run"] for s in summaries} if len(groups) == 1 else {s["run"] for s in groups.values()}
    fig, (ax, bx) = plt.subplots(1, 2, figsize=(12, 4.5))
    for s in summaries:
        if s["run"] not in best:
            continue
        rows = [r for r in evals if r["run"] == s["run"]]
        label = (
            f"{s['group']} ({s['run']}, {s['bits_per_element']:.2f} bits/elem)"
            if len(groups) > 1
            else f"{s['run']} ({s['bits_per_element']:.2f} bits/elem)"
        )
        ax.plot([r["step"] for r in rows], [r["eval_accuracy"] for r in rows], marker="o", label=label)
        bx.plot(
            [r["payload_bytes_total"] / 1e6 for r in rows],
            [r["eval_accuracy"] for r in rows],
            marker="o",
            label=s["group"] if len(groups) > 1 else s["run"],
        )
    ax.set_xlabel("round")
    ax.set_ylabel("test accuracy")
    ax.set_title(f"{folder.name}: " + ("best run of each group" if len(groups) > 1 else "every run"))
    ax.legend(fontsize=7)
    bx.set_xscale("log")
    bx.set_xlabel("MB sent by all workers (ppermute payloads)")
    bx.set_ylabel("test accuracy")
    bx.set_title("accuracy against bytes sent")
    fig.tight_layout()
    path = out / f"{folder.name}.png"
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def plot_binary(paths: list[Path], out: Path) -> Path:
    fig, axes = plt.subplots(1, len(paths), figsize=(6 * len(paths), 4.5), squeeze=False)
    for ax, p in zip(axes[0], paths):
        res = json.loads(p.read_text())
        entries = res["summary"]
        names = [f"{e['model']} L{e['layer']}" for e in entries]
        x = range(len(entries))
        ax.errorbar(
            [i - 0.15 for i in x],
            [e["as_trained_test"][0] for e in entries],
            yerr=[e["as_trained_test"][1] for e in entries],
            fmt="o",
            label="as trained (aux. head, 100 steps)",
        )
        ax.errorbar(
            [i + 0.15 for i in x],
            [e["converged_test"][0] for e in entries],
            yerr=[e["converged_test"][1] for e in entries],
            fmt="s",
            label="converged head",
        )
        base = [e for e in entries if e["model"] == "head" and e["layer"] == 1][0]["converged_test"][0]
        ax.axhline(base, color="grey", ls="--", label="one random binary layer + converged head")
        ax.set_xticks(list(x), names, rotation=45, ha="right", fontsize=8)
        ax.set_ylabel("test accuracy (mean, 95% interval)")
        ax.set_title(
            f"{res['dataset']} ({res['train_size']} train / {res['test_size']} test, {len(res['seeds'])} seeds)"
        )
        ax.legend(fontsize=7)
    fig.tight_layout()
    path = out / "binary_probe.png"
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--marsit", nargs="*", default=[], type=Path)
    ap.add_argument("--binary", nargs="*", default=[], type=Path)
    ap.add_argument("--out", type=Path, default=Path("experiments/results"))
    a = ap.parse_args()
    for f in a.marsit:
        print(plot_marsit(f, a.out))
    if a.binary:
        print(plot_binary(a.binary, a.out))


if __name__ == "__main__":
    main()
