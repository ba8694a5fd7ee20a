#!/usr/bin/env bash
# The test command: set up, then every quality gate, then the whole test suite, `extended` tests included
# (CI runs exactly this). The suite runs on two pytest workers (pytest-xdist): most tests wait on processes,
# sockets and compilers as much as they compute. Extra arguments go to pytest (e.g. scripts/test.sh -k ir).
# `--quick` (first argument) leaves out the tests marked `extended` (further variants of what a default test
# checks; about a third of the time) for a faster local loop. OCTOPIPE_SKIP_PANTS=1 skips the Pants gate.
set -euo pipefail

selection=()
if [[ "${1:-}" == "--quick" ]]; then
  selection=(-m "not extended")
  shift
fi

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
"$ROOT/scripts/setup.sh"
cd "$ROOT"
export PATH="$ROOT/.venv/bin:$PATH"

gate() { printf '\n== %s\n' "$1"; shift; "$@"; }

gate "ruff lint" ruff check .
gate "ruff format" ruff format --check .
gate "buf lint" buf lint protos
gate "buf breaking (against the released baseline)" scripts/buf_breaking.sh
gate "mypy (all packages)" mypy examples/src packages/capture/src packages/transform/src packages/execute/src tests bench
gate "mypy --strict (ir, simulate, tune)" mypy --strict packages/ir/src packages/simulate/src packages/tune/src
# the slowest tests are listed at the end, to keep CI's 45-minute budget in view
gate "pytest" python -m pytest -n 2 --durations=30 ${selection[@]+"${selection[@]}"} "$@"
if [[ "${OCTOPIPE_SKIP_PANTS:-0}" != "1" ]]; then
  gate "pants: package (8 wheels), layering" scripts/pants_check.sh
fi
