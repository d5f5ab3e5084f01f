"""A strict test environment: several CPU devices, derandomized hypothesis, warnings that matter as errors."""

import os

# Must happen before jax is imported anywhere.
_flags = os.environ.get("XLA_FLAGS", "")
if "xla_force_host_platform_device_count" not in _flags:
    os.environ["XLA_FLAGS"] = (_flags + " --xla_force_host_platform_device_count=4").strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")

# One persistent compilation cache for the session, for the processes the tests start (peers,
# stages, command-line runs, notebooks; pytest-xdist's workers pass the controller's environment on):
# the peers of a run, a run and its resume, the stages of the pipeline tests compile the same
# programs, and the second compile of a program is a read. Loaded programs give the same bits
# (test_doctor.py). It starts empty, as on a clean clone, and is removed at the end. A size limit
# turns on jax's file lock (the filelock package), so that no process reads an entry another is
# still writing. A test that names its own cache (or none) sets the variable itself. The test
# processes themselves do not use it (below): their thousands of small programs, each written
# once and rarely compiled again, made the suite slower.
if "JAX_COMPILATION_CACHE_DIR" not in os.environ:
    import tempfile

    os.environ["JAX_COMPILATION_CACHE_DIR"] = SESSION_JAX_CACHE = tempfile.mkdtemp(prefix="zeroth-tests-jax-cache-")
    os.environ["JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"] = "0"
    try:  # without filelock, jax refuses a size limit at the first compile of every process
        import filelock  # noqa: F401

        os.environ["JAX_COMPILATION_CACHE_MAX_SIZE"] = str(8 << 30)
    except ImportError:
        pass
else:
    SESSION_JAX_CACHE = None  # a worker of this session, or a cache the caller chose

import warnings  # noqa: E402

import jax  # noqa: E402
from hypothesis import HealthCheck, settings  # noqa: E402

jax.config.update("jax_compilation_cache_dir", None)  # the environment's cache is for the processes tests start
jax.config.update("jax_numpy_rank_promotion", "raise")
jax.config.update("jax_numpy_dtype_promotion", "strict")

settings.register_profile(
    "zeroth",
    derandomize=True,
    deadline=None,
    max_examples=40,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
    print_blob=True,
)
settings.load_profile("zeroth")

warnings.filterwarnings("error", category=RuntimeWarning, module="zeroth")
warnings.filterwarnings("error", category=FutureWarning, module="zeroth")
warnings.filterwarnings("error", category=DeprecationWarning, module="zeroth")


import pytest  # noqa: E402

ACCELERATOR = jax.default_backend() != "cpu"
if ACCELERATOR:
    # This process has its backends, the accelerator's among them. The processes that tests start
    # (peers, command-line runs, notebooks) run on the host CPU, as CI runs them and as the tests
    # not marked accelerator run here. With JAX_PLATFORMS=cuda,cpu inherited they would run on the
    # GPU against expectations computed for a CPU (beside an NVIDIA H200, the copy-mode host-memory
    # test, whose child process replays on the default device, failed).
    os.environ["JAX_PLATFORMS"] = "cpu"


@pytest.fixture(autouse=True)
def _default_device(request):
    """On a machine with an accelerator (``JAX_PLATFORMS=cuda,cpu``), tests run on the host CPU's
    devices (four of them, forced above) unless marked ``accelerator``: the kernels' native tests,
    the sign-bit tests and the ZO trainer's layout test run on the accelerator, everything else
    where CI runs it."""
    if not ACCELERATOR:
        yield
        return
    device = jax.devices()[0] if request.node.get_closest_marker("accelerator") else jax.devices("cpu")[0]
    with jax.default_device(device):
        yield


# The files that took longest on a 2-core machine (each file's tests in one process, `--dist loadfile`),
# longest first: with `--no-loadscope-reorder` (pyproject.toml) pytest-xdist hands the files out in
# this order, then the others in collection order, so that the files left for the end of the run
# are short and both processes finish together. Measured on 2026-12-03, each file's total seconds in
# `pytest -n 2` (test_bench 193, test_net_chaos 35): before, a run ended with one process idle while
# the other ran test_net_chaos, which had come last for having few tests. An order, not a selection:
# a file missing from the list runs all the same, after these.
LONGEST_FIRST = (
    "test_multihost.py",
    "test_bench.py",
    "test_kernels_perturb.py",
    "test_zo.py",
    "test_pipeline_e2e.py",
    "test_pretrained_q4train.py",
    "test_cluster_ravnest.py",
    "test_kernel_compile.py",
    "test_e2e_job.py",
    "test_doctor.py",
    "test_peer_resume.py",
    "test_pretrained_smollm2.py",
    "test_binary_ops.py",
    "test_interrupt.py",
    "test_pipeline_stages.py",
    "test_flat_pallas.py",
    "test_net_chaos.py",
)


def pytest_collection_modifyitems(session, config, items):
    rank = {name: i for i, name in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))  # stable: a file's tests keep their order


def pytest_unconfigure(config):
    if SESSION_JAX_CACHE is not None:
        import shutil

        shutil.rmtree(SESSION_JAX_CACHE, ignore_errors=True)
