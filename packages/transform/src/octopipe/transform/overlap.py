"""OVERLAP_F_B: the runtime's call for F of one micro-batch multiplexed with the backward of another.

:class:`OverlapStage` is what a runtime calls for ``(sF m;tB n)OVERLAP_F_B``:
the forward inputs of one micro-batch and the forward context and output
gradient of another go in; the forward output and context, and the input
gradients and weight context (B) or parameter gradients (fused backward),
come out. Values are bitwise those of ``StageExecutable.forward`` plus
``backward_input`` / ``full_backward`` run one after the other; the graph is
:func:`~octopipe.transform.multiplexing.multiplex`'s, ordered so collectives
overlap the other half's compute.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

import torch

from octopipe.transform.costs import CostModel, roofline_costs
from octopipe.transform.executable import ForwardContext, StageExecutable, WeightContext
from octopipe.transform.multiplexing import Multiplexed, multiplex

__all__ = ["OverlapResult", "OverlapStage"]


@dataclass(eq=False)
class OverlapResult:
    """Both halves' results of one OVERLAP_F_B.

    Forward: ``output`` and ``forward_ctx`` (as ``StageExecutable.forward``).
    Backward: ``input_grads`` and ``weight_ctx`` (B) or ``param_grads`` (fused).
    """

    output: torch.Tensor
    forward_ctx: ForwardContext
    input_grads: list[torch.Tensor | None]
    weight_ctx: WeightContext | None
    param_grads: list[torch.Tensor | None] | None


class OverlapStage:
    """F of one micro-batch on ``forward_stage`` and the backward of another on ``backward_stage``, as one graph.

    ``backward="full"`` multiplexes the fused backward, ``"input"`` the B
    graph (W runs later from ``weight_ctx``). The two stages may be the same
    (1F1B-style steady state) or differ (a V-shape rank holding two stages).
    Every rank of a collective's group must build its OverlapStage from the
    same graphs, so collectives are issued in the same order everywhere.
    ``overlap=False`` keeps F then B in their own orders in the one graph (a
    control for measuring what the reordering buys).
    """

    def __init__(
        self,
        forward_stage: StageExecutable,
        backward_stage: StageExecutable,
        *,
        backward: Literal["full", "input"] = "full",
        costs: CostModel | None = None,
        overlap: bool = True,
        multiplexed: Multiplexed | None = None,
    ) -> None:
        if backward not in ("full", "input"):
            raise ValueError(f"backward must be 'full' or 'input', got {backward!r}")
        self.forward_stage = forward_stage
        self.backward_stage = backward_stage
        self.backward = backward
        graph = backward_stage.graphs.backward if backward == "full" else backward_stage.split.backward_input
        # a graph multiplexed already for these stages' graphs (``StageCompiler.overlap``) is reused
        self.multiplexed: Multiplexed = multiplexed or multiplex(
            forward_stage.graphs.forward, graph, costs=costs or roofline_costs(), overlap=overlap
        )

    def run(self, inputs: Sequence[torch.Tensor], ctx: ForwardContext, output_grad: torch.Tensor) -> OverlapResult:
        """OVERLAP_F_B: forward ``inputs`` of one micro-batch; backward of the micro-batch ``ctx`` belongs to."""
        if ctx.saved is None:
            raise RuntimeError("this micro-batch's backward already ran: its saved activations are gone")
        fw, bw = self.forward_stage, self.backward_stage
        values = [*ctx.saved, output_grad]
        ctx.saved = None
        bw_inputs = values if self.backward == "full" else [values[i] for i in bw.split.b_inputs]
        fw_out, bw_out = self.multiplexed([*fw.params, *fw.buffers, *inputs], bw_inputs)
        outputs = fw.graphs.num_outputs
        forward_ctx = ForwardContext(list(fw_out[outputs:]))  # type: ignore[arg-type]
        output = fw_out[0]
        assert isinstance(output, torch.Tensor)
        if self.backward == "full":
            graphs = bw.graphs
            first_input = graphs.num_params + len(graphs.buffer_names)
            return OverlapResult(
                output=output,
                forward_ctx=forward_ctx,
                input_grads=list(bw_out[first_input:]),  # type: ignore[arg-type]
                weight_ctx=None,
                param_grads=list(bw_out[: graphs.num_params]),  # type: ignore[arg-type]
            )
        split = bw.split
        stash = list(bw_out[split.num_input_grads :])
        weight_ctx = WeightContext([*stash, *[values[i] for i in split.w_inputs]])  # type: ignore[list-item]
        return OverlapResult(
            output=output,
            forward_ctx=forward_ctx,
            input_grads=list(bw_out[: split.num_input_grads]),  # type: ignore[arg-type]
            weight_ctx=weight_ctx,
            param_grads=None,
        )
