"""4-bit forward-only training (seed 000, section 3): the MeZO step, then every quantized weight back on its grid.

``train.requantize: nearest | stochastic`` (:func:`requantize_method`). The trained state is the
model file's quantized weights: after every exact MeZO update (:func:`zeroth.methods.mezo.mezo_update`,
the same keys and coefficients as ``train.method: zo``) each gridded weight is projected back
onto its fixed 4-bit grid (:func:`zeroth.models.pretrained.q4train.make_projection`). Each
step's metrics carry ``changed``, the fraction of quantized weights whose code changed. With
nearest rounding, the first step that changes no code and moved no weight by half a grid step
raises a ``RuntimeWarning`` saying so (:func:`nearest_warning`): at that step size no update can
change a weight.

Example:
  >>> method = zo_q4_method(cfg, model, rounding="stochastic")      # doctest: +SKIP
  >>> state, info = method.step(method.init(params, key), batch)     # doctest: +SKIP
  >>> info.metrics["changed"]                                        # doctest: +SKIP
"""

from __future__ import annotations

import warnings

from zeroth import objectives as _objectives
from zeroth import schedules as _schedules
from zeroth import zo as _zo
from zeroth.methods.base import Method, StepInfo, TrainState
from zeroth.methods.mezo import mezo_update
from zeroth.models.pretrained import q4train as _q4
from zeroth.models.pretrained import quant as _quant

__all__ = ["zo_q4_method", "requantize_method", "nearest_warning"]


def zo_q4_method(cfg, model, *, rounding: str = "nearest", grids: dict[str, _quant.Grid] | None = None) -> Method:
    """A :class:`~zeroth.methods.base.Method`: the ZO step of ``train.method: zo``, then requantization.

    ``init(params, key)`` checks that the parameters start on their grids (SmolLM2's pretrained
    values do); ``step`` runs :func:`zeroth.zo.mezo_step` exactly as ``train.method: zo`` does,
    then projects the result (:func:`zeroth.models.pretrained.q4train.make_projection`). The
    fraction of gridded weights whose code changed in the step is ``info.metrics["changed"]``.

    Args:
      cfg: the experiment config (``train.method`` must be ``zo``).
      model: the flax module; without ``grids`` it must have ``quant_grids()`` (``smollm2_prompt``).
      rounding: ``"nearest"`` or ``"stochastic"``.
      grids: ``{leaf path: Grid}``; default ``model.quant_grids()``.

    Raises:
      ValueError: ``train.method`` is not ``zo``, an unknown ``rounding``, or a model without grids.
    """
    t = cfg.train
    if t.method != "zo":
        raise ValueError(f"4-bit forward-only training needs train.method 'zo', got {t.method!r}")
    _q4.check_rounding(rounding)
    if grids is None:
        if not callable(getattr(model, "quant_grids", None)):
            raise ValueError(
                f"4-bit forward-only training (requantize {rounding!r}) needs a model whose weights have 4-bit "
                f"grids, such as smollm2_prompt; {type(model).__name__} has none"
            )
        grids = model.quant_grids()
    project = _q4.make_projection(grids, rounding)
    nearest = _q4.make_projection(grids, "nearest") if rounding != "nearest" else project
    loss_fn = _objectives.make_objective(t.objective, model)
    _zo.round_eps(t.eps)
    schedule = _schedules.from_train(t)
    gridded = sorted(grids)

    def init(params, key):
        on_grid = nearest(params, cfg.run.seed, 0)
        frac = _q4.changed_fraction(params, on_grid, gridded)
        if frac:
            raise ValueError(
                f"{frac:.2%} of the quantized weights are not on their file grids; start from pretrained_params()"
            )
        return TrainState(0, params, None, key)

    warned = []

    def step(state, batch):
        out = mezo_update(cfg, loss_fn, state.params, batch, state.step, donate=False, schedule=schedule)
        new = project(out.params, cfg.run.seed, state.step)
        changed = _q4.changed_fraction(state.params, new, gridded)
        if rounding == "nearest" and changed == 0.0 and not warned:
            move = _q4.largest_move(state.params, out.params, grids)
            if move < 0.5:
                warned.append(state.step)
                warnings.warn(nearest_warning(state.step, move, t.lr), RuntimeWarning, stacklevel=2)
        info = StepInfo(2 * t.n_perturbations, 0, len(out.payload), out.loss, out.grads, {"changed": changed})
        return state._replace(step=state.step + 1, params=new), info

    return Method(init, step)


def nearest_warning(step: int, move: float, lr: float) -> str:
    """Why nearest requantization changed no weight in ``step`` (``move``: :func:`~zeroth.models.pretrained.q4train.largest_move`)."""
    need = f"about {0.5 / move:.3g}x" if move > 0 else "a larger"
    return (
        f"train.requantize 'nearest': step {step} changed none of the quantized weights: the largest update "
        f"moved a weight by {move:.2%} of its grid step, and nearest rounding puts back every move under half "
        f"a step (50%), so only the float leaves train; use train.requantize: stochastic (unbiased), or a "
        f"train.lr {need} the {lr:g} configured"
    )


def requantize_method(cfg, model) -> Method:
    """4-bit forward-only ZO (``train.requantize``): :func:`zo_q4_method` with ``model.quant_grids()``.

    Raises:
      ValueError: the model has no 4-bit weight grids, or its parameters do not start on them.
    """
    r = cfg.train.requantize
    if not callable(getattr(model, "quant_grids", None)):
        raise ValueError(
            f"config field train.requantize: {r!r} needs a model whose weights have 4-bit grids "
            f"(smollm2_prompt); model {cfg.model.name!r} has none, set train.requantize to null"
        )
    return zo_q4_method(cfg, model, rounding=r)
