"""MeZO / Just One Byte on one machine: forward passes only, the update replayed exactly.

Step ``t`` (:func:`zo_method`), with ``n = train.n_perturbations`` and machine 0:

1. keys ``k_i = sample_key(run.seed, 0, t, i)`` for ``i < n``;
2. projected gradients ``g_i = (L(θ+εz_i) − L(θ−εz_i)) / (2ε)`` on the step's batch
   (:func:`zeroth.zo.projected_gradients`, ε host-rounded);
3. ``payload = codec.encode(g)``; ``ĝ = codec.decode(payload)``: the *decoded* values are applied,
   exactly what a peer would receive;
4. coefficients ``c_i = −η_t ĝ_i / √n`` (or ``/ n``) (:func:`zeroth.zo.update_coefficients`),
   ``η_t`` the host schedule of ``train.schedule`` at step ``t`` (:func:`zeroth.schedules.from_train`);
5. ``θ ← replay(θ, [(k_i, c_i)])``: the exact, backend-independent update of
   :mod:`zeroth.replay`; then the optional exact weight-decay step of :mod:`zeroth.zo`.

The step holds its update back (:class:`zeroth.zo.Held`): step ``t + 1`` applies it inside the
program of its own projected gradients, so a step is one compiled call (on a GPU each call
costs host time while the device waits), with the same bits; ``settle`` applies it alone
before the trainer evaluates, logs a digest or saves a checkpoint, and after the last step.
With the ``onebyte`` codec (the default) the step is also deferred (:class:`zeroth.zo.Deferred`):
its program encodes the projected gradients and looks up the update's scales in a table the host
rounded ahead of time, so the trainer dispatches step ``t + 1`` before it fetches step ``t``, whose
codes and scales are then checked against the host's (the same bits; a non-finite projected
gradient is reported when step ``t + 1`` runs, its update not applied).

With ``train.layout: flat`` (and with ``auto``, the default, where the parameters live on a GPU:
:func:`zeroth.replay.preferred_layout`) the state holds θ in the flat layout
(:func:`zeroth.replay.flatten`: the small leaves in one buffer per dtype), so that each compiled
call of a step passes a few arrays instead of one per leaf, with the bits of the tree (the digest,
the checkpoints and the evaluation are the tree's).

Example:
  >>> from zeroth.config import load_config_dict                     # doctest: +SKIP
  >>> method = zo_method(load_config_dict({}), model)                # doctest: +SKIP
  >>> state, info = method.step(method.init(params, key), batch)     # doctest: +SKIP
"""

from __future__ import annotations

from zeroth import codecs as _codecs
from zeroth import objectives as _objectives
from zeroth import replay as _replay
from zeroth import schedules as _schedules
from zeroth import zo as _zo
from zeroth.kernels import perturb as _kernels
from zeroth.methods.base import MACHINE, Later, Method, StepInfo, TrainState

__all__ = ["zo_method", "mezo_update"]


def mezo_update(
    cfg,
    loss_fn,
    params,
    batch,
    step: int,
    *,
    donate: bool,
    schedule: _schedules.Schedule,
    hold: bool = False,
    defer: bool = False,
) -> _zo.StepResult | _zo.Deferred:
    """One :func:`zeroth.zo.mezo_step` of machine 0 with the hyperparameters of ``cfg.train``
    and learning rate ``schedule(step)`` (:func:`zeroth.schedules.from_train` of ``cfg.train``);
    ``hold`` returns the parameters as a :class:`zeroth.zo.Held`, ``defer`` a :class:`zeroth.zo.Deferred`."""
    t = cfg.train
    return _zo.mezo_step(
        loss_fn, params, batch, run_seed=cfg.run.seed, iteration=step, lr=schedule, eps=t.eps,
        n_perturbations=t.n_perturbations, machine=MACHINE, scaling=t.lr_scaling,
        distribution=t.distribution, codec=t.codec, weight_decay=t.weight_decay, donate=donate, hold=hold,
        defer=defer,
    )  # fmt: skip


def zo_method(cfg, model, *, defer: bool | None = None) -> Method:
    """The MeZO / Just One Byte step on one machine: :func:`zeroth.zo.mezo_step` with machine 0.

    keys ``sample_key(run.seed, 0, step, i)`` -> projected gradients -> ``codec`` encode/decode ->
    canonical coefficients -> ``replay(..., donate=True)`` -> optional exact weight decay. The
    loss reported is the mean over the pairs of ``(L(θ+εz) + L(θ−εz)) / 2``, before the update.
    With ``train.layout: flat`` (or ``auto`` on a GPU), ``init`` lays the parameters out flat, donating
    them (``state.params`` is a :class:`zeroth.replay.Flat`; :func:`zeroth.replay.unflatten` gives the tree).
    ``defer`` (default: with the ``onebyte`` codec) runs the steps deferred (:class:`zeroth.zo.Deferred`),
    the method ``pipelined``; the same bits.
    """
    t = cfg.train
    loss_fn = _objectives.make_objective(t.objective, model)
    bytes_per_value = _codecs.get_codec(t.codec).bytes_per_value
    schedule = _schedules.from_train(t)
    _zo.round_eps(t.eps)  # validate early
    # the one-byte codec lets a step's program encode its projected gradients and look up its
    # update's scales itself (zeroth.zo.Deferred): the next step is dispatched before this one is fetched
    defer = t.codec == "onebyte" if defer is None else bool(defer)
    if defer and t.codec != "onebyte":
        raise ValueError(f"a deferred ZO step needs train.codec 'onebyte', got {t.codec!r}")

    def layout(params) -> str:
        return _replay.preferred_layout(_kernels.platform_of(params)) if t.layout == "auto" else t.layout

    def init(params, key):  # the flat layout takes the parameters over, as the first step's donation would
        return TrainState(0, _replay.flatten(params, donate=True) if layout(params) == "flat" else params, None, key)

    def step(state, batch):
        out = mezo_update(
            cfg, loss_fn, state.params, batch, state.step, donate=True, schedule=schedule, hold=True, defer=defer
        )
        if defer:  # fetched when a hook reads them, or by the next step while the device runs it
            outcome = out.params.outcome  # (not the Held: its parameters go to the next step)
            info = StepInfo(
                2 * t.n_perturbations,
                0,
                t.n_perturbations * bytes_per_value,
                Later(lambda: outcome.result().loss),
                Later(lambda: outcome.result().grads),
            )
            return state._replace(step=state.step + 1, params=out.params), info
        if len(out.payload) != t.n_perturbations * bytes_per_value:
            raise RuntimeError(f"codec {t.codec!r} produced {len(out.payload)} bytes for {t.n_perturbations} values")
        info = StepInfo(2 * t.n_perturbations, 0, len(out.payload), out.loss, out.grads)
        return state._replace(step=state.step + 1, params=out.params), info

    def settle(state):
        return state._replace(params=_zo.settle(state.params))

    return Method(init, step, settle, pipelined=defer)
