"""The equivalence harness: a parallel run against the single-device run.

`verify_plan` trains the model on one device from seeded parameters (the
reference), then on `world` local processes with the plan from the same
parameters, and compares, on every rank and for its own shards: the loss of every
step, every parameter's gradient at every step, and the parameters after the last
step. Errors are relative to the largest magnitude of the full reference tensor.

With a `Diagnosis` both runs also trace every op's value and gradient
(`runtime/trace.py`), and the report names the first op that diverges
(`runtime/divergence.py`); its `fault` perturbs one op on one rank, the checker's
self-test.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, replace

import torch

from fivedc.ir.mesh import Mesh, MeshAxis
from fivedc.plan.execution_plan import ExecutionPlan
from fivedc.runtime.compare import check_reference, compare_runs, relative_error
from fivedc.runtime.divergence import Divergence, RankTrace, first_divergence
from fivedc.runtime.fp8 import reference_blocks
from fivedc.runtime.kernel_context import KernelContext
from fivedc.runtime.moe import ExpertLoad
from fivedc.runtime.program import Program, init_params, make_inputs, qualified_params, shard
from fivedc.runtime.trace import Fault, ValueTrace
from fivedc.passes.chunk_params import chunk_param_names
from fivedc.passes.tied import holder_sets
from fivedc.runtime.train import TrainRecord, TrainSettings, loss_axes_of, train


@dataclass(frozen=True)
class VerifyReport:
    world: int
    losses: tuple[float, ...]  # reference loss per step
    parallel_losses: tuple[float, ...]
    loss_error: float
    grad_error: float
    param_error: float
    worst: str  # the tensor with the largest error
    held: tuple[dict[str, int], ...] = ()  # per rank: bytes in params, grads, optimizer state
    expert_load: tuple[dict[str, ExpertLoad], ...] = ()  # per step, MoE layer: tokens per expert, all ranks
    routing_matches: bool = True  # the parallel run routed every token as the single-device run did
    traced: bool = False  # every op's value and gradient was compared too (a `Diagnosis`)
    divergence: Divergence | None = None  # traced: the first op beyond the tolerance
    injected: int = 0  # traced with a fault: how many times it was applied

    @property
    def max_error(self) -> float:
        traced = self.divergence.error if self.divergence is not None else 0.0
        return max(self.loss_error, self.grad_error, self.param_error, traced)


@dataclass(frozen=True)
class Diagnosis:
    """Trace every op's value and gradient and name the first beyond `tol`; `fault`
    perturbs one op on one rank (the checker's self-test)."""

    tol: float
    fault: Fault | None = None


def reference_run(plan: ExecutionPlan, settings: TrainSettings, *, tracer: ValueTrace | None = None,
                  fp8_blocks: int = 1) -> TrainRecord:
    """Train on one device with a plan compiled for a 1x1x1x1x1 mesh; `ReferenceNotFinite`
    when its losses, gradients or parameters are not finite. `tracer` keeps every op's
    value and gradient. `fp8_blocks`: float8 linears scale the batch in that many blocks of
    rows (`fivedc.runtime.fp8.reference_blocks` of the parallel plan)."""
    graph = plan.graph
    ctx = KernelContext(graph, plan.mesh, plan.mesh.coords(0), fp8_blocks=fp8_blocks)
    params = init_params(graph, seed=settings.seed, dtype=settings.torch_dtype)
    inputs = make_inputs(graph, seed=settings.seed, dtype=settings.torch_dtype)
    record = train(Program(graph, ctx, recompute=plan.recompute, tracer=tracer), params, inputs, settings)
    check_reference(record.losses, [*record.grads, record.params], what=graph.name)
    return record


def setup_rank(plan: ExecutionPlan, info, settings: TrainSettings) -> tuple[Program, dict, dict, dict]:
    """This rank's program, its shards of the seeded parameters (only its chunks' with
    a pipeline) and of the inputs, and the parameters' IR records by name."""
    from fivedc.runtime.groups import MeshGroups

    graph, mesh = plan.graph, plan.mesh
    axis_sets = {c.axes for c in plan.collectives} | {p.grad_partial for _, p in qualified_params(graph) if p.grad_partial}
    axis_sets.add(loss_axes_of(graph, mesh))
    groups = MeshGroups(mesh, device_type=info.device.split(":")[0], axis_sets=sorted(a for a in axis_sets if a),
                        pp_subsets=holder_sets(graph, plan.pipeline, mesh.size(MeshAxis.PP)))
    ctx = KernelContext(graph, mesh, mesh.coords(info.rank), groups)
    device, meta = torch.device(info.device), info.device == "meta"
    mine = chunk_param_names(graph, plan.pipeline, pp_rank=ctx.coords[MeshAxis.PP]) if plan.pipeline else None
    full = init_params(graph, seed=settings.seed, dtype=settings.torch_dtype, meta=meta, only=mine)
    named = dict(qualified_params(graph))
    params = {n: shard(t, named[n].dims, named[n].sharding, ctx).to(device) for n, t in full.items()}
    inputs = {
        i.name: shard(t, i.type.dims, i.sharding, ctx).to(device)
        for i, t in zip(graph.inputs, make_inputs(graph, seed=settings.seed, dtype=settings.torch_dtype,
                                                  meta=meta).values())
    }
    return Program(graph, ctx, recompute=plan.recompute, compile=settings.compile), params, inputs, named


def train_plan(plan: ExecutionPlan, program: Program, params: dict, inputs: dict, settings: TrainSettings,
               info=None) -> TrainRecord:
    """`train` with everything the plan decides: ZeRO, buckets, overlap, the pipeline;
    each step reported as progress (`RankInfo.report`: rank 0's reach the parent)."""
    on_step = step_reporter(info, settings.steps) if info is not None else None
    return train(program, params, inputs, settings, zero=plan.zero, buckets=plan.buckets, overlap=plan.overlap,
                 pipeline=plan.pipeline, on_step=on_step)


def step_reporter(info, steps: int):
    """A progress line per step: `step 2/5: loss 4.1589, 312 ms`."""
    return lambda step, loss, seconds: info.report(f"step {step}/{steps}: loss {loss:.6g}, {seconds * 1e3:.0f} ms")


def rank_job(info, payload) -> dict:
    """One rank of a verification run (module-level so the worker pool can pickle it)."""
    plan, reference, settings, diagnosis = payload
    program, params, inputs, named = setup_rank(plan, info, settings)
    ctx = program.ctx
    if diagnosis is not None:
        program.tracer = ValueTrace(info.rank, diagnosis.fault)
    record = train_plan(plan, program, params, inputs, settings, info)
    shard_of = lambda name, full: shard(full, named[name].dims, named[name].sharding, ctx)  # noqa: E731
    errors = compare_runs(record, reference, names=tuple(params), shard_of=shard_of)
    load = record.expert_load if ctx.coords[MeshAxis.TP] == 0 else None  # tp ranks share their tokens
    out = {"errors": errors, "losses": record.losses, "held": record.held, "expert_load": load}
    if program.tracer is not None:
        grad_errors = tuple({name: relative_error(mine[name].cpu(), shard_of(name, ref[name]), ref[name])
                             for name in params if name in mine}
                            for mine, ref in zip(record.grads, reference.grads))
        traced = program.tracer.export()
        out["trace"] = RankTrace(info.rank, traced["values"], traced["grads"], grad_errors)
        out["injected"] = traced["injected"]
    return out


def verify_plan(plan: ExecutionPlan, reference_plan: ExecutionPlan, *, settings: TrainSettings, pool=None,
                timeout_s: float | None = None, on_progress=None, diagnosis: Diagnosis | None = None) -> VerifyReport:
    """Compare `plan` on `plan.mesh.world` processes (a temporary pool unless `pool`,
    its collectives timing out after `timeout_s`) with the single-device reference;
    `on_progress(line)` hears the reference run and each parallel step. With a
    `diagnosis`, every op's value and gradient is compared too."""
    from fivedc.runtime.pool import DEFAULT_TIMEOUT_S, run_once

    report = on_progress or (lambda line: None)
    start = time.perf_counter()
    tracer = ValueTrace(0) if diagnosis is not None else None
    reference = reference_run(reference_plan, settings, tracer=tracer, fp8_blocks=reference_blocks(plan))
    report(f"reference run on one device: {settings.steps} steps in {time.perf_counter() - start:.1f} s")
    payload = (plan, reference, settings, diagnosis)
    world = plan.mesh.world
    report(f"the parallel run on {world} processes" + ("" if pool is not None else " (starting them)"))
    if pool is not None:
        results = pool.run(rank_job, world=world, payload=payload, on_progress=on_progress)
    else:
        results = run_once(rank_job, world=world, payload=payload, timeout_s=timeout_s or DEFAULT_TIMEOUT_S,
                           on_progress=on_progress)
    return merge_results(results, reference, plan=plan, tracer=tracer, diagnosis=diagnosis)


def merge_results(results: list[dict], reference: TrainRecord, *, plan: ExecutionPlan | None = None,
                  tracer: ValueTrace | None = None, diagnosis: Diagnosis | None = None) -> VerifyReport:
    """One report from every rank's `rank_job` result: the worst error of each kind, and
    with a `diagnosis` (and the reference's `tracer`) the first divergent op of `plan`."""
    report = _merge(results, reference)
    if diagnosis is None:
        return report
    found = first_divergence(plan, tracer.export(), [r["trace"] for r in results], steps=len(reference.losses),
                             tol=diagnosis.tol)
    return replace(report, traced=True, divergence=found, injected=sum(r["injected"] for r in results))


def _merge(results: list[dict], reference: TrainRecord) -> VerifyReport:
    worst = {k: max(r["errors"][k] for r in results) for k in ("loss", "grad", "param")}  # errors are never NaN
    loads = merge_loads([r.get("expert_load") for r in results])
    return VerifyReport(
        world=len(results),
        losses=tuple(reference.losses),
        parallel_losses=tuple(results[0]["losses"]),
        loss_error=worst["loss"][0],
        grad_error=worst["grad"][0],
        param_error=worst["param"][0],
        worst=max(worst.values())[1],
        held=tuple(r.get("held", {}) for r in results),
        expert_load=loads,
        routing_matches=not loads or loads == tuple(reference.expert_load),
    )


def merge_loads(per_rank: list[list[dict[str, ExpertLoad]] | None]) -> tuple[dict[str, ExpertLoad], ...]:
    """Per step and MoE layer, the tokens per expert summed over the ranks' disjoint tokens."""
    merged: list[dict[str, ExpertLoad]] = []
    for steps in filter(None, per_rank):
        for step, layers in enumerate(steps):
            if step == len(merged):
                merged.append({})
            for name, load in layers.items():
                merged[step][name] = merged[step][name] + load if name in merged[step] else load
    return tuple(merged) if any(merged) else ()


def single_device_mesh() -> Mesh:
    return Mesh((1, 1, 1, 1, 1))
