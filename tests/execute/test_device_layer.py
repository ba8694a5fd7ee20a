"""The device layer: one place decides where a rank computes (transform.Device, torch side; execute.devices,
torch-free), no other module branches on the device, and a device this machine cannot give is one line
before any rank starts. On this CPU-only machine the CUDA side is exercised up to the point it refuses;
tests/gpu/ runs it where a GPU is."""

from __future__ import annotations

import ast
import json
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from octopipe.execute.cli import EXIT_USAGE, main
from octopipe.execute.control import LocalCluster
from octopipe.execute.control.security import CertPaths, secure_channel
from octopipe.execute.devices import (
    Gpu,
    backend_problem,
    gpu_problem,
    probe_pairs,
    rank_device,
    submission_problem,
)
from octopipe.execute.runs import RunOptions, WorkerConfig
from octopipe.ir import save_plan
from octopipe.node.v1 import node_pb2, node_pb2_grpc
from octopipe.transform import CPU, Device, DeviceError
from tests.execute.control_cluster import llama_plan

ROOT = Path(__file__).resolve().parents[2]
#: the modules allowed to know CPU from CUDA: the torch side, its allocator windows, the torch-free decisions
DEVICE_MODULES = {
    "packages/transform/src/octopipe/transform/device.py",
    "packages/transform/src/octopipe/transform/allocator.py",
    "packages/execute/src/octopipe/execute/devices.py",
}
_NAMES = {"cpu", "cuda", "gloo", "nccl"}


def _device_decisions(path: Path) -> list[str]:
    """Where a module decides on the device itself: ``torch.cuda`` used, a device or backend name compared,
    or a backend named in a call (``init_process_group("gloo")``)."""
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Attribute) and node.attr == "cuda" and ast.unparse(node.value) == "torch":
            found.append(f"line {node.lineno}: torch.cuda")
        if isinstance(node, ast.Compare):
            for operand in (node.left, *node.comparators):
                for constant in ast.walk(operand):
                    value = constant.value if isinstance(constant, ast.Constant) else None
                    if isinstance(value, str) and (value in _NAMES or value.startswith("cuda:")):
                        found.append(f"line {node.lineno}: compares with {value!r}")
        if isinstance(node, ast.Call):
            for arg in (*node.args, *(k.value for k in node.keywords)):
                if isinstance(arg, ast.Constant) and arg.value in ("gloo", "nccl"):
                    found.append(f"line {node.lineno}: backend {arg.value!r} named in a call")
    return found


def test_no_module_outside_the_device_layer_branches_on_the_device() -> None:
    sources = sorted((ROOT / "packages").glob("*/src/octopipe/**/*.py"))
    assert len(sources) > 100  # the whole tree was read
    offenders = {
        str(path.relative_to(ROOT)): found
        for path in sources
        if str(path.relative_to(ROOT)) not in DEVICE_MODULES and (found := _device_decisions(path))
    }
    assert offenders == {}


def test_the_gate_sees_a_device_branch() -> None:
    sample = ROOT / "packages/transform/src/octopipe/transform/device.py"
    assert any("torch.cuda" in f for f in _device_decisions(sample))  # the one module that may: it is seen


def test_devices_parse_name_their_backend_and_refuse_bad_names() -> None:
    assert Device.parse("cpu") == CPU and CPU.backend == "gloo" and str(CPU) == "cpu"
    gpu = Device.parse("cuda:3")
    assert (gpu.kind, gpu.index, gpu.backend, str(gpu)) == ("cuda", 3, "cpu:gloo,cuda:nccl", "cuda:3")
    assert Device.parse("cuda") == Device("cuda", 0)
    for bad in ("gpu", "cuda:x", "cpu:1", "cuda:-1", ""):
        with pytest.raises(DeviceError, match="is not cpu, cuda or cuda:N"):
            Device.parse(bad)
    tensor = torch.ones(2)
    assert CPU.put(tensor) is tensor  # on its device already: the same tensor, nothing copied


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has CUDA: tests/gpu checks the device there")
def test_a_cuda_device_on_a_machine_without_cuda_is_one_line() -> None:
    with pytest.raises(DeviceError) as caught:
        Device.parse("cuda:0").check()
    message = str(caught.value)
    assert "no usable CUDA device" in message and "run on cpu" in message and "\n" not in message
    CPU.check()  # the CPU is always there


def test_a_cpu_stopwatch_reads_the_host_clock_and_a_link_probe_measures_one_cpu_pair_but_every_gpu_pair() -> None:
    watch = CPU.stopwatch()
    marks = [watch.mark() for _ in range(3)]
    assert watch.device_ns() == marks == sorted(marks)  # the CPU's work is done when the call returns
    assert watch.elapsed_us(0, 2) == (marks[2] - marks[0]) / 1000 and CPU.timing == "host clock"
    assert Device.parse("cuda:1").timing == "cuda events"
    assert probe_pairs("cpu", 4) == [(0, 1)]  # every local pair shares the loopback
    assert probe_pairs("cuda", 3) == [(0, 1), (0, 2), (1, 2)]  # NVLink, PCIe or a NIC: each pair its own
    with pytest.raises(ValueError, match="a link needs two ranks"):
        probe_pairs("cuda", 1)


def test_ranks_get_their_local_gpu_and_a_machine_short_of_gpus_is_refused() -> None:
    assert [rank_device("cuda", r) for r in range(3)] == ["cuda:0", "cuda:1", "cuda:2"]
    assert rank_device("cpu", 5) == "cpu"
    options = RunOptions(device="cuda")
    common = {"plans": [b""], "world_size": 1, "store_host": "h", "store_port": 1, "result_dir": "r"}
    assert WorkerConfig.for_rank(options, rank=5, local_rank=1, **common).device == "cuda:1"  # type: ignore[arg-type]
    assert WorkerConfig.for_rank(RunOptions(), rank=5, **common).device == "cpu"  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="device must be one of cpu, cuda"):
        RunOptions(device="tpu")
    assert gpu_problem("cpu", 8, 0) == ""
    assert gpu_problem("cuda", 1, 1) == ""
    assert "has no GPU that CUDA can use" in gpu_problem("cuda", 1, 0)
    assert gpu_problem("cuda", 2, 2) == ""  # a GPU per rank: NCCL point-to-point, one communicator per direction
    assert "NCCL refuses two ranks on one GPU" in gpu_problem("cuda", 2, 1)
    assert backend_problem("", 2, 0) == "" and backend_problem("gloo", 1, 0) == ""
    assert "is not known: use gloo or nccl" in backend_problem("mpi", 1, 0)
    assert "node n1 has no GPU" in backend_problem("nccl", 1, 0, where="node n1")
    assert submission_problem("cuda") == "" and "is not known" in submission_problem("tpu")


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has CUDA: tests/gpu runs plans there")
def test_run_on_cuda_without_a_gpu_is_one_line_before_any_rank_however_many_ranks(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    for ranks in (1, 2):
        says = "has no GPU that CUDA can use"
        plan_file = tmp_path / f"plan{ranks}.binpb"
        save_plan(llama_plan(ranks, 2), plan_file)
        assert main(["run", str(plan_file), "--device", "cuda", "--steps", "1", "--json"]) == EXIT_USAGE
        err = capsys.readouterr().err
        assert says in err and err.count("\n") == 1 and "Traceback" not in err, err


@pytest.mark.extended  # 25-50 s; run it (CI does; ./scripts/test.sh -k gpu_check) before spending device time on the script
def test_the_prepared_gpu_check_runs_on_the_cpu(tmp_path: Path) -> None:
    out = tmp_path / "gpu_check.json"
    command = [sys.executable, str(ROOT / "bench/gpu_check.py"), "--device", "cpu", "--steps", "2"]
    command += ["--workloads", "llama-8", "--schedules", "zb-h1", "--precisions", "bfloat16", "--out", str(out)]
    command += ["--profile-repeats", "1", "--split-repeats", "1", "--split-sequence", "16", "--split-blocks", "mamba"]
    done = subprocess.run(command, capture_output=True, text=True, timeout=600, check=False)
    assert done.returncode == 0, done.stderr[-2000:]
    record = json.loads(out.read_text())
    assert [(p["workload"], p["schedule"], p["precision"]) for p in record["plans"]] == [
        ("llama-8", "zb-h1", "bfloat16")
    ]  # one plan here (CI's budget); the GPU run compares every schedule's first loss
    assert record["every_schedule_same_first_loss"] and record["tests"] == {"skipped": "device cpu"}
    for plan in record["plans"]:  # predicted (profile on the device) against measured (run and allocator)
        assert plan["predicted_step_ms"] > 0 and plan["step"]["median_ms"] > 0 and plan["step_time_error"] >= 0
        assert plan["allocator_peak_bytes"] > 0 and plan["memory_error"] is not None
        assert {"F", "SEND_F"} & set(plan["actions"]) == {"F"}  # one rank: no messages
        for clocks in plan["actions"].values():  # on the CPU the device's clock is the host's
            assert clocks["device_us"] == clocks["host_us"] > 0
    split = record["split_overhead"]
    assert split["dtype"] == "float32" and [r["block"] for r in split["rows"]] == ["mamba"]
    assert (
        record["machine"]["gpus"] == [] and "NCCL between GPUs" in record["not_checked"][0]
    )  # said in the JSON, not left out
    assert all(p["step"]["samples"] == 1 and p["memory"]["peak_bytes"] > 0 for p in record["plans"])


def test_a_node_reports_its_gpus_and_refuses_a_gpu_push_it_cannot_hold(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    h200 = Gpu(index=0, name="NVIDIA H200", memory_bytes=143_771_090_944)
    with LocalCluster(tmp_path) as cluster:
        cluster.add_node("cpu-only")
        gpu_node = cluster.add_node("gpu", slots=2, gpus=(h200,))
        args = ["--coordinator", cluster.coordinator.address, "--certs", str(cluster.certs)]
        assert main(["nodes", *args]) == 0
        rows = {line.split()[0]: line for line in capsys.readouterr().out.splitlines()[1:] if line[:1].strip()}
        assert rows["gpu"].endswith("1 x NVIDIA H200 (133.9 GiB)") and rows["cpu-only"].endswith(" -")
        assert main(["nodes", "--json", *args]) == 0
        listed = {n["node_id"]: n for n in json.loads(capsys.readouterr().out.splitlines()[-1])}
        assert listed["gpu"]["slots"] == 2 and listed["gpu"]["gpus"][0]["name"] == "NVIDIA H200"
        assert listed["cpu-only"]["gpus"] == []
        stub = node_pb2_grpc.NodeServiceStub(secure_channel(gpu_node.address, CertPaths(cluster.certs, "coordinator")))
        request = node_pb2.PushPlanRequest(
            run_id="on-gpus", version=1, nonce="n1", plan=llama_plan(2, 2), num_steps=1,
            assignment=node_pb2.RankAssignment(ranks=[0, 1], world_size=2, rendezvous_host="127.0.0.1",
                                               backend="nccl"),
        )  # fmt: skip
        answer = stub.PushPlan(request, timeout=10)
        assert not answer.accepted and "puts 2 ranks on node gpu, which has 1 GPU(s)" in answer.reason, answer.reason
        assert not (cluster.root / "gpu" / "on-gpus").exists()  # refused before anything was written or started
        request.assignment.backend = "mpi"
        request.nonce = "n2"
        assert "is not known" in stub.PushPlan(request, timeout=10).reason


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has CUDA: tests/gpu runs plans there")
def test_a_cuda_run_waits_for_a_gpu_is_placed_on_one_and_fails_in_one_line_where_cuda_is_missing(
    tmp_path: Path,
) -> None:
    h200 = Gpu(index=0, name="NVIDIA H200", memory_bytes=143_771_090_944)
    with LocalCluster(tmp_path) as cluster:
        cluster.add_node("cpu-only", slots=2)
        with cluster.client() as client:
            run_id = client.submit(llama_plan(1, 2), steps=1, device="cuda")
            deadline = time.monotonic() + 30
            while not (run := client.run(run_id)).waiting_for and time.monotonic() < deadline:
                time.sleep(0.05)
            assert run.state == node_pb2.RUN_STATE_QUEUED  # a CPU node's slots are not GPUs
            assert run.waiting_for.startswith("waiting for 1 GPU slots: 0 registered on 1 live nodes")
            cluster.add_node("gpu", slots=2, gpus=(h200,))  # declared: this machine has none
            run = client.wait(run_id, timeout_s=120)
    assert list(run.rank_nodes) == ["gpu"]  # placed on the GPU, with backend nccl and device cuda:0
    assert run.state == node_pb2.RUN_STATE_FAILED
    assert "cuda:0: this machine has no usable CUDA device" in run.error, run.error
