"""Freed host buffers kept for reuse: copy-mode replays on CPU without the page-fault penalty.

A replay that does not donate its parameters gets a fresh output buffer from XLA's CPU allocator,
which takes it from the C library's ``malloc``. glibc serves blocks above its mmap threshold
(128 KiB, rising to at most 32 MiB) with a fresh ``mmap`` and returns them with ``munmap`` when
freed, so every call faults in every page of its output again, and a copy-mode replay costs several
times a donated one, nearly all of it page faults.

:func:`reuse_freed_host_memory` raises glibc's mmap and trim thresholds (``mallopt``) so large
blocks come from the heap and freed ones stay there for the next call, as the caching allocators of
GPU frameworks do. The price is that the process keeps
its peak heap instead of returning it to the system. :func:`zeroth.replay.replay` calls it once,
on the first copy-mode replay on a CPU, and the ZO estimator (:func:`zeroth.zo.projected_gradients_fn`)
on its first call on a CPU (its scratch, whole perturbed leaves among it, is allocated at every
step); ``ZEROTH_REUSE_HOST_MEMORY=0`` turns it off. Elsewhere
than glibc it does nothing and says so.

Example:
  >>> from zeroth.kernels import host_memory
  >>> host_memory.reuse_freed_host_memory() in (True, False)
  True
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import threading

__all__ = ["reuse_freed_host_memory", "decided", "ENV"]

ENV = "ZEROTH_REUSE_HOST_MEMORY"
_M_TRIM_THRESHOLD = -1  # glibc's mallopt parameters (malloc.h)
_M_MMAP_THRESHOLD = -3
_MMAP_THRESHOLD = 1 << 30  # blocks up to 1 GiB from the heap
_TRIM_THRESHOLD = (1 << 31) - 1  # never give the heap's top back on free
_lock = threading.Lock()
_state: dict[str, bool] = {}


def decided() -> bool:
    """Whether :func:`reuse_freed_host_memory` already ran in this process (set or refused)."""
    return "done" in _state


def reuse_freed_host_memory() -> bool:
    """Ask glibc to serve large blocks from the heap and keep freed ones (once per process).

    Returns:
      ``True`` if the thresholds are set (now or earlier); ``False`` when turned off by
      ``ZEROTH_REUSE_HOST_MEMORY=0``, or where the C library is not glibc.
    """
    with _lock:
        if "done" in _state:
            return _state["done"]
        ok = False
        if os.environ.get(ENV, "1").strip().lower() not in ("0", "false", "no", "off"):
            try:
                libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
                mallopt = libc.mallopt
            except (OSError, AttributeError):  # not glibc: nothing to tune
                mallopt = None
            if mallopt is not None:
                mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
                mallopt.restype = ctypes.c_int
                ok = bool(mallopt(_M_MMAP_THRESHOLD, _MMAP_THRESHOLD)) and bool(
                    mallopt(_M_TRIM_THRESHOLD, _TRIM_THRESHOLD)
                )
        _state["done"] = ok
        return ok
