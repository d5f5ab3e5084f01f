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
    devices = ensure_cpu_devices(spec.topology.workers)

    import jax
    import jax.numpy as jnp
    import optax
    from jax.flatten_util import ravel_pytree

    from zeroth import data as D
    from zeroth import models as Mo
    from zeroth.collectives import sync as S
    from zeroth.collectives import topology as Tp
    from zeroth.collectives import train as T
    from zeroth.marsit.experiment import lr_scales

    topo = Tp.make_topology(spec.topology.kind, spec.topology.workers, spec.topology.rows)
    train_ds, test_ds = D.load(spec.data.dataset, "train"), D.load(spec.data.dataset, "test")
    n_eval = spec.data.eval_size or test_ds.x.shape[0]
    x_test, y_test = jnp.asarray(test_ds.x[:n_eval]), jnp.asarray(test_ds.y[:n_eval])
    model = Mo.build(spec.model.name, num_classes=train_ds.num_classes, **dict(spec.model.kwargs))
    params0 = Mo.init(model, Mo.init_key(spec.seed), train_ds.x[:1])

    def loss_fn(p, x, y):
        return optax.softmax_cross_entropy_with_integer_labels(Mo.apply(model, p, x), y).mean()

    accuracy = jax.jit(lambda p: jnp.mean(jnp.argmax(Mo.apply(model, p, x_test), -1) == y_test))
    sync = S.build("marsit", topo, eta_s=spec.sync.eta_s, K=spec.sync.K)
    h = spec.train.local_steps
    tr = T.make_trainer(
        loss_fn,
        params0,
        topo,
        sync,
        eta_l=spec.train.eta_l,
        run_seed=spec.seed,
        mesh=topo.mesh(devices),
        local_steps=h,
        momentum=spec.train.momentum,
    )
    state = tr.init(params0)
    lr_scale = lr_scales(spec, sync.phase)
    m, b, n = topo.size, spec.data.batch_size, train_ds.x.shape[0]
    k = spec.sync.K

    def batch(t):
        if h == 1:
            idx = [D.batch_indices(spec.seed, t * m + w, b, n) for w in range(m)]
            return np.stack([train_ds.x[i] for i in idx]), np.stack([train_ds.y[i] for i in idx])
        idx = [[D.batch_indices(spec.seed, (t * h + j) * m + w, b, n) for j in range(h)] for w in range(m)]
        return (
            np.stack([np.stack([train_ds.x[i] for i in row]) for row in idx]),
            np.stack([np.stack([train_ds.y[i] for i in row]) for row in idx]),
        )

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
            acc = float(accuracy(T.worker_copy(state.params, 0)))
            print(
                f"{t:5d} {phase:5s} {lr_scale(t):8.0e} {float(np.mean(T.gather(losses))):13.4f} "
                f"{np.linalg.norm(x):9.2f} {np.linalg.norm(comp.mean(0)):12.3f} {np.abs(comp).max():11.3f} "
                f"{np.linalg.norm(x1 - x):9.3f} {acc:15.3f}",
                flush=True,
            )


if __name__ == "__main__":
    main()
