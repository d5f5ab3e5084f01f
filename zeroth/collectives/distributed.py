"""The collectives over several processes (hosts) with ``jax.distributed``: the same programs, a bigger mesh.

Each process calls :func:`initialize` (coordinator address, process count, its id) before it
touches a device; ``jax.devices()`` then lists every process's devices and a topology's mesh spans
them all. Nothing else changes: the ring and torus all-reduce, Marsit and the baselines are the
same ``shard_map`` programs, and ``ppermute`` between devices of different processes goes through
the backend's cross-process collectives (on CPU: gloo over TCP, ``jax_cpu_collectives_implementation``).

As a program it is a self-check to run once per process, e.g. two processes on loopback::

    python -m zeroth.collectives.distributed --coordinator 127.0.0.1:29500 --num-processes 2 --process-id 0 &
    python -m zeroth.collectives.distributed --coordinator 127.0.0.1:29500 --num-processes 2 --process-id 1

Each prints one JSON line: whether the ring and torus all-reduce equal ``psum`` on this process's
shards, and the parameter checksum of each of its workers after every Marsit round. Workers on
different processes must print the same checksums.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

__all__ = ["initialize", "global_array", "self_check", "main"]


def initialize(
    coordinator: str,
    num_processes: int,
    process_id: int,
    *,
    local_devices: int | None = None,
    cpu_collectives: str = "gloo",
    timeout_s: int = 60,
    hostname: str | None = None,
) -> None:
    """Join a multi-process JAX job (call before any other use of jax devices).

    Args:
      coordinator: ``host:port`` of process 0's coordinator (e.g. ``127.0.0.1:29500``).
      num_processes: number of processes.
      process_id: this process's id in ``[0, num_processes)``.
      local_devices: on CPU, how many devices this process exposes (sets ``XLA_FLAGS``).
      cpu_collectives: cross-process collectives on CPU: ``"gloo"`` (TCP) or ``"mpi"``.
      timeout_s: how long to wait for the other processes.
      hostname: on CPU with gloo, the address the other processes reach this one's collectives at
        (default: gloo resolves this machine's host name, which on a host with several interfaces
        or in a container may name an address the others cannot reach).
    """
    if not 0 <= process_id < num_processes:
        raise ValueError(f"process_id must be in [0, {num_processes}), got {process_id}")
    if local_devices is not None:
        flags = os.environ.get("XLA_FLAGS", "")
        if "xla_force_host_platform_device_count" in flags:
            raise ValueError(f"XLA_FLAGS already sets the device count ({flags!r}); drop local_devices or the flag")
        os.environ["XLA_FLAGS"] = f"{flags} --xla_force_host_platform_device_count={local_devices}".strip()
    import jax

    jax.config.update("jax_cpu_collectives_implementation", cpu_collectives)
    jax.distributed.initialize(
        coordinator_address=coordinator,
        num_processes=num_processes,
        process_id=process_id,
        initialization_timeout=timeout_s,
    )
    if hostname is not None and cpu_collectives == "gloo":
        # jax builds gloo's TCP collectives without a host name; the CPU backend is made again (it is
        # not started yet) with gloo bound to ``hostname``.
        from jax._src import distributed as _jd
        from jax._src import xla_bridge
        from jax._src.lib import _jax

        def cpu_backend():
            gloo = _jax.make_gloo_tcp_collectives(distributed_client=_jd.global_state.client, hostname=hostname)
            return xla_bridge.make_cpu_client(collectives=gloo)

        xla_bridge.register_backend_factory("cpu", cpu_backend, priority=0, fail_quietly=False)


def global_array(host_value, sharding):
    """A global ``jax.Array`` from a host array every process holds in full (each places its shards)."""
    import jax
    import numpy as np

    host_value = np.asarray(host_value)
    return jax.make_array_from_callback(host_value.shape, sharding, lambda idx: host_value[idx])


def self_check(rounds: int = 3, *, eta_s: float = 1e-2, K: int | None = 2) -> dict:
    """All-reduce vs ``psum`` on ring and torus, then ``rounds`` Marsit rounds with checksums.

    Uses every global device as a worker. Returns a JSON-able dict (this process's view).
    """
    import jax
    import numpy as np
    import optax
    from jax.sharding import NamedSharding

    from zeroth.collectives import ring as _ring
    from zeroth.collectives import sync as _sync
    from zeroth.collectives import topology as _topo
    from zeroth.collectives import train as _train

    m = jax.device_count()
    out: dict = {"process": jax.process_index(), "processes": jax.process_count(), "workers": m}
    topos = [_topo.Ring(m), _topo.make_topology("torus", m)]
    for topo in topos:
        mesh = topo.mesh()
        spec = topo.spec()
        sharding = NamedSharding(mesh, spec)
        rng = np.random.default_rng(7)
        ints = rng.integers(-(2**20), 2**20, (m, 45)).astype(np.int32)
        floats = rng.standard_normal((m, 45)).astype(np.float32)

        def ring_fn(a):
            return _ring.allreduce_sum(a[0], topo)[None]

        def psum_fn(a):
            return jax.lax.psum(a[0], topo.axes)[None]

        checks = {}
        for name, host in (("int32", ints), ("float32", floats)):
            arr = global_array(host, sharding)
            got = jax.jit(jax.shard_map(ring_fn, mesh=mesh, in_specs=spec, out_specs=spec))(arr)
            want = jax.jit(jax.shard_map(psum_fn, mesh=mesh, in_specs=spec, out_specs=spec))(arr)
            total = host.sum(axis=0) if name == "int32" else host.astype(np.float64).sum(axis=0)
            ok = True
            for g, w in zip(got.addressable_shards, want.addressable_shards):
                gv, wv = np.asarray(g.data)[0], np.asarray(w.data)[0]
                if name == "int32":
                    ok = ok and bool(np.array_equal(gv, wv)) and bool(np.array_equal(gv, total))
                else:
                    ok = (
                        ok
                        and bool(np.allclose(gv, wv, rtol=1e-5, atol=1e-5))
                        and bool(np.allclose(gv, total, atol=1e-4))
                    )
            checks[name] = ok
        out[f"{type(topo).__name__.lower()}_allreduce_equals_psum"] = checks

    # Marsit on a least-squares problem, every worker with its own rows.
    topo = topos[0]
    mesh = topo.mesh()
    sharding = NamedSharding(mesh, topo.spec())
    rng = np.random.default_rng(11)
    w_true = rng.standard_normal((16,)).astype(np.float32)
    xs = rng.standard_normal((rounds, m, 8, 16)).astype(np.float32)
    ys = np.einsum("rmbi,i->rmb", xs, w_true).astype(np.float32)
    params = {"w": np.zeros((16,), np.float32)}

    def loss_fn(p, x, y):
        return optax.l2_loss(x @ p["w"], y).mean()

    sync = _sync.marsit(topo, eta_s, K)
    tr = _train.make_trainer(loss_fn, params, topo, sync, eta_l=0.1, mesh=mesh)
    state = _train.WorkerState(
        {"w": global_array(np.zeros((m, 16), np.float32), sharding)},
        jax.tree_util.tree_map(
            lambda a: global_array(np.broadcast_to(np.asarray(a), (m,) + np.shape(a)).copy(), sharding),
            sync.init(tr.dim),
        ),
    )
    sums = []
    for t in range(rounds):
        state, _ = tr.round(state, t, global_array(xs[t], sharding), global_array(ys[t], sharding))
        sums.append(_train.worker_checksums(state.params))
    out["marsit_checksums"] = sums
    out["marsit_phases"] = [sync.phase(t) for t in range(rounds)]
    return out


def main(argv: list[str] | None = None) -> int:
    """CLI (see module docstring)."""
    ap = argparse.ArgumentParser(prog="python -m zeroth.collectives.distributed", description=__doc__.split("\n")[0])
    ap.add_argument("--coordinator", required=True, help="host:port of process 0 (e.g. 127.0.0.1:29500)")
    ap.add_argument("--num-processes", type=int, required=True)
    ap.add_argument("--process-id", type=int, required=True)
    ap.add_argument("--local-devices", type=int, default=2, help="CPU devices of this process (default 2)")
    ap.add_argument("--rounds", type=int, default=3, help="Marsit rounds of the self-check")
    ap.add_argument("--timeout", type=int, default=60, help="seconds to wait for the other processes")
    args = ap.parse_args(argv)
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    initialize(
        args.coordinator, args.num_processes, args.process_id, local_devices=args.local_devices, timeout_s=args.timeout
    )
    print(json.dumps(self_check(args.rounds)), flush=True)
    import jax

    jax.distributed.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
