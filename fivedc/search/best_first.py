"""The search's loop: candidates taken best bound first, scored while they can still rank.

`BestFirst` holds a heap of entries, each standing for some candidates of one
`GraphCase` (`cases.py`) with a lower bound of their step times (`bounds.py`):

    case       all its candidates     bound: the units' seconds over pp (no recomputation)
    recompute  one recompute mode     bound: the same with that mode's seconds
    pipeline   a pipeline and a mode  bound: the busiest rank's, from the cut and the placement
    mode       one candidate          bound: that, plus the gradient sync and optimizer after
                                      it; then scored by the planning passes

Popping an entry refines it into the entries below it, or scores it. With `keep=K`,
once the smallest bound left exceeds the K-th best step time scored, every candidate
left is counted as pruned: its step time is at least its bound, so it cannot be among
the K best. With a `band` (the model's error) or a `floor` (a compared layout's step),
pruning waits until the bound exceeds those too, so every tie of the best and every
layout faster than the floor is scored. Ties break by insertion order, so the search is deterministic.
"""

from __future__ import annotations

import heapq
import re
from collections import Counter
from dataclasses import dataclass, replace

from fivedc.errors import FivedcError
from fivedc.estimates.memory import MemoryEstimate
from fivedc.estimates.step_time import TimeEstimate
from fivedc.ir.graph import Graph
from fivedc.ir.hardware import Hardware
from fivedc.ir.mesh import Mesh
from fivedc.pipeline import GRAPH_PASSES, run_passes
from fivedc.plan.planning import Draft
from fivedc.search.cases import GraphCase
from fivedc.search.space import RECOMPUTE, ZERO_STAGES, Candidate, batch_splits, pipelines, rank_orders

DOES_NOT_FIT = "does not fit in the GPU's memory"
DOMINATED = "dominated: the same layout fits with less recomputation, which is faster"
BATCH = "the global batch does not split over dp x ep"
PRUNED = ("pruned: a lower bound of its step time exceeds the K-th best step scored, the best's ties and any "
          "--compare step")


@dataclass(frozen=True, slots=True)
class Scored:
    """A candidate with the plan's own figures for it."""

    candidate: Candidate
    memory: MemoryEstimate
    time: TimeEstimate

    @property
    def comm_share(self) -> float:
        """Share of the step in collectives not hidden behind compute."""
        t = self.time
        return (t.layer_comm_seconds + t.grad_sync_seconds + t.zero_gather_seconds) / t.step_seconds

    def sort_key(self) -> tuple:
        return (self.time.step_seconds, self.memory.total, self.candidate.flags())

    def as_json(self) -> dict:
        return {"mesh": str(self.candidate.mesh), "options": self.candidate.as_json(),
                "step_seconds": self.time.step_seconds, "memory_bytes": self.memory.total, "mfu": self.time.mfu}


class BestFirst:
    """The search's state: the heap, the scored, the rejected by reason (filled as it runs)."""

    def __init__(self, hw: Hardware, dtype: str, keep: int | None, progress=None, *, band: float = 0.0,
                 floor: float = 0.0, fp8: bool = False) -> None:
        """`band`: score every candidate within (1 + band) x the best step too (ties by the model's
        error: `fivedc/estimates/model_error.py`); `floor`: every candidate faster than `floor` seconds;
        `fp8`: every candidate with float8 linears (`--fp8`)."""
        self.hw, self.dtype, self.keep, self.progress, self.fp8 = hw, dtype, keep, progress, fp8
        self.band, self.floor, self._least = band, floor, float("inf")
        self.ranked: list[Scored] = []
        self.rejected: Counter = Counter()
        self._heap: list = []
        self._best: list[float] = []  # the `keep` smallest step times, negated (a max-heap)
        self._seq = 0
        self._done = 0  # candidates resolved, not yet shown

    # ---- filling ----------------------------------------------------------------------------
    def add_meshes(self, graph: Graph, sizes: tuple[int, ...]) -> None:
        """The cases of one mesh size: the graph passes once per (SP, CP variant), shared by the rank orders."""
        orders = rank_orders(sizes)
        if not batch_splits(graph, sizes):
            self.rejected[BATCH] += len(orders)
        else:
            tp, cp = sizes[2], sizes[3]
            for sp in ((False, True) if tp > 1 else (False,)):
                for cp_attention in (("ring", "allgather") if cp > 1 else (None,)):
                    base = Candidate(Mesh(sizes, orders[0]), sp, cp_attention, fp8=self.fp8)
                    self._add_cases(graph, sizes, orders, base)
        if self.progress is not None:
            self.progress.advance(len(orders))

    def _add_cases(self, graph: Graph, sizes, orders, base: Candidate) -> None:
        try:
            sharded = run_passes(Draft(graph), base.options(dtype=self.dtype), GRAPH_PASSES).graph
        except FivedcError as error:
            self.rejected[reason(error)] += count(graph, base.mesh) * len(orders)
            return
        first = None
        for order in orders:
            case = GraphCase(replace(base, mesh=Mesh(sizes, order)), sharded, dtype=self.dtype, hw=self.hw,
                             sharing=first)
            first = first or case
            self._push(case.mesh_bound("none"), case.count(), ("case", case))

    def _push(self, bound: float, candidates: int, entry: tuple) -> None:
        if candidates:
            heapq.heappush(self._heap, (bound, self._seq, candidates, entry))
            self._seq += 1

    # ---- running ----------------------------------------------------------------------------
    def run(self) -> None:
        if self.progress is not None:
            self.progress.start(sum(item[2] for item in self._heap), "scoring layouts")
        while self._heap:
            bound, _, candidates, entry = heapq.heappop(self._heap)
            if self._pruned(bound):
                left = candidates + sum(item[2] for item in self._heap)
                self.rejected[PRUNED] += left
                self._heap.clear()
                self._advance(left)
                return
            getattr(self, f"_{entry[0]}")(bound, *entry[1:])

    def _pruned(self, bound: float) -> bool:
        return self.keep is not None and len(self._best) >= self.keep and \
            bound > max(-self._best[0], self.floor, self._least * (1 + self.band))

    def _advance(self, n: int) -> None:
        """Tell the progress bar, every 200 candidates (a bar's update costs more than a candidate)."""
        self._done += n
        if self.progress is not None and (self._done >= 200 or not self._heap):
            self.progress.advance(self._done)
            self._done = 0

    def _case(self, bound: float, case: GraphCase) -> None:
        for rc in case.recomputes():
            self._push(case.mesh_bound(rc), len(case.pipelines) * len(case.zeros(rc)), ("recompute", case, rc))

    def _recompute(self, bound: float, case: GraphCase, rc: str) -> None:
        for pipeline in case.pipelines:
            self._push(case.pipeline_bound(pipeline, rc), len(case.zeros(rc)), ("pipeline", case, pipeline, rc))

    def _pipeline(self, bound: float, case: GraphCase, pipeline, rc: str) -> None:
        for zero in case.zeros(rc):
            self._push(bound + case.tail_bound(pipeline, zero), 1, ("mode", case, pipeline, rc, zero))

    def _mode(self, bound: float, case: GraphCase, pipeline, rc: str, zero: int) -> None:
        """One candidate by the planning passes: refused, dominated, too large, or ranked."""
        self._advance(1)
        refused = case.refusal(pipeline)
        if refused is not None:
            self.rejected[reason(refused)] += 1
            return
        lesser = RECOMPUTE[:RECOMPUTE.index(rc)]
        if any(case.fits(pipeline, r, zero) for r in lesser if (r, zero) in case.modes):
            self.rejected[DOMINATED] += 1
            return
        if not case.fits(pipeline, rc, zero):
            self.rejected[DOES_NOT_FIT] += 1
            return
        timed = case.timed(pipeline, rc, zero)
        self.ranked.append(Scored(case.candidate(pipeline, rc, zero), timed.memory, timed.time))
        self._least = min(self._least, timed.time.step_seconds)
        if self.keep is not None:
            heapq.heappush(self._best, -timed.time.step_seconds)
            if len(self._best) > self.keep:
                heapq.heappop(self._best)


def count(graph: Graph, mesh: Mesh) -> int:
    """Candidates a refused sharded graph stands for (its pipelines, ZeRO stages, recompute modes)."""
    return len(pipelines(graph, mesh.sizes)) * len(RECOMPUTE) * len(ZERO_STAGES)


def reason(error: FivedcError) -> str:
    """The compiler's message with its numbers as N: one reason for many meshes."""
    text = re.sub(r"\d+", "N", error.message.split("\n")[0])
    return f"{type(error).__name__}: {text[:140]}"
