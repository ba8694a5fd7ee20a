#!/usr/bin/env bash
# Check the Pants build: `pants package ::` must write one wheel per distribution into dist/, each
# with its py.typed and no octopipe/__init__.py (the protos wheel with its generated code), and
# the layering rules must pass (ruff, which `pants lint ::` runs, is scripts/test.sh's first gates). Prints the wall time of each step. Exit status: 0 when all is well.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
PANTS="$ROOT/scripts/pants"
DISTS=(protos ir examples capture transform simulate tune execute)
status=0

step() {  # step NAME COMMAND...: run, print its wall time, remember a failure
  local name="$1" start end rc
  shift
  printf '\n== %s: %s\n' "$name" "$*"
  start=$(date +%s%N)
  set +e
  "$@"
  rc=$?
  set -e
  end=$(date +%s%N)
  local ms=$(((end - start) / 1000000))
  printf '== %s: exit %d, %d.%d s\n' "$name" "$rc" $((ms / 1000)) $((ms % 1000 / 100))
  [[ $rc -eq 0 ]] || status=1
  return $rc
}

step bootstrap "$PANTS" --version || exit 1

rm -f dist/octopipe_*.whl
step package "$PANTS" package :: || true

printf '\n== wheels in dist/\n'
for name in "${DISTS[@]}"; do
  wheels=(dist/octopipe_"$name"-*.whl)
  if [[ ! -f "${wheels[0]}" ]]; then
    echo "MISSING: octopipe-$name (no dist/octopipe_$name-*.whl)"
    status=1
    continue
  fi
  wheel="${wheels[0]}"
  files="$(unzip -Z1 "$wheel")"
  problems=()
  grep -qx 'octopipe/__init__.py' <<<"$files" && problems+=("ships octopipe/__init__.py")
  if [[ "$name" == protos ]]; then
    for suffix in _pb2.py _pb2.pyi _pb2_grpc.py _pb2_grpc.pyi; do
      grep -q "^octopipe/[a-z_]*/v1/[a-z_]*$suffix\$" <<<"$files" || problems+=("no *$suffix")
    done
    grep -q '^octopipe/[a-z_]*/v1/py.typed$' <<<"$files" || problems+=("no py.typed")
    grep -q 'build_backend' <<<"$files" && problems+=("ships the build backend")
  else
    grep -qx "octopipe/$name/py.typed" <<<"$files" || problems+=("no octopipe/$name/py.typed")
    grep -qx "octopipe/$name/__init__.py" <<<"$files" || problems+=("no octopipe/$name/__init__.py")
  fi
  if [[ ${#problems[@]} -eq 0 ]]; then
    printf 'ok       %s (%d files)\n' "$(basename "$wheel")" "$(wc -l <<<"$files")"
  else
    printf 'BAD      %s: %s\n' "$(basename "$wheel")" "$(IFS=';'; echo "${problems[*]}")"
    status=1
  fi
done
for wheel in dist/octopipe_*.whl; do  # distributions beyond the six, if any
  name="$(basename "$wheel" | cut -d- -f1)"
  [[ " ${DISTS[*]/#/octopipe_} " == *" $name "* ]] || printf 'also     %s\n' "$(basename "$wheel")"
done

# `pants lint ::` would run ruff again: scripts/test.sh's first two gates run it (CI's 20-minute budget)

# The layering rules (visibility, see the BUILD files) are checked whenever Pants computes
# dependencies; `lint` does not, so ask for every target's dependencies.
all_dependencies() { "$PANTS" dependencies :: >/dev/null; }
step layering all_dependencies || true

if [[ $status -eq 0 ]]; then echo; echo "pants_check: all good"; else echo; echo "pants_check: FAILED"; fi
exit $status
