"""``zeroth doctor [--json] [--golden PATH]``: does this machine reproduce the golden replay digest?

Run it on every machine of a CPU / GPU / TPU mix before a run: it replays fixed canonical update
logs with :func:`zeroth.replay.replay` and compares their digests with the NumPy reference's and
the golden ones shipped in ``zeroth/golden/doctor.json``. What the replays cover, the digests and
the exit codes are described in the docs (``docs/concepts/determinism.md``, "Checking a machine").

Example:
  >>> from zeroth.doctor import main
  >>> main(["--json"])  # doctest: +SKIP
  0
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import os
import sys
import time
from pathlib import Path

import ml_dtypes
import numpy as np

from zeroth import reference as _ref
from zeroth.kernels import cpu_native

__all__ = [
    "main",
    "GOLDEN_PATH",
    "FORMAT",
    "RUN_SEED",
    "canonical_params",
    "canonical_units",
    "canonical_paths",
    "tile_params",
    "tile_units",
    "SUITES",
    "numpy_checksum",
    "split_float16",
    "reference_result",
    "reference_digests",
    "jax_result",
    "write_golden",
]

FORMAT = "zeroth-doctor-v2"
_GOLDEN_FIELDS = ("digest", "float16_digest", "tiles_digest", "tiles_float16_digest")
GOLDEN_PATH = Path(__file__).resolve().parent / "golden" / "doctor.json"
RUN_SEED = 20_251_122
UPDATES_PER_UNIT = 16  # one size for every unit: one compilation per distribution

_BF16, _F16 = np.dtype(ml_dtypes.bfloat16), np.dtype(np.float16)


def _bits32(words) -> np.ndarray:
    return np.asarray(words, dtype=np.uint32).view(np.float32)


def _uniform(tag: int, n: int) -> np.ndarray:
    """``n`` float32 values in [-0.5, 0.5) from threefry words (exact integer construction)."""
    words = _ref.noise_words(_ref.fold_in(_ref.root_key(RUN_SEED), tag), n)
    ones = _bits32((words >> np.uint32(9)) | np.uint32(0x3F800000))  # [1, 2)
    return (ones - np.float32(1.5)).astype(np.float32)  # exact (Sterbenz)


def _ints(tag: int, n: int, lo: int, hi: int) -> np.ndarray:
    words = _ref.noise_words(_ref.fold_in(_ref.root_key(RUN_SEED), tag), n).astype(np.int64)
    return lo + words % (hi - lo + 1)


def canonical_params() -> dict:
    """The doctor's parameters: a nested dict of four NumPy leaves (float32, bfloat16, float16).

    * ``dense/kernel`` f32[33, 65]: its first 67 elements on a 2**-121 lattice plus ±2**-127
      (updates of magnitude 2**-120 give subnormal results that must be flushed), then 16
      specials (±0, subnormals, ±FLT_MIN, ±inf, NaNs with payloads, one signalling, the largest
      finite values, ±1, 2**-125), then values uniform in [-0.5, 0.5).
    * ``embed`` bf16[7, 13, 3]: uniform, its first nine elements bfloat16 specials (±0, a
      subnormal, ±inf, a NaN, the largest finite, 1, -3.5).
    * ``norm/scale`` f16[134]: 129 values below 2**-13 (some float16 subnormals), then 65504,
      -65504, 65000, -60000 and 1 (updates push them past the float16 range: inf).
    * ``scalar`` f32[]: 0.75.

    Every value is built from integers (threefry words and bit patterns), identically everywhere.
    """
    lattice_n = _ints(3, 67, -6, 6)
    lattice_n = np.where(lattice_n == 0, 1, lattice_n)
    lattice_sign = np.where(_ints(4, 67, 0, 1) == 0, -1.0, 1.0)
    lattice = np.array(
        [math.ldexp(int(n), -121) + s * math.ldexp(1, -127) for n, s in zip(lattice_n, lattice_sign)],
        dtype=np.float32,
    )
    specials = _bits32(
        [
            0x00000000,  # +0
            0x80000000,  # -0
            0x00000001,  # smallest subnormal
            0x807FFFFF,  # largest negative subnormal
            0x00800000,  # FLT_MIN
            0x80800000,  # -FLT_MIN
            0x7F800000,  # +inf
            0xFF800000,  # -inf
            0x7FC00000,  # canonical quiet NaN
            0x7F800001,  # signalling NaN
            0xFFC00123,  # negative quiet NaN with payload
            0x7F7FFFFF,  # largest finite
            0xFF7FFFFF,  # most negative finite
            0x3F800000,  # 1
            0xBF800000,  # -1
            0x01000000,  # 2**-125
        ]
    )
    embed = _uniform(6, 7 * 13 * 3).astype(_BF16)
    embed[:9] = np.array([0x0000, 0x8000, 0x0001, 0x807F, 0x7F80, 0xFF80, 0xFFC1, 0x7F7F, 0xC060], np.uint16).view(
        _BF16
    )
    norm = np.concatenate(
        [
            (_uniform(5, 129) * np.float32(2.0**-12)).astype(_F16),
            np.array([65504.0, -65504.0, 65000.0, -60000.0, 1.0], _F16),
        ]
    )
    return {
        "dense": {"kernel": np.concatenate([lattice, specials, _uniform(1, 33 * 65 - 83)]).reshape(33, 65)},
        "embed": embed.reshape(7, 13, 3),
        "norm": {"scale": norm},
        "scalar": np.array(0.75, np.float32),
    }


def canonical_paths(tree: dict | None = None, prefix: str = "") -> dict[str, np.ndarray]:
    """Flatten a nested dict into ``{path string: array}`` with jax's key-path spelling
    (``"['dense']['kernel']"``), without importing jax."""
    tree = canonical_params() if tree is None else tree
    out: dict[str, np.ndarray] = {}
    for name in sorted(tree):
        path = f"{prefix}[{name!r}]"
        if isinstance(tree[name], dict):
            out.update(canonical_paths(tree[name], path))
        else:
            out[path] = tree[name]
    return out


def _coefficient(j: int, unit: int, lo_exp: int, span: int) -> float:
    """An exact, varied coefficient: a 31-bit odd mantissa (exercises rounding) times 2**e."""
    mantissa = ((2_654_435_761 * (j + 1 + 97 * unit)) % (1 << 30)) | (1 << 30) | 1
    exponent = lo_exp + (j * 7 + unit) % span - 30
    sign = -1 if (j + unit) % 3 == 0 else 1
    return sign * math.ldexp(mantissa, exponent)


def canonical_units() -> list[tuple[str, list[tuple[np.ndarray, float]]]]:
    """The canonical update log: four replay calls (units) of 16 updates, in canonical order.

    Returns ``[(distribution, [(sample key u32[2], coefficient), ...]), ...]``:

    1. binomial, iteration 1: coefficients on the 2**-120 lattice (flushed subnormal results in
       ``dense/kernel``), 0.0, 1e-40 (rounds to 0) and float16-subnormal-scale values;
    2. binomial, iteration 2: magnitudes 2**-21 .. 2**6 with 31-bit mantissas (rounding);
    3. rademacher, iteration 3: again lattice and float16-scale coefficients, an exact
       half-to-even tie (1 + 3 * 2**-20) and 2**-120;
    4. rademacher, iteration 4: magnitudes 2**-18 .. 2**6 (the large ``norm/scale`` values overflow to inf).

    Machines ``(0, 1, 23, 2**32 - 1)`` and samples ``0 .. 3``, machine first then sample.
    """
    machines = (0, 1, 23, 2**32 - 1)
    units = []
    for unit, dist in enumerate(("binomial", "binomial", "rademacher", "rademacher")):
        iteration = unit + 1
        pairs = [(m, s) for m in machines for s in range(UPDATES_PER_UNIT // len(machines))]
        coefficients = []
        for j in range(len(pairs)):
            if unit in (0, 2):
                if j % 4 == 0:
                    c = (-1) ** (j // 4) * (1 + j % 5) * math.ldexp(1, -120)
                elif j % 4 == 1:
                    c = (-1) ** j * (1 + j) * math.ldexp(1, -22)
                else:
                    c = _coefficient(j, unit, -119 if j % 4 == 2 else -24, 6)
                if j == 6:
                    c = 0.0
                if j == 10:
                    c = 1e-40
                if unit == 2 and j == 14:
                    c = 1.0 + 3 * 2.0**-20  # a tie at 20 bits: rounds to even, 1 + 2**-18
            else:
                c = _coefficient(j, unit, -21 if unit == 1 else -18, 27 if unit == 1 else 23)
            coefficients.append(c)
        updates = [(_ref.sample_key(RUN_SEED, m, iteration, s), c) for (m, s), c in zip(pairs, coefficients)]
        units.append((dist, updates))
    return units


# NaN payloads and other specials of each dtype, as bit patterns: NVIDIA's conversions give
# 0x7fff (bf16, f16); the others are quiet and signalling NaNs of either sign with payloads.
_TILE_SPECIALS = {
    "float32": [0x7FFFFFFF, 0xFFFFFFFF, 0x7F800001, 0xFFC00001, 0x7FC00000, 0x80000000, 0x00000001, 0x7F800000],
    "bfloat16": [0x7FFF, 0xFFFF, 0x7F81, 0xFFC1, 0x7FC0, 0x8000, 0x0001, 0x7F80],
    "float16": [0x7FFF, 0xFFFF, 0x7C01, 0xFE01, 0x7E00, 0x8000, 0x0001, 0x7C00],
}
_TILE_LEAVES = (  # (name, shape, dtype): sizes that leave partial tiles for the GPU, TPU and CPU tilings
    ("a", (67, 259), "bfloat16"),  # 17,353: odd, not a whole number of rows of 4
    ("b", (129, 260), "float16"),  # 33,540: rows of 4 but not of 64
    ("c", (96, 1537), "bfloat16"),  # 147,552: rows of 4 and 32, not of 64, 18 tiles of 8192 and a part
    ("d", (3, 4099), "float32"),  # 12,297
    ("e", (8197,), "float16"),  # one tile of 8192 and 5 elements
)


def tile_params() -> dict:
    """The tiles suite's parameters: ``{"tiles": {name: array}}`` of the five leaves of
    ``_TILE_LEAVES``, uniform values in [-0.5, 0.5) with the dtype's specials (NaN payloads,
    -0, a subnormal, inf) written at the start and again as the last elements (the ragged tail)."""
    leaves = {}
    for j, (name, shape, dtype) in enumerate(_TILE_LEAVES):
        dt = _BF16 if dtype == "bfloat16" else np.dtype(dtype)
        n = int(np.prod(shape))
        values = _uniform(20 + j, n).astype(dt)
        specials = np.array(_TILE_SPECIALS[dtype], np.dtype(f"u{dt.itemsize}")).view(dt)
        values[: len(specials)] = specials
        values[-len(specials) :] = specials
        leaves[name] = values.reshape(shape)
    return {"tiles": leaves}


def tile_units() -> list[tuple[str, list[tuple[np.ndarray, float]]]]:
    """The tiles suite's update log: binomial K=3, Rademacher K=5, binomial K=1 (iterations 5-7)."""
    units = []
    for unit, (dist, k) in enumerate((("binomial", 3), ("rademacher", 5), ("binomial", 1))):
        coefficients = [_coefficient(j, unit + 4, -12, 8) for j in range(k)]
        units.append((dist, [(_ref.sample_key(RUN_SEED, 7 * j, unit + 5, j), c) for j, c in enumerate(coefficients)]))
    return units


# suite -> (parameters, update log)
SUITES = {"canonical": (canonical_params, canonical_units), "tiles": (tile_params, tile_units)}


def numpy_checksum(leaves: dict[str, np.ndarray]) -> str:
    """:func:`zeroth.replay.checksum` of ``{path string: array}``, in NumPy only (same bytes)."""
    return _ref.checksum_leaves(leaves)


def split_float16(leaves: dict[str, np.ndarray]) -> tuple[dict[str, np.ndarray], dict[str, np.ndarray]]:
    """``({path: leaf} of float32 / bfloat16 leaves, {path: leaf} of float16 leaves)``."""
    main_part = {p: a for p, a in leaves.items() if a.dtype != _F16}
    return main_part, {p: a for p, a in leaves.items() if a.dtype == _F16}


def reference_result(suite: str = "canonical") -> dict[str, np.ndarray]:
    """The replay of ``suite`` (:data:`SUITES`) computed by :mod:`zeroth.reference` (NumPy): ``{path: array}``."""
    make_params, make_units = SUITES[suite]
    leaves = canonical_paths(make_params())
    for dist, updates in make_units():
        leaves = {path: _ref.replay_leaf(leaf, path, updates, dist) for path, leaf in leaves.items()}
    return leaves


def reference_digests(suite: str = "canonical") -> tuple[str, str]:
    """``(digest, float16_digest)``: checksums of :func:`reference_result`, float16 leaves apart."""
    main_part, f16_part = split_float16(reference_result(suite))
    return numpy_checksum(main_part), numpy_checksum(f16_part)


def _subtree(tree: dict, keep) -> dict:
    out = {}
    for name, value in tree.items():
        if isinstance(value, dict):
            sub = _subtree(value, keep)
            if sub:
                out[name] = sub
        elif keep(value):
            out[name] = value
    return out


def jax_result(float16: bool = False, suite: str = "canonical", donate: bool = True, flat: bool = False):
    """The replay of ``suite`` run by :func:`zeroth.replay.replay` on the default jax backend.

    Args:
      float16: replay the float16 leaves only (``True``) or all the others (``False``).
      suite: ``"canonical"`` or ``"tiles"`` (:data:`SUITES`).
      donate: replay in place (``True``) or into fresh buffers.
      flat: replay the parameters in the flat layout (:func:`zeroth.replay.flatten`).

    Returns:
      The replayed pytree (nested dict of jax arrays), or its :class:`zeroth.replay.Flat`, already computed.
    """
    import jax

    from zeroth import replay as _replay
    from zeroth import rng as _rng

    make_params, make_units = SUITES[suite]
    tree = _subtree(make_params(), lambda a: (a.dtype == _F16) == float16)
    expected = sorted(canonical_paths(tree))
    got = sorted(_rng.leaf_path(p) for p, _ in jax.tree_util.tree_flatten_with_path(tree)[0])
    if got != expected:
        raise RuntimeError(f"jax spells key paths {got}, zeroth expects {expected}: leaf ids would change")
    params = jax.device_put(tree)
    if flat:
        params = _replay.flatten(params)
    for dist, updates in make_units():
        params = _replay.replay(params, updates, distribution=dist, donate=donate)
    return jax.block_until_ready(params)


def _gaussian_digest() -> str:
    """Digest of ``jax.random.normal`` noise (backend-dependent), shown for contrast."""
    import jax
    import jax.numpy as jnp

    from zeroth import noise as _noise

    key = jnp.asarray(_ref.sample_key(RUN_SEED, 0, 0, 0))
    z = jax.jit(lambda k: _noise.sample("gaussian", k, (4096,), exact=False) * jnp.float32(0.37) + jnp.float32(1.0))(
        key
    )
    return hashlib.sha256(np.asarray(z).tobytes()).hexdigest()


def _load_golden(path: Path) -> dict:
    try:
        data = json.loads(Path(path).read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise ValueError(f"cannot read golden file {path}: {exc}") from exc
    if not isinstance(data, dict) or data.get("format") != FORMAT:
        got = data.get("format") if isinstance(data, dict) else type(data).__name__
        raise ValueError(f"golden file {path} is not a {FORMAT!r} file (format: {got!r})")
    for field in _GOLDEN_FIELDS:
        value = data.get(field)
        if not (isinstance(value, str) and len(value) == 64 and all(ch in "0123456789abcdef" for ch in value)):
            raise ValueError(f"golden file {path}: {field!r} must be 64 lowercase hex characters, got {value!r}")
    return data


def write_golden(path: Path | str = GOLDEN_PATH) -> tuple[str, str]:
    """Write the golden digests of both suites, computed by the NumPy reference, to ``path``;
    return the canonical suite's ``(digest, float16_digest)``."""
    digest, f16_digest = reference_digests()
    tiles_digest, tiles_f16_digest = reference_digests("tiles")
    payload = {
        "format": FORMAT,
        "digest": digest,
        "float16_digest": f16_digest,
        "tiles_digest": tiles_digest,
        "tiles_float16_digest": tiles_f16_digest,
        "run_seed": RUN_SEED,
        "n_updates": sum(len(u) for _, u in canonical_units()),
        "tiles_n_updates": sum(len(u) for _, u in tile_units()),
        "leaves": {p: f"{a.dtype}{list(a.shape)}" for p, a in canonical_paths().items()},
        "tiles_leaves": {p: f"{a.dtype}{list(a.shape)}" for p, a in canonical_paths(tile_params()).items()},
        "generated_by": "python -m zeroth.doctor --write-golden (NumPy reference, zeroth.reference)",
    }
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    Path(path).write_text(json.dumps(payload, indent=2, sort_keys=True) + "\n")
    return digest, f16_digest


def _environment() -> dict:
    import jax
    import jaxlib

    devices = jax.devices()
    return {
        "backend": jax.default_backend(),
        "devices": [str(d) for d in devices],
        "device_kind": devices[0].device_kind if devices else None,
        "jax": jax.__version__,
        "jaxlib": jaxlib.__version__,
        "xla_flags": os.environ.get("XLA_FLAGS", ""),
        "jax_disable_jit": bool(jax.config.jax_disable_jit),
        # which path of the native CPU kernel replays on the host (None: the jnp rule there)
        "native_kernel": cpu_native.kernel_path(),
    }


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="zeroth doctor", description="Check that this machine reproduces the golden replay digest."
    )
    p.add_argument("--json", action="store_true", help="print one JSON object instead of a report")
    p.add_argument(
        "--golden", type=Path, default=GOLDEN_PATH, help="golden file to compare with (default: the packaged one)"
    )
    p.add_argument(
        "--write-golden",
        nargs="?",
        const=GOLDEN_PATH,
        type=Path,
        metavar="PATH",
        help="compute the golden digests with the NumPy reference, write them (default: the packaged file) and exit",
    )
    return p


def _verdict(digest: str | None, reference: str, golden: str) -> str:
    if digest is None:
        return "unsupported"
    return "ok" if digest == reference == golden else "mismatch"


def _verdict_pair(digests: tuple[str | None, str | None], reference: str, golden: str) -> str:
    """The tiles suite: the in-place and the copying replay must both give the golden digest."""
    if digests[0] is None:
        return "unsupported"
    return "ok" if digests[0] == digests[1] == reference == golden else "mismatch"


def _pair_digest(digests: tuple[str | None, str | None]) -> str | None:
    """One digest to print for an (in place, copy) pair; a mismatch between them shows as such."""
    if digests[0] == digests[1]:
        return digests[0]
    return f"{digests[0]} (in place) / {digests[1]} (copy)"


def main(argv: list[str] | None = None) -> int:
    """Run the doctor. Returns 0 (OK), 1 (a digest differs), 2 (usage or golden-file error) or
    3 (float32/bfloat16 OK but this backend cannot compile float16 at all)."""
    try:
        args = _parser().parse_args(sys.argv[1:] if argv is None else argv)
    except SystemExit as exc:
        return int(exc.code or 0)
    if args.write_golden is not None:
        digest, f16_digest = write_golden(args.write_golden)
        print(f"wrote {args.write_golden}: digest {digest}, float16_digest {f16_digest}")
        return 0
    try:
        golden = _load_golden(args.golden)
    except ValueError as exc:
        print(f"zeroth doctor: {exc}", file=sys.stderr)
        return 2

    import jax

    from zeroth import replay as _replay

    try:
        env = _environment()
    except (RuntimeError, AssertionError) as exc:  # jax raises a bare AssertionError for an unknown JAX_PLATFORMS
        platforms = os.environ.get("JAX_PLATFORMS", "")
        print(
            f"zeroth doctor: jax could not start a backend (JAX_PLATFORMS={platforms!r}): "
            f"{str(exc).strip() or type(exc).__name__}; name a platform this machine has (cpu, or cuda with "
            f"jax's CUDA build installed), or unset JAX_PLATFORMS",
            file=sys.stderr,
        )
        return 2
    t0 = time.perf_counter()
    digest = _replay.checksum(jax_result(float16=False))
    flat_digest = _replay.checksum(jax_result(float16=False, flat=True))
    try:
        f16_digest, f16_error = _replay.checksum(jax_result(float16=True)), None
    except jax.errors.JaxRuntimeError as exc:  # e.g. XLA:CPU without F16C cannot link half conversions
        f16_digest, f16_error = None, str(exc).strip().splitlines()[0]
    # The tiles suite, in place and into fresh buffers: a digest only when both agree.
    tiles = {}
    for float16 in (False, True):
        if float16 and f16_error is not None:
            tiles[float16] = (None, None)
            continue
        got = [_replay.checksum(jax_result(float16=float16, suite="tiles", donate=d)) for d in (True, False)]
        tiles[float16] = tuple(got)
    t1 = time.perf_counter()
    ref_digest, ref_f16_digest = reference_digests()
    ref_tiles, ref_tiles_f16 = reference_digests("tiles")
    t2 = time.perf_counter()
    status = _verdict(digest, ref_digest, golden["digest"])
    flat_status = _verdict(flat_digest, ref_digest, golden["digest"])
    f16_status = _verdict(f16_digest, ref_f16_digest, golden["float16_digest"])
    tiles_status = _verdict_pair(tiles[False], ref_tiles, golden["tiles_digest"])
    tiles_f16_status = _verdict_pair(tiles[True], ref_tiles_f16, golden["tiles_float16_digest"])
    statuses = (status, flat_status, f16_status, tiles_status, tiles_f16_status)
    ok = all(st == "ok" for st in statuses)
    report = {
        **env,
        "digest": digest,
        "reference_digest": ref_digest,
        "golden_digest": golden["digest"],
        "status": status,
        "flat_digest": flat_digest,
        "flat_status": flat_status,
        "float16_digest": f16_digest,
        "float16_reference_digest": ref_f16_digest,
        "float16_golden_digest": golden["float16_digest"],
        "float16_status": f16_status,
        "float16_error": f16_error,
        "tiles_digest": tiles[False][0],
        "tiles_copy_digest": tiles[False][1],
        "tiles_reference_digest": ref_tiles,
        "tiles_golden_digest": golden["tiles_digest"],
        "tiles_status": tiles_status,
        "tiles_float16_digest": tiles[True][0],
        "tiles_float16_copy_digest": tiles[True][1],
        "tiles_float16_reference_digest": ref_tiles_f16,
        "tiles_float16_golden_digest": golden["tiles_float16_digest"],
        "tiles_float16_status": tiles_f16_status,
        "gaussian_digest": _gaussian_digest(),
        "golden_file": str(args.golden),
        "ok": ok,
        "n_updates": sum(len(u) for _, u in canonical_units()),
        "tiles_n_updates": sum(len(u) for _, u in tile_units()),
        "jax_seconds": round(t1 - t0, 3),
        "reference_seconds": round(t2 - t1, 3),
    }
    if "mismatch" in statuses:
        code, verdict = 1, "MISMATCH: this machine does not reproduce the golden replay; do not join a run with it"
    elif "unsupported" in statuses:
        code, verdict = (
            3,
            (
                "OK for float32/bfloat16, but this backend cannot compile float16 leaves (XLA:CPU cannot link "
                f"half-precision conversions without F16C, e.g. under --xla_cpu_max_isa=SSE4_2): {f16_error}"
            ),
        )
    else:
        code, verdict = 0, "OK: this machine reproduces the golden replay bit for bit"
    if args.json:
        print(json.dumps(report, sort_keys=True))
        if code:
            print(f"zeroth doctor: {verdict}", file=sys.stderr)
        return code
    for name in ("backend", "device_kind", "jax", "jaxlib", "xla_flags", "jax_disable_jit", "native_kernel"):
        print(f"{name:<17} {report[name]}")
    print(f"{'devices':<17} {len(env['devices'])}: {', '.join(env['devices'])}")
    print(
        f"replay            {report['n_updates']} + {report['tiles_n_updates']} updates, both exact distributions, "
        f"{report['jax_seconds']} s"
    )
    for label, got, ref, gold, st in (
        ("f32/bf16 digest", digest, ref_digest, golden["digest"], status),
        ("  flat layout", flat_digest, ref_digest, golden["digest"], flat_status),
        ("float16 digest", f16_digest, ref_f16_digest, golden["float16_digest"], f16_status),
        ("tiles digest", _pair_digest(tiles[False]), ref_tiles, golden["tiles_digest"], tiles_status),
        (
            "tiles f16 digest",
            _pair_digest(tiles[True]),
            ref_tiles_f16,
            golden["tiles_float16_digest"],
            tiles_f16_status,
        ),
    ):
        print(f"{label:<17} {got or '-'}  {st.upper()}")
        print(f"{'  reference':<17} {ref}  {'-' if got is None else 'same' if got == ref else 'DIFFERENT'}")
        print(f"{'  golden':<17} {gold}  {'-' if got is None else 'same' if got == gold else 'DIFFERENT'}")
    print(f"{'gaussian digest':<17} {report['gaussian_digest']}  (jax.random.normal: backend-dependent, for contrast)")
    print(verdict)
    return code


if __name__ == "__main__":
    sys.exit(main())
