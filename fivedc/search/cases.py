"""One sharded graph on one mesh: what its candidates share, their bounds, and their scores.

A `GraphCase` is the model after the graph passes on one mesh (sizes, rank order, SP,
CP variant) with a `Memo` of its per-layer figures. Its candidates are its pipelines
(schedule, microbatches, virtual stages) times its (recompute, ZeRO) modes. It gives
their lower bounds (`bounds.py`) and scores them lazily with `fivedc compile`'s own
planning passes (all but the agreement proof): a pipeline's schedule and partition once
(`PER_PIPELINE`), a mode's memory once (`PER_MODE`), the step time (`TIMING`) of a mode
that fits; so a score is what `fivedc compile` of the candidate prints.
"""

from __future__ import annotations

from dataclasses import replace

from fivedc.errors import FivedcError
from fivedc.estimates.memo import Memo
from fivedc.ir.graph import Graph
from fivedc.ir.hardware import Hardware
from fivedc.ir.mesh import MeshAxis
from fivedc.passes.base import DTYPE_BYTES
from fivedc.passes.param_sync import zero_notes
from fivedc.passes.recompute import recomputed_regions
from fivedc.passes.stage_plan import check_pipeline, chunk_ranges
from fivedc.pipeline import PLANNING_PASSES, run_passes
from fivedc.plan.planning import Draft
from fivedc.schedule.generators import placement
from fivedc.search.bounds import held_rows, kept_rows, mesh_bound, pipeline_bound, single_bound, tail_bound
from fivedc.search.space import RECOMPUTE, ZERO_STAGES, Candidate, pipelines


def _passes(*names: str) -> tuple:
    """The planning passes of `PIPELINE` (the very objects `fivedc compile` runs) by name."""
    by_name = {p.name: p for p in PLANNING_PASSES}
    return tuple(by_name[n] for n in names)


# The planning passes split where the search shares their work: once per pipeline, then per
# (recompute, ZeRO) mode, then the step time of those that fit. Together, in this order, they
# are every planning pass but the agreement proof (tests/test_search.py holds them so).
PER_PIPELINE = _passes("schedule", "stage-partition")
PER_MODE = _passes("recompute", "buckets", "zero", "memory")
TIMING = _passes("time")

Pipeline = tuple  # (schedule, microbatches, virtual); (None, None, None) without a pipeline


class GraphCase:
    """The candidates of one sharded graph on one mesh (search state: filled as they are scored)."""

    __slots__ = ("base", "dtype", "hw", "draft", "pipelines", "modes", "_laid", "_planned", "_bounds", "_tails")

    def __init__(self, base: Candidate, sharded: Graph, *, dtype: str, hw: Hardware, sharing: GraphCase | None = None):
        """`sharing`: the case of the same graph on another rank order, whose memo's figures
        that do not depend on the order this one shares (`memo.ORDER_FREE`)."""
        self.base, self.dtype, self.hw = base, dtype, hw
        memo = Memo(sharded, base.mesh, dtype) if sharing is None else sharing.draft.memo.sharing(base.mesh)
        self.draft = Draft(sharded, memo=memo)
        self.pipelines: list[Pipeline] = pipelines(sharded, base.mesh.sizes)
        self.modes = modes(sharded, base.mesh)
        self._laid: dict = {}
        self._planned: dict = {}
        self._bounds: dict = {} if sharing is None else sharing._bounds  # cuts, memory bounds' rows: order-free
        self._tails: dict = {}  # tail bounds (collectives: they depend on the rank order)

    def count(self) -> int:
        return len(self.pipelines) * len(self.modes)

    def recomputes(self) -> list[str]:
        return list(dict.fromkeys(r for r, _ in self.modes))

    def zeros(self, recompute: str) -> list[int]:
        return [z for r, z in self.modes if r == recompute]

    def candidate(self, pipeline: Pipeline, recompute: str = "none", zero: int = 0) -> Candidate:
        schedule, m, v = pipeline
        return replace(self.base, schedule=schedule, microbatches=m, virtual=v, zero=zero, recompute=recompute)

    # ---- bounds -----------------------------------------------------------------------------
    def mesh_bound(self, recompute: str) -> float:
        return mesh_bound(self.draft.memo, self.hw, dtype_bytes=DTYPE_BYTES[self.dtype], recompute=recompute,
                          pp=self.base.mesh.size(MeshAxis.PP))

    def pipeline_bound(self, pipeline: Pipeline, recompute: str) -> float:
        shape = self._shape(pipeline)
        if shape is None:
            return self.mesh_bound(recompute)
        ranges, chunk_place, copies = shape
        return pipeline_bound(self.draft.memo, self.hw, dtype_bytes=DTYPE_BYTES[self.dtype], recompute=recompute,
                              schedule=pipeline[0], microbatches=pipeline[1], ranges=ranges, placement=chunk_place,
                              pipelines=copies)

    def tail_bound(self, pipeline: Pipeline, zero: int) -> float:
        """At least the seconds after the schedule (0 without a pipeline or a cut)."""
        shape = self._shape(pipeline) if pipeline[0] is not None else None
        if shape is None:
            return 0.0
        key = (pipeline[0], pipeline[2], zero)
        if key not in self._tails:
            ranges, chunk_place, _ = shape
            self._tails[key] = tail_bound(self.draft.memo, self.hw, dtype_bytes=DTYPE_BYTES[self.dtype], zero=zero,
                                          overlap=self.candidate(pipeline).options(dtype=self.dtype).overlap,
                                          schedule=pipeline[0], virtual=pipeline[2], ranges=ranges,
                                          placement=chunk_place)
        return self._tails[key]

    def memory_bound(self, pipeline: Pipeline, recompute: str, zero: int) -> int:
        """At most the busiest rank's bytes (0 when unknown: a pipeline the passes refuse)."""
        if pipeline[0] is None:
            key = ("single", recompute, zero)
            if key not in self._bounds:
                self._bounds[key] = single_bound(self.draft.memo, dtype_bytes=DTYPE_BYTES[self.dtype],
                                                 recompute=recompute, zero=zero)
            return self._bounds[key]
        shape = self._shape(pipeline)
        if shape is None:
            return 0
        ranges, chunk_place, _ = shape
        name, m, v = pipeline
        held_key, kept_key = ("held rows", name, v, zero), ("kept rows", pipeline, recompute)
        if held_key not in self._bounds:
            self._bounds[held_key] = held_rows(self.draft.memo, dtype_bytes=DTYPE_BYTES[self.dtype], zero=zero,
                                               schedule=name, virtual=v, ranges=ranges, placement=chunk_place)
        if kept_key not in self._bounds:
            self._bounds[kept_key] = kept_rows(self.draft.memo, dtype_bytes=DTYPE_BYTES[self.dtype],
                                               recompute=recompute, schedule=name, microbatches=m, virtual=v,
                                               ranges=ranges, placement=chunk_place)
        return max(rest + max(grads, k) for (rest, grads), k in zip(self._bounds[held_key], self._bounds[kept_key]))

    def _shape(self, pipeline: Pipeline) -> tuple | None:
        """(units per model chunk, each schedule chunk's pp rank, model copies) of a pipeline cut
        by cost; None without a pipeline or when the cut is refused (too few units)."""
        name, _, v = pipeline
        if name is None:
            return None
        key = ("shape", name, v)
        if key not in self._bounds:
            self._bounds[key] = self._cut(name, v)
        return self._bounds[key]

    def _cut(self, name: str, v: int | None) -> tuple | None:
        p = self.base.mesh.size(MeshAxis.PP)
        chunk_place, copies = placement(name, p, v)
        try:
            ranges, _ = chunk_ranges(self.draft.graph, self.base.mesh, schedule=name, n_chunks=len(chunk_place) // copies,
                                     p=p, layout=None, dtype_bytes=DTYPE_BYTES[self.dtype], memo=self.draft.memo)
        except FivedcError:  # the schedule pass says so when the candidate is scored
            return None
        return ranges, chunk_place, copies

    def refusal(self, pipeline: Pipeline) -> FivedcError | None:
        """What the schedule and stage-partition passes would refuse this pipeline with, if anything
        (checked without building the schedule)."""
        key = ("refusal", pipeline)
        if key not in self._laid:
            name, m, v = pipeline
            self._laid[key] = None
            if name is not None:
                try:
                    check_pipeline(self.draft.graph, self.base.mesh, schedule=name, microbatches=m, virtual=v,
                                   dtype_bytes=DTYPE_BYTES[self.dtype], memo=self.draft.memo)
                except FivedcError as error:
                    self._laid[key] = error
        return self._laid[key]

    # ---- scores -----------------------------------------------------------------------------
    def laid_out(self, pipeline: Pipeline) -> Draft | FivedcError:
        """The draft after the schedule and partition passes, or the compiler's refusal."""
        if pipeline not in self._laid:
            options = self.candidate(pipeline).options(dtype=self.dtype, hardware=self.hw)
            try:
                self._laid[pipeline] = run_passes(self.draft, options, PER_PIPELINE)
            except FivedcError as error:
                self._laid[pipeline] = error
        return self._laid[pipeline]

    def planned(self, pipeline: Pipeline, recompute: str, zero: int) -> Draft:
        """The draft after the recompute, buckets, zero and memory passes (a laid-out pipeline)."""
        key = (pipeline, recompute, zero)
        if key not in self._planned:
            options = self.candidate(pipeline, recompute, zero).options(dtype=self.dtype, hardware=self.hw)
            laid = self.laid_out(pipeline)
            if isinstance(laid, FivedcError):  # `refusal` found nothing: a bug, reported as the passes' error
                raise laid
            self._planned[key] = run_passes(laid, options, PER_MODE)
        return self._planned[key]

    def fits(self, pipeline: Pipeline, recompute: str, zero: int) -> bool:
        """Whether the busiest rank fits: first by the bound, then by the memory pass."""
        if self.memory_bound(pipeline, recompute, zero) > self.hw.usable_bytes:
            return False
        return self.planned(pipeline, recompute, zero).memory.total <= self.hw.usable_bytes

    def timed(self, pipeline: Pipeline, recompute: str, zero: int) -> Draft:
        options = self.candidate(pipeline, recompute, zero).options(dtype=self.dtype, hardware=self.hw)
        return run_passes(self.planned(pipeline, recompute, zero), options, TIMING)


def modes(graph: Graph, mesh) -> list[tuple[str, int]]:
    """(recompute, zero) pairs that change something, least recomputation first."""
    recompute = [r for r in RECOMPUTE if r == "none" or recomputed_regions(graph, r) != (0, 0)]
    zero = [z for z in ZERO_STAGES if z == 0 or not any("changes nothing" in n for n in zero_notes(graph, mesh, z))]
    return [(r, z) for r in recompute for z in zero]
