"""Where a call's time goes: the XLA ops it ran, read from a ``jax.profiler`` trace.

:func:`profile` runs a callable a few times under :func:`jax.profiler.trace` and reads the trace
back with :class:`jax.profiler.ProfileData` (no TensorBoard, no Nsight Systems needed). It
reports, per call:

* **wall**: the host's clock around the calls;
* **busy**: the union of the ops' intervals (time in which at least one op ran);
* **idle** = wall − busy: the device (or the CPU's XLA runtime) waiting for the host, a
  synchronisation, a transfer or a launch; on an accelerator this is where launch-bound work hides;
* the ops per call, the busy time of each program (XLA module), and the ops by total time.

The trace file (an ``XSpace`` protocol buffer) is read by :func:`read_planes` with the protobuf
runtime zeroth already uses, not with ``jax.profiler.ProfileData``: on a machine with an NVIDIA
H200, iterating the stats of the host planes' events through ``ProfileData`` aborted the Python
process (``Fatal Python error: Aborted``; work pinned to the CPU with the GPU present, two test
processes lost), and a C++ abort cannot be caught. A field this reader does not know is skipped, as protobuf does.

Which events count as ops: on a GPU or TPU, the device planes' ops (a plane's ``XLA Ops`` line
where it has one, else its ``Stream`` lines: kernels and copies), named by their ``hlo_op`` and
``hlo_module`` where the trace annotates them, else by the kernel's name; without device events
(a CPU), the XLA CPU runtime's thunks, which carry ``hlo_op`` and ``hlo_module``. Ops can nest (a
while loop's thunk holds its body's), so the ops' total times may add up to more than busy.

Example:
  >>> import jax, jax.numpy as jnp
  >>> f = jax.jit(lambda x: jnp.sin(x) * 2)
  >>> x = jnp.ones(1000); _ = f(x).block_until_ready()
  >>> p = profile(lambda: f(x).block_until_ready(), calls=2)
  >>> p["source"], p["busy_s_per_call"] <= p["wall_s_per_call"]
  ('host', True)
"""

from __future__ import annotations

import functools
import glob
import os
import re
import tempfile
import time
from collections.abc import Callable, Iterable, Sequence
from types import SimpleNamespace
from typing import Any, NamedTuple

from zeroth import rule

__all__ = ["OpEvent", "profile", "summarize", "op_events", "read_planes", "traced", "union_ns"]

_ANNOTATED = re.compile(r"(hlo_op|hlo_module|program_id)=([^,#]+)")
_NOT_OPS = frozenset(
    {"XLA Modules", "Steps", "XLA TraceMe", "Launch Stats", "Source", "Framework Ops", "Framework Name Scope"}
)


class OpEvent(NamedTuple):
    """One op's run: its program (the XLA module's name, with ``[program id]`` after it where
    the trace gives one; "" where it names none), its name, and its interval in the trace's
    nanoseconds."""

    module: str
    op: str
    start_ns: float
    duration_ns: float


# The trace's schema (tsl/profiler/protobuf/xplane.proto), the fields read here: an XPlane's maps
# are written as their wire form, repeated (key, value) entries.
_XSPACE_FIELDS = {
    "XSpace": [("planes", 1, "XPlane", True)],
    "XPlane": [
        ("name", 2, "string", False),
        ("lines", 3, "XLine", True),
        ("event_metadata", 4, "EventMetadataEntry", True),
        ("stat_metadata", 5, "StatMetadataEntry", True),
    ],
    "EventMetadataEntry": [("key", 1, "int64", False), ("value", 2, "XEventMetadata", False)],
    "StatMetadataEntry": [("key", 1, "int64", False), ("value", 2, "XStatMetadata", False)],
    "XLine": [("name", 2, "string", False), ("timestamp_ns", 3, "int64", False), ("events", 4, "XEvent", True)],
    "XEvent": [
        ("metadata_id", 1, "int64", False),
        ("offset_ps", 2, "int64", False),
        ("duration_ps", 3, "int64", False),
        ("stats", 4, "XStat", True),
    ],
    "XStat": [
        ("metadata_id", 1, "int64", False),
        ("double_value", 2, "double", False),
        ("uint64_value", 3, "uint64", False),
        ("int64_value", 4, "int64", False),
        ("str_value", 5, "string", False),
        ("bytes_value", 6, "bytes", False),
        ("ref_value", 7, "uint64", False),
    ],
    "XEventMetadata": [("name", 2, "string", False), ("stats", 5, "XStat", True)],
    "XStatMetadata": [("name", 2, "string", False)],
}


@functools.cache
def _xspace_class():
    """The ``XSpace`` message class, built once from :data:`_XSPACE_FIELDS` in a private pool."""
    from google.protobuf import descriptor_pb2, descriptor_pool, message_factory

    fd = descriptor_pb2.FileDescriptorProto(name="zeroth_xplane.proto", package="zeroth_xplane", syntax="proto3")
    scalar = {
        "int64": "TYPE_INT64",
        "uint64": "TYPE_UINT64",
        "double": "TYPE_DOUBLE",
        "string": "TYPE_STRING",
        "bytes": "TYPE_BYTES",
    }
    F = descriptor_pb2.FieldDescriptorProto
    for message, fields in _XSPACE_FIELDS.items():
        m = fd.message_type.add(name=message)
        if message == "XStat":
            m.oneof_decl.add(name="value")  # which value a stat holds: all but its metadata_id
        for name, number, kind, repeated in fields:
            f = m.field.add(name=name, number=number, label=F.LABEL_REPEATED if repeated else F.LABEL_OPTIONAL)
            if message == "XStat" and name != "metadata_id":
                f.oneof_index = 0
            if kind in scalar:
                f.type = getattr(F, scalar[kind])
            else:
                f.type, f.type_name = F.TYPE_MESSAGE, f".zeroth_xplane.{kind}"
    pool = descriptor_pool.DescriptorPool()
    pool.Add(fd)
    return message_factory.GetMessageClass(pool.FindMessageTypeByName("zeroth_xplane.XSpace"))


def read_planes(path: str) -> list:
    """The planes of the trace file ``path`` (an ``.xplane.pb``), in the shape
    :func:`op_events` reads: planes with ``name`` and ``lines``; lines with ``name`` and
    ``events``; events with ``name`` (their metadata's), ``start_ns`` (the line's timestamp plus
    the event's offset), ``duration_ns`` and ``stats``: ``(name, value)`` pairs, the event's own
    and then its metadata's, a reference stat given as the name it refers to.

    Raises:
      ValueError: the file is not an ``XSpace`` protocol buffer.
    """
    from google.protobuf.message import DecodeError

    space = _xspace_class()()
    with open(path, "rb") as f:
        raw = f.read()
    try:
        space.ParseFromString(raw)
    except DecodeError as exc:
        raise ValueError(f"{path} is not a profiler trace (an XSpace protocol buffer): {exc}") from exc
    planes = []
    for plane in space.planes:
        stat_names = {e.key: e.value.name for e in plane.stat_metadata}

        def stats(items, stat_names=stat_names) -> list[tuple[str, Any]]:
            out = []
            for st in items:
                which = st.WhichOneof("value")
                value = getattr(st, which) if which else None
                if which == "ref_value":
                    value = stat_names.get(value, "")
                out.append((stat_names.get(st.metadata_id, ""), value))
            return out

        # each metadata's name and stats, read once for all the events that name it
        metadata = {e.key: (e.value.name, stats(e.value.stats)) for e in plane.event_metadata}
        lines = []
        for line in plane.lines:
            events = []
            for e in line.events:
                name, meta_stats = metadata.get(e.metadata_id, ("", []))
                events.append(
                    SimpleNamespace(
                        name=name,
                        start_ns=line.timestamp_ns + e.offset_ps / 1000,
                        duration_ns=e.duration_ps / 1000,
                        stats=stats(e.stats) + meta_stats,
                    )
                )
            lines.append(SimpleNamespace(name=line.name, events=events))
        planes.append(SimpleNamespace(name=plane.name, lines=lines))
    return planes


def _stats(event) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for stat in event.stats:
        name, value = stat[0], stat[1]
        out[name] = value
        if isinstance(value, str):  # an annotation such as "fusion.3:#hlo_op=fusion.3,hlo_module=jit_f#"
            for key, found in _ANNOTATED.findall(value):
                out.setdefault(key, found)
    return out


def _program(stats: dict[str, Any]) -> str:
    """The program's name: two jitted lambdas are both ``jit__lambda``, so its id goes with it."""
    name = str(stats.get("hlo_module", ""))
    return f"{name} [{stats['program_id']}]" if name and "program_id" in stats else name


def _device_lines(plane) -> list:
    lines = [line for line in plane.lines if line.name not in _NOT_OPS]
    ops = [line for line in lines if line.name == "XLA Ops"]
    if ops:
        return ops
    streams = [line for line in lines if line.name.startswith("Stream")]
    return streams or lines


def op_events(planes: Iterable, *, devices: bool = True) -> tuple[str, list[OpEvent]]:
    """``(source, events)`` of a trace's planes (objects with ``name`` and ``lines``; lines with
    ``name`` and ``events``; events with ``name``, ``start_ns``, ``duration_ns``, ``stats``):
    ``"device"`` and the device planes' ops where there are any, else ``"host"`` and the events
    that name an ``hlo_op`` (the XLA CPU runtime's thunks), else ``"none"`` and no events.
    ``devices=False`` reads the host's events only (work that ran on the CPU of a machine whose
    GPU's plane is in the trace too)."""
    planes = list(planes)
    device: list[OpEvent] = []
    for plane in planes:
        if not devices or not plane.name.startswith("/device:"):
            continue
        for line in _device_lines(plane):
            for e in line.events:
                s = _stats(e)
                device.append(
                    OpEvent(_program(s), str(s.get("hlo_op", e.name)), float(e.start_ns), float(e.duration_ns))
                )
    if device:
        return "device", device
    host: list[OpEvent] = []
    for plane in planes:
        if plane.name.startswith("/device:"):
            continue
        for line in plane.lines:
            for e in line.events:
                s = _stats(e)
                if "hlo_op" in s:
                    host.append(OpEvent(_program(s), str(s["hlo_op"]), float(e.start_ns), float(e.duration_ns)))
    return ("host", host) if host else ("none", [])


def union_ns(intervals: Iterable[tuple[float, float]]) -> float:
    """The length of the union of ``(start, duration)`` intervals (overlaps counted once)."""
    total, end = 0.0, float("-inf")
    for start, duration in sorted(intervals):
        stop = start + duration
        if stop <= end:
            continue
        total += stop - max(start, end)
        end = stop
    return total


def summarize(source: str, events: Sequence[OpEvent], *, calls: int, wall_s: float, top: int = 12) -> dict:
    """The per-call summary of :func:`profile` from its events (see the module docstring)."""
    if calls < 1:
        raise ValueError(f"calls must be >= 1, got {calls}")
    busy = union_ns((e.start_ns, e.duration_ns) for e in events) * 1e-9
    by_module: dict[str, list[OpEvent]] = {}
    by_op: dict[tuple[str, str], list[float]] = {}
    for e in events:
        by_module.setdefault(e.module, []).append(e)
        by_op.setdefault((e.module, e.op), []).append(e.duration_ns)
    modules = {m: union_ns((e.start_ns, e.duration_ns) for e in evs) * 1e-9 / calls for m, evs in by_module.items()}
    ops = sorted(by_op.items(), key=lambda kv: -sum(kv[1]))
    wall = wall_s / calls
    return {
        "source": source,
        "calls": calls,
        "wall_s_per_call": wall,
        "busy_s_per_call": busy / calls,
        "idle_s_per_call": max(0.0, wall - busy / calls),
        "ops_per_call": len(events) / calls,
        "programs": dict(sorted(modules.items(), key=lambda kv: -kv[1])),
        "top_ops": [
            {"program": m, "op": op, "count_per_call": len(d) / calls, "s_per_call": sum(d) * 1e-9 / calls}
            for (m, op), d in ops[:top]
        ],
    }


def profile(fn: Callable[[], Any], *, calls: int = 3, top: int = 12, platform: str | None = None) -> dict:
    """Run ``fn()`` (which must block until its work is done) ``calls`` times under the JAX
    profiler and summarise the ops it ran (:func:`summarize`; the module docstring says which).
    ``platform`` says where ``fn`` runs (default :func:`zeroth.rule.default_platform`, which
    follows ``jax.default_device``): on ``"cpu"`` the device planes are not read.

    Raises:
      ValueError: ``calls`` below 1.
      RuntimeError: the profiler wrote no trace.
    """
    if calls < 1:
        raise ValueError(f"calls must be >= 1, got {calls}")

    def run():
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        return time.perf_counter() - t0

    wall, planes = _under_profiler(run)
    on_cpu = (rule.default_platform() if platform is None else rule.platform_name(platform)) == "cpu"
    source, events = op_events(planes, devices=not on_cpu)
    return summarize(source, events, calls=calls, wall_s=wall, top=top)


def _under_profiler(fn: Callable[[], Any]) -> tuple[Any, list]:
    """``(fn(), planes)``: ``fn`` run under :func:`jax.profiler.trace` into a temporary folder and
    the planes of the trace it wrote (:func:`read_planes`).

    Raises:
      RuntimeError: the profiler wrote no trace.
    """
    import jax

    with tempfile.TemporaryDirectory(prefix="zeroth-profile-") as d:
        with jax.profiler.trace(d):
            result = fn()
        files = glob.glob(os.path.join(d, "**", "*.xplane.pb"), recursive=True)
        if not files:
            raise RuntimeError(f"jax.profiler.trace wrote no .xplane.pb under {d}")
        return result, read_planes(max(files, key=os.path.getmtime))


def traced(fn: Callable[[], Any], *, top: int = 12) -> tuple[Any, list[dict]]:
    """``(fn(), events)``: ``fn`` run once under the JAX profiler, and the ``top`` names of the
    native events it traced by their total time (``{"event", "s", "count", "threads"}``; Python's
    own frames, named ``$file:line``, left out). Where a compilation goes: XLA traces each of its
    passes (``priority-fusion``, ``layout-assignment``...) and the LLVM and PTX work of each
    kernel module (``CompileSingleModule``, on threads of their own: ``threads`` counts them, and
    their times add up over the threads, so they can exceed the wall time).

    Example:
      >>> import jax, jax.numpy as jnp
      >>> lowered = jax.jit(jnp.sin).lower(jnp.ones(8))
      >>> compiled, events = traced(lambda: lowered.compile(), top=1000)
      >>> any(e["event"].startswith("HLO passes") for e in events)  # XLA CPU's; a GPU's: "OptimizeHloModule"
      True
    """
    result, planes = _under_profiler(fn)
    total: dict[str, float] = {}
    count: dict[str, int] = {}
    threads: dict[str, set] = {}
    for plane in planes:
        for line in plane.lines:
            for e in line.events:
                if e.name.startswith("$"):
                    continue
                total[e.name] = total.get(e.name, 0.0) + e.duration_ns * 1e-9
                count[e.name] = count.get(e.name, 0) + 1
                threads.setdefault(e.name, set()).add((plane.name, line.name))
    ranked = sorted(total, key=lambda k: -total[k])[:top]
    return result, [{"event": k, "s": total[k], "count": count[k], "threads": len(threads[k])} for k in ranked]
