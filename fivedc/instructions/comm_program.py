"""What a rank sends on the wire in one training step, expanded from the plan.

The plan is SPMD: every rank runs the same graph, and what a rank issues depends on
its coordinates only through the pipeline (its pp rank's chunks and schedule
actions). So the ranks fall into *classes*, one per pp rank, and `class_programs`
expands each class's step into the collectives and transfers it issues, in the
runtime's order: the schedule's actions (without a pipeline, one forward and one
backward of the whole graph); in a forward, each node in program order (a
redistribution's steps, a gather or reduce-scatter run in a ring as its n - 1 hops, an
all-reduce run by chunks as its n chunks'; what
a kernel sends inside: vocab-parallel cross-entropy's all-reduces, ring attention's hops, MoE's count exchange, dispatch and combine); in a
backward, the nodes in reverse (a recomputed attention's forward hops first, the
gradient buckets as their last gradient arrives when overlap is on; under sequence parallelism, at the first backward of a gathered
linear input's readers, the all-gather that makes it again); pipeline sends and
receives with their buffers; the tied parameters' sums over the pp ranks holding
them; then the buckets left (ZeRO-1's all of them, reduce-scattered), DualPipe's
exchange of the two copies' gradients, the loss's all-reduce, and ZeRO-1/2's gathers
after the update (those: `fivedc/instructions/sync_events.py`). ZeRO-3 without a pipeline
gathers and reduce-scatters by group inside forward and backward
(`fivedc/instructions/zero3_program.py`).

An `Event` records what must agree between the ranks of its group: the operation,
the group's axes, the elements this rank contributes and their dtype (None: sized at
run time, MoE's rows, whose sizes the count exchange just before agrees). A full
recomputed layer is placed at its backward's start (the runtime redoes it at the
first tensor the layer saved: the same collectives of the same class, a little
later). `fivedc/proof/agreement.py` proves from these programs that every group agrees.
`tests/test_agreement.py` holds them against what the runtime really calls.

`class_instructions` gives the same step with its computations too (an op's forward and
backward, a recomputed op's forward again, a zero-bubble chunk's weight gradients, the
optimizer step): each class's instruction list, which `fivedc show PLAN --program` prints.
The proof's events are that list without its `COMPUTE` instructions (a test holds them so).

`class_runs` gives each class's step as shared `Run`s: a repeat's layer forward and
backward are each built once for all its layers (a site's events depend on its node, not
its layer), a chunk's runs once for every microbatch; `class_programs` flattens them.
"""

from __future__ import annotations

import itertools

from fivedc.ir.graph import DType, Graph, Op, Redistribute, Repeat, param_instances, walk_ops, walk_params
from fivedc.ir.mesh import MeshAxis
from fivedc.ir.ops import POINTWISE
from fivedc.ir.pointwise import Saves
from fivedc.passes.recompute import recomputes_layer, recomputes_op
from fivedc.passes.regather import regathered
from fivedc.ir.sharding import Sharding
from fivedc.instructions.sites import Site, sites, trainable
from fivedc.instructions.events import COMPUTE, RING_TAG, Event, Run, at_layer, compute, flatten, templated
from fivedc.instructions.kernel_events import KernelEvents
from fivedc.instructions.param_facts import ParamFacts
from fivedc.instructions.pipeline_events import PipelineEvents
from fivedc.instructions.sync_events import Buckets, SyncEvents
from fivedc.instructions.zero3_program import zero3_step
from fivedc.passes.overlap import expand_buckets
from fivedc.passes.chunk_params import held_by_rank
from fivedc.passes.stages import units
from fivedc.passes.tied import tied_groups

TORCH_DTYPES = {"fp64": "float64", "fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}
# Kernels whose backward reads nothing they computed from (autograd saves no tensor for
# them, as for a redistribution): a recomputed layer is redone at the first node from its
# end that is not one of these. The pointwise ops whose definition saves nothing (add, sub).
SAVES_NOTHING = frozenset(kind for kind, pointwise in POINTWISE.items() if pointwise.saves == Saves.NOTHING)
# Kernels whose backward does not read their parameter: ZeRO-3 does not gather it again.
KEEPS_NO_PARAMETER = frozenset({"embedding"})


def class_runs(plan, *, shared: bool = True, computations: bool = False) -> dict[int, tuple[Run, ...]]:
    """Per pp rank (a class of ranks), one training step as runs in issue order. The proof
    (`fivedc/proof/agreement.py`) does its work once per distinct run's events, so its cost
    follows the plan's structure, not the layers' repetition, the microbatches or the world
    size. `shared=False` builds each layer's and each site's events apart (the reference
    the tests hold the shared runs against); `computations`: with the `COMPUTE` instructions."""
    expander = _Expander(plan, shared=shared, computations=computations)
    return {rank: expander.runs(rank) for rank in range(plan.mesh.size(MeshAxis.PP))}


def class_instructions(plan) -> dict[int, tuple[Run, ...]]:
    """Per pp rank, one training step as instructions: the proof's events and the
    computations between them, in issue order (shared runs, as `class_runs`)."""
    return class_runs(plan, computations=True)


def rank_instructions(plan, pp_rank: int) -> tuple[Run, ...]:
    """`class_instructions(plan)[pp_rank]`, without expanding the other classes."""
    return _Expander(plan, computations=True).runs(pp_rank)


def class_programs(plan) -> dict[int, tuple[Event, ...]]:
    """Per pp rank (a class of ranks), the events of one training step in issue order."""
    return {rank: flatten(runs) for rank, runs in class_runs(plan).items()}


class _Expander(KernelEvents, SyncEvents, PipelineEvents, ParamFacts):
    def __init__(self, plan, *, shared: bool = True, computations: bool = False) -> None:
        self.shared, self.computations = shared, computations
        self.plan, self.graph, self.mesh = plan, plan.graph, plan.mesh
        self.dtype = TORCH_DTYPES[plan.dtype]
        self.pipeline = plan.pipeline
        self.m = plan.pipeline.microbatches if plan.pipeline is not None else 1
        self.dims = _dims(plan.graph)
        self.sites = sites(plan.graph)
        self.repeats = {i.name: i for i in plan.graph.body.items if isinstance(i, Repeat)}
        self.params = dict(param_instances(plan.graph))  # qualified name -> Param
        self.trainable = trainable(plan.graph)  # what backward reaches
        self.index = {id(site): i for i, site in enumerate(self.sites)}
        self.unit_sites: dict[int, list[Site]] = {}
        for site in self.sites:
            self.unit_sites.setdefault(site.unit, []).append(site)
        self.units = units(plan.graph)
        self.regather_at = _regather_points(plan, self.sites)  # site index -> the redistribution gathered again
        self.tied = tied_groups(plan.graph, plan.pipeline, plan.mesh.size(MeshAxis.PP))
        # per node of the graph (of a repeat's body: for all its layers), computed once
        self._cache: dict[tuple, list] = {}
        self._chunks: dict[tuple, object] = {}  # units' and chunks' runs, transfers' sizes
        self.expanded_buckets = expand_buckets(plan.buckets)
        self._held_by_rank: dict[int, list[str]] | None = None
        self._buckets_by_rank: dict[int, list[tuple[str, ...]]] | None = None
        self._param_names: dict[str | None, set[str]] = {}  # per repeat (None: none), and "": the top level's
        self._numels: dict = {}  # per parameter of the graph: its local elements, its ZeRO chunk
        self.schedule = plan.pipeline.build_schedule(plan.mesh.size(MeshAxis.PP)) if plan.pipeline else None

    # ---- one class ----------------------------------------------------------------------------
    def runs(self, pp_rank: int) -> tuple[Run, ...]:
        mine = self._held(pp_rank)
        overlap = self.plan.overlap and self.pipeline is None and self.plan.zero in (0, 2)
        buckets = Buckets(self, pp_rank, overlap=overlap)
        out: list[Run] = []
        if self.pipeline is None and self.plan.zero == 3:  # gathered and reduce-scattered by group
            out.append(Run(tuple(zero3_step(self))))
        elif self.pipeline is None:
            out += self._units("forward", 0, len(self.units))
            out += self._units("backward", 0, len(self.units), buckets)
        else:
            out.append(Run(tuple(self._pipeline_start(pp_rank, mine))))
            out += self._actions(pp_rank)
            out.append(Run(tuple(self._tied(pp_rank))))
        tail = buckets.rest()
        if self.pipeline is not None and self.plan.zero == 3:
            tail += self._zero3_pipeline_sync(mine)
        if self.pipeline is not None and self.pipeline.kind.pipelines > 1:
            tail += self._copies(pp_rank, mine)
        tail += self._loss()
        if self.computations:
            tail.append(compute("optimizer step: this rank's parameters (its ZeRO chunks)" if self.plan.zero
                                else "optimizer step: this rank's parameters"))
        if self.plan.zero in (1, 2):
            tail += self._gathers(mine, "gather the updated parameters (ZeRO-1/2)")
        tail += self._states()
        out.append(Run(tuple(tail)))
        return tuple(run for run in out if run.events)

    def held_buckets(self, pp_rank: int) -> list[tuple[str, ...]]:
        """The gradient buckets (executions, in launch order) whose parameters this class all
        holds; found for every class in one pass over the buckets."""
        if self._buckets_by_rank is None:
            self._buckets_by_rank = {}
            every = set(range(self.mesh.size(MeshAxis.PP)))
            holders: dict[str, set[int]] = {}
            for rank in every:
                for name in self._held(rank):
                    holders.setdefault(name, set()).add(rank)
            for bucket in self.expanded_buckets:
                for rank in sorted(set.intersection(*(holders.get(n, set()) for n in bucket)) if bucket else every):
                    self._buckets_by_rank.setdefault(rank, []).append(bucket)
        return self._buckets_by_rank.get(pp_rank, [])

    def _held(self, pp_rank: int) -> list[str]:
        """The parameter instances this class holds, in the plan's order."""
        if self.pipeline is None:
            return list(self.params)
        if self._held_by_rank is None:
            by_rank = held_by_rank(self.graph, self.pipeline, self.mesh.size(MeshAxis.PP))
            self._held_by_rank = {r: [n for n in self.params if n in names] for r, names in by_rank.items()}
        return self._held_by_rank[pp_rank]

    def _units(self, what: str, first: int, stop: int, buckets: Buckets | None = None) -> list[Run]:
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
            return self._steps(node.forward, self.numel(node.type.dims, node.src_sharding),
                               f"forward of {templated(site)}",
                               node.loc, "int64" if node.type.dtype == DType.INT else self.dtype,
                               rings=("all_gather", "reduce_scatter", "all_reduce"))
        return self.computed(site, "forward") + self._kernel_forward(site)

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
            return self._steps(node.backward, self.numel(node.type.dims, node.sharding),
                               f"backward of {templated(site)}",
                               node.loc, rings=("all_gather",))  # a sum's gradient back in a ring
        return [self._again(e) for s in self.redone(site) for e in self.forward(s)] + self.input_again(site) \
            + self.computed(site, "backward") + self._kernel_backward(site)

    @staticmethod
    def _again(event: Event) -> Event:
        """A recomputed op's forward instruction, named so."""
        return event if event.op != COMPUTE else compute(event.what.replace("forward of", "forward again of", 1),
                                                         event.loc)

    def redone(self, site: Site) -> list[Site]:
        """The sites whose forward backward redoes at `site`: a recomputed layer's, at its
        recompute point; a recomputed op's own."""
        repeat = self.repeats.get(site.repeat) if site.repeat else None
        if repeat is not None and recomputes_layer(repeat, self.plan.recompute):
            if site != self._recompute_point(site):
                return []
            return [s for s in self.sites if s.repeat == site.repeat and s.layer == site.layer]
        return [site] if recomputes_op(site.node, repeat, self.plan.recompute) else []

    def saves_params(self, site: Site) -> bool:
        """Whether autograd keeps the parameters this op reads (its backward reads them), not
        inside a recomputed layer, where the recomputation reads them again."""
        if not isinstance(site.node, Op):
            return False
        repeat = self.repeats.get(site.repeat) if site.repeat else None
        whole_layer = repeat is not None and recomputes_layer(repeat, self.plan.recompute)
        return not whole_layer and site.node.kind not in SAVES_NOTHING | KEEPS_NO_PARAMETER

    def input_again(self, site: Site) -> list[Event]:
        """SP: the gathered input of its linears, gathered again at the first backward that reads it."""
        if self.index[id(site)] not in self.regather_at:
            return []
        gathered = self.regather_at[self.index[id(site)]]
        return self._steps([c for c in gathered.node.forward if c.kind == "all_gather"],
                           self.numel(gathered.node.type.dims, gathered.node.src_sharding),
                           f"{templated(gathered)} gathered again for the weight gradients (SP)", gathered.node.loc)

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
        total = self.graph.local_numel(dims, sharding, self.mesh)
        return total // self.m if self.graph.batch_dim in dims else total


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


def _regather_points(plan, all_sites: list[Site]) -> dict[int, Site]:
    """Where backward gathers an SP linear input again (`fivedc.passes.regather.regathered`): at the
    backward of the last linear (in program order) reading it, the first whose backward
    runs; per layer instance. Maps that site's index to the redistribution's site."""
    again = regathered(plan.graph, plan.recompute)
    made = {(s.repeat, s.layer, s.node.out): s for s in all_sites if isinstance(s.node, Redistribute)
            and s.node.out in again}
    last: dict[tuple, int] = {}
    for i, s in enumerate(all_sites):
        if isinstance(s.node, Op) and s.node.args and (s.repeat, s.layer, s.node.args[0]) in made:
            last[(s.repeat, s.layer, s.node.args[0])] = i
    return {i: made[key] for key, i in last.items()}

