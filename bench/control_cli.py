"""The control plane as an operator times it: client command latency and a daemon's wait for its coordinator.

- ``octopipe runs``, ``nodes``, ``submit`` (a run that stays queued) and ``cancel`` against a local
  coordinator (``LocalCluster``, one node): wall time of each command, a fresh process each time;
- a daemon started before its coordinator (``octopipe node`` as a process): the time from the
  coordinator's start to the daemon registered (its registration retries back off up to 5 s).

Prints a table (median [p10, p90]) and writes ``bench/results/control_cli.json``.

    python bench/control_cli.py [--rounds 7]
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).parent))

from quiet import DEFAULT_MAX_LOAD, Environment, require_quiet, seconds_summary, write_record

from octopipe.execute.control import Coordinator, CoordinatorConfig, LocalCluster, make_certs
from octopipe.execute.processes import free_port
from octopipe.ir import save_plan
from tests.execute.control_cluster import llama_plan

OUT = Path(__file__).parent / "results" / "control_cli.json"


def _octopipe(*args: str) -> float:
    started = time.perf_counter()
    done = subprocess.run(
        [sys.executable, "-m", "octopipe.execute", *args], capture_output=True, text=True, timeout=60, check=False
    )
    elapsed = time.perf_counter() - started
    if done.returncode != 0:
        raise SystemExit(f"octopipe {' '.join(args)} failed: {done.stderr[-1000:]}")
    return elapsed


def _client_latency(root: Path, rounds: int) -> dict[str, list[float]]:
    times: dict[str, list[float]] = {"runs": [], "nodes": [], "submit": [], "cancel": []}
    with LocalCluster(root / "cluster") as cluster:
        cluster.add_node("n0")
        plan_file = root / "plan.binpb"
        save_plan(llama_plan(2, 4), plan_file)  # two ranks on a one-slot node: it stays queued
        client = ["--coordinator", cluster.coordinator.address, "--certs", str(cluster.certs)]
        for index in range(rounds):
            run_id = f"queued-{index}"
            times["submit"].append(_octopipe("submit", str(plan_file), *client, "--run-id", run_id))
            times["runs"].append(_octopipe("runs", *client))
            times["nodes"].append(_octopipe("nodes", *client))
            times["cancel"].append(_octopipe("cancel", run_id, *client))
    return times


def _registration(root: Path, rounds: int, head_start_s: float) -> list[float]:
    certs = root / "certs"
    make_certs(certs, nodes=["early"])
    waits = []
    for index in range(rounds):
        port = free_port()
        node = subprocess.Popen(
            [
                sys.executable, "-m", "octopipe.execute", "node", "--coordinator", f"127.0.0.1:{port}",
                "--certs", str(certs), "--node-id", "early", "--work-dir", str(root / f"node{index}"), "--no-pin",
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )  # fmt: skip
        try:
            time.sleep(head_start_s)
            config = CoordinatorConfig(certs=certs, listen_port=port, state_dir=root / f"state{index}")
            coordinator = Coordinator(config).start()
            started = time.perf_counter()
            try:
                while not coordinator.nodes():
                    if time.perf_counter() - started > 60:
                        raise SystemExit("the daemon did not register within 60 s")
                    time.sleep(0.01)
                waits.append(time.perf_counter() - started)
            finally:
                coordinator.stop()
        finally:
            node.terminate()
            node.wait(timeout=30)
    return waits


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--head-start", type=float, default=5.0, help="seconds the daemon runs before its coordinator")
    parser.add_argument("--max-load", type=float, default=DEFAULT_MAX_LOAD)
    parser.add_argument("--force", action="store_true", help="run on a busy machine (recorded in the JSON)")
    args = parser.parse_args()
    require_quiet(args.max_load, force=args.force)
    environment = Environment(forced=args.force)
    with tempfile.TemporaryDirectory(prefix="octopipe-control-cli-") as folder:
        root = Path(folder)
        latency = _client_latency(root, args.rounds)
        registration = _registration(root, max(3, args.rounds // 2), args.head_start)
    record: dict[str, Any] = {
        "rounds": args.rounds,
        "client_command_s": {name: seconds_summary(values) for name, values in latency.items()},
        "daemon_first_registration_s": seconds_summary(registration),
        "daemon_head_start_s": args.head_start,
    }
    print(f"{'':28} {'median (s)':>10} {'p10-p90 (s)':>16}")
    for name, summary in record["client_command_s"].items():
        print(f"octopipe {name:<19} {summary['median_s']:>10.3f} {summary['p10_s']:>7.3f}-{summary['p90_s']:.3f}")
    summary = record["daemon_first_registration_s"]
    print(
        f"{'daemon first: registered':<28} {summary['median_s']:>10.3f} {summary['p10_s']:>7.3f}-{summary['p90_s']:.3f}"
        f"  (after the coordinator's start; the daemon ran {args.head_start:g} s before it)"
    )
    record["environment"] = environment.finish()
    write_record(OUT, record)


if __name__ == "__main__":
    main()
