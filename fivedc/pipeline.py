"""The compiler pipeline, in one place: read this file first.

A model (from the DSL or torch.fx) is an IR `Graph`; the passes in `PIPELINE` run
in order, each a pure Graph -> Graph function (shapes, the CP sequence split, EP
expert placement, sharding propagation for DP/TP/SP/CP, gradient reductions,
communication insertion). `compile_graph` then makes the decisions that are not
yet passes: the pipeline's chunks and schedule (`stage_plan.plan_pipeline`), and in
`plan.build_plan` the gradient buckets and overlap (`overlap.py`), ZeRO's
collectives (`param_sync.py`) and the memory estimate (with the activation
recomputation the options or the model choose: `recompute.py`, `activations.py`);
they are still to become passes of `PIPELINE`. Last, `agreement.prove_agreement`
proves that every process group's ranks will issue the same collectives in the same
order, and the pipeline's transfers pair up without deadlock; a plan that fails it
is never returned (a compiler bug, exit 4).
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from fivedc.agreement import prove_agreement
from fivedc.errors import FivedcError, PassError
from fivedc.ir import Graph
from fivedc.memo import Memo
from fivedc.plan import ExecutionPlan, build_plan
from fivedc.stage_plan import plan_pipeline
from fivedc.passes.base import CompileOptions, Pass
from fivedc.passes.communication import InsertCommunication
from fivedc.passes.context import SplitSequence
from fivedc.passes.experts import PlaceExperts
from fivedc.passes.gradients import ReduceGradients
from fivedc.passes.propagate import PropagateShardings
from fivedc.passes.shapes import InferShapes
from fivedc.passes.support import CheckSupportedAxes
from fivedc.passes.verify import VerifyIR

PIPELINE: tuple[Pass, ...] = (
    VerifyIR(stage="entry"),
    CheckSupportedAxes(),  # an axis whose pass has not landed: "not yet supported", never a wrong plan
    InferShapes(),
    SplitSequence(),  # CP: the sequence layout over cp, and each attention's ring/allgather variant
    PlaceExperts(),  # EP: check each moe op, resolve its @ep(placement, all-to-all) before the rules read it
    PropagateShardings(),  # DP batch split, TP column/row pairing, SP, the CP sequence split
    ReduceGradients(),  # which axes each parameter's gradient is summed over
    InsertCommunication(),  # redistributions with forward and backward collectives, and why
    VerifyIR(stage="exit"),
)


@dataclass(frozen=True, slots=True)
class PassTiming:
    name: str
    seconds: float


def run_passes(graph: Graph, options: CompileOptions, *, timings: list[PassTiming] | None = None) -> Graph:
    done: list[str] = []
    for compiler_pass in PIPELINE:
        start = time.perf_counter()
        try:
            graph = compiler_pass.run(graph, options)
        except FivedcError:
            raise
        except Exception as error:  # a bug in a pass: say which, and what ran before it
            raise PassError(
                f"pass {compiler_pass.name} failed ({type(error).__name__}: {error}) "
                f"after {', '.join(done) or 'no passes'}"
            ) from error
        done.append(compiler_pass.name)
        if timings is not None:
            timings.append(PassTiming(compiler_pass.name, time.perf_counter() - start))
    return graph


def compile_graph(graph: Graph, options: CompileOptions, *, timings: list[PassTiming] | None = None,
                  proofs: list | None = None) -> ExecutionPlan:
    """The plan for `graph`; before it is returned, a proof that every process group's ranks
    issue the same collectives (`fivedc/agreement.py`), kept in `proofs` when given."""
    plan = _build(run_passes(graph, options, timings=timings), options)
    start = time.perf_counter()
    proof = prove_agreement(plan)
    if timings is not None:
        timings.append(PassTiming("prove-agreement", time.perf_counter() - start))
    if proofs is not None:
        proofs.append(proof)
    return plan


def _build(graph: Graph, options: CompileOptions, memo: Memo | None = None) -> ExecutionPlan:
    # per-layer figures computed once (fivedc/memo.py; the layout search hands its own, shared by many plans)
    memo = memo if memo is not None else Memo(graph, options.mesh, options.dtype)
    # pipeline stages: chunks of layers (at the model's @stage marks, a given layout, or balanced by cost)
    # and the schedule (fivedc/stage_plan.py)
    pipeline = plan_pipeline(graph, options.mesh, schedule=options.schedule, microbatches=options.microbatches,
                             virtual=options.virtual, layout=options.pp_layout, dtype_bytes=options.dtype_bytes,
                             memo=memo)
    return build_plan(
        graph,
        mesh=options.mesh,
        sequence_parallel=options.sp_enabled(graph),
        dtype=options.dtype,
        dtype_bytes=options.dtype_bytes,
        zero=options.zero,
        overlap=options.overlap,
        bucket_bytes=options.bucket_bytes,
        pipeline=pipeline,
        recompute=options.recompute_mode(graph),
        hardware=options.hardware,
        memo=memo,
    )
