"""A few training steps with a plan: forward, backward, gradient sync, AdamW.

The same loop serves the single-device reference (no groups) and every rank of a
parallel run. After backward, each parameter's gradient is summed over the axes
the plan lists for it (`Param.grad_partial`), and with ZeRO sharded over them
(`runtime/zero.py`). AdamW is elementwise, so each rank updating only its shards
(or its ZeRO chunk) computes exactly the slices of the full update. The loss
reported is the full loss: the local value summed over its pending axes.
"""

from __future__ import annotations

import contextlib
import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import Tensor

from fivedc.errors import FivedcError, PassError
from fivedc.ir.graph import Graph, Op, walk_ops, walk_params
from fivedc.ir.mesh import MeshAxis
from fivedc.runtime.program import Program, grad_groups
from fivedc.passes.overlap import Bucket
from fivedc.passes.overlap import expand_units
from fivedc.runtime.moe import ExpertLoad, discard_counts, end_step, register_gathered, register_params
from fivedc.runtime.pipeline import PipelineRunner
from fivedc.runtime.saved import LiveMeter
from fivedc.runtime.zero import ZeroOptimizer, gathered_params_scope
from fivedc.passes.stages import PipelineSpec

DTYPES = {"fp64": torch.float64, "fp32": torch.float32, "bf16": torch.bfloat16}


def check_trainable(graph: Graph) -> None:
    """A model with no parameter has nothing to train or verify: say so before any step."""
    if next(walk_params(graph.body), None) is None:
        raise FivedcError(f"model {graph.name} has no parameters: there is nothing to train or verify",
                          loc=graph.loc, hint="declare the weights with `param NAME: [dims]`")


@dataclass(frozen=True)
class TrainSettings:
    steps: int = 2
    lr: float = 1e-2
    weight_decay: float = 0.1
    seed: int = 0
    dtype: str = "fp64"
    keep_grads: bool = True  # record every step's gradients (the equivalence checks read them)
    measure: bool = False  # record the peak of what each step keeps for backward (`runtime/saved.LiveMeter`)
    compile: bool = False  # each repeat's layer one torch.compile region (runtime/regions.py)

    @property
    def torch_dtype(self) -> torch.dtype:
        return DTYPES[self.dtype]


@dataclass
class TrainRecord:
    losses: list[float] = field(default_factory=list)
    grads: list[dict[str, Tensor]] = field(default_factory=list)  # per step, after sync
    params: dict[str, Tensor] = field(default_factory=dict)  # after the last step
    held: dict[str, int] = field(default_factory=dict)  # bytes held at rest after the last backward
    expert_load: list[dict[str, ExpertLoad]] = field(default_factory=list)  # per step, MoE layer: this rank's tokens
    seconds: list[float] = field(default_factory=list)  # per step: forward, backward, sync and update
    kept: list[int] = field(default_factory=list)  # per step with `measure`: peak bytes kept for backward


def loss_partial_axes(graph: Graph) -> tuple:
    for node, _ in walk_ops(graph.body):
        if isinstance(node, Op) and node.out == graph.output:
            return node.sharding.partial
    return ()


def loss_axes_of(graph: Graph, mesh) -> tuple:
    """The axes the local loss is summed over: its pending axes, and pp (only the
    last chunk's rank holds a loss; the others hold zero)."""
    axes = loss_partial_axes(graph)
    return tuple(sorted(set(axes) | {MeshAxis.PP})) if mesh.size(MeshAxis.PP) > 1 else axes


class Trainer:
    """One rank's training state for a plan: the optimizer (ZeRO stage, buckets,
    overlap), the pipeline runner, and the axes the local loss is summed over.
    `forward_backward` leaves every gradient summed in `optimizer.grads`; the caller
    steps the optimizer (after clipping, with its learning rate) and calls `end_step`."""

    def __init__(self, program: Program, params: dict[str, Tensor], settings: TrainSettings, *, zero: int = 0,
                 buckets: tuple[Bucket, ...] = (), overlap: bool = True, pipeline: PipelineSpec | None = None) -> None:
        graph, ctx = program.graph, program.ctx
        self.program, self.zero = program, zero
        groups = {name: group for name, group in grad_groups(graph, ctx).items() if name in params}
        self.runner = None
        if pipeline is not None:  # gradients accumulate over microbatches: sum them after the last
            device = next(iter(params.values())).device
            self.runner = PipelineRunner(program, pipeline, dtype=settings.torch_dtype, device=device)
            overlap = False
        expanded = [(b, unit) for b, unit in expand_units(buckets) if any(n in params for n in b)]
        local_buckets = [b for b, _ in expanded]
        if any(n not in params for b in local_buckets for n in b):  # its other gradients would go unsummed
            raise PassError("a gradient bucket of the plan spans pipeline stages: "
                            + ", ".join(next(b for b in local_buckets if any(n not in params for n in b))))
        self.optimizer = ZeroOptimizer(params, groups, stage=zero, lr=settings.lr, weight_decay=settings.weight_decay,
                                       buckets=local_buckets, overlap=overlap, keep_gathered=self.runner is not None,
                                       units=[unit for _, unit in expanded])
        self.loss_axes = loss_axes_of(graph, ctx.mesh)
        register_params(ctx, self.optimizer.params)  # MoE layers name their per-layer state by their router
        if zero == 3:  # ... also when it is a gathered copy
            register_gathered(ctx, self.optimizer.sharded.name_of)
        self.measure, self.kept = settings.measure, 0

    def forward_backward(self, inputs: dict[str, Tensor]) -> float:
        """Forward and backward of one step on these inputs (this rank's shards); the
        gradients summed over their groups; the full loss. With `measure`, `kept` is the
        step's peak of bytes kept for backward (`runtime/saved.LiveMeter`)."""
        optimizer, runner = self.optimizer, self.runner
        meter = LiveMeter() if self.measure else None
        with gathered_params_scope(0 if optimizer.keep_gathered else self.zero):
            view = optimizer.view()
            if meter is not None:  # parameters and inputs are not activations
                meter.exclude([*optimizer.params.values(), *inputs.values(),
                               *(view.values() if isinstance(view, dict) else ())])
            if runner is not None:
                runner.meter = meter
                loss = runner.step(view, inputs)  # forward and backward of every microbatch
                optimizer.forward_done(view)
            else:
                with meter.forward("step") if meter is not None else contextlib.nullcontext():
                    loss = self.program.loss(view, inputs)
                optimizer.forward_done(view)
                loss.backward()
        self.kept = meter.peak if meter is not None else 0
        optimizer.reduce_gradients()
        if runner is not None:  # DualPipe: the two copies of each chunk add their gradients
            runner.sum_copies(optimizer.grads)
        return self._full(loss)

    def evaluate(self, inputs: dict[str, Tensor]) -> float:
        """The full loss on these inputs, forward only (no gradients, no MoE bookkeeping)."""
        optimizer, ctx = self.optimizer, self.program.ctx
        with torch.no_grad():
            view = optimizer.view()
            if self.runner is not None:
                loss = self.runner.forward_only(view, inputs)
            else:
                loss = self.program.loss(view, inputs)
            optimizer.forward_done(view)
        optimizer.gathered = {}
        discard_counts(ctx)  # evaluation tokens move no balancing bias and count in no load
        return self._full(loss)

    def end_step(self) -> dict[str, ExpertLoad]:
        """After the optimizer step: the MoE bias update; this rank's tokens per expert."""
        return end_step(self.program.ctx)

    def _full(self, loss: Tensor) -> float:
        full_loss = loss.detach().clone()
        group = self.program.ctx.group(self.loss_axes) if self.loss_axes else None
        if group is not None:
            dist.all_reduce(full_loss, group=group)
        return math.nan if full_loss.is_meta else full_loss.item()  # a rehearsal has shapes, no values


def train(program: Program, params: dict[str, Tensor], inputs: dict[str, Tensor], settings: TrainSettings,
          *, zero: int = 0, buckets: tuple[Bucket, ...] = (), overlap: bool = True,
          pipeline: PipelineSpec | None = None, on_step: Callable[[int, float, float], None] | None = None
          ) -> TrainRecord:
    """Train `settings.steps` steps from `params` (this rank's local tensors: with a
    pipeline, only those of its chunks) and record them; `on_step(step, loss, seconds)`
    after each step (progress for the command line)."""
    trainer = Trainer(program, params, settings, zero=zero, buckets=buckets, overlap=overlap, pipeline=pipeline)
    optimizer = trainer.optimizer
    record = TrainRecord()
    for step in range(1, settings.steps + 1):
        start = time.perf_counter()
        if program.tracer is not None:  # verify's diagnosis: every op's value, by step
            program.tracer.step, program.tracer.microbatch = step, 0
        record.losses.append(trainer.forward_backward(inputs))
        if settings.measure:
            record.kept.append(trainer.kept)
        record.held = optimizer.held_bytes()
        if settings.keep_grads:  # for the checks: every step's summed gradients, gathered
            record.grads.append(optimizer.full_grads())
        optimizer.step()
        record.expert_load.append(trainer.end_step())  # tokens per expert; the MoE bias update
        synchronize(params)
        record.seconds.append(time.perf_counter() - start)
        if on_step is not None:
            on_step(len(record.losses), record.losses[-1], record.seconds[-1])
    record.params = optimizer.full_params()
    return record


def synchronize(params: dict[str, Tensor]) -> None:
    """Wait for the device (a step's time is the device's, not the launch's)."""
    first = next(iter(params.values()), None)
    if first is not None and first.is_cuda:
        torch.cuda.synchronize(first.device)
