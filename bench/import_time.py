"""How fast the CLI and the control plane start, and whether they load torch: this tree against a baseline.

Measures, in interleaved rounds, each a fresh interpreter:
- ``python -m octopipe.execute --help`` (what ``octopipe --help`` runs);
- importing the coordinator, the node daemon and the client (``octopipe.execute.control.{coordinator,node,client}``), and whether torch got loaded;
and counts, per tree, the modules and lines at the top level of ``octopipe.execute`` and the deferred
imports (``# noqa: PLC0415``) in the packages. The baseline is another checkout of the repository
(e.g. ``git worktree add /tmp/base <commit>``); both run with this venv, each tree's sources first on
the path. Prints a table and writes ``bench/results/import_time.json``.

    python bench/import_time.py --baseline /tmp/base
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).parent))

from quiet import DEFAULT_MAX_LOAD, Environment, require_quiet, seconds_summary, write_record

ROOT = Path(__file__).resolve().parents[1]
OUT = ROOT / "bench" / "results" / "import_time.json"
_CONTROL = (
    "import sys, octopipe.execute.control.coordinator, octopipe.execute.control.node, "
    "octopipe.execute.control.client; print(any(m == 'torch' or m.startswith('torch.') for m in sys.modules))"
)


def _env(tree: Path) -> dict[str, str]:
    sources = [str(p) for p in sorted((tree / "packages").glob("*/src"))]
    return {**os.environ, "PYTHONPATH": os.pathsep.join([*sources, str(tree)])}


def _timed(tree: Path, args: list[str]) -> tuple[float, str]:
    started = time.perf_counter()
    done = subprocess.run(
        [sys.executable, *args], env=_env(tree), capture_output=True, text=True, timeout=120, check=False
    )
    elapsed = time.perf_counter() - started
    if done.returncode != 0:
        raise SystemExit(f"{tree}: {' '.join(args)} failed:\n{done.stderr[-2000:]}")
    return elapsed, done.stdout.strip()


def _counts(tree: Path) -> dict[str, int]:
    top = sorted((tree / "packages/execute/src/octopipe/execute").glob("*.py"))
    deferred = sum(p.read_text().count("noqa: PLC0415") for p in (tree / "packages").glob("*/src/**/*.py"))
    return {
        "top_level_modules": len(top),
        "top_level_lines": sum(len(p.read_text().splitlines()) for p in top),
        "deferred_imports": deferred,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--baseline", type=Path, required=True, help="another checkout of the repository")
    parser.add_argument("--rounds", type=int, default=9)
    parser.add_argument("--max-load", type=float, default=DEFAULT_MAX_LOAD)
    parser.add_argument("--force", action="store_true", help="run on a busy machine (recorded in the JSON)")
    args = parser.parse_args()
    require_quiet(args.max_load, force=args.force)
    environment = Environment(forced=args.force)
    trees = {"baseline": args.baseline.resolve(), "this tree": ROOT}
    times: dict[str, dict[str, list[float]]] = {name: {"help": [], "control": []} for name in trees}
    torch_loaded: dict[str, bool] = {}
    for tree in trees.values():  # warm the file cache once, untimed
        _timed(tree, ["-m", "octopipe.execute", "--help"])
        _timed(tree, ["-c", _CONTROL])
    for _ in range(args.rounds):
        for name, tree in trees.items():
            times[name]["help"].append(_timed(tree, ["-m", "octopipe.execute", "--help"])[0])
            elapsed, out = _timed(tree, ["-c", _CONTROL])
            times[name]["control"].append(elapsed)
            torch_loaded[name] = out.splitlines()[-1] == "True"
    record: dict[str, Any] = {"rounds": args.rounds, "trees": {}}
    print(f"{'':12} {'--help (s)':>22} {'import control (s)':>22} {'torch':>6} {'top level':>16} {'deferred':>9}")
    for name, tree in trees.items():
        counts = _counts(tree)
        help_s, control_s = seconds_summary(times[name]["help"]), seconds_summary(times[name]["control"])
        record["trees"][name] = {
            "path": str(tree),
            "help": help_s,
            "import_control": control_s,
            "control_loads_torch": torch_loaded[name],
            **counts,
        }
        print(
            f"{name:12} {help_s['median_s']:>9.3f} [{help_s['p10_s']:.3f}-{help_s['p90_s']:.3f}]"
            f" {control_s['median_s']:>9.3f} [{control_s['p10_s']:.3f}-{control_s['p90_s']:.3f}]"
            f" {torch_loaded[name]!s:>6}"
            f" {counts['top_level_modules']:>3} / {counts['top_level_lines']:>5} lines {counts['deferred_imports']:>9}"
        )
    record["environment"] = environment.finish()
    write_record(OUT, record)
    print(json.dumps({k: v["import_control"]["median_s"] for k, v in record["trees"].items()}))


if __name__ == "__main__":
    main()
