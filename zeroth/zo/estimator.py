"""The two-point projected gradients of SPSA / MeZO over zeroth's exact perturbations.

``g_i = (L(θ + εz_i) − L(θ − εz_i)) / (2ε)``, where ``θ ± εz_i`` is ``replay(θ, [(k_i, ±ε)])`` bit for
bit. :func:`projected_gradients` traces it into the caller's program; :func:`projected_gradients_fn`
compiles it with the memory-saving options of :mod:`zeroth.zo.autotune`. Both return ``(g, ℓ)``.
"""

from __future__ import annotations

import functools
import math
import os
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from zeroth import codecs as _codecs
from zeroth import layerwise as _layerwise
from zeroth import noise as _noise
from zeroth import replay as _replay
from zeroth import rng as _rng
from zeroth import rule as _rule
from zeroth.kernels import host_memory as _host_memory
from zeroth.kernels import perturb as _fused
from zeroth.zo import autotune as _autotune
from zeroth.zo import update as _update

__all__ = [
    "round_eps",
    "projected_gradients",
    "projected_gradients_fn",
    "ProjectedGradientsFn",
    "PERTURB_IMPLS",
    "PERTURB_ENV",
    "BLOCKS_MIN_ELEMENTS",
]


def round_eps(eps: float) -> np.float32:
    """The host-rounded perturbation size ε (:func:`zeroth.replay.round_coefficient`) as float32.

    ``θ ± εz`` with this ε is exactly ``replay(θ, [(key, ±ε)])``.

    Raises:
      ValueError: ``eps`` is not a finite number > 0.

    Example:
      >>> float(round_eps(1e-3))
      0.0010000001639127731
    """
    e = float(eps)
    if not (math.isfinite(e) and e > 0.0):
        raise ValueError(f"eps must be a finite number > 0, got {eps!r}")
    r = _replay.round_coefficient(e)
    if r == 0.0:
        raise ValueError(f"eps={eps!r} rounds to 0 (it must be >= 2**-120)")
    return np.float32(r)


def _eps_scale(eps):
    """``eps`` host-rounded (:func:`round_eps`) where it is a concrete number; a traced or abstract
    ``eps`` is passed through and must be host-rounded by its caller."""
    if isinstance(eps, (jax.core.Tracer, jax.ShapeDtypeStruct)):  # traced, or abstract (compiled, never run)
        return eps
    e = np.asarray(eps)
    if e.shape != ():
        raise ValueError(f"eps must be a scalar, got shape {e.shape}")
    return round_eps(float(e))


def projected_gradients(
    loss_fn: Callable[[Any, Any], jax.Array],
    params: Any,
    batch: Any,
    keys,
    eps_scale,
    *,
    distribution: str = "binomial",
    unroll: bool = False,
    perturb_impl: str = "auto",
) -> tuple[jax.Array, jax.Array]:
    """``(g, ℓ)``: two-point projected gradients and the mean loss of each pair (traceable).

    The compiled form is :func:`projected_gradients_fn`; both take a raw ε and return ``(g, ℓ)``.

    For each key ``k_i``: ``θ± = replay(θ, [(k_i, ±ε)])`` (the exact rule: the native CPU kernel
    leaf by leaf where the program runs on a CPU that has it, else
    :func:`zeroth.replay.apply_updates`; the same bits), ``g_i = (L(θ+) − L(θ−)) / (2ε)`` and
    ``ℓ_i = (L(θ+) + L(θ−)) / 2``, in float32. The 2n forward passes are the iterations of one
    ``lax.map`` over ``(k_i, ±ε)``: each iteration builds one perturbed model, leaf by leaf as the
    forward pass needs it, and nothing of it outlives the iteration (see the module docstring on
    memory and :func:`compiler_options`). The leaves' keys of all 2n evaluations are derived
    before the loop, in one computation (the native CPU kernel derives its own). While
    ``loss_fn`` is traced, a :class:`zeroth.layerwise.Provider` serves the parts of ``θ±`` that the model reads through
    :mod:`zeroth.layerwise` (layer ``i`` of a stacked leaf inside a scan, rows of a table),
    computed on demand from ``θ`` with the same bits; ``loss_fn(params, batch)`` is called as
    usual, and a model that does not use :mod:`zeroth.layerwise` sees no difference.

    Args:
      loss_fn: ``loss_fn(params, batch) -> scalar``; any function, differentiable or not.
      params: pytree of f32 / bf16 / f16 arrays, or its :class:`zeroth.replay.Flat` (the tree's
        leaves, paths and bits; each iteration slices the leaves out of the buffers).
      batch: any pytree, passed through to ``loss_fn``.
      keys: ``u32[n, 2]`` sample keys (:func:`zeroth.rng.sample_keys`).
      eps_scale: ε, a number rounded here as the update rule rounds it (:func:`round_eps`); a
        traced ε must be host-rounded by the caller.
      distribution: ``"binomial"`` or ``"rademacher"`` (exact noise only).
      perturb_impl: how each perturbed leaf is computed: ``"auto"`` (the native CPU kernel on a
        CPU that has it; on a GPU with jax's Triton backend the flat Triton kernel,
        :func:`zeroth.kernels.perturb.perturb_pallas_segments`, a launch per leaf of at least
        :data:`zeroth.kernels.perturb.APART_MIN_BYTES`, and the jnp rule for the others; else
        the jnp rule; :data:`PERTURB_ENV` may name another), ``"native"``,
        ``"pallas"`` (on a CPU in Pallas interpret mode, for tests) or ``"jnp"``. The same bits.
      unroll: the 2n forward passes as straight-line code instead of a ``lax.map``, each
        evaluation's perturbed model made after the previous evaluation's loss (an optimization
        barrier orders them, so that still only one perturbed model is alive at a time). A loop
        runs its body as a sequence of launches apart from the program's other work (on a GPU,
        outside the CUDA graphs that hold a forward's kernels); straight-line code is one program
        like a forward. The same noise; the losses may round differently (another program).

    Returns:
      ``(g, ℓ)``, both ``f32[n]``.
    """
    _noise.check_distribution(distribution)
    eps_scale = _eps_scale(eps_scale)
    keys = jnp.asarray(keys, jnp.uint32).reshape(-1, 2)
    n = keys.shape[0]
    eps = jnp.asarray(eps_scale, jnp.float32).reshape(())
    # z = k / 2 for binomial: θ + εz = θ + (ε/2)·k, the scale replay.update_scale gives (exact).
    scale = eps * jnp.float32(0.5) if distribution == "binomial" else eps
    pair_keys = jnp.repeat(keys, 2, axis=0)  # k_0, k_0, k_1, k_1, ...
    pair_scales = jnp.tile(jnp.stack([scale, -scale]), n)  # +s, -s, +s, -s, ...

    impl = _perturb_impl(perturb_impl)
    native = impl == "native"
    if isinstance(params, _replay.Flat):
        ids = [g.leaf_id for g in params.layout.segments]
    else:
        ids = [_rng.leaf_id(path) for path, _ in jax.tree_util.tree_flatten_with_path(params)[0]]
    # every evaluation's table of leaf keys, derived once for all of them (inside the loop they
    # were kernels of their own at each evaluation); the native kernel derives whole leaves' itself
    tables = jnp.swapaxes(_fused.leaf_key_table(pair_keys, ids), 0, 1)[:, :, None, :]

    def one(args, source=params, after=None):
        # The barrier makes this iteration's copy of θ depend on its key, so no whole-model value
        # is hoisted out of the loop even where invariant code motion runs. Unrolled, ``source``
        # is the previous evaluation's θ (one chain of barriers over the parameters) and ``after``
        # its loss, so that the evaluations run one after the other.
        key, s, table, theta, _ = jax.lax.optimization_barrier((args[0], args[1], args[2], source, after))
        return evaluate(key, s, table, theta), theta

    def evaluate(key, s, table, theta):
        sources = None
        if isinstance(theta, _replay.Flat):  # unflattened after the barrier: slices fused into their uses
            # where each leaf lies: a layer of a stacked leaf is read from its buffer (a slice of
            # a shared buffer passed to a scan would be a copy of the whole leaf, for the whole loop)
            sources = [(theta.buffers[g.buffer], g.offset) for g in theta.layout.segments]
            theta = _replay.unflatten(theta)
        if native:
            # The native CPU kernel, one launch per leaf: one threefry call per 4 (binomial) or
            # 64 (Rademacher) elements where the jnp rule hashes once per element, and each
            # perturbed leaf is its own buffer, computed just before its first use.
            perturbed = _fused.apply_updates(
                theta, key[None], s[None], distribution=distribution, impl="native", platform="cpu", per_leaf=True
            )
        elif impl == "pallas":
            # A kernel per large leaf, reading it where it lies (its own array, or a Flat buffer)
            # and writing the perturbed leaf apart: XLA neither fuses it into its consumers nor
            # merges the leaves' kernels, and compiles it once per shape. Small leaves by the
            # jnp rule.
            perturbed = _pallas_leaves(theta, key, s, table, distribution, sources)
        else:
            perturbed = _jnp_leaves(theta, key, s, table, distribution)
        # Models that read stacked layers or embedding rows through zeroth.layerwise get them
        # from here, computed on demand from θ (same bits); the whole perturbed leaf is then
        # unused and XLA drops it.
        with _layerwise.provide(_perturbed_parts(theta, perturbed, table, s, distribution, native, sources)):
            loss = loss_fn(perturbed, batch)
        return jnp.asarray(loss).astype(jnp.float32).reshape(())

    if unroll:
        out: list[jax.Array] = []
        theta = params
        for i in range(2 * n):
            loss, theta = one((pair_keys[i], pair_scales[i], tables[i]), theta, out[-1] if out else None)
            out.append(loss)
        losses = jnp.stack(out).reshape(n, 2)
    else:
        losses = jax.lax.map(lambda args: one(args)[0], (pair_keys, pair_scales, tables)).reshape(n, 2)
    lp, lm = losses[:, 0], losses[:, 1]
    return (lp - lm) / (jnp.float32(2.0) * eps), (lp + lm) * jnp.float32(0.5)


PERTURB_IMPLS = ("auto", "native", "pallas", "jnp")
PERTURB_ENV = "ZEROTH_ZO_PERTURB"
"""An environment variable that, where set to one of :data:`PERTURB_IMPLS` but ``"auto"``, is
what ``perturb_impl="auto"`` means in this process: ``ZEROTH_ZO_PERTURB=jnp zeroth bench zo ...``
times a GPU's ZO steps with the jnp rule for every leaf, to compare with the default's kernels."""


def _perturb_impl(impl: str) -> str:
    """The ``perturb_impl`` of :func:`projected_gradients` for the platform it is traced
    for (:func:`zeroth.rule.default_platform`): ``"native"``, ``"pallas"`` or ``"jnp"``."""
    if impl not in PERTURB_IMPLS:
        raise ValueError(f"perturb_impl must be one of {', '.join(map(repr, PERTURB_IMPLS))}; got {impl!r}")
    if impl == "auto" and os.environ.get(PERTURB_ENV, "auto") != "auto":
        impl = os.environ[PERTURB_ENV]
        if impl not in PERTURB_IMPLS:
            raise ValueError(f"{PERTURB_ENV} must be one of {', '.join(map(repr, PERTURB_IMPLS))}; got {impl!r}")
    platform = _rule.default_platform()
    if impl == "auto":
        if platform == "gpu":
            return "pallas" if _fused.resolve_impl("auto", "gpu", 2) == "pallas" else "jnp"
        return "native" if _fused.resolve_impl("auto", platform, 1) == "native" else "jnp"
    if impl == "native":
        _fused.resolve_impl("native", platform)  # refuses anything but a CPU
    if impl == "pallas" and platform == "tpu":
        raise ValueError("perturb_impl='pallas' loads leaves by element index (Triton's); a TPU takes 'jnp'")
    return impl


def _jnp_leaves(leaves, key, scale, table, distribution: str):
    """``leaves`` (a pytree) perturbed by ``scale · z`` with the jnp rule (``table``: their keys
    ``u32[L, 1, 2]`` in tree order), each large leaf apart (``per_leaf``: on a GPU one kernel would
    otherwise compute every large perturbed leaf at once), each divided by a runtime 1.0 (exact:
    ``x / 1 == x`` for every float). The division marks its producer as expensive, so XLA
    materializes the leaf once instead of fusing the noise generation into consumers that
    broadcast it (a bias added to every token would otherwise regenerate its noise once per token)."""
    perturbed = _fused.apply_updates(
        leaves, key[None], scale[None], distribution=distribution, impl="jnp", per_leaf=True, leaf_keys=table
    )
    unit = scale / scale
    return jax.tree_util.tree_map(lambda x: x / unit.astype(x.dtype), perturbed)


def _pallas_leaves(theta, key, scale, table, distribution: str, sources=None):
    """``theta`` perturbed by ``scale · z``: each leaf of at least
    :data:`zeroth.kernels.perturb.APART_MIN_BYTES` by a launch of its own of
    :func:`zeroth.kernels.perturb.perturb_pallas_segments` (row ``i`` of ``table``, the leaves'
    keys ``u32[L, 1, 2]``), read where it lies (``sources[i] = (buffer, offset)`` in a
    :class:`zeroth.replay.Flat` buffer, else the leaf itself); the smaller leaves by the jnp rule
    (:func:`_jnp_leaves`), which XLA fuses into few kernels, some into their consumers. (A launch for every
    leaf, or per group of small vectors, runs more operations per call than this split.) Off a GPU: interpret mode."""
    leaves, treedef = jax.tree_util.tree_flatten(theta)
    interpret = _rule.default_platform() != "gpu"
    out: list[Any] = [None] * len(leaves)
    small = [i for i, x in enumerate(leaves) if x.size * x.dtype.itemsize < _fused.dispatch.APART_MIN_BYTES]
    if small:
        rows = table[np.asarray(small)] if len(small) < len(leaves) else table
        for i, x in zip(small, _jnp_leaves([leaves[i] for i in small], key, scale, rows, distribution), strict=True):
            out[i] = x
    for i, leaf in enumerate(leaves):
        if out[i] is None:
            buffer, base = (leaf.reshape(-1), 0) if sources is None else sources[i]
            out[i] = _fused.perturb_pallas_segments(
                buffer,
                table,
                scale[None],
                ((base, leaf.size, i),),
                distribution=distribution,
                interpret=interpret,
                platform="cpu" if interpret else None,
            ).reshape(leaf.shape)
    return jax.tree_util.tree_unflatten(treedef, out)


BLOCKS_MIN_ELEMENTS = _layerwise.BLOCKS << 18
"""The smallest dense kernel a ZO step on a CPU perturbs a block of rows at a time
(:func:`zeroth.layerwise.dot_general`): one whose blocks hold at least 2^18 elements each, the
work above which the native CPU kernel runs on threads. Smaller kernels in blocks
save memory but cost time; ``zeroth bench zo --model mlp --rows step --width W`` measures both."""


def _perturbed_parts(
    theta, perturbed, table, scale, distribution: str, native: bool, sources=None
) -> _layerwise.Provider:
    """The :class:`zeroth.layerwise.Provider` of one perturbed model ``perturbed = θ + s·z``.

    It recognises the leaves of ``perturbed`` by identity and serves layer ``i`` of a stacked leaf
    (:func:`zeroth.kernels.perturb.slices.perturb_slice` of θ's leaf at ``i · m``, the native kernel
    reading the slice in place on CPU), rows of a table (:func:`zeroth.kernels.perturb.slices.perturb_rows`)
    and blocks of rows of a 2-D leaf of at least :data:`BLOCKS_MIN_ELEMENTS` (a dense kernel, for
    :func:`zeroth.layerwise.dot_general`; ``perturb_slice`` too), each
    bit-identical to the same part of the whole perturbed leaf. ``table``: the leaves' keys
    ``u32[L, 1, 2]`` in tree order (:func:`zeroth.kernels.perturb.leaf_key_table`). ``sources``: for θ given
    as a :class:`zeroth.replay.Flat`, each leaf's ``(buffer, element offset)`` in tree order; a
    layer is then read from the buffer where the leaf lies in it.
    """
    t_leaves = jax.tree_util.tree_leaves(theta)
    p_leaves = jax.tree_util.tree_leaves(perturbed)
    if sources is None:
        sources = [(t, 0) for t in t_leaves]
    known = {
        id(p): (p, t, table[i], src) for i, (t, p, src) in enumerate(zip(t_leaves, p_leaves, sources, strict=True))
    }
    scales = scale[None]
    impl = "native" if native else "jnp"

    def find(leaf):
        hit = known.get(id(leaf))
        return None if hit is None or hit[0] is not leaf else hit

    def materialize(x, like):
        # As for whole leaves on the jnp path: a division by a runtime 1.0 keeps XLA from fusing
        # the noise into consumers that broadcast it (exact, x / 1 == x).
        return x / (scale / scale).astype(like.dtype)

    def part(hit, shape):
        # at(start): prod(shape) elements of the perturbed leaf from flat index start on (traced)
        _, t, lk, (source, base) = hit

        def at(start):
            z = _fused.slices.perturb_slice(
                source, lk, scales, start, shape, distribution=distribution, impl=impl, base=base, size=t.size
            )
            return z if native else materialize(z, t)

        return at

    def layer(leaf):
        hit = find(leaf)
        if hit is None or jnp.ndim(hit[1]) < 1:
            return None
        shape = tuple(hit[1].shape[1:])
        at = part(hit, shape)
        return lambda i: at(jnp.asarray(i).astype(jnp.uint32) * jnp.uint32(math.prod(shape)))

    def blocks(leaf):
        # a dense kernel of at least BLOCKS_MIN_ELEMENTS, multiplied a block of rows at a time
        hit = find(leaf)
        if hit is None or jnp.ndim(hit[1]) != 2 or hit[1].size < BLOCKS_MIN_ELEMENTS:
            return None
        cols = hit[1].shape[1]
        return lambda start, n: part(hit, (n, cols))(jnp.asarray(start).astype(jnp.uint32) * jnp.uint32(cols))

    def rows(leaf, ids):
        hit = find(leaf)
        if hit is None or jnp.ndim(hit[1]) < 1:
            return None
        _, t, lk, _ = hit
        return materialize(_fused.slices.perturb_rows(t, lk, scales, ids, distribution=distribution), t)

    # Blocks are for a CPU: a GPU would run each block's noise and product as launches of their
    # own, several times the operations of a forward (not timed there).
    return _layerwise.Provider(layer, rows, blocks if _rule.default_platform() == "cpu" else None)


class ProjectedGradientsFn:
    """``fn(params, batch, keys, eps_scale) -> (g f32[n], ℓ f32[n])``, compiled per input signature
    (``unroll``: the forward passes as straight-line code, :func:`projected_gradients`).

    ``params`` is the pytree ``loss_fn`` takes, or its :class:`zeroth.replay.Flat`
    (:func:`zeroth.replay.flatten`): the program then takes a buffer per dtype (and one per large
    leaf) instead of an array per leaf and unflattens them inside (slices that XLA fuses into their
    uses; a large leaf, which a scan would need whole, is its buffer reshaped), with the same
    leaves, paths, noise and bits as the tree. A call's host cost grows with the number of arrays
    it passes, and most with those of an accelerator.

    For each new signature (tree structure, shapes and dtypes) it compiles
    :func:`projected_gradients` under each of :func:`compiler_option_candidates` and
    keeps the first executable whose compiled peak memory (``memory_analysis()``:
    argument + output + temp − alias bytes) is within :data:`NEAR_LEAST_MEMORY` of the smallest
    (:func:`kept_candidate`); below :data:`AUTOTUNE_MIN_BYTES` of parameters it compiles once
    (:func:`estimator_option_candidates`). The candidates compile in rounds (pairs side by side on
    a CPU, one at a time elsewhere: :func:`compile_candidates`); after a round holding one whose
    scratch is at most :data:`NEAR_LEAST_MEMORY` of its peak, the next are not compiled
    (:func:`near_least_memory`). :meth:`after_update` (a held update applied first, in the
    same program) compiles once, with the options chosen for the same arguments without the
    update where those are compiled already (a held step follows a step that compiled them). ``keys`` and ``eps_scale`` are traced: a new iteration
    or ε never recompiles. On a CPU the first call keeps freed host memory for reuse
    (:func:`zeroth.kernels.host_memory.reuse_freed_host_memory`): the program's scratch, whole
    perturbed leaves among it, is allocated at every call, and would otherwise be faulted in page
    by page each time.
    """

    def __init__(
        self,
        loss_fn: Callable[[Any, Any], jax.Array],
        distribution: str,
        *,
        unroll: bool = False,
        perturb_impl: str = "auto",
    ):
        self.loss_fn = loss_fn
        self.distribution = distribution
        self.unroll = unroll
        self.perturb_impl = perturb_impl
        self._cache: dict[tuple, tuple[Any, dict[str, Any]]] = {}
        estimate = functools.partial(
            projected_gradients, loss_fn, distribution=distribution, unroll=unroll, perturb_impl=perturb_impl
        )

        def program(params, batch, keys, eps_scale, enc=None):
            return _encoded(estimate(params, batch, keys, eps_scale), enc)

        program.__name__ = program.__qualname__ = "projected_gradients"  # its name in profiles and dumps

        def projected_gradients_after_update(params, update, batch, keys, eps_scale, enc=None, *, impl):
            params = _apply_held(params, update, distribution, impl)
            return (params, *_encoded(estimate(params, batch, keys, eps_scale), enc))

        self._jitted = jax.jit(program)
        self._jitted_after = jax.jit(projected_gradients_after_update, static_argnames=("impl",), donate_argnums=(0,))

    def _args(self, params, batch, keys, eps_scale, enc=None):
        args = (params, batch, _conform(keys, np.uint32, (-1, 2)), _conform(_eps_scale(eps_scale), np.float32, ()))
        if enc is None:  # the plain program's four arguments (a lowered one is called with them)
            return args
        table, factor = enc
        return (
            *args,
            (_conform(table, np.float32, (256,)), None if factor is None else _conform(factor, np.float32, ())),
        )

    def compiled(self, params, batch, keys, eps_scale, enc=None):
        """The chosen ``jax.stages.Compiled`` for these arguments' signature (compiling if new)."""
        return self._entry(*self._args(params, batch, keys, eps_scale, enc))[0]

    def lowered(self, params, batch, keys, eps_scale):
        """The ``jax.stages.Lowered`` program for these arguments, to compile under other options
        (``zeroth bench zo --zo-option``); the estimator itself keeps its chosen executable."""
        return self._jitted.lower(*self._args(params, batch, keys, eps_scale))

    def chosen_options(self, params, batch, keys, eps_scale) -> dict[str, Any]:
        """The compiler options of the executable chosen for these arguments' signature."""
        return dict(self._entry(*self._args(params, batch, keys, eps_scale))[1])

    def cache_size(self) -> int:
        """Number of compiled signatures."""
        return len(self._cache)

    def _after_args(self, params, update, batch, keys, eps_scale, enc=None):
        keys_u, scales, factor = update  # a deferred step's scales and factor are still on the device
        held = (
            _conform(keys_u, np.uint32, (-1, 2)),
            _conform(scales, np.float32, (-1,)),
            None if factor is None else _conform(factor, np.float32, ()),
        )
        return (params, held, *self._args(None, batch, keys, eps_scale, enc)[1:])

    def compiled_after_update(self, params, update, batch, keys, eps_scale, enc=None):
        """The chosen ``jax.stages.Compiled`` of :meth:`after_update` for these arguments' signature."""
        args = self._after_args(params, update, batch, keys, eps_scale, enc)
        return self._entry(*args, after=_held_impl(params))[0]

    def after_update(self, params, update, batch, keys, eps_scale, enc=None):
        """``(θ', g, ℓ)``: a held update ``(keys u32[K, 2], scales f32[K], _update.decay factor or None)``
        applied to ``params`` (donated), then the projected gradients and losses at ``θ'``, in one
        compiled program; the same bits as :func:`zeroth.replay.replay` (and :func:`weight_decay`)
        followed by this estimator's call (see :class:`Held`). The scales and factor may be
        device arrays (a deferred step's, :class:`Deferred`). With ``enc`` (see :meth:`__call__`),
        ``(θ', g, ℓ, codes, scales, factor)``."""
        args = self._after_args(params, update, batch, keys, eps_scale, enc)
        _reuse_host_memory()
        return self._entry(*args, after=_held_impl(params))[0](*args)

    def _entry(self, *args, after: str | None = None):
        sig = (_autotune._signature(args), after)
        entry = self._cache.get(sig)
        if entry is None:
            lowered = self._jitted.lower(*args) if after is None else self._jitted_after.lower(*args, impl=after)
            candidates = _autotune.estimator_option_candidates(args[0])
            alone = None if after is None else self._cache.get((_autotune._signature((args[0], *args[2:])), None))
            if alone is not None:  # the same forward passes: the options chosen for them alone (one compilation)
                candidates = [alone[1]]
            compiled = _autotune.compile_candidates(lowered, candidates, enough=_autotune.near_least_memory)
            kept = _autotune.kept_candidate([_autotune._peak_bytes(c) for c in compiled])
            entry = self._cache[sig] = (compiled[kept], candidates[kept])
        return entry

    def __call__(self, params, batch, keys, eps_scale, enc=None):
        """``(g, ℓ)``; with ``enc = (table f32[256], _update.decay factor or None)`` also the one-byte
        codes of ``g``, ``scales = table[codes]`` and the factor, computed in the program
        (:func:`_encoded`): ``(g, ℓ, codes, scales, factor)``."""
        args = self._args(params, batch, keys, eps_scale, enc)
        _reuse_host_memory()
        return self._entry(*args)[0](*args)


def _conform(x, dtype, shape):
    """``x`` as ``dtype`` and ``shape`` for a ZO program's call: a device array stays on its device
    (a deferred step's scales), a host value stays a NumPy array (the call transfers it; converting
    it with jnp would dispatch a small program of its own at every step)."""
    if isinstance(x, jax.ShapeDtypeStruct):  # an abstract argument: lowered and compiled, never run
        return x
    return (jnp if isinstance(x, jax.Array) else np).asarray(x, dtype).reshape(shape)


def _encoded(out, enc):
    """Traceable: ``(g, ℓ)`` as they are without ``enc``; with ``enc = (table f32[256], factor or
    None)``, ``(g, ℓ, codes u8[n], scales f32[n], factor)``: the one-byte codes of ``g``
    (:func:`zeroth.codecs.onebyte_codes`, integer operations on its bits: the codes the host's
    encoder gives), ``scales = table[codes]``, and the weight-_update.decay factor. Where some ``g`` is
    not finite the scales are 0 and the factor 1: the update that the host will refuse
    (:class:`Deferred`) changes nothing when the next program applies it before the host knows.

    ``g`` passes an optimization barrier first, so that the codes are those of the ``g`` returned
    (a fusion cannot recompute it with other roundings)."""
    if enc is None:
        return out
    g, losses = out
    g = jax.lax.optimization_barrier(g)
    table, factor = enc
    bits = jax.lax.bitcast_convert_type(g, jnp.uint32)
    ok = jnp.all((bits & jnp.uint32(0x7FFFFFFF)) < jnp.uint32(0x7F800000))
    codes = _codecs.onebyte_codes(bits, jnp)
    scales = jnp.where(ok, table[codes.astype(jnp.int32)], jnp.float32(0))
    if factor is not None:
        factor = jnp.where(ok, factor, jnp.float32(1))
    return g, losses, codes, scales, factor


def _reuse_host_memory() -> None:
    """On a CPU, once: every call of a ZO program allocates its scratch (the perturbed leaves, the
    activations) afresh; kept in the heap, it does not fault in every page again at each step."""
    if not _host_memory.decided() and _rule.default_platform() == "cpu":
        _host_memory.reuse_freed_host_memory()


def _held_impl(params) -> str:
    """The replay implementation of a held update inside the step's program: the fused kernels
    (chosen at lowering for the devices the program runs on), or the jnp rule for parameters split
    across devices, as :func:`zeroth.replay.replay` chooses."""
    return "jnp" if _fused.dispatch.is_sharded(params) else "auto"  # a Flat's leaves are its buffers


def _apply_held(params, update, distribution: str, impl: str):
    """Traceable: the held update ``(keys, scales, _update.decay factor or None)`` of :class:`Held` applied
    to ``params`` (donated), as :func:`zeroth.replay.replay` and :func:`weight_decay` apply it.

    The result passes an optimization barrier before anything reads it: no operation fuses across
    it, so the update and the _update.decay each keep their one rounding (the _update.decay's multiply cannot be
    contracted with a later add into an FMA), as when each runs as its own program."""
    keys, scales, factor = update
    params = _replay.apply_updates(params, keys, scales, distribution=distribution, impl=impl, inplace=True)
    if factor is not None:
        params = jax.lax.optimization_barrier(params)
        params = _update.decay(params, factor)
    return jax.lax.optimization_barrier(params)


@functools.lru_cache(maxsize=64)
def _estimator(loss_fn, distribution: str, backend: str, unroll: bool, perturb_impl: str) -> ProjectedGradientsFn:
    return ProjectedGradientsFn(loss_fn, distribution, unroll=unroll, perturb_impl=perturb_impl)


def projected_gradients_fn(
    loss_fn: Callable[[Any, Any], jax.Array],
    *,
    distribution: str = "binomial",
    unroll: bool = False,
    perturb_impl: str = "auto",
) -> ProjectedGradientsFn:
    """The compiled estimator ``fn(params, batch, keys, eps_scale) -> (g f32[n], ℓ f32[n])``.

    Compiled with the memory-saving options of :func:`compiler_option_candidates` (the first
    within 1/32 of the smallest compiled peak, :func:`kept_candidate`), cached per ``loss_fn``, distribution, backend, ``unroll`` and
    ``perturb_impl`` (:func:`projected_gradients`); it recompiles only for new shapes. Prefer it to wrapping :func:`projected_gradients` in a plain ``jax.jit``,
    whose default options can keep a perturbed copy of the model.

    Example:
      >>> fn = projected_gradients_fn(lambda p, b: jnp.sum(p["w"] ** 2))
    """
    _noise.check_distribution(distribution)
    _perturb_impl(perturb_impl)
    return _estimator(loss_fn, distribution, _rule.default_platform(), bool(unroll), perturb_impl)
