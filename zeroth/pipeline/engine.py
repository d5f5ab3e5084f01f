"""One pipeline stage's computation: GPipe micro-batches, link codecs, gradient accumulation, AdamW.

A :class:`StageEngine` knows nothing of the transport: the in-process pipeline
(:mod:`zeroth.pipeline.sim`) and the stage process (:mod:`zeroth.pipeline.stage`) call the same
methods with the same frames, so their bytes, buffers and parameters are the same.

One step of stage ``s`` of ``S`` with ``M`` micro-batches (fill and drain):

* forward, ``j = 0..M-1``: stage 0 embeds the tokens, other stages decode the activation frame
  of link ``s − 1`` (AQ-SGD: updating their copy of ``m[ξ]``); stages ``s < S−1`` run their blocks
  and encode the output for link ``s``; the last stage computes the micro-batch loss ``ℓ_j``, the
  gradients of ``ℓ_j / M`` for its parameters and input, and encodes the input gradient.
* backward, ``j = 0..M-1``: stages ``0 < s < S−1`` decode the gradient frame, recompute their
  forward (rematerialization, as GPipe) and pull it back through ``jax.vjp``; stage 0 only needs
  its parameter gradients; stages ``s > 0`` encode their input gradient for link ``s − 1``.
* update: the accumulated gradients ``Σ_j ∇(ℓ_j / M)`` (the gradient of the batch mean) go
  through the stage's own ``optax.adamw``.

Codec keys: activations of link ``l`` at step ``t`` use ``example_keys(seed, link=l,
direction=0, step=t)``, gradients ``direction=1``.

Uncompressed warm-up (``full_steps``): during the first ``full_steps`` steps every link sends
float32 in both directions (``full=True`` of the codecs; AQ-SGD's buffers take every activation),
as the seed's recipe sends its first epoch.

``c_Q``: every quantized message's relative error ``‖Q(v) − v‖ / ‖v‖`` per example (``v`` the
quantizer's input: the activation for DirectQ, its change ``a − m[ξ]`` for AQ-SGD, the
gradient backward) is collected for the links this stage sends on; :meth:`StageEngine.finish_step`
leaves the step's mean and maximum in ``last_cq`` (``fw_cq``, ``fw_cq_max`` for link ``index``,
``bw_cq``, ``bw_cq_max`` for link ``index − 1``; None where nothing was quantized). At
initialization (step 0), where the warm-up or AQ-SGD's first sight sends float32, the link's
quantizer is also applied to the activations and gradients themselves without sending the result:
``fw_cq_init`` and ``bw_cq_init`` (step 0 only, else None). The seed's theorem needs
``c_Q < 1/√2`` (:data:`CQ_LIMIT`).
"""

from __future__ import annotations

import time
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from zeroth import compress as C
from zeroth.pipeline import wire
from zeroth.stages import steps as _steps
from zeroth.stages import timing as _timing

__all__ = ["CQ_LIMIT", "LinkCodecs", "StageEngine", "StepTimes", "cq_summary", "link_codecs"]

CQ_LIMIT = float(np.sqrt(0.5))  # the seed's condition on the quantizer: c_Q < 1/√2


class LinkCodecs(NamedTuple):
    """The codecs of every link: ``forward`` for activations, ``backward`` for their gradients."""

    forward: C.LinkCodec
    backward: C.LinkCodec


def link_codecs(
    compression: str, fw_bits: int, bw_bits: int, axis: str = "channel", rounding: str = "stochastic"
) -> LinkCodecs:
    """``fp32``: both float32; ``directq``: both quantized; ``aqsgd``: AQ-SGD forward, DirectQ backward.

    ``axis``: the quantizers' scale axis (``channel``: one scale per channel, ``row``: per token);
    ``rounding``: ``stochastic`` (unbiased) or ``nearest``.
    """
    if compression == "fp32":
        return LinkCodecs(C.fp32(), C.fp32())
    if compression == "directq":
        return LinkCodecs(C.directq(fw_bits, axis, rounding), C.directq(bw_bits, axis, rounding))
    if compression == "aqsgd":
        return LinkCodecs(C.aqsgd(fw_bits, axis, rounding), C.directq(bw_bits, axis, rounding))
    raise ValueError(f"unknown pipeline compression {compression!r}; expected one of {list(C.CODEC_NAMES)}")


def cq_summary(values) -> tuple[float | None, float | None]:
    """``(mean, max)`` of per-example ``c_Q`` values; ``(None, None)`` when there are none."""
    v = np.concatenate([np.asarray(a, np.float64).reshape(-1) for a in values]) if len(values) else np.zeros(0)
    return (float(v.mean()), float(v.max())) if v.size else (None, None)


class StepTimes(NamedTuple):
    """Seconds one stage spent in one step: jitted compute, encoding/decoding, and waiting for frames."""

    compute_s: float
    codec_s: float
    wait_s: float


class StageEngine:
    """Stage ``index`` of ``n_stages``: parameters, optimizer state, link buffers, one step at a time.

    Args:
      index, n_stages: this stage and the pipeline length.
      fn: the stage function (:mod:`zeroth.stages.partition`).
      params: this stage's parameters.
      optimizer: an ``optax.GradientTransformation`` (AdamW).
      codecs: the links' codecs.
      run_seed, run_id: the run's seed (rounding keys) and id (frames).
      n_examples: size of the fixed example set (AQ-SGD buffers hold one row each).
      row_shape: ``(T, d)``: one example's activation.
      micro_batches: M.
      buffer_dir: folder for memory-mapped AQ-SGD buffers; None = host memory.
      slowdown: emulated compute speed (:class:`zeroth.stages.timing.SlowClock`; ``1`` = this machine).
      full_steps: steps of uncompressed warm-up (every link in float32, see the module docstring).
    """

    def __init__(
        self,
        index: int,
        n_stages: int,
        fn,
        params,
        optimizer,
        codecs: LinkCodecs,
        *,
        run_seed: int,
        run_id: str,
        n_examples: int,
        row_shape: tuple[int, ...],
        micro_batches: int,
        buffer_dir=None,
        slowdown: float = 1.0,
        full_steps: int = 0,
    ):
        self.index, self.n_stages = index, n_stages
        self.slowdown = _timing.check_slowdown(slowdown)
        self._clock = _timing.SlowClock(self.slowdown)
        self.first, self.last = index == 0, index == n_stages - 1
        self.codecs, self.run_seed, self.run_id = codecs, run_seed, run_id
        self.row_shape, self.micro_batches = tuple(row_shape), micro_batches
        self.full_steps = int(full_steps)
        self.last_cq = {f"{d}_cq{k}": None for d in ("fw", "bw") for k in ("", "_max", "_init")}
        self.params = jax.tree_util.tree_map(jnp.asarray, params)
        self.optimizer = optimizer
        with jax.numpy_dtype_promotion("standard"):
            self.opt_state = optimizer.init(self.params)
        path = (lambda name: None) if buffer_dir is None else (lambda name: f"{buffer_dir}/{name}.npy")
        # the sender's buffers of link `index` and the receiver's of link `index - 1`
        self.send_state = None if self.last else codecs.forward.init(n_examples, row_shape, path(f"send_link{index}"))
        self.recv_state = (
            None if self.first else codecs.forward.init(n_examples, row_shape, path(f"recv_link{index - 1}"))
        )
        scale = np.float32(1.0 / micro_batches)
        self._compile(fn, scale)
        self.step = 0
        self._reset()

    def _compile(self, fn, scale) -> None:
        fns = _steps.compile_stage(fn, self.first, self.last, scale)
        self._fwd, self._bwd, self._loss_grad = fns.fwd, fns.bwd, fns.loss_grad
        self._update = _steps.compile_update(self.optimizer)

    def _reset(self) -> None:
        self.grads = None
        self.inputs: dict[int, Any] = {}
        self.pending: dict[int, Any] = {}
        self.losses: list[float] = []
        self.times = {"compute_s": 0.0, "codec_s": 0.0}
        self.cq: dict[str, list] = {"fw": [], "bw": []}
        self.cq_init: dict[str, list] = {"fw": [], "bw": []}

    # ------------------------------------------------------------------ helpers

    def warm(self, step: int | None = None) -> bool:
        """Whether ``step`` (default: the current one) is in the uncompressed warm-up."""
        return (self.step if step is None else step) < self.full_steps

    def _encode(self, codec: C.LinkCodec, direction: str, state, x, ids, keys):
        """Encode through ``codec`` (in float32 during the warm-up) and collect the message's ``c_Q``."""
        full = self.warm()
        if self.step == 0 and codec.bits:  # c_Q at initialization: the quantizer on the tensor itself, not sent
            probe = C.directq(codec.bits, codec.axis, codec.rounding).encode(None, x, ids, keys)[2]
            self.cq_init[direction].append(C.relative_errors(x, probe - x))
        mask, v = C.quantizer_input(codec, state, x, ids, full)
        state, enc, xhat = codec.encode(state, x, ids, keys, full=full)
        if mask.any():
            self.cq[direction].append(C.relative_errors(v, (xhat - x)[mask]))
        return state, enc

    def _keys(self, link: int, direction: int, ids) -> np.ndarray:
        return C.example_keys(self.run_seed, link=link, direction=direction, step=self.step, ids=ids)

    def _timed(self, key: str, f, *args):
        out, dt = self._clock.run(f, *args)
        self.times[key] += dt
        return out

    def _accumulate(self, g) -> None:
        self.grads = g if self.grads is None else jax.tree_util.tree_map(jnp.add, self.grads, g)

    def expected(self, kind: str, micro: int, ids, step: int | None = None) -> wire.Expected:
        """What the incoming frame of ``kind`` at ``step`` (default: the current one) and micro-batch
        ``micro`` must look like (activation from s−1, gradient from s+1; float32 during the warm-up)."""
        step = self.step if step is None else step
        codec, link = (
            (self.codecs.forward, self.index - 1) if kind == "activation" else (self.codecs.backward, self.index)
        )
        bits = 0 if self.warm(step) else codec.bits
        return wire.Expected(self.run_id, link, kind, step, micro, np.asarray(ids), self.row_shape, bits, codec.axis)

    # ------------------------------------------------------------------ the schedule

    def forward(self, micro: int, ids, tokens, labels, frame=None):
        """Forward of one micro-batch. Returns the activation frame for link ``index`` (None on the last stage).

        ``frame`` is the activation frame from stage ``index − 1`` (None on stage 0); it is checked
        (:func:`zeroth.pipeline.wire.check_frame`) and decoded through this end's buffers.
        """
        tokens, labels = jnp.asarray(tokens), jnp.asarray(labels)
        if self.first and self.last:
            loss, g = self._timed("compute_s", self._loss_grad, self.params, tokens, labels)
            self.losses.append(float(loss) * self.micro_batches)
            self._accumulate(g)
            return None
        if self.first:
            h = self._timed("compute_s", self._fwd, self.params, tokens)
        else:
            wire.check_frame(frame, self.expected("activation", micro, ids))
            enc, _ = wire.from_frame(frame)
            t0 = time.perf_counter()
            self.recv_state, x = self.codecs.forward.decode(self.recv_state, enc, ids, full=self.warm())
            self.times["codec_s"] += time.perf_counter() - t0
            x = jnp.asarray(x)
            self.inputs[micro] = x
            if self.last:
                loss, (gp, gx) = self._timed("compute_s", self._loss_grad, self.params, x, tokens, labels)
                self.losses.append(float(loss) * self.micro_batches)
                self._accumulate(gp)
                self.pending[micro] = self._encode_grad(micro, ids, gx)
                return None
            h = self._timed("compute_s", self._fwd, self.params, x, tokens)
        t0 = time.perf_counter()
        keys = self._keys(self.index, 0, ids)
        self.send_state, enc = self._encode(self.codecs.forward, "fw", self.send_state, np.asarray(h), ids, keys)
        self.times["codec_s"] += time.perf_counter() - t0
        return wire.to_frame(
            enc, run_id=self.run_id, link=self.index, kind="activation", step=self.step, micro_batch=micro, ids=ids
        )

    def _encode_grad(self, micro: int, ids, gx):
        t0 = time.perf_counter()
        keys = self._keys(self.index - 1, 1, ids)
        _, enc = self._encode(self.codecs.backward, "bw", None, np.asarray(gx), ids, keys)
        self.times["codec_s"] += time.perf_counter() - t0
        return wire.to_frame(
            enc, run_id=self.run_id, link=self.index - 1, kind="gradient", step=self.step, micro_batch=micro, ids=ids
        )

    def backward(self, micro: int, ids, tokens, frame=None):
        """Backward of one micro-batch. Returns the gradient frame for link ``index − 1`` (None on stage 0).

        ``frame`` is the gradient frame from stage ``index + 1`` (None on the last stage).
        """
        if self.last:
            return None if self.first else self.pending.pop(micro)
        wire.check_frame(frame, self.expected("gradient", micro, ids))
        enc, _ = wire.from_frame(frame)
        t0 = time.perf_counter()
        _, g = self.codecs.backward.decode(None, enc, ids, full=self.warm())
        self.times["codec_s"] += time.perf_counter() - t0
        g = jnp.asarray(g)
        tokens = jnp.asarray(tokens)
        if self.first:
            gp = self._timed("compute_s", self._bwd, self.params, tokens, g)
            self._accumulate(gp)
            return None
        gp, gx = self._timed("compute_s", self._bwd, self.params, self.inputs.pop(micro), tokens, g)
        self._accumulate(gp)
        return self._encode_grad(micro, ids, gx)

    def finish_step(self, update=None) -> float | None:
        """Apply AdamW with the accumulated gradients; returns the step's loss (last stage) or None.

        ``update(params, opt_state, grads, optimizer_update) -> (params, opt_state)`` replaces the
        update (the data-parallel replicas average first, :mod:`zeroth.pipeline.replicas`);
        ``optimizer_update`` is this stage's jitted optimizer step. Its seconds count as compute (the
        caller has the average in hand: the exchange is timed by the caller).
        """
        if update is not None:
            self.params, self.opt_state = self._timed(
                "compute_s", update, self.params, self.opt_state, self.grads, self._update
            )
        else:
            with jax.numpy_dtype_promotion("standard"):
                self.params, self.opt_state = self._timed(
                    "compute_s", self._update, self.params, self.opt_state, self.grads
                )
        loss = float(np.mean(self.losses)) if self.losses else None
        times = dict(self.times)
        cq = {}
        for d in ("fw", "bw"):
            cq[f"{d}_cq"], cq[f"{d}_cq_max"] = cq_summary(self.cq[d])
            cq[f"{d}_cq_init"] = cq_summary(self.cq_init[d])[0]
        self.last_cq = cq
        self.step += 1
        self._reset()
        self.last_times = times
        return loss

    # ------------------------------------------------------------------ reporting

    def buffer_digests(self) -> dict[str, str | None]:
        """SHA-256 of this end's buffers: ``send`` (link ``index``) and ``recv`` (link ``index − 1``)."""
        return {"send": C.buffer_digest(self.send_state), "recv": C.buffer_digest(self.recv_state)}

    def buffer_nbytes(self) -> int:
        """Bytes of AQ-SGD buffers this stage holds."""
        return C.buffer_nbytes(self.send_state) + C.buffer_nbytes(self.recv_state)
