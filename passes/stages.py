"""Pipeline stages: the model cut into contiguous chunks of layers, balanced by cost.

The unit of partitioning is a *unit*: one layer of a repeat block, or a run of
top-level ops between repeats (the embedding before the first repeat, the final
norm, head and loss after the last); a top-level op marked `@stage` starts a new
run, and so does one marked `@layer(path)`, the first op of a layer the frontend
inlined (`fivedc/frontends/fx/marks.py`: each a unit of its own, cut only where balance
wants). Units run in order and are cut into `pp * v` chunks (v chunks per rank for
interleaved or V schedules) in one of three ways (`CUTS`): where the model marks
them (`marked_ranges`: `@stage` ops and `Repeat.stage_layers`), as a layout given
in layers says (`layout_ranges`, `passes/stage_cuts.py`), or by `partition`
(`passes/stage_cuts.py`), so the most expensive chunk is as cheap as it can be,
each unit costed by `passes/stage_costs.py`.
The schedule's placement puts chunk c on a pp rank. Values live across a cut are
what one chunk sends the next (`boundary_values`, `passes/stage_values.py`); inputs
are on every rank, and parameters are not sent: each lives on the ranks of the chunks
that use it (`passes/chunk_params.py`; a tied table used by the first and the last
chunk on both: `passes/tied.py`).
`passes/stage_plan.py` turns these into the plan's `PipelineSpec`.

This file owns the data: `Unit`, `Chunk`, `PipelineSpec`, the units of a graph, and
where the model marks chunk boundaries.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

from fivedc.errors import PlanError
from fivedc.ir.graph import Graph, Op, Redistribute, Repeat
from fivedc.ir.limits import check_microbatches
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


def chunk_starts(graph: Graph, spec: PipelineSpec | None) -> frozenset[int]:
    """The top-level items at which a pipeline chunk begins (none without a pipeline)."""
    if spec is None:
        return frozenset()
    all_units = units(graph)
    return frozenset(all_units[c.units[0]].start for c in spec.chunks if all_units[c.units[0]].layer is None)

