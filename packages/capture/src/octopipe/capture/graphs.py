"""A captured stage: its forward and backward FX graphs and how to call them."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import fx

__all__ = ["StageGraphs"]


@dataclass(frozen=True, eq=False)
class StageGraphs:
    """The joint forward+backward of one stage, partitioned into two graphs.

    Calling convention (all tensors, flat):

    - ``forward(*params, *buffers, *inputs) -> (*outputs, *saved)`` with
      ``num_outputs`` outputs (the boundary activation, or the loss on the
      last stage) followed by ``num_saved`` tensors saved for the backward.
    - ``backward(*saved, *output_grads) -> (*param_grads, *buffer_grads, *input_grads)``:
      ``output_grads`` has one entry per output that requires grad (``output_requires_grad``);
      one result per forward input, ``None`` where no gradient flows (buffers,
      token ids, targets).

    ``param_names`` and ``buffer_names`` are the stage's (and the original
    model's) names, in the order the graphs take them.
    """

    forward: fx.GraphModule
    backward: fx.GraphModule
    param_names: tuple[str, ...]
    buffer_names: tuple[str, ...]
    num_inputs: int
    num_outputs: int
    num_saved: int
    input_requires_grad: tuple[bool, ...]
    #: "direct" or "export" (torch.export first, then joint capture)
    route: str
    #: activation-checkpoint regions found (their forward ops are recomputed in the backward)
    recompute_regions: int
    #: dead backward nodes removed, e.g. a recomputed dropout whose result nothing uses
    pruned_nodes: tuple[str, ...]
    #: which outputs carry a gradient; the backward takes one output gradient for each of those, in order
    output_requires_grad: tuple[bool, ...] = (True,)

    @property
    def num_params(self) -> int:
        return len(self.param_names)

    def run_forward(
        self, params: list[torch.Tensor], buffers: list[torch.Tensor], inputs: list[torch.Tensor]
    ) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """Run the forward graph: (outputs, saved tensors)."""
        flat = self.forward(*params, *buffers, *inputs)
        return list(flat[: self.num_outputs]), list(flat[self.num_outputs :])

    def run_backward(
        self, saved: list[torch.Tensor], output_grads: list[torch.Tensor]
    ) -> tuple[list[torch.Tensor | None], list[torch.Tensor | None]]:
        """Run the fused backward graph: (parameter grads, input grads)."""
        grads = list(self.backward(*saved, *output_grads))
        first_input = len(self.param_names) + len(self.buffer_names)
        return grads[: len(self.param_names)], grads[first_input:]
