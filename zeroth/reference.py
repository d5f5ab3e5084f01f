"""NumPy reference of zeroth's exact perturbation engine. It never imports jax.

Everything here is written for clarity, element by element where that makes the definition
plain, and is the specification the fast jax paths are tested against bit for bit:

* ``threefry2x32``: Random123 threefry-2x32, 20 rounds.
* ``fold_in`` / ``root_key`` / ``sample_key``: key derivation (same as ``jax.random``'s
  partitionable threefry: ``fold_in(k, d) = threefry2x32(k, (0, d))``).
* ``leaf_id``: the 32-bit id of a pytree leaf from its path string.
* ``noise_words`` / ``rademacher`` / ``binomial``: integer-only noise of the contract.
* ``round_coefficient`` / ``replay``: the exact update rule.
* ``decay_factor`` / ``decay_leaf``: exact decoupled weight decay, the unit after an iteration's replay.
"""

from __future__ import annotations

import hashlib
import math

import ml_dtypes
import numpy as np

__all__ = [
    "threefry2x32",
    "fold_in",
    "root_key",
    "sample_key",
    "leaf_id",
    "leaf_key",
    "noise_int",
    "round_coefficient",
    "update_scale",
    "apply_update",
    "replay_leaf",
    "decay_leaf",
    "checksum_leaves",
]

MASK32 = 0xFFFFFFFF
ROTATIONS = ((13, 15, 26, 6), (17, 29, 16, 24))
PARITY = 0x1BD11BDA
U32_LIMIT = 1 << 32
COEFF_BITS = 20
FLT_MIN = np.float32(np.finfo(np.float32).tiny)  # 2**-126, the smallest normal float32
CANONICAL_NAN = np.uint32(0x7FC00000)


def _rotl(x: np.ndarray, r: int) -> np.ndarray:
    return (x << np.uint32(r)) | (x >> np.uint32(32 - r))


def threefry2x32(key, counter):
    """Threefry-2x32 with 20 rounds (Random123).

    threefry2x32 :: (u32[...], u32[...]) -> (u32[...], u32[...]) -> (u32[...], u32[...])

    Keys and counters broadcast against each other (many keys at once is how
    :func:`zeroth.rng.sample_keys` derives a whole iteration's keys in one call).
    """
    # every operand is uint32 from here on, and NumPy keeps uint32 through +, ^, << and >>
    # (sums wrap mod 2**32), so no step needs a cast of its own
    k0 = np.asarray(key[0], dtype=np.uint32)
    k1 = np.asarray(key[1], dtype=np.uint32)
    ks = (k0, k1, k0 ^ k1 ^ np.uint32(PARITY))
    x0 = np.asarray(counter[0], dtype=np.uint32)
    x1 = np.asarray(counter[1], dtype=np.uint32)
    with np.errstate(over="ignore"):
        x0 = x0 + ks[0]
        x1 = x1 + ks[1]
        for block in range(5):
            for r in ROTATIONS[block % 2]:
                x0 = x0 + x1
                x1 = _rotl(x1, r) ^ x0
            x0 = x0 + ks[(block + 1) % 3]
            x1 = x1 + ks[(block + 2) % 3] + np.uint32(block + 1)
    return x0, x1


def _check_u32(name: str, value) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        raise ValueError(f"{name} must be an integer in [0, 2**32), got {value!r} ({type(value).__name__})")
    if not 0 <= int(value) < U32_LIMIT:
        raise ValueError(f"{name} must be an integer in [0, 2**32), got {int(value)}")
    return int(value)


def root_key(run_seed: int) -> np.ndarray:
    """The key of a run: ``(0, run_seed)``, i.e. ``jax.random.PRNGKey(run_seed)``."""
    return np.array([0, _check_u32("run_seed", run_seed)], dtype=np.uint32)


def fold_in(key, data: int) -> np.ndarray:
    """``fold_in(k, d) = threefry2x32(k, (0, d))``, as ``jax.random.fold_in``."""
    d = _check_u32("data", data)
    x0, x1 = threefry2x32(key, (np.uint32(0), np.uint32(d)))
    return np.array([x0, x1], dtype=np.uint32)


def sample_key(run_seed: int, machine: int, iteration: int, sample: int) -> np.ndarray:
    """The key of one perturbation: ``fold_in(fold_in(fold_in(root(run), machine), iteration), sample)``."""
    key = root_key(run_seed)
    key = fold_in(key, _check_u32("machine", machine))
    key = fold_in(key, _check_u32("iteration", iteration))
    return fold_in(key, _check_u32("sample", sample))


def leaf_id(path: str) -> int:
    """A leaf's stable 32-bit id: the first 4 bytes (big endian) of SHA-256 of its path string."""
    return int.from_bytes(hashlib.sha256(path.encode("utf-8")).digest()[:4], "big")


def leaf_key(key, path: str) -> np.ndarray:
    """The key of the leaf at ``path`` under update key ``key``: ``fold_in(key, leaf_id(path))``."""
    return fold_in(key, leaf_id(path))


def noise_words(key, n_words: int) -> np.ndarray:
    """The leaf's word stream: word ``2j`` is ``x0`` and word ``2j+1`` is ``x1`` of threefry call j,
    whose counter is ``(j >> 32, j & 0xffffffff)``.

    ``key`` is ``u32[2]`` (returns ``u32[n_words]``) or a batch ``u32[..., 2]`` (returns
    ``u32[..., n_words]``, row by row the stream of each key, in one broadcast threefry)."""
    key = np.asarray(key, dtype=np.uint32)
    n_calls = (n_words + 1) // 2
    j = np.arange(n_calls, dtype=np.uint64)
    counter = ((j >> np.uint64(32)).astype(np.uint32), (j & np.uint64(MASK32)).astype(np.uint32))
    x0, x1 = threefry2x32((key[..., 0, None], key[..., 1, None]), counter)
    words = np.empty(key.shape[:-1] + (2 * n_calls,), dtype=np.uint32)
    words[..., 0::2] = x0
    words[..., 1::2] = x1
    return words[..., :n_words]


def rademacher_int(key, n: int, offset: int = 0) -> np.ndarray:
    """Elements ``offset .. offset+n-1`` of the leaf's Rademacher stream as int8 in {-1, +1}.

    Element i is bit ``i % 32`` (LSB first) of word ``i // 32``: set -> +1, clear -> -1.
    """
    idx = np.arange(offset, offset + n, dtype=np.int64)
    words = noise_words(key, int((offset + n + 31) // 32))
    bit = (words[idx // 32] >> (idx % 32).astype(np.uint32)) & np.uint32(1)
    return (2 * bit.astype(np.int8) - 1).astype(np.int8)


def binomial_int(key, n: int, offset: int = 0) -> np.ndarray:
    """Elements of the leaf's binomial stream as ``k = popcount(h) - 8`` (int8, ``|k| <= 8``); z = k / 2.

    Element i takes half ``i % 2`` (0: low 16 bits, 1: high 16 bits) of word ``i // 2``.
    """
    idx = np.arange(offset, offset + n, dtype=np.int64)
    words = noise_words(key, int((offset + n + 1) // 2))
    half = (words[idx // 2] >> (16 * (idx % 2)).astype(np.uint32)) & np.uint32(0xFFFF)
    return (np.bitwise_count(half).astype(np.int8) - np.int8(8)).astype(np.int8)


def noise_int(distribution: str, key, n: int, offset: int = 0) -> np.ndarray:
    """The integer noise of elements ``offset .. offset + n - 1`` of a leaf with key ``key``."""
    if distribution == "rademacher":
        return rademacher_int(key, n, offset)
    if distribution == "binomial":
        return binomial_int(key, n, offset)
    raise ValueError(f"unknown exact distribution {distribution!r}; expected 'rademacher' or 'binomial'")


def round_coefficient(c: float, bits: int = COEFF_BITS) -> float:
    """Round ``c`` to ``bits`` significant bits (half to even), deterministically on the host.

    Results whose magnitude falls below 2**-120 become 0.0 (so c * z is never subnormal);
    magnitudes at or above 2**100 are refused.
    """
    c = float(c)
    if not math.isfinite(c):
        raise ValueError(f"coefficient must be finite, got {c!r}")
    if c == 0.0:
        return 0.0
    m, e = math.frexp(c)  # c = m * 2**e, 0.5 <= |m| < 1
    q = round(m * (1 << bits))  # integer with at most `bits` bits (Python round: half to even)
    r = math.ldexp(q, e - bits)
    if abs(r) < 2.0**-120:
        return 0.0
    if abs(r) >= 2.0**100:
        raise ValueError(f"coefficient {c!r} is too large (|c| must be < 2**100)")
    return r


def update_scale(distribution: str, coefficient: float) -> np.float32:
    """The float32 multiplier of the integer noise: c for Rademacher, c / 2 for binomial (exact)."""
    c = round_coefficient(coefficient)
    return np.float32(c * 0.5 if distribution == "binomial" else c)


def _flush(x: np.ndarray) -> np.ndarray:
    """Subnormals and -0 become +0; every NaN becomes the canonical quiet NaN."""
    x = np.where(np.abs(x) < FLT_MIN, np.float32(0.0), x).astype(np.float32)
    return np.where(np.isnan(x), CANONICAL_NAN.view(np.float32), x).astype(np.float32)


def apply_update(p32: np.ndarray, scale: np.float32, k: np.ndarray) -> np.ndarray:
    """One exact update in float32: ``flush(p + scale * k)``; ``scale * k`` is exact."""
    with np.errstate(over="ignore", invalid="ignore"):
        return _flush((p32 + np.float32(scale) * k.astype(np.float32)).astype(np.float32))


def replay_leaf(leaf: np.ndarray, path: str, updates, distribution: str, dtype=None) -> np.ndarray:
    """Replay ``updates`` (sequence of (sample_key, coefficient)) on one leaf, in order.

    The leaf is widened to float32 once, every update is rounded once in float32 and flushed,
    and the result is cast once to ``dtype`` (default: the leaf's dtype).
    """
    dtype = leaf.dtype if dtype is None else dtype
    p = _flush(np.asarray(leaf).astype(np.float32).reshape(-1))
    for key, coefficient in updates:
        scale = update_scale(distribution, coefficient)
        k = noise_int(distribution, leaf_key(key, path), p.size)
        p = apply_update(p, scale, k)
    return flush_cast(p, dtype).reshape(np.shape(leaf))


# Weight decay flushes its products below this to +0: every backend rounds a product whose exact
# value is at least 2**-125 to the same normal float32, and flush-to-zero hardware and gradual
# underflow disagree only below it.
DECAY_FLUSH = np.float32(2.0**-125)


def decay_factor(lr: float, weight_decay: float) -> np.float32:
    """``d = float32(1 − η·λ)``: computed in float64, rounded once to float32.

    Raises:
      ValueError: non-finite values, or ``η·λ`` outside ``[0, 1)`` (d must lie in ``(0, 1]``).
    """
    lr, wd = float(lr), float(weight_decay)
    if not (math.isfinite(lr) and math.isfinite(wd)):
        raise ValueError(f"lr and weight_decay must be finite, got lr={lr!r}, weight_decay={wd!r}")
    d = 1.0 - lr * wd
    if not 0.0 < d <= 1.0:
        raise ValueError(f"lr * weight_decay must lie in [0, 1), got {lr} * {wd} = {lr * wd}")
    return np.float32(d)


def decay_leaf(leaf: np.ndarray, factor: np.float32) -> np.ndarray:
    """Exact weight decay of one stored leaf: ``flush_cast(flushd(flush(p32) · d))`` in its dtype.

    The leaf is widened to float32 and flushed as a replay loads it, multiplied once by ``d``
    (:func:`decay_factor`; one correctly rounded float32 multiply), every result below
    :data:`DECAY_FLUSH` in magnitude (-0 and the subnormals with it) becomes +0, and the result is
    cast once to the leaf's dtype.
    """
    leaf = np.asarray(leaf)
    p = _flush(leaf.astype(np.float32))
    with np.errstate(under="ignore", over="ignore", invalid="ignore"):
        x = (p * np.float32(factor)).astype(np.float32)
    x = np.where(np.abs(x) < DECAY_FLUSH, np.float32(0.0), x).astype(np.float32)
    return flush_cast(x, leaf.dtype)


# The canonical quiet NaN of each leaf dtype, as its unsigned bit pattern.
CANONICAL_NAN_BITS = {"float32": 0x7FC00000, "bfloat16": 0x7FC0, "float16": 0x7E00}


def canonicalize(x: np.ndarray) -> np.ndarray:
    """By bit pattern in ``x``'s own dtype: every NaN -> the dtype's canonical quiet NaN
    (:data:`CANONICAL_NAN_BITS`), subnormals and ±0 -> +0; other values unchanged."""
    x = np.asarray(x)
    info = ml_dtypes.finfo(x.dtype)
    utype = np.dtype(f"u{x.dtype.itemsize}")
    u = x.view(utype)
    magnitude = u & utype.type((1 << (8 * x.dtype.itemsize - 1)) - 1)
    inf_bits = np.array(np.inf, x.dtype).view(utype)
    normal_bits = np.array(info.tiny, x.dtype).view(utype)
    out = np.where(magnitude < normal_bits, utype.type(0), u)
    out = np.where(magnitude > inf_bits, utype.type(CANONICAL_NAN_BITS[x.dtype.name]), out)
    return out.astype(utype).view(x.dtype)


def flush_cast(p32: np.ndarray, dtype) -> np.ndarray:
    """Cast once to ``dtype``, then :func:`canonicalize` in that dtype (subnormals and -0 -> +0,
    any NaN -> the canonical quiet NaN)."""
    with np.errstate(over="ignore", invalid="ignore"):  # overflow to inf is defined here
        return canonicalize(np.asarray(p32, dtype=np.float32).astype(dtype))


def checksum_leaves(leaves: dict[str, np.ndarray]) -> str:
    """SHA-256 (hex) of a state given as ``{leaf path string: array}``: for every leaf, in order
    of its path, the path, dtype, shape and every value's bytes (little endian, row-major).
    :func:`zeroth.replay.checksum` is this function applied to a pytree's leaves.
    """
    h = hashlib.sha256()
    items = sorted(leaves.items())
    h.update(f"zeroth-checksum-v1 {len(items)}\n".encode())
    for path, arr in items:
        arr = np.ascontiguousarray(arr)
        if arr.dtype.byteorder == ">":
            arr = arr.astype(arr.dtype.newbyteorder("<"))
        h.update(f"{path}\0{arr.dtype.name}\0{arr.shape}\0{arr.nbytes}\n".encode())
        h.update(arr.reshape(-1).view(np.uint8))  # arr.tobytes(), read in place (no copy of the state)
    return h.hexdigest()
