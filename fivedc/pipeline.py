"""The compiler pipeline, in one place: read this file first.

A model (from the DSL, torch.fx or torch.export: `fivedc/frontends/`) is an IR
`Graph`. The passes of `PIPELINE` run in order, each a pure function of what the
passes before it produced and the options (`CompileOptions`):

- graph passes (`passes/`), Graph -> Graph: check the IR, infer shapes,
  split the sequence over cp, place experts over ep, propagate shardings (dp, tp,
  sp, cp), decide the gradient sums, insert the redistributions with their
  collectives, check the IR again;
- planning passes (`fivedc/plan/planning.py`), Draft -> Draft: the pipeline
  schedule and stage partition, recomputation, gradient buckets and overlap, ZeRO's
  gathers by those buckets, then the memory and step-time estimates
  (`fivedc/estimates/`);
- last, `prove-agreement` (`fivedc/proof/`): every process group's ranks issue the
  same collectives in the same order and the pipeline's transfers pair up without
  deadlock; a plan that fails it is never returned (a compiler bug, exit 4).

`compile_graph` runs them and assembles the `ExecutionPlan` (`fivedc/plan/`), which
decides nothing of its own. `fivedc compile --passes` lists the passes with their
times.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, replace

from fivedc.errors import FivedcError, PassError
from fivedc.estimates.memo import Memo
from fivedc.ir.graph import Graph
from fivedc.passes.attention_kernel import ChooseAttentionKernel
from fivedc.passes.base import CompileOptions, Pass
from fivedc.passes.communication import InsertCommunication
from fivedc.passes.context import SplitSequence
from fivedc.passes.experts import PlaceExperts
from fivedc.passes.fp8 import ChooseFp8
from fivedc.passes.gradients import ReduceGradients
from fivedc.passes.propagate import PropagateShardings
from fivedc.passes.shapes import InferShapes
from fivedc.passes.verify import VerifyIR
from fivedc.plan.execution_plan import ExecutionPlan
from fivedc.plan.planning import (BucketGradients, ChooseRecompute, ChooseSchedule, Draft, EstimateMemory,
                                  EstimateTime, PartitionStages, PlanningPass, ShardZero, assemble)
from fivedc.proof.agreement import prove_agreement


class ProveAgreement(PlanningPass):
    name = "prove-agreement"
    purpose = "every group's ranks issue the same collectives in the same order; transfers pair up"

    def plan(self, draft: Draft, options: CompileOptions) -> Draft:
        return replace(draft, proof=prove_agreement(assemble(draft, options)))


PIPELINE: tuple[Pass | PlanningPass, ...] = (
    VerifyIR(stage="entry"),
    InferShapes(),
    ChooseAttentionKernel(),
    SplitSequence(),
    PlaceExperts(),
    PropagateShardings(),
    ReduceGradients(),
    InsertCommunication(),
    ChooseFp8(),
    VerifyIR(stage="exit"),
    ChooseSchedule(),
    PartitionStages(),
    ChooseRecompute(),
    BucketGradients(),
    ShardZero(),
    EstimateMemory(),
    EstimateTime(),
    ProveAgreement(),
)


@dataclass(frozen=True, slots=True)
class PassTiming:
    name: str
    purpose: str
    seconds: float


def run_pipeline(graph: Graph, options: CompileOptions, *, timings: list[PassTiming] | None = None) -> Draft:
    """Every pass of `PIPELINE` in order; a pass that fails other than with a user's error
    is a compiler bug, named with the passes that ran before it."""
    return run_passes(Draft(graph), options, PIPELINE, timings=timings)


def run_passes(draft: Draft, options: CompileOptions, passes: tuple[Pass | PlanningPass, ...], *,
               timings: list[PassTiming] | None = None) -> Draft:
    """`passes` (a part of `PIPELINE`, in its order) on `draft`. The planning passes get
    a `Memo` of the graph's per-layer figures (`fivedc/estimates/memo.py`) when the draft
    has none; the layout search hands its own, shared by every candidate of the graph."""
    done: list[str] = []
    for compiler_pass in passes:
        start = time.perf_counter()
        try:
            if isinstance(compiler_pass, PlanningPass):
                if draft.memo is None:
                    draft = replace(draft, memo=Memo(draft.graph, options.mesh, options.dtype))
                draft = compiler_pass.plan(draft, options)
            else:
                draft = replace(draft, graph=compiler_pass.run(draft.graph, options))
        except FivedcError:
            raise
        except Exception as error:
            raise PassError(
                f"pass {compiler_pass.name} failed ({type(error).__name__}: {error}) "
                f"after {', '.join(done) or 'no passes'}"
            ) from error
        done.append(compiler_pass.name)
        if timings is not None:
            timings.append(PassTiming(compiler_pass.name, compiler_pass.purpose, time.perf_counter() - start))
    return draft


GRAPH_PASSES = tuple(p for p in PIPELINE if not isinstance(p, PlanningPass))
PLANNING_PASSES = tuple(p for p in PIPELINE if isinstance(p, PlanningPass))


def compile_graph(graph: Graph, options: CompileOptions, *, timings: list[PassTiming] | None = None,
                  proofs: list | None = None) -> ExecutionPlan:
    """The plan for `graph`; the proof that every process group's ranks agree is kept in
    `proofs` when given."""
    draft = run_pipeline(graph, options, timings=timings)
    if proofs is not None:
        proofs.append(draft.proof)
    return assemble(draft, options)
