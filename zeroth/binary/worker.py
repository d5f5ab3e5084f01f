"""A sparse-mutation worker: deltas over its data shard, one sparse list per round, the server's flips applied.

The model is one binary/ternary conv layer on thermometer-encoded images with a fixed head:
either *votes* (channel ``o`` votes for class ``o % classes``) or a float head the launcher fitted
to the initial layer's features and ships, frozen, inside the packed model. Only bits move, and
every worker holds the same model. Each round the worker

1. draws a batch from its shard (``examples i`` with ``i % shards == worker_id % shards``; the
   batch is a pure function of ``(seed, worker_id, round)``),
2. computes the summed loss change of every mutation (:func:`zeroth.binary.flips.mutation_deltas`),
   keeps the entries with ``|delta| > threshold`` (at most ``max_entries``, the most negative first),
3. submits them with its model's checksum, polls the round's result, applies the mutations and
   compares its checksum with the server's.

The worker's process makes an Ed25519 key pair; its join commits the public key to its worker id
(with a proof of the run secret), and it signs every list and result request with it
(:mod:`zeroth.binary.protocol`). Dropped at a round's deadline (it was paused, or slow), it
rejoins with its id, fetches the model and carries on.

It appends one JSON line per round to ``--metrics``: round, entries, bytes up (the serialized
``DeltaList``) and down (the ``RoundResult``), the dense float32 gradient's bytes, the loss, and
whether the checksums matched.

Run: ``python -m zeroth.binary.worker --server HOST:PORT --config JSON --metrics FILE``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from typing import NamedTuple

import grpc
import jax
import jax.numpy as jnp
import numpy as np

from zeroth import data as zdata
from zeroth.binary import flips as F
from zeroth.binary import layers as L
from zeroth.binary import protocol as P
from zeroth.binary import service as S
from zeroth.binary.proto import binary_pb2 as pb
from zeroth.binary.proto import binary_pb2_grpc as pbg
from zeroth.transport import identity, security

__all__ = ["DistConfig", "load_split", "model_spec", "votes", "sparse_list", "run_worker", "main"]


class DistConfig(NamedTuple):
    """A sparse-mutation run (the server and every worker read the same one)."""

    run_id: str = "binary"
    dataset: str = "digits"
    train_size: int = 0  # 0 = the whole train split
    test_size: int = 0
    levels: int = 4  # thermometer channels
    c_out: int = 20
    ternary: bool = False
    grid: int = 2
    votes_scale: float = 8.0
    batch_size: int = 32
    shards: int = 3
    threshold: float = 0.01  # |delta| a list entry must exceed
    max_entries: int = 4096
    k: int = 4
    rounds: int = 20
    seed: int = 0
    round_timeout_s: float = 3.0
    founders: int = 3  # round 0 waits for this many workers
    min_workers: int = 1  # a round closes only with at least this many lists
    head: str = "votes"  # votes: fixed class votes; trained: a head fitted by the launcher, then frozen
    head_steps: int = 100  # trained head: Adam steps on the initial layer's features
    classes: int = 10

    def server_config(self, image_hw: tuple[int, int] = (0, 0)) -> P.ServerConfig:
        """The server's config; a trained head needs the image size (its number of regions)."""
        regions = len(L.regions(*image_hw, self.grid).counts) if self.head == "trained" else 0
        return P.ServerConfig(
            self.run_id,
            self.levels,
            self.c_out,
            self.ternary,
            self.k,
            self.rounds,
            max_entries=self.max_entries,
            round_timeout_s=self.round_timeout_s,
            founders=self.founders,
            regions=regions,
            classes=self.classes if regions else 0,
            min_workers=self.min_workers,
        )


def load_split(cfg: DistConfig, split: str) -> tuple[np.ndarray, np.ndarray]:
    """Packed thermometer inputs and labels of a split (the first ``train_size`` / ``test_size``)."""
    ds = zdata.load(cfg.dataset, split)
    n = cfg.train_size if split == "train" else cfg.test_size
    n = len(ds.y) if n == 0 else min(n, len(ds.y))
    return L.encode_thermometer(ds.x[:n], cfg.levels), np.asarray(ds.y[:n], np.int32)


def model_spec(cfg: DistConfig) -> L.ConvSpec:
    return L.ConvSpec(c_in=cfg.levels, c_out=cfg.c_out, ternary=cfg.ternary, pool=False)


def votes(cfg: DistConfig, h: int, w: int) -> tuple[L.Head, L.Regions]:
    reg = L.regions(h, w, cfg.grid)
    return L.votes_head(cfg.c_out, len(reg.counts), cfg.classes, cfg.votes_scale), reg


def sparse_list(deltas, threshold: float, max_entries: int) -> tuple[np.ndarray, np.ndarray]:
    """Entries of ``f32[O, J, 2]`` with finite ``|delta| > threshold``, sorted by index.

    Over ``max_entries``, the most negative deltas are kept first (the server applies only
    mutations whose summed delta is negative; a positive entry can only veto another worker's).
    """
    flat = np.asarray(deltas, np.float32).reshape(-1)
    keep = np.flatnonzero(np.isfinite(flat) & (np.abs(flat) > threshold))
    if keep.size > max_entries:
        order = np.lexsort((keep, flat[keep]))[:max_entries]
        keep = np.sort(keep[order])
    return keep.astype(np.int64), flat[keep]


class _Authenticated:
    """A stub whose every call carries ``metadata`` (the access token)."""

    def __init__(self, stub, metadata):
        self._stub, self._md = stub, metadata

    def __getattr__(self, name):
        call = getattr(self._stub, name)
        return lambda request, **kw: call(request, metadata=self._md, **kw)


def _dropped(e: grpc.RpcError) -> bool:
    return e.code() == grpc.StatusCode.FAILED_PRECONDITION and "dropped from the run" in (e.details() or "")


def run_worker(
    address: str,
    cfg: DistConfig,
    metrics_path: str,
    *,
    poll_s: float = 0.02,
    max_wait_s: float = 120.0,
    hold: str | None = None,
    token: str | None = None,
    tls: security.TLSFiles | None = None,
    secret: str | None = None,
    max_rejoins: int = 100,
) -> dict:
    """Join the server at ``address`` and take part until the run finishes; returns a summary.

    ``token``: the run's access token, carried by every call (the server refuses calls without it);
    ``secret``: the run secret, whose proof the join carries (a server with the secret requires it);
    ``tls``: call over TLS (presenting this worker's certificate when ``tls.mutual``).
    A worker dropped from the run rejoins with its id, at most ``max_rejoins`` times.

    ``hold``: a file path; when given, the worker loads and compiles, then waits (at most
    ``max_wait_s``) for the file to exist before joining (how a launcher makes it join mid-run).
    """
    spec = model_spec(cfg)
    x, y = load_split(cfg, "train")
    votes_head, reg = votes(cfg, x.shape[1], x.shape[2])
    scfg = cfg.server_config(x.shape[1:3])
    deltas_fn = jax.jit(lambda layer, head, xb, yb: F.mutation_deltas(layer, head, xb, yb, spec, reg))
    loss_fn = jax.jit(lambda layer, head, xb, yb: F.batch_loss(layer, head, xb, yb, spec, reg))
    warm = L.ConvLayer(jnp.zeros((cfg.c_out, 9 * cfg.levels), jnp.int8), jnp.zeros((cfg.c_out,), jnp.int32))
    bs = min(cfg.batch_size, -(-len(y) // cfg.shards))
    deltas_fn(warm, votes_head, jnp.asarray(x[:bs]), jnp.asarray(y[:bs])).block_until_ready()  # compile before joining
    loss_fn(warm, votes_head, jnp.asarray(x[:bs]), jnp.asarray(y[:bs])).block_until_ready()
    if hold is not None:
        deadline = time.monotonic() + max_wait_s
        while not os.path.exists(hold):
            if time.monotonic() > deadline:
                raise RuntimeError(f"worker: {hold} did not appear within {max_wait_s} s")
            time.sleep(poll_s)
    channel = security.open_channel(address, S.CHANNEL_OPTIONS, tls)
    stub = _Authenticated(pbg.BinaryMutationsStub(channel), security.token_metadata(token))
    me, seq = identity.Identity.generate(), identity.Sequence()
    proof = identity.join_proof(secret, cfg.run_id, S.JOIN_ADDRESS, me.public) if secret else b""
    wid = None

    def wait_result(r: int):
        deadline = time.monotonic() + max_wait_s
        while True:
            n = seq.next()
            res = stub.Result(
                pb.ResultRequest(
                    run_id=cfg.run_id,
                    worker_id=wid,
                    round=r,
                    seq=n,
                    signature=me.sign(P.result_request_bytes(cfg.run_id, wid, r, n)),
                ),
                timeout=30,
            )
            if res.ready:
                return res
            if time.monotonic() > deadline:
                raise RuntimeError(f"worker {wid}: round {r} did not close within {max_wait_s} s")
            time.sleep(poll_s)

    def enter():
        """Join (or rejoin with our id): the model at the round we submit to next, its checksum, that
        round, whether the run finished, and the reply."""
        if wid is None:
            # the server may still be starting (on another host, launched at the same time): wait for it
            rep = stub.Join(
                pb.JoinRequest(run_id=cfg.run_id, key=me.public, proof=proof), timeout=max_wait_s, wait_for_ready=True
            )
        else:
            n = seq.next()
            rep = stub.Join(
                pb.JoinRequest(
                    run_id=cfg.run_id,
                    rejoin=True,
                    worker_id=wid,
                    seq=n,
                    signature=me.sign(P.rejoin_bytes(cfg.run_id, wid, n)),
                ),
                timeout=max_wait_s,
            )
        w, thresh, shipped = P.model_from_bytes(
            rep.model, cfg.levels, cfg.c_out, cfg.ternary, regions=scfg.regions, classes=scfg.classes
        )
        mine = P.checksum(w, thresh, cfg.levels, cfg.ternary, shipped)
        if mine != rep.checksum:
            raise RuntimeError(f"worker {rep.worker_id}: fetched model checksum {mine} != server's {rep.checksum}")
        return w, thresh, shipped, mine, rep

    w, thresh, shipped, mine, rep = enter()
    wid, rnd, finished = rep.worker_id, rep.round, rep.finished
    head = votes_head if shipped is None else L.Head(jnp.asarray(shipped[0]), jnp.asarray(shipped[1]))
    shard = np.flatnonzero(np.arange(len(y)) % cfg.shards == wid % cfg.shards)
    dense = P.dense_bytes(scfg)
    rounds = matches = rejoins = 0

    def catch_up(w, mine, rep):
        """Apply the result of the round the model was fetched in, when we submit to the next one."""
        if rep.model_round < rep.round and not rep.finished:
            prev = wait_result(rep.model_round)  # joined while that round was open: it closes without us
            if prev.mutations:
                w = F.apply_mutations_np(w, np.asarray(prev.mutations, np.int64), cfg.ternary)
                mine = P.checksum(w, thresh, cfg.levels, cfg.ternary, shipped)
            return w, mine, prev.finished
        return w, mine, rep.finished

    w, mine, finished = catch_up(w, mine, rep)
    with open(metrics_path, "a") as log:
        log.write(
            json.dumps(
                {"event": "join", "worker": wid, "round": rnd, "model_bytes": len(rep.model), "checksum_ok": True}
            )
            + "\n"
        )
        while not finished:
            rng = np.random.default_rng([cfg.seed, wid, rnd])
            idx = rng.choice(shard, size=min(cfg.batch_size, shard.size), replace=False)
            layer = L.ConvLayer(jnp.asarray(w), jnp.asarray(thresh))
            xb, yb = jnp.asarray(x[idx]), jnp.asarray(y[idx])
            index, delta = sparse_list(deltas_fn(layer, head, xb, yb), cfg.threshold, cfg.max_entries)
            loss = float(loss_fn(layer, head, xb, yb))
            unsigned = P.DeltaList(cfg.run_id, wid, rnd, index, delta, mine, len(idx), loss)
            msg = S.encode_deltas(unsigned._replace(signature=me.sign(P.submission_bytes(unsigned))))
            try:
                stub.Submit(msg, timeout=30)
            except grpc.RpcError as e:
                if e.code() == grpc.StatusCode.FAILED_PRECONDITION and "finished" in (e.details() or ""):
                    break  # joined near the end: the run finished before this worker's first round
                if not _dropped(e) or rejoins >= max_rejoins:
                    raise
                # dropped at a round's deadline (this process was paused or slow): take our id back
                rejoins += 1
                w, thresh, shipped, mine, rep = enter()
                rnd = rep.round
                w, mine, finished = catch_up(w, mine, rep)
                log.write(
                    json.dumps(
                        {
                            "event": "rejoin",
                            "worker": wid,
                            "round": rnd,
                            "model_bytes": len(rep.model),
                            "checksum_ok": True,
                        }
                    )
                    + "\n"
                )
                log.flush()
                continue
            res = wait_result(rnd)
            w = F.apply_mutations_np(w, np.asarray(res.mutations, np.int64), cfg.ternary)
            mine = P.checksum(w, thresh, cfg.levels, cfg.ternary, shipped)
            ok = mine == res.checksum
            matches += ok
            rounds += 1
            log.write(
                json.dumps(
                    {
                        "event": "round",
                        "worker": wid,
                        "round": rnd,
                        "entries": int(index.size),
                        "bytes_up": msg.ByteSize(),
                        "bytes_down": res.ByteSize(),
                        "dense_float32_bytes": dense,
                        "loss": loss / len(idx),
                        "flips": len(res.mutations),
                        "checksum_ok": ok,
                        "contributors": list(res.contributors),
                        "dropped": list(res.dropped),
                    }
                )
                + "\n"
            )
            log.flush()
            if not ok:
                raise RuntimeError(f"worker {wid}: checksum {mine} != server's {res.checksum} after round {rnd}")
            finished = res.finished
            rnd += 1
    channel.close()
    return {"worker": wid, "rounds": rounds, "checksum_matches": matches, "checksum": mine, "rejoins": rejoins}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m zeroth.binary.worker", description="A sparse-mutation worker.")
    p.add_argument("--server", required=True, help="HOST:PORT of the parameter server")
    p.add_argument("--config", required=True, help="the run's DistConfig as JSON")
    p.add_argument("--metrics", required=True, help="JSON lines file to append to")
    p.add_argument("--hold", default=None, help="join only once this file exists (after loading and compiling)")
    p.add_argument(
        "--insecure",
        action="store_true",
        help="no run secret: calls carry no access token (a server without one, loopback tests only)",
    )
    security.add_tls_arguments(p)
    args = p.parse_args(argv)
    cfg = DistConfig(**json.loads(args.config))
    try:
        token = identity.token_from_env(args.insecure)
        tls = security.tls_from_args(args)
    except (ValueError, OSError) as e:
        p.error(str(e))
    secret = None if args.insecure else identity.secret_from_env()
    print(
        json.dumps(run_worker(args.server, cfg, args.metrics, hold=args.hold, token=token, tls=tls, secret=secret)),
        flush=True,
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
