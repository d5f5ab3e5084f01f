"""The rendezvous of `zeroth launch`: its rules as a pure store (simulated time), its gRPC server with
the run's token and mutual TLS on 127.0.0.1, the host certificates, the launch plan of each config,
and the founders' start-up window in the peers' protocol."""

from __future__ import annotations

import secrets
import socket
import time

import grpc
import pytest

from zeroth import config as _config
from zeroth import launch
from zeroth.net import protocol as P
from zeroth.net.sim import SimNet
from zeroth.transport import certs, identity, security
from zeroth.transport import rendezvous as R
from zeroth.transport.proto import rendezvous_pb2 as pb
from zeroth.transport.proto import rendezvous_pb2_grpc as pb_grpc


def _store(**kw):
    base = dict(min_nodes=3, max_nodes=3, timeout_s=30.0, config_digest="d" * 64, version="1.0", last_call_s=5.0)
    base.update(kw)
    return R.Store(**base)


def _join(s, now, name, rank=-1, digest="d" * 64, version="1.0", port=7000):
    return s.join(
        now,
        config_digest=digest,
        version=version,
        advertise=f"10.0.0.{ord(name[-1]) % 200}:{port}",
        node_rank=rank,
        hostname=name,
        nonce=name.encode(),
    )


def test_hosts_get_ranks_in_arrival_order_and_the_run_forms_when_all_joined():
    s = _store()
    assert [_join(s, t, n) for t, n in [(0, "a"), (1, "b")]] == [(0, False), (1, False)]
    assert not s.roster(2).formed and s.roster(2).joined == 2
    assert _join(s, 3, "a") == (0, False)  # the same host asking again gets its rank back
    assert _join(s, 4, "c") == (2, False)
    r = s.roster(4)
    assert r.formed and r.nodes == 3 and [m.hostname for m in r.members] == ["a", "b", "c"]


def test_scheduler_ranks_are_kept_and_a_rank_taken_twice_is_refused():
    s = _store()
    assert _join(s, 0, "b", rank=2) == (2, False)
    with pytest.raises(R.Refused, match="node rank 2 is taken by host b; host x asked for it too") as e:
        _join(s, 1, "x", rank=2)
    assert e.value.code == "ALREADY_EXISTS"
    with pytest.raises(R.Refused, match="give --node-rank on every host or on none"):
        _join(s, 1, "y")
    with pytest.raises(R.Refused, match="node rank 3; the ranks are 0..2"):
        _join(s, 1, "z", rank=3)


def test_another_config_or_zeroth_is_refused_naming_both():
    s = _store()
    _join(s, 0, "a")
    with pytest.raises(
        R.Refused,
        match=r"host b runs a different config \(digest eeeeeeeeeeeeeeee\) than the run's "
        r"\(digest dddddddddddddddd\)",
    ):
        _join(s, 1, "b", digest="e" * 64)
    with pytest.raises(R.Refused, match="host c runs zeroth 2.0, the run zeroth 1.0"):
        _join(s, 1, "c", version="2.0")
    assert s.roster(1).joined == 1  # nothing of the refused hosts was kept


def test_a_run_short_of_its_minimum_fails_for_every_host_when_the_window_ends():
    s = _store(timeout_s=10.0)
    _join(s, 0, "a")
    _join(s, 4, "b")
    assert not s.roster(9.9).failed
    r = s.roster(10.1)
    assert not r.formed and r.failed.startswith(
        "only 2 of 3 hosts joined within the start-up window of 10s (joined: 0:a, 1:b)"
    )
    with pytest.raises(R.Refused, match="only 2 of 3"):  # a host arriving now reads the same reason
        _join(s, 11, "c")


def test_an_elastic_run_forms_after_the_last_call_and_takes_late_hosts_up_to_its_maximum():
    s = _store(min_nodes=2, max_nodes=3, late_joins=True)
    _join(s, 0, "a")
    _join(s, 1, "b")
    assert not s.roster(5.9).formed  # MIN joined: it waits last_call_s for more
    r = s.roster(6.1)
    assert r.formed and r.nodes == 2
    assert _join(s, 7, "c") == (2, True)
    r = s.roster(8)
    assert r.nodes == 2 and [m.hostname for m in r.members] == ["a", "b", "c"]
    with pytest.raises(R.Refused, match="the run has 3 hosts already") as e:
        _join(s, 9, "d")
    assert e.value.code == "RESOURCE_EXHAUSTED"
    fixed = _store(min_nodes=2, max_nodes=3)
    _join(fixed, 0, "a")
    _join(fixed, 1, "b")
    fixed.roster(7)
    with pytest.raises(R.Refused, match="takes no late host"):
        _join(fixed, 8, "c")


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_the_server_refuses_a_caller_without_the_token_and_forms_the_run_for_those_with_it():
    secret = identity.new_secret()
    token = identity.access_token(secret)
    address = f"127.0.0.1:{_port()}"
    server = R.serve(_store(min_nodes=2, max_nodes=2), address, token=token)
    assert server is not None and R.serve(_store(), address, token=token) is None  # the second launcher only calls
    try:
        with grpc.insecure_channel(address) as ch:
            with pytest.raises(grpc.RpcError) as e:
                pb_grpc.RendezvousStub(ch).Roster(pb.RosterQuery(), timeout=5)
            assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED
        clients = [R.Client(address, token=token) for _ in range(2)]
        deadline = time.monotonic() + 30
        ranks = [
            c.join(
                config_digest="d" * 64,
                version="1.0",
                advertise=f"10.0.0.{i + 1}:7000",
                node_rank=-1,
                hostname=f"h{i}",
                deadline=deadline,
            )[0]
            for i, c in enumerate(clients)
        ]
        assert ranks == [0, 1]
        roster = clients[1].wait_formed(deadline, poll_s=0.05)
        assert [m.advertise for m in roster.members] == ["10.0.0.1:7000", "10.0.0.2:7000"]
        with pytest.raises(R.Refused, match="runs a different config") as e:
            R.Client(address, token=token).join(
                config_digest="x", version="1.0", advertise="10.0.0.3:1", node_rank=-1, hostname="h3", deadline=deadline
            )
        assert e.value.code == "FAILED_PRECONDITION"
        for c in clients:
            c.close()
    finally:
        server.stop(0)


def test_the_roster_carries_each_stages_key_and_a_stage_is_told_its_upstreams(tmp_path):
    """Over gRPC: the public key each host joins with comes back in the roster; `zeroth launch`'s
    command for pipeline stage 1 names stage 0's key (--upstream-key) and its own key file; a key
    that is not 32 bytes is refused."""
    token = identity.access_token(identity.new_secret())
    address = f"127.0.0.1:{_port()}"
    server = R.serve(_store(min_nodes=2, max_nodes=2), address, token=token)
    keys = [identity.Identity.generate() for _ in range(2)]
    try:
        clients = [R.Client(address, token=token) for _ in range(2)]
        deadline = time.monotonic() + 30
        with pytest.raises(R.Refused, match="a key of 5 bytes") as e:
            clients[0].join(
                config_digest="d" * 64,
                version="1.0",
                advertise="10.0.0.9:7000",
                node_rank=-1,
                hostname="bad",
                deadline=deadline,
                key=b"short",
            )
        assert e.value.code == "INVALID_ARGUMENT"
        for i, c in enumerate(clients):
            c.join(
                config_digest="d" * 64,
                version="1.0",
                advertise=f"10.0.0.{i + 1}:7000",
                node_rank=i,
                hostname=f"h{i}",
                deadline=deadline,
                key=keys[i].public,
            )
        roster = clients[1].wait_formed(deadline, poll_s=0.05)
        assert [m.key for m in roster.members] == [k.public.hex() for k in keys]
        for c in clients:
            c.close()
    finally:
        server.stop(0)
    cfg = _config.load_config_dict(
        {
            "model": {"name": "transformer"},
            "train": {"method": "backprop"},
            "data": {"dataset": "sotu", "batch_size": 4},
            "pipeline": {"stages": 2},
        }
    )
    plan = launch.plan_of(cfg, None)
    key_file = keys[1].save(tmp_path / "identity.key")
    assert identity.Identity.load(key_file).public == keys[1].public and (key_file.stat().st_mode & 0o777) == 0o600
    _, cmd, _ = launch._role(
        plan, cfg, tmp_path / "c.yaml", tmp_path, 1, False, roster, 7000, "10.0.0.2", "s" * 64, None, 60.0, [], key_file
    )
    assert cmd[cmd.index("--upstream-key") + 1] == keys[0].public.hex()
    assert cmd[cmd.index("--identity") + 1] == str(key_file)
    (tmp_path / "bad.key").write_text("not a key\n")
    with pytest.raises(ValueError, match="does not hold an Ed25519 private key"):
        identity.Identity.load(tmp_path / "bad.key")


def test_a_rendezvous_nobody_serves_is_named_with_what_to_check():
    c = R.Client(f"127.0.0.1:{_port()}", token=None)
    with pytest.raises(R.Refused, match=r"cannot reach the rendezvous at 127\.0\.0\.1:\d+: UNAVAILABLE.*port is open"):
        c.join(
            config_digest="d",
            version="1",
            advertise="127.0.0.1:1",
            node_rank=-1,
            hostname="h",
            deadline=time.monotonic() + 1.0,
            poll_s=0.1,
        )
    c.close()


def test_mutual_tls_admits_a_host_certificate_and_refuses_a_caller_without_one(tmp_path):
    made = certs.make_host_certificates(tmp_path, ["127.0.0.1", "node-b"])
    assert oct((tmp_path / "ca.key").stat().st_mode & 0o777) == "0o600"
    assert oct((tmp_path / "node-b" / "key.pem").stat().st_mode & 0o777) == "0o600"
    again = certs.make_host_certificates(tmp_path, ["node-c"])  # the CA is reused: node-c is trusted as the others
    assert (tmp_path / "ca.pem").read_bytes() == open(again["node-c"].ca, "rb").read()
    tls = certs.host_tls(tmp_path, ["10.9.9.9", "127.0.0.1"])
    assert tls == made["127.0.0.1"] and tls.mutual
    address = f"127.0.0.1:{_port()}"
    server = R.serve(_store(min_nodes=1, max_nodes=1), address, token=None, tls=tls)
    try:
        c = R.Client(address, token=None, tls=tls)
        assert c.join(
            config_digest="d" * 64,
            version="1.0",
            advertise="127.0.0.1:7000",
            node_rank=-1,
            hostname="a",
            deadline=time.monotonic() + 20,
        ) == (0, False)
        c.close()
        server_only = security.TLSFiles(tls.cert, tls.key, tls.ca, mutual=False)  # trusts the CA, shows no certificate
        stranger = R.Client(address, token=None, tls=server_only)
        with pytest.raises(R.Refused, match="cannot reach the rendezvous"):
            stranger.roster(time.monotonic() + 2.0, poll_s=0.2)
        stranger.close()
    finally:
        server.stop(0)
    with pytest.raises(FileNotFoundError, match="no certificate for this host .* 'other'"):
        certs.host_tls(tmp_path, ["other"])
    with pytest.raises(ValueError, match="host '../x' is not a DNS name"):
        certs.make_host_certificates(tmp_path, ["../x"])


@pytest.mark.parametrize(
    "section, nnodes, message",
    [
        ("pipeline", "3", "the config's pipeline.stages is 2; give --nnodes 2"),
        ("pipeline", "1:2", "a pipeline run has a fixed number of hosts \\(2\\)"),
        ("peers", "4", "the config's peers.count is 3; give --nnodes 3, --set peers.count=4, or --nnodes MIN:MAX"),
        ("peers", "3:2", "need 1 <= MIN <= MAX"),
        ("peers", "x", "expected N or MIN:MAX"),
    ],
)
def test_launch_plans_refuse_a_host_count_the_config_cannot_run(section, nnodes, message):
    raw = (
        {"peers": {"count": 3}}
        if section == "peers"
        else {
            "train": {"method": "backprop"},
            "model": {"name": "transformer"},
            "data": {"dataset": "sotu", "batch_size": 4},
            "pipeline": {"stages": 2},
        }
    )
    cfg = _config.load_config_dict(raw)
    with pytest.raises(ValueError, match=message):
        launch.plan_of(cfg, nnodes)


def test_launch_plans_by_system_and_ranks_from_the_scheduler():
    peers = _config.load_config_dict({"peers": {"count": 3}})
    assert launch.plan_of(peers, None) == launch.Plan("peers", 3, 3, True)
    assert launch.plan_of(peers, "2:8") == launch.Plan("peers", 2, 8, True)
    assert launch.node_rank_from_env({"SLURM_PROCID": "4"}) == 4
    assert launch.node_rank_from_env({"JOB_COMPLETION_INDEX": "2"}) == 2
    assert launch.node_rank_from_env({}) is None
    with pytest.raises(ValueError, match="this config trains on one machine: use `zeroth run`"):
        launch.plan_of(_config.load_config_dict({}), None)


def _params(**kw):
    return P.Params(
        run_id="run",
        config_digest="cfg",
        bytes_per_value=1,
        max_count=4,
        iterations=5,
        iteration_timeout_s=1.0,
        barrier_timeout_s=0.5,
        founders=3,
        forming_timeout_s=2.0,
        **kw,
    )


@pytest.mark.parametrize("strict", [True, False])
def test_founders_missing_at_the_end_of_the_window_fail_the_run_when_required(strict):
    net = SimNet(_params(require_founders=strict))
    net.start(2)  # one of the three founders never comes
    founder = net.peers["sim:1000"]
    assert net.run_until(lambda: founder.finished is not None, limit=30.0)
    if strict:
        assert founder.finished == "failed"
        assert "only 2 of 3 founders joined within the start-up window of 2s" in founder.events[-1][1]
    else:
        assert founder.finished == "done"


def test_a_launch_secret_comes_from_its_file_the_environment_or_is_refused(tmp_path, monkeypatch):
    monkeypatch.delenv("ZEROTH_SECRET", raising=False)
    monkeypatch.delenv("ZEROTH_TOKEN", raising=False)
    args = launch.build_parser().parse_args(["c.yaml", "--rendezvous", "h:1", "--out", "o"])
    with pytest.raises(ValueError, match="every host needs the same run secret: --secret-file FILE"):
        launch._secret(args)
    value = secrets.token_hex(32)
    monkeypatch.setenv("ZEROTH_SECRET", value)
    assert launch._secret(args) == value
    insecure = launch.build_parser().parse_args(["c.yaml", "--rendezvous", "h:1", "--out", "o", "--insecure"])
    assert launch._secret(insecure) is None


def test_a_launcher_killed_by_its_scheduler_takes_its_process_with_it():
    import os
    import subprocess
    import sys

    code = (
        "import os, sys; from zeroth import launch; "
        "sys.exit(launch._run([sys.executable, '-c', 'import time; time.sleep(60)'], dict(os.environ)))"
    )
    launcher = subprocess.Popen([sys.executable, "-c", code])
    child = None
    deadline = time.monotonic() + 30
    while child is None and time.monotonic() < deadline:
        kids = subprocess.run(["pgrep", "-P", str(launcher.pid)], capture_output=True, text=True).stdout.split()
        child = int(kids[0]) if kids else None
        time.sleep(0.1)
    assert child is not None
    launcher.kill()
    launcher.wait()

    def running(pid):
        try:
            with open(f"/proc/{pid}/stat") as fh:
                return fh.read().split()[2] != "Z"
        except FileNotFoundError:
            return False

    deadline = time.monotonic() + 10
    while running(child) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not running(child), "the launcher's process outlived it"
    if running(child):
        os.kill(child, 9)


def test_checked_in_stubs_are_what_protoc_generates(tmp_path):
    pytest.importorskip("grpc_tools", reason="grpcio-tools (dev extra) regenerates the stubs")
    from zeroth import protogen

    written = protogen.generate("rendezvous", tmp_path)
    assert {p.name for p in written} == {"rendezvous_pb2.py", "rendezvous_pb2_grpc.py"}
    for p in written:
        assert (protogen.stub_dir("rendezvous") / p.name).read_text() == p.read_text(), (
            "run `python -m zeroth.protogen rendezvous`"
        )
