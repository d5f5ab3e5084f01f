"""Shared pieces of the ``zeroth bench`` programs: timing, tables, JSON, command-line flags.

A benchmark builds a list of rows (dicts), prints them with :func:`print_table` (or, with
``--json``, one JSON object through :func:`emit`), baselines side by side. Timings are wall
clock with warm-up calls first (compilation, caches), then the minimum and the median over
repeats; the minimum is the best estimate on a quiet machine, the median shows the noise.

Example:
  >>> t = timeit(lambda: sum(range(1000)), warmup=1, repeats=3)
  >>> t.min_s <= t.median_s
  True
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

from zeroth.kernels import cpu_native

__all__ = [
    "Timing",
    "timeit",
    "timeit_many",
    "round_order",
    "base_parser",
    "parse_ks",
    "environment",
    "fmt_rate",
    "fmt_seconds",
    "print_table",
    "emit",
]


class Timing(NamedTuple):
    """Wall-clock seconds of one call: best and median over ``repeats`` timed calls; the best
    process CPU time of a call (every thread of the process, ``time.process_time``); and the best
    time the call spent before its wait, where the call reports it (:func:`timeit_many`); NaN where
    not measured. On a shared machine the CPU time moves less with the load than the wall time."""

    min_s: float
    median_s: float
    repeats: int
    cpu_min_s: float = float("nan")
    host_min_s: float = float("nan")


def timeit(fn: Callable[[], Any], *, warmup: int = 1, repeats: int = 5) -> Timing:
    """Time ``fn()`` (which must block until its work is done, e.g. ``jax.block_until_ready``).

    Args:
      fn: a zero-argument callable; it may carry state between calls (a donated buffer).
      warmup: untimed calls first (compilation, allocation, caches).
      repeats: timed calls (at least 1).

    Returns:
      :class:`Timing` with the minimum and median seconds.
    """
    if repeats < 1:
        raise ValueError(f"repeats must be >= 1, got {repeats}")
    if warmup < 0:
        raise ValueError(f"warmup must be >= 0, got {warmup}")
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return Timing(min(times), statistics.median(times), repeats)


class Progress:
    """``progress(message)``: a line on stderr with the seconds since the benchmark started, so
    that a long run (minutes of compiling on a GPU) shows where it is, and one stopped by a time
    limit says where it was. Disabled, it prints nothing."""

    def __init__(self, prog: str, *, enabled: bool = True):
        self.prog, self.enabled, self.t0 = prog, enabled, time.perf_counter()

    def __call__(self, message: str) -> None:
        if self.enabled:
            print(f"[{self.prog} {time.perf_counter() - self.t0:6.1f} s] {message}", file=sys.stderr, flush=True)


def no_progress(message: str) -> None:
    """The progress callback that prints nothing."""
    del message


def round_order(n: int, r: int) -> list[int]:
    """The order of the rows ``0 .. n-1`` in round ``r`` of :func:`timeit_many`: from row
    ``r mod n`` in steps of ``s``, the ``r``-th number coprime with ``n`` (cycling), so that a row
    follows a different row in each round (row ``i`` follows ``i - s``) as long as there are steps
    left (``n - 1`` of them for a prime ``n``).

    Example:
      >>> round_order(5, 0), round_order(5, 1), round_order(5, 2)
      ([0, 1, 2, 3, 4], [1, 3, 0, 2, 4], [2, 0, 3, 1, 4])
    """
    if n < 1:
        return []
    steps = [s for s in range(1, n) if math.gcd(s, n) == 1] or [1]
    step, first = steps[r % len(steps)], r % n
    return [(first + j * step) % n for j in range(n)]


def timeit_many(
    fns: dict[str, Callable[[], Any]],
    *,
    warmup: int = 1,
    repeats: int = 5,
    progress: Callable[[str], None] = no_progress,
) -> dict[str, Timing]:
    """Time several callables interleaved: repeat ``r`` times each of them once, in turn.

    On a shared machine the load changes during a run; interleaving gives every row the same
    conditions, so the ratios between rows stay meaningful even when absolute times move. The
    order changes from round to round (:func:`round_order`): each round starts one row further on
    and walks the rows with another stride, so a row follows a different row in each round. What
    ran just before matters: on a GPU a short call timed after a long program reads slower than
    after a short one, so a fixed order would bias the same rows in every round.

    A callable that returns a float reports the seconds of its call before the wait for the
    device (its dispatch): :attr:`Timing.host_min_s` is the best of them (at most the best time,
    the host part of the best call being at most that call).

    Returns:
      ``{name: Timing}`` in the order of ``fns``.
    """
    if repeats < 1:
        raise ValueError(f"repeats must be >= 1, got {repeats}")
    if warmup < 0:
        raise ValueError(f"warmup must be >= 0, got {warmup}")
    for name, fn in fns.items():
        if warmup:
            progress(f"warming up: {name.strip()}")
        for _ in range(warmup):
            fn()
    progress(f"timing {len(fns)} rows, {repeats} rounds")
    times: dict[str, list[float]] = {name: [] for name in fns}
    cpu: dict[str, list[float]] = {name: [] for name in fns}
    host: dict[str, list[float]] = {name: [] for name in fns}
    names = list(fns)
    for r in range(repeats if names else 0):
        for i in round_order(len(names), r):
            name = names[i]
            fn = fns[name]
            t0, c0 = time.perf_counter(), time.process_time()
            reported = fn()
            times[name].append(time.perf_counter() - t0)
            cpu[name].append(time.process_time() - c0)
            if isinstance(reported, float):
                host[name].append(reported)
    return {
        name: Timing(
            min(ts), statistics.median(ts), repeats, min(cpu[name]), min(host[name]) if host[name] else float("nan")
        )
        for name, ts in times.items()
    }


def base_parser(prog: str, description: str, *, repeats: int = 5, warmup: int = 1) -> argparse.ArgumentParser:
    """An ``argparse`` parser with the flags every benchmark has: ``--json``, ``--repeats``, ``--warmup``."""
    p = argparse.ArgumentParser(prog=prog, description=description)
    p.add_argument("--json", action="store_true", help="print one JSON object instead of a table")
    p.add_argument("--repeats", type=_positive_int, default=repeats, help=f"timed calls per row (default {repeats})")
    p.add_argument("--warmup", type=_non_negative_int, default=warmup, help=f"untimed calls first (default {warmup})")
    return p


def parse_ks(text: str) -> tuple[int, ...]:
    """``--ks``: comma-separated positive update counts, e.g. ``"1,16,64"``.

    Raises:
      ValueError: an entry is not a positive integer (names the whole value).
    """
    parts = [k.strip() for k in text.split(",")]
    if not parts or not all(k.isdigit() and int(k) >= 1 for k in parts):
        raise ValueError(f"--ks must be comma-separated positive integers, got {text!r}")
    return tuple(int(k) for k in parts)


def _positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {text}")
    return value


def _non_negative_int(text: str) -> int:
    value = int(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be a non-negative integer, got {text}")
    return value


def environment() -> dict:
    """Where the numbers come from: machine, jax backend and versions (torch when importable)."""
    import jax

    env = {
        "machine": platform.machine(),
        "processor": _cpu_model(),
        "cpu_count": os.cpu_count(),
        "python": platform.python_version(),
        "jax": jax.__version__,
        "backend": jax.default_backend(),
        "devices": len(jax.devices()),
        "xla_flags": os.environ.get("XLA_FLAGS", ""),
        # the native CPU kernel's compiled path (avx512, avx2, portable; None without it): CPU
        # numbers depend on it as much as on the CPU
        "native_kernel": cpu_native.kernel_path(),
    }
    try:
        import torch

        env["torch"] = torch.__version__
        env["torch_threads"] = torch.get_num_threads()
    except ImportError:
        env["torch"] = None
    return env


def machine_line(env: dict) -> str:
    """``environment()`` in a benchmark's header: CPU, cores, jax and its backend, and the native
    CPU kernel's path (where there is one)."""
    kernel = f", native kernel {env['native_kernel']}" if env.get("native_kernel") else ""
    return f"{env['processor']}, {env['cpu_count']} CPUs, jax {env['jax']} {env['backend']}{kernel}"


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor()


def fmt_rate(per_second: float | None, unit: str = "el/s") -> str:
    """``1.23e9`` -> ``"1.23 G el/s"``; ``None`` -> ``"-"``."""
    if per_second is None:
        return "-"
    for scale, prefix in ((1e12, "T"), (1e9, "G"), (1e6, "M"), (1e3, "k")):
        if abs(per_second) >= scale:
            return f"{per_second / scale:.3g} {prefix} {unit}"
    return f"{per_second:.3g} {unit}"


def fmt_seconds(seconds: float | None) -> str:
    """Seconds with a readable unit: ``0.0123`` -> ``"12.3 ms"``."""
    if seconds is None:
        return "-"
    for scale, unit in ((1.0, "s"), (1e-3, "ms"), (1e-6, "us")):
        if seconds >= scale:
            return f"{seconds / scale:.3g} {unit}"
    return f"{seconds / 1e-9:.3g} ns"


def print_table(
    columns: Sequence[tuple[str, str]], rows: Sequence[dict], *, title: str | None = None, file=None
) -> None:
    """Print ``rows`` as an aligned text table.

    Args:
      columns: ``(key, header)`` pairs; a row's value for ``key`` is printed with ``str`` (a
        missing key or ``None`` prints ``-``).
      rows: dicts.
      title: printed above the table.
    """
    file = sys.stdout if file is None else file
    cells = [[header for _, header in columns]]
    cells += [["-" if row.get(key) is None else str(row[key]) for key, _ in columns] for row in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(columns))]
    if title:
        print(title, file=file)
    for i, r in enumerate(cells):
        print(
            "  ".join(c.ljust(w) if j == 0 else c.rjust(w) for j, (c, w) in enumerate(zip(r, widths))).rstrip(),
            file=file,
        )
        if i == 0:
            print("  ".join("-" * w for w in widths), file=file)


def emit(result: dict, *, as_json: bool, render: Callable[[dict], None]) -> None:
    """Print ``result`` as one JSON object (``as_json``) or through ``render`` (tables)."""
    if as_json:
        print(json.dumps(result, sort_keys=True, default=_json_default))
    else:
        render(result)


def run_cli(
    parser: argparse.ArgumentParser,
    argv: list[str] | None,
    run: Callable[[argparse.Namespace], dict],
    render: Callable[[dict], None],
) -> int:
    """A benchmark's entry point: parse ``argv`` (default ``sys.argv[1:]``), ``run(args)`` and print
    the result (``--json``: one JSON object, else ``render``). Returns 0, or 2 where an argument is
    bad or a package or file is missing (the message on stderr, after the parser's program name).
    """
    from zeroth.data.resources import MissingPackage

    try:
        args = parser.parse_args(sys.argv[1:] if argv is None else argv)
        result = run(args)
    except SystemExit as exc:
        return int(exc.code or 0)
    except (ValueError, MissingPackage, FileNotFoundError) as exc:
        print(f"{parser.prog}: {exc}", file=sys.stderr)
        return 2
    emit(result, as_json=args.json, render=render)
    return 0


def _json_default(value):
    if hasattr(value, "item"):  # NumPy scalars
        return value.item()
    if hasattr(value, "_asdict"):
        return value._asdict()
    raise TypeError(f"not JSON serialisable: {type(value).__name__}")
