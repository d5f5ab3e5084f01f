"""``zeroth bench peers``: the Just One Byte protocol at M peers, on the simulator, at real wire sizes over a WAN.

For each number of peers M it runs :mod:`zeroth.net.protocol` in a :class:`WanNet` (the
deterministic simulator of :mod:`zeroth.net.sim` with per-pair latency and per-peer uplink
bandwidth drawn from a WAN distribution) and prints, per iteration, averaged over the iterations
measured after a warm-up:

* ``messages``: calls between peers (pushes, commits, prepares, leaves);
* ``bytes all`` and ``bytes busiest``: wire bytes sent by all peers, and by the peer that sent the
  most (requests it made and replies it gave), each message sized as the runtime would send it
  (:func:`zeroth.net.wire.wire_size` of its protobuf, the call token included, 64-byte signatures;
  a commit as a delta of its view, :func:`zeroth.net.wire.commit_to_pb`, unless ``--whole-commits``);
  ``c = busiest / M`` is the constant of ``bytes(busiest) <= c * M``;
* ``cpu/peer``: protocol CPU per peer (mean and max, in ms of this thread's CPU time; the handlers
  of :mod:`zeroth.net.protocol`, timed here, signing included, signature checks not) and
  ``sig checks/peer``: signed messages a peer verifies (each costs one Ed25519 verification,
  measured on this machine: ``verify_us``);
* ``iteration s`` and ``RTTs``: simulated seconds per iteration and the same in median round trips,
  with ``--call-slots`` calls in flight per peer (0: no limit, the runtime's asynchronous sends; 16:
  a pool of 16 threads that block for a reply) and ``--compute-s`` seconds of gradient computation
  per iteration;
* ``contributors``: the fewest and most members whose gradients an iteration applied (fewer than
  M: the barrier went on without some); ``drops`` (JSON, and a line under the table): peers
  dropped because a takeover replaced a decision they applied; they rejoin, as the runtime's do.

The link model: peer i has an access delay a_i and an uplink of b_i bit/s, both log-normal
(seeded); a message from i to j leaves when i's uplink is free, occupies it for its bytes / b_i,
and arrives a_i + a_j later; the median round trip between two peers is ``--rtt-ms`` (``--spread
0``: every round trip, and every uplink, the median). Downlinks
are not modelled. M is bounded by ``--budget-s`` seconds of this process's CPU time each (other
jobs on a shared machine do not shorten it): a size that
does not finish its warm-up within the budget is reported as not run, and one that finishes fewer
iterations is averaged over those.

Example:
  $ zeroth bench peers --peers 4,16,64 --iterations 2 --json
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import json
import math
import random
import statistics
import sys
import time
from typing import Any

from zeroth.net import protocol as P
from zeroth.net import wire
from zeroth.net.sim import SimNet

__all__ = ["WanNet", "measure", "main"]

_TOKEN = "t" * 22  # the length of a run's access token (zeroth.transport.identity.access_token)
_TIMED = (
    "on_push",
    "on_commit",
    "on_prepare",
    "on_leave",
    "on_tick",
    "on_local_gradients",
    "on_commit_acked",
    "on_commit_failed",
    "on_push_refused",
    "on_prepare_reply",
    "on_prepare_rejected",
    "on_fetched",
    "on_fetch_failed",
    "on_ready",
    "on_join",
    "prepare_probe",
)


def _fake_sign(data: bytes) -> bytes:
    """A 64-byte stand-in for an Ed25519 signature (the size is what matters here; nothing verifies it)."""
    return hashlib.sha512(data).digest()


def _request_pb(msg, base: P.View | None, max_count: int):
    if isinstance(msg, P.Push):
        return wire.push_to_pb(msg)
    if isinstance(msg, P.Commit):  # a delta of the sender's view of its iteration, as the runtime sends it
        return wire.commit_to_pb(msg, base, max_count) if base is not None else wire.commit_to_pb(msg)
    if isinstance(msg, P.LogEntry):  # a commit with its payloads relayed (pushes: leader)
        return wire.relay_to_pb(_request_pb(msg.commit, base, max_count), msg)
    if isinstance(msg, P.Prepare):
        return wire.prepare_to_pb(msg)
    if isinstance(msg, P.Leave):
        return wire.leave_to_pb(msg)
    raise TypeError(f"no wire form for {type(msg).__name__}")


def _reply_size(reply) -> int:
    if isinstance(reply, P.CommitReply):
        return wire.wire_size(wire.pb.CommitAck(not_held=not reply.stored, previous=reply.previous), kind="response")
    if isinstance(reply, P.PrepareReply):
        return wire.wire_size(wire.prepare_reply_to_pb(reply), kind="response")
    if isinstance(reply, int):  # a leave's answer
        return wire.wire_size(wire.pb.LeaveResponse(iteration=reply), kind="response")
    return wire.RESPONSE_OVERHEAD  # a push's empty acknowledgement, or a refusal


class WanNet(SimNet):
    """:class:`zeroth.net.sim.SimNet` over WAN links, counting every call's wire bytes (see the module docstring)."""

    def __init__(
        self,
        params: P.Params,
        *,
        rtt_s: float,
        uplink_bps: float,
        seed: int,
        call_slots: int | None,
        whole_commits: bool = False,
        spread: float = 1.0,
        **kw,
    ):
        super().__init__(params, call_slots=call_slots, **kw)
        self.whole_commits = whole_commits
        self.spread = spread
        self._rng = random.Random(seed)
        self._access: dict[str, float] = {}
        self._uplink: dict[str, float] = {}
        self._free: dict[str, float] = {}
        self.rtt_s = rtt_s
        self.uplink_bps = uplink_bps
        # per iteration (the message's, an answer's: its request's): calls, and per address the
        # wire bytes it sent (requests and answers) and the signed requests it received (one
        # signature verification each)
        self.messages: dict[int, int] = {}
        self.sent: dict[int, dict[str, int]] = {}
        self.received_signed: dict[int, dict[str, int]] = {}
        self._sizes: dict[int, tuple[Any, int]] = {}

    def _link(self, address: str) -> tuple[float, float]:
        if address not in self._access:
            # access delay: a median round trip of rtt_s between two peers (2 * (a_i + a_j)); log-normal
            # spreads 0.5 (delay) and 0.7 (uplink), times ``spread`` (0: every peer has the medians)
            self._access[address] = self.rtt_s / 4 * math.exp(self._rng.gauss(0.0, 0.5) * self.spread)
            self._uplink[address] = self.uplink_bps * math.exp(self._rng.gauss(0.0, 0.7) * self.spread)
        return self._access[address], self._uplink[address]

    def _size(self, src: str, msg) -> int:
        got = self._sizes.get(id(msg))
        if got is None or got[0] is not msg:
            st = self.peers[src].state
            commit = msg.commit if isinstance(msg, P.LogEntry) else msg
            base = (
                P.view_at(st, commit.iteration)
                if isinstance(commit, P.Commit) and st is not None and not self.whole_commits
                else None
            )
            got = (msg, wire.wire_size(_request_pb(msg, base, self.params.max_count), kind="request", token=_TOKEN))
            self._sizes[id(msg)] = got
        return got[1]

    def link_delay(self, src: str, dst: str, message, *, answer_to=None) -> float:
        n = _reply_size(message) if answer_to is not None else self._size(src, message)
        about = message if answer_to is None else answer_to
        it = (about.commit if isinstance(about, P.LogEntry) else about).iteration
        if answer_to is None:
            self.messages[it] = self.messages.get(it, 0) + 1
            signatures = len(message.payloads) + 1 if isinstance(message, P.LogEntry) else int(bool(message.signature))
            if signatures:
                signed = self.received_signed.setdefault(it, {})
                signed[dst] = signed.get(dst, 0) + signatures
        sent = self.sent.setdefault(it, {})
        sent[src] = sent.get(src, 0) + n
        a_src, up = self._link(src)
        a_dst, _ = self._link(dst)
        start = max(self.now, self._free.get(src, 0.0))
        self._free[src] = start + 8 * n / up
        return self._free[src] - self.now + a_src + a_dst

    def forget_sizes(self) -> None:
        self._sizes.clear()


@contextlib.contextmanager
def _cpu_timers(cpu: dict[int, float]):
    """Time the protocol's handlers (``P.on_push`` ...) per machine id while inside."""
    saved = {name: getattr(P, name) for name in _TIMED}

    def timed(fn):
        def call(params, st, *args, **kwargs):
            t0 = time.thread_time()  # CPU time: other processes on the machine do not count
            try:
                return fn(params, st, *args, **kwargs)
            finally:
                me = getattr(st, "me", None)
                cpu[me] = cpu.get(me, 0.0) + time.thread_time() - t0

        return call

    try:
        for name, fn in saved.items():
            setattr(P, name, timed(fn))
        yield
    finally:
        for name, fn in saved.items():
            setattr(P, name, fn)


def verify_cost_us(n: int = 200) -> float:
    """Microseconds one Ed25519 verification of a push-sized message takes on this machine (median of ``n``)."""
    from zeroth.transport import identity as _id

    ident = _id.Identity.generate()
    data = b"x" * 120
    sig = ident.sign(data)
    times = []
    for _ in range(n):
        t0 = time.perf_counter()
        _id.verify(ident.public, data, sig)
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e6


def measure(
    m: int,
    *,
    iterations: int = 3,
    warmup: int = 1,
    rtt_s: float = 0.1,
    uplink_bps: float = 20e6,
    compute_s: float = 0.05,
    call_slots: int | None = None,
    whole_commits: bool = False,
    pushes: str = "all",
    relay_fanout: int = 0,
    relay_parts: int = 1,
    spread: float = 1.0,
    seed: int = 0,
    budget_s: float = 120.0,
    max_count: int = 16,
    iteration_timeout_s: float = 3.0,
    barrier_timeout_s: float = 2.0,
) -> dict[str, Any]:
    """One row of the table for ``m`` peers (see the module docstring); ``ran`` False when the warm-up
    did not finish within ``budget_s`` seconds of this process's CPU time (``wall_s``, ``cpu_s``: what it took)."""
    params = P.Params(
        run_id="bench",
        config_digest="c",
        bytes_per_value=1,
        max_count=max_count,
        iterations=warmup + iterations + 1,
        iteration_timeout_s=iteration_timeout_s,
        barrier_timeout_s=barrier_timeout_s,
        founders=m,
        forming_timeout_s=3600.0,
        window=8,
        sign=_fake_sign,
        max_members=max(m, 1),
        pushes=pushes,
        relay_fanout=relay_fanout,
        relay_parts=relay_parts,
    )
    net = WanNet(
        params,
        rtt_s=rtt_s,
        uplink_bps=uplink_bps,
        seed=seed,
        call_slots=call_slots,
        whole_commits=whole_commits,
        spread=spread,
        tick=0.05,
        rejoin=True,  # a peer dropped (its decision replaced by a takeover's) rejoins, as the runtime's
    )
    cpu: dict[int, float] = {}
    t0, c0 = time.monotonic(), time.process_time()
    deadline = c0 + budget_s
    row: dict[str, Any] = {"peers": m, "ran": False}
    with _cpu_timers(cpu):
        net.start(m)
        for p in net.peers.values():
            p.compute_time = compute_s
        lead = net.peers["sim:1000"]

        def everyone(n):  # every peer applied n decisions (so every message of those iterations is counted)
            return lambda: (
                (len(lead.log) >= n and all(len(p.log) >= n for p in net.peers.values()))
                or time.process_time() > deadline
            )

        net.run_until(everyone(warmup), limit=1e9)
        if not everyone(warmup)() or len(lead.log) < warmup:
            row["wall_s"], row["cpu_s"] = time.monotonic() - t0, time.process_time() - c0
            return row
        base = (net.now, dict(cpu))
        net.forget_sizes()
        net.run_until(everyone(warmup + iterations), limit=1e9)
        end = net.now
    done = min(len(p.log) for p in net.peers.values())
    k = done - warmup
    row["wall_s"], row["cpu_s"] = time.monotonic() - t0, time.process_time() - c0
    if k < 1:
        return row
    its = range(warmup, warmup + k)
    sent: dict[str, float] = {}
    for t in its:
        for a, n in net.sent.get(t, {}).items():
            sent[a] = sent.get(a, 0) + n / k
    per_cpu = [(cpu.get(i, 0.0) - base[1].get(i, 0.0)) / k for i in range(m)]
    signed = [sum(net.received_signed.get(t, {}).get(a, 0) for t in its) / k for a in net.peers]
    busiest = max(sent.values())
    it_s = (end - base[0]) / k
    row.update(
        ran=True,
        iterations=k,
        messages=sum(net.messages.get(t, 0) for t in its) / k,
        bytes_all=sum(sent.values()),
        bytes_busiest=busiest,
        c=busiest / m,
        cpu_ms_mean=1e3 * statistics.mean(per_cpu),
        cpu_ms_max=1e3 * max(per_cpu),
        sig_checks_per_peer=statistics.mean(signed),
        sig_checks_max=max(signed),
        iteration_s=it_s,
        rtts=it_s / rtt_s,
        contributors=lead.counters.contributors[-k:],
        drops=sum(p.dropped for p in net.peers.values()),
    )
    return row


def _fmt_bytes(n: float) -> str:
    for unit in ("B", "KB", "MB", "GB"):
        if n < 1000 or unit == "GB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1000
    return str(n)


def table(rows: list[dict], verify_us: float) -> str:
    head = (
        f"{'M':>5} {'messages':>9} {'bytes all':>10} {'busiest':>10} {'c=busiest/M':>11} {'cpu/peer ms':>15} "
        f"{'sig checks/peer':>15} {'iteration s':>11} {'RTTs':>6} {'contributors':>12}"
    )
    lines = [head]
    for r in rows:
        if not r["ran"]:
            lines.append(
                f"{r['peers']:>5}  not run: its warm-up did not finish within the budget "
                f"({r.get('cpu_s', r['wall_s']):.0f} s of CPU)"
            )
            continue
        cpu = f"{r['cpu_ms_mean']:.2f} ({r['cpu_ms_max']:.2f})"
        lines.append(
            f"{r['peers']:>5} {r['messages']:>9,.0f} {_fmt_bytes(r['bytes_all']):>10} {_fmt_bytes(r['bytes_busiest']):>10} "
            f"{r['c']:>11,.0f} {cpu:>15} {r['sig_checks_per_peer']:>15,.0f} {r['iteration_s']:>11.2f} {r['rtts']:>6.1f} "
            f"{min(r['contributors']):>5}-{max(r['contributors'])}"
        )
    for r in rows:
        if r.get("drops"):
            lines.append(
                f"M={r['peers']}: {r['drops']} peer(s) dropped (a takeover replaced their decision) and rejoined"
            )
    lines.append(f"one Ed25519 verification here: {verify_us:.0f} us (sig checks/peer x that = signature CPU per peer)")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        prog="zeroth bench peers",
        description=__doc__.split("\n\n")[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    ap.add_argument(
        "--peers", default="4,16,64,256,1024", help="comma-separated numbers of peers (default 4,16,64,256,1024)"
    )
    ap.add_argument("--iterations", type=int, default=3, help="iterations measured after the warm-up (default 3)")
    ap.add_argument(
        "--warmup",
        type=int,
        default=1,
        help="iterations run before measuring (default 1); the relay tree orders its relays by what "
        "the earlier iterations' relays took, so its steady state needs more",
    )
    ap.add_argument("--rtt-ms", type=float, default=100.0, help="median round trip between two peers (default 100)")
    ap.add_argument("--uplink-mbps", type=float, default=20.0, help="median uplink per peer, Mbit/s (default 20)")
    ap.add_argument("--compute-s", type=float, default=0.05, help="gradient computation per iteration (default 0.05)")
    ap.add_argument(
        "--call-slots",
        type=int,
        default=0,
        help="calls in flight per peer; 0 = no limit, as the runtime's asynchronous sends (default); "
        "16 = a pool of 16 blocking sender threads, as the runtime had before",
    )
    ap.add_argument(
        "--whole-commits",
        action="store_true",
        help="size commits whole (every member in every commit), as the wire was before commit deltas",
    )
    ap.add_argument(
        "--pushes",
        choices=P.PUSHES,
        default="all",
        help="where pushes go (peers.pushes): all = every member (default), leader = the committer, which relays them",
    )
    ap.add_argument(
        "--relay-fanout",
        type=int,
        default=0,
        help="with --pushes leader: the relay tree's fan-out (peers.relay_fanout); 0 = the leader sends to all (default)",
    )
    ap.add_argument(
        "--relay-parts",
        type=int,
        default=1,
        help="with --relay-fanout: the relayed payloads go in this many parts, each forwarded as it "
        "arrives (peers.relay_parts; default 1)",
    )
    ap.add_argument(
        "--spread",
        type=float,
        default=1.0,
        help="scales the log-normal spreads of the access delays (0.5) and uplinks (0.7); 0 = every peer "
        "at the medians, a uniform --rtt-ms and --uplink-mbps (default 1)",
    )
    ap.add_argument("--budget-s", type=float, default=120.0, help="CPU seconds per M at most (default 120)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", action="store_true", help="print one JSON object")
    args = ap.parse_args(argv)
    try:
        ms = [int(x) for x in args.peers.split(",") if x.strip()]
    except ValueError:
        print(f"zeroth bench peers: --peers must be comma-separated integers, got {args.peers!r}", file=sys.stderr)
        return 2
    if not ms or any(not 1 <= m <= P.MAX_MEMBERS for m in ms):
        print(
            f"zeroth bench peers: each number of peers must be from 1 to {P.MAX_MEMBERS}, got {args.peers!r}",
            file=sys.stderr,
        )
        return 2
    if (
        args.iterations < 1
        or args.warmup < 1
        or args.rtt_ms <= 0
        or args.uplink_mbps <= 0
        or args.compute_s < 0
        or args.call_slots < 0
        or args.relay_fanout < 0
        or not 1 <= args.relay_parts <= P.MAX_MEMBERS
        or args.spread < 0
        or args.budget_s <= 0
    ):
        print(
            "zeroth bench peers: --iterations and --warmup must be >= 1, --rtt-ms, --uplink-mbps and --budget-s > 0, "
            f"--compute-s, --call-slots and --spread >= 0, --relay-parts from 1 to {P.MAX_MEMBERS}",
            file=sys.stderr,
        )
        return 2
    rows = []
    for m in ms:
        rows.append(
            measure(
                m,
                iterations=args.iterations,
                warmup=args.warmup,
                rtt_s=args.rtt_ms / 1e3,
                uplink_bps=args.uplink_mbps * 1e6,
                compute_s=args.compute_s,
                call_slots=args.call_slots or None,
                whole_commits=args.whole_commits,
                pushes=args.pushes,
                relay_fanout=args.relay_fanout,
                relay_parts=args.relay_parts,
                spread=args.spread,
                seed=args.seed,
                budget_s=args.budget_s,
            )
        )
        if not args.json:
            print(f"[zeroth bench peers] M={m}: {rows[-1]['wall_s']:.1f} s", file=sys.stderr)
    vus = verify_cost_us()
    settings = {
        k: getattr(args, k)
        for k in (
            "iterations",
            "warmup",
            "rtt_ms",
            "uplink_mbps",
            "compute_s",
            "call_slots",
            "whole_commits",
            "pushes",
            "relay_fanout",
            "relay_parts",
            "spread",
            "budget_s",
            "seed",
        )
    }
    if args.json:
        print(json.dumps({"settings": settings, "verify_us": vus, "rows": rows}, indent=2))
    else:
        print(table(rows, vus))
    return 0
