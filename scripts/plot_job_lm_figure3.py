"""Seed 000's Figure 3 on MiniLM (experiments/job_lm_figure3.yaml): test accuracy and training loss
against the gradients computed by all machines together, for every run folder under a results folder
(Just One Byte runs of `zeroth run`: ``config.yaml`` + ``peers/p*/metrics.jsonl``; backprop runs of
``python -m zeroth.train.finetune``: ``config.yaml`` + ``metrics.jsonl``). One ZO gradient is one
projected gradient (2 forward passes of a batch); one backprop gradient is that of one batch of
``BATCH`` sentences (a step on a batch of 64 counts 4: the seed's gradient accumulation). Needs
matplotlib (a dev extra).

    python scripts/plot_job_lm_figure3.py experiments/results/job_lm_figure3
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import yaml

from zeroth.train.metrics import read_metrics

BATCH = 16  # sentences per gradient: the ZO runs' data.batch_size


def load(folder: Path) -> dict:
    """One run folder: ``{"label", "kind", "evals": [(gradients, accuracy)], "losses": [(gradients, loss)],
    "gradients", "forward_passes", "digests", "accuracy"}``; forward passes of ``BATCH`` sentences (backprop:
    each followed by a backward pass)."""
    cfg = yaml.safe_load((folder / "config.yaml").read_text())
    if cfg.get("peers"):
        peers = sorted(p for p in (folder / "peers").glob("p*") if p.is_dir())
        rows = [r for p in peers for r in read_metrics(p / "metrics.jsonl")]
        summaries = [json.loads((p / "summary.json").read_text()) for p in peers]
        train = {r["step"]: r for r in rows if r["kind"] == "train"}
        own = {}  # step -> each peer's own mean loss of its projected gradients
        for r in rows:
            if r["kind"] == "train":
                own.setdefault(r["step"], []).append(r["loss"])
        grads_at = {s: r["forward_passes"] // 2 for s, r in train.items()}
        evals = sorted({(grads_at[r["step"]], r["eval_accuracy"]) for r in rows if r["kind"] == "eval"})
        n, codec = cfg["peers"]["count"], cfg["train"]["codec"]
        label = f"{n} peers, {codec}" if n > 1 else f"1 machine, {codec}"
        return {
            "label": label,
            "kind": "zo",
            "evals": evals,
            "losses": sorted((grads_at[s], sum(v) / len(v)) for s, v in own.items()),
            "gradients": max(grads_at.values()),
            "forward_passes": max(r["forward_passes"] for r in train.values()),
            "digests": sorted({s["digest"] for s in summaries}),
            "accuracy": summaries[0]["eval"]["eval_accuracy"],
        }
    rows = read_metrics(folder / "metrics.jsonl")
    per_step = cfg["data"]["batch_size"] // BATCH
    train = [r for r in rows if r["kind"] == "train"]
    evals = [(r["step"] * per_step, r["eval_accuracy"]) for r in rows if r["kind"] == "eval"]
    done = (folder / "summary.json").exists()  # finetune writes it at the end of the run
    summary = json.loads((folder / "summary.json").read_text()) if done else {}
    return {
        "label": f"backprop (Adam, batch {cfg['data']['batch_size']} = {per_step} gradients per step)"
        + ("" if done else ", stopped early"),
        "kind": "backprop",
        "evals": evals,
        "losses": [(r["step"] * per_step, r["loss"]) for r in train],
        "gradients": max(r["step"] for r in train) * per_step,
        "forward_passes": max(r["forward_passes"] for r in train)
        * per_step,  # of BATCH sentences, each with a backward
        "digests": [summary["digest"]] if done else [],
        "accuracy": evals[-1][1],
    }


def runs(root: Path) -> dict[str, dict]:
    """Every run folder under ``root`` by name."""
    return {c.parent.name: load(c.parent) for c in sorted(root.glob("*/config.yaml"))}


def smooth(points: list[tuple[int, float]], window: int) -> tuple[list[int], list[float]]:
    """Trailing moving average of ``window`` points."""
    xs, ys = [], []
    for i in range(window - 1, len(points)):
        xs.append(points[i][0])
        ys.append(sum(y for _, y in points[i - window + 1 : i + 1]) / window)
    return xs, ys


def plot(root: Path, out: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rs = runs(root)
    fig, (ax, bx) = plt.subplots(1, 2, figsize=(12, 4.5))
    for _, r in sorted(rs.items(), key=lambda kv: "float32" in kv[1]["label"]):
        # float32 draws dotted over one byte: the two 4-peer curves nearly coincide
        style = {"ls": "--"} if r["kind"] == "backprop" else {"ls": ":", "lw": 2.5} if "float32" in r["label"] else {}
        ax.plot(*zip(*r["evals"]), marker="o", label=f"{r['label']}: {r['accuracy']:.3f}", **style)
        # a loss point every gradient count the runs share: 200 gradients per point
        window = max(1, round(200 / (r["losses"][1][0] - r["losses"][0][0])))
        bx.plot(*smooth(r["losses"], window), label=r["label"], **style)
    starts = [r["evals"][0] for r in rs.values() if r["evals"] and r["evals"][0][0] == 0]
    if starts:  # every run starts from the same parameters (pretrained encoder, seed 0's head)
        ax.annotate(f"step 0: {starts[0][1]:.3f} (the same start for every run)", starts[0], (40, starts[0][1] + 0.01),
                    fontsize=7)  # fmt: skip
    ax.axhline(0.5, color="grey", lw=0.8, ls=":")
    ax.set_xlabel(f"gradients computed by all machines (ZO: projected, 2 forward passes of {BATCH} sentences)")
    ax.set_ylabel("test accuracy (600 sentences)")
    ax.set_title("MiniLM-L6 on the sentiment sentences: accuracy")
    ax.legend(fontsize=7)
    bx.set_xlabel("gradients computed by all machines")
    bx.set_ylabel("training loss (mean over the last 200 gradients)")
    bx.set_title("training loss (ZO: at the perturbed parameters)")
    bx.legend(fontsize=7)
    fig.tight_layout()
    path = out / f"{root.name}.png"
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("root", type=Path, help="folder of run folders (experiments/results/job_lm_figure3)")
    ap.add_argument("--out", type=Path, default=None, help="where the PNG goes (default: the root's parent)")
    a = ap.parse_args()
    print(plot(a.root, a.out or a.root.parent))
    for name, r in runs(a.root).items():
        print(json.dumps({"run": name, **{k: r[k] for k in ("gradients", "forward_passes", "accuracy", "digests")}}))


if __name__ == "__main__":
    main()
