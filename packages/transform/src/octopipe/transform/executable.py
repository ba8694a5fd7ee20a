"""A captured, split stage ready to run: F, B (input grads), W (weight grads), or the fused backward.

The runtime interprets a Plan's actions with these four calls. Saved
activations live in the context objects between the calls and are dropped as
soon as nothing needs them: B releases what only it needed, W the rest.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
from torch import nn

from octopipe.capture import StageGraphs
from octopipe.transform.bw_split import BWSplit, split_backward

__all__ = ["ForwardContext", "StageExecutable", "WeightContext"]


@dataclass(eq=False)
class ForwardContext:
    """What F leaves for the backward of one micro-batch."""

    saved: list[torch.Tensor] | None


@dataclass(eq=False)
class WeightContext:
    """What B leaves for W of one micro-batch."""

    tensors: list[torch.Tensor] | None = field(default=None)


class StageExecutable:
    """Run one stage's graphs on its own parameters."""

    def __init__(
        self, graphs: StageGraphs, split: BWSplit, params: Sequence[torch.Tensor], buffers: Sequence[torch.Tensor]
    ) -> None:
        if len(params) != graphs.num_params or len(buffers) != len(graphs.buffer_names):
            raise ValueError(
                f"expected {graphs.num_params} parameters and {len(graphs.buffer_names)} buffers, got {len(params)} and {len(buffers)}"
            )
        self.graphs = graphs
        self.split = split
        self.params = [p.detach() for p in params]
        self.buffers = [b.detach() for b in buffers]

    @classmethod
    def from_module(cls, stage: nn.Module, graphs: StageGraphs) -> StageExecutable:
        """Bind ``graphs`` to ``stage``'s current parameters and buffers (shared storage)."""
        named_params = dict(stage.named_parameters())
        named_buffers = dict(stage.named_buffers())
        split = split_backward(graphs.backward, num_params=graphs.num_params, num_inputs=graphs.num_inputs)
        return cls(
            graphs,
            split,
            [named_params[n] for n in graphs.param_names],
            [named_buffers[n] for n in graphs.buffer_names],
        )

    def forward(self, inputs: Sequence[torch.Tensor]) -> tuple[torch.Tensor, ForwardContext]:
        """F: the stage output (activation, or loss on the last stage) and the context for backward."""
        with torch.no_grad():
            outputs, saved = self.graphs.run_forward(self.params, self.buffers, list(inputs))
        return outputs[0], ForwardContext(saved)

    def forward_all(self, inputs: Sequence[torch.Tensor]) -> tuple[list[torch.Tensor], ForwardContext]:
        """F for a stage with several boundary outputs (hidden states, router logits, ...): all of them."""
        with torch.no_grad():
            outputs, saved = self.graphs.run_forward(self.params, self.buffers, list(inputs))
        return outputs, ForwardContext(saved)

    def _output_grads(self, output_grads: Sequence[torch.Tensor | None]) -> list[torch.Tensor]:
        """The gradients of the outputs that carry one (``graphs.output_requires_grad``), in order."""
        flags = self.graphs.output_requires_grad
        if len(output_grads) != len(flags):
            raise ValueError(
                f"expected one gradient (or None) per stage output ({len(flags)}), got {len(output_grads)}"
            )
        grads = []
        for index, (grad, needed) in enumerate(zip(output_grads, flags, strict=True)):
            if needed and grad is None:
                raise ValueError(f"output {index} of the stage carries a gradient: pass it, not None")
            if needed and grad is not None:
                grads.append(grad)
        return grads

    def backward_input_all(
        self, ctx: ForwardContext, output_grads: Sequence[torch.Tensor | None]
    ) -> tuple[list[torch.Tensor | None], WeightContext]:
        """B for a stage with several outputs: one gradient (or None) per output in, one per input out."""
        return self._backward_input(self._bw_inputs(ctx, self._output_grads(output_grads)))

    def full_backward_all(
        self, ctx: ForwardContext, output_grads: Sequence[torch.Tensor | None]
    ) -> tuple[list[torch.Tensor | None], list[torch.Tensor | None]]:
        """B and W fused, for a stage with several outputs: (input grads, parameter grads)."""
        grads = self._output_grads(output_grads)
        values = self._bw_inputs(ctx, grads)
        with torch.no_grad():
            param_grads, input_grads = self.graphs.run_backward(values[: len(values) - len(grads)], grads)
        return input_grads, param_grads

    def _bw_inputs(self, ctx: ForwardContext, output_grads: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        if ctx.saved is None:
            raise RuntimeError("this micro-batch's backward already ran: its saved activations are gone")
        values = [*ctx.saved, *output_grads]
        ctx.saved = None
        return values

    def backward_input(
        self, ctx: ForwardContext, output_grad: torch.Tensor
    ) -> tuple[list[torch.Tensor | None], WeightContext]:
        """B: gradients for the stage inputs; the context W needs."""
        return self._backward_input(self._bw_inputs(ctx, [output_grad]))

    def _backward_input(self, values: list[torch.Tensor]) -> tuple[list[torch.Tensor | None], WeightContext]:
        split = self.split
        with torch.no_grad():
            results = list(split.backward_input(*[values[i] for i in split.b_inputs]))
        input_grads = results[: split.num_input_grads]
        stash = results[split.num_input_grads :]
        return input_grads, WeightContext([*stash, *[values[i] for i in split.w_inputs]])

    def backward_weight(self, ctx: WeightContext) -> list[torch.Tensor | None]:
        """W: one gradient per parameter (None where a parameter gets none)."""
        if ctx.tensors is None:
            raise RuntimeError("this micro-batch's W already ran")
        tensors, ctx.tensors = ctx.tensors, None
        with torch.no_grad():
            return list(self.split.backward_weight(*tensors))

    def full_backward(
        self, ctx: ForwardContext, output_grad: torch.Tensor
    ) -> tuple[list[torch.Tensor | None], list[torch.Tensor | None]]:
        """B and W fused in one graph: (input grads, parameter grads)."""
        values = self._bw_inputs(ctx, [output_grad])
        with torch.no_grad():
            param_grads, input_grads = self.graphs.run_backward(values[:-1], values[-1:])
        return input_grads, param_grads
