#!/usr/bin/env bash
# The one-shot GPU check on a device machine that has python3 with torch but no package index.
#
# On the device, from the repository root, with .whl/ (built below) carried along:
#
#   bash bench/gpu_check.sh          # results in $OUT (default /tmp/gpu_check_out)
#
# It installs .whl/*.whl into /tmp/site (no index, no dependency resolution: the octopipe
# distributions, and the third-party wheels the machine lacks or may have in another version),
# puts /tmp/site and the checkout (tests/, bench/) on PYTHONPATH, prints the versions, runs
# bench/gpu_check.py under `timeout`, and leaves at most 5 flat files in $OUT: gpu_check.json,
# gpu_check.log (this script's output) and gpu_check_{tests,plans,split}.log.
#
# Environment: OUT; GPU_CHECK_DEVICE (cuda, or cpu to check the script on a CPU machine);
# GPU_CHECK_TIMEOUT (seconds for gpu_check.py, default 480; its parts get 30 s less);
# GPU_CHECK_ARGS (more arguments for gpu_check.py); PYTHON (default python3); SITE (default /tmp/site).
#
# Exit status: gpu_check.py's (0 every part ran and every goal held, 1 a goal failed, 2 no GPU,
# 3 a part crashed, timed out or was not reached), 124/137 when `timeout` had to end it, 4 when the
# wheels did not install or import.
#
# Build .whl/ on the development machine (from a commit, not the work tree; default HEAD), with .venv:
#
#   bash bench/gpu_check.sh --build-wheels [REF]
set -uo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT" || exit 4
PY="${PYTHON:-python3}"

# The octopipe distributions (scripts/setup.sh's PACKAGES) and the third-party wheels they need that the
# device lacks (structlog, rich and its dependencies) or may have in another version: protobuf as the
# generated code's runtime, grpcio at least the generated stubs' GRPC_GENERATED_VERSION.
PACKAGES=(protos packages/ir examples packages/capture packages/transform packages/simulate packages/tune packages/execute)
THIRD_PARTY=(protobuf grpcio grpcio-health-checking structlog rich markdown-it-py mdurl pygments)

build_wheels() {
  local ref="${1:-HEAD}" venv="$ROOT/.venv" tree
  [[ -x "$venv/bin/python" ]] || { echo "run ./scripts/setup.sh first (needs .venv)" >&2; return 4; }
  tree="$(mktemp -d)"
  trap 'rm -rf "$tree"' RETURN
  git -C "$ROOT" archive "$ref" | tar -x -C "$tree" || return 4
  mkdir -p "$ROOT/.whl" && rm -f "$ROOT/.whl/"*.whl
  local pkg spec
  for pkg in "${PACKAGES[@]}"; do  # ./ so that pip takes a folder, never an index's project of that name
    (cd "$tree" && PATH="$venv/bin:$PATH" "$venv/bin/python" -m pip wheel -q --no-deps --no-build-isolation \
      -w "$ROOT/.whl" "./$pkg") || return 4
  done
  for pkg in "${THIRD_PARTY[@]}"; do  # the versions .venv runs (its generated code matches them)
    spec="$pkg==$("$venv/bin/python" -c "import importlib.metadata as m, sys; print(m.version(sys.argv[1]))" "$pkg")"
    "$venv/bin/python" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
      --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
      --platform manylinux2014_x86_64 -d "$ROOT/.whl" "$spec" || return 4
  done
  ls -l "$ROOT/.whl" && du -sh "$ROOT/.whl"
  echo "built from $(git -C "$ROOT" rev-parse --short "$ref")"
}

install_wheels() {
  local site="$1"
  shopt -s nullglob
  local wheels=("$ROOT"/.whl/*.whl)
  shopt -u nullglob
  ((${#wheels[@]})) || { echo "no wheels in .whl/ (carry .whl; build it with --build-wheels)"; return 4; }
  rm -rf "$site"
  if ! "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$site" \
    "${wheels[@]}"; then
    echo "pip could not install the wheels: unpacking them instead"
    "$PY" - "$site" "${wheels[@]}" <<'EOF' || return 4
import sys, zipfile
for wheel in sys.argv[2:]:
    zipfile.ZipFile(wheel).extractall(sys.argv[1])
EOF
  fi
  echo "installed ${#wheels[@]} wheels into $site"
}

versions() {
  "$PY" - <<'EOF'
import importlib.metadata as metadata, os, platform, sys
import torch
site = os.environ["SITE"]
print(f"python {platform.python_version()} ({sys.executable})")
cuda = torch.cuda.is_available()
print(f"torch {torch.__version__}, CUDA {torch.version.cuda}, cuDNN {torch.backends.cudnn.version()}, "
      f"NCCL {'.'.join(map(str, torch.cuda.nccl.version())) if cuda else None}, GPUs {torch.cuda.device_count()}")
for index in range(torch.cuda.device_count()):
    props = torch.cuda.get_device_properties(index)
    print(f"  cuda:{index} {props.name}, {props.total_memory / 2**30:.1f} GiB, sm {props.major}.{props.minor}")
problems = []
for module, dist in (("google.protobuf", "protobuf"), ("grpc", "grpcio"), ("structlog", "structlog"),
                     ("rich", "rich"), ("numpy", "numpy"), ("pytest", "pytest"), ("safetensors", "safetensors"),
                     ("transformers", "transformers")):
    try:
        where = __import__(module, fromlist=["_"]).__file__
        print(f"{dist} {metadata.version(dist)} from {os.path.dirname(where)}")
    except Exception as error:
        print(f"{dist}: {type(error).__name__}: {error}")
        if dist not in ("transformers", "safetensors"):
            problems.append(dist)
import google.protobuf
if not google.protobuf.__file__.startswith(site):
    problems.append(f"google.protobuf comes from {google.protobuf.__file__}, not {site}")
try:
    import octopipe.execute.runtime, octopipe.plan.v1.plan_pb2, octopipe.coordinator.v1.coordinator_pb2_grpc  # noqa
    print("octopipe imports from", os.path.dirname(os.path.dirname(octopipe.execute.runtime.__file__)))
except Exception as error:
    problems.append(f"octopipe: {type(error).__name__}: {error}")
if problems:
    print("cannot run the check:", *problems, sep="\n  ")
    sys.exit(4)
EOF
}

main() {
  local device="${GPU_CHECK_DEVICE:-cuda}" limit="${GPU_CHECK_TIMEOUT:-480}" code started
  export SITE="${SITE:-/tmp/site}"
  echo "gpu_check.sh: $(date -u +%FT%TZ) on $(hostname 2>/dev/null || uname -n), checkout $(git rev-parse --short HEAD 2>/dev/null || echo '?')"
  command -v nvidia-smi >/dev/null && nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
  install_wheels "$SITE" || return 4
  export PYTHONPATH="$SITE:$ROOT${PYTHONPATH:+:$PYTHONPATH}"
  export PYTHONUNBUFFERED=1
  versions || return 4
  started=$SECONDS
  # shellcheck disable=SC2086  # GPU_CHECK_ARGS is split into arguments on purpose
  timeout -k 30 "$limit" "$PY" bench/gpu_check.py --device "$device" --budget "$((limit - 30))" \
    --out "$OUT/gpu_check.json" --logs "$OUT" ${GPU_CHECK_ARGS:-}
  code=$?
  echo "gpu_check.py: exit $code after $((SECONDS - started)) s"
  ((code == 124 || code == 137)) && echo "timeout ended gpu_check.py after ${limit} s: see gpu_check.json's parts"
  return "$code"
}

if [[ "${1:-}" == "--build-wheels" ]]; then
  build_wheels "${2:-HEAD}"
  exit $?
fi
OUT="${OUT:-/tmp/gpu_check_out}"
mkdir -p "$OUT"
main 2>&1 | tee "$OUT/gpu_check.log"
code=${PIPESTATUS[0]}
rm -f "$OUT"/*.partial
echo "files in $OUT: $(find "$OUT" -maxdepth 1 -type f | wc -l) ($(cd "$OUT" && ls | tr '\n' ' '))"
exit "$code"
