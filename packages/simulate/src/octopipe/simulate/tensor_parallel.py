"""Tensor and context parallelism inside pipeline stages: one rank's share of a layer, and its traffic.

The mesh (``octopipe.ir.mesh``) puts ``tp`` tensor ranks innermost (consecutive
global ranks, one node's links) and ``cp`` context ranks ``tp`` apart. The
simulator times one (tensor rank, context rank) of one pipeline replica: all of
them run the same program on equal shares. The runtime runs TP as Megatron-LM
does (column-parallel then row-parallel linear layers) and CP as Llama 3 does
(each rank holds s/cp tokens; attention all-gathers the keys and values).

**Which layers split over tp.** ``LayerCost.layer_type`` is a ``+``-joined list
of components (``attention``, ``mamba``, ``mamba2``, ``swiglu``, ``relu2``,
``mlp``, ``moe``, ``embedding``, ``head``, ...). A layer whose components are
all in :data:`TP_SPLIT` (MoE: every expert's hidden units, the router whole,
as the runtime splits them), or whose profile entry sets
``tensor_parallel_all_reduce_bytes``, is split; any other (embedding, head,
unknown kinds) is replicated on the tp ranks: whole compute, whole
parameters, no tensor-parallel traffic.

**One rank's share** of a layer (``split_layer``), with ``q = tp * cp`` for a
split layer and ``q = cp`` for a replicated one:

* F, I, W and B time / q (matmuls, attention's scores: s/cp queries against all
  s keys, the Mamba scan over its heads; norms are taken as negligible);
* parameters, gradients, optimizer state / tp for a split layer (whole when
  replicated); every cp rank holds them whole (cp is data parallelism for the
  weights);
* saved activations ``(R + (A - R) / tp) / cp`` for a split layer (A / cp when
  replicated), R = ``tensor_parallel_replicated_activation_bytes`` or
  ``min(A, 2 k O)``: each of the layer's k split components keeps its norm's
  input and output ([b, s, h], the size O of the layer's output tensors) whole
  on every tp rank; what I frees and keeps for W, and F's and I's scratch, / q;
  W's and B's scratch (mostly fresh gradients) / tp for a split layer;
* boundary tensors and MoE all-to-all bytes / cp (the rank's tokens);
* with cp > 1, F's and I/B's scratch also hold the other ranks' keys and
  values: ``(cp - 1) / cp * KV / tp``.

**Traffic** of one rank for one micro-batch (``layer_traffic``):

* TP, forward: all-reduces of ``V / cp`` bytes in ``c`` collectives,
  V = ``tensor_parallel_all_reduce_bytes`` or ``k O`` (one [b, s, h] output per
  split component), c = ``tensor_parallel_all_reduces`` or one per component
  (two per Mamba mixer: its small x_proj all-reduce, whose bytes only the
  profile field carries, and its out_proj; a MoE's all-reduce of its experts'
  outputs is top-k times O, which only the profile field carries);
* TP, input-gradient backward (I or B): the same again, plus the forward's once
  more when ``backward_recomputes_forward`` (activation checkpointing);
* CP, forward: one all-gather of ``KV / tp`` bytes (the whole gathered tensor)
  per attention component, KV = ``context_parallel_gather_bytes`` or ``2 O``
  (keys and values at the full hidden size: no grouped-query sharing, an upper
  bound); backward: the reduce-scatter of their gradients (same formula), plus
  the all-gather again when recomputing;
* CP, once per step: the stage's gradients all-reduced over the cp group (after
  the REDUCE_GRAD of an FSDP stage: its 1/dp shard).

**Embedding and head by vocabulary** (tp > 1, no sequence parallelism; the
runtime's ``loss_parallel``): ``embedding`` and ``head`` layers are split too
(time / (tp x cp), weights / tp, activations split but the head's input, kept
whole); the embedding all-reduces its output in F; the head all-reduces its
input gradient in I/B (the previous layer's output bytes in the same stage; 0
for a stage's first layer) and three values per token in F (the
cross-entropy's max, sum and target logit).

**Sequence parallelism** (``sequence_parallel``, tp > 1): between layers a
rank holds 1/tp of its tokens, so replicated layers (embedding, head) run on
them too (time, activations / (tp x cp)) and boundary tensors are / (tp x cp);
a split layer keeps only its gathered input whole (one [b, s, h] per component:
its weight gradient reads it), norms hold 1/tp; its all-reduces become an
all-gather in and a reduce-scatter out (the same bytes: a ring all-reduce *is*
a reduce-scatter then an all-gather, so the same time); once per step the
replicated layers' gradients (``replicated_gradient_bytes``, their 1/dp shard)
are all-reduced over the tp group (norm weights inside split layers are left
out: a few KB).

**Times** (ring formulas of ``octopipe.simulate.collectives``, over the group's
link, n ranks, B bytes in c collectives):
``all-reduce: 2 ((n-1)/n B / bw + c (n-1) lat)``;
``all-gather, reduce-scatter: (n-1)/n B / bw + c (n-1) lat``. The TP and CP
collectives of a layer block its computation (they sit between its matmuls):
they add to F, I and B on the compute stream; W has none. An OVERLAP_F_B unit
takes the longer of its compute and its two halves' traffic (each half's under
the other's compute, as for MoE all-to-alls). Nothing here applies at
tp = cp = 1.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace

from octopipe.profile.v1 import profile_pb2
from octopipe.simulate.collectives import all_gather_us, all_reduce_us
from octopipe.simulate.links import Link

__all__ = [
    "ATTENTION",
    "MAMBA",
    "TP_SPLIT",
    "VOCAB_SPLIT",
    "ParallelTraffic",
    "components",
    "gradient_all_reduce_us",
    "layer_traffic",
    "split_layer",
    "split_layers",
    "traffic_us",
]

#: layer_type components whose heads / hidden units the runtime splits over tp
TP_SPLIT = frozenset({"attention", "mamba", "mamba2", "swiglu", "relu2", "mlp", "moe"})
#: layer_type components the runtime splits by vocabulary over tp when there is no sequence parallelism
VOCAB_SPLIT = frozenset({"embedding", "head"})
#: components that gather keys and values over cp
ATTENTION = frozenset({"attention"})
#: components that cannot run with cp > 1 (a scan over the whole sequence in order)
MAMBA = frozenset({"mamba", "mamba2"})


@dataclass(kw_only=True, frozen=True, slots=True)
class ParallelTraffic:
    """One rank's tensor- and context-parallel collectives for one micro-batch of a stage (module doc).

    ``tp_*``: all-reduces over the tp group; ``cp_*``: all-gathers and
    reduce-scatters over the cp group; ``*_bytes`` summed over ``*_count``
    collectives; ``forward`` in each F, ``backward`` in each I or B.
    """

    tp: int = 1
    cp: int = 1
    tp_forward_bytes: int = 0
    tp_forward_count: int = 0
    tp_backward_bytes: int = 0
    tp_backward_count: int = 0
    cp_forward_bytes: int = 0
    cp_forward_count: int = 0
    cp_backward_bytes: int = 0
    cp_backward_count: int = 0
    #: sequence parallelism: the tp collectives are all-gathers and reduce-scatters (the same ring time as
    #: all-reduces of the same bytes), and the replicated layers' gradients are averaged over tp once per step
    sequence_parallel: bool = False
    #: gradient bytes of the layers replicated on the tp ranks (sequence parallelism's per-step all-reduce)
    replicated_gradient_bytes: int = 0

    def __add__(self, other: ParallelTraffic) -> ParallelTraffic:
        mine, theirs = (self.tp, self.cp, self.sequence_parallel), (other.tp, other.cp, other.sequence_parallel)
        if mine != theirs:
            raise ValueError(f"cannot add traffic of (tp, cp, sp) {theirs} to {mine}")
        return ParallelTraffic(
            tp=self.tp,
            cp=self.cp,
            sequence_parallel=self.sequence_parallel,
            replicated_gradient_bytes=self.replicated_gradient_bytes + other.replicated_gradient_bytes,
            tp_forward_bytes=self.tp_forward_bytes + other.tp_forward_bytes,
            tp_forward_count=self.tp_forward_count + other.tp_forward_count,
            tp_backward_bytes=self.tp_backward_bytes + other.tp_backward_bytes,
            tp_backward_count=self.tp_backward_count + other.tp_backward_count,
            cp_forward_bytes=self.cp_forward_bytes + other.cp_forward_bytes,
            cp_forward_count=self.cp_forward_count + other.cp_forward_count,
            cp_backward_bytes=self.cp_backward_bytes + other.cp_backward_bytes,
            cp_backward_count=self.cp_backward_count + other.cp_backward_count,
        )


def components(cost: profile_pb2.LayerCost) -> tuple[str, ...]:
    """The layer's kinds: ``layer_type`` split at ``+``, lower-cased (``attention+swiglu`` -> two)."""
    return tuple(part.strip().lower() for part in cost.layer_type.split("+") if part.strip())


def _is_split(cost: profile_pb2.LayerCost, kinds: tuple[str, ...]) -> bool:
    return cost.HasField("tensor_parallel_all_reduce_bytes") or (bool(kinds) and all(k in TP_SPLIT for k in kinds))


def _vocab_split(kinds: tuple[str, ...], sequence_parallel: bool) -> bool:
    return not sequence_parallel and bool(kinds) and all(k in VOCAB_SPLIT for k in kinds)


def _vocab_traffic(cost: profile_pb2.LayerCost, kinds: tuple[str, ...], cp: int, input_bytes: int) -> tuple[int, ...]:
    """(forward bytes, forward count, backward bytes, backward count) of a vocabulary-split embedding / head:
    the embedding sums its ranks' lookups (one all-reduce of its output, forward); the head's input gradient is
    all-reduced (backward) and its cross-entropy combines a max, a sum and the target's logit per token (three
    all-reduces of one value per token, forward)."""
    forward_bytes = forward_count = backward_bytes = backward_count = 0
    if "embedding" in kinds:
        forward_bytes, forward_count = _ceil(_output_bytes(cost), cp), 1
    if "head" in kinds and cost.output_tensors:
        logits = cost.output_tensors[0]
        values = 1
        for size in logits.shape:
            values *= max(1, size)
        element = logits.size_bytes // values if values else 4
        tokens = values // max(1, logits.shape[-1]) if logits.shape else 0
        forward_bytes, forward_count = forward_bytes + _ceil(3 * tokens * element, cp), forward_count + 3
        backward_bytes, backward_count = _ceil(input_bytes, cp), 1
    return forward_bytes, forward_count, backward_bytes, backward_count


def _output_bytes(cost: profile_pb2.LayerCost) -> int:
    return sum(t.size_bytes for t in cost.output_tensors)


def _ceil(size: int, parts: int) -> int:
    return -(-size // parts)


def _check(tp: int, cp: int) -> None:
    if tp < 1 or cp < 1:
        raise ValueError(f"tp and cp must be >= 1, got tp={tp}, cp={cp}")


def _kv_bytes(cost: profile_pb2.LayerCost, kinds: tuple[str, ...]) -> int:
    if cost.HasField("context_parallel_gather_bytes"):
        return cost.context_parallel_gather_bytes
    return 2 * _output_bytes(cost) * sum(k in ATTENTION for k in kinds)


def layer_traffic(
    cost: profile_pb2.LayerCost, tp: int, cp: int, sequence_parallel: bool = False, input_bytes: int = 0
) -> ParallelTraffic:
    """One rank's TP and CP collectives in one micro-batch of the layer (module doc). ``input_bytes``: the
    layer's input tensor (the previous layer's output), which a vocabulary-split head all-reduces backward."""
    _check(tp, cp)
    sp = sequence_parallel and tp > 1
    kinds = components(cost)
    out = ParallelTraffic(tp=tp, cp=cp, sequence_parallel=sp)
    if tp > 1 and _vocab_split(kinds, sp) and not cost.HasField("tensor_parallel_all_reduce_bytes"):
        f_bytes, f_count, b_bytes, b_count = _vocab_traffic(cost, kinds, cp, input_bytes)
        out = ParallelTraffic(
            tp=tp,
            cp=cp,
            tp_forward_bytes=f_bytes,
            tp_forward_count=f_count,
            tp_backward_bytes=b_bytes,
            tp_backward_count=b_count,
        )
    again = 2 if cost.backward_recomputes_forward else 1  # the backward re-runs the forward's collectives
    if tp > 1 and _is_split(cost, kinds):
        splits = sum(k in TP_SPLIT for k in kinds)
        if cost.HasField("tensor_parallel_all_reduce_bytes"):
            volume = cost.tensor_parallel_all_reduce_bytes
        else:
            volume = splits * _output_bytes(cost)
        count = cost.tensor_parallel_all_reduces or max(1, splits + sum(k in MAMBA for k in kinds))
        share = _ceil(volume, cp)
        out = ParallelTraffic(
            tp=tp,
            cp=cp,
            sequence_parallel=sp,
            tp_forward_bytes=share,
            tp_forward_count=count,
            tp_backward_bytes=share * again,
            tp_backward_count=count * again,
        )
    gathers = sum(k in ATTENTION for k in kinds)
    if cp > 1 and (gathers or cost.HasField("context_parallel_gather_bytes")):
        gathered = _ceil(_kv_bytes(cost, kinds), tp if _is_split(cost, kinds) else 1)
        count = max(1, gathers)
        out = out + ParallelTraffic(
            tp=tp,
            cp=cp,
            sequence_parallel=sp,
            cp_forward_bytes=gathered,
            cp_forward_count=count,
            cp_backward_bytes=gathered * again,
            cp_backward_count=count * again,
        )
    if sp and not _is_split(cost, kinds):  # a replicated layer on 1/tp of the tokens: its gradient is partial
        out = replace(out, replicated_gradient_bytes=cost.gradient_bytes)
    return out


def split_layer(
    cost: profile_pb2.LayerCost, tp: int, cp: int, sequence_parallel: bool = False, input_bytes: int = 0
) -> profile_pb2.LayerCost:
    """The layer as one (tensor rank, context rank) runs it: a LayerCost of that rank's times and bytes
    (module doc). Raises ValueError for cp > 1 on a Mamba layer (its scan needs the whole sequence)."""
    _check(tp, cp)
    kinds = components(cost)
    if cp > 1 and any(k in MAMBA for k in kinds):
        raise ValueError(
            f"layer {cost.layer_name!r} ({cost.layer_type}) is a Mamba layer, whose scan needs the whole sequence: "
            f"mesh cp={cp} cannot split it; use cp=1 for this model"
        )
    sp = sequence_parallel and tp > 1
    vocab = tp > 1 and _vocab_split(kinds, sp)
    split = tp > 1 and (_is_split(cost, kinds) or vocab)
    t = tp if split else 1
    tokens = cp * (tp if sp else 1)  # the slices of the sequence a rank holds between layers
    q = t * cp if split or not sp else tokens  # sp: a replicated layer runs on 1/tp of the tokens too
    out = profile_pb2.LayerCost()
    out.CopyFrom(cost)
    out.forward_duration_us = cost.forward_duration_us / q
    out.backward_input_duration_us = cost.backward_input_duration_us / q
    out.backward_weight_duration_us = cost.backward_weight_duration_us / q
    if cost.HasField("full_backward_duration_us"):
        out.full_backward_duration_us = cost.full_backward_duration_us / q
    saved = cost.activation_saved_bytes
    parts = max(1, sum(k in TP_SPLIT for k in kinds))
    if split:
        if cost.HasField("tensor_parallel_replicated_activation_bytes"):
            whole = min(saved, cost.tensor_parallel_replicated_activation_bytes)
        elif vocab:  # the head keeps its normalised input whole (its projection's weight gradient reads it)
            whole = min(saved, input_bytes if "head" in kinds else 0)
        elif sp:  # each component keeps its gathered input whole (its weight gradient reads it); norms hold 1/tp
            whole = min(saved, parts * _output_bytes(cost))
        else:
            whole = min(saved, 2 * parts * _output_bytes(cost))
        mine = _ceil(whole + _ceil(saved - whole, t), cp)
    else:
        mine = _ceil(saved, tokens)
    out.activation_saved_bytes = mine
    freed_input = cost.activation_freed_by_backward_input_bytes * mine // saved if saved else 0
    out.activation_freed_by_backward_input_bytes = freed_input
    out.activation_freed_by_backward_weight_bytes = mine - freed_input
    out.backward_input_kept_bytes = _ceil(cost.backward_input_kept_bytes, q)
    gathered = 0
    if cp > 1:
        kv = _kv_bytes(cost, kinds)
        gathered = (cp - 1) * _ceil(kv, t) // cp
    out.forward_scratch_bytes = _ceil(cost.forward_scratch_bytes, q) + gathered
    out.backward_input_scratch_bytes = _ceil(cost.backward_input_scratch_bytes, q) + gathered
    out.backward_weight_scratch_bytes = _ceil(cost.backward_weight_scratch_bytes, t)
    out.full_backward_scratch_bytes = _ceil(cost.full_backward_scratch_bytes, t) + (
        gathered if cost.full_backward_scratch_bytes else 0
    )
    if split:
        out.parameter_bytes = _ceil(cost.parameter_bytes, t)
        out.gradient_bytes = _ceil(cost.gradient_bytes, t)
        out.optimizer_state_bytes = _ceil(cost.optimizer_state_bytes, t)
        out.expert_parameter_bytes = min(out.parameter_bytes, _ceil(cost.expert_parameter_bytes, t))
    out.all_to_all_bytes = _ceil(cost.all_to_all_bytes, cp)
    for tensor in out.output_tensors:
        tensor.size_bytes = _ceil(tensor.size_bytes, tokens)
        if len(tensor.shape) >= 2 and tensor.shape[-2] % tokens == 0:
            tensor.shape[-2] //= tokens  # [..., s, h]: the rank's tokens
    return out


def split_layers(
    costs: Sequence[profile_pb2.LayerCost], tp: int, cp: int, sequence_parallel: bool = False
) -> tuple[tuple[profile_pb2.LayerCost, ...], ParallelTraffic]:
    """Every layer's per-rank share (``split_layer``) and the layers' summed traffic (``layer_traffic``)."""
    sp = sequence_parallel and tp > 1
    traffic = ParallelTraffic(tp=tp, cp=cp, sequence_parallel=sp)
    inputs = [0] + [_output_bytes(cost) for cost in costs[:-1]]  # a stage's first input: its boundary, unknown here
    for cost, size in zip(costs, inputs, strict=True):
        traffic = traffic + layer_traffic(cost, tp, cp, sp, size)
    return tuple(split_layer(cost, tp, cp, sp, size) for cost, size in zip(costs, inputs, strict=True)), traffic


def _many(formula: Callable[[Link, int, int], float], link: Link, group: int, size: int, count: int) -> float:
    """``count`` collectives of ``size`` bytes in all: the bandwidth term once, the latency ``count`` times."""
    if count == 0 or group == 1:
        return 0.0
    return formula(link, group, size) + (count - 1) * formula(link, group, 0)


def traffic_us(traffic: ParallelTraffic, tp_link: Link | None, cp_link: Link | None) -> tuple[float, float]:
    """(forward, input-gradient backward) microseconds of ``traffic`` on the tp and cp groups' links."""
    forward = backward = 0.0
    if traffic.tp > 1 and tp_link is not None:
        forward += _many(all_reduce_us, tp_link, traffic.tp, traffic.tp_forward_bytes, traffic.tp_forward_count)
        backward += _many(all_reduce_us, tp_link, traffic.tp, traffic.tp_backward_bytes, traffic.tp_backward_count)
    if traffic.cp > 1 and cp_link is not None:
        forward += _many(all_gather_us, cp_link, traffic.cp, traffic.cp_forward_bytes, traffic.cp_forward_count)
        backward += _many(all_gather_us, cp_link, traffic.cp, traffic.cp_backward_bytes, traffic.cp_backward_count)
    return forward, backward


def gradient_all_reduce_us(link: Link, cp: int, gradient_bytes: int) -> float:
    """The per-step all-reduce of a rank's ``gradient_bytes`` over its cp group: 2 ((n-1)/n B / bw + (n-1) lat)."""
    return all_reduce_us(link, cp, gradient_bytes)
