"""Build, cache and register zeroth's native CPU kernel (``cpu_perturb.cc``, an XLA FFI custom call).

The kernel is compiled with the machine's C++ compiler the first time it is needed (or ahead of
time by ``python -m zeroth.kernels.cpu_native``) and cached as a shared library under the user's
cache directory, in a file named by the hash of everything that can change the binary: the
source, the compiler command and its version, the XLA FFI headers and the CPU's feature flags
(``-march=native`` code must not be loaded on a CPU without those instructions).

Nothing here can change a bit of the result: the kernel uses integer arithmetic for the noise and
an exact product for the update, so every instruction set and compiler gives the same output,
and the tests compare it with :mod:`zeroth.reference`. What the build can change is speed only.

If the compiler is missing or the build fails, :func:`available` returns ``False``, a single
:class:`NativeKernelWarning` explains why, and :mod:`zeroth.kernels.perturb` falls back to plain
XLA. Environment:

* ``ZEROTH_NATIVE=0`` disables the native kernel (``1``, the default, allows it);
* ``ZEROTH_CACHE_DIR`` overrides the cache directory (default ``$XDG_CACHE_HOME/zeroth`` or
  ``~/.cache/zeroth``); libraries live in its ``kernels/`` subfolder;
* ``CXX`` names the compiler (default: the first of ``c++``, ``g++``, ``clang++`` on ``PATH``).

Example:
  >>> from zeroth.kernels import cpu_native
  >>> cpu_native.available() in (True, False)
  True
"""

from __future__ import annotations

import ctypes
import dataclasses
import hashlib
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import threading
import warnings
from pathlib import Path

__all__ = [
    "NativeKernelWarning",
    "BuildConfig",
    "DEFAULT_BUILD",
    "PORTABLE_BUILD",
    "INSTRUCTION_SETS",
    "SOURCE",
    "cache_dir",
    "build",
    "build_for",
    "kernel_path",
    "missing_instructions",
    "register",
    "available",
    "unavailable_reason",
    "target_name",
    "main",
]

SOURCE = Path(__file__).with_name("cpu_perturb.cc")
_SYMBOL = "ZerothPerturb"
_TREE_SYMBOL = "ZerothPerturbTree"
_FLAT_SYMBOL = "ZerothPerturbFlat"
_SLICE_SYMBOL = "ZerothPerturbSlice"
_PATH_SYMBOL = "ZerothPerturbPath"


class NativeKernelWarning(UserWarning):
    """The native CPU kernel could not be built or loaded; the plain XLA path is used instead."""


@dataclasses.dataclass(frozen=True)
class BuildConfig:
    """How to compile the kernel.

    Attributes:
      name: short name, part of the registered FFI target (``zeroth_perturb_<name>``).
      march: the ``-march`` value; ``"native"`` uses every instruction the CPU has.
      extra_flags: further compiler flags (never anything like ``-ffast-math``: the kernel's
        flush of subnormals and NaNs is written in integer arithmetic, but an unsafe math flag
        has no place on an exact path).
    """

    name: str = "native"
    march: str = "native"
    extra_flags: tuple[str, ...] = ()

    def flags(self) -> list[str]:
        return [
            "-O3",
            f"-march={self.march}",
            "-std=c++17",
            "-shared",
            "-fPIC",
            "-fno-fast-math",
            "-ffp-contract=off",
            "-w",
            *self.extra_flags,
        ]


DEFAULT_BUILD = BuildConfig()
# The x86-64 baseline (SSE2) or the compiler's default elsewhere: the same bits, slower.
PORTABLE_BUILD = BuildConfig(name="portable", march="x86-64" if platform.machine() in ("x86_64", "AMD64") else "native")

# The x86-64 levels a kernel can be built for besides -march=native, with the CPU flags
# (/proc/cpuinfo) each one's code needs: the same bits, another speed (the kernel's paths: AVX-512,
# AVX2, plain loops). `zeroth bench kernels` times each one this CPU can run.
INSTRUCTION_SETS: dict[str, frozenset[str]] = {
    "x86-64-v4": frozenset({"avx512f", "avx512bw", "avx512cd", "avx512dq", "avx512vl"}),
    "x86-64-v3": frozenset({"avx", "avx2", "bmi1", "bmi2", "f16c", "fma", "abm", "movbe", "xsave"}),
    "x86-64": frozenset(),
}

_lock = threading.Lock()
_registered: dict[str, str] = {}  # build name -> registered target name
_paths: dict[str, str] = {}  # build name -> the path its library was compiled with
_failed: dict[str, str] = {}  # build name -> reason
_warned = False


def cache_dir() -> Path:
    """The directory holding compiled kernels (created on demand)."""
    root = os.environ.get("ZEROTH_CACHE_DIR")
    if not root:
        xdg = os.environ.get("XDG_CACHE_HOME")
        root = os.path.join(xdg, "zeroth") if xdg else os.path.join(os.path.expanduser("~"), ".cache", "zeroth")
    return Path(root) / "kernels"


def _compiler() -> str | None:
    cxx = os.environ.get("CXX")
    if cxx:
        return cxx
    for name in ("c++", "g++", "clang++"):
        path = shutil.which(name)
        if path:
            return path
    return None


def _cpu_fingerprint() -> str:
    flags = ""
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as f:
            for line in f:
                if line.startswith(("flags", "Features")):
                    flags = " ".join(sorted(line.split(":", 1)[1].split()))
                    break
    except OSError:
        pass
    return f"{platform.machine()} {platform.system()} {flags}"


def missing_instructions(march: str) -> list[str]:
    """The CPU flags ``march`` (a key of :data:`INSTRUCTION_SETS`) needs that this CPU lacks: code
    built for it must not run where this is not empty (an x86-64 level on another architecture
    lacks everything, named by the architecture)."""
    if march not in INSTRUCTION_SETS:
        raise ValueError(f"unknown instruction set {march!r}; expected one of {list(INSTRUCTION_SETS)}")
    if platform.machine() not in ("x86_64", "AMD64"):
        return [f"x86-64 (this is {platform.machine()})"]
    flags = set(_cpu_fingerprint().split())
    return sorted(INSTRUCTION_SETS[march] - flags)


def build_for(march: str) -> BuildConfig:
    """The :class:`BuildConfig` of an x86-64 level of :data:`INSTRUCTION_SETS` (``x86-64`` is
    :data:`PORTABLE_BUILD` there).

    Raises:
      ValueError: ``march`` is unknown, or this CPU lacks instructions its code needs (named).
    """
    if missing := missing_instructions(march):
        raise ValueError(f"this CPU cannot run code built for -march={march}: it lacks {', '.join(missing)}")
    return PORTABLE_BUILD if march == PORTABLE_BUILD.march else BuildConfig(name=march.replace("-", "_"), march=march)


def _include_dir() -> Path:
    import jax.ffi

    return Path(jax.ffi.include_dir())


def _library_path(config: BuildConfig, cxx: str) -> tuple[Path, list[str]]:
    include = _include_dir()
    try:
        version = subprocess.run([cxx, "--version"], capture_output=True, text=True, timeout=60).stdout
    except (OSError, subprocess.SubprocessError) as exc:
        raise RuntimeError(f"cannot run the C++ compiler {cxx!r}: {exc}") from exc
    h = hashlib.sha256()
    h.update(SOURCE.read_bytes())
    for header in sorted((include / "xla" / "ffi" / "api").glob("*.h")):
        h.update(header.read_bytes())
    h.update(repr((config.flags(), version, _cpu_fingerprint(), sys.implementation.cache_tag)).encode())
    cmd = [cxx, *config.flags(), f"-I{include}", str(SOURCE)]
    return cache_dir() / f"zeroth_perturb_{config.name}_{h.hexdigest()[:20]}.so", cmd


def build(config: BuildConfig = DEFAULT_BUILD, *, force: bool = False) -> Path:
    """Compile the kernel (unless a cached library for this exact build exists) and return its path.

    Raises:
      RuntimeError: no compiler, or the compiler failed (its output is in the message).
    """
    cxx = _compiler()
    if cxx is None:
        raise RuntimeError("no C++ compiler found (set CXX or install g++ / clang++)")
    path, cmd = _library_path(config, cxx)
    if path.exists() and not force:
        return path
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=path.parent)
    os.close(fd)
    try:
        proc = subprocess.run([*cmd, "-o", tmp], capture_output=True, text=True, timeout=600)
        if proc.returncode != 0:
            raise RuntimeError(f"compiling {SOURCE.name} failed ({' '.join(cmd)}):\n{proc.stderr[-4000:]}")
        os.replace(tmp, path)  # atomic: concurrent builders never see a partial library
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return path


def target_name(
    config: BuildConfig = DEFAULT_BUILD, *, tree: bool = False, flat: bool = False, sliced: bool = False
) -> str:
    """The FFI target of one leaf (default), of every leaf of a replay in one launch (``tree=True``),
    of every segment of one flat buffer in one launch (``flat=True``), or of one slice of a leaf
    whose start is given at run time (``sliced=True``)."""
    if tree + flat + sliced > 1:
        raise ValueError(
            f"target_name: pass at most one of tree, flat, sliced (got tree={tree}, flat={flat}, sliced={sliced})"
        )
    return f"zeroth_perturb_{'tree_' if tree else 'flat_' if flat else 'slice_' if sliced else ''}{config.name}"


def register(config: BuildConfig = DEFAULT_BUILD) -> str:
    """Build (if needed), load and register the kernel's XLA CPU FFI targets (one leaf; every leaf
    of a replay: :func:`target_name` with ``tree=True``; every segment of a flat buffer:
    ``flat=True``; one slice of a leaf: ``sliced=True``); return the one-leaf name.

    Raises:
      RuntimeError: the build or the load failed.
    """
    with _lock:
        if config.name in _registered:
            return _registered[config.name]
        import jax.ffi

        path = build(config)
        try:
            lib = ctypes.cdll.LoadLibrary(str(path))
            handler, tree_handler = getattr(lib, _SYMBOL), getattr(lib, _TREE_SYMBOL)
            flat_handler = getattr(lib, _FLAT_SYMBOL)
            slice_handler = getattr(lib, _SLICE_SYMBOL)
            path_of = getattr(lib, _PATH_SYMBOL)
            path_of.restype = ctypes.c_char_p
            _paths[config.name] = path_of().decode()
        except (OSError, AttributeError) as exc:
            raise RuntimeError(f"cannot load the native kernel {path}: {exc}") from exc
        name = target_name(config)
        jax.ffi.register_ffi_target(name, jax.ffi.pycapsule(handler), platform="cpu")
        jax.ffi.register_ffi_target(target_name(config, tree=True), jax.ffi.pycapsule(tree_handler), platform="cpu")
        jax.ffi.register_ffi_target(target_name(config, flat=True), jax.ffi.pycapsule(flat_handler), platform="cpu")
        jax.ffi.register_ffi_target(target_name(config, sliced=True), jax.ffi.pycapsule(slice_handler), platform="cpu")
        _registered[config.name] = name
        return name


def kernel_path(config: BuildConfig = DEFAULT_BUILD) -> str | None:
    """Which of the kernel's paths ``config``'s library was compiled with: ``"avx512"`` (AVX-512 F,
    BW and DQ), ``"avx2"`` (AVX2 without those) or ``"portable"`` (plain loops); None where the
    kernel is unavailable (:func:`available` builds it on first call). The same bits on every
    path; the speed differs (``zeroth bench kernels --sections isa``)."""
    return _paths.get(config.name) if available(config) else None


def _disabled() -> bool:
    return os.environ.get("ZEROTH_NATIVE", "1").strip().lower() in ("0", "false", "no", "off")


def unavailable_reason(config: BuildConfig = DEFAULT_BUILD) -> str | None:
    """Why :func:`available` is ``False`` for ``config`` (None where it is ``True``): the environment
    disables the kernel, or the build's error (no C++ compiler, a failed compile)."""
    if _disabled():
        return "ZEROTH_NATIVE=0 disables the native CPU kernel"
    if available(config):
        return None
    return f"the native CPU kernel cannot be built: {_failed.get(config.name, 'not registered')}"


def available(config: BuildConfig = DEFAULT_BUILD) -> bool:
    """Whether the native kernel can be used (building it on first call). Never raises.

    On failure, warns once (:class:`NativeKernelWarning`) with the reason and returns ``False``.
    """
    global _warned
    if _disabled():
        return False
    if config.name in _registered:
        return True
    if config.name in _failed:
        return False
    try:
        register(config)
        return True
    except (RuntimeError, OSError, subprocess.SubprocessError) as exc:
        _failed[config.name] = str(exc)
        if not _warned:
            _warned = True
            warnings.warn(
                f"zeroth: the native CPU replay kernel is unavailable, using the plain XLA path "
                f"(same bits, slower): {exc}",
                NativeKernelWarning,
                stacklevel=2,
            )
        return False


def main(argv: list[str] | None = None) -> int:
    """``python -m zeroth.kernels.cpu_native``: build the kernel ahead of time, print the library path."""
    del argv
    try:
        print(build(DEFAULT_BUILD))
    except RuntimeError as exc:
        print(f"zeroth: native kernel build failed: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
