"""Every Pallas kernel compiled for a TPU v5e and a TPU v4 by libtpu, on this CPU-only machine.

The lowering tests export the kernels for Mosaic; compiling them goes further (vector layouts,
VMEM) and found what export could not: no TPU compiled the replay kernel on a float16 leaf (the
doctor's canonical replay among them), and a TPU v4 compiles none of the sign-bit or binary
kernels. ``tests/tpu_compile.py`` compiles them in a process of its own; libtpu comes from
``scripts/install_libtpu.sh`` (run by ``make install-dev``).
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
LIBTPU = Path(os.environ.get("ZEROTH_LIBTPU", Path(sys.prefix) / "libtpu" / "libtpu.so"))

pytestmark = pytest.mark.skipif(
    not LIBTPU.is_file(), reason=f"no libtpu at {LIBTPU} (scripts/install_libtpu.sh, run by make install-dev, puts it there)"
)

# Mosaic's sublane gather, which a TPU v3 or v4 lacks: every kernel that reduces along lanes into a
# lane-major row needs it. zeroth.rule.lacks_sublane_gather sends `auto` to the jnp path there.
GATHER_KERNELS = ("signbits pack", "signbits merge", "binary dense", "binary dense ternary", "binary conv3x3",
                  "binary dots")


def _compile(generation: str) -> dict[str, dict]:
    env = dict(os.environ, TPU_LIBRARY_PATH=str(LIBTPU), JAX_PLATFORMS="cpu", TPU_SKIP_MDS_QUERY="1",
               PYTHONPATH=str(ROOT))
    env.pop("XLA_FLAGS", None)
    proc = subprocess.run([sys.executable, str(ROOT / "tests" / "tpu_compile.py"), generation], env=env, cwd=ROOT,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    assert lines[0]["generation"] == generation, lines[0]
    return {line["case"]: line for line in lines[1:]}


def _mosaic_kernels(results: dict[str, dict], case: str) -> int:
    assert results[case]["ok"], f"{case}: {results[case]['error']}"
    return results[case]["mosaic_kernels"]


def _check_replay(results: dict[str, dict]) -> None:
    for dist in ("binomial", "rademacher"):
        for case in [c for c in results if c.startswith(("perturb_pallas", "tiling")) and dist in c]:
            assert _mosaic_kernels(results, case) == 1, case
        # a buffer per dtype: float32 and bfloat16 through the kernel, float16 through the jnp rule
        assert _mosaic_kernels(results, f"flat 50 leaves bf16/f32/f16 {dist} K=3") == 2
        assert _mosaic_kernels(results, f"doctor flat {dist} K=16") == 2
        assert _mosaic_kernels(results, f"doctor tree {dist} K=16") == 0  # leaves under a tile: the jnp rule
        # a kernel for each of the three bfloat16 and float32 leaves, the two float16 ones by the jnp rule
        assert _mosaic_kernels(results, f"doctor tiles {dist} K=5") == 3


def test_every_kernel_compiles_for_a_tpu_v5e():
    results = _compile("v5e")
    _check_replay(results)
    for case in ("signbits pack", "signbits unpack", "signbits merge", "signbits majority", "binary dense",
                 "binary dense ternary", "binary conv3x3", "binary dots"):
        assert _mosaic_kernels(results, case) == 1, case


def test_a_tpu_v4_compiles_the_replay_and_lacks_the_sublane_gather():
    results = _compile("v4")
    _check_replay(results)
    for case in ("signbits unpack", "signbits majority"):
        assert _mosaic_kernels(results, case) == 1, case
    for case in GATHER_KERNELS:  # asked for by name (impl="pallas"); `auto` runs the jnp path on a v4
        assert not results[case]["ok"] and "Sublane gather not supported" in results[case]["error"], results[case]
