"""Binary vs float32 speed of the same layer shapes (rows for ``zeroth bench binary`` and the binary experiment).

Each shape runs as the bit-packed binary layer (``zeroth.kernels.binary``: jnp on XLA, Pallas
natively on GPU/TPU, the NumPy reference on the host) and as a float32 matmul / convolution
of the same shape (``jnp.dot``, ``lax.conv_general_dilated``). Rates are **binary operations per
second**: a layer with ``M`` multiply-accumulates over ±1 values does ``2 M`` operations (one
XOR-and-count pair per weight and input, like a float multiply-add counts 2 FLOPs), so the
binary and float rows are directly comparable; ``speedup_vs_float32`` is float time / binary time.
The binary rows include the integer threshold and the packing of the output bits.

Example:
  >>> rows = binary_rows(batch=8, features=64, channels=32, image=6, repeats=1, warmup=1, host=False)
  >>> sorted({r["layer"] for r in rows})
  ['conv3x3', 'dense']
"""

from __future__ import annotations

import statistics
import time
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from zeroth import rule as _rule
from zeroth.binary import reference as R
from zeroth.kernels import binary as kb

__all__ = ["Timing", "timeit", "binary_rows"]


class Timing(NamedTuple):
    min_s: float
    median_s: float
    repeats: int


def timeit(fn, *, warmup: int = 1, repeats: int = 5) -> Timing:
    """Minimum and median seconds of ``fn()`` (which blocks until done) over ``repeats`` calls after ``warmup``."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(max(1, repeats)):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return Timing(min(times), statistics.median(times), len(times))


def _impls(backend: str) -> list[str]:
    return ["jnp"] + (["pallas"] if backend in ("gpu", "cuda", "rocm", "tpu") else [])


def _timed(fn, args, warm, reps) -> Timing:
    f = jax.jit(fn)
    return timeit(lambda: jax.block_until_ready(f(*args)), warmup=warm, repeats=reps)


def binary_rows(
    *,
    batch: int = 256,
    features: int = 1024,
    channels: int = 64,
    image: int = 28,
    conv_batch: int = 8,
    repeats: int = 5,
    warmup: int = 1,
    host: bool = True,
) -> list[dict]:
    """Rows: dense ``[batch, features] x [features, features]`` and conv ``[conv_batch, image, image, channels]``.

    Returns dicts with ``layer``, ``shape``, ``kind`` (binary / float32), ``impl``, ``seconds_min``,
    ``ops`` (2 x multiply-accumulates), ``ops_per_s`` and ``speedup_vs_float32`` (binary rows).
    """
    rng = np.random.default_rng(0)
    backend = _rule.default_platform()  # where the rows' arrays go (a jax.default_device too)
    rows: list[dict] = []

    def add(layer, shape, kind, impl, ops, t, note=""):
        rows.append(
            {
                "layer": layer,
                "shape": shape,
                "kind": kind,
                "impl": impl,
                "ops": ops,
                "seconds_min": t.min_s,
                "seconds_median": t.median_s,
                "ops_per_s": ops / t.min_s,
                "note": note,
            }
        )

    # dense
    n, o = features, features
    xv, wv = rng.choice([-1, 1], (batch, n)), rng.choice([-1, 1], (o, n))
    x, w = jnp.asarray(R.pack(xv)), jnp.asarray(R.pack(wv))
    t = jnp.zeros((o,), jnp.int32)
    ops = 2 * batch * n * o
    shape = f"{batch}x{n} @ {n}x{o}"
    xf, wf = jnp.asarray(xv, jnp.float32), jnp.asarray(wv.T, jnp.float32)
    tf = _timed(lambda a, b: jnp.dot(a, b), (xf, wf), warmup, repeats)
    add("dense", shape, "float32", "xla", ops, tf, "jnp.dot")
    for impl in _impls(backend):
        add(
            "dense",
            shape,
            "binary",
            impl,
            ops,
            _timed(lambda a, b, c: kb.dense(a, b, c, n=n, impl=impl), (x, w, t), warmup, repeats),
            "XOR-popcount + threshold",
        )
    if host:
        xh, wh, th = np.asarray(x), np.asarray(w), np.asarray(t)
        add(
            "dense",
            shape,
            "binary",
            "numpy",
            ops,
            timeit(lambda: R.dense(xh, wh, th, n=n), warmup=warmup, repeats=repeats),
            "np.bitwise_count",
        )

    # conv 3x3
    c = channels
    xv = rng.choice([-1, 1], (conv_batch, image, image, c))
    wv = rng.choice([-1, 1], (c, 9, c))
    x, w = jnp.asarray(R.pack(xv)), jnp.asarray(R.pack(wv).reshape(c, -1))
    t = jnp.zeros((c,), jnp.int32)
    ops = 2 * conv_batch * image * image * 9 * c * c
    shape = f"{conv_batch}x{image}x{image}x{c} -> {c}"
    xf = jnp.asarray(xv, jnp.float32)
    kf = jnp.asarray(wv.reshape(c, 3, 3, c).transpose(1, 2, 3, 0), jnp.float32)  # HWIO

    def fconv(a, k):
        return jax.lax.conv_general_dilated(a, k, (1, 1), "SAME", dimension_numbers=("NHWC", "HWIO", "NHWC"))

    add("conv3x3", shape, "float32", "xla", ops, _timed(fconv, (xf, kf), warmup, repeats), "lax.conv_general_dilated")
    for impl in _impls(backend):
        add(
            "conv3x3",
            shape,
            "binary",
            impl,
            ops,
            _timed(lambda a, b, d: kb.conv3x3(a, b, d, c=c, impl=impl), (x, w, t), warmup, repeats),
            "bit-packed im2col + XOR-popcount",
        )
    if host:
        xh, wh, th = np.asarray(x), np.asarray(w), np.asarray(t)
        add(
            "conv3x3",
            shape,
            "binary",
            "numpy",
            ops,
            timeit(lambda: R.conv3x3(xh, wh, th, c=c), warmup=warmup, repeats=repeats),
            "np.bitwise_count",
        )

    for r in rows:
        if r["kind"] == "binary":
            f = next(q for q in rows if q["layer"] == r["layer"] and q["kind"] == "float32")
            r["speedup_vs_float32"] = f["seconds_min"] / r["seconds_min"]
    return rows
