"""Compiler options under which a ZO step keeps no perturbed copy of the model.

The estimator compiles its program under each candidate of :func:`compiler_option_candidates` and
keeps the first whose compiled peak is within :data:`NEAR_LEAST_MEMORY` of the least
(:func:`kept_candidate`); see the ZO memory page of the docs for why each option is there.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from concurrent import futures as _futures
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from zeroth import rule as _rule

__all__ = [
    "AUTOTUNE_MIN_BYTES",
    "NEAR_LEAST_MEMORY",
    "compiler_options",
    "compiler_option_candidates",
    "estimator_option_candidates",
    "compile_candidates",
    "side_by_side",
    "compiled_count",
    "near_least_memory",
    "kept_candidate",
    "compiled_memory",
]


_DISABLED_PASSES = "while-loop-invariant-code-motion"
_INDIVIDUAL_LIBRARY_OPS = "LIBRARY_FUSION_TYPE_INDIVIDUAL_DOT,LIBRARY_FUSION_TYPE_INDIVIDUAL_CONVOLUTION"
# Parameters smaller than this are compiled once (base options): choosing among compilations only
# pays where the parameters are big enough for the memory to matter.
AUTOTUNE_MIN_BYTES = 1 << 20


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
      weight at once; limiting it to individual dots and convolutions does the opposite. The
      motion shortens the projected gradients for about the same peak on the models measured
      (``zeroth bench zo --zo-option xla_disable_hlo_passes=`` compares).
    * GPU: the motion, then the base options. The motion shortens the projected gradients, with the same peak and bits.
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
    param_bytes = sum(
        int(np.size(x)) * jnp.dtype(jnp.result_type(x)).itemsize for x in jax.tree_util.tree_leaves(params)
    )
    if param_bytes >= AUTOTUNE_MIN_BYTES:
        return candidates
    if _platform(backend) == "cpu":
        # the base options: there the motion takes the jnp rule's per-leaf work out of the loop as
        # ops of their own (12 leaves: 65 ops per call instead of at most 40), and no later
        # candidate compiles to catch what it may hoist
        return [compiler_options(backend)]
    return candidates[:1]


def compile_candidates(
    lowered,
    candidates: Sequence[Mapping[str, Any]],
    backend: str | None = None,
    *,
    enough: Callable[[Any], bool] | None = None,
) -> list:
    """``[lowered.compile(options) for options in candidates]``, in rounds of
    :func:`side_by_side` candidates (``backend`` default: :func:`zeroth.rule.default_platform`):
    on a CPU pairs compile side by side in threads (XLA compiles without holding Python's lock),
    so the estimator's first call waits for the slower of two instead of their sum; elsewhere one after the other: a GPU compiler times candidate kernels on
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
        batch = [dict(o) for o in candidates[start : start + size]]
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
    estimator's candidates after its round are then not compiled (:func:`compile_candidates`: a large
    model's compilations take seconds each, and where one holds little scratch the next holds the same). Where code motion hoists widened leaves and
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
