"""Collective steps over mesh axes, and `redistribute`, their autograd-aware form.

The compiler turns every layout change into a list of `Step`s for the forward pass
and another for the backward pass; `apply_steps` runs a list on one tensor and
`redistribute` wraps a forward/backward pair in an autograd Function (forward [] /
backward [all_reduce tp] is Megatron's "f"). Chunks are always taken in
group-index order (`MeshGroups.index`), steps over a group of one rank are no-ops,
and the input tensor is never modified. Where a process group's rank order
differs from group-index order (`MeshGroups.positions`), chunks are reordered.
gloo gets reduce_scatter as all_reduce + slice; NCCL uses the native op.

A forward all-gather the plan runs in a ring (its `overlaps` names the matmul behind it)
passes its chunks hop by hop while its reader multiplies them (`runtime/tp_ring.py`):
`redistribute(..., ring=)` returns the ring's tensor as it fills.

A backward sum the plan overlaps with weight gradients (`Collective.overlaps`, set by
`passes/communication.py`) runs async: `redistribute(..., put_off=)` starts it
(`start_sum`), computes the weight gradients its readers put off
(`runtime/tp_overlap.py`), then waits.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from fivedc.errors import PassError, ShapeError
from fivedc.ir.mesh import MeshAxis
from fivedc.runtime.groups import MeshGroups

KINDS = ("all_reduce", "all_gather", "reduce_scatter", "slice", "all_to_all")
_NEEDS_DIM = {"all_gather", "reduce_scatter", "slice", "all_to_all"}


@dataclass(frozen=True, slots=True)
class Step:
    """One collective over the group of `axes`; `dim` is a tensor dim (all_to_all: split dim)."""

    kind: str
    axes: tuple[MeshAxis, ...]
    dim: int | None = None
    dim2: int | None = None  # all_to_all only: the dim the received chunks are concatenated on

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise PassError(f"unknown collective step {self.kind!r}", hint=f"one of {', '.join(KINDS)}")
        if self.kind in _NEEDS_DIM and self.dim is None:
            raise PassError(f"step {self.kind} needs a tensor dim")
        if (self.kind == "all_to_all") != (self.dim2 is not None):
            raise PassError(f"step {self.kind}: dim2 is for all_to_all only, and all_to_all needs it")

    def __str__(self) -> str:
        dims = "" if self.dim is None else f"[{self.dim}]"
        if self.dim2 is not None:
            dims = f"[{self.dim}->{self.dim2}]"
        return f"{self.kind}{dims}({','.join(self.axes)})"


def apply_steps(x: Tensor, steps: Sequence[Step], groups: MeshGroups) -> Tensor:
    """Run `steps` in order on `x` (no autograd); always returns a new tensor."""
    out = x
    for step in steps:
        n = groups.size(step.axes)
        if n > 1:
            out = _STEP_FNS[step.kind](out, step, n, groups)
    return out.clone() if out is x else out


def redistribute(
    x: Tensor, forward: Sequence[Step], backward: Sequence[Step], groups: MeshGroups, put_off: Any = None,
    ring: Any = None,
) -> Tensor:
    """`forward` steps on x; `backward` steps on the gradient flowing back into x. With
    `put_off` (a `fivedc.runtime.tp_overlap.PutOff`), the backward's one sum starts async,
    the readers' weight gradients are computed while it runs and given to the weights.
    With `ring` (a `fivedc.runtime.tp_ring.RingGather` of x, started), the forward's one
    all-gather is that ring: the value is its `out`, filled as the hops complete; a
    `RingSum` or `ChunkedSum` has summed x already: the value is its `out` (and a `RingSum`
    whose gradient's gather the plan runs in a ring runs it so in backward)."""
    weights = put_off.weights if put_off is not None else ()
    return _Redistribute.apply(x, tuple(forward), tuple(backward), groups, put_off, ring, *weights)


class _Redistribute(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx: Any, x: Tensor, forward: tuple[Step, ...], backward: tuple[Step, ...], groups: MeshGroups, put_off: Any,
        ring: Any, *weights: Tensor,
    ) -> Tensor:
        ctx.backward_steps, ctx.groups, ctx.put_off = backward, groups, put_off
        ctx.gather_grad = ring if getattr(ring, "grad_step", None) is not None else None  # a sum whose
        return apply_steps(x, forward, groups) if ring is None else ring.out  # gradient's gather runs in a ring

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor | None, ...]:
        if ctx.gather_grad is not None:
            return ctx.gather_grad.gather_grad_of(grad), None, None, None, None, None
        if ctx.put_off is None:
            return apply_steps(grad, ctx.backward_steps, ctx.groups), None, None, None, None, None
        (step,) = ctx.backward_steps
        finish = start_sum(grad, step, ctx.groups)
        weight_grads = ctx.put_off.weight_grads()
        return finish(), None, None, None, None, None, *weight_grads


def start_gather(x: Tensor, step: Step, groups: MeshGroups):
    """Start an all_gather `step` of `x` async; a function that waits for it and returns
    what `apply_steps(x, [step])` returns."""
    n = groups.size(step.axes)
    if n == 1:
        out = x.clone()
        return lambda: out
    local = x.contiguous()
    parts = [torch.empty_like(local) for _ in range(n)]
    work = dist.all_gather(parts, local, group=groups.group(step.axes), async_op=True)

    def finish() -> Tensor:
        work.wait()
        return torch.cat(_to_index_order(parts, groups.positions(step.axes)), dim=step.dim)  # type: ignore[arg-type]
    return finish


def start_sum(x: Tensor, step: Step, groups: MeshGroups):
    """Start `step` (an all_reduce or reduce_scatter) on `x` async; a function that waits for
    it and returns what `apply_steps(x, [step])` returns."""
    n = groups.size(step.axes)
    if n == 1:
        out = x.clone()
        return lambda: out
    group = groups.group(step.axes)
    if step.kind == "reduce_scatter" and _native(x, group):
        chunk_size(x, step, n)
        chunks = x.chunk(n, dim=step.dim)  # type: ignore[arg-type]
        inputs = [chunks[i].contiguous() for i in groups.positions(step.axes)]
        out = torch.empty_like(inputs[0])
        work = dist.reduce_scatter(out, inputs, group=group, async_op=True)
    else:  # gloo's reduce_scatter is n all_reduces (torch >= 2.8) or missing: an all-reduce and a slice
        if step.kind == "reduce_scatter":
            chunk_size(x, step, n)
        elif step.kind != "all_reduce":
            raise PassError(f"{step} cannot run behind weight gradients: only a sum can")
        out = x.clone(memory_format=torch.contiguous_format)  # all_reduce is in place
        work = dist.all_reduce(out, group=group, async_op=True)

    def finish() -> Tensor:
        work.wait()
        return out if step.kind == "all_reduce" or _native(x, group) else _slice(out, step, n, groups)
    return finish


# ---- one function per step kind ---------------------------------------------------
def chunk_size(x: Tensor, step: Step, n: int) -> int:
    """The size of one of n chunks of `x` along `step`'s dim; a clear error where n does not divide it."""
    assert step.dim is not None
    size = x.shape[step.dim]
    if size % n:
        raise ShapeError(
            f"{step}: tensor dim {step.dim} has size {size}, which does not divide by the "
            f"{n} ranks of axes {','.join(step.axes)}",
            hint="pick a mesh whose axis sizes divide this dim, or pad the dim",
        )
    return size // n


def _native(x: Tensor, group: Any) -> bool:
    return x.is_cuda and "nccl" in str(dist.get_backend(group))


def _all_reduce(x: Tensor, step: Step, n: int, groups: MeshGroups) -> Tensor:
    return start_sum(x, step, groups)()


def _all_gather(x: Tensor, step: Step, n: int, groups: MeshGroups) -> Tensor:
    return start_gather(x, step, groups)()


def _slice(x: Tensor, step: Step, n: int, groups: MeshGroups) -> Tensor:
    size = chunk_size(x, step, n)
    part = x.narrow(step.dim, groups.index(step.axes) * size, size)  # type: ignore[arg-type]
    return part.clone(memory_format=torch.contiguous_format)


def _reduce_scatter(x: Tensor, step: Step, n: int, groups: MeshGroups) -> Tensor:
    return start_sum(x, step, groups)()


def _all_to_all(x: Tensor, step: Step, n: int, groups: MeshGroups) -> Tensor:
    chunk_size(x, step, n)
    chunks = x.chunk(n, dim=step.dim)  # type: ignore[arg-type]
    positions = groups.positions(step.axes)
    send = torch.stack([chunks[i] for i in positions])  # row p goes to process-group rank p
    recv = torch.empty_like(send)
    dist.all_to_all_single(recv, send, group=groups.group(step.axes))
    ordered = _to_index_order(list(recv.unbind(0)), positions)
    return torch.cat(ordered, dim=step.dim2)  # type: ignore[arg-type]


def _to_index_order(parts: list[Tensor], positions: tuple[int, ...]) -> list[Tensor]:
    """`parts` come in process-group rank order; put them in group-index order."""
    ordered = list(parts)
    for rank, index in enumerate(positions):
        ordered[index] = parts[rank]
    return ordered


_STEP_FNS = {
    "all_reduce": _all_reduce,
    "all_gather": _all_gather,
    "reduce_scatter": _reduce_scatter,
    "slice": _slice,
    "all_to_all": _all_to_all,
}
