"""Failure detection, clean stop and resume times of the control plane (real daemons, real ranks).

Each repeat: a coordinator and two node daemons (own processes) run llama-8 (tiny) on 2 ranks with a
checkpoint every 4 steps; after step 6 the second daemon is SIGKILLed. Measured from the kill:
the run failed (often first through a rank whose peer's connection closed), detection (the lost node
named as the cause, by the heartbeat timeout), clean stop (every rank process of both nodes gone).
Then the daemon is started again and the run resumed: time to the first step after the checkpoint and
to the end. Heartbeats every 0.25 s, node lost after 1.5 s of silence.

Run: .venv/bin/python bench/control_faults.py [--repeats 3]
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

from octopipe.execute.control import LocalCluster, process_alive
from octopipe.execute.runtime import build_model, workload_reference
from octopipe.node.v1 import node_pb2
from octopipe.plan.v1 import plan_pb2
from octopipe.tune import equal_partition, one_f_one_b

RESULTS = Path(__file__).parent / "results" / "control_faults.json"


def _plan() -> plan_pb2.Plan:
    reference = workload_reference("llama-8", tiny=True, sequence=8, global_batch=8)
    names = build_model(reference).model.pipeline_layers()  # type: ignore[operator]
    plan = one_f_one_b(2, 4, layer_names=equal_partition(names, 2))
    plan.model.CopyFrom(reference)
    return plan


def once(root: Path, steps: int) -> dict[str, float]:
    with LocalCluster(root) as cluster, cluster.client() as client:
        cluster.node_process("node0")
        victim = cluster.node_process("node1")
        run_id = client.submit(_plan(), steps=steps, checkpoint_every=4)
        for run in client.watch(run_id, timeout_s=300):
            if run.completed_steps >= 6:
                break
        pids = cluster.rank_pids("node0") + cluster.rank_pids("node1")
        killed = time.monotonic()
        victim.kill()
        run = client.wait(run_id, timeout_s=60)
        failed = time.monotonic() - killed  # often first through a rank whose peer's connection closed
        assert run.state == node_pb2.RUN_STATE_FAILED, run.error
        while "missed heartbeats" not in run.error:  # the cause: the lost node, named by the heartbeat timeout
            if time.monotonic() - killed > 60:
                raise RuntimeError(f"the lost node was not named: {run.error}")
            time.sleep(0.02)
            run = client.run(run_id)
        detected = time.monotonic() - killed
        while any(process_alive(pid) for pid in pids):
            if time.monotonic() - killed > 60:
                raise RuntimeError("ranks still alive 60 s after the kill")
            time.sleep(0.02)
        stopped = time.monotonic() - killed
        cluster.node_process("node1")
        resumed_at = time.monotonic()
        checkpoint = client.resume(run_id).last_checkpoint_step
        first_step = None
        for run in client.watch(run_id, timeout_s=300):
            if first_step is None and run.completed_steps > checkpoint:
                first_step = time.monotonic() - resumed_at
        assert run.state == node_pb2.RUN_STATE_DONE, run.error
        done = time.monotonic() - resumed_at
    return {
        "run_failed_s": failed,
        "detect_s": detected,
        "clean_stop_s": stopped,
        "resume_first_step_s": first_step or done,
        "resume_to_done_s": done,
        "checkpoint_step": float(checkpoint),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--steps", type=int, default=12)
    args = parser.parse_args()
    samples = []
    for index in range(args.repeats):
        with tempfile.TemporaryDirectory(prefix="octopipe-faults-") as folder:
            samples.append(once(Path(folder), args.steps))
        print(f"repeat {index}: " + ", ".join(f"{k} {v:.2f}" for k, v in samples[-1].items()), flush=True)
    keys = ["run_failed_s", "detect_s", "clean_stop_s", "resume_first_step_s", "resume_to_done_s"]
    summary = {
        key: {
            "median": statistics.median(s[key] for s in samples),
            "min": min(s[key] for s in samples),
            "max": max(s[key] for s in samples),
        }
        for key in keys
    }
    print(f"{'measure':<22} {'median s':>9} {'min':>7} {'max':>7}")
    for key in keys:
        print(f"{key:<22} {summary[key]['median']:>9.2f} {summary[key]['min']:>7.2f} {summary[key]['max']:>7.2f}")
    RESULTS.parent.mkdir(exist_ok=True)
    config = {"heartbeat_interval_s": 0.25, "heartbeat_timeout_s": 1.5, "stop_grace_s": 3.0, "steps": args.steps}
    RESULTS.write_text(json.dumps({"config": config, "summary": summary, "samples": samples}, indent=2) + "\n")
    print(f"wrote {RESULTS}")


if __name__ == "__main__":
    main()
