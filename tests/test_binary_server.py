"""Sparse-mutation parameter server: the pure protocol, the gRPC stubs, and server + workers on 127.0.0.1."""

import filecmp

import grpc
import numpy as np
import pytest
from numpy.testing import assert_array_equal

import jax.numpy as jnp

from zeroth.binary import flips as F
from zeroth.binary import launch
from zeroth.binary import layers as L
from zeroth import protogen
from zeroth.binary import protocol as P
from zeroth.binary import service as S
from zeroth.binary import worker as W
from zeroth.binary.proto import binary_pb2 as pb
from zeroth.binary.proto import binary_pb2_grpc as pbg
from zeroth.transport import identity, security

CFG = P.ServerConfig(
    run_id="run", c_in=3, c_out=2, ternary=True, k=2, rounds=3, max_entries=10, round_timeout_s=5.0, founders=2
)


def _model(seed=0):
    rng = np.random.default_rng(seed)
    return rng.integers(-1, 2, (CFG.c_out, 9 * CFG.c_in)).astype(np.int8), rng.integers(-5, 5, CFG.c_out).astype(
        np.int32
    )


KEYS = [identity.Identity.generate() for _ in range(4)]  # worker i's key pair (i joins with KEYS[i])


def _two_workers(cfg=CFG):
    w, t = _model()
    st = P.init_state(cfg, w, t)
    st, a = P.join(st, cfg, "run", KEYS[0].public, now=0.0)
    st, b = P.join(st, cfg, "run", KEYS[1].public, now=0.0)
    return st, a, b


def _list(st, wid, index, delta, signer=None, **kw):
    """Worker ``wid``'s list for the open round, signed by ``signer`` (default: its own key)."""
    fields = dict(run_id="run", worker_id=wid, round=st.round, index=index, delta=delta, checksum=st.checksum)
    fields.update(kw)
    fields["index"], fields["delta"] = np.asarray(fields["index"], np.int64), np.asarray(fields["delta"], np.float32)
    msg = P.DeltaList(**fields)
    return msg._replace(signature=(signer or KEYS[wid % len(KEYS)]).sign(P.submission_bytes(msg)))


def _result(st, wid, rnd, cfg=CFG, seq=1, signer=None, now=0.0):
    sig = (signer or KEYS[wid]).sign(P.result_request_bytes("run", wid, rnd, seq))
    return P.result(st, cfg, "run", wid, rnd, seq, sig, now=now)


def _join_pb(ident, secret=None, run_id="run"):
    proof = identity.join_proof(secret, run_id, S.JOIN_ADDRESS, ident.public) if secret else b""
    return pb.JoinRequest(run_id=run_id, key=ident.public, proof=proof)


def _submit_pb(ident, wid, rnd, checksum, index=(), delta=(), run_id="run"):
    msg = P.DeltaList(run_id, wid, rnd, np.asarray(index, np.int64), np.asarray(delta, np.float32), checksum)
    return S.encode_deltas(msg._replace(signature=ident.sign(P.submission_bytes(msg))))


def _result_pb(ident, wid, rnd, seq, run_id="run"):
    return pb.ResultRequest(
        run_id=run_id,
        worker_id=wid,
        round=rnd,
        seq=seq,
        signature=ident.sign(P.result_request_bytes(run_id, wid, rnd, seq)),
    )


def test_checked_in_stubs_equal_freshly_generated_ones(tmp_path):
    pytest.importorskip("grpc_tools", reason="grpcio-tools (dev extra) regenerates the stubs")
    written = protogen.generate("binary", tmp_path)
    assert {p.name for p in written} == {"binary_pb2.py", "binary_pb2_grpc.py"}
    for p in written:
        checked_in = protogen.stub_dir("binary") / p.name
        assert filecmp.cmp(p, checked_in, shallow=False), (
            f"{checked_in} is stale: run `python -m zeroth.protogen binary` after editing protos/zeroth/v1/binary.proto"
        )
    assert (
        "from zeroth.binary.proto import binary_pb2" in (protogen.stub_dir("binary") / "binary_pb2_grpc.py").read_text()
    )


def test_packed_model_round_trips_and_checksum_matches_the_layer():
    w, t = _model(3)
    data = P.model_bytes(w, t, CFG.c_in, True)
    w2, t2, h2 = P.model_from_bytes(data, CFG.c_in, CFG.c_out, True)
    assert_array_equal(w2, w)
    assert_array_equal(t2, t)
    assert h2 is None
    head = (np.arange(2 * CFG.c_out * 3, dtype=np.float32).reshape(2, CFG.c_out, 3), np.ones(3, np.float32))
    w3, t3, h3 = P.model_from_bytes(
        P.model_bytes(w, t, CFG.c_in, True, head), CFG.c_in, CFG.c_out, True, regions=2, classes=3
    )
    assert_array_equal(w3, w)
    assert_array_equal(t3, t)
    assert_array_equal(h3[0], head[0])
    assert_array_equal(h3[1], head[1])
    assert P.checksum(w, t, CFG.c_in, True, head) != P.checksum(w, t, CFG.c_in, True)
    spec = L.ConvSpec(c_in=CFG.c_in, c_out=CFG.c_out, ternary=True)
    assert P.checksum(w, t, CFG.c_in, True) == L.layer_checksum(L.ConvLayer(jnp.asarray(w), jnp.asarray(t)), spec)
    with pytest.raises(ValueError, match="has 3 bytes"):
        P.model_from_bytes(b"abc", CFG.c_in, CFG.c_out, True)


def test_round_sums_lists_drops_limits_and_applies_top_k():
    st, a, b = _two_workers()
    w0 = st.w.copy()
    flat = w0.reshape(-1)
    up = next(i for i in range(flat.size) if flat[i] == 1)  # +1 weight: moving up is at its limit
    free = next(i for i in range(flat.size) if flat[i] == 0)
    other = next(i for i in range(flat.size) if flat[i] == -1)
    st = P.submit(
        st, CFG, _list(st, 0, sorted([2 * up + 1, 2 * free + 1]), [-9.0, -1.0] if up < free else [-1.0, -9.0]), now=1.0
    )
    assert st.round == 0  # waits for worker 1
    st = P.submit(
        st, CFG, _list(st, 1, sorted([2 * free + 1, 2 * other]), [-1.5, 3.0] if free < other else [3.0, -1.5]), now=1.5
    )
    assert st.round == 1
    res = st.results[0]
    assert res.mutations == (2 * free + 1,)  # the at-limit one dropped; the only negative total: -2.5
    assert res.contributors == (0, 1) and res.dropped == ()
    assert_array_equal(st.w, F.apply_mutations_np(w0, [2 * free + 1], True))
    assert res.checksum == P.checksum(st.w, st.thresh, CFG.c_in, True)


@pytest.mark.parametrize(
    "change,code,match",
    [
        (dict(run_id="other"), "FAILED_PRECONDITION", "the request's run id is not this server's run"),
        (dict(round=7), "FAILED_PRECONDITION", "list for round 7 but the open round is 0"),
        (dict(worker_id=9), "FAILED_PRECONDITION", "worker 9 never joined"),
        (dict(checksum="0" * 64), "FAILED_PRECONDITION", "differs from the server's"),
        (
            dict(index=np.array([3, 1000]), delta=np.array([1.0, 2.0], np.float32)),
            "INVALID_ARGUMENT",
            "mutation index 1000 out of range \\[0, 108\\)",
        ),
        (dict(index=np.array([-1]), delta=np.array([1.0], np.float32)), "INVALID_ARGUMENT", "mutation index -1"),
        (
            dict(index=np.array([1, 2]), delta=np.array([1.0, np.nan], np.float32)),
            "INVALID_ARGUMENT",
            "delta nan at entry 1 is not finite",
        ),
        (
            dict(index=np.arange(11), delta=np.ones(11, np.float32)),
            "INVALID_ARGUMENT",
            "11 entries is oversized: at most 10",
        ),
        (dict(index=np.array([2, 2]), delta=np.ones(2, np.float32)), "INVALID_ARGUMENT", "strictly increasing"),
        (dict(index=np.array([2]), delta=np.ones(2, np.float32)), "INVALID_ARGUMENT", "1 indices but 2 deltas"),
    ],
)
def test_malformed_lists_are_rejected_with_the_problem_named(change, code, match):
    st, _, _ = _two_workers()
    with pytest.raises(P.Rejected, match=match) as e:
        P.submit(st, CFG, _list(st, 0, **{"index": [1], "delta": [1.0], **change}), now=0.0)
    assert e.value.code == code


def test_deadline_drops_a_silent_worker_and_a_joiner_waits_for_the_next_round():
    st, _, _ = _two_workers()
    st = P.submit(st, CFG, _list(st, 0, [], []), now=10.0)
    st, late = P.join(st, CFG, "run", KEYS[2].public, now=11.0)  # a list is in: the joiner takes part from round 1
    assert late.round == 1
    with pytest.raises(P.Rejected, match="takes part from round 1; round 0 is still open"):
        P.submit(st, CFG, _list(st, late.worker_id, [], []), now=11.0)
    st = P.tick(st, CFG, now=14.9)
    assert st.round == 0
    st, res = _result(st, 0, 0, now=15.0)  # deadline: 5 s after the first list
    assert res.ready and res.dropped == (1,) and res.contributors == (0,)
    assert st.live == (0, late.worker_id)
    with pytest.raises(P.Rejected, match="worker 1 was dropped"):
        P.submit(st, CFG, _list(st, 1, [], []), now=15.0)


def test_a_list_or_request_in_another_workers_name_is_refused_and_changes_nothing():
    st, a, b = _two_workers()
    forged = _list(st, 0, [1], [-5.0], signer=KEYS[3])  # signed by a key other than worker 0's
    with pytest.raises(P.Rejected, match="list in worker 0's name is not signed by the key it committed") as e:
        P.submit(st, CFG, forged, now=0.0)
    assert e.value.code == "PERMISSION_DENIED"
    with pytest.raises(P.Rejected, match="not signed"):  # worker 1 signing a list in worker 0's name
        P.submit(st, CFG, _list(st, 0, [1], [-5.0], signer=KEYS[1]), now=0.0)
    with pytest.raises(P.Rejected, match="not signed"):  # a signed list altered in flight
        P.submit(st, CFG, _list(st, 0, [1], [-5.0])._replace(delta=np.array([-6.0], np.float32)), now=0.0)
    with pytest.raises(P.Rejected, match="result request in worker 1's name is not signed"):
        _result(st, 1, 0, signer=KEYS[0])
    with pytest.raises(P.Rejected, match="rejoin in worker 1's name is not signed"):
        P.rejoin(st, CFG, "run", 1, 5, KEYS[0].sign(P.rejoin_bytes("run", 1, 5)), now=0.0)
    with pytest.raises(P.Rejected, match="committed to worker 0") as e:  # a second seat for one key
        P.join(st, CFG, "run", KEYS[0].public, now=0.0)
    assert e.value.code == "ALREADY_EXISTS"
    # the real workers' lists still count: the round closes with both, worker 0's mutation applied
    free = 2 * int(np.flatnonzero(st.w.reshape(-1) == 0)[0]) + 1
    st = P.submit(st, CFG, _list(st, 0, [free], [-5.0]), now=1.0)
    st = P.submit(st, CFG, _list(st, 1, [], []), now=1.0)
    assert st.round == 1 and st.results[0].contributors == (0, 1) and st.results[0].mutations == (free,)


def test_a_dropped_worker_rejoins_with_its_id_and_min_workers_holds_a_round_open():
    cfg = CFG._replace(min_workers=2, rounds=5)
    st, a, b = _two_workers(cfg)
    st = P.submit(st, cfg, _list(st, 0, [], []), now=10.0)
    st = P.tick(st, cfg, now=60.0)  # past the deadline with one list: fewer than min_workers, the round stays open
    assert st.round == 0 and st.live == (0, 1)
    st = P.submit(st, cfg, _list(st, 1, [], []), now=61.0)
    assert st.round == 1
    st = P.submit(st, cfg, _list(st, 0, [], []), now=62.0)
    st, c = P.join(st, cfg, "run", KEYS[2].public, now=62.5)  # a third worker, from round 2
    assert c.round == 2
    st = P.submit(st, cfg, _list(st, 1, [], []), now=63.0)  # complete: both live workers submitted
    st = P.submit(st, cfg, _list(st, 0, [], []), now=64.0)
    st = P.submit(st, cfg, _list(st, 2, [], []), now=64.0)
    st = P.tick(st, cfg, now=70.0)  # worker 1 silent past the deadline: dropped, two lists are enough
    assert st.round == 3 and st.results[2].dropped == (1,) and st.live == (0, 2)
    with pytest.raises(P.Rejected, match="worker 1 was dropped from the run"):
        P.submit(st, cfg, _list(st, 1, [], [], round=3), now=70.5)
    st, back = P.rejoin(st, cfg, "run", 1, 7, KEYS[1].sign(P.rejoin_bytes("run", 1, 7)), now=71.0)
    assert (back.worker_id, back.round, back.model_round, back.checksum) == (1, 3, 3, st.checksum)
    assert st.live == (0, 2, 1)  # no list in yet for round 3: it takes part at once, with its shard (its id)
    for wid in (0, 2, 1):
        st = P.submit(st, cfg, _list(st, wid, [], []), now=72.0)
    assert st.results[3].contributors == (0, 1, 2)


def test_grpc_service_aborts_with_status_codes():
    w, t = _model()
    srv = S.Server(CFG, w, t)
    port = srv.start("127.0.0.1:0")
    try:
        with grpc.insecure_channel(f"127.0.0.1:{port}") as ch:
            stub = pbg.BinaryMutationsStub(ch)
            rep = stub.Join(_join_pb(KEYS[0]), timeout=10)
            assert P.model_from_bytes(rep.model, CFG.c_in, CFG.c_out, True)[0].tolist() == w.tolist()
            bad = _submit_pb(KEYS[0], rep.worker_id, 0, rep.checksum, [5], [float("nan")])
            with pytest.raises(grpc.RpcError) as e:
                stub.Submit(bad, timeout=10)
            assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "not finite" in e.value.details()
            for call in (
                lambda: stub.Join(_join_pb(KEYS[1], run_id="nope"), timeout=10),
                lambda: stub.Submit(_submit_pb(KEYS[0], 0, 0, rep.checksum, run_id="nope"), timeout=10),
                lambda: stub.Result(_result_pb(KEYS[0], 0, 0, 1, run_id="nope"), timeout=10),
            ):
                with pytest.raises(grpc.RpcError) as e:
                    call()
                assert e.value.code() == grpc.StatusCode.FAILED_PRECONDITION and "run id" in e.value.details()
                assert "nope" not in e.value.details() and "'run'" not in e.value.details()  # no run id is told
    finally:
        srv.stop()


def test_a_token_holder_cannot_join_without_the_secret_or_submit_in_a_real_workers_name():
    """Over gRPC with the run's token and secret: a caller holding the token but no proof of the
    secret gets no seat; a secret holder forging a list in worker 0's name is refused, and worker
    0's own list still counts; a result request replayed is refused."""
    secret = identity.new_secret()
    md = security.token_metadata(identity.access_token(secret))
    w, t = _model()
    srv = S.Server(CFG, w, t, token=identity.access_token(secret), secret=secret)
    address = f"127.0.0.1:{srv.start('127.0.0.1:0')}"
    try:
        with grpc.insecure_channel(address) as ch:
            stub = pbg.BinaryMutationsStub(ch)
            for bad in (
                _join_pb(KEYS[3]),
                _join_pb(KEYS[3], secret=identity.new_secret()),
                pb.JoinRequest(
                    run_id="run",
                    key=KEYS[3].public,
                    proof=identity.join_proof(secret, "run", S.JOIN_ADDRESS, KEYS[2].public),
                ),
            ):
                with pytest.raises(grpc.RpcError) as e:
                    stub.Join(bad, metadata=md, timeout=10)
                assert (
                    e.value.code() == grpc.StatusCode.PERMISSION_DENIED
                    and "proof of the run secret" in e.value.details()
                )
            assert srv.snapshot().next_id == 0
            a = stub.Join(_join_pb(KEYS[0], secret), metadata=md, timeout=10)
            b = stub.Join(_join_pb(KEYS[1], secret), metadata=md, timeout=10)
            forger = identity.Identity.generate()  # holds the secret, speaks for worker 0
            for msg in (
                _submit_pb(forger, a.worker_id, 0, a.checksum, [3], [-9.0]),
                _submit_pb(KEYS[b.worker_id], a.worker_id, 0, a.checksum, [3], [-9.0]),
            ):
                with pytest.raises(grpc.RpcError) as e:
                    stub.Submit(msg, metadata=md, timeout=10)
                assert e.value.code() == grpc.StatusCode.PERMISSION_DENIED and "worker 0's name" in e.value.details()
            assert srv.snapshot().pending == {}
            stub.Submit(_submit_pb(KEYS[0], a.worker_id, 0, a.checksum, [5], [-1.0]), metadata=md, timeout=10)
            stub.Submit(_submit_pb(KEYS[1], b.worker_id, 0, b.checksum), metadata=md, timeout=10)
            req = _result_pb(KEYS[0], a.worker_id, 0, seq=11)
            res = stub.Result(req, metadata=md, timeout=10)
            assert res.ready and list(res.contributors) == [0, 1] and list(res.mutations) == [5]
            with pytest.raises(grpc.RpcError) as e:
                stub.Result(req, metadata=md, timeout=10)
            assert e.value.code() == grpc.StatusCode.PERMISSION_DENIED and "seen before" in e.value.details()
    finally:
        srv.stop()


def test_server_answers_while_calls_that_never_send_their_body_are_held():
    """12 calls that never send their body (more than the server used to have threads) hold no
    thread the real workers need: a Join is answered at once, and the held calls are cancelled
    after the server's wait for a body; an oversized list is refused (the server receives lists
    of at most max_entries)."""
    from slowloris import Held, timed

    w, t = _model()
    srv = S.Server(CFG, w, t)
    port = srv.start("127.0.0.1:0")
    address = f"127.0.0.1:{port}"
    try:
        with Held(address, "/zeroth.v1.binary.BinaryMutations/Submit", 12) as held:
            with grpc.insecure_channel(address) as ch:
                seconds, rep = timed(lambda: pbg.BinaryMutationsStub(ch).Join(_join_pb(KEYS[0]), timeout=10))
                assert rep.worker_id == 0 and seconds < 2.0
                big = pb.DeltaList(run_id="run", worker_id=0, round=0, index=list(range(20000)), delta=[1.0] * 20000)
                with pytest.raises(grpc.RpcError) as e:
                    pbg.BinaryMutationsStub(ch).Submit(big, timeout=10)
                assert e.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            codes = held.codes(timeout_s=S.limits(CFG).body_s + 5)
        assert codes == [grpc.StatusCode.CANCELLED] * 12
    finally:
        srv.stop()


def test_a_server_with_the_run_token_refuses_every_call_without_it_at_once():
    """An outsider gets nothing: no model, no result, no seat, no run id; its calls that never send
    a body are refused at once, and the worker holding the token is answered promptly."""
    from slowloris import Held, timed

    token = identity.access_token(identity.new_secret())
    w, t = _model()
    srv = S.Server(CFG, w, t, token=token)
    address = f"127.0.0.1:{srv.start('127.0.0.1:0')}"
    try:
        with grpc.insecure_channel(address) as ch:
            stub = pbg.BinaryMutationsStub(ch)
            for md in (None, security.token_metadata(identity.access_token(identity.new_secret()))):
                calls = [
                    lambda md=md: stub.Join(pb.JoinRequest(run_id="run"), metadata=md, timeout=10),
                    lambda md=md: stub.Result(
                        pb.ResultRequest(run_id="run", worker_id=0, round=0), metadata=md, timeout=10
                    ),
                    lambda md=md: stub.Submit(
                        pb.DeltaList(run_id="run", worker_id=0, round=0), metadata=md, timeout=10
                    ),
                ]
                for call in calls:
                    with pytest.raises(grpc.RpcError) as e:
                        call()
                    assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED
                    assert "'run'" not in e.value.details()
            assert srv.snapshot().next_id == 0  # no seat was taken
            with Held(address, "/zeroth.v1.binary.BinaryMutations/Submit", 40) as held:
                assert held.codes(timeout_s=5.0) == [grpc.StatusCode.UNAUTHENTICATED] * 40
                seconds, rep = timed(
                    lambda: stub.Join(_join_pb(KEYS[0]), metadata=security.token_metadata(token), timeout=10)
                )
            assert rep.worker_id == 0 and seconds < 2.0
    finally:
        srv.stop()


def test_on_round_runs_as_each_round_opens_before_any_reply_tells_of_it():
    w, t = _model()
    opened = []
    srv = S.Server(CFG, w, t, on_round=lambda r: opened.append((r, srv.state.round, sorted(srv.state.results))))
    port = srv.start("127.0.0.1:0")
    try:
        with grpc.insecure_channel(f"127.0.0.1:{port}") as ch:
            stub = pbg.BinaryMutationsStub(ch)
            a, b = (stub.Join(_join_pb(KEYS[i]), timeout=10) for i in range(2))
            for rnd in range(2):
                for rep in (a, b):
                    chk = P.checksum(srv.state.w, srv.state.thresh, CFG.c_in, True)
                    stub.Submit(_submit_pb(KEYS[rep.worker_id], rep.worker_id, rnd, chk), timeout=10)
                    if rep is a:  # one of two lists in: the round is still open
                        assert opened == [(r, r, list(range(r))) for r in range(1, rnd + 1)]
                with pytest.raises(grpc.RpcError):  # rejected (a second list for the closed round): no round opens
                    stub.Submit(_submit_pb(KEYS[a.worker_id], a.worker_id, rnd, chk), timeout=10)
                assert opened == [(r, r, list(range(r))) for r in range(1, rnd + 2)]
    finally:
        srv.stop()


def _replayed_checksum(cfg, contributors):
    """The final checksum of a run whose round r applied the lists of ``contributors[r]``, each
    computed here as a worker process computes it (its batch is a function of seed, id and round)."""
    init = launch.initial_model(cfg)
    x, y = W.load_split(cfg, "train")
    spec, (votes_head, reg) = W.model_spec(cfg), W.votes(cfg, x.shape[1], x.shape[2])
    head = votes_head if init.head is None else L.Head(jnp.asarray(init.head[0]), jnp.asarray(init.head[1]))
    scfg = init.server_config._replace(round_timeout_s=1e9)
    st = P.init_state(scfg, init.w, init.thresh, head=init.head)
    keys = {}
    for wid in sorted({w for c in contributors for w in c}):
        keys[wid] = identity.Identity.generate()
        st = st._replace(next_id=wid + 1, keys={**st.keys, wid: keys[wid].public})
    for rnd, who in enumerate(contributors):
        st = st._replace(live=tuple(who))
        for wid in who:
            shard = np.flatnonzero(np.arange(len(y)) % cfg.shards == wid % cfg.shards)
            idx = np.random.default_rng([cfg.seed, wid, rnd]).choice(
                shard, size=min(cfg.batch_size, shard.size), replace=False
            )
            layer = L.ConvLayer(jnp.asarray(st.w), jnp.asarray(st.thresh))
            d = F.mutation_deltas(layer, head, jnp.asarray(x[idx]), jnp.asarray(y[idx]), spec, reg)
            index, delta = W.sparse_list(d, cfg.threshold, cfg.max_entries)
            msg = P.DeltaList(cfg.run_id, wid, rnd, index, delta, st.checksum, len(idx))
            st = P.submit(st, scfg, msg._replace(signature=keys[wid].sign(P.submission_bytes(msg))), now=0.0)
        assert st.round == rnd + 1
    return st.checksum


@pytest.mark.slow
@pytest.mark.e2e
def test_server_and_worker_processes_survive_a_kill_a_pause_and_a_join(tmp_path):
    """A worker SIGKILLed as round 2 opens and one SIGSTOPped as round 4 opens (SIGCONT once that
    round closed without it) do not end the run: it finishes every round, the paused worker is
    dropped and rejoins with its id, and the final model is exactly the one the real workers'
    lists of each round give (recomputed here from who contributed to each round)."""
    cfg = W.DistConfig(
        run_id="e2e",
        dataset="digits",
        train_size=300,
        test_size=100,
        c_out=10,
        rounds=12,
        batch_size=16,
        threshold=0.05,
        k=3,
        round_timeout_s=2.0,
        founders=3,
        min_workers=2,
        head="trained",
        head_steps=5,
    )
    s = launch.run(cfg, workers=3, kill_at=(2,), join_at=(1,), pause_at=(4,), out_dir=tmp_path, timeout_s=240)
    # every worker compared its checksum after each round it took part in (the killed one perhaps not its last)
    assert s["checksum_mismatches"] == 0 and s["checksum_comparisons"] >= sum(s["contributors_per_round"]) - 1
    assert s["killed_at_round"] == [2] and s["paused_at_round"] == [4]  # as those rounds opened
    assert s["lost"] == {str(s["killed"][0]): -9}  # only the killed process; the launcher carried on
    assert s["rejoins"] >= 1  # the paused worker took its id back
    assert s["contributors_per_round"][0] == 3 and len(s["contributors"]) == 12
    killed_wid = next(w for w in s["contributors"][0] + s["contributors"][1] if w not in sum(s["contributors"][2:], []))
    paused_wid = next(w for w in s["contributors"][3] if w not in s["contributors"][4])
    assert paused_wid != killed_wid and any(paused_wid in c for c in s["contributors"][5:])  # back after its pause
    assert all(f <= 3 for f in s["flips_per_round"]) and sum(s["flips_per_round"]) > 0
    assert s["dense_float32_bytes_per_round_per_worker"] == 4 * 10 * 9 * 4
    assert _replayed_checksum(cfg, s["contributors"]) == s["final_checksum"]


def test_sparse_list_thresholds_and_keeps_the_most_negative_under_the_cap():
    d = np.array([[[0.5, np.inf], [-0.01, -3.0]], [[9.0, -1.0], [np.inf, 0.2]]], np.float32)
    idx, val = W.sparse_list(d, 0.1, 10)
    assert idx.tolist() == [0, 3, 4, 5, 7] and val.tolist() == [0.5, -3.0, 9.0, -1.0, pytest.approx(0.2)]
    idx, val = W.sparse_list(d, 0.1, 2)
    assert idx.tolist() == [3, 5] and val.tolist() == [-3.0, -1.0]
