"""Seconds of one pipeline unit for one microbatch: its ops' phases (`costs.py`) added up with
its collectives, less what runs beside compute.

What runs is read from the unit's instruction list (`fivedc/instructions/unit_program.py`),
the one the agreement proof checks and `fivedc show PLAN --program` prints: the nodes that run
forward and backward (a node the list issues nothing for, a local slice, costs nothing), the
forwards backward does again (an op's own under selective recomputation, or the whole
layer's), and the gathered inputs sequence parallelism gathers again for the weight
gradients. How long each takes is this module's: an op's phases, a collective by its
algorithm over its group's links (not the list's hops).

Collectives are timed by their algorithm over the group's links
(`fivedc/estimates/collectives.py`). A unit's collectives are on its critical path unless the
plan says they overlap (`Collective.overlaps`): ring attention's hops hide behind the
attention they feed; an all-gather run in a ring (collective matmul) behind its next
linear's matmul on the chunks before the last, (n-1)/n of it (the last chunk's product
waits for the last hop), and a reduce-scatter run in a ring behind the matmul making
its input on the chunks after the first, (n-1)/n of it; an all-reduce run in n chunks
behind that matmul's next chunks: (n-1)/n of the lesser of the two (the last chunk's sum
waits). In backward, a linear input's sum hides behind the weight gradients of the
linears reading it, under SP that input's gather for dW behind their input gradients,
and a ring reduce-scatter's gradient, gathered back in a ring, behind (n-1)/n of its
linear's input gradient (`UnitTime.hidden`, as much of each as those take, in a whole
backward B only: a split one runs W later). What hides is not free: a collective beside
compute holds a share of the compute units for its duration (`Hardware.overlap_sm_share`),
so of each hidden second that share still adds to the compute beside it.

`unit_times` gives the seconds of each unit once; the schedule simulator and the
step-time model (`fivedc/estimates/step_time.py`) only add them up, so a layout search can
score many pipeline shapes from one set of unit costs. Every figure is added in the order
the ops run, so the same plan gives the same seconds to the last bit.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from fivedc.estimates.collectives import collective_seconds
from fivedc.estimates.costs import fp8_cast_bytes, op_times
from fivedc.estimates.saved import SaveContext
from fivedc.instructions.events import BACKWARD
from fivedc.instructions.unit_program import distinct_units, unit_instructions, unit_key
from fivedc.estimates.terms import ISSUE, MEMORY_BOUND, PHASES, RECOMPUTATION, Ledger, UnitParts, comm_term, op_term
from fivedc.ir.graph import CollectiveKind, Graph, Op, Phase, Redistribute, Repeat
from fivedc.ir.hardware import Hardware
from fivedc.passes.fp8 import is_fp8
from fivedc.passes.stages import Unit

K = CollectiveKind


@dataclass(frozen=True, slots=True)
class UnitTime:
    """Seconds of one unit for one microbatch: forward, input-gradient backward (I) and
    weight-gradient backward (W; B = I + W), with its blocking collectives."""

    forward: float
    backward_input: float
    backward_weight: float
    comm: float = 0.0  # of the three, seconds in collectives on the unit's path (forward and backward)
    hidden: float = 0.0  # of `comm`, what a whole backward runs behind its compute: tp's sums, SP's regathers
    parts: UnitParts = field(default=UnitParts(), compare=False, repr=False)  # the same seconds by term (`terms.py`)

    @property
    def backward(self) -> float:
        """B, a whole backward: the tp sums the plan overlaps with weight gradients hide behind
        them, and under SP the gathers for dW behind the input gradients (a split backward,
        I then W, cannot: the runtime leaves every dW to W)."""
        return self.backward_input + self.backward_weight - self.hidden


def unit_times(c: SaveContext, graph: Graph, units: list[Unit], hw: Hardware, *, recompute: str,
               instructions: dict | None = None) -> list[UnitTime]:
    """Every unit's seconds, a repeat's layers computed once: each priced from its instruction
    list (`instructions`, by unit: `fivedc/instructions/unit_program.unit_instructions`, made
    here if not given), which says which nodes run forward and backward, and from what those
    lists do again (`c.again`: recomputation, SP's gathers again; `done_again.py`)."""
    keys = [unit_key(graph, unit) for unit in units]
    first = distinct_units(graph, units)
    listed = instructions if instructions is not None else unit_instructions(
        graph, c.mesh, recompute=recompute, dtype=c.dtype, wanted=list(first.values()))
    cache = {key: unit_time(c, graph, unit, hw, instructions=listed[unit]) for key, unit in first.items()}
    return [cache[key] for key in keys]


def unit_time(c: SaveContext, graph: Graph, unit: Unit, hw: Hardware, *, instructions: tuple[tuple, tuple]
              ) -> UnitTime:
    """Seconds of one unit for one microbatch, its blocking collectives included: the nodes its
    `instructions` (forward, backward) issue added up in program order (`UnitSums`), then each
    phase bounded by the host's issue, what the forward's matmuls hide taken off, a forward done
    again in backward added (an op's own, or the whole layer's: `c.again`, read from the same
    lists), and what a whole backward hides set apart (`UnitSums.finish`)."""
    forward, backward = instructions
    runs_forward = {id(e.node) for e in forward}
    runs_backward = {id(e.node) for e in backward if e.phase == BACKWARD}
    repeat, nodes = unit_nodes(graph, unit)
    whole = repeat is not None and c.again.layer(repeat)  # the layer's whole forward, again
    sums = UnitSums(c, graph, hw, layers=repeat.count if repeat else 1, again=set(c.again.gathered))
    for node in nodes:
        if id(node) not in runs_forward and id(node) not in runs_backward:
            continue  # it issues nothing (a local slice): nothing to price
        if isinstance(node, Redistribute):
            sums.redistribution(node, backward=id(node) in runs_backward)
        elif isinstance(node, Op):
            sums.op(node, recomputed=c.again.op(node, repeat), backward=id(node) in runs_backward)
    return sums.finish(layer_recomputed=whole)


def unit_nodes(graph: Graph, unit: Unit) -> tuple[Repeat | None, tuple]:
    """The repeat a unit is one layer of (None for a run of top-level nodes) and its nodes."""
    if unit.layer is None:
        return None, graph.body.items[unit.start:unit.stop]
    repeat = graph.body.items[unit.start]
    return repeat, repeat.body.items


@dataclass(frozen=True, slots=True)
class Phases:
    """A figure per phase of a unit: forward, input gradient (I), weight gradient (W)."""

    forward: float = 0.0
    input: float = 0.0
    weight: float = 0.0

    def plus(self, forward: float, input: float, weight: float) -> Phases:
        return Phases(self.forward + forward, self.input + input, self.weight + weight)

    def values(self) -> tuple[float, float, float]:
        return self.forward, self.input, self.weight


@dataclass(frozen=True, slots=True)
class SumBehindWeights:
    """A redistribution whose backward sum (of a linear input's gradient) the plan runs beside
    the weight gradients of the linears reading it, and under SP whose forward gather, run
    again for their dW, beside their input gradients: a whole backward hides as much of each
    as those take."""

    sum_seconds: float
    regather_seconds: float  # 0 where nothing is gathered again
    sum_term: str
    regather_term: str
    readers_weight: float = 0.0  # the weight-gradient seconds of the linears reading its output
    readers_input: float = 0.0  # and their input-gradient seconds

    def read_by(self, *, weight: float, input: float) -> SumBehindWeights:
        return replace(self, readers_weight=self.readers_weight + weight, readers_input=self.readers_input + input)

    def hidden_sum(self) -> float:
        return min(self.sum_seconds, self.readers_weight)

    def hidden_regather(self) -> float:
        return min(self.regather_seconds, self.readers_input)


@dataclass(frozen=True, slots=True)
class RingGather:
    """A forward all-gather run in a ring, waiting for the linear that reads it to run beside."""

    seconds: float
    group: int  # ranks in the ring
    term: str


class Hidden:
    """Seconds of collectives that compute beside them hides: in all, and by term."""

    __slots__ = ("total", "by_term")

    def __init__(self) -> None:
        self.total = 0.0
        self.by_term: dict[str, float] = {}

    def add(self, term: str, seconds: float) -> None:
        self.total = self.total + seconds
        self.by_term[term] = self.by_term.get(term, 0.0) + seconds


class UnitSums:
    """What `unit_time` adds up as it walks a unit's nodes in order, with the same seconds by
    term in `ledger` (`terms.py`)."""

    __slots__ = ("c", "graph", "hw", "layers", "again", "seconds", "comm", "issued", "ledger",
                 "beside_matmuls", "beside_input_grads", "behind_weights", "ring_gathers", "linear_outputs")

    def __init__(self, c: SaveContext, graph: Graph, hw: Hardware, *, layers: int, again: set[str]) -> None:
        self.c, self.graph, self.hw, self.layers, self.again = c, graph, hw, layers, again
        self.seconds = Phases()  # forward, input gradients, weight gradients
        self.comm = 0.0  # of those, the seconds in collectives
        self.issued = Phases(0, 0, 0)  # ops issued in each phase
        self.ledger = Ledger()
        self.beside_matmuls = Hidden()  # of the forward's collectives, what the matmuls beside them hide
        self.beside_input_grads = Hidden()  # of a sum's gradient gathered back in a ring, what dX hides
        self.behind_weights: dict[str, SumBehindWeights] = {}  # by the redistribution's output
        self.ring_gathers: dict[str, RingGather] = {}  # by the value gathered
        self.linear_outputs: dict[str, tuple[float, float]] = {}  # a linear's forward and input-gradient seconds

    def collectives_seconds(self, steps, scale: float, only: CollectiveKind | None = None) -> float:
        """Seconds of a redistribution's `steps` (those of kind `only`), its bytes times `scale`,
        for one of the repeat's layers."""
        return sum(collective_seconds(x.kind, x.axes, x.bytes * scale, self.c.mesh, self.hw) * x.count / self.layers
                   for x in steps if only is None or x.kind == only)

    def redistribution(self, node: Redistribute, *, backward: bool = True) -> None:
        """A redistribution's collectives: forward, its gradient's in backward (`backward`: where
        the gradient reaches it), and under SP its gather run again for the weight gradients."""
        scale = 1.0 / self.c.microbatches if _batched(self.graph, node) else 1.0
        forward = self.collectives_seconds(node.forward, scale)
        input = self.collectives_seconds(node.backward, scale) if backward else 0.0
        weight = self.collectives_seconds(node.forward, scale, K.ALL_GATHER) if node.out in self.again else 0.0
        self.seconds = self.seconds.plus(forward, input, weight)
        self.comm = self.comm + forward + input + weight
        forward_term, input_term = comm_term(node.forward), comm_term(node.backward)
        weight_term = comm_term([x for x in node.forward if x.kind == K.ALL_GATHER])
        for phase, term, part in (("forward", forward_term, forward), ("input", input_term, input),
                                  ("weight", weight_term, weight)):
            self.ledger.add(phase, term, part)
        if any(x.overlaps for x in node.backward):
            self.behind_weights[node.out] = SumBehindWeights(input, weight, input_term, weight_term)
        if len(node.forward) == 1 and node.forward[0].overlaps:
            self.collective_matmul(node, scale, forward, input, forward_term, input_term)

    def collective_matmul(self, node: Redistribute, scale: float, forward: float, input: float,
                          forward_term: str, input_term: str) -> None:
        """A forward collective run beside a linear's matmul: an all-gather beside the next
        linear's, a reduce-scatter or chunked all-reduce beside the linear making its input
        (and its gradient, gathered back in a ring, beside that linear's input gradient)."""
        x, n = node.forward[0], self.c.mesh.size(*node.forward[0].axes)
        if x.kind == K.ALL_REDUCE:  # n all-reduces of 1/n: n times the latency
            chunked = n * collective_seconds(x.kind, x.axes, x.bytes * scale / n, self.c.mesh, self.hw) \
                * x.count / self.layers
            self.ledger.add("forward", forward_term, chunked - forward)
            self.seconds = replace(self.seconds, forward=self.seconds.forward + chunked - forward)
            self.comm, forward = self.comm + chunked - forward, chunked
        if x.kind == K.ALL_GATHER:
            self.ring_gathers[node.out] = RingGather(forward, n, forward_term)
            return
        made_forward, made_input = self.linear_outputs.pop(node.src, (0.0, 0.0))
        self.beside_matmuls.add(forward_term, hidden_beside(x.kind, forward, made_forward, n))
        if node.backward and node.backward[0].overlaps:
            self.beside_input_grads.add(input_term, hidden_beside(K.ALL_GATHER, input, made_input, n))

    def op(self, node: Op, *, recomputed: bool, backward: bool = True) -> None:
        """An op's phases with its own collectives; `recomputed`: its forward runs again in
        backward; `backward`: its backward runs (the gradient reaches it)."""
        forward, input, weight = op_times(self.c, node, self.hw)
        if not backward:
            input = weight = 0.0
        self.op_terms(node, forward, input, weight)
        if node.kind == "linear":
            self.linear(node, forward, input, weight)
        own_forward = _op_collectives(self.c, node, self.hw, forward, ledger=self.ledger)
        own_input = _op_collectives(self.c, node, self.hw, input, backward=True, ledger=self.ledger) if backward else 0.0
        forward, input = forward + own_forward, input + own_input
        self.comm = self.comm + own_forward + own_input
        if recomputed:
            input += forward
            self.ledger.add("input", RECOMPUTATION, forward)
        self.seconds = self.seconds.plus(forward, input, weight)
        self.issued = self.issued.plus(1, backward + recomputed, bool(weight))

    def op_terms(self, node: Op, forward: float, input: float, weight: float) -> None:
        """An op's phases in the ledger: its compute term, a float8 linear's casts memory-bound work."""
        term = op_term(node.kind)
        casts = [b / self.hw.op_bytes_per_s for b in fp8_cast_bytes(self.c, node)] if is_fp8(node) else (0.0, 0.0)
        for phase, part, cast in (("forward", forward, casts[0]), ("input", input, casts[1]), ("weight", weight, 0.0)):
            self.ledger.add(phase, term, part - cast)
            self.ledger.add(phase, MEMORY_BOUND, cast)

    def linear(self, node: Op, forward: float, input: float, weight: float) -> None:
        """A linear: its output for a collective beside it, its matmul beside a ring gather of its
        input, its gradients behind its input's backward sum."""
        self.linear_outputs[node.out] = (forward, input)
        gather = self.ring_gathers.pop(node.args[0], None)
        if gather is not None:
            self.beside_matmuls.add(gather.term, hidden_beside(K.ALL_GATHER, gather.seconds, forward, gather.group))
        if node.args[0] in self.behind_weights:
            self.behind_weights[node.args[0]] = self.behind_weights[node.args[0]].read_by(weight=weight, input=input)

    def finish(self, *, layer_recomputed: bool) -> UnitTime:
        """The unit's seconds: each phase at least its ops' issue, less what the matmuls hide of
        the forward's collectives (`keep` of it: the rest slows them), a recomputed layer's
        forward again in backward, and what a whole backward hides (`UnitTime.hidden`)."""
        bounded = Phases(*(issue_bound(t, n, self.hw) for t, n in zip(self.seconds.values(), self.issued.values())))
        for phase, before, after in zip(PHASES, self.seconds.values(), bounded.values()):
            self.ledger.add(phase, ISSUE, after - before)
        keep = self.hw.overlap_keep  # what runs beside compute slows it by the SMs it holds
        forward = bounded.forward - self.beside_matmuls.total * keep
        comm = self.comm - self.beside_matmuls.total * keep
        for term, part in self.beside_matmuls.by_term.items():
            self.ledger.add("forward", term, -part * keep)
        backward_input = bounded.input
        if layer_recomputed:
            backward_input += forward  # the whole layer's forward again (its rings hidden again)
            self.ledger.add("input", RECOMPUTATION, forward)
        hidden = self.hidden_in_backward(keep)
        return UnitTime(forward, backward_input, bounded.weight, comm, hidden, self.ledger.parts())

    def hidden_in_backward(self, keep: float) -> float:
        """What a whole backward runs behind its compute, `keep` of it, recorded in the ledger too."""
        behind = self.behind_weights.values()
        hidden = keep * (self.beside_input_grads.total + sum(s.hidden_sum() + s.hidden_regather() for s in behind))
        for term, part in self.beside_input_grads.by_term.items():
            self.ledger.add("hidden", term, keep * part)
        for s in behind:
            self.ledger.add("hidden", s.sum_term, keep * s.hidden_sum())
            self.ledger.add("hidden", s.regather_term, keep * s.hidden_regather())
        return hidden


def _batched(graph: Graph, node) -> bool:  # no cache: a key would hash the whole graph at every call
    return graph.batch_dim in node.type.dims if node.type else True


def issue_bound(seconds: float, issues: int, hw: Hardware) -> float:
    """A unit's phase where the host issues ahead of the device: the device's work, unless the
    host takes longer to issue its ops (then the device waits on it)."""
    return max(seconds, issues * hw.op_latency_s) if hw.host_runs_ahead else seconds


def hidden_beside(kind: CollectiveKind, seconds: float, matmul: float, n: int) -> float:
    """Of a forward collective run beside a linear's matmul over a group of n (collective
    matmul), the seconds that matmul hides: a ring (all-gather, reduce-scatter) is n - 1
    hops, each beside one chunk's product, so all but one chunk's product hide it:
    min(C, (n-1)/n M); an all-reduce by n chunks sums each while the next is made, the last
    one waited for: (n-1)/n min(C, M)."""
    if kind == K.ALL_REDUCE:
        return (n - 1) / n * min(seconds, matmul)
    return min(seconds, (n - 1) / n * matmul)


def _op_collectives(c: SaveContext, op: Op, hw: Hardware, compute: float, *, backward: bool = False,
                    ledger: Ledger | None = None) -> float:
    """The op's own collectives in one phase: blocking ones add; overlapped ones (ring hops)
    beyond the compute they hide behind, and behind it the SMs they hold
    (`Hardware.overlap_sm_share`). `ledger`: given the seconds by term too (the overlapped
    ones' share by their seconds)."""
    phase = Phase.BACKWARD if backward else Phase.FORWARD
    blocking = hidden = 0.0
    overlapped: dict[str, float] = {}
    for x in op.collectives:
        if x.phase != phase:
            continue
        seconds = collective_seconds(x.kind, x.axes, x.bytes / c.microbatches, c.mesh, hw) * x.count
        if x.overlaps:
            hidden += seconds
            overlapped[comm_term((x,))] = overlapped.get(comm_term((x,)), 0.0) + seconds
        else:
            blocking += seconds
            if ledger is not None:
                ledger.add("input" if backward else "forward", comm_term((x,)), seconds)
    if ledger is not None and overlapped:
        ledger.share("input" if backward else "forward", overlapped,
                     max(0.0, hidden - compute) + min(hidden, compute) * hw.overlap_sm_share)
    return blocking + max(0.0, hidden - compute) + min(hidden, compute) * hw.overlap_sm_share
