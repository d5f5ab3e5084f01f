"""Gradient synchronization over a topology, as small composable transformations (optax style).

A :class:`SyncTransform` is three pure functions closing over their hyperparameters:

* ``init(d) -> state``: one worker's state for a flat update vector ``f32[d]``;
* ``update(u, state, ctx) -> (g, state, contribution)``: runs *inside* ``jax.shard_map``; ``u`` is
  this worker's local update ``f32[d]`` (the local step size times its gradient), ``g`` the global
  update every worker applies (``x <- x - g``; bit-identical on all workers), ``contribution``
  what of this worker's ``u`` the receivers decode (its compressed message, decoded) where a
  method can say, else ``g``;
* ``phase(t) -> str``: on the host, the kind of round ``t`` (``"sync"``, or ``"full"`` for a
  full-precision round); a training loop compiles one step per phase, so no branch is traced.

The methods (seed 004 and its baselines) are compositions:

====================  ==================================================================================
``psgd``              :func:`mean_allreduce`: full-precision multi-hop all-reduce, ``g = mean_m u_m``
``signsgd``           :func:`sign_count_allreduce`: bit-sliced counts of signs (bit length grows per
                      hop), ``g = eta_s * mean_m sign(u_m)``
``majority_vote``     the same counts, thresholded to one bit before the all-gather,
                      ``g = eta_s * sign(sum_m sign(u_m))`` (ties +1)
``ef_signsgd``        ``compensate(scaled_sign_allgather(), target="contribution")``: error feedback
                      on ``(||p||_1 / d) sign(p)``, every worker's message all-gathered
``ef_signsgd_count``  the same error feedback, the signs summed as counts over the hops and the
                      scales all-gathered (:func:`scaled_sign_count_allreduce`): the seed's baseline,
                      "extended to MAR by dynamically changing the bit length"
``ssdm``              :func:`ssdm_cascade`: cascading compression (decompress, add, recompress per hop),
                      the seed's Table 1 row; ``norm="bucket"`` sends a norm per bucket of elements
``ssdm_count``        :func:`stochastic_sign_count_allreduce`: SSDM's stochastic signs summed as counts
                      (bit length up to ``planes_for(M)``), ``g = eta_s * (mean of the signs)``
``marsit``            ``compensate(periodic(sign_merge_allreduce(eta_s), K, mean_allreduce()),
                      target="global", reset_phases=("full",))``: Algorithm 1
====================  ==================================================================================

Example (inside ``jax.shard_map``)::

    sync = marsit(Ring(4), eta_s=1e-3, K=100)
    state = sync.init(d)
    g, state, _ = sync.update(eta_l * grad, state, RoundCtx(key, sync.phase(t)))
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from zeroth import reference as _ref
from zeroth import rng as _rng
from zeroth.collectives import ring as _ring
from zeroth.collectives import schemes as _schemes
from zeroth.kernels import signbits as sb

__all__ = [
    "RoundCtx",
    "SyncTransform",
    "MARSIT_TAG",
    "round_key",
    "host_round_key",
    "mean_allreduce",
    "sign_merge_allreduce",
    "sign_count_allreduce",
    "scaled_sign_allgather",
    "scaled_sign_count_allreduce",
    "stochastic_sign_count_allreduce",
    "ssdm_cascade",
    "compensate",
    "periodic",
    "CompensationState",
    "psgd",
    "signsgd",
    "majority_vote",
    "ef_signsgd",
    "ef_signsgd_count",
    "ssdm",
    "ssdm_count",
    "marsit",
    "METHODS",
    "build",
]

MARSIT_TAG = 0x6D617273  # "mars": folded into the run key to name the synchronization keys


class RoundCtx(NamedTuple):
    """What a round's ``update`` needs besides the vector.

    Attributes:
      key: ``u32[2]`` round key (:func:`round_key`; traced, so rounds share one compilation).
      phase: the round's phase (static), from ``SyncTransform.phase(t)``.
      scale: factor on the global step size ``eta_s`` this round (a step-size schedule that
        divides the local step size divides ``eta_s`` with it); ``1.0`` leaves the bits unchanged.
    """

    key: jax.Array
    phase: str
    scale: Any = 1.0


class SyncTransform(NamedTuple):
    """``init``, ``update`` and ``phase`` of one synchronization method (see module docstring)."""

    init: Callable[[int], Any]
    update: Callable[[jax.Array, Any, RoundCtx], tuple[jax.Array, Any, jax.Array]]
    phase: Callable[[int], str]


def host_round_key(run_seed: int, t: int) -> np.ndarray:
    """``u32[2]`` key of round ``t``: ``fold_in(fold_in(root_key(run_seed), MARSIT_TAG), t)`` (host)."""
    return _ref.fold_in(_ref.fold_in(_ref.root_key(run_seed), MARSIT_TAG), t)


def round_key(run_key: jax.Array, t) -> jax.Array:
    """Traceable: ``fold_in(run_key, t)`` with ``run_key = fold_in(root_key(run_seed), MARSIT_TAG)``."""
    return _rng.fold_in(run_key, jnp.asarray(t).astype(jnp.uint32))


def _always(name: str) -> Callable[[int], str]:
    return lambda t: name


def _check_vec(u: jax.Array) -> None:
    if u.ndim != 1 or u.dtype != jnp.float32:
        raise TypeError(f"sync updates take one worker's flat f32[d] vector, got dtype {u.dtype} shape {u.shape}")


def _pad(u: jax.Array, n: int) -> jax.Array:
    return jnp.pad(u, (0, n - u.shape[0]))


def _eta(eta_s: float) -> float:
    if not (isinstance(eta_s, (int, float)) and math.isfinite(eta_s) and eta_s > 0):
        raise ValueError(f"eta_s (the global step size) must be a finite float > 0, got {eta_s!r}")
    return float(eta_s)


# --------------------------------------------------------------------------- aggregations


def mean_allreduce(topology) -> SyncTransform:
    """PSGD's synchronization: ``g = (1/M) sum_m u_m`` by the full-precision multi-hop all-reduce."""

    def update(u, state, ctx):
        _check_vec(u)
        return _ring.allreduce_mean(u, topology), state, u

    return SyncTransform(lambda d: (), update, _always("sync"))


def sign_merge_allreduce(topology, eta_s: float, *, impl: str = "auto") -> SyncTransform:
    """Marsit's one-bit synchronization (Algorithm 1, lines 4-9): ``g = eta_s * (merged signs)``.

    The signs of ``u`` are packed, every hop merges with the transient vector of eq. (2), and the
    all-gather moves the merged bits; ``g`` is ``+eta_s`` / ``-eta_s`` per element.
    """
    eta = _eta(eta_s)

    def update(u, state, ctx):
        _check_vec(u)
        d = u.shape[0]
        dp = _ring.padded_length(d, topology, sb.WORD_BITS)
        words = sb.pack(_pad(u, dp), impl=impl)
        merged = _ring.allreduce(words, _schemes.marsit_scheme(impl=impl), topology.stages, round_key=ctx.key)
        g = sb.unpack(merged.reshape(-1), (dp,), scale=jnp.float32(eta) * ctx.scale, impl=impl)[:d]
        return g, state, g

    return SyncTransform(lambda d: (), update, _always("sync"))


def _count_signs(words, d: int, dp: int, topology, eta, vote: bool, impl: str) -> jax.Array:
    """``g`` of packed sign words ``u32[dp/32]``: their counts summed by the multi-hop all-reduce
    (bit-sliced, up to ``planes_for(M)`` bits per element), as the mean sign or the majority."""
    m_total = topology.size
    planes = _ring.allreduce((words,), _schemes.count_scheme(m_total, vote=vote), topology.stages)
    flat = tuple(p.reshape(-1) for p in planes)
    if vote:
        return sb.unpack(flat[0], (dp,), scale=eta, impl=impl)[:d]
    c = _schemes.planes_to_counts(flat)[:d]
    return eta * (2 * c - m_total).astype(jnp.float32) / jnp.float32(m_total)


def sign_count_allreduce(topology, eta_s: float, *, vote: bool = False, impl: str = "auto") -> SyncTransform:
    """signSGD over multi-hop all-reduce with bit-sliced sign counts.

    ``vote=False``: ``g = eta_s * (2 c - M) / M`` (the mean sign; counts all-gathered at
    ``planes_for(M)`` bits). ``vote=True``: ``g = eta_s * (+1 if 2 c >= M else -1)`` (majority vote,
    the one-bit result all-gathered). ``c`` = number of workers with a non-negative element.
    """
    eta = _eta(eta_s)

    def update(u, state, ctx):
        _check_vec(u)
        d = u.shape[0]
        dp = _ring.padded_length(d, topology, sb.WORD_BITS)
        words = sb.pack(_pad(u, dp), impl=impl)
        g = _count_signs(words, d, dp, topology, jnp.float32(eta) * ctx.scale, vote, impl)
        return g, state, g

    return SyncTransform(lambda d: (), update, _always("sync"))


def stochastic_sign_count_allreduce(
    topology, eta_s: float, *, norm: str = "l2", bucket: int = 256, impl: str = "auto"
) -> SyncTransform:
    """SSDM extended to the multi-hop all-reduce by bit length (seed 004, section 5, "Baselines").

    Every worker draws SSDM's stochastic signs of ``u`` (``+1`` with probability
    ``1/2 + u_j / (2 ||u||)``, its own keys: the round key folded with its worker index); the
    signs are summed as bit-sliced counts over the hops (up to ``planes_for(M)`` bits per element,
    as :func:`sign_count_allreduce`) and ``g = eta_s * (2 c - M) / M``, so
    ``E[g] = eta_s * mean_m u_m / ||u_m||``. ``norm``: ``"l2"`` (the seed's, whole vector),
    ``"linf"`` or ``"bucket"`` (the l2 norm of every ``bucket`` consecutive elements).
    """
    eta = _eta(eta_s)
    _schemes.check_norm(norm, bucket)

    def update(u, state, ctx):
        _check_vec(u)
        d = u.shape[0]
        dp = _ring.padded_length(d, topology, _schemes.norm_unit(norm, bucket))
        key = _rng.fold_in(ctx.key, _ring.worker_index(topology).astype(jnp.uint32))
        _, words = _schemes.ssdm_compress(_pad(u, dp), key, norm=norm, bucket=bucket, impl=impl)
        g = _count_signs(words, d, dp, topology, jnp.float32(eta) * ctx.scale, False, impl)
        return g, state, g

    return SyncTransform(lambda d: (), update, _always("sync"))


def scaled_sign_count_allreduce(topology, *, impl: str = "auto") -> SyncTransform:
    """EF-signSGD's scaled sign extended to the multi-hop all-reduce by bit length.

    Worker ``m``'s message is ``s_m sign(u_m)`` with ``s_m = ||u_m||_1 / d``. The signs are summed
    as bit-sliced counts over the hops (up to ``planes_for(M)`` bits per element) and the M scales
    all-gathered (32 bits each); ``g = mean_m(s_m) * (2 c - M) / M``. The contribution (for error
    feedback) is this worker's own ``s_m sign(u_m)``.
    """

    def update(u, state, ctx):
        _check_vec(u)
        d = u.shape[0]
        dp = _ring.padded_length(d, topology, sb.WORD_BITS)
        scale = jnp.sum(jnp.abs(u)) / jnp.float32(d)
        words = sb.pack(_pad(u, dp), impl=impl)
        scales = _ring.all_gather_workers(scale[None], topology).reshape(-1)
        mean_scale = jnp.sum(scales) / jnp.float32(topology.size)
        g = mean_scale * _count_signs(words, d, dp, topology, jnp.float32(1.0), False, impl)
        mine = sb.unpack(words, (dp,), scale=scale, impl=impl)[:d]
        return g, state, mine

    return SyncTransform(lambda d: (), update, _always("sync"))


def scaled_sign_allgather(topology, *, impl: str = "auto") -> SyncTransform:
    """Every worker sends ``(s_m, sign bits of u_m)`` with ``s_m = ||u_m||_1 / d`` to all others
    (ring all-gathers of the compressed messages); ``g = (1/M) sum_m s_m sign(u_m)`` summed in
    worker order. The contribution is ``s_m sign(u_m)`` (for error feedback).
    """

    def update(u, state, ctx):
        _check_vec(u)
        d = u.shape[0]
        dp = -(-d // sb.WORD_BITS) * sb.WORD_BITS
        scale = jnp.sum(jnp.abs(u)) / jnp.float32(d)
        words = sb.pack(_pad(u, dp), impl=impl)
        scales, all_words = _ring.all_gather_workers((scale, words), topology)
        total = None
        for m in range(topology.size):
            part = sb.unpack(all_words[m], (dp,), scale=scales[m], impl=impl)[:d]
            total = part if total is None else total + part
        g = total / jnp.float32(topology.size)
        mine = sb.unpack(words, (dp,), scale=scale, impl=impl)[:d]
        return g, state, mine

    return SyncTransform(lambda d: (), update, _always("sync"))


def ssdm_cascade(topology, *, norm: str = "l2", bucket: int = 256, impl: str = "auto") -> SyncTransform:
    """SSDM with cascading compression: every hop sends ``Q(received + own)`` at one bit plus a norm;
    ``g = (1/M) * (decoded all-gathered result)``. Unbiased, with a variance that explodes with M
    (``norm="l2"``, the seed's; ``"linf"`` is the milder max-norm variant; ``"bucket"`` sends the
    l2 norm of every ``bucket`` elements, so a hop's norm grows with the bucket, not the vector).
    """
    scheme = _schemes.ssdm_scheme(norm=norm, bucket=bucket, impl=impl)
    unit = _schemes.norm_unit(norm, bucket)

    def update(u, state, ctx):
        _check_vec(u)
        d = u.shape[0]
        dp = _ring.padded_length(d, topology, unit)
        norms, words = _ring.allreduce(_pad(u, dp), scheme, topology.stages, round_key=ctx.key)
        words = words.reshape(-1, words.shape[-1])  # one row per final segment, in segment order
        if norm == "bucket":
            norms = norms.reshape(words.shape[0], -1)
        else:
            norms = norms.reshape(-1)
        parts = [_schemes.ssdm_decompress((norms[j], words[j]), impl=impl) for j in range(words.shape[0])]
        g = jnp.concatenate(parts)[:d] / jnp.float32(topology.size)
        return g, state, g

    return SyncTransform(lambda d: (), update, _always("sync"))


# --------------------------------------------------------------------------- combinators


class CompensationState(NamedTuple):
    """State of :func:`compensate`."""

    compensation: jax.Array  # f32[d], this worker's compensation (error) vector
    inner: Any  # the wrapped transform's state


def compensate(inner: SyncTransform, *, target: str = "global", reset_phases: Sequence[str] = ()) -> SyncTransform:
    """Add a compensation vector to the update before ``inner`` and keep what was not applied.

    ``p = u + c``; ``g, _, contrib = inner(p)``; then ``c <- p - g`` (``target="global"``: Marsit's
    global compensation, Algorithm 1 line 10) or ``c <- p - contrib`` (``target="contribution"``:
    error feedback on this worker's own compressed message). In a phase of ``reset_phases`` the
    compensation becomes 0 (Marsit's full-precision rounds, line 13).
    """
    if target not in ("global", "contribution"):
        raise ValueError(f"compensate target must be 'global' or 'contribution', got {target!r}")
    resets = tuple(reset_phases)

    def init(d):
        return CompensationState(jnp.zeros((d,), jnp.float32), inner.init(d))

    def update(u, state, ctx):
        _check_vec(u)
        p = u + state.compensation
        g, inner_state, contrib = inner.update(p, state.inner, ctx)
        if ctx.phase in resets:
            c = jnp.zeros_like(p)
        else:
            c = p - (g if target == "global" else contrib)
        return g, CompensationState(c, inner_state), contrib

    return SyncTransform(init, update, inner.phase)


def periodic(inner: SyncTransform, every: int | None, full: SyncTransform) -> SyncTransform:
    """Rounds ``t`` with ``t % every == 0`` use ``full`` (phase ``"full"``), the others ``inner``.

    ``every=None`` means never (K = infinity); ``every=1`` means always ``full``.
    """
    if every is not None and (not isinstance(every, int) or isinstance(every, bool) or every < 1):
        raise ValueError(
            f"K (rounds between full-precision synchronizations) must be an int >= 1 or None, got {every!r}"
        )

    def init(d):
        return (inner.init(d), full.init(d))

    def phase(t):
        return "full" if every is not None and t % every == 0 else inner.phase(t)

    def update(u, state, ctx):
        if ctx.phase == "full":
            g, s, contrib = full.update(u, state[1], ctx)
            return g, (state[0], s), contrib
        g, s, contrib = inner.update(u, state[0], ctx)
        return g, (s, state[1]), contrib

    return SyncTransform(init, update, phase)


# --------------------------------------------------------------------------- the methods


def psgd(topology) -> SyncTransform:
    """Parallel SGD: full-precision (32-bit) multi-hop all-reduce of the local updates."""
    return mean_allreduce(topology)


def signsgd(topology, eta_s: float, *, impl: str = "auto") -> SyncTransform:
    """signSGD: ``g = eta_s * mean of the workers' signs`` (bit-sliced counts, growing bit length)."""
    return sign_count_allreduce(topology, eta_s, vote=False, impl=impl)


def majority_vote(topology, eta_s: float, *, impl: str = "auto") -> SyncTransform:
    """signSGD with majority vote: ``g = eta_s * sign(sum of signs)``, ties +1."""
    return sign_count_allreduce(topology, eta_s, vote=True, impl=impl)


def ef_signsgd(topology, *, impl: str = "auto") -> SyncTransform:
    """EF-signSGD: error feedback around the scaled sign ``(||p||_1 / d) sign(p)``, all-gathered."""
    return compensate(scaled_sign_allgather(topology, impl=impl), target="contribution")


def ef_signsgd_count(topology, *, impl: str = "auto") -> SyncTransform:
    """EF-signSGD extended by bit length (seed 004's baseline): error feedback around the scaled
    sign, the signs summed as counts over the hops (:func:`scaled_sign_count_allreduce`)."""
    return compensate(scaled_sign_count_allreduce(topology, impl=impl), target="contribution")


def ssdm(topology, *, norm: str = "l2", bucket: int = 256, impl: str = "auto") -> SyncTransform:
    """SSDM's stochastic sign with cascading compression over the multi-hop all-reduce (seed 004's
    Table 1 "cascading compression")."""
    return ssdm_cascade(topology, norm=norm, bucket=bucket, impl=impl)


def ssdm_count(topology, eta_s: float, *, norm: str = "l2", bucket: int = 256, impl: str = "auto") -> SyncTransform:
    """SSDM extended by bit length (seed 004's Table 2 baseline): stochastic signs summed as counts."""
    return stochastic_sign_count_allreduce(topology, eta_s, norm=norm, bucket=bucket, impl=impl)


def marsit(topology, eta_s: float, K: int | None = None, *, impl: str = "auto") -> SyncTransform:
    """Marsit (seed 004, Algorithm 1): one-bit merges, global compensation, full precision every K.

    Args:
      topology: :class:`~zeroth.collectives.topology.Ring` or ``Torus``.
      eta_s: global step size on the aggregated signs.
      K: rounds ``t`` with ``t % K == 0`` synchronize in full precision and reset the
        compensation; ``None`` = never (K = infinity). ``K = 1`` is PSGD.
    """
    inner = periodic(sign_merge_allreduce(topology, eta_s, impl=impl), K, mean_allreduce(topology))
    return compensate(inner, target="global", reset_phases=("full",))


METHODS = ("psgd", "signsgd", "majority_vote", "ef_signsgd", "ef_signsgd_count", "ssdm", "ssdm_count", "marsit")


def build(
    method: str,
    topology,
    *,
    eta_s: float | None = None,
    K: int | None = None,
    norm: str = "l2",
    bucket: int = 256,
    impl: str = "auto",
) -> SyncTransform:
    """The :class:`SyncTransform` of a method by name (see :data:`METHODS`); ``norm`` and ``bucket``
    are SSDM's (``ssdm``, ``ssdm_count``).

    Raises:
      ValueError: unknown method, or ``eta_s`` missing for a method with a global step size.
    """
    if method not in METHODS:
        raise ValueError(f"unknown synchronization method {method!r}; expected one of {list(METHODS)}")
    needs_eta = method in ("signsgd", "majority_vote", "ssdm_count", "marsit")
    if needs_eta and eta_s is None:
        raise ValueError(f"method {method!r} needs eta_s (its global step size)")
    if method == "psgd":
        return psgd(topology)
    if method == "signsgd":
        return signsgd(topology, eta_s, impl=impl)
    if method == "majority_vote":
        return majority_vote(topology, eta_s, impl=impl)
    if method == "ef_signsgd":
        return ef_signsgd(topology, impl=impl)
    if method == "ef_signsgd_count":
        return ef_signsgd_count(topology, impl=impl)
    if method == "ssdm":
        return ssdm(topology, norm=norm, bucket=bucket, impl=impl)
    if method == "ssdm_count":
        return ssdm_count(topology, eta_s, norm=norm, bucket=bucket, impl=impl)
    return marsit(topology, eta_s, K, impl=impl)
