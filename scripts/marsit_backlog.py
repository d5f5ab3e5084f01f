"""What a Marsit-K run's full-precision rounds apply: one run of a Marsit config, round by round.

Algorithm 1 (seed 004) adds each worker's compensation to its update before every round, and a
full-precision round averages the sum, so it moves the parameters by everything the one-bit rounds
held back since the previous one (the worker-mean compensation). This trains one run of a config
exactly as ``zeroth run`` does (the same batches, keys and step-size schedule: the same digests) and
prints, at every full round and around it, the norm of that backlog next to the norm of the
parameters, the step the round took and the test accuracy after it::

    python scripts/marsit_backlog.py experiments/marsit_fig3b.yaml --run K=50 --rounds 103
    python scripts/marsit_backlog.py experiments/marsit_fig3b.yaml --run K=50 --rounds 103 --set sync.eta_s=0.01
"""

from __future__ import annotations

import argparse

import numpy as np

from zeroth.marsit.devices import ensure_cpu_devices


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("config", help="a Marsit experiment YAML (experiments/marsit_*.yaml)")
    ap.add_argument("--run", required=True, help="the label of one run of its list, e.g. K=50")
    ap.add_argument("--rounds", type=int, default=None, help="stop after this many rounds (default: the run's)")
    ap.add_argument("--set", action="append", default=[], metavar="SECTION.FIELD=VALUE", help="override a field")
    a = ap.parse_args()

    from zeroth.marsit import config as C

    runs = C.load_runs(a.config, a.set)
    spec = next((r for r in runs if r.label == a.run), None)
    if spec is None:
        ap.error(f"--run {a.run!r} is not in {a.config}; its runs: {', '.join(r.label for r in runs)}")
    if spec.sync.method != "marsit":
        ap.error(f"run {a.run!r} synchronizes with {spec.sync.method}; this needs a Marsit run")
    ensure_cpu_devices(spec.topology.workers)  # before jax starts

    from jax.flatten_util import ravel_pytree

    from zeroth.collectives import train as T
    from zeroth.marsit.experiment import setup

    _, sync, tr, state, batch, evaluate, lr_scale = setup(spec)
    k = spec.sync.K

    print(
        f"{a.config} {a.run}: eta_l {spec.train.eta_l}, eta_s {spec.sync.eta_s}, K {k}, one-bit step norm "
        f"eta_s * sqrt(d) = {spec.sync.eta_s * np.sqrt(tr.dim):.3f} (times the round's step-size factor)"
    )
    print("round phase   factor    round loss  |params|  |mean comp.|  max|comp.|    |step|  accuracy after")
    for t in range(spec.train.rounds if a.rounds is None else a.rounds):
        phase = sync.phase(t)
        comp = np.asarray(T.gather(state.sync.compensation), np.float64)  # [M, d]: every worker's
        x = np.asarray(ravel_pytree(T.worker_copy(state.params, 0))[0], np.float64)
        state, losses = tr.round(state, t, *batch(t), lr_scale=lr_scale(t))
        x1 = np.asarray(ravel_pytree(T.worker_copy(state.params, 0))[0], np.float64)
        near = k is not None and t > 0 and (t % k in (1, k - 1) or phase == "full")
        if near or (t + 1) % spec.train.eval_every == 0:
            acc = float(evaluate(T.worker_copy(state.params, 0))[1])
            print(
                f"{t:5d} {phase:5s} {lr_scale(t):8.0e} {float(np.mean(T.gather(losses))):13.4f} "
                f"{np.linalg.norm(x):9.2f} {np.linalg.norm(comp.mean(0)):12.3f} {np.abs(comp).max():11.3f} "
                f"{np.linalg.norm(x1 - x):9.3f} {acc:15.3f}",
                flush=True,
            )


if __name__ == "__main__":
    main()
