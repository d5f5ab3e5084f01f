"""The fixed example sets a model-parallel run revisits every epoch (AQ-SGD keeps one buffer row per example).

* ``lm`` on ``sotu``: the train-split State of the Union addresses in year order, concatenated
  (separated by a blank line) and tokenized; example ``i`` is the window of ``T`` tokens starting at
  token ``i · T``. Labels are unused (the next tokens are the targets).
* ``classify`` on ``sentiment``: the first ``N`` train-split sentences, tokenized, cut to ``T``
  tokens and right-padded with the pad id; label 0 negative / 1 positive.

Tokenizers: ``bytes`` (UTF-8 bytes + 1, so id 0 is padding; vocabulary 257) for zeroth's own
transformer, ``smollm2`` (SmolLM2's byte-level BPE; padding with its end-of-text id) for SmolLM2.
Example ids are the row indices, stable across epochs and processes. The batch of step ``t`` is
``zeroth.data.batch_indices(seed, t, B, N)`` (a fresh permutation per epoch); ``B`` must divide
``N`` so that a batch never holds one example twice.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np

from zeroth import data as _data

__all__ = [
    "BYTES_PAD",
    "BYTES_VOCAB",
    "TOKENIZERS",
    "Examples",
    "batch_ids",
    "encode",
    "load_examples",
    "micro_batches",
    "sentiment_examples",
    "sotu_windows",
]

TOKENIZERS = ("bytes", "smollm2")
BYTES_VOCAB = 257
BYTES_PAD = 0


class Examples(NamedTuple):
    """The fixed example set: ``tokens int32[N, T]``, ``labels int32[N]``, ``vocab_size``, ``pad_id``."""

    tokens: np.ndarray
    labels: np.ndarray
    vocab_size: int
    pad_id: int | None
    num_classes: int


def _smollm2_tokenizer():
    from zeroth.models.pretrained import smollm2

    return smollm2.tokenizer()


def encode(text: str, tokenizer: str) -> list[int]:
    """Token ids of ``text`` (``bytes``: UTF-8 bytes + 1)."""
    if tokenizer == "bytes":
        return [b + 1 for b in text.encode("utf-8")]
    if tokenizer == "smollm2":
        return list(_smollm2_tokenizer().encode(text))
    raise ValueError(f"unknown tokenizer {tokenizer!r}; expected one of {list(TOKENIZERS)}")


def _vocab(tokenizer: str) -> tuple[int, int]:
    if tokenizer == "bytes":
        return BYTES_VOCAB, BYTES_PAD
    tok = _smollm2_tokenizer()
    return tok.vocab_size, tok.eos_id


def sotu_windows(n: int, seq_len: int, tokenizer: str) -> Examples:
    """``n`` consecutive windows of ``seq_len`` tokens of the train-split addresses (see the module docstring)."""
    texts = _data.load("sotu", "train").x
    need = n * seq_len
    ids: list[int] = []
    for text in texts:
        # tokenize paragraph by paragraph: only as much text as the windows need
        for para in str(text).split("\n"):
            if para.strip():
                ids += encode(para.strip() + "\n", tokenizer)
            if len(ids) >= need:
                break
        if len(ids) >= need:
            break
    if len(ids) < need:
        raise ValueError(f"the SOTU train split holds {len(ids)} tokens, fewer than {n} windows of {seq_len}")
    tokens = np.asarray(ids[:need], np.int32).reshape(n, seq_len)
    vocab, _ = _vocab(tokenizer)
    return Examples(tokens, np.zeros(n, np.int32), vocab, None, vocab)


def sentiment_examples(n: int, seq_len: int, tokenizer: str) -> Examples:
    """The first ``n`` train-split sentiment sentences, ``int32[n, seq_len]`` right-padded, and their labels."""
    ds = _data.load("sentiment", "train")
    if n > len(ds.x):
        raise ValueError(f"the sentiment train split holds {len(ds.x)} sentences; asked for {n}")
    vocab, pad = _vocab(tokenizer)
    tokens = np.full((n, seq_len), pad, np.int32)
    for i in range(n):
        t = encode(str(ds.x[i]), tokenizer)[:seq_len]
        tokens[i, : len(t)] = t
    return Examples(tokens, np.asarray(ds.y[:n], np.int32), vocab, pad, 2)


def load_examples(dataset: str, n: int, seq_len: int, tokenizer: str) -> Examples:
    """``sotu`` -> :func:`sotu_windows`; ``sentiment`` -> :func:`sentiment_examples`."""
    if dataset == "sotu":
        return sotu_windows(n, seq_len, tokenizer)
    if dataset == "sentiment":
        return sentiment_examples(n, seq_len, tokenizer)
    raise ValueError(f"pipelines train on 'sotu' (lm) or 'sentiment' (classify); got dataset {dataset!r}")


def batch_ids(seed: int, step: int, batch_size: int, n: int) -> np.ndarray:
    """Example ids ``int64[B]`` of the batch at ``step`` (``B`` must divide ``n``)."""
    if n % batch_size:
        raise ValueError(f"batch size {batch_size} must divide the {n} examples (so no batch holds one twice)")
    return _data.batch_indices(seed, step, batch_size, n)


def micro_batches(ids: np.ndarray, m: int) -> list[np.ndarray]:
    """Split a batch's ids into ``m`` equal contiguous micro-batches."""
    if len(ids) % m:
        raise ValueError(f"{m} micro-batches must divide the batch of {len(ids)} examples")
    return list(np.asarray(ids).reshape(m, -1))
