"""hypothesis strategies for actions and whole plans."""

from __future__ import annotations

from hypothesis import strategies as st

from octopipe.ir import Action, ActionKind, action_to_proto
from octopipe.plan.v1 import plan_pb2

SIMPLE_KINDS = [k for k in ActionKind if k is not ActionKind.OVERLAP_F_B]
small = st.integers(min_value=0, max_value=40)


@st.composite
def simple_actions(draw: st.DrawFn, stage: int | None = None, microbatches: int = 41) -> Action:
    kind = draw(st.sampled_from(SIMPLE_KINDS))
    s = stage if stage is not None else draw(small)
    mb = draw(st.integers(0, microbatches - 1)) if kind.has_microbatch else None
    return Action(kind, s, mb)


@st.composite
def actions(draw: st.DrawFn) -> Action:
    if draw(st.booleans()):
        return draw(simple_actions())
    forward = Action(ActionKind.FORWARD, draw(small), draw(small))
    backward = Action(
        draw(st.sampled_from([ActionKind.FULL_BACKWARD, ActionKind.BACKWARD_INPUT])), draw(small), draw(small)
    )
    return Action(ActionKind.OVERLAP_F_B, sub_actions=(forward, backward))


text = st.text(st.characters(codec="utf-8"), max_size=12)


@st.composite
def plans(draw: st.DrawFn) -> plan_pb2.Plan:
    """Valid plans with every field exercised: arbitrary names, optional fields set or not."""
    num_ranks = draw(st.integers(1, 4))
    num_stages = draw(st.integers(num_ranks, 2 * num_ranks))
    microbatches = draw(st.integers(1, 6))
    placement = [draw(st.integers(0, num_ranks - 1)) for _ in range(num_stages)]
    plan = plan_pb2.Plan(name=draw(text), version=draw(st.integers(0, 2**64 - 1)), num_microbatches=microbatches)
    if draw(st.booleans()):
        plan.model.name = draw(text)
        plan.model.source = draw(text)
        for key, value in draw(st.dictionaries(text, text, max_size=3)).items():
            plan.model.config[key] = value
    for key, value in draw(st.dictionaries(text, text, max_size=3)).items():
        plan.labels[key] = value
    if draw(st.booleans()):  # a mesh: dp, ep, tp, cp as stored (0 reads as 1), sp, maybe an explicit rank map
        dp = draw(st.integers(0, 4))
        ep = draw(st.sampled_from([0] + [e for e in range(1, 5) if (dp or 1) % e == 0]))
        tp, cp = draw(st.integers(0, 2)), draw(st.integers(0, 2))
        plan.mesh.SetInParent()
        plan.mesh.dp, plan.mesh.ep, plan.mesh.tp, plan.mesh.cp = dp, ep, tp, cp
        plan.mesh.sequence_parallel = tp > 1 and draw(st.booleans())
        if draw(st.booleans()):
            size = num_ranks * (dp or 1) * (tp or 1) * (cp or 1)
            plan.mesh.global_ranks.extend(draw(st.permutations(range(size))))
    layer_names = draw(st.lists(text, unique=True, max_size=3 * num_stages))
    for s, rank in enumerate(placement):
        plan.stages.add(stage_index=s, rank=rank, layer_names=layer_names[s::num_stages])
    for rank in range(num_ranks):
        program = plan.ranks.add(rank=rank)
        if draw(st.booleans()):
            program.memory_cap_bytes = draw(st.integers(0, 2**64 - 1))
        mine = [s for s, r in enumerate(placement) if r == rank]
        if not mine:
            continue
        for _ in range(draw(st.integers(0, 8))):
            if len(mine) > 0 and draw(st.integers(0, 4)) == 0:
                f = Action(ActionKind.FORWARD, draw(st.sampled_from(mine)), draw(st.integers(0, microbatches - 1)))
                b = Action(
                    ActionKind.FULL_BACKWARD, draw(st.sampled_from(mine)), draw(st.integers(0, microbatches - 1))
                )
                action = Action(ActionKind.OVERLAP_F_B, sub_actions=(f, b))
            else:
                action = draw(simple_actions(stage=draw(st.sampled_from(mine)), microbatches=microbatches))
            program.actions.append(action_to_proto(action))
    return plan
