"""`fivedc search`: the fastest layouts of a model on a cluster, scored as `fivedc compile` scores them.

For every mesh of the space (`fivedc/search/space.py`) the graph passes run once per
(mesh sizes, SP, CP variant), the rank orders sharing the result; each (sharded graph,
rank order) is a `GraphCase` (`cases.py`) with a `Memo` of its per-layer figures
(`fivedc/estimates/memo.py`). A candidate (a pipeline and a (recompute, ZeRO) mode of a
case) is scored by `fivedc compile`'s own planning passes on a draft carrying that memo
(schedule, stage-partition, recompute, buckets, zero, memory, time: all but the agreement
proof), so its step time and memory are what `fivedc compile` of it prints
(tests/test_search.py holds them equal).

Candidates are taken best bound first (`bounds.py`: lower bounds of the step time from
per-layer seconds computed once per case, first per mesh, then per recompute mode, then
per pipeline). With `keep=K` the search stops when the next bound exceeds the K-th best
step time scored: the rest cannot be among the K best and are counted as pruned, so the
K best are exactly those of scoring every candidate; `keep=None` scores every candidate.
With `band` (the model's error, `fivedc/estimates/model_error.py`) it stops only past
(1 + band) x the best step too, so every layout the model cannot tell from the best is
scored (`fivedc search` counts them as ties), and with `floor` (a `--compare` layout's
step) past that, so the compared layout's rank is exact.

Rejected, and counted by reason (`--explain`): a layout the compiler refuses (its
error, numbers written N), one whose busiest rank does not fit the GPU's usable
memory, one dominated by another (with less recomputation the same layout fits, and
recomputation only adds compute, so it is never faster), and those pruned by their
bound. The ranked are sorted by step time (then memory, then the flags, so the order
is deterministic); the best is compiled for real (its plan carries the agreement proof)
when asked.

`fp8` (`fivedc search --fp8`): every candidate with float8 linears (`Candidate.fp8`; the
precision is the user's, not searched), after `check_fp8` has met compile's own refusals once.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field, replace

from fivedc.errors import FivedcError, PassError
from fivedc.ir.graph import Graph
from fivedc.ir.hardware import Hardware
from fivedc.ir.limits import check_world
from fivedc.ir.mesh import Mesh
from fivedc.passes.base import DTYPE_BYTES, CompileOptions
from fivedc.passes.stages import units
from fivedc.pipeline import GRAPH_PASSES, compile_graph, run_passes
from fivedc.plan.planning import Draft
from fivedc.search.best_first import BATCH, DOES_NOT_FIT, DOMINATED, PRUNED, BestFirst, Scored
from fivedc.search.space import mesh_sizes, rank_orders

__all__ = ["BATCH", "DOES_NOT_FIT", "DOMINATED", "PRUNED", "Scored", "SearchError", "SearchResult", "check_cluster",
           "check_fp8", "search"]


class SearchError(FivedcError):
    """No layout of the model fits the cluster, or the cluster itself is not one to search."""

    exit_code = 2


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
           compile_best: bool = True, keep: int | None = None, band: float = 0.0, floor: float = 0.0,
           fp8: bool = False) -> SearchResult:
    """The layouts of `graph` on `gpus` GPUs of `hardware`, ranked by estimated step time:
    every one that fits (`keep=None`), or at least the `keep` best, every one within
    (1 + `band`) x the best step and every one faster than `floor` seconds. `fp8`: every
    layout with float8 linears (`fivedc compile --fp8`; the precision is not searched)."""
    check_cluster(gpus, hardware)
    if dtype not in DTYPE_BYTES:
        raise SearchError(f"unknown dtype {dtype!r}", hint=f"choose one of {', '.join(DTYPE_BYTES)}")
    if keep is not None and keep < 1:
        raise SearchError(f"keep={keep} must be at least 1 (or None: rank every layout)")
    if fp8:
        check_fp8(graph, hardware, dtype)
    sizes = mesh_sizes(graph, gpus=gpus, gpus_per_node=hardware.gpus_per_node, units=len(units(graph)))
    meshes = sum(len(rank_orders(s)) for s in sizes)
    state = BestFirst(hardware, dtype, keep, progress, band=band, floor=floor, fp8=fp8)
    if progress is not None:
        progress.start(meshes, "sharding meshes")
    for s in sizes:
        state.add_meshes(graph, s)
    state.run()
    if not state.ranked:
        raise SearchError(_nothing_fits(graph, gpus, hardware, state.rejected),
                          hint="use more GPUs or a GPU with more memory, or a smaller batch or sequence "
                          "(--global-batch, --seq); fivedc search --explain lists every reason")
    result = SearchResult(tuple(sorted(state.ranked, key=Scored.sort_key)), state.rejected, meshes)
    return _compiled(graph, result, hardware, dtype) if compile_best else result


def check_cluster(gpus: int, hardware: Hardware) -> None:
    if not isinstance(gpus, int) or isinstance(gpus, bool) or gpus < 1:
        raise SearchError(f"--gpus {gpus!r} must be a whole number of GPUs >= 1", hint="e.g. --gpus 1024")
    check_world(gpus, what=f"--gpus {gpus}", hint="search a cluster of at most 2^20 GPUs, e.g. --gpus 1024")
    per_node = hardware.gpus_per_node
    if gpus > per_node and gpus % per_node:
        raise SearchError(
            f"--gpus {gpus} is not a whole number of {per_node}-GPU nodes ({hardware.key}): ranks would "
            f"straddle a partial node", hint=f"use a multiple of {per_node}, e.g. --gpus {gpus // per_node * per_node or per_node}"
            f" or {(gpus // per_node + 1) * per_node}, or set --gpus-per-node")


def check_fp8(graph: Graph, hardware: Hardware, dtype: str) -> None:
    """`--fp8`: compile's own refusals, once before the search rather than counted on every
    mesh: a profile without float8 tensor cores (`CompileOptions`), a model with no linear
    torchao converts (the fp8 pass, after shape inference, on one GPU: eligibility does not
    depend on the mesh)."""
    options = CompileOptions(mesh=Mesh((1, 1, 1, 1, 1)), dtype=dtype, hardware=hardware, fp8=True)
    run_passes(Draft(graph), options, tuple(p for p in GRAPH_PASSES if p.name in ("infer-shapes", "fp8")))


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
