"""The values live across a pipeline cut: what one chunk sends the next.

A value defined before a cut and read after it crosses the cut (`boundary_values`,
`all_boundary_values` for every cut at once); inputs are on every rank, and
parameters are not sent. `value_types` gives each top-level value's type and
sharding, what a transfer's size is counted from.
"""

from __future__ import annotations

from fivedc.ir.graph import Block, Graph, Op, Redistribute, Repeat
from fivedc.ir.sharding import Sharding
from fivedc.passes.stages import Unit, units


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
