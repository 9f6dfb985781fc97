"""What one rank's step does, by kind of work: the counts a profile's rates divide.

`step_work(plan)` prices the plan's step with `estimate_time` on probe hardware on which
one kind of work costs one second per unit and every other kind (and every link)
nothing, so the step's seconds are that kind's count: matmul FLOPs, attention FLOPs
(counted as the step-time model counts them: causal halved, backward 2.5x), bytes of the
memory-bound ops of forward and backward, bytes of the optimizer's update, ops issued.
Recomputation
and the plan's sharding count as the model counts them, because it is the model that
counts. A calibration divides measured seconds by these (`runtime/calibrate_profile.py`),
so the profile it writes prices exactly what it measured.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from fivedc.errors import FivedcError
from fivedc.estimates.step_time import estimate_time
from fivedc.ir.hardware import Hardware
from fivedc.ir.mesh import MeshAxis
from fivedc.passes.base import DTYPE_BYTES
from fivedc.plan.execution_plan import ExecutionPlan

FREE = 1e30  # a rate so high that its work costs nothing


@dataclass(frozen=True)
class StepWork:
    """One rank's work in one step (no pipeline: one microbatch)."""

    matmul_flops: float
    attention_flops: float
    op_bytes: float  # the memory-bound ops of forward and backward
    optimizer_bytes: float
    op_issues: float  # ops issued, forward and backward (a weight gradient its own)


def step_work(plan: ExecutionPlan) -> StepWork:
    """The counts of `plan`'s step on one rank: a plan without a pipeline (each rank runs
    the whole step, no schedule in between)."""
    if plan.pipeline is not None:
        raise FivedcError(f"the plan pipelines over pp={plan.mesh.size(MeshAxis.PP)}: a calibration times one rank's "
                          "whole step", hint="calibrate on a mesh with pp=1 (e.g. --mesh 1x1x1x1x1)")
    return StepWork(
        matmul_flops=_compute(plan, bf16_flops=1.0, matmul_efficiency=1.0),
        attention_flops=_compute(plan, bf16_flops=1.0, attention_efficiency=1.0),
        op_bytes=_compute(plan, hbm_bytes_per_s=1.0, op_memory_efficiency=1.0),
        optimizer_bytes=_price(plan, _probe(hbm_bytes_per_s=1.0, memory_efficiency=1.0)).optimizer_seconds,
        op_issues=_compute(plan, op_latency_s=1.0))


def matmul_seconds(plan: ExecutionPlan, hw: Hardware) -> float:
    """The model's seconds of `plan`'s matmuls in a step on `hw` (on a profile with tile terms,
    each GEMM by its shape, its memory roofline included): its forward and backward with every
    other kind of work free."""
    probe = _probe(bf16_flops=hw.bf16_flops, matmul_efficiency=hw.matmul_efficiency,
                   hbm_bytes_per_s=hw.hbm_bytes_per_s, memory_efficiency=hw.memory_efficiency)
    return compute_seconds(plan, dataclasses.replace(probe, sm_count=hw.sm_count, matmul_tiles=hw.matmul_tiles))


def attention_seconds(plan: ExecutionPlan, hw: Hardware) -> float:
    """The model's seconds of `plan`'s fused attention in a step on `hw`, each op at its kernel's
    share of the peak (`Hardware.attention_share`: flash, flash2), every other kind of work free."""
    probe = _probe(bf16_flops=hw.bf16_flops, attention_efficiency=hw.attention_efficiency)
    return compute_seconds(plan, dataclasses.replace(probe, flash2_efficiency=hw.flash2_efficiency))


def compute_seconds(plan: ExecutionPlan, hw: Hardware) -> float:
    """The model's forward and backward of `plan`'s step on `hw`."""
    return _price(plan, hw).compute_seconds


def step_seconds(plan: ExecutionPlan, hw: Hardware) -> float:
    """The model's whole step of `plan` on `hw` (a plan priced on another profile than its own)."""
    return _price(plan, hw).step_seconds


def own_work_seconds(plan: ExecutionPlan, hw: Hardware) -> float:
    """What a rank of `plan` spends on its own work in a step on `hw`: the model's step with
    every link free (no collective costs anything), less the schedule's idle share: compute,
    the runtime's copies around the sums, the optimizer."""
    free = dataclasses.replace(hw, nvlink_bytes_per_s=FREE, internode_bytes_per_s=FREE, nvlink_latency_s=0.0,
                               internode_latency_s=0.0)
    t = _price(plan, free)
    return t.step_seconds - t.compute_seconds * t.bubble


def _compute(plan: ExecutionPlan, **rates: float) -> float:
    return compute_seconds(plan, _probe(**rates))


def _price(plan: ExecutionPlan, hw: Hardware):
    return estimate_time(plan.graph, mesh=plan.mesh, dtype=plan.dtype, dtype_bytes=DTYPE_BYTES[plan.dtype],
                         zero=plan.zero, overlap=plan.overlap, buckets=plan.buckets, pipeline=plan.pipeline,
                         recompute=plan.recompute, hardware=hw)


def _probe(**rates: float) -> Hardware:
    """Hardware on which only the named rates are finite."""
    free = dict(bf16_flops=FREE, hbm_bytes_per_s=FREE, matmul_efficiency=FREE, attention_efficiency=FREE,
                memory_efficiency=FREE, op_memory_efficiency=FREE)
    return Hardware("probe", "probe", memory_gib=FREE, reserved_gib=0.0, nvlink_bytes_per_s=FREE,
                    internode_bytes_per_s=FREE, gpus_per_node=1 << 30, link_efficiency=1.0,
                    nvlink_latency_s=0.0, internode_latency_s=0.0, **(free | rates))
