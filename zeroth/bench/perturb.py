"""``zeroth bench perturb [--json] [--size N] [--repeats R] [--ks 1,16,64]``: perturbation throughput.

The exact replay of one float32 leaf side by side with ``jax.random.normal + add``, torch and a
plain memory pass, timed round-robin; ``--overhead`` measures the host cost of a replay call over
pytrees of many leaves instead. The rows and ratios are described in the docs
(``docs/guides/benchmarks.md``).

Example:
  $ zeroth bench perturb --size 4194304 --repeats 3
  $ zeroth bench perturb --overhead
"""

from __future__ import annotations

import functools
import math
import sys
import time
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from zeroth import noise, replay, rng, rule
from zeroth.bench import _common
from zeroth.kernels import perturb as kp

__all__ = ["main", "run", "run_overhead", "kernel_launches"]

TARGETS = {
    "binomial_over_torch": (">=", 3.0),
    "binomial_not_donated_over_torch": (">=", 2.0),
    "binomial_over_jax_normal": (">=", 7.0),
    "rademacher_over_memory_floor": (">=", 1 / 3),
}
# On a GPU a replay is bound by memory, torch's randn too: the replay of one update must reach 80%
# of jax's in-place pass p + c over the same leaf and beat torch.randn + add_ by half.
GPU_TARGETS = {
    "binomial_over_torch": (">=", 1.5),
    "binomial_over_memory_floor": (">=", 0.8),
    "rademacher_over_memory_floor": (">=", 1 / 3),
}


def targets(backend: str) -> dict[str, tuple[str, float]]:
    """The targets of the ratios on ``backend`` (jax's name: ``"cpu"``, ``"gpu"``, ``"tpu"``)."""
    return GPU_TARGETS if backend == "gpu" else TARGETS


_COEFF = 1e-3


def _row(
    name: str, group: str, n: int, timing: _common.Timing | None, *, updates: int = 1, note: str | None = None
) -> dict:
    row = {"name": name, "group": group, "elements": n, "updates": updates, "note": note}
    if timing is not None:
        row.update(
            seconds_min=timing.min_s,
            seconds_median=timing.median_s,
            repeats=timing.repeats,
            elements_per_s=n * updates / timing.min_s,
            seconds_per_update=timing.min_s / updates,
        )
        if not math.isnan(timing.host_min_s):
            row["host_seconds_min"] = timing.host_min_s
    return row


def _donated(step: Callable, state) -> Callable[[], float]:
    """A zero-argument call doing ``state = step(state)`` (the state's buffers donated) and waiting;
    it returns the seconds before the wait (the host's part: ``host_seconds_min``)."""
    return _queued(step, state, 1)


QUEUED_CALLS = 8
# the rows timed again as QUEUED_CALLS calls in a row with one wait (_queued), and their names
QUEUED = {
    name: f"{name}, {QUEUED_CALLS} calls queued"
    for name in (
        "zeroth binomial (replay, K=1)",
        "jax p + c (memory floor)",
        "torch.randn + add_",
        "torch add_(c) (memory floor)",
    )
}


def _queued(step: Callable, state, calls: int = QUEUED_CALLS) -> Callable[[], float]:
    """``calls`` steps ``state = step(state)`` in a row and one wait at the end: how a loop of
    replays runs, each call dispatched while the device still works on the last (the host's cost
    of a call hides behind the device's, where the device is the slower). Returns the seconds
    before the wait."""
    box = [state]

    def dispatch():
        for _ in range(calls):
            box[0] = step(box[0])
        return box[0]

    return functools.partial(_host_then_wait, dispatch, jax.block_until_ready)


def _host_then_wait(dispatch: Callable[[], Any], wait: Callable[[Any], Any]) -> float:
    """``wait(dispatch())``; returns the seconds ``dispatch`` took (the host's part of the call,
    ``host_seconds_min``)."""
    t0 = time.perf_counter()
    out = dispatch()
    host = time.perf_counter() - t0
    wait(out)
    return host


# the jnp rule's row with its keys and scales passed from the host each call, as replay passes them
HOST_ARGS_ROW = "jnp rule binomial (apply_updates, K=1), keys and scales from the host"


def _zeroth_core(n: int, dist: str, k: int, *, host: bool = False) -> Callable[[], None]:
    """The jitted jnp rule, donated, its keys and scales already on the device; ``host``: passed
    as :func:`zeroth.replay.replay` passes them, one NumPy array (``pack_updates``) sent each call:
    what a call of the same program costs beyond the device's rows, without the rest of
    ``replay``'s host work."""
    keys = rng.sample_keys(0, [(0, 1, s) for s in range(k)])
    scales = replay.update_scales(dist, [_COEFF * (1 + s % 3) for s in range(k)])
    if host:
        fn = jax.jit(
            lambda p, packed: replay.apply_updates(p, *kp.dispatch.unpack_updates(packed), distribution=dist),
            donate_argnums=0,
        )
        packed = kp.dispatch.pack_updates(keys, scales)
        return _donated(lambda p: fn(p, packed), {"w": jnp.zeros(n, jnp.float32)})
    fn = jax.jit(functools.partial(replay.apply_updates, distribution=dist), donate_argnums=0)
    keys, scales = jnp.asarray(keys), jnp.asarray(scales)
    return _donated(lambda p: fn(p, keys, scales), {"w": jnp.zeros(n, jnp.float32)})


def _zeroth_replay(n: int, dist: str, k: int, *, queued: bool = False) -> Callable[[], None]:
    """What users call: :func:`zeroth.replay.replay` (host-rounded coefficients, the backend's
    fastest exact path: the native fused kernel on CPU), donated; ``queued``: :func:`_queued`."""
    keys = rng.sample_keys(0, [(0, 1, s) for s in range(k)])
    coefficients = [_COEFF * (1 + s % 3) for s in range(k)]
    step = lambda p: replay.replay(p, (keys, coefficients), distribution=dist, donate=True)  # noqa: E731
    return (_queued if queued else _donated)(step, {"w": jnp.zeros(n, jnp.float32)})


def _jax_normal(n: int) -> Callable[[], None]:
    @functools.partial(jax.jit, donate_argnums=0)
    def step(p, key):
        return p + jnp.float32(_COEFF) * jax.random.normal(key, p.shape, jnp.float32)

    key = jax.random.PRNGKey(0)
    return _donated(lambda p: step(p, key), jnp.zeros(n, jnp.float32))


def _jax_memory(n: int, *, queued: bool = False) -> Callable[[], None]:
    step = jax.jit(lambda p, c: p + c, donate_argnums=0)
    c = jnp.float32(_COEFF)
    return (_queued if queued else _donated)(lambda p: step(p, c), jnp.zeros(n, jnp.float32))


def _torch_calls(n: int) -> tuple[dict[str, Callable[[], None]], str | None]:
    """``({name: call}, note)``: torch on the same device as jax's arrays (``cuda`` when jax's
    default device is a GPU and torch sees one, else the CPU), each call alone and
    :data:`QUEUED_CALLS` in a row (:data:`QUEUED` names them); no calls and the note
    "not installed" without torch."""
    try:
        import torch
    except ImportError:
        return {}, "not installed"
    device = "cuda" if rule.default_platform() == "gpu" and torch.cuda.is_available() else "cpu"
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    gen = torch.Generator(device=device).manual_seed(0)
    p = torch.zeros(n, dtype=torch.float32, device=device)
    q = torch.zeros(n, dtype=torch.float32, device=device)

    def randn_add(calls: int = 1):
        def dispatch():
            for _ in range(calls):
                p.add_(torch.randn(n, generator=gen, dtype=torch.float32, device=device), alpha=_COEFF)

        return _host_then_wait(dispatch, lambda _: sync())

    def add(calls: int = 1):
        def dispatch():
            for _ in range(calls):
                q.add_(_COEFF)

        return _host_then_wait(dispatch, lambda _: sync())

    calls = {
        "torch.randn + add_": randn_add,
        "torch add_(c) (memory floor)": add,
        QUEUED["torch.randn + add_"]: functools.partial(randn_add, QUEUED_CALLS),
        QUEUED["torch add_(c) (memory floor)"]: functools.partial(add, QUEUED_CALLS),
    }
    threads = f", {torch.get_num_threads()} threads" if device == "cpu" else ""
    return calls, f"torch {torch.__version__} on {device}{threads}"


def _zeroth_replay_copy(n: int, dist: str) -> Callable[[], None]:
    """:func:`zeroth.replay.replay` without donation: a new output buffer every call."""
    keys = rng.sample_keys(0, [(0, 1, 0)])
    p = {"w": jnp.zeros(n, jnp.float32)}

    return functools.partial(
        _host_then_wait, lambda: replay.replay(p, (keys, [_COEFF]), distribution=dist), jax.block_until_ready
    )


def _kernel_calls(n: int, ks: list[int]) -> tuple[dict[str, tuple[Callable[[], None], int, str]], list[dict]]:
    """Fused fast path of :mod:`zeroth.kernels.perturb`: ``({name: (call, K, note)}, rows that could
    not be timed)``. Bits are checked against :func:`zeroth.replay.apply_updates` on a small leaf first."""
    impl = kp.resolve_impl("auto")
    fused = kp.fused_apply_updates
    calls, failed = {}, []
    for dist, k in [("binomial", 1), ("rademacher", 1)] + [("binomial", k) for k in ks if k > 1]:
        name = f"kernels fused {dist} K={k} ({impl})"
        keys = rng.sample_keys(0, [(0, 1, s) for s in range(k)])
        scales = replay.update_scales(dist, [_COEFF * (1 + s % 3) for s in range(k)])
        try:
            small = {"w": jnp.asarray(np.linspace(-1, 1, 4099, dtype=np.float32))}
            want = replay.apply_updates(small, keys, scales, distribution=dist)["w"]
            got = fused(small, keys, scales, distribution=dist, impl=impl)["w"]
            same = bool(np.array_equal(np.asarray(got).view(np.uint32), np.asarray(want).view(np.uint32)))
            step = lambda p, keys=keys, scales=scales, dist=dist: fused(  # noqa: E731
                p, keys, scales, distribution=dist, donate=True, impl=impl
            )
            call = _donated(step, {"w": jnp.zeros(n, jnp.float32)})
            call()  # compile now: a failure is reported here, not in the middle of the timing
            calls[name] = (call, k, "bits match replay" if same else "BITS DIFFER from replay")
        except Exception as exc:  # report, don't abort the other rows
            failed.append(_row(name, "kernels", n, None, updates=k, note=f"failed: {type(exc).__name__}: {exc}"))
    return calls, failed


def _rate(rows: list[dict], name: str) -> float | None:
    for row in rows:
        if row["name"] == name:
            return row.get("elements_per_s")
    return None


def _host_fraction(rows: list[dict], name: str) -> float | None:
    row = next((r for r in rows if r["name"] == name), {})
    return _ratio(row.get("host_seconds_min"), row.get("seconds_min"))


def _ratio(a: float | None, b: float | None) -> float | None:
    return None if a is None or b is None else a / b


def run(
    size: int = 2**24, *, repeats: int = 5, warmup: int = 1, ks: tuple[int, ...] = (1, 16, 64), kernels: bool = False
) -> dict:
    """Run the benchmark; returns ``{"size", "environment", "rows", "ratios", "targets"}``.

    Every row's call is set up first, then all are timed round-robin (:func:`_common.timeit_many`)
    so a change of machine load affects them alike.
    """
    if size < 1:
        raise ValueError(f"size must be a positive number of elements, got {size}")
    n = size
    torch_calls, torch_note = _torch_calls(n)
    # name -> (group, call or None, K, note), in table order
    spec: dict[str, tuple[str, Callable[[], None] | None, int, str | None]] = {}
    for dist in noise.EXACT:
        spec[f"zeroth {dist} (replay, K=1)"] = ("zeroth", _zeroth_replay(n, dist, 1), 1, None)
    spec["zeroth binomial (replay, K=1, not donated)"] = ("zeroth", _zeroth_replay_copy(n, "binomial"), 1, "copy mode")
    for dist in noise.EXACT:
        spec[f"jnp rule {dist} (apply_updates, K=1)"] = ("reference", _zeroth_core(n, dist, 1), 1, "traceable jnp path")
    spec[HOST_ARGS_ROW] = ("reference", _zeroth_core(n, "binomial", 1, host=True), 1, "keys and scales sent per call")
    spec["jax.random.normal + add"] = ("baseline", _jax_normal(n), 1, "backend-dependent")
    spec["torch.randn + add_"] = ("baseline", torch_calls.get("torch.randn + add_"), 1, torch_note)
    spec["jax p + c (memory floor)"] = ("memory", _jax_memory(n), 1, None)
    spec["torch add_(c) (memory floor)"] = ("memory", torch_calls.get("torch add_(c) (memory floor)"), 1, torch_note)
    spec[QUEUED["zeroth binomial (replay, K=1)"]] = (
        "queued",
        _zeroth_replay(n, "binomial", 1, queued=True),
        QUEUED_CALLS,
        f"one wait per {QUEUED_CALLS} calls",
    )
    spec[QUEUED["torch.randn + add_"]] = (
        "queued",
        torch_calls.get(QUEUED["torch.randn + add_"]),
        QUEUED_CALLS,
        torch_note,
    )
    spec[QUEUED["jax p + c (memory floor)"]] = ("queued", _jax_memory(n, queued=True), QUEUED_CALLS, None)
    spec[QUEUED["torch add_(c) (memory floor)"]] = (
        "queued",
        torch_calls.get(QUEUED["torch add_(c) (memory floor)"]),
        QUEUED_CALLS,
        torch_note,
    )
    for k in ks:
        spec[f"zeroth replay K={k} (binomial)"] = ("replay", _zeroth_replay(n, "binomial", k), k, None)
    for k in ks:
        spec[f"jnp rule replay K={k} (binomial)"] = (
            "reference",
            _zeroth_core(n, "binomial", k),
            k,
            "traceable jnp path",
        )
    failed: list[dict] = []
    if kernels:
        kernel_calls, failed = _kernel_calls(n, list(ks))
        for name, (call, k, note) in kernel_calls.items():
            spec[name] = ("kernels", call, k, note)

    timings = _common.timeit_many(
        {name: call for name, (_, call, _, _) in spec.items() if call is not None}, warmup=warmup, repeats=repeats
    )
    rows = [
        _row(name, group, n, timings.get(name), updates=k, note=note) for name, (group, _, k, note) in spec.items()
    ] + failed

    binomial = _rate(rows, "zeroth binomial (replay, K=1)")
    rademacher = _rate(rows, "zeroth rademacher (replay, K=1)")
    floors = [r["elements_per_s"] for r in rows if r["group"] == "memory" and r.get("elements_per_s")]
    ratios = {
        "binomial_over_torch": _ratio(binomial, _rate(rows, "torch.randn + add_")),
        "binomial_not_donated_over_torch": _ratio(
            _rate(rows, "zeroth binomial (replay, K=1, not donated)"), _rate(rows, "torch.randn + add_")
        ),
        "binomial_over_jax_normal": _ratio(binomial, _rate(rows, "jax.random.normal + add")),
        "binomial_over_memory_floor": _ratio(binomial, _rate(rows, "jax p + c (memory floor)")),
        # the same program with its keys and scales from the host over on the device: what sending
        # them costs (below 1), and replay over it: what the rest of replay's host work costs
        "jnp_host_args_over_device_args": _ratio(
            _rate(rows, HOST_ARGS_ROW), _rate(rows, "jnp rule binomial (apply_updates, K=1)")
        ),
        "binomial_over_jnp_host_args": _ratio(binomial, _rate(rows, HOST_ARGS_ROW)),
        "rademacher_over_memory_floor": _ratio(rademacher, max(floors) if floors else None),
        # the same calls queued (QUEUED_CALLS in a row, one wait): the device's rate once the host's
        # cost of a call hides behind the device's work
        "binomial_queued_over_torch_queued": _ratio(
            _rate(rows, QUEUED["zeroth binomial (replay, K=1)"]), _rate(rows, QUEUED["torch.randn + add_"])
        ),
        "binomial_queued_over_memory_floor_queued": _ratio(
            _rate(rows, QUEUED["zeroth binomial (replay, K=1)"]), _rate(rows, QUEUED["jax p + c (memory floor)"])
        ),
        # the host's part of one replay call, and of the same program's call with its updates from
        # the host: where a single call's time goes beyond the device's
        "binomial_host_fraction_of_call": _host_fraction(rows, "zeroth binomial (replay, K=1)"),
        "jnp_host_args_host_fraction_of_call": _host_fraction(rows, HOST_ARGS_ROW),
    }
    if 1 in ks:
        t1 = timings["zeroth replay K=1 (binomial)"].min_s
        for k in ks:
            if k > 1:
                ratios[f"replay_K{k}_over_{k}x_K1"] = timings[f"zeroth replay K={k} (binomial)"].min_s / (k * t1)
                ratios[f"replay_K{k}_speedup_over_{k}_jnp_passes"] = (
                    k
                    * timings["jnp rule replay K=1 (binomial)"].min_s
                    / timings[f"zeroth replay K={k} (binomial)"].min_s
                )
    return {
        "benchmark": "perturb",
        "size": n,
        "dtype": "float32",
        "repeats": repeats,
        "environment": _common.environment(),
        "rows": rows,
        "ratios": ratios,
        "targets": {k: f"{op} {v:.3g}" for k, (op, v) in targets(rule.default_platform()).items()},
    }


OVERHEAD_LEAVES = (1, 10, 50, 200)
OVERHEAD_KS = (1, 16)
OVERHEAD_TARGET_US = 100.0
_CALLS_PER_TIMING = 20


def _per_leaf_native(params, keys, scales):
    """The design before one launch per replay: a native launch per leaf, leaf keys in XLA."""
    flat, treedef = jax.tree_util.tree_flatten_with_path(params)
    out = [kp.perturb_native(x, kp.leaf_keys(keys, rng.leaf_id(path)), scales, inplace=True) for path, x in flat]
    return jax.tree_util.tree_unflatten(treedef, out)


def kernel_launches(fn: Callable, *args) -> int:
    """Kernels one call of ``jax.jit(fn, donate_argnums=0)(*args)`` launches: the custom calls
    (zeroth's native or Pallas kernels) and XLA fusions of its compiled program."""
    text = jax.jit(fn, donate_argnums=0).lower(*args).compile().as_text()
    return sum(line.count(" custom-call(") + line.count(" fusion(") for line in text.splitlines())


def _launch_counts(params, keys, scales) -> dict[str, int]:
    """:func:`kernel_launches` of the replay of ``params`` as a pytree and in the flat layout (donated)."""
    flat = replay.flatten(params)
    tables = flat.layout.tables()
    return {
        "replay (pytree)": kernel_launches(
            lambda p, k, s: kp.apply_updates(p, k, s, inplace=True), params, keys, scales
        ),
        "replay (flat layout)": kernel_launches(
            lambda b, k, s: kp.apply_updates_flat(b, k, s, tables, inplace=True), flat.buffers, keys, scales
        ),
    }


# The rows of jax's own floors under each pytree verdict: jitted calls of (params, scalar) on the same arrays.
_DISPATCH_FLOOR = "jax dispatch floor"  # returns them unchanged
_UPDATE_FLOOR = "jax update floor (p + s on each leaf)"  # writes each of them: the floor of any update


def run_overhead(
    *, leaves: tuple[int, ...] = OVERHEAD_LEAVES, ks: tuple[int, ...] = OVERHEAD_KS, repeats: int = 5, warmup: int = 1
) -> dict:
    """Host overhead of a replay call (``docs/guides/benchmarks.md``); ``{"rows", "environment", ...}``.

    Each timing is ``_CALLS_PER_TIMING`` back-to-back calls (the state donated from one to the
    next), divided; rows are timed round-robin.
    """
    from zeroth.kernels import cpu_native

    spec: dict[str, tuple[int, int, str, Callable[[], None]]] = {}
    same_bits: dict[str, bool] = {}  # checksum of the flat replay == checksum of the pytree replay
    launches: dict[tuple[int, int, str], int] = {}  # kernels per call (compiled program), by row
    for n_leaves in leaves:
        for k in ks:
            params = {f"leaf{i:03d}": jnp.zeros(64, jnp.float32) for i in range(n_leaves)}
            keys = rng.sample_keys(0, [(0, 1, s) for s in range(k)])
            coefficients = [_COEFF * (1 + s % 3) for s in range(k)]
            scales = replay.update_scales("binomial", coefficients)

            step = lambda p, keys=keys, c=coefficients: replay.replay(p, (keys, c), donate=True)  # noqa: E731
            for what, count in _launch_counts(params, keys, scales).items():
                launches[(n_leaves, k, what)] = count
            tree_digest = replay.checksum(step(jax.tree_util.tree_map(jnp.copy, params)))
            same_bits[f"L{n_leaves}_K{k}"] = tree_digest == replay.checksum(step(replay.flatten(params)))
            rows = {
                "replay (pytree)": (step, params),
                "replay (flat layout)": (step, replay.flatten(params)),
                "flat, one leaf of L*64 (arithmetic)": (
                    step,
                    replay.flatten({"w": jnp.zeros(64 * n_leaves, jnp.float32)}),
                ),
                _DISPATCH_FLOOR: (jax.jit(lambda p, s: p, donate_argnums=0), params),
                _UPDATE_FLOOR: (
                    jax.jit(lambda p, s: jax.tree_util.tree_map(lambda x: x + s, p), donate_argnums=0),
                    params,
                ),
            }
            if cpu_native.available() and rule.default_platform() == "cpu":
                per_leaf = jax.jit(_per_leaf_native, donate_argnums=0)
                rows["native, a launch per leaf"] = (
                    lambda p, per_leaf=per_leaf, keys=keys, scales=scales: per_leaf(p, keys, scales),
                    params,
                )
            for what, (step, state) in rows.items():
                fn = (
                    step
                    if what not in (_DISPATCH_FLOOR, _UPDATE_FLOOR)
                    else (lambda p, step=step: step(p, np.float32(0)))
                )
                spec[f"{what} L={n_leaves} K={k}"] = (
                    n_leaves,
                    k,
                    what,
                    _queued(fn, jax.tree_util.tree_map(jnp.copy, state), _CALLS_PER_TIMING),
                )
    timings = _common.timeit_many(
        {name: call for name, (_, _, _, call) in spec.items()}, warmup=warmup, repeats=repeats
    )
    rows = []
    for name, (n_leaves, k, what, _) in spec.items():
        t = timings[name]
        rows.append(
            {
                "name": what,
                "leaves": n_leaves,
                "updates": k,
                "us_per_call_min": 1e6 * t.min_s / _CALLS_PER_TIMING,
                "us_per_call_median": 1e6 * t.median_s / _CALLS_PER_TIMING,
                "kernel_launches": launches.get((n_leaves, k, what)),
            }
        )

    def per_call(prefix: str, what: str) -> dict[str, float]:  # the best us per call of row `what`, by L and K
        return {f"{prefix}_L{r['leaves']}_K{r['updates']}_us": r["us_per_call_min"] for r in rows if r["name"] == what}

    verdicts = {**per_call("replay", "replay (pytree)"), **per_call("flat", "replay (flat layout)")}
    arithmetic = per_call("flat", "flat, one leaf of L*64 (arithmetic)")
    dispatch = per_call("replay", _DISPATCH_FLOOR)
    update_floor = per_call("replay", _UPDATE_FLOOR)
    return {
        "benchmark": "perturb_overhead",
        "leaf_elements": 64,
        "repeats": repeats,
        "calls_per_timing": _CALLS_PER_TIMING,
        "environment": _common.environment(),
        "rows": rows,
        "replay_us": verdicts,
        "flat_bits_match_pytree": same_bits,
        "kernel_launches": {
            f"{prefix}_L{n}_K{k}": count
            for (n, k, what), count in launches.items()
            for prefix, row in (("replay", "replay (pytree)"), ("flat", "replay (flat layout)"))
            if what == row
        },
        "target": f"<= {OVERHEAD_TARGET_US:g} us per call",
        "met": {name: us <= OVERHEAD_TARGET_US for name, us in verdicts.items()},
        # the same elements as one leaf (the arithmetic floor) under each flat verdict
        "arithmetic_us": arithmetic,
        # jax passing the same donated leaves through a jitted identity under each tree verdict:
        # what any call on that many arrays costs before zeroth does anything
        "dispatch_floor_us": dispatch,
        # jax adding a scalar to each of the same donated leaves in one jitted call: the cheapest
        # program that writes every leaf, so the floor of any update of the pytree as separate arrays
        "update_floor_us": update_floor,
    }


def _render_overhead(result: dict) -> None:
    env = result["environment"]
    print(
        f"zeroth bench perturb --overhead: leaves of {result['leaf_elements']} float32, donated, "
        f"{result['calls_per_timing']} calls per timing, best of {result['repeats']} "
        f"({_common.machine_line(env)})"
    )
    table = [
        {
            **r,
            "best": f"{r['us_per_call_min']:.0f} us",
            "median": f"{r['us_per_call_median']:.0f} us",
            "launches": "" if r["kernel_launches"] is None else str(r["kernel_launches"]),
        }
        for r in result["rows"]
    ]
    _common.print_table(
        [
            ("name", "row"),
            ("leaves", "leaves"),
            ("updates", "K"),
            ("best", "per call"),
            ("median", "median"),
            ("launches", "kernels per call"),
        ],
        table,
    )
    print()
    for name, us in result["replay_us"].items():
        floor = result["arithmetic_us"].get(name)
        of_it = "" if floor is None else f"; one leaf of the same elements: {floor:.0f} us"
        dispatch = result["dispatch_floor_us"].get(name)
        if dispatch is not None:
            of_it += f"; jax's dispatch of the same arrays alone: {dispatch:.0f} us"
        written = result["update_floor_us"].get(name)
        if written is not None:
            of_it += f", jax writing each of them (p + s): {written:.0f} us"
        print(
            f"  {name:<24} {us:8.0f} us   (target {result['target']}: {'met' if result['met'][name] else 'MISSED'}{of_it})"
        )
    same = result["flat_bits_match_pytree"]
    print(f"  flat replay digest == pytree replay digest: {'yes' if all(same.values()) else 'NO: ' + str(same)}")


def _render(result: dict) -> None:
    env = result["environment"]
    print(
        f"zeroth bench perturb: N = {result['size']:,} float32 elements, donated, best of "
        f"{result['repeats']}, interleaved ({_common.machine_line(env)})"
    )
    table = [
        {
            **row,
            "rate": _common.fmt_rate(row.get("elements_per_s")),
            "best": _common.fmt_seconds(row.get("seconds_min")),
            "median": _common.fmt_seconds(row.get("seconds_median")),
            "per_update": _common.fmt_seconds(row.get("seconds_per_update")),
            "host": _common.fmt_seconds(row.get("host_seconds_min")),
        }
        for row in result["rows"]
    ]
    _common.print_table(
        [
            ("name", "row"),
            ("updates", "K"),
            ("rate", "elements*K/s"),
            ("best", "best"),
            ("median", "median"),
            ("per_update", "per update"),
            ("host", "host, best"),
            ("note", "note"),
        ],
        table,
    )
    print("host, best: the time until the call (all of a row's calls) returned, before the wait for the device")
    print()
    for name, value in result["ratios"].items():
        target = result["targets"].get(name)
        verdict = ""
        if target and value is not None:
            op, bound = targets(result["environment"]["backend"])[name]
            verdict = ": met" if (value >= bound if op == ">=" else value <= bound) else ": MISSED"
        print(
            f"  {name:<40} {'-' if value is None else f'{value:.3g}':>8}"
            + (f"   (target {target}{verdict})" if target else "")
        )


def main(argv: list[str] | None = None) -> int:
    """``zeroth bench perturb``: returns 0 (the numbers are printed, never judged)."""
    p = _common.base_parser(
        "zeroth bench perturb", "Perturbation throughput: zeroth vs jax.random.normal, torch.randn and a memory pass."
    )
    p.add_argument("--size", type=int, default=2**24, help="elements of the float32 leaf (default 2**24)")
    p.add_argument("--ks", default="1,16,64", help="comma-separated replay sizes K (default 1,16,64)")
    p.add_argument(
        "--kernels",
        action="store_true",
        help="add rows calling zeroth.kernels.perturb directly (replay already dispatches to it)",
    )
    p.add_argument(
        "--overhead",
        action="store_true",
        help="host overhead per replay call for 1-200 small leaves, K=1 and 16 (microseconds)",
    )
    try:
        args = p.parse_args(sys.argv[1:] if argv is None else argv)
        ks = _common.parse_ks(args.ks)
        if args.size < 1:
            raise ValueError(f"--size must be a positive number of elements, got {args.size}")
    except SystemExit as exc:
        return int(exc.code or 0)
    except ValueError as exc:
        print(f"zeroth bench perturb: {exc}", file=sys.stderr)
        return 2
    if args.overhead:
        result = run_overhead(repeats=args.repeats, warmup=args.warmup)
        _common.emit(result, as_json=args.json, render=_render_overhead)
        return 0
    result = run(args.size, repeats=args.repeats, warmup=args.warmup, ks=ks, kernels=args.kernels)
    _common.emit(result, as_json=args.json, render=_render)
    return 0


if __name__ == "__main__":
    sys.exit(main())
