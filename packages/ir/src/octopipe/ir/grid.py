"""A rank x step grid of a plan, for people: where each rank is at each step."""

from __future__ import annotations

from octopipe.ir.plan import rank_actions
from octopipe.plan.v1 import plan_pb2

__all__ = ["format_grid"]


def format_grid(
    plan: plan_pb2.Plan,
    *,
    focus: tuple[int, int] | None = None,
    context: int = 6,
    compute_only: bool = False,
) -> str:
    """Rows are ranks, columns program steps.

    With ``focus=(rank, step)`` only ``context`` steps either side are shown and
    the focused cell is marked with ``>`` and ``<``.
    """
    programs = rank_actions(plan)
    cells = {
        rank: [str(a) for a in actions if not compute_only or a.kind.is_compute] for rank, actions in programs.items()
    }
    length = max((len(c) for c in cells.values()), default=0)
    first, last = 0, length
    if focus is not None:
        first, last = max(0, focus[1] - context), min(length, focus[1] + context + 1)
    width = max([len(c) + 2 for row in cells.values() for c in row] + [len(str(last)) + 2, 4])
    header = "rank".ljust(6) + "".join(str(step).center(width) for step in range(first, last))
    lines = [header]
    for rank in sorted(cells):
        row = cells[rank]
        texts = []
        for step in range(first, last):
            text = row[step] if step < len(row) else "."
            if focus == (rank, step):
                text = f">{text}<"
            texts.append(text.center(width))
        lines.append(str(rank).ljust(6) + "".join(texts).rstrip())
    return "\n".join(lines) + "\n"
