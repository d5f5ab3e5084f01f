"""M workers on one CPU machine: enough host devices, asked for before jax starts its backend.

XLA reads ``--xla_force_host_platform_device_count`` from ``XLA_FLAGS`` once, when jax creates its
CPU backend (the first ``jax.devices()`` or computation), not when jax is imported. So the
dispatcher calls :func:`ensure_cpu_devices` before anything computes: it raises the count in
``XLA_FLAGS`` to at least ``n`` (never lowers one set by the user) and checks the result. Once the
backend exists its device count is fixed; asking for more is a :class:`DeviceError` that says how
to start a process with enough.

Example:
  >>> with_device_count("--xla_cpu_enable_fast_math=false --xla_force_host_platform_device_count=2", 4)
  '--xla_cpu_enable_fast_math=false --xla_force_host_platform_device_count=4'
  >>> with_device_count("", 3)
  '--xla_force_host_platform_device_count=3'
"""

from __future__ import annotations

import os
import re

import jax
from jax._src import xla_bridge

__all__ = ["DeviceError", "with_device_count", "ensure_cpu_devices"]

_FLAG = re.compile(r"--xla_force_host_platform_device_count=(\d+)")


class DeviceError(ValueError):
    """This process cannot give a run the CPU devices it needs (the message says how to get them)."""


def with_device_count(flags: str, n: int) -> str:
    """``flags`` (an ``XLA_FLAGS`` string) with the host device count raised to at least ``n``."""
    m = _FLAG.search(flags)
    if m is None:
        return f"{flags} --xla_force_host_platform_device_count={n}".strip()
    if int(m.group(1)) >= n:
        return flags
    return flags[: m.start()] + f"--xla_force_host_platform_device_count={n}" + flags[m.end() :]


def ensure_cpu_devices(n: int) -> list:
    """The first ``n`` CPU devices of this process, asking XLA for ``n`` if its backend has not started.

    Raises:
      DeviceError: jax's backend started earlier with fewer than ``n`` CPU devices.
    """
    if not xla_bridge.backends_are_initialized():
        os.environ["XLA_FLAGS"] = with_device_count(os.environ.get("XLA_FLAGS", ""), n)
    devices = jax.devices("cpu")
    if len(devices) < n:
        raise DeviceError(
            f"this run needs {n} CPU devices (one per worker) but jax started with {len(devices)}; run it in a "
            f"fresh process (zeroth run sets the count before jax starts), or start Python with "
            f"XLA_FLAGS=--xla_force_host_platform_device_count={n}"
        )
    return devices[:n]
