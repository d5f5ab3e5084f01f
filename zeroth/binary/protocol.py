"""The sparse-mutation parameter server as a pure state machine (no sockets, no clock of its own).

Every function takes the state and a message (and ``now``, seconds, where a deadline matters) and
returns a new state and a reply; bad messages raise :class:`Rejected` with a gRPC status name
and a message naming the problem. :mod:`zeroth.binary.service` is a thin gRPC layer over it.

Round 0 opens when ``founders`` workers have joined. A round ``r`` closes when every live
worker has submitted, or at its deadline (``round_timeout_s`` after its first list arrived): the
silent workers are dropped. Either way it closes only with at least ``min_workers`` lists; with
fewer it stays open, and a worker joining or rejoining then takes part in it at once. A dropped
worker rejoins with its id (:func:`rejoin`) and takes part from the next round it can join.
Closing sums the lists in
worker-id order (float64, then float32), drops mutations whose weight is at its limit, picks the
``k`` best (:func:`zeroth.binary.flips.select`), applies them to the packed model and records the
result with the model's SHA-256.

**Identity.** A worker's first :func:`join` commits its Ed25519 public key to the id it is given
(the service checks first that the joiner holds the run secret). Every later message naming that
id is signed with the key: a list (:func:`submission_bytes`), a rejoin (:func:`rejoin_bytes`) and
a result request (:func:`result_request_bytes`); one whose signature does not verify under the
committed key is refused with ``PERMISSION_DENIED`` and changes nothing, so a holder of the run
secret cannot speak for another worker. Error messages name the problem, never the run id.

**The packed model** (:func:`model_bytes`): the sign plane ``u32[O, 9 words(C)]``, the mask plane
(ternary only), the ``int32[O]`` thresholds and, when the run has one, the frozen float32 head
(trained by the launcher on the initial features, never updated by the rounds), little-endian,
concatenated. Its SHA-256 is the checksum peers compare.

Example:
  >>> import numpy as np
  >>> cfg = ServerConfig(run_id="r", c_in=2, c_out=1, ternary=False, k=1, rounds=1)
  >>> st = init_state(cfg, np.ones((1, 18), np.int8), np.zeros(1, np.int32))
  >>> from zeroth.transport.identity import Identity
  >>> st, reply = join(st, cfg, "r", Identity.generate().public, now=0.0)
  >>> reply.worker_id, reply.round
  (0, 0)
"""

from __future__ import annotations

import hashlib
from typing import NamedTuple

import numpy as np

from zeroth.binary import flips as F
from zeroth.binary import reference as R
from zeroth.transport import identity

__all__ = [
    "Rejected",
    "ServerConfig",
    "ServerState",
    "JoinReply",
    "DeltaList",
    "RoundResult",
    "model_bytes",
    "model_from_bytes",
    "checksum",
    "init_state",
    "join",
    "rejoin",
    "submit",
    "submission_bytes",
    "rejoin_bytes",
    "result_request_bytes",
    "tick",
    "result",
    "dense_bytes",
]


class Rejected(Exception):
    """A message the server refuses: ``code`` is a gRPC status name, ``message`` says what was wrong."""

    def __init__(self, code: str, message: str):
        super().__init__(f"{code}: {message}")
        self.code, self.message = code, message


class ServerConfig(NamedTuple):
    run_id: str
    c_in: int
    c_out: int
    ternary: bool
    k: int  # mutations applied per round
    rounds: int  # rounds of the run
    min_gain: float = 0.0  # a mutation must lower the summed loss by more than this
    max_entries: int = 1 << 16  # longest accepted list
    round_timeout_s: float = 5.0  # a round closes at this deadline with whoever submitted
    founders: int = 1  # round 0 waits until this many workers have joined
    regions: int = 0  # the model carries a frozen float32 head f32[regions, c_out, classes] + f32[classes]
    classes: int = 0  # (0 = no head in the model: workers use a fixed votes head)
    min_workers: int = 1  # a round closes only with at least this many lists

    @property
    def n_weights(self) -> int:
        return self.c_out * 9 * self.c_in


class ServerState(NamedTuple):
    w: np.ndarray  # int8[O, 9 C]
    thresh: np.ndarray  # int32[O]
    round: int
    opened_at: float  # when the open round received its first list (its deadline runs from there)
    live: tuple  # worker ids taking part in the current round
    next_id: int
    pending: dict  # worker id -> (indices int64[n], deltas float32[n])
    results: dict  # round -> RoundResult
    checksum: str
    start: dict  # worker id -> the first round it takes part in
    head: tuple | None  # (f32[R, O, K], f32[K]) frozen head shipped with the model, or None
    keys: dict = {}  # worker id -> its committed Ed25519 public key (32 bytes)


class JoinReply(NamedTuple):
    worker_id: int
    round: int
    model: bytes
    checksum: str
    n_mutations: int
    max_entries: int
    finished: bool
    model_round: int  # the model is the state at the start of this round (round - 1 or round)


class DeltaList(NamedTuple):
    run_id: str
    worker_id: int
    round: int
    index: np.ndarray  # int64[n], strictly increasing
    delta: np.ndarray  # float32[n]
    checksum: str
    examples: int = 0
    loss: float = 0.0
    signature: bytes = b""  # the worker's Ed25519 signature of submission_bytes(self)


class RoundResult(NamedTuple):
    ready: bool
    round: int
    mutations: tuple = ()
    checksum: str = ""
    contributors: tuple = ()
    dropped: tuple = ()
    finished: bool = False


def model_bytes(w, thresh, c_in: int, ternary: bool, head=None) -> bytes:
    """The packed model: sign words, mask words (ternary), thresholds, then the frozen head (if any); little-endian."""
    w = np.asarray(w)
    o = w.shape[0]
    v = w.reshape(o, 9, c_in)
    parts = [R.pack(v < 0).reshape(o, -1)]
    if ternary:
        parts.append(R.pack(v != 0).reshape(o, -1))
    data = b"".join(p.astype("<u4").tobytes() for p in parts) + np.asarray(thresh).astype("<i4").tobytes()
    if head is not None:
        data += b"".join(np.asarray(h, np.float32).astype("<f4").tobytes() for h in head)
    return data


def model_from_bytes(data: bytes, c_in: int, c_out: int, ternary: bool, *, regions: int = 0, classes: int = 0):
    """Inverse of :func:`model_bytes`: ``(int8[O, 9 C] values, int32[O] thresholds, head or None)``."""
    wc = R.n_words(c_in)
    plane = c_out * 9 * wc * 4
    head_bytes = 4 * (regions * c_out * classes + classes) if regions and classes else 0
    want = plane * (2 if ternary else 1) + 4 * c_out + head_bytes
    if len(data) != want:
        raise ValueError(
            f"packed model has {len(data)} bytes; a {c_out}x9x{c_in} {'ternary' if ternary else 'binary'} "
            f"layer{' with its head' if head_bytes else ''} has {want}"
        )
    sign = np.frombuffer(data[:plane], "<u4").reshape(c_out, 9, wc)
    if ternary:
        mask = np.frombuffer(data[plane : 2 * plane], "<u4").reshape(c_out, 9, wc)
        w = R.unpack_ternary(sign, mask, c_in)
    else:
        w = R.unpack(sign, c_in)
    end = want - head_bytes
    thresh = np.frombuffer(data[end - 4 * c_out : end], "<i4").astype(np.int32)
    head = None
    if head_bytes:
        flat = np.frombuffer(data[end:], "<f4").astype(np.float32)
        head = (flat[: regions * c_out * classes].reshape(regions, c_out, classes), flat[regions * c_out * classes :])
    return w.reshape(c_out, -1).astype(np.int8), thresh, head


def checksum(w, thresh, c_in: int, ternary: bool, head=None) -> str:
    """SHA-256 hex of :func:`model_bytes` (without a head it equals :func:`zeroth.binary.layers.layer_checksum`)."""
    return hashlib.sha256(model_bytes(w, thresh, c_in, ternary, head)).hexdigest()


def dense_bytes(cfg: ServerConfig) -> int:
    """Bytes of a dense float32 gradient of the same model (one float per weight)."""
    return 4 * cfg.n_weights


def init_state(cfg: ServerConfig, w, thresh, *, head=None, now: float = 0.0) -> ServerState:
    w, thresh = np.array(w, np.int8), np.array(thresh, np.int32)
    if w.shape != (cfg.c_out, 9 * cfg.c_in) or thresh.shape != (cfg.c_out,):
        raise ValueError(f"model shapes {w.shape}, {thresh.shape} do not match config ({cfg.c_out}, {9 * cfg.c_in})")
    if (head is None) != (cfg.regions == 0 or cfg.classes == 0):
        raise ValueError(
            f"config regions={cfg.regions}, classes={cfg.classes} but head is {'absent' if head is None else 'given'}"
        )
    if head is not None:
        head = (np.array(head[0], np.float32), np.array(head[1], np.float32))
        if head[0].shape != (cfg.regions, cfg.c_out, cfg.classes) or head[1].shape != (cfg.classes,):
            raise ValueError(f"head shapes {head[0].shape}, {head[1].shape} do not match config")
    digest = checksum(w, thresh, cfg.c_in, cfg.ternary, head)
    return ServerState(w, thresh, 0, now, (), 0, {}, {}, digest, {}, head, {})


def _finished(st: ServerState, cfg: ServerConfig) -> bool:
    return st.round >= cfg.rounds


def submission_bytes(msg: DeltaList) -> bytes:
    """What a worker signs for its list: every field but the signature, in a fixed encoding
    (indices as int64 and deltas and loss as float32, little-endian)."""
    return identity.canonical(
        "zeroth-binary-submit-v1",
        msg.run_id,
        int(msg.worker_id),
        int(msg.round),
        np.asarray(msg.index, "<i8").tobytes(),
        np.asarray(msg.delta, "<f4").tobytes(),
        msg.checksum,
        int(msg.examples),
        np.float32(msg.loss).astype("<f4").tobytes(),
    )


def rejoin_bytes(run_id: str, worker_id: int, seq: int) -> bytes:
    """What a dropped worker signs to take its id back."""
    return identity.request_bytes("BinaryRejoin", run_id, int(worker_id), int(seq))


def result_request_bytes(run_id: str, worker_id: int, rnd: int, seq: int) -> bytes:
    """What a worker signs to ask for the result of round ``rnd``."""
    return identity.request_bytes("BinaryResult", run_id, int(worker_id), int(seq), int(rnd))


def _check_run(cfg: ServerConfig, run_id: str) -> None:
    if run_id != cfg.run_id:
        raise Rejected("FAILED_PRECONDITION", "the request's run id is not this server's run (check the config)")


def _check_signed(st: ServerState, worker_id: int, data: bytes, signature: bytes, what: str) -> None:
    if worker_id >= st.next_id:
        raise Rejected("FAILED_PRECONDITION", f"worker {worker_id} never joined (call Join first)")
    if not identity.verify(st.keys[worker_id], data, bytes(signature)):
        raise Rejected(
            "PERMISSION_DENIED",
            f"the {what} in worker {worker_id}'s name is not signed by the key it committed when it joined",
        )


def _admit(st: ServerState, cfg: ServerConfig, wid: int) -> tuple[ServerState, int]:
    """``wid`` takes part from the open round if it may (founding, no list in yet, or fewer than
    ``min_workers`` live), else from the next one; returns the state and that round."""
    founding = st.round == 0 and len(st.live) < cfg.founders
    joins_now = not _finished(st, cfg) and (founding or not st.pending or len(st.live) < cfg.min_workers)
    live = st.live + (wid,) if joins_now and wid not in st.live else st.live
    first = st.round + (0 if joins_now else 1)
    return st._replace(live=live, start={**st.start, wid: first}), first


def _reply(st: ServerState, cfg: ServerConfig, wid: int, first: int) -> JoinReply:
    data = model_bytes(st.w, st.thresh, cfg.c_in, cfg.ternary, st.head)
    return JoinReply(wid, first, data, st.checksum, 2 * cfg.n_weights, cfg.max_entries, _finished(st, cfg), st.round)


def join(st: ServerState, cfg: ServerConfig, run_id: str, key: bytes, *, now: float) -> tuple[ServerState, JoinReply]:
    """A new worker with public key ``key``: a fresh id (``key`` committed to it), the packed model
    and the round it submits to next.

    A worker joining while a round is open takes part from the next round (the current one
    closes without waiting for it), unless fewer than ``min_workers`` are live.
    """
    _check_run(cfg, run_id)
    key = bytes(key)
    if len(key) != 32:
        raise Rejected("INVALID_ARGUMENT", f"a worker's key is an Ed25519 public key of 32 bytes, not {len(key)}")
    if key in st.keys.values():
        owner = next(w for w, k in st.keys.items() if k == key)
        raise Rejected("ALREADY_EXISTS", f"this key is committed to worker {owner}: rejoin with its id")
    wid = st.next_id
    st = st._replace(next_id=wid + 1, keys={**st.keys, wid: key})
    st, first = _admit(st, cfg, wid)
    return st, _reply(st, cfg, wid, first)


def rejoin(
    st: ServerState, cfg: ServerConfig, run_id: str, worker_id: int, seq: int, signature: bytes, *, now: float
) -> tuple[ServerState, JoinReply]:
    """Worker ``worker_id`` (a signed request, :func:`rejoin_bytes`) takes part again: the packed
    model and the round it submits to next. A worker still live gets the model and its round back."""
    _check_run(cfg, run_id)
    _check_signed(st, worker_id, rejoin_bytes(run_id, worker_id, seq), signature, "rejoin")
    if worker_id in st.live or st.start.get(worker_id, -1) > st.round or _finished(st, cfg):
        first = st.start[worker_id] if st.start.get(worker_id, -1) > st.round else st.round
        return st, _reply(st, cfg, worker_id, first)
    st, first = _admit(st, cfg, worker_id)
    return st, _reply(st, cfg, worker_id, first)


def _validate(st: ServerState, cfg: ServerConfig, msg: DeltaList) -> None:
    _check_run(cfg, msg.run_id)
    _check_signed(st, msg.worker_id, submission_bytes(msg), msg.signature, "list")
    if msg.worker_id not in st.live:
        start = st.start.get(msg.worker_id)
        if start is not None and start > st.round:
            raise Rejected(
                "FAILED_PRECONDITION",
                f"worker {msg.worker_id} takes part from round {start}; round {st.round} is still open",
            )
        raise Rejected("FAILED_PRECONDITION", f"worker {msg.worker_id} was dropped from the run (join again)")
    if msg.round != st.round:
        raise Rejected("FAILED_PRECONDITION", f"list for round {msg.round} but the open round is {st.round}")
    if msg.worker_id in st.pending:
        raise Rejected("FAILED_PRECONDITION", f"worker {msg.worker_id} already submitted round {st.round}")
    if msg.checksum != st.checksum:
        raise Rejected(
            "FAILED_PRECONDITION",
            f"model checksum {msg.checksum[:16]}... differs from the server's "
            f"{st.checksum[:16]}... at round {st.round} (fetch the model again)",
        )
    n = len(msg.index)
    if n != len(msg.delta):
        raise Rejected("INVALID_ARGUMENT", f"{n} indices but {len(msg.delta)} deltas")
    if n > cfg.max_entries:
        raise Rejected("INVALID_ARGUMENT", f"list of {n} entries is oversized: at most {cfg.max_entries}")
    idx = np.asarray(msg.index, np.int64)
    if n and (idx.min() < 0 or idx.max() >= 2 * cfg.n_weights):
        bad = int(idx[(idx < 0) | (idx >= 2 * cfg.n_weights)][0])
        raise Rejected("INVALID_ARGUMENT", f"mutation index {bad} out of range [0, {2 * cfg.n_weights})")
    if n > 1 and not np.all(np.diff(idx) > 0):
        raise Rejected("INVALID_ARGUMENT", "mutation indices must be strictly increasing (sorted, no repeats)")
    d = np.asarray(msg.delta, np.float32)
    if not np.all(np.isfinite(d)):
        raise Rejected(
            "INVALID_ARGUMENT",
            f"delta {float(d[~np.isfinite(d)][0])} at entry {int(np.flatnonzero(~np.isfinite(d))[0])} is not finite",
        )


def submit(st: ServerState, cfg: ServerConfig, msg: DeltaList, *, now: float) -> ServerState:
    """Record a worker's list for the open round (signed by the worker, validated) and close the
    round if it is complete."""
    if _finished(st, cfg):
        raise Rejected("FAILED_PRECONDITION", f"the run finished after {cfg.rounds} rounds")
    _validate(st, cfg, msg)
    pending = {**st.pending, msg.worker_id: (np.asarray(msg.index, np.int64), np.asarray(msg.delta, np.float32))}
    opened = now if not st.pending else st.opened_at  # the deadline runs from the round's first list
    return tick(st._replace(pending=pending, opened_at=opened), cfg, now=now)


def _close(st: ServerState, cfg: ServerConfig, *, now: float) -> ServerState:
    total = np.zeros(2 * cfg.n_weights, np.float64)
    contributors = tuple(sorted(st.pending))
    for wid in contributors:
        idx, d = st.pending[wid]
        np.add.at(total, idx, d.astype(np.float64))
    dense = total.astype(np.float32)
    dense[F.at_limit_np(st.w, np.arange(dense.size), cfg.ternary)] = np.inf
    chosen = F.select(dense.reshape(cfg.c_out, 9 * cfg.c_in, 2), k=cfg.k, min_gain=cfg.min_gain)
    w = F.apply_mutations_np(st.w, chosen, cfg.ternary)
    digest = checksum(w, st.thresh, cfg.c_in, cfg.ternary, st.head)
    dropped = tuple(sorted(set(st.live) - set(contributors)))
    joined = tuple(sorted(wid for wid, r in st.start.items() if r == st.round + 1))
    res = RoundResult(
        True, st.round, tuple(int(i) for i in chosen), digest, contributors, dropped, st.round + 1 >= cfg.rounds
    )
    return st._replace(
        w=w,
        round=st.round + 1,
        opened_at=now,
        live=contributors + joined,
        pending={},
        results={**st.results, st.round: res},
        checksum=digest,
    )


def tick(st: ServerState, cfg: ServerConfig, *, now: float) -> ServerState:
    """Close the open round if it holds at least ``min_workers`` lists (and one) and every live
    worker submitted or its deadline passed."""
    if _finished(st, cfg) or not st.pending or (st.round == 0 and len(st.live) < cfg.founders):
        return st
    if len(st.pending) < cfg.min_workers:
        return st
    complete = set(st.live) <= set(st.pending)
    if complete or now - st.opened_at >= cfg.round_timeout_s:
        return _close(st, cfg, now=now)
    return st


def result(
    st: ServerState, cfg: ServerConfig, run_id: str, worker_id: int, rnd: int, seq: int, signature: bytes, *, now: float
) -> tuple[ServerState, RoundResult]:
    """The result of round ``rnd`` (``ready=False`` while it is open) for worker ``worker_id``'s
    signed request (:func:`result_request_bytes`)."""
    _check_run(cfg, run_id)
    _check_signed(st, worker_id, result_request_bytes(run_id, worker_id, rnd, seq), signature, "result request")
    st = tick(st, cfg, now=now)
    if rnd in st.results:
        return st, st.results[rnd]
    if rnd > st.round:
        raise Rejected("INVALID_ARGUMENT", f"round {rnd} is in the future (the open round is {st.round})")
    return st, RoundResult(False, rnd, finished=_finished(st, cfg))
