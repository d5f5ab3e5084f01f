"""Lower Pallas kernels for GPU (Triton) and TPU (Mosaic) on a CPU-only machine with ``jax.export``.

No accelerator is needed: exporting for a platform runs that platform's whole Pallas lowering
(every op of the kernel body must have a Triton or Mosaic rule), which is what fails first when
a kernel uses something the backend lacks. Mosaic's block-shape check also asks for the chip's
tiling; with no TPU attached we register the TPU v5e's description for the CPU device kind.
"""

import contextlib
import re

import jax
import pytest
from jax import export

PLATFORMS = ("cuda", "tpu")
_CUSTOM_CALLS = {"cuda": "__gpu$xla.gpu.triton", "tpu": "tpu_custom_call"}

# Primitives that Pallas lowers to Triton IR but that Triton itself cannot compile. The export
# below stops at Triton IR; the GPU's compiler fails later, on the device: on an NVIDIA H100 (jax
# 0.11.2) `lax.population_count` of a uint32 in the replay kernel gave "failed to legalize
# operation 'math.ctpop'" and every Pallas replay failed to compile. Of an int32, Pallas lowers it
# to libdevice's __nv_popc (the GPU's popc instruction), which zeroth.noise.binomial_from_words
# counts with.
TRITON_CANNOT_COMPILE = frozenset({"population_count of an unsigned integer"})


def _sub_jaxprs(value):
    for v in value if isinstance(value, (tuple, list)) else (value,):
        if hasattr(v, "eqns"):  # a Jaxpr
            yield v
        elif hasattr(getattr(v, "jaxpr", None), "eqns"):  # a ClosedJaxpr
            yield v.jaxpr


def _primitives(jaxpr, found: set[str], in_kernel: bool) -> set[str]:
    for eqn in jaxpr.eqns:
        if in_kernel:
            name = eqn.primitive.name
            if name == "population_count" and jax.numpy.issubdtype(eqn.invars[0].aval.dtype, jax.numpy.unsignedinteger):
                name = "population_count of an unsigned integer"
            found.add(name)
        for value in eqn.params.values():
            for sub in _sub_jaxprs(value):
                _primitives(sub, found, in_kernel or eqn.primitive.name == "pallas_call")
    return found


def kernel_primitives(fn, args) -> set[str]:
    """The primitives inside the bodies of every Pallas kernel that ``fn(*args)`` calls."""
    return _primitives(jax.make_jaxpr(fn)(*args).jaxpr, set(), False)


@pytest.fixture
def tpu_chip_info(monkeypatch):
    from jax._src.pallas.mosaic import tpu_info
    from jax.experimental.pallas import tpu as pltpu

    info = pltpu.get_tpu_info_for_chip(pltpu.ChipVersion.TPU_V5E, 1)
    monkeypatch.setitem(tpu_info.registry, jax.devices()[0].device_kind, lambda: info)


# The GPU a cuda export lowers its Triton kernels for. jax 0.10 falls back to compute capability 9.0
# without a GPU; jax 0.11.2 reads the GPU from the abstract mesh's device or else the default
# device, and refused ("No supported GPU devices found, please specify an abstract GPU device
# using AbstractDevice") every export here beside an NVIDIA H200, where the tests run under the
# host CPU as their default device (tests/conftest.py).
GPU_TARGET = "NVIDIA H100 80GB HBM3"


def gpu_target():
    """A context in which exports lower Pallas GPU kernels for :data:`GPU_TARGET`."""
    from jax.sharding import AbstractDevice, AbstractMesh

    device = AbstractDevice(device_kind=GPU_TARGET, num_cores=None, platform="gpu")
    return jax.sharding.use_abstract_mesh(AbstractMesh((), (), abstract_device=device))


def _lowered_text(fn, args, platform: str) -> str:
    """The exported module; for ``cuda`` also checks that no kernel body uses a primitive that
    Triton cannot compile (:data:`TRITON_CANNOT_COMPILE`)."""
    target = _CUSTOM_CALLS[platform]
    if platform == "cuda":
        bad = kernel_primitives(fn, args) & TRITON_CANNOT_COMPILE
        assert not bad, f"a Pallas kernel body uses {sorted(bad)}, which Triton cannot compile on a GPU"
    with gpu_target() if platform == "cuda" else contextlib.nullcontext():
        exported = export.export(
            jax.jit(fn), platforms=[platform], disabled_checks=[export.DisabledSafetyCheck.custom_call(target)]
        )(*args)
    text = exported.mlir_module()
    assert target.split("$")[-1] in text, f"no {target} custom call in the {platform} module"
    return text


def lowered_kernels(fn, args, platform: str) -> list[str]:
    """Export ``fn(*args)`` for ``platform``; returns the kernel names in the module's custom calls."""
    return re.findall(r"zeroth_[a-z_]+", _lowered_text(fn, args, platform))


def kernel_launches(fn, args, platform: str) -> int:
    """Export ``fn(*args)`` for ``platform``; returns how many Triton / Mosaic kernel custom calls
    the module holds (one launch each)."""
    return _lowered_text(fn, args, platform).count(f"stablehlo.custom_call @{_CUSTOM_CALLS[platform]}(")
