#!/usr/bin/env bash
# Makes the small real runs that notebooks/analysis.ipynb and notebooks/job_comparison.ipynb are
# committed with (their outputs and figures come from these folders): about a minute of CPU.
#
#   analysis_small/   the digits experiments of experiments/, whole, three seeds each
#                     (only logged, and backprop evaluated, less often, to keep the files small):
#                       mezo_digits/seed_{0,1,2}        MeZO, one byte per projected gradient
#                       backprop_digits/seed_{0,1,2}    the backprop baseline (same model, data, evaluation)
#                       codec/{onebyte,float32}/seed_{0,1,2}   onebyte_vs_float32.yaml with each codec
#   job_small/        experiments/job_comparison.yaml shortened: 2 peers x 20 iterations with each codec,
#                     and one machine doing the same forward passes (40 iterations)
#
# Only config.yaml, metrics.jsonl and summary.json files are kept (checkpoints, logs and the run
# secret are removed). Usage: scripts/make_notebook_runs.sh [OUT]   (default OUT: notebooks/data)
# PYTHON names the interpreter that has zeroth installed (default: python).
set -euo pipefail

repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
out="${1:-notebooks/data}"  # relative to the repository: the run folders record it
py="${PYTHON:-python}"
cd "$repo"

zrun() { "$py" -m zeroth run --quiet "$@"; }

a="$out/analysis_small"
j="$out/job_small"
rm -rf "$a" "$j"

zrun experiments/mezo_digits.yaml --seeds 0,1,2 --set train.log_every=100 --out "$a/mezo_digits"
zrun experiments/backprop_digits.yaml --seeds 0,1,2 --set train.eval_every=250 --set train.log_every=2000 --out "$a/backprop_digits"
for codec in onebyte float32; do
  zrun experiments/onebyte_vs_float32.yaml --seeds 0,1,2 --set train.codec=$codec --set train.log_every=200 \
    --out "$a/codec/$codec"
done

short=(--set peers.count=2 --set peers.iterations=20 --set train.eval_every=4)
zrun experiments/job_comparison.yaml "${short[@]}" --out "$j/onebyte_2peers"
zrun experiments/job_comparison.yaml "${short[@]}" --set train.codec=float32 --out "$j/float32_2peers"
zrun experiments/job_comparison.yaml --set peers.count=1 --set peers.iterations=40 --set train.eval_every=8 \
  --out "$j/onebyte_1machine"

find "$a" "$j" -depth \( -name checkpoints -o -name run.secret -o -name '*.log' -o -name address -o -name machine \) \
  -exec rm -rf {} +
du -sh "$a" "$j"
