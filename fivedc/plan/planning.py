"""The planning passes: the decisions made on the compiled graph, each a pass of `PIPELINE`.

After the graph passes have placed every value on the mesh, these decide, in order:
the pipeline schedule (how many microbatches, chunks per rank), the stage partition
(which layers each chunk runs, on which pp rank, and what it sends on), what
recomputes in backward, the gradient buckets and their overlap, ZeRO's gathers by
those buckets, the memory per rank and the step time. Each reads the options and the
`Draft` (what the passes before it decided) and returns the draft with its own
fields filled; it decides nothing else. `assemble` makes the `ExecutionPlan` of a
finished draft, deciding nothing. A draft may carry a `Memo` (`fivedc/estimates/memo.py`)
of the graph's per-layer figures: `run_pipeline` gives one to each compile, and the
layout search (`fivedc/search/`) one to all the candidates of a sharded graph, so its
scores are these passes' figures; without one they are computed, to the same values.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, ClassVar

from fivedc.estimates.memo import Memo
from fivedc.estimates.memory import MemoryEstimate, estimate_memory
from fivedc.passes.regather import regather_collectives
from fivedc.estimates.step_time import TimeEstimate, estimate_time
from fivedc.ir.graph import Collective, Graph
from fivedc.ir.mesh import MeshAxis
from fivedc.passes.base import CompileOptions
from fivedc.passes.overlap import Bucket, plan_buckets
from fivedc.passes.param_sync import (
    copy_sync_collectives, sum_collectives, sync_bytes, tied_sync_collectives, zero_gathers, zero_notes,
)
from fivedc.passes.recompute import recompute_notes
from fivedc.passes.stage_plan import choose_schedule, partition_stages, pipeline_collectives
from fivedc.passes.stages import PipelineSpec, chunk_starts
from fivedc.passes.state_sync import state_sync_collectives
from fivedc.passes.tied import TiedGroup, tied_groups
from fivedc.plan.execution_plan import PLAN_VERSION, ExecutionPlan, graph_collectives, groups_of
from fivedc.schedule import Schedule

if TYPE_CHECKING:
    from fivedc.proof.agreement import AgreementProof


@dataclass(frozen=True, slots=True)
class Draft:
    """What the passes have decided so far (each field's comment names the pass that fills it)."""

    graph: Graph  # the graph passes
    memo: Memo | None = None  # per-layer figures of `graph` on the mesh, shared (optional)
    schedule: Schedule | None = None  # schedule (pp > 1)
    pipeline: PipelineSpec | None = None  # stage-partition (pp > 1)
    transfers: tuple[Collective, ...] = ()  # stage-partition: activations and gradients between chunks
    recompute: str = "none"  # recompute
    regathers: tuple[Collective, ...] = ()  # recompute: SP's gathered inputs gathered again in backward
    buckets: tuple[Bucket, ...] = ()  # buckets
    sums: tuple[Collective, ...] = ()  # buckets: each bucket's gradient sum
    copy_sync: tuple[Collective, ...] = ()  # buckets: DualPipe's two copies add their gradients
    tied: tuple[TiedGroup, ...] = ()  # buckets: top-level parameters several pp ranks hold copies of
    tied_sync: tuple[Collective, ...] = ()  # buckets: pp ranks holding a tied parameter sum its gradient
    gathers: tuple[Collective, ...] = ()  # zero: ZeRO's gathers by the buckets
    notes: tuple[str, ...] = ()  # recompute, zero
    memory: MemoryEstimate | None = None  # memory
    time: TimeEstimate | None = None  # time (with --gpu)
    proof: AgreementProof | None = None  # prove-agreement (fivedc/pipeline.py)


class PlanningPass:
    """A decision on the compiled graph: `plan(draft, options)` returns the draft with its fields."""

    name: ClassVar[str]
    purpose: ClassVar[str]

    def plan(self, draft: Draft, options: CompileOptions) -> Draft:
        raise NotImplementedError


class ChooseSchedule(PlanningPass):
    name = "schedule"
    purpose = "PP: the schedule, its microbatches and chunks per rank, checked against the model"

    def plan(self, draft: Draft, options: CompileOptions) -> Draft:
        return replace(draft, schedule=choose_schedule(
            draft.graph, options.mesh, schedule=options.schedule, microbatches=options.microbatches,
            virtual=options.virtual, layout=options.pp_layout, memo=draft.memo))


class PartitionStages(PlanningPass):
    name = "stage-partition"
    purpose = "PP: the layers cut into the schedule's chunks (marks, layout or cost), and what each sends on"

    def plan(self, draft: Draft, options: CompileOptions) -> Draft:
        if draft.schedule is None:
            return draft
        pipeline = partition_stages(draft.graph, options.mesh, draft.schedule, layout=options.pp_layout,
                                    dtype_bytes=options.dtype_bytes, memo=draft.memo)
        transfers = pipeline_collectives(draft.graph, options.mesh, pipeline, options.dtype_bytes)
        return replace(draft, pipeline=pipeline, transfers=tuple(transfers))


class ChooseRecompute(PlanningPass):
    name = "recompute"
    purpose = "what backward recomputes (none, selective, full), and SP's inputs gathered again"

    def plan(self, draft: Draft, options: CompileOptions) -> Draft:
        mode = options.recompute_mode(draft.graph)

        def regathers() -> tuple[Collective, ...]:
            return tuple(regather_collectives(draft.graph, mode))
        return replace(draft, recompute=mode, regathers=regathers() if draft.memo is None else
                       draft.memo.get(("regathers", mode), regathers),
                       notes=draft.notes + recompute_notes(draft.graph, mode))


class BucketGradients(PlanningPass):
    name = "buckets"
    purpose = "gradient buckets in backward order, their sums and what each overlaps"

    def plan(self, draft: Draft, options: CompileOptions) -> Draft:
        graph, mesh, zero = draft.graph, options.mesh, options.zero
        cuts = chunk_starts(graph, draft.pipeline)
        tied = tied_groups(graph, draft.pipeline, mesh.size(MeshAxis.PP))
        apart = tuple(group.names for group in tied)

        def buckets_of() -> tuple[Bucket, ...]:
            return plan_buckets(graph, mesh, bucket_bytes=options.bucket_bytes, cuts=cuts, apart=apart,
                                param_bytes=lambda p: sync_bytes(graph, mesh, p, options.dtype_bytes, zero))
        key = ("buckets", options.dtype_bytes, zero, options.bucket_bytes, cuts, apart)
        buckets = buckets_of() if draft.memo is None else draft.memo.get(key, buckets_of)
        sums = sum_collectives(buckets, mesh, zero=zero, overlap=options.overlap, pipelined=draft.pipeline is not None)
        tied_names = frozenset(n for g in tied for n in g.names)

        def copies() -> tuple[Collective, ...]:
            return tuple(copy_sync_collectives(graph, mesh, draft.pipeline, options.dtype_bytes, zero, tied=tied_names))
        key = ("copy sync", options.dtype_bytes, zero, draft.pipeline, tied_names)
        return replace(draft, buckets=buckets, sums=tuple(sums),
                       copy_sync=copies() if draft.memo is None else draft.memo.get(key, copies), tied=tied,
                       tied_sync=tuple(tied_sync_collectives(graph, mesh, tied, options.dtype_bytes)))


class ShardZero(PlanningPass):
    name = "zero"
    purpose = "ZeRO: each rank's chunks, and their gathers by the buckets (ZeRO-3: per group, as FSDP2)"

    def plan(self, draft: Draft, options: CompileOptions) -> Draft:
        gathers = zero_gathers(draft.buckets, options.mesh, zero=options.zero, overlap=options.overlap,
                               pipelined=draft.pipeline is not None)
        notes = zero_notes(draft.graph, options.mesh, options.zero) + draft.notes
        return replace(draft, gathers=tuple(gathers), notes=notes)


class EstimateMemory(PlanningPass):
    name = "memory"
    purpose = "bytes per class of ranks: parameters, gradients, optimizer, activations, transient"

    def plan(self, draft: Draft, options: CompileOptions) -> Draft:
        return replace(draft, memory=estimate_memory(
            draft.graph, mesh=options.mesh, dtype=options.dtype, dtype_bytes=options.dtype_bytes, zero=options.zero,
            pipeline=draft.pipeline, recompute=draft.recompute, buckets=draft.buckets, overlap=options.overlap,
            memo=draft.memo, tied=draft.tied))


class EstimateTime(PlanningPass):
    name = "time"
    purpose = "with --gpu: the step time, bubble, tokens/s and MFU on that GPU"

    def plan(self, draft: Draft, options: CompileOptions) -> Draft:
        if options.hardware is None:
            return draft
        return replace(draft, time=estimate_time(
            draft.graph, mesh=options.mesh, dtype=options.dtype, dtype_bytes=options.dtype_bytes, zero=options.zero,
            overlap=options.overlap, buckets=draft.buckets, pipeline=draft.pipeline, recompute=draft.recompute,
            hardware=options.hardware, memo=draft.memo, tied=draft.tied))


def assemble(draft: Draft, options: CompileOptions) -> ExecutionPlan:
    """The plan of a finished draft: the collectives in a fixed order (the graph's, the
    gradient sums, ZeRO's gathers, SP's gathers again, the pipeline's, the tied parameters'
    sums, DualPipe's, the states' sum over pp) and the groups they use."""
    graph, mesh = draft.graph, options.mesh
    collectives = (graph_collectives(graph) + draft.sums + draft.gathers + draft.regathers + draft.transfers
                   + draft.tied_sync + draft.copy_sync + state_sync_collectives(graph, mesh))
    return ExecutionPlan(PLAN_VERSION, graph, mesh, options.sp_enabled(graph), options.dtype,
                         groups_of(mesh, collectives), collectives, draft.memory, options.zero, options.overlap,
                         options.bucket_bytes, draft.buckets, draft.pipeline, draft.notes, draft.recompute, draft.time,
                         options.fp8)
