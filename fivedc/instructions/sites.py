"""Where a plan computes its values: every op and redistribution in program order.

A *site* is one node of the graph at one layer of its repeat (top-level nodes have
no layer): the unit in which verify's diagnosis compares values, and the name a
user gives `fivedc verify --inject-fault`. `fivedc show PLAN --ops` lists the nodes
with their ids: a top-level node's id is its value name (`logits`); a node in a
repeat body is `REPEAT.LAYER.NAME` (`layers.2.q`), as parameters are named, and its
bare name means layer 0. `pp_rank_of` says which pipeline stage computes a site.
"""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import dataclass

from fivedc.errors import FivedcError
from fivedc.ir.graph import DType, Graph, Op, Redistribute, Repeat, walk_params
from fivedc.ir.mesh import MeshAxis
from fivedc.passes.stages import PipelineSpec, units

Node = Op | Redistribute


@dataclass(frozen=True, slots=True)
class Site:
    node: Node
    layer: int | None = None  # in a repeat: which iteration
    repeat: str | None = None  # the repeat's name
    unit: int = 0  # index into `fivedc.passes.stages.units(graph)`: what a pipeline chunk holds

    @property
    def value(self) -> str:
        return self.node.out

    @property
    def id(self) -> str:
        return self.value if self.repeat is None else f"{self.repeat}.{self.layer}.{self.value}"

    @property
    def kind(self) -> str:
        return self.node.kind if isinstance(self.node, Op) else "redistribute"


def sites(graph: Graph, only: Collection[int] | None = None) -> list[Site]:
    """Every node at every layer, in the order a rank computes them (`only`: of those units)."""
    out: list[Site] = []
    for index, unit in enumerate(units(graph)):
        if only is not None and index not in only:
            continue
        if unit.layer is None:
            out += [Site(item, unit=index) for item in graph.body.items[unit.start:unit.stop]]
            continue
        repeat = graph.body.items[unit.start]
        out += [Site(node, unit.layer, repeat.name, index) for node in _nodes(repeat.body.items)]
    return out


def _nodes(items) -> list[Node]:
    found: list[Node] = []
    for item in items:
        if isinstance(item, Repeat):  # a nested repeat is not made by either frontend
            raise FivedcError(f"repeat {item.name} inside a repeat body has no sites")
        found.append(item)
    return found


def graph_nodes(graph: Graph) -> list[tuple[Node, Repeat | None]]:
    """Each node once (a repeat body's once, not per layer), in program order."""
    out: list[tuple[Node, Repeat | None]] = []
    for item in graph.body.items:
        if isinstance(item, Repeat):
            out += [(node, item) for node in _nodes(item.body.items)]
        else:
            out.append((item, None))
    return out


def pp_rank_of(site: Site, pipeline: PipelineSpec | None) -> int | None:
    """The pp rank whose chunk computes `site` (None without a pipeline: every rank)."""
    if pipeline is None:
        return None
    return next(c.rank for c in pipeline.chunks if c.units[0] <= site.unit < c.units[1])


def find_site(graph: Graph, text: str) -> Site:
    """The site an id names: `NAME` (layer 0 in a repeat) or `REPEAT.LAYER.NAME`."""
    every = sites(graph)
    by_id = {s.id: s for s in every} | {s.value: s for s in reversed(every) if s.layer in (None, 0)}
    if text in by_id:
        return by_id[text]
    hint = "fivedc show PLAN --ops lists the ids (NAME, or REPEAT.LAYER.NAME in a layer stack)"
    for repeat in (i for i in graph.body.items if isinstance(i, Repeat)):
        layer, _, name = text.removeprefix(repeat.name + ".").partition(".")
        if text.startswith(repeat.name + ".") and name in {n.out for n in repeat.body.items}:
            raise FivedcError(f"{text}: {repeat.name} has {repeat.count} layers (0 to {repeat.count - 1}), "
                              f"not {layer}", hint=hint)
    raise FivedcError(f"no op or redistribution computes {text!r} in {graph.name}", hint=hint)


def is_float(site: Site) -> bool:
    return site.node.type is not None and site.node.type.dtype == DType.FLOAT


def ranks_computing(site: Site, pipeline: PipelineSpec | None, mesh) -> list[int]:
    """The ranks that compute `site`: all, or those of its pipeline stage."""
    stage = pp_rank_of(site, pipeline)
    return [r for r in range(mesh.world) if stage is None or mesh.coords(r)[MeshAxis.PP] == stage]


def data_dependent(graph: Graph) -> set[str]:
    """The values computed from the inputs (through any chain of ops): those a pipeline's
    microbatches compute in parts; the rest (from parameters and constants alone) every
    microbatch computes whole."""
    return computed_from(graph, {i.name for i in graph.inputs})


def trainable(graph: Graph) -> set[str]:
    """The values computed from a parameter: those backward computes a gradient for."""
    return computed_from(graph, {p.name for p, _ in walk_params(graph.body)})


def computed_from(graph: Graph, roots: set[str]) -> set[str]:
    """`roots` and every value computed from one of them, through any chain of nodes."""
    found = set(roots)
    for _ in range(2):  # a repeat's yields feed its args from the second layer on
        for item in graph.body.items:
            if isinstance(item, Repeat):
                found |= {a for a, c, y in zip(item.body.args, item.carried, item.body.yields)
                          if c in found or y in found}
                found |= _spread(item.body.items, found)
                found |= {r for r, y in zip(item.results, item.body.yields) if y in found}
            else:
                found |= _spread((item,), found)
    return found


def _spread(items, found: set[str]) -> set[str]:
    found = set(found)
    for node in items:
        reads = node.reads
        if any(r in found for r in reads):
            found.add(node.out)
    return found
