"""Ravnest's asynchronous stages, node loop, transport and whole runs (seed 003)."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import threading

import grpc
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from zeroth import config as _config
from zeroth import protogen
from zeroth.cluster import build, chaos, driver, engine, schedule, sim, transport, wire
from zeroth.cluster.proto import cluster_pb2 as pb
from zeroth.cluster.proto import cluster_pb2_grpc as pb_grpc
from zeroth.stages import partition
from zeroth.train.metrics import check_schema, read_metrics
from zeroth.train.runs import load_run
from zeroth.transport import identity, security

BASE = {
    "run": {"name": "rv", "seed": 0},
    "data": {"dataset": "sentiment", "batch_size": 8},
    "model": {"name": "transformer", "kwargs": {}},
    "train": {"method": "backprop", "steps": 8, "lr": 1e-3, "optimizer": {"name": "adamw"}},
    "ravnest": {"examples": 64, "seq_len": 32, "average_every": 4},
}


LATE = [{"name": "j0", "ram_mb": 10, "bandwidth_mbps": 200, "join_round": 2}]


def _with_late(raw: dict) -> dict:
    raw = json.loads(json.dumps(raw))
    raw["ravnest"]["nodes"] = [dict(n) for n in _config.load_config_dict(BASE).ravnest.nodes] + LATE
    return raw


def _cfg(**ravnest):
    raw = json.loads(json.dumps(BASE))
    raw["ravnest"].update(ravnest)
    return _config.load_config_dict(raw)


def test_checked_in_stubs_are_what_protoc_generates(tmp_path):
    for p in protogen.generate("cluster", tmp_path):
        assert (protogen.stub_dir("cluster") / p.name).read_text() == p.read_text(), (
            "run `python -m zeroth.protogen cluster`"
        )


@settings(max_examples=60, deadline=None)
@given(st.integers(1, 6), st.integers(0, 12), st.integers(0, 7))
def test_fixed_order_runs_every_batch_once_within_the_delay_bound(S, n, D):
    for s in range(S):
        ops = schedule.fixed_order(s, S, n, D)
        w = schedule.in_flight(s, S, D)
        if s == S - 1:
            assert ops == [("FB", b) for b in range(n)]
            continue
        assert [b for k, b in ops if k == "F"] == list(range(n)) == [b for k, b in ops if k == "B"]
        inflight = 0
        for k, b in ops:
            inflight += 1 if k == "F" else -1
            assert 0 <= inflight <= w
        # no deadlock: stage s needs B(k - w_{s-1}) before F(k) of stage s-1 can exist
        if s > 0:
            prev = schedule.in_flight(s - 1, S, D)
            pos = {op: i for i, op in enumerate(ops)}
            for b in range(n):
                if b - prev >= 0:
                    assert pos[("B", b - prev)] < pos[("F", b)]


def test_one_batch_in_flight_is_plain_backprop_on_the_whole_model():
    """D = 1: every stage waits for its gradient, so the async stages train exactly like one model."""
    cfg = _cfg(max_in_flight=1)
    ex = build.examples_of(cfg)
    model, params = build.model_of(cfg, ex)
    ranges = [(0, 1), (1, 1), (1, 2)]
    part = partition.transformer_partition(
        params, ranges, objective="classify", heads=model.heads, mlp_dim=model.mlp_dim, pad_id=ex.pad_id
    )
    opt = optax.adamw(1e-3)
    stages = [engine.AsyncStage(i, 3, part.fns[i], part.params[i], opt) for i in range(3)]
    data = build.data_of(cfg, ex, 0, 1)
    ref = [jax.tree_util.tree_map(jnp.asarray, p) for p in part.params]
    with jax.numpy_dtype_promotion("standard"):
        ref_state = opt.init(ref)

    @jax.jit
    def ref_step(ps, state, tok, lab):
        loss, grads = jax.value_and_grad(lambda q: partition.reference_loss(part, q, tok, lab))(ps)
        upd, state = opt.update(grads, state, ps)
        return optax.apply_updates(ps, upd), state, loss

    for b in range(3):
        tok, lab = data(b)
        h = stages[0].forward(b, tok, lab)
        h = stages[1].forward(b, tok, lab, h)
        loss, g = stages[2].forward(b, tok, lab, h)
        g = stages[1].backward(b, tok, g)
        assert stages[0].backward(b, tok, g) is None
        with jax.numpy_dtype_promotion("standard"):
            ref, ref_state, ref_loss = ref_step(ref, ref_state, jnp.asarray(tok), jnp.asarray(lab))
        assert loss == pytest.approx(float(ref_loss), rel=1e-5)
    for s, r in zip(stages, ref):
        for a, c in zip(jax.tree_util.tree_leaves(s.params), jax.tree_util.tree_leaves(r)):
            np.testing.assert_allclose(np.asarray(a), np.asarray(c), rtol=2e-5, atol=2e-6)
    assert all(x == 0 for s in stages for x in s.staleness)


def test_flat_slices_of_differently_cut_clusters_line_up():
    cfg = _cfg()
    ex = build.examples_of(cfg)
    _, params = build.model_of(cfg, ex)
    units = engine.model_units(2)
    whole = engine.flat_of(params, units)
    for cut in ([(0, 4)], [(0, 1), (1, 4)], [(0, 2), (2, 3), (3, 4)]):
        parts = [{k: params[k] for u in units[a:b] for k in u} for a, b in cut]
        flats = [engine.flat_of(p, units) for p in parts]
        np.testing.assert_array_equal(np.concatenate(flats), whole)
        again = engine.with_flat(parts[0], units, flats[0] * 2)
        np.testing.assert_array_equal(engine.flat_of(again, units), flats[0] * 2)


@pytest.fixture(scope="module")
def reference():
    """The in-process run of BASE plus a late node forming a third cluster at round 2 (8 batches, fixed order)."""
    return sim.run_local(_config.load_config_dict(_with_late(BASE)))


def test_in_process_clusters_end_averaged_and_a_late_cluster_starts_from_the_average(reference):
    a = reference
    plan = a["plan"]
    assert plan.join_round == (0, 0, 2) and len(plan.rings) >= 2
    models = [
        np.concatenate([a["flat"][plan.primaries[(c, s)]] for s in range(len(cl))]) for c, cl in enumerate(plan.stages)
    ]
    assert len(models) == 3 and all(
        np.array_equal(models[0], m) for m in models[1:]
    )  # the last update averages all three
    for name, res in a["results"].items():
        c, s = plan.slots[name]
        assert res["updates"] == (4 if c == 2 else 8)
        assert res["staleness_max"] == schedule.staleness(s, len(plan.stages[c]))
    records = a["records"][plan.primaries[(0, 0)]]
    assert [r["average_round"] for r in records if "average_round" in r] == [1, 2]
    assert [r["step"] for r in records] == list(range(1, 9))
    assert [r["step"] for r in a["records"]["j0"]] == [5, 6, 7, 8]
    assert [r["forward_passes"] for r in a["records"]["j0"]] == [1, 2, 3, 4]  # one stage: no batch in flight
    # the late cluster started from what the first cluster averaged at round 1
    round1 = np.concatenate([a["averaged"][plan.primaries[(0, s)]][1] for s in range(len(plan.stages[0]))])
    lo, hi = plan.layouts[2][0]
    assert (lo, hi) == (0, round1.size)
    np.testing.assert_array_equal(a["starts"]["j0"], round1)


@pytest.mark.slow
@pytest.mark.e2e
def test_processes_match_the_in_process_run_and_a_backup_takes_over(tmp_path, reference):
    """Node processes on loopback end on the in-process digests, with a late cluster joining at round 2, a
    backup shadowing from the start and one joining at round 1 (its primary's state handed over), both
    primaries SIGKILLed and their backups taking over."""
    raw = _with_late(BASE)
    raw["ravnest"]["nodes"] += [
        {"name": "b0", "ram_mb": 6, "bandwidth_mbps": 150, "backup": True},
        {"name": "b1", "ram_mb": 6, "bandwidth_mbps": 150, "backup": True, "join_round": 1},
    ]
    raw["ravnest"]["kill_at"] = [3, 6]
    cfg_path = tmp_path / "rv.yaml"
    cfg_path.write_text(json.dumps(raw))
    ref = reference
    out = tmp_path / "run"
    proc = subprocess.run(
        [sys.executable, "-m", "zeroth", "run", str(cfg_path), "--out", str(out)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    summary = json.loads((out / "summary.json").read_text())
    plan = ref["plan"]
    # b0 shadows the least reliable node (n1, 100 Mbit/s) from the start; b1 arrives at round 1 for the next (n2)
    assert summary["plan"]["backups"] == {"n1": "b0", "n2": "b1"} and sorted(summary["killed"]) == ["n1", "n2"]
    assert summary["nodes"]["b0"]["took_over"] and summary["nodes"]["b1"]["took_over"]
    for name in [
        n["name"] for n in raw["ravnest"]["nodes"]
    ]:  # every node writes the metrics schema, TensorBoard beside it
        rows = read_metrics(out / "nodes" / name / "metrics.jsonl")
        assert check_schema(rows, name) == len(rows) > 0 and {r["node"] for r in rows} == {name}
        assert list((out / "nodes" / name).glob("events.out.tfevents.*")), name
    merged = read_metrics(out / "metrics.jsonl")
    assert check_schema(merged) == len(merged) and list(out.glob("events.out.tfevents.*"))
    assert [r["time_unix_s"] for r in merged] == sorted(r["time_unix_s"] for r in merged)
    handover = [r for r in read_metrics(out / "nodes" / "n2" / "metrics.jsonl") if "handover_backup" in r]
    assert len(handover) == 1 and handover[0]["handover_round"] == 1 and handover[0]["handover_backup"] == "b1"
    assert handover[0]["average_round"] == 1 and handover[0]["state_bytes"] > 0
    last = {}  # the digest of each node's last row is its final slice's (the holders' rows run to step 8)
    for r in merged:
        last[r["node"]] = r
    for name, dig in ref["digests"].items():
        holder = {"n1": "b0", "n2": "b1"}.get(name, name)
        assert last[holder]["step"] == 8 and last[holder]["digest"] == ref["checksums"][name], name
    for name, dig in ref["digests"].items():
        holder = {"n1": "b0", "n2": "b1"}.get(name, name)
        assert summary["nodes"][holder]["digest"] == dig, name
    assert summary["clusters_agree"]
    assert all(n["messages_refused"] == 0 for n in summary["nodes"].values())
    run = load_run(out)  # the folder reads back: the first cluster's model from the nodes that ended holding it
    assert run.kind == "ravnest" and run.step == 8 and {r["kind"] for r in run.metrics} == {"train"}
    assert run.metrics.frame()["node"].nunique() == len(raw["ravnest"]["nodes"])
    np.testing.assert_array_equal(
        run.params, np.concatenate([ref["flat"][plan.primaries[(0, s)]] for s in range(len(plan.stages[0]))])
    )


A_KEY = identity.Identity.generate()  # node "a" of the two-node transport below


def _transport(tmp_path, token, sizes=None):
    slots = {"a": (0, 0), "b": (0, 1)}
    t = transport.ClusterTransport(
        "b",
        slots,
        {(0, 0): "a", (0, 1): "b"},
        {},
        run_id="run1",
        token=token,
        address_dir=tmp_path,
        bandwidth_mbps={"a": 100.0, "b": 100.0},
        timeout_s=5,
        keys={"a": A_KEY.public},
        sizes=sizes,
    )
    return t, t.serve("127.0.0.1:0")


def _from_a(kind, array, **kw):
    """A message node "a" signs for node "b" (slot (0, 1)) unless ``kw`` says otherwise."""
    return wire.sign(wire.to_message("run1", "a", kind, array, **{"to": (0, 1), **kw}), A_KEY)


def test_node_refuses_bad_messages_and_calls_without_the_token(tmp_path):
    token = identity.access_token(identity.new_secret())
    t, address = _transport(tmp_path, token)
    try:
        stub = pb_grpc.ClusterNodeStub(grpc.insecure_channel(address))
        good = _from_a("activation", np.ones((2, 3), np.float32), batch=0)
        md = security.token_metadata(token)
        assert stub.Deliver(iter([good]), metadata=md).received == 1
        np.testing.assert_array_equal(t.inbox.get("activation", 0, 1.0), np.ones((2, 3), np.float32))
        with pytest.raises(grpc.RpcError) as e:
            stub.Deliver(iter([good]))
        assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED
        bad = [
            (wire.to_message("other", "a", "activation", np.ones(2, np.float32), batch=1), "run_id 'other'"),
            (wire.to_message("run1", "mallory", "activation", np.ones(2, np.float32), batch=1), "sender 'mallory'"),
            (
                pb.Message(run_id="run1", sender="a", kind=pb.ACTIVATION, batch=1, shape=[4], data=b"\0" * 8),
                "data has 8 bytes",
            ),
            (wire.to_message("run1", "a", "ring", np.ones(2, np.float32), phase="steal"), "phase 'steal'"),
            # a holder of the token (not of a's key) speaking for a: unsigned, or signed with its own key
            (wire.to_message("run1", "a", "activation", np.ones(2, np.float32), batch=1, to=(0, 1)), "does not verify"),
            (
                wire.sign(
                    wire.to_message("run1", "a", "activation", np.ones(2, np.float32), batch=1, to=(0, 1)),
                    identity.Identity.generate(),
                ),
                "does not verify",
            ),
            # a's own signature on a message moved to another slot, or a field changed after signing
            (_from_a("activation", np.ones(2, np.float32), batch=1, to=(0, 0)), "to slot [0, 0]"),
            (_with(_from_a("activation", np.ones(2, np.float32), batch=1), batch=2), "does not verify"),
            (_from_a("gradient", np.ones(2, np.float32), batch=1), "gradients come from [0, 2]"),
            (wire.sign(wire.promote_message("run1", "a", (0, 0)), A_KEY), "to slot [0, 0]"),  # another node's slot
            (wire.sign(wire.state_message("run1", "a", b"x", (0, 1)), A_KEY), "not the primary"),
        ]
        for msg, reason in bad:
            with pytest.raises(grpc.RpcError) as e:
                stub.Deliver(iter([msg]), metadata=md)
            assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and reason in e.value.details()
        assert not t.inbox.has("activation", 1) and t.refused == len(bad) and not t.inbox.has("activation", 2)
        assert not t.shadow and t.promoted_at is None
        genuine = _from_a("activation", np.full(2, 7, np.float32), batch=1)  # refused copies were not "the first"
        assert stub.Deliver(iter([genuine]), metadata=md).received == 1
        np.testing.assert_array_equal(t.inbox.get("activation", 1, 1.0), np.full(2, 7, np.float32))
    finally:
        t.close(2)


def _with(msg, **fields):
    out = pb.Message()
    out.CopyFrom(msg)
    for k, v in fields.items():
        setattr(out, k, v)
    return out


def test_node_caps_messages_at_the_runs_largest_and_keys_are_learned_once(tmp_path):
    """With the run's sizes the server refuses a message above the largest one (a token holder's too)
    and an activation of another shape; a node's key is asked of it at its address and kept."""
    cfg = _cfg()
    plan = build.plan_of(cfg)
    sizes = build.sizes_of(cfg, plan)
    assert sizes.activation == (8, 32, 32) and sizes.message_bytes() < 4 << 20
    token = identity.access_token(identity.new_secret())
    t, address = _transport(tmp_path, token, sizes)
    try:
        md = security.token_metadata(token)
        stub = pb_grpc.ClusterNodeStub(grpc.insecure_channel(address))
        ok = _from_a("activation", np.ones(sizes.activation, np.float32), batch=0)
        assert stub.Deliver(iter([ok]), metadata=md).received == 1
        for msg, code, reason in [
            (
                _from_a("activation", np.ones(sizes.message_bytes() // 4 + 1, np.float32)),
                grpc.StatusCode.RESOURCE_EXHAUSTED,
                "",
            ),
            (
                _from_a("activation", np.ones((8, 32, 33), np.float32)),
                grpc.StatusCode.INVALID_ARGUMENT,
                "not the model's [8, 32, 32]",
            ),
            (
                _from_a("ring", np.ones(sizes.ring_values + 1, np.float32), phase="reduce"),
                grpc.StatusCode.INVALID_ARGUMENT,
                "more than a stage's slice",
            ),
        ]:
            with pytest.raises(grpc.RpcError) as e:
                stub.Deliver(iter([msg]), metadata=md, timeout=10)
            assert e.value.code() == code and reason in e.value.details()
        # another transport learns b's key by asking it, with b's proof of the secret checked
        secret = identity.new_secret()
        t2 = transport.ClusterTransport(
            "c",
            {"b": (0, 1), "c": (0, 0)},
            {(0, 0): "c", (0, 1): "b"},
            {},
            run_id="run1",
            token=token,
            address_dir=tmp_path,
            bandwidth_mbps={"b": 1.0, "c": 1.0},
            secret=secret,
        )
        with pytest.raises(ConnectionError, match="does not prove it holds the run secret"):
            t2.key_of("b", 5.0)  # b has no secret: no proof
        t2.secret = None
        assert t2.key_of("b", 5.0) == t.identity.public
        t2.keys["b"] = b"k" * 32  # the first key learned stays
        assert t2.key_of("b", 5.0) == b"k" * 32
    finally:
        t.close(2)


def test_a_dead_neighbour_without_backup_fails_the_waiting_node(tmp_path):
    t, _ = _transport(tmp_path, None)
    (tmp_path / "a").write_text("127.0.0.1:1\n")  # nothing listens there
    try:
        t.send("gradient", 0, np.ones(3, np.float32))
        with pytest.raises(ConnectionError, match="node 'a'.*no backup"):
            t.inbox.get("activation", 0, 10.0)
    finally:
        t.close(2)


@pytest.mark.parametrize(
    "change, message",
    [
        ({"nodes": [{"name": "a", "ram_mb": 4, "bandwidth_mbps": 10, "gpu": 1}]}, "unknown key 'gpu'"),
        ({"nodes": [{"name": "a", "ram_mb": 4}]}, "missing 'bandwidth_mbps'"),
        (
            {
                "nodes": [
                    {"name": "a", "ram_mb": 4, "bandwidth_mbps": 1},
                    {"name": "a", "ram_mb": 4, "bandwidth_mbps": 1},
                ]
            },
            "appears twice",
        ),
        ({"clusters": 5}, "5 clusters need at least 5 non-backup nodes"),
        ({"kill_at": [2]}, "1 kills but 0 backup nodes"),
        ({"order": "random"}, "ravnest.order"),
    ],
)
def test_ravnest_config_is_validated(change, message):
    with pytest.raises(ValueError, match=message):
        _cfg(**change)


def test_an_infeasible_pool_names_the_shortfall(tmp_path):
    tiny = [{"name": f"t{i}", "ram_mb": 0.1, "bandwidth_mbps": 10} for i in range(4)]
    with pytest.raises(ValueError, match="short"):
        build.plan_of(_cfg(nodes=tiny))
    from zeroth import run

    cfg_path = tmp_path / "c.yaml"
    raw = json.loads(json.dumps(BASE))
    raw["ravnest"]["nodes"] = tiny
    cfg_path.write_text(json.dumps(raw))
    assert run.main([str(cfg_path), "--out", str(tmp_path / "o"), "--quiet"]) == 2
    assert not (tmp_path / "o" / "nodes").exists()


def test_arrival_order_trains_within_the_staleness_bound():
    two = [{"name": "a", "ram_mb": 3, "bandwidth_mbps": 100}, {"name": "b", "ram_mb": 3, "bandwidth_mbps": 100}]
    cfg = _cfg(order="arrival", max_in_flight=2, average_every=0, clusters=1, nodes=two)
    out = sim.run_local(cfg, steps=4)
    assert len(out["plan"].stages[0]) == 2
    a, b = out["results"]["a"], out["results"]["b"]
    assert a["updates"] == b["updates"] == 4
    assert a["staleness_max"] <= 1 and b["staleness_max"] == 0  # w = min(2, S - s): the bound, whatever the timing


def test_inbox_drops_duplicates_and_bounds_waits():
    box = driver.Inbox()
    assert box.put("activation", 1, "x") and not box.put("activation", 1, "y")
    assert box.get("activation", 1, 0.1) == "x"
    assert not box.put("activation", 1, "z")  # consumed: a re-sent copy is dropped
    with pytest.raises(TimeoutError, match="no gradient for batch 2"):
        box.get("gradient", 2, 0.05)
    threading.Timer(0.05, box.fail, args=(ConnectionError("gone"),)).start()
    with pytest.raises(ConnectionError, match="gone"):
        box.get("gradient", 2, 5.0)


def test_a_primary_still_running_after_its_backup_finished_in_its_place_is_killed_and_the_run_ends(tmp_path):
    """A frozen primary (SIGSTOP: it never exits) whose backup finished holding its slot: once every
    other node has exited 0, the launcher kills it and the run ends with code 0 (it waited for the
    frozen process until its deadline and failed). A backup that did not take over leaves it running."""
    from zeroth.cluster import launch

    def nodes(name: str, took_over: bool, frozen: bool, also_running=()) -> tuple:
        """n1 (a primary, frozen or not) and ``also_running`` sleep; n0 and b0 (n1's backup) have exited 0."""
        out = tmp_path / name
        launch.node_dir(out, "b0").mkdir(parents=True)
        (launch.node_dir(out, "b0") / "summary.json").write_text(json.dumps({"node": "b0", "took_over": took_over}))
        procs = {n: subprocess.Popen([sys.executable, "-c", "pass"]) for n in ("n0", "b0")}
        procs |= {
            n: subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"]) for n in ("n1", *also_running)
        }
        if frozen:
            procs["n1"].send_signal(signal.SIGSTOP)
        return out, procs

    out, procs = nodes("frozen", took_over=True, frozen=True)
    code, killed = launch.wait_nodes(procs, out, {}, timeout_s=60, progress=False, backup_of={"n1": "b0"})
    assert (code, killed) == (0, ["n1"]) and procs["n1"].returncode == -signal.SIGKILL

    # The same beside a primary killed on cue (``kill_at``; no update needed here), whose code is -9.
    out, procs = nodes("with_a_kill", took_over=True, frozen=True, also_running=("n2",))
    code, killed = launch.wait_nodes(
        procs, out, {"n2": (0, False)}, timeout_s=60, progress=False, backup_of={"n1": "b0"}
    )
    assert (code, killed) == (0, ["n2", "n1"]) and procs["n1"].returncode == -signal.SIGKILL

    # Not frozen here, so that stopping it at the deadline is quick (SIGTERM).
    out, procs = nodes("not_taken_over", took_over=False, frozen=False)
    code, killed = launch.wait_nodes(procs, out, {}, timeout_s=1, progress=False, backup_of={"n1": "b0"})
    assert (code, killed) == (1, []) and procs["n1"].returncode is not None  # stopped at the deadline: a failure


def test_node_answers_its_neighbour_while_outsiders_hold_calls_and_send_oversized_messages(tmp_path):
    """40 calls without the token that never send a body, to an unknown method and to Deliver,
    are refused at once (a unary refusal would hold each in a node thread) and the neighbour's
    message is delivered promptly; four unauthenticated 64 MiB messages are refused unread."""
    import time

    from slowloris import Held, oversized_growth

    token = identity.access_token(identity.new_secret())
    t, address = _transport(tmp_path, token)
    try:
        with (
            Held(address, "/zeroth.v1.cluster.ClusterNode/Nothing", 40) as held,
            Held(address, "/zeroth.v1.cluster.ClusterNode/Deliver", 40) as streams,
        ):
            assert held.codes(timeout_s=5.0) == [grpc.StatusCode.UNAUTHENTICATED] * 40
            assert streams.codes(timeout_s=5.0) == [grpc.StatusCode.UNAUTHENTICATED] * 40
            t0 = time.perf_counter()
            with grpc.insecure_channel(address) as ch:
                good = _from_a("activation", np.ones((2, 3), np.float32), batch=0)
                ack = pb_grpc.ClusterNodeStub(ch).Deliver(
                    iter([good]), metadata=security.token_metadata(token), timeout=10
                )
            assert ack.received == 1 and time.perf_counter() - t0 < 2.0
        growth, codes = oversized_growth(address, "/zeroth.v1.cluster.ClusterNode/Deliver", 4, 64 << 20)
        assert codes == ["UNAUTHENTICATED"] * 4 and growth < 32 << 20, growth
    finally:
        t.close(2)


@pytest.fixture(scope="module")
def base_reference():
    """The in-process run of BASE (two clusters of two stages, 8 batches, fixed order)."""
    return sim.run_local(_cfg())


def _grpc_run(cfg, out, secret, attack=None):
    """Every node of ``cfg``'s pool as :func:`zeroth.cluster.node.run_node_process` in a thread of this
    process (real gRPC servers on loopback), ``attack(plan, out)`` run meanwhile; returns the summaries."""
    from zeroth.cluster import node as _node

    plan = build.plan_of(cfg)
    token = identity.access_token(secret)
    summaries, errors = {}, []

    def run(name):
        try:
            summaries[name] = _node.run_node_process(
                cfg, name, out / "nodes" / name, out / "addresses", "127.0.0.1:0", token, secret=secret
            )
        except BaseException as e:  # noqa: BLE001 - reported below
            errors.append((name, e))

    threads = [threading.Thread(target=run, args=(n["name"],), daemon=True) for n in plan.pool]
    for th in threads:
        th.start()
    attacked = attack(plan, out) if attack is not None else None
    for th in threads:
        th.join(120)
    assert not errors and not any(th.is_alive() for th in threads), errors
    return summaries, attacked


@pytest.fixture(scope="module")
def attacked_run(tmp_path_factory):
    """BASE's nodes as gRPC servers in threads while a holder of the run secret (no node's key) sends
    every stage forged activations and gradients (every batch, in the real sender's name) and forged
    ring chunks (every ring, both averaging rounds). Returns ``(cfg, out, secret, summaries, codes)``."""
    cfg = _cfg(timeout_s=60)
    out = tmp_path_factory.mktemp("attacked")
    secret = identity.new_secret()

    def attack(plan, out):
        md = security.token_metadata(identity.access_token(secret))
        return chaos.deliver(chaos.forged_messages(cfg, plan, (1, 2)), out, md, 30)

    summaries, codes = _grpc_run(cfg, out, secret, attack)
    return cfg, out, secret, summaries, codes


def test_a_token_holder_speaking_for_other_nodes_is_refused_and_the_run_is_the_clean_one(attacked_run, base_reference):
    """Every forged message is refused, the run finishes, and every node ends on the digest of the
    clean in-process run, bit for bit (the forgeries are sent from the moment the nodes serve)."""
    _, _, _, summaries, codes = attacked_run
    assert len(codes) > 40 and set(codes) == {"INVALID_ARGUMENT"}, codes
    assert sum(s["messages_refused"] for s in summaries.values()) == len(codes)
    assert {n: s["digest"] for n, s in summaries.items()} == base_reference["digests"]


def test_nodes_resumed_from_a_checkpoint_end_on_the_uninterrupted_digests(attacked_run, base_reference):
    """Every node checkpoints at each averaging round; the attacked run's nodes restarted from update
    4 (with new keys, the messages kept in the checkpoints sent again) end on the clean run's
    digests, and the rows after update 4 are written once."""
    from zeroth.cluster import checkpoint as _ckpt
    from zeroth.cluster import node as _node

    cfg, tmp_path, secret, _, _ = attacked_run
    assert _ckpt.steps(tmp_path / "nodes" / "n0" / "checkpoints") == [4, 8]
    plan = build.plan_of(cfg)
    token = identity.access_token(secret)
    for f in (tmp_path / "addresses").iterdir():
        f.unlink()
    summaries, errors = {}, []

    def run(name):
        try:
            summaries[name] = _node.run_node_process(
                cfg,
                name,
                tmp_path / "nodes" / name,
                tmp_path / "addresses",
                "127.0.0.1:0",
                token,
                secret=secret,
                resume_step=4,
            )
        except BaseException as e:  # noqa: BLE001 - reported below
            errors.append((name, e))

    threads = [threading.Thread(target=run, args=(n["name"],), daemon=True) for n in plan.pool]
    for th in threads:
        th.start()
    for th in threads:
        th.join(120)
    assert not errors, errors
    assert {n: s["digest"] for n, s in summaries.items()} == base_reference["digests"]
    assert all(s["updates"] == 4 for s in summaries.values())
    rows = read_metrics(tmp_path / "nodes" / "n1" / "metrics.jsonl")
    assert [r["step"] for r in rows] == list(range(1, 9)) and check_schema(rows, "n1") == 8


def test_a_damaged_checkpoint_is_named_in_one_line(tmp_path):
    from zeroth.cluster import checkpoint as _ckpt

    meta = {"run_id": "r", "node": "n0"}
    path = _ckpt.save(tmp_path, 4, {"a": np.arange(1000, dtype=np.float32)}, [((0, 1), b"msg")], meta)
    arrays, sent, got = _ckpt.load(tmp_path, 4, "r", "n0")
    assert (
        sent == [((0, 1), b"msg")]
        and got["step"] == 4
        and np.array_equal(arrays["a"], np.arange(1000, dtype=np.float32))
    )
    with pytest.raises(_ckpt.CheckpointError, match="of node 'n0' at update 4 of run 'r', not of node 'n1'"):
        _ckpt.load(tmp_path, 4, "r", "n1")
    data = bytearray(path.read_bytes())
    data[200] ^= 0xFF  # one byte inside the array
    path.write_bytes(bytes(data))
    with pytest.raises(_ckpt.CheckpointError) as e:
        _ckpt.load(tmp_path, 4, "r", "n0")
    assert str(path) in str(e.value) and "damaged" in str(e.value) and "\n" not in str(e.value)
    path.write_bytes(bytes(data[: len(data) // 2]))  # truncated
    with pytest.raises(_ckpt.CheckpointError, match="damaged"):
        _ckpt.load(tmp_path, 4, "r", "n0")
    assert _ckpt.common_step([tmp_path, tmp_path / "none"]) is None


def _node_pid(out, name):
    """The pid of the ``zeroth node`` process of node ``name`` writing into ``out`` (None if not running)."""
    from pathlib import Path

    for proc in Path("/proc").iterdir():
        try:
            cmd = (proc / "cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if b"zeroth.cluster.node" in cmd and name.encode() in cmd and str(out / "nodes" / name).encode() in cmd:
            return int(proc.name)
    return None


@pytest.mark.slow
@pytest.mark.e2e
def test_a_node_killed_without_a_backup_is_resumed_from_the_checkpoints(tmp_path, base_reference):
    """``zeroth run``: node n1 (no backup) is SIGKILLed once every node holds its checkpoint of update 4
    (the averaging round), before update 8; the run fails (rc 1);
    ``--resume`` restarts every node from update 4 and the run ends on the uninterrupted digests."""
    import time

    raw = json.loads(json.dumps(BASE))
    raw["ravnest"]["latency_ms"] = 40  # a few seconds of run: time to kill n1 between updates 5 and 8
    cfg_path = tmp_path / "rv.yaml"
    cfg_path.write_text(json.dumps(raw))
    out = tmp_path / "run"
    cmd = [sys.executable, "-m", "zeroth", "run", str(cfg_path), "--out", str(out)]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    from zeroth.cluster import checkpoint as _ckpt
    from zeroth.cluster import launch as _launch

    folders = [_ckpt.folder_of(_launch.node_dir(out, n)) for n in ("n0", "n1", "n2", "n3")]
    deadline = time.monotonic() + 240
    while time.monotonic() < deadline and proc.poll() is None:
        # every node past its averaging round of update 4 (its checkpoint written), however the load skews them
        if (_ckpt.common_step(folders) or 0) >= 4:
            pid = _node_pid(out, "n1")
            assert pid is not None
            import os

            os.kill(pid, signal.SIGKILL)
            break
        time.sleep(0.02)
    first, _ = proc.communicate(timeout=240)
    assert proc.returncode == 1 and "n1" in first, first[-2000:]
    assert f"checkpoint after update 4; continue with `zeroth run {cfg_path} --out {out} --resume`" in first, first[
        -2000:
    ]
    assert not (out / "summary.json").exists()
    again = subprocess.run(cmd + ["--resume"], capture_output=True, text=True, timeout=300)
    assert again.returncode == 0, again.stdout[-2000:] + again.stderr[-2000:]
    assert "from its checkpoint after update 4" in again.stdout
    summary = json.loads((out / "summary.json").read_text())
    assert {n: s["digest"] for n, s in summary["nodes"].items()} == base_reference["digests"]
    assert summary["clusters_agree"] and all(s["messages_refused"] == 0 for s in summary["nodes"].values())


def test_resume_names_what_is_missing(tmp_path):
    from zeroth.cluster import checkpoint as _ckpt
    from zeroth.cluster import launch

    plan = build.plan_of(_cfg())
    with pytest.raises(ValueError, match=r"no checkpoint update count common to every node .*n0: \[\]"):
        launch._resume_step(tmp_path, plan, ["--resume"])
    for name in ("n0", "n1", "n2", "n3"):
        for k in (4, 8) if name != "n2" else (4,):
            _ckpt.save(
                launch.node_dir(tmp_path, name) / "checkpoints", k, {}, [], {"run_id": plan.run_id, "node": name}
            )
    assert launch._resume_step(tmp_path, plan, ["--resume"]) == 4
    with pytest.raises(ValueError, match=r"--resume-step 8: nodes \['n2'\] hold no checkpoint"):
        launch._resume_step(tmp_path, plan, ["--resume", "--resume-step", "8"])
    late = build.plan_of(_config.load_config_dict(_with_late(BASE)))
    with pytest.raises(ValueError, match="joining later .* cannot resume yet"):
        launch._resume_step(tmp_path, late, ["--resume"])
