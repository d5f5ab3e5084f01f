"""Data-parallel pipeline replicas: R copies of the S stages, each stage's gradients averaged over its R replicas.

Replica ``r`` of a pipeline takes the ``r``-th of ``R`` equal contiguous shares of every batch
(:func:`zeroth.pipeline.build.plan_of`) and runs the GPipe schedule on it as a lone pipeline
does. Before the update, stage ``s`` of every replica averages with the other replicas of stage
``s`` (``pipeline.replica_sync``) through replica 0 of that stage (a star: replica 0 is the server):

* ``fp32``: every replica sends its accumulated gradient in float32 (a ``REPLICA_GRADIENT``
  frame); replica 0 takes the mean in replica order (:func:`zeroth.collectives.quantized_adam.mean`)
  and sends it back (``REPLICA_AVERAGE``); every replica applies ``train.optimizer`` to that mean,
  which is the gradient of the whole batch's mean loss: R replicas step as one pipeline on the
  union of their batches (up to float reassociation).
* ``onebit_adam``: QuantizedAdam (:class:`zeroth.collectives.quantized_adam.QuantizedAdam`):
  ``pipeline.replica_warmup_steps`` steps as ``fp32`` but with its own Adam, then the momentum
  travels as sign bits with one float32 scale per parameter tensor (``bits = 1``, quantizer
  ``sign/tensor-rms``), error feedback on each worker and on the server.

Every replica applies the same shared vector with the same host arithmetic, so the replicas of a
stage hold the same parameters bit for bit, and a rerun repeats them. :class:`ReplicaSync` is one
replica's part of one stage; it does not know the transport: :mod:`zeroth.pipeline.sim` calls it
directly, :mod:`zeroth.pipeline.stage` over the gRPC service ``ReplicaSync``
(:class:`SyncServicer`, :func:`connect_sync`).
"""

from __future__ import annotations

import queue
import threading
import time
import zipfile
from collections.abc import Callable

import grpc
import jax
import jax.numpy as jnp
import numpy as np

from zeroth.collectives import quantized_adam as qa
from zeroth.pipeline import wire
from zeroth.pipeline.proto import pipeline_pb2 as pb
from zeroth.pipeline.proto import pipeline_pb2_grpc as pb_grpc
from zeroth.transport import identity, security
from zeroth.transport.pacing import END, Pacer

__all__ = ["QUANTIZER", "ReplicaSync", "SyncServicer", "check_sync_frame", "connect_sync", "serve_sync", "sync_fields"]

QUANTIZER = "sign/tensor-rms"  # the frames' quantizer when bits = 1
KINDS = {"gradient": pb.REPLICA_GRADIENT, "average": pb.REPLICA_AVERAGE}


class ReplicaSync:
    """Replica ``replica`` of ``replicas`` for stage ``stage``: its share of the averaging.

    Args:
      mode: ``fp32`` or ``onebit_adam`` (``pipeline.replica_sync``).
      replicas, replica, stage: R, this replica, this stage.
      run_id: the run's id (frames carry it).
      params: the stage's parameters (their tree, shapes and dtypes fix the flat vector's layout).
      warmup, b1, b2, eps, weight_decay: QuantizedAdam's constants (``onebit_adam`` only).

    A step: :meth:`contribution` (every replica), :meth:`reduce` (replica 0, with the other
    replicas' contributions in replica order), :meth:`apply` (every replica, with the average).
    """

    def __init__(
        self,
        mode: str,
        replicas: int,
        replica: int,
        stage: int,
        run_id: str,
        params,
        *,
        warmup: int = 1,
        b1: float = 0.9,
        b2: float = 0.999,
        eps: float = 1e-8,
        weight_decay: float = 0.0,
    ):
        if mode not in ("fp32", "onebit_adam"):
            raise ValueError(f"unknown replica_sync {mode!r}; expected fp32 or onebit_adam")
        if not 0 <= replica < replicas:
            raise ValueError(f"replica {replica} is outside 0..{replicas - 1} (pipeline.replicas = {replicas})")
        self.mode, self.replicas, self.replica, self.stage, self.run_id = mode, replicas, replica, stage, run_id
        leaves, self.treedef = jax.tree_util.tree_flatten(params)
        self.shapes = [tuple(np.shape(x)) for x in leaves]
        self.dtypes = [jnp.asarray(x).dtype for x in leaves]
        self.bounds = qa.segments_of([max(int(np.prod(s, dtype=np.int64)), 1) for s in self.shapes])
        self.n = int(self.bounds[-1])
        self.adam = (
            qa.QuantizedAdam(self.bounds, warmup, b1, b2, eps, weight_decay, server=replica == 0)
            if mode == "onebit_adam"
            else None
        )
        self._own: np.ndarray | None = None

    # ------------------------------------------------------------------ layout

    def bits(self, step: int) -> int:
        """Bits per value of the frames of ``step``: 1 once QuantizedAdam compresses, else 0 (float32)."""
        return 1 if self.adam is not None and self.adam.compressed(step) else 0

    def flat(self, tree) -> np.ndarray:
        """The tree's leaves as one float32 vector (tree order)."""
        leaves = jax.tree_util.tree_leaves(tree)
        return np.concatenate([np.asarray(x, np.float32).reshape(-1) for x in leaves]).astype(np.float32, copy=False)

    def unflat(self, vec: np.ndarray):
        """The tree of the stage's parameters from a flat float32 vector (each leaf cast once to its dtype)."""
        leaves = [
            jnp.asarray(vec[self.bounds[k] : self.bounds[k + 1]].reshape(s), self.dtypes[k])
            for k, s in enumerate(self.shapes)
        ]
        return jax.tree_util.tree_unflatten(self.treedef, leaves)

    def _frame(self, kind: str, step: int, vec: np.ndarray, packed) -> pb.TensorFrame:
        f = pb.TensorFrame(
            run_id=self.run_id,
            link=self.stage,
            kind=KINDS[kind],
            step=int(step),
            micro_batch=0,
            shape=[self.n],
            dtype="float32",
            replica=self.replica if kind == "gradient" else 0,
        )
        if packed is None:
            f.bits, f.full = 0, np.asarray(vec, "<f4").tobytes()
        else:
            words, scales = packed
            f.bits, f.packed, f.scales, f.quantizer = (
                1,
                np.asarray(words, "<u4").tobytes(),
                np.asarray(scales, "<f4").tobytes(),
                QUANTIZER,
            )
        return f

    def decode(self, frame: pb.TensorFrame) -> np.ndarray:
        """The vector a (checked) frame carries."""
        if frame.bits == 0:
            return np.frombuffer(frame.full, "<f4").astype(np.float32)
        words = np.frombuffer(frame.packed, "<u4").astype(np.uint32)
        scales = np.frombuffer(frame.scales, "<f4").astype(np.float32)
        return qa.sign_decompress(words, scales, self.bounds)

    def check(self, frame, kind: str, step: int, replica: int) -> None:
        """:func:`check_sync_frame` against this stage's layout and step."""
        check_sync_frame(
            frame,
            run_id=self.run_id,
            stage=self.stage,
            kind=kind,
            step=step,
            replica=replica,
            n=self.n,
            bits=self.bits(step),
            segments=len(self.bounds) - 1,
        )

    # ------------------------------------------------------------------ checkpoints

    def state(self) -> dict[str, np.ndarray]:
        """What a checkpoint of this replica's averaging holds between steps: QuantizedAdam's moments,
        step count and error-feedback errors (worker, and server on replica 0); empty for ``fp32``
        (the stage's optimizer state is the engine's)."""
        return {} if self.adam is None else {k: np.asarray(v) for k, v in self.adam.state().items()}

    def state_digest(self) -> str:
        """SHA-256 hex of :meth:`state` (names, dtypes, shapes and bytes, in name order)."""
        import hashlib

        h = hashlib.sha256()
        for k, v in sorted(self.state().items()):
            a = np.ascontiguousarray(v)
            h.update(f"{k}:{a.dtype.str}:{a.shape};".encode())
            h.update(a.tobytes())
        return h.hexdigest()

    def save_state(self, path) -> str:
        """Write :meth:`state` to ``path`` (``.npz``, atomically); returns :meth:`state_digest`."""
        import os
        from pathlib import Path

        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(path.name + ".tmp")
        with open(tmp, "wb") as fh:
            np.savez(fh, **self.state())
        os.replace(tmp, path)
        return self.state_digest()

    def load_state(self, path, digest: str) -> None:
        """Read a state saved by :meth:`save_state` and check it against ``digest``.

        Raises:
          ValueError: the file is missing or damaged, or its arrays or digest are not this replica's.
        """
        try:
            with np.load(path, allow_pickle=False) as z:
                state = {k: z[k] for k in z.files}
        except (OSError, ValueError, EOFError, zipfile.BadZipFile) as e:
            raise ValueError(f"the averaging state {path} cannot be read: {e}") from None
        if self.adam is not None:
            self.adam.load(state)
        elif state:
            raise ValueError(f"{path} holds a QuantizedAdam state; this run averages in float32")
        if self.state_digest() != digest:
            raise ValueError(f"the averaging state {path} does not match its checkpoint's digest (damaged or replaced)")

    # ------------------------------------------------------------------ a step

    def contribution(self, step: int, grads) -> pb.TensorFrame:
        """This replica's ``REPLICA_GRADIENT`` frame of ``step`` from its accumulated gradients."""
        g = self.flat(grads)
        vec, packed = (g, None) if self.adam is None else self.adam.local_momentum(step, g)
        self._own = vec
        return self._frame("gradient", step, vec, packed)

    def reduce(self, step: int, frames: list) -> pb.TensorFrame:
        """Replica 0: the ``REPLICA_AVERAGE`` frame of ``step`` from the other replicas' frames (replicas 1..R−1, in order)."""
        if self.replica != 0 or self._own is None:
            raise ValueError("reduce() runs on replica 0 after its own contribution()")
        if len(frames) != self.replicas - 1:
            raise ValueError(f"{len(frames)} contributions; replicas 1..{self.replicas - 1} must each send one")
        for r, f in enumerate(frames, start=1):
            self.check(f, "gradient", step, r)
        vecs = [self._own] + [self.decode(f) for f in frames]
        if self.adam is None:
            vec, packed = qa.mean(vecs), None
        else:
            vec, packed = self.adam.reduce(step, vecs)
        return self._frame("average", step, vec, packed)

    def apply(self, step: int, params, opt_state, frame: pb.TensorFrame, update, lr: float):
        """``(params, opt_state)`` after ``step`` from the ``REPLICA_AVERAGE`` frame: ``update(params,
        opt_state, mean gradient)`` (the stage's optimizer) for ``fp32``, QuantizedAdam otherwise."""
        self.check(frame, "average", step, 0)
        shared = self.decode(frame)
        self._own = None
        if self.adam is None:
            with jax.numpy_dtype_promotion("standard"):
                return update(params, opt_state, self.unflat(shared))
        return self.unflat(self.adam.apply(step, self.flat(params), shared, lr)), opt_state


def check_sync_frame(
    frame, *, run_id: str, stage: int, kind: str, step: int, replica: int, n: int, bits: int, segments: int
) -> None:
    """Raise :class:`zeroth.pipeline.wire.FrameError` unless ``frame`` is the expected replica frame:
    its run, stage, kind, step, sender, shape ``[n]``, bits and payload sizes."""
    inv, pre = wire.INVALID, wire.PRECONDITION
    if frame.run_id != run_id:
        raise wire.FrameError(inv, f"replica frame of run {frame.run_id!r}; this stage belongs to run {run_id!r}")
    if frame.link != stage or frame.kind != KINDS[kind]:
        got = pb.FrameKind.Name(frame.kind) if frame.kind in pb.FrameKind.values() else str(frame.kind)
        raise wire.FrameError(
            inv, f"frame {got} for stage {frame.link}; expected {pb.FrameKind.Name(KINDS[kind])} for stage {stage}"
        )
    if frame.replica != replica:
        raise wire.FrameError(inv, f"replica frame from replica {frame.replica}; expected replica {replica}")
    if frame.step != step:
        raise wire.FrameError(pre, f"out-of-order replica frame: got step {frame.step}, expected step {step}")
    if list(frame.shape) != [n] or frame.dtype != "float32":
        raise wire.FrameError(
            inv, f"replica frame of shape {list(frame.shape)} {frame.dtype!r}; expected [{n}] 'float32'"
        )
    if frame.bits != bits:
        raise wire.FrameError(inv, f"replica frame with bits {frame.bits}; step {step} of this run uses {bits}")
    want = (
        {"full": 4 * n, "packed": 0, "scales": 0, "quantizer": 0}
        if bits == 0
        else {"full": 0, "packed": 4 * ((n + 31) // 32), "scales": 4 * segments, "quantizer": len(QUANTIZER)}
    )
    for name, size in want.items():
        if len(getattr(frame, name)) != size:
            raise wire.FrameError(
                inv, f"replica frame's {name} holds {len(getattr(frame, name))} bytes; expected {size}"
            )
    if bits and frame.quantizer != QUANTIZER:
        raise wire.FrameError(inv, f"replica frame's quantizer {frame.quantizer!r}; expected {QUANTIZER!r}")


# ---------------------------------------------------------------------- transport


def sync_fields(run_id: str, stage: int, replica: int) -> tuple:
    """What replica ``replica`` of ``stage`` signs when it opens its averaging stream (:func:`connect_sync`)."""
    return ("zeroth-replica-sync-v1", run_id, int(stage), int(replica))


class SyncServicer(pb_grpc.ReplicaSyncServicer):
    """Replica 0's end of a stage's averaging: one stream per other replica.

    The first frame of a stream names its replica; that replica's frames go to ``inboxes[r]``
    (then :data:`END`, or an exception), the frames submitted to ``outs[r]`` are its responses.
    With ``replica_keys`` (``replica_keys(r) -> bytes | None``, replica ``r``'s public key, None
    while unknown) a stream is served only when replica ``r``'s key signed it for
    :func:`sync_fields` (``connect_sync(..., me=...)``): a token holder cannot speak for a replica.
    """

    def __init__(
        self,
        replicas: int,
        bandwidth_bps: float | None = None,
        latency_s: float = 0.0,
        *,
        replica_keys: Callable[[int], bytes | None] | None = None,
        run_id: str = "",
        stage: int = 0,
    ):
        self.replicas = replicas
        self.replica_keys, self.run_id, self.stage = replica_keys, run_id, stage
        self.inboxes = {r: queue.Queue() for r in range(1, replicas)}
        self.outs = {r: Pacer(bandwidth_bps, latency_s) for r in range(1, replicas)}
        self.readers: list[threading.Thread] = []
        self._lock = threading.Lock()
        self._seen: set[int] = set()

    def _read(self, r: int, it) -> None:
        try:
            for frame in it:
                self.inboxes[r].put(frame)
            self.inboxes[r].put(END)
        except grpc.RpcError:
            self.inboxes[r].put(ConnectionError(f"the stream of replica {r} broke"))
        except Exception as e:  # noqa: BLE001 - the failure must reach the stage
            self.inboxes[r].put(ConnectionError(f"reading the stream of replica {r} failed: {type(e).__name__}: {e}"))

    def Sync(self, request_iterator, context):
        try:
            first = next(request_iterator)
        except StopIteration:
            return
        r = int(first.replica)
        if self.replica_keys is not None and 1 <= r < self.replicas:
            try:
                want = self.replica_keys(r)
            except (OSError, ValueError) as e:
                context.abort(grpc.StatusCode.FAILED_PRECONDITION, f"replica {r}'s key cannot be read: {e}")
            if want is None:
                context.abort(grpc.StatusCode.UNAVAILABLE, f"replica {r}'s key is not known yet: try again")
            signer = identity.call_signer(context.invocation_metadata(), *sync_fields(self.run_id, self.stage, r))
            if signer is None or signer[0] != bytes(want):
                context.abort(
                    grpc.StatusCode.PERMISSION_DENIED,
                    f"the averaging stream of replica {r} must be signed by replica {r}'s key",
                )
        with self._lock:
            if not 1 <= r < self.replicas or r in self._seen:
                context.abort(
                    grpc.StatusCode.INVALID_ARGUMENT,
                    f"replica {r} is not a worker of this stage (1..{self.replicas - 1}) or is already connected",
                )
            self._seen.add(r)
        self.inboxes[r].put(first)
        reader = threading.Thread(target=self._read, args=(r, request_iterator), daemon=True)
        self.readers.append(reader)
        reader.start()
        yield from self.outs[r].frames()

    def close(self) -> None:
        for out in self.outs.values():
            out.close()


def serve_sync(servicer: SyncServicer, listen: str, token: str | None, bounds, tls=None) -> tuple[grpc.Server, int]:
    """Serve ``servicer`` on ``listen`` (``HOST:PORT``, port 0 = any); returns the server and its port."""
    from zeroth.transport import guard

    server = guard.make_server(bounds, token, name="zeroth-replica-sync")
    pb_grpc.add_ReplicaSyncServicer_to_server(servicer, server)
    port = security.bind(server, listen, tls)
    server.start()
    return server, port


def connect_sync(
    address: str,
    pacer: Pacer,
    inbox: queue.Queue,
    timeout_s: float,
    readers: list,
    token: str | None = None,
    tls=None,
    channel_options=(),
    *,
    me=None,
    run_id: str = "",
    stage: int = 0,
    replica: int = 0,
) -> grpc.Channel:
    """Open replica r's stream to replica 0 of its stage at ``address``: ``pacer``'s frames go out,
    the averages land in ``inbox`` (then :data:`END`, or a ``ConnectionError``). ``me``: this
    replica's :class:`zeroth.transport.identity.Identity`, which signs the stream for
    :func:`sync_fields` (``run_id``, ``stage``, ``replica``)."""
    channel = security.open_channel(address, channel_options, tls)
    try:
        grpc.channel_ready_future(channel).result(timeout=timeout_s)
    except grpc.FutureTimeoutError:
        channel.close()
        raise ConnectionError(f"replica 0 of this stage at {address} did not answer within {timeout_s:g}s") from None
    metadata = tuple(security.token_metadata(token))
    if me is not None:
        metadata += identity.call_metadata(me, time.time_ns(), *sync_fields(run_id, stage, replica))
    responses = pb_grpc.ReplicaSyncStub(channel).Sync(pacer.frames(), metadata=metadata)

    def read():
        try:
            for frame in responses:
                inbox.put(frame)
            inbox.put(END)
        except grpc.RpcError as e:
            inbox.put(ConnectionError(f"the stream to replica 0 at {address} closed: {e.code().name}: {e.details()}"))

    t = threading.Thread(target=read, daemon=True)
    readers.append(t)
    t.start()
    return channel
