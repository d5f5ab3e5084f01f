"""Every Pallas kernel compiled for an NVIDIA H100 on this CPU-only machine: Triton's compiler takes
each kernel to PTX, what failed every replay on the first H100 (``lax.population_count``, the
canary here). The TPU targets and how it works: ``tests/test_kernel_compile.py``; a file of its
own so that the two run in different test processes."""

from test_kernel_compile import GPU_REPLAY, check_target, needs_cuda_compiler


@needs_cuda_compiler
def test_every_kernel_compiles_for_an_h100():
    check_target("h100", GPU_REPLAY)
