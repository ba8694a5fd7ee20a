"""The demo (``./scripts/run.sh``'s job) run N times on a quiet machine: what it chose, predicted and measured.

Each run is a fresh ``octopipe demo`` process (profile, link probe, tune with the 5% error, verify,
run the tuned plan and 1F1B alternately, or 1F1B alone when nothing beats it by more than the error).
Reports per run the choice, the predicted and measured speed-up over 1F1B with equal layers and
the cores the ranks ran on; refuses a busy machine unless ``--force``.

    .venv/bin/python bench/demo_runs.py [--runs 5]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).parent))

from quiet import DEFAULT_MAX_LOAD, Environment, require_quiet, write_record


def one_run(out: Path) -> dict[str, Any]:
    command = [sys.executable, "-m", "octopipe.execute", "demo", "--out", str(out)]
    result = subprocess.run(command, capture_output=True, text=True, check=False, timeout=900)
    if result.returncode != 0:
        return {"failed": result.returncode, "stderr_tail": result.stderr[-2000:]}
    summary = json.loads((out / "summary.json").read_text())
    return {
        "tuned": summary["tuned"],
        "choice": summary["choice"],
        "ran_1f1b_only": summary["ran_1f1b_only"],
        "fastest_predicted_speedup": summary["fastest_predicted_speedup"],
        "predicted_speedup": summary["speedup_over_1f1b_equal"]["predicted"],
        "measured_speedup": summary["speedup_over_1f1b_equal"]["measured"],
        "link_latency_us": summary["link"]["latency_us"],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--max-load", type=float, default=DEFAULT_MAX_LOAD)
    parser.add_argument("--force", action="store_true", help="run on a busy machine (recorded in the JSON)")
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "results" / "demo_runs.json")
    args = parser.parse_args()
    require_quiet(args.max_load, force=args.force)
    env = Environment(forced=args.force)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for index in range(args.runs):
            row = one_run(Path(tmp) / f"demo{index}")
            rows.append(row)
            if "failed" in row:
                print(f"run {index + 1}: FAILED (exit {row['failed']})")
                continue
            what = "1F1B only (nothing beats it by more than the error)" if row["ran_1f1b_only"] else row["tuned"]
            print(
                f"run {index + 1}: {what}; speed-up over 1F1B predicted {row['predicted_speedup']:.3f}x, measured "
                f"{row['measured_speedup']:.3f}x (fastest predicted {row['fastest_predicted_speedup']:.3f}x; "
                f"link {row['link_latency_us']:.0f} us)"
            )
    # the demo's own runs pin their ranks (runtime.pinning); their cores are in each run's trace, not here
    environment = env.finish()
    record = {"environment": environment, "runs": rows}
    write_record(args.out, record)


if __name__ == "__main__":
    main()
