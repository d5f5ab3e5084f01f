"""Zeroth-order (SPSA / MeZO) estimators and steps over zeroth's exact perturbations.

One iteration of Just One Byte on the machines ``M`` (each evaluating its own samples):

1. perturbation ``i`` of machine ``m`` at iteration ``t`` is named by
   ``k = sample_key(run_seed, m, t, i)``; its noise ``z`` is regenerated exactly from ``k``
   (:mod:`zeroth.noise`, unit variance);
2. its projected gradient is the two-point difference (:func:`projected_gradients`)

       g = (L(θ + εz) − L(θ − εz)) / (2ε),

   where ``θ ± εz`` is computed with the exact update rule (``replay(θ, [(k, ±ε)])`` bit for bit)
   and ε is rounded on the host (:func:`round_eps`);
3. ``g`` is encoded (:mod:`zeroth.codecs`) and shared; every machine decodes the same bytes;
4. all machines apply ``θ ← θ − η Σ g·z`` as one canonical replay (:func:`canonical_updates`):
   updates sorted by (machine, sample), coefficients ``c = −η g / N`` (``lr_scaling="linear"``)
   or ``c = −η g / √N`` (``"sqrt"``, the seed's choice), ``N`` the number of projected gradients
   of the iteration across all machines, each ``c`` rounded on the host (:func:`update_coefficients`);
5. optionally, exact decoupled weight decay ``θ ← θ·(1 − ηλ)`` as a separate canonical unit
   (:func:`weight_decay`), after the replay.

Steps 4 and 5 are inside the determinism contract (same log -> same bits on every backend);
step 2 is not required to be (contract point 5: the loss only produces the scalar that is shared).
The loss may be any scalar function, differentiable or not (accuracy, F1, a step function).

Memory. MeZO's point is that a step costs no more memory than inference. Here the parameters
are never copied as a whole: the 2n forward passes of a step are the iterations of one
``lax.map`` over ``(key, ±ε)`` inside one compiled program; each iteration builds its perturbed
model leaf by leaf as the forward pass reads it, and nothing of it outlives the iteration. On CPU
each perturbed leaf is one launch of the native kernel (:mod:`zeroth.kernels.perturb`, one
threefry call per 4 binomial or 64 Rademacher elements, vectorised and threaded), which makes
the perturbations of a step cost a small fraction of its two forward passes; on GPU each
large perturbed leaf is one launch of the flat Triton kernel reading the leaf where it lies
(:func:`zeroth.kernels.perturb.perturb_pallas_segments`), which XLA compiles in a fraction of the
time it takes to fuse the jnp rule's threefry graph leaf by leaf; elsewhere (and on GPU for
leaves under 1 MiB) it is the jnp rule, fused by XLA. XLA
honours this under the options of :func:`compiler_options`: on CPU the memory-optimized
scheduler (the default concurrency-optimized one computes every perturbed leaf up front, a whole
perturbed copy), and, where it would hoist the widened parameters and the noise index arrays out
of the loop (about 2.25 times the largest leaf), while-loop invariant code motion disabled. On
CPU the library fusion then decides the rest, and differently per model (a fused chain of dense
layers needs all its perturbed weights at once; an unfused convolution materializes its
activations), so :func:`projected_gradients_fn` compiles the candidates of
:func:`compiler_option_candidates` and keeps the first whose compiled peak is within 1/32 of
the smallest (:func:`kept_candidate`): the code motion first (it takes the work that does not
depend on the perturbation out of the loop), kept where it holds about no more memory than
without it; the candidates compile in rounds (pairs side by side on CPU, one at a time
elsewhere), and a round with one whose scratch is a small part of its peak ends the search
(:func:`near_least_memory`). Typical
result: the inference peak plus one perturbed copy of the largest leaf (or of the few leaves one
library call reads). Layers stacked on a leading axis and run by ``lax.scan`` would be perturbed
whole before the scan (a whole perturbed copy, and its write and read an extra memory pass per
forward): a model that reads them through :mod:`zeroth.layerwise` (the Llama forward does)
gets layer ``i`` perturbed inside the scan body just before it runs, and embedding rows perturbed
as they are read; the estimator serves these parts while it traces ``loss_fn``, bit-identical to
the same parts of the whole perturbed leaf, which XLA then drops as unused. A caller wrapping
:func:`projected_gradients` in its own ``jax.jit`` should pass ``compiler_options=zo.compiler_options()``. The update is ``replay(..., donate=True)``, in
place; or, with ``mezo_step(..., hold=True)``, held (:class:`Held`) and applied in place by the
next step's program before its forward passes, one compiled call per step with the same bits
(:func:`settle` applies it alone); with the one-byte codec also deferred (``defer=True``,
:class:`Deferred`: the program encodes its projected gradients and looks up the update's scales,
so the host fetches a step while the device runs the next). ``zeroth bench zo`` measures all of
it against a plain forward pass.

The optax bridge: :func:`zo_estimate` is an optax ``GradientTransformation`` turning a
:class:`ZOGrads` (keys and projected gradients, from :func:`zo_value_and_grad`) into the dense
estimate ``Σ g_i z_i / √N``, so it composes with ``optax.chain`` (clipping, schedules, momentum,
Adam); :func:`zo_optax` wraps a chain with an optimizer. Both materialize a dense gradient
estimate and keep optax state: they are OUTSIDE the determinism contract (their state is float
math whose rounding differs between backends) and cost one to three extra copies of the
parameters. Learning-rate schedules on the exact path are host schedules
(:mod:`zeroth.schedules`, ``lr=`` of :func:`mezo_step` and :func:`canonical_updates`).

Example:
  >>> import jax.numpy as jnp, numpy as np
  >>> loss = lambda p, b: jnp.sum((p["w"] - b) ** 2)
  >>> params = {"w": jnp.zeros(4)}
  >>> out = mezo_step(loss, params, jnp.ones(4), run_seed=0, iteration=0, lr=0.1, eps=1e-2,
  ...                 n_perturbations=2)
  >>> out.grads.shape, len(out.payload)
  ((2,), 8)
"""

from __future__ import annotations

import functools
import math
import os
from collections.abc import Callable, Mapping, Sequence
from concurrent import futures as _futures
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax

from zeroth import codecs as _codecs
from zeroth import layerwise as _layerwise
from zeroth import noise as _noise
from zeroth import reference as _ref
from zeroth import replay as _replay
from zeroth import rng as _rng
from zeroth import rule as _rule
from zeroth import schedules as _schedules
from zeroth.kernels import host_memory as _host_memory
from zeroth.kernels import perturb as _fused

__all__ = [
    "SCALINGS",
    "DECAY_FLUSH",
    "AUTOTUNE_MIN_BYTES",
    "BLOCKS_MIN_ELEMENTS",
    "compiler_options",
    "compiler_option_candidates",
    "compile_candidates",
    "side_by_side",
    "compiled_count",
    "NEAR_LEAST_MEMORY",
    "near_least_memory",
    "estimator_option_candidates",
    "kept_candidate",
    "round_eps",
    "projected_gradients",
    "projected_gradients_and_losses",
    "projected_gradients_fn",
    "ProjectedGradientsFn",
    "lr_at",
    "update_coefficients",
    "canonical_updates",
    "decay_factor",
    "decay",
    "weight_decay",
    "StepResult",
    "Held",
    "Deferred",
    "onebyte_scales",
    "settle",
    "mezo_step",
    "dense_gradient",
    "ZOGrads",
    "zo_value_and_grad",
    "zo_estimate",
    "ZOOptaxState",
    "ZOOptax",
    "zo_optax",
]

SCALINGS = ("linear", "sqrt")
# Weight-decay results below this magnitude become +0 (see :func:`decay`): one binade above the
# smallest normal float32, so backends that flush subnormal products and backends that round
# them gradually agree.
DECAY_FLUSH = _ref.DECAY_FLUSH
_DISABLED_PASSES = "while-loop-invariant-code-motion"
_INDIVIDUAL_LIBRARY_OPS = "LIBRARY_FUSION_TYPE_INDIVIDUAL_DOT,LIBRARY_FUSION_TYPE_INDIVIDUAL_CONVOLUTION"
# Parameters smaller than this are compiled once (base options): choosing among compilations only
# pays where the parameters are big enough for the memory to matter.
AUTOTUNE_MIN_BYTES = 1 << 20


# --------------------------------------------------------------------------- estimator


def _platform(backend: str | None) -> str:
    """The platform family of ``backend`` (default: where uncommitted arrays go)."""
    return _rule.default_platform() if backend is None else _rule.platform_name(backend)


def compiler_options(backend: str | None = None) -> dict[str, Any]:
    """The base XLA options under which a ZO step keeps no perturbed copy of the model.

    * ``xla_disable_hlo_passes=while-loop-invariant-code-motion`` (every backend): the widened
      parameters and the noise index arrays stay inside the loop over perturbations instead of
      being hoisted out of it as whole-model temporaries (about 2.25 times the largest leaf);
    * CPU: ``xla_cpu_scheduler_type=CPU_SCHEDULER_TYPE_MEMORY_OPTIMIZED``: each perturbed leaf is
      computed just before its use (the default concurrency-optimized scheduler computes them all
      first, a whole perturbed copy).

    :func:`compiler_option_candidates` puts the same with the code motion first (kept where it
    holds about no more memory) and adds the CPU library-fusion variants, among which
    :func:`projected_gradients_fn` picks by compiled peak (:func:`kept_candidate`). A caller
    wrapping :func:`projected_gradients` in its own ``jax.jit`` gets these, the safe ones.

    Args:
      backend: ``"cpu"``, ``"gpu"``, ``"tpu"``...; default where uncommitted arrays go (:func:`zeroth.rule.default_platform`).

    Returns:
      A dict for ``jax.jit(..., compiler_options=...)`` or ``Lowered.compile(...)``.

    Example:
      >>> compiler_options("cpu")["xla_cpu_scheduler_type"]
      'CPU_SCHEDULER_TYPE_MEMORY_OPTIMIZED'
    """
    backend = _platform(backend)
    opts: dict[str, Any] = {"xla_disable_hlo_passes": _DISABLED_PASSES}
    if backend == "cpu":
        opts["xla_cpu_scheduler_type"] = "CPU_SCHEDULER_TYPE_MEMORY_OPTIMIZED"
    return opts


def compiler_option_candidates(backend: str | None = None) -> list[dict[str, Any]]:
    """The option sets :func:`projected_gradients_fn` compiles and chooses among (by compiled
    peak, :func:`kept_candidate`), in the order they compile (:func:`compile_candidates`: pairs
    side by side on a CPU, one after the other elsewhere, until one holds near the least memory,
    :func:`near_least_memory`).

    Loop-invariant code motion comes first wherever it runs: it takes work that does not depend
    on the perturbation out of the loop over evaluations, and is kept wherever its compiled peak
    is within 1/32 of the least, or where its scratch is small beside its peak and the next
    candidates are not compiled. Where it hoists whole-model temporaries (widened bfloat16 leaves, the jnp rule's
    noise indices) the next candidates, without it, compile, and one of these is kept.

    * CPU: the motion, then the base options (:func:`compiler_options`), each with the YNNPACK
      library fusion's default and with ``xla_cpu_experimental_ynn_fusion_type`` limited to
      individual dots and convolutions. The library fusion decides the memory of a forward pass
      more than anything else, and no single setting is best for every model: its default fuses a
      convolution with its activation and pooling (streaming tiles, no activation buffer) but can
      also fuse a chain of dense layers into one call, whose operands are then every perturbed
      weight at once; limiting it to individual dots and convolutions does the opposite. On a
      2-core AMD EPYC (jax 0.10.2, `zeroth bench zo --zo-option xla_disable_hlo_passes=`) the
      motion made SmolLM2-135M's projected gradients 0.95-0.98 times as long (stacked layers;
      0.95 with them held to AVX2) and 0.946 unrolled, for 1.75 MiB more of 523 (its scratch
      2.2 % of its peak: kept alone), the CNN's 0.953; MiniLM's peak grew 1.8 % (scratch 8.9 %:
      the base options compile too, and the motion, within 1/32 of their peak, is kept).
    * GPU: the motion, then the base options. On an NVIDIA H100 (transformer at the default
      width, batch 256) the motion made the projected gradients 0.69 times as long, 1.31 against
      1.89 ms, with the same peak and bits.
    * Other backends: the base options alone.

    Below :data:`AUTOTUNE_MIN_BYTES` of parameters one is compiled alone
    (:func:`estimator_option_candidates`).

    Example:
      >>> len(compiler_option_candidates("cpu")), len(compiler_option_candidates("gpu"))
      (4, 2)
    """
    base = compiler_options(backend)
    backend = _platform(backend)
    motion = dict(base, xla_disable_hlo_passes="")
    if backend == "gpu":
        return [motion, base]
    if backend != "cpu":
        return [base]
    individual = {"xla_cpu_experimental_ynn_fusion_type": _INDIVIDUAL_LIBRARY_OPS}
    return [motion, dict(motion, **individual), base, dict(base, **individual)]


def estimator_option_candidates(params, backend: str | None = None) -> list[dict[str, Any]]:
    """The option sets :func:`projected_gradients_fn` may compile for ``params`` (a pytree, a
    :class:`zeroth.replay.Flat`, or their abstract ``jax.ShapeDtypeStruct`` values): those of
    :func:`compiler_option_candidates`; below :data:`AUTOTUNE_MIN_BYTES` of parameters only the
    first, or on a CPU the base options (:func:`compiler_options`). It compiles them in rounds
    until one holds near the least memory (:func:`compile_candidates`) and keeps the first whose
    compiled peak is within 1/32 of the smallest (:func:`kept_candidate`).

    Example:
      >>> len(estimator_option_candidates({"w": jnp.zeros(8)}, "cpu"))
      1
    """
    candidates = compiler_option_candidates(backend)
    param_bytes = sum(int(np.size(x)) * jnp.dtype(jnp.result_type(x)).itemsize for x in jax.tree_util.tree_leaves(params))
    if param_bytes >= AUTOTUNE_MIN_BYTES:
        return candidates
    if _platform(backend) == "cpu":
        # the base options: there the motion takes the jnp rule's per-leaf work out of the loop as
        # ops of their own (12 leaves: 65 ops per call instead of at most 40), and no later
        # candidate compiles to catch what it may hoist
        return [compiler_options(backend)]
    return candidates[:1]


def compile_candidates(lowered, candidates: Sequence[Mapping[str, Any]], backend: str | None = None, *,
                       enough: Callable[[Any], bool] | None = None) -> list:
    """``[lowered.compile(options) for options in candidates]``, in rounds of
    :func:`side_by_side` candidates (``backend`` default: :func:`zeroth.rule.default_platform`):
    on a CPU pairs compile side by side in threads (XLA compiles without holding Python's lock),
    so the estimator's first call waits for the slower of two instead of their sum (SmolLM2-135M
    unrolled on a 2-core CPU: the projected gradients and the update compiled in 5.8-5.9 s
    instead of 6.7-7.5); elsewhere one after the other: a GPU compiler times candidate kernels on
    the device (autotuning), and two compilations at once would time each other's. Each
    executable is the one a compilation alone gives, in order.

    ``enough(executable) -> bool``: after each round, if it accepts one compiled in that round,
    the later candidates are not compiled (see :func:`near_least_memory`; :func:`compiled_count`).

    Example:
      >>> lowered = jax.jit(lambda x: x + 1).lower(jnp.zeros(3))
      >>> [c(jnp.zeros(3)).tolist() for c in compile_candidates(lowered, [{}, {}])]
      [[1.0, 1.0, 1.0], [1.0, 1.0, 1.0]]
      >>> len(compile_candidates(lowered, [{}, {}], backend="gpu", enough=lambda c: True))
      1
    """
    size = side_by_side(backend)
    compiled: list = []
    for start in range(0, len(candidates), size):
        batch = [dict(o) for o in candidates[start:start + size]]
        if len(batch) == 1:
            new = [lowered.compile(batch[0])]
        else:
            with _futures.ThreadPoolExecutor(len(batch), thread_name_prefix="zeroth-compile") as pool:
                new = list(pool.map(lowered.compile, batch))
        compiled += new
        if enough is not None and any([enough(c) for c in new]):
            break
    return compiled


def side_by_side(backend: str | None = None) -> int:
    """How many of the estimator's candidates :func:`compile_candidates` compiles at once on
    ``backend`` (default: :func:`zeroth.rule.default_platform`): 2 on a CPU, 1 elsewhere.

    Example:
      >>> side_by_side("cpu"), side_by_side("gpu")
      (2, 1)
    """
    return 2 if _platform(backend) == "cpu" else 1


def compiled_count(accepted: Sequence[bool], backend: str | None = None) -> int:
    """How many of the candidates :func:`compile_candidates` compiles, where ``accepted[i]`` is
    whether ``enough`` accepts candidate ``i``: up to the end of the first round holding an
    accepted one (rounds of :func:`side_by_side`), else all.

    Example:
      >>> compiled_count([False, True, False, False], "cpu"), compiled_count([False, True], "gpu")
      (2, 2)
      >>> compiled_count([False, False, True, False], "cpu"), compiled_count([False, False], "gpu")
      (4, 2)
    """
    size = side_by_side(backend)
    for end in range(size, len(accepted) + size, size):
        if any(accepted[:end]):
            return min(end, len(accepted))
    return len(accepted)


# A compiled program whose scratch is at most this fraction of its peak is within that fraction of
# the least memory any program with its arguments and results can hold (temp >= 0).
NEAR_LEAST_MEMORY = 1 / 32


def near_least_memory(compiled) -> bool:
    """Whether ``compiled`` holds so little scratch (``temp`` at most :data:`NEAR_LEAST_MEMORY` of
    its peak) that another compilation of the same program could save at most that much: the
    estimator's candidates after its round are then not compiled (:func:`compile_candidates`;
    compiled for an H100 on a 2-core CPU, without the device, each
    compilation of SmolLM2-135M unrolled's projected gradients took 17.1-17.2 s, and both
    candidates held the same 529.23 MiB, 16.09 of it scratch). Where code motion hoists widened leaves and
    noise out of the loop (whole-model temporaries, :func:`compiler_options`), the scratch is
    larger than that unless the largest leaf is small beside the model, and the next candidate is
    compiled.

    Example:
      >>> small = jax.jit(lambda w, x: jnp.tanh(x @ w).sum()).lower(jnp.ones((256, 256)), jnp.ones((2, 256))).compile()
      >>> near_least_memory(small)
      True
    """
    m = compiled_memory(compiled)
    return m["temp"] <= NEAR_LEAST_MEMORY * m["peak"]


def kept_candidate(peaks: list[int], within: float = NEAR_LEAST_MEMORY) -> int:
    """The index of the program the estimator keeps among its candidates' compiled peaks
    (:func:`estimator_option_candidates`, in their order): the first whose peak is at most
    ``within`` (a fraction, default :data:`NEAR_LEAST_MEMORY`) above the smallest, so that a
    faster candidate earlier in the list (code motion) is not given up for a few bytes (the MLP
    of ``zeroth bench zo``: 2,312 bytes of 14.55 MB); ``within=0``: the smallest, the first of equal ones.

    Example:
      >>> kept_candidate([300, 200, 200]), kept_candidate([201, 200]), kept_candidate([201, 200], within=0)
      (1, 0, 1)
    """
    least = min(peaks)
    return next(i for i, p in enumerate(peaks) if p <= least * (1 + within))


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


def _check_eps_scale(eps_scale) -> None:
    if isinstance(eps_scale, (jax.core.Tracer, jax.ShapeDtypeStruct)):  # traced, or abstract (compiled, never run)
        return
    e = np.asarray(eps_scale)
    if e.shape != ():
        raise ValueError(f"eps_scale must be a scalar, got shape {e.shape}")
    v = float(e)
    if not (math.isfinite(v) and v > 0.0):
        raise ValueError(f"eps_scale must be a finite number > 0, got {v!r}")
    if float(np.float32(v)) != v or _replay.round_coefficient(v) != v:
        raise ValueError(
            f"eps_scale={v!r} is not host-rounded; pass zeroth.zo.round_eps(eps) "
            f"(= {float(round_eps(v))!r}) so that θ ± εz follows the exact update rule"
        )


def projected_gradients_and_losses(
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
    """Two-point projected gradients and the mean loss of each pair (traceable).

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
      eps_scale: ``f32[]`` host-rounded ε (:func:`round_eps`); may be traced.
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
    _check_eps_scale(eps_scale)
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
            perturbed = _fused.apply_updates(theta, key[None], s[None], distribution=distribution, impl="native",
                                             platform="cpu", per_leaf=True)
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
    """The ``perturb_impl`` of :func:`projected_gradients_and_losses` for the platform it is traced
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
    perturbed = _fused.apply_updates(leaves, key[None], scale[None], distribution=distribution, impl="jnp",
                                     per_leaf=True, leaf_keys=table)
    unit = scale / scale
    return jax.tree_util.tree_map(lambda x: x / unit.astype(x.dtype), perturbed)


def _pallas_leaves(theta, key, scale, table, distribution: str, sources=None):
    """``theta`` perturbed by ``scale · z``: each leaf of at least
    :data:`zeroth.kernels.perturb.APART_MIN_BYTES` by a launch of its own of
    :func:`zeroth.kernels.perturb.perturb_pallas_segments` (row ``i`` of ``table``, the leaves'
    keys ``u32[L, 1, 2]``), read where it lies (``sources[i] = (buffer, offset)`` in a
    :class:`zeroth.replay.Flat` buffer, else the leaf itself); the smaller leaves by the jnp rule
    (:func:`_jnp_leaves`), which XLA fuses into few kernels, some into their consumers. Compiled
    for an H100, the transformer's projected gradients ran 228 operations per call at width 4096
    with the jnp rule, 236 so, 320 with a launch for every leaf and 264 with a launch per group
    of small vectors (176, 176, 304 and 204 at the default width). Off a GPU: interpret mode."""
    leaves, treedef = jax.tree_util.tree_flatten(theta)
    interpret = _rule.default_platform() != "gpu"
    out: list[Any] = [None] * len(leaves)
    small = [i for i, x in enumerate(leaves) if x.size * x.dtype.itemsize < _fused.APART_MIN_BYTES]
    if small:
        rows = table[np.asarray(small)] if len(small) < len(leaves) else table
        for i, x in zip(small, _jnp_leaves([leaves[i] for i in small], key, scale, rows, distribution), strict=True):
            out[i] = x
    for i, leaf in enumerate(leaves):
        if out[i] is None:
            buffer, base = (leaf.reshape(-1), 0) if sources is None else sources[i]
            out[i] = _fused.perturb_pallas_segments(
                buffer, table, scale[None], ((base, leaf.size, i),), distribution=distribution, interpret=interpret,
                platform="cpu" if interpret else None).reshape(leaf.shape)
    return jax.tree_util.tree_unflatten(treedef, out)


BLOCKS_MIN_ELEMENTS = _layerwise.BLOCKS << 18
"""The smallest dense kernel a ZO step on a CPU perturbs a block of rows at a time
(:func:`zeroth.layerwise.dot_general`): one whose blocks hold at least 2^18 elements each, the
work above which the native CPU kernel runs on threads. Measured on a 2-core CPU with ``zeroth
bench zo --model mlp --rows step`` (ZO step over two forwards, best; memory over inference):
kernels of 1M elements in blocks held 1.165 instead of 1.405 but took 1.5-1.8 instead of 1.2-1.3,
so the default width keeps them whole; at ``--width 2048`` (its 4.2M-element kernel in blocks)
1.158 instead of 1.593 in 1.28 instead of 1.26, and at ``--width 4096`` (3.2M and 16.8M) 1.147
instead of 1.751 in 1.25 instead of 1.39."""


def _perturbed_parts(theta, perturbed, table, scale, distribution: str, native: bool,
                     sources=None) -> _layerwise.Provider:
    """The :class:`zeroth.layerwise.Provider` of one perturbed model ``perturbed = θ + s·z``.

    It recognises the leaves of ``perturbed`` by identity and serves layer ``i`` of a stacked leaf
    (:func:`zeroth.kernels.perturb.perturb_slice` of θ's leaf at ``i · m``, the native kernel
    reading the slice in place on CPU), rows of a table (:func:`zeroth.kernels.perturb.perturb_rows`)
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
    known = {id(p): (p, t, table[i], src) for i, (t, p, src) in enumerate(zip(t_leaves, p_leaves, sources, strict=True))}
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
            z = _fused.perturb_slice(source, lk, scales, start, shape, distribution=distribution, impl=impl,
                                     base=base, size=t.size)
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
        return materialize(_fused.perturb_rows(t, lk, scales, ids, distribution=distribution), t)

    # Blocks were measured on a CPU only; a GPU runs each block's noise and product as launches
    # of their own (compiled for an H100, the MLP at width 4096 ran 15.3 operations per forward
    # instead of 2.7, for 1.096 of inference's memory instead of 1.718), untimed.
    return _layerwise.Provider(layer, rows, blocks if _rule.default_platform() == "cpu" else None)


def projected_gradients(
    loss_fn: Callable[[Any, Any], jax.Array],
    params: Any,
    batch: Any,
    keys,
    eps_scale,
    *,
    distribution: str = "binomial",
) -> jax.Array:
    """``g_i = (L(θ + εz_i) − L(θ − εz_i)) / (2ε)`` for each key: ``f32[n]`` (traceable).

    See :func:`projected_gradients_and_losses` for the arguments. Jit it with
    ``compiler_options=compiler_options()`` (or use :func:`projected_gradients_fn`) to keep the
    memory of a step at that of inference.

    Example:
      >>> from zeroth.rng import sample_keys
      >>> g = projected_gradients(lambda p, b: jnp.sum(p["w"] ** 2), {"w": jnp.ones(3)}, None,
      ...                         sample_keys(0, [(0, 0, 0)]), round_eps(1e-2))
      >>> g.shape
      (1,)
    """
    return projected_gradients_and_losses(loss_fn, params, batch, keys, eps_scale, distribution=distribution)[0]


def _signature(tree) -> tuple:
    leaves, treedef = jax.tree_util.tree_flatten(tree)
    return treedef, tuple(_leaf_signature(x) for x in leaves)


def _leaf_signature(x) -> tuple:
    """``(shape, dtype, weak_type)`` as jit sees the leaf; a jax array's own attributes, or a NumPy
    array's with its dtype canonicalized (what ``jnp.result_type`` would compute for them, at a
    fraction of the host time: a peer's batches are NumPy arrays)."""
    if isinstance(x, jax.Array):
        return tuple(x.shape), x.dtype, bool(getattr(x, "weak_type", False))
    if isinstance(x, np.ndarray):
        return x.shape, jax.dtypes.canonicalize_dtype(x.dtype), False
    return tuple(np.shape(x)), jnp.result_type(x), bool(getattr(x, "weak_type", False))


def compiled_memory(compiled) -> dict[str, int]:
    """XLA's memory accounting of a compiled program, in bytes: ``argument``, ``output``, ``temp``,
    ``alias`` and ``peak = argument + output + temp - alias`` (all 0 where the backend reports none)."""
    m = compiled.memory_analysis()
    if m is None:
        return dict.fromkeys(("argument", "output", "temp", "alias", "peak"), 0)
    parts = {
        "argument": int(m.argument_size_in_bytes),
        "output": int(m.output_size_in_bytes),
        "temp": int(m.temp_size_in_bytes),
        "alias": int(m.alias_size_in_bytes),
    }
    return {**parts, "peak": parts["argument"] + parts["output"] + parts["temp"] - parts["alias"]}


def _peak_bytes(compiled) -> int:
    return compiled_memory(compiled)["peak"]


class ProjectedGradientsFn:
    """``fn(params, batch, keys, eps_scale) -> (g f32[n], ℓ f32[n])``, compiled per input signature
    (``unroll``: the forward passes as straight-line code, :func:`projected_gradients_and_losses`).

    ``params`` is the pytree ``loss_fn`` takes, or its :class:`zeroth.replay.Flat`
    (:func:`zeroth.replay.flatten`): the program then takes a buffer per dtype (and one per large
    leaf) instead of an array per leaf and unflattens them inside (slices that XLA fuses into their
    uses; a large leaf, which a scan would need whole, is its buffer reshaped), with the same
    leaves, paths, noise and bits as the tree. A call's host cost grows with the number of arrays
    it passes, and most with those of an accelerator.

    For each new signature (tree structure, shapes and dtypes) it compiles
    :func:`projected_gradients_and_losses` under each of :func:`compiler_option_candidates` and
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
    by page each time (SmolLM2-135M: 448 against 222 ms of CPU time to perturb θ twice).
    """

    def __init__(self, loss_fn: Callable[[Any, Any], jax.Array], distribution: str, *, unroll: bool = False,
                 perturb_impl: str = "auto"):
        self.loss_fn = loss_fn
        self.distribution = distribution
        self.unroll = unroll
        self.perturb_impl = perturb_impl
        self._cache: dict[tuple, tuple[Any, dict[str, Any]]] = {}
        estimate = functools.partial(projected_gradients_and_losses, loss_fn, distribution=distribution, unroll=unroll,
                                     perturb_impl=perturb_impl)

        def projected_gradients(params, batch, keys, eps_scale, enc=None):  # its program's name in profiles and dumps
            return _encoded(estimate(params, batch, keys, eps_scale), enc)

        def projected_gradients_after_update(params, update, batch, keys, eps_scale, enc=None, *, impl):
            params = _apply_held(params, update, distribution, impl)
            return (params, *_encoded(estimate(params, batch, keys, eps_scale), enc))

        self._jitted = jax.jit(projected_gradients)
        self._jitted_after = jax.jit(projected_gradients_after_update, static_argnames=("impl",), donate_argnums=(0,))

    def _args(self, params, batch, keys, eps_scale, enc=None):
        _check_eps_scale(eps_scale)
        args = (params, batch, _conform(keys, np.uint32, (-1, 2)), _conform(eps_scale, np.float32, ()))
        if enc is None:  # the plain program's four arguments (a lowered one is called with them)
            return args
        table, factor = enc
        return (*args, (_conform(table, np.float32, (256,)), None if factor is None else _conform(factor, np.float32, ())))

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
        held = (_conform(keys_u, np.uint32, (-1, 2)), _conform(scales, np.float32, (-1,)),
                None if factor is None else _conform(factor, np.float32, ()))
        return (params, held, *self._args(None, batch, keys, eps_scale, enc)[1:])

    def compiled_after_update(self, params, update, batch, keys, eps_scale, enc=None):
        """The chosen ``jax.stages.Compiled`` of :meth:`after_update` for these arguments' signature."""
        args = self._after_args(params, update, batch, keys, eps_scale, enc)
        return self._entry(*args, after=_held_impl(params))[0]

    def after_update(self, params, update, batch, keys, eps_scale, enc=None):
        """``(θ', g, ℓ)``: a held update ``(keys u32[K, 2], scales f32[K], decay factor or None)``
        applied to ``params`` (donated), then the projected gradients and losses at ``θ'``, in one
        compiled program; the same bits as :func:`zeroth.replay.replay` (and :func:`weight_decay`)
        followed by this estimator's call (see :class:`Held`). The scales and factor may be
        device arrays (a deferred step's, :class:`Deferred`). With ``enc`` (see :meth:`__call__`),
        ``(θ', g, ℓ, codes, scales, factor)``."""
        args = self._after_args(params, update, batch, keys, eps_scale, enc)
        _reuse_host_memory()
        return self._entry(*args, after=_held_impl(params))[0](*args)

    def _entry(self, *args, after: str | None = None):
        sig = (_signature(args), after)
        entry = self._cache.get(sig)
        if entry is None:
            lowered = self._jitted.lower(*args) if after is None else self._jitted_after.lower(*args, impl=after)
            candidates = estimator_option_candidates(args[0])
            alone = None if after is None else self._cache.get((_signature((args[0], *args[2:])), None))
            if alone is not None:  # the same forward passes: the options chosen for them alone (one compilation)
                candidates = [alone[1]]
            compiled = compile_candidates(lowered, candidates, enough=near_least_memory)
            kept = kept_candidate([_peak_bytes(c) for c in compiled])
            entry = self._cache[sig] = (compiled[kept], candidates[kept])
        return entry

    def __call__(self, params, batch, keys, eps_scale, enc=None):
        """``(g, ℓ)``; with ``enc = (table f32[256], decay factor or None)`` also the one-byte
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
    encoder gives), ``scales = table[codes]``, and the weight-decay factor. Where some ``g`` is
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
    return "jnp" if _fused.is_sharded(params) else "auto"  # a Flat's leaves are its buffers


def _apply_held(params, update, distribution: str, impl: str):
    """Traceable: the held update ``(keys, scales, decay factor or None)`` of :class:`Held` applied
    to ``params`` (donated), as :func:`zeroth.replay.replay` and :func:`weight_decay` apply it.

    The result passes an optimization barrier before anything reads it: no operation fuses across
    it, so the update and the decay each keep their one rounding (the decay's multiply cannot be
    contracted with a later add into an FMA), as when each runs as its own program."""
    keys, scales, factor = update
    params = _replay.apply_updates(params, keys, scales, distribution=distribution, impl=impl, inplace=True)
    if factor is not None:
        params = jax.lax.optimization_barrier(params)
        params = decay(params, factor)
    return jax.lax.optimization_barrier(params)


@functools.lru_cache(maxsize=64)
def _estimator(loss_fn, distribution: str, backend: str, unroll: bool, perturb_impl: str) -> ProjectedGradientsFn:
    return ProjectedGradientsFn(loss_fn, distribution, unroll=unroll, perturb_impl=perturb_impl)


def projected_gradients_fn(loss_fn: Callable[[Any, Any], jax.Array], *, distribution: str = "binomial",
                           unroll: bool = False, perturb_impl: str = "auto") -> ProjectedGradientsFn:
    """The compiled estimator ``fn(params, batch, keys, eps_scale) -> (g f32[n], ℓ f32[n])``.

    Compiled with the memory-saving options of :func:`compiler_option_candidates` (the first
    within 1/32 of the smallest compiled peak, :func:`kept_candidate`), cached per ``loss_fn``, distribution, backend, ``unroll`` and
    ``perturb_impl`` (:func:`projected_gradients_and_losses`); it recompiles only for new shapes. Prefer it to wrapping :func:`projected_gradients` in a plain ``jax.jit``,
    whose default options can keep a perturbed copy of the model.

    Example:
      >>> fn = projected_gradients_fn(lambda p, b: jnp.sum(p["w"] ** 2))
    """
    _noise.check_distribution(distribution)
    _perturb_impl(perturb_impl)
    return _estimator(loss_fn, distribution, _rule.default_platform(), bool(unroll), perturb_impl)


# --------------------------------------------------------------------------- coefficients


def _check_scaling(scaling: str) -> str:
    if scaling not in SCALINGS:
        raise ValueError(f"unknown lr_scaling {scaling!r}; expected one of {list(SCALINGS)}")
    return scaling


def lr_at(lr: float | _schedules.Schedule, iteration: int) -> float:
    """The learning rate η_t of ``iteration`` on the exact path: ``lr`` itself, or a host schedule's value.

    Args:
      lr: a number, or a :class:`zeroth.schedules.Schedule` (evaluated on the host in float64).
      iteration: t, the step whose update it scales.

    Raises:
      TypeError: ``lr`` is another callable (an optax schedule is ``jnp`` math on a device, outside
        the determinism contract: use :mod:`zeroth.schedules`, or the optax transforms below).

    Example:
      >>> from zeroth import schedules
      >>> lr_at(0.1, 7), lr_at(schedules.linear(0.1, decay_steps=10), 5)
      (0.1, 0.05)
    """
    if isinstance(lr, _schedules.Schedule):
        return lr(iteration)
    if callable(lr):
        raise TypeError(
            f"lr is {lr!r}, a callable that is not a zeroth.schedules.Schedule: the exact update takes a number "
            f"or a host schedule (zeroth.schedules); optax schedules belong in zo_estimate's optax chains"
        )
    return float(lr)


def update_coefficients(grads, lr: float, n_total: int, scaling: str = "sqrt") -> list[float]:
    """Host-rounded update coefficients ``c_i = round(−η g_i / N)`` or ``round(−η g_i / √N)``.

    Computed in float64 on the host, ``(−η · g_i) / N`` or ``(−η · g_i) / sqrt(N)`` (each IEEE
    operation correctly rounded, so identical on every host), then rounded once by
    :func:`zeroth.replay.round_coefficient` (20 significant bits). ``replay`` rounds again, which
    is the identity on these values.

    Args:
      grads: the *decoded* projected gradients, ``f32[n]`` (any real sequence).
      lr: the learning rate η (finite).
      n_total: N, the number of projected gradients of the iteration across all machines (>= n).
      scaling: ``"sqrt"`` (η/√N, the seed's choice) or ``"linear"`` (η/N).

    Returns:
      ``list[float]`` of n coefficients.

    Raises:
      ValueError: a non-finite gradient or lr, N < n or N < 1, an unknown scaling.

    Example:
      >>> update_coefficients([2.0, -1.0], 0.5, 4, "sqrt")
      [-0.5, 0.25]
    """
    _check_scaling(scaling)
    # Python floats (float64): the coefficients are computed one by one below anyway, and a step's
    # few values cost less so than NumPy's fixed cost per operation
    if type(grads) is np.ndarray and grads.ndim == 1 and grads.dtype in (np.float32, np.float64):
        g = grads.tolist()
    else:
        g = np.asarray(grads, dtype=np.float64).reshape(-1).tolist()
    lr = float(lr)
    if not math.isfinite(lr):
        raise ValueError(f"lr must be finite, got {lr!r}")
    if isinstance(n_total, bool) or not isinstance(n_total, (int, np.integer)) or n_total < max(1, len(g)):
        raise ValueError(f"n_total must be an integer >= max(1, len(grads)) = {max(1, len(g))}, got {n_total!r}")
    bad = next((i for i, gi in enumerate(g) if not math.isfinite(gi)), None)
    if bad is not None:
        raise ValueError(f"projected gradient {bad} is {g[bad]!r}; only finite values can be applied")
    denom = _denominator(n_total, scaling)
    return [_replay.round_coefficient((-lr * float(gi)) / denom) for gi in g]


def _denominator(n_total: int, scaling: str) -> float:
    """N or √N in float64: what :func:`update_coefficients` divides ``−η g`` by."""
    return float(n_total) if scaling == "linear" else math.sqrt(float(n_total))


def canonical_updates(
    run_seed: int,
    iteration: int,
    grads_by_machine: Mapping[int, Sequence[float]],
    lr: float | _schedules.Schedule,
    scaling: str = "sqrt",
) -> list[tuple[np.ndarray, float]]:
    """The iteration's updates in canonical order: machine id ascending, then sample index.

    Every machine that holds the same ``grads_by_machine`` (decoded values) builds the same list,
    whatever the order of the mapping; ``replay(params, updates)`` then gives the same bits.

    Args:
      run_seed: the run's seed.
      iteration: the iteration t.
      grads_by_machine: ``{machine_id: [g_0, g_1, ...]}``, sample ``i`` of machine ``m`` having key
        ``sample_key(run_seed, m, iteration, i)``.
      lr: the learning rate η, or a host schedule (:func:`lr_at`: η_t of ``iteration``).
      scaling: ``"sqrt"`` or ``"linear"``; N is the total number of gradients in the mapping.

    Returns:
      ``[(u32[2] key, float coefficient), ...]`` ready for :func:`zeroth.replay.replay`.

    Example:
      >>> ups = canonical_updates(0, 5, {2: [1.0], 0: [0.5, -0.5]}, lr=0.1, scaling="linear")
      >>> [round(c, 6) for _, c in ups]
      [-0.016667, 0.016667, -0.033333]
    """
    _check_scaling(scaling)
    lr = lr_at(lr, iteration)
    machines = list(grads_by_machine)
    for m in machines:
        if isinstance(m, bool) or not isinstance(m, (int, np.integer)):
            raise ValueError(f"machine ids must be integers, got {m!r} ({type(m).__name__})")
    order = sorted(int(m) for m in machines)
    if len(set(order)) != len(order):
        raise ValueError(f"duplicate machine ids in {machines}")
    per = {int(m): np.asarray(grads_by_machine[m], dtype=np.float64).reshape(-1) for m in machines}
    n_total = sum(v.size for v in per.values())
    if n_total == 0:
        return []
    coeffs = [(m, i, c) for m in order if per[m].size for i, c in enumerate(update_coefficients(per[m], lr, n_total, scaling))]
    # every key in one call (each (machine, iteration) prefix folded once): a peer builds this list
    # at every iteration; derived one at a time, the 48 keys of 3 peers of 16 took 8 ms
    keys = _rng.sample_keys(run_seed, [(m, iteration, i) for m, i, _ in coeffs])
    return [(keys[j], c) for j, (_, _, c) in enumerate(coeffs)]


# --------------------------------------------------------------------------- weight decay


def decay_factor(lr: float, weight_decay: float) -> np.float32:
    """``d = float32(1 − η·λ)``, computed in float64 on the host and rounded once to float32
    (:func:`zeroth.reference.decay_factor`).

    Raises:
      ValueError: non-finite values, or ``η·λ`` outside ``[0, 1)`` (d must lie in ``(0, 1]``).

    Example:
      >>> float(decay_factor(0.5, 0.5))
      0.75
    """
    return _ref.decay_factor(lr, weight_decay)


def decay(params: Any, factor) -> Any:
    """Traceable core of exact weight decay: ``p ← cast(flushd(flush(p32) · d))`` per leaf.

    ``flushd`` maps results with ``|x| < 2**-125`` (:data:`DECAY_FLUSH`) and -0 to +0 and NaN to
    the canonical NaN. Why this is exact across backends when it runs as its own program
    (:func:`weight_decay`): an IEEE float32 multiply is correctly rounded everywhere; the program
    has no add after the multiply, so no backend can contract it into an FMA; results in or near
    the subnormal range, where flush-to-zero hardware and gradual underflow disagree, are all
    below 2**-125 and become 0 on every backend (any product whose exact value is >= 2**-125
    rounds to the same normal number everywhere).

    Args:
      params: pytree of f32 / bf16 / f16 arrays.
      factor: ``f32[]`` from :func:`decay_factor` (may be traced).
    """
    d = jnp.asarray(factor, jnp.float32).reshape(())

    def leaf_fn(leaf):
        leaf = jnp.asarray(leaf)
        _rule.check_dtype(leaf.dtype, "a leaf given to weight decay")
        # the flushes in halves, as the replay kernels apply them (zeroth.rule): the zeros on
        # load, DECAY_FLUSH's threshold (which takes -0 and every subnormal with it), the NaNs on store
        x = _rule.flush_tiny(leaf.astype(jnp.float32)) * d
        x = jnp.where(jnp.abs(x) < DECAY_FLUSH, jnp.float32(0.0), x)
        return _rule.cast_flushed(x, leaf.dtype)

    return jax.tree_util.tree_map(leaf_fn, params)


_decay_copy = jax.jit(decay)
_decay_donated = jax.jit(decay, donate_argnums=(0,))


def weight_decay(params: Any, lr: float, weight_decay: float, *, donate: bool = False) -> Any:
    """Exact decoupled weight decay ``θ ← θ·(1 − ηλ)``, one canonical unit (its own program).

    In an iteration it comes after the replay of the iteration's updates. A no-op copy when
    ``weight_decay == 0``. See :func:`decay` for why every backend gives the same bits; the NumPy
    specification is :func:`zeroth.reference.decay_leaf`.

    Args:
      params: pytree of f32 / bf16 / f16 arrays.
      lr: learning rate η; weight_decay: λ (``η·λ`` in ``[0, 1)``).
      donate: reuse the input buffers (the input must not be used afterwards).

    Example:
      >>> weight_decay({"w": jnp.ones(2)}, 0.5, 0.5)["w"]
      Array([0.75, 0.75], dtype=float32)
    """
    return _weight_decay(params, lr, weight_decay, donate)


def _weight_decay(params, lr, wd, donate):
    d = decay_factor(lr, wd)
    return (_decay_donated if donate else _decay_copy)(params, d)


# --------------------------------------------------------------------------- one machine


class StepResult(NamedTuple):
    """The outcome of :func:`mezo_step`."""

    params: Any  # the updated parameters (same structure and dtypes), or a Held (mezo_step(..., hold=True))
    grads: np.ndarray  # f32[n]: the decoded projected gradients, exactly what was applied
    payload: bytes  # codec.encode(raw gradients): what this machine would send to its peers
    loss: float  # mean over the n pairs of (L(θ+εz) + L(θ−εz)) / 2, before the update


class Held(NamedTuple):
    """Parameters whose last update is held back (``mezo_step(..., hold=True)``).

    The next :func:`mezo_step` applies it inside its own compiled program, before the forward
    passes of its projected gradients (:meth:`ProjectedGradientsFn.after_update`): one program
    call per step instead of two, the same bits. :func:`settle` applies it alone, for a caller
    that reads the parameters (an evaluation, a digest, a checkpoint). A step's update is known
    only once its projected gradients are on the host, so holding it is what lets a step run as
    one call; on a GPU each call costs host time that the device spends idle.
    """

    params: Any  # the parameters before the held update: a pytree, or its zeroth.replay.Flat
    keys: np.ndarray  # u32[K, 2]: the held update's keys, in canonical order
    # its coefficients (update_coefficients), one per key; None for a deferred step's (see outcome)
    coefficients: tuple[float, ...] | None
    decay: np.float32 | None  # the weight-decay factor (decay_factor) applied after it, or None
    distribution: str
    # the next step's keys, derived while the device ran this step's program: ((run_seed, machine,
    # iteration, n), u32[n, 2]); mezo_step uses them where they name its perturbations
    ahead: tuple[tuple[int, int, int, int], np.ndarray] | None = None
    # a deferred step's (mezo_step(..., defer=True)): its outcome, which holds the update's scales
    # and decay factor as the program computed them on the device
    outcome: _Outcome | None = None


class _Outcome:
    """A deferred step's outcome (``mezo_step(..., defer=True)``), on the device until
    :meth:`result` fetches and checks it: the projected gradients and losses, their one-byte codes,
    and the update's scales and decay factor (:func:`_encoded`), which the next step's program
    applies without the host."""

    __slots__ = ("g", "losses", "codes", "scales", "factor", "iteration", "lr", "eps", "scaling", "distribution",
                 "_result")

    def __init__(self, g, losses, codes, scales, factor, *, iteration: int, lr: float, eps: float, scaling: str,
                 distribution: str):
        # device arrays, as _encoded returns them (factor: None without weight decay)
        self.g, self.losses, self.codes, self.scales, self.factor = g, losses, codes, scales, factor
        self.iteration, self.lr, self.eps, self.scaling, self.distribution = iteration, lr, eps, scaling, distribution
        self._result: _Resolved | None = None

    def result(self) -> _Resolved:
        """Fetched and checked once (then kept): the host encodes the fetched ``g`` itself
        (:func:`_host_update`: a non-finite one raises ``ValueError``, naming the iteration) and
        the program's codes and scales must equal the host's bit for bit (``RuntimeError`` if
        not: the backend broke the determinism contract)."""
        if self._result is not None:
            return self._result
        g, losses, codes, scales = jax.device_get((self.g, self.losses, self.codes, self.scales))
        payload, decoded, coefficients = _host_update(g, losses, _codecs.ONEBYTE, self.lr, self.scaling,
                                                      iteration=self.iteration, eps=self.eps)
        host_scales = _replay.update_scales(self.distribution, coefficients)
        if payload != np.asarray(codes, np.uint8).tobytes() or not np.array_equal(
                host_scales.view(np.uint32), np.asarray(scales, np.float32).view(np.uint32)):
            raise RuntimeError(
                f"iteration {self.iteration}: the program's one-byte codes {np.asarray(codes).tolist()} and scales "
                f"{np.asarray(scales).tolist()} differ from the host's {list(payload)} and {host_scales.tolist()} for "
                f"the projected gradients {np.asarray(g).tolist()}; this backend breaks the determinism contract "
                f"(run `zeroth doctor`), and mezo_step(..., defer=False) computes them on the host"
            )
        self._result = _Resolved(decoded, payload, float(np.mean(losses)), tuple(coefficients))
        self.g = self.losses = self.codes = None  # fetched; the scales and factor may still be applied
        return self._result


class _Resolved(NamedTuple):
    grads: np.ndarray
    payload: bytes
    loss: float
    coefficients: tuple[float, ...]


class Deferred(NamedTuple):
    """What ``mezo_step(..., hold=True, defer=True)`` returns: the step's :class:`Held`
    parameters, at once, and its outcome when asked (:meth:`result`).

    The step's program encodes its projected gradients itself (one byte each, integer operations
    that give the host's codes) and looks up the update's scales in a table of the 256 codes that
    the host rounded ahead of time (:func:`onebyte_scales`), so the next step's program can apply
    the update before the host has seen the step: the host dispatches step t + 1, then fetches
    step t while the device runs it. The fetched values are checked against the host's own
    encoding and rounding, so the bits are those of ``defer=False``.
    """

    params: Held

    def result(self) -> StepResult:
        """The :class:`StepResult` (``params`` is :attr:`params`), fetched and checked: raises
        ``ValueError`` for a non-finite projected gradient, as ``mezo_step`` does (the next step's
        program, if it ran, applied no update for it), and ``RuntimeError`` if the program's codes
        or scales differ from the host's."""
        r = self.params.outcome.result()
        return StepResult(self.params, r.grads, r.payload, r.loss)


@functools.lru_cache(maxsize=64)
def _onebyte_scales(lr: float, n_total: int, scaling: str, distribution: str) -> np.ndarray:
    if not math.isfinite(lr) or n_total < 1:
        raise ValueError(f"onebyte_scales needs a finite lr and n_total >= 1, got lr={lr!r}, n_total={n_total!r}")
    # update_coefficients' float64 operations, on all 256 values at once (NumPy's IEEE operations
    # give Python's bits), rounded once by update_scales as update_coefficients then update_scales
    # round twice (the second rounding is the identity)
    raw = (-lr * _codecs.ONEBYTE_TABLE.astype(np.float64)) / _denominator(n_total, scaling)
    table = _replay.update_scales(distribution, raw)
    table.setflags(write=False)
    return table


def onebyte_scales(lr: float, n_total: int, scaling: str = "sqrt", distribution: str = "binomial") -> np.ndarray:
    """``f32[256]``: the replay scale of each one-byte code, ``update_scales(update_coefficients(
    ONEBYTE_TABLE, lr, n_total, scaling))``: entry ``b`` is the scale a projected gradient encoded
    as ``b`` is applied with, rounded on the host (cached per argument; read-only).

    Example:
      >>> from zeroth import codecs
      >>> t = onebyte_scales(0.5, 4)
      >>> float(t[codecs.ONEBYTE_ZERO]), float(t[0xC0])  # g = 0 and g = 1: c = -0.5 / 2, z = k / 2
      (0.0, -0.125)
    """
    _check_scaling(scaling)
    _noise.check_distribution(distribution)
    return _onebyte_scales(float(lr), int(n_total), scaling, distribution)


def settle(params: Any) -> Any:
    """The parameters with a :class:`Held` update applied (the held parameters are donated), as
    :func:`zeroth.replay.replay` and :func:`weight_decay` apply it; anything else as it is.

    Example:
      >>> loss = lambda p, b: jnp.sum((p["w"] - b) ** 2)
      >>> out = mezo_step(loss, {"w": jnp.zeros(4)}, jnp.ones(4), run_seed=0, iteration=0, lr=0.1,
      ...                 eps=1e-2, hold=True)
      >>> type(out.params).__name__, settle(out.params)["w"].shape
      ('Held', (4,))
    """
    if not isinstance(params, Held):
        return params
    coefficients = params.coefficients
    if params.outcome is not None:  # fetched and checked now (a refused step raises here, naming it)
        try:
            coefficients = params.outcome.result().coefficients
        except ValueError as exc:
            exc.params = params.params  # its update not applied
            raise
    out = _replay.replay(params.params, (params.keys, list(coefficients)), distribution=params.distribution, donate=True)
    return out if params.decay is None else _decay_donated(out, params.decay)


def _host_update(g, losses, cod, lr: float, scaling: str, *, iteration: int, eps: float):
    """The host's part of :func:`mezo_step` between its projected gradients and its replay:
    ``(payload, decoded, coefficients)`` of the fetched ``g`` (``f32[n]``), refusing a non-finite
    one. ``zeroth bench zo`` times it alone (with the keys' derivation) to attribute a step's time."""
    g = np.asarray(g, np.float32)
    if not all(map(math.isfinite, g.tolist())):  # one NumPy call where all are finite: the common case
        i = int(np.flatnonzero(~np.isfinite(g))[0])
        raise ValueError(
            f"projected gradient {i} of iteration {iteration} is {float(g[i])!r} (mean loss of the pair {float(losses[i])!r}); "
            f"the loss is not finite at θ ± εz: lower lr (now {lr}) or eps (now {eps})"
        )
    payload = cod.encode(g)
    decoded = cod.decode(payload)
    return payload, decoded, update_coefficients(decoded, lr, decoded.size, scaling)


def mezo_step(
    loss_fn: Callable[[Any, Any], jax.Array],
    params: Any,
    batch: Any,
    *,
    run_seed: int,
    iteration: int,
    lr: float | _schedules.Schedule,
    eps: float,
    n_perturbations: int = 1,
    machine: int = 0,
    scaling: str = "sqrt",
    distribution: str = "binomial",
    codec: str = "float32",
    weight_decay: float = 0.0,
    donate: bool = False,
    hold: bool = False,
    unroll: bool = False,
    defer: bool = False,
) -> StepResult | Deferred:
    """One MeZO / Just One Byte iteration on one machine (N = ``n_perturbations``).

    keys ``sample_key(run_seed, machine, iteration, i)`` -> projected gradients (compiled with
    :func:`compiler_options`) -> ``codec`` encode/decode -> :func:`canonical_updates` ->
    ``replay`` (exact) -> optional :func:`weight_decay`. Bit-identical to replaying the same
    decoded gradients with :mod:`zeroth.reference`.

    Args:
      loss_fn: ``loss_fn(params, batch) -> scalar`` (hashable; its compiled estimator is cached).
      params, batch: the model parameters and the batch. ``params`` may be the
        :class:`zeroth.replay.Flat` of the tree ``loss_fn`` takes: the step then passes a buffer per
        dtype to each compiled call instead of an array per leaf, with the same bits, and returns a
        ``Flat``.
      run_seed, iteration, machine: name the perturbations.
      lr, eps: learning rate η (a number, or a :class:`zeroth.schedules.Schedule`: η_t of
        ``iteration``, which also scales the weight decay) and perturbation size ε (host-rounded).
      n_perturbations: n >= 1.
      scaling: ``"sqrt"`` or ``"linear"``.
      distribution: ``"binomial"`` or ``"rademacher"``.
      codec: ``"float32"`` or ``"onebyte"`` (:func:`zeroth.codecs.get_codec`).
      weight_decay: λ (0 = none).
      donate: update ``params`` in place (the input must not be used afterwards).
      hold: return the parameters as a :class:`Held`: this step's update (and weight decay) not
        applied yet, for the next ``mezo_step`` to apply inside its program (one compiled call per
        step) or :func:`settle` to apply alone; both donate the Held's parameters, which are
        ``params`` itself with ``donate``, else a copy. ``params`` may be a :class:`Held` whatever
        ``hold`` is: its update is applied first, in the same program as this step's projected
        gradients, and its parameters are donated (if the step then raises, the error's
        ``params`` attribute holds them with that update applied).
      unroll: evaluate the 2n forward passes as straight-line code instead of a loop
        (:func:`projected_gradients_and_losses`); the update is the same.
      defer: with ``hold`` and the ``onebyte`` codec, return a :class:`Deferred` at once, before
        the device has run the step: its program encodes the projected gradients and looks up the
        update's scales itself, so the next step's program can apply the update without waiting
        for the host, which fetches and checks this step's outcome while the device runs the next
        (:meth:`Deferred.result`; a non-finite projected gradient is then reported one step late,
        and its update is not applied). The same bits.

    Returns:
      a :class:`StepResult`, or with ``defer`` a :class:`Deferred`.

    Raises:
      ValueError: bad arguments, or a non-finite projected gradient (the losses are named).
    """
    if isinstance(n_perturbations, bool) or not isinstance(n_perturbations, (int, np.integer)) or n_perturbations < 1:
        raise ValueError(f"n_perturbations must be an integer >= 1, got {n_perturbations!r}")
    _check_scaling(scaling)
    if defer and (not hold or codec != "onebyte"):
        raise ValueError(
            f"defer=True needs hold=True and codec='onebyte' (the program encodes its projected gradients and "
            f"looks up the update's scales itself, which only the one-byte code's fixed table allows), got "
            f"hold={hold!r}, codec={codec!r}"
        )
    lr = lr_at(lr, iteration)
    cod = _codecs.get_codec(codec)
    eps_scale = round_eps(eps)
    decay_to = decay_factor(lr, weight_decay) if weight_decay else None  # validated before any work
    n = int(n_perturbations)

    def keys_of(it: int) -> np.ndarray:  # the n perturbations' keys of this machine's iteration it
        return _rng.sample_keys(run_seed, [(machine, it, i) for i in range(n)])

    if isinstance(params, Held) and params.ahead is not None and params.ahead[0] == (run_seed, machine, iteration, n):
        keys = params.ahead[1]
    else:
        keys = keys_of(iteration)
    estimator = projected_gradients_fn(loss_fn, distribution=distribution, unroll=unroll)
    enc = (onebyte_scales(lr, n, scaling, distribution), decay_to) if defer else None
    before = None  # the previous step's outcome, if it was deferred: checked once this step is under way
    if isinstance(params, Held):
        if params.distribution != distribution:
            raise ValueError(f"the held update is of distribution {params.distribution!r}; this step's is {distribution!r}")
        before = params.outcome
        if before is None:
            held = (params.keys, _replay.update_scales(distribution, list(params.coefficients)), params.decay)
        else:
            held = (params.keys, before.scales, before.factor)
        params, *out = estimator.after_update(params.params, held, batch, keys, eps_scale, enc)
        donate = True  # the held parameters were this function's, and these are the program's output
    else:
        out = estimator(params, batch, keys, eps_scale, enc)
    ahead = None
    if hold:  # while the device runs the program: the keys of the step that will apply this one's update
        try:
            ahead = ((run_seed, machine, iteration + 1, n), keys_of(iteration + 1))
        except ValueError:  # the last iteration a key can name: the next step says so itself
            pass
    if before is not None:
        try:
            before.result()
        except (ValueError, RuntimeError) as exc:  # ValueError: its update was not applied (_encoded); these are the parameters it had
            exc.params = params
            raise
    if defer:
        outcome = _Outcome(*out, iteration=iteration, lr=lr, eps=eps, scaling=scaling, distribution=distribution)
        return Deferred(Held(params, keys, None, decay_to, distribution, ahead, outcome))
    g, losses = jax.device_get(tuple(out))
    try:
        payload, decoded, coefficients = _host_update(g, losses, cod, lr, scaling, iteration=iteration, eps=eps)
    except ValueError as exc:
        exc.params = params  # a held input was donated: these are its parameters, its update applied
        raise
    if hold:
        if not donate:  # the Held's parameters are donated later (settle, the next step): not the caller's
            params = jax.tree_util.tree_map(jnp.copy, params)
        return StepResult(Held(params, keys, tuple(coefficients), decay_to, distribution, ahead), decoded, payload,
                          float(np.mean(losses)))
    # canonical_updates(run_seed, iteration, {machine: decoded}, lr, scaling), without re-deriving the keys
    updates = list(zip(keys, coefficients, strict=True))
    params = _replay.replay(params, updates, distribution=distribution, donate=donate)
    if decay_to is not None:
        params = _decay_donated(params, decay_to)
    return StepResult(params, decoded, payload, float(np.mean(losses)))


# --------------------------------------------------------------------------- optax bridge


def dense_gradient(params: Any, keys, coefficients, *, distribution: str = "binomial") -> Any:
    """``Σ_i c_i z_i`` as a float32 pytree of the parameters' structure (traceable).

    OUTSIDE the determinism contract (a float sum) and one extra parameter-sized buffer; ``z_i``
    are the same noise values the exact replay uses.

    Args:
      params: pytree (only structure and shapes are used).
      keys: ``u32[n, 2]``; coefficients: ``f32[n]``.
    """
    _noise.check_distribution(distribution)
    keys = jnp.asarray(keys, jnp.uint32).reshape(-1, 2)
    coefficients = jnp.asarray(coefficients, jnp.float32).reshape(-1)
    with_path, treedef = jax.tree_util.tree_flatten_with_path(params)
    out = []
    for path, leaf in with_path:
        lid = np.uint32(_rng.leaf_id(path))
        shape = jnp.shape(leaf)

        def body(i, acc, lid=lid, shape=shape):
            z = _noise.sample(distribution, _rng.fold_in(keys[i], lid), shape, jnp.float32)
            return acc + coefficients[i] * z

        out.append(jax.lax.fori_loop(0, keys.shape[0], body, jnp.zeros(shape, jnp.float32)))
    return jax.tree_util.tree_unflatten(treedef, out)


class ZOGrads(NamedTuple):
    """A zeroth-order gradient: what ``jax.grad`` is to optax, the input of :func:`zo_estimate`.

    Perturbation ``i`` is named by ``keys[i]`` (its noise ``z_i`` is regenerated from it) and
    ``grads[i]`` is its projected gradient ``(L(θ+εz_i) − L(θ−εz_i)) / (2ε)``, as computed by
    :func:`projected_gradients` (or decoded from a peer's bytes).
    """

    keys: Any  # u32[n, 2] sample keys (zeroth.rng.sample_keys)
    grads: Any  # f32[n] projected gradients


def zo_value_and_grad(loss_fn: Callable[[Any, Any], jax.Array], *, eps: float, distribution: str = "binomial"):
    """The ZO analogue of ``jax.value_and_grad``: ``fn(params, batch, keys) -> (loss f32[], ZOGrads)``.

    ``loss`` is the mean over the pairs of ``(L(θ+εz_i) + L(θ−εz_i)) / 2``; ε is host-rounded.
    Called with concrete arrays it runs :func:`projected_gradients_fn` (compiled once per shape
    with the memory-saving options); inside a ``jax.jit`` it traces
    :func:`projected_gradients_and_losses` into the caller's program (jit that with
    ``compiler_options=compiler_options()`` to keep a step's memory at that of inference).

    Example:
      >>> from zeroth.rng import sample_keys
      >>> fn = zo_value_and_grad(lambda p, b: jnp.sum(p["w"] ** 2), eps=1e-2)
      >>> loss, g = fn({"w": jnp.ones(3)}, None, sample_keys(0, [(0, 0, 0), (0, 0, 1)]))
      >>> g.grads.shape
      (2,)
    """
    estimator = projected_gradients_fn(loss_fn, distribution=distribution)
    eps_scale = round_eps(eps)

    def fn(params, batch, keys):
        keys = jnp.asarray(keys, jnp.uint32).reshape(-1, 2)
        if any(isinstance(x, jax.core.Tracer) for x in jax.tree_util.tree_leaves((params, batch, keys))):
            g, losses = projected_gradients_and_losses(loss_fn, params, batch, keys, eps_scale, distribution=distribution)
        else:
            g, losses = estimator(params, batch, keys, eps_scale)
        return jnp.mean(losses), ZOGrads(keys, g)

    return fn


@functools.partial(jax.jit, static_argnames=("distribution",))
def _estimate(params, keys, grads, denom, *, distribution):
    c = jnp.asarray(grads, jnp.float32).reshape(-1) / jnp.asarray(denom, jnp.float32)
    est = dense_gradient(params, keys, c, distribution=distribution)
    return jax.tree_util.tree_map(lambda e, p: e.astype(jnp.asarray(p).dtype), est, params)


def zo_estimate(*, distribution: str = "binomial", scaling: str = "sqrt") -> optax.GradientTransformationExtraArgs:
    """The ZO estimator as the first link of an optax chain: :class:`ZOGrads` in, a dense gradient out.

    ``update(updates, state, params, *, n_total=None)`` takes ``updates = ZOGrads(keys, grads)``
    (``n`` perturbations) and returns the dense estimate of ``∇L``

        ĝ = Σ_i g_i z_i / s,    s = √N ("sqrt") or N ("linear"),  N = n_total (default n),

    a pytree of the parameters' structure and dtypes (``z_i`` are the replay's own noise values,
    :func:`dense_gradient`). Everything after it in the chain sees an ordinary gradient: clipping,
    schedules, momentum, Adam, the learning rate (``optax.sgd(η)`` then gives ZO-SGD, the update
    ``−η ĝ`` that :func:`mezo_step` applies exactly). ``params`` is required (its leaf paths name
    the noise); ``n_total`` (an extra argument that ``optax.chain`` forwards) is the number of
    projected gradients of the iteration across all machines when ``updates`` holds a subset. The
    state is ``optax.EmptyState()``.

    OUTSIDE THE DETERMINISM CONTRACT: the dense sum and optax's float math (clipping norms,
    schedules evaluated on the device, optimizer moments) round differently on different
    backends, so peers running it drift apart; and the estimate is one parameter-sized buffer
    more. The exact path is :func:`mezo_step` / :func:`canonical_updates` with a host schedule
    (:mod:`zeroth.schedules`).

    Example:
      >>> import optax
      >>> from zeroth.rng import sample_keys
      >>> loss = lambda p, b: jnp.sum((p["w"] - 1.0) ** 2)
      >>> opt = optax.chain(zo_estimate(), optax.clip_by_global_norm(1.0),
      ...                   optax.sgd(optax.warmup_cosine_decay_schedule(0.0, 0.5, 5, 40)))
      >>> params = {"w": jnp.zeros(8)}
      >>> state = opt.init(params)
      >>> value_and_grad = zo_value_and_grad(loss, eps=1e-2)
      >>> for t in range(40):
      ...     loss_t, grads = value_and_grad(params, None, sample_keys(0, [(0, t, i) for i in range(4)]))
      ...     updates, state = opt.update(grads, state, params)
      ...     params = optax.apply_updates(params, updates)
      >>> float(loss(params, None)) < 0.01 * 8.0  # from 8.0
      True
    """
    _noise.check_distribution(distribution)
    _check_scaling(scaling)

    def init_fn(params):
        del params
        return optax.EmptyState()

    def update_fn(updates, state, params=None, *, n_total=None, **extra_args):
        del extra_args
        if params is None:
            raise ValueError("zo_estimate needs params (opt.update(grads, state, params)): their leaf paths name the noise")
        if not isinstance(updates, ZOGrads):
            raise TypeError(f"zo_estimate takes updates=ZOGrads(keys, grads) (see zo_value_and_grad), got {type(updates).__name__}")
        keys = jnp.asarray(updates.keys, jnp.uint32).reshape(-1, 2)
        n = keys.shape[0]
        if n_total is None:
            n_total = n
        if isinstance(n_total, jax.core.Tracer):
            total = jnp.asarray(n_total, jnp.float32)
            denom = total if scaling == "linear" else jnp.sqrt(total)
        else:
            if isinstance(n_total, bool) or not isinstance(n_total, (int, np.integer)) or n_total < max(1, n):
                raise ValueError(f"n_total must be an integer >= max(1, number of keys) = {max(1, n)}, got {n_total!r}")
            denom = np.float32(n_total if scaling == "linear" else math.sqrt(n_total))
        return _estimate(params, keys, updates.grads, denom, distribution=distribution), state

    return optax.GradientTransformationExtraArgs(init_fn, update_fn)


class ZOOptaxState(NamedTuple):
    """State of :func:`zo_optax`: the wrapped optimizer's state (float math, not exact)."""

    inner: Any  # optax state of the wrapped optimizer, e.g. momentum / Adam moments (param-sized)


class ZOOptax(NamedTuple):
    """``init(params) -> state``; ``update(params, state, keys, grads, n_total) -> (params, state)``."""

    init: Callable[[Any], ZOOptaxState]
    update: Callable[..., tuple[Any, ZOOptaxState]]


def zo_optax(optimizer, *, distribution: str = "binomial", scaling: str = "sqrt") -> ZOOptax:
    """ZO-momentum / ZO-Adam: ``optimizer`` after :func:`zo_estimate`, and the update applied.

    ``update(params, state, keys, grads, n_total)`` is ``ĝ = zo_estimate(...)(ZOGrads(keys,
    grads), n_total=n_total)``, then ``optimizer.update(ĝ, ...)`` and ``optax.apply_updates``, in
    one compiled program; the learning rate (and its optax schedule) lives in ``optimizer``.
    The same as ``optax.chain(zo_estimate(...), optimizer)`` with the parameters updated for you.
    OUTSIDE THE DETERMINISM CONTRACT (see :func:`zo_estimate`); it costs the dense estimate (one
    copy of the parameters) plus the optimizer state (one for momentum, two for Adam).
    Use :func:`mezo_step` / :func:`canonical_updates` where bit-exactness is needed.

    Example:
      >>> import optax
      >>> opt = zo_optax(optax.adam(1e-2))
      >>> state = opt.init({"w": jnp.zeros(3)})
    """
    estimate = zo_estimate(distribution=distribution, scaling=scaling)

    def init(params):
        return ZOOptaxState(optimizer.init(params))

    @functools.partial(jax.jit, static_argnums=(4,))
    def _update(params, state, keys, grads, n_total):
        est, _ = estimate.update(ZOGrads(keys, grads), optax.EmptyState(), params, n_total=n_total)
        with jax.numpy_dtype_promotion("standard"):  # optax's internals mix Python floats and int32 counts
            updates, inner = optimizer.update(est, state.inner, params)
            return optax.apply_updates(params, updates), ZOOptaxState(inner)

    def update(params, state, keys, grads, n_total):
        if isinstance(n_total, bool) or not isinstance(n_total, (int, np.integer)) or n_total < 1:
            raise ValueError(f"n_total must be an integer >= 1, got {n_total!r}")
        return _update(params, state, keys, grads, int(n_total))

    return ZOOptax(init, update)
