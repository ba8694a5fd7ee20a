"""The B/W split: a stage's backward graph into an input-gradient graph (B) and a weight-gradient graph (W).

A pure function on FX graphs, by dependency analysis:

- B = every node the input gradients depend on. B returns the input
  gradients and, in addition, every B value a W node consumes (the "stash"),
  so nothing is computed twice.
- W = every node the weight gradients depend on, minus B. W takes the stash
  and the saved activations it reads, and returns one entry per parameter.

Running B then W executes exactly the fused backward's nodes, once each, so
the results are bitwise those of the fused backward. A stage without input
gradients (the first stage, whose input is token ids) gets an empty B and a W
that is the whole backward.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from torch import fx

__all__ = ["BWSplit", "split_backward"]


@dataclass(frozen=True, eq=False)
class BWSplit:
    """The two graphs and how to feed them.

    ``backward_input(*[bw_inputs[i] for i in b_inputs]) -> (*input_grads, *stash)``
    with ``num_input_grads`` gradients (one per stage input, None where no
    gradient flows), and
    ``backward_weight(*stash, *[bw_inputs[i] for i in w_inputs]) -> (*param_grads,)``
    where ``bw_inputs`` are the fused backward's inputs (saved tensors, then
    output gradients).
    """

    backward_input: fx.GraphModule
    backward_weight: fx.GraphModule
    b_inputs: tuple[int, ...]
    w_inputs: tuple[int, ...]
    num_input_grads: int
    num_stash: int
    num_param_grads: int


def _ancestors(roots: Iterable[fx.Node]) -> set[fx.Node]:
    seen: set[fx.Node] = set()
    stack = [r for r in roots if isinstance(r, fx.Node)]
    while stack:
        node = stack.pop()
        if node not in seen:
            seen.add(node)
            stack.extend(node.all_input_nodes)
    return seen


def _subgraph(
    source: fx.GraphModule,
    nodes: set[fx.Node],
    inputs: list[fx.Node],
    outputs: list[fx.Node | None],
) -> fx.GraphModule:
    """A graph with placeholders for ``inputs``, the ``nodes`` in source order, returning ``outputs``."""
    graph = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    for node in inputs:
        placeholder = graph.placeholder(node.name)
        placeholder.meta = dict(node.meta)
        env[node] = placeholder
    for node in source.graph.nodes:
        if node in nodes and node not in env and node.op not in ("placeholder", "output"):
            env[node] = graph.node_copy(node, lambda n: env[n])
    graph.output(tuple(env[o] if o is not None else None for o in outputs))
    graph.lint()
    return fx.GraphModule(source, graph)


def split_backward(backward: fx.GraphModule, *, num_params: int, num_inputs: int) -> BWSplit:
    """Split ``backward`` whose outputs are ``(*param_grads, *buffer_grads, *input_grads)``.

    ``num_params`` and ``num_inputs`` say how many leading and trailing outputs
    are parameter and input gradients; those between (buffers) must be None.
    """
    placeholders = [n for n in backward.graph.nodes if n.op == "placeholder"]
    output = next(n for n in reversed(backward.graph.nodes) if n.op == "output")
    grads = list(output.args[0])
    if num_params + num_inputs > len(grads):
        raise ValueError(
            f"the backward returns {len(grads)} values, fewer than {num_params} params + {num_inputs} inputs"
        )
    param_grads = grads[:num_params]
    input_grads = grads[len(grads) - num_inputs :]
    middle = grads[num_params : len(grads) - num_inputs]
    if any(g is not None for g in middle):
        raise ValueError("a buffer received a gradient: buffers must not require grad")

    b_nodes = _ancestors(g for g in input_grads if g is not None)
    w_nodes = _ancestors(g for g in param_grads if g is not None) - b_nodes
    stash = [
        n for n in backward.graph.nodes if n in b_nodes and n.op != "placeholder" and any(u in w_nodes for u in n.users)
    ]
    # parameter gradients computed in B (or passed straight through) travel in the stash too
    for g in param_grads:
        if g is not None and g in b_nodes and g.op != "placeholder" and g not in stash:
            stash.append(g)
    b_in = [p for p in placeholders if p in b_nodes]
    w_in = [p for p in placeholders if (p in w_nodes or p in param_grads) and p not in stash]
    w_in += [p for p in placeholders if any(u in w_nodes for u in p.users) and p not in w_in]
    w_in = sorted(set(w_in), key=placeholders.index)

    b_graph = _subgraph(backward, b_nodes, b_in, [*input_grads, *stash])
    w_graph = _subgraph(backward, w_nodes | set(stash) | set(w_in), [*stash, *w_in], list(param_grads))
    index = {p: i for i, p in enumerate(placeholders)}
    return BWSplit(
        backward_input=b_graph,
        backward_weight=w_graph,
        b_inputs=tuple(index[p] for p in b_in),
        w_inputs=tuple(index[p] for p in w_in),
        num_input_grads=num_inputs,
        num_stash=len(stash),
        num_param_grads=num_params,
    )
