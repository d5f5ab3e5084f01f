"""Data-parallel pipeline replicas: the averaging math, QuantizedAdam's error feedback, the frames,
R replicas against one pipeline on the union of their batches, and the processes."""

from __future__ import annotations

import json
import math

import jax
import numpy as np
import pytest

from zeroth.collectives import quantized_adam as qa
from zeroth.config import load_config_dict
from zeroth.pipeline import build, replicas, sim, wire
from zeroth.replay import checksum
from zeroth.train.metrics import check_schema

ROUNDS = 40


def _raw(steps=4, optimizer="adamw", **pipeline):
    return {
        "run": {"seed": 1},
        "data": {"dataset": "sotu", "batch_size": 8},
        "model": {"name": "transformer", "kwargs": {"d_model": 16, "heads": 2, "layers": 2, "mlp_dim": 16}},
        "train": {"method": "backprop", "lr": 1e-2, "steps": steps, "optimizer": {"name": optimizer}},
        "pipeline": {"stages": 2, "micro_batches": 2, "examples": 16, "seq_len": 8, **pipeline},
    }


# ---------------------------------------------------------------------- the math


def test_mean_sums_in_replica_order_and_divides_once():
    rng = np.random.default_rng(0)
    vs = [rng.standard_normal(1000).astype(np.float32) * 10.0**k for k in range(4)]
    want = ((vs[0] + vs[1]) + vs[2]) + vs[3]
    assert qa.mean(vs).tobytes() == (want / np.float32(4)).tobytes()
    assert qa.mean(vs).tobytes() != qa.mean(vs[::-1]).tobytes()  # the order is part of the result
    with pytest.raises(ValueError, match="differ in shape"):
        qa.mean([vs[0], vs[1][:10]])


def _packbits_reference(c: np.ndarray, bounds: np.ndarray):
    """Sign compression written independently: np.packbits words, per-segment root mean square."""
    bits = ~(c <= -np.finfo(np.float32).tiny)
    pad = np.zeros((-c.size) % 32, bool)
    words = np.packbits(np.concatenate([bits, pad]), bitorder="little").view("<u4")
    scales = np.array(
        [
            np.float32(math.sqrt(math.fsum(float(x) ** 2 for x in c[a:b]) / (b - a)))
            for a, b in zip(bounds[:-1], bounds[1:])
        ],
        np.float32,
    )
    q = np.where(bits, 1.0, -1.0).astype(np.float32) * np.repeat(scales, np.diff(bounds))
    return words, scales, q


def test_sign_compression_matches_an_independent_reference_bit_for_bit():
    rng = np.random.default_rng(1)
    bounds = qa.segments_of([37, 1, 64, 5])
    c = rng.standard_normal(int(bounds[-1])).astype(np.float32)
    c[3], c[40] = 0.0, -0.0  # a zero's sign is +
    words, scales, q = qa.sign_compress(c, bounds)
    rw, rs, rq = _packbits_reference(c, bounds)
    assert words.tobytes() == rw.tobytes() and scales.tobytes() == rs.tobytes() and q.tobytes() == rq.tobytes()
    assert q[3] > 0 and q[40] > 0
    assert qa.sign_decompress(words, scales, bounds).tobytes() == q.tobytes()
    from zeroth.kernels import signbits  # the words are the sign kernels' reference's, edge values included

    tiny = np.finfo(np.float32).tiny
    edge = np.float32([0.0, -0.0, tiny, -tiny, -tiny / 4, np.nan, -np.inf, np.inf, -1.0, 1.0] * 7)
    for x in (c, edge, c[:32], c[:33]):
        assert qa._pack_signs(x).tobytes() == np.asarray(signbits.pack_ref(x), np.uint32).tobytes()
        b = qa.segments_of([x.size])
        ref = np.asarray(signbits.unpack_ref(qa._pack_signs(x), (x.size,), dtype=np.float32, scale=1.0))
        assert qa.sign_decompress(qa._pack_signs(x), np.float32([1.0]), b).tobytes() == ref.tobytes()
    assert qa.sign_nbytes(c.size, 4) == words.nbytes + scales.nbytes == 4 * 4 + 4 * 4
    with pytest.raises(ValueError, match="need 4 and 4"):
        qa.sign_decompress(words[:-1], scales, bounds)


def test_error_feedback_keeps_its_error_of_the_inputs_order_and_delivers_their_sum():
    rng = np.random.default_rng(2)
    bounds = qa.segments_of([300, 200])
    ef = qa.ErrorFeedback(bounds)
    sent = np.zeros(500, np.float64)
    given = np.zeros(500, np.float64)
    norms = []
    for t in range(ROUNDS):
        x = (rng.standard_normal(500) * (1 + t % 3)).astype(np.float32)
        x[:50] *= 20  # uneven magnitudes, as momenta have
        c = x + ef.error
        _, scales, q = ef.step(x)
        for k, (a, b) in enumerate(zip(bounds[:-1], bounds[1:])):  # ‖C(c)‖ = ‖c‖; ‖c − q‖² = 2‖c‖² − 2‖c‖₂‖c‖₁/√n
            cs, es = c[a:b].astype(np.float64), ef.error[a:b].astype(np.float64)
            assert np.linalg.norm(q[a:b]) == pytest.approx(np.linalg.norm(cs), rel=1e-5)
            want = 2 * (cs @ cs) - 2 * np.linalg.norm(cs) * np.abs(cs).sum() / np.sqrt(b - a)
            assert es @ es == pytest.approx(want, rel=1e-4) and es @ es <= 2 * (cs @ cs)
        sent += q
        given += x
        norms.append(np.linalg.norm(ef.error) / np.linalg.norm(x))
    # what the rounds delivered is what they were given, but for the last error (no drift)
    np.testing.assert_allclose(sent + ef.error, given, atol=1e-3)
    assert max(norms[ROUNDS // 2 :]) < 2 * max(norms[: ROUNDS // 2]) and max(norms) < 3  # bounded, not growing with t


def _onebit_reference(grads, bounds, warmup, lr, b1=0.9, b2=0.999, eps=1e-8, wd=0.0):
    """1-bit Adam written out for R replicas from the same start, without the class (float32 NumPy)."""
    R, n = len(grads[0]), int(bounds[-1])
    p = np.zeros(n, np.float32)
    m, v = np.zeros(n, np.float32), np.zeros(n, np.float32)
    ew = [np.zeros(n, np.float32) for _ in range(R)]
    es = np.zeros(n, np.float32)
    f = np.float32
    for t, gs in enumerate(grads):
        if t < warmup:
            g = qa.mean(gs)
            m = f(b1) * m + f(1 - b1) * g
            v = f(b2) * v + f(1 - b2) * (g * g)
        else:
            qs = []
            for r in range(R):
                c = (f(b1) * m + f(1 - b1) * gs[r]) + ew[r]
                qs.append(_packbits_reference(c, bounds)[2])
                ew[r] = c - qs[-1]
            c = qa.mean(qs) + es
            q = _packbits_reference(c, bounds)[2]
            es = c - q
            m = np.where(v > 0, q, f(0))
        k = t + 1
        upd = (m * f(1 / (1 - b1**k))) / (np.sqrt(v * f(1 / (1 - b2 ** min(k, warmup)))) + f(eps))
        p = p - f(lr) * (upd + f(wd) * p)
    return p, ew, es


def test_quantized_adam_reproduces_the_written_out_algorithm_exactly_on_every_replica():
    rng = np.random.default_rng(3)
    bounds = qa.segments_of([40, 24])
    R, T, warmup = 3, 8, 3
    grads = [[rng.standard_normal(64).astype(np.float32) for _ in range(R)] for _ in range(T)]
    for gs in grads[:warmup]:  # entries 5 and 50 never see a gradient in the warm-up: their momentum stays 0
        for g in gs:
            g[[5, 50]] = 0.0
    states = [qa.QuantizedAdam(bounds, warmup, weight_decay=0.01, server=r == 0) for r in range(R)]
    params = [np.zeros(64, np.float32) for _ in range(R)]
    for t in range(T):
        contrib = [s.local_momentum(t, g) for s, g in zip(states, grads[t])]
        assert all((c[1] is None) == (t < warmup) for c in contrib)
        shared, packed = states[0].reduce(t, [c[0] for c in contrib])
        params = [s.apply(t, p, shared, 1e-2) for s, p in zip(states, params)]
    want, ew, es = _onebit_reference(grads, bounds, warmup, 1e-2, wd=0.01)
    assert want[5] == want[50] == 0.0 and np.all(want[:5] != 0)
    for r in range(R):
        assert params[r].tobytes() == want.tobytes()
        assert states[r].worker.error.tobytes() == ew[r].tobytes()
    assert states[0].server.error.tobytes() == es.tobytes()
    with pytest.raises(ValueError, match="at least 1 uncompressed step"):
        qa.QuantizedAdam(bounds, 0)


# ---------------------------------------------------------------------- frames and config


def test_replica_frames_are_checked_field_by_field():
    cfg = load_config_dict(_raw(replicas=2, replica_sync="onebit_adam", replica_warmup_steps=1))
    params = {"w": np.ones((3, 5), np.float32), "b": np.zeros(7, np.float32)}
    w = build.replica_sync_of(cfg, 1, 0, params)
    s0 = build.replica_sync_of(cfg, 0, 0, params)
    grads = {"w": np.full((3, 5), 0.5, np.float32), "b": -np.ones(7, np.float32)}
    f0 = w.contribution(0, grads)  # warm-up: float32
    assert f0.bits == 0 and len(f0.full) == 4 * 22 and f0.replica == 1
    f1 = w.contribution(1, grads)  # compressed: one word of signs, one scale per tensor
    assert f1.bits == 1 and len(f1.packed) == 4 and len(f1.scales) == 8 and f1.quantizer == replicas.QUANTIZER
    s0.contribution(1, grads)
    s0.reduce(1, [f1])
    bad = [
        (dict(step=2), "FAILED_PRECONDITION", "expected step 1"),
        (dict(replica=2), "INVALID_ARGUMENT", "expected replica 1"),
        (dict(bits=0), "INVALID_ARGUMENT", "uses 1"),
        (dict(scales=b"\0" * 4), "INVALID_ARGUMENT", "scales holds 4 bytes"),
        (dict(run_id="x"), "INVALID_ARGUMENT", "belongs to run"),
    ]
    for change, code, msg in bad:
        f = type(f1)()
        f.CopyFrom(f1)
        for k, v in change.items():
            setattr(f, k, v)
        with pytest.raises(wire.FrameError, match=msg) as e:
            s0.contribution(1, grads)
            s0.reduce(1, [f])
        assert e.value.code == code


@pytest.mark.parametrize(
    "change, msg",
    [
        (dict(replicas=3), "3 replicas x 2 micro-batches must divide data.batch_size=8"),
        (dict(replicas=2, replica_sync="onebit_adam", optimizer="sgd"), "onebit_adam is an Adam"),
        (dict(replicas=32, stages=3), "expected at most 64"),
        (dict(replicas=0), "replicas"),
    ],
)
def test_bad_replica_configs_are_refused_with_the_field_and_the_fix(change, msg):
    opt = change.pop("optimizer", "adamw")
    with pytest.raises(ValueError, match=msg):
        load_config_dict(_raw(optimizer=opt, **change))


def test_compare_names_the_replicas_averaging_and_times_a_target_from_compute_and_bytes():
    from zeroth.pipeline import compare

    assert compare.parse_setting("aqsgd:4:8+onebit_adam") == ("aqsgd", 4, 8, None, None)
    assert compare.setting_name("aqsgd:4:8:row+onebit_adam") == "aqsgd fw4/bw8 row + onebit_adam"
    cfg = compare.apply_setting(load_config_dict(_raw(replicas=2)), "fp32+onebit_adam")
    assert (cfg.pipeline.compression, cfg.pipeline.replica_sync) == ("fp32", "onebit_adam")
    with pytest.raises(ValueError, match="after '\\+' is fp32 or onebit_adam, got 'topk'"):
        compare.parse_setting("aqsgd:4:8+topk")

    def rec(step, epoch, loss, compute):  # 1 MB of links and 1 MB of averaging per step
        return {
            "step": step,
            "epoch": epoch,
            "loss": loss,
            "links": [{"fw_bytes": 5e5, "bw_bytes": 5e5, "fw_frames": 0, "bw_frames": 0}],
            "stages": [{"compute_s": compute, "codec_s": 0.0}],
            "sync": [{"up_bytes": 5e5, "down_bytes": 5e5}],
        }

    recs = [rec(1, 0, 3.0, 5.0), rec(2, 0, 3.0, 1.0), rec(3, 1, 2.0, 1.0), rec(4, 1, 1.0, 1.0)]
    assert compare.epoch_means(recs) == {0: 3.0, 1: 1.5}
    assert compare.time_to_target(recs, 2.0, 8e6) == pytest.approx(8.0 + 4 * 2.0)  # compute + 2 MB at 1 MB/s per step
    assert compare.time_to_target(recs, 2.0, 8e6, compute_s=0.5) == pytest.approx(4 * 0.5 + 4 * 2.0)
    assert compare.time_to_target(recs, 3.0, 8e6) == pytest.approx(6.0 + 2 * 2.0)
    assert compare.time_to_target(recs, 1.0, 8e6) is None


def test_launch_places_each_replica_stage_on_a_host_with_its_links_averaging_and_keys(tmp_path):
    """``zeroth launch`` with R × S hosts: rank k runs stage k mod S of replica k div S, linked to its
    replica's neighbours; replica 0 of each stage serves the averaging on its port + 1 to the
    streams signed by the keys the other replicas brought to the rendezvous."""
    from zeroth import launch
    from zeroth.transport import rendezvous

    cfg = load_config_dict(_raw(replicas=2))
    plan = launch.plan_of(cfg, None)
    assert (plan.system, plan.min_nodes, plan.max_nodes) == ("pipeline", 4, 4)
    with pytest.raises(ValueError, match=r"pipeline.stages × pipeline.replicas is 4; give --nnodes 4"):
        launch.plan_of(cfg, "2")
    assert launch.plan_of(load_config_dict(_raw()), None).max_nodes == 2
    keys = [f"{k:02x}" * 32 for k in range(4)]
    members = tuple(rendezvous.Member(k, f"10.0.0.{k + 1}:{7000 + 10 * k}", f"h{k}", keys[k]) for k in range(4))
    roster = rendezvous.Roster(True, members, 4, 4, 4, 1.0)
    roles = {}
    for k in range(4):
        role, cmd, _ = launch._role(
            plan,
            cfg,
            tmp_path / "c.yaml",
            tmp_path,
            k,
            False,
            roster,
            7000 + 10 * k,
            f"10.0.0.{k + 1}",
            "s",
            None,
            60.0,
            [],
        )

        def arg(flag, cmd=cmd):
            return [cmd[i + 1] for i, a in enumerate(cmd) if a == flag]

        roles[k] = role
        replica, stage = divmod(k, 2)
        folder = tmp_path / (f"replica_{replica}" if replica else "") / f"stage_{stage}"
        assert arg("--stage") == [str(stage)] and arg("--out") == [str(folder)] and arg("--replica") == [str(replica)]
        assert arg("--listen") == ([f"0.0.0.0:{7000 + 10 * k}"] if stage else [])
        assert arg("--upstream-key") == ([keys[k - 1]] if stage else [])
        assert arg("--next") == ([members[k + 1].advertise] if stage == 0 else [])
        if replica == 0:
            assert arg("--sync-listen") == [f"0.0.0.0:{7000 + 10 * k + 1}"] and arg("--sync-server") == []
            assert arg("--replica-key") == [f"1={keys[2 + stage]}"]
        else:
            assert arg("--sync-server") == [f"10.0.0.{stage + 1}:{7000 + 10 * stage + 1}"]
            assert arg("--sync-listen") == arg("--replica-key") == []
    assert roles[3] == "stage 1 of 2, replica 1 of 2"


def test_averaging_state_saved_and_loaded_continues_bit_for_bit_and_refuses_a_damaged_file(tmp_path):
    params = {"w": np.zeros((3, 5), np.float32), "b": np.zeros(7, np.float32)}
    rng = np.random.default_rng(3)
    grads = [
        [{k: rng.standard_normal(v.shape).astype(np.float32) for k, v in params.items()} for _ in range(2)]
        for _ in range(6)
    ]

    def make():
        return [replicas.ReplicaSync("onebit_adam", 2, r, 0, "run", params, warmup=2) for r in range(2)]

    def step(syncs, t, ps):
        mine = [s.contribution(t, g) for s, g in zip(syncs, grads[t])]
        avg = syncs[0].reduce(t, mine[1:])
        return [s.apply(t, p, None, avg, None, 1e-2)[0] for s, p in zip(syncs, ps)]

    a, ps = make(), [params, params]
    for t in range(4):
        ps = step(a, t, ps)
    digests = [s.save_state(tmp_path / f"{r}.npz") for r, s in enumerate(a)]
    b = make()
    for r, s in enumerate(b):
        s.load_state(tmp_path / f"{r}.npz", digests[r])
        assert s.state_digest() == a[r].state_digest() and set(s.state()) >= {"m", "v", "count", "worker_error"}
    assert "server_error" in b[0].state() and "server_error" not in b[1].state()
    pa = pb = ps
    for t in range(4, 6):
        pa, pb = step(a, t, pa), step(b, t, pb)
    for x, y in zip(jax.tree_util.tree_leaves(pa), jax.tree_util.tree_leaves(pb)):
        assert np.asarray(x).tobytes() == np.asarray(y).tobytes()
    np.savez(tmp_path / "bad.npz", **{**a[1].state(), "m": a[1].state()["m"] + 1})
    with pytest.raises(ValueError, match="does not match its checkpoint's digest"):
        make()[1].load_state(tmp_path / "bad.npz", digests[1])
    (tmp_path / "cut.npz").write_bytes((tmp_path / "1.npz").read_bytes()[:100])
    with pytest.raises(ValueError, match="cut.npz cannot be read"):
        make()[1].load_state(tmp_path / "cut.npz", digests[1])


# ---------------------------------------------------------------------- replicas in one process


def test_fp32_replicas_step_as_one_pipeline_on_the_union_of_their_batches():
    one, e1 = sim.run_local(load_config_dict(_raw(optimizer="sgd", micro_batches=4)))
    two, e2 = sim.run_local(load_config_dict(_raw(optimizer="sgd", replicas=2)))
    np.testing.assert_allclose([r["loss"] for r in two], [r["loss"] for r in one], rtol=1e-6)
    for a, b, c in zip(e1, *e2):  # every stage: replica 0 = replica 1 bit for bit, = one pipeline up to rounding
        for x, y, z in zip(*(jax.tree_util.tree_leaves(e.params) for e in (a, b, c))):
            assert np.asarray(y).tobytes() == np.asarray(z).tobytes()
            np.testing.assert_allclose(y, x, rtol=1e-5, atol=1e-7)
    assert all(r["replicas_agree"] for r in two) and check_schema(two) == 4
    sync = two[0]["sync"]
    assert [(x["stage"], x["replica"], x["bits"]) for x in sync] == [(0, 1, 0), (1, 1, 0)]
    n = [sum(int(np.size(v)) for v in jax.tree_util.tree_leaves(e.params)) for e in e1]
    for x in sync:  # float32 each way: the stage's parameters plus a frame header
        assert 4 * n[x["stage"]] < x["up_bytes"] < 4 * n[x["stage"]] + 64
        assert 4 * n[x["stage"]] < x["down_bytes"] < 4 * n[x["stage"]] + 64
    assert two[0]["payload_bytes"] == sum(r["link_bytes"] for r in two[0]["replicas"]) + two[0]["sync_bytes"]


def test_onebit_adam_replicas_track_fp32_with_a_thirtieth_of_the_bytes_and_rerun_bit_identical():
    steps, warm = 10, 4
    fp, _ = sim.run_local(load_config_dict(_raw(steps=steps, replicas=2)))
    cfg = load_config_dict(_raw(steps=steps, replicas=2, replica_sync="onebit_adam", replica_warmup_steps=warm))
    ob, _ = sim.run_local(cfg)
    again, _ = sim.run_local(cfg, steps=warm + 2)  # two compressed steps again
    assert [r["digest"] for r in again] == [r["digest"] for r in ob[: warm + 2]] and all(
        r["replicas_agree"] for r in ob
    )
    lf, lo = [r["loss"] for r in fp], [r["loss"] for r in ob]
    np.testing.assert_allclose(lo[:warm], lf[:warm], rtol=1e-4)  # the warm-up is Adam on the float32 mean
    assert lo[-1] < 0.8 * lo[0] and abs(lo[-1] - lf[-1]) < 0.15 * lf[-1], (lf, lo)
    assert [x["bits"] for x in ob[warm]["sync"]] == [1, 1]
    assert ob[warm]["sync_bytes"] * 25 < fp[warm]["sync_bytes"]


# ---------------------------------------------------------------------- processes


def test_two_replicas_of_two_stage_processes_average_as_the_in_process_run(tmp_path):
    from zeroth.pipeline import launch

    cfg = load_config_dict(_raw(steps=3, optimizer="sgd", replicas=2))
    assert launch.run_config(cfg, tmp_path, [], progress=False) == 0
    recs = launch.read_records(tmp_path)
    assert check_schema(recs) == 3
    local, _ = sim.run_local(cfg)
    one, _ = sim.run_local(load_config_dict(_raw(steps=3, optimizer="sgd", micro_batches=4)))
    assert [r["digest"] for r in recs] == [r["digest"] for r in local]
    assert [r["loss"] for r in recs] == [r["loss"] for r in local]
    np.testing.assert_allclose([r["loss"] for r in recs], [r["loss"] for r in one], rtol=1e-6)
    for r, lr in zip(recs, local):
        assert r["replicas_agree"] and [(x["up_bytes"], x["down_bytes"]) for x in r["sync"]] == [
            (x["up_bytes"], x["down_bytes"]) for x in lr["sync"]
        ]
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["replicas_agree"] and summary["sync_bytes_per_step"] == pytest.approx(
        np.mean([r["sync_bytes"] for r in local])
    )
    assert (tmp_path / "replica_1" / "stage_1" / "metrics.jsonl").is_file()


def test_replica_zero_serves_only_averaging_streams_its_replicas_keys_signed():
    """A token holder cannot speak for a replica: replica 0's server (a real gRPC server) refuses
    an averaging stream for replica 1 that replica 1's key did not sign, before taking a frame,
    and serves the one it signed."""
    import queue as _queue

    from zeroth.pipeline import replicas
    from zeroth.pipeline.proto import pipeline_pb2 as pb
    from zeroth.transport import guard, identity
    from zeroth.transport.pacing import Pacer

    real, mallory = identity.Identity.generate(), identity.Identity.generate()
    servicer = replicas.SyncServicer(2, replica_keys=lambda r: real.public if r == 1 else None, run_id="run", stage=1)
    server, port = replicas.serve_sync(servicer, "127.0.0.1:0", "tok", guard.Limits(1 << 20, idle_s=10.0))
    try:

        def open_as(me, replica=1, stage=1):
            pacer, inbox, readers = Pacer(None, 0.0), _queue.Queue(), []
            ch = replicas.connect_sync(
                f"127.0.0.1:{port}",
                pacer,
                inbox,
                10.0,
                readers,
                "tok",
                me=me,
                run_id="run",
                stage=stage,
                replica=replica,
            )
            pacer.submit(pb.TensorFrame(run_id="run", replica=replica))
            return ch, pacer, inbox

        for me, stage in ((mallory, 1), (real, 0), (None, 1)):  # another key; the right key for another stage; unsigned
            ch, pacer, inbox = open_as(me, stage=stage)
            got = inbox.get(timeout=10)
            assert isinstance(got, ConnectionError) and "PERMISSION_DENIED" in str(got), got
            assert servicer.inboxes[1].empty()  # nothing of the refused stream was taken
            pacer.close()
            ch.close()
        ch, pacer, _ = open_as(real)
        first = servicer.inboxes[1].get(timeout=10)
        assert first.replica == 1 and first.run_id == "run"
        pacer.close()
        ch.close()
    finally:
        servicer.close()
        server.stop(0)


@pytest.mark.e2e
@pytest.mark.slow
def test_replicas_stopped_mid_run_resume_to_the_uninterrupted_parameters_bit_for_bit(tmp_path):
    """2 × 2 stage processes, QuantizedAdam compressed from step 2, stopped after step 3 or so:
    replica 0 stops at a step boundary, replica 1 in the step after it; `--resume` takes the newest
    checkpoint every process holds (its AQ-SGD buffers and averaging state: moments, step count,
    error-feedback errors) and ends every step on the parameters of the run never stopped."""
    from zeroth.pipeline import launch
    from zeroth.train import interrupt

    raw = _raw(steps=8, replicas=2, replica_sync="onebit_adam", replica_warmup_steps=2, compression="aqsgd", fw_bits=4)
    raw["train"].update(checkpoint_every=2, keep_checkpoints=0)
    cfg = load_config_dict(raw)
    rows = tmp_path / "stage_0" / "metrics.jsonl"

    def stop():
        return rows.is_file() and rows.read_text().count('"kind": "train"') >= 3

    with pytest.raises(interrupt.Interrupted):
        launch.run_config(cfg, tmp_path, [], progress=False, stop=stop)
    held = launch.common_step(tmp_path, 2, 2)
    assert held is not None and 2 <= held < 8, held
    assert (tmp_path / "replica_1" / "stage_1" / "sync" / f"{held}.npz").is_file()
    assert launch.run_config(cfg, tmp_path, ["--resume"], progress=False) == 0
    recs = launch.read_records(tmp_path)
    local, engines = sim.run_local(cfg)
    assert [r["step"] for r in recs] == list(range(1, 9))
    assert [r["digest"] for r in recs] == [r["digest"] for r in local]
    assert [r["loss"] for r in recs] == [r["loss"] for r in local]
    for k, d in enumerate(launch.process_dirs(tmp_path, 2, 2)):
        summary = json.loads((d / "summary.json").read_text())
        assert summary["start"] == held and summary["param_digest"] == checksum(engines[k // 2][k % 2].params), d
