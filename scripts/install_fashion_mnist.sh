#!/usr/bin/env bash
# Installs Fashion-MNIST (Zalando's 70,000 28x28 grey images of 10 clothing classes, the official
# 60,000 / 10,000 split as IDX files, ~31 MB) from the Debian package `dataset-fashion-mnist`,
# unpacked into a project-local folder: no root needed, nothing installed system-wide. Only
# Debian's archive is contacted, once, here; nothing at run time. If the package is already
# installed system-wide (apt-get install dataset-fashion-mnist), that copy is used and nothing is
# fetched.
#
# Usage: scripts/install_fashion_mnist.sh [PREFIX]     (default PREFIX: <repo>/.data/debian)
# The loader (zeroth/data/images.py) looks in $ZEROTH_FASHION_MNIST, then
# <repo>/.data/debian/usr/share/datasets/fashion-mnist, then /usr/share/datasets/fashion-mnist.
set -euo pipefail

repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
prefix="${1:-$repo/.data/debian}"
files="train-images-idx3-ubyte.gz train-labels-idx1-ubyte.gz t10k-images-idx3-ubyte.gz t10k-labels-idx1-ubyte.gz"

complete() {
  for f in $files; do [ -f "$1/$f" ] || return 1; done
}
if complete "/usr/share/datasets/fashion-mnist"; then
  echo "Fashion-MNIST already installed in /usr/share/datasets/fashion-mnist"
  exit 0
fi
if complete "$prefix/usr/share/datasets/fashion-mnist"; then
  echo "Fashion-MNIST already installed in $prefix/usr/share/datasets/fashion-mnist"
  exit 0
fi
for tool in apt-get dpkg-deb; do
  if ! command -v "$tool" >/dev/null 2>&1; then
    echo "install_fashion_mnist.sh: $tool is not available (a Debian/Ubuntu system is needed)" >&2
    exit 1
  fi
done

work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT
cd "$work"
if ! apt-get download dataset-fashion-mnist >/dev/null 2>&1; then
  # A fresh system has no package lists yet: read them once (needs root), then try again.
  if [ "$(id -u)" = 0 ]; then
    apt-get update -qq >/dev/null
  fi
  if ! apt-get download dataset-fashion-mnist; then
    echo "install_fashion_mnist.sh: apt-get download dataset-fashion-mnist failed (as root, run apt-get update first)" >&2
    exit 1
  fi
fi
mkdir -p "$prefix"
dpkg-deb -x dataset-fashion-mnist_*.deb "$prefix"
if ! complete "$prefix/usr/share/datasets/fashion-mnist"; then
  echo "install_fashion_mnist.sh: expected $files in $prefix/usr/share/datasets/fashion-mnist; the package layout changed" >&2
  exit 1
fi
echo "Fashion-MNIST installed in $prefix/usr/share/datasets/fashion-mnist ($(du -sh "$prefix/usr/share/datasets/fashion-mnist" | cut -f1))"
