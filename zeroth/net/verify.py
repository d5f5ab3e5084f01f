"""``zeroth verify``: replay a Just One Byte run's update logs on this machine and check every
digest its peers recorded.

:func:`verify` reads every update log under a folder (:mod:`zeroth.net.updatelog`), checks each
run's signed decisions and their chain, replays it with this machine's exact rule and compares
every recorded digest and saved state; the steps are described in the docs
(``docs/guides/proving_a_run.md``, "What verify checks").
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, NamedTuple

import jax
import numpy as np

from zeroth import reference as _ref
from zeroth import replay as _replay
from zeroth import rng as _rng
from zeroth.config import load_config_dict
from zeroth.net import counters as _counters
from zeroth.net import protocol as P
from zeroth.net import state as _state
from zeroth.net import updatelog as _log
from zeroth.net.work import Worker
from zeroth.transport import identity as _id

__all__ = [
    "Report",
    "RunCheck",
    "PeerCheck",
    "find_logs",
    "verify",
]

IMPLS = ("auto", "native", "pallas", "jnp", "reference")


class PeerCheck(NamedTuple):
    """What one log recorded for one run, against the replay."""

    log: str  # the log's folder, relative to the verified folder
    starts: tuple[tuple[int, str], ...]  # (iteration, reason) of each START record of this run
    first: int  # the first iteration whose state it recorded
    last: int  # the state at the start of ``last`` is the newest it recorded
    checked: int  # digests compared with the replay
    agreed: int
    first_mismatch: int | None  # the first iteration whose recorded state differs from the replay's
    replaced: int  # states it recorded after decisions the run did not take (it dropped out and recovered)
    replaced_at: int | None  # the first such decision's iteration


class RunCheck(NamedTuple):
    """One run id's verification."""

    run_id: str
    source: str  # the state the replay started from
    first: int
    last: int  # the replay ended at the start of this iteration
    final_digest: str | None
    peers: tuple[PeerCheck, ...]
    commits_signed: int  # commits whose signature was checked
    pushes_signed: int
    problems: tuple[str, ...]
    keys_proven: int | None = None  # signing keys on the chain proven by the run secret (None: not checked)
    states_agreed: int = 0  # saved states of the run (checkpoints) whose content is the replay's state
    barrier: dict | None = None  # zeroth.net.counters.from_decisions over the chain's decisions

    @property
    def ok(self) -> bool:
        return not self.problems and all(p.agreed == p.checked for p in self.peers)


class Report(NamedTuple):
    path: str
    impl: str
    backend: str
    runs: tuple[RunCheck, ...]
    notes: tuple[str, ...]  # e.g. a log's last record cut short
    seconds: float
    reported: tuple[tuple[str, dict], ...] = ()  # (log, the barrier totals its peer's metrics.jsonl reported last)

    @property
    def ok(self) -> bool:
        return bool(self.runs) and all(r.ok for r in self.runs)


def find_logs(path: str | Path) -> list[Path]:
    """The update logs at ``path``: the file itself, or every :data:`zeroth.net.updatelog.FILENAME` below the folder."""
    path = Path(path)
    if path.is_file():
        return [path]
    if not path.is_dir():
        raise FileNotFoundError(f"{path} is neither an update log nor a folder")
    return sorted(path.rglob(_log.FILENAME))


# --------------------------------------------------------------------------- the exact rule, by implementation


class _Replayer:
    """The run's exact rule on this machine: ``initial()``, ``apply(params, t, entry)``, ``digest(params)``,
    ``host(params)`` (a copy kept for another run to start from) and ``load(host)``."""

    def __init__(self, cfg, impl: str):
        self.cfg, self.impl = cfg, impl
        self.worker = Worker(cfg)
        self.template = self.worker.template()

    def initial(self):
        return self.load(jax.device_get(self.worker.initial_params()))

    def load(self, host):
        if self.impl == "reference":
            with_path, _ = jax.tree_util.tree_flatten_with_path(host)
            return {_rng.leaf_path(p): np.array(x) for p, x in with_path}
        return jax.tree_util.tree_map(lambda x: jax.numpy.array(x, copy=True), host)

    def host(self, params):
        if self.impl == "reference":
            leaves, treedef = jax.tree_util.tree_flatten_with_path(self.template)
            return jax.tree_util.tree_unflatten(treedef, [params[_rng.leaf_path(p)].copy() for p, _ in leaves])
        return jax.device_get(params)

    def digest(self, params) -> str:
        if self.impl == "reference":
            return _ref.checksum_leaves(params)
        return _replay.checksum(params)

    def apply(self, params, t: int, entry: P.LogEntry):
        c = entry.commit
        if self.impl != "reference":  # the peers' own code path ("auto"), or it with another kernel
            return self.worker.apply(params, t, c.contributors, entry.payloads, self.cfg.peers.clip, impl=self.impl)[0]
        keys, coefficients, _ = self.worker.updates(t, c.contributors, entry.payloads, self.cfg.peers.clip)
        ups = list(zip(keys, coefficients.tolist(), strict=True))
        params = {path: _ref.replay_leaf(x, path, ups, self.worker.distribution) for path, x in params.items()}
        if self.cfg.train.weight_decay:  # the iteration's second unit, at the iteration's learning rate
            d = _ref.decay_factor(self.worker.schedule(t), self.cfg.train.weight_decay)
            params = {path: _ref.decay_leaf(x, d) for path, x in params.items()}
        return params


# --------------------------------------------------------------------------- checks of the logs


def _signature_ok(key: bytes, msg) -> bool:
    return bool(key) and bool(msg.signature) and _id.verify(key, P.signed_bytes(msg), msg.signature)


class _Run:
    """Every log's records of one run id.

    Decisions are told apart by :func:`zeroth.net.protocol.chain_digest` (their value and every
    decision before them). Two logs may hold different decisions of one iteration: a peer that
    applied a decision no majority took, then dropped out and took the run's state again (the
    protocol's recovery); :meth:`chain` picks the run's own, the one the decisions after it continue.
    """

    def __init__(self, run_id: str):
        self.run_id = run_id
        self.config: dict | None = None
        self.decisions: dict[int, dict[bytes, tuple[P.LogEntry, list[str]]]] = {}  # t -> chain -> (entry, logs)
        # t -> [(entry, log)]: every other log's copy of a decision that differs from the first
        # one read (a signature, a ballot): each copy is checked on its own
        self.copies: dict[int, list[tuple[P.LogEntry, str]]] = {}
        self.records: dict[
            str, list[tuple[int, bytes | None, str]]
        ] = {}  # log -> [(t, chain or None for a START, digest)]
        self.starts: dict[str, list[tuple[int, str, str]]] = {}  # log -> [(iteration, reason, digest)]
        self.owned: list[tuple[str, int, bytes, bytes]] = []  # (log, iteration, key, proof) of each START
        self.problems: list[str] = []

    def add(self, log: str, seg: _log.Segment) -> None:
        s = seg.start
        if self.config is None:
            self.config = s["config"]
        elif s["config"] != self.config:
            self.problems.append(f"{log}: its config for run {self.run_id} differs from another log's")
        it, digest = int(s["iteration"]), str(s["digest"])
        self.starts.setdefault(log, []).append((it, str(s["reason"]), digest))
        try:
            self.owned.append((log, it, bytes.fromhex(str(s.get("key", ""))), bytes.fromhex(str(s.get("proof", "")))))
        except ValueError:
            self.problems.append(f"{log}: the START at iteration {it} names a key or proof that is not hex")
        recs = self.records.setdefault(log, [])
        recs.append((it, None, digest))
        for a in seg.applied:
            t, chain = a.iteration, P.chain_digest(a.entry.commit)
            held = self.decisions.setdefault(t, {}).get(chain)
            if held is None:
                self.decisions[t][chain] = (a.entry, [log])
            elif held[0].payloads != a.entry.payloads:
                self.problems.append(
                    f"{log} and {held[1][0]} logged different payloads for one decision of iteration {t}"
                )
            else:
                if log not in held[1]:
                    held[1].append(log)
                if a.entry != held[0]:
                    self.copies.setdefault(t, []).append((a.entry, log))
            recs.append((t + 1, chain, a.digest))

    def first(self) -> tuple[int, str]:
        """The earliest (iteration, digest) a process of this run started from."""
        return min((it, d) for starts in self.starts.values() for it, _, d in starts)

    def chain(self, first: int) -> dict[int, bytes]:
        """``{t: chain digest}`` of the run's decisions from ``first`` on, as long as they continue
        one another: at each iteration the candidate that continues the previous one, and of several
        the one a decision of the next iteration continues, else the one most logs hold."""
        out: dict[int, bytes] = {}
        previous: bytes | None = None
        t = first
        while t in self.decisions:
            cands = {c: e for c, e in self.decisions[t].items() if previous is None or e[0].commit.previous == previous}
            if not cands:
                break
            nxt = {e[0].commit.previous for e in self.decisions.get(t + 1, {}).values()}
            pick = max(cands, key=lambda c: (c in nxt, len(cands[c][1])))
            out[t] = previous = pick
            t += 1
        return out

    def keys(self) -> dict[int, bytes]:
        out: dict[int, bytes] = {}
        for t in sorted(self.decisions):
            for entry, _ in self.decisions[t].values():
                for m in entry.commit.next_view.members:
                    if m.key and out.setdefault(m.machine, m.key) != m.key:
                        self.problems.append(f"iteration {t}: machine {m.machine} appears with a second public key")
        return out

    def check_signatures(self) -> tuple[int, int]:
        """Check every logged decision's ``updates_digest`` and, for a signed run, its commit's and
        payloads' signatures (decisions the run replaced included); returns (commits, payloads) checked."""
        keys = self.keys()
        signed = any(keys.values())
        commits = pushes = 0
        for t in sorted(self.decisions):
            copies = [(entry, logs[0]) for entry, logs in self.decisions[t].values()] + self.copies.get(t, [])
            for entry, log in copies:
                c, where = entry.commit, f"iteration {t} ({log})"
                if P.updates_digest(c.contributors, entry.payloads) != c.updates_digest:
                    self.problems.append(f"{where}: the payloads do not match the commit's updates_digest")
                if not signed:
                    continue
                commits += 1
                if not _signature_ok(keys.get(c.sender, b""), c):
                    self.problems.append(f"{where}: the commit's signature is not machine {c.sender}'s")
                for (m, n), payload, sig in zip(c.contributors, entry.payloads, entry.signatures, strict=True):
                    pushes += 1
                    if not _signature_ok(keys.get(m, b""), P.Push(c.run_id, m, t, n, payload, sig, c.previous)):
                        self.problems.append(f"{where}: the payload of machine {m} is not signed by it")
        return commits, pushes

    def check_authorship(self, secret: str, chain: dict[int, bytes]) -> int:
        """Check that every key that signed a decision of ``chain`` belongs to a process that held
        ``secret``: a START record of some log names it with a valid
        :func:`zeroth.transport.identity.log_proof`. Returns how many signing keys were proven."""
        proven = set()
        for log, it, key, proof in self.owned:
            if not key:
                continue
            if _id.check_log_proof(secret, proof, self.run_id, key):
                proven.add(key)
            else:
                self.problems.append(
                    f"{log}: the START at iteration {it} names key {key.hex()[:16]}... "
                    + (
                        "without a proof of the run secret"
                        if not proof
                        else "with a proof that does not match the run secret"
                    )
                )
        keys = self.keys()
        if not any(keys.values()):
            self.problems.append(
                f"run {self.run_id} is not signed (peers.insecure): no key to prove against the run secret"
            )
            return 0
        signers: dict[bytes, tuple[int, int]] = {}  # key -> (machine, first iteration it signs)
        for t, c in sorted(chain.items()):
            commit = self.decisions[t][c][0].commit
            for m in (commit.sender, *(m for m, _ in commit.contributors)):
                signers.setdefault(keys.get(m, b""), (m, t))
        for key, (m, t) in signers.items():
            if key not in proven:
                self.problems.append(
                    f"machine {m} signs from iteration {t} with a key that no log proves to be held by "
                    f"a process with the run secret: its decisions are not shown to be this run's"
                )
        return sum(key in proven for key in signers)


class _Saved(NamedTuple):
    """A saved state below the verified folder (:func:`zeroth.net.state.save_state`) whose files check."""

    folder: Path
    run_id: str
    iteration: int
    digest: str


def _saved_states(root: Path) -> tuple[list[_Saved], list[str]]:
    """Every saved state below ``root`` whose files check, and a note for each ``state.json`` that does not."""
    out, notes = [], []
    for meta in sorted(root.rglob("state.json")) if root.is_dir() else []:
        try:
            info = _state.check_state(meta.parent)
        except (OSError, ValueError) as e:  # damaged, or not a saved state: another may hold the same
            notes.append(f"{meta.parent.relative_to(root)}: a saved state that does not read back, left out ({e})")
            continue
        out.append(_Saved(meta.parent, str(info.get("run_id", "")), int(info["iteration"]), str(info["digest"])))
    return out, notes


def _check_saved(run: _Run, saved: list[_Saved], root: Path, template, digests: dict[int, str]) -> int:
    """Compare every saved state of ``run`` with the replay's state at its iteration: its content's
    digest (:func:`zeroth.net.state.load_state` recomputes it) must be the replay's. Returns how many agree."""
    agreed = 0
    for s in saved:
        if s.run_id != run.run_id:
            continue
        where = f"the saved state {s.folder.relative_to(root)} (iteration {s.iteration})"
        if s.iteration not in digests:
            run.problems.append(f"{where} lies outside what the replay reached")
            continue
        try:
            _, _, digest = _state.load_state(s.folder, template)
        except (OSError, ValueError) as e:
            run.problems.append(f"{where} does not load: {e}")
            continue
        if digest != digests[s.iteration]:
            run.problems.append(
                f"{where} has digest {digest[:16]}, the replay's state there {digests[s.iteration][:16]}"
            )
        else:
            agreed += 1
    return agreed


def _verify_run(
    run: _Run,
    root: Path,
    impl: str,
    states: dict[tuple[int, str], Any],
    wanted: set[tuple[int, str]],
    progress: Callable[[str], None],
    secret: str | None,
    saved: list[_Saved],
) -> RunCheck:
    problems = run.problems
    cfg = load_config_dict(run.config)
    replayer = _Replayer(cfg, impl)
    first, first_digest = run.first()
    params, source = None, ""
    if first == 0:
        params, source = replayer.initial(), "the config's initial parameters"
    elif (first, first_digest) in states:
        params, source = (
            replayer.load(states[(first, first_digest)]),
            f"the state another run of {root} reached at iteration {first}",
        )
    else:
        for s in saved:  # a saved state of that iteration and digest, of any run (a resumed run's is the one before)
            if (s.iteration, s.digest) != (first, first_digest):
                continue
            try:
                host, _, _ = _state.load_state(s.folder, replayer.template)
            except (OSError, ValueError):  # its content is not what its state.json says: another may hold it
                continue
            params, source = replayer.load(host), f"the checkpoint {s.folder}"
            break
    if params is None:
        problems.append(
            f"run {run.run_id} starts at iteration {first} (digest {first_digest[:12]}) from a state "
            f"that neither another log nor a checkpoint under {root} holds: nothing to replay from"
        )
        return _report(run, source, first, first, None, {}, {}, 0, 0)
    commits, pushes = run.check_signatures()
    chain = run.chain(first)
    proven = None if secret is None else run.check_authorship(secret, chain)
    last = max(chain, default=first - 1) + 1
    digests: dict[int, str] = {}
    last_say = time.monotonic()
    t = first
    while True:
        digest = replayer.digest(params)
        digests[t] = digest
        if (t, digest) in wanted:
            states[(t, digest)] = replayer.host(params)
        if t >= last:
            break
        params = replayer.apply(params, t, run.decisions[t][chain[t]][0])
        t += 1
        if time.monotonic() - last_say > 2.0:
            progress(f"run {run.run_id}: iteration {t}/{last}")
            last_say = time.monotonic()
    newest = max(run.decisions, default=first - 1) + 1
    if last < newest:
        problems.append(
            f"the decisions stop continuing one another at iteration {last} (logs reach {newest}): "
            f"no log holds a decision of iteration {last} that continues the one before it"
        )
    states_agreed = _check_saved(run, saved, root, replayer.template, digests)
    return _report(run, source, first, last, digests.get(last), digests, chain, commits, pushes, proven, states_agreed)


def _report(
    run: _Run,
    source: str,
    first: int,
    last: int,
    final: str | None,
    digests: dict[int, str],
    chain: dict[int, bytes],
    commits: int,
    pushes: int,
    proven: int | None = None,
    states: int = 0,
) -> RunCheck:
    peers = []
    for log, recs in sorted(run.records.items()):
        checked = agreed = replaced = beyond = 0
        mismatch = replaced_at = None
        for t, c, d in recs:
            if c is not None and chain.get(t - 1) != c:  # the state after a decision the run did not take
                replaced += 1
                replaced_at = t - 1 if replaced_at is None else replaced_at
                continue
            if t not in digests:
                beyond += 1
                continue
            checked += 1
            if digests[t] == d:
                agreed += 1
            elif mismatch is None:
                mismatch = t
        if beyond:
            run.problems.append(f"{log}: {beyond} recorded digest(s) lie beyond what the replay reached")
        its = [t for t, _, _ in recs]
        peers.append(
            PeerCheck(
                log,
                tuple((it, reason) for it, reason, _ in run.starts[log]),
                min(its),
                max(its),
                checked,
                agreed,
                mismatch,
                replaced,
                replaced_at,
            )
        )
    barrier = _counters.from_decisions(run.decisions[t][chain[t]][0] for t in sorted(chain)) if chain else None
    return RunCheck(
        run.run_id,
        source,
        first,
        last,
        final,
        tuple(peers),
        commits,
        pushes,
        tuple(run.problems),
        proven,
        states,
        barrier,
    )


def verify(
    path: str | Path, *, impl: str = "auto", progress: Callable[[str], None] | None = None, secret: str | None = None
) -> Report:
    """Verify every run whose update logs lie at ``path`` (the steps: ``docs/guides/proving_a_run.md``).

    Args:
      path: a run's output folder (every log below it), or one ``updates.log``.
      impl: ``"auto"`` (the peers' own replay), ``"native"``, ``"pallas"``, ``"jnp"`` (a kernel
        of :func:`zeroth.kernels.perturb.fused_apply_updates`) or ``"reference"`` (NumPy).
      progress: called with a line now and then on long replays.
      secret: the run secret (``OUT/run.secret``): also check that every key that signed a
        decision the replay follows is proven, by the START record of the log of the process that
        held it, to belong to a process with this secret (step 5 of ``docs/guides/proving_a_run.md``).

    Raises:
      FileNotFoundError: no such file or folder, or no update log in it.
      ValueError: a damaged log (named), an unknown ``impl``, a config the replay cannot build.
    """
    if impl not in IMPLS:
        raise ValueError(f"impl must be one of {', '.join(IMPLS)}; got {impl!r}")
    t0 = time.monotonic()
    root = Path(path)
    files = find_logs(root)
    if not files:
        raise FileNotFoundError(f"no {_log.FILENAME} under {root}: is it the output folder of a Just One Byte run?")
    base = root if root.is_dir() else root.parent
    runs: dict[str, _Run] = {}
    notes = []
    for f in files:
        log = _log.read(f)
        label = str(f.parent.relative_to(base)) if f.parent != base else f.parent.name
        if log.truncated:
            notes.append(f"{label}: its last record was cut short ({log.truncated} bytes, left out)")
        for seg in log.segments:
            run_id = str(seg.start["run_id"])
            runs.setdefault(run_id, _Run(run_id)).add(label, seg)
    if not runs:
        raise ValueError(
            f"the update logs under {root} hold no records: no peer of it took a state "
            f"({', '.join(str(f) for f in files[:4])}{', ...' if len(files) > 4 else ''})"
        )
    order = sorted(runs.values(), key=lambda r: r.first())
    wanted = {r.first() for r in order}
    states: dict[tuple[int, str], Any] = {}
    say = progress or (lambda _line: None)
    saved, unread = _saved_states(base)
    checks = tuple(_verify_run(r, base, impl, states, wanted, say, secret, saved) for r in order)
    reported = tuple(
        (str(f.parent.relative_to(base)) if f.parent != base else f.parent.name, got)
        for f in files
        if (got := _reported(f.parent / "metrics.jsonl"))
    )
    return Report(
        str(root), impl, jax.default_backend(), checks, tuple(notes + unread), time.monotonic() - t0, reported
    )


def _reported(path: Path) -> dict | None:
    """The barrier totals (:data:`zeroth.net.counters.TOTALS`) of the last train row of a peer's
    ``metrics.jsonl`` that has them (None: no such file or row; a line that is not JSON is skipped)."""
    if not path.is_file():
        return None
    last = None
    for line in path.read_text(errors="replace").splitlines():
        try:
            row = json.loads(line)
        except ValueError:
            continue
        if isinstance(row, dict) and row.get("kind") == "train" and all(k in row for k in _counters.TOTALS):
            last = row
    return None if last is None else {k: last[k] for k in _counters.TOTALS}


# --------------------------------------------------------------------------- the command


def _peer_line(p: PeerCheck) -> str:
    how = ", ".join(f"{reason} at {it}" for it, reason in p.starts)
    verdict = (
        "every digest reproduced"
        if p.agreed == p.checked
        else f"{p.checked - p.agreed} differ, first at iteration {p.first_mismatch}"
    )
    extra = (
        (
            f"; {p.replaced} state(s) after a decision of iteration {p.replaced_at} that the run replaced "
            f"(it dropped out and took the run's state again)"
        )
        if p.replaced
        else ""
    )
    return f"    {p.log:<12} iterations {p.first}-{p.last} ({how}): {p.agreed}/{p.checked} digests, {verdict}{extra}"


def format_report(r: Report) -> str:
    lines = [
        f"zeroth verify {r.path}: {len(r.runs)} run(s), replayed on {r.backend} with impl {r.impl} in {r.seconds:.1f}s"
    ]
    for run in r.runs:
        lines.append(f"  run {run.run_id}: iterations {run.first}-{run.last} from {run.source or 'nothing'}")
        lines += [_peer_line(p) for p in run.peers]
        if run.commits_signed:
            lines.append(f"    signatures  {run.commits_signed} commits and {run.pushes_signed} payloads checked")
        else:
            lines.append("    signatures  none (an unsigned run)")
        if run.keys_proven is None:
            lines.append("    authorship  not checked (give --secret-file: each signing key's proof of the run secret)")
        elif run.keys_proven:
            lines.append(
                f"    authorship  {run.keys_proven} signing keys, each proven to be held by a process with the run secret"
            )
        if run.states_agreed:
            lines.append(
                f"    saved states {run.states_agreed} (checkpoints), each the replay's state at its iteration"
            )
        if run.barrier:
            b = run.barrier
            lines.append(
                f"    barrier     contributors per iteration min {b['contributors_min']} median {b['contributors_median']} "
                f"max {b['contributors_max']} over {b['iterations']} decisions; {b['missed_barrier']} active "
                f"member(s) missed it in {b['iterations_with_missed']} iteration(s); "
                f"{b['forward_passes_applied']} forward passes applied"
            )
        if run.final_digest:
            lines.append(f"    final digest {run.final_digest}")
        lines += [f"    PROBLEM: {p}" for p in run.problems]
    for log, got in r.reported:
        lines.append(
            f"  reported by {log}: {got['pushes_late']} own push(es) late, {got['forward_passes_wasted']} forward "
            f"passes wasted, {got['late_pushes_received']} late push(es) received, "
            f"{got['barrier_wait_s_total']:.2f}s at the barrier"
        )
    lines += [f"  note: {n}" for n in r.notes]
    lines.append(
        "verified: every digest the peers recorded follows from the log on this machine"
        if r.ok
        else "NOT verified: see above"
    )
    return "\n".join(lines)


def _as_json(r: Report) -> dict:
    return {
        "path": r.path,
        "impl": r.impl,
        "backend": r.backend,
        "seconds": r.seconds,
        "ok": r.ok,
        "notes": list(r.notes),
        "reported": {log: got for log, got in r.reported},
        "runs": [
            {
                **{k: v for k, v in run._asdict().items() if k != "peers"},
                "ok": run.ok,
                "peers": [p._asdict() for p in run.peers],
            }
            for run in r.runs
        ],
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        prog="zeroth verify", description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("path", help="a Just One Byte run's output folder (zeroth run ... --out PATH), or one updates.log")
    ap.add_argument(
        "--impl",
        default="auto",
        choices=IMPLS,
        help="the exact rule to replay with: auto (the peers' own path on this machine), a kernel "
        "(native, pallas, jnp) or reference (the NumPy specification); default auto",
    )
    ap.add_argument(
        "--secret-file",
        default=None,
        metavar="FILE",
        help="the run secret (OUT/run.secret): also prove that every signing key belongs to a process "
        "that held it, so a log made with anybody else's keys does not verify",
    )
    ap.add_argument("--json", action="store_true", help="print one JSON object instead of the report")
    args = ap.parse_args(argv)
    try:
        secret = _id.read_secret(args.secret_file) if args.secret_file else None
        report = verify(
            args.path,
            impl=args.impl,
            secret=secret,
            progress=lambda line: print(f"[zeroth verify] {line}", file=sys.stderr),
        )
    except (FileNotFoundError, ValueError) as e:
        print(f"zeroth verify: {e}", file=sys.stderr)
        return 2
    print(json.dumps(_as_json(report), indent=2) if args.json else format_report(report))
    return 0 if report.ok else 1
