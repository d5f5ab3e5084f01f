"""``zeroth bench zo [--json] [--model M] [--batch B] [--width W] [--seq-len T] [--n N] [--flat] [--rows G,...]``.

A MeZO step against plain inference and against a backprop step, on one model and batch: time
over two forwards and peak memory over inference's, with their targets. The models, rows, ratios
and how memory and time are measured are described in the docs (``docs/guides/benchmarks.md``).

Example:
  $ zeroth bench zo --model mlp --batch 256
"""

from __future__ import annotations

import functools
import os
import sys
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from zeroth import codecs, models, noise, replay, rng, zo
from zeroth import rule as _rule
from zeroth.bench import _common
from zeroth.bench import pretrained as _pretrained_bench
from zeroth.bench import profile as _profile
from zeroth.kernels import perturb as fused

__all__ = ["main", "run", "setup", "default_batch", "MODELS", "PRETRAINED_MODELS"]

PRETRAINED_MODELS = _pretrained_bench.MODELS
MODELS = ("mlp", "cnn", "transformer", *PRETRAINED_MODELS)
TARGETS = {"zo_time_over_forwards": ("<=", 1.2), "zo_memory_over_inference": ("<=", 1.2)}
# The groups of rows ``--rows`` names (the inference forward is always timed: every ratio is over it).
ROW_GROUPS = {
    "step": "the ZO step (tree) and its parts: projected gradients, update, fetched, host work",
    "held": "the ZO step with its update held (tree)",
    "flat": "the ZO step, its projected gradients and its update on the flat layout",
    "flat_held": "the flat layout's step with its update held (what the trainer runs on a GPU)",
    "deferred": "the flat layout's held step, deferred (the trainer's one-byte step on a GPU)",
    "deferred_tree": "the held step deferred on the tree (the trainer's one-byte step on a CPU, whose layout is the tree)",
    "backprop": "the backprop step",
}
_FLAT_GROUPS = ("flat", "flat_held", "deferred")
_INPUT_SHAPE = (28, 28, 1)
_NUM_CLASSES = 10
_EPS = 1e-3
_LR = 1e-3


def _model_kwargs(name: str, width: int) -> dict:
    if name == "mlp":
        return {"num_classes": _NUM_CLASSES, "hidden": (width, width)}
    if name == "cnn":
        return {
            "num_classes": _NUM_CLASSES,
            "features": (max(1, width // 32), max(1, width // 16)),
            "dense": max(1, width // 8),
        }
    if name == "transformer":
        d = max(8, width // 8 // 4 * 4)
        return {
            "num_classes": _NUM_CLASSES,
            "d_model": d,
            "heads": 4,
            "layers": 4,
            "mlp_dim": 4 * d,
            "max_len": _INPUT_SHAPE[0],
        }
    raise ValueError(f"unknown model {name!r}; expected one of {list(MODELS)}")


def default_batch(model: str) -> int:
    """The batch ``zeroth bench zo`` uses when none is given: 8 for the pretrained models, else 256."""
    return 8 if model in PRETRAINED_MODELS else 256


def setup(name: str, width: int, batch: int, seq_len: int | None = None, weights: str = "pretrained"):
    """``(model kwargs, params, batch, loss_fn)`` of a model of :data:`MODELS` as ``zeroth bench zo`` and
    ``zeroth bench memory`` run it (random inputs for zeroth's own models, real prompts and weights for
    the pretrained ones, or with ``weights="random"`` SmolLM2's architecture with random weights and
    tokens: :func:`zeroth.bench.pretrained.setup`)."""
    if name in PRETRAINED_MODELS:
        return _pretrained_bench.setup(name, batch, seq_len, weights)
    for flag, v, default in (("--seq-len", seq_len, None), ("--weights", weights, "pretrained")):
        if v != default:
            raise ValueError(f"{flag} applies to the pretrained models {list(PRETRAINED_MODELS)}, not to {name!r}")
    kwargs = _model_kwargs(name, width)
    model = models.build(name, **kwargs)
    r = np.random.default_rng(0)
    x = jnp.asarray(r.uniform(0, 1, (batch, *_INPUT_SHAPE)).astype(np.float32))
    y = jnp.asarray(r.integers(0, _NUM_CLASSES, batch).astype(np.int32))
    params = models.init(model, models.init_key(0), x[:1])

    def loss_fn(p, b):
        xb, yb = b
        logits = models.apply(model, p, xb).astype(jnp.float32)
        logp = jax.nn.log_softmax(logits, axis=-1)
        return -jnp.mean(jnp.take_along_axis(logp, yb[:, None], axis=-1))

    return kwargs, params, (x, y), loss_fn


def run(
    model: str = "mlp",
    *,
    batch: int | None = None,
    width: int = 1024,
    n: int = 1,
    seq_len: int | None = None,
    weights: str = "pretrained",
    codec: str = "float32",
    distributions: tuple[str, ...] = noise.EXACT,
    repeats: int = 5,
    warmup: int = 1,
    profile_calls: int = 0,
    zo_options: dict[str, Any] | None = None,
    flat: bool = False,
    unroll: bool = False,
    rows: tuple[str, ...] | None = None,
    progress: Callable[[str], None] = _common.no_progress,
) -> dict:
    """Run the benchmark; returns ``{"config", "environment", "rows", "ratios", "targets"}``.

    With ``zo_options`` (``--zo-option NAME=VALUE``, repeatable), the projected-gradients program
    is also compiled with the chosen options updated by these and timed beside it: one more row
    per distribution, and the ratios ``options_time_over_chosen_*`` and
    ``options_memory_over_chosen_*``, and ``options_same_bits_*`` (1.0 when both programs give
    the same projected gradients and losses, bit for bit). For instance
    ``--zo-option xla_disable_hlo_passes=`` runs XLA's loop-invariant code motion, which the ZO
    options turn off to keep the memory of inference: what it costs in time on this device (on a
    GPU the chosen program may already run it; ``compiler_options.chosen`` says which).

    With ``flat``, the ZO step, its projected gradients and its update also run on the
    parameters' :class:`zeroth.replay.Flat` (:func:`zeroth.replay.flatten`: a buffer per dtype,
    and one per large leaf, instead of an array per leaf) and are timed beside the tree's: rows
    marked "(flat layout)", the ratios ``flat_*_time_over_tree_*``, ``zo_time_over_forwards_flat_*`` and
    ``flat_same_bits_*`` (1.0 when the flat estimator's projected gradients and losses equal the
    tree's, bit for bit). What they measure is the host cost of passing every leaf to each call;
    the flat step is what the trainer runs with ``train.layout: flat``.

    With ``profile_calls`` > 0, also ``"profile"``: the fastest inference forward and each ZO step
    run that many times more under the JAX profiler (:func:`zeroth.bench.profile.profile`: wall,
    busy and idle time per call, each program's busy time, the ops by time), and the ratios
    ``zo_busy_over_forwards_*`` (the ZO step's op time over 2N forwards' op time) and
    ``zo_idle_fraction_*`` (the part of the ZO step's wall time in which no op ran). A profiler
    that fails leaves ``{"error": ...}`` there and the timings as they are.

    With ``unroll``, the projected gradients are also compiled with their 2N forward passes as
    straight-line code (``zo.projected_gradients_fn(..., unroll=True)``) and timed beside the loop:
    rows marked "unrolled" (on the flat layout too with ``flat``, and there the held step, what the
    trainer would run), the ratios ``unrolled_pg_time_over_loop[_flat]_*``,
    ``unrolled_memory_over_loop[_flat]_*``, ``unrolled_same_bits[_flat]_*`` and
    ``zo_time_over_forwards_flat_held_unrolled_*``.

    With ``rows`` (``--rows step,held,...``), only those groups of :data:`ROW_GROUPS` are compiled
    and timed, with the inference forward (ratios of rows left out are left out too): on a GPU,
    where compiling is most of a run, ``--rows flat_held,deferred``
    times the trainer's steps alone. A flat group implies ``flat``; ``None`` is every group (the
    flat ones with ``flat``).

    ``progress(message)`` is called at each stage (compiling a program, warming up a row, timing,
    profiling); ``zeroth bench zo`` prints these lines on stderr (:class:`zeroth.bench._common.Progress`).

    ``width`` sizes zeroth's own models; ``seq_len`` is the token length of the pretrained models'
    prompts (default: the model's own, 40 for SmolLM2, 64 for MiniLM), and ``weights="random"``
    runs SmolLM2's architecture with random weights and tokens, without its package (the same
    programs and work; its losses mean nothing). ``batch`` defaults to
    :func:`default_batch` of the model (256; 8 for the pretrained models, as their configs train).

    Raises:
      ValueError: an unknown model, codec or distribution, or a size below 1.
      MissingPackage: a pretrained model's weights package is not installed (the message is the command).
    """
    if model not in MODELS:
        raise ValueError(f"unknown model {model!r}; expected one of {list(MODELS)}")
    batch = default_batch(model) if batch is None else batch
    if profile_calls < 0:
        raise ValueError(f"--profile must be a non-negative number of calls, got {profile_calls}")
    for name, v in (("batch", batch), ("width", width), ("n", n), ("seq-len", seq_len)):
        if v is not None and v < 1:
            raise ValueError(f"--{name} must be a positive integer, got {v}")
    codecs.get_codec(codec)
    for d in distributions:
        noise.check_distribution(d)
    zo_options = dict(zo_options or {})
    groups = _row_groups(rows, flat)
    flat = any(g in _FLAT_GROUPS for g in groups)
    for needs, what in ((unroll, "--unroll"), (zo_options, "--zo-option")):
        missing = [g for g in ("step", *(("flat",) if flat and what == "--unroll" else ())) if g not in groups]
        if needs and missing:
            raise ValueError(f"{what} compares with the rows of {missing}: add them to --rows (got {','.join(groups)})")
    import optax

    progress(f"setting up {model}")
    kwargs, params, data, loss_fn = setup(model, width, batch, seq_len, weights)
    input_shape = [int(d) for d in data[0].shape[1:]]
    param_bytes = int(sum(np.size(p) * jnp.dtype(p.dtype).itemsize for p in jax.tree_util.tree_leaves(params)))
    n_params = int(sum(np.size(p) for p in jax.tree_util.tree_leaves(params)))
    largest_leaf = max(int(np.size(p)) * 4 for p in jax.tree_util.tree_leaves(params))

    # the inference baseline: the forward under XLA's defaults and under each ZO option set;
    # ratios use the smallest peak and the fastest time among them
    fwd_variants = {"default": None, **{f"zo{i}": o for i, o in enumerate(zo.autotune.compiler_option_candidates())}}
    progress(f"compiling the forward under {len(fwd_variants)} option sets")
    fwd_jit = jax.jit(loss_fn)
    lowered = fwd_jit.lower(params, data)
    fwd_compiled = {k: lowered.compile(o) for k, o in fwd_variants.items()}
    mem = {f"forward_{k}": zo.compiled_memory(c) for k, c in fwd_compiled.items()}
    fns: dict[str, Callable[[], Any]] = {
        f"forward_{k}": (lambda c=c: jax.block_until_ready(c(params, data))) for k, c in fwd_compiled.items()
    }

    eps = zo.round_eps(_EPS)
    keys = rng.sample_keys(0, [(0, 0, i) for i in range(n)])
    chosen: dict[str, dict] = {}
    same: dict[str, bool] = {}
    flat_params = replay.flatten(params) if flat else None  # read only: the flat rows' and the unrolled rows'
    for dist in distributions:
        pg = zo.projected_gradients_fn(loss_fn, distribution=dist)
        coefficients = [_LR * 0.1 * (i + 1) for i in range(n)]
        scales = replay.update_scales(dist, coefficients)
        held = functools.partial(
            _held_rows, fns, mem, same, loss_fn, params, data, keys, eps, scales, pg, dist, n, codec
        )
        if "step" in groups:
            progress(f"compiling the projected gradients and the update ({dist})")
            _step_rows(fns, mem, chosen, pg, params, data, keys, eps, scales, codec, loss_fn, dist, n)
        if "held" in groups:
            progress(f"the step with its update held, and its bits ({dist})")
            held(flat=False)
        if "flat" in groups:
            progress(f"the flat layout's step, with its update applied, and its bits ({dist})")
            _flat_rows(fns, mem, same, loss_fn, params, flat_params, data, keys, eps, coefficients, pg, dist, n, codec)
        if "flat_held" in groups:
            progress(f"the flat layout's step with its update held, and its bits ({dist})")
            held(flat=True)
        if "deferred" in groups:
            progress(f"the flat layout's step, deferred, and its bits ({dist})")
            held(flat=True, defer=True)
        if "deferred_tree" in groups:
            progress(f"the step deferred on the tree, and its bits ({dist})")
            held(flat=False, defer=True)
        if unroll:
            progress(f"the projected gradients unrolled ({dist})")
            _unrolled_rows(
                fns,
                mem,
                same,
                loss_fn,
                params,
                flat_params,
                data,
                keys,
                eps,
                scales,
                pg,
                dist,
                n,
                codec,
                held_flat="flat_held" in groups,
            )
        if zo_options:
            progress(f"compiling the projected gradients under --zo-option ({dist})")
            try:
                other = pg.lowered(params, data, keys, eps).compile(_options(chosen[dist], zo_options))
            except jax.errors.JaxRuntimeError as exc:  # an option XLA does not know, or a bad value
                raise ValueError(f"--zo-option {zo_options}: XLA refused it: {exc}") from None
            mem[f"zo_pg_options_{dist}"] = zo.compiled_memory(other)
            fns[f"zo_pg_options_{dist}"] = lambda other=other: jax.block_until_ready(other(params, data, keys, eps))
            same[dist] = _same_bits(pg(params, data, keys, eps), other(params, data, keys, eps))

    if "backprop" in groups:
        progress(f"compiling the backprop step under {len(fwd_variants)} option sets")
        mem["backprop"], backprop_options = _backprop_row(fns, loss_fn, params, data, fwd_variants, optax.sgd(_LR))
    times = _common.timeit_many(fns, warmup=warmup, repeats=repeats, progress=progress)
    times.update({k: _per_step(v) for k, v in times.items() if k.startswith("zo_held_deferred")})

    t_fwd = min(times[f"forward_{k}"].min_s for k in fwd_variants)
    t_fwd_median = min(times[f"forward_{k}"].median_s for k in fwd_variants)
    c_fwd = min(times[f"forward_{k}"].cpu_min_s for k in fwd_variants)
    m_fwd = min(mem[f"forward_{k}"]["peak"] for k in fwd_variants)
    rows = [
        _row(
            "inference forward",
            times[f"forward_{k}"],
            mem[f"forward_{k}"],
            1,
            t_fwd,
            m_fwd,
            "XLA default options" if o is None else _describe(o),
        )
        for k, o in fwd_variants.items()
    ]
    ratios: dict[str, float] = {}
    for dist in distributions:
        if "step" in groups:
            step_mem = _step_memory(mem[f"zo_pg_{dist}"], mem[f"zo_update_{dist}"])
            m_step = step_mem["peak"]
            rows.append(
                _row(
                    f"ZO step n={n} {dist}",
                    times[f"zo_step_{dist}"],
                    step_mem,
                    2 * n,
                    t_fwd,
                    m_fwd,
                    f"mezo_step end to end, codec {codec}",
                )
            )
            rows.append(
                _row(
                    "  projected gradients",
                    times[f"zo_pg_{dist}"],
                    mem[f"zo_pg_{dist}"],
                    2 * n,
                    t_fwd,
                    m_fwd,
                    f"{2 * n} forwards at θ±εz, one program, {_describe(chosen[dist])}",
                )
            )
            rows.append(
                _row(
                    "  update (replay)",
                    times[f"zo_update_{dist}"],
                    mem[f"zo_update_{dist}"],
                    None,
                    t_fwd,
                    m_fwd,
                    "replay, fused kernels, donated",
                )
            )
            rows.append(
                _row(
                    "  projected gradients, fetched",
                    times[f"zo_fetch_{dist}"],
                    mem[f"zo_pg_{dist}"],
                    2 * n,
                    t_fwd,
                    m_fwd,
                    "the same call, its outputs fetched to the host (jax.device_get) as mezo_step does",
                )
            )
            rows.append(
                _row(
                    "  host work of the step",
                    times[f"zo_host_{dist}"],
                    {"peak": 0, "temp": 0},
                    None,
                    t_fwd,
                    m_fwd,
                    "keys, codec, coefficients and scales on the host, no device",
                )
            )
        if zo_options:
            t_opt, m_opt = times[f"zo_pg_options_{dist}"], mem[f"zo_pg_options_{dist}"]
            rows.append(
                _row(
                    "  projected gradients",
                    t_opt,
                    m_opt,
                    2 * n,
                    t_fwd,
                    m_fwd,
                    "the same program with " + ", ".join(f"{k}={v!r}" for k, v in zo_options.items()),
                )
            )
            ratios[f"options_time_over_chosen_{dist}"] = t_opt.min_s / times[f"zo_pg_{dist}"].min_s
            ratios[f"options_memory_over_chosen_{dist}"] = m_opt["peak"] / mem[f"zo_pg_{dist}"]["peak"]
            ratios[f"options_same_bits_{dist}"] = float(same[dist])
        if "held" in groups:
            rows.append(
                _row(
                    f"ZO step n={n} {dist}, update held",
                    times[f"zo_held_{dist}"],
                    mem[f"zo_held_{dist}"],
                    2 * n,
                    t_fwd,
                    m_fwd,
                    "mezo_step(hold=True): the last update applied in this step's program, one call",
                )
            )
            ratios[f"zo_time_over_forwards_held_{dist}"] = times[f"zo_held_{dist}"].min_s / (2 * n * t_fwd)
            ratios[f"zo_memory_over_inference_held_{dist}"] = mem[f"zo_held_{dist}"]["peak"] / m_fwd
            if "step" in groups:
                ratios[f"held_step_time_over_step_{dist}"] = (
                    times[f"zo_held_{dist}"].min_s / times[f"zo_step_{dist}"].min_s
                )
            ratios[f"held_same_bits_{dist}"] = float(same[f"held_{dist}"])
        if "step" in groups:
            ratios[f"zo_time_over_forwards_{dist}"] = times[f"zo_step_{dist}"].min_s / (2 * n * t_fwd)
            ratios[f"zo_time_over_forwards_{dist}_medians"] = times[f"zo_step_{dist}"].median_s / (2 * n * t_fwd_median)
            ratios[f"zo_cpu_time_over_forwards_{dist}"] = times[f"zo_step_{dist}"].cpu_min_s / (2 * n * c_fwd)
            ratios[f"zo_memory_over_inference_{dist}"] = m_step / m_fwd
            ratios[f"update_fraction_of_step_{dist}"] = (
                times[f"zo_update_{dist}"].min_s / times[f"zo_step_{dist}"].min_s
            )
            parts = times[f"zo_fetch_{dist}"].min_s + times[f"zo_update_{dist}"].min_s + times[f"zo_host_{dist}"].min_s
            ratios[f"host_work_fraction_of_step_{dist}"] = (
                times[f"zo_host_{dist}"].min_s / times[f"zo_step_{dist}"].min_s
            )
            # what the parts timed alone leave of the step: waits between its calls (0 or below: none)
            ratios[f"unattributed_fraction_of_step_{dist}"] = 1.0 - parts / times[f"zo_step_{dist}"].min_s
        if "flat" in groups:
            for key, name, note in (
                ("zo_step", f"ZO step n={n} {dist} (flat layout)", "mezo_step on replay.flatten(params)"),
                ("zo_pg", "  projected gradients (flat layout)", "the same program, unflattened inside"),
                ("zo_update", "  update (replay, flat layout)", "replay(flat, donate=True)"),
            ):
                rows.append(
                    _row(
                        name,
                        times[f"{key}_flat_{dist}"],
                        mem[f"{key}_flat_{dist}"],
                        2 * n if key != "zo_update" else None,
                        t_fwd,
                        m_fwd,
                        note,
                    )
                )
                if "step" in groups:
                    ratios[f"flat_{key[3:]}_time_over_tree_{dist}"] = (
                        times[f"{key}_flat_{dist}"].min_s / times[f"{key}_{dist}"].min_s
                    )
            ratios[f"zo_time_over_forwards_flat_{dist}"] = times[f"zo_step_flat_{dist}"].min_s / (2 * n * t_fwd)
            ratios[f"flat_same_bits_{dist}"] = float(same[f"flat_{dist}"])
        if "flat_held" in groups:
            rows.append(
                _row(
                    f"ZO step n={n} {dist} (flat layout), update held",
                    times[f"zo_held_flat_{dist}"],
                    mem[f"zo_held_flat_{dist}"],
                    2 * n,
                    t_fwd,
                    m_fwd,
                    "mezo_step(hold=True) on replay.flatten(params): what the trainer runs on a GPU",
                )
            )
            ratios[f"zo_time_over_forwards_flat_held_{dist}"] = times[f"zo_held_flat_{dist}"].min_s / (2 * n * t_fwd)
            ratios[f"zo_memory_over_inference_flat_held_{dist}"] = mem[f"zo_held_flat_{dist}"]["peak"] / m_fwd
            ratios[f"held_same_bits_flat_{dist}"] = float(same[f"held_flat_{dist}"])
        for group, f, held_group, label, runs in (
            ("deferred", "_flat", "flat_held", " (flat layout)", "on the flat layout"),
            ("deferred_tree", "", "held", "", "on the tree"),
        ):
            if group not in groups:
                continue
            key = f"zo_held_deferred{f}_{dist}"
            rows.append(
                _row(
                    f"ZO step n={n} {dist}{label}, update held, deferred",
                    times[key],
                    mem[key],
                    2 * n,
                    t_fwd,
                    m_fwd,
                    f"mezo_step(hold=True, defer=True) {runs}, codec onebyte (the trainer's step on a "
                    f"{'GPU' if f else 'CPU'}): {DEFERRED_CHAIN} steps in a row, each dispatched before "
                    "the last is fetched; per step",
                )
            )
            ratios[f"zo_time_over_forwards{f}_deferred_{dist}"] = times[key].min_s / (2 * n * t_fwd)
            ratios[f"zo_time_over_forwards{f}_deferred_{dist}_medians"] = times[key].median_s / (2 * n * t_fwd_median)
            ratios[f"zo_memory_over_inference{f}_deferred_{dist}"] = mem[key]["peak"] / m_fwd
            if held_group in groups:
                ratios[f"deferred_time_over_held{f}_{dist}"] = times[key].min_s / times[f"zo_held{f}_{dist}"].min_s
            ratios[f"deferred_same_bits{f}_{dist}"] = float(same[f"held_deferred{f}_{dist}"])
    for dist in distributions if unroll else ():
        for suffix, label in (("", ""), *((("_flat", " (flat layout)"),) if flat else ())):
            key = f"zo_pg_unrolled{suffix}_{dist}"
            rows.append(
                _row(
                    f"  projected gradients{label}, unrolled",
                    times[key],
                    mem[key],
                    2 * n,
                    t_fwd,
                    m_fwd,
                    "the same forwards as straight-line code, not a loop",
                )
            )
            loop = f"zo_pg{suffix}_{dist}"
            ratios[f"unrolled_pg_time_over_loop{suffix}_{dist}"] = times[key].min_s / times[loop].min_s
            ratios[f"unrolled_memory_over_loop{suffix}_{dist}"] = mem[key]["peak"] / mem[loop]["peak"]
            ratios[f"unrolled_same_bits{suffix}_{dist}"] = float(same[f"unrolled{suffix}_{dist}"])
        if flat and "flat_held" in groups:
            key = f"zo_held_flat_unrolled_{dist}"
            rows.append(
                _row(
                    f"ZO step n={n} {dist} (flat layout), update held, unrolled",
                    times[key],
                    mem[key],
                    2 * n,
                    t_fwd,
                    m_fwd,
                    "mezo_step(hold=True, unroll=True) on replay.flatten(params)",
                )
            )
            ratios[f"zo_time_over_forwards_flat_held_unrolled_{dist}"] = times[key].min_s / (2 * n * t_fwd)
            ratios[f"zo_memory_over_inference_flat_held_unrolled_{dist}"] = mem[key]["peak"] / m_fwd
            ratios[f"held_same_bits_flat_unrolled_{dist}"] = float(same[f"held_flat_unrolled_{dist}"])
    if "backprop" in groups:
        rows.append(
            _row(
                "backprop step (sgd)",
                times["backprop"],
                mem["backprop"],
                None,
                t_fwd,
                m_fwd,
                f"value_and_grad + optax.sgd, donated, {_describe(backprop_options)}",
            )
        )
        ratios["backprop_time_over_two_forwards"] = times["backprop"].min_s / (2 * t_fwd)
        ratios["backprop_time_over_two_forwards_medians"] = times["backprop"].median_s / (2 * t_fwd_median)
        ratios["backprop_memory_over_inference"] = mem["backprop"]["peak"] / m_fwd
    profiled: dict[str, Any] = {}
    if profile_calls:
        progress(f"profiling the forward and each ZO step, {profile_calls} calls each")
        fastest = min(fwd_variants, key=lambda k: times[f"forward_{k}"].min_s)
        # (label, its fns key, its ratios' suffix) of each ZO row present
        zo_rows = [
            (label, key, suffix)
            for label, key, suffix, group in (
                ("", "zo_step", "", "step"),
                (" (flat layout)", "zo_step_flat", "_flat", "flat"),
                (", update held", "zo_held", "_held", "held"),
                (" (flat layout), update held", "zo_held_flat", "_flat_held", "flat_held"),
                (f" (flat layout), update held, deferred x{DEFERRED_CHAIN}", "zo_held_deferred_flat", None, "deferred"),
                (f", update held, deferred x{DEFERRED_CHAIN}", "zo_held_deferred", None, "deferred_tree"),
                (
                    " (flat layout), update held, unrolled",
                    "zo_held_flat_unrolled",
                    "_flat_held_unrolled",
                    "flat_held" if unroll else None,
                ),
            )
            if group in groups
        ]
        profiled = _profile_rows(
            {
                "inference forward": fns[f"forward_{fastest}"],
                **{f"ZO step {d}{label}": fns[f"{key}_{d}"] for label, key, _ in zo_rows for d in distributions},
            },
            profile_calls,
        )
        if "error" not in profiled:
            fwd_busy = profiled["inference forward"]["busy_s_per_call"]
            for dist in distributions:
                if "step" in groups and fwd_busy > 0:
                    ratios[f"zo_busy_over_forwards_{dist}"] = profiled[f"ZO step {dist}"]["busy_s_per_call"] / (
                        2 * n * fwd_busy
                    )
                for label, _, suffix in zo_rows:
                    if suffix is not None:
                        prof = profiled[f"ZO step {dist}{label}"]
                        ratios[f"zo_idle_fraction{suffix}_{dist}"] = prof["idle_s_per_call"] / prof["wall_s_per_call"]
    result = {
        "benchmark": "zo",
        "config": {
            "model": model,
            "model_kwargs": kwargs,
            "batch": batch,
            "width": None if model in PRETRAINED_MODELS else width,
            "input_shape": input_shape,
            "n_perturbations": n,
            "codec": codec,
            "flat": flat,
            "unroll": unroll,
            "rows": list(groups),
            "zo_perturb": os.environ.get(zo.estimator.PERTURB_ENV, "auto"),
            "distributions": list(distributions),
            "params": n_params,
            "param_bytes": int(param_bytes),
            "largest_leaf_bytes": largest_leaf,
        },
        "memory_measure": "Compiled.memory_analysis(): argument + output + temp - alias bytes of each compiled program",
        "compiler_options": {
            "candidates": zo.autotune.compiler_option_candidates(),
            "chosen": chosen,
            **({"compared": {d: _options(chosen[d], zo_options) for d in distributions}} if zo_options else {}),
        },
        "environment": _common.environment(),
        "rows": rows,
        "ratios": ratios,
        "targets": {k: f"{op} {v:.3g}" for k, (op, v) in TARGETS.items()},
    }
    if profile_calls:
        result["profile"] = profiled
    return result


def _row_groups(rows, flat: bool) -> tuple[str, ...]:
    """The groups of :data:`ROW_GROUPS` to run, in their order: ``rows`` (names, or None for every
    group, the flat ones only with ``flat``, ``deferred_tree`` only where the trainer keeps the tree:
    :func:`zeroth.replay.preferred_layout` of the default platform, a CPU's).

    Raises:
      ValueError: an unknown or repeated group, none, or ``flat`` with no flat group among ``rows``.
    """
    if rows is None:  # the tree's deferred step where the trainer keeps the tree (a CPU; a GPU trains flat)
        tree_trains = replay.preferred_layout(_rule.default_platform()) == "tree"
        return tuple(g for g in ROW_GROUPS if (flat or g not in _FLAT_GROUPS) and (tree_trains or g != "deferred_tree"))
    rows = [str(r).strip() for r in rows]
    unknown = [r for r in rows if r not in ROW_GROUPS]
    if unknown or not rows or len(set(rows)) != len(rows):
        raise ValueError(
            f"--rows takes distinct groups among {', '.join(ROW_GROUPS)} (comma-separated), got {','.join(rows)!r}"
            + (f": {unknown} unknown" if unknown else "")
        )
    if flat and not any(r in _FLAT_GROUPS for r in rows):
        raise ValueError(
            f"--flat adds the flat layout's rows, and --rows {','.join(rows)} names none of them "
            f"({', '.join(_FLAT_GROUPS)})"
        )
    return tuple(g for g in ROW_GROUPS if g in rows)


def _step_rows(fns, mem, chosen, pg, params, data, keys, eps, scales, codec: str, loss_fn, dist: str, n: int) -> None:
    """The ZO step on the tree and its parts (the projected gradients, the update as ``mezo_step``
    runs it, the projected gradients fetched, the host work), added to ``fns`` and ``mem`` under
    ``zo_{step,pg,update,fetch,host}_{dist}``; ``chosen[dist]``: the estimator's compiler options."""
    # the update as mezo_step runs it: replay(..., donate=True), the fused kernels in place
    upd = jax.jit(functools.partial(fused.apply_updates, distribution=dist, inplace=True), donate_argnums=0)
    mem[f"zo_pg_{dist}"] = zo.compiled_memory(pg.compiled(params, data, keys, eps))
    chosen[dist] = pg.chosen_options(params, data, keys, eps)
    mem[f"zo_update_{dist}"] = zo.compiled_memory(upd.lower(params, keys, scales).compile())
    state = {"params": jax.tree_util.tree_map(jnp.copy, params), "it": 0}

    def step():
        out = zo.mezo_step(
            loss_fn,
            state["params"],
            data,
            run_seed=0,
            iteration=state["it"],
            lr=_LR,
            eps=_EPS,
            n_perturbations=n,
            distribution=dist,
            codec=codec,
            donate=True,
        )
        state["params"] = jax.block_until_ready(out.params)
        state["it"] += 1

    ustate = {"params": jax.tree_util.tree_map(jnp.copy, params)}

    def update():
        ustate["params"] = jax.block_until_ready(upd(ustate["params"], keys, scales))

    fns[f"zo_step_{dist}"] = step
    fns[f"zo_pg_{dist}"] = lambda: jax.block_until_ready(pg(params, data, keys, eps))
    fns[f"zo_update_{dist}"] = update
    # the step's other parts: its projected gradients fetched to the host as mezo_step does
    # (device_get, not block_until_ready), and its host work alone (keys, codec, coefficients, scales)
    fns[f"zo_fetch_{dist}"] = lambda: jax.device_get(pg(params, data, keys, eps))
    fns[f"zo_host_{dist}"] = functools.partial(_host_work, jax.device_get(pg(params, data, keys, eps)), n, dist, codec)


def _backprop_row(fns, loss_fn, params, data, variants: dict, opt) -> tuple[dict, dict | None]:
    """The backprop step (``value_and_grad`` + ``opt``, parameters donated), compiled under each
    option set of ``variants`` and the smallest peak kept, added to ``fns`` as ``backprop``;
    returns its memory and its options."""
    import optax

    def bp_step(p, s, b):
        with jax.numpy_dtype_promotion("standard"):
            loss, g = jax.value_and_grad(loss_fn)(p, b)
            updates, s = opt.update(g, s, p)
            return optax.apply_updates(p, updates), s, loss

    bstate = {"params": jax.tree_util.tree_map(jnp.copy, params)}
    bstate["opt"] = opt.init(bstate["params"])
    bp_lowered = jax.jit(bp_step, donate_argnums=(0, 1)).lower(bstate["params"], bstate["opt"], data)
    bp_compiled = [bp_lowered.compile(o) for o in variants.values()]
    bp_mem = [zo.compiled_memory(c) for c in bp_compiled]
    best = int(np.argmin([m["peak"] for m in bp_mem]))
    bp = bp_compiled[best]

    def backprop():
        p, s, _ = bp(bstate["params"], bstate["opt"], data)
        bstate["params"], bstate["opt"] = jax.block_until_ready((p, s))

    fns["backprop"] = backprop
    return bp_mem[best], list(variants.values())[best]


def _flat_rows(
    fns, mem, same, loss_fn, params, flat, data, keys, eps, coefficients, pg, dist: str, n: int, codec: str
) -> None:
    """The ZO step, its projected gradients and its update on the parameters' ``replay.Flat``
    (``flat``, read only), added to ``fns`` and ``mem`` (the step's: :func:`_step_memory`) under ``*_flat_{dist}``; ``same["flat_{dist}"]``: whether the
    flat estimator gives the tree's projected gradients and losses, bit for bit."""
    same[f"flat_{dist}"] = _same_bits(pg(params, data, keys, eps), pg(flat, data, keys, eps))
    mem[f"zo_pg_flat_{dist}"] = zo.compiled_memory(pg.compiled(flat, data, keys, eps))
    updates = (keys, coefficients)  # the tree's update row's
    fstate = {"step": replay.flatten(params), "update": replay.flatten(params), "it": 0}
    program = replay._flat_fn(flat.layout, dist, True, "auto")  # what replay(flat, donate=True) calls
    mem[f"zo_update_flat_{dist}"] = zo.compiled_memory(
        program.lower(
            flat.buffers, fused.dispatch.pack_updates(keys, replay.update_scales(dist, coefficients))
        ).compile()
    )
    mem[f"zo_step_flat_{dist}"] = _step_memory(mem[f"zo_pg_flat_{dist}"], mem[f"zo_update_flat_{dist}"])

    def step():
        res = zo.mezo_step(
            loss_fn,
            fstate["step"],
            data,
            run_seed=0,
            iteration=fstate["it"],
            lr=_LR,
            eps=_EPS,
            n_perturbations=n,
            distribution=dist,
            codec=codec,
            donate=True,
        )
        fstate["step"] = jax.block_until_ready(res.params)
        fstate["it"] += 1

    def update():
        fstate["update"] = jax.block_until_ready(
            replay.replay(fstate["update"], updates, distribution=dist, donate=True)
        )

    fns[f"zo_step_flat_{dist}"] = step
    fns[f"zo_pg_flat_{dist}"] = lambda: jax.block_until_ready(pg(flat, data, keys, eps))
    fns[f"zo_update_flat_{dist}"] = update


def _unrolled_rows(
    fns,
    mem,
    same,
    loss_fn,
    params,
    flat,
    data,
    keys,
    eps,
    scales,
    pg,
    dist: str,
    n: int,
    codec: str,
    *,
    held_flat: bool = True,
) -> None:
    """The projected gradients with their forwards unrolled, on the tree (and its ``Flat`` ``flat``,
    read only, unless None; with the held step there where ``held_flat``), beside the loop's: ``fns``/``mem`` under ``zo_pg_unrolled[_flat]_{dist}``
    (and ``zo_held_flat_unrolled_{dist}``); ``same["unrolled[_flat]_{dist}"]``: the same projected
    gradients and losses, bit for bit."""
    unrolled = zo.projected_gradients_fn(loss_fn, distribution=dist, unroll=True)
    for suffix, p in (("", params), *((("_flat", flat),) if flat is not None else ())):
        key = f"zo_pg_unrolled{suffix}_{dist}"
        mem[key] = zo.compiled_memory(unrolled.compiled(p, data, keys, eps))
        same[f"unrolled{suffix}_{dist}"] = _same_bits(pg(p, data, keys, eps), unrolled(p, data, keys, eps))
        fns[key] = lambda p=p: jax.block_until_ready(unrolled(p, data, keys, eps))
    if flat is not None and held_flat:
        _held_rows(
            fns, mem, same, loss_fn, params, data, keys, eps, scales, unrolled, dist, n, codec, flat=True, unroll=True
        )


# A deferred step is timed over this many steps in a row (each dispatched before the one before it
# is fetched, as the trainer runs them), the call's time divided by it.
DEFERRED_CHAIN = 8


def _held_rows(
    fns,
    mem,
    same,
    loss_fn,
    params,
    data,
    keys,
    eps,
    scales,
    pg,
    dist: str,
    n: int,
    codec: str,
    *,
    flat: bool,
    unroll: bool = False,
    defer: bool = False,
) -> None:
    """The ZO step with its update held (``mezo_step(..., hold=True)``: each step applies the last
    one's update in its own program, one compiled call per step), on the tree or its ``Flat``,
    added to ``fns`` and ``mem`` (the one program's) under ``zo_held[_flat]_{dist}``;
    ``same["held[_flat]_{dist}"]``: whether three held steps and a settle give the projected
    gradients and parameters of three steps that apply their updates, bit for bit.

    ``defer``: the deferred step instead (``mezo_step(..., defer=True)``, the one-byte codec
    whatever ``codec`` is; under ``zo_held_deferred[_flat]_{dist}``): a call runs
    :data:`DEFERRED_CHAIN` steps, each fetched by the next, the last by the call, and is divided
    by it (:func:`_per_step`)."""
    tag = (
        "held"
        + ("_deferred" if defer else "")
        + ("_flat" if flat else "")
        + ("_unrolled" if unroll else "")
        + f"_{dist}"
    )
    codec = "onebyte" if defer else codec

    def fresh():
        p = jax.tree_util.tree_map(jnp.copy, params)
        return replay.flatten(p, donate=True) if flat else p

    def mezo(p, it, hold: bool):
        return zo.mezo_step(
            loss_fn,
            p,
            data,
            run_seed=0,
            iteration=it,
            lr=_LR,
            eps=_EPS,
            n_perturbations=n,
            distribution=dist,
            codec=codec,
            donate=True,
            hold=hold,
            unroll=unroll,
            defer=hold and defer,
        )

    def run(hold: bool):
        p, outs = fresh(), []
        for it in range(3):
            out = mezo(p, it, hold)
            p = out.params
            outs.append(out)
        grads = [(out.result() if isinstance(out, zo.Deferred) else out).grads for out in outs]
        return replay.checksum(zo.settle(p)), np.stack(grads).view(np.uint32)

    (d_applied, g_applied), (d_held, g_held) = run(False), run(True)
    same[tag] = d_applied == d_held and np.array_equal(g_applied, g_held)
    start = fresh()
    enc = (zo.step.onebyte_scales(_LR, n, "sqrt", dist), None) if defer else None
    mem[f"zo_{tag}"] = zo.compiled_memory(pg.compiled_after_update(start, (keys, scales, None), data, keys, eps, enc))
    state = {"params": start, "it": 0}

    def step():
        out = mezo(state["params"], state["it"], True)
        state["params"] = jax.block_until_ready(out.params)
        state["it"] += 1

    def chain():
        for _ in range(DEFERRED_CHAIN):
            out = mezo(state["params"], state["it"], True)
            state["params"] = out.params
            state["it"] += 1
        out.result()  # the last step's outcome, fetched: its program has run

    fns[f"zo_{tag}"] = chain if defer else step


def _per_step(timing: _common.Timing) -> _common.Timing:
    """A deferred chain's timing per step (:data:`DEFERRED_CHAIN`)."""
    return timing._replace(
        min_s=timing.min_s / DEFERRED_CHAIN,
        median_s=timing.median_s / DEFERRED_CHAIN,
        cpu_min_s=timing.cpu_min_s / DEFERRED_CHAIN,
    )


def _host_work(fetched, n: int, dist: str, codec: str) -> None:
    """What :func:`zeroth.zo.mezo_step` does on the host alone, on a step's fetched projected
    gradients: the keys' derivation, the codec, the coefficients and the replay's scales."""
    rng.sample_keys(0, [(0, 1, i) for i in range(n)])
    _, _, coefficients = zo.step._host_update(*fetched, codecs.get_codec(codec), _LR, "sqrt", iteration=1, eps=_EPS)
    replay.update_scales(dist, list(coefficients))


def _same_bits(a, b) -> bool:
    """Whether two programs' outputs (projected gradients and losses, float32) are equal bit for bit."""
    a, b = jax.device_get((a, b))
    return all(np.array_equal(np.asarray(x).view(np.uint32), np.asarray(y).view(np.uint32)) for x, y in zip(a, b))


def _step_memory(pg: dict, update: dict) -> dict:
    """A ZO step's memory: its two programs run one after the other, so its peak is the larger."""
    return dict(pg, peak=max(pg["peak"], update["peak"]))


def _profile_rows(fns: dict[str, Callable[[], Any]], calls: int) -> dict[str, Any]:
    """:func:`zeroth.bench.profile.profile` of each row, or ``{"error": ...}`` if the profiler fails."""
    try:
        return {name: _profile.profile(fn, calls=calls) for name, fn in fns.items()}
    except Exception as exc:  # noqa: BLE001 - a profiler that cannot run must not lose the timings
        return {"error": f"{type(exc).__name__}: {exc}"}


def _row(
    name: str, timing: _common.Timing, memory: dict, forwards: int | None, t_fwd: float, m_fwd: int, note: str
) -> dict:
    return {
        "name": name,
        "seconds_min": timing.min_s,
        "seconds_median": timing.median_s,
        "cpu_seconds_min": timing.cpu_min_s,
        "repeats": timing.repeats,
        "forwards": forwards,
        "time_over_forward": timing.min_s / t_fwd,
        "peak_bytes": memory["peak"],
        "temp_bytes": memory["temp"],
        "memory_over_inference": memory["peak"] / m_fwd,
        "note": note,
    }


def _options(chosen: dict, changes: dict) -> dict:
    """The chosen options updated by ``--zo-option`` changes."""
    return {**chosen, **changes}


def parse_option(text: str) -> tuple[str, Any]:
    """``NAME=VALUE`` of ``--zo-option``: VALUE as a bool (true/false), an int, a float, else a string (may be empty).

    Raises:
      ValueError: no ``=``, or no name before it.

    Example:
      >>> parse_option("xla_disable_hlo_passes="), parse_option("xla_gpu_autotune_level=0")
      (('xla_disable_hlo_passes', ''), ('xla_gpu_autotune_level', 0))
    """
    name, eq, value = text.partition("=")
    name = name.strip()
    if not eq or not name:
        raise ValueError(f"--zo-option takes NAME=VALUE (an XLA compiler option), got {text!r}")
    if value.lower() in ("true", "false"):
        return name, value.lower() == "true"
    for kind in (int, float):
        try:
            return name, kind(value)
        except ValueError:
            pass
    return name, value


def _describe(opts: dict | None) -> str:
    """A short name for a compiler option set."""
    if not opts:
        return "XLA default options"
    return "zo options" + (", individual library ops" if "xla_cpu_experimental_ynn_fusion_type" in opts else "")


def _mib(b: int) -> str:
    return f"{b / 2**20:.2f} MiB"


def _render(result: dict) -> None:
    c, env = result["config"], result["environment"]
    print(
        f"zeroth bench zo: {c['model']} {c['model_kwargs']}, {c['params']:,} parameters ({_mib(c['param_bytes'])}, "
        f"largest leaf {_mib(c['largest_leaf_bytes'])}), batch {c['batch']} x {tuple(c['input_shape'])}, "
        f"n={c['n_perturbations']}"
    )
    print(f"  {_common.machine_line(env)}; best of {result['rows'][0]['repeats']}, memory = {result['memory_measure']}")
    table = [
        {
            **row,
            "best": _common.fmt_seconds(row["seconds_min"]),
            "median": _common.fmt_seconds(row["seconds_median"]),
            "cpu": _common.fmt_seconds(row["cpu_seconds_min"]),
            "tf": f"{row['time_over_forward']:.2f}",
            "peak": _mib(row["peak_bytes"]),
            "temp": _mib(row["temp_bytes"]),
            "mr": f"{row['memory_over_inference']:.2f}",
        }
        for row in result["rows"]
    ]
    _common.print_table(
        [
            ("name", "row"),
            ("best", "best"),
            ("median", "median"),
            ("cpu", "best CPU time"),
            ("forwards", "fwd passes"),
            ("tf", "time/fwd"),
            ("peak", "peak memory"),
            ("temp", "temp"),
            ("mr", "mem/inference"),
            ("note", "note"),
        ],
        table,
    )
    print()
    for name, value in result["ratios"].items():
        key = next((k for k in result["targets"] if name.startswith(k)), None)
        verdict = ""
        if key is not None:
            op, bound = TARGETS[key]
            verdict = ": met" if (value <= bound if op == "<=" else value >= bound) else ": MISSED"
        print(f"  {name:<40} {value:>7.3f}" + (f"   (target {result['targets'][key]}{verdict})" if key else ""))
    if "profile" in result:
        _render_profile(result["profile"])


def _render_profile(profiled: dict) -> None:
    print()
    if "error" in profiled:
        print(f"profile: the JAX profiler failed ({profiled['error']})")
        return
    first = next(iter(profiled.values()))
    print(
        f"profile: {first['calls']} calls of each row under the JAX profiler; ops = "
        f"{'the device ops' if first['source'] == 'device' else 'the XLA CPU runtime thunks'}; "
        "idle = wall - busy (no op running)"
    )
    _common.print_table(
        [
            ("name", "row"),
            ("wall", "wall/call"),
            ("busy", "busy/call"),
            ("idle", "idle/call"),
            ("ops", "ops/call"),
            ("programs", "busy per program"),
        ],
        [
            {
                "name": name,
                "wall": _common.fmt_seconds(p["wall_s_per_call"]),
                "busy": _common.fmt_seconds(p["busy_s_per_call"]),
                "idle": _common.fmt_seconds(p["idle_s_per_call"]),
                "ops": f"{p['ops_per_call']:.0f}",
                "programs": ", ".join(
                    f"{m or '?'} {_common.fmt_seconds(t)}" for m, t in list(p["programs"].items())[:4]
                ),
            }
            for name, p in profiled.items()
        ],
    )
    for name, p in profiled.items():
        if name == "inference forward":
            continue
        print(f"\n  ops of {name} by time:")
        _common.print_table(
            [("op", "op"), ("program", "program"), ("count", "count/call"), ("time", "time/call")],
            [
                {
                    "op": o["op"],
                    "program": o["program"] or "?",
                    "count": f"{o['count_per_call']:.2f}",
                    "time": _common.fmt_seconds(o["s_per_call"]),
                }
                for o in p["top_ops"]
            ],
        )


def main(argv: list[str] | None = None) -> int:
    """``zeroth bench zo``: returns 0 (the numbers are printed, never judged), 2 on a bad argument or missing weights."""
    p = _common.base_parser("zeroth bench zo", "ZO step vs two forwards and inference memory, next to a backprop step.")
    p.add_argument(
        "--model",
        default="mlp",
        choices=MODELS,
        help="zeroth's mlp, cnn, transformer, or a pretrained model: smollm2, smollm2_unrolled, minilm (default mlp)",
    )
    p.add_argument("--batch", type=int, default=None, help="batch size (default 256; 8 for the pretrained models)")
    p.add_argument(
        "--width",
        type=int,
        default=1024,
        help="model size: mlp hidden (W, W); cnn features (W/32, W/16), dense W/8; transformer d_model W/8 (default 1024; "
        "not used by the pretrained models)",
    )
    p.add_argument(
        "--seq-len",
        type=int,
        default=None,
        help="pretrained models: tokens per prompt (default 40 for smollm2, 64 for minilm)",
    )
    p.add_argument(
        "--weights",
        default="pretrained",
        choices=_pretrained_bench.WEIGHTS,
        help="pretrained models: their weights (default), or random: SmolLM2's architecture with random "
        "weights and tokens, without its package (time and memory only)",
    )
    p.add_argument("--n", type=int, default=1, help="perturbations per ZO step (default 1)")
    p.add_argument(
        "--codec", default="float32", choices=sorted(codecs.CODECS), help="projected-gradient codec (default float32)"
    )
    p.add_argument("--distribution", default="both", choices=["both", *noise.EXACT], help="exact noise (default both)")
    p.add_argument(
        "--profile",
        type=int,
        nargs="?",
        const=3,
        default=0,
        metavar="CALLS",
        help="also run the forward and each ZO step CALLS more times (default 3) under the JAX profiler and "
        "show where the time goes: busy and idle time, each program, the ops by time",
    )
    p.add_argument(
        "--flat",
        action="store_true",
        help="also run the ZO step, its projected gradients and its update on replay.flatten(params) (a "
        "buffer per dtype, and one per large leaf, instead of an array per leaf) and time them beside the tree's",
    )
    p.add_argument(
        "--unroll",
        action="store_true",
        help="also time the projected gradients with their forward passes as straight-line code instead of "
        "a loop (and, with --flat, the held step on the flat layout so): time, memory and bits beside the loop's",
    )
    p.add_argument(
        "--rows",
        type=lambda t: tuple(t.split(",")),
        default=None,
        metavar="GROUP,...",
        help="time only these groups of rows, with the inference forward (default all; the flat ones with "
        "--flat, which a flat group implies): " + "; ".join(f"{k}: {v}" for k, v in ROW_GROUPS.items()),
    )
    p.add_argument(
        "--zo-option",
        action="append",
        default=[],
        metavar="NAME=VALUE",
        help="also time the projected-gradients program compiled with this XLA option changed (repeatable), "
        "e.g. xla_disable_hlo_passes= to run loop-invariant code motion: its time, memory and bits beside the chosen one",
    )

    def measure(args) -> dict:
        dists = noise.EXACT if args.distribution == "both" else (args.distribution,)
        return run(
            args.model,
            batch=args.batch,
            width=args.width,
            n=args.n,
            seq_len=args.seq_len,
            weights=args.weights,
            codec=args.codec,
            distributions=dists,
            repeats=args.repeats,
            warmup=args.warmup,
            profile_calls=args.profile,
            zo_options=dict(parse_option(o) for o in args.zo_option),
            flat=args.flat,
            unroll=args.unroll,
            rows=args.rows,
            progress=_common.Progress(p.prog),
        )

    return _common.run_cli(p, argv, measure, _render)


if __name__ == "__main__":
    sys.exit(main())
