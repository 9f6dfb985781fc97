"""One unit's instructions: each node's forward and backward as a rank issues them (a part
of `fivedc/instructions/comm_program.py`, and what the step-time model prices).

A unit (`fivedc.passes.stages.units`: a layer of a repeat, or a run of top-level nodes) runs
its nodes' forwards in program order, then in backward its nodes in reverse: before a node's
backward, the forwards it redoes (`FORWARD_AGAIN`: a recomputed op's own; `LAYER_AGAIN`: at a
layer's recompute point, the whole layer's, its collectives included) and under sequence
parallelism the gathered linear input gathered again for the weight gradients
(`GATHER_AGAIN`). Every instruction names its node and that part (`Event.node`,
`Event.phase`), so that a reader can price it (`fivedc/estimates/unit_costs.py`) or act on it
(`done_again.py`) without deciding again what runs.

`unit_instructions(graph, mesh, ...)` gives each unit's two lists; the class expander
(`_Expander` in comm_program.py) builds on `UnitExpander` and adds the pipeline, the
gradients' sums and the parameters' gathers.
"""

from __future__ import annotations

import itertools
from dataclasses import replace
from typing import TYPE_CHECKING

from fivedc.ir.graph import DType, Graph, Op, Redistribute, Repeat, walk_ops, walk_params
from fivedc.ir.mesh import Mesh
from fivedc.ir.ops import POINTWISE
from fivedc.ir.pointwise import Saves
from fivedc.ir.sharding import Sharding
from fivedc.instructions.events import (BACKWARD, COMPUTE, FORWARD, FORWARD_AGAIN, GATHER_AGAIN, LAYER_AGAIN,
                                        RING_TAG, Event, Run, at_layer, compute, of_node, templated)
from fivedc.instructions.kernel_events import KernelEvents
from fivedc.instructions.sites import Site, sites, trainable
from fivedc.passes.recompute import recomputes_layer, recomputes_op
from fivedc.passes.regather import regathered
from fivedc.passes.stages import PipelineSpec, Unit, units

if TYPE_CHECKING:
    from fivedc.instructions.sync_events import Buckets

TORCH_DTYPES = {"fp64": "float64", "fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}
# Kernels whose backward reads nothing they computed from (autograd saves no tensor for
# them, as for a redistribution): a recomputed layer is redone at the first node from its
# end that is not one of these. The pointwise ops whose definition saves nothing (add, sub).
SAVES_NOTHING = frozenset(kind for kind, pointwise in POINTWISE.items() if pointwise.saves == Saves.NOTHING)
# Kernels whose backward does not read their parameter: ZeRO-3 does not gather it again.
KEEPS_NO_PARAMETER = frozenset({"embedding"})


def unit_instructions(graph: Graph, mesh: Mesh, *, recompute: str, dtype: str, wanted: list[Unit] | None = None
                      ) -> dict[Unit, tuple[tuple[Event, ...], tuple[Event, ...]]]:
    """Unit by unit (those of `wanted`, or all of `units(graph)`), its forward and its backward
    instructions for one microbatch, computations included: a layer's are shared by all layers
    of its repeat. Only the wanted units' nodes are expanded."""
    index = {unit: u for u, unit in enumerate(units(graph))}
    wanted = list(index) if wanted is None else wanted
    expander = UnitExpander(graph, mesh, recompute=recompute, dtype=TORCH_DTYPES[dtype], computations=True,
                            only={index[unit] for unit in wanted})
    out = {}
    for unit in wanted:
        u = index[unit]
        (forward,), (backward,) = expander.unit_runs("forward", u, u + 1), expander.unit_runs("backward", u, u + 1)
        out[unit] = forward.events, backward.events
    return out


def unit_key(graph: Graph, unit: Unit):
    """What units with the same instructions share: a repeat's layers, its name."""
    return graph.body.items[unit.start].name if unit.layer is not None else ("ops", unit.start)


def distinct_units(graph: Graph, units: list[Unit]) -> dict:
    """One unit of each `unit_key` (a repeat's first layer, every top-level run): the units a
    reader of the lists needs (`fivedc/estimates/unit_costs.unit_times`, `done_again`)."""
    return {key: unit for key, unit in reversed([(unit_key(graph, unit), unit) for unit in units])}


class UnitExpander(KernelEvents):
    """Each node's forward and backward instructions, cached per node (a repeat body's for all
    its layers), and a unit's runs of them. `pipeline`, `microbatches`: the plan's (they size
    the events of a batched value, per microbatch)."""

    def __init__(self, graph: Graph, mesh: Mesh, *, recompute: str, dtype: str, pipeline: PipelineSpec | None = None,
                 microbatches: int = 1, shared: bool = True, computations: bool = False,
                 only: set[int] | None = None) -> None:
        self.shared, self.computations = shared, computations
        self.graph, self.mesh, self.recompute, self.dtype = graph, mesh, recompute, dtype
        self.pipeline, self.m = pipeline, microbatches
        self.dims = _dims(graph)
        self.sites = sites(graph, only)  # `only`: of those units (the rest are not expanded)
        self.repeats = {i.name: i for i in graph.body.items if isinstance(i, Repeat)}
        self.trainable = trainable(graph)  # what backward reaches
        self.index = {id(site): i for i, site in enumerate(self.sites)}
        self.unit_sites: dict[int, list[Site]] = {}
        for site in self.sites:
            self.unit_sites.setdefault(site.unit, []).append(site)
        self.units = units(graph)
        self.regather_at = _regather_points(graph, recompute, self.sites)  # site index -> the value gathered again
        # per node of the graph (of a repeat's body: for all its layers), computed once
        self._cache: dict[tuple, list] = {}
        self._chunks: dict[tuple, object] = {}  # units' and chunks' runs, transfers' sizes
        self._numel: dict[tuple, int] = {}  # a value's local elements by its dims and sharding

    def unit_runs(self, what: str, first: int, stop: int, buckets: Buckets | None = None) -> list[Run]:
        """The forward (in order) or backward (in reverse) of units [first, stop), a run per
        unit: a layer's is shared by all layers of its repeat, but where gradient buckets start
        inside it (`buckets`, overlap on): then the shared events with the buckets' inserted."""
        order = range(first, stop) if what == "forward" else reversed(range(first, stop))
        runs = []
        for u in order:
            sites, layer = self.unit_sites.get(u, []), self.units[u].layer
            key = ("unit", what, sites[0].repeat if self.shared and layer is not None and sites else u)
            if key not in self._chunks:
                parts = [self.forward(site) for site in sites] if what == "forward" else \
                    [self.backward(site) for site in reversed(sites)]
                ends = list(itertools.accumulate(map(len, parts)))  # backward: after each site, from the last
                self._chunks[key] = tuple(itertools.chain.from_iterable(parts)), ends
            events, ends = self._chunks[key]
            start = self.index[id(sites[0])] if sites else 0
            started = [(j, buckets.after(start + len(sites) - 1 - j)) for j in range(len(sites))
                       if buckets is not None and start + len(sites) - 1 - j in buckets.at]
            if started:
                cuts = [0] + [ends[j] for j, _ in started]
                events = tuple(itertools.chain.from_iterable(
                    (*events[cuts[i]:cuts[i + 1]], *more) for i, (_, more) in enumerate(started))) + events[cuts[-1]:]
            runs.append(Run(events, layer))
        return runs

    # ---- one node ------------------------------------------------------------------------------
    def forward(self, site: Site) -> list[Event]:
        return self._cached("forward", site, self._forward)

    def backward(self, site: Site) -> list[Event]:
        return self._cached("backward", site, self._backward)

    def at(self, site: Site, events: list[Event]) -> list[Event]:
        """`forward(site)`'s or `backward(site)`'s events as issued at the site's layer."""
        return [at_layer(e, site.layer) for e in events]

    def _cached(self, what: str, site: Site, compute) -> list:
        """`compute(site)` once per node: a repeat's body node's for all its layers (its events
        name the layer `{layer}`), but the parameters an op reads (`params`), which are the
        layer's own."""
        if self.shared and site.repeat is not None and what != "params":
            key = (what, site.repeat, id(site.node))
        else:
            key = (what, self.index[id(site)])
        if key not in self._cache:
            self._cache[key] = compute(site)
        return self._cache[key]

    def _forward(self, site: Site) -> list[Event]:
        node = site.node
        if isinstance(node, Redistribute):
            return of_node(self._steps(node.forward, self.numel(node.type.dims, node.src_sharding),
                                       f"forward of {templated(site)}",
                                       node.loc, "int64" if node.type.dtype == DType.INT else self.dtype,
                                       rings=("all_gather", "reduce_scatter", "all_reduce")), node, FORWARD)
        return of_node(self.computed(site, "forward") + self._kernel_forward(site), node, FORWARD)

    def computed(self, site: Site, what: str) -> list[Event]:
        """The instruction that runs an op's kernel (`what`: forward, backward, forward again),
        where the expander lists computations; its collectives follow it."""
        if not self.computations or not isinstance(site.node, Op):
            return []
        node = site.node
        return [compute(f"{what} of {node.kind} {templated(site)}({', '.join(map(str, node.args))})", node.loc)]

    def _backward(self, site: Site) -> list[Event]:
        node = site.node
        if node.out not in self.trainable:  # no gradient flows through it
            return []
        if isinstance(node, Redistribute):
            return of_node(self._steps(node.backward, self.numel(node.type.dims, node.sharding),
                                       f"backward of {templated(site)}",
                                       node.loc, rings=("all_gather",)), node, BACKWARD)  # a sum's gradient in a ring
        redone, phase = self.redone(site)
        return [self._again(e, phase) for s in redone for e in self.forward(s)] + self.input_again(site) \
            + of_node(self.computed(site, "backward") + self._kernel_backward(site), node, BACKWARD)

    @staticmethod
    def _again(event: Event, phase: str) -> Event:
        """A forward instruction done again in backward (`phase`: `FORWARD_AGAIN`, an op's own,
        or `LAYER_AGAIN`, its layer's): a computation named so."""
        what = event.what.replace("forward of", "forward again of", 1) if event.op == COMPUTE else event.what
        return replace(event, what=what, phase=phase)

    def redone(self, site: Site) -> tuple[list[Site], str]:
        """The sites whose forward backward redoes at `site`, and how: a recomputed layer's, at
        its recompute point (`LAYER_AGAIN`); a recomputed op's own (`FORWARD_AGAIN`)."""
        repeat = self.repeats.get(site.repeat) if site.repeat else None
        if repeat is not None and recomputes_layer(repeat, self.recompute):
            if site != self._recompute_point(site):
                return [], LAYER_AGAIN
            return [s for s in self.sites if s.repeat == site.repeat and s.layer == site.layer], LAYER_AGAIN
        return ([site] if recomputes_op(site.node, repeat, self.recompute) else []), FORWARD_AGAIN

    def saves_params(self, site: Site) -> bool:
        """Whether autograd keeps the parameters this op reads (its backward reads them), not
        inside a recomputed layer, where the recomputation reads them again."""
        if not isinstance(site.node, Op):
            return False
        repeat = self.repeats.get(site.repeat) if site.repeat else None
        whole_layer = repeat is not None and recomputes_layer(repeat, self.recompute)
        return not whole_layer and site.node.kind not in SAVES_NOTHING | KEEPS_NO_PARAMETER

    def input_again(self, site: Site) -> list[Event]:
        """SP: the gathered input of its linears, gathered again at the first backward that reads it."""
        if self.index[id(site)] not in self.regather_at:
            return []
        gathered = self.regather_at[self.index[id(site)]]
        return of_node(self._steps([c for c in gathered.node.forward if c.kind == "all_gather"],
                                   self.numel(gathered.node.type.dims, gathered.node.src_sharding),
                                   f"{templated(gathered)} gathered again for the weight gradients (SP)",
                                   gathered.node.loc), gathered.node, GATHER_AGAIN)

    def _recompute_point(self, site: Site) -> Site | None:
        """Where backward redoes a recomputed layer: at the first of its nodes, from the
        end, that saved a tensor (autograd unpacks it then)."""
        layer = [s for s in self.sites if s.repeat == site.repeat and s.layer == site.layer]
        return next((s for s in reversed(layer) if isinstance(s.node, Op) and s.node.kind not in SAVES_NOTHING), None)

    def _steps(self, collectives, numel: int, what: str, loc, dtype: str | None = None, *,
               rings: tuple[str, ...] = ()) -> list[Event]:
        """`rings`: the kinds that run beside a matmul where the plan says so (`overlaps`): an
        all-gather or reduce-scatter in a ring is its n - 1 hops, an all-reduce by chunks its n
        chunks' all-reduces."""
        out = []
        for c in collectives:
            n = self.mesh.size(*c.axes)
            if n == 1:
                continue
            if c.kind in rings and c.kind in ("all_gather", "reduce_scatter") and c.overlaps:
                hop = numel if c.kind == "all_gather" else numel // n  # a chunk, or a chunk's sum so far
                out += [Event("send_recv", c.axes, hop, dtype or self.dtype, f"{what}: a chunk to the next "
                              "member (collective matmul)", loc, tag=RING_TAG)] * (n - 1)
            elif c.kind in rings and c.kind == "all_reduce" and c.overlaps:  # by chunks, each as the linear makes it
                out += [Event("all_reduce", c.axes, numel // n, dtype or self.dtype, f"{what}: a chunk's sum "
                              "(collective matmul)", loc)] * n
            elif c.kind != "slice":
                out.append(Event(str(c.kind), c.axes, numel, dtype or self.dtype, what, loc))
            numel = numel // n if c.kind in ("slice", "reduce_scatter") else numel * n if c.kind == "all_gather" \
                else numel
        return out

    def _step_forward(self, site: Site) -> list[Event]:
        """`forward(site)` on the whole step's rows at once, as the count up front runs it (not
        cached: its sizes are those of all microbatches together)."""
        m, self.m = self.m, 1
        try:
            return self._forward(site)
        finally:
            self.m = m

    @property
    def plan_bytes(self) -> int:
        return {"float64": 8, "float32": 4}.get(self.dtype, 2)

    def numel(self, dims: tuple[str, ...], sharding: Sharding) -> int:
        key = (dims, sharding, self.m)  # `_step_forward` sizes the whole step's rows (m = 1)
        if key not in self._numel:
            total = self.graph.local_numel(dims, sharding, self.mesh)
            self._numel[key] = total // self.m if self.graph.batch_dim in dims else total
        return self._numel[key]



def _dims(graph: Graph) -> dict[str, tuple[str, ...]]:
    """Every value's dims (inputs, parameters, node outputs, a repeat's args and results)."""
    out = {i.name: i.type.dims for i in graph.inputs} | {p.name: p.dims for p, _ in walk_params(graph.body)}
    for node, _ in walk_ops(graph.body):
        if isinstance(node, Repeat):
            for arg, carried, result in zip(node.body.args, node.carried, node.results):
                out[arg] = out[result] = out[carried]
        else:
            out[node.out] = node.type.dims
    return out


def _regather_points(graph: Graph, recompute: str, all_sites: list[Site]) -> dict[int, Site]:
    """Where backward gathers an SP linear input again (`fivedc.passes.regather.regathered`): at the
    backward of the last linear (in program order) reading it, the first whose backward
    runs; per layer instance. Maps that site's index to the redistribution's site."""
    again = regathered(graph, recompute)
    made = {(s.repeat, s.layer, s.node.out): s for s in all_sites if isinstance(s.node, Redistribute)
            and s.node.out in again}
    last: dict[tuple, int] = {}
    for i, s in enumerate(all_sites):
        if isinstance(s.node, Op) and s.node.args and (s.repeat, s.layer, s.node.args[0]) in made:
            last[(s.repeat, s.layer, s.node.args[0])] = i
    return {i: made[key] for key, i in last.items()}

