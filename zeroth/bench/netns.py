"""Hosts on one machine for multi-host tests and benchmarks: Linux network namespaces joined by a
bridge, one address each (root only).

:func:`hosts` makes ``n`` namespaces, each with a veth pair whose outer end is on one bridge and
whose inner end holds ``10.R.0.<i+1>/24`` (``R`` chosen per test process, so test processes side
by side do not meet); the bridge has no address, so the hosts reach each other and nothing else.
Everything is removed on exit, also after a failure. :func:`unavailable` says why namespaces
cannot be made here (not root, no ``ip``), for a skip.

A host's link can be cut (:meth:`Host.link`), limited (:meth:`Host.limit`, ``tc tbf`` on both
ends of its veth pair) and read (:meth:`Host.bytes`: the kernel's counters of its link).
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import shutil
import subprocess

__all__ = ["Host", "hosts", "unavailable"]


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run(["ip", *args], capture_output=True, text=True, check=check, timeout=30)


def unavailable() -> str | None:
    """Why network namespaces cannot be made here, or None when they can."""
    if os.geteuid() != 0:
        return "network namespaces need root (CI runs as root)"
    if shutil.which("ip") is None:
        return "the `ip` command (iproute2) is not installed"
    name = f"zt{os.getpid() % 100000}probe"
    made = _ip("netns", "add", name, check=False)
    if made.returncode != 0:
        return f"`ip netns add` failed: {made.stderr.strip()}"
    _ip("netns", "del", name, check=False)
    return None


@dataclasses.dataclass
class Host:
    """One namespace: its ``name``, its ``address`` on the bridge, the outer end ``veth`` of its link."""

    name: str
    address: str
    veth: str
    inner: str

    def command(self, argv: list[str]) -> list[str]:
        """``argv`` run inside this host's namespace."""
        return ["ip", "netns", "exec", self.name, *argv]

    def link(self, up: bool) -> None:
        """Cut (``up=False``) or restore this host's link to the bridge."""
        _ip("link", "set", self.veth, "up" if up else "down")

    def bytes(self) -> tuple[int, int]:
        """``(sent, received)`` bytes of this host's link so far, from the kernel's interface counters
        (every frame on the wire: headers, TLS and retransmissions included)."""
        stats = f"/sys/class/net/{self.veth}/statistics"
        with open(f"{stats}/rx_bytes") as rx, open(f"{stats}/tx_bytes") as tx:  # the outer end: rx = the host sent
            return int(rx.read()), int(tx.read())

    def limit(self, rate_mbit: float) -> None:
        """Limit both directions of this host's link to ``rate_mbit`` (token bucket, ``tc tbf``)."""
        burst = max(16 * 1024, int(rate_mbit * 1e6 / 8 / 250))  # 4 ms of traffic, at least 16 KiB
        for dev, ns in ((self.veth, None), (self.inner, self.name)):
            cmd = [
                "tc",
                "qdisc",
                "replace",
                "dev",
                dev,
                "root",
                "tbf",
                "rate",
                f"{rate_mbit}mbit",
                "burst",
                str(burst),
                "latency",
                "50ms",
            ]
            subprocess.run(
                (["ip", "netns", "exec", ns] if ns else []) + cmd, check=True, capture_output=True, timeout=30
            )


@contextlib.contextmanager
def hosts(n: int):
    """``n`` :class:`Host` namespaces on one bridge (removed on exit)."""
    tag = f"zt{os.getpid() % 100000}"
    subnet = 16 + os.getpid() % 200
    bridge = f"{tag}br"
    made: list[Host] = []
    try:
        _ip("link", "add", bridge, "type", "bridge")
        _ip("link", "set", bridge, "up")
        for i in range(n):
            h = Host(f"{tag}h{i}", f"10.{subnet}.0.{i + 1}", f"{tag}v{i}", "eth0")
            _ip("netns", "add", h.name)
            made.append(h)
            _ip("link", "add", h.veth, "type", "veth", "peer", "name", f"{tag}p{i}")
            _ip("link", "set", f"{tag}p{i}", "netns", h.name)
            _ip("-n", h.name, "link", "set", f"{tag}p{i}", "name", h.inner)
            _ip("link", "set", h.veth, "master", bridge)
            _ip("link", "set", h.veth, "up")
            _ip("-n", h.name, "addr", "add", f"{h.address}/24", "dev", h.inner)
            _ip("-n", h.name, "link", "set", h.inner, "up")
            _ip("-n", h.name, "link", "set", "lo", "up")
        yield made
    finally:
        for h in made:
            _ip("netns", "del", h.name, check=False)
            _ip("link", "del", h.veth, check=False)
        _ip("link", "del", bridge, check=False)
