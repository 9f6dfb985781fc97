"""A few training steps with a plan: forward, backward, gradient sync, AdamW.

The same loop serves the single-device reference (no groups) and every rank of a
parallel run. After backward, each parameter's gradient is summed over the axes
the plan lists for it (`Param.grad_partial`), and with ZeRO sharded over them
(`runtime/zero.py`). AdamW is elementwise, so each rank updating only its shards
(or its ZeRO chunk) computes exactly the slices of the full update. The loss
reported is the full loss: the local value summed over its pending axes.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import Tensor

from fivedc.ir import Graph, Op, walk_ops
from fivedc.runtime.program import Program, qualified_params
from fivedc.overlap import Bucket
from fivedc.runtime.buckets import expand_buckets
from fivedc.runtime.zero import ZeroOptimizer, gathered_params_scope

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
    held: dict[str, int] = field(default_factory=dict)  # bytes held at rest after the last backward


def loss_partial_axes(graph: Graph) -> tuple:
    for node, _ in walk_ops(graph.body):
        if isinstance(node, Op) and node.out == graph.output:
            return node.sharding.partial
    return ()


def train(program: Program, params: dict[str, Tensor], inputs: dict[str, Tensor], settings: TrainSettings,
          *, zero: int = 0, buckets: tuple[Bucket, ...] = (), overlap: bool = True) -> TrainRecord:
    """Train `settings.steps` steps from `params` (this rank's local tensors) and record them."""
    graph, ctx = program.graph, program.ctx
    groups = {name: ctx.group(p.grad_partial) if p.grad_partial else None for name, p in qualified_params(graph)}
    optimizer = ZeroOptimizer(params, groups, stage=zero, lr=settings.lr, weight_decay=settings.weight_decay,
                              buckets=expand_buckets(buckets), overlap=overlap)
    loss_axes = loss_partial_axes(graph)
    record = TrainRecord()
    for _ in range(settings.steps):
        with gathered_params_scope(zero):
            view = optimizer.view()
            loss = program.loss(view, inputs)
            optimizer.forward_done(view)
            loss.backward()
        optimizer.reduce_gradients()
        full_loss = loss.detach().clone()
        if loss_axes and ctx.group(loss_axes) is not None:
            dist.all_reduce(full_loss, group=ctx.group(loss_axes))
        record.losses.append(full_loss.item())
        record.held = optimizer.held_bytes()
        record.grads.append(optimizer.full_grads())
        optimizer.step()
    record.params = optimizer.full_params()
    return record
