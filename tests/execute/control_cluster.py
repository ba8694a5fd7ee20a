"""Plans for the control-plane tests (the cluster itself is ``octopipe.execute.control.LocalCluster``)."""

from __future__ import annotations

from collections.abc import Callable

from octopipe.execute.runtime import build_model, workload_reference
from octopipe.plan.v1 import plan_pb2
from octopipe.tune import equal_partition, one_f_one_b


def llama_plan(ranks: int = 2, m: int = 4, schedule: Callable[..., plan_pb2.Plan] = one_f_one_b) -> plan_pb2.Plan:
    reference = workload_reference("llama-8", tiny=True, sequence=8, global_batch=2 * m)
    names = build_model(reference).model.pipeline_layers()  # type: ignore[operator]
    plan = schedule(ranks, m, layer_names=equal_partition(names, ranks))
    plan.model.CopyFrom(reference)
    return plan
