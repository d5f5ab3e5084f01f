"""The exact update rule of zeroth's determinism contract, canonical replay and checksums.

An update is a pair ``(key, c)``: a sample key (see :func:`zeroth.rng.sample_key`) and a
coefficient. Applying it to a leaf ``p`` with path ``path`` computes, in float32,

    p <- flush(p + s * k),   k = noise_int(fold_in(key, leaf_id(path)), p.shape),
                             s = round_coefficient(c)        (Rademacher, z = k)
                             s = round_coefficient(c) / 2    (binomial,  z = k / 2)

``s`` has at most 20 significant bits and ``|k| <= 8`` so ``s * k`` is exact in float32; the add
is then rounded once, identically with or without FMA. ``flush`` maps subnormals and -0 to +0
and every NaN to the canonical quiet NaN ``0x7fc00000``; infinities propagate. A leaf is widened
to float32 once, all updates of a :func:`replay` call are applied in the given (canonical) order,
and the result is cast once to the leaf dtype (whose subnormals are flushed again).

Cost: :func:`perturb` and :func:`replay` hold at most one float32 temporary of one leaf at a
time beyond the parameters when called with ``donate=True`` (the input buffers are reused);
with ``donate=False`` the result is a second copy of the parameters. :func:`replay` dispatches to
the fused kernels of :mod:`zeroth.kernels.perturb`, which read and write each leaf once for all
K updates; :func:`apply_updates` (the traceable jnp rule) reads and writes it once per update.

A flat layout (:class:`Flat`, from :func:`flatten`) keeps the parameters in one contiguous buffer
per dtype, and every leaf of at least :data:`ALONE_FROM` elements in a buffer of its own, with a
static :class:`Layout` (each leaf's path, id, shape, buffer and offset).
:func:`replay` of a :class:`Flat` gives the bits of :func:`replay` of the tree (each leaf keeps
its id, ``leaf_id(path)``, and its counters, its own flat index), through one kernel launch per
buffer whatever the number of leaves (the native kernel on CPU, one Triton kernel on GPU, one
Mosaic kernel on TPU, whose buffers :func:`flatten` pads to whole blocks of 128-lane rows), one
compiled call per (layout, K, distribution); its host cost does not grow with the number of
leaves. :func:`unflatten` gives the tree back (slices and reshapes; traceable, so a forward pass
can take the flat buffers inside its ``jit``), and :func:`checksum` of a :class:`Flat` equals the
checksum of its tree.
"""

from __future__ import annotations

import functools
import math
import weakref
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from zeroth import noise as _noise
from zeroth import reference as _ref
from zeroth import rng as _rng
from zeroth import rule as _rule
from zeroth.kernels import host_memory as _host_memory
from zeroth.kernels import perturb as _fused
from zeroth.rule import COEFF_BITS, SUPPORTED_DTYPES, update_scales
from zeroth.rule import (
    flush as flush,
    flush_cast as flush_cast,
    update_scale as update_scale,
)  # the rule, read here too

__all__ = [
    "SUPPORTED_DTYPES",
    "round_coefficient",
    "update_scales",
    "apply_updates",
    "perturb",
    "replay",
    "checksum",
    "Flat",
    "flatten",
    "unflatten",
    "host_tree",
    "preferred_layout",
]


def round_coefficient(c: float, bits: int = COEFF_BITS) -> float:
    """Round a coefficient on the host to ``bits`` (<= 20) significant bits, half to even.

    Deterministic (pure Python integer arithmetic on the float64 value); magnitudes below
    2**-120 become 0.0; non-finite values and magnitudes >= 2**100 raise ``ValueError``.

    Example:
      >>> round_coefficient(0.1)
      0.10000002384185791
    """
    if not 1 <= bits <= COEFF_BITS:
        raise ValueError(f"bits must be in [1, {COEFF_BITS}] so that c * z is exact in float32, got {bits}")
    return _ref.round_coefficient(c, bits)


def apply_updates(
    params: Any,
    keys: jax.Array,
    scales: jax.Array,
    *,
    distribution: str = "binomial",
    impl: str = "jnp",
    inplace: bool = False,
) -> Any:
    """Traceable core: apply K updates with *already rounded* scales, in order (by default the
    plain jnp rule, :func:`zeroth.kernels.perturb.perturb_reference` on every leaf).

    A :class:`Flat` is updated leaf by leaf inside its buffers (each leaf keeps its id and
    counters), so the result is the :class:`Flat` of the tree's result.

    Args:
      params: pytree of f32 / bf16 / f16 arrays.
      keys: ``u32[K, 2]`` sample keys (may be traced).
      scales: ``f32[K]`` from :func:`update_scales` (host-rounded; may be traced).
      distribution: ``"binomial"`` or ``"rademacher"``.
      impl: ``"jnp"`` (default), or ``"auto"`` for the fused kernels :func:`replay` runs (chosen
        when the program is lowered, for the devices it runs on); the same bits.
      inplace: let the fused kernels write into their inputs; only where ``params`` is donated.

    Returns:
      The updated pytree (same structure, dtypes and shapes).
    """
    if isinstance(params, Flat):
        out = _fused.apply_updates_flat(
            params.buffers, keys, scales, params.layout.tables(), distribution=distribution, impl=impl, inplace=inplace
        )
        return Flat(out, params.layout)
    return _fused.apply_updates(params, keys, scales, distribution=distribution, impl=impl, inplace=inplace)


def _as_keys(keys) -> np.ndarray:
    arr = np.asarray(keys)
    if arr.dtype != np.uint32 or arr.ndim < 1 or arr.shape[-1] != 2:
        raise ValueError(f"keys must be uint32 of shape (2,) or (K, 2), got dtype {arr.dtype} shape {arr.shape}")
    return arr.reshape(-1, 2)


def _is_key_matrix(x) -> bool:
    """Whether ``x`` is a ``(K, 2)`` key array (the ``(keys, coefficients)`` form of ``updates``),
    rather than one ``(key, coefficient)`` pair (whose ``np.ndim`` is not even defined)."""
    try:
        return np.ndim(x) == 2
    except ValueError:  # a ragged (key, coefficient) pair
        return False


def replay(params: Any, updates, *, distribution: str = "binomial", donate: bool = False, impl: str = "auto") -> Any:
    """Apply ``updates``, a sequence of ``(key, coefficient)`` in canonical order, exactly.

    Coefficients are rounded on the host (:func:`round_coefficient`). The result is bit-identical
    on every backend and to :func:`zeroth.reference.replay_leaf`.

    Args:
      params: pytree of f32 / bf16 / f16 arrays (flax params included), or a :class:`Flat`
        layout of one (:func:`flatten`; the result is then a :class:`Flat` of the same layout,
        whose :func:`unflatten` is bit for bit the replay of the tree).
      updates: sequence of ``(u32[2] key, float coefficient)``; or a pair ``(u32[K,2], f[K])``.
      distribution: ``"binomial"`` (default) or ``"rademacher"``; ``"gaussian"`` is refused.
      donate: reuse the input buffers (the input ``params`` must not be used afterwards). The
        copy path (``False``) allocates a new set of buffers; on a CPU the first such call keeps
        freed host memory for reuse (:mod:`zeroth.kernels.host_memory`), so later copies do not
        pay page faults again.
      impl: the kernel of a pytree's replay (:func:`zeroth.kernels.perturb.fused_apply_updates`):
        ``"auto"`` (the fastest exact path for the platform), ``"native"``, ``"pallas"`` or
        ``"jnp"``; the same bits. A :class:`Flat` takes ``"auto"`` only.

    Example:
      >>> from zeroth.rng import sample_key
      >>> p = {"w": jnp.zeros(3)}
      >>> q = replay(p, [(sample_key(0, 0, 0, 0), 0.5)])
    """
    if isinstance(updates, tuple) and len(updates) == 2 and _is_key_matrix(updates[0]):
        keys, coefficients = _as_keys(updates[0]), updates[1]
        if not isinstance(coefficients, list):  # a list goes as it is (checked where it is rounded)
            coefficients = np.asarray(coefficients, np.float64).reshape(-1)
    else:
        updates = list(updates)
        keys = _as_keys([k for k, _ in updates]) if updates else np.zeros((0, 2), np.uint32)
        coefficients = [c for _, c in updates]
    if len(coefficients) != keys.shape[0]:
        raise ValueError(f"{keys.shape[0]} keys but {len(coefficients)} coefficients")
    scales = update_scales(distribution, coefficients)
    if isinstance(params, Flat):
        if impl != "auto":
            raise ValueError(
                f"a Flat layout replays through its own kernel per buffer; impl must be 'auto', got {impl!r}"
            )
        return _replay_flat(params, keys, scales, distribution, donate)
    if not donate and not _host_memory.decided() and _fused.platform_of(params) == "cpu":
        _host_memory.reuse_freed_host_memory()
    # The fused kernels pick the fastest exact path for the platform the parameters live on
    # (native CPU kernel, Pallas on GPU/TPU, the jnp rule otherwise); every path is held
    # bit-identical to zeroth.reference by the tests.
    return _fused.fused_apply_updates(params, keys, scales, distribution=distribution, donate=donate, impl=impl)


def perturb(params: Any, key, scale: float, *, distribution: str = "binomial", donate: bool = False) -> Any:
    """``params + round(scale) * z`` with the exact rule: one update, ``replay(params, [(key, scale)])``."""
    return replay(params, [(np.asarray(key, np.uint32), scale)], distribution=distribution, donate=donate)


def checksum(params: Any) -> str:
    """SHA-256 (hex) over the whole state: for every leaf, in order of its path string,
    the path, dtype, shape and every value's bytes (little endian, row-major)
    (:func:`zeroth.reference.checksum_leaves` of the leaves, fetched to the host one at a time).

    For a :class:`Flat`, the checksum of its tree (:func:`unflatten`): the same bytes, each
    buffer fetched to the host once and cut into its leaves there.
    """
    if isinstance(params, Flat):
        return _ref.checksum_leaves(
            {seg.path: leaf for seg, leaf in zip(params.layout.segments, _host_leaves(params), strict=True)}
        )
    with_path, _ = jax.tree_util.tree_flatten_with_path(params)
    return _ref.checksum_leaves({_rng.leaf_path(p): np.asarray(jax.device_get(leaf)) for p, leaf in with_path})


def _nbytes(tree) -> int:  # used by benchmarks and docs
    return sum(math.prod(np.shape(x)) * jnp.dtype(x.dtype).itemsize for x in jax.tree_util.tree_leaves(tree))


# --------------------------------------------------------------------------- flat layout


class Segment(NamedTuple):
    """Where one leaf lives in a :class:`Flat`: ``buffers[buffer][offset : offset + size]``,
    row-major, reshaped to ``shape``."""

    path: str  # the leaf's path string (zeroth.rng.leaf_path)
    leaf_id: int  # zeroth.rng.leaf_id(path): names its noise, as in the tree
    dtype: str  # the leaf's dtype (= its buffer's)
    shape: tuple[int, ...]
    buffer: int  # index into Flat.buffers
    offset: int  # element offset in that buffer
    size: int  # elements (prod(shape))


class Layout:
    """The static part of a :class:`Flat`: the tree structure, one :class:`Segment` per leaf (in
    tree order) and the buffers' dtypes and sizes. The leaves smaller than the layout's
    ``alone_from`` share one buffer per dtype; a leaf of at least ``alone_from`` elements has a
    buffer of its own (:func:`layout_of`). Buffers come in the order their first leaf appears; a
    buffer holds its leaves back to back, in tree order (then, in a layout for a TPU, zeros up to
    whole blocks).
    Hashable and compared by value (the hash is computed once), so it keys compiled replays.
    :func:`layout_of` gives one object per value while any is alive, so the lookups of a replay's
    compiled call compare by identity (cheaper than a comparison by value of every leaf).
    """

    __slots__ = ("treedef", "segments", "dtypes", "sizes", "_key", "_hash", "__weakref__")

    def __init__(self, treedef, segments: tuple[Segment, ...], dtypes: tuple[str, ...], sizes: tuple[int, ...]):
        self.treedef = treedef
        self.segments = tuple(segments)
        self.dtypes = tuple(dtypes)
        self.sizes = tuple(sizes)
        self._key = (treedef, self.segments, self.dtypes, self.sizes)
        self._hash = hash(self._key)

    def __hash__(self) -> int:
        return self._hash

    def __eq__(self, other) -> bool:
        return self is other or (isinstance(other, Layout) and self._hash == other._hash and self._key == other._key)

    def __repr__(self) -> str:
        bufs = ", ".join(f"{d}[{n}]" for d, n in zip(self.dtypes, self.sizes))
        return f"Layout({len(self.segments)} leaves in {len(self.dtypes)} buffers: {bufs})"

    def table(self, buffer: int) -> tuple[tuple[int, int, int], ...]:
        """``(offset, size, leaf_id)`` of every leaf in buffer ``buffer``: the kernels' segment table."""
        return tuple((s.offset, s.size, s.leaf_id) for s in self.segments if s.buffer == buffer)

    def tables(self) -> tuple[tuple[tuple[int, int, int], ...], ...]:
        """:meth:`table` of every buffer, in buffer order (the ``segments`` argument of
        :func:`zeroth.kernels.perturb.apply_updates_flat`)."""
        return tuple(self.table(b) for b in range(len(self.dtypes)))


@jax.tree_util.register_pytree_node_class
class Flat:
    """Parameters laid out flat: ``buffers[i]`` is a 1-D array of dtype ``layout.dtypes[i]``
    holding the leaves of that dtype smaller than the layout's ``alone_from``, or one larger
    leaf (see :class:`Layout`). A pytree whose leaves are the buffers
    (the layout is static aux data), so it goes through ``jit``, ``device_put`` and ``tree_map``.
    :func:`replay`, :func:`apply_updates`, :func:`perturb` and :func:`checksum` take it and keep
    each leaf's id, and so do the ZO estimators and :func:`zeroth.zo.mezo_step` (they slice the
    tree out inside their programs); other code that names leaves by their pytree path (the
    kernels' pytree entries) takes the tree: pass it ``unflatten(flat)`` (inside its ``jit``).

    Example:
      >>> from zeroth.rng import sample_key
      >>> f = flatten({"w": jnp.zeros((2, 3)), "b": jnp.ones(3, jnp.bfloat16)})
      >>> f = replay(f, [(sample_key(0, 0, 0, 0), 0.5)], donate=True)
      >>> unflatten(f)["w"].shape
      (2, 3)
    """

    __slots__ = ("buffers", "layout")

    def __init__(self, buffers, layout: Layout):
        self.buffers = tuple(buffers)
        self.layout = layout

    def tree_flatten(self):
        return self.buffers, self.layout

    @classmethod
    def tree_unflatten(cls, layout, buffers):
        return cls(buffers, layout)

    def __repr__(self) -> str:
        return f"Flat({self.layout!r})"


# Leaves of at least this many elements (8 MiB of float32) get a buffer of their own in a Flat.
ALONE_FROM = 1 << 21

# Where the flat layout is the faster way to hold parameters between steps (train.layout auto):
# where each compiled call's host cost per array matters, as on a GPU (measured: the docs'
# measurement pages, "Replay layout"); on a CPU it was slower; a TPU is not measured yet.
FLAT_PLATFORMS = ("gpu",)


def preferred_layout(platform: str) -> str:
    """``"flat"`` on the platforms of :data:`FLAT_PLATFORMS`, else ``"tree"``: what
    ``train.layout: auto`` holds the parameters as, for parameters living on ``platform``
    (``"cpu"``, ``"gpu"``, ``"tpu"``; :func:`zeroth.kernels.perturb.platform_of`).

    Example:
      >>> preferred_layout("gpu"), preferred_layout("cpu")
      ('flat', 'tree')
    """
    return "flat" if _check_platform(platform) in FLAT_PLATFORMS else "tree"


def _check_platform(platform: str) -> str:
    if platform not in ("cpu", "gpu", "tpu"):
        raise ValueError(f"unknown platform {platform!r}; expected 'cpu', 'gpu' or 'tpu'")
    return platform


def layout_of(params: Any, *, platform: str | None = None, alone_from: int | None = ALONE_FROM) -> Layout:
    """The :class:`Layout` of a pytree of f32 / bf16 / f16 arrays (shapes and dtypes only).

    Leaves smaller than ``alone_from`` elements share one buffer per dtype: a replay or a ZO step
    then passes a few arrays instead of one per leaf, which is what costs host time with many
    small leaves. A leaf of at least ``alone_from`` elements has a buffer of its own, so that a
    program that needs it whole reads the buffer itself: a leaf sliced out of a shared buffer is
    a copy wherever XLA cannot fuse the slice into its use. A scanned stack of layers is such a
    use, held for the whole scan: with every leaf in one buffer, a scanned model's ZO step holds
    copies of its stacks that its stacks alone in buffers of their own do not
    (``zeroth bench zo --model smollm2 --flat`` measures it). Beside such a leaf's arithmetic the
    cost of one more array is small. (A stack that the
    model reads through :mod:`zeroth.layerwise` is read by the ZO estimator where it lies in its
    buffer, layer by layer, so there its size does not matter.)

    Args:
      params: the pytree (arrays or ``jax.ShapeDtypeStruct`` s).
      platform: the platform whose replay the layout serves (``"cpu"``, ``"gpu"``, ``"tpu"``;
        None: where the parameters live, :func:`zeroth.kernels.perturb.platform_of`). On
        ``"tpu"`` every shared buffer's size is padded to whole blocks of 128-lane rows
        (:func:`zeroth.kernels.perturb.plans.tpu_flat_size`), so that its replay is one Mosaic launch;
        the padding at its end belongs to no leaf (:func:`flatten` fills it with zeros, no replay
        writes it, :func:`checksum` and :func:`unflatten` never read it). Elsewhere, and for a
        leaf alone, buffers hold their leaves exactly.
      alone_from: the size in elements from which a leaf has a buffer of its own (default
        :data:`ALONE_FROM`, 2**21); None: every leaf in its dtype's buffer; 1: every leaf alone.

    Raises:
      TypeError: a leaf has another dtype (naming its path).
      ValueError: an unknown platform, or ``alone_from`` below 1.
    """
    platform = _check_platform(_fused.platform_of(params) if platform is None else _rule.platform_name(platform))
    if alone_from is not None and (isinstance(alone_from, bool) or not isinstance(alone_from, int) or alone_from < 1):
        raise ValueError(f"alone_from must be an int >= 1 (elements) or None, got {alone_from!r}")
    with_path, treedef = jax.tree_util.tree_flatten_with_path(params)
    dtypes: list[str] = []
    sizes: list[int] = []
    shared: dict[str, int] = {}  # dtype -> index of its shared buffer
    segments = []
    for path, leaf in with_path:
        name = _rng.leaf_path(path)
        dt = _rule.check_dtype(getattr(leaf, "dtype", None) or np.asarray(leaf).dtype, f"leaf {name}")
        shape = tuple(int(d) for d in np.shape(leaf))
        size = math.prod(shape)
        if size > _noise.MAX_LEAF_SIZE:
            raise ValueError(f"leaf {name} has {size} elements; at most {_noise.MAX_LEAF_SIZE} per leaf")
        alone = alone_from is not None and size >= alone_from
        if alone or dt.name not in shared:
            dtypes.append(dt.name)
            sizes.append(0)
            if not alone:
                shared[dt.name] = len(dtypes) - 1
        b = len(dtypes) - 1 if alone else shared[dt.name]
        segments.append(Segment(name, _rng.leaf_id(name), dt.name, shape, b, sizes[b], size))
        sizes[b] += size
    if platform == "tpu":  # shared buffers in whole blocks; a leaf alone is replayed as in the tree
        padded = set(shared.values())
        sizes = [_fused.plans.tpu_flat_size(z) if b in padded else z for b, z in enumerate(sizes)]
    layout = Layout(treedef, tuple(segments), tuple(dtypes), tuple(sizes))
    return _LAYOUTS.setdefault(layout._key, layout)


# The live layouts by value: layout_of returns the one already alive when there is one.
_LAYOUTS: weakref.WeakValueDictionary[tuple, Layout] = weakref.WeakValueDictionary()


def _flatten_leaves(leaves, layout: Layout) -> tuple[jax.Array, ...]:
    parts: list[list[jax.Array]] = [[] for _ in layout.dtypes]
    used = [0] * len(layout.dtypes)
    for seg, leaf in zip(layout.segments, leaves):
        parts[seg.buffer].append(jnp.asarray(leaf, seg.dtype).reshape(-1))
        used[seg.buffer] += seg.size
    for b, (dt, size) in enumerate(zip(layout.dtypes, layout.sizes)):
        if size > used[b]:  # the alignment padding: zeros, outside every leaf
            parts[b].append(jnp.zeros(size - used[b], dt))
    return tuple(
        jnp.concatenate(p) if len(p) > 1 else (p[0] if p else jnp.zeros(0, dt)) for p, dt in zip(parts, layout.dtypes)
    )


@functools.lru_cache(maxsize=64)
def _flatten_fn(layout: Layout, donate: bool):
    """``fn(own, rest) -> buffers``: ``own`` the leaves that are their buffer's whole (donated with
    ``donate``: each becomes its buffer without a copy), ``rest`` the others, each in tree order."""
    own = _own_buffer(layout)

    def run(own_leaves, rest_leaves):
        a, b = iter(own_leaves), iter(rest_leaves)
        return _flatten_leaves([next(a) if o else next(b) for o in own], layout)

    return jax.jit(run, donate_argnums=(0,) if donate else ())


@functools.lru_cache(maxsize=64)
def _own_buffer(layout: Layout) -> tuple[bool, ...]:
    """For each leaf, whether it is the whole of its buffer (the only leaf, and no padding)."""
    count = [0] * len(layout.sizes)
    for s in layout.segments:
        count[s.buffer] += 1
    return tuple(count[s.buffer] == 1 and layout.sizes[s.buffer] == s.size for s in layout.segments)


def flatten(
    params: Any, *, platform: str | None = None, alone_from: int | None = ALONE_FROM, donate: bool = False
) -> Flat:
    """The :class:`Flat` layout of ``params`` (a copy of every leaf into its buffer, one compiled
    call per layout). ``unflatten(flatten(p))`` equals ``p`` bit for bit; each buffer lives where
    the leaves did. ``platform`` and ``alone_from``: see :func:`layout_of` (buffers for a TPU are
    padded to whole blocks; leaves of at least ``alone_from`` elements have a buffer each).

    ``donate=True`` gives the leaves' buffers up (``params`` must not be used afterwards): a leaf
    alone in its buffer then becomes that buffer without a copy, and the jax arrays of the leaves
    copied into a shared buffer are deleted once copied, so that a model laid out this way is not
    held twice while the caller still refers to its tree.
    """
    layout = layout_of(params, platform=platform, alone_from=alone_from)
    leaves = jax.tree_util.tree_leaves(params)
    own = _own_buffer(layout)
    whole = [x for x, o in zip(leaves, own) if o]
    rest = [x for x, o in zip(leaves, own) if not o]
    out = Flat(_flatten_fn(layout, bool(donate))(whole, rest), layout)
    if donate:  # the copied leaves are given up too
        for x in rest:
            if isinstance(x, jax.Array) and not x.is_deleted():
                x.delete()
    return out


def _unflatten_buffers(buffers, layout: Layout) -> Any:
    leaves = [
        jax.lax.slice(buffers[seg.buffer], (seg.offset,), (seg.offset + seg.size,)).reshape(seg.shape)
        for seg in layout.segments
    ]
    return jax.tree_util.tree_unflatten(layout.treedef, leaves)


@functools.lru_cache(maxsize=64)
def _unflatten_fn(layout: Layout):
    return jax.jit(lambda buffers: _unflatten_buffers(buffers, layout))


def _host_leaves(flat: Flat) -> list[np.ndarray]:
    """The leaves of ``flat`` as NumPy views into its buffers, each buffer fetched to the host once."""
    host = [np.asarray(jax.device_get(b)) for b in flat.buffers]
    return [host[s.buffer][s.offset : s.offset + s.size].reshape(s.shape) for s in flat.layout.segments]


def host_tree(params: Any) -> Any:
    """``params`` on the host as a pytree of NumPy arrays: ``jax.device_get`` of a tree, and for a
    :class:`Flat` the tree of its leaves, each a view into its buffer fetched once (no device copy,
    as checkpoints need)."""
    if isinstance(params, Flat):
        return jax.tree_util.tree_unflatten(params.layout.treedef, _host_leaves(params))
    return jax.device_get(params)


def unflatten(flat: Flat) -> Any:
    """The pytree of a :class:`Flat`: each leaf sliced out of its buffer and reshaped.

    Traceable: inside a ``jit`` (a forward pass taking the :class:`Flat`) the slices are views
    that XLA fuses into their uses; outside, one compiled call per layout makes the copies.
    """
    if not isinstance(flat, Flat):
        raise TypeError(f"unflatten takes a zeroth.replay.Flat (from flatten), got {type(flat).__name__}")
    if any(isinstance(b, jax.core.Tracer) for b in flat.buffers):
        return _unflatten_buffers(flat.buffers, flat.layout)
    return _unflatten_fn(flat.layout)(flat.buffers)


def _flat_core(buffers, packed, *, tables, distribution, impl, inplace):
    keys, scales = _fused.dispatch.unpack_updates(packed)  # one transfer per call (_fused.dispatch.pack_updates)
    return tuple(
        _fused.apply_updates_flat(buffers, keys, scales, tables, distribution=distribution, impl=impl, inplace=inplace)
    )


@functools.lru_cache(maxsize=256)
def _flat_fn(layout: Layout, distribution: str, donate: bool, impl: str):
    """The compiled replay of ``layout`` (one per layout, distribution, donation and impl; K is a
    shape, so jit keeps one executable per K)."""
    core = functools.partial(_flat_core, tables=layout.tables(), distribution=distribution, impl=impl, inplace=donate)
    return jax.jit(core, donate_argnums=(0,) if donate else ())


def _replay_flat(flat: Flat, keys: np.ndarray, scales: np.ndarray, distribution: str, donate: bool) -> Flat:
    """:func:`replay` of a :class:`Flat`: one compiled call, one kernel launch per buffer."""
    if not donate and not _host_memory.decided() and _fused.platform_of(flat.buffers) == "cpu":
        _host_memory.reuse_freed_host_memory()
    impl = "jnp" if _fused.dispatch.is_sharded(flat.buffers) else "auto"
    out = _flat_fn(flat.layout, distribution, donate, impl)(flat.buffers, _fused.dispatch.pack_updates(keys, scales))
    return Flat(out, flat.layout)
