"""``zeroth bench memory [--json] [--target host|h100] [--model M] [--width W] [--batch B] [--flat]``.

XLA's compiled memory of a ZO step's program beside inference's, for this machine's backend or
for a GPU that this machine does not have. Nothing runs: each program is lowered and compiled,
and ``Compiled.memory_analysis()`` gives its peak (``argument + output + temp − alias`` bytes),
the measure ``zeroth bench zo`` reports beside its timings.

* ``--target host`` compiles for this process's default backend, as ``zeroth bench zo`` does;
* ``--target h100`` compiles for an NVIDIA H100 without one (deviceless: jax's CUDA plugin
  compiles for a described device, :data:`TARGETS`), so the memory of a GPU's programs can be
  read, and a change to them checked, on a machine with a CPU only. XLA cannot autotune Triton's
  matrix-multiply tilings without the device, so the programs use cuBLAS for them
  (``xla_gpu_enable_triton_gemm`` off); the docs' measurement pages compare its ratios with
  those a device measured. It needs jax's CUDA plugin and the CUDA runtime
  (:data:`CUDA_PACKAGES`, no GPU and no driver), found in ``.venv/cuda-compiler/`` where
  ``scripts/install_device_compilers.sh`` (run by ``make test``) puts them
  (:func:`compiler_folder`) or among the installed packages: a missing one is an error naming
  the commands that install them.

Rows: the inference forward under XLA's default options and under each option set of
:func:`zeroth.zo.autotune.compiler_option_candidates` (the baseline is the smallest peak), then per
distribution the ZO projected-gradients program (2N forwards at ``θ ± εz``, the program of a ZO
step that holds the most) under each option set :func:`zeroth.zo.autotune.estimator_option_candidates`
gives, the one the estimator keeps (:func:`zeroth.zo.autotune.kept_candidate`) marked, and those the estimator does not
compile, after the round (pairs on a CPU, one at a time elsewhere) of one near the least memory
(:func:`zeroth.zo.autotune.near_least_memory`), marked "not compiled" (compiled here all the same, to be
shown); with ``--flat`` the same on ``replay.flatten(params)``. Each row gives the seconds its
compilation took ("compile"). The ratios ``zo_memory_over_inference_{dist}`` (and ``_flat``) are
the kept program's peak over inference's, target ``<= 1.2`` as in ``zeroth bench zo``.

Each row also counts the operations one call of the program runs (:func:`ops_run`, "ops run"):
on a GPU each is a kernel or a library call, what a step too small to fill the device waits on.
``zo_ops_over_forwards_{dist}`` (and ``_flat``) is the kept program's count over 2N forwards'
(the forward of the smallest peak): no target, a count to read beside the GPU's timings.

Example:
  $ zeroth bench memory --model transformer --width 4096 --target h100
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import importlib.util
import os
import re
import sys
import time
from pathlib import Path
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from zeroth import noise, replay, rule, zo
from zeroth.bench import _common
from zeroth.bench import profile as _profile
from zeroth.bench import pretrained as _pretrained_bench
from zeroth.bench import zo as _zo_bench
from zeroth.data.resources import MissingPackage

__all__ = ["main", "run", "ops_run", "Target", "TARGETS", "CUDA_PACKAGES", "compiler_folder"]

# NVIDIA H100 80GB HBM3 (SXM), as XLA's GPU compiler describes a device (GpuTargetConfigProto).
_H100 = """
gpu_device_info {
  threads_per_block_limit: 1024
  threads_per_warp: 32
  shared_memory_per_block: 49152
  shared_memory_per_core: 233472
  threads_per_core_limit: 2048
  core_count: 132
  fpus_per_core: 128
  block_dim_limit_x: 2147483647
  block_dim_limit_y: 65535
  block_dim_limit_z: 65535
  memory_bandwidth: 3352320000000
  l2_cache_size: 52428800
  clock_rate_ghz: 1.98
  device_memory_size: 84929347584
  shared_memory_per_block_optin: 232448
  cuda_compute_capability { major: 9 }
  registers_per_core_limit: 65536
  registers_per_block_limit: 65536
}
platform_name: "CUDA"
dnn_version_info { major: 9 minor: 7 }
runtime_version { major: 12 minor: 8 patch: 0 }
device_description_str: "NVIDIA H100 80GB HBM3"
"""


class Target(NamedTuple):
    """A device compiled for without one: jax's platform, the topology's name and arguments
    (``jax.experimental.topologies.get_topology_desc``), the compiler options every program of it
    takes, the packages that compile for it (``{v}``: the installed jax's version), the module
    that says they are importable, and the folder ``scripts/install_device_compilers.sh`` installs
    them in (relative to the virtual environment, or the environment variable naming another)."""

    platform: str
    topology: str
    topology_args: dict[str, Any]
    options: dict[str, Any]
    packages: tuple[str, ...]
    module: str
    folder: tuple[str, str]  # (environment variable, default folder under sys.prefix)


CUDA_PACKAGES = ("jax-cuda12-plugin=={v}", "jax-cuda12-pjrt=={v}", "nvidia-cuda-runtime-cu12", "nvidia-cuda-nvcc-cu12")
# "host": this process's default backend, its own options. (A TPU compiled for without one, with
# libtpu, reports no scratch at all, not even a 64 MiB intermediate: its memory analysis is not read.)
TARGETS: dict[str, Target | None] = {
    "host": None,
    "h100": Target(
        "cuda",
        "",
        {"target_config": _H100, "topology": "1x1x1"},
        {"xla_gpu_enable_triton_gemm": False},
        CUDA_PACKAGES,
        "jax_cuda12_plugin",
        ("ZEROTH_CUDA_COMPILER", "cuda-compiler"),
    ),
}


def compiler_folder(spec: Target) -> Path:
    """Where ``scripts/install_device_compilers.sh`` puts the compiler of ``spec`` (``make test``
    runs it): ``$ZEROTH_CUDA_COMPILER``, else ``<virtual environment>/cuda-compiler``."""
    variable, default = spec.folder
    return Path(os.environ.get(variable) or Path(sys.prefix) / default)


def run(
    model: str = "transformer",
    *,
    target: str = "host",
    batch: int | None = None,
    width: int = 1024,
    n: int = 1,
    seq_len: int | None = None,
    weights: str = "pretrained",
    distributions: tuple[str, ...] = noise.EXACT,
    flat: bool = False,
    compile_profile: int = 0,
    perturb_impl: str = "auto",
    progress=_common.no_progress,
) -> dict:
    """Compile and measure; returns ``{"config", "environment", "rows", "ratios", "targets"}``.
    ``compile_profile`` > 0: each ZO program's compilations are profiled, their rows carry that
    many of the events by time (``compile_events``: XLA's passes, the kernels' LLVM and PTX work).
    ``perturb_impl``: how the ZO programs compute their perturbed leaves
    (:func:`zeroth.zo.projected_gradients`; ``"jnp"`` gives the jnp rule's programs
    for a GPU target, whose default is a kernel per leaf), to compare compile times and memory.

    Raises:
      ValueError: an unknown model, target or distribution, or a size below 1.
      MissingPackage: the target's compiler (jax's CUDA plugin) or a pretrained model's weights
        are not installed; the message is the command that installs them.
    """
    if target not in TARGETS:
        raise ValueError(f"unknown target {target!r}; expected one of {list(TARGETS)}")
    if model not in _zo_bench.MODELS:
        raise ValueError(f"unknown model {model!r}; expected one of {list(_zo_bench.MODELS)}")
    batch = _zo_bench.default_batch(model) if batch is None else batch
    if compile_profile < 0:
        raise ValueError(f"--compile-profile must be a non-negative number of events, got {compile_profile}")
    for name, v in (("batch", batch), ("width", width), ("n", n), ("seq-len", seq_len)):
        if v is not None and v < 1:
            raise ValueError(f"--{name} must be a positive integer, got {v}")
    for d in distributions:
        noise.check_distribution(d)
    device, sharding, options = _target(target)
    progress(f"setting up {model}")
    kwargs, params, data, loss_fn = _zo_bench.setup(model, width, batch, seq_len, weights)
    # the flat layout of the target's platform (a TPU's buffers are padded to whole blocks)
    family = None if device is None else rule.platform_name(device.platform)
    layouts = {"": params, **({"_flat": replay.flatten(params, platform=family)} if flat else {})}

    def abstract(tree):
        return jax.tree_util.tree_map(
            lambda x: jax.ShapeDtypeStruct(np.shape(x), jnp.result_type(x), sharding=sharding), tree
        )

    rows, ratios = [], {}
    # the platform zeroth's programs are traced for: the target's (jnp rule, its compiler options)
    place = contextlib.nullcontext() if device is None else jax.default_device(device)
    with place:
        fwd = jax.jit(loss_fn).lower(abstract(params), abstract(data))
        fwd_rows = []
        for opts in (None, *zo.autotune.compiler_option_candidates()):
            progress(f"compiling the forward ({_describe(opts)})")
            fwd_rows.append(_compiled_row("inference forward", opts, fwd, options))
        baseline = fwd_rows[zo.autotune.kept_candidate([r["peak_bytes"] for r in fwd_rows], within=0)]
        m_fwd = baseline["peak_bytes"]
        rows += fwd_rows
        keys = jax.ShapeDtypeStruct((n, 2), jnp.uint32, sharding=sharding)
        eps = jax.ShapeDtypeStruct((), jnp.float32, sharding=sharding)
        for dist in distributions:
            pg = zo.projected_gradients_fn(loss_fn, distribution=dist, perturb_impl=perturb_impl)
            for suffix, p in layouts.items():
                lowered = pg.lowered(abstract(p), abstract(data), keys, eps)
                name = f"ZO projected gradients n={n} {dist}" + (" (flat layout)" if suffix else "")
                found, compiled = [], []
                for opts in zo.autotune.estimator_option_candidates(p):
                    progress(f"compiling {name} ({_describe(opts)})")
                    found.append(_compiled_row(name, opts, lowered, options, compiled, compile_profile))
                # what the estimator compiles (zo.autotune.compile_candidates with zo.autotune.near_least_memory): in
                # rounds, up to the end of the first holding one near the least memory
                upto = zo.autotune.compiled_count([zo.autotune.near_least_memory(c) for c in compiled], family)
                kept = zo.autotune.kept_candidate([r["peak_bytes"] for r in found[:upto]])
                for i, r in enumerate(found):
                    r["kept"] = i == kept
                    r["estimator_compiles"] = i < upto
                rows += found
                ratios[f"zo_memory_over_inference_{dist}{suffix}"] = found[kept]["peak_bytes"] / m_fwd
                ratios[f"zo_ops_over_forwards_{dist}{suffix}"] = found[kept]["ops_run"] / (2 * n * baseline["ops_run"])
    for r in rows:
        r["memory_over_inference"] = r["peak_bytes"] / m_fwd
    n_params = int(sum(np.size(x) for x in jax.tree_util.tree_leaves(params)))
    return {
        "config": {
            "model": model,
            "model_kwargs": kwargs,
            "target": target,
            "batch": batch,
            "n": n,
            "seq_len": seq_len,
            "weights": weights,
            "distributions": list(distributions),
            "flat": flat,
            "params": n_params,
            "compile_profile": compile_profile,
            "perturb_impl": perturb_impl,
            "extra_compiler_options": options,
        },
        "environment": _common.environment(),
        "rows": rows,
        "ratios": ratios,
        "targets": {"zo_memory_over_inference": ("<=", 1.2)},
    }


def _target(target: str):
    """``(device, sharding, compiler options)``: ``(None, None, {})`` for the host; for a described
    device, its deviceless device and a replicated sharding on it."""
    spec = TARGETS[target]
    if spec is None:
        return None, None, {}
    from jax.experimental import topologies

    if not os.environ.get("JAX_PLATFORMS"):
        # run on the host: an accelerator's backend would be started (and fail without one) only to compile
        jax.config.update("jax_platforms", "cpu")
    folder = compiler_folder(spec)
    if importlib.util.find_spec(spec.module) is None and (folder / "jax_plugins").is_dir():
        # the project's own install, kept out of the environment's packages (installed there, every jax
        # process would look for the device): jax finds the plugin there when its backends start
        sys.path.insert(0, str(folder))
    try:
        topology = topologies.get_topology_desc(spec.topology, spec.platform, **spec.topology_args)
    except (NotImplementedError, RuntimeError) as exc:
        packages = " ".join(p.format(v=jax.__version__) for p in spec.packages)
        raise MissingPackage(
            f"--target {target} compiles with jax's {spec.platform.upper()} plugin, which this process cannot load "
            f"({exc}); install what compiles for it (no device or driver is needed): scripts/install_device_compilers.sh "
            f"(into {folder}, found there), or pip install {packages}"
        ) from None
    mesh = topologies.make_mesh(topology, (1,), ("x",))
    return topology.devices[0], jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec()), spec.options


# Instructions that run no kernel of their own: names, tuples, views, ordering, the done half of
# an asynchronous pair (its start is counted). A loop or a call is counted through its body.
_FREE_OPS = frozenset(
    {
        "parameter",
        "constant",
        "get-tuple-element",
        "tuple",
        "bitcast",
        "opt-barrier",
        "after-all",
        "add-dependency",
        "domain",
        "partition-id",
        "replica-id",
        "copy-done",
        "all-reduce-done",
        "all-gather-done",
        "collective-permute-done",
        "send-done",
        "recv-done",
        "async-done",
        "async-update",
    }
)
_HEADER = re.compile(r"^(ENTRY )?%?([\w.\-]+) .*\{\s*$")
_OP = re.compile(r"=\s.*?\b([a-z][\w\-]*)\(")
_TRIP = re.compile(r'"known_trip_count":\{"n":"(\d+)"')
_NAMED = r"=%?([\w.\-]+)"


def ops_run(hlo_text: str) -> int:
    """The operations one call of a compiled program runs (``Compiled.as_text()``): on a GPU each
    is a kernel or a library call (a fusion, a cuBLAS call, a copy), the launches that a step too
    small to fill the device waits on. Instructions of the entry computation and of what it calls
    count once per run: a loop's body and condition per iteration (XLA's known trip count; a loop
    without one counts once), a conditional's largest branch; names, tuples, views and barriers
    (``_FREE_OPS``) count nothing, and neither do the instructions inside a fusion.

    Example:
      >>> text = chr(10).join([
      ...     "%body (p: (s32[], f32[8])) -> (s32[], f32[8]) {",
      ...     "  %p = (s32[], f32[8]) parameter(0)",
      ...     "  ROOT %f = (s32[], f32[8]) fusion(%p), kind=kLoop, calls=%fused",
      ...     "}",
      ...     "%cond (p: (s32[], f32[8])) -> pred[] {",
      ...     "  %p = (s32[], f32[8]) parameter(0)",
      ...     "  ROOT %c = pred[] fusion(%p), kind=kLoop, calls=%fused_lt",
      ...     "}",
      ...     "ENTRY %main (x: f32[8]) -> f32[8] {",
      ...     "  %x = f32[8]{0} parameter(0)",
      ...     "  %t = (s32[], f32[8]{0}) tuple(%x, %x)",
      ...     '  %w = (s32[], f32[8]{0}) while(%t), condition=%cond, body=%body, '
      ...     'backend_config={"known_trip_count":{"n":"2"}}',
      ...     "  %g = f32[8]{0} get-tuple-element(%w), index=1",
      ...     '  ROOT %y = f32[8]{0} custom-call(%g), custom_call_target="__cublas$gemm"',
      ...     "}"])
      >>> ops_run(text)  # 2 bodies, 3 conditions, 1 library call
      6
    """
    comps: dict[str, list[str]] = {}
    entry, current = None, None
    for line in hlo_text.splitlines():
        header = _HEADER.match(line)
        if header and not line.startswith(" "):
            current = header.group(2)
            comps[current] = []
            entry = current if header.group(1) else entry
        elif line.startswith("}"):
            current = None
        elif current is not None:
            comps[current].append(line)
    if entry is None:
        raise ValueError("ops_run: no ENTRY computation in the HLO text")

    @functools.lru_cache(maxsize=None)
    def count(name: str) -> int:
        total = 0
        for line in comps.get(name, ()):
            found = _OP.search(line)
            op = found.group(1) if found else None
            if op is None or op in _FREE_OPS:
                continue
            if op == "while":
                trip = _TRIP.search(line)
                n = int(trip.group(1)) if trip else 1
                total += n * count(re.search("body" + _NAMED, line).group(1))
                total += (n + 1) * count(re.search("condition" + _NAMED, line).group(1))
            elif op == "conditional":  # the predicate's read, and one branch
                listed = re.search(r"branch_computations=\{([^}]*)\}", line)
                branches = (
                    re.findall(r"%?([\w.\-]+)", listed.group(1))
                    if listed
                    else re.findall(r"(?:true|false)_computation" + _NAMED, line)
                )
                total += 1 + max((count(b) for b in branches), default=0)
            elif op == "call":
                total += count(re.search("to_apply" + _NAMED, line).group(1))
            else:
                total += 1
        return total

    return count(entry)


def _describe(opts: dict | None) -> str:
    return "XLA default options" if opts is None else ", ".join(f"{k}={v!r}" for k, v in opts.items())


def _compiled_row(
    name: str, opts: dict | None, lowered, options: dict, into: list | None = None, compile_profile: int = 0
) -> dict:
    """The row of ``lowered`` compiled under ``opts`` and the target's ``options``, with the
    seconds the compilation took (``compile_s``); the executable is appended to ``into``. With
    ``compile_profile`` > 0, the compilation runs under the JAX profiler and the row's
    ``compile_events`` are that many of its traced events by time (:func:`zeroth.bench.profile.traced`)."""

    def build():  # the executable and the seconds its compilation took (not the trace's reading)
        t0 = time.perf_counter()
        executable = lowered.compile({**(opts or {}), **options})
        return executable, time.perf_counter() - t0

    if compile_profile > 0:
        (compiled, seconds), events = _profile.traced(build, top=compile_profile)
    else:
        (compiled, seconds), events = build(), None
    if into is not None:
        into.append(compiled)
    memory = zo.compiled_memory(compiled)
    return {
        "name": name,
        "options": _describe(opts),
        "peak_bytes": memory["peak"],
        "temp_bytes": memory["temp"],
        "argument_bytes": memory["argument"],
        "ops_run": ops_run(compiled.as_text()),
        "compile_s": seconds,
        **({"compile_events": events} if events is not None else {}),
    }


def _mib(b: int) -> str:
    return f"{b / 2**20:.2f} MiB"


def _render(result: dict) -> None:
    cfg = result["config"]
    rows = [
        dict(
            r,
            peak=_mib(r["peak_bytes"]),
            temp=_mib(r["temp_bytes"]),
            arg=_mib(r["argument_bytes"]),
            ratio=f"{r['memory_over_inference']:.3f}",
            compile=f"{r['compile_s']:.1f} s",
            mark="kept" if r.get("kept") else ("not compiled" if r.get("estimator_compiles") is False else None),
        )
        for r in result["rows"]
    ]
    _common.print_table(
        [
            ("name", "program"),
            ("peak", "peak"),
            ("temp", "scratch"),
            ("arg", "arguments"),
            ("ratio", "/ inference"),
            ("ops_run", "ops run"),
            ("compile", "compile"),
            ("mark", "estimator"),
            ("options", "compiler options"),
        ],
        rows,
        title=f"compiled memory, {cfg['model']} ({cfg['params']:,} parameters), batch {cfg['batch']}, "
        f"target {cfg['target']} (nothing runs: XLA's memory analysis of each compiled program)",
    )
    for k, v in result["ratios"].items():
        target = result["targets"].get(k.split("_binomial")[0].split("_rademacher")[0])
        print(f"{k}: {v:.3f}" + (f" (target {target[0]} {target[1]})" if target else ""))
    for r in result["rows"]:
        if r.get("compile_events"):
            _common.print_table(
                [("event", "traced event"), ("s", "seconds"), ("count", "count"), ("threads", "threads")],
                [dict(e, s=f"{e['s']:.2f}") for e in r["compile_events"]],
                title=f"compiling {r['name']} ({r['options']}): {r['compile_s']:.1f} s, the traced events by time "
                "(times on several threads add up)",
            )


def main(argv: list[str] | None = None) -> int:
    """``zeroth bench memory``: returns 0 (the numbers are printed, never judged), 2 on a bad argument or a missing package."""
    p = argparse.ArgumentParser(
        prog="zeroth bench memory",
        description="Compiled memory of the ZO step's program beside "
        "inference's, for this machine or a GPU it does not have (nothing runs).",
    )
    p.add_argument("--json", action="store_true", help="print one JSON object instead of a table")
    p.add_argument(
        "--target",
        default="host",
        choices=list(TARGETS),
        help="host: this machine's backend; h100: an NVIDIA H100, compiled without one (default host)",
    )
    p.add_argument(
        "--model", default="transformer", choices=_zo_bench.MODELS, help="as zeroth bench zo (default transformer)"
    )
    p.add_argument("--batch", type=int, default=None, help="batch size (default 256; 8 for the pretrained models)")
    p.add_argument("--width", type=int, default=1024, help="model size, as zeroth bench zo (default 1024)")
    p.add_argument("--seq-len", type=int, default=None, help="pretrained models: tokens per prompt")
    p.add_argument(
        "--weights",
        default="pretrained",
        choices=_pretrained_bench.WEIGHTS,
        help="pretrained models: their weights (default), or random: SmolLM2's architecture with random "
        "weights, without its package",
    )
    p.add_argument("--n", type=int, default=1, help="perturbations per ZO step (default 1)")
    p.add_argument("--distribution", default="both", choices=["both", *noise.EXACT], help="exact noise (default both)")
    p.add_argument(
        "--flat", action="store_true", help="also the program on replay.flatten(params), the layout a GPU trains in"
    )
    p.add_argument(
        "--compile-profile",
        type=int,
        nargs="?",
        const=15,
        default=0,
        metavar="EVENTS",
        help="profile each ZO program's compilation and show its EVENTS (default 15) traced events by time: "
        "where compiling goes (XLA's passes, the kernels' LLVM and PTX work)",
    )
    p.add_argument(
        "--perturb-impl",
        default="auto",
        choices=list(zo.PERTURB_IMPLS),
        help="how the ZO programs compute each perturbed leaf (default auto: the native kernel on a CPU, "
        "a Triton kernel per leaf on a GPU, the jnp rule elsewhere)",
    )

    def measure(args) -> dict:
        dists = noise.EXACT if args.distribution == "both" else (args.distribution,)
        return run(
            args.model,
            target=args.target,
            batch=args.batch,
            width=args.width,
            n=args.n,
            seq_len=args.seq_len,
            weights=args.weights,
            distributions=dists,
            flat=args.flat,
            compile_profile=args.compile_profile,
            perturb_impl=args.perturb_impl,
            progress=_common.Progress(p.prog),
        )

    return _common.run_cli(p, argv, measure, _render)


if __name__ == "__main__":
    sys.exit(main())
