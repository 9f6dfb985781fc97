"""A parallelized module under a pipeline: the forward runs the whole schedule.

A pipeline interleaves the microbatches' forwards and backwards across the pp
ranks, so it cannot wait for the user's `loss.backward()`. `PipelineLoss.loss`
runs the plan's schedule (`runtime/pipeline.PipelineRunner`: every microbatch's
forward and backward) on aliases of the weights, and returns the full loss (the
last chunk's sum of microbatch losses, summed over pp and the loss's pending
axes) through `_PrecomputedGrads`, an autograd function of the weights whose
backward hands autograd the gradients the schedule computed, times the gradient
that reaches the loss. For a scalar loss that is the chain rule exactly, so
`loss.backward()`, `(loss / k).backward()` for accumulation, and anything else
the user does to the loss get the same gradients as on one device; autograd then
accumulates them and the parameters' hooks sum them over dp (`GradSync`).
Without grad (`torch.no_grad()`), the forward runs the chunks alone
(`PipelineRunner.forward_only`).

A rank holds only its chunks' parameters (`mine`; a tied parameter used on several
pp ranks has a copy on each, their gradients summed by the runner). `share` completes
a gather of full tensors (state dicts, gradients) across pp: each pp rank broadcasts
those it is the first to hold.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist
from torch import Tensor

from fivedc.ir.graph import Param
from fivedc.ir.mesh import MeshAxis
from fivedc.plan.execution_plan import ExecutionPlan
from fivedc.runtime.pipeline import PipelineRunner
from fivedc.runtime.moe import register_params
from fivedc.runtime.train import DTYPES, loss_axes_of
from fivedc.passes.chunk_params import chunk_param_names


class PipelineLoss:
    def __init__(self, program, plan: ExecutionPlan, device: torch.device) -> None:
        self.program, self.plan, self.ctx = program, plan, program.ctx
        self.dtype = DTYPES[plan.dtype]
        self.runner = PipelineRunner(program, plan.pipeline, dtype=self.dtype, device=device)
        self.pp_rank = self.ctx.coords[MeshAxis.PP]
        self.owners: dict[str, int] = {}  # the first pp rank holding each (a tied one has copies on several)
        for r in reversed(range(plan.mesh.size(MeshAxis.PP))):
            self.owners.update((name, r) for name in chunk_param_names(plan.graph, plan.pipeline, pp_rank=r))
        self.mine = chunk_param_names(plan.graph, plan.pipeline, pp_rank=self.pp_rank)
        self.loss_group = self.ctx.group(loss_axes_of(plan.graph, plan.mesh))

    def loss(self, view: dict[str, Tensor], inputs: dict[str, Tensor]) -> Tensor:
        """The full loss; with grad enabled, the schedule's gradients wait in its backward."""
        if not torch.is_grad_enabled():
            register_params(self.ctx, view)
            return self._full(self.runner.forward_only(view, inputs))
        alias = {n: t.detach().requires_grad_(t.requires_grad) for n, t in view.items()}
        register_params(self.ctx, alias)  # MoE layers name their state by their router
        local = self.runner.step(alias, inputs)  # every microbatch's forward and backward
        weights = [n for n in sorted(view) if view[n].requires_grad]
        grads = [alias[n].grad if alias[n].grad is not None else torch.zeros_like(view[n]) for n in weights]
        return _PrecomputedGrads.apply(self._full(local), grads, *(view[n] for n in weights))

    def _full(self, local: Tensor) -> Tensor:
        full = local.detach().to(self.dtype).clone()
        if self.loss_group is not None:
            dist.all_reduce(full, group=self.loss_group)
        return full

    def share(self, held: dict[str, Tensor], specs: dict[str, Param]) -> dict[str, Tensor]:
        """Full tensors of every parameter on every rank, from those this rank's pp stage holds
        (one broadcast per pp rank of its parameters, as one flat buffer)."""
        graph, mesh, out = self.plan.graph, self.plan.mesh, dict(held)
        group = self.ctx.group((MeshAxis.PP,))
        dtype = next(iter(held.values())).dtype if held else self.dtype
        device = self.runner.device
        for r in range(mesh.size(MeshAxis.PP)):
            names = sorted(n for n, owner in self.owners.items() if owner == r)
            shapes = [tuple(graph.dim(d) for d in specs[n].dims) for n in names]
            sizes = [math.prod(shape) for shape in shapes]
            if r == self.pp_rank and names:
                flat = torch.cat([held[n].reshape(-1).to(device, dtype) for n in names])
            else:
                flat = torch.empty(sum(sizes), dtype=dtype, device=device)
            dist.broadcast(flat, src=mesh.rank_of({**self.ctx.coords, MeshAxis.PP: r}), group=group)
            out.update((n, part.view(shape).cpu()) for n, part, shape in zip(names, flat.split(sizes), shapes))
        return out


class _PrecomputedGrads(torch.autograd.Function):
    """`loss` as a function of `weights` whose gradients are already known (`grads`):
    backward scales them by the incoming gradient of the scalar loss."""

    @staticmethod
    def forward(fctx, loss: Tensor, grads: list[Tensor], *weights: Tensor) -> Tensor:
        fctx.grads = grads
        return loss.clone()

    @staticmethod
    def backward(fctx, grad: Tensor):
        return (None, None, *(g * grad.to(g.dtype) for g in fctx.grads))
