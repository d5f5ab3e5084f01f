"""zeroth.bench.profile: which trace events count as ops, the busy time as a union of intervals,
and a real JAX profiler trace on this CPU read back per program; `zeroth bench zo --profile`."""

import json
import subprocess
import sys
from types import SimpleNamespace as NS

import jax
import jax.numpy as jnp
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from zeroth.bench import profile as bp


def _event(name, start, duration, **stats):
    return NS(name=name, start_ns=start, duration_ns=duration, stats=list(stats.items()))


def _line(name, *events):
    return NS(name=name, events=list(events))


def _plane(name, *lines):
    return NS(name=name, lines=list(lines))


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 60), st.integers(0, 15)), max_size=12))
def test_busy_time_is_the_union_of_the_intervals(intervals):
    covered = {t for start, duration in intervals for t in range(start, start + duration)}
    assert bp.union_ns(intervals) == len(covered)


def test_device_ops_come_from_xla_ops_where_the_plane_has_that_line():
    tpu = _plane("/device:TPU:0",
                 _line("XLA Modules", _event("jit_step(1)", 0, 100)),
                 _line("XLA Ops", _event("fusion.1", 0, 40, hlo_module="jit_step", program_id=1),
                       _event("fusion.2", 50, 30, hlo_module="jit_step", program_id=1)),
                 _line("Stream #1", _event("fusion.1", 0, 40)))  # fmt: skip
    host = _plane("/host:CPU", _line("python", _event("PjitFunction(step)", 0, 200)))
    source, events = bp.op_events([host, tpu])
    assert source == "device"
    assert [(e.module, e.op, e.duration_ns) for e in events] == [
        ("jit_step [1]", "fusion.1", 40),
        ("jit_step [1]", "fusion.2", 30),
    ]


def test_gpu_kernels_named_by_their_annotation_else_by_the_kernel():
    annotated = "fusion.3:#hlo_op=fusion.3,hlo_module=jit_fn,program_id=7#"
    gpu = _plane("/device:GPU:0",
                 _line("XLA Modules", _event("jit_fn", 0, 90)),
                 _line("Stream #13(Compute)", _event("loop_add_fusion_3", 0, 10, kernel_annotation=annotated),
                       _event("sm90_xmma_gemm", 20, 50)),
                 _line("Stream #14(MemcpyD2H)", _event("MemcpyD2H", 80, 5)))  # fmt: skip
    source, events = bp.op_events([gpu])
    assert source == "device"
    assert [(e.module, e.op) for e in events] == [("jit_fn [7]", "fusion.3"), ("", "sm90_xmma_gemm"), ("", "MemcpyD2H")]
    summary = bp.summarize(source, events, calls=1, wall_s=200e-9)
    assert summary["busy_s_per_call"] == pytest.approx(65e-9)
    assert summary["idle_s_per_call"] == pytest.approx(135e-9)
    assert summary["programs"] == pytest.approx({"": 55e-9, "jit_fn [7]": 10e-9})


def test_without_device_events_the_host_thunks_naming_an_hlo_op_count():
    cpu = _plane("/host:CPU",
                 _line("python", _event("PjitFunction(f)", 0, 500)),
                 _line("tf_XLAEigen/1", _event("ThreadpoolListener::StartRegion", 0, 1),
                       _event("ynn_fusion", 10, 100, hlo_op="ynn_fusion", hlo_module="jit_f", program_id=4),
                       _event("end: ynn_fusion", 110, 1)),
                 _line("tf_XLAPjRtCpuClient/2", _event("wrapped_sine", 50, 100, hlo_op="wrapped_sine", hlo_module="jit_f",
                                                       program_id=4)))  # fmt: skip
    source, events = bp.op_events([cpu, _plane("/device:GPU:0")])
    assert source == "host" and sorted(e.op for e in events) == ["wrapped_sine", "ynn_fusion"]
    summary = bp.summarize(source, events, calls=2, wall_s=400e-9)
    assert summary["busy_s_per_call"] == pytest.approx(70e-9)  # [10, 150) over two calls
    assert summary["ops_per_call"] == 1.0
    assert bp.op_events([_plane("/host:CPU", _line("python", _event("x", 0, 1)))]) == ("none", [])
    with pytest.raises(ValueError, match="calls must be >= 1, got 0"):
        bp.summarize("host", [], calls=0, wall_s=1.0)


def test_work_on_the_cpu_reads_the_host_thunks_even_where_a_gpu_plane_has_events():
    # tests pinned to the CPU on a GPU machine: the GPU's plane is in the trace, with events of its own
    gpu = _plane("/device:GPU:0", _line("Stream #13(Compute)", _event("loop_add_fusion", 0, 10)))
    cpu = _plane("/host:CPU", _line("tf_XLAEigen/1", _event("fusion", 10, 100, hlo_op="fusion", hlo_module="jit_f")))
    assert bp.op_events([cpu, gpu])[0] == "device"
    source, events = bp.op_events([cpu, gpu], devices=False)
    assert source == "host" and [(e.module, e.op) for e in events] == [("jit_f", "fusion")]


def test_a_real_trace_names_each_program_and_counts_its_ops_per_call():
    def first(x):
        return jnp.sin(x) @ x

    def second(x):
        return jnp.cos(x).sum()

    f, g = jax.jit(first), jax.jit(second)
    x = jnp.ones((128, 128))
    jax.block_until_ready((f(x), g(x)))
    p = bp.profile(lambda: jax.block_until_ready((f(x), g(x))), calls=3)
    assert p["source"] == "host" and p["calls"] == 3
    names = {m.split(" [")[0] for m in p["programs"]}
    assert {"jit_first", "jit_second"} <= names
    assert 0 < p["busy_s_per_call"] <= p["wall_s_per_call"]
    assert p["idle_s_per_call"] == pytest.approx(p["wall_s_per_call"] - p["busy_s_per_call"])
    assert p["ops_per_call"] >= 2
    assert all(o["count_per_call"] * 3 == round(o["count_per_call"] * 3) for o in p["top_ops"])  # whole events
    with pytest.raises(ValueError, match="calls must be >= 1, got 0"):
        bp.profile(lambda: None, calls=0)


def test_the_trace_reader_gives_the_events_jax_profiledata_gives(tmp_path):
    # read_planes parses the .xplane.pb itself (ProfileData aborted the process on a GPU machine):
    # on this CPU's real trace, every plane, line and event, with its start, duration and stats
    # (a reference stat as the name it refers to), equals what jax's reader gives
    f = jax.jit(lambda x: jnp.tanh(x @ x).sum())
    x = jnp.ones((64, 64))
    f(x).block_until_ready()
    with jax.profiler.trace(str(tmp_path)):
        for _ in range(2):
            f(x).block_until_ready()
    (path,) = [str(p) for p in tmp_path.rglob("*.xplane.pb")]

    def flat(planes):
        return [
            (p.name, ln.name, e.name, e.start_ns, e.duration_ns, sorted(map(tuple, e.stats), key=repr))
            for p in planes
            for ln in p.lines
            for e in ln.events
        ]

    ours, theirs = flat(bp.read_planes(path)), flat(jax.profiler.ProfileData.from_file(path).planes)
    assert ours == theirs
    assert any(dict(e[5]).get("hlo_module") == "jit__lambda" for e in ours)  # the program's ops are among them
    assert bp.op_events(bp.read_planes(path))[0] == "host"
    bad = tmp_path / "bad.xplane.pb"
    bad.write_bytes(open(path, "rb").read()[:-1])  # cut short: its last message ends past the file
    with pytest.raises(ValueError, match="bad.xplane.pb is not a profiler trace"):
        bp.read_planes(str(bad))


def test_bench_zo_profile_shows_the_update_program_inside_the_zo_step():
    out = subprocess.run(
        [sys.executable, "-m", "zeroth", "bench", "zo", "--model", "mlp", "--batch", "8", "--width", "64",
         "--repeats", "1", "--warmup", "0", "--distribution", "binomial", "--profile", "2", "--json"],
        capture_output=True, text=True, timeout=300, check=True,
    )  # fmt: skip
    result = json.loads(out.stdout)
    prof = result["profile"]
    assert set(prof) == {
        "inference forward",
        "ZO step binomial",
        "ZO step binomial, update held",
        "ZO step binomial, update held, deferred x8",
    }
    step = prof["ZO step binomial"]
    assert step["calls"] == 2 and step["source"] == "host"
    programs = {name.split(" [")[0] for name in step["programs"]}
    # the 2 forwards at θ±εz and the donated replay, and no other program per step (host keys and ε go
    # in as NumPy arrays: converted with jnp they were two small programs of their own)
    assert programs == {"jit_projected_gradients", "jit__fused_donated"}
    assert step["ops_per_call"] > prof["inference forward"]["ops_per_call"]
    assert result["ratios"]["zo_busy_over_forwards_binomial"] > 0
    assert 0 <= result["ratios"]["zo_idle_fraction_binomial"] < 1
    # with its update held, a step is one program: the last update applied, then the 2 forwards
    held = prof["ZO step binomial, update held"]
    assert {name.split(" [")[0] for name in held["programs"]} == {"jit_projected_gradients_after_update"}
    assert held["calls"] == 2 and 0 <= result["ratios"]["zo_idle_fraction_held_binomial"] < 1
    # deferred (the trainer's one-byte step on a CPU): the same one program per step, 8 steps a call
    deferred = prof["ZO step binomial, update held, deferred x8"]
    assert {name.split(" [")[0] for name in deferred["programs"]} == {"jit_projected_gradients_after_update"}


def test_bench_zo_profile_refuses_a_negative_count():
    out = subprocess.run([sys.executable, "-m", "zeroth", "bench", "zo", "--profile", "-1"],
                         capture_output=True, text=True, timeout=120)  # fmt: skip
    assert out.returncode == 2
    assert "--profile must be a non-negative number of calls, got -1" in out.stderr
