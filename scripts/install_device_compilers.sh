#!/usr/bin/env bash
# Installs the compilers of the devices this machine lacks, into folders of the virtual environment
# that no jax process uses unless told to: libtpu's shared library (the TPU compiler) in
# VENV/libtpu/ (found through TPU_LIBRARY_PATH), jax's CUDA plugin with the CUDA runtime and
# compiler in VENV/cuda-compiler/ (found through PYTHONPATH). tests/test_kernel_compile*.py compile
# zeroth's Pallas kernels with them for a TPU v5e, a TPU v4 and an NVIDIA H100 (no device, no
# driver; nothing runs). Installed as packages, either would make every jax process on this
# machine look for its device at start-up.
#
# libtpu is the release the installed jax names in its `tpu` extra (a 213 MB wheel, 693 MB
# unpacked); the CUDA plugin is the installed jax's release, the CUDA runtime and compiler are
# pinned (582 MB). Both are built for Linux on x86_64: elsewhere this prints why and installs
# nothing (the tests then skip, naming the missing file).
#
# Usage: scripts/install_device_compilers.sh [VENV]     (default VENV: <repo>/.venv)
set -euo pipefail

repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
venv="${1:-$repo/.venv}"
python="$venv/bin/python"

if [ "$(uname -s)-$(uname -m)" != "Linux-x86_64" ]; then
  echo "libtpu and jax's CUDA plugin are built for Linux x86_64, not $(uname -s)-$(uname -m): the kernel compile tests will skip"
  exit 0
fi

# --- libtpu: the wheel's shared library only
dest="$venv/libtpu"
requirement="$("$python" - <<'PY'
import importlib.metadata as m
found = [r.split(";")[0].strip() for r in (m.requires("jax") or []) if r.startswith("libtpu") and "tpu" in r.split(";")[-1]]
if not found:
    raise SystemExit("the installed jax names no libtpu release in its tpu extra")
print(found[0])
PY
)"
if [ -f "$dest/libtpu.so" ] && [ "$(cat "$dest/requirement.txt" 2>/dev/null)" = "$requirement" ]; then
  echo "libtpu ($requirement) already installed in $dest"
else
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
  echo "$requirement" > "$dest/requirement.txt"
  echo "libtpu ($requirement, $(basename "$wheel")) installed in $dest"
fi

# --- jax's CUDA plugin and the CUDA compiler
dest="$venv/cuda-compiler"
jax_version="$("$python" -c 'import jax; print(jax.__version__)')"
packages="jax-cuda12-plugin==$jax_version jax-cuda12-pjrt==$jax_version nvidia-cuda-runtime-cu12==12.9.79 nvidia-cuda-nvcc-cu12==12.9.86"
if [ -f "$dest/requirement.txt" ] && [ "$(cat "$dest/requirement.txt")" = "$packages" ]; then
  echo "jax's CUDA plugin and compiler ($packages) already installed in $dest"
else
  rm -rf "$dest.part"
  # shellcheck disable=SC2086 (one word per package)
  "$python" -m pip install -q --no-deps --only-binary=:all: --target "$dest.part" $packages
  rm -rf "$dest"
  mv "$dest.part" "$dest"
  echo "$packages" > "$dest/requirement.txt"
  echo "jax's CUDA plugin and compiler ($packages) installed in $dest"
fi
