"""Bit-flip training: the loss delta of every single mutation equals re-running the layer with it applied."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from numpy.testing import assert_array_equal

from zeroth.binary import flips as F
from zeroth.binary import layers as L
from zeroth.binary import reference as R


def _setup(ternary, seed, c_in=5, c_out=3, b=4, h=5, w=4, classes=3):
    rng = np.random.default_rng(seed)
    spec = L.ConvSpec(c_in=c_in, c_out=c_out, ternary=ternary)
    x = R.pack(rng.choice([-1, 1], (b, h, w, c_in)))
    layer = L.init_layer(spec, x, seed=seed)
    reg = L.regions(h, w, 2)
    head = L.Head(
        jnp.asarray(rng.standard_normal((len(reg.counts), c_out, classes)).astype(np.float32)),
        jnp.asarray(rng.standard_normal(classes).astype(np.float32)),
    )
    labels = jnp.asarray(rng.integers(0, classes, b).astype(np.int32))
    return spec, x, layer, reg, head, labels


@pytest.mark.parametrize("ternary,seed", [(False, 0), (False, 1), (True, 2), (True, 3)])
def test_deltas_equal_brute_force_single_flips(ternary, seed):
    spec, x, layer, reg, head, labels = _setup(ternary, seed)
    deltas = np.asarray(F.mutation_deltas(layer, head, x, labels, spec, reg))
    loss = jax.jit(lambda lay: F.batch_loss(lay, head, x, labels, spec, reg))  # one program for every flip
    base = float(loss(layer))
    valid = np.asarray(F.valid_moves(layer.w, ternary))
    assert_array_equal(np.isfinite(deltas), valid)
    changed = 0
    for m in range(2 * spec.n_weights):
        o, j, d = m // 2 // deltas.shape[1], m // 2 % deltas.shape[1], m % 2
        if not valid[o, j, d]:
            with pytest.raises(ValueError, match="past its limit"):
                F.apply_mutations_np(layer.w, [m], ternary)
            continue
        w2 = F.apply_mutations_np(layer.w, [m], ternary)
        brute = float(loss(L.ConvLayer(jnp.asarray(w2), layer.thresh))) - base
        assert abs(deltas[o, j, d] - brute) <= 1e-4 * (1 + abs(base)), (m, deltas[o, j, d], brute)
        changed += brute != 0
    assert changed > 0  # some flips cross a threshold: the comparison is not all zeros


def test_dots_match_float_patches_and_packing():
    spec, x, layer, reg, head, labels = _setup(True, 4, c_in=37)
    d = np.asarray(L.dots(layer, x, spec)).reshape(x.shape[0], -1, spec.c_out)
    xcol = np.asarray(L.im2col_pm1(x, spec.c_in))
    assert_array_equal(d, np.einsum("bpj,oj->bpo", xcol, np.asarray(layer.w, np.float32)))
    sign, mask = L.packed_weights(layer.w, spec.c_in, True)
    s_ref, m_ref = R.pack_ternary(np.asarray(layer.w).reshape(spec.c_out, 9, spec.c_in))
    assert_array_equal(np.asarray(sign), s_ref.reshape(spec.c_out, -1))
    assert_array_equal(np.asarray(mask), m_ref.reshape(spec.c_out, -1))


def test_select_top_k_one_per_weight_and_limits():
    d = np.array([[[np.inf, -0.5], [-0.9, -1.0], [-0.2, np.inf]]], np.float32)
    assert F.select(d, k=2).tolist() == [1, 3]  # (0,1,+1) best, then (0,0,+1)
    assert F.select(d, k=5, min_gain=0.3).tolist() == [1, 3]
    w = np.array([[1, -1, 0]], np.int8)
    assert F.at_limit_np(w, [1, 2, 4, 5], True).tolist() == [True, True, False, False]
    assert F.at_limit_np(w, [1, 0, 3], False).tolist() == [True, False, False]


@pytest.mark.parametrize("ternary,seed", [(False, 0), (False, 1), (True, 2)])
def test_threshold_deltas_equal_brute_force_moves(ternary, seed):
    spec, x, layer, reg, head, labels = _setup(ternary, seed, c_out=6, b=8)
    deltas = np.asarray(F.threshold_deltas(layer, head, x, labels, spec, reg))
    assert deltas.shape == (spec.c_out, 2)
    loss = jax.jit(lambda lay: F.batch_loss(lay, head, x, labels, spec, reg))
    base = float(loss(layer))
    changed = 0
    for o in range(spec.c_out):
        for d in (0, 1):
            moves = np.zeros(spec.c_out, np.int32)
            moves[o] = 2 * d - 1
            t2 = F.apply_thresholds(layer.thresh, moves, spec)
            assert t2[o] == int(layer.thresh[o]) + (2 * d - 1) * spec.step
            brute = float(loss(L.ConvLayer(layer.w, jnp.asarray(t2)))) - base
            assert abs(deltas[o, d] - brute) <= 1e-4 * (1 + abs(base)), (o, d, deltas[o, d], brute)
            changed += brute != 0
    assert changed > 0


def test_select_thresholds_takes_the_k_best_moves():
    d = np.array([[0.1, -0.3], [-0.9, -0.2], [0.0, 0.5], [-0.5, -0.6]], np.float32)
    assert F.select_thresholds(d, k=2).tolist() == [0, -1, 0, 1]
    assert F.select_thresholds(d, k=9, min_gain=0.4).tolist() == [0, -1, 0, 1]
    assert F.select_thresholds(d, k=9).tolist() == [1, -1, 0, 1]
