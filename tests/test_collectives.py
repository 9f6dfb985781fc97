"""Collective steps, `redistribute` gradients and `MeshGroups` against hand-computed values.

Every rank builds every rank's local tensor deterministically, so it can compute
what each step must give it from `Mesh.group_ranks` alone; the checks run inside
one pool job per mesh and come back as a list of failure messages (empty when
all pass), which keeps the number of multi-process jobs small.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable

import pytest
import torch

from fivedc.errors import ShapeError
from fivedc.ir.mesh import Mesh, MeshAxis
from fivedc.runtime.collectives import Step, apply_steps, redistribute
from fivedc.runtime import groups as groups_module
from fivedc.runtime.groups import MeshGroups
from fivedc.runtime.pool import RankInfo, WorkerPool

SHAPE = (8, 2, 8)  # dims 0 and 2 divide by every group size up to 8
# (mesh, rank order, whether new_group may keep an unsorted order: False tests torch < 2.12)
MESHES = [
    ("dp=2", None, True),
    ("tp=4", None, True),
    ("dp=2,tp=2", None, True),
    ("dp=2,ep=2", "ep,dp,tp,cp,pp", True),
    ("dp=2,tp=2,cp=2", None, True),
    ("dp=2,tp=2,cp=2", "dp,cp,tp,ep,pp", True),
    ("dp=2,tp=2,cp=2", "cp,dp,tp,ep,pp", False),
]


def local(rank: int, dtype: torch.dtype = torch.float64, *, small: bool = False) -> torch.Tensor:
    """Rank `rank`'s input; `small` keeps every sum an integer below 256 (exact in bfloat16)."""
    base = torch.arange(torch.Size(SHAPE).numel()).reshape(SHAPE)
    values = base % 4 + 4 * rank if small else base + 1000 * rank
    return values.to(dtype)


def upstream(rank: int, shape: torch.Size) -> torch.Tensor:
    """A gradient that differs per rank."""
    return torch.arange(shape.numel(), dtype=torch.float64).reshape(shape) * (rank + 1) + 0.5 * rank


def axis_sets(mesh: Mesh) -> list[tuple[MeshAxis, ...]]:
    """Every ordering of every non-empty set of the mesh's split axes, and a size-1 axis."""
    split = [a for a in mesh.rank_order if mesh.size(a) > 1]
    sets = [p for k in range(1, len(split) + 1) for p in itertools.permutations(split, k)]
    return sets + [(MeshAxis.PP,)]


# ---- the expectations -------------------------------------------------------------
def expected(step: Step, mesh: Mesh, rank: int, make: Callable[[int], torch.Tensor]) -> torch.Tensor:
    members = mesh.group_ranks(step.axes, rank)
    n, i = len(members), members.index(rank)
    if step.kind == "all_reduce":
        return sum((make(r) for r in members), torch.zeros_like(make(rank)))
    if step.kind == "all_gather":
        return torch.cat([make(r) for r in members], dim=step.dim)
    if step.kind == "reduce_scatter":
        total = sum((make(r) for r in members), torch.zeros_like(make(rank)))
        return total.chunk(n, dim=step.dim)[i]
    if step.kind == "slice":
        return make(rank).chunk(n, dim=step.dim)[i]
    assert step.kind == "all_to_all"
    return torch.cat([make(r).chunk(n, dim=step.dim)[i] for r in members], dim=step.dim2)


def all_steps(axes: tuple[MeshAxis, ...]) -> list[Step]:
    return [
        Step("all_reduce", axes),
        Step("all_gather", axes, 0),
        Step("all_gather", axes, -1),
        Step("reduce_scatter", axes, 0),
        Step("reduce_scatter", axes, 2),
        Step("slice", axes, 2),
        Step("all_to_all", axes, 0, 2),
        Step("all_to_all", axes, 2, 1),
    ]


# ---- the checks, run on every rank ------------------------------------------------
def check_groups(mesh: Mesh, groups: MeshGroups, rank: int, fail: Callable[[str], None]) -> None:
    import torch.distributed as dist

    reordered: set[tuple[MeshAxis, ...]] = set()
    for axes in axis_sets(mesh):
        members = mesh.group_ranks(axes, rank)
        group = groups.group(axes)
        got = tuple(dist.get_process_group_ranks(group)) if group is not None else (rank,)
        in_index_order = tuple(got[groups.positions(axes).index(i)] for i in range(len(got)))
        if in_index_order != members or groups.index(axes) != members.index(rank):
            fail(f"group {axes}: ranks {got} index {groups.index(axes)}, expected {members}")
        if groups_module.KEEPS_ORDER and got != members:
            fail(f"group {axes}: process-group order {got} is not {members}")
        if not groups_module.KEEPS_ORDER and got != members:
            reordered.add(axes)
        if groups.size(axes) != len(members):
            fail(f"group {axes}: size {groups.size(axes)}")
    if not groups_module.KEEPS_ORDER and not reordered:
        fail("no group was created sorted, so the reordering in the collectives went untested")
    if groups.group(()) is not None or groups.group((MeshAxis.PP,)) is not None:
        fail("groups of one rank must be None")


def check_steps(mesh: Mesh, groups: MeshGroups, rank: int, fail: Callable[[str], None]) -> None:
    """float64 over every axis set; the other dtypes over the largest composite group."""
    largest = axis_sets(mesh)[-2]
    cases = [(axes, torch.float64) for axes in axis_sets(mesh)]
    cases += [(largest, dtype) for dtype in (torch.int64, torch.float32, torch.bfloat16)]
    for axes, dtype in cases:
        small = dtype in (torch.float32, torch.bfloat16)
        x = local(rank, dtype, small=small)
        before = x.clone()
        for step in all_steps(axes):
            got = apply_steps(x, [step], groups)
            want = expected(step, mesh, rank, lambda r: local(r, dtype, small=small))
            if got is x or got.dtype != dtype or not torch.equal(got, want):
                fail(f"{step} {dtype}: got {got.flatten()[:6]}..., want {want.flatten()[:6]}...")
        if not torch.equal(x, before):
            fail(f"steps over {axes} modified their input")


def check_multi_step(mesh: Mesh, groups: MeshGroups, rank: int, fail: Callable[[str], None]) -> None:
    x, replicated = local(rank), local(0)
    for axes in axis_sets(mesh):
        split_join = [Step("slice", axes, 0), Step("all_gather", axes, 0)]
        round_trip = apply_steps(replicated, split_join, groups)
        as_reduce = apply_steps(x, [Step("reduce_scatter", axes, 2), Step("all_gather", axes, 2)], groups)
        if not torch.equal(round_trip, replicated):
            fail(f"slice then all_gather over {axes} is not the identity")
        if not torch.equal(as_reduce, apply_steps(x, [Step("all_reduce", axes)], groups)):
            fail(f"reduce_scatter then all_gather over {axes} is not all_reduce")
    try:
        apply_steps(torch.zeros(3, 5), [Step("reduce_scatter", axis_sets(mesh)[0], 1)], groups)
        fail("reduce_scatter of an indivisible dim did not raise")
    except ShapeError as err:
        if "does not divide" not in err.message:
            fail(f"unclear ShapeError: {err.message}")


def check_gradients(mesh: Mesh, groups: MeshGroups, rank: int, fail: Callable[[str], None]) -> None:
    for axes in axis_sets(mesh):
        members = mesh.group_ranks(axes, rank)
        n, i = len(members), members.index(rank)
        gather, scatter = Step("all_gather", axes, 0), Step("reduce_scatter", axes, 0)
        cut, join = Step("slice", axes, 2), Step("all_gather", axes, 2)
        cases = [  # forward, backward, expected gradient given every rank's upstream g(r)
            ([gather], [scatter], lambda g: sum(g(r) for r in members).chunk(n, 0)[i]),
            ([Step("all_reduce", axes)], [], lambda g: g(rank)),
            ([], [Step("all_reduce", axes)], lambda g: sum(g(r) for r in members)),
            ([cut], [join], lambda g: torch.cat([g(r) for r in members], 2)),
        ]
        for forward, backward, want_of in cases:
            x = local(rank).requires_grad_(True)
            y = redistribute(x, forward, backward, groups)
            (grad,) = torch.autograd.grad(y, x, upstream(rank, y.shape))
            want = want_of(lambda r: upstream(r, y.shape))
            if not torch.allclose(grad, want, rtol=0, atol=1e-9):
                fail(f"grad of {[str(s) for s in forward]} / {[str(s) for s in backward]} over {axes}")


def collectives_job(info: RankInfo, payload: tuple[str, str | None, bool]) -> list[str]:
    text, order, keeps_order = payload
    mesh = Mesh.parse(text, rank_order=order)
    failures: list[str] = []

    def fail(message: str) -> None:
        failures.append(f"rank {info.rank}: {message}")

    saved = groups_module.KEEPS_ORDER
    groups_module.KEEPS_ORDER = keeps_order and saved
    try:
        groups = MeshGroups(mesh, device_type="cpu", axis_sets=axis_sets(mesh))
        for check in (check_groups, check_steps, check_multi_step, check_gradients):
            check(mesh, groups, info.rank, fail)
    finally:
        groups_module.KEEPS_ORDER = saved
    return failures


@pytest.mark.parametrize(
    ("text", "order", "keeps_order"), MESHES, ids=[f"{t}|{o or 'default'}|{k}" for t, o, k in MESHES]
)
def test_collectives(worker_pool: WorkerPool, text: str, order: str | None, keeps_order: bool) -> None:
    mesh = Mesh.parse(text, rank_order=order)
    failures = worker_pool.run(collectives_job, world=mesh.world, payload=(text, order, keeps_order))
    assert [f for per_rank in failures for f in per_rank] == []


def test_step_validation() -> None:
    from fivedc.errors import PassError

    with pytest.raises(PassError):
        Step("broadcast", (MeshAxis.TP,))
    with pytest.raises(PassError):
        Step("all_gather", (MeshAxis.TP,))
    with pytest.raises(PassError):
        Step("all_to_all", (MeshAxis.TP,), 0)
    assert str(Step("all_to_all", (MeshAxis.DP, MeshAxis.EP), 0, 1)) == "all_to_all[0->1](dp,ep)"
