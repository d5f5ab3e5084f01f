"""The chaos table of Just One Byte peers: attacks and faults against live runs on 127.0.0.1.

  python scripts/chaos_peers.py [--tries N] [--out DIR] [--only NAME ...] [--measured-timeouts K]

Two kinds of scenarios:

* a hostile member (:class:`zeroth.net.chaos.HostileMember`: valid credentials for ONE member)
  attacks an in-process run of 3 peers (:class:`zeroth.net.runtime.Node`, real gRPC on
  127.0.0.1): messages forged as other members, rule-breaking messages as itself;
* faults on ``zeroth peer`` processes (:class:`zeroth.net.chaos.Cluster`): SIGKILL of the leader,
  SIGSTOP/SIGCONT of a non-leader, a killed joiner restarted on its port, 2 of 4 members killed,
  a joiner reaching a finished run.

For every scenario and try: whether the run finished, whether the digests agree (every digest two
peers recorded for the same iteration, and the final ones), the stall (the longest gap between two
applied iterations on a surviving peer), and the wrong updates applied (forged messages accepted
plus (peer, iteration) digests that differ from the other peers'), which must be 0. Prints a
Markdown table and writes ``OUT/chaos.json``.
"""

from __future__ import annotations

import argparse
import json
import signal
import statistics
import sys
import tempfile
import time
from pathlib import Path

import grpc
import yaml

from zeroth.config import load_config_dict
from zeroth.net import protocol as P
from zeroth.net.chaos import Cluster, HostileMember, wait_for
from zeroth.net.proto import peer_pb2 as pb
from zeroth.net.runtime import Node, NodeOptions
from zeroth.net.work import Worker

SECRET = "chaos-secret"
ITERATION_TIMEOUT, BARRIER = 1.5, 1.0


def raw_config(iterations: int, count: int, **peers) -> dict:
    p = {
        "count": count,
        "inferences_per_iteration": 4,
        "iteration_timeout_s": ITERATION_TIMEOUT,
        "barrier_timeout_s": BARRIER,
        "iterations": iterations,
    }
    p.update(peers)
    return {
        "run": {"name": "chaos", "seed": 11},
        "data": {"dataset": "digits", "batch_size": 32, "eval_size": 200},
        "model": {"name": "mlp", "kwargs": {"hidden": [16]}},
        "train": {"method": "zo", "lr": 0.05, "eps": 1e-3, "codec": "onebyte", "eval_every": 1000},
        "peers": p,
    }


def disagreements(digest_maps) -> int:
    """(peer, iteration) digests that differ from the most common digest of that iteration."""
    by_it: dict[int, list[str]] = {}
    for m in digest_maps:
        for t, d in m.items():
            by_it.setdefault(t, []).append(d)
    bad = 0
    for ds in by_it.values():
        common = max(set(ds), key=ds.count)
        bad += sum(d != common for d in ds)
    return bad


# --------------------------------------------------------------------------- a hostile member


def attack(name: str, hostile: HostileMember, nodes: list[Node], tries: int) -> int:
    """Send ``tries`` messages of scenario ``name``; returns how many forged ones were accepted."""
    h = hostile.machine
    accepted = 0
    for i in range(tries):
        n = nodes[i % len(nodes)]
        victim = next(m for m in (0, 1, 2) if n.machine != m)
        t = n.status()["iteration"]
        view = n.status_view()
        if name == "forged pushes as other members (0xFF)":
            code, _ = hostile.send(n.address, "PushGradients", hostile.push(victim, iteration=t, payload=b"\xff" * 4))
        elif name == "forged commits as the leader (past iteration)":
            msg = hostile.commit(0, iteration=max(0, t - 1), ballot=P.Ballot(0, 0), view=view._replace(iteration=t))
            code, _ = hostile.send(n.address, "CommitIteration", msg)
        elif name == "forged Leave naming a member":
            code, _ = hostile.send(n.address, "Leave", hostile.leave(victim, iteration=t))
        elif name == "Join with a member's address":
            code, _ = hostile.send(nodes[0].address, "Join", hostile.join_request(nodes[victim].address))
        elif name == "forged Checksum as another member":
            req = hostile.signed(
                "Checksum", pb.ChecksumRequest(run_id=hostile.run_id, sender=victim, iteration=t, digest=b"\x01" * 32)
            )
            code, _ = hostile.send(n.address, "Checksum", req)
        elif name == "future-iteration commits (own key) to every peer":
            for k in nodes:
                it = k.status()["iteration"] + 1 + i % 3
                msg = hostile.commit(h, iteration=it, ballot=P.Ballot(7, h), view=view._replace(iteration=it + 1))
                hostile.send(k.address, "CommitIteration", msg)
            code = "HINT"  # accepted as a hint only, never stored: counted below through the digests and stall
        elif name == "Prepare with round 2^63-1 to every peer":
            code = (
                "OK"
                if any(
                    hostile.send(k.address, "Prepare", hostile.prepare(h, iteration=t, round=2**63 - 1))[0] == "OK"
                    for k in nodes
                )
                else "REFUSED"
            )
        elif name == "Prepare saying the leader is gone (own key)":
            code = "REFUSED"  # accepted: a promise for the iteration the member is in (the leader is alive)
            for k in nodes[1:]:
                it = k.status()["iteration"]
                try:
                    req = hostile.prepare(h, iteration=it, round=1, previous=hostile.chain(k.address, it), gone=True)
                    reply = hostile.stub(k.address).Prepare(req, metadata=hostile.metadata, timeout=10)
                except grpc.RpcError:
                    continue
                code = "OK" if reply.iteration == it else code
        elif name == "outlier pushes as itself (0xFF, clip 8)":
            lead = nodes[0]
            it = lead.status()["iteration"]
            outlier = hostile.push(h, iteration=it, payload=b"\xff" * 4, previous=hostile.chain(lead.address, it))
            code, _ = hostile.send(lead.address, "PushGradients", outlier)
            code = "CLIPPED" if code == "OK" else code  # within the rules: accepted, clipped
        else:
            raise ValueError(name)
        accepted += code == "OK"
        time.sleep(0.01)
    return accepted


HOSTILE = (
    "forged pushes as other members (0xFF)",
    "forged commits as the leader (past iteration)",
    "forged Leave naming a member",
    "Join with a member's address",
    "forged Checksum as another member",
    "future-iteration commits (own key) to every peer",
    "Prepare with round 2^63-1 to every peer",
    "Prepare saying the leader is gone (own key)",
    "outlier pushes as itself (0xFF, clip 8)",
)


def hostile_scenario(name: str, tries: int, root: Path, worker: Worker) -> dict:
    iterations = 300
    cfg = load_config_dict(raw_config(iterations, 3, token=SECRET, clip=8.0))
    first = Node(cfg, NodeOptions(out_dir=str(root / "p0"), founders=3, secret=SECRET, log=False), worker=worker)
    nodes = [first]
    address = first.start()
    for i in (1, 2):
        nodes.append(
            Node(
                cfg, NodeOptions(out_dir=str(root / f"p{i}"), join=(address,), secret=SECRET, log=False), worker=worker
            )
        )
        nodes[-1].start()
    hostile = HostileMember(secret=SECRET, config_digest=first.join_digest)
    try:
        assert wait_for(lambda: all(n.applied >= 5 for n in nodes), 120)
        hostile.join(address)
        before = [dict(n.counters) for n in nodes]
        started = nodes[1].applied
        accepted = attack(name, hostile, nodes, tries)
        finished = all(n.wait(240) for n in nodes) and all(n.finish_reason == "done" for n in nodes)
        digests = [n.digests() for n in nodes]
        final = {d.get(iterations) for d in digests}
        records = [json.loads(line) for line in (root / "p1" / "metrics.jsonl").read_text().splitlines()]
        times = [r["wall_time_s"] for r in records if r.get("kind") == "train" and r["step"] - 1 >= started]
        stall = max((b - a for a, b in zip(times, times[1:], strict=False)), default=0.0)
        stats = nodes[0].summary()["member_stats"]
        honest_outliers = sum(1 for m, s in stats.items() if int(m) != hostile.machine and s["max_abs"] > 50)
        mismatches = sum(
            n.counters["checksum_mismatches"] - b["checksum_mismatches"] for n, b in zip(nodes, before, strict=True)
        )
        return {
            "scenario": name,
            "tries": tries,
            "finished": finished,
            "digests_agree": len(final) == 1 and None not in final and disagreements(digests) == 0,
            "stall_s": stall,
            "wrong_updates": accepted + honest_outliers + disagreements(digests),
            "mismatches": mismatches,
            "evicted": sum(n.counters["rejoins"] for n in nodes),
            "hostile_clipped": stats.get(str(hostile.machine), {}).get("clipped", 0),
        }
    finally:
        hostile.close()
        for n in nodes:
            n.stop()


# --------------------------------------------------------------------------- faults on processes


def write_config(path: Path, iterations: int, count: int, **peers) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(yaml.safe_dump(raw_config(iterations, count, **peers)))
    return path


def process_scenario(name: str, root: Path, measured_timeouts: float = 0.0) -> dict:
    count = 4 if name == "2 of 4 members killed (lost majority)" else 3
    # the run must outlast the fault (a run of 3 peers on loopback decides about 50 iterations a second)
    iterations = 1000 if name.startswith("SIGSTOP") else 5000 if name.startswith("killed joiner") else 300
    c = Cluster(write_config(root / "chaos.yaml", iterations, count, measured_timeouts=measured_timeouts), root)
    names = [f"p{i}" for i in range(count)]
    out = {"scenario": name, "tries": 1}
    linger = ("--linger", "20") if name == "joiner reaching a finished run" else ()  # the finished run keeps serving
    try:
        c.start("p0", founders=count, args=linger)
        for n in names[1:]:
            c.start(n, join="p0", args=linger)
        assert c.wait_for(lambda: c.iteration("p1") >= 20, 180), c.log("p1")[-2000:]
        t0 = time.monotonic()
        survivors = list(names)
        extra = {}
        if name == "SIGKILL of the leader":
            c.signal("p0", signal.SIGKILL)
            survivors = names[1:]
        elif name == "SIGSTOP 10 s / SIGCONT of a non-leader":
            c.signal("p2", signal.SIGSTOP)
            time.sleep(10)
            c.signal("p2", signal.SIGCONT)
            survivors = ["p0", "p1"]  # the paused one is judged apart: rejoined or exited with a reason
        elif name == "killed joiner restarted on its port":
            c.start("j", join="p1")
            assert c.wait_for(lambda: c.records("j") and not c.records("j")[-1]["catching_up"], 120), c.log("j")[-2000:]
            c.signal("j", signal.SIGKILL)
            c.peers["j"].proc.wait()
            c.start("j2", join="p1", port=c.ports["j"])
            survivors = [*names, "j2"]
        elif name == "2 of 4 members killed (lost majority)":
            c.signal("p2", signal.SIGKILL)
            c.signal("p3", signal.SIGKILL)
            survivors = ["p0", "p1"]
        elif name == "joiner reaching a finished run":
            assert c.wait_for(lambda: c.summary("p0").get("finish_reason") == "done", 300)
            c.start("late", join="p0")  # while the finished peers still serve
            started = time.monotonic()
            late = c.wait_exit(["late"], timeout=180)["late"]
            extra.update(
                late_exit_code=late,
                late_exit_s=time.monotonic() - started,
                late_reason=c.log("late").strip().splitlines()[-1][:160],
            )
        codes = c.wait_exit(survivors, timeout=300)
        extra["exit_s"] = time.monotonic() - t0
        if name.startswith("SIGSTOP"):
            paused = c.wait_exit(["p2"], timeout=60)["p2"]
            extra.update(
                paused_exit_code=paused,
                paused_rejoined=c.log("p2").count("joined run") >= 2,
                paused_log_bytes=len(c.log("p2")),
                paused_reason=(c.summary("p2").get("error") or "")[:160],
            )
        summaries = {n: c.summary(n) for n in c.peers}
        finished = all(summaries[n].get("finish_reason") == "done" for n in survivors)
        digest_maps = [{r["step"]: r["digest"] for r in c.records(n)} for n in c.peers]
        finals = {summaries[n].get("digest") for n in survivors}
        out.update(
            finished=finished,
            digests_agree=len(finals) == 1 and disagreements(digest_maps) == 0,
            stall_s=max(c.stall_seconds(n) for n in survivors if c.records(n)),
            wrong_updates=disagreements(digest_maps),
            exit_codes={n: codes[n] for n in survivors},
            reasons=sorted({(summaries[n].get("error") or "")[:140] for n in survivors} - {""}),
            tracebacks=sum("Traceback" in c.log(n) for n in c.peers),
            contributors_mean=statistics.fmean([len(r["contributors"]) for r in c.records(survivors[0])] or [0]),
            **extra,
        )
        return out
    finally:
        c.stop()


PROCESS = (
    "SIGKILL of the leader",
    "SIGSTOP 10 s / SIGCONT of a non-leader",
    "killed joiner restarted on its port",
    "2 of 4 members killed (lost majority)",
    "joiner reaching a finished run",
)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tries", type=int, default=2, help="runs per process scenario")
    ap.add_argument("--attacks", type=int, default=60, help="messages per hostile scenario")
    ap.add_argument("--out", default=None)
    ap.add_argument("--only", nargs="*", default=None, help="scenarios whose name contains one of these words")
    ap.add_argument(
        "--measured-timeouts",
        type=float,
        default=0.0,
        help="peers.measured_timeouts of the process scenarios (default 0: fixed timeouts)",
    )
    args = ap.parse_args(argv)
    out = Path(args.out or tempfile.mkdtemp(prefix="chaos-"))
    rows = []
    want = lambda n: not args.only or any(w.lower() in n.lower() for w in args.only)  # noqa: E731
    worker = None
    for i, name in enumerate(HOSTILE):
        if want(name):
            worker = worker or Worker(load_config_dict(raw_config(300, 3)))
            rows.append(hostile_scenario(name, args.attacks, out / f"h{i}", worker))
            print(json.dumps(rows[-1]), flush=True)
    for i, name in enumerate(PROCESS):
        if want(name):
            for k in range(args.tries):
                rows.append(process_scenario(name, out / f"s{i}-{k}", args.measured_timeouts))
                print(json.dumps(rows[-1]), flush=True)
    (out / "chaos.json").write_text(json.dumps(rows, indent=2) + "\n")
    merged: dict[str, dict] = {}
    for r in rows:
        m = merged.setdefault(
            r["scenario"], {"tries": 0, "finished": 0, "agree": 0, "stall": 0.0, "wrong": 0, "notes": set()}
        )
        m["tries"] += r["tries"] if r["scenario"] in HOSTILE else 1
        m["finished"] += bool(r["finished"])
        m["agree"] += bool(r["digests_agree"])
        m["stall"] = max(m["stall"], r["stall_s"])
        m["wrong"] += r["wrong_updates"]
        if "exit_codes" in r and not r["finished"]:
            m["notes"].add(f"survivors exit {sorted(set(r['exit_codes'].values()), key=str)} after {r['exit_s']:.0f}s")
        if "paused_exit_code" in r:
            m["notes"].add(
                f"paused peer: {'rejoined' if r['paused_rejoined'] else 'did not rejoin'}, exit {r['paused_exit_code']}, "
                f"log {r['paused_log_bytes'] // 1000} kB"
            )
        if "late_exit_code" in r:
            m["notes"].add(f"late joiner exit {r['late_exit_code']} after {r['late_exit_s']:.1f}s")
        if r.get("hostile_clipped"):
            m["notes"].add(f"{r['hostile_clipped']} values clipped")
    runs = {name: sum(1 for r in rows if r["scenario"] == name) for name in merged}
    print("\n| scenario | tries | run finished | digests agree | stall s (max) | wrong updates applied | notes |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for name, m in merged.items():
        n = runs[name]
        print(
            f"| {name} | {m['tries']} | {m['finished']}/{n} | {m['agree']}/{n} | {m['stall']:.1f} | {m['wrong']} | {'; '.join(sorted(m['notes']))} |"
        )
    print(f"\n(raw rows: {out / 'chaos.json'})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
