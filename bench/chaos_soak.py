"""Chaos soak: runs that heal themselves, each hit by one random fault at a random step.

A coordinator and two node daemons (own processes; in two network namespaces on a bridge when this machine
can make them, else on loopback) run llama-8 (tiny) on 2 ranks, with an automatic recovery policy, the
plan's profile (for re-planning) and an asynchronous checkpoint every step. First one uninterrupted run;
then N runs, each with one fault drawn at random, at a random step:

- ``daemon_kill``: SIGKILL of node1's daemon (its ranks die with it); the run is re-planned onto node0;
- ``link_cut``: node1's link taken down at the bridge (namespaces only); re-planned onto node0;
- ``coordinator_restart``: the coordinator stopped and started again on its state folder; the run goes on;
- ``rank_crash``: SIGKILL of one rank process; the same plan is resumed on both nodes.

After each run the cluster is mended (the daemon started again, the link brought up). Per run: finished
(all steps), steps short of the asked number (goal 0), steps re-run after the fault (failed_at_step -
resumed_from_step), time to recover (fault to the healed run's first completed step), and whether the final
checkpoint (weights and AdamW state) is bitwise the uninterrupted run's (goal: every run).

Each daemon is started under `taskset -c <its index>`, so the two ranks run on two distinct cores (recorded per
run and checked); the load average is recorded and a busy machine refused (`--force` to override).

Run: PYTHONPATH=. .venv/bin/python bench/chaos_soak.py [--runs 20] [--seed 0]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import random
import signal
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from octopipe.coordinator.v1 import coordinator_pb2
from octopipe.execute.control import LocalCluster, process_alive
from octopipe.execute.runtime.checkpoint import read_checkpoint
from octopipe.execute.runtime.pinning import online_cpus
from octopipe.execute.runtime.pipeline import profile_reference
from octopipe.node.v1 import node_pb2
from tests.execute import netns

sys.path.insert(0, str(Path(__file__).parent))
from quiet import DEFAULT_MAX_LOAD, Environment, require_quiet

from tests.execute.control_cluster import llama_plan

RESULTS = Path(__file__).parent / "results" / "chaos_soak.json"
FAULTS = ("daemon_kill", "link_cut", "coordinator_restart", "rank_crash")


class Soak:
    """The cluster of the soak and how to hurt and mend it."""

    def __init__(self, root: Path, hosts: list[netns.Host] | None, gateway: str) -> None:
        self.hosts = hosts
        addresses = [gateway, *(h.address for h in hosts)] if hosts else ["127.0.0.1", "localhost"]
        self.cluster = LocalCluster(root, listen_host=gateway, hosts=addresses)
        self.daemons: dict[str, Any] = {}
        for index in range(2):
            self.start_daemon(index)

    def start_daemon(self, index: int) -> None:
        """Daemon ``index`` on core ``index`` (taskset): its rank inherits the mask, so the two ranks never
        share a core (the daemons start their ranks unpinned)."""
        node_id = f"node{index}"
        pin = ["taskset", "-c", str(index % len(online_cpus()))]
        if self.hosts:
            host = self.hosts[index]
            prefix = [*host.prefix, *pin]
            self.daemons[node_id] = self.cluster.node_process(node_id, prefix=prefix, listen=f"{host.address}:0")
        else:
            self.daemons[node_id] = self.cluster.node_process(node_id, prefix=pin)

    def wait_for_nodes(self, timeout_s: float = 60) -> None:
        deadline = time.monotonic() + timeout_s
        while sum(alive for _, _, alive in self.cluster.coordinator.nodes()) < 2:
            if time.monotonic() > deadline:
                raise RuntimeError("the two daemons did not come back")
            time.sleep(0.1)

    def rank_cores(self) -> dict[int, list[int]]:
        """The cores each running rank may use (its affinity mask), by rank (node0 runs rank 0 unless re-planned)."""
        cores: dict[int, list[int]] = {}
        for index, node_id in enumerate(("node0", "node1")):
            for pid in self.newest_rank_pids(node_id):
                with contextlib.suppress(OSError):
                    cores[index] = sorted(os.sched_getaffinity(pid))
        return cores

    def newest_rank_pids(self, node_id: str) -> list[int]:
        files = sorted((self.cluster.root / node_id).glob("*/rank*.pid"), key=lambda p: p.stat().st_mtime)
        return [pid for p in files[-1:] if process_alive(pid := int(p.read_text()))]

    def hurt(self, fault: str) -> None:
        if fault == "daemon_kill":
            self.daemons["node1"].kill()
            self.daemons["node1"].wait(timeout=10)
        elif fault == "link_cut":
            assert self.hosts
            netns.cut(self.hosts[1])
        elif fault == "coordinator_restart":
            self.cluster.restart_coordinator()
        elif fault == "rank_crash":
            for pid in self.newest_rank_pids(random.choice(["node0", "node1"])):
                os.kill(pid, signal.SIGKILL)

    def mend(self, fault: str) -> None:
        if fault == "daemon_kill":
            self.start_daemon(1)
        elif fault == "link_cut":
            assert self.hosts
            netns.mend(self.hosts[1])
        self.wait_for_nodes()


def same_state(expected: dict[str, torch.Tensor], actual: dict[str, torch.Tensor]) -> bool:
    return sorted(expected) == sorted(actual) and all(torch.equal(expected[k], actual[k]) for k in expected)


def one_run(soak: Soak, index: int, fault: str, at_step: int, options: dict[str, Any]) -> dict[str, Any]:
    plan, steps = options["plan"], options["steps"]
    run_id = f"soak{index}"
    with soak.cluster.client() as client:
        client.submit(plan, run_id=run_id, **options["submit"])
        for run in client.watch(run_id, timeout_s=300):
            if run.completed_steps >= at_step:
                break
        before = len(client.run(run_id).recoveries)  # a recovery before the fault is not this fault's
    cores = soak.rank_cores()
    hurt_at = time.monotonic()
    soak.hurt(fault)
    recovered_s = None
    deadline = hurt_at + 300
    with soak.cluster.client() as client:
        while time.monotonic() < deadline:  # polled: the coordinator may be restarting under the client
            try:
                run = client.run(run_id)
            except Exception:
                time.sleep(0.1)
                continue
            healed = (
                len(run.recoveries) > before
                and run.recoveries[-1].resumed_at.seconds
                and run.completed_steps > run.recoveries[-1].resumed_from_step
            )
            if recovered_s is None and (healed or (fault == "coordinator_restart" and run.completed_steps > at_step)):
                recovered_s = time.monotonic() - hurt_at
            if run.state in (node_pb2.RUN_STATE_DONE, node_pb2.RUN_STATE_FAILED, node_pb2.RUN_STATE_CANCELLED):
                break
            time.sleep(0.05)
    soak.mend(fault)
    rerun = sum(r.failed_at_step - r.resumed_from_step for r in run.recoveries)
    final = options["root"] / run_id
    equal = run.state == node_pb2.RUN_STATE_DONE and same_state(options["clean"], read_checkpoint(final, steps))
    return {
        "run": run_id,
        "fault": fault,
        "at_step": at_step,
        "state": node_pb2.RunState.Name(run.state),
        "finished": run.state == node_pb2.RUN_STATE_DONE and run.completed_steps == steps,
        "steps_short": steps - run.completed_steps,
        "steps_rerun": rerun,
        "recoveries": [
            {"kind": r.kind, "cause": r.cause[:200], "new_plan": r.new_plan, "lost_s": r.lost_seconds}
            for r in run.recoveries
        ],
        "recover_s": recovered_s,
        "recoveries_before_fault": before,
        "rank_cores": {str(r): c for r, c in cores.items()},
        "bitwise_equal": equal,
        "error": run.error[:300],
    }


def soak_runs(root: Path, hosts: list[netns.Host] | None, gateway: str, args: argparse.Namespace) -> dict[str, Any]:
    plan = llama_plan(2, 4)
    profile = profile_reference(plan.model, num_microbatches=plan.num_microbatches, repeats=2)
    recovery = coordinator_pb2.RecoveryPolicy(automatic=True)
    submit = {"steps": args.steps, "checkpoint_every": 1, "checkpoint_async": True, "profile": profile}
    submit["recovery"] = recovery
    soak = Soak(root, hosts, gateway)
    try:
        with soak.cluster.client() as client:
            client.submit(plan, run_id="clean", **submit)
            assert client.wait("clean", timeout_s=300).state == node_pb2.RUN_STATE_DONE
        checkpoints = soak.cluster.config.state_dir / "checkpoints"
        options = {"plan": plan, "steps": args.steps, "submit": submit, "root": checkpoints}
        options["clean"] = read_checkpoint(checkpoints / "clean", args.steps)
        faults = [f for f in FAULTS if hosts or f != "link_cut"]
        draw = random.Random(args.seed)
        results = []
        started = time.monotonic()
        for index in range(args.runs):
            if time.monotonic() - started > args.budget_s:
                print(f"time budget of {args.budget_s:.0f} s spent after {index} runs", flush=True)
                break
            fault, at_step = draw.choice(faults), draw.randint(1, args.steps - 3)
            results.append(one_run(soak, index, fault, at_step, options))
            row = results[-1]
            print(
                f"{index:>3} {fault:<20} step {at_step:>2}: {row['state']:<16} short {row['steps_short']} rerun "
                f"{row['steps_rerun']} recover {row['recover_s'] or 0:.2f} s bitwise {row['bitwise_equal']}",
                flush=True,
            )
        return {"results": results, "faults_drawn_from": faults}
    finally:
        soak.cluster.stop()


def _spread(times: list[float]) -> dict[str, float | None]:
    ordered = sorted(times)
    return {
        "median": statistics.median(ordered) if ordered else None,
        "p90": ordered[min(len(ordered) - 1, round(0.9 * (len(ordered) - 1)))] if ordered else None,
    }


def summarize(results: list[dict[str, Any]], faults: list[str]) -> dict[str, Any]:
    """Runs finished, steps short and re-run, bitwise-equal runs; time to recover over the faults that need a
    recovery (a coordinator restart does not: its run goes on, re-attached), and per fault."""
    healed = [r["recover_s"] for r in results if r["recover_s"] is not None and r["fault"] != "coordinator_restart"]
    return {
        "runs": len(results),
        "finished": sum(r["finished"] for r in results),
        "steps_short_total": sum(r["steps_short"] for r in results),
        "steps_rerun_total": sum(r["steps_rerun"] for r in results),
        "bitwise_equal": sum(r["bitwise_equal"] for r in results),
        "recover_s_without_restarts": _spread(healed),
        "by_fault": {
            f: {
                "runs": sum(r["fault"] == f for r in results),
                "finished": sum(r["finished"] for r in results if r["fault"] == f),
                "recover_s": _spread(
                    [r["recover_s"] for r in results if r["fault"] == f and r["recover_s"] is not None]
                ),
            }
            for f in faults
        },
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=20, help="faulted runs (default 20)")
    parser.add_argument("--steps", type=int, default=16, help="steps per run (default 16)")
    parser.add_argument("--seed", type=int, default=0, help="draws the faults and their steps (default 0)")
    parser.add_argument("--budget-s", type=float, default=1800.0, help="stop drawing runs after this (default 1800)")
    parser.add_argument("--max-load", type=float, default=DEFAULT_MAX_LOAD, help="refuse a busier machine")
    parser.add_argument("--force", action="store_true", help="run on a busy machine (recorded in the JSON)")
    args = parser.parse_args()
    require_quiet(args.max_load, force=args.force)
    environment = Environment(forced=args.force)
    with tempfile.TemporaryDirectory(prefix="octopipe-soak-") as folder:
        if netns.unavailable():
            print(f"no network namespaces ({netns.unavailable()}): loopback daemons, no link cuts", flush=True)
            found = soak_runs(Path(folder), None, "127.0.0.1", args)
        else:
            with netns.hosts(2, subnet="10.215.0") as (gateway, hosts):
                found = soak_runs(Path(folder), hosts, gateway, args)
    results = found["results"]
    summary = summarize(results, found["faults_drawn_from"])
    print(json.dumps(summary, indent=2))
    RESULTS.parent.mkdir(exist_ok=True)
    config = {
        "steps": args.steps,
        "seed": args.seed,
        "checkpoint_every": 1,
        "checkpoint_async": True,
        "heartbeat_interval_s": 0.25,
        "heartbeat_timeout_s": 1.5,
        "network_namespaces": not netns.unavailable(),
    }
    for row in results:  # the two ranks on two distinct cores in every run: checked, not assumed
        environment.record({int(r): c for r, c in row["rank_cores"].items()})
    RESULTS.write_text(
        json.dumps(
            {"config": config, "environment": environment.finish(), "summary": summary, "runs": results}, indent=2
        )
        + "\n"
    )
    print(f"wrote {RESULTS}")


if __name__ == "__main__":
    main()
