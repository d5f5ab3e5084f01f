"""``zeroth doctor``: one digest, equal to the golden one (written by the NumPy reference), under
different CPU code generation: default, no FMA (SSE4.2), fast-math, and without jit."""

import json
import os
import subprocess
import sys

import jax
import numpy as np
import pytest

from zeroth import doctor, noise, replay
from zeroth import reference as ref
from zeroth.kernels import cpu_native

# name -> extra environment. XLA rejects unknown flags at start-up (a fatal "Unknown flag in
# XLA_FLAGS"), so a renamed flag fails these runs instead of being silently ignored.
CONFIGS = {
    "default": {"XLA_FLAGS": ""},
    "no-fma (SSE4.2)": {"XLA_FLAGS": "--xla_cpu_max_isa=SSE4_2"},
    "fast-math": {"XLA_FLAGS": "--xla_cpu_enable_fast_math=true"},
    "no-jit": {"XLA_FLAGS": "", "JAX_DISABLE_JIT": "1"},
}


@pytest.fixture(scope="module")
def runs():
    """Run ``python -m zeroth doctor --json`` under every config, all at once (they are independent)."""
    procs = {}
    for name, extra in CONFIGS.items():
        env = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "JAX_DISABLE_JIT")}
        env.update(extra, JAX_PLATFORMS="cpu")
        procs[name] = subprocess.Popen(
            [sys.executable, "-m", "zeroth", "doctor", "--json"],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
    out = {}
    for name, proc in procs.items():
        stdout, stderr = proc.communicate(timeout=300)
        assert stdout.strip(), f"{name}: no output (exit {proc.returncode}); stderr:\n{stderr[-3000:]}"
        out[name] = (proc.returncode, json.loads(stdout), stderr)
    return out


def _golden() -> dict:
    return json.loads(doctor.GOLDEN_PATH.read_text())


def test_one_digest_under_every_config_equal_to_golden(runs):
    golden = _golden()
    digests = {name: report["digest"] for name, (_, report, _) in runs.items()}
    assert set(digests.values()) == {golden["digest"]}, digests
    for name, (code, report, stderr) in runs.items():
        assert report["status"] == "ok" and report["reference_digest"] == golden["digest"], name
        assert report["flat_status"] == "ok" and report["flat_digest"] == golden["digest"], name
        assert report["xla_flags"] == CONFIGS[name]["XLA_FLAGS"]
        assert report["jax_disable_jit"] == (name == "no-jit")
        # the native kernel's path that replayed on the host: the one this process's library has
        assert report["native_kernel"] == cpu_native.kernel_path(), name
        if report["float16_status"] == "ok":
            assert report["float16_digest"] == golden["float16_digest"] and code == 0, (name, stderr[-2000:])
            assert report["tiles_float16_status"] == "ok", (name, report)
        else:
            # jaxlib's XLA:CPU cannot link half-precision conversions without F16C; the doctor
            # reports it (exit 3) rather than a mismatch. Only the SSE4.2 config may hit it.
            assert name == "no-fma (SSE4.2)" and report["float16_status"] == "unsupported", (name, report)
            assert code == 3 and "cannot compile float16" in stderr
        assert report["tiles_status"] == "ok" and report["tiles_digest"] == golden["tiles_digest"], name
        assert report["tiles_copy_digest"] == golden["tiles_digest"], name
    assert runs["default"][0] == 0 and runs["default"][1]["ok"]


def test_the_configs_really_change_float_code(runs):
    # jax.random.normal goes through erf_inv/log1p: its digest moves with FMA and fast-math, which
    # shows the runs above really compiled different code while the exact replay did not move.
    gaussian = {name: report["gaussian_digest"] for name, (_, report, _) in runs.items()}
    assert len(set(gaussian.values())) > 1, gaussian


def test_golden_is_the_reference_result():
    golden = _golden()
    assert golden["format"] == doctor.FORMAT
    assert doctor.reference_digests() == (golden["digest"], golden["float16_digest"])
    assert doctor.reference_digests("tiles") == (golden["tiles_digest"], golden["tiles_float16_digest"])
    # the canonical suite's digests are the ones every zeroth version since the first has shipped
    assert golden["digest"].startswith("4894f949d339bc5f") and golden["float16_digest"].startswith("4f3b861c871ee1be")


def test_tiles_suite_exercises_partial_tiles_and_nan_payloads():
    """The tiles suite would have caught both defects seen on an H100: every leaf leaves a partial
    last tile under the GPU, TPU and CPU-interpret tilings, 16-bit leaves sit side by side, and
    every dtype carries NaN payloads (NVIDIA's 0x7fff among them) at its start and in its tail."""
    from zeroth.kernels import perturb as kp

    leaves = doctor.canonical_paths(doctor.tile_params())
    assert sum(a.dtype.itemsize == 2 for a in leaves.values()) >= 3
    for path, leaf in leaves.items():
        for platform in ("gpu", "tpu", "cpu"):
            for dist, updates in doctor.tile_units():
                plan = kp.plans.plan_tiles(leaf.size, dist, kp.default_block_sizes(platform), platform)
                if platform != "tpu" or leaf.size >= 8 * 1024:
                    assert plan.tail > 0, (path, platform, dist, plan)
        bits = leaf.reshape(-1).view(np.dtype(f"u{leaf.dtype.itemsize}"))
        nan_start = np.isnan(leaf.reshape(-1)[:8].astype(np.float32)).sum()
        nan_end = np.isnan(leaf.reshape(-1)[-8:].astype(np.float32)).sum()
        assert nan_start >= 4 and nan_end >= 4, path
        if leaf.dtype.itemsize == 2:
            assert 0x7FFF in bits[:8] and 0x7FFF in bits[-8:], path
    assert sorted(len(u) for _, u in doctor.tile_units()) == [1, 3, 5]
    # the canonical NaN comes out of every NaN payload
    out = doctor.reference_result("tiles")
    for path, leaf in out.items():
        flat = leaf.reshape(-1)
        bits = flat.view(np.dtype(f"u{leaf.dtype.itemsize}"))
        nan = np.isnan(flat.astype(np.float32))
        assert nan.sum() >= 8 and set(bits[nan].tolist()) == {ref.CANONICAL_NAN_BITS[leaf.dtype.name]}, path


def test_tiles_suite_replays_to_golden_through_the_pallas_kernel():
    """The tiles suite through the Pallas kernel (interpret mode, GPU tiling, in place) equals the
    golden digest: what the doctor checks natively on a GPU. (The copy path of the same kernel is
    checked against the reference bit for bit in test_kernels_perturb.py.)"""
    from zeroth import rng
    from zeroth.kernels import perturb as kp

    golden = _golden()
    params = doctor.tile_params()
    for dist, updates in doctor.tile_units():
        keys = np.stack([np.asarray(k, np.uint32) for k, _ in updates])
        scales = replay.update_scales(dist, [c for _, c in updates])
        fn = jax.jit(
            lambda p, k, s, dist=dist: kp.apply_updates(
                p, k, s, distribution=dist, impl="pallas", interpret=True, platform="gpu", inplace=True
            ),
            donate_argnums=(0,),
        )
        params = fn(params, keys, scales)
    leaves = {rng.leaf_path(p): np.asarray(v) for p, v in jax.tree_util.tree_flatten_with_path(params)[0]}
    main_part, f16_part = doctor.split_float16(leaves)
    assert doctor.numpy_checksum(main_part) == golden["tiles_digest"]
    assert doctor.numpy_checksum(f16_part) == golden["tiles_float16_digest"]


def test_write_golden_reproduces_the_shipped_file(tmp_path):
    path = tmp_path / "g.json"
    assert doctor.main(["--write-golden", str(path)]) == 0
    assert json.loads(path.read_text()) == _golden()


def test_numpy_checksum_equals_replay_checksum():
    leaves = doctor.reference_result()
    nested = {
        "dense": {"kernel": leaves["['dense']['kernel']"]},
        "embed": leaves["['embed']"],
        "norm": {"scale": leaves["['norm']['scale']"]},
        "scalar": leaves["['scalar']"],
    }
    assert sorted(doctor.canonical_paths(nested)) == sorted(leaves)
    assert doctor.numpy_checksum(leaves) == replay.checksum(nested)


def test_canonical_replay_exercises_the_contract():
    """Instrumented reference replay: the doctor's log hits every rule it is meant to check."""
    leaves = doctor.canonical_paths()
    units = doctor.canonical_units()
    assert sum(len(u) for _, u in units) >= 64
    assert {d for d, _ in units} == set(noise.EXACT)
    shapes = {a.shape for a in leaves.values()}
    assert () in shapes and any(len(s) == 1 and s[0] % 4 for s in shapes) and any(len(s) == 3 for s in shapes)
    assert {str(a.dtype) for a in leaves.values()} == {"float32", "bfloat16", "float16"}
    coefficients = [c for _, u in units for _, c in u]
    assert 0.0 in coefficients and any(c != 0 and ref.round_coefficient(c) == 0 for c in coefficients)
    assert any(ref.round_coefficient(c) != c for c in coefficients)
    seen = {"flushed_f32": 0, "flushed_cast": 0, "nan_inputs": 0, "inf_results": 0, "neg_zero_inputs": 0}
    for dist, updates in units:
        for path, leaf in leaves.items():
            x = np.asarray(leaf).astype(np.float32).reshape(-1)
            seen["nan_inputs"] += int(np.isnan(x).sum())
            seen["neg_zero_inputs"] += int(((x == 0) & np.signbit(x)).sum())
            p = ref._flush(x)
            for key, c in updates:
                k = ref.noise_int(dist, ref.leaf_key(key, path), p.size)
                with np.errstate(over="ignore", invalid="ignore"):
                    raw = (p + ref.update_scale(dist, c) * k.astype(np.float32)).astype(np.float32)
                seen["flushed_f32"] += int(((raw != 0) & (np.abs(raw) < ref.FLT_MIN)).sum())
                p = ref.apply_update(p, ref.update_scale(dist, c), k)
            if leaf.dtype != np.float32:
                with np.errstate(over="ignore", invalid="ignore"):
                    cast = p.astype(leaf.dtype)
                    seen["flushed_cast"] += int(
                        ((cast != 0) & (np.abs(cast) < ref.ml_dtypes.finfo(leaf.dtype).tiny)).sum()
                    )
            seen["inf_results"] += int(np.isinf(p).sum())
            leaves[path] = ref.flush_cast(p, leaf.dtype).reshape(leaf.shape)
    assert all(v > 0 for v in seen.values()), seen
    assert doctor.numpy_checksum(doctor.split_float16(leaves)[0]) == _golden()["digest"]


def test_corrupted_golden_is_a_mismatch(tmp_path, capsys):
    golden = _golden()
    bad = dict(golden, digest=("0" if golden["digest"][0] != "0" else "1") + golden["digest"][1:])
    path = tmp_path / "bad.json"
    path.write_text(json.dumps(bad))
    assert doctor.main(["--json", "--golden", str(path)]) == 1
    captured = capsys.readouterr()
    report = json.loads(captured.out)
    assert report["status"] == "mismatch" and not report["ok"]
    assert report["digest"] == golden["digest"] and report["golden_digest"] == bad["digest"]
    assert "MISMATCH" in captured.err
    # the human report says so too, and a wrong float16 digest alone is a mismatch as well
    for field in ("float16_digest", "tiles_digest", "tiles_float16_digest"):
        path.write_text(json.dumps(dict(golden, **{field: "f" * 64})))
        assert doctor.main(["--golden", str(path)]) == 1, field
        assert "MISMATCH" in capsys.readouterr().out


@pytest.mark.parametrize(
    "content, message",
    [
        ("{not json", "cannot read golden file"),
        (json.dumps({"format": "other", "digest": "0" * 64}), "is not a 'zeroth-doctor-v2' file"),
        (json.dumps({"format": doctor.FORMAT, "digest": "xyz", "float16_digest": "0" * 64}), "'digest' must be 64"),
        (json.dumps([1, 2]), "is not a 'zeroth-doctor-v2' file"),
    ],
)
def test_unreadable_golden_is_a_clear_error(tmp_path, capsys, content, message):
    path = tmp_path / "g.json"
    path.write_text(content)
    assert doctor.main(["--golden", str(path)]) == 2
    err = capsys.readouterr().err
    assert message in err and str(path) in err


def test_missing_golden_file_is_a_clear_error(tmp_path, capsys):
    assert doctor.main(["--golden", str(tmp_path / "nope.json")]) == 2
    assert "cannot read golden file" in capsys.readouterr().err


def test_in_process_doctor_agrees_on_four_devices(capsys):
    # the test process has 4 CPU devices (tests/conftest.py); the digest does not care
    assert doctor.main(["--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["ok"] and report["devices"] == [str(d) for d in jax.devices()]


def test_a_platform_the_machine_lacks_is_one_clear_line():
    missing = "rocm" if jax.default_backend() == "tpu" else "tpu"
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    env["JAX_PLATFORMS"] = missing
    proc = subprocess.run(
        [sys.executable, "-m", "zeroth", "doctor"], env=env, capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 2, proc.stderr[-2000:]
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and f"JAX_PLATFORMS='{missing}'" in lines[0] and "Traceback" not in proc.stderr


_CACHED_RUN = r"""
import json, sys
import jax.numpy as jnp, numpy as np
from zeroth import doctor, replay, zo

code = doctor.main(["--json"])
r = np.random.default_rng(3)
params = {"w": jnp.asarray(r.normal(size=(16, 8)).astype(np.float32)), "b": jnp.zeros(8, jnp.float32)}
batch = (jnp.asarray(r.normal(size=(32, 16)).astype(np.float32)), jnp.asarray(r.normal(size=(32, 8)).astype(np.float32)))
loss = lambda p, b: jnp.mean((jnp.tanh(b[0] @ p["w"] + p["b"]) - b[1]) ** 2)
sums = {}
for layout in ("tree", "flat"):
    p = params if layout == "tree" else replay.flatten(params)
    for it in range(3):
        p = zo.mezo_step(loss, p, batch, run_seed=1, iteration=it, lr=0.05, eps=1e-2, weight_decay=0.01,
                         donate=it > 0, hold=True).params
    sums[layout] = replay.checksum(zo.settle(p))
print(json.dumps({"doctor_exit": code, "zo": sums}))
"""


def test_programs_loaded_from_the_compilation_cache_give_the_same_bits(tmp_path):
    # jax's persistent compilation cache (JAX_COMPILATION_CACHE_DIR, which scripts/gpu_speed.sh sets and
    # any zeroth command reads): a run that loads every program from it, the native replay kernels'
    # custom calls and a held ZO step's program among them, gives the golden digests and the same
    # parameters as the run that compiled them.
    cache = tmp_path / "xla_cache"
    env = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "JAX_DISABLE_JIT")}
    env.update(
        JAX_PLATFORMS="cpu", JAX_COMPILATION_CACHE_DIR=str(cache), JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0"
    )
    results, entries = [], []
    for _ in range(2):
        proc = subprocess.run([sys.executable, "-c", _CACHED_RUN], env=env, capture_output=True, text=True, timeout=300)
        assert proc.returncode == 0, proc.stderr[-3000:]
        lines = proc.stdout.strip().splitlines()
        results.append((json.loads(lines[0]), json.loads(lines[-1])))
        entries.append(sorted(p.name for p in cache.iterdir()))
    assert entries[0], "the first run wrote nothing to the compilation cache"
    assert entries[1] == entries[0], "the second run compiled programs the first had cached"
    golden = _golden()
    for report, run in results:
        assert report["digest"] == report["flat_digest"] == golden["digest"], report
        assert run["doctor_exit"] == (0 if report["float16_status"] == "ok" else 3), report
        assert report["tiles_status"] == "ok", report
    assert results[0][1]["zo"] == results[1][1]["zo"]
    assert results[0][1]["zo"]["tree"] == results[0][1]["zo"]["flat"]
