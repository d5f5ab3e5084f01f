"""`zeroth launch` across hosts: network namespaces joined by a bridge stand for hosts, each with its
own address, and every host runs the same command (no loopback shortcut between them).

* Just One Byte: three hosts end on one digest, the digest the same run ends on over loopback;
  a host whose link is cut for seconds stays in the run, a host whose peer is killed leaves it,
  and the folders collected from every host verify as one run;
* an AQ-SGD pipeline of two hosts (mutual TLS, 100 Mbit/s links) ends on the parameters and
  buffers of the same engines run in one process;
* 2 replicas × 2 stages of an AQ-SGD pipeline on four hosts, their averaging QuantizedAdam between
  hosts over signed streams, end on the in-process run's parameters;
* Ravnest nodes on four hosts (two clusters, averaged by rings; mutual TLS) end on the in-process
  run's digests;
* Marsit on two hosts (one ``jax.distributed`` job, two CPU devices each, gloo between the hosts)
  ends every run on the one-process run's digest, accuracy and bits per element;
* binary learning's sparse-mutation run with its server on one host and a worker on each of two
  others ends on the checksum of the same run on loopback, every worker agreeing every round;
* a run that cannot form (a host missing) fails on every host with one line and a non-zero exit.
"""

from __future__ import annotations

import json
import secrets
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from zeroth import compress as C
from zeroth.bench import netns
from zeroth.config import load_config, load_config_dict, to_yaml
from zeroth.cluster import sim as ravnest_sim
from zeroth.pipeline import sim
from zeroth.replay import checksum
from zeroth.train.runs import load_run
from zeroth.transport import certs

_WHY = netns.unavailable()
pytestmark = [pytest.mark.e2e, pytest.mark.slow, pytest.mark.skipif(_WHY is not None, reason=str(_WHY))]

ROOT = Path(__file__).resolve().parent.parent
JOB = ROOT / "experiments" / "job_digits.yaml"
JOB_SETTINGS = [
    "peers.iterations=30",
    "peers.join_at=[]",
    "peers.kill_at=[]",
    "peers.iteration_timeout_s=10",
    "train.eval_every=1000",
]
PORT = 29400


def _launch(config: Path, out: Path, rendezvous: str, nnodes: int, secret: Path, *extra: str) -> list[str]:
    cmd = [
        sys.executable,
        "-m",
        "zeroth",
        "launch",
        str(config),
        "--rendezvous",
        rendezvous,
        "--nnodes",
        str(nnodes),
        "--out",
        str(out),
        "--secret-file",
        str(secret),
        *extra,
    ]
    return cmd


def _start(argv: list[str], log: Path) -> subprocess.Popen:
    with log.open("w") as fh:
        return subprocess.Popen(argv, stdout=fh, stderr=subprocess.STDOUT, cwd=ROOT)


def _wait(procs: list[subprocess.Popen], timeout_s: float, grace_s: float = 20.0) -> list[int]:
    """The exit codes of ``procs``; once one has failed, the others get ``grace_s`` to end, then are
    killed (a host left waiting for a dead one would wait its own timeouts out)."""
    deadline = time.monotonic() + timeout_s
    while any(p.poll() is None for p in procs) and time.monotonic() < deadline:
        if any(p.poll() not in (None, 0) for p in procs):
            deadline = min(deadline, time.monotonic() + grace_s)
        time.sleep(0.2)
    for p in procs:
        if p.poll() is None:
            p.kill()
            p.wait()
    return [p.returncode for p in procs]


def _logs(tmp: Path) -> str:
    return "\n".join(f"--- {p.name}\n" + "\n".join(p.read_text().splitlines()[-8:]) for p in sorted(tmp.glob("*.log")))


def _secret(tmp: Path) -> Path:
    path = tmp / "run.secret"
    path.write_text(secrets.token_hex(32) + "\n")
    path.chmod(0o600)
    return path


def _peer_summaries(out: Path) -> list[dict]:
    return [json.loads(p.read_text()) for p in sorted(out.glob("peers/p*/summary.json"))]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _progress(out: Path) -> int:
    """The newest iteration the peer under ``out`` logged (-1 before the first)."""
    step = -1
    for m in out.glob("peers/p*/metrics.jsonl"):
        for line in m.read_text().splitlines():
            if '"kind": "train"' in line:
                step = max(step, json.loads(line)["step"])
    return step


@pytest.fixture(scope="module")
def job_on_loopback(tmp_path_factory):
    """The 30-iteration Just One Byte run of these tests, its three launchers on 127.0.0.1: its digests."""
    tmp = tmp_path_factory.mktemp("loopback")
    secret = _secret(tmp)
    rdv = f"127.0.0.1:{_free_port()}"
    sets = [a for s in JOB_SETTINGS for a in ("--set", s)]
    procs = [_start(_launch(JOB, tmp / f"h{i}", rdv, 3, secret, *sets), tmp / f"h{i}.log") for i in range(3)]
    assert _wait(procs, 300) == [0, 0, 0], _logs(tmp)
    return {s["digest"] for i in range(3) for s in _peer_summaries(tmp / f"h{i}")}


def test_job_across_three_hosts_ends_on_the_loopback_digest_and_verifies(tmp_path, job_on_loopback):
    secret = _secret(tmp_path)
    sets = [a for s in JOB_SETTINGS for a in ("--set", s)]
    with netns.hosts(3) as hosts:
        rdv = f"{hosts[0].address}:{PORT}"
        procs = [
            _start(h.command(_launch(JOB, tmp_path / f"h{i}", rdv, 3, secret, *sets)), tmp_path / f"h{i}.log")
            for i, h in enumerate(hosts)
        ]
        assert _wait(procs, 300) == [0, 0, 0], _logs(tmp_path)
    launched = [json.loads((tmp_path / f"h{i}" / "launch.json").read_text()) for i in range(3)]
    # each host advertised its own namespace's address (the route's source), none of them loopback
    assert sorted(r["advertise"].rsplit(":", 1)[0] for r in launched) == sorted(h.address for h in hosts)
    assert sum(r["served_rendezvous"] for r in launched) == 1 and launched[0]["served_rendezvous"]
    assert sorted(r["rank"] for r in launched) == [0, 1, 2]
    digests = {s["digest"] for i in range(3) for s in _peer_summaries(tmp_path / f"h{i}")}
    assert len(digests) == 1 and digests == job_on_loopback, (digests, job_on_loopback)
    # the folders of the three hosts, collected into one place, are one run: every log replays
    collected = tmp_path / "collected"
    for i in range(3):
        shutil.copytree(tmp_path / f"h{i}" / "peers", collected / "peers", dirs_exist_ok=True)
    v = subprocess.run(
        [sys.executable, "-m", "zeroth", "verify", str(collected), "--secret-file", str(secret)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert v.returncode == 0, v.stdout + v.stderr
    assert "30/30" in v.stdout.replace(" ", "") or "31/31" in v.stdout.replace(" ", ""), v.stdout
    shutil.copy(tmp_path / "h0" / "config.yaml", collected / "config.yaml")
    run = load_run(collected)  # and the collected folder reads back as one run, the final state included
    assert run.kind == "peers" and run.step == 30 and checksum(run.params) == digests.pop()
    assert [r["step"] for r in run.metrics if r["kind"] == "train"][-1] == 30


def test_a_cut_link_is_survived_and_a_killed_host_leaves_the_run(tmp_path):
    secret = _secret(tmp_path)
    sets = [a for s in [*JOB_SETTINGS, "peers.iterations=40", "peers.count=4"] for a in ("--set", s)]
    with netns.hosts(4) as hosts:
        rdv = f"{hosts[0].address}:{PORT}"
        procs = [
            _start(
                h.command(_launch(JOB, tmp_path / f"h{i}", rdv, 4, secret, "--node-rank", str(i), *sets)),
                tmp_path / f"h{i}.log",
            )
            for i, h in enumerate(hosts)
        ]
        deadline = time.monotonic() + 240
        while _progress(tmp_path / "h1") < 8 and time.monotonic() < deadline and procs[1].poll() is None:
            time.sleep(0.2)
        hosts[1].link(up=False)  # host 1 unreachable for 3 s: shorter than the stall bound, so it stays a member
        time.sleep(3.0)
        hosts[1].link(up=True)
        while _progress(tmp_path / "h3") < 20 and time.monotonic() < deadline and procs[3].poll() is None:
            time.sleep(0.2)
        peer3 = subprocess.run(
            ["pgrep", "-f", f"{tmp_path / 'h3' / 'peers'}"], capture_output=True, text=True
        ).stdout.split()
        assert peer3, _logs(tmp_path)
        subprocess.run(["kill", "-9", *peer3], check=False)
        codes = _wait(procs, 300, grace_s=300)  # host 3 fails at once; the others finish the run
    assert codes[:3] == [0, 0, 0] and codes[3] != 0, _logs(tmp_path)
    assert "exited with code" in (tmp_path / "h3.log").read_text()  # one line says the host's process died
    done = [s for i in range(3) for s in _peer_summaries(tmp_path / f"h{i}")]
    assert all(s["finish_reason"] == "done" and s["iterations"] == 40 for s in done), done
    assert len({s["digest"] for s in done}) == 1


def test_aqsgd_pipeline_across_two_hosts_ends_on_the_in_process_run(tmp_path):
    cfg = load_config_dict(
        {
            "run": {"name": "pipeline-hosts", "seed": 0},
            "data": {"dataset": "sotu", "batch_size": 4},
            "model": {"name": "transformer", "kwargs": {"d_model": 16, "heads": 2, "layers": 3, "mlp_dim": 32}},
            "train": {
                "method": "backprop",
                "lr": 1e-2,
                "steps": 5,
                "optimizer": {"name": "adamw"},
                "keep_checkpoints": 0,
            },
            "pipeline": {
                "stages": 2,
                "micro_batches": 2,
                "examples": 8,
                "seq_len": 16,
                "objective": "lm",
                "compression": "aqsgd",
                "fw_bits": 2,
                "bw_bits": 4,
            },
        }
    )
    config = tmp_path / "pipeline.yaml"
    config.write_text(to_yaml(cfg))
    secret = _secret(tmp_path)
    with netns.hosts(2) as hosts:
        for h in hosts:
            h.limit(100)  # 100 Mbit/s each way on every host's link
        rdv = f"{hosts[1].address}:{PORT}"  # the rendezvous on the last stage's host, not rank 0's
        certs.make_host_certificates(tmp_path / "certs", [h.address for h in hosts])  # mutual TLS on every link
        procs = [
            _start(
                h.command(
                    _launch(
                        config,
                        tmp_path / f"h{i}",
                        rdv,
                        2,
                        secret,
                        "--node-rank",
                        str(i),
                        "--tls-dir",
                        str(tmp_path / "certs"),
                    )
                ),
                tmp_path / f"h{i}.log",
            )
            for i, h in enumerate(hosts)
        ]
        assert _wait(procs, 300) == [0, 0], _logs(tmp_path)
    assert "--tls-mutual" in json.loads((tmp_path / "h0" / "launch.json").read_text())["command"]
    # stage 1 served only the stream signed by stage 0's key, which went through the rendezvous
    up = json.loads((tmp_path / "h1" / "launch.json").read_text())
    stage0_key = (tmp_path / "h0" / "stage_0" / "key.pub").read_text().strip()
    assert up["command"][up["command"].index("--upstream-key") + 1] == stage0_key == up["roster"][0]["key"]
    assert load_config(config) == cfg
    local, engines = sim.run_local(cfg)
    for s, e in enumerate(engines):
        summary = json.loads((tmp_path / f"h{s}" / f"stage_{s}" / "summary.json").read_text())
        assert summary["param_digest"] == checksum(e.params), s
        assert summary["send_digest"] == C.buffer_digest(e.send_state)
        assert summary["recv_digest"] == C.buffer_digest(e.recv_state)


def test_pipeline_replicas_on_four_hosts_average_as_the_in_process_run(tmp_path):
    """2 replicas × 2 stages, one host each (the same `zeroth launch` line): the replicas' averaging
    (QuantizedAdam, compressed after 1 step) runs between hosts over signed streams, and every
    stage of every replica ends on the in-process run's parameters."""
    cfg = load_config_dict(
        {
            "run": {"name": "replicas-hosts", "seed": 0},
            "data": {"dataset": "sotu", "batch_size": 8},
            "model": {"name": "transformer", "kwargs": {"d_model": 16, "heads": 2, "layers": 2, "mlp_dim": 16}},
            "train": {"method": "backprop", "lr": 1e-2, "steps": 3, "optimizer": {"name": "adamw"}},
            "pipeline": {
                "stages": 2,
                "micro_batches": 2,
                "replicas": 2,
                "replica_sync": "onebit_adam",
                "replica_warmup_steps": 1,
                "examples": 16,
                "seq_len": 8,
                "compression": "aqsgd",
                "fw_bits": 4,
                "bw_bits": 8,
            },
        }
    )
    config = tmp_path / "replicas.yaml"
    config.write_text(to_yaml(cfg))
    secret = _secret(tmp_path)
    with netns.hosts(4) as hosts:
        rdv = f"{hosts[0].address}:{PORT}"
        procs = [
            _start(
                h.command(_launch(config, tmp_path / f"h{i}", rdv, 4, secret, "--node-rank", str(i))),
                tmp_path / f"h{i}.log",
            )
            for i, h in enumerate(hosts)
        ]
        assert _wait(procs, 300) == [0, 0, 0, 0], _logs(tmp_path)
    _, engines = sim.run_local(cfg)
    for k in range(4):
        replica, stage = divmod(k, 2)
        folder = tmp_path / f"h{k}" / (f"replica_{replica}" if replica else "") / f"stage_{stage}"
        summary = json.loads((folder / "summary.json").read_text())
        assert (summary["replica"], summary["stage"]) == (replica, stage)
        assert summary["param_digest"] == checksum(engines[replica][stage].params), k
    rows = [
        json.loads(x) for x in (tmp_path / "h2" / "replica_1" / "stage_0" / "metrics.jsonl").read_text().splitlines()
    ]
    assert [r["sync_bits"] for r in rows if r.get("kind") == "train"] == [0, 1, 1]


def test_ravnest_nodes_on_four_hosts_end_on_the_in_process_digests(tmp_path):
    cfg = load_config_dict(
        {
            "run": {"name": "ravnest-hosts", "seed": 0},
            "data": {"dataset": "sentiment", "batch_size": 8},
            "model": {"name": "transformer", "kwargs": {}},
            "train": {"method": "backprop", "steps": 8, "lr": 1e-3, "optimizer": {"name": "adamw"}},
            "ravnest": {"examples": 64, "seq_len": 32, "average_every": 4},
        }
    )
    config = tmp_path / "ravnest.yaml"
    config.write_text(to_yaml(cfg))
    secret = _secret(tmp_path)
    with netns.hosts(4) as hosts:
        rdv = f"{hosts[2].address}:{PORT}"
        certs.make_host_certificates(tmp_path / "certs", [h.address for h in hosts])  # mutual TLS on every link
        procs = [
            _start(
                h.command(_launch(config, tmp_path / f"h{i}", rdv, 4, secret, "--tls-dir", str(tmp_path / "certs"))),
                tmp_path / f"h{i}.log",
            )
            for i, h in enumerate(hosts)
        ]
        assert _wait(procs, 300) == [0, 0, 0, 0], _logs(tmp_path)
    ref = ravnest_sim.run_local(cfg)
    got = {p.parent.name: json.loads(p.read_text())["digest"] for p in tmp_path.glob("h*/nodes/*/summary.json")}
    assert got == ref["digests"]
    # each node reached the others at their namespaces' addresses, as the roster gave them
    book = {p.name: p.read_text().strip() for p in (tmp_path / "h0" / "addresses").iterdir()}
    assert {a.rsplit(":", 1)[0] for a in book.values()} == {h.address for h in hosts}


MARSIT = {
    "name": "marsit-hosts",
    "seed": 3,
    "data": {"dataset": "digits", "batch_size": 8, "eval_size": 200},
    "model": {"name": "mlp", "kwargs": {"hidden": [16]}},
    "topology": {"kind": "ring", "workers": 4},
    "train": {"rounds": 6, "eta_l": 0.1, "eval_every": 3, "target_acc": 0.05},
    "runs": [
        {"label": "psgd", "sync": {"method": "psgd"}},
        {"label": "marsit-k3", "sync": {"method": "marsit", "eta_s": 0.01, "K": 3}},
    ],
}


def test_marsit_over_two_hosts_ends_on_the_one_process_run(tmp_path):
    config = tmp_path / "marsit.yaml"
    config.write_text(json.dumps(MARSIT))
    ref = subprocess.run(
        [sys.executable, "-m", "zeroth", "run", str(config), "--out", str(tmp_path / "ref"), "--quiet"],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=ROOT,
    )
    assert ref.returncode == 0, ref.stderr[-2000:]
    secret = _secret(tmp_path)
    with netns.hosts(2) as hosts:
        rdv = f"{hosts[0].address}:{PORT}"
        procs = [
            _start(
                h.command(_launch(config, tmp_path / f"h{i}", rdv, 2, secret, "--node-rank", str(i))),
                tmp_path / f"h{i}.log",
            )
            for i, h in enumerate(hosts)
        ]
        assert _wait(procs, 300) == [0, 0], _logs(tmp_path)
    want = json.loads((tmp_path / "ref" / "summary.json").read_text())["runs"]
    for i in range(2):
        got = json.loads((tmp_path / f"h{i}" / "marsit" / "summary.json").read_text())["runs"]
        assert [r["run"] for r in got] == ["psgd", "marsit-k3"]
        for g, w in zip(got, want):
            assert g["checksums_equal"] and g["workers"] == 4
            assert (g["digest"], g["bits_per_element"], g["eval_accuracy"]) == (
                w["digest"],
                w["bits_per_element"],
                w["eval_accuracy"],
            ), g["run"]


def test_binary_server_and_workers_on_three_hosts_end_on_the_loopback_run(tmp_path):
    from zeroth.binary import experiment, launch as binary_launch

    config = tmp_path / "binary.yaml"
    config.write_text((ROOT / "experiments" / "binary_digits_smoke.yaml").read_text())
    cfg = load_config(config)
    secret = _secret(tmp_path)
    with netns.hosts(3) as hosts:
        rdv = f"{hosts[0].address}:{PORT}"
        procs = [
            _start(
                h.command(_launch(config, tmp_path / f"h{i}", rdv, 3, secret, "--node-rank", str(i))),
                tmp_path / f"h{i}.log",
            )
            for i, h in enumerate(hosts)
        ]
        assert _wait(procs, 300) == [0, 0, 0], _logs(tmp_path)
    server = json.loads((tmp_path / "h0" / "server" / "summary.json").read_text())
    assert server["contributors_per_round"] == [2] * cfg.binary.rounds
    for i in (1, 2):
        rows = [json.loads(x) for x in (tmp_path / f"h{i}" / "worker.jsonl").read_text().splitlines()]
        rounds = [r for r in rows if r["event"] == "round"]
        assert len(rounds) == cfg.binary.rounds and all(r["checksum_ok"] for r in rows)
    ref = binary_launch.run(experiment.dist_config(cfg), workers=2, out_dir=tmp_path / "loopback")
    assert ref["contributors_per_round"] == [2] * cfg.binary.rounds
    assert (server["final_checksum"], server["test_accuracy"]) == (ref["final_checksum"], ref["test_accuracy"])


def test_a_run_missing_a_host_fails_on_every_host_with_one_line(tmp_path):
    secret = _secret(tmp_path)
    with netns.hosts(2) as hosts:
        rdv = f"{hosts[0].address}:{PORT}"
        procs = [
            _start(
                h.command(_launch(JOB, tmp_path / f"h{i}", rdv, 3, secret, "--startup-timeout", "6")),
                tmp_path / f"h{i}.log",
            )
            for i, h in enumerate(hosts)
        ]
        codes = _wait(procs, 120)
    assert codes == [1, 1], _logs(tmp_path)
    for i in range(2):
        errors = [ln for ln in (tmp_path / f"h{i}.log").read_text().splitlines() if "error" in ln]
        assert len(errors) == 1 and "only 2 of 3 hosts joined within the start-up window of 6s" in errors[0], errors
        assert not (tmp_path / f"h{i}" / "launch.json").exists()  # nothing was started
