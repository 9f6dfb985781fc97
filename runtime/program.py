"""Executes a plan's program on one rank: kernels, redistributions and repeat blocks.

`Program.loss(params, inputs)` walks the graph in order with this rank's shards.
A `Redistribute` node runs its forward collectives through the autograd-aware
`runtime.collectives.redistribute`, whose backward runs the plan's backward
collectives. A repeat body runs `count` times with `prefix.i.name` parameters.
Parameters live in a flat dict keyed by qualified name (`layers.3.wq`); this
module also makes the initial full parameters and inputs (seeded, so every rank
and the single-device reference start from the same values) and cuts shards.

With activation recomputation (`recompute`, `passes/recompute.py`) a layer of a
repeat (full) or an attention kernel (selective) runs as one region of
`runtime/recompute.run_recomputed`: it keeps its inputs, and backward runs its
forward again. Which, and which gathered values sequence parallelism gathers again, the
program reads from the instruction lists the proof checks and the estimates price
(`fivedc/instructions/done_again.py`). A recomputed layer computes into an environment of its own, so
its intermediate values are not kept alive by the program's either.

Which linears run beside which tensor-parallel collectives is worked out once, from the
plan's graph (`runtime/linear_paths.py`); as it runs, the program makes the live
objects where the run allows (`linear_paths.Overlaps`: the run-time conditions, in one
place) and passes a linear's to its kernel as a `LinearFeed`; a pipeline's units are
blocks of their own (`run_units`), so their paths are read with the top level cut there. Where the plan overlaps a redistribution's backward sum with weight
gradients, the linears reading its output put their dW off until that sum has started
(`runtime/tp_overlap.py`). Where it sums a linear's output as it is made, the
linear feeds the sum and the redistribution returns it. Where it runs a gather in a
ring, the op right after it (a linear) multiplies the chunks as they arrive; the one rule
for finishing a ring: it is whole before any other item runs, and right after its reader
(`_block`; `runtime/tp_ring.py`). The objects that pass from one node to a later
one (a sum to its redistribution, a put-off to its readers) are held by name in a `Live`
per run.
"""

from __future__ import annotations

import zlib
from collections.abc import Collection

import torch
from torch import Tensor

from fivedc.ir.ops import counts_targets
from fivedc.ir.graph import Block, DType, Graph, Op, Redistribute, Repeat, outer_reads, readers, walk_ops
from fivedc.ir.graph import param_instances as qualified_params
from fivedc.passes.stages import units as all_units
from fivedc.instructions.done_again import read_done_again
from fivedc.ir.sharding import Sharding
from fivedc.runtime.collectives import Step, redistribute
from fivedc.runtime.grad_once import counted_once
from fivedc.runtime.kernel_context import KernelContext
from fivedc.runtime.kernels import KERNELS
from fivedc.runtime.recompute import run_recomputed
from fivedc.runtime.regions import CompiledLayers
from fivedc.runtime.saved import mark_regathered
from fivedc.runtime.linear_paths import Live, Overlaps, plan_paths
from fivedc.runtime.tp_ring import RingGather


def grad_groups(graph: Graph, ctx: KernelContext) -> dict[str, object | None]:
    """Each parameter instance's process group over its `grad_partial` axes, where its
    gradient is summed and ZeRO shards it (None: nothing to sum over)."""
    return {name: ctx.group(p.grad_partial) if p.grad_partial else None for name, p in qualified_params(graph)}


def init_params(graph: Graph, *, seed: int, dtype: torch.dtype, meta: bool = False,
                only: Collection[str] | None = None) -> dict[str, Tensor]:
    """Full, unsharded initial parameters; each seeded by its name, so any rank can
    make any of them without making the others (`only`: just these, a pipeline stage's).
    `meta`: shapes without values (a rehearsal)."""
    out = {}
    for name, param in qualified_params(graph):
        if only is not None and name not in only:
            continue
        shape = tuple(graph.dim(d) for d in param.dims)
        if meta:
            out[name] = torch.empty(shape, dtype=dtype, device="meta")
        elif param.init == "ones":
            out[name] = torch.ones(shape, dtype=dtype)
        elif param.init == "zeros":
            out[name] = torch.zeros(shape, dtype=dtype)
        else:
            gen = torch.Generator().manual_seed(seed * 1_000_003 + zlib.crc32(name.encode()))
            out[name] = torch.randn(shape, generator=gen, dtype=dtype) * param.std
    return out


def _int_bound(graph: Graph, name: str) -> int:
    """Exclusive upper bound for an int input: the vocab of the embedding or loss using it,
    also through replicated ops that compute from it (a label shift)."""
    types = {i.name: i.type for i in graph.inputs}
    for node, _ in walk_ops(graph.body):
        if isinstance(node, (Op, Redistribute)):
            types[node.out] = node.type
    users = {name: [node for node, _ in uses] for name, uses in readers(graph.body).items()}
    seen, todo = set(), [name]
    while todo:
        value = todo.pop(0)
        for node in users.get(value, []):
            if isinstance(node, Op) and node.kind == "embedding" and node.args[0] == value:
                return graph.dim(_param_dims(graph, node.args[1])[0])
            if isinstance(node, Op) and node.kind == "cross_entropy" and node.args[1] == value:
                return graph.dim(types[node.args[0]].dims[-1])
            if (isinstance(node, Redistribute) or node.kind == "aten") and node.out not in seen:
                seen.add(node.out)
                todo.append(node.out)
    return 2


def _param_dims(graph: Graph, name: str) -> tuple[str, ...]:
    return next(p.dims for _, p in qualified_params(graph) if p.name == name)


def make_inputs(graph: Graph, *, seed: int, dtype: torch.dtype, meta: bool = False) -> dict[str, Tensor]:
    """The seeded synthetic batch; `meta`: its shapes without values."""
    gen = torch.Generator().manual_seed(seed)
    out = {}
    for item in graph.inputs:
        shape = tuple(graph.dim(d) for d in item.type.dims)
        if meta:
            kind = torch.long if item.type.dtype == DType.INT else dtype
            out[item.name] = torch.empty(shape, dtype=kind, device="meta")
        elif item.type.dtype == DType.INT:
            out[item.name] = torch.randint(0, _int_bound(graph, item.name), shape, generator=gen)
        else:
            out[item.name] = torch.randn(shape, generator=gen, dtype=dtype)
    return out


def shard(full: Tensor, dims: tuple[str, ...], sharding: Sharding, ctx: KernelContext) -> Tensor:
    """This rank's chunk of a full tensor; a dim with a storage order (the sequence
    under cp, experts placed other than contiguously) is reordered first."""
    out = full
    for index, dim in enumerate(dims):
        order = ctx.storage_order(dim, sharding)
        if order is not None:
            out = out.index_select(index, order.to(out.device))
        if sharding.axes_of(dim):
            start, stop = ctx.shard_range(dim, sharding)
            out = out.narrow(index, start, stop - start)
    if out.untyped_storage().nbytes() > out.numel() * out.element_size():  # a slice: not the whole tensor's memory
        return out.clone(memory_format=torch.contiguous_format)
    return out.contiguous()


class Program:
    def __init__(self, graph: Graph, ctx: KernelContext, *, recompute: str = "none", tracer=None,
                 compile: bool | str = False) -> None:
        self.graph, self.ctx = graph, ctx
        self.tracer = tracer  # runtime/trace.ValueTrace: every node's value and gradient (verify's diagnosis)
        # each repeat's layer as one torch.compile region (runtime/regions.py); not while tracing
        self.regions = None
        if compile and tracer is None:
            self.regions = CompiledLayers(self, "inductor" if compile is True else compile)
        self.param_dims = {name: p.dims for name, p in qualified_params(graph)}
        # what backward does again (recomputation, SP's gathers), read from the instruction lists
        self.again = read_done_again(graph, ctx.mesh, recompute=recompute)
        self.steps = {
            node.out: (_steps(node, node.forward), _steps(node, node.backward))
            for node, _ in walk_ops(graph.body)
            if isinstance(node, Redistribute)
        }
        # which linears run beside which collectives (read once from the plan), and when this run can;
        # for a pipeline's units, each a block of its own (made at its first run)
        self.overlaps = Overlaps(plan_paths(graph, self.again), ctx, self.steps)
        self.unit_overlaps: Overlaps | None = None

    def loss(self, params: dict[str, Tensor], inputs: dict[str, Tensor]) -> Tensor:
        env: dict[str, Tensor] = dict(inputs)
        dims = {i.name: i.type.dims for i in self.graph.inputs}
        scope = {p.name: p.name for p in self.graph.body.params}
        self._block(self.graph.body, env, dims, params, scope, live=Live(self.overlaps))
        return env[self.graph.output]

    def losses_ignoring(self) -> list[Op]:
        """The cross-entropy ops with ignore_index (their mean divides by a count of targets)."""
        return [op for op, _ in walk_ops(self.graph.body)
                if isinstance(op, Op) and counts_targets(op)]

    def run_units(self, units, params, env: dict[str, Tensor], dims: dict[str, tuple[str, ...]]) -> None:
        """Run a pipeline chunk: top-level item ranges and single layers of repeats
        (`fivedc.passes.stages.Unit`), reading and extending `env` and `dims`."""
        scope = {p.name: p.name for p in self.graph.body.params}
        if self.unit_overlaps is None:
            pieces = [(unit.start, unit.stop) for unit in all_units(self.graph) if unit.layer is None]
            self.unit_overlaps = Overlaps(plan_paths(self.graph, self.again, pieces=pieces), self.ctx, self.steps)
        items, live = self.graph.body.items, Live(self.unit_overlaps)
        for unit in units:
            if unit.layer is None:
                self._block(Block(items=items[unit.start:unit.stop]), env, dims, params, scope, live=live)
            else:
                self._layer(items[unit.start], unit.layer, env, dims, params, scope, live)

    def _block(self, block: Block, env: dict, dims: dict, params: dict, scope: dict,
               repeat: Repeat | None = None, layer: int | None = None, live: Live | None = None) -> None:
        """Run `block`'s items into `env`. A gather the plan runs in a ring is finished where its
        value's readers are: its chunk reader (`GatherPath.reader`, the op right after it)
        multiplies the chunks as they come and the ring is whole after it; before any other
        item, and at the block's end, the program finishes it first."""
        live = live if live is not None else Live(self.overlaps)
        gathering: tuple[RingGather, str | None] | None = None  # a ring still bringing a value, and its reader
        for item in block.items:
            ring = None  # the ring this item reads by chunks
            if gathering is not None:
                if isinstance(item, Op) and item.out == gathering[1]:
                    ring = gathering[0]
                else:
                    gathering[0].finish()  # anything else waits for the whole value
                gathering = None
            if isinstance(item, Repeat):
                for index in range(item.count):
                    self._layer(item, index, env, dims, params, scope, live)
            elif isinstance(item, Redistribute):
                started = self._redistribute(item, env, dims, params, scope, layer, live)
                if started is not None:
                    gathering = (started, live.overlaps.paths.gathers[item.out].reader)
            else:
                self._op(item, env, dims, params, scope, repeat, layer, live, ring)
            if ring is not None:
                ring.finish()  # done by its reader already, unless that took another path
        if gathering is not None:  # the block ends before its reader (a pipeline unit's last item)
            gathering[0].finish()

    def _op(self, item: Op, env: dict, dims: dict, params: dict, scope: dict, repeat: Repeat | None,
            layer: int | None, live: Live, ring: RingGather | None) -> None:
        """Run one op's kernel into `env`; a linear gets its `LinearFeed` (`ring`: the gather it
        reads by chunks)."""
        args, arg_dims = list(item.args), [None] * len(item.args)  # number literals as they are
        for index, name in item.reads_at:
            if name in scope:
                args[index], arg_dims[index] = params[scope[name]], self.param_dims[scope[name]]
            else:
                args[index], arg_dims[index] = env[name], dims[name]
        for index, spec in enumerate(item.arg_specs):
            if spec is not None and spec.grad_once:
                args[index] = counted_once(args[index], spec.grad_once, self.ctx.coords)
        summing = live.overlaps.start_sum(item.out)
        if summing is not None:
            live.sums[item.out] = summing  # for its redistribution
        feed = live.overlaps.feed(item, live, ring, summing, tracing=self.tracer is not None)
        if self.again.op(item, repeat):
            out = run_recomputed(self.ctx, KERNELS[item.kind], self.ctx, item, args, arg_dims)
        elif feed is not None:  # a linear beside collectives (its kernel is kernels._linear: LINEAR_KINDS)
            out = KERNELS[item.kind](self.ctx, item, args, arg_dims, feed)
        else:
            out = KERNELS[item.kind](self.ctx, item, args, arg_dims)
        env[item.out] = self._traced(item.out, layer, out)
        dims[item.out] = item.type.dims

    def _redistribute(self, item: Redistribute, env: dict, dims: dict, params: dict, scope: dict,
                      layer: int | None, live: Live) -> RingGather | None:
        """Run a redistribution into `env`; the ring still bringing its value, if it runs in one.
        A sum its source's maker ran (`live.sums`) is finished here if the maker did not feed it."""
        forward, backward = self.steps[item.out]
        summing = live.sums.pop(item.src, None)
        put_off = live.overlaps.put_off(item, env[item.src], lambda name: params[scope[name]])
        if put_off is not None:  # the linears reading it compute dW while its backward sum runs
            live.put_offs[item.out] = put_off
        else:
            live.put_offs.pop(item.out, None)
        if summing is not None:
            summing.finish(env[item.src])
        ring = live.overlaps.start_gather(item, env[item.src])
        out = redistribute(env[item.src], forward, backward, self.ctx.groups, put_off, ring or summing)
        if summing is not None:
            summing.out = None  # the value is `out` now: the sum (kept for backward's ring) lets go of it
        if ring is not None and self.tracer is not None:  # the tracer copies the value now: the same hops,
            ring.finish()  # waited at once; no reader takes them by chunks
            ring = None
        out = self._traced(item.out, layer, out)
        if item.out in self.again.gathered:  # sequence parallelism: backward gathers it again
            # (marked after tracing: an injected fault's perturbed copy is gathered again too,
            # so every rank issues the same collectives; backward sees the unperturbed value)
            note = mark_regathered(out, env[item.src], forward, self.ctx.groups)
            if put_off is not None:  # its readers' dW gathers it again by this note, in or out of a saving scope
                put_off.regathered(out, note)
        env[item.out] = out
        dims[item.out] = item.type.dims
        return ring

    def _traced(self, name: str, layer: int | None, out: Tensor) -> Tensor:
        return out if self.tracer is None else self.tracer.record(name, layer, out)

    def _layer(self, item: Repeat, layer: int, env: dict, dims: dict, params: dict, scope: dict,
               live: Live | None = None) -> None:
        """One iteration: the carried values enter (layer 0) or the previous layer's,
        kept under the results' names, and the body's yields become the results."""
        sources = item.carried if layer == 0 else item.results
        for arg, source in zip(item.body.args, sources):
            env[arg] = env[source]
            dims[arg] = dims[source]
        inner = {**scope, **{p.name: f"{item.name}.{layer}.{p.name}" for p in item.body.params}}
        if self.again.layer(item):
            self._recomputed_layer(item, layer, env, dims, params, inner)
        elif self.regions is not None:
            self.regions.run(item, env, dims, params, scope, inner)
        else:
            self._block(item.body, env, dims, params, inner, item, layer, live)
        for result, value, source in zip(item.results, item.body.yields, sources):
            env[result] = env[value]
            dims[result] = dims[source]

    def _recomputed_layer(self, item: Repeat, index: int, env: dict, dims: dict, params: dict, scope: dict) -> None:
        """One layer as a recomputed region: it reads only the values it takes from outside
        (bound now: `env` moves on to the next layer), computes in an environment of its
        own and hands back its yields; `dims` gets the body's dims (they are the same for
        every run)."""
        taken = {name: env[name] for name in outer_reads(item.body) if name in env}

        def layer() -> tuple:
            local, local_dims = dict(taken), dict(dims)
            self._block(item.body, local, local_dims, params, scope, item, index)
            dims.update(local_dims)
            return tuple(local[name] for name in item.body.yields)

        for name, value in zip(item.body.yields, run_recomputed(self.ctx, layer, holding=tuple(taken.values()))):
            env[name] = value


def _steps(node: Redistribute, collectives) -> tuple[Step, ...]:
    """The runtime steps of a redistribution: dim names become indices of its tensor."""
    index = node.type.dims.index
    return tuple(
        Step(str(c.kind), c.axes, None if c.dim is None else index(c.dim), None if c.dim2 is None else index(c.dim2))
        for c in collectives
    )
