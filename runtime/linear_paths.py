"""Which linears run beside which collectives: worked out once per program from the plan's graph.

Communication insertion marks three overlaps of a tensor-parallel collective with a
linear (`Collective.overlaps`, `passes/communication.py`). `plan_paths(graph,
again)` reads them once per `Program` (`runtime/program.py`) into frozen
records, by the name of the value each node makes:

- `GatherPath`, per redistribution whose forward all-gather runs in a ring
  (`tp_ring.RingGather`): `reader`, the op right after it that multiplies the value
  chunk by chunk as the ring brings it (None: the value is made whole before that op);
- `SumPath`, per value a redistribution sums as the op making it runs (a reduce-scatter
  in a ring, `tp_ring.RingSum`; an all-reduce by chunks, `tp_ring.ChunkedSum`): the
  redistribution, and whether its maker is a linear that feeds the sum chunk by chunk;
- `PutOffPath`, per redistribution whose backward sum runs behind its readers' weight
  gradients (`tp_overlap.PutOff`): the readers' weights, by name in its block;
- `LinearPath`, per linear (or matmul) with any of these: the redistribution whose ring
  brings its input, whether it feeds the sum of its output, and the redistribution whose
  backward sum its dW is put off behind, with its weight's index there.

A pipeline runs the top level's items by units, each a block of its own: its paths are
read with the top level cut there (`plan_paths(..., pieces=)`), as the program ran them.

At run time `Overlaps` makes the live objects where the run allows, and the program hands
a linear's kernel the ones it works with as a `LinearFeed` (`runtime/kernels._linear`):
nothing travels on tensors or on the kernel context. What depends on the run is checked
there, in one place: whether the group has one member, whether torch.compile is tracing,
whether grad is enabled, whether a zero-bubble store defers dW, whether verify traces
values. (The kernel itself checks grad and the store again to pick its autograd path.)
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Sequence

import torch
from torch import Tensor

from fivedc.ir.graph import Block, Graph, Op, Redistribute, Repeat, walk_ops
from fivedc.ir.ops import LINEAR_KINDS  # their kernel is `kernels._linear` (it takes a `LinearFeed`)
from fivedc.passes.communication import weight_readers
from fivedc.passes.fp8 import is_fp8
from fivedc.instructions.done_again import DoneAgain
from fivedc.runtime.collectives import Step
from fivedc.runtime.tp_overlap import PutOff
from fivedc.runtime.tp_ring import ChunkedSum, RingGather, RingSum, start_ring
from fivedc.runtime.weight_grads import store_of



@dataclass(frozen=True, slots=True)
class GatherPath:
    """A redistribution whose all-gather runs in a ring; `reader`: the op (its output) that
    multiplies the value chunk by chunk as they arrive, or None."""

    reader: str | None


@dataclass(frozen=True, slots=True)
class SumPath:
    """A value summed by the redistribution `redistribution` (its output) as its maker runs;
    `fed`: the maker is a linear that makes its product chunk by chunk into the sum;
    `grad_ring`: the backward gathers the sum's gradient in a ring too."""

    redistribution: str
    fed: bool
    grad_ring: bool


@dataclass(frozen=True, slots=True)
class PutOffPath:
    """A redistribution whose backward sum runs behind the weight gradients of the linears
    reading its output: their weights, by name in its block, each once."""

    weights: tuple[str, ...]


@dataclass(frozen=True, slots=True)
class LinearPath:
    """What the plan decides for one linear: `gathered_by`, the redistribution (its output,
    the linear's input) whose ring brings the input chunk by chunk; `feeds_sum`, whether it
    makes its output chunk by chunk into the sum of it; `put_off_by`, the redistribution
    whose backward sum its dW waits behind, its weight at `put_off_index` there."""

    gathered_by: str | None = None
    feeds_sum: bool = False
    put_off_by: str | None = None
    put_off_index: int = -1


@dataclass(frozen=True, slots=True)
class Paths:
    """Every path of a program's graph, by the name of the value its node makes."""

    gathers: dict[str, GatherPath]
    sums: dict[str, SumPath]  # by the summed value (the maker's output, the redistribution's source)
    put_offs: dict[str, PutOffPath]
    linears: dict[str, LinearPath]


@dataclass(frozen=True, slots=True)
class LinearFeed:
    """The live objects one call of a linear works with: `gather`, the ring still bringing
    its input; `summing`, the sum it feeds its output into chunk by chunk; `put_off`, where
    it keeps (X, dY) for its weight at `put_off_index`."""

    gather: RingGather | None = None
    summing: RingSum | ChunkedSum | None = None
    put_off: PutOff | None = None
    put_off_index: int = -1


@dataclass(slots=True)
class Live:
    """One run of a program (a loss, a pipeline chunk's units): the `overlaps` it follows (a
    pipeline's units are blocks of their own), and the live objects that pass from one node
    to a later one, by value name: a sum from the op making its value to its redistribution
    (a pipeline unit may end between them), a put-off from its redistribution to the linears
    reading its output."""

    overlaps: Overlaps
    sums: dict[str, RingSum | ChunkedSum] = field(default_factory=dict)
    put_offs: dict[str, PutOff] = field(default_factory=dict)


class Overlaps:
    """A program's paths (`paths`, read once from the plan) and the run-time conditions on
    them: each live object is made only where the plan asks for it and this run allows it.
    `steps`: each redistribution's runtime steps, forward and backward, by its output."""

    def __init__(self, paths: Paths, ctx, steps: dict[str, tuple[tuple[Step, ...], tuple[Step, ...]]]) -> None:
        self.paths, self.ctx, self.steps = paths, ctx, steps

    def _runs(self, step: Step) -> bool:
        """Whether a collective can run beside its linear: its group has more than one member,
        and torch.compile is not tracing (each hop would break a compiled region: there it is
        one collective)."""
        return self.ctx.groups.size(step.axes) > 1 and not torch.compiler.is_compiling()

    def start_gather(self, item: Redistribute, src: Tensor) -> RingGather | None:
        """The ring that gathers `item`'s value (`src`'s shards), started, where the plan runs
        its all-gather so (`runtime/tp_ring.py`)."""
        if item.out not in self.paths.gathers:
            return None
        (step,) = self.steps[item.out][0]
        return start_ring(src, step, self.ctx.groups) if self._runs(step) else None

    def start_sum(self, value: str) -> RingSum | ChunkedSum | None:
        """How to sum `value` as the op making it runs, where the plan says so (a reduce-scatter
        in a ring, an all-reduce by chunks: `runtime/tp_ring.py`)."""
        path = self.paths.sums.get(value)
        if path is None:
            return None
        (step,), backward = self.steps[path.redistribution]
        if not self._runs(step):
            return None
        if step.kind == "all_reduce":
            return ChunkedSum(step, self.ctx.groups)
        return RingSum(step, self.ctx.groups, grad_step=backward[0] if path.grad_ring else None)

    def put_off(self, item: Redistribute, src: Tensor, weight: Callable[[str], Tensor]) -> PutOff | None:
        """The weights (`weight(name)`) of the linears reading `item`'s output, where the plan
        runs its backward sum behind their gradients (`runtime/tp_overlap.py`) and this
        run can: grad is enabled and `src` needs one (else that backward never runs), no
        zero-bubble store puts dW off until W, torch.compile is not tracing."""
        path = self.paths.put_offs.get(item.out)
        if path is None or not (torch.is_grad_enabled() and src.requires_grad and store_of(self.ctx) is None
                                and not torch.compiler.is_compiling()):
            return None
        return PutOff(tuple(weight(name) for name in path.weights))

    def feed(self, op: Op, live: Live, ring: RingGather | None, summing: RingSum | ChunkedSum | None, *,
             tracing: bool) -> LinearFeed | None:
        """The live objects linear `op` works with (None: a plain linear): `ring`, where it
        reads that gather by chunks; `summing`, where it feeds that sum (not while verify
        traces values: the hops run on the traced value, at the redistribution); the put-off
        of its dW (`live`)."""
        path = self.paths.linears.get(op.out)
        if path is None:
            return None
        gather = ring if path.gathered_by is not None else None
        summing = summing if path.feeds_sum and not tracing else None
        put_off = live.put_offs.get(path.put_off_by) if path.put_off_by is not None else None
        if gather is None and summing is None and put_off is None:
            return None
        return LinearFeed(gather=gather, summing=summing, put_off=put_off, put_off_index=path.put_off_index)


def plan_paths(graph: Graph, again: DoneAgain, *, pieces: Sequence[tuple[int, int]] | None = None) -> Paths:
    """The paths of every block of `graph` (see the module's doc). `pieces`: the ranges of
    top-level items a pipeline runs as blocks of their own (its units, `Program.run_units`);
    a gather's reader and a put-off's readers are then those in its piece."""
    makers = {node.out: node for node, _ in walk_ops(graph.body) if isinstance(node, Op)}
    sums = {node.src: _sum_path(node, makers.get(node.src)) for node, _ in walk_ops(graph.body)
            if isinstance(node, Redistribute) and _sums_as_made(node)}
    gathers: dict[str, GatherPath] = {}
    put_offs: dict[str, PutOffPath] = {}
    linears: dict[str, LinearPath] = {}
    for block, repeat, params in _blocks(graph.body, None, frozenset(), pieces):
        items = block.items
        for index, node in enumerate(items):
            if not isinstance(node, Redistribute):
                continue
            if len(node.forward) == 1 and node.forward[0].kind == "all_gather" and node.forward[0].overlaps:
                after = items[index + 1] if index + 1 < len(items) else None
                chunks = _multiplies_chunks(after, node, repeat, again, sums)
                gathers[node.out] = GatherPath(after.out if chunks else None)
            if len(node.backward) == 1 and node.backward[0].overlaps and weight_readers(items, node.out, params):
                put_offs[node.out] = PutOffPath(weight_readers(items, node.out, params))
        for op in items:
            if isinstance(op, Op) and op.kind in LINEAR_KINDS:
                path = _linear_path(op, gathers, sums, put_offs)
                if path != LinearPath():
                    linears[op.out] = path
    return Paths(gathers, sums, put_offs, linears)


def _sums_as_made(node: Redistribute) -> bool:
    """Whether the plan runs `node`'s one forward sum beside the op making its source."""
    return len(node.forward) == 1 and node.forward[0].kind in ("reduce_scatter", "all_reduce") \
        and bool(node.forward[0].overlaps)


def _sum_path(node: Redistribute, maker: Op | None) -> SumPath:
    """The sum `node` runs as `maker` makes its source: fed by a linear (not one in float8),
    its gradient gathered back in a ring where the plan marks that too."""
    fed = maker is not None and maker.kind in LINEAR_KINDS and not is_fp8(maker)
    return SumPath(node.out, fed, len(node.backward) == 1 and bool(node.backward[0].overlaps))


def _blocks(block: Block, repeat: Repeat | None, outer: frozenset[str],
            pieces: Sequence[tuple[int, int]] | None = None):
    """(block, its repeat, the parameter names in scope there), the bodies of repeats too;
    `block` cut into `pieces`, where given."""
    params = outer | {p.name for p in block.params}
    if pieces is None:
        yield block, repeat, params
    else:
        yield from ((Block(items=block.items[start:stop]), repeat, params) for start, stop in pieces)
    for item in block.items:
        if isinstance(item, Repeat):
            yield from _blocks(item.body, item, params)


def _multiplies_chunks(op, node: Redistribute, repeat: Repeat | None, again: DoneAgain,
                       sums: dict[str, SumPath]) -> bool:
    """Whether `op`, right after the ring-gathered `node`, can multiply its value chunk by
    chunk: a linear reading it as its input only, as it is (not counted once, not recomputed
    alone, not in float8), that keeps the gathered dim (its input's contracted dims are its
    last), and whose output is not summed as it is made (that product reads its input
    whole)."""
    if not (isinstance(op, Op) and op.kind == "linear" and op.args[0] == node.out and node.out not in op.args[1:]):
        return False
    spec = op.arg_specs[0] if op.arg_specs else None
    dims, gathered = node.type.dims, node.forward[0].dim
    kept = len([d for d in dims if d in op.type.dims])  # tensordot keeps x's leading dims
    return not (spec is not None and spec.grad_once) and not again.op(op, repeat) \
        and not is_fp8(op) and gathered in dims and dims.index(gathered) < kept and op.out not in sums


def _linear_path(op: Op, gathers: dict[str, GatherPath], sums: dict[str, SumPath],
                 put_offs: dict[str, PutOffPath]) -> LinearPath:
    """`op`'s path: the ring it reads by chunks, the sum it feeds, the redistribution it puts
    dW off behind (its input and weight read as they are: a value counted once is another
    tensor; a float8 linear keeps its own dW)."""
    source = op.read(0)
    gather = gathers.get(source) if source is not None else None
    sum_path = sums.get(op.out)
    put_off = put_offs.get(source) if source is not None else None
    specs = [op.arg_specs[i] if i < len(op.arg_specs) else None for i in range(2)]
    as_is = not any(s is not None and s.grad_once for s in specs) and not is_fp8(op)
    index = put_off.weights.index(op.args[1]) if put_off is not None and as_is and op.args[1] in put_off.weights \
        else -1
    return LinearPath(gathered_by=source if gather is not None and gather.reader == op.out else None,
                      feeds_sum=sum_path is not None and sum_path.fed,
                      put_off_by=source if index >= 0 else None, put_off_index=index)
