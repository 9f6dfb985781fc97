"""The plan's pipeline: which schedule, how many microbatches, and the chunks.

Two passes of `fivedc/pipeline.py` for pp > 1: `choose_schedule` checks the request
(enough layers, microbatches that split the batch, a schedule the runtime runs) and
makes the schedule; `partition_stages` cuts the units into its chunks (`passes/stages.py`: at the model's `@stage` marks,
which must give exactly the chunks the schedule runs; else a layout given in
layers; else balanced by cost) and names, for each chunk, its layers, cost,
parameter bytes and the values it sends on; `pipeline_collectives` lists those
transfers for the plan. Marks on a pp=1 mesh are not used (the summary says so).
"""

from __future__ import annotations

import numpy as np

from fivedc.ir.ops import counts_targets
from fivedc.ir.aten_layout import whole_dims
from fivedc.errors import NotSupportedError, PlanError, SourceLoc
from fivedc.ir.graph import Collective, CollectiveKind, DType, Graph, Op, Phase, Redistribute, Repeat, walk_ops
from fivedc.ir.mesh import Mesh, MeshAxis
from fivedc.schedule import SCHEDULES, Schedule, schedule_kind
from fivedc.schedule.batched import peaks, program
from fivedc.schedule.generators import check_request, placement
from fivedc.passes.stages import (
    Chunk, PipelineSpec, Unit, all_boundary_values, cached_schedule, check_enough, has_marks, layout_ranges,
    marked_ranges, partition, unit_costs, units, value_types,
)


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
    _check_mark_places(graph)
    all_units = _cached(memo, "units", lambda: units(graph))
    if has_marks(graph):  # before the batch is checked: the marks decide the chunks
        _check_marks(graph, all_units, layout, schedule, p, per_rank)
    elif layout is None:
        check_enough(len(all_units), p * per_rank, "layers and op groups")
    m = microbatches if microbatches is not None else _default_microbatches(graph, mesh, p, kind.min_microbatches(p))
    _check_microbatches(graph, mesh, m)
    _check_per_microbatch(graph, m)
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


def balance_v(costs: list[float], ranges: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """DualPipeV's rank r runs chunks r and 2p-1-r: move units across chunk boundaries
    while that lowers the ranks' pair costs, largest first (compared as sorted lists, so
    a tie at the top still lets the next one come down), starting from chunks balanced
    one by one."""
    n = len(ranges)
    cuts = [b for _, b in ranges[:-1]]  # chunk k is [cuts[k-1], cuts[k])

    sums: dict[tuple[int, int], float] = {}  # a move changes one or two chunks: the others' sums are kept

    def chunk_sum(a: int, b: int) -> float:
        if (a, b) not in sums:
            sums[a, b] = sum(costs[a:b])
        return sums[a, b]

    def pairs(cuts: list[int]) -> list[float]:
        bounds = [0, *cuts, ranges[-1][1]]
        chunk = [chunk_sum(bounds[k], bounds[k + 1]) for k in range(n)]
        return sorted((chunk[r] + chunk[n - 1 - r] for r in range(n // 2)), reverse=True)

    end = ranges[-1][1]
    moves = [((k, step),) for k in range(n - 1) for step in (-1, 1)]  # one boundary, or it and its mirror
    moves += [((k, a), (n - 2 - k, b)) for k in range((n - 1) // 2) for a in (-1, 1) for b in (-1, 1)]
    best = pairs(cuts)
    improved = True
    while improved:
        improved = False
        for move in moves:
            moved = list(cuts)
            for k, step in move:
                moved[k] += step
            if not all(a < b for a, b in zip([0, *moved], [*moved, end])):
                continue
            trial = pairs(moved)
            if _lower(trial, best):
                cuts, best, improved = moved, trial, True
    bounds = [0, *cuts, ranges[-1][1]]
    return [(bounds[k], bounds[k + 1]) for k in range(n)]


def _lower(trial: list[float], best: list[float]) -> bool:
    """Whether `trial` (pair costs, largest first) is lower than `best`, lexicographically."""
    for x, y in zip(trial, best):
        if abs(x - y) > 1e-9 * max(abs(y), 1.0):
            return x < y
    return False


# ---- the model's @stage marks ------------------------------------------------------------------
def _check_marks(graph: Graph, all_units: list[Unit], layout: tuple[int, ...] | None, schedule: str,
                 p: int, per_rank: int) -> None:
    """Marks not together with a layout, and giving the chunks the schedule runs."""
    first = next(u for u in all_units if u.marked)
    where = [_mark_name(graph, u) for k, u in enumerate(all_units) if u.marked and k > 0]
    if layout is not None:
        raise PlanError(
            f"the model marks its pipeline chunks with @stage (at {_mark_name(graph, first)}) and --pp-layout "
            f"{','.join(map(str, layout))} gives layers per chunk too; use one of the two",
            loc=_mark_loc(graph, first),
            hint="drop --pp-layout to cut at the model's marks, or remove the @stage marks to cut as the layout says",
        )
    n, runs = len(where) + 1, p * per_rank
    if n == runs or per_rank < (2 if schedule_kind(schedule).takes_virtual else 1):
        return  # a bad --virtual is make_schedule's error
    boundaries = f"{len(where)} stage boundar{'y' if len(where) == 1 else 'ies'}"
    at = f" (before {', '.join(where)})" if where else " (a mark on the first op or layer cuts nothing)"
    raise PlanError(
        f"the model marks {boundaries}{at}, giving {n} chunk{'s' if n != 1 else ''}; "
        f"{schedule} on pp={p} runs {runs} chunks ({per_rank} per pp rank)",
        hint=_marks_hint(n, runs, schedule, p, per_rank),
    )


def _marks_hint(n: int, runs: int, schedule: str, p: int, per_rank: int) -> str:
    more = "remove" if n > runs else "add"
    fixes = [f"{more} {abs(n - runs)} mark{'s' if abs(n - runs) != 1 else ''}"]
    if n % per_rank == 0 and n // per_rank >= 2:
        fixes.append(f"use pp={n // per_rank} ({schedule} runs {per_rank} chunk{'s' if per_rank > 1 else ''} per rank)")
    kind = schedule_kind(schedule)
    if n % p == 0 and n // p >= 2 and not (kind.takes_virtual and n // p == per_rank):
        fixes.append(f"use --schedule interleaved --virtual {n // p} ({n // p} chunks per rank on pp={p})")
    if n == 2 * p and not kind.folded:
        fixes.append(f"use --schedule dualpipev (2 chunks per rank on pp={p})")
    if n == p and per_rank > 1:
        fixes.append(f"use --schedule 1f1b (1 chunk per rank on pp={p})")
    return "; or ".join(fixes)


def _check_mark_places(graph: Graph) -> None:
    """Marks the DSL cannot write but another frontend could: layers out of range,
    twice, or `@stage` on an op inside a repeat body."""
    for item in graph.body.items:
        if isinstance(item, Repeat) and (len(set(item.stage_layers)) != len(item.stage_layers)
                                         or any(not 0 <= k < item.count for k in item.stage_layers)):
            raise PlanError(f"repeat {item.name} marks layers {list(item.stage_layers)} as chunk starts; "
                            f"each must be a different layer in 0..{item.count - 1}", loc=item.loc)
    for node, repeat in walk_ops(graph.body):
        if repeat is not None and isinstance(node, Op) and node.annotation("stage") is not None:
            raise PlanError(f"@stage on an op inside repeat {repeat.name}: a chunk can only begin at a layer",
                            loc=node.annotation("stage").loc or node.loc,
                            hint=f"mark layers on the repeat instead: repeat {repeat.name} @stage(2) {{ ... }}")


def _mark_name(graph: Graph, unit: Unit) -> str:
    """`layers.4`, or the marked op's value name (its kind, for a temporary) and line."""
    if unit.layer is not None:
        return f"{graph.body.items[unit.start].name}.{unit.layer}"
    op = next(i for i in graph.body.items[unit.start:unit.stop] if isinstance(i, Op) and i.annotation("stage"))
    name = op.kind if "#" in op.out else op.out
    return f"{name} (line {op.loc.line})" if op.loc else name


def _mark_loc(graph: Graph, unit: Unit) -> SourceLoc | None:
    if unit.layer is not None:
        return graph.body.items[unit.start].loc
    op = next(i for i in graph.body.items[unit.start:unit.stop] if isinstance(i, Op) and i.annotation("stage"))
    return op.annotation("stage").loc or op.loc


def _default_microbatches(graph: Graph, mesh: Mesh, p: int, least: int) -> int:
    """pp microbatches (or the schedule's least, if more), else the nearest count that
    splits the local batch: the next larger divisor, or the largest one."""
    local = graph.dim(graph.batch_dim) // mesh.size(MeshAxis.DP, MeshAxis.EP)
    want = max(p, least)
    divisors = [d for d in range(1, local + 1) if local % d == 0]
    return next((d for d in divisors if d >= want), divisors[-1])


def _check_microbatches(graph: Graph, mesh: Mesh, m: int) -> None:
    batch = graph.dim(graph.batch_dim)
    data = mesh.size(MeshAxis.DP, MeshAxis.EP)
    local = batch // data
    if m < 1 or local % m:
        choices = ", ".join(str(d) for d in range(1, local + 1) if local % d == 0)
        raise PlanError(
            f"{graph.batch_dim}={batch} over dp*ep={data} leaves {local} per rank, which does not split into "
            f"{m} microbatches",
            hint=f"choose --microbatches in {{{choices}}}, or change {graph.batch_dim}",
        )


def input_only_items(graph: Graph, name: str) -> tuple[int, ...] | None:
    """The top-level items (indices) that compute value `name` from the inputs alone, in order
    (none: it is an input); None when it depends on a parameter, an activation or a repeat."""
    inputs = {i.name for i in graph.inputs}
    params = {p.name for p in graph.body.params}
    made = {item.out: i for i, item in enumerate(graph.body.items) if isinstance(item, (Op, Redistribute))}
    needed: set[int] = set()
    todo = [name]
    while todo:
        value = todo.pop()
        if value in inputs:
            continue
        if value in params or value not in made:
            return None
        index = made[value]
        if index not in needed:
            needed.add(index)
            item = graph.body.items[index]
            todo.extend(item.reads)
    return tuple(sorted(needed))


def _check_per_microbatch(graph: Graph, m: int) -> None:
    """Ops that see the whole batch at once cannot run one microbatch at a time: an `aten` op
    that runs replicated or along the batch (it may reduce over it), and a loss with
    ignore_index whose targets are computed from more than the inputs (its count spans the
    step: the runtime counts it up front, from the inputs, running the ops that compute the
    targets once more on the whole step's inputs: `runtime/pipeline.py`)."""
    if m == 1:
        return
    inputs = {i.name for i in graph.inputs}
    additive = _added_sums(graph)
    for op, _ in walk_ops(graph.body):
        if not isinstance(op, Op) or op.out in additive:
            continue
        if op.kind == "state_add":
            raise NotSupportedError(
                f"a write of the module buffer {op.attr('state')} in a pipeline of {m} microbatches: each "
                "microbatch's forward would add it, one device's forward adds it once (only a sum over the "
                "batch adds up over the microbatches)", loc=op.loc, hint="use --microbatches 1, or pp=1")
        whole = whole_dims(op) if op.kind == "aten" else frozenset()
        if whole is None or graph.batch_dim in whole:
            how = "runs replicated (no sharding rule)" if whole is None else "runs along the batch"
            raise NotSupportedError(
                f"{op.attr('target')} {how} and sees the whole batch, so it cannot run "
                f"in {m} microbatches", loc=op.loc, hint="use --microbatches 1, or pp=1")
        if counts_targets(op) and op.args[1] not in inputs \
                and input_only_items(graph, op.args[1]) is None:
            raise NotSupportedError(
                f"cross_entropy with ignore_index over targets computed from more than the inputs ({op.args[1]}): "
                f"the count of targets spans the {m} microbatches", loc=op.loc,
                hint="compute the targets from the inputs only (a shift, a mask), pass them as an input, "
                "or use --microbatches 1")


_CASTS = ("aten.to.", "aten._to_copy.")


def _added_sums(graph: Graph) -> set[str]:
    """The `state_add` ops whose value is a sum over the batch (`aten.sum`, then casts) that nothing
    else reads, with that sum and its casts: each microbatch adds its rows' sum, and the
    microbatches' sums add up to the whole batch's (what one device adds)."""
    ops = {op.out: op for op, _ in walk_ops(graph.body) if isinstance(op, Op)}
    readers: dict[str, list[Op]] = {}
    for op in ops.values():
        for a in op.reads:
            readers.setdefault(a, []).append(op)
    out: set[str] = set()
    for op in ops.values():
        if op.kind != "state_add":
            continue
        chain, name = [op.out], op.args[0]
        while name in ops and ops[name].kind == "aten" and str(ops[name].attr("target")).startswith(_CASTS):
            chain.append(name)
            name = ops[name].args[0]
        source = ops.get(name)
        alone = all(len(readers.get(n, [])) == 1 for n in chain[1:] + [name])
        if source is not None and source.kind == "aten" and str(source.attr("target")).startswith("aten.sum.") \
                and alone:
            out.update(chain + [name])
    return out


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
