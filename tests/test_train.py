"""Trainer: ZO-SGD learns digits, backprop baseline, a non-differentiable objective, metrics,
checkpoints, resume (in process and after SIGKILL), corrupt checkpoints, the `zeroth run` CLI."""

import json
import os
import signal
import subprocess
import sys
import time
import types
from pathlib import Path

import jax
import numpy as np
import pytest
import yaml

from zeroth import codecs
from zeroth.config import load_config_dict, to_dict
from zeroth.train import trainer
from zeroth.train.checkpoint import FILES, Checkpointer, CheckpointError, checksum
from zeroth.train.metrics import read_metrics, summarize
from zeroth.train.runs import load_run
from zeroth.run import main as run_main

REPO = Path(__file__).resolve().parent.parent

SMALL = {
    "run": {"name": "t", "seed": 0},
    "data": {"dataset": "digits", "batch_size": 32, "eval_size": 200},
    "model": {"name": "mlp", "kwargs": {"hidden": [16]}},
    "train": {"method": "zo", "lr": 0.02, "eps": 1.0e-3, "n_perturbations": 8, "codec": "onebyte"},
}


def small(**sections) -> dict:
    raw = json.loads(json.dumps(SMALL))
    for sec, vals in sections.items():
        raw.setdefault(sec, {}).update(vals)
    return raw


def test_zo_sgd_decreases_the_loss_on_digits(tmp_path):
    cfg = load_config_dict(small(train={"steps": 200, "eval_every": 100, "log_every": 10}))
    res = trainer.train(cfg, tmp_path / "run", progress=False)
    recs = read_metrics(tmp_path / "run" / "metrics.jsonl")
    evals = [r for r in recs if r["kind"] == "eval"]
    assert [e["step"] for e in evals] == [0, 100, 200]
    assert evals[-1]["eval_loss"] < 0.6 * evals[0]["eval_loss"], evals
    assert evals[-1]["eval_accuracy"] > 0.6 and evals[0]["eval_accuracy"] < 0.3
    losses = [r["loss"] for r in recs if r["kind"] == "train"]
    assert len(losses) == 20 and np.mean(losses[-5:]) < 0.7 * np.mean(losses[:5])
    # the counters are exact: 2 forward passes and one byte per perturbation
    last = recs[-1]
    assert last["forward_passes"] == 200 * 2 * 8 and last["payload_bytes_total"] == 200 * 8 * 1
    assert last["backward_passes"] == 0 and last["examples"] == 200 * 2 * 8 * 32
    assert res.digest == last["digest"] == evals[-1]["digest"]
    assert len({r["digest"] for r in recs}) == 21  # the parameters change every logged step
    saved = yaml.safe_load((tmp_path / "run" / "config.yaml").read_text())
    assert saved["train"] == to_dict(cfg)["train"]


def test_zo_trainer_holds_a_flat_state_with_the_bits_of_the_tree_steps(tmp_path):
    # train.layout flat: the ZO method keeps its parameters in the flat layout (a few arrays per
    # compiled call instead of one per leaf); the run's digests, evaluation and checkpoints are
    # those of the tree.
    import jax

    from zeroth import data, methods, objectives, replay, schedules
    from zeroth.methods.mezo import mezo_update

    cfg = load_config_dict(
        small(
            train={
                "steps": 12,
                "eval_every": 12,
                "log_every": 4,
                "weight_decay": 0.01,
                "checkpoint_every": 6,
                "layout": "flat",
            }
        )
    )
    res = trainer.train(cfg, tmp_path / "run", progress=False)
    train_ds = data.load("digits", "train")
    model, params = objectives.build_model(cfg, train_ds.num_classes, train_ds.x[:1])
    loss_fn = objectives.make_objective(cfg.train.objective, model)
    schedule = schedules.from_train(cfg.train)
    tree = params
    for s in range(12):
        batch = data.batch_at(train_ds, cfg.run.seed, s, cfg.data.batch_size)
        tree = mezo_update(cfg, loss_fn, tree, batch, s, donate=False, schedule=schedule).params
    assert not isinstance(tree, replay.Flat) and replay.checksum(tree) == res.digest
    evaluate = objectives.make_eval_fn(model, cfg.data.eval_batch_size)
    x, y = data.load("digits", "test").x[:200], data.load("digits", "test").y[:200]
    assert evaluate(tree, x, y) == {k: res.eval[k] for k in ("eval_loss", "eval_accuracy")}
    saved = load_run(tmp_path / "run")  # the checkpoint holds the tree
    assert saved.step == 12 and replay.checksum(saved.params) == res.digest
    assert jax.tree_util.tree_structure(saved.params) == jax.tree_util.tree_structure(params)
    start = replay.checksum(params)
    state = methods.make_method(cfg, model).init(params, np.zeros(2, np.uint32))
    assert isinstance(state.params, replay.Flat) and replay.checksum(state.params) == start
    default = load_config_dict(small())  # auto: the tree on a CPU
    assert default.train.layout == "auto" and methods.make_method(default, model).init(tree, None).params is tree
    # a resume from step 6 lays the restored tree out again and ends on the same digest
    cfg2 = load_config_dict(
        small(train={"steps": 6, "log_every": 4, "weight_decay": 0.01, "checkpoint_every": 6, "layout": "flat"})
    )
    trainer.train(cfg2, tmp_path / "resumed", progress=False)
    again = trainer.train(cfg, tmp_path / "resumed", resume=True, progress=False)
    assert again.resumed_from == 6 and again.digest == res.digest
    for layout, fix in (("flat", {"method": "backprop"}), ("flat", {"requantize": "nearest"}), ("diagonal", {})):
        with pytest.raises(ValueError, match=f"train.layout"):
            load_config_dict(small(train={"layout": layout, **fix}))
    for fix in ({"method": "backprop"}, {"requantize": "nearest"}):  # auto resolves to the tree there
        assert load_config_dict(small(train={"layout": "auto", **fix})).train.layout == "auto"


def test_the_one_byte_trainer_dispatches_each_step_before_fetching_the_last_with_the_same_records(
    tmp_path, monkeypatch
):
    # with train.codec onebyte the ZO method is pipelined (zeroth.zo.Deferred): the loop does not
    # wait after a step, and each step fetches and checks the one before while the device runs it.
    # Every record (losses, digests, evaluation) and checkpoint is that of the steps run on the host.
    import functools

    from zeroth import data, methods, objectives

    raw = small(
        train={
            "steps": 14,
            "eval_every": 7,
            "log_every": 3,
            "weight_decay": 0.01,
            "checkpoint_every": 7,
            "schedule": {"name": "cosine", "decay_steps": 14},
        }
    )
    cfg = load_config_dict(raw)
    train_ds = data.load("digits", "train")
    model, _ = objectives.build_model(cfg, train_ds.num_classes, train_ds.x[:1])
    assert methods.make_method(cfg, model).pipelined
    assert not methods.make_method(load_config_dict(small(train={"codec": "float32"})), model).pipelined
    with pytest.raises(ValueError, match="a deferred ZO step needs train.codec 'onebyte', got 'float32'"):
        methods.zo_method(load_config_dict(small(train={"codec": "float32"})), model, defer=True)
    deferred = trainer.train(cfg, tmp_path / "deferred", progress=False)
    monkeypatch.setitem(methods.METHODS, "zo", functools.partial(methods.zo_method, defer=False))
    assert not methods.make_method(cfg, model).pipelined
    host = trainer.train(cfg, tmp_path / "host", progress=False)
    fields = ("kind", "step", "loss", "digest", "eval_loss", "eval_accuracy", "payload_bytes_total", "forward_passes")
    a, b = (read_metrics(tmp_path / run / "metrics.jsonl") for run in ("deferred", "host"))
    assert [[r.get(f) for f in fields] for r in a] == [[r.get(f) for f in fields] for r in b]
    assert len(a) == 8 and deferred.digest == host.digest
    assert [r["step"] for r in a if r["kind"] == "train"] == [3, 6, 9, 12, 14]


def test_zo_layout_auto_is_flat_where_the_parameters_live_on_a_gpu(monkeypatch):
    # train.layout auto holds the parameters flat on a GPU (measured there: 0.60x the tree's step)
    # and as the tree on a CPU or TPU; the decision follows the platform the parameters live on.
    import jax.numpy as jnp

    from zeroth import data, methods, objectives, replay
    from zeroth.kernels import perturb

    assert [replay.preferred_layout(p) for p in ("cpu", "gpu", "tpu")] == ["tree", "flat", "tree"]
    with pytest.raises(ValueError, match="'cuda'"):
        replay.preferred_layout("cuda")
    cfg = load_config_dict(small())
    train_ds = data.load("digits", "train")
    model, params = objectives.build_model(cfg, train_ds.num_classes, train_ds.x[:1])
    start = replay.checksum(params)
    method = methods.make_method(cfg, model)
    assert method.init(params, None).params is params  # these live on the CPU
    seen = []
    monkeypatch.setattr(perturb, "platform_of", lambda p: seen.append(p) or "gpu")
    state = method.init(params, None)
    assert seen[0] is params and isinstance(state.params, replay.Flat) and replay.checksum(state.params) == start
    tree_cfg = load_config_dict(small(train={"layout": "tree"}))
    other = jax.tree_util.tree_map(jnp.copy, replay.unflatten(state.params))
    assert methods.make_method(tree_cfg, model).init(other, None).params is other


@pytest.mark.accelerator
@pytest.mark.skipif(jax.default_backend() == "cpu", reason="needs a GPU or TPU as jax's default device")
def test_zo_trainer_on_the_accelerator_gives_the_same_digests_in_both_layouts(tmp_path):
    # auto holds the parameters as replay.preferred_layout says for the accelerator (flat on a GPU):
    # every logged digest and the checkpoint equal those of the tree on the same device.
    from zeroth import data, methods, objectives, replay, rule

    train = {"steps": 8, "eval_every": 8, "log_every": 2, "checkpoint_every": 4, "weight_decay": 0.01}
    cfg = load_config_dict(small(train=train))
    model, params = objectives.build_model(cfg, 10, data.load("digits", "train").x[:1])
    held = methods.make_method(cfg, model).init(params, None).params
    assert isinstance(held, replay.Flat) == (replay.preferred_layout(rule.default_platform()) == "flat")
    auto = trainer.train(cfg, tmp_path / "auto", progress=False)
    tree = trainer.train(load_config_dict(small(train={**train, "layout": "tree"})), tmp_path / "tree", progress=False)
    digests = [[r["digest"] for r in read_metrics(tmp_path / run / "metrics.jsonl")] for run in ("auto", "tree")]
    assert digests[0] == digests[1] and len(digests[0]) >= 5 and auto.digest == tree.digest
    assert replay.checksum(load_run(tmp_path / "auto").params) == tree.digest


def test_backprop_baseline_same_model_and_eval(tmp_path):
    cfg = load_config_dict(small(train={"method": "backprop", "steps": 100, "lr": 1e-2, "eval_every": 50}))
    trainer.train(cfg, tmp_path / "bp", progress=False)
    s = summarize(tmp_path / "bp" / "metrics.jsonl")
    assert s["eval_accuracy"] > 0.8
    assert s["forward_passes"] == s["backward_passes"] == 100 and s["passes"] == 300 and s["payload_bytes"] == 0


def test_progress_says_the_first_steps_compile_and_how_long_each_took(tmp_path, capsys):
    # the first steps compile the method's programs (a ZO step's first two: the projected
    # gradients, then the same with the held update applied; minutes for a large model on a GPU):
    # a line before them, and the time of each of the first two; then the usual progress lines
    cfg = load_config_dict(small(train={"steps": 20, "eval_every": 20, "log_every": 10}))
    trainer.train(cfg, tmp_path / "run", progress=True)
    lines = [ln for ln in capsys.readouterr().err.splitlines() if ln.startswith("[t] ")]
    assert lines[0] == "[t] step 1/20: the first steps compile the method's programs"
    timed = [ln for ln in lines if " took " in ln]
    assert [ln.split(" took ")[0] for ln in timed] == ["[t] step 1/20", "[t] step 2/20"]
    assert all(float(ln.split(" took ")[1].rstrip("s")) >= 0 for ln in timed)
    assert (
        lines.index(timed[0])
        < lines.index(timed[1])
        < lines.index(next(ln for ln in lines if "step 10/20 train" in ln))
    )
    trainer.train(cfg, tmp_path / "quiet", progress=False)
    assert "[t] " not in capsys.readouterr().err


def test_error_rate_has_no_gradient_for_backprop():
    import jax

    from zeroth import data, models, objectives

    ds = data.load("digits", "train")
    model = models.build("mlp", num_classes=10, hidden=(16,))
    params = models.init(model, models.init_key(0), ds.x[:1])
    grads = jax.grad(objectives.make_objective("error_rate", model))(params, (ds.x[:64], ds.y[:64]))
    assert all(float(np.abs(g).max()) == 0.0 for g in jax.tree_util.tree_leaves(grads))


def test_non_differentiable_objective_improves_with_zo(tmp_path):
    # loss = 1 - accuracy on the batch: piecewise constant, its gradient is zero almost everywhere
    cfg = load_config_dict(
        small(
            data={"batch_size": 256},
            train={
                "objective": "error_rate",
                "steps": 100,
                "lr": 0.05,
                "eps": 0.05,
                "n_perturbations": 16,
                "codec": "float32",
                "eval_every": 100,
            },
        )
    )
    trainer.train(cfg, tmp_path / "nd", progress=False)
    evals = read_metrics(tmp_path / "nd" / "metrics.jsonl", "eval")
    assert evals[0]["eval_accuracy"] < 0.2 and evals[-1]["eval_accuracy"] > 0.35, evals
    assert evals[-1]["payload_bytes_total"] == 100 * 16 * codecs.get_codec("float32").bytes_per_value


@pytest.mark.parametrize("method", ["zo", "backprop"])
def test_resume_in_process_equals_uninterrupted(tmp_path, method):
    extra = {"lr": 1e-2} if method == "backprop" else {}
    full = load_config_dict(
        small(train={"method": method, "steps": 24, "eval_every": 8, "log_every": 4, "checkpoint_every": 8, **extra})
    )
    ref = trainer.train(full, tmp_path / "full", progress=False)
    short = load_config_dict(
        small(train={"method": method, "steps": 16, "eval_every": 8, "log_every": 4, "checkpoint_every": 8, **extra})
    )
    trainer.train(short, tmp_path / "split", progress=False)
    res = trainer.train(full, tmp_path / "split", resume=True, progress=False)
    assert res.resumed_from == 16 and res.digest == ref.digest
    a = read_metrics(tmp_path / "full" / "metrics.jsonl")
    b = read_metrics(tmp_path / "split" / "metrics.jsonl")
    strip = lambda recs: [
        {k: v for k, v in r.items() if k not in ("wall_time_s", "train_time_s", "time_unix_s", "step_time_s")}
        for r in recs
    ]  # noqa: E731
    assert strip(a) == strip(b)


def test_refuses_to_overwrite_and_checks_resumed_config(tmp_path):
    cfg = load_config_dict(small(train={"steps": 4, "eval_every": 4}))
    trainer.train(cfg, tmp_path / "r", progress=False)
    with pytest.raises(ValueError, match="already holds a run.*--resume"):
        trainer.train(cfg, tmp_path / "r", progress=False)
    changed = load_config_dict(small(train={"steps": 8, "eval_every": 4, "lr": 0.5}))
    with pytest.raises(ValueError, match=r"differs.*\['train.lr'\]"):
        trainer.train(changed, tmp_path / "r", resume=True, progress=False)


def _files_under(path: Path):
    return [p for p in path.rglob("*") if p.is_file()]


@pytest.mark.filterwarnings("error::pytest.PytestUnraisableExceptionWarning")
def test_corrupt_checkpoint_gives_clear_error_and_loses_nothing(tmp_path):
    cfg = load_config_dict(small(train={"steps": 20, "eval_every": 10, "checkpoint_every": 10}))
    out = tmp_path / "c"
    ref = trainer.train(cfg, out, progress=False)
    ck = out / "checkpoints"
    assert sorted(int(p.name) for p in ck.iterdir() if p.name.isdigit()) == [10, 20]
    # truncate every array file of the newest checkpoint's parameters
    damaged = [p for p in _files_under(ck / "20" / "params") if "/d/" in str(p)]
    assert damaged
    sizes = {p: p.stat().st_size for p in damaged}
    for p in damaged:
        p.write_bytes(p.read_bytes()[: max(1, p.stat().st_size // 3)])
    with pytest.raises(CheckpointError) as e:
        trainer.train(cfg, out, resume=True, progress=False)
    msg = str(e.value)
    assert "20" in msg and "--resume-step 10" in msg and "Nothing was deleted" in msg
    # the file list names a cut file with both sizes, before orbax reads it
    named = [p for p in damaged if p.relative_to(ck / "20").as_posix() in msg]
    assert len(named) == 1 and f"{named[0].stat().st_size:,} bytes, {sizes[named[0]]:,} when saved" in msg, msg
    assert (ck / "10").is_dir() and (ck / "20").is_dir()
    # resuming the older checkpoint moves the damaged one aside and reproduces the run
    res = trainer.train(cfg, out, resume=True, resume_step=10, progress=False)
    assert res.digest == ref.digest and res.resumed_from == 10
    assert (out / "checkpoints_quarantine" / "20").is_dir()


def test_a_checkpoints_file_list_names_a_damaged_file_and_an_unlisted_step_is_still_read(tmp_path):
    rng = np.random.default_rng(0)
    params = {"w": rng.standard_normal((64, 32)).astype(np.float32), "b": {"c": np.arange(7, dtype=np.float32)}}
    opt = {"m": np.ones(5, np.float32)}
    ck = Checkpointer(tmp_path / "ck")
    for step in (1, 2, 3):
        ck.save(step, params, opt, {"step": step, "digest": checksum(params)})
    listed = json.loads((tmp_path / "ck" / "2" / FILES).read_text())
    assert {k.split("/")[0] for k in listed} == {"params", "opt_state", "meta"}
    assert ck.restore(2, params, opt).meta["step"] == 2
    # one flipped bit in a data file, same size: its CRC-32 is named
    victim = max((tmp_path / "ck" / "2").glob("params/**/d/*"), key=lambda f: f.stat().st_size)
    data = bytearray(victim.read_bytes())
    data[len(data) // 2] ^= 0x10
    victim.write_bytes(bytes(data))
    for read in (lambda: ck.restore(2, params, opt), lambda: ck.restore_saved(2)):
        with pytest.raises(
            CheckpointError,
            match=rf"{victim.relative_to(tmp_path / 'ck' / '2').as_posix()} has CRC-32 [0-9a-f]{{8}}, [0-9a-f]{{8}} when saved.*--resume-step 1",
        ):
            read()
    # a missing file, and a list that is not one
    (tmp_path / "ck" / "3" / "meta" / "metadata").unlink()
    with pytest.raises(CheckpointError, match=r"meta/metadata is missing"):
        ck.restore(3, params, opt)
    (tmp_path / "ck" / "1" / FILES).write_text("[1, 2")
    with pytest.raises(CheckpointError, match=rf"its {FILES} is not a valid list of files"):
        ck.restore(1, params, opt)
    # a step without the list (saved before it existed) is read, and still checked by its digest
    (tmp_path / "ck" / "1" / FILES).unlink()
    got = ck.restore(1, params, opt)
    assert checksum(got.params) == checksum(params) and ck.steps() == [1, 2, 3]


def _write_cfg(path: Path, raw: dict) -> Path:
    path.write_text(yaml.safe_dump(raw))
    return path


def test_run_cli_trains_and_reports(tmp_path, capsys):
    cfg = _write_cfg(tmp_path / "c.yaml", small(train={"steps": 6, "eval_every": 3}))
    assert run_main([str(cfg), "--set", "train.steps=4", "--out", str(tmp_path / "o"), "--quiet"]) == 0
    line = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert line["step"] == 4 and line["forward_passes"] == 4 * 16 and line["out_dir"] == str(tmp_path / "o")
    assert run_main([str(cfg), "--set", "train.lrr=1", "--out", str(tmp_path / "o2")]) == 2
    err = capsys.readouterr().err
    assert "'lrr'" in err and "'lr'" in err


def test_peers_section_is_handed_to_the_launcher(tmp_path, monkeypatch):
    calls = []
    fake = types.ModuleType("zeroth.net.launch")
    fake.run_config = lambda cfg, out_dir, argv: calls.append((cfg, out_dir, argv)) or 7
    import zeroth.net

    monkeypatch.setitem(sys.modules, "zeroth.net.launch", fake)
    monkeypatch.setattr(zeroth.net, "launch", fake, raising=False)
    cfg = _write_cfg(tmp_path / "p.yaml", small(peers={"count": 3}))
    argv = [str(cfg), "--out", str(tmp_path / "po")]
    assert run_main(argv) == 7
    ((got_cfg, out_dir, got_argv),) = calls
    assert got_cfg.peers.count == 3 and Path(out_dir) == tmp_path / "po" and got_argv == argv


@pytest.mark.slow
@pytest.mark.e2e
def test_sigkill_mid_run_then_resume_gives_the_same_digest(tmp_path):
    # same shapes as test_zo_sgd_decreases_the_loss_on_digits, so the in-process reference reuses its compile
    raw = small(train={"steps": 240, "eval_every": 80, "log_every": 20, "checkpoint_every": 20})
    cfg_path = _write_cfg(tmp_path / "k.yaml", raw)
    out = tmp_path / "killed"
    cmd = [sys.executable, "-m", "zeroth", "run", str(cfg_path), "--out", str(out), "--quiet"]
    env = {
        **os.environ,
        "PYTHONPATH": str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""),
        # the resumed process reuses the first one's compiled programs (same executables, less time)
        "JAX_COMPILATION_CACHE_DIR": str(tmp_path / "jax_cache"),
        "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0",
    }
    err_path = tmp_path / "killed.stderr"
    with err_path.open("wb") as err:
        proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.DEVNULL, stderr=err)
    deadline = time.monotonic() + 240
    try:
        while time.monotonic() < deadline:
            steps = [int(p.name) for p in (out / "checkpoints").glob("*") if p.name.isdigit()] if out.exists() else []
            if steps and max(steps) >= 40:
                break
            assert proc.poll() is None, f"run ended before it was killed: {err_path.read_text()[-2000:]}"
            time.sleep(0.02)
        else:
            pytest.fail("no checkpoint >= 40 within the time limit")
        assert proc.poll() is None, "the run finished before it could be killed"
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == -signal.SIGKILL
    done_before = max(r["step"] for r in read_metrics(out / "metrics.jsonl"))
    assert done_before < 240
    resumed = subprocess.run(cmd + ["--resume"], cwd=REPO, env=env, capture_output=True, text=True, timeout=240)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    final = json.loads(resumed.stdout.strip().splitlines()[-1])
    reference = trainer.train(load_config_dict(raw), tmp_path / "uninterrupted", progress=False)
    assert final["step"] == 240 and final["digest"] == reference.digest
    a = read_metrics(out / "metrics.jsonl")
    b = read_metrics(tmp_path / "uninterrupted" / "metrics.jsonl")
    assert [(r["kind"], r["step"], r["digest"]) for r in a] == [(r["kind"], r["step"], r["digest"]) for r in b]
