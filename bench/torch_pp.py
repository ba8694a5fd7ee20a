"""The baseline every speed figure is measured against: torch.distributed.pipelining on the same model.

``run_torch`` launches 2 gloo ranks on 127.0.0.1 that run torch's schedule
class ``name`` with its own runtime (``PipelineStage`` on octopipe's stage
modules, equal layer counts, the model's own loss) and return each step's time
(slowest rank) and where each rank ran. Every launch is set up as octopipe's
ranks are: each rank pinned to its own core from the machine's online CPUs, one
thread, and the same host allocator policy (``transform.host_memory``; ``reuse``
unless told ``system``, which is how torch runs when a user starts it), so that
a difference is the runtime's and not the C library's. A barrier before every
step, the optimizer outside the timed region.

``compile_blocks``: every layer module compiled in place (``module.compile()``),
as torchtitan runs torch's schedules; torch's zero-bubble schedules cannot run
such blocks (their split backward fails at the first input-gradient action),
which the caller records.

``checkpoint``: torch's own activation checkpointing on every decoder layer
(``torch.utils.checkpoint``, non-reentrant, as torchtitan's full AC wraps each
block): the embedding and the head save their activations.
"""

from __future__ import annotations

import dataclasses
import datetime
import functools
import json
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.distributed.pipelining import PipelineStage, schedules
from torch.utils.checkpoint import checkpoint

from octopipe.capture import StageModule, pipeline_spec
from octopipe.execute.processes import free_port
from octopipe.execute.runtime.interop import torch_placement
from octopipe.execute.runtime.models import build_model
from octopipe.execute.runtime.pinning import pin_rank
from octopipe.plan.v1 import plan_pb2
from octopipe.transform import configure_host_memory
from octopipe.tune import equal_partition

__all__ = ["SCHEDULES", "run_torch"]

#: torch's schedule classes that run on 2 ranks with one or two stages each
SCHEDULES = ["ScheduleGPipe", "Schedule1F1B", "ScheduleInterleaved1F1B", "ScheduleZBVZeroBubble", "ScheduleDualPipeV"]


def _worker(rank: int, port: int, name: str, reference: bytes, m: int, steps: int, options: dict[str, Any]) -> None:
    cores, _ = pin_rank(rank)  # the machine's online CPUs, never the mask this process inherited
    torch.set_num_threads(1)
    memory = configure_host_memory(options["host_memory"])
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2, timeout=datetime.timedelta(seconds=900)
    )
    built = build_model(plan_pb2.ModelReference.FromString(reference))
    model = built.model
    spec = pipeline_spec(model)
    placement = torch_placement(name, 2)
    parts = equal_partition(spec.names, len(placement))
    by_name = {layer.name: layer for layer in spec.layers}
    if options.get("checkpoint"):
        by_name = {
            n: dataclasses.replace(layer, run=functools.partial(_checkpointed, layer.run)) if n.startswith("layers.")
            else layer
            for n, layer in by_name.items()
        }  # fmt: skip
    mine = sorted(s for s, r in placement.items() if r == rank)
    if options["compile_blocks"]:  # each layer's modules compiled in place, as torchtitan compiles blocks
        for path in sorted({path for s in mine for layer in parts[s] for path in by_name[layer].modules}):
            model.get_submodule(path).compile()
    stages = [
        PipelineStage(
            StageModule(model, [by_name[n] for n in parts[s]], stage_index=s, num_stages=len(placement), loss=None),
            s,
            len(placement),
            torch.device("cpu"),
        )
        for s in mine
    ]
    cls: Any = getattr(schedules, name)
    multi = issubclass(cls, schedules.PipelineScheduleMulti)
    schedule = cls(stages if multi else stages[0], m, loss_fn=model.pipeline_loss)
    optimizer = torch.optim.AdamW([p for st in stages for p in st.submod.parameters()], lr=1e-3, foreach=False)
    times = []
    holds_first, holds_last = 0 in mine, len(placement) - 1 in mine
    for step in range(steps):
        tokens, targets = built.batch(step)
        dist.barrier()
        start = time.perf_counter_ns()
        schedule.step(*((tokens,) if holds_first else ()), target=targets if holds_last else None)
        times.append((time.perf_counter_ns() - start) / 1e3)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    record = {"times": times, "cores": cores, "host_memory": memory.as_json()}
    Path(options["out"], f"rank{rank}.json").write_text(json.dumps(record))
    dist.destroy_process_group()


def _checkpointed(run: Any, root: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    out: torch.Tensor = checkpoint(run, root, x, use_reentrant=False)
    return out


def run_torch(
    name: str,
    reference: plan_pb2.ModelReference,
    m: int,
    steps: int,
    *,
    compile_blocks: bool = False,
    host_memory: str = "reuse",
    checkpoint_layers: bool = False,
) -> tuple[list[float], dict[int, list[int]]]:
    """torch's ``name`` schedule for ``steps`` steps: each step's time (us, slowest rank), and each rank's cores."""
    with tempfile.TemporaryDirectory() as folder:
        options = {
            "compile_blocks": compile_blocks,
            "host_memory": host_memory,
            "out": folder,
            "checkpoint": checkpoint_layers,
        }
        mp.start_processes(
            _worker,
            args=(free_port(), name, reference.SerializeToString(), m, steps, options),
            nprocs=2,
            start_method="spawn",
        )
        per_rank = [json.loads(Path(folder, f"rank{r}.json").read_text()) for r in range(2)]
    if host_memory == "reuse" and not all(r["host_memory"]["applied"] for r in per_rank):
        raise RuntimeError(f"torch's ranks could not apply the host allocator policy: {per_rank[0]['host_memory']}")
    times = [max(values) for values in zip(*(r["times"] for r in per_rank), strict=True)]
    return times, {r: per_rank[r]["cores"] for r in range(2)}
