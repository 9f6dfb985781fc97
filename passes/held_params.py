"""The parameters each pp rank holds, counted: what the memory and time estimates and DualPipe's copy sync sum over.

`chunk_param_names` (passes/chunk_params.py) names every parameter instance a pp rank's
chunks use (`layers.17.wq`), which the runtime needs; the estimates need only how
many copies of each parameter a rank holds, which `held_params` counts in one pass
over the rank's units, whatever the depth of the model.
"""

from __future__ import annotations

from dataclasses import dataclass

from fivedc.ir.graph import Graph, Repeat
from fivedc.passes.chunk_params import outer_params, unit_top_params
from fivedc.passes.stages import PipelineSpec, Unit, units


@dataclass(frozen=True, slots=True)
class HeldParams:
    """The parameters a pp rank's chunks use, counted: the layers of each repeat it holds
    and the top-level parameters its ops read (what `chunk_param_names` names one by one)."""

    layers: tuple[tuple[str, int], ...]  # (repeat name, layers of it on this rank)
    top: frozenset[str]

    def instances(self, param_name: str, repeat: Repeat | None) -> int:
        """How many copies of a parameter (one per layer for a repeat's) this rank holds."""
        if repeat is None:
            return 1 if param_name in self.top else 0
        return dict(self.layers).get(repeat.name, 0)


def held_params(graph: Graph, spec: PipelineSpec, *, pp_rank: int, all_units: list[Unit] | None = None) -> HeldParams:
    """`chunk_param_names(graph, spec, pp_rank=...)` as counts: O(units), whatever the depth."""
    all_units = units(graph) if all_units is None else all_units
    items = graph.body.items
    top = {p.name for p in graph.body.params}
    layers: dict[str, int] = {}
    names: set[str] = set()
    for spec_chunk in spec.chunks:
        if spec_chunk.rank != pp_rank:
            continue
        for unit in all_units[spec_chunk.units[0]:spec_chunk.units[1]]:
            if unit.layer is None:
                names |= unit_top_params(items, unit, top)
            else:
                name = items[unit.start].name
                layers[name] = layers.get(name, 0) + 1
    for name in layers:  # what a repeat's body reads of the top level, once per repeat
        names |= outer_params(next(i for i in items if isinstance(i, Repeat) and i.name == name), top)
    return HeldParams(tuple(sorted(layers.items())), frozenset(names))


def param_count(held: HeldParams | None, param_name: str, repeat: Repeat | None) -> int:
    """Copies of a parameter a rank holds: every layer's without a pipeline (`held` None)."""
    if held is None:
        return repeat.count if repeat is not None else 1
    return held.instances(param_name, repeat)
