#!/usr/bin/env bash
# Installs libtpu's shared library (the TPU compiler jax uses) into the virtual environment, outside
# its site-packages, for the tests that compile zeroth's Pallas kernels for a TPU on a machine
# without one (tests/test_kernel_compile.py: no TPU needed, nothing runs). jax itself never sees it:
# installed as a package, libtpu would make every jax process on this machine look for a TPU at
# start-up; here only the test's own process names it (TPU_LIBRARY_PATH).
#
# The wheel is the release that the installed jax asks for (its `tpu` extra), from the package
# registry; about 213 MB to fetch, 693 MB unpacked. libtpu is built for Linux on x86_64 only:
# elsewhere this prints why and installs nothing (the tests then skip, naming the missing file).
#
# Usage: scripts/install_libtpu.sh [VENV]     (default VENV: <repo>/.venv)
set -euo pipefail

repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
venv="${1:-$repo/.venv}"
python="$venv/bin/python"
dest="$venv/libtpu"

if [ "$(uname -s)-$(uname -m)" != "Linux-x86_64" ]; then
  echo "libtpu is built for Linux x86_64 only, not $(uname -s)-$(uname -m): the TPU compile tests will skip"
  exit 0
fi
requirement="$("$python" - <<'PY'
import importlib.metadata as m
found = [r.split(";")[0].strip() for r in (m.requires("jax") or []) if r.startswith("libtpu") and "tpu" in r.split(";")[-1]]
if not found:
    raise SystemExit("the installed jax names no libtpu release in its tpu extra")
print(found[0])
PY
)"
stamp="$dest/requirement.txt"
if [ -f "$dest/libtpu.so" ] && [ "$(cat "$stamp" 2>/dev/null)" = "$requirement" ]; then
  echo "libtpu ($requirement) already installed in $dest"
  exit 0
fi
tmp="$(mktemp -d)"
trap 'rm -rf "$tmp"' EXIT
"$python" -m pip download -q --no-deps --only-binary=:all: "$requirement" -d "$tmp"
wheel="$(ls "$tmp"/libtpu-*.whl)"
mkdir -p "$dest"
"$python" - "$wheel" "$dest" <<'PY'
import shutil, sys, zipfile
with zipfile.ZipFile(sys.argv[1]) as wheel, wheel.open("libtpu/libtpu.so") as src, \
        open(sys.argv[2] + "/libtpu.so.part", "wb") as dst:
    shutil.copyfileobj(src, dst, 1 << 24)
PY
mv "$dest/libtpu.so.part" "$dest/libtpu.so"
echo "$requirement" > "$stamp"
echo "libtpu ($requirement, $(basename "$wheel")) installed in $dest"
