"""Pipeline stages: the model cut into contiguous chunks of layers, balanced by cost.

The unit of partitioning is a *unit*: one layer of a repeat block, or a run of
top-level ops between repeats (the embedding before the first repeat, the final
norm, head and loss after the last); a top-level op marked `@stage` starts a new
run, and so does one marked `@layer(path)`, the first op of a layer the frontend
inlined (`fivedc/frontends/fx/marks.py`: each a unit of its own, cut only where balance
wants). Units run in order and are cut into `pp * v` chunks (v chunks per rank for
interleaved or V schedules) in one of three ways (`CUTS`): where the model marks
them (`marked_ranges`: `@stage` ops and `Repeat.stage_layers`), as a layout given
in layers says (`layout_ranges`), or by `partition`, so the most expensive chunk is
as cheap as it can be.
The schedule's placement puts chunk c on a pp rank. Values live across a cut are
what one chunk sends the next (`boundary_values`); inputs are on every rank, and
parameters are not sent: each lives on the ranks of the chunks that use it (a tied
table used by the first and the last chunk on both: `passes/tied.py`).
`passes/stage_plan.py` turns these into the plan's `PipelineSpec`.

Cost of an op: its multiply-adds on one rank (linear: output elements x contracted
size; attention: queries x keys x head dim, twice), else its output elements.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

from fivedc.errors import PlanError
from fivedc.ir.graph import Block, Graph, Op, Redistribute, Repeat, walk_ops
from fivedc.ir.sharding import Sharding
from fivedc.ir.limits import check_microbatches
from fivedc.ir.mesh import Mesh
from fivedc.schedule import Schedule, ScheduleKind, make_schedule, schedule_kind


@dataclass(frozen=True, slots=True)
class Unit:
    """Top-level items [start, stop), or layer `layer` of the repeat at item `start`;
    `marked`: the model marks a pipeline chunk as beginning here."""

    start: int
    stop: int
    layer: int | None = None
    marked: bool = False

    def describe(self, graph: Graph) -> str:
        if self.layer is None:
            ops = [i for i in graph.body.items[self.start:self.stop] if isinstance(i, Op)]
            layer = next((op.annotation("layer") for op in ops[:1] if op.annotation("layer")), None)
            if layer is not None and layer.args:
                return str(layer.args[0])
            return "+".join(dict.fromkeys(op.kind for op in ops)) or "ops"
        return f"{graph.body.items[self.start].name}.{self.layer}"


@dataclass(frozen=True, slots=True)
class Chunk:
    index: int
    rank: int  # pp rank
    units: tuple[int, int]  # [first, stop) into `units(graph)`
    what: str  # e.g. "embedding, layers.0-3"
    cost: float  # multiply-adds per step on one rank (see `op_cost`)
    param_bytes: int
    sends: tuple[str, ...] = ()  # values passed to the next chunk


# How the chunks were cut, as the plan's summary says it.
CUTS = {
    "cost": "balanced by cost",
    "layout": "layers per chunk from --pp-layout",
    "marks": "cut at the model's @stage marks",
}


@dataclass(frozen=True, slots=True)
class PipelineSpec:
    schedule: str
    microbatches: int
    virtual: int  # chunks per rank
    chunks: tuple[Chunk, ...]
    cut: str = "cost"  # a key of CUTS

    def __post_init__(self) -> None:
        if self.cut not in CUTS:
            raise PlanError(f"unknown pipeline cut {self.cut!r}; one of {', '.join(CUTS)}")
        if isinstance(self.microbatches, int):
            check_microbatches(self.microbatches, chunks=len(self.chunks))

    @property
    def kind(self) -> ScheduleKind:
        """What the schedule is (chunks per rank, placement, copies, split backward), by property."""
        return schedule_kind(self.schedule)

    def build_schedule(self, pp: int) -> Schedule:
        """The schedule as data (`fivedc/schedule/`), regenerated from its name."""
        return cached_schedule(self.schedule, pp, self.microbatches, self.kind.virtual(self.virtual))


@functools.lru_cache(maxsize=256)
def cached_schedule(name: str, p: int, m: int, v: int | None) -> Schedule:
    """`make_schedule`, kept for reuse: a schedule is immutable data, and the plan's
    memory, its time and the layout search each play the same one."""
    return make_schedule(name, p, m, v)


def units(graph: Graph) -> list[Unit]:
    """The units in order. A marked op begins a unit together with the redistributions
    just before it (communication insertion put them there for that op)."""
    items = graph.body.items
    out: list[Unit] = []
    start, marked = None, False
    for index, item in enumerate(items):
        if isinstance(item, Repeat):
            if start is not None:
                out.append(Unit(start, index, marked=marked))
                start = None
            marks = set(item.stage_layers)
            out += [Unit(index, index + 1, layer, layer in marks) for layer in range(item.count)]
            continue
        if start is None:
            start, marked = index, False
        if isinstance(item, Op) and (item.annotation("stage") or item.annotation("layer")) is not None:
            cut = index
            while cut > start and isinstance(items[cut - 1], Redistribute):
                cut -= 1
            if cut > start:
                out.append(Unit(start, cut, marked=marked))
                start, marked = cut, False
            marked = marked or item.annotation("stage") is not None
    if start is not None:
        out.append(Unit(start, len(items), marked=marked))
    return out


def has_marks(graph: Graph) -> bool:
    """Whether the model marks any pipeline chunk boundary (`@stage`, `stage_layers`)."""
    return any(
        (isinstance(i, Op) and i.annotation("stage") is not None) or (isinstance(i, Repeat) and i.stage_layers)
        for i in graph.body.items
    )


def marked_ranges(all_units: list[Unit]) -> list[tuple[int, int]]:
    """The unit ranges between marks (a mark on the first unit cuts nothing)."""
    cuts = [k for k, unit in enumerate(all_units) if unit.marked and k > 0]
    return list(zip([0, *cuts], [*cuts, len(all_units)]))


def op_cost(graph: Graph, op: Op, mesh: Mesh, types: dict) -> float:
    out = graph.local_numel(op.type.dims, op.sharding, mesh)
    if op.kind in ("linear", "matmul"):
        x = types.get(op.args[0])
        contracted = [d for d in (x.dims if x else ()) if d not in op.type.dims]
        spec = op.arg_specs[0].sharding if op.arg_specs and op.arg_specs[0] else None
        return float(out * max(1, graph.local_numel(tuple(contracted), spec, mesh) if spec else 1))
    if op.kind == "attention":
        k_spec = op.arg_specs[1].sharding
        seq = graph.local_size(graph.seq_dim, k_spec, mesh)
        return 2.0 * out * seq
    return float(out)


@dataclass(frozen=True, slots=True)
class UnitCosts:
    """Per unit: its cost, the bytes of its own parameters (a layer's), and the top-level
    parameters it reads (a tied table is read by two units: a chunk counts it once,
    `chunk_param_bytes`); the bytes of each top-level parameter."""

    costs: tuple[float, ...]
    own_bytes: tuple[int, ...]
    reads: tuple[frozenset[str], ...]
    top_bytes: dict[str, int]

    def chunk_param_bytes(self, first: int, stop: int) -> int:
        read = frozenset().union(*self.reads[first:stop])
        return sum(self.own_bytes[first:stop]) + sum(self.top_bytes[n] for n in read)


def unit_costs(graph: Graph, mesh: Mesh, dtype_bytes: int) -> UnitCosts:
    """Cost and parameter bytes of every unit."""
    types = {}
    for node, _ in walk_ops(graph.body):
        if isinstance(node, (Op, Redistribute)):
            types[node.out] = node.type
    for item in graph.inputs:
        types[item.name] = item.type

    def block_cost(items) -> float:
        return sum(op_cost(graph, i, mesh, types) for i in items if isinstance(i, Op))

    def params_bytes(params) -> int:
        return sum(graph.local_numel(p.dims, p.sharding, mesh) for p in params) * dtype_bytes

    items, top = graph.body.items, {p.name for p in graph.body.params}
    costs, sizes, reads, layers = [], [], [], {}
    for unit in units(graph):
        if unit.layer is not None:  # every layer of a repeat costs the same
            if unit.start not in layers:
                body = items[unit.start].body
                layers[unit.start] = (block_cost(body.items), params_bytes(body.params),
                                      frozenset(outer_params(items[unit.start], top)))
            cost, size, read = layers[unit.start]
        else:
            cost, size = block_cost(items[unit.start:unit.stop]), 0
            read = frozenset(unit_top_params(items, unit, top))
        costs.append(cost)
        sizes.append(size)
        reads.append(read)
    top_bytes = {p.name: params_bytes((p,)) for p in graph.body.params}
    return UnitCosts(tuple(costs), tuple(sizes), tuple(reads), top_bytes)


def partition(costs: list[float], parts: int, *, what: str = "units") -> list[tuple[int, int]]:
    """Contiguous ranges, `parts` of them, each non-empty, minimising the largest sum."""
    check_enough(len(costs), parts, what)
    low, high = max(costs), sum(costs)
    for _ in range(60):
        if high - low <= high * 1e-13:  # closer than `_greedy`'s tolerance tells apart
            break
        mid = (low + high) / 2
        if _groups_needed(costs, mid) <= parts:
            high = mid
        else:
            low = mid
    ranges = _greedy(costs, high)
    while len(ranges) < parts:  # split the largest multi-unit range; the maximum cannot grow
        k = max((i for i, (a, b) in enumerate(ranges) if b - a > 1), key=lambda i: sum(costs[slice(*ranges[i])]))
        a, b = ranges[k]
        cut = _best_cut(costs, a, b)
        ranges[k:k + 1] = [(a, cut), (cut, b)]
    return ranges


def check_enough(n: int, parts: int, what: str) -> None:
    if n < parts:
        raise PlanError(f"the model has {n} {what} but the pipeline needs {parts} chunks",
                        hint=f"use pp * virtual stages <= {n}")


def _groups_needed(costs: list[float], limit: float) -> int:
    return len(_greedy(costs, limit))


def _greedy(costs: list[float], limit: float) -> list[tuple[int, int]]:
    ranges, start, total = [], 0, 0.0
    for i, cost in enumerate(costs):
        if total + cost > limit * (1 + 1e-12) and i > start:
            ranges.append((start, i))
            start, total = i, 0.0
        total += cost
    ranges.append((start, len(costs)))
    return ranges


def _best_cut(costs: list[float], a: int, b: int) -> int:
    return min(range(a + 1, b), key=lambda c: max(sum(costs[a:c]), sum(costs[c:b])))


def layout_ranges(layers_per_chunk: tuple[int, ...], graph: Graph) -> list[tuple[int, int]]:
    """Unit ranges for a layout given in repeat layers per chunk; the ops before the
    first layer join the first chunk, the ops after the last layer the last chunk."""
    all_units = units(graph)
    layer_units = [i for i, u in enumerate(all_units) if u.layer is not None]
    if sum(layers_per_chunk) != len(layer_units) or min(layers_per_chunk) < 0:
        raise PlanError(f"the layout {','.join(map(str, layers_per_chunk))} places {sum(layers_per_chunk)} layers, "
                        f"but the model has {len(layer_units)}", hint="give one count per chunk, summing to the layers")
    ranges, position = [], 0
    for k, count in enumerate(layers_per_chunk):
        first = 0 if k == 0 else layer_units[position]
        position += count
        stop = len(all_units) if k == len(layers_per_chunk) - 1 else layer_units[position]
        if stop <= first:
            raise PlanError(f"chunk {k} of the layout {','.join(map(str, layers_per_chunk))} would be empty",
                            hint="give every chunk at least one layer (the first and last may take only ops)")
        ranges.append((first, stop))
    return ranges


# ---- values live across a cut -------------------------------------------------------------
def _names_read(block: Block) -> set[str]:
    read: set[str] = set()
    for item in block.items:
        if isinstance(item, (Op, Redistribute)):
            read.update(item.reads)
        elif isinstance(item, Repeat):
            read |= set(item.carried) | (_names_read(item.body) - _names_defined(item.body) - set(item.body.args))
    return read


def _names_defined(block: Block) -> set[str]:
    out: set[str] = set()
    for item in block.items:
        out.update(item.writes)
    return out


def unit_uses_defs(graph: Graph, unit: Unit) -> tuple[set[str], set[str]]:
    params = {p.name for p in graph.body.params}
    if unit.layer is None:
        block = Block(items=graph.body.items[unit.start:unit.stop])
        return _names_read(block) - params - _names_defined(block), _names_defined(block)
    repeat = graph.body.items[unit.start]
    body = repeat.body
    inner = _names_read(body) - _names_defined(body) - set(body.args) - {p.name for p in body.params} - params
    carried = set(repeat.carried) if unit.layer == 0 else set(repeat.results)
    return carried | inner, set(repeat.results)


def all_boundary_values(graph: Graph) -> list[tuple[str, ...]]:
    """`boundary_values(graph, cut)` for every cut 0..len(units), in one sweep."""
    all_units = units(graph)
    inputs = {i.name for i in graph.inputs}
    pairs = [unit_uses_defs(graph, unit) for unit in all_units]
    used_from: list[set[str]] = [set() for _ in range(len(pairs) + 1)]
    for k in range(len(pairs) - 1, -1, -1):
        used_from[k] = used_from[k + 1] | pairs[k][0]
    out, defined = [], set()
    for k in range(len(pairs) + 1):
        out.append(tuple(sorted((defined & used_from[k]) - inputs)))
        if k < len(pairs):
            defined |= pairs[k][1]
    return out


def boundary_values(graph: Graph, cut: int) -> tuple[str, ...]:
    """Values defined before unit `cut` and read from it on (inputs excluded), sorted."""
    all_units = units(graph)
    inputs = {i.name for i in graph.inputs}
    defined, used = set(), set()
    for k, unit in enumerate(all_units):
        uses, defs = unit_uses_defs(graph, unit)
        if k < cut:
            defined |= defs
        else:
            used |= uses
    return tuple(sorted((defined & used) - inputs))


def chunk_starts(graph: Graph, spec: PipelineSpec | None) -> frozenset[int]:
    """The top-level items at which a pipeline chunk begins (none without a pipeline)."""
    if spec is None:
        return frozenset()
    all_units = units(graph)
    return frozenset(all_units[c.units[0]].start for c in spec.chunks if all_units[c.units[0]].layer is None)


# ---- which parameters a chunk uses ------------------------------------------------------------
def chunk_param_names(graph: Graph, spec: PipelineSpec, *, pp_rank: int | None = None,
                      chunk: int | None = None, all_units: list[Unit] | None = None) -> set[str]:
    """Qualified names of the parameters a pp rank's chunks (or one chunk) use (`all_units`:
    `units(graph)`, when the caller has them)."""
    all_units = units(graph) if all_units is None else all_units
    items = graph.body.items
    top = {p.name for p in graph.body.params}
    names: set[str] = set()
    repeats: set[int] = set()
    for spec_chunk in spec.chunks:
        if (pp_rank is not None and spec_chunk.rank != pp_rank) or (chunk is not None and spec_chunk.index != chunk):
            continue
        chunk_units = all_units[spec_chunk.units[0]:spec_chunk.units[1]]
        for unit in chunk_units:
            if unit.layer is None:
                names |= unit_top_params(items, unit, top)
            else:
                repeat = items[unit.start]
                names |= {f"{repeat.name}.{unit.layer}.{p.name}" for p in repeat.body.params}
                repeats.add(unit.start)
    for start in repeats:  # what a repeat's body reads of the top level, once per repeat
        names |= outer_params(items[start], top)
    return names


def held_by_rank(graph: Graph, spec: PipelineSpec, pp: int) -> dict[int, set[str]]:
    """`chunk_param_names` of every pp rank, the units found once."""
    all_units = units(graph)
    return {r: chunk_param_names(graph, spec, pp_rank=r, all_units=all_units) for r in range(pp)}


def unit_top_params(items, unit: Unit, top: set[str]) -> set[str]:
    """The top-level parameters the ops of a unit outside any repeat read."""
    return {a for item in items[unit.start:unit.stop] if isinstance(item, Op)
            for a in item.reads if a in top}


def outer_params(repeat: Repeat, top: set[str]) -> set[str]:
    """Top-level parameters the ops of a repeat's body read."""
    used = set()
    for node, _ in walk_ops(repeat.body):
        if isinstance(node, Op):
            used |= {a for a in node.reads if a in top}
    return used



def value_types(graph: Graph) -> dict[str, tuple]:
    """Type and sharding of every top-level value (what a chunk boundary can carry)."""
    out = {i.name: (i.type, i.sharding or Sharding()) for i in graph.inputs}
    for item in graph.body.items:
        if isinstance(item, Repeat):
            for result, carried, sharding in zip(item.results, item.carried, item.carried_shardings):
                out[result] = (out[carried][0], sharding)
        elif isinstance(item, Redistribute):
            out[item.out] = (item.type, item.sharding)
        else:
            out[item.out] = (item.type, item.sharding)
    return out
