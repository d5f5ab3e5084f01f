"""Data-parallel training over a device mesh, one worker per device, with a :class:`SyncTransform`.

Algorithm 2 of seed 004 for every method: each round ``t`` every worker ``m``

1. computes its stochastic gradient on its own batch, ``u_m = eta_l * grad f_m(x_t)`` (flattened);
   with ``local_steps = H > 1`` or ``momentum = beta > 0`` (the seed's protocol: "clients perform
   multiple local updates between two successive synchronizations", optimizer "Momentum"), it
   makes ``H`` local steps, each on its own batch, ``v <- beta v + grad f_m(x_t - u_m)``,
   ``u_m <- u_m + eta v`` (``u_m`` starts at 0; ``v`` is the worker's momentum, kept across
   rounds), so ``u_m`` is the worker's whole local update of the round;
2. synchronizes: ``g_t, state_m = sync.update(u_m, state_m, RoundCtx(round_key(t), phase(t)))``;
3. updates its copy of the parameters, ``x_{t+1} = x_t - g_t``.

``H = 1, beta = 0`` computes ``u_m = 0 + eta * grad``: the same bits as one plain step. The round's
step size is ``eta_l * lr_scale`` and the global step size of the sign methods ``eta_s * lr_scale``
(``round(..., lr_scale=)``: a schedule such as the seed's division by 10 at every full-precision
synchronization is the caller's).

All of it is one ``jax.shard_map`` program per phase (compiled once; the round key is an
argument). Parameters and synchronization state are per-worker arrays with a leading worker axis
sharded over the mesh, so each device holds exactly its worker's copy; :func:`worker_checksums`
hashes each device's shard with :func:`zeroth.replay.checksum`, and they must all agree after
every round.

Example::

    tr = make_trainer(loss_fn, params, Ring(4), marsit(Ring(4), 1e-3, K=100), eta_l=0.05)
    state = tr.init(params)
    for t in range(rounds):
        state, loss = tr.round(state, t, xs, ys)       # xs: [M, B, ...] one batch per worker
        assert len(set(worker_checksums(state.params))) == 1
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax.flatten_util import ravel_pytree
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from zeroth import replay as _replay
from zeroth.collectives import bits as _bits
from zeroth.collectives import ring as _ring
from zeroth.collectives import sync as _sync

__all__ = [
    "WorkerState",
    "Trainer",
    "make_trainer",
    "worker_checksums",
    "all_worker_checksums",
    "worker_copy",
    "first_local_worker",
    "stack_workers",
    "place",
    "gather",
]


class WorkerState(NamedTuple):
    """Every worker's state, stacked on a leading worker axis sharded over the mesh."""

    params: Any  # pytree of f32[M, ...]: worker m's copy of the model is row m
    sync: Any  # pytree with leading axis M: each worker's synchronization state
    opt: Any = ()  # f32[M, d]: each worker's momentum (``()`` without momentum)


class Trainer(NamedTuple):
    """Functions of one training setup (see :func:`make_trainer`)."""

    init: Callable[[Any], WorkerState]
    round: Callable[..., tuple[WorkerState, jax.Array]]
    round_bits: Callable[[str, Any, Any], int]
    round_report: Callable[[str, Any, Any], list]
    reference_bits: Callable[[], int]
    dim: int
    mesh: Any
    topology: Any
    sync: _sync.SyncTransform


def place(host_value, sharding) -> jax.Array:
    """A ``jax.Array`` of a host array placed with ``sharding``: each process puts only the shards of
    its own devices (the same on one process as ``jax.device_put``; over several, the way to build a
    global array from a value every process holds)."""
    host_value = np.asarray(host_value)
    return jax.make_array_from_callback(host_value.shape, sharding, lambda idx: host_value[idx])


def stack_workers(tree: Any, m: int, sharding) -> Any:
    """``tree`` repeated on a new leading axis of size ``m`` and placed with ``sharding``."""
    return jax.tree_util.tree_map(lambda a: place(np.broadcast_to(np.asarray(a), (m,) + np.shape(a)), sharding), tree)


def worker_copy(tree: Any, m: int = 0) -> Any:
    """Worker ``m``'s row of every leaf, as host NumPy arrays (``m`` must be a worker of this process)."""

    def row(a):
        for s in a.addressable_shards:
            start = s.index[0].start or 0
            if start <= m < start + s.data.shape[0]:
                return np.asarray(s.data)[m - start]
        raise ValueError(f"worker {m} is not held by this process (process {jax.process_index()})")

    return jax.tree_util.tree_map(row, tree)


def first_local_worker(tree: Any) -> int:
    """The smallest worker index this process holds (0 on a single process)."""
    leaf = jax.tree_util.tree_leaves(tree)[0]
    return min(s.index[0].start or 0 for s in leaf.addressable_shards)


def gather(a: jax.Array) -> np.ndarray:
    """A sharded array's full value on every process, as host NumPy (``np.asarray`` on one process)."""
    if jax.process_count() == 1:
        return np.asarray(a)
    from jax.experimental import multihost_utils

    return np.asarray(multihost_utils.process_allgather(a, tiled=True))


def all_worker_checksums(params: Any) -> list[str]:
    """:func:`worker_checksums` of every worker of every process, in worker order (on each process)."""
    local = worker_checksums(params)
    if jax.process_count() == 1:
        return local
    from jax.experimental import multihost_utils

    rows = np.stack([np.frombuffer(bytes.fromhex(h), np.uint8) for h in local])
    every = np.asarray(multihost_utils.process_allgather(rows, tiled=True))  # processes in order: workers in order
    return [bytes(r).hex() for r in every]


def worker_checksums(params: Any) -> list[str]:
    """``zeroth.replay.checksum`` of each addressable device shard of a stacked parameter tree.

    One checksum per worker held by this process, in worker order; all equal means every worker
    ended the round with bit-identical parameters.
    """
    leaves, treedef = jax.tree_util.tree_flatten(params)
    per_leaf = []
    for leaf in leaves:
        shards = sorted(leaf.addressable_shards, key=lambda s: s.index[0].start or 0)
        per_leaf.append([np.asarray(s.data) for s in shards])
    n = len(per_leaf[0])
    out = []
    for k in range(n):
        rows = [blocks[k] for blocks in per_leaf]
        if any(r.shape[0] != 1 for r in rows):
            raise ValueError(f"expected one worker per device shard, got shard shapes {[r.shape for r in rows]}")
        out.append(_replay.checksum(jax.tree_util.tree_unflatten(treedef, [r[0] for r in rows])))
    return out


def make_trainer(
    loss_fn: Callable[[Any, jax.Array, jax.Array], jax.Array],
    params: Any,
    topology,
    sync: _sync.SyncTransform,
    *,
    eta_l: float,
    run_seed: int = 0,
    mesh=None,
    local_steps: int = 1,
    momentum: float = 0.0,
) -> Trainer:
    """Build the per-phase round programs of data-parallel training with ``sync``.

    Args:
      loss_fn: ``loss_fn(params, x, y) -> f32[]`` on one worker's batch.
      params: an example parameter pytree (float32 leaves), fixes shapes.
      topology: ``Ring`` / ``Torus`` (mesh axes and all-reduce stages).
      sync: a :class:`~zeroth.collectives.sync.SyncTransform` for ``topology``.
      eta_l: local step size (``u = eta_l * grad``).
      run_seed: names the round keys (``host_round_key(run_seed, t)``).
      mesh: a ``jax.sharding.Mesh`` for the topology (default ``topology.mesh()``).
      local_steps: local steps per round (``H``); with ``H > 1`` a worker's batch has a leading
        step axis: ``xs`` is ``[M, H, B, ...]``.
      momentum: heavy-ball momentum ``beta`` of the local steps (0 = plain SGD).

    Returns:
      A :class:`Trainer`. ``round(state, t, xs, ys, lr_scale=1.0)`` takes host or device batches
      with a leading worker axis and returns the new state and the per-worker losses ``f32[M]``
      (the mean over the round's local steps).

    Raises:
      ValueError: ``local_steps`` not an int >= 1, or ``momentum`` not in ``[0, 1)``.
    """
    if isinstance(local_steps, bool) or not isinstance(local_steps, int) or local_steps < 1:
        raise ValueError(f"local_steps must be an int >= 1, got {local_steps!r}")
    if isinstance(momentum, bool) or not isinstance(momentum, (int, float)) or not 0.0 <= momentum < 1.0:
        raise ValueError(f"momentum must be a number in [0, 1), got {momentum!r}")
    mesh = topology.mesh() if mesh is None else mesh
    spec = topology.spec()
    sharding = NamedSharding(mesh, spec)
    flat0, unravel = ravel_pytree(params)
    dim = int(flat0.shape[0])
    m_total = topology.size
    beta = float(momentum)
    plain = local_steps == 1 and beta == 0.0

    def local_update(p, v, x, y, eta):
        """``(u, v, mean loss)`` of ``local_steps`` steps from ``p`` (``v``: momentum or ``()``)."""
        if plain:
            loss, grads = jax.value_and_grad(loss_fn)(p, x, y)
            return eta * ravel_pytree(grads)[0].astype(jnp.float32), v, loss
        flat_p = ravel_pytree(p)[0]
        xs, ys = (x, y) if local_steps > 1 else (x[None], y[None])

        def one(carry, batch):
            u, v = carry
            loss, grads = jax.value_and_grad(loss_fn)(unravel(flat_p - u), *batch)
            gf = ravel_pytree(grads)[0].astype(jnp.float32)
            v = gf if beta == 0.0 else jnp.float32(beta) * v + gf
            return (u + eta * v, v), loss

        v0 = v if beta > 0.0 else jnp.zeros_like(flat_p)
        (u, v1), losses = jax.lax.scan(one, (jnp.zeros_like(flat_p), v0), (xs, ys))
        return u, (v1 if beta > 0.0 else v), jnp.mean(losses)

    def local_round(phase, params_w, sync_w, opt_w, x_w, y_w, rkey, eta, scale):
        p = jax.tree_util.tree_map(lambda a: a[0], params_w)
        s = jax.tree_util.tree_map(lambda a: a[0], sync_w)
        v = jax.tree_util.tree_map(lambda a: a[0], opt_w)
        u, v, loss = local_update(p, v, x_w[0], y_w[0], eta)
        g, s, _ = sync.update(u, s, _sync.RoundCtx(rkey, phase, scale))
        new_p = jax.tree_util.tree_map(lambda a, b: a - b, p, unravel(g))
        expand = functools.partial(jax.tree_util.tree_map, lambda a: a[None])
        return expand(new_p), expand(s), expand(v), loss[None]

    def program(phase):
        return jax.shard_map(
            functools.partial(local_round, phase),
            mesh=mesh,
            in_specs=(spec, spec, spec, spec, spec, P(), P(), P()),
            out_specs=(spec, spec, spec, spec),
        )

    compiled: dict[str, Callable] = {}

    def step(phase):
        if phase not in compiled:
            compiled[phase] = jax.jit(program(phase), donate_argnums=(0, 1, 2))
        return compiled[phase]

    def init(p) -> WorkerState:
        s0 = sync.init(dim)
        v0 = np.zeros((dim,), np.float32) if beta > 0.0 else ()
        return WorkerState(
            stack_workers(p, m_total, sharding),
            stack_workers(s0, m_total, sharding),
            stack_workers(v0, m_total, sharding),
        )

    def put(a):
        if isinstance(a, jax.Array) and a.sharding == sharding:
            return a
        return place(a, sharding)

    def run_round(state: WorkerState, t: int, xs, ys, lr_scale: float = 1.0):
        phase = sync.phase(t)
        rkey = jnp.asarray(_sync.host_round_key(run_seed, t))
        eta = jnp.float32(eta_l * lr_scale)
        params_w, sync_w, opt_w, losses = step(phase)(
            state.params, state.sync, state.opt, put(xs), put(ys), rkey, eta, jnp.float32(lr_scale)
        )
        return WorkerState(params_w, sync_w, opt_w), losses

    def dtype_of(a):
        return a.dtype if hasattr(a, "dtype") else np.asarray(a).dtype

    def abstract(tree):
        return jax.tree_util.tree_map(lambda a: jax.ShapeDtypeStruct(np.shape(a), dtype_of(a)), tree)

    def round_report(phase: str, xs, ys) -> list[dict]:
        """Every ``ppermute`` of one round of ``phase`` with batches like ``xs, ys`` (see ``bits.ppermute_report``)."""
        stacked = functools.partial(
            jax.tree_util.tree_map, lambda a: jax.ShapeDtypeStruct((m_total,) + np.shape(a), dtype_of(a))
        )
        v0 = jax.ShapeDtypeStruct((dim,), jnp.float32) if beta > 0.0 else ()
        args = (
            stacked(params),
            stacked(sync.init(dim)),
            stacked(v0),
            abstract(xs),
            abstract(ys),
            jax.ShapeDtypeStruct((2,), jnp.uint32),
            jax.ShapeDtypeStruct((), jnp.float32),
            jax.ShapeDtypeStruct((), jnp.float32),
        )
        return _bits.ppermute_report(program(phase), *args)

    def round_bits(phase: str, xs, ys) -> int:
        """Bits all workers send through ``ppermute`` in one round of ``phase``."""
        return int(sum(r["bits"] for r in round_report(phase, xs, ys)))

    def reference_bits() -> int:
        """Bits of a full-precision all-reduce of the ``dim``-element update on this topology."""
        fn = jax.shard_map(
            lambda v: _ring.allreduce_mean(v[0], topology)[None], mesh=mesh, in_specs=(spec,), out_specs=spec
        )
        return _bits.ppermute_bits(fn, jax.ShapeDtypeStruct((m_total, dim), jnp.float32))

    return Trainer(init, run_round, round_bits, round_report, reference_bits, dim, mesh, topology, sync)
