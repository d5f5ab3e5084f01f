"""Frozen binary features read by a converged head: ``python -m zeroth.binary.probe``.

A layer's accuracy as :mod:`zeroth.binary.experiment` reports it is that of the float head trained
alongside the layer for ``steps`` Adam steps on small batches: it measures the head's training
as much as the features. This module freezes every layer of a trained stack and fits a fresh
head to convergence on its features (the region means of the layer's ±1 activations, the same
inputs the auxiliary head reads): multinomial logistic regression with a small l2 penalty,
full batch, L-BFGS until the gradient norm is below ``tol``. The baseline every method must beat
is the first layer of ``head`` (one random binary layer whose bits never move) with such a head.

:func:`compare` trains every method with several seeds and returns, per method and layer, the
converged-head test accuracy (and train accuracy), mean and 95% interval (Student's t over the
seeds). Example::

    python -m zeroth.binary.probe --dataset mnist5k --seeds 0 1 2 --out probe_mnist5k.json
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time

import numpy as np

from zeroth import data as zdata
from zeroth.binary import layers as L
from zeroth.binary import layerwise as LW
from zeroth.binary import train as T

__all__ = ["T95", "features", "fit_head", "interval", "stack", "compare", "main"]

# Two-sided 95% quantiles of Student's t by degrees of freedom (n - 1 seeds).
T95 = {1: 12.706, 2: 4.303, 3: 3.182, 4: 2.776, 5: 2.571, 6: 2.447, 7: 2.365, 8: 2.306, 9: 2.262}


features = T.features
fit_head = T.fit_head


def _acc(w, b, f, y) -> float:
    return float(np.mean(np.argmax(np.asarray(f) @ w + b, axis=1) == np.asarray(y)))


def interval(values) -> tuple[float, float]:
    """``(mean, half-width of the 95% interval)`` of the values (Student's t; 0 for one value)."""
    v = np.asarray(values, np.float64)
    if len(v) < 2:
        return float(v.mean()), 0.0
    return float(v.mean()), float(T95[len(v) - 1] * v.std(ddof=1) / math.sqrt(len(v)))


def stack(
    method: str,
    data,
    *,
    seed: int,
    channels=(32, 32),
    layers: int = 0,
    levels: int = 8,
    steps: int = 100,
    batch_size: int = 64,
    k: int = 4,
    grid: int = 4,
    head_lr: float = 1e-2,
    ste_lr: float = 1e-2,
    min_gain: float = 0.0,
    accept_batch: int = 0,
    refit_every: int = 0,
    thresh_k: int = 0,
) -> list:
    """Train a binary conv stack greedily with ``method`` (:mod:`zeroth.binary.train`); its frozen layers
    (the first ``layers`` of ``channels``; 0 = all)."""
    xtr, ytr, xte, yte, classes = data
    plan, c_in = [], levels
    for c in channels[: layers or len(channels)]:
        plan.append(
            (
                L.ConvSpec(c_in=c_in, c_out=c, ternary=False, pool=True),
                T.TrainConfig(
                    method=method,
                    steps=steps,
                    batch_size=batch_size,
                    k=k,
                    min_gain=min_gain,
                    head_lr=head_lr,
                    ste_lr=ste_lr,
                    grid=grid,
                    seed=seed,
                    accept_batch=accept_batch,
                    refit_every=refit_every,
                    thresh_k=thresh_k,
                ),
            )
        )
        c_in = c
    return LW.train_layerwise(plan, xtr, ytr, xte, yte, classes=classes)


def load(dataset: str, *, train_size: int = 0, eval_size: int = 0, levels: int = 8):
    """``(x_train, y_train, x_test, y_test, classes)``: thermometer-packed images as the experiment encodes them."""
    tr, te = zdata.load(dataset, "train"), zdata.load(dataset, "test")
    n = len(tr.y) if train_size == 0 else min(train_size, len(tr.y))
    m = len(te.y) if eval_size == 0 else min(eval_size, len(te.y))
    return (
        L.encode_thermometer(tr.x[:n], levels),
        np.asarray(tr.y[:n], np.int32),
        L.encode_thermometer(te.x[:m], levels),
        np.asarray(te.y[:m], np.int32),
        tr.num_classes,
    )


def compare(
    dataset: str,
    methods,
    seeds,
    *,
    train_size: int = 0,
    eval_size: int = 0,
    variants: dict | None = None,
    progress=print,
    **kw,
) -> dict:
    """Every method (and ``variants``: name -> keyword overrides of :func:`stack`, method included)
    with every seed: per layer, the auxiliary head's test accuracy as trained and the converged
    head's train and test accuracy; then mean and 95% interval over the seeds."""
    data = load(dataset, train_size=train_size, eval_size=eval_size)
    xtr, ytr, xte, yte, classes = data
    runs = {m: {"method": m} for m in methods}
    runs.update(variants or {})
    rows = []
    for name, over in runs.items():
        for seed in seeds:
            t0 = time.perf_counter()
            frozen = stack(**{**kw, **over}, data=data, seed=seed)
            inputs_tr, inputs_te = xtr, xte
            for i, fr in enumerate(frozen):
                grid = kw.get("grid", 4)
                f_tr, f_te = features(fr.layer, inputs_tr, fr.spec, grid), features(fr.layer, inputs_te, fr.spec, grid)
                w, b, info = fit_head(f_tr, ytr, classes)
                rows.append(
                    {
                        "model": name,
                        "seed": seed,
                        "layer": i + 1,
                        "as_trained_test": fr.test_accuracy,
                        "converged_train": _acc(w, b, f_tr, ytr),
                        "converged_test": _acc(w, b, f_te, yte),
                        "fit": info,
                    }
                )
                inputs_tr, inputs_te = fr.out_train, fr.out_test
            if progress is not None:
                last = [r for r in rows if r["model"] == name and r["seed"] == seed]
                progress(
                    f"[{dataset}] {name} seed {seed}: "
                    + ", ".join(
                        f"layer {r['layer']} {r['as_trained_test']:.3f} -> {r['converged_test']:.3f}" for r in last
                    )
                    + f" ({time.perf_counter() - t0:.0f} s)"
                )
    summary = []
    for name in runs:
        for layer in sorted({r["layer"] for r in rows if r["model"] == name}):
            sel = [r for r in rows if r["model"] == name and r["layer"] == layer]
            entry = {"model": name, "layer": layer, "seeds": len(sel)}
            for key in ("as_trained_test", "converged_train", "converged_test"):
                entry[key] = interval([r[key] for r in sel])
            summary.append(entry)
    return {
        "dataset": dataset,
        "train_size": len(ytr),
        "test_size": len(yte),
        "seeds": list(seeds),
        "settings": kw,
        "variants": variants or {},
        "rows": rows,
        "summary": summary,
    }


def markdown(result: dict) -> str:
    """The summary as a markdown table (mean ± 95% interval), the random-layer baseline marked."""
    lines = [
        "| model | layer | as trained (aux. head) | converged head, test | converged head, train |",
        "| --- | ---: | ---: | ---: | ---: |",
    ]
    for e in result["summary"]:
        name = e["model"] + (" (random layer: baseline)" if e["model"] == "head" and e["layer"] == 1 else "")
        cells = [f"{m:.3f} ± {h:.3f}" for m, h in (e["as_trained_test"], e["converged_test"], e["converged_train"])]
        lines.append(f"| {name} | {e['layer']} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m zeroth.binary.probe", description=__doc__.split("\n")[0])
    ap.add_argument("--dataset", default="mnist5k")
    ap.add_argument("--methods", nargs="*", default=["flips", "evolution", "ste", "head"], choices=list(T.METHODS))
    ap.add_argument("--seeds", nargs="+", type=int, default=[0, 1, 2])
    ap.add_argument("--train-size", type=int, default=0, help="training examples (0 = all)")
    ap.add_argument("--eval-size", type=int, default=0, help="test examples (0 = all)")
    ap.add_argument("--steps", type=int, default=100)
    ap.add_argument(
        "--variant",
        action="append",
        default=[],
        metavar="NAME:KEY=V,KEY=V",
        help="an extra model, e.g. flips-b512:method=flips,batch_size=512,layers=1 (keys: stack's arguments)",
    )
    ap.add_argument("--out", help="write the JSON result here")
    a = ap.parse_args(argv)
    variants = {}
    for v in a.variant:
        if ":" not in v:
            ap.error(
                f"--variant {v!r} must look like NAME:key=value,key=value (e.g. flips-b512:method=flips,batch_size=512)"
            )
        name, body = v.split(":", 1)
        over = {}
        for kv in body.split(","):
            key, _, val = kv.partition("=")
            over[key] = val if key == "method" else (float(val) if "." in val else int(val))
        variants[name] = over
    res = compare(
        a.dataset, a.methods, a.seeds, train_size=a.train_size, eval_size=a.eval_size, variants=variants, steps=a.steps
    )
    print(markdown(res))
    if a.out:
        with open(a.out, "w") as fh:
            json.dump(res, fh, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
