"""Two processes on loopback join one jax.distributed job (CPU collectives: gloo) and run the same
ring / torus all-reduce and Marsit programs over the 4 devices they hold together."""

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.e2e
def test_two_processes_agree_over_jax_distributed():
    port = _free_port()
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}  # each process sets its own 2 devices
    env["JAX_PLATFORMS"] = "cpu"
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    procs = [
        subprocess.Popen(
            [
                sys.executable,
                "-m",
                "zeroth.collectives.distributed",
                "--coordinator",
                f"127.0.0.1:{port}",
                "--num-processes",
                "2",
                "--process-id",
                str(i),
                "--local-devices",
                "2",
                "--rounds",
                "3",
                "--timeout",
                "60",
            ],
            cwd=ROOT,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for i in range(2)
    ]
    outs = []
    try:
        for p in procs:
            stdout, stderr = p.communicate(timeout=180)
            assert p.returncode == 0, stderr[-3000:]
            outs.append(json.loads(stdout.strip().splitlines()[-1]))
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    assert [o["process"] for o in outs] == [0, 1]
    for o in outs:
        assert o["processes"] == 2 and o["workers"] == 4
        assert o["ring_allreduce_equals_psum"] == {"int32": True, "float32": True}
        assert o["torus_allreduce_equals_psum"] == {"int32": True, "float32": True}
        assert o["marsit_phases"] == ["full", "sync", "full"]
    # every round, all four workers (two per process) hold bit-identical parameters
    for t in range(3):
        sums = outs[0]["marsit_checksums"][t] + outs[1]["marsit_checksums"][t]
        assert len(sums) == 4 and len(set(sums)) == 1, (t, sums)
    assert len({outs[0]["marsit_checksums"][t][0] for t in range(3)}) == 3
