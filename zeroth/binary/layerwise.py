"""Greedy layer-wise training (Belilovsky et al. 2018, seed 002): one binary layer at a time, frozen, cached.

Layer ``i`` is trained with its own auxiliary head on the packed outputs of the frozen layers
below it (:func:`zeroth.binary.train.train_layer`), then frozen; its packed (pooled) outputs for
the train and test sets are computed once and cached. A layer's weights are a function of its
spec, its training config and its inputs only, never of the layers above, so the cache key is

    SHA-256(spec, training config, layer index, SHA-256 of the packed train and test inputs)

and models that share their lower layers train them once: the second model finds them in the
:class:`LayerCache` (in memory, and in a folder of ``.npz`` files when given one).

Example:
  >>> cache = LayerCache()
  >>> len(cache), cache.trained
  (0, 0)
"""

from __future__ import annotations

import hashlib
import json
import pathlib
from typing import NamedTuple

import jax.numpy as jnp
import numpy as np

from zeroth.binary import layers as L
from zeroth.binary import train as T

__all__ = ["Frozen", "Interrupted", "LayerCache", "layer_key", "digest", "train_layerwise"]


class Frozen(NamedTuple):
    """A trained, frozen layer, its head and its cached packed outputs."""

    spec: L.ConvSpec
    layer: L.ConvLayer
    head: L.Head
    out_train: np.ndarray  # u32[N, H', W', words(O)]
    out_test: np.ndarray
    test_accuracy: float  # of this layer's auxiliary head
    history: list
    seconds: float
    key: str
    test_loss: float = float("nan")  # mean cross-entropy of the auxiliary head on the test set


class Interrupted(Exception):
    """:func:`train_layerwise` stopped inside layer ``len(done)``: the frozen layers below it and its state."""

    def __init__(self, done: list, state: T.LayerState):
        self.done, self.state = done, state
        super().__init__(f"layer-wise training stopped in layer {len(done)} after step {state.step}")


def digest(*arrays) -> str:
    """SHA-256 of arrays' shapes, dtypes and bytes."""
    h = hashlib.sha256()
    for a in arrays:
        a = np.ascontiguousarray(a)
        h.update(f"{a.dtype.str}{a.shape}".encode())
        h.update(a.tobytes())
    return h.hexdigest()


def layer_key(spec: L.ConvSpec, cfg: T.TrainConfig, layer_index: int, inputs_digest: str) -> str:
    """Cache key of a layer: its config and the digest of its inputs."""
    text = json.dumps(
        {"spec": spec._asdict(), "train": cfg._asdict(), "index": layer_index, "inputs": inputs_digest}, sort_keys=True
    )
    return hashlib.sha256(text.encode()).hexdigest()


class LayerCache:
    """Trained layers by key, in memory and optionally on disk (``<dir>/<key>.npz``).

    ``trained`` counts the layers this cache had to train (misses); ``hits`` the reuses.
    """

    def __init__(self, directory: str | pathlib.Path | None = None):
        self._mem: dict[str, Frozen] = {}
        self._dir = pathlib.Path(directory) if directory is not None else None
        self.trained = 0
        self.hits = 0

    def __len__(self) -> int:
        return len(self._mem)

    def get(self, key: str, spec: L.ConvSpec) -> Frozen | None:
        if key in self._mem:
            return self._mem[key]
        if self._dir is not None and (self._dir / f"{key}.npz").is_file():
            z = np.load(self._dir / f"{key}.npz", allow_pickle=False)
            meta = json.loads(str(z["meta"]))
            fr = Frozen(
                spec,
                L.ConvLayer(jnp.asarray(z["w"]), jnp.asarray(z["thresh"])),
                L.Head(jnp.asarray(z["head_a"]), jnp.asarray(z["head_b"])),
                z["out_train"],
                z["out_test"],
                meta["test_accuracy"],
                meta["history"],
                meta["seconds"],
                key,
                meta["test_loss"],
            )
            self._mem[key] = fr
            return fr
        return None

    def put(self, fr: Frozen) -> None:
        self._mem[fr.key] = fr
        if self._dir is not None:
            self._dir.mkdir(parents=True, exist_ok=True)
            meta = json.dumps(
                {
                    "test_accuracy": fr.test_accuracy,
                    "test_loss": fr.test_loss,
                    "history": fr.history,
                    "seconds": fr.seconds,
                }
            )
            np.savez(
                self._dir / f"{fr.key}.npz",
                w=np.asarray(fr.layer.w),
                thresh=np.asarray(fr.layer.thresh),
                head_a=np.asarray(fr.head.a),
                head_b=np.asarray(fr.head.b),
                out_train=fr.out_train,
                out_test=fr.out_test,
                meta=np.array(meta),
            )


def train_layerwise(
    plan,
    x_train,
    y_train,
    x_test,
    y_test,
    *,
    classes: int,
    cache: LayerCache | None = None,
    log=None,
    done: list[Frozen] = (),
    state: T.LayerState | None = None,
    stop=None,
) -> list[Frozen]:
    """Train ``plan`` (a list of ``(ConvSpec, TrainConfig)``) greedily, bottom up.

    Args:
      plan: layer ``i`` reads the (pooled) packed outputs of layer ``i - 1``; ``spec.c_in`` must match.
      x_train, x_test: packed inputs ``u32[N, H, W, words(C)]``; y_*: labels.
      cache: reuse layers trained before with the same config on the same inputs.
      log: called with ``(layer_index, record, layer)`` after each training step, and with
        ``(layer_index, None, frozen)`` when a layer is frozen (trained or found in the cache).
      done, state: resume: the frozen layers at the bottom of the plan, and the state of the next
        layer's training (from :class:`Interrupted`).
      stop: called before each training step; True stops the training with :class:`Interrupted`.

    Returns:
      One :class:`Frozen` per layer; the last one's head is the classifier.
    """
    cache = LayerCache() if cache is None else cache
    out, xtr, xte = list(done), np.asarray(x_train), np.asarray(x_test)
    c_prev = None
    if out:
        xtr, xte, c_prev = out[-1].out_train, out[-1].out_test, out[-1].spec.c_out
    for i, (spec, cfg) in enumerate(plan[len(out) :], len(out)):
        if c_prev is not None and spec.c_in != c_prev:
            raise ValueError(f"layer {i} has c_in={spec.c_in} but layer {i - 1} outputs {c_prev} channels")
        key = layer_key(spec, cfg, i, digest(xtr, xte))
        fr = cache.get(key, spec)
        if fr is None:
            try:
                res = T.train_layer(
                    spec,
                    xtr,
                    y_train,
                    cfg,
                    classes=classes,
                    layer_index=i,
                    state=state,
                    stop=stop,
                    log=None if log is None else (lambda rec, layer, i=i: log(i, rec, layer)),
                )
            except T.LayerInterrupted as e:
                raise Interrupted(out, e.state) from None
            loss, acc = T.evaluate(res.layer, res.head, xte, y_test, spec, cfg.grid)
            fr = Frozen(
                spec,
                res.layer,
                res.head,
                T.layer_outputs(res.layer, xtr, spec),
                T.layer_outputs(res.layer, xte, spec),
                acc,
                res.history,
                res.seconds,
                key,
                loss,
            )
            cache.put(fr)
            cache.trained += 1
        else:
            cache.hits += 1
        state = None
        out.append(fr)
        if log is not None:
            log(i, None, fr)
        xtr, xte, c_prev = fr.out_train, fr.out_test, spec.c_out
    return out
