"""The shared pieces of the exact update rule (layer 1): dtypes, flushes, scales, platforms.

Every path that applies an update (:mod:`zeroth.replay`'s jnp rule, the fused kernels of
:mod:`zeroth.kernels`, the native CPU kernel) calls these, so there is one definition of each:

* :func:`flush` (float32): subnormals and -0 -> +0, every NaN -> the canonical quiet NaN
  ``0x7fc00000``; infinities propagate. It is :func:`flush_tiny` (the zeros) then
  :func:`canonical_nan` (the NaNs). The kernels apply it to a chain ``load, K updates, store``
  in halves with the same bits: :func:`flush_tiny` after the load and after every update, and
  the NaNs once, in the store (:func:`cast_flushed`). A NaN stays a NaN through every add,
  whatever its payload, and :func:`flush_tiny` leaves it alone, so only the last NaN's bits
  could differ, and the store makes them canonical.
* :func:`canonicalize` (any supported dtype): the same, **by bit pattern** in the array's own
  dtype. Hardware conversions disagree on the NaN they produce (NVIDIA's f32 -> bf16 and
  f32 -> f16 give ``0x7fff``; x86 and NumPy give ``0x7fc0`` / ``0x7e00``), so the result of the
  single cast is canonicalised with integer operations only: whatever NaN a backend produced,
  the stored bits are the dtype's canonical quiet NaN (:data:`CANONICAL_NAN_BITS`).
* :func:`flush_cast`: the single cast of an update's float32 result to the leaf dtype,
  followed by :func:`canonicalize`; :func:`cast_flushed` is the same for a result whose zeros
  are flushed (a float32 one then needs only :func:`canonical_nan`).
* :func:`update_scale` / :func:`update_scales`: the host-rounded float32 multipliers of the
  integer noise (20 significant bits, so ``scale * k`` is exact).
* :func:`check_dtype` / :data:`SUPPORTED_DTYPES`, :func:`platform_name` (``"cuda"`` /
  ``"rocm"`` -> ``"gpu"``) and :func:`default_platform` (where uncommitted arrays go).

Example:
  >>> import jax.numpy as jnp, numpy as np
  >>> nvidia_nan = jnp.asarray(np.array([0x7FFF], np.uint16)).view(jnp.bfloat16)
  >>> hex(int(canonicalize(nvidia_nan).view(jnp.uint16)[0]))
  '0x7fc0'
"""

from __future__ import annotations

import math
import re
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from zeroth import noise as _noise
from zeroth import reference as _ref

__all__ = [
    "SUPPORTED_DTYPES",
    "COEFF_BITS",
    "check_dtype",
    "default_platform",
    "flush",
    "flush_cast",
    "canonicalize",
    "update_scale",
    "update_scales",
]

COEFF_BITS = _ref.COEFF_BITS
SUPPORTED_DTYPES = (jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))
_FLT_MIN = np.float32(np.finfo(np.float32).tiny)


# dtype -> (uint dtype of its bits, |x| mask, +inf bits, smallest-normal bits, canonical quiet NaN bits)
_BITS = {
    jnp.dtype(jnp.float32): (jnp.uint32, 0x7FFFFFFF, 0x7F800000, 0x00800000, 0x7FC00000),
    jnp.dtype(jnp.bfloat16): (jnp.uint16, 0x7FFF, 0x7F80, 0x0080, 0x7FC0),
    jnp.dtype(jnp.float16): (jnp.uint16, 0x7FFF, 0x7C00, 0x0400, 0x7E00),
}
CANONICAL_NAN_BITS = {str(dt): bits[4] for dt, bits in _BITS.items()}
"""The canonical quiet NaN of each supported dtype, as an unsigned integer bit pattern."""


def check_dtype(dtype, what: str = "leaf") -> jnp.dtype:
    """Return ``dtype`` if the exact update supports it; else a ``TypeError`` naming ``what``."""
    dt = jnp.dtype(dtype)
    if dt not in SUPPORTED_DTYPES:
        raise TypeError(f"{what} has dtype {dt}; the exact update supports {[str(d) for d in SUPPORTED_DTYPES]}")
    return dt


def platform_name(name: str) -> str:
    """The platform family of a jax backend or device platform name: "cuda"/"rocm" -> "gpu"."""
    return "gpu" if name in ("cuda", "rocm", "gpu") else name


def default_platform() -> str:
    """The platform family where ``jit`` puts uncommitted arrays: the default device's
    (``jax.default_device(...)`` or ``jax_default_device``) if one is set, else the default backend's."""
    device = jax.config.jax_default_device
    if device is None:
        return platform_name(jax.default_backend())
    return platform_name(device if isinstance(device, str) else device.platform)


def default_devices() -> list:
    """The devices of the platform where ``jit`` puts uncommitted arrays (:func:`default_platform`):
    the default device's platform's if one is set (``jax.default_device(...)``), else the default
    backend's. On a machine with one GPU, code run under ``jax.default_device(jax.devices("cpu")[0])``
    (with ``--xla_force_host_platform_device_count=4``) gets the four CPU devices, not the GPU."""
    device = jax.config.jax_default_device
    if device is None:
        return jax.devices()
    return jax.devices(device if isinstance(device, str) else device.platform)


def tpu_generation(device_kind: str | None = None) -> int | None:
    """The TPU generation (2, 3, 4, 5, 6, ...) of a ``device.device_kind`` ("TPU v4", "TPU v5 lite",
    "TPU v6 lite", "TPU7x"), by default the default device's; None for any other device.

    Pallas kernels that reduce along lanes into a lane-major row need Mosaic's sublane gather,
    which TPU v3 and v4 lack (compiled with libtpu: "Sublane gather not supported by this TPU
    generation"; v5e, v5p and v6e compile them): :mod:`zeroth.kernels.signbits` and
    :mod:`zeroth.kernels.binary` run their jnp paths there.
    """
    if device_kind is None:
        device = jax.config.jax_default_device
        if not isinstance(device, jax.Device):
            device = jax.devices(device)[0] if device else jax.devices()[0]
        device_kind = device.device_kind
    found = re.match(r"\s*TPU\s*v?(\d+)", device_kind, re.IGNORECASE)
    return int(found.group(1)) if found else None


MOSAIC_REFUSES = (jnp.dtype(jnp.float16),)
"""Array dtypes no TPU Pallas kernel can load or store: Mosaic has no float16 vectors ("Invalid
vector type for load" when libtpu compiles the replay or sign-bit kernels for a TPU v3, v4, v5e,
v5p or v6e; bfloat16 and float32 compile). On a TPU ``impl="auto"`` takes such arrays through the
jnp path (same bits) and ``impl="pallas"`` refuses them (:func:`check_mosaic_dtype`)."""


def check_mosaic_dtype(dtype, platform: str) -> None:
    """Refuses an array dtype of :data:`MOSAIC_REFUSES` for a Pallas kernel on ``platform`` "tpu"
    (interpret mode included, which simulates the TPU), saying what to do instead."""
    if platform == "tpu" and jnp.dtype(dtype) in MOSAIC_REFUSES:
        name = jnp.dtype(dtype).name
        raise ValueError(
            f"the TPU Pallas kernels cannot take {name} arrays (Mosaic has no {name} vectors on any TPU "
            "generation); use impl='auto', which takes them through the jnp path (same bits), or store "
            "them as bfloat16 or float32"
        )


def mosaic_refuses(impl: str, dtype, platform: str | None = None) -> bool:
    """Whether arrays of ``dtype`` on ``platform`` (default :func:`default_platform`) must take the
    jnp path instead of a Pallas kernel: a dtype of :data:`MOSAIC_REFUSES` on a TPU under ``impl``
    ``"auto"``; under ``"pallas"`` that is refused (:func:`check_mosaic_dtype`). The kernels'
    ``resolve_impl`` ask it; ``dtype=None`` (not known) is never refused."""
    if impl not in ("auto", "pallas") or dtype is None or jnp.dtype(dtype) not in MOSAIC_REFUSES:
        return False
    platform = default_platform() if platform is None else platform_name(platform)
    if impl == "pallas":
        check_mosaic_dtype(dtype, platform)
    return platform == "tpu"


MOSAIC_SUBLANE_GATHER_FROM = 5
"""The first TPU generation with Mosaic's sublane gather (:func:`tpu_generation`)."""


def lacks_sublane_gather(device_kind: str | None = None) -> bool:
    """Whether uncommitted arrays go to a TPU older than :data:`MOSAIC_SUBLANE_GATHER_FROM` (a
    ``device_kind`` given names the device instead)."""
    if device_kind is None and default_platform() != "tpu":
        return False
    generation = tpu_generation(device_kind)
    return generation is not None and generation < MOSAIC_SUBLANE_GATHER_FROM


def flush(x: jax.Array) -> jax.Array:
    """float32: subnormals and -0 -> +0, NaN -> canonical quiet NaN; explicit on every backend."""
    return canonical_nan(flush_tiny(x))


def flush_tiny(x: jax.Array) -> jax.Array:
    """float32: subnormals and -0 -> +0; NaNs and infinities unchanged (the zeros of :func:`flush`)."""
    return jnp.where(jnp.abs(x) < _FLT_MIN, jnp.float32(0.0), x)


def canonical_nan(x: jax.Array) -> jax.Array:
    """float32: every NaN -> the canonical quiet NaN ``0x7fc00000``; other values unchanged."""
    return jnp.where(jnp.isnan(x), jnp.float32(np.uint32(0x7FC00000).view(np.float32)), x)


def canonicalize(x: jax.Array) -> jax.Array:
    """By bit pattern in ``x``'s own dtype: every NaN -> the canonical quiet NaN, subnormals and
    ±0 -> +0; every other value (infinities included) unchanged. Integer operations only, so no
    backend's float conversion or NaN propagation can change the stored bits.

    16-bit patterns are widened to uint32 for the compares (every backend has 32-bit integer
    vector ops; some lack 16-bit ones).
    """
    dt = check_dtype(x.dtype, "array")
    utype, abs_mask, inf_bits, normal_bits, nan_bits = _BITS[dt]
    u = jax.lax.bitcast_convert_type(x, utype).astype(jnp.uint32)
    a = u & jnp.uint32(abs_mask)
    u = jnp.where(a < jnp.uint32(normal_bits), jnp.uint32(0), u)
    u = jnp.where(a > jnp.uint32(inf_bits), jnp.uint32(nan_bits), u)
    return jax.lax.bitcast_convert_type(u.astype(utype), dt)


def _convert(x32: jax.Array, dtype) -> jax.Array:
    """The backend's float32 -> ``dtype`` conversion (round to nearest even; its NaN bits vary)."""
    return x32.astype(dtype)


def flush_cast(x32: jax.Array, dtype) -> jax.Array:
    """Cast float32 once to ``dtype``, then :func:`canonicalize` in that dtype (subnormals and
    -0 -> +0, whatever NaN the conversion produced -> the dtype's canonical quiet NaN)."""
    return canonicalize(_convert(x32, check_dtype(dtype)))


def cast_flushed(x32: jax.Array, dtype) -> jax.Array:
    """:func:`flush_cast` of an ``x32`` whose zeros are flushed already (:func:`flush_tiny`: a
    loaded leaf, an update's result), with the same bits: a float32 result needs only
    :func:`canonical_nan` (two operations per element where :func:`canonicalize` takes five)."""
    dtype = check_dtype(dtype)
    if dtype == jnp.float32:
        return canonical_nan(x32)
    return canonicalize(_convert(x32, dtype))


def update_scale(distribution: str, coefficient: float) -> np.float32:
    """The float32 scale that multiplies the integer noise k (host-rounded; exact)."""
    _noise.check_distribution(distribution)
    return _ref.update_scale(distribution, coefficient)


# Up to this many coefficients, update_scales rounds them one by one with Python floats: a dozen
# NumPy calls on tiny arrays cost more (tens of microseconds) than the whole replay of small leaves.
_SCALAR_SCALES = 16


def update_scales(distribution: str, coefficients: Sequence[float]) -> np.ndarray:
    """``f32[K]`` of :func:`update_scale` for each coefficient, vectorised with the same bits.

    ``frexp`` splits ``c = m * 2**e`` exactly, ``rint(m * 2**20)`` rounds half to even like Python's
    ``round`` (the product is exact in float64), and ``ldexp`` puts it back; magnitudes below
    2**-120 become 0. A non-finite or too large coefficient goes through the scalar
    :func:`zeroth.reference.round_coefficient`, which raises with the value named. Up to 16
    coefficients are rounded one by one with Python's ``math.frexp``, ``round`` and ``ldexp``
    (the same operations on scalars, so the same bits; much less host time per call).
    """
    _noise.check_distribution(distribution)
    seq = coefficients.reshape(-1).tolist() if isinstance(coefficients, np.ndarray) else coefficients
    if (
        isinstance(seq, (list, tuple))
        and len(seq) <= _SCALAR_SCALES
        and all(isinstance(c, (float, int, np.floating, np.integer)) for c in seq)
    ):
        half = 0.5 if distribution == "binomial" else 1.0
        out = []
        for c in seq:
            c = float(c)
            if not abs(c) < 2.0**100:  # non-finite or too large: the reference raises, naming the value
                _ref.round_coefficient(c)
            m, e = math.frexp(c)
            r = math.ldexp(round(m * 1048576.0), e - COEFF_BITS)  # 1048576 = 2**COEFF_BITS
            if not abs(r) < 2.0**100:  # rounding up reached the limit
                _ref.round_coefficient(c)
            out.append(0.0 if abs(r) < 2.0**-120 else r * half)
        return np.array(out, np.float32)
    c = np.asarray(coefficients, dtype=np.float64).reshape(-1)
    bad = ~np.isfinite(c) | (np.abs(c) >= 2.0**100)
    if bad.any():
        _ref.round_coefficient(float(c[np.argmax(bad)]))  # raises, naming the value
    m, e = np.frexp(c)
    r = np.ldexp(np.rint(m * float(1 << COEFF_BITS)), e - COEFF_BITS)
    r = np.where(np.abs(r) < 2.0**-120, 0.0, r)
    if (np.abs(r) >= 2.0**100).any():  # rounding up reached the limit: the scalar rule raises
        _ref.round_coefficient(float(c[np.argmax(np.abs(r) >= 2.0**100)]))
    if distribution == "binomial":
        r = r * 0.5
    return r.astype(np.float32)
