"""Every Pallas kernel compiled for a TPU v5e and a TPU v4 on this CPU-only machine (and for an
NVIDIA H100 in ``test_kernel_compile_gpu.py``, so that the two run in different test processes).

The lowering tests export the kernels; compiling them goes on to what the chip's compiler refuses
(vector layouts, VMEM and SMEM on a TPU; Triton's legalization to PTX on a GPU) and found what
export had passed: no TPU compiled the replay kernel on a float16 leaf (the doctor's canonical
replay among them), a TPU v4 compiles none of the sign-bit pack and merge or binary kernels, and
the keys of a 4096-update replay outgrew a TPU's SMEM. ``tests/kernel_compile.py`` compiles them
in a process of its own, with libtpu and jax's CUDA plugin and compiler from
``scripts/install_device_compilers.sh`` (run by ``make install-dev``).
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from kernel_compile import in_short_run
from zeroth.bench.memory import TARGETS, compiler_folder

ROOT = Path(__file__).resolve().parents[1]
LIBTPU = Path(os.environ.get("ZEROTH_LIBTPU", Path(sys.prefix) / "libtpu" / "libtpu.so"))
CUDA_COMPILER = compiler_folder(TARGETS["h100"])  # where scripts/install_device_compilers.sh puts it

needs_libtpu = pytest.mark.skipif(
    not LIBTPU.is_file(),
    reason=f"no libtpu at {LIBTPU} (scripts/install_device_compilers.sh, run by make install-dev, puts it there)",
)
needs_cuda_compiler = pytest.mark.skipif(
    not (CUDA_COMPILER / "jax_plugins").is_dir(),
    reason=f"no jax CUDA plugin in {CUDA_COMPILER} (scripts/install_device_compilers.sh, run by make install-dev, "
    "puts it there)",
)

# Mosaic's sublane gather, which a TPU v3 or v4 lacks: every kernel that reduces along lanes into a
# lane-major row needs it. zeroth.rule.lacks_sublane_gather sends `auto` to the jnp path there.
GATHER_KERNELS = (
    "signbits pack",
    "signbits merge",
    "binary dense",
    "binary dense ternary",
    "binary conv3x3",
    "binary dots",
)
OTHER_KERNELS = ("signbits unpack", "signbits majority")


def _compile(target: str) -> dict[str, dict]:
    env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=str(ROOT))
    env.pop("XLA_FLAGS", None)
    env.pop("JAX_COMPILATION_CACHE_DIR", None)  # compiled for the chip here, not read from the session's cache
    if target == "h100":
        env["PYTHONPATH"] = os.pathsep.join([str(CUDA_COMPILER), str(ROOT)])
    else:
        env.update(TPU_LIBRARY_PATH=str(LIBTPU), TPU_SKIP_MDS_QUERY="1")
    proc = subprocess.run(
        [sys.executable, str(ROOT / "tests" / "kernel_compile.py"), target],
        env=env,
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    assert lines[0]["target"] == target, lines[0]
    results = {line["case"]: line for line in lines[1:]}
    assert not results.pop("canary")["ok"]  # compiled for the chip, not only exported
    return results


def _kernels(results: dict[str, dict], case: str) -> int:
    assert results[case]["ok"], f"{case}: {results[case]['error']}"
    return results[case]["kernels"]


# a kernel per buffer or leaf of float32 or bfloat16 on a TPU (float16, and leaves under a tile, by
# the jnp rule); Triton takes every dtype
TPU_REPLAY = {"flat 50 leaves bf16/f32/f16 {dist} K=3": 2, "doctor flat {dist} K=16": 2, "doctor tiles {dist} K=5": 3}
GPU_REPLAY = {"flat 50 leaves bf16/f32/f16 {dist} K=3": 3, "doctor flat {dist} K=16": 3, "doctor tiles {dist} K=5": 5}


def check_target(target: str, replay_kernels: dict[str, int], lacking: tuple[str, ...] = (), why: str = "") -> None:
    """Compile every case for ``target``: one kernel per replay and tiling, ``replay_kernels`` for the
    multi-leaf replays, one per sign-bit and binary kernel but those ``lacking``, which must fail
    with ``why``."""
    results = _compile(target)
    for dist in ("binomial", "rademacher"):
        for case in [c for c in results if c.startswith(("perturb_pallas", "tiling")) and dist in c]:
            assert _kernels(results, case) == 1, case
        for case, n in replay_kernels.items():
            name = case.format(dist=dist)
            if in_short_run(target, name):
                assert _kernels(results, name) == n, name
            else:  # its twin of the other distribution compiles the same blocks
                assert name not in results
    for case in GATHER_KERNELS + OTHER_KERNELS:
        if case in lacking:
            assert not results[case]["ok"] and why in results[case]["error"], results[case]
        else:
            assert _kernels(results, case) == 1, case


@needs_libtpu
def test_every_kernel_compiles_for_a_tpu_v5e():
    check_target("v5e", TPU_REPLAY)


@needs_libtpu
def test_a_tpu_v4_compiles_the_replay_and_lacks_the_sublane_gather():
    # asked for by name (impl="pallas"); `auto` runs the jnp path on a v4
    check_target("v4", TPU_REPLAY, lacking=GATHER_KERNELS, why="Sublane gather not supported")
