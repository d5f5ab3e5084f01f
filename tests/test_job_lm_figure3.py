"""The committed runs of seed 000's Figure 3 on MiniLM (experiments/results/job_lm_figure3/, made by
experiments/job_lm_figure3.yaml) compare what the figure says they compare: the same number of
gradients in every run, evaluated at the same counts, peers that agree bit for bit, and the payload
of the codec each run names."""

import importlib.util
import json
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "experiments" / "results" / "job_lm_figure3"
ZO = ("onebyte_4peers", "float32_4peers", "onebyte_1machine")


@pytest.fixture(scope="module")
def runs():
    spec = importlib.util.spec_from_file_location("plot_job_lm_figure3", ROOT / "scripts" / "plot_job_lm_figure3.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod.runs(RESULTS)


def test_every_run_computes_the_same_number_of_gradients(runs):
    assert set(runs) == {*ZO, "backprop"}
    for name in ZO:
        assert (runs[name]["gradients"], runs[name]["forward_passes"]) == (1000, 2000), name
    assert runs["backprop"]["gradients"] == 1000  # 250 steps of 64 sentences = 4 gradients of 16 each
    # evaluated at the same gradient counts, so the curves compare at equal passes
    counts = [g for g, _ in runs["onebyte_4peers"]["evals"]]
    assert counts == [200, 400, 600, 800, 1000]
    for name in ZO[1:]:
        assert [g for g, _ in runs[name]["evals"]] == counts, name
    assert [g for g, _ in runs["backprop"]["evals"]] == [0, *counts]


def test_peers_agree_and_send_their_codec_s_payload():
    summaries = {n: json.loads((RESULTS / n / "summary.json").read_text()) for n in ZO}
    for name, s in summaries.items():
        peers = 1 if name.endswith("1machine") else 4
        assert s["peers_done"] == s["peers_started"] == peers, name
        assert s["digests_agree"] is True and s["final_digests"] == [s["final_digest"]], name
        assert {p["digest"] for p in s["peers"]} == {s["final_digest"]}, name
        assert [p["finish_reason"] for p in s["peers"]] == ["done"] * peers, name
        assert s["checksum_mismatches"] == 0 and s["projected_gradients"] == 1000, name
        assert set(s["contributors_per_iteration"]) == {peers}, name  # nobody missed an iteration
    assert summaries["onebyte_4peers"]["payload_bytes"] == 1000
    assert summaries["float32_4peers"]["payload_bytes"] == 4000
    # the codec changes the updates: the two 4-peer runs end on different parameters
    assert summaries["onebyte_4peers"]["final_digest"] != summaries["float32_4peers"]["final_digest"]
