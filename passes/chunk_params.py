"""Which parameters a pipeline chunk uses, by name: each lives on the ranks of the chunks that read it.

`chunk_param_names` names every parameter instance a pp rank's chunks (or one
chunk) use (`layers.17.wq`), `held_by_rank` does so for every pp rank;
`passes/held_params.py` counts them instead, for the estimates.
"""

from __future__ import annotations

from fivedc.ir.graph import Graph, Op, Repeat, walk_ops
from fivedc.passes.stages import PipelineSpec, Unit, units


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
