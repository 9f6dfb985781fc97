"""The plan's pipeline: which schedule, how many microbatches, and the chunks.

Two passes of `fivedc/pipeline.py` for pp > 1: `choose_schedule` checks the request
(enough layers, the model's marks: `passes/stage_marks.py`, microbatches that split the
batch and ops that can run in them: `passes/microbatch_checks.py`, a schedule the
runtime runs) and makes the schedule; `partition_stages` cuts the units into its chunks
(`passes/stages.py`: at the model's `@stage` marks, which must give exactly the chunks
the schedule runs; else a layout given in layers; else balanced by cost:
`passes/stage_cuts.py`) and names, for each chunk, its layers, cost, parameter bytes
and the values it sends on; `pipeline_collectives` lists those transfers for the plan.
Marks on a pp=1 mesh are not used (the summary says so).
"""

from __future__ import annotations

import numpy as np

from fivedc.errors import NotSupportedError, PlanError
from fivedc.ir.graph import Collective, CollectiveKind, DType, Graph, Op, Phase
from fivedc.ir.mesh import Mesh, MeshAxis
from fivedc.schedule import SCHEDULES, Schedule, schedule_kind
from fivedc.schedule.batched import peaks, program
from fivedc.schedule.generators import check_request, placement
from fivedc.passes.microbatch_checks import check_microbatches, check_per_microbatch, default_microbatches
from fivedc.passes.stage_costs import unit_costs
from fivedc.passes.stage_cuts import balance_v, check_enough, layout_ranges, partition
from fivedc.passes.stage_marks import check_mark_places, check_marks
from fivedc.passes.stage_values import all_boundary_values, value_types
from fivedc.passes.stages import Chunk, PipelineSpec, Unit, cached_schedule, has_marks, marked_ranges, units


def pipeline_collectives(graph: Graph, mesh: Mesh, spec: PipelineSpec, dtype_bytes: int) -> list[Collective]:
    """The P2P transfers between consecutive chunks: activations forward, their
    gradients backward, once per microbatch."""
    types = value_types(graph)
    out = []
    copies = spec.kind.pipelines  # each copy carries half the microbatches
    for chunk in spec.chunks[:-1]:
        if not chunk.sends:
            continue  # the last chunk of a copy
        numel = 0
        for name in chunk.sends:
            t, sharding = types[name]
            numel += graph.local_numel(t.dims, sharding, mesh) // (spec.microbatches if graph.batch_dim in t.dims else 1)
        values = ", ".join(chunk.sends)
        nxt = spec.chunks[chunk.index + 1]
        if nxt.rank == chunk.rank:
            continue  # the next chunk runs on the same rank: handed over, not sent
        for phase, what in ((Phase.FORWARD, "activations"), (Phase.BACKWARD, "their gradients")):
            out.append(Collective(
                CollectiveKind.SEND_RECV, (MeshAxis.PP,), phase, values, numel * dtype_bytes,
                f"pipeline: chunk {chunk.index} (pp rank {chunk.rank}) and chunk {nxt.index} (pp rank {nxt.rank}) "
                f"exchange {what} at their boundary, once per microbatch" + (" of their copy" if copies > 1 else ""),
                count=spec.microbatches // copies, overlaps="the other microbatches' compute (as the schedule orders it)",
            ))
    return out


RUNNABLE = SCHEDULES


def choose_schedule(graph: Graph, mesh: Mesh, *, schedule: str, microbatches: int | None, virtual: int | None,
                    layout: tuple[int, ...] | None, memo=None, build: bool = True) -> Schedule | None:
    """The pipeline schedule for pp > 1 (None for pp = 1): its microbatches (given, or
    max(pp, the schedule's least) that split the batch) and chunks per rank, after
    checking that the model has the layers, marks and batch it needs. `memo` (optional:
    anything with `get(key, compute)`, as `fivedc/estimates/memo.py`'s) keeps the units.
    With `build=False` only the checks (and `make_schedule`'s) run: None, or their error."""
    p = mesh.size(MeshAxis.PP)
    if p == 1:
        return None
    kind = schedule_kind(schedule)
    if virtual is None and kind.takes_virtual:
        virtual = kind.per_rank()
    per_rank = kind.model_chunks_per_rank(virtual)
    check_mark_places(graph)
    all_units = _cached(memo, "units", lambda: units(graph))
    if has_marks(graph):  # before the batch is checked: the marks decide the chunks
        check_marks(graph, all_units, layout, schedule, p, per_rank)
    elif layout is None:
        check_enough(len(all_units), p * per_rank, "layers and op groups")
    m = microbatches if microbatches is not None else default_microbatches(graph, mesh, p, kind.min_microbatches(p))
    check_microbatches(graph, mesh, m)
    check_per_microbatch(graph, m)
    if not build:
        return check_request(schedule, p, m, virtual)
    return cached_schedule(schedule, p, m, virtual)


def check_pipeline(graph: Graph, mesh: Mesh, *, schedule: str, microbatches: int, virtual: int | None,
                   dtype_bytes: int, memo=None) -> None:
    """Raise what the schedule and stage-partition passes raise for this pipeline (cut by
    cost), in their order, without building its schedule (the layout search checks a
    candidate before bounding its memory)."""
    choose_schedule(graph, mesh, schedule=schedule, microbatches=microbatches, virtual=virtual, layout=None,
                    memo=memo, build=False)
    p = mesh.size(MeshAxis.PP)
    chunk_place, copies = placement(schedule, p, virtual)
    n_chunks = len(chunk_place) // copies
    ranges, _ = chunk_ranges(graph, mesh, schedule=schedule, n_chunks=n_chunks, p=p, layout=None,
                             dtype_bytes=dtype_bytes, memo=memo)
    boundaries = _cached(memo, "boundaries", lambda: all_boundary_values(graph))
    for k in range(n_chunks - 1):
        _check_sends(graph, boundaries[ranges[k][1]], k)


def partition_stages(graph: Graph, mesh: Mesh, sched: Schedule, *, layout: tuple[int, ...] | None,
                     dtype_bytes: int, memo=None) -> PipelineSpec:
    """The model cut into the schedule's chunks (at the model's marks, a given layout, or
    balanced by cost), each placed on the pp rank the schedule runs it on, with its
    layers, cost, parameter bytes and the values it sends on. Unit costs, boundaries and
    the balanced cut are kept in `memo` when one is given (the layout search shares one
    across candidates); without one they are computed, to the same figures."""
    p, all_units = sched.p, _cached(memo, "units", lambda: units(graph))
    n_chunks = p * sched.v // sched.pipelines  # the model's chunks (DualPipe runs each on two ranks)
    unit_cost = _cached(memo, ("unit costs", dtype_bytes), lambda: unit_costs(graph, mesh, dtype_bytes))
    costs = list(unit_cost.costs)
    ranges, cut = chunk_ranges(graph, mesh, schedule=sched.name, n_chunks=n_chunks, p=p, layout=layout,
                               dtype_bytes=dtype_bytes, memo=memo)
    chunks = []
    for k in range(p * sched.v):  # DualPipe: chunk n_chunks + s is the second copy's chunk s
        a, b = ranges[k % n_chunks]
        what = _describe(graph, all_units[a:b]) + (" (second copy)" if k >= n_chunks else "")
        boundaries = _cached(memo, "boundaries", lambda: all_boundary_values(graph))
        sends = boundaries[b] if k % n_chunks < n_chunks - 1 else ()
        _check_sends(graph, sends, k % n_chunks)
        chunks.append(Chunk(k, sched.placement[k], (a, b), what, sum(costs[a:b]), unit_cost.chunk_param_bytes(a, b),
                            sends))
    return PipelineSpec(sched.name, sched.m, sched.v, tuple(chunks), cut)


def chunk_ranges(graph: Graph, mesh: Mesh, *, schedule: str, n_chunks: int, p: int,
                 layout: tuple[int, ...] | None, dtype_bytes: int, memo=None) -> tuple[list[tuple[int, int]], str]:
    """(unit range of each of the model's `n_chunks` chunks, how they were cut): at the
    model's marks, by a given layout, or balanced by cost (DualPipeV: rank pairs balanced)."""
    if has_marks(graph):
        return marked_ranges(_cached(memo, "units", lambda: units(graph))), "marks"
    if layout is not None:
        if len(layout) != n_chunks:
            raise PlanError(f"the layout gives {len(layout)} chunks; {schedule} on pp={p} runs {n_chunks}",
                            hint=f"give {n_chunks} layer counts, one per chunk ({n_chunks // p} per pp rank)")
        return layout_ranges(layout, graph), "layout"
    costs = list(_cached(memo, ("unit costs", dtype_bytes), lambda: unit_costs(graph, mesh, dtype_bytes)).costs)
    v_shape = schedule_kind(schedule).folded
    return _cached(memo, ("partition", dtype_bytes, n_chunks, v_shape),
                   lambda: _balanced(costs, n_chunks, v_shape)), "cost"


def _check_sends(graph: Graph, sends: tuple[str, ...], chunk: int) -> None:
    """A chunk passes on activations, which carry gradients: an integer value cannot cross a cut."""
    types = {item.out: item for item in graph.body.items if isinstance(item, Op)}
    for name in sends:
        op = types.get(name)
        if op is not None and op.type is not None and op.type.dtype == DType.INT:
            raise NotSupportedError(
                f"the integer value {name} is computed in pipeline chunk {chunk} and used after it; a chunk passes "
                "on floating-point activations only", loc=op.loc,
                hint="compute it from the inputs only (each chunk then computes what it uses), move the pipeline "
                "cut (--pp-layout, or a stage mark) so that one chunk computes and uses it, or use pp=1")


def _cached(memo, key, compute):
    """`memo.get(key, compute)`, or `compute()` without a memo (passes do not import the
    estimates' `Memo`, so it is taken by its one method)."""
    return compute() if memo is None else memo.get(key, compute)


def _balanced(costs: list[float], n_chunks: int, v_shape: bool) -> list[tuple[int, int]]:
    ranges = partition(costs, n_chunks, what="layers and op groups")
    return balance_v(costs, ranges) if v_shape else ranges


def _describe(graph: Graph, chunk_units: list[Unit]) -> str:
    """`embedding, layers.0-3`: op runs by kind, consecutive layers as a range."""
    parts: list[list] = []
    for unit in chunk_units:
        if unit.layer is None:
            parts.append(["ops", unit.describe(graph)])
            continue
        name = graph.body.items[unit.start].name
        if parts and parts[-1][0] == "layers" and parts[-1][1] == name:
            parts[-1][3] = unit.layer
        else:
            parts.append(["layers", name, unit.layer, unit.layer])
    return ", ".join(
        p[1] if p[0] == "ops" else f"{p[1]}.{p[2]}" + (f"-{p[3]}" if p[3] != p[2] else "") for p in parts
    )


def activations_in_flight(pipeline: PipelineSpec, pp: int, per_chunk, deferred=None, grads=None) -> tuple[int, ...]:
    """Per pp rank, the activation bytes kept at its peak under the pipeline's schedule,
    when one microbatch's forward through chunk c keeps `per_chunk[c]` bytes until its
    backward (B, or W after I): the schedule played action by action
    (`peak_live_weighted`) says how many are alive at once on each rank: all m under
    GPipe, p - rank under 1F1B, (p - rank - 1) x 2 + (v - 1) x p + 1 chunk-microbatches
    under interleaved, and so on for ZB-H1, DualPipeV and DualPipe. Under a split backward
    (I, then W) a microbatch keeps only `deferred[c]` between its I and its W. With `grads`
    (per chunk) the peak is of the activations and the gradients made so far together."""
    prog = program(pipeline.build_schedule(pp))
    split = None if deferred is None else np.array([deferred], dtype=np.int64)
    made = None if grads is None else np.array([grads], dtype=np.int64)
    return tuple(int(x) for x in peaks(prog, np.array([per_chunk], dtype=np.int64), split, made)[0])
