"""From a config to what every stage of a model-parallel run builds the same way (pipeline or cluster).

* :func:`examples_of`: the fixed example set of a dataset, cached per process;
* :func:`transformer_of`: zeroth's transformer sized for the examples and its exact initial parameters;
* :func:`optimizer_of`: each stage's optimizer (``train.optimizer`` at ``train.lr``).
"""

from __future__ import annotations

import functools
from typing import Any

import optax

from zeroth import config as _config
from zeroth import models
from zeroth.stages import examples as _examples

__all__ = ["examples_of", "optimizer_of", "transformer_of"]


@functools.lru_cache(maxsize=4)
def examples_of(dataset: str, n: int, seq_len: int, tokenizer: str) -> _examples.Examples:
    """The fixed example set (:func:`zeroth.stages.examples.load_examples`), cached."""
    return _examples.load_examples(dataset, n, seq_len, tokenizer)


def transformer_of(cfg: _config.Config, ex: _examples.Examples, objective: str, seq_len: int) -> tuple[Any, dict]:
    """``(model, params)``: ``Transformer(**model.kwargs)`` for the examples, initialised from ``run.seed``.

    ``num_classes`` is the vocabulary for ``lm`` and the label count for ``classify``.

    Raises:
      ValueError: ``model.kwargs`` sets a size the data decides.
    """
    kw = dict(cfg.model.kwargs)
    for banned in ("num_classes", "vocab_size", "pad_id", "max_len"):
        if banned in kw:
            raise ValueError(f"config field model.kwargs.{banned}: set from the data; remove it")
    num_classes = ex.vocab_size if objective == "lm" else ex.num_classes
    model = models.build(
        "transformer", num_classes=num_classes, vocab_size=ex.vocab_size, max_len=seq_len, pad_id=ex.pad_id, **kw
    )
    return model, models.init(model, models.init_key(cfg.run.seed), ex.tokens[:1])


def optimizer_of(cfg: _config.Config, lr: Any = None) -> Any:
    """The stage optimizer: ``train.optimizer`` with learning rate ``lr`` (default ``train.lr``; a
    float or an optax schedule of the update count) (AdamW in the experiments)."""
    o = cfg.train.optimizer
    lr = cfg.train.lr if lr is None else lr
    if o.name == "adamw":
        return optax.adamw(lr, b1=o.b1, b2=o.b2, weight_decay=o.weight_decay)
    if o.name == "adam":
        return optax.adam(lr, b1=o.b1, b2=o.b2)
    if o.name == "momentum":
        return optax.sgd(lr, momentum=o.momentum)
    return optax.sgd(lr)
