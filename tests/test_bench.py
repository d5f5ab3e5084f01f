"""The benchmark programs run end to end on tiny sizes and report what they promise.

No timing is asserted (machines are shared and noisy): only that every row was measured and that
the ratios the issues target are reported. (Bit equality of the fast paths is tested in
test_kernels_perturb.py and test_replay.py.)
"""

import json
import subprocess
import sys


def _bench(*args: str) -> dict:
    out = subprocess.run(
        [sys.executable, "-m", "zeroth", "bench", *args, "--json"],
        capture_output=True, text=True, timeout=300, check=True,
    )
    return json.loads(out.stdout)


def test_bench_perturb_reports_every_row_and_the_target_ratios():
    result = _bench("perturb", "--size", "4099", "--repeats", "1", "--ks", "1,4")
    rows = {r["name"]: r for r in result["rows"]}
    for name in ("zeroth binomial (replay, K=1)", "zeroth rademacher (replay, K=1)",
                 "jax.random.normal + add", "jax p + c (memory floor)", "zeroth replay K=4 (binomial)"):
        assert rows[name]["elements_per_s"] > 0, name
    for ratio in ("binomial_over_torch", "binomial_over_jax_normal", "rademacher_over_memory_floor"):
        assert ratio in result["ratios"] and ratio in result["targets"]
    assert result["ratios"]["binomial_over_jax_normal"] > 0


def test_bench_kernels_measures_fused_replay_and_sign_bits():
    result = _bench("kernels", "--size", "4099", "--repeats", "1", "--ks", "1,4")
    sections = {}
    for row in result["rows"]:
        sections.setdefault(row["section"], []).append(row)
    assert {"baseline", "fused replay", "signbits"} <= set(sections)
    for section in ("fused replay", "signbits"):
        for row in sections[section]:
            assert row["elements_per_s"] > 0, row["name"]
    assert any(r["name"] == "binomial fused K=4" for r in sections["fused replay"])
