#!/usr/bin/env bash
# The test suite on a machine with an accelerator, in a form that a short lease can read: the test
# files are dealt round-robin into SHARDS groups (default 8), each run by a pytest process of its
# own (-n 0: in that process) with its log in OUT/shard-N.txt. A shard prints its failures' tracebacks when it
# ends, so a run stopped by a time limit keeps those of every shard that ended (with xdist, one
# stopped run of the whole suite beside an NVIDIA H200 ended at 99% with no traceback at all).
#
#   OUT/shard-N.txt    the shard's files, then pytest's output (-rfE: the failures and errors listed)
#   OUT/summary.txt    one line per shard as it ends: exit status, seconds, pytest's last line
#
# Usage: scripts/gpu_tests.sh [OUT]   (default: $OUT if set, else runs/gpu_tests)
# PYTHON (default python), SHARDS (default 8), LIMIT (seconds per shard, default 480), TESTS (the
# test files, default every tests/test_*.py) and PYTEST_ARGS (more pytest arguments, e.g.
# -m accelerator) may be set. BUNDLE=FILE.tgz also packs OUT into that one file at the end, for a
# transport that brings back a few files only (one such run beside an NVIDIA H200 got back none of
# its nine logs). Tests marked `accelerator` run on the accelerator, every other test
# on the host CPU's devices (tests/conftest.py), with the accelerator listed first:
# JAX_PLATFORMS=cuda,cpu unless set.
set -uo pipefail

repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
out="${1:-${OUT:-runs/gpu_tests}}"
py="${PYTHON:-python}"
shards="${SHARDS:-8}"
limit="${LIMIT:-480}"
cd "$repo"
mkdir -p "$out"
: > "$out/summary.txt"
export JAX_PLATFORMS="${JAX_PLATFORMS:-cuda,cpu}" XLA_PYTHON_CLIENT_PREALLOCATE=false PYTHONUNBUFFERED=1

# shellcheck disable=SC2086
mapfile -t files < <(ls ${TESTS:-tests/test_*.py})
run_shard() {
  local n=$1 t0=$SECONDS
  local mine=()
  for i in "${!files[@]}"; do
    [ $((i % shards)) -eq "$n" ] && mine+=("${files[$i]}")
  done
  { printf '%s\n' "${mine[@]}"; echo; } > "$out/shard-$n.txt"
  # shellcheck disable=SC2086
  timeout -k 10 "$limit" "$py" -m pytest -p no:cacheprovider -n 0 -q --tb=short -rfE ${PYTEST_ARGS:-} "${mine[@]}" \
    >> "$out/shard-$n.txt" 2>&1
  local rc=$?
  printf 'shard %d  exit %3d  %4d s  %s\n' "$n" "$rc" $((SECONDS - t0)) "$(tail -n 1 "$out/shard-$n.txt")" >> "$out/summary.txt"
}
for ((n = 0; n < shards; n++)); do
  run_shard "$n" &
done
wait
cat "$out/summary.txt"
if [ -n "${BUNDLE:-}" ]; then
  tar -czf "$BUNDLE" -C "$(dirname "$out")" "$(basename "$out")" && echo "bundle: $BUNDLE ($(du -h "$BUNDLE" | cut -f1))"
fi
