"""Learning-rate schedules evaluated on the host, inside the determinism contract.

A schedule gives the learning rate ``η_t`` of step ``t`` (0-based: the update of iteration
``t``), with peak ``η`` (``train.lr``), ``W`` warmup steps, decay end ``D``:

* warmup (every shape), ``t < W``: ``η_t = η · (a + (1 − a) · t / W)``, ``a = init_ratio``
  (``η_0 = a·η`` exactly; ``W = 0``: no warmup);
* ``constant``: ``η_t = η`` (exactly ``η``: the default, bit-identical to a run without a schedule);
* ``cosine``, ``W <= t < D``: ``u = (t − W) / (D − W)``, ``c = (1 + cos πu) / 2``,
  ``η_t = η − (η − ηr) · (1 − c)`` (``η_W = η`` exactly); ``t >= D``: ``η_t = η·r`` exactly,
  ``r = final_ratio``;
* ``linear``: the same with ``c = 1 − u``;
* ``step``: ``η_t = η · γ^⌊(t − W) / every⌋`` (staircase decay, ``γ = gamma``).

These are optax's ``warmup_cosine_decay_schedule`` / ``linear_schedule`` /
``exponential_decay(staircase=True)`` (``init_value = a·η``, ``end_value = r·η``, optax's
``decay_steps`` of the cosine = ``D`` counted from step 0), evaluated differently: in Python
float64 with IEEE basic operations only (``+ − × /``, each correctly rounded, so the same bits on
every host). ``cos`` is not taken from the C library (whose last bit may differ between
platforms) but computed by :func:`cos_pi` (argument reduction by exact symmetries, a fixed
Taylor polynomial in Horner form), and ``γ^k`` by repeated squaring (:func:`ipow`), not ``pow``.
``η_t`` then enters the update coefficients ``c = round(−η_t g / √N)`` of
:func:`zeroth.zo.update_coefficients` (host-rounded to 20 significant bits), so an update log
gives the same parameters on every backend, and every peer computes the same ``η_t``.

optax's own schedules are ``jnp`` functions evaluated on a device in float32: fine for the
optax transforms of :mod:`zeroth.zo` (outside the contract), refused on the exact path.

Example:
  >>> s = cosine(0.1, decay_steps=100, warmup_steps=10, final_ratio=0.1)
  >>> s(0), s(5), s(10), s(100), s(1000)
  (0.0, 0.05, 0.1, 0.010000000000000002, 0.010000000000000002)
  >>> constant(0.02)(123)
  0.02
"""

from __future__ import annotations

import dataclasses
import math
import operator

__all__ = [
    "SCHEDULES",
    "Schedule",
    "constant",
    "cosine",
    "linear",
    "step",
    "make",
]

SCHEDULES = ("constant", "cosine", "linear", "step")  # the decay shapes; warmup applies to each
_DECAYING = ("cosine", "linear")  # shapes that reach final_ratio at decay_steps

# Taylor coefficients (-1)^k / (2k)! and (-1)^k / (2k+1)!, highest degree first (Horner order).
# Python's int / int true division is correctly rounded, so these are the same doubles everywhere.
# |x| <= π/4: the next terms, x^20/20! and x^19/19!, are below 2**-60: the polynomials are
# accurate to about one unit in the last place.
_COS = tuple((-1) ** k / math.factorial(2 * k) for k in range(9, -1, -1))
_SIN = tuple((-1) ** k / math.factorial(2 * k + 1) for k in range(9, -1, -1))


def _horner(coeffs: tuple[float, ...], x2: float) -> float:
    acc = 0.0
    for c in coeffs:
        acc = acc * x2 + c
    return acc


def cos_pi(u: float) -> float:
    """``cos(π u)`` for ``u`` in ``[0, 1]`` with IEEE basic operations only (the same bits on every host).

    ``cos(π(1 − u)) = −cos(πu)`` and ``cos(πu) = sin(π(½ − u))`` reduce ``u`` to ``[0, ¼]``
    (both ``1 − u`` and ``½ − u`` are exact there, by Sterbenz's lemma); then ``x = πu`` with
    ``|x| <= π/4`` goes through a degree-18 (cos) or 19 (sin) Taylor polynomial in Horner form.
    Within about 2 ulp of ``math.cos(math.pi * u)``; exactly 1, 0 and −1 at 0, ½ and 1.

    Raises:
      ValueError: ``u`` outside ``[0, 1]``.

    Example:
      >>> cos_pi(0.0), cos_pi(0.5), cos_pi(1.0), cos_pi(1 / 3)
      (1.0, 0.0, -1.0, 0.5)
    """
    u = float(u)
    if not 0.0 <= u <= 1.0:
        raise ValueError(f"cos_pi takes u in [0, 1], got {u!r}")
    sign = 1.0
    if u > 0.5:
        u, sign = 1.0 - u, -1.0
    if u > 0.25:
        x = (0.5 - u) * math.pi
        return sign * (x * _horner(_SIN, x * x))
    x = u * math.pi
    return sign * _horner(_COS, x * x)


def ipow(base: float, k: int) -> float:
    """``base ** k`` for an integer ``k >= 0`` by repeated squaring (IEEE multiplies only, a fixed order).

    Example:
      >>> ipow(0.5, 3), ipow(0.9, 0)
      (0.125, 1.0)
    """
    if isinstance(k, bool) or not isinstance(k, int) or k < 0:
        raise ValueError(f"ipow takes an integer exponent >= 0, got {k!r}")
    result, b = 1.0, float(base)
    while k:
        if k & 1:
            result *= b
        b *= b
        k >>= 1
    return result


def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


@dataclasses.dataclass(frozen=True)
class Schedule:
    """A learning-rate schedule ``step -> η_t`` (Python float64) evaluated on the host.

    Built by :func:`constant`, :func:`cosine`, :func:`linear`, :func:`step` or :func:`make`;
    frozen and hashable (two equal schedules compare equal). Invalid arguments raise
    ``ValueError("<field>: ...")`` naming the field (``train.schedule.<field>`` in a config).

    Attributes:
      name: the decay shape, one of :data:`SCHEDULES`.
      lr: the peak learning rate η (finite, > 0).
      warmup_steps: W, steps of linear warmup from ``init_ratio·η`` to η (0 = none).
      init_ratio: a in ``[0, 1]``: ``η_0 = a·η``.
      decay_steps: D > W, the step at which ``cosine`` / ``linear`` reach ``final_ratio·η``
        (counted from step 0, warmup included); None for ``constant`` and ``step``.
      final_ratio: r in ``[0, 1]``: the floor ``r·η`` of ``cosine`` / ``linear``.
      gamma: γ in ``(0, 1]``: the factor of ``step`` decay.
      every: steps between two ``step`` decays (>= 1).
    """

    name: str
    lr: float
    warmup_steps: int = 0
    init_ratio: float = 0.0
    decay_steps: int | None = None
    final_ratio: float = 0.0
    gamma: float = 1.0
    every: int = 1

    def __post_init__(self):
        if self.name not in SCHEDULES:
            raise ValueError(f"name: unknown schedule {self.name!r}; expected one of {list(SCHEDULES)}")
        lr = self.lr
        if isinstance(lr, bool) or not isinstance(lr, (int, float)) or not (math.isfinite(lr) and lr > 0):
            raise ValueError(f"lr: the peak learning rate must be a finite number > 0, got {lr!r}")
        object.__setattr__(self, "lr", float(lr))
        if not _is_int(self.warmup_steps) or self.warmup_steps < 0:
            raise ValueError(f"warmup_steps: expected an integer >= 0, got {self.warmup_steps!r}")
        for field in ("init_ratio", "final_ratio"):
            v = getattr(self, field)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not 0.0 <= v <= 1.0:
                raise ValueError(f"{field}: expected a number in [0, 1], got {v!r}")
            object.__setattr__(self, field, float(v))
        if self.name in _DECAYING:
            d = self.decay_steps
            if d is None:
                raise ValueError(
                    f"decay_steps: schedule {self.name!r} needs the step at which it reaches its floor "
                    f"(an integer > warmup_steps = {self.warmup_steps})"
                )
            if not _is_int(d) or d <= self.warmup_steps:
                raise ValueError(f"decay_steps: expected an integer > warmup_steps = {self.warmup_steps}, got {d!r}")
        else:
            if self.decay_steps is not None:
                raise ValueError(
                    f"decay_steps: schedule {self.name!r} has no decay end; leave it null "
                    f"(or use name cosine or linear)"
                )
            if self.final_ratio != 0.0:
                raise ValueError(
                    f"final_ratio: schedule {self.name!r} has no floor; leave it 0 (or use name cosine or linear)"
                )
        g = self.gamma
        if isinstance(g, bool) or not isinstance(g, (int, float)) or not 0.0 < g <= 1.0:
            raise ValueError(f"gamma: expected a number in (0, 1], got {g!r}")
        object.__setattr__(self, "gamma", float(g))
        if not _is_int(self.every) or self.every < 1:
            raise ValueError(f"every: expected an integer >= 1, got {self.every!r}")
        if self.name != "step" and (self.gamma != 1.0 or self.every != 1):
            raise ValueError(
                f"{'gamma' if self.gamma != 1.0 else 'every'}: only schedule 'step' uses gamma and every; "
                f"leave them at 1 for {self.name!r}"
            )

    def __call__(self, step: int) -> float:
        """``η_t`` of step ``t`` (an integer >= 0), a Python float (float64)."""
        if isinstance(step, bool):
            raise TypeError(f"a zeroth schedule is evaluated at an integer step, got {step!r}")
        try:
            t = operator.index(step)  # int, a NumPy integer, a concrete integer array scalar
        except Exception:  # noqa: BLE001 (a float, a traced value inside jit, ...)
            raise TypeError(
                f"a zeroth schedule is evaluated on the host at an integer step, got {step!r} "
                f"({type(step).__name__}); inside optax transforms use optax schedules"
            ) from None
        if t < 0:
            raise ValueError(f"step must be >= 0, got {t}")
        eta, w = self.lr, self.warmup_steps
        if t < w:
            a = self.init_ratio
            return eta * (a + (1.0 - a) * (t / w))
        if self.name == "constant":
            return eta
        if self.name == "step":
            return eta * ipow(self.gamma, (t - w) // self.every)
        d = self.decay_steps
        floor = eta * self.final_ratio
        if t >= d:
            return floor
        u = (t - w) / (d - w)
        drop = 1.0 - (0.5 + 0.5 * cos_pi(u)) if self.name == "cosine" else u  # 1 − c
        return eta - (eta - floor) * drop

    @property
    def is_constant(self) -> bool:
        """True when ``η_t = η`` at every step (no warmup, no decay)."""
        return self.name == "constant" and self.warmup_steps == 0


def constant(lr: float, *, warmup_steps: int = 0, init_ratio: float = 0.0) -> Schedule:
    """``η_t = η`` (after an optional linear warmup from ``init_ratio·η``).

    Example:
      >>> [constant(1.0, warmup_steps=4)(t) for t in range(6)]
      [0.0, 0.25, 0.5, 0.75, 1.0, 1.0]
    """
    return Schedule("constant", lr, warmup_steps=warmup_steps, init_ratio=init_ratio)


def cosine(
    lr: float, *, decay_steps: int, final_ratio: float = 0.0, warmup_steps: int = 0, init_ratio: float = 0.0
) -> Schedule:
    """Cosine decay from η (at step ``warmup_steps``) to ``final_ratio·η`` (at ``decay_steps`` and after).

    Example:
      >>> s = cosine(1.0, decay_steps=4)
      >>> [s(t) for t in range(5)]
      [1.0, 0.8535533905932737, 0.5, 0.14644660940672627, 0.0]
    """
    return Schedule(
        "cosine", lr, warmup_steps=warmup_steps, init_ratio=init_ratio, decay_steps=decay_steps, final_ratio=final_ratio
    )


def linear(
    lr: float, *, decay_steps: int, final_ratio: float = 0.0, warmup_steps: int = 0, init_ratio: float = 0.0
) -> Schedule:
    """Linear decay from η (at step ``warmup_steps``) to ``final_ratio·η`` (at ``decay_steps`` and after).

    Example:
      >>> [linear(1.0, decay_steps=4)(t) for t in range(5)]
      [1.0, 0.75, 0.5, 0.25, 0.0]
    """
    return Schedule(
        "linear", lr, warmup_steps=warmup_steps, init_ratio=init_ratio, decay_steps=decay_steps, final_ratio=final_ratio
    )


def step(lr: float, *, gamma: float, every: int, warmup_steps: int = 0, init_ratio: float = 0.0) -> Schedule:
    """Staircase decay ``η · γ^⌊(t − W) / every⌋`` after the warmup.

    Example:
      >>> [step(1.0, gamma=0.5, every=2)(t) for t in range(5)]
      [1.0, 1.0, 0.5, 0.5, 0.25]
    """
    return Schedule("step", lr, warmup_steps=warmup_steps, init_ratio=init_ratio, gamma=gamma, every=every)


def make(name: str, lr: float, **fields) -> Schedule:
    """The schedule ``name`` (one of :data:`SCHEDULES`) with peak ``lr`` and the given fields of :class:`Schedule`.

    Raises:
      ValueError: ``"<field>: ..."`` naming a bad or unknown field.

    Example:
      >>> make("linear", 0.5, decay_steps=2)(1)
      0.25
    """
    known = {f.name for f in dataclasses.fields(Schedule)} - {"name", "lr"}
    unknown = sorted(set(fields) - known)
    if unknown:
        raise ValueError(f"{unknown[0]}: unknown schedule field; valid fields are {sorted(known)}")
    return Schedule(name, lr, **fields)


def from_train(train) -> Schedule:
    """The schedule of a config's ``train`` section: ``train.schedule`` with peak ``train.lr``.

    Args:
      train: a :class:`zeroth.config.TrainConfig` (any object with ``lr`` and a ``schedule``
        holding the fields of :class:`Schedule` and its ``name``).

    Raises:
      ValueError: ``config field train.schedule.<field>: ...`` naming the field that is wrong.

    Example:
      >>> from zeroth.config import load_config_dict
      >>> s = from_train(load_config_dict({"train": {"lr": 0.1, "schedule": {"name": "linear", "decay_steps": 10}}}).train)
      >>> s(0), s(5), s(10)
      (0.1, 0.05, 0.0)
    """
    sc = train.schedule
    fields = {f.name: getattr(sc, f.name) for f in dataclasses.fields(sc) if f.name != "name"}
    try:
        return make(sc.name, train.lr, **fields)
    except ValueError as e:
        field, _, msg = str(e).partition(": ")
        raise ValueError(f"config field train.schedule.{field}: {msg}") from None
