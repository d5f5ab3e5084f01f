"""Layer trainers (bit flips, evolution, STE) and greedy layer-wise training with its cache."""

import numpy as np
import pytest
from numpy.testing import assert_array_equal

from zeroth.binary import layers as L
from zeroth.binary import layerwise as LW
from zeroth.binary import train as T
from zeroth.data import images


@pytest.fixture(scope="module")
def digits():
    tr, te = images.load_digits("train"), images.load_digits("test")
    return (
        L.encode_thermometer(tr.x[:400], 4),
        tr.y[:400].astype(np.int32),
        L.encode_thermometer(te.x[:200], 4),
        te.y[:200].astype(np.int32),
    )


@pytest.mark.parametrize("method,ternary", [("flips", False), ("flips", True), ("evolution", False), ("ste", True)])
def test_each_method_trains_a_layer(digits, method, ternary):
    xtr, ytr, xte, yte = digits
    spec = L.ConvSpec(c_in=4, c_out=16, ternary=ternary)
    cfg = T.TrainConfig(method=method, steps=30, batch_size=16, k=4, grid=2, head_lr=0.05, ste_lr=0.05)
    res = T.train_layer(spec, xtr, ytr, cfg, classes=10)
    w = np.asarray(res.layer.w)
    assert set(np.unique(w)) <= ({-1, 0, 1} if ternary else {-1, 1})
    assert len(res.history) == 30
    first, last = np.mean([r["loss"] for r in res.history[:5]]), np.mean([r["loss"] for r in res.history[-5:]])
    assert last < first  # the batch loss falls
    assert T.accuracy(res.layer, res.head, xte, yte, spec, cfg.grid) > 0.3  # 10 classes: chance is 0.1
    if method == "flips":
        assert sum(r["flips"] for r in res.history) > 0


def test_flips_only_move_weights_they_report(digits):
    xtr, ytr, _, _ = digits
    spec = L.ConvSpec(c_in=4, c_out=16)
    cfg = T.TrainConfig(method="flips", steps=3, batch_size=16, k=5, grid=2, head_lr=0.1)
    a = T.train_layer(spec, xtr, ytr, cfg, classes=10)
    w0 = np.asarray(L.init_layer(spec, xtr[T._batch(len(xtr), cfg, 0, 0, tag=4)], seed=0).w)
    assert int(np.sum(np.asarray(a.layer.w) != w0)) <= sum(r["flips"] for r in a.history)


def test_layerwise_freezes_lower_layers_and_shares_them(digits, tmp_path):
    xtr, ytr, xte, yte = digits
    base = (L.ConvSpec(c_in=4, c_out=16, ternary=False), T.TrainConfig(steps=8, batch_size=16, k=4, grid=2))
    top_a = (
        L.ConvSpec(c_in=16, c_out=16, ternary=True, pool=False),
        T.TrainConfig(steps=6, batch_size=16, k=4, grid=2),
    )
    top_b = (L.ConvSpec(c_in=16, c_out=16, pool=False), T.TrainConfig(method="ste", steps=6, batch_size=16, grid=2))
    cache = LW.LayerCache(tmp_path)
    first = LW.train_layerwise([base], xtr, ytr, xte, yte, classes=10, cache=cache)
    w_before = np.asarray(first[0].layer.w).copy()
    out_before = first[0].out_train.copy()
    model_a = LW.train_layerwise([base, top_a], xtr, ytr, xte, yte, classes=10, cache=cache)
    model_b = LW.train_layerwise([base, top_b], xtr, ytr, xte, yte, classes=10, cache=cache)
    # the base layer was trained once and reused by both models, bit for bit
    assert cache.trained == 3 and cache.hits == 2
    for m in (model_a, model_b):
        assert_array_equal(np.asarray(m[0].layer.w), w_before)
        assert_array_equal(m[0].out_train, out_before)
        assert m[0].key == first[0].key
    # the cached outputs are the frozen layer's packed, pooled outputs
    assert_array_equal(T.layer_outputs(model_b[0].layer, xtr, base[0]), out_before)
    assert out_before.shape == (400, 4, 4, 1)
    # a fresh cache on the same folder loads the layer from disk instead of training it
    disk = LW.LayerCache(tmp_path)
    again = LW.train_layerwise([base], xtr, ytr, xte, yte, classes=10, cache=disk)
    assert disk.trained == 0 and disk.hits == 1
    assert_array_equal(np.asarray(again[0].layer.w), w_before)
    # different inputs -> a different key -> trained again
    other = LW.train_layerwise([base], xtr[::-1], ytr[::-1], xte, yte, classes=10, cache=disk)
    assert disk.trained == 1 and other[0].key != first[0].key
    with pytest.raises(ValueError, match="c_in=8 but layer 0 outputs 16"):
        LW.train_layerwise([base, (L.ConvSpec(8, 4), base[1])], xtr, ytr, xte, yte, classes=10, cache=cache)


def test_flips_checked_on_other_examples_are_kept_only_when_that_loss_falls(digits):
    xtr, ytr, _, _ = digits
    spec = L.ConvSpec(c_in=4, c_out=16)
    cfg = T.TrainConfig(method="flips", steps=12, batch_size=16, k=4, grid=2, head_lr=0.05, accept_batch=64)
    res = T.train_layer(spec, xtr, ytr, cfg, classes=10)
    applied = [r["flips"] for r in res.history]
    assert set(applied) <= {0, 4} and 0 < sum(applied)  # a step keeps all its flips or none
    assert T.step_cost(cfg) == (4, 1)
    with pytest.raises(ValueError, match="accept_batch must be 0, or > 0 with method 'flips' \\(got 8 with 'ste'\\)"):
        T.TrainConfig(method="ste", accept_batch=8).check()


def test_probe_features_are_what_the_head_reads_and_the_fit_converges(digits):
    from zeroth.binary import probe

    xtr, ytr, xte, yte = digits
    spec = L.ConvSpec(c_in=4, c_out=16)
    cfg = T.TrainConfig(method="head", steps=20, batch_size=32, grid=2, head_lr=0.05)
    res = T.train_layer(spec, xtr, ytr, cfg, classes=10)
    f_tr, f_te = probe.features(res.layer, xtr, spec, 2), probe.features(res.layer, xte, spec, 2)
    assert f_tr.shape == (400, 4 * 16)
    w, b, info = probe.fit_head(f_tr, ytr, 10)
    assert info["converged"] and info["iterations"] > 1
    # the fitted (W, b) as a Head of the layer: the layer's own evaluation gives the same accuracy
    head = L.Head(np.asarray(w).reshape(4, 16, 10), np.asarray(b))
    assert T.accuracy(res.layer, head, xte, yte, spec, 2) == probe._acc(w, b, f_te, yte)
    # converged: it fits the training set better than the head trained alongside for 20 steps
    assert probe._acc(w, b, f_tr, ytr) > T.accuracy(res.layer, res.head, xtr, ytr, spec, 2)
    assert probe.interval([0.5, 0.7, 0.6]) == pytest.approx((0.6, 4.303 * 0.1 / np.sqrt(3)))


def test_flips_with_the_head_refitted_to_convergence_between_rounds(digits):
    xtr, ytr, _, _ = digits
    spec = L.ConvSpec(c_in=4, c_out=16)
    base = dict(method="flips", steps=4, batch_size=16, k=4, grid=2, head_lr=0.05)
    plain = T.train_layer(spec, xtr, ytr, T.TrainConfig(**base), classes=10)
    refit = T.train_layer(spec, xtr, ytr, T.TrainConfig(**base, refit_every=2, refit_size=200), classes=10)
    assert refit.history[1]["loss"] < plain.history[1]["loss"]  # from step 0 on, a fitted head instead of a zero one
    assert not np.array_equal(np.asarray(refit.layer.w), np.asarray(plain.layer.w))
    with pytest.raises(ValueError, match="refit_every must be 0, or > 0 with method 'flips'"):
        T.TrainConfig(method="evolution", refit_every=2).check()


def test_flips_can_train_thresholds_and_lower_the_loss(digits):
    xtr, ytr, _, _ = digits
    spec = L.ConvSpec(c_in=4, c_out=16)
    base = dict(method="flips", steps=6, batch_size=32, k=1, grid=2, head_lr=0.05)
    plain = T.train_layer(spec, xtr, ytr, T.TrainConfig(**base), classes=10)
    moved = T.train_layer(spec, xtr, ytr, T.TrainConfig(**base, thresh_k=8), classes=10)
    t0 = T.init_state(spec, xtr, T.TrainConfig(**base), classes=10).layer.thresh
    assert np.array_equal(np.asarray(plain.layer.thresh), np.asarray(t0))  # the seed's thresholds never move
    assert not np.array_equal(np.asarray(moved.layer.thresh), np.asarray(t0))
    assert sum(r["thresholds"] for r in moved.history) > 0 and "thresholds" not in plain.history[0]
    # on a fixed batch, with the head trained alongside: the trained thresholds lower the loss of the
    # trained weights against the same weights at the initial thresholds
    loss = T.step_functions(spec, xtr.shape[1], xtr.shape[2], 2).loss
    xb, yb = xtr[:256], ytr[:256]
    at_init = L.ConvLayer(moved.layer.w, t0)
    assert float(loss(moved.layer, moved.head, xb, yb)) < float(loss(at_init, moved.head, xb, yb))
    with pytest.raises(ValueError, match="thresh_k must be 0, or > 0 with method 'flips' \\(got 2 with 'ste'\\)"):
        T.TrainConfig(method="ste", thresh_k=2).check()
