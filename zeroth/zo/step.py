"""One machine's MeZO step: estimate, encode, update (held or deferred) in one compiled call."""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from zeroth import codecs as _codecs
from zeroth import noise as _noise
from zeroth import replay as _replay
from zeroth import rng as _rng
from zeroth import schedules as _schedules
from zeroth.zo import update as _update
from zeroth.zo import estimator as _estimator

__all__ = [
    "StepResult",
    "Held",
    "Deferred",
    "onebyte_scales",
    "settle",
    "mezo_step",
]


class StepResult(NamedTuple):
    """The outcome of :func:`mezo_step`."""

    params: Any  # the updated parameters (same structure and dtypes), or a Held (mezo_step(..., hold=True))
    grads: np.ndarray  # f32[n]: the decoded projected gradients, exactly what was applied
    payload: bytes  # codec.encode(raw gradients): what this machine would send to its peers
    loss: float  # mean over the n pairs of (L(θ+εz) + L(θ−εz)) / 2, before the update


class Held(NamedTuple):
    """Parameters whose last update is held back (``mezo_step(..., hold=True)``).

    The next :func:`mezo_step` applies it inside its own compiled program, before the forward
    passes of its projected gradients (:meth:`ProjectedGradientsFn.after_update`): one program
    call per step instead of two, the same bits. :func:`settle` applies it alone, for a caller
    that reads the parameters (an evaluation, a digest, a checkpoint). A step's update is known
    only once its projected gradients are on the host, so holding it is what lets a step run as
    one call; on a GPU each call costs host time that the device spends idle.
    """

    params: Any  # the parameters before the held update: a pytree, or its zeroth.replay.Flat
    keys: np.ndarray  # u32[K, 2]: the held update's keys, in canonical order
    # its coefficients (_update.update_coefficients), one per key; None for a deferred step's (see outcome)
    coefficients: tuple[float, ...] | None
    decay: np.float32 | None  # the weight-decay factor (_update.decay_factor) applied after it, or None
    distribution: str
    # the next step's keys, derived while the device ran this step's program: ((run_seed, machine,
    # iteration, n), u32[n, 2]); mezo_step uses them where they name its perturbations
    ahead: tuple[tuple[int, int, int, int], np.ndarray] | None = None
    # a deferred step's (mezo_step(..., defer=True)): its outcome, which holds the update's scales
    # and decay factor as the program computed them on the device
    outcome: _Outcome | None = None


class _Outcome:
    """A deferred step's outcome (``mezo_step(..., defer=True)``), on the device until
    :meth:`result` fetches and checks it: the projected gradients and losses, their one-byte codes,
    and the update's scales and decay factor (:func:`_encoded`), which the next step's program
    applies without the host."""

    __slots__ = (
        "g",
        "losses",
        "codes",
        "scales",
        "factor",
        "iteration",
        "lr",
        "eps",
        "scaling",
        "distribution",
        "_result",
    )

    def __init__(
        self,
        g,
        losses,
        codes,
        scales,
        factor,
        *,
        iteration: int,
        lr: float,
        eps: float,
        scaling: str,
        distribution: str,
    ):
        # device arrays, as _encoded returns them (factor: None without weight decay)
        self.g, self.losses, self.codes, self.scales, self.factor = g, losses, codes, scales, factor
        self.iteration, self.lr, self.eps, self.scaling, self.distribution = iteration, lr, eps, scaling, distribution
        self._result: _Resolved | None = None

    def result(self) -> _Resolved:
        """Fetched and checked once (then kept): the host encodes the fetched ``g`` itself
        (:func:`_host_update`: a non-finite one raises ``ValueError``, naming the iteration) and
        the program's codes and scales must equal the host's bit for bit (``RuntimeError`` if
        not: the backend broke the determinism contract)."""
        if self._result is not None:
            return self._result
        g, losses, codes, scales = jax.device_get((self.g, self.losses, self.codes, self.scales))
        payload, decoded, coefficients = _host_update(
            g, losses, _codecs.ONEBYTE, self.lr, self.scaling, iteration=self.iteration, eps=self.eps
        )
        host_scales = _replay.update_scales(self.distribution, coefficients)
        if payload != np.asarray(codes, np.uint8).tobytes() or not np.array_equal(
            host_scales.view(np.uint32), np.asarray(scales, np.float32).view(np.uint32)
        ):
            raise RuntimeError(
                f"iteration {self.iteration}: the program's one-byte codes {np.asarray(codes).tolist()} and scales "
                f"{np.asarray(scales).tolist()} differ from the host's {list(payload)} and {host_scales.tolist()} for "
                f"the projected gradients {np.asarray(g).tolist()}; this backend breaks the determinism contract "
                f"(run `zeroth doctor`), and mezo_step(..., defer=False) computes them on the host"
            )
        self._result = _Resolved(decoded, payload, float(np.mean(losses)), tuple(coefficients))
        self.g = self.losses = self.codes = None  # fetched; the scales and factor may still be applied
        return self._result


class _Resolved(NamedTuple):
    grads: np.ndarray
    payload: bytes
    loss: float
    coefficients: tuple[float, ...]


class Deferred(NamedTuple):
    """What ``mezo_step(..., hold=True, defer=True)`` returns: the step's :class:`Held`
    parameters, at once, and its outcome when asked (:meth:`result`).

    The step's program encodes its projected gradients itself (one byte each, integer operations
    that give the host's codes) and looks up the update's scales in a table of the 256 codes that
    the host rounded ahead of time (:func:`onebyte_scales`), so the next step's program can apply
    the update before the host has seen the step: the host dispatches step t + 1, then fetches
    step t while the device runs it. The fetched values are checked against the host's own
    encoding and rounding, so the bits are those of ``defer=False``.
    """

    params: Held

    def result(self) -> StepResult:
        """The :class:`StepResult` (``params`` is :attr:`params`), fetched and checked: raises
        ``ValueError`` for a non-finite projected gradient, as ``mezo_step`` does (the next step's
        program, if it ran, applied no update for it), and ``RuntimeError`` if the program's codes
        or scales differ from the host's."""
        r = self.params.outcome.result()
        return StepResult(self.params, r.grads, r.payload, r.loss)


@functools.lru_cache(maxsize=64)
def _onebyte_scales(lr: float, n_total: int, scaling: str, distribution: str) -> np.ndarray:
    if not math.isfinite(lr) or n_total < 1:
        raise ValueError(f"onebyte_scales needs a finite lr and n_total >= 1, got lr={lr!r}, n_total={n_total!r}")
    # _update.update_coefficients' float64 operations, on all 256 values at once (NumPy's IEEE operations
    # give Python's bits), rounded once by update_scales as _update.update_coefficients then update_scales
    # round twice (the second rounding is the identity)
    raw = (-lr * _codecs.ONEBYTE_TABLE.astype(np.float64)) / _update._denominator(n_total, scaling)
    table = _replay.update_scales(distribution, raw)
    table.setflags(write=False)
    return table


def onebyte_scales(lr: float, n_total: int, scaling: str = "sqrt", distribution: str = "binomial") -> np.ndarray:
    """``f32[256]``: the replay scale of each one-byte code, ``update_scales(_update.update_coefficients(
    ONEBYTE_TABLE, lr, n_total, scaling))``: entry ``b`` is the scale a projected gradient encoded
    as ``b`` is applied with, rounded on the host (cached per argument; read-only).

    Example:
      >>> from zeroth import codecs
      >>> t = onebyte_scales(0.5, 4)
      >>> float(t[codecs.ONEBYTE_ZERO]), float(t[0xC0])  # g = 0 and g = 1: c = -0.5 / 2, z = k / 2
      (0.0, -0.125)
    """
    _update._check_scaling(scaling)
    _noise.check_distribution(distribution)
    return _onebyte_scales(float(lr), int(n_total), scaling, distribution)


def settle(params: Any) -> Any:
    """The parameters with a :class:`Held` update applied (the held parameters are donated), as
    :func:`zeroth.replay.replay` and :func:`weight_decay` apply it; anything else as it is.

    Example:
      >>> loss = lambda p, b: jnp.sum((p["w"] - b) ** 2)
      >>> out = mezo_step(loss, {"w": jnp.zeros(4)}, jnp.ones(4), run_seed=0, iteration=0, lr=0.1,
      ...                 eps=1e-2, hold=True)
      >>> type(out.params).__name__, settle(out.params)["w"].shape
      ('Held', (4,))
    """
    if not isinstance(params, Held):
        return params
    coefficients = params.coefficients
    if params.outcome is not None:  # fetched and checked now (a refused step raises here, naming it)
        try:
            coefficients = params.outcome.result().coefficients
        except ValueError as exc:
            exc.params = params.params  # its update not applied
            raise
    out = _replay.replay(
        params.params, (params.keys, list(coefficients)), distribution=params.distribution, donate=True
    )
    return out if params.decay is None else _update._decay_donated(out, params.decay)


def _host_update(g, losses, cod, lr: float, scaling: str, *, iteration: int, eps: float):
    """The host's part of :func:`mezo_step` between its projected gradients and its replay:
    ``(payload, decoded, coefficients)`` of the fetched ``g`` (``f32[n]``), refusing a non-finite
    one. ``zeroth bench zo`` times it alone (with the keys' derivation) to attribute a step's time."""
    g = np.asarray(g, np.float32)
    if not all(map(math.isfinite, g.tolist())):  # one NumPy call where all are finite: the common case
        i = int(np.flatnonzero(~np.isfinite(g))[0])
        raise ValueError(
            f"projected gradient {i} of iteration {iteration} is {float(g[i])!r} (mean loss of the pair {float(losses[i])!r}); "
            f"the loss is not finite at θ ± εz: lower lr (now {lr}) or eps (now {eps})"
        )
    payload = cod.encode(g)
    decoded = cod.decode(payload)
    return payload, decoded, _update.update_coefficients(decoded, lr, decoded.size, scaling)


def mezo_step(
    loss_fn: Callable[[Any, Any], jax.Array],
    params: Any,
    batch: Any,
    *,
    run_seed: int,
    iteration: int,
    lr: float | _schedules.Schedule,
    eps: float,
    n_perturbations: int = 1,
    machine: int = 0,
    scaling: str = "sqrt",
    distribution: str = "binomial",
    codec: str = "float32",
    weight_decay: float = 0.0,
    donate: bool = False,
    hold: bool = False,
    unroll: bool = False,
    defer: bool = False,
) -> StepResult | Deferred:
    """One MeZO / Just One Byte iteration on one machine (N = ``n_perturbations``).

    keys ``sample_key(run_seed, machine, iteration, i)`` -> projected gradients (compiled with
    :func:`compiler_options`) -> ``codec`` encode/decode -> :func:`canonical_updates` ->
    ``replay`` (exact) -> optional :func:`weight_decay`. Bit-identical to replaying the same
    decoded gradients with :mod:`zeroth.reference`.

    Args:
      loss_fn: ``loss_fn(params, batch) -> scalar`` (hashable; its compiled estimator is cached).
      params, batch: the model parameters and the batch. ``params`` may be the
        :class:`zeroth.replay.Flat` of the tree ``loss_fn`` takes: the step then passes a buffer per
        dtype to each compiled call instead of an array per leaf, with the same bits, and returns a
        ``Flat``.
      run_seed, iteration, machine: name the perturbations.
      lr, eps: learning rate η (a number, or a :class:`zeroth.schedules.Schedule`: η_t of
        ``iteration``, which also scales the weight decay) and perturbation size ε (host-rounded).
      n_perturbations: n >= 1.
      scaling: ``"sqrt"`` or ``"linear"``.
      distribution: ``"binomial"`` or ``"rademacher"``.
      codec: ``"float32"`` or ``"onebyte"`` (:func:`zeroth.codecs.get_codec`).
      weight_decay: λ (0 = none).
      donate: update ``params`` in place (the input must not be used afterwards).
      hold: return the parameters as a :class:`Held`: this step's update (and weight decay) not
        applied yet, for the next ``mezo_step`` to apply inside its program (one compiled call per
        step) or :func:`settle` to apply alone; both donate the Held's parameters, which are
        ``params`` itself with ``donate``, else a copy. ``params`` may be a :class:`Held` whatever
        ``hold`` is: its update is applied first, in the same program as this step's projected
        gradients, and its parameters are donated (if the step then raises, the error's
        ``params`` attribute holds them with that update applied).
      unroll: evaluate the 2n forward passes as straight-line code instead of a loop
        (:func:`projected_gradients`); the update is the same.
      defer: with ``hold`` and the ``onebyte`` codec, return a :class:`Deferred` at once, before
        the device has run the step: its program encodes the projected gradients and looks up the
        update's scales itself, so the next step's program can apply the update without waiting
        for the host, which fetches and checks this step's outcome while the device runs the next
        (:meth:`Deferred.result`; a non-finite projected gradient is then reported one step late,
        and its update is not applied). The same bits.

    Returns:
      a :class:`StepResult`, or with ``defer`` a :class:`Deferred`.

    Raises:
      ValueError: bad arguments, or a non-finite projected gradient (the losses are named).
    """
    if isinstance(n_perturbations, bool) or not isinstance(n_perturbations, (int, np.integer)) or n_perturbations < 1:
        raise ValueError(f"n_perturbations must be an integer >= 1, got {n_perturbations!r}")
    _update._check_scaling(scaling)
    if defer and (not hold or codec != "onebyte"):
        raise ValueError(
            f"defer=True needs hold=True and codec='onebyte' (the program encodes its projected gradients and "
            f"looks up the update's scales itself, which only the one-byte code's fixed table allows), got "
            f"hold={hold!r}, codec={codec!r}"
        )
    lr = _update.lr_at(lr, iteration)
    cod = _codecs.get_codec(codec)
    eps_scale = _estimator.round_eps(eps)
    decay_to = _update.decay_factor(lr, weight_decay) if weight_decay else None  # validated before any work
    n = int(n_perturbations)

    def keys_of(it: int) -> np.ndarray:  # the n perturbations' keys of this machine's iteration it
        return _rng.sample_keys(run_seed, [(machine, it, i) for i in range(n)])

    if isinstance(params, Held) and params.ahead is not None and params.ahead[0] == (run_seed, machine, iteration, n):
        keys = params.ahead[1]
    else:
        keys = keys_of(iteration)
    estimator = _estimator.projected_gradients_fn(loss_fn, distribution=distribution, unroll=unroll)
    enc = (onebyte_scales(lr, n, scaling, distribution), decay_to) if defer else None
    before = None  # the previous step's outcome, if it was deferred: checked once this step is under way
    if isinstance(params, Held):
        if params.distribution != distribution:
            raise ValueError(
                f"the held update is of distribution {params.distribution!r}; this step's is {distribution!r}"
            )
        before = params.outcome
        if before is None:
            held = (params.keys, _replay.update_scales(distribution, list(params.coefficients)), params.decay)
        else:
            held = (params.keys, before.scales, before.factor)
        params, *out = estimator.after_update(params.params, held, batch, keys, eps_scale, enc)
        donate = True  # the held parameters were this function's, and these are the program's output
    else:
        out = estimator(params, batch, keys, eps_scale, enc)
    ahead = None
    if hold:  # while the device runs the program: the keys of the step that will apply this one's update
        try:
            ahead = ((run_seed, machine, iteration + 1, n), keys_of(iteration + 1))
        except ValueError:  # the last iteration a key can name: the next step says so itself
            pass
    if before is not None:
        try:
            before.result()
        except (
            ValueError,
            RuntimeError,
        ) as exc:  # ValueError: its update was not applied (_encoded); these are the parameters it had
            exc.params = params
            raise
    if defer:
        outcome = _Outcome(*out, iteration=iteration, lr=lr, eps=eps, scaling=scaling, distribution=distribution)
        return Deferred(Held(params, keys, None, decay_to, distribution, ahead, outcome))
    g, losses = jax.device_get(tuple(out))
    try:
        payload, decoded, coefficients = _host_update(g, losses, cod, lr, scaling, iteration=iteration, eps=eps)
    except ValueError as exc:
        exc.params = params  # a held input was donated: these are its parameters, its update applied
        raise
    if hold:
        if not donate:  # the Held's parameters are donated later (settle, the next step): not the caller's
            params = jax.tree_util.tree_map(jnp.copy, params)
        return StepResult(
            Held(params, keys, tuple(coefficients), decay_to, distribution, ahead),
            decoded,
            payload,
            float(np.mean(losses)),
        )
    # canonical_updates(run_seed, iteration, {machine: decoded}, lr, scaling), without re-deriving the keys
    updates = list(zip(keys, coefficients, strict=True))
    params = _replay.replay(params, updates, distribution=distribution, donate=donate)
    if decay_to is not None:
        params = _update._decay_donated(params, decay_to)
    return StepResult(params, decoded, payload, float(np.mean(losses)))
