"""Compile zeroth's Pallas kernels for a TPU or a GPU without one: ``python tests/kernel_compile.py v5e|v4|h100 [--all]``.

Exporting (``lowering_util``) stops at Mosaic's or Triton's input; compiling goes on to what the
chip's compiler refuses and export never sees. For a TPU, libtpu (vector layouts, VMEM and SMEM
allocation) refused a float16 vector load on every generation, Mosaic's sublane gather on a TPU
v3 or v4, and the keys of a 4096-update replay (2 MiB of a TPU v5e's 1 MiB of SMEM). For a GPU,
Triton's compiler to PTX refuses what it cannot legalize: ``lax.population_count`` in a kernel
("failed to legalize operation 'math.ctpop'") failed every replay on the first H100, and fails
here too. jax compiles for a described device without one (``jax.experimental.topologies``): a
TPU once ``TPU_LIBRARY_PATH`` names libtpu's shared library, an H100
(``zeroth.bench.memory.TARGETS``) once jax's CUDA plugin and the CUDA compiler are on
``PYTHONPATH``; ``scripts/install_device_compilers.sh`` puts them in ``.venv/libtpu/`` and
``.venv/cuda-compiler/``.

Prints one JSON object per case: its name, ``ok`` or the first line of the error, and the kernels
(Mosaic's ``tpu_custom_call``, Triton's ``__gpu$xla.gpu.triton``) in the compiled program. Run in
a process of its own (``tests/test_kernel_compile.py``): the compilers stay out of the test processes.
"""

import json
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import topologies

from zeroth import doctor, replay, rule
from zeroth.bench.kernels import TILE_CANDIDATES
from zeroth.kernels import binary as kb
from zeroth.kernels import perturb as kp
from zeroth.kernels import signbits as sb

TPUS = {"v3": "v3:2x2", "v4": "v4:2x2x1", "v5e": "v5e:2x2", "v5p": "v5p:2x2x1", "v6e": "v6e:2x2"}
GPUS = ("h100",)
KERNEL_CALLS = {"tpu": 'custom_call_target="tpu_custom_call"', "gpu": 'custom_call_target="__gpu$xla.gpu.triton"'}
DISTS = ("binomial", "rademacher")


def target(name: str):
    """``(platform, device, sharding, compiler options)`` for a TPU generation of :data:`TPUS` or a
    GPU of :data:`GPUS`: the first device of a described topology (no device needed) and a
    replicated sharding on it.

    Pallas reads a TPU's description (tiling, VMEM, SMEM) from the process's default device, here
    a CPU: the topology's chip is registered under the CPU's device kind."""
    if name in GPUS:
        from zeroth.bench import memory

        device, sharding, options = memory._target(name)
        return "gpu", device, sharding, options
    from jax._src.pallas.mosaic import tpu_info

    device = topologies.get_topology_desc(TPUS[name], "tpu").devices[0]
    chip = tpu_info.chip_version_from_device_kind(device.device_kind)
    tpu_info.registry[jax.devices()[0].device_kind] = lambda: tpu_info._get_tpu_info_impl(chip, 1)
    mesh = jax.sharding.Mesh(np.array([device]), ("x",))
    return "tpu", device, jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec()), {}


def cases(platform: str):
    """``(name, fn, [(shape, dtype), ...], donate)``: every Pallas kernel as zeroth calls it on ``platform``."""
    # float16 has no Mosaic vectors: on a TPU the replay takes it to the jnp rule (checked below)
    dtypes = ("float32", "bfloat16") + (("float16",) if platform == "gpu" else ())
    for dist in DISTS:
        for dtype in dtypes:
            # in place on whole rows; whole tiles and a jnp tail; the keys of 4096 updates (TPU: SMEM)
            for k, n in ((1, 1 << 20), (16, 100_003)) + (((4096, 1 << 20),) if dtype == "float32" else ()):
                yield (
                    f"perturb_pallas {dist} {dtype} K={k} n={n}",
                    lambda x, keys, s, dist=dist: kp.perturb_pallas(
                        x, keys, s, distribution=dist, platform=platform, inplace=True
                    ),
                    [((n,), dtype), ((k, 2), "uint32"), ((k,), "float32")],
                    (0,),
                )
        # what `zeroth bench kernels` sweeps there; on a GPU not the tiles of 16384 elements and more,
        # which Triton takes 1-57 s each to compile (110 s of the 153 s of every case here)
        for blocks in [b for b in TILE_CANDIDATES[platform] if platform == "tpu" or b.tile < 16384]:
            yield (
                f"tiling {blocks.tile}x{blocks.lanes} {dist} K=64",
                lambda x, keys, s, dist=dist, blocks=blocks: kp.perturb_pallas(
                    x, keys, s, distribution=dist, block_sizes=blocks, platform=platform, inplace=True
                ),
                [((1 << 20,), "float32"), ((64, 2), "uint32"), ((64,), "float32")],
                (0,),
            )
        if platform == "gpu":  # a ZO step's perturbed leaves, read in place, written apart (Triton only)
            yield (
                f"perturb_pallas_segments {dist} 3 leaves apart",
                lambda buf, keys, s, dist=dist: kp.perturb_pallas_segments(
                    buf,
                    keys,
                    s,
                    ((5, 70_001, 2), (100_003, 4096, 0), (70_010, 3, 1)),
                    distribution=dist,
                    platform=platform,
                ),
                [((110_000,), "bfloat16"), ((3, 1, 2), "uint32"), ((1,), "float32")],
                (),
            )
        mixed = {
            f"l{i:02d}": jax.ShapeDtypeStruct((1008 + 7 * i,), ("bfloat16", "float32", "float16")[i % 3])
            for i in range(50)
        }
        yield _flat_case(f"flat 50 leaves bf16/f32/f16 {dist} K=3", mixed, dist, 3, platform)
        canonical = doctor.canonical_params()
        yield _flat_case(f"doctor flat {dist} K=16", canonical, dist, 16, platform)
        for suite, tree, k in (("tiles", doctor.tile_params(), 5), ("tree", canonical, 16)):
            leaves = jax.tree_util.tree_map(lambda a: (a.shape, str(a.dtype)), tree)
            yield (
                f"doctor {suite} {dist} K={k}",  # the tiles suite's leaves leave partial tiles
                lambda p, keys, s, dist=dist: kp.apply_updates(
                    p, keys, s, distribution=dist, platform=platform, inplace=True
                ),
                [leaves, ((k, 2), "uint32"), ((k,), "float32")],
                (0,),
            )
    n = 100_003
    words = ((sb.n_words(n),), "uint32")
    yield "signbits pack", lambda x: sb.pack(x, impl="pallas", platform=platform), [((n,), "bfloat16")], ()
    yield (
        "signbits unpack",
        lambda w: sb.unpack(w, (n,), dtype=jnp.bfloat16, scale=0.25, impl="pallas", platform=platform),
        [words],
        (),
    )
    yield (
        "signbits merge",
        lambda v, vs, key: sb.merge(v, vs, key, 3, word_offset=64, impl="pallas", platform=platform),
        [words, words, ((2,), "uint32")],
        (),
    )
    yield (
        "signbits majority",
        lambda s: sb.majority(s, impl="pallas", platform=platform),
        [((5, sb.n_words(n)), "uint32")],
        (),
    )
    x, s, t = ((300, 20), "uint32"), ((70, 20), "uint32"), ((70,), "int32")
    yield "binary dense", lambda x, s, t: kb.dense(x, s, t, n=600, impl="pallas", platform=platform), [x, s, t], ()
    yield (
        "binary dense ternary",
        lambda x, s, m, t: kb.dense(x, s, t, m, impl="pallas", platform=platform),
        [x, s, s, t],
        (),
    )
    yield (
        "binary conv3x3",
        lambda x, s, t: kb.conv3x3(x, s, t, c=50, impl="pallas", platform=platform),
        [((2, 7, 7, 2), "uint32"), ((40, 18), "uint32"), ((40,), "int32")],
        (),
    )
    yield "binary dots", lambda x, s, m: kb.dots(x, s, m, impl="pallas", platform=platform), [x, s, s], ()
    yield "canary", _canary(platform), [((1024,), "uint32") if platform == "gpu" else ((8, 128), "float16")], ()


def _canary(platform: str):
    """A kernel the chip's compiler refuses though it exports: on a GPU ``lax.population_count``
    (Triton cannot legalize ``math.ctpop``, what failed every replay on the first H100), on a TPU
    a float16 vector load ("Invalid vector type for load" from Mosaic on every generation, what
    failed the doctor's float16 replay). Its failure shows that the cases here were compiled for
    the chip, not only exported. (A block of 64 MiB, past every TPU's VMEM, fails too, but only
    after 8 s of compiling for a v5e; the float16 load fails in 0.07 s.)"""
    from jax.experimental import pallas as pl

    from zeroth.kernels import triton_params

    def kernel(x_ref, o_ref):
        o_ref[...] = jax.lax.population_count(x_ref[...]) if platform == "gpu" else x_ref[...] * x_ref[...]

    def fn(x):
        return pl.pallas_call(
            kernel,
            out_shape=jax.ShapeDtypeStruct(x.shape, x.dtype),
            compiler_params=triton_params() if platform == "gpu" else None,
            name="canary",
        )(x)

    return fn


def _flat_case(name, tree, dist, k, platform):
    layout = replay.layout_of(tree, platform=platform)
    tables = layout.tables()
    return (
        name,
        lambda bufs, keys, s: kp.apply_updates_flat(
            bufs, keys, s, tables, distribution=dist, platform=platform, inplace=True
        ),
        [
            [((n,), str(np.dtype(d))) for d, n in zip(layout.dtypes, layout.sizes)],
            ((k, 2), "uint32"),
            ((k,), "float32"),
        ],
        (0,),
    )


def in_short_run(target_name: str, case: str) -> bool:
    """The cases the test compiles (``--all``: every case), to keep the suite short: Rademacher's
    tilings, 4096-update keys, 50 mixed leaves and the doctor's tiles and the bfloat16 / float16
    single-update replays compile the same blocks as their binomial or float32 twins (Rademacher's
    noise is compiled by its single-leaf replays and the doctor's flat replay), the doctor's tree is
    the flat replay's leaves; a TPU v4 has the v5e's block rules and SMEM, so it compiles only the
    float32 replays and what else differs (sign-bit, binary, multi-leaf)."""
    if (
        case.startswith("doctor tree")
        or "rademacher" in case
        and case.startswith(("tiling", "flat 50", "doctor tiles"))
    ):
        return False
    if case.startswith("perturb_pallas") and (
        "K=4096" in case and "rademacher" in case or "K=1 " in case and "float32" not in case
    ):
        return False
    if target_name == "v4":
        return (
            not case.startswith("tiling")
            and "K=4096" not in case
            and (not case.startswith("perturb_pallas") or "float32" in case)
        )
    return True


def main(name: str, every: bool = False) -> None:
    platform, device, sharding, options = target(name)
    print(
        json.dumps(
            {
                "target": name,
                "platform": platform,
                "device_kind": device.device_kind,
                "tpu_generation": rule.tpu_generation(device.device_kind),
            }
        ),
        flush=True,
    )

    def spec(shape_dtype):
        return jax.ShapeDtypeStruct(shape_dtype[0], jnp.dtype(shape_dtype[1]), sharding=sharding)

    for case, fn, args, donate in cases(platform):
        if not (every or in_short_run(name, case)):
            continue
        args = jax.tree_util.tree_map(spec, args, is_leaf=lambda a: isinstance(a, tuple) and isinstance(a[1], str))
        start = time.perf_counter()
        try:
            text = jax.jit(fn, donate_argnums=donate).trace(*args).lower().compile(options).as_text()
            result = {"ok": True, "kernels": text.count(KERNEL_CALLS[platform])}
        except Exception as e:  # noqa: BLE001 (every compile error is the result)
            result = {"ok": False, "error": f"{type(e).__name__}: {str(e).strip().splitlines()[0][:300]}"}
        print(json.dumps({"case": case, **result, "seconds": round(time.perf_counter() - start, 2)}), flush=True)


if __name__ == "__main__":
    main(sys.argv[1], every="--all" in sys.argv[2:])
