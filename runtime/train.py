"""A few training steps with a plan: forward, backward, gradient sync, AdamW.

The same loop serves the single-device reference (no groups) and every rank of a
parallel run. After backward, each parameter's gradient is all-reduced over the
axes the plan lists for it (`Param.grad_partial`). AdamW is elementwise, so each
rank updating only its shards computes exactly the slices of the full update. The
loss reported is the full loss: the local value summed over its pending axes.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import Tensor

from fivedc.ir import Graph, Op, walk_ops
from fivedc.runtime.program import Program, qualified_params

DTYPES = {"fp64": torch.float64, "fp32": torch.float32, "bf16": torch.bfloat16}


@dataclass(frozen=True)
class TrainSettings:
    steps: int = 2
    lr: float = 1e-2
    weight_decay: float = 0.1
    seed: int = 0
    dtype: str = "fp64"

    @property
    def torch_dtype(self) -> torch.dtype:
        return DTYPES[self.dtype]


@dataclass
class TrainRecord:
    losses: list[float] = field(default_factory=list)
    grads: list[dict[str, Tensor]] = field(default_factory=list)  # per step, after sync
    params: dict[str, Tensor] = field(default_factory=dict)  # after the last step


def loss_partial_axes(graph: Graph) -> tuple:
    for node, _ in walk_ops(graph.body):
        if isinstance(node, Op) and node.out == graph.output:
            return node.sharding.partial
    return ()


def train(program: Program, params: dict[str, Tensor], inputs: dict[str, Tensor], settings: TrainSettings) -> TrainRecord:
    """Train `settings.steps` steps in place on `params` (leaf tensors) and record them."""
    graph, ctx = program.graph, program.ctx
    for tensor in params.values():
        tensor.requires_grad_(True)
    optimizer = torch.optim.AdamW(
        list(params.values()), lr=settings.lr, weight_decay=settings.weight_decay, foreach=False
    )
    sync = [(name, p.grad_partial) for name, p in qualified_params(graph) if p.grad_partial]
    loss_axes = loss_partial_axes(graph)
    record = TrainRecord()
    for _ in range(settings.steps):
        optimizer.zero_grad(set_to_none=True)
        loss = program.loss(params, inputs)
        loss.backward()
        for name, axes in sync:
            group = ctx.group(axes)
            if group is not None:
                dist.all_reduce(params[name].grad, group=group)
        full_loss = loss.detach().clone()
        if loss_axes and ctx.group(loss_axes) is not None:
            dist.all_reduce(full_loss, group=ctx.group(loss_axes))
        record.losses.append(full_loss.item())
        record.grads.append({n: p.grad.detach().clone() for n, p in params.items()})
        optimizer.step()
    record.params = {n: p.detach().clone() for n, p in params.items()}
    return record
