"""What a rank sends on the wire in one training step, expanded from the plan.

The plan is SPMD: every rank runs the same graph, and what a rank issues depends on
its coordinates only through the pipeline (its pp rank's chunks and schedule
actions). So the ranks fall into *classes*, one per pp rank, and `class_programs`
expands each class's step into the collectives and transfers it issues, in the
runtime's order: the schedule's actions (without a pipeline, one forward and one
backward of the whole graph); in a forward, each node in program order (a
redistribution's steps, a gather or reduce-scatter run in a ring as its n - 1 hops, an
all-reduce run by chunks as its n chunks'; what
a kernel sends inside: vocab-parallel cross-entropy's all-reduces, ring attention's hops, MoE's count exchange, dispatch and combine); in a
backward, the nodes in reverse (a recomputed attention's forward hops first, the
gradient buckets as their last gradient arrives when overlap is on; under sequence parallelism, at the first backward of a gathered
linear input's readers, the all-gather that makes it again); pipeline sends and
receives with their buffers; the tied parameters' sums over the pp ranks holding
them; then the buckets left (ZeRO-1's all of them, reduce-scattered), DualPipe's
exchange of the two copies' gradients, the loss's all-reduce, and ZeRO-1/2's gathers
after the update (those: `fivedc/instructions/sync_events.py`). ZeRO-3 without a pipeline
gathers and reduce-scatters by group inside forward and backward
(`fivedc/instructions/zero3_program.py`).

An `Event` records what must agree between the ranks of its group: the operation,
the group's axes, the elements this rank contributes and their dtype (None: sized at
run time, MoE's rows, whose sizes the count exchange just before agrees). A full
recomputed layer is placed at its backward's start (the runtime redoes it at the
first tensor the layer saved: the same collectives of the same class, a little
later). `fivedc/proof/agreement.py` proves from these programs that every group agrees.
`tests/test_agreement.py` holds them against what the runtime really calls.

`class_instructions` gives the same step with its computations too (an op's forward and
backward, a recomputed op's forward again, a zero-bubble chunk's weight gradients, the
optimizer step): each class's instruction list, which `fivedc show PLAN --program` prints.
The proof's events are that list without its `COMPUTE` instructions (a test holds them so).

`class_runs` gives each class's step as shared `Run`s: a repeat's layer forward and
backward are each built once for all its layers (a site's events depend on its node, not
its layer), a chunk's runs once for every microbatch; `class_programs` flattens them.
"""

from __future__ import annotations

from fivedc.ir.graph import param_instances
from fivedc.ir.mesh import MeshAxis
from fivedc.instructions.events import Event, Run, compute, flatten
from fivedc.instructions.param_facts import ParamFacts
from fivedc.instructions.pipeline_events import PipelineEvents
from fivedc.instructions.sync_events import Buckets, SyncEvents
from fivedc.instructions.unit_program import TORCH_DTYPES, UnitExpander
from fivedc.instructions.zero3_program import zero3_step
from fivedc.passes.chunk_params import held_by_rank
from fivedc.passes.overlap import expand_buckets
from fivedc.passes.tied import tied_groups


def class_runs(plan, *, shared: bool = True, computations: bool = False) -> dict[int, tuple[Run, ...]]:
    """Per pp rank (a class of ranks), one training step as runs in issue order. The proof
    (`fivedc/proof/agreement.py`) does its work once per distinct run's events, so its cost
    follows the plan's structure, not the layers' repetition, the microbatches or the world
    size. `shared=False` builds each layer's and each site's events apart (the reference
    the tests hold the shared runs against); `computations`: with the `COMPUTE` instructions."""
    expander = _Expander(plan, shared=shared, computations=computations)
    return {rank: expander.runs(rank) for rank in range(plan.mesh.size(MeshAxis.PP))}


def class_instructions(plan) -> dict[int, tuple[Run, ...]]:
    """Per pp rank, one training step as instructions: the proof's events and the
    computations between them, in issue order (shared runs, as `class_runs`)."""
    return class_runs(plan, computations=True)


def rank_instructions(plan, pp_rank: int) -> tuple[Run, ...]:
    """`class_instructions(plan)[pp_rank]`, without expanding the other classes."""
    return _Expander(plan, computations=True).runs(pp_rank)


def class_programs(plan) -> dict[int, tuple[Event, ...]]:
    """Per pp rank (a class of ranks), the events of one training step in issue order."""
    return {rank: flatten(runs) for rank, runs in class_runs(plan).items()}


class _Expander(UnitExpander, SyncEvents, PipelineEvents, ParamFacts):
    def __init__(self, plan, *, shared: bool = True, computations: bool = False) -> None:
        super().__init__(plan.graph, plan.mesh, recompute=plan.recompute, dtype=TORCH_DTYPES[plan.dtype],
                         pipeline=plan.pipeline, microbatches=plan.pipeline.microbatches if plan.pipeline else 1,
                         shared=shared, computations=computations)
        self.plan = plan
        self.params = dict(param_instances(plan.graph))  # qualified name -> Param
        self.tied = tied_groups(plan.graph, plan.pipeline, plan.mesh.size(MeshAxis.PP))
        self.expanded_buckets = expand_buckets(plan.buckets)
        self._held_by_rank: dict[int, list[str]] | None = None
        self._buckets_by_rank: dict[int, list[tuple[str, ...]]] | None = None
        self._param_names: dict[str | None, set[str]] = {}  # per repeat (None: none), and "": the top level's
        self._numels: dict = {}  # per parameter of the graph: its local elements, its ZeRO chunk
        self.schedule = plan.pipeline.build_schedule(plan.mesh.size(MeshAxis.PP)) if plan.pipeline else None

    # ---- one class ----------------------------------------------------------------------------
    def runs(self, pp_rank: int) -> tuple[Run, ...]:
        mine = self._held(pp_rank)
        overlap = self.plan.overlap and self.pipeline is None and self.plan.zero in (0, 2)
        buckets = Buckets(self, pp_rank, overlap=overlap)
        out: list[Run] = []
        if self.pipeline is None and self.plan.zero == 3:  # gathered and reduce-scattered by group
            out.append(Run(tuple(zero3_step(self))))
        elif self.pipeline is None:
            out += self.unit_runs("forward", 0, len(self.units))
            out += self.unit_runs("backward", 0, len(self.units), buckets)
        else:
            out.append(Run(tuple(self._pipeline_start(pp_rank, mine))))
            out += self._actions(pp_rank)
            out.append(Run(tuple(self._tied(pp_rank))))
        tail = buckets.rest()
        if self.pipeline is not None and self.plan.zero == 3:
            tail += self._zero3_pipeline_sync(mine)
        if self.pipeline is not None and self.pipeline.kind.pipelines > 1:
            tail += self._copies(pp_rank, mine)
        tail += self._loss()
        if self.computations:
            tail.append(compute("optimizer step: this rank's parameters (its ZeRO chunks)" if self.plan.zero
                                else "optimizer step: this rank's parameters"))
        if self.plan.zero in (1, 2):
            tail += self._gathers(mine, "gather the updated parameters (ZeRO-1/2)")
        tail += self._states()
        out.append(Run(tuple(tail)))
        return tuple(run for run in out if run.events)

    def held_buckets(self, pp_rank: int) -> list[tuple[str, ...]]:
        """The gradient buckets (executions, in launch order) whose parameters this class all
        holds; found for every class in one pass over the buckets."""
        if self._buckets_by_rank is None:
            self._buckets_by_rank = {}
            every = set(range(self.mesh.size(MeshAxis.PP)))
            holders: dict[str, set[int]] = {}
            for rank in every:
                for name in self._held(rank):
                    holders.setdefault(name, set()).add(rank)
            for bucket in self.expanded_buckets:
                for rank in sorted(set.intersection(*(holders.get(n, set()) for n in bucket)) if bucket else every):
                    self._buckets_by_rank.setdefault(rank, []).append(bucket)
        return self._buckets_by_rank.get(pp_rank, [])

    def _held(self, pp_rank: int) -> list[str]:
        """The parameter instances this class holds, in the plan's order."""
        if self.pipeline is None:
            return list(self.params)
        if self._held_by_rank is None:
            by_rank = held_by_rank(self.graph, self.pipeline, self.mesh.size(MeshAxis.PP))
            self._held_by_rank = {r: [n for n in self.params if n in names] for r, names in by_rank.items()}
        return self._held_by_rank[pp_rank]
