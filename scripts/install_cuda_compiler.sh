#!/usr/bin/env bash
# Installs jax's CUDA plugin and the CUDA compiler (no driver, no GPU) into a folder of the virtual
# environment that no jax process imports unless it is put on its PYTHONPATH: the tests that
# compile zeroth's Pallas kernels for an NVIDIA H100 on a machine without one
# (tests/test_kernel_compile.py) and `zeroth bench memory --target h100` use it. Installed in
# site-packages, the plugin would make every jax process on this machine look for a GPU at start-up.
#
# The plugin is the release of the installed jax; the CUDA runtime and compiler are pinned (about
# 580 MB unpacked). Built for Linux on x86_64 only: elsewhere this prints why and installs nothing
# (the tests then skip, naming the missing folder).
#
# Usage: scripts/install_cuda_compiler.sh [VENV]     (default VENV: <repo>/.venv)
set -euo pipefail

repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
venv="${1:-$repo/.venv}"
python="$venv/bin/python"
dest="$venv/cuda-compiler"

if [ "$(uname -s)-$(uname -m)" != "Linux-x86_64" ]; then
  echo "jax's CUDA plugin is built for Linux x86_64 here, not $(uname -s)-$(uname -m): the GPU compile tests will skip"
  exit 0
fi
jax_version="$("$python" -c 'import jax; print(jax.__version__)')"
packages="jax-cuda12-plugin==$jax_version jax-cuda12-pjrt==$jax_version nvidia-cuda-runtime-cu12==12.9.79 nvidia-cuda-nvcc-cu12==12.9.86"
stamp="$dest/requirement.txt"
if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$packages" ]; then
  echo "jax's CUDA plugin and compiler ($packages) already installed in $dest"
  exit 0
fi
rm -rf "$dest.part"
# shellcheck disable=SC2086 (one word per package)
"$python" -m pip install -q --no-deps --only-binary=:all: --target "$dest.part" $packages
rm -rf "$dest"
mv "$dest.part" "$dest"
echo "$packages" > "$stamp"
echo "jax's CUDA plugin and compiler ($packages) installed in $dest"
