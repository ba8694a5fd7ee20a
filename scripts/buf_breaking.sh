#!/usr/bin/env bash
# buf breaking: the protos must stay wire- and source-compatible (buf's FILE rules)
#  1. with the released API, protos/breaking-baseline.binpb (an image of the last
#     release, made by `scripts/buf_breaking.sh --update-baseline` when one is cut);
#  2. with the `main` branch, when run on another branch that has one.
# A clean clone of main always has (1), so CI checks it on every run.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
BASELINE=protos/breaking-baseline.binpb

if [[ "${1:-}" == "--update-baseline" ]]; then
  buf build protos -o "$BASELINE"
  echo "wrote $BASELINE"
  exit 0
fi

buf breaking protos --against "$BASELINE"
echo "buf breaking: compatible with $BASELINE"

branch="$(git rev-parse --abbrev-ref HEAD 2>/dev/null || echo "")"
if [[ "$branch" != "main" ]] && git rev-parse --verify -q main >/dev/null \
   && git cat-file -e main:protos/buf.yaml 2>/dev/null; then
  buf breaking protos --against ".git#branch=main,subdir=protos"
  echo "buf breaking: compatible with branch main"
fi
