"""The embedded default job.

Today it exercises what exists: it generates a 1F1B plan for a small example
partition, checks it, round-trips it through every plan format (binary proto,
JSON, text, torch CSV), writes the files and prints the plan. Later issues grow
this into the full capture -> profile -> tune -> simulate -> execute run.
"""

from __future__ import annotations

from pathlib import Path

import structlog
from rich.console import Console
from rich.table import Table

from octopipe.simulate.ir import format_grid, load_plan, plan_to_torch_csv, rank_actions, save_plan
from octopipe.tune import equal_partition, one_f_one_b

__all__ = ["run"]

_LAYERS = ["embed", *[f"layers.{i}" for i in range(8)], "head"]


def run(*, out: Path, ranks: int, microbatches: int) -> int:
    log = structlog.get_logger("octopipe.demo")
    console = Console()
    plan = one_f_one_b(ranks, microbatches, layer_names=equal_partition(_LAYERS, ranks))
    plan.model.name = "llama-8"
    plan.model.source = "octopipe.examples:llama"
    out.mkdir(parents=True, exist_ok=True)
    files = {fmt: out / f"plan{suffix}" for fmt, suffix in (("binary", ".binpb"), ("json", ".json"), ("text", ".txt"))}
    for fmt, path in files.items():
        save_plan(plan, path)
        if load_plan(path) != plan:
            raise AssertionError(f"{fmt} round trip changed the plan")  # internal invariant
    csv_path = out / "plan.csv"
    csv_path.write_text(plan_to_torch_csv(plan))
    log.info("demo_plan_written", out=str(out), ranks=ranks, microbatches=microbatches)

    table = Table(
        title=f"plan {plan.name}: {len(plan.stages)} stages on {len(plan.ranks)} ranks, {plan.num_microbatches} micro-batches"
    )
    table.add_column("stage")
    table.add_column("rank")
    table.add_column("layers")
    table.add_column("actions on its rank")
    programs = rank_actions(plan)
    for stage in plan.stages:
        table.add_row(
            str(stage.stage_index), str(stage.rank), " ".join(stage.layer_names), str(len(programs[stage.rank]))
        )
    console.print(table)
    console.print("compute order per rank (torch.distributed.pipelining action text):")
    console.print(format_grid(plan, compute_only=True), highlight=False, markup=False)
    console.print("written (all round-trip to the same Plan):")
    for path in [*files.values(), csv_path]:
        console.print(f"  {path}  ({path.stat().st_size} bytes)", highlight=False)
    return 0
