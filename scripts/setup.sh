#!/usr/bin/env bash
# Set up .venv for the demo, development and tests: torch (CPU, pinned, first),
# the pinned tools, and every octopipe package installed in development mode.
# Idempotent: a second run with nothing changed takes about a second.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="${OCTOPIPE_VENV:-$ROOT/.venv}"
PYTHON="${PYTHON:-python3}"
TORCH_SPEC="torch==2.13.0"
PACKAGES=(protos packages/ir examples packages/capture packages/transform packages/simulate packages/tune packages/execute)

# pip warns about every package missing from the image's local indexes: noise.
quiet_pip() { "$VENV/bin/python" -m pip "$@" 2> >(grep -v "is ignored: it is neither a file nor a directory" >&2); }
say() { printf '[setup] %s\n' "$*" >&2; }

"$PYTHON" -c 'import sys; sys.exit(0 if sys.version_info >= (3, 11) else 1)' \
  || { say "octopipe needs Python >= 3.11; set PYTHON=/path/to/python3.11"; exit 2; }

if [[ ! -x "$VENV/bin/python" ]]; then
  say "creating $VENV"
  "$PYTHON" -m venv "$VENV"
fi

# The stamp records what the venv was built from; rebuild when any of it changes.
manifests=("$ROOT/requirements/dev.txt" "$ROOT/scripts/setup.sh")
for pkg in "${PACKAGES[@]}"; do manifests+=("$ROOT/$pkg/pyproject.toml"); done
stamp_now="$(cat "${manifests[@]}" | sha256sum | cut -c1-16)"
stamp_file="$VENV/.octopipe-setup"
if [[ "$(cat "$stamp_file" 2>/dev/null)" != "$stamp_now" ]]; then
  export PIP_DISABLE_PIP_VERSION_CHECK=1
  say "installing $TORCH_SPEC (CPU) first, so nothing pulls a CUDA build"
  quiet_pip install -q "$TORCH_SPEC"
  say "installing pinned tools (requirements/dev.txt)"
  quiet_pip install -q -r "$ROOT/requirements/dev.txt"
  say "installing the octopipe packages in development mode"
  editables=()
  for pkg in "${PACKAGES[@]}"; do editables+=(-e "$ROOT/$pkg"); done
  # compat mode puts each source root on sys.path, which PEP 420 namespaces need.
  quiet_pip install -q --no-deps --no-build-isolation \
    --config-settings editable_mode=compat "${editables[@]}"
  echo "$stamp_now" > "$stamp_file"
fi

# Generated code is never committed: (re)generate it from the .proto files.
PATH="$VENV/bin:$PATH" "$VENV/bin/python" -c "
import sys; sys.path.insert(0, '$ROOT/protos/build_backend')
import octopipe_protos_backend as backend
backend.generate()
" >/dev/null 2>"$VENV/.protoc.log" || { cat "$VENV/.protoc.log" >&2; say "generating code from protos/ failed"; exit 1; }
say "ready: $VENV"
