"""Every Pallas kernel compiled for an NVIDIA H100 on this CPU-only machine: Triton's compiler takes
each kernel to PTX, what failed every replay on the first H100 (``lax.population_count``, the
canary here). The TPU targets and how it works: ``tests/test_kernel_compile.py``; a file of its
own so that the two run in different test processes."""

from test_kernel_compile import GATHER_KERNELS, OTHER_KERNELS, _check_replay, _compile, _kernels, needs_cuda_compiler


@needs_cuda_compiler
def test_every_kernel_compiles_for_an_h100():
    results = _compile("h100")
    # Triton takes every dtype: a kernel per flat buffer (three dtypes) and per leaf of the doctor's suites
    _check_replay(results, {"flat 50 leaves bf16/f32/f16 {dist} K=3": 3, "doctor flat {dist} K=16": 3,
                            "doctor tiles {dist} K=5": 5, "doctor tree {dist} K=16": 3})
    for case in GATHER_KERNELS + OTHER_KERNELS:
        assert _kernels(results, case) == 1, case
