"""The Plan's device mesh: defaults, rank maps, groups, and refusals."""

from __future__ import annotations

import pytest

from octopipe.ir import MeshSpec, PlanError, mesh_spec
from octopipe.plan.v1 import plan_pb2
from octopipe.tune import one_f_one_b


def _plan(**mesh: object) -> plan_pb2.Plan:
    plan = one_f_one_b(2, 4)
    if mesh:
        plan.mesh.CopyFrom(plan_pb2.Mesh(**mesh))  # type: ignore[arg-type]
    return plan


def test_no_mesh_is_pipeline_only() -> None:
    assert mesh_spec(_plan()) == MeshSpec(pp=2, dp=1, ep=1, global_ranks=(0, 1))


def test_default_rank_map_is_pipeline_outermost() -> None:
    spec = mesh_spec(_plan(dp=2, ep=2))
    assert spec.world_size == 4
    assert spec.dp_group(0) == (0, 1) and spec.dp_group(1) == (2, 3)
    assert spec.replica_ranks(1) == (1, 3)
    assert spec.coords(3) == (1, 1)
    assert spec.ep_group_of(2) == (2, 3)


def test_explicit_rank_map_and_ep_groups() -> None:
    spec = mesh_spec(_plan(dp=4, ep=2, global_ranks=[0, 2, 4, 6, 1, 3, 5, 7]))
    assert spec.dp_group(1) == (1, 3, 5, 7)
    assert spec.ep_groups(1) == ((1, 3), (5, 7))
    assert spec.replica_ranks(2) == (4, 5)
    assert spec.coords(5) == (1, 2)


@pytest.mark.parametrize(
    ("mesh", "message"),
    [
        ({"dp": 4, "ep": 3}, "does not divide"),
        ({"dp": 2, "global_ranks": [0, 1, 2]}, "needs 4"),
        ({"dp": 2, "global_ranks": [0, 1, 1, 3]}, "permutation"),
    ],
)
def test_bad_meshes_are_refused(mesh: dict[str, object], message: str) -> None:
    with pytest.raises(PlanError, match=message):
        mesh_spec(_plan(**mesh))


def test_coordinates_outside_are_refused() -> None:
    spec = mesh_spec(_plan(dp=2))
    with pytest.raises(PlanError, match="outside"):
        spec.global_rank(2, 0)
    with pytest.raises(PlanError, match="not in the mesh"):
        spec.coords(9)


def test_a_mesh_too_large_to_hold_is_refused() -> None:
    with pytest.raises(PlanError, match="at most"):
        mesh_spec(_plan(dp=1 << 30))
