"""zeroth.collectives: ring and torus all-reduce over ppermute equal psum; bit accounting.

M = 2 and 4 run on this process's 4 CPU devices (tests/conftest.py); M = 3 and 8 run in a
subprocess started with 8 CPU devices (this file is also that subprocess's program).
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parents[1]


def _check_allreduce(topo, sizes=(1, 37, 130)) -> dict:
    """Ring/torus all-reduce vs psum on one topology: ints bit-exact, floats within rounding."""
    import jax
    from jax.sharding import NamedSharding

    from zeroth.collectives import ring as R

    mesh, spec = topo.mesh(), topo.spec()
    sharding = NamedSharding(mesh, spec)
    rng = np.random.default_rng(topo.size)
    out = {}
    for d in sizes:
        ints = rng.integers(-(2**24), 2**24, (topo.size, d)).astype(np.int32)
        floats = rng.standard_normal((topo.size, d)).astype(np.float32)
        ring = jax.jit(
            jax.shard_map(lambda a: R.allreduce_sum(a[0], topo)[None], mesh=mesh, in_specs=spec, out_specs=spec)
        )
        psum = jax.jit(
            jax.shard_map(lambda a: jax.lax.psum(a[0], topo.axes)[None], mesh=mesh, in_specs=spec, out_specs=spec)
        )
        gi = np.asarray(ring(jax.device_put(ints, sharding)))
        pi = np.asarray(psum(jax.device_put(ints, sharding)))
        gf = np.asarray(ring(jax.device_put(floats, sharding)))
        pf = np.asarray(psum(jax.device_put(floats, sharding)))
        out[d] = {
            "int_equal_psum": bool(np.array_equal(gi, pi)),
            "int_equal_numpy": bool(np.array_equal(gi, np.broadcast_to(ints.sum(0), gi.shape))),
            "float_close_psum": bool(np.allclose(gf, pf, rtol=1e-5, atol=1e-5 * topo.size)),
            "float_close_f64": bool(
                np.allclose(gf, np.broadcast_to(floats.astype(np.float64).sum(0), gf.shape), atol=1e-5 * topo.size)
            ),
            # the result is computed once and copied: every worker holds the same bits
            "float_workers_identical": bool((gf == gf[:1]).all()),
        }
    return out


def _assert_all_true(report: dict, label: str) -> None:
    for d, checks in report.items():
        for name, ok in checks.items():
            assert ok, f"{label} d={d}: {name} failed"


@pytest.mark.parametrize(
    "kind,shape",
    [("ring", (2,)), ("torus", (1, 2)), ("torus", (2, 1)), ("ring", (4,)), ("torus", (2, 2))],
)
def test_allreduce_equals_psum_in_process(kind, shape):
    from zeroth.collectives.topology import Ring, Torus

    topo = Ring(*shape) if kind == "ring" else Torus(*shape)
    _assert_all_true(_check_allreduce(topo), str(topo))


def _subprocess_main(sizes: list[int]) -> None:
    from zeroth.collectives.topology import Ring, make_topology

    result = {}
    for m in sizes:
        for topo in {Ring(m), make_topology("torus", m), make_topology("torus", m, rows=min(4, m))}:
            result[repr(topo)] = _check_allreduce(topo, sizes=(37,))
    print(json.dumps(result))


def test_allreduce_equals_psum_for_3_and_8_workers_in_a_subprocess():
    env = dict(os.environ)
    env["XLA_FLAGS"] = "--xla_force_host_platform_device_count=8"
    env["JAX_PLATFORMS"] = "cpu"
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    proc = subprocess.run(
        [sys.executable, __file__, "3", "8"], env=env, cwd=ROOT, capture_output=True, text=True, timeout=240
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    # M = 3: ring, 1x3 and 3x1 tori; M = 8: ring, 2x4 and 4x2 tori
    assert (
        len(result) == 6 and any("rows=2, cols=4" in k for k in result) and any("rows=3, cols=1" in k for k in result)
    )
    for label, report in result.items():
        _assert_all_true(report, label)


def test_gathered_segments_are_ordered_and_identical():
    import jax
    from jax.sharding import NamedSharding

    from zeroth.collectives import ring as R
    from zeroth.collectives.topology import Torus

    topo = Torus(2, 2)
    mesh, spec = topo.mesh(), topo.spec()

    def fn(a):
        return R.all_gather_workers(a[0], topo)[None]

    x = np.arange(4 * 3, dtype=np.int32).reshape(4, 3)
    got = np.asarray(
        jax.jit(jax.shard_map(fn, mesh=mesh, in_specs=spec, out_specs=spec))(
            jax.device_put(x, NamedSharding(mesh, spec))
        )
    )
    for k in range(4):
        np.testing.assert_array_equal(got[k], x)  # worker order = row-major mesh order


def test_bit_accounting_counts_what_crosses_ppermute():
    import jax
    import jax.numpy as jnp

    from zeroth.collectives import bits as B
    from zeroth.collectives import ring as R
    from zeroth.collectives import sync as S
    from zeroth.collectives.topology import Ring, Torus

    d = 4096  # divisible by 32 * M: no padding
    for topo in (Ring(4), Torus(2, 2)):
        mesh, spec = topo.mesh(), topo.spec()
        x = jax.ShapeDtypeStruct((topo.size, d), jnp.float32)

        def prog(sync, phase):
            def f(u, key):
                g, _, _ = sync.update(u[0], sync.init(d), S.RoundCtx(key, phase))
                return g[None]

            return jax.shard_map(f, mesh=mesh, in_specs=(spec, jax.sharding.PartitionSpec()), out_specs=spec)

        key = jax.ShapeDtypeStruct((2,), jnp.uint32)
        ref = B.ppermute_bits(
            jax.shard_map(lambda u: R.allreduce_mean(u[0], topo)[None], mesh=mesh, in_specs=spec, out_specs=spec), x
        )
        if isinstance(topo, Ring):
            assert ref == 2 * (4 - 1) * (d // 4) * 32 * 4  # 2(M-1) hops of D/M floats, 4 senders each
        bpe = {
            name: B.bits_per_element(B.ppermute_bits(prog(sync, "sync"), x, key), ref)
            for name, sync in (
                ("psgd", S.psgd(topo)),
                ("marsit", S.marsit(topo, 1e-3)),
                ("majority_vote", S.majority_vote(topo, 1e-3)),
                ("signsgd", S.signsgd(topo, 1e-3)),
                ("ef_signsgd", S.ef_signsgd(topo)),
                ("ssdm", S.ssdm(topo)),
            )
        }
        assert bpe["psgd"] == 32.0
        assert bpe["marsit"] == 1.0  # one bit per element at every hop, nothing else
        # every worker's (scale, d sign bits) reaches the M - 1 others: M/2 bits per element, plus scales
        assert bpe["ef_signsgd"] == pytest.approx(2 + 64 / d)
        # one bit per element plus one float32 norm per segment and hop
        if isinstance(topo, Ring):
            assert bpe["ssdm"] == pytest.approx(1 + 32 * topo.size / d)
        else:
            assert bpe["ssdm"] == pytest.approx(32 * 4 * (1.5 * d + 160) / (192 * d))
        if isinstance(topo, Torus):
            # row ring: 1 plane; column ring: 2 planes (counts up to 2 already); vote gathers 1 bit
            assert bpe["majority_vote"] == pytest.approx(32 * 7 / 192)
        else:
            # counts grow 1, 2, 2 planes over the reduce hops; the vote all-gathers 1 bit, the mean 3 planes
            assert bpe["majority_vote"] == pytest.approx((1 + 2 + 2 + 3 * 1) / 6)
            assert bpe["signsgd"] == pytest.approx((1 + 2 + 2 + 3 * 3) / 6)
    # Marsit with K = 100 over 200 rounds: two full-precision rounds
    phases = [S.marsit(Ring(4), 1e-3, 100).phase(t) for t in range(200)]
    assert phases.count("full") == 2
    assert B.average_bits_per_element({"full": 320, "sync": 10}, phases, 320) == pytest.approx((2 * 32 + 198) / 200)


def test_ppermute_under_cond_is_refused():
    import jax
    import jax.numpy as jnp

    from zeroth.collectives import bits as B
    from zeroth.collectives.topology import Ring

    topo = Ring(2)
    mesh, spec = topo.mesh(), topo.spec()

    def f(x):
        return jax.lax.cond(x[0, 0] > 0, lambda v: jax.lax.ppermute(v, "w", [(0, 1), (1, 0)]), lambda v: v, x)

    with pytest.raises(ValueError, match="cond"):
        B.ppermute_bits(
            jax.shard_map(f, mesh=mesh, in_specs=spec, out_specs=spec), jax.ShapeDtypeStruct((2, 3), jnp.float32)
        )


def test_topology_errors_name_the_problem():
    from zeroth.collectives.topology import Ring, Torus, make_topology

    with pytest.raises(ValueError, match="Ring.size"):
        Ring(0)
    with pytest.raises(ValueError, match="must divide"):
        make_topology("torus", 6, rows=4)
    with pytest.raises(ValueError, match="unknown topology"):
        make_topology("mesh", 4)
    with pytest.raises(ValueError, match="needs 16 devices"):
        Torus(4, 4).mesh()


def test_a_mesh_takes_the_devices_of_the_default_devices_platform(monkeypatch):
    """On a machine with one GPU, work placed on the host CPU (``jax.default_device``, four CPU
    devices forced) builds its ring there: beside an NVIDIA H200 every Marsit test stopped with
    "Ring(size=4, axis='w') needs 4 devices but 1 are available", the mesh taken from
    ``jax.devices()``, the GPU's backend."""
    import jax

    from zeroth.collectives.topology import Ring, Torus

    cpus = jax.devices("cpu")
    real = jax.devices
    monkeypatch.setattr(jax, "devices", lambda backend=None: [cpus[3]] if backend is None else real(backend))
    with pytest.raises(ValueError, match="needs 4 devices but 1 are available"):
        Ring(4).mesh()  # no default device: the default backend's (here one device)
    with jax.default_device(cpus[0]):
        assert list(Ring(4).mesh().devices) == cpus[:4]
        assert Torus(2, 2).mesh().devices.tolist() == [cpus[:2], cpus[2:4]]


if __name__ == "__main__":
    import jax

    jax.config.update("jax_numpy_rank_promotion", "raise")
    jax.config.update("jax_numpy_dtype_promotion", "strict")
    _subprocess_main([int(a) for a in sys.argv[1:]])
