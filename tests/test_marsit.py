"""Marsit (seed 004) and its baselines on 4 CPU devices: semantics of Algorithm 1, unbiased merges
through the ring and the torus, identical workers after every round, K = 1 equals PSGD."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import NamedSharding

from zeroth import data as zdata
from zeroth import models as zmodels
from zeroth.collectives import ring as R
from zeroth.collectives import schemes as SC
from zeroth.collectives import sync as S
from zeroth.collectives import train as T
from zeroth.collectives.topology import Ring, Torus
from zeroth.kernels import signbits as sb
from lowering_util import lowered_kernels

RING, TORUS = Ring(4), Torus(2, 2)


def per_worker(topo, fn, *arrays):
    """Run ``fn(*worker_rows)`` on every worker; arrays have a leading worker axis."""
    mesh, spec = topo.mesh(), topo.spec()
    sharding = NamedSharding(mesh, spec)

    def body(*xs):
        out = fn(*(x[0] for x in xs))
        return jax.tree_util.tree_map(lambda a: a[None], out)

    prog = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(spec,) * len(arrays), out_specs=spec))
    return jax.tree_util.tree_map(np.asarray, prog(*(jax.device_put(a, sharding) for a in arrays)))


KEY = S.host_round_key(0, 5)


@pytest.mark.parametrize("topo", [RING, TORUS], ids=["ring", "torus"])
def test_marsit_round_follows_algorithm_1(topo):
    d, eta_s = 300, 0.125
    rng = np.random.default_rng(0)
    u = rng.standard_normal((4, d)).astype(np.float32)
    c = rng.standard_normal((4, d)).astype(np.float32) * 0.1
    sync = S.marsit(topo, eta_s, K=3)

    def run(phase, u_w, c_w):
        state = S.CompensationState(c_w, sync.init(d).inner)
        g, st, _ = sync.update(u_w, state, S.RoundCtx(jnp.asarray(KEY), phase))
        return g, st.compensation

    # one-bit round (t % K != 0): g = +-eta_s everywhere, same on every worker; c <- (u + c) - g
    assert sync.phase(1) == "sync" and sync.phase(3) == "full" and sync.phase(0) == "full"
    g, comp = per_worker(topo, functools.partial(run, "sync"), u, c)
    assert np.all(np.abs(g) == np.float32(eta_s))
    assert (g == g[:1]).all()
    np.testing.assert_array_equal(comp, (u + c) - g)
    # where every worker agrees on a sign the merge keeps it
    p = u + c
    agree = (np.all(p > 0, axis=0)) | (np.all(p < 0, axis=0))
    np.testing.assert_array_equal(np.sign(g[0][agree]), np.sign(p[0][agree]))
    # full-precision round: g = mean(u + c) by the all-reduce, compensation reset to 0
    g, comp = per_worker(topo, functools.partial(run, "full"), u, c)
    np.testing.assert_allclose(g[0], (u + c).astype(np.float64).mean(0), atol=1e-6)
    assert (g == g[:1]).all() and not comp.any()


def test_a_full_precision_round_applies_everything_the_one_bit_rounds_held_back():
    """Algorithm 1 over a whole period: after the sign rounds 1..K-1 and the full round K, the
    parameters have moved by exactly the sum of the worker-mean updates (the virtual sequence), so
    the full round's own step is everything the one-bit rounds did not apply. With updates that
    keep one sign and exceed eta_s, that backlog grows every round and the full round's step is
    many one-bit steps long (what makes Marsit-K jump at its full rounds in Figure 3(b))."""
    d, eta_s, k = 256, 0.01, 8
    sync = S.marsit(RING, eta_s, K=k)
    rng = np.random.default_rng(1)
    # every worker's update: a persistent drift of 3 eta_s on the first half of the elements, noise
    drift = np.where(np.arange(d) < d // 2, 3 * eta_s, 0.0).astype(np.float32)
    us = [(drift + 0.01 * rng.standard_normal((4, d))).astype(np.float32) for _ in range(k)]

    def run(t, u_w, c_w):
        state = S.CompensationState(c_w, sync.init(d).inner)
        g, st, _ = sync.update(u_w, state, S.RoundCtx(jnp.asarray(S.host_round_key(0, t)), sync.phase(t)))
        return g, st.compensation

    c = np.zeros((4, d), np.float32)
    moved = np.zeros(d, np.float64)
    steps = []
    for t in range(1, k + 1):
        g, c = per_worker(RING, functools.partial(run, t), us[t - 1], c)
        assert (g == g[:1]).all()
        moved += g[0]
        steps.append(np.linalg.norm(g[0]))
        if t < k:  # the compensation holds the backlog: sum of mean updates minus what was applied
            np.testing.assert_allclose(c.mean(0), sum(u.mean(0) for u in us[:t]) - moved, atol=1e-5)
    assert sync.phase(k) == "full" and not c.any()
    np.testing.assert_allclose(moved, sum(u.astype(np.float64).mean(0) for u in us), atol=1e-5)
    one_bit = eta_s * np.sqrt(d)
    assert np.allclose(steps[:-1], one_bit)
    assert steps[-1] > 5 * one_bit  # the full round's step: the backlog of k - 1 rounds of drift at once


@pytest.mark.parametrize("topo", [RING, TORUS], ids=["ring", "torus"])
def test_merged_signs_through_the_allreduce_are_unbiased(topo):
    """Each output bit is set with probability (#workers whose bit is set) / M, on ring and torus."""
    reps = 4096
    patterns = np.arange(16)
    bits = ((patterns[None, :] >> np.arange(4)[:, None]) & 1).astype(bool)  # worker k's bit per pattern
    x = np.where(np.tile(bits, (1, reps)), 1.0, -1.0).astype(np.float32)  # [4, 16 * reps]

    def fn(v):
        words = sb.pack(v)
        out = R.allreduce(words, SC.marsit_scheme(), topo.stages, round_key=jnp.asarray(KEY))
        return out.reshape(-1)

    out = per_worker(topo, fn, x)
    assert (out == out[:1]).all()
    got = np.unpackbits(out[0].view(np.uint8), bitorder="little")[: x.shape[1]].reshape(reps, 16).mean(0)
    want = bits.mean(0)
    std = np.sqrt(np.maximum(want * (1 - want), 1 / reps) / reps)
    assert np.all(np.abs(got - want) < 5 * std), np.c_[want, got]


SIGN_METHODS = {
    "marsit": lambda topo, impl: S.marsit(topo, 0.125, K=3, impl=impl),
    "signsgd": lambda topo, impl: S.signsgd(topo, 0.125, impl=impl),
    "majority_vote": lambda topo, impl: S.majority_vote(topo, 0.125, impl=impl),
    "ef_signsgd": lambda topo, impl: S.ef_signsgd(topo, impl=impl),
    "ssdm": lambda topo, impl: S.ssdm(topo, impl=impl),
}


@pytest.mark.parametrize(
    "method, topo",
    [(m, RING) for m in SIGN_METHODS] + [("marsit", TORUS)],
    ids=[f"{m}-ring" for m in SIGN_METHODS] + ["marsit-torus"],
)
def test_a_sign_methods_round_builds_for_a_gpu_with_its_kernels_inside_shard_map(method, topo, monkeypatch):
    """On a GPU a sign method's round runs the Pallas sign-bit kernels inside ``shard_map``, which
    refused their outputs there: every Marsit run beside an NVIDIA H200 stopped with "When
    `check_vma=True` on `jax.shard_map`, `manual_axis_type` on `jax.ShapeDtypeStruct` must not be
    `None`". The round (what the trainer compiles) now lowers for a GPU, its kernels in it."""
    monkeypatch.setattr(sb._rule, "default_platform", lambda: "gpu")  # the kernels' choice on a GPU
    d = 300
    sync = SIGN_METHODS[method](topo, "auto")
    mesh, spec = topo.mesh(), topo.spec()

    def body(u, c):
        state = sync.init(d)
        if isinstance(state, S.CompensationState):
            state = S.CompensationState(c[0], state.inner)
        g, st, _ = sync.update(u[0], state, S.RoundCtx(jnp.asarray(KEY), sync.phase(1)))
        return jax.tree_util.tree_map(lambda a: a[None], (g, st))

    fn = jax.shard_map(body, mesh=mesh, in_specs=(spec, spec), out_specs=spec)
    args = [jax.ShapeDtypeStruct((4, d), jnp.float32)] * 2
    kernels = set(lowered_kernels(fn, args, "cuda"))
    assert "zeroth_signbits_pack" in kernels, (method, sorted(kernels))
    if method == "marsit":
        assert {"zeroth_signbits_merge", "zeroth_signbits_unpack"} <= kernels, sorted(kernels)


def test_ssdm_stochastic_sign_is_unbiased():
    n = 2000
    u = jnp.asarray(np.random.default_rng(1).standard_normal(32).astype(np.float32))
    keys = jnp.asarray(np.stack([S.host_round_key(1, t) for t in range(n)]))
    dec = jax.jit(jax.vmap(lambda k: SC.ssdm_decompress(SC.ssdm_compress(u, k), impl="jnp")))(keys)
    norm = float(jnp.linalg.norm(u))
    assert np.all(np.abs(np.asarray(dec)) == np.float32(norm))  # every element is +-||u||
    np.testing.assert_allclose(np.asarray(dec.mean(0)), np.asarray(u), atol=5 * norm / np.sqrt(n))


def test_error_feedback_keeps_what_was_not_sent():
    d = 100
    rng = np.random.default_rng(2)
    u = rng.standard_normal((4, d)).astype(np.float32)
    sync = S.ef_signsgd(RING)

    def fn(u_w):
        g, st, mine = sync.update(u_w, sync.init(d), S.RoundCtx(jnp.asarray(KEY), "sync"))
        return g, st.compensation, mine

    g, e, mine = per_worker(RING, fn, u)
    scale = np.abs(u).mean(1, keepdims=True)
    np.testing.assert_allclose(mine, np.where(u < 0, -scale, scale), rtol=1e-6)
    np.testing.assert_array_equal(e, u - mine)
    np.testing.assert_allclose(g[0], mine.mean(0), rtol=1e-5, atol=1e-7)
    assert (g == g[:1]).all()


# ----------------------------------------------------------------------------- training


@functools.lru_cache(maxsize=1)
def _setup():
    ds = zdata.load("digits", "train")
    model = zmodels.build("mlp", num_classes=10, hidden=(16,))
    params = zmodels.init(model, zmodels.init_key(0), ds.x[:1])

    def loss_fn(p, x, y):
        return optax.softmax_cross_entropy_with_integer_labels(zmodels.apply(model, p, x), y).mean()

    return ds, params, loss_fn


def _batches(t, m=4, b=16):
    ds, _, _ = _setup()
    idx = [zdata.batch_indices(0, t * m + k, b, ds.x.shape[0]) for k in range(m)]
    return np.stack([ds.x[i] for i in idx]), np.stack([ds.y[i] for i in idx])


def _local_batches(t, h, m=4, b=16):
    ds, _, _ = _setup()
    idx = [[zdata.batch_indices(0, (t * h + j) * m + k, b, ds.x.shape[0]) for j in range(h)] for k in range(m)]
    return (
        np.stack([np.stack([ds.x[i] for i in row]) for row in idx]),
        np.stack([np.stack([ds.y[i] for i in row]) for row in idx]),
    )


def _train(topo, sync, rounds, eta_l=0.1, local_steps=1, momentum=0.0, lr_scale=lambda t: 1.0):
    ds, params, loss_fn = _setup()
    tr = T.make_trainer(loss_fn, params, topo, sync, eta_l=eta_l, local_steps=local_steps, momentum=momentum)
    state = tr.init(params)
    sums, losses = [], []
    for t in range(rounds):
        xs, ys = _batches(t) if local_steps == 1 else _local_batches(t, local_steps)
        state, loss = tr.round(state, t, xs, ys, lr_scale=lr_scale(t))
        sums.append(T.worker_checksums(state.params))
        losses.append(float(np.mean(loss)))
    return sums, losses


METHOD_CASES = [
    ("psgd", RING, {}),
    ("signsgd", RING, {"eta_s": 1e-2}),
    ("majority_vote", TORUS, {"eta_s": 1e-2}),
    ("ef_signsgd", RING, {}),
    ("ssdm", TORUS, {}),
    ("ssdm", RING, {"norm": "bucket", "bucket": 64}),
    ("ssdm_count", TORUS, {"eta_s": 1e-2}),
    ("ef_signsgd_count", RING, {}),
    ("marsit", TORUS, {"eta_s": 1e-2, "K": 2}),
]


@pytest.mark.parametrize(
    "method,topo,kw", METHOD_CASES, ids=[f"{m}-{type(t).__name__}-{kw.get('norm', '')}" for m, t, kw in METHOD_CASES]
)
def test_every_worker_holds_identical_parameters_after_every_round(method, topo, kw):
    sums, _ = _train(topo, S.build(method, topo, **kw), rounds=3, eta_l=0.01 if method == "ssdm" else 0.1)
    for t, per in enumerate(sums):
        assert len(per) == 4 and len(set(per)) == 1, (method, t, per)
    assert len({s[0] for s in sums}) == 3  # and the parameters did move every round


def test_marsit_with_k1_is_psgd_bit_for_bit():
    a, _ = _train(RING, S.marsit(RING, 1e-2, K=1), rounds=3)
    b, _ = _train(RING, S.psgd(RING), rounds=3)
    assert a == b


def test_local_steps_with_momentum_keep_k1_on_psgd_and_workers_identical():
    kw = {"local_steps": 3, "momentum": 0.9, "eta_l": 0.05}
    a, la = _train(RING, S.marsit(RING, 1e-2, K=1), rounds=3, **kw)
    b, lb = _train(RING, S.psgd(RING), rounds=3, **kw)
    assert a == b and la == lb
    c, _ = _train(RING, S.psgd(RING), rounds=3, eta_l=0.05)
    assert all(len(set(s)) == 1 for s in a) and a[-1] != c[-1]  # the local steps did change the run


def test_one_plain_local_step_is_the_same_bits_as_before():
    # local_steps=1, momentum=0 takes the one-gradient path; a step-size scale of 1 changes nothing
    a, _ = _train(RING, S.marsit(RING, 1e-2, K=2), rounds=3)
    b, _ = _train(RING, S.marsit(RING, 1e-2, K=2), rounds=3, lr_scale=lambda t: 1.0)
    c, _ = _train(RING, S.marsit(RING, 1e-2, K=2), rounds=3, lr_scale=lambda t: 0.1 if t else 1.0)
    assert a == b and a[0] == c[0] and a[1] != c[1] and a[2] != c[2]  # eta_s falls with the local step size


def test_local_step_settings_are_refused_with_the_value():
    ds, params, loss_fn = _setup()
    with pytest.raises(ValueError, match="local_steps must be an int >= 1, got 0"):
        T.make_trainer(loss_fn, params, RING, S.psgd(RING), eta_l=0.1, local_steps=0)
    with pytest.raises(ValueError, match="momentum must be a number in \\[0, 1\\), got 1.0"):
        T.make_trainer(loss_fn, params, RING, S.psgd(RING), eta_l=0.1, momentum=1.0)


def _count_values(g, eta, m):
    return np.all(np.isin(np.round(np.asarray(g) / eta * m).astype(int), np.arange(-m, m + 1, 2)))


def test_ssdm_count_sums_stochastic_signs_and_is_unbiased():
    d, eta, n = 64, 0.5, 400
    rng = np.random.default_rng(3)
    u = (rng.standard_normal((4, d)) * rng.uniform(0.1, 3.0, (4, 1))).astype(np.float32)
    sync = S.ssdm_count(RING, eta)
    run = jax.jit(
        jax.shard_map(
            lambda u_w, k: sync.update(u_w[0], (), S.RoundCtx(k, "sync"))[0][None],
            mesh=RING.mesh(),
            in_specs=(RING.spec(), jax.sharding.PartitionSpec()),
            out_specs=RING.spec(),
        )
    )
    gs = np.stack([np.asarray(run(u, jnp.asarray(S.host_round_key(4, t)))) for t in range(n)])
    assert (gs == gs[:, :1]).all()  # every worker applies the same g
    assert _count_values(gs[:, 0], eta, 4)  # g = eta (2c - M) / M, c a count in 0..M
    expect = eta * (u / np.linalg.norm(u, axis=1, keepdims=True)).mean(0)
    np.testing.assert_allclose(gs[:, 0].mean(0), expect, atol=5 * eta / np.sqrt(n))


def test_ef_signsgd_count_keeps_what_was_not_sent():
    d = 100
    u = np.random.default_rng(2).standard_normal((4, d)).astype(np.float32)
    sync = S.ef_signsgd_count(RING)

    def fn(u_w):
        g, st, mine = sync.update(u_w, sync.init(d), S.RoundCtx(jnp.asarray(KEY), "sync"))
        return g, st.compensation, mine

    g, e, mine = per_worker(RING, fn, u)
    scale = np.abs(u).mean(1, keepdims=True)
    np.testing.assert_allclose(mine, np.where(u < 0, -scale, scale), rtol=1e-6)
    np.testing.assert_array_equal(e, u - mine)
    counts = (u >= 0).sum(0)
    np.testing.assert_allclose(g[0], scale.mean() * (2 * counts - 4) / 4, rtol=1e-5, atol=1e-7)
    assert (g == g[:1]).all()


def test_bucket_norms_are_unbiased_and_count_methods_send_count_bits():
    n = 2000
    u = jnp.asarray(
        np.random.default_rng(1).standard_normal(128).astype(np.float32) * np.repeat([0.01, 1, 10, 100], 32)
    )
    keys = jnp.asarray(np.stack([S.host_round_key(1, t) for t in range(n)]))
    dec = jax.jit(jax.vmap(lambda k: SC.ssdm_decompress(SC.ssdm_compress(u, k, norm="bucket", bucket=32), impl="jnp")))(
        keys
    )
    norms = np.repeat(np.linalg.norm(np.asarray(u).reshape(4, 32), axis=1), 32)
    np.testing.assert_allclose(np.abs(np.asarray(dec)), np.broadcast_to(norms, dec.shape), rtol=1e-6)
    np.testing.assert_allclose(np.asarray(dec.mean(0)), np.asarray(u), atol=5 * norms.max() / np.sqrt(n))
    with pytest.raises(ValueError, match="bucket must be a positive multiple of 32 elements, got 48"):
        S.ssdm(RING, norm="bucket", bucket=48)
    ds, params, loss_fn = _setup()
    xs, ys = _batches(0)
    bits = {}
    for name, sync in (
        ("signsgd", S.signsgd(RING, 1e-2)),
        ("ssdm_count", S.ssdm_count(RING, 1e-2)),
        ("ef_count", S.ef_signsgd_count(RING)),
        ("l2", S.ssdm(RING)),
        ("bucket", S.ssdm(RING, norm="bucket", bucket=64)),
    ):
        bits[name] = T.make_trainer(loss_fn, params, RING, sync, eta_l=0.1).round_bits("sync", xs, ys)
    assert bits["ssdm_count"] == bits["signsgd"]  # the same counts cross the ring
    assert bits["ef_count"] == bits["signsgd"] + 3 * 4 * 32  # plus the 4 scales, each all-gathered over 3 hops
    assert bits["bucket"] > bits["l2"]  # a norm per 64 elements instead of one per segment


def test_marsit_trains_and_its_workers_agree():
    sums, losses = _train(RING, S.marsit(RING, 1e-2, K=None), rounds=40, eta_l=0.5)
    assert all(len(set(s)) == 1 for s in sums)
    assert np.mean(losses[-5:]) < 0.6 * np.mean(losses[:3]), losses


def test_build_rejects_bad_settings():
    with pytest.raises(ValueError, match="unknown synchronization method"):
        S.build("qsgd", RING)
    with pytest.raises(ValueError, match="needs eta_s"):
        S.build("marsit", RING)
    with pytest.raises(ValueError, match="K .* must be an int >= 1 or None"):
        S.marsit(RING, 1e-3, K=0)
    with pytest.raises(ValueError, match="eta_s"):
        S.signsgd(RING, -1.0)
    with pytest.raises(TypeError, match="flat f32"):
        S.psgd(RING).update(jnp.zeros((2, 3)), (), S.RoundCtx(jnp.asarray(KEY), "sync"))


def test_round_keys_are_named_integers_on_host_and_device():
    from zeroth import reference as zref

    run_key = zref.fold_in(zref.root_key(7), S.MARSIT_TAG)
    for t in (0, 1, 123456):
        np.testing.assert_array_equal(np.asarray(S.round_key(jnp.asarray(run_key), t)), S.host_round_key(7, t))
    assert not np.array_equal(S.host_round_key(7, 1), S.host_round_key(8, 1))
