"""A stage's recomputation policy: the plan's ``Stage.recompute``, read and written as plain values.

``none`` saves what the backward reads; ``layers`` keeps each layer's input
and recomputes its internals; ``budget`` keeps at most ``activation_budget``
of the saved bytes (min-cut). The names are capture's ``CaptureConfig.recompute``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Final, Literal

from octopipe.ir.plan_error import PlanError
from octopipe.plan.v1 import plan_pb2

__all__ = ["RECOMPUTE_NAMES", "Recompute", "check_recompute", "recompute_of", "with_recompute"]

RecomputeName = Literal["none", "layers", "budget"]
RECOMPUTE_NAMES: Final[tuple[RecomputeName, ...]] = ("none", "layers", "budget")
_BY_POLICY: Final = {
    plan_pb2.RECOMPUTE_POLICY_UNSPECIFIED: "none",
    plan_pb2.RECOMPUTE_POLICY_SAVE_ALL: "none",
    plan_pb2.RECOMPUTE_POLICY_LAYERS: "layers",
    plan_pb2.RECOMPUTE_POLICY_BUDGET: "budget",
}
_BY_NAME: Final = {
    "none": plan_pb2.RECOMPUTE_POLICY_SAVE_ALL,
    "layers": plan_pb2.RECOMPUTE_POLICY_LAYERS,
    "budget": plan_pb2.RECOMPUTE_POLICY_BUDGET,
}


@dataclass(kw_only=True, frozen=True)
class Recompute:
    """One stage's policy; ``activation_budget`` (a fraction in [0, 1]) only for ``budget``."""

    policy: RecomputeName = "none"
    activation_budget: float = 1.0

    def __post_init__(self) -> None:
        if self.policy not in RECOMPUTE_NAMES:
            raise ValueError(f"recompute policy must be one of {', '.join(RECOMPUTE_NAMES)}, got {self.policy!r}")
        if not 0.0 <= self.activation_budget <= 1.0:
            raise ValueError(f"activation_budget is a fraction in [0, 1], got {self.activation_budget}")
        if self.policy != "budget" and self.activation_budget != 1.0:
            raise ValueError("activation_budget applies only to the 'budget' policy")

    @property
    def label(self) -> str:
        """``none``, ``layers`` or ``budget:0.5``."""
        return f"budget:{self.activation_budget:g}" if self.policy == "budget" else self.policy

    @staticmethod
    def parse(text: str) -> Recompute:
        """``none``, ``layers`` or ``budget:F`` (F a fraction in [0, 1])."""
        name, _, fraction = text.strip().partition(":")
        if name == "budget":
            try:
                return Recompute(policy="budget", activation_budget=float(fraction))
            except ValueError as exc:
                raise ValueError(f"recompute {text!r}: write budget:F with F a fraction in [0, 1] ({exc})") from None
        if fraction or name not in RECOMPUTE_NAMES:
            raise ValueError(f"recompute {text!r}: write none, layers or budget:F")
        return Recompute(policy=name)


def check_recompute(stage: plan_pb2.Stage) -> None:
    """Raise PlanError when the stage's recompute field is not a policy this version knows."""
    message = stage.recompute
    if message.policy not in _BY_POLICY:
        raise PlanError(
            f"stage {stage.stage_index}: recompute policy {message.policy} is unknown: use SAVE_ALL, LAYERS or BUDGET"
        )
    budget = message.policy == plan_pb2.RECOMPUTE_POLICY_BUDGET
    if budget and not 0.0 <= message.activation_budget <= 1.0:
        raise PlanError(
            f"stage {stage.stage_index}: recompute activation_budget {message.activation_budget} is not in [0, 1]"
        )
    if not budget and message.activation_budget != 0.0:
        raise PlanError(
            f"stage {stage.stage_index}: recompute activation_budget is set but the policy is not BUDGET: "
            "set the policy to RECOMPUTE_POLICY_BUDGET or clear the budget"
        )


def recompute_of(stage: plan_pb2.Stage) -> Recompute:
    """The stage's policy (absent: ``none``)."""
    check_recompute(stage)
    name = _BY_POLICY[stage.recompute.policy]
    if name == "budget":
        return Recompute(policy="budget", activation_budget=stage.recompute.activation_budget)
    return Recompute(policy=name)  # type: ignore[arg-type]


def with_recompute(plan: plan_pb2.Plan, policies: dict[int, Recompute]) -> plan_pb2.Plan:
    """A copy of ``plan`` with the given stages' policies set (``none`` clears the field)."""
    out = plan_pb2.Plan()
    out.CopyFrom(plan)
    for index, policy in policies.items():
        if not 0 <= index < len(out.stages):
            raise ValueError(f"stage {index} is not in the plan (it has {len(out.stages)} stages)")
        stage = out.stages[index]
        if policy.policy == "none":
            stage.ClearField("recompute")
            continue
        stage.recompute.policy = _BY_NAME[policy.policy]
        stage.recompute.activation_budget = policy.activation_budget if policy.policy == "budget" else 0.0
    return out
