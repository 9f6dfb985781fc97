"""`fivedc search`: the fastest layout of a model on a cluster, scored as `fivedc compile` scores it.

For every mesh of the space (`fivedc/search/space.py`) the graph passes run once per
(mesh, rank order, SP, CP variant); a `Memo` (`fivedc/estimates/memo.py`) then holds
that sharded graph's per-layer figures (seconds, bytes kept, working sets, parameter
sizes), and every pipeline, ZeRO stage and recomputation on it is scored by running
`fivedc compile`'s own planning passes (`fivedc/plan/planning.py`: schedule,
stage-partition, recompute, buckets, zero, memory, time) on a `Draft` carrying that
memo: no compile per candidate, and a candidate's step time and memory are what
`fivedc compile` of it prints by construction (tests/test_search.py holds them equal).

Pruned, and counted by reason (`--explain`): a layout the compiler refuses (its
error, numbers written N), one whose busiest rank does not fit the GPU's usable
memory, and one dominated by another: with less recomputation the same layout fits,
and recomputation only adds compute, so it is never faster. The rest are ranked by
step time (then memory, then the flags, so the order is deterministic); the best is
compiled for real (its plan carries the agreement proof) before it is returned.
"""

from __future__ import annotations

import re
from collections import Counter
from dataclasses import dataclass, field, replace

from fivedc.errors import FivedcError, PassError
from fivedc.estimates.memo import Memo
from fivedc.estimates.memory import MemoryEstimate
from fivedc.estimates.step_time import TimeEstimate
from fivedc.ir.graph import Graph
from fivedc.ir.hardware import Hardware
from fivedc.ir.mesh import Mesh, MeshAxis
from fivedc.passes.base import DTYPE_BYTES
from fivedc.passes.param_sync import zero_notes
from fivedc.passes.recompute import recomputed_regions
from fivedc.passes.stages import units
from fivedc.pipeline import GRAPH_PASSES, PLANNING_PASSES, compile_graph, run_passes
from fivedc.plan.planning import Draft
from fivedc.search.space import (RECOMPUTE, ZERO_STAGES, Candidate, batch_splits, mesh_sizes, pipelines,
                                 rank_orders)


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

DOES_NOT_FIT = "does not fit in the GPU's memory"
DOMINATED = "dominated: the same layout fits with less recomputation, which is faster"
BATCH = "the global batch does not split over dp x ep"


class SearchError(FivedcError):
    """No layout of the model fits the cluster, or the cluster itself is not one to search."""

    exit_code = 2


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


@dataclass(frozen=True)
class SearchResult:
    ranked: tuple[Scored, ...]  # best first
    rejected: Counter = field(default_factory=Counter)  # reason -> candidates
    meshes: int = 0  # (mesh, rank order) pairs considered
    plan: object = None  # the best candidate compiled (ExecutionPlan)
    proof: object = None  # its agreement proof

    @property
    def best(self) -> Scored:
        return self.ranked[0]


def search(graph: Graph, *, gpus: int, hardware: Hardware, dtype: str = "bf16", progress=None,
           compile_best: bool = True) -> SearchResult:
    """Every layout of `graph` on `gpus` GPUs of `hardware`, ranked by estimated step time."""
    check_cluster(gpus, hardware)
    if dtype not in DTYPE_BYTES:
        raise SearchError(f"unknown dtype {dtype!r}", hint=f"choose one of {', '.join(DTYPE_BYTES)}")
    n_units = len(units(graph))
    sizes = mesh_sizes(graph, gpus=gpus, gpus_per_node=hardware.gpus_per_node, units=n_units)
    meshes = [Mesh(s, order) for s in sizes for order in rank_orders(s)]
    rejected: Counter = Counter()
    ranked: list[Scored] = []
    if progress is not None:
        progress.start(len(meshes))
    for mesh in meshes:
        if not batch_splits(graph, mesh.sizes):
            rejected[BATCH] += 1
        else:
            _score_mesh(graph, mesh, hardware, dtype, ranked, rejected)
        if progress is not None:
            progress.advance()
    if not ranked:
        raise SearchError(_nothing_fits(graph, gpus, hardware, rejected),
                          hint="use more GPUs or a GPU with more memory, or a smaller batch or sequence "
                          "(--global-batch, --seq); fivedc search --explain lists every reason")
    ranked.sort(key=Scored.sort_key)
    result = SearchResult(tuple(ranked), rejected, len(meshes))
    return _compiled(graph, result, hardware, dtype) if compile_best else result


def check_cluster(gpus: int, hardware: Hardware) -> None:
    if not isinstance(gpus, int) or isinstance(gpus, bool) or gpus < 1:
        raise SearchError(f"--gpus {gpus!r} must be a whole number of GPUs >= 1", hint="e.g. --gpus 1024")
    per_node = hardware.gpus_per_node
    if gpus > per_node and gpus % per_node:
        raise SearchError(
            f"--gpus {gpus} is not a whole number of {per_node}-GPU nodes ({hardware.key}): ranks would "
            f"straddle a partial node", hint=f"use a multiple of {per_node}, e.g. --gpus {gpus // per_node * per_node or per_node}"
            f" or {(gpus // per_node + 1) * per_node}, or set --gpus-per-node")


def _score_mesh(graph: Graph, mesh: Mesh, hw: Hardware, dtype: str, ranked: list, rejected: Counter) -> None:
    tp, cp = mesh.size(MeshAxis.TP), mesh.size(MeshAxis.CP)
    for sp in ((False, True) if tp > 1 else (False,)):
        for cp_attention in (("ring", "allgather") if cp > 1 else (None,)):
            base = Candidate(mesh, sp, cp_attention)
            try:
                sharded = run_passes(Draft(graph), base.options(dtype=dtype), GRAPH_PASSES).graph
            except FivedcError as error:
                rejected[_reason(error)] += _count(graph, mesh)
                continue
            draft = Draft(sharded, memo=Memo(sharded, mesh, dtype))
            for schedule, m, v in pipelines(graph, mesh.sizes):
                _score_pipeline(draft, replace(base, schedule=schedule, microbatches=m, virtual=v), hw,
                                dtype, ranked, rejected)


def _score_pipeline(draft: Draft, base: Candidate, hw: Hardware, dtype: str, ranked: list,
                    rejected: Counter) -> None:
    """The planning passes of `fivedc compile` on the candidates of one pipeline: the
    schedule and partition once, then per (recompute, ZeRO) the rest, the step time only
    for a layout that fits."""
    try:
        laid_out = run_passes(draft, base.options(dtype=dtype, hardware=hw), PER_PIPELINE)
    except FivedcError as error:
        rejected[_reason(error)] += len(_modes(draft.graph, base.mesh))
        return
    fitted: set[int] = set()
    for recompute, zero in _modes(draft.graph, base.mesh):
        if zero in fitted:
            rejected[DOMINATED] += 1
            continue
        candidate = replace(base, zero=zero, recompute=recompute)
        options = candidate.options(dtype=dtype, hardware=hw)
        planned = run_passes(laid_out, options, PER_MODE)
        if planned.memory.total > hw.usable_bytes:
            rejected[DOES_NOT_FIT] += 1
            continue
        fitted.add(zero)
        timed = run_passes(planned, options, TIMING)
        ranked.append(Scored(candidate, timed.memory, timed.time))


def _modes(graph: Graph, mesh: Mesh) -> list[tuple[str, int]]:
    """(recompute, zero) pairs that change something, least recomputation first."""
    recompute = [r for r in RECOMPUTE if r == "none" or recomputed_regions(graph, r) != (0, 0)]
    zero = [z for z in ZERO_STAGES if z == 0 or not any("changes nothing" in n for n in zero_notes(graph, mesh, z))]
    return [(r, z) for r in recompute for z in zero]


def _count(graph: Graph, mesh: Mesh) -> int:
    """Candidates a refused sharded graph stands for (its pipelines, ZeRO stages, recompute modes)."""
    return len(pipelines(graph, mesh.sizes)) * len(RECOMPUTE) * len(ZERO_STAGES)


def _reason(error: FivedcError) -> str:
    """The compiler's message with its numbers as N: one reason for many meshes."""
    text = re.sub(r"\d+", "N", error.message.split("\n")[0])
    return f"{type(error).__name__}: {text[:140]}"


def _nothing_fits(graph: Graph, gpus: int, hw: Hardware, rejected: Counter) -> str:
    total = sum(rejected.values())
    top = "; ".join(f"{reason} ({n})" for reason, n in rejected.most_common(3))
    return (f"no layout of {graph.name} on {gpus} x {hw.key} fits and compiles: all {total} candidates were "
            f"rejected ({top})")


def _compiled(graph: Graph, result: SearchResult, hw: Hardware, dtype: str) -> SearchResult:
    """The best candidate compiled for real, its figures checked against its score."""
    best = result.best
    proofs: list = []
    plan = compile_graph(graph, best.candidate.options(dtype=dtype, hardware=hw), proofs=proofs)
    if plan.time.step_seconds != best.time.step_seconds or plan.memory.total != best.memory.total:
        raise PassError(f"the search scored {best.candidate.flags()} at {best.time.step_seconds} s and "
                        f"{best.memory.total} bytes, its compiled plan says {plan.time.step_seconds} s and "
                        f"{plan.memory.total} bytes: a bug in fivedc")
    return replace(result, plan=plan, proof=proofs[0])
