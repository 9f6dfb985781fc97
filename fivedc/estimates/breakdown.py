"""A plan's step time by term: where `estimate_time`'s seconds come from.

`step_breakdown` follows `estimate_time` (`step_time.py`) and keeps the terms its sums
are made of, so they add up to its step (tests/test_search_compare.py):

- the schedule's makespan: without a pipeline, every unit's forward and whole backward
  by term (`terms.py`: matmuls, attention, memory-bound ops, recomputation, collectives
  by axes, op issue); with one, the work of the busiest pp rank (each of its F, B, I and
  W actions in the schedule, with the terms of its chunk's units), the pipeline bubble
  (the schedule played with free transfers, less that work), and `pp sends` (what the
  transfers add to the makespan);
- after it, on the pp rank `estimate_time` takes (the largest tail): the gradient sums not
  hidden (whatever their groups' axes: dp, dp x ep, ...), ZeRO's gathers, the
  runtime's copies around the sums, DualPipe's copies adding their gradients, the tied
  parameters' sums over pp, and the optimizer.

`fivedc search --compare MESH --explain` prints two of these side by side.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

from fivedc.estimates.memo import memo_for, param_sizes, rank_held, save_context
from fivedc.estimates.step_time import (
    _play, _tied_seconds, chunk_costs, estimate_time, memo_unit_times, tail_parts,
)
from fivedc.estimates.terms import Terms, merge
from fivedc.ir.mesh import MeshAxis
from fivedc.schedule.actions import COMPUTE

BUBBLE, PP_SENDS, OPTIMIZER = "pipeline bubble", "pp sends", "optimizer"
SYNC, GATHERS = "dp/ZeRO grad sync", "ZeRO gathers"
COPIES, PAIR, TIED = "grad copies (memory)", "pp: DualPipe grad add", "pp: tied grad sums"
ORDER = ("matmuls", "attention", "memory-bound ops", "recomputation", "op issue (host)", BUBBLE, "collectives",
         PP_SENDS, SYNC, GATHERS, COPIES, PAIR, TIED, OPTIMIZER)  # display order (`<axes> collectives` together)


@dataclass(frozen=True, slots=True)
class StepBreakdown:
    """A step's seconds by term; the terms add up to `step_seconds`."""

    step_seconds: float
    terms: Terms
    pp_rank: int | None = None  # the pp rank whose work the compute terms count (None: no pipeline)

    def seconds(self, term: str) -> float:
        return dict(self.terms).get(term, 0.0)


def term_order(term: str) -> tuple[int, str]:
    """Where `term` goes in a printed breakdown (`ORDER`)."""
    key = "collectives" if term.endswith(" collectives") else term
    return (ORDER.index(key) if key in ORDER else len(ORDER), term)


def plan_breakdown(plan) -> StepBreakdown:
    """The breakdown of a compiled plan's step on its own hardware (`plan.time`)."""
    from fivedc.passes.base import DTYPE_BYTES
    from fivedc.passes.tied import tied_groups

    if plan.time is None:
        raise ValueError("a plan compiled without --gpu has no step time to break down")
    return step_breakdown(plan.graph, mesh=plan.mesh, dtype=plan.dtype, dtype_bytes=DTYPE_BYTES[plan.dtype],
                          zero=plan.zero, overlap=plan.overlap, buckets=plan.buckets, pipeline=plan.pipeline,
                          recompute=plan.recompute, hardware=plan.time.hardware,
                          tied=tied_groups(plan.graph, plan.pipeline, plan.mesh.size(MeshAxis.PP)))


def step_breakdown(graph, *, mesh, dtype: str, dtype_bytes: int, zero: int, overlap: bool, buckets, pipeline,
                   recompute: str, hardware, memo=None, tied=()) -> StepBreakdown:
    """`estimate_time`'s step (same arguments) by term."""
    memo = memo_for(memo, graph, mesh, dtype)
    hw = hardware
    time = estimate_time(graph, mesh=mesh, dtype=dtype, dtype_bytes=dtype_bytes, zero=zero, overlap=overlap,
                         buckets=buckets, pipeline=pipeline, recompute=recompute, hardware=hw, memo=memo, tied=tied)
    m = pipeline.microbatches if pipeline else 1
    times = memo_unit_times(memo, hw, dtype_bytes, m, recompute)
    if pipeline is None:
        work = merge(*(merge(t.parts.forward, t.parts.backward(whole=True)) for t in times))
        rank, backward, last = None, sum(t.backward for t in times), times[0].backward if times else 0.0
    else:
        rank, work = _busiest(save_context(memo, dtype_bytes, m, recompute), pipeline, mesh, hw, times)
        free = _play(pipeline.build_schedule(mesh.size(MeshAxis.PP)), chunk_costs(
            save_context(memo, dtype_bytes, m, recompute), pipeline, mesh, hw, times)[0],
            {"RF": [0.0] * len(pipeline.chunks), "RB": [0.0] * len(pipeline.chunks)})[0]
        idle = max(0.0, free - sum(v for _, v in work))  # a schedule with no idle time: 0, not a rounding residue
        work += ((BUBBLE, idle), (PP_SENDS, time.compute_seconds - free))
        backward = last = 0.0

    def tail(r):
        parts = tail_parts(param_sizes(memo), mesh, dtype, dtype_bytes, zero, overlap, buckets, pipeline,
                           rank_held(memo, pipeline, r), hw, backward, last, time.compute_seconds)
        tied_s = _tied_seconds(param_sizes(memo), tied, r, mesh, dtype_bytes, hw)
        return (parts.sync + parts.copies + parts.pair + tied_s, parts.gathers, parts.optimizer), parts, tied_s

    _, parts, tied_s = max((tail(r) for r in (range(mesh.size(MeshAxis.PP)) if pipeline else (None,))),
                           key=lambda t: t[0])
    after = ((SYNC, parts.sync), (GATHERS, parts.gathers), (COPIES, parts.copies), (PAIR, parts.pair), (TIED, tied_s),
             (OPTIMIZER, parts.optimizer))
    terms = tuple((k, v) for k, v in merge(work, after) if v or k == BUBBLE and pipeline is not None)
    return StepBreakdown(time.step_seconds, terms, rank)


def _busiest(c, pipeline, mesh, hw, times) -> tuple[int, Terms]:
    """The pp rank with the most work in the schedule, and that work by term: each of its
    compute actions, with its chunk's units' terms for that phase."""
    whole = not pipeline.kind.split_backward
    schedule = pipeline.build_schedule(mesh.size(MeshAxis.PP))
    per, _ = chunk_costs(c, pipeline, mesh, hw, times)
    chunk_parts = []
    for chunk in pipeline.chunks:
        mine = [t.parts for t in times[chunk.units[0]:chunk.units[1]]]
        chunk_parts.append({"F": merge(*(p.forward for p in mine)), "I": merge(*(p.input for p in mine)),
                            "W": merge(*(p.weight for p in mine)),
                            "B": merge(*(p.backward(whole=whole) for p in mine))})
    counts = [Counter((a.kind.value, a.chunk) for a in actions if a.kind in COMPUTE) for actions in schedule.ranks]
    busy = [sum(n * per[kind][chunk] for (kind, chunk), n in mine.items()) for mine in counts]
    rank = max(range(len(busy)), key=busy.__getitem__)
    return rank, merge(*(merge(chunk_parts[chunk][kind], scale=n) for (kind, chunk), n in counts[rank].items()))
