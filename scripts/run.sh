#!/usr/bin/env bash
# The run command: set up, then run the main job on its embedded default.
# Extra arguments go to `octopipe demo` (see `octopipe demo --help`).
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
"$ROOT/scripts/setup.sh"
cd "$ROOT"
exec "$ROOT/.venv/bin/octopipe" demo "$@"
