"""The chaos table of every networked system: an attacker against live runs on 127.0.0.1.

  python scripts/chaos_systems.py [--out DIR] [--only WORD ...] [--hold S]

For each system (Just One Byte peers, the AQ-SGD pipeline, Ravnest, binary learning) it runs a
small run as processes on loopback (``zeroth run``, ``python -m zeroth.binary.launch``) once clean
and once per attack, the attacker in this process:

* ``slowloris (no secret)``: 40 calls that open and never send their body, held ``--hold`` seconds,
  against the server every other process of the run depends on (a peer, stage 1, a Ravnest node,
  the binary server);
* ``oversized unauthenticated``: four 64 MiB messages without the token to the same server (its
  RSS growth is in the notes);
* ``forged sender (with secret)``: the run secret (read from the environment of one of the run's
  processes: an insider) and messages in another process's name: Ravnest activations, gradients
  and ring chunks in real nodes' names (unsigned, or signed with the attacker's own key); pipeline
  activations on stage 1's upstream link, opened before stage 0's; binary lists from an insider's seat in every
  worker's name for each round; for the peers, the in-process hostile member of
  ``scripts/chaos_peers.py`` (forged pushes as other members).

Columns: whether the run finished (exit 0), whether its digests agree (Ravnest, pipeline, binary:
final digests equal the clean run's, the runs are deterministic; peers: every peer recorded the
same digest for every iteration and the same final one), the longest stall (the longest time
without a new metrics row while the run went on), and the wrong updates applied (forged messages
accepted, plus steps or nodes whose digest differs from the clean run's). Prints a Markdown table
and writes ``OUT/chaos_systems.json``. Marsit runs inside JAX collectives and serves nothing: no row.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import grpc
import numpy as np
import yaml

ROOT = Path(__file__).resolve().parents[1]
PY = sys.executable
SIZE = 64 << 20


# --------------------------------------------------------------------------- processes and files


def pids_with(*needles: str) -> list[int]:
    """Pids of the processes whose command line contains every one of ``needles``."""
    out = []
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            cmd = (proc / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        if all(n in cmd for n in needles) and "chaos_systems" not in cmd:
            out.append(int(proc.name))
    return out


def secret_of(pid: int) -> str | None:
    """The run secret in the environment of process ``pid`` (one of the run's: this user's)."""
    try:
        env = (Path("/proc") / str(pid) / "environ").read_bytes().split(b"\0")
    except OSError:
        return None
    for kv in env:
        if kv.startswith(b"ZEROTH_SECRET="):
            return kv.split(b"=", 1)[1].decode()
    return None


def rss(pid: int) -> int:
    try:
        for line in (Path("/proc") / str(pid) / "status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def lines(paths) -> int:
    n = 0
    for p in paths:
        try:
            n += sum(1 for line in Path(p).read_text().splitlines() if line.strip())
        except OSError:
            pass
    return n


def wait_file(path: Path, timeout_s: float) -> str | None:
    end = time.monotonic() + timeout_s
    while time.monotonic() < end:
        if path.is_file() and path.read_text().strip():
            return path.read_text().strip()
        time.sleep(0.02)
    return None


class Progress(threading.Thread):
    """Samples a progress count every 50 ms: the longest time it stood still between its first and
    last change (the stall)."""

    def __init__(self, count):
        super().__init__(daemon=True)
        self.count, self.stop = count, threading.Event()
        self.changes: list[float] = []
        self.start()

    def run(self):
        last = None
        while not self.stop.is_set():
            n = self.count()
            if n != last and n:
                self.changes.append(time.monotonic())
            last = n
            time.sleep(0.05)

    def stall(self) -> float:
        self.stop.set()
        self.join()
        c = self.changes
        return max((b - a for a, b in zip(c, c[1:], strict=False)), default=0.0)


# --------------------------------------------------------------------------- attacks without the secret


class Held:
    """``n`` calls to ``method`` without the token that never send their body."""

    def __init__(self, address: str, method: str, n: int):
        self._event = threading.Event()
        self.channel = grpc.insecure_channel(address)
        call = self.channel.stream_unary(method)
        self.futures = [call.future(self._nothing()) for _ in range(n)]

    def _nothing(self):
        self._event.wait(120.0)
        return
        yield

    def release(self) -> list[str]:
        codes = []
        for f in self.futures:
            if f.done():
                try:
                    f.result()
                    codes.append("OK")
                except grpc.RpcError as e:
                    codes.append(e.code().name)
            else:
                codes.append("HELD")
        self._event.set()
        for f in self.futures:
            f.cancel()
        self.channel.close()
        return codes


def slowloris(address: str, method: str, hold_s: float) -> dict:
    h = Held(address, method, 40)
    time.sleep(hold_s)
    codes = h.release()
    return {"held_calls": 40, "still_open_at_release": codes.count("HELD"), "codes": sorted(set(codes))}


def oversized(address: str, method: str, pid: int | None) -> dict:
    before = rss(pid) if pid else 0
    codes = []
    data = b"x" * SIZE
    with grpc.insecure_channel(address, options=[("grpc.max_send_message_length", SIZE + 1024)]) as ch:
        for _ in range(4):
            try:
                ch.unary_unary(method)(data, timeout=60)
                codes.append("OK")
            except grpc.RpcError as e:
                codes.append(e.code().name)
    peak = rss(pid) if pid else 0
    return {"codes": sorted(set(codes)), "victim_rss_growth_mb": round((peak - before) / 2**20, 1) if pid else None}


# --------------------------------------------------------------------------- systems


class Ravnest:
    name = "Ravnest"
    method = "/zeroth.v1.cluster.ClusterNode/Deliver"

    def __init__(self, root: Path):
        raw = {
            "run": {"name": "chaos", "seed": 0},
            "data": {"dataset": "sentiment", "batch_size": 8},
            "model": {"name": "transformer", "kwargs": {}},
            "train": {"method": "backprop", "steps": 16, "lr": 1e-3, "optimizer": {"name": "adamw"}},
            "ravnest": {"examples": 64, "seq_len": 32, "average_every": 4, "latency_ms": 40, "timeout_s": 60},
        }
        self.cfg_path = root / "ravnest.yaml"
        self.cfg_path.write_text(yaml.safe_dump(raw))

    def start(self, out: Path) -> subprocess.Popen:
        return subprocess.Popen(
            [PY, "-m", "zeroth", "run", str(self.cfg_path), "--out", str(out), "--quiet"],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )

    def target(self, out: Path) -> tuple[str | None, int | None]:
        address = wait_file(out / "addresses" / "n1", 120)
        pids = pids_with("zeroth.cluster.node", "--name n1", str(out))
        return address, (pids[0] if pids else None)

    def progress(self, out: Path) -> int:
        return lines((out / "nodes").glob("*/metrics.jsonl"))

    def forge(self, out: Path, stop: threading.Event) -> dict:
        from zeroth import config as _config
        from zeroth.cluster import build
        from zeroth.cluster import chaos as cluster_chaos
        from zeroth.transport import identity, security

        pid = None
        while pid is None and not stop.is_set():
            pid = next(iter(pids_with("zeroth.cluster.node", str(out))), None)
            time.sleep(0.02)
        secret = secret_of(pid)
        cfg = _config.load_config(str(self.cfg_path))
        plan = build.plan_of(cfg)
        md = security.token_metadata(identity.access_token(secret))
        rounds = range(1, cfg.train.steps // cfg.ravnest.average_every + 1)
        codes = cluster_chaos.deliver(cluster_chaos.forged_messages(cfg, plan, rounds, chunk_divisor=2), out, md, 60)
        return {"forged": len(codes), "accepted": codes.count("OK"), "codes": sorted(set(codes))}

    def result(self, out: Path) -> dict:
        path = out / "summary.json"
        if not path.is_file():
            return {}
        s = json.loads(path.read_text())
        return {"final": {n: v["digest"] for n, v in s["nodes"].items()}, "agree_inside": s["clusters_agree"]}


class Pipeline:
    name = "pipeline (AQ-SGD)"
    method = "/zeroth.v1.PipelineLink/Link"

    def __init__(self, root: Path):
        raw = {
            "run": {"seed": 1},
            "data": {"dataset": "sotu", "batch_size": 4},
            "model": {"name": "transformer", "kwargs": {"d_model": 16, "heads": 2, "layers": 2, "mlp_dim": 16}},
            "train": {"method": "backprop", "lr": 1e-2, "steps": 400, "optimizer": {"name": "adamw"}},
            "pipeline": {"stages": 2, "micro_batches": 2, "examples": 8, "seq_len": 8, "compression": "aqsgd"},
        }
        self.cfg_path = root / "pipeline.yaml"
        self.cfg_path.write_text(yaml.safe_dump(raw))

    def start(self, out: Path) -> subprocess.Popen:
        return subprocess.Popen(
            [PY, "-m", "zeroth", "run", str(self.cfg_path), "--out", str(out), "--quiet"],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )

    def target(self, out: Path):
        address = wait_file(out / "stage_1" / "address", 120)
        pids = pids_with("zeroth.pipeline.stage", "--stage 1", str(out))
        return address, (pids[0] if pids else None)

    def progress(self, out: Path) -> int:
        return lines([out / "stage_1" / "metrics.jsonl"])

    def forge(self, out: Path, stop: threading.Event) -> dict:
        from zeroth import config as _config
        from zeroth.pipeline import build
        from zeroth.pipeline.proto import pipeline_pb2 as pb
        from zeroth.pipeline.proto import pipeline_pb2_grpc as pb_grpc
        from zeroth.transport import identity, security

        address, pid = None, None
        while (address is None or pid is None) and not stop.is_set():
            path = out / "stage_1" / "address"
            address = path.read_text().strip() if path.is_file() and path.read_text().strip() else None
            pid = next(iter(pids_with("zeroth.pipeline.stage", "--stage 1", str(out))), None)
            time.sleep(0.005)
        md = security.token_metadata(identity.access_token(secret_of(pid)))
        run_id = build.run_id_of(_config.load_config(str(self.cfg_path)))
        x = np.full((2, 8, 16), 3.0, np.float32)

        def frames():
            for step in range(3):
                for mb in range(2):
                    yield pb.TensorFrame(
                        run_id=run_id,
                        link=0,
                        kind=pb.ACTIVATION,
                        step=step,
                        micro_batch=mb,
                        example_ids=[2 * mb, 2 * mb + 1],
                        shape=list(x.shape),
                        dtype="float32",
                        bits=0,
                        fresh=b"\x01\x01",
                        full=x.tobytes(),
                    )
            stop.wait(15.0)  # hold the link

        got, code = 0, "OK"
        with grpc.insecure_channel(address) as ch:
            try:
                for _ in pb_grpc.PipelineLinkStub(ch).Link(frames(), metadata=md, timeout=30):
                    got += 1
            except grpc.RpcError as e:
                code = e.code().name
        return {
            "forged": 6,
            "accepted": got,
            "codes": [code],
            "note": f"{got} gradient frames came back for forged activations",
        }

    def result(self, out: Path) -> dict:
        path = out / "metrics.jsonl"
        if not path.is_file():
            return {}
        rows = [json.loads(x) for x in path.read_text().splitlines() if x.strip()]
        return {"final": {r["step"]: r["digest"] for r in rows}, "agree_inside": True}


class Binary:
    name = "binary learning"
    method = "/zeroth.v1.binary.BinaryMutations/Submit"

    def start(self, out: Path) -> subprocess.Popen:
        return subprocess.Popen(
            [PY, "-m", "zeroth.binary.launch", "--workers", "3", "--rounds", "40", "--out", str(out)],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            cwd=ROOT,
        )

    def __init__(self, root: Path):
        self.procs: dict[Path, subprocess.Popen] = {}

    def target(self, out: Path):
        end = time.monotonic() + 120
        while time.monotonic() < end:
            for pid in pids_with("zeroth.binary.worker", str(out)):
                cmd = (Path("/proc") / str(pid) / "cmdline").read_bytes().split(b"\0")
                if b"--server" in cmd:
                    address = cmd[cmd.index(b"--server") + 1].decode()
                    launcher = next(iter(pids_with("zeroth.binary.launch", str(out))), None)
                    return address, launcher
            time.sleep(0.02)
        return None, None

    def progress(self, out: Path) -> int:
        return lines(out.glob("worker*.jsonl"))

    def forge(self, out: Path, stop: threading.Event) -> dict:
        """An insider: with the run secret it takes a seat of its own (a join with a valid proof) and
        submits lists in the real workers' names, signed with its own key or unsigned."""
        from zeroth.binary import protocol as P
        from zeroth.binary import service as S
        from zeroth.binary.proto import binary_pb2 as pb
        from zeroth.binary.proto import binary_pb2_grpc as pb_grpc
        from zeroth.transport import identity, security

        address, _ = self.target(out)
        while self.progress(out) == 0 and not stop.is_set():  # the real workers hold seats 0-2 first
            time.sleep(0.02)
        pid = next(iter(pids_with("zeroth.binary.worker", str(out))), None)
        secret = secret_of(pid) if pid else None
        md = security.token_metadata(identity.access_token(secret)) if secret else ()
        run_id = "binary"
        mallory = identity.Identity.generate()
        sent = accepted = 0
        codes = set()
        with grpc.insecure_channel(address) as ch:
            stub = pb_grpc.BinaryMutationsStub(ch)
            proof = identity.join_proof(secret, run_id, S.JOIN_ADDRESS, mallory.public) if secret else b""
            try:
                rep = stub.Join(pb.JoinRequest(run_id=run_id, key=mallory.public, proof=proof), metadata=md, timeout=30)
            except grpc.RpcError as e:
                return {"forged": 0, "accepted": 0, "codes": [e.code().name], "note": "the insider's join was refused"}
            me, r = rep.worker_id, rep.round
            end = time.monotonic() + 60
            while not stop.is_set() and time.monotonic() < end:
                for w in range(3):  # the real workers' ids, for the open round and the next
                    for rnd in (r, r + 1):
                        unsigned = P.DeltaList(
                            run_id, w, rnd, np.arange(4), np.full(4, -100.0, np.float32), rep.checksum, 32, 1.0
                        )
                        signed = (
                            unsigned._replace(signature=mallory.sign(P.submission_bytes(unsigned)))
                            if sent % 2
                            else unsigned
                        )
                        sent += 1
                        try:
                            accepted += bool(stub.Submit(S.encode_deltas(signed), metadata=md, timeout=5).accepted)
                            codes.add("OK")
                        except grpc.RpcError as e:
                            codes.add(e.code().name)
                            if e.code() == grpc.StatusCode.UNAVAILABLE:  # the run ended, and its server with it
                                stop.set()
                r += 1
                time.sleep(0.1)
        return {
            "forged": sent,
            "accepted": accepted,
            "codes": sorted(codes),
            "note": f"insider seat {me}; lists in workers 0-2's names, half signed with its own key",
        }

    def result(self, out: Path) -> dict:
        path = out / "summary.json"
        if not path.is_file():
            return {}
        s = json.loads(path.read_text())
        return {
            "final": {"model": s["final_checksum"]},
            "agree_inside": s["checksum_mismatches"] == 0,
            "mismatches": s["checksum_mismatches"],
        }


class Peers:
    name = "JOB peers"
    method = "/zeroth.v1.Peer/PushGradients"

    def __init__(self, root: Path):
        self.chaos = _chaos_peers()
        self.cfg_path = root / "peers.yaml"
        self.cfg_path.write_text(yaml.safe_dump(self.chaos.raw_config(150, 3)))

    def start(self, out: Path) -> subprocess.Popen:
        return subprocess.Popen(
            [PY, "-m", "zeroth", "run", str(self.cfg_path), "--out", str(out), "--quiet"],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )

    def target(self, out: Path):
        address = wait_file(out / "peers" / "p1" / "address", 120)
        pids = pids_with(str(out / "peers" / "p1"))
        return address, (pids[0] if pids else None)

    def progress(self, out: Path) -> int:
        return lines((out / "peers").glob("p*/metrics.jsonl"))

    def result(self, out: Path) -> dict:
        maps, finals = [], set()
        for p in sorted(d for d in (out / "peers").glob("p*") if d.is_dir()):
            rows = (
                [json.loads(x) for x in (p / "metrics.jsonl").read_text().splitlines() if x.strip()]
                if (p / "metrics.jsonl").is_file()
                else []
            )
            maps.append({r["step"]: r["digest"] for r in rows if r.get("kind") == "train"})
            s = json.loads((p / "summary.json").read_text()) if (p / "summary.json").is_file() else {}
            finals.add(s.get("digest"))
        bad = self.chaos.disagreements(maps)
        return {
            "final": None,
            "agree_inside": len(finals) == 1 and None not in finals and bad == 0,
            "disagreements": bad,
        }


def _chaos_peers():
    spec = importlib.util.spec_from_file_location("chaos_peers", ROOT / "scripts" / "chaos_peers.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


# --------------------------------------------------------------------------- one run


def run_one(system, attack: str, out: Path, clean: dict | None, hold_s: float) -> dict:
    t0 = time.monotonic()
    proc = system.start(out)
    prog = Progress(lambda: system.progress(out))
    stop = threading.Event()
    detail: dict = {}
    try:
        if attack == "slowloris (no secret)":
            address, _ = system.target(out)
            detail = slowloris(address, system.method, hold_s)
        elif attack == "oversized unauthenticated":
            address, pid = system.target(out)
            detail = oversized(address, system.method, pid)
        elif attack == "forged sender (with secret)":
            box: dict = {}
            th = threading.Thread(target=lambda: box.update(system.forge(out, stop)), daemon=True)
            th.start()
            while th.is_alive() and proc.poll() is None:
                time.sleep(0.1)
            stop.set()
            th.join(60)
            detail = box
        try:
            log, _ = proc.communicate(timeout=600)
        except subprocess.TimeoutExpired:
            proc.kill()
            log, _ = proc.communicate()
    finally:
        stop.set()
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    stall = prog.stall()
    res = system.result(out)
    finished = proc.returncode == 0
    wrong = int(detail.get("accepted", 0))
    if clean is None or clean.get("final") is None:
        agree = bool(res.get("agree_inside"))
        wrong += int(res.get("disagreements", 0)) + int(res.get("mismatches", 0))
    else:
        mine, ref = res.get("final") or {}, clean["final"]
        differ = sum(1 for k, v in mine.items() if ref.get(k) != v)
        agree = finished and mine == ref and bool(res.get("agree_inside"))
        wrong += differ + int(res.get("mismatches", 0))
    return {
        "system": system.name,
        "attack": attack,
        "finished": finished,
        "exit_code": proc.returncode,
        "digests_agree": agree,
        "max_stall_s": round(stall, 2),
        "wrong_updates": wrong,
        "seconds": round(time.monotonic() - t0, 1),
        "detail": detail,
        "final": res.get("final"),
        "log_tail": "" if finished else (log or "")[-600:],
    }


def peers_forged(system: Peers, root: Path, tries: int) -> dict:
    from zeroth.config import load_config_dict
    from zeroth.net.work import Worker

    ch = system.chaos
    worker = Worker(load_config_dict(ch.raw_config(300, 3)))
    r = ch.hostile_scenario("forged pushes as other members (0xFF)", tries, root, worker)
    return {
        "system": system.name,
        "attack": "forged sender (with secret)",
        "finished": r["finished"],
        "exit_code": None,
        "digests_agree": r["digests_agree"],
        "max_stall_s": round(r["stall_s"], 2),
        "wrong_updates": r["wrong_updates"],
        "seconds": None,
        "detail": {"forged": tries, "note": "in-process run of scripts/chaos_peers.py (hostile member)"},
        "final": None,
        "log_tail": "",
    }


ATTACKS = ("none (clean run)", "slowloris (no secret)", "oversized unauthenticated", "forged sender (with secret)")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=None)
    ap.add_argument("--only", nargs="*", default=None, help="systems whose name contains one of these words")
    ap.add_argument("--hold", type=float, default=15.0, help="seconds the slowloris calls are held")
    args = ap.parse_args(argv)
    root = Path(args.out or tempfile.mkdtemp(prefix="chaos-systems-"))
    root.mkdir(parents=True, exist_ok=True)
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    rows = []
    for cls in (Peers, Pipeline, Ravnest, Binary):
        if args.only and not any(w.lower() in cls.name.lower() for w in args.only):
            continue
        system = cls(root)
        clean = None
        for i, attack in enumerate(ATTACKS):
            out = root / f"{cls.__name__.lower()}-{i}"
            if isinstance(system, Peers) and attack.startswith("forged"):
                row = peers_forged(system, out, 60)
            else:
                row = run_one(system, attack, out, clean, args.hold)
            if i == 0:
                clean = row
            rows.append(row)
            print(json.dumps({k: v for k, v in row.items() if k != "final"}), flush=True)
    (root / "chaos_systems.json").write_text(json.dumps(rows, indent=1) + "\n")
    print("\n| system | attack | run finished | digests agree | max stall s | wrong updates applied | notes |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for r in rows:
        d = r["detail"]
        notes = []
        if "codes" in d:
            notes.append("attacker saw " + "/".join(d["codes"]))
        if "still_open_at_release" in d:
            notes.append(f"{d['still_open_at_release']} of {d['held_calls']} calls still open at release")
        if d.get("victim_rss_growth_mb") is not None:
            notes.append(f"victim RSS +{d['victim_rss_growth_mb']} MiB")
        if "forged" in d:
            notes.append(
                f"{d.get('accepted', '?')} of {d['forged']} forged accepted"
                if "accepted" in d
                else f"{d['forged']} forged"
            )
        if d.get("note"):
            notes.append(d["note"])
        if not r["finished"] and r["exit_code"] is not None:
            notes.append(f"exit {r['exit_code']}")
        print(
            f"| {r['system']} | {r['attack']} | {'yes' if r['finished'] else 'no'} | {'yes' if r['digests_agree'] else 'no'} | "
            f"{r['max_stall_s']:.1f} | {r['wrong_updates']} | {'; '.join(notes)} |"
        )
    print(f"\n(raw rows: {root / 'chaos_systems.json'})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
