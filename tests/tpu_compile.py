"""Compile zeroth's Pallas kernels for a TPU without one, through libtpu: ``python tests/tpu_compile.py v5e``.

Exporting for TPU (``lowering_util``) stops at Mosaic's input; libtpu then compiles the kernel
(vector layouts, VMEM allocation) and refuses what the chip cannot do, which export never sees: a
float16 vector load on every generation, Mosaic's sublane gather on a TPU v3 or v4, SMEM
allocations (the keys of a 4096-update replay took 2 MiB of a TPU v5e's 1 MiB). jax compiles
for a TPU topology without a device (``jax.experimental.topologies``) once ``TPU_LIBRARY_PATH``
names libtpu's shared library (``scripts/install_libtpu.sh`` puts it in ``.venv/libtpu/``).

Prints one JSON object per case: its name, ``ok`` or the first line of the error, and the Mosaic
kernels (``tpu_custom_call``) in the compiled program. Run in a process of its own
(``tests/test_tpu_compile.py``): libtpu stays out of the test processes.
"""

import json
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
from jax._src.pallas.mosaic import tpu_info
from jax.experimental import topologies

from zeroth import doctor, replay, rule
from zeroth.bench.kernels import TILE_CANDIDATES
from zeroth.kernels import binary as kb
from zeroth.kernels import perturb as kp
from zeroth.kernels import signbits as sb

TOPOLOGIES = {"v3": "v3:2x2", "v4": "v4:2x2x1", "v5e": "v5e:2x2", "v5p": "v5p:2x2x1", "v6e": "v6e:2x2"}
DISTS = ("binomial", "rademacher")


def target(generation: str):
    """The first device of a topology of ``generation`` (no TPU needed) and a replicated sharding on it.

    Pallas reads the chip's description (tiling, VMEM) from the process's default device, here a
    CPU: the chip of the topology is registered under the CPU's device kind."""
    device = topologies.get_topology_desc(TOPOLOGIES[generation], "tpu").devices[0]
    chip = tpu_info.chip_version_from_device_kind(device.device_kind)
    tpu_info.registry[jax.devices()[0].device_kind] = lambda: tpu_info._get_tpu_info_impl(chip, 1)
    mesh = jax.sharding.Mesh(np.array([device]), ("x",))
    return device, jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())


def cases():
    """``(name, fn, [(shape, dtype), ...], donate)``: every Pallas kernel as zeroth calls it on a TPU."""
    for dist in DISTS:
        for dtype in ("float32", "bfloat16"):
            # in place on whole rows; whole tiles and a jnp tail; keys of 4096 updates in SMEM (32 KiB)
            for k, n in ((1, 1 << 20), (16, 100_003)) + (((4096, 1 << 20),) if dtype == "float32" else ()):
                yield (f"perturb_pallas {dist} {dtype} K={k} n={n}",
                       lambda x, keys, s, dist=dist: kp.perturb_pallas(x, keys, s, distribution=dist, platform="tpu",
                                                                       inplace=True),
                       [((n,), dtype), ((k, 2), "uint32"), ((k,), "float32")], (0,))
        for blocks in TILE_CANDIDATES["tpu"]:  # what `zeroth bench kernels` sweeps on a TPU
            yield (f"tiling {blocks.tile}x{blocks.lanes} {dist} K=64",
                   lambda x, keys, s, dist=dist, blocks=blocks: kp.perturb_pallas(
                       x, keys, s, distribution=dist, block_sizes=blocks, platform="tpu", inplace=True),
                   [((1 << 20,), "float32"), ((64, 2), "uint32"), ((64,), "float32")], (0,))
        mixed = {f"l{i:02d}": jax.ShapeDtypeStruct((1008 + 7 * i,), ("bfloat16", "float32", "float16")[i % 3])
                 for i in range(50)}
        yield _flat_case(f"flat 50 leaves bf16/f32/f16 {dist} K=3", mixed, dist, 3)
        canonical = doctor.canonical_params()
        yield _flat_case(f"doctor flat {dist} K=16", canonical, dist, 16)
        leaves = jax.tree_util.tree_map(lambda a: (a.shape, str(a.dtype)), canonical)
        tiles = jax.tree_util.tree_map(lambda a: (a.shape, str(a.dtype)), doctor.tile_params())
        yield (f"doctor tiles {dist} K=5",  # the doctor's leaves of partial tiles
               lambda p, keys, s, dist=dist: kp.apply_updates(p, keys, s, distribution=dist, platform="tpu",
                                                              inplace=True),
               [tiles, ((5, 2), "uint32"), ((5,), "float32")], (0,))
        yield (f"doctor tree {dist} K=16",
               lambda p, keys, s, dist=dist: kp.apply_updates(p, keys, s, distribution=dist, platform="tpu",
                                                              inplace=True),
               [leaves, ((16, 2), "uint32"), ((16,), "float32")], (0,))
    n = 100_003
    words = ((sb.n_words(n),), "uint32")
    yield "signbits pack", lambda x: sb.pack(x, impl="pallas", platform="tpu"), [((n,), "bfloat16")], ()
    yield ("signbits unpack", lambda w: sb.unpack(w, (n,), dtype=jnp.bfloat16, scale=0.25, impl="pallas",
                                                  platform="tpu"), [words], ())
    yield ("signbits merge", lambda v, vs, key: sb.merge(v, vs, key, 3, word_offset=64, impl="pallas", platform="tpu"),
           [words, words, ((2,), "uint32")], ())
    yield ("signbits majority", lambda s: sb.majority(s, impl="pallas", platform="tpu"),
           [((5, sb.n_words(n)), "uint32")], ())
    x, s, t = ((300, 20), "uint32"), ((70, 20), "uint32"), ((70,), "int32")
    yield "binary dense", lambda x, s, t: kb.dense(x, s, t, n=600, impl="pallas", platform="tpu"), [x, s, t], ()
    yield ("binary dense ternary", lambda x, s, m, t: kb.dense(x, s, t, m, impl="pallas", platform="tpu"),
           [x, s, s, t], ())
    yield ("binary conv3x3", lambda x, s, t: kb.conv3x3(x, s, t, c=50, impl="pallas", platform="tpu"),
           [((2, 7, 7, 2), "uint32"), ((40, 18), "uint32"), ((40,), "int32")], ())
    yield "binary dots", lambda x, s, m: kb.dots(x, s, m, impl="pallas", platform="tpu"), [x, s, s], ()


def _flat_case(name, tree, dist, k):
    layout = replay.layout_of(tree, platform="tpu")
    tables = layout.tables()
    return (name,
            lambda bufs, keys, s: kp.apply_updates_flat(bufs, keys, s, tables, distribution=dist, platform="tpu",
                                                        inplace=True),
            [[((n,), str(np.dtype(d))) for d, n in zip(layout.dtypes, layout.sizes)], ((k, 2), "uint32"),
             ((k,), "float32")], (0,))


def main(generation: str) -> None:
    device, sharding = target(generation)
    print(json.dumps({"generation": generation, "device_kind": device.device_kind,
                      "tpu_generation": rule.tpu_generation(device.device_kind)}), flush=True)

    def spec(shape_dtype):
        return jax.ShapeDtypeStruct(shape_dtype[0], jnp.dtype(shape_dtype[1]), sharding=sharding)

    for name, fn, args, donate in cases():
        args = jax.tree_util.tree_map(spec, args, is_leaf=lambda a: isinstance(a, tuple) and isinstance(a[1], str))
        start = time.perf_counter()
        try:
            text = jax.jit(fn, donate_argnums=donate).trace(*args).lower().compile().as_text()
            result = {"ok": True, "mosaic_kernels": text.count('custom_call_target="tpu_custom_call"')}
        except Exception as e:  # noqa: BLE001 (every compile error is the result)
            result = {"ok": False, "error": f"{type(e).__name__}: {str(e).strip().splitlines()[0][:300]}"}
        print(json.dumps({"case": name, **result, "seconds": round(time.perf_counter() - start, 2)}), flush=True)


if __name__ == "__main__":
    main(sys.argv[1])
