"""Work and time per op and per pipeline unit, on one rank for one microbatch, on given hardware.

Each op's forward is a roofline: the larger of its FLOPs at the achievable share of
peak and its memory traffic at the achievable share of HBM bandwidth (`Hardware`).

    linear, matmul   one GEMM, rows M (the tokens on this rank after SP/CP/TP and the
                     microbatch split) x local output features N x local contracted K:
                     2MNK FLOPs; backward: the input gradient (I, M x K contracting N) and
                     the weight gradient (W, K x N contracting M), as many FLOPs each, and
                     each GEMM timed by its own shape (`gemm.py`: tiles in waves over the
                     SMs, and its own memory roofline; the flat matmul rate on a profile
                     without tile terms)
    attention        flash: 4 x batch x heads x sq x sk x head dim (half of it causal;
                     with a window W: sk is W (1 - W / 2 seq) keys a query, W <= seq),
                     at the attention efficiency; backward 2.5 x; math (the scores
                     materialised): kernel by kernel, `attention_cost.py`
    moe              the experts' matmuls on its routed rows (top_k per token), as one GEMM
                     per local expert on its share of the rows (balanced routing), and the
                     router's; backward 2 x, half of it weight gradients
    everything else  memory-bound: its inputs and output read and written once
                     forward, twice backward

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

`unit_costs` gives the seconds of each unit once; the schedule simulator and the
step-time model (`fivedc/estimates/step_time.py`) only add them up, so a layout search can
score many pipeline shapes from one set of unit costs.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from dataclasses import dataclass, field, replace

from fivedc.ir.hardware import Hardware
from fivedc.ir.graph import CollectiveKind, Graph, Op, Redistribute, Repeat
from fivedc.ir.mesh import Mesh
from fivedc.passes.recompute import recomputes_layer, recomputes_op
from fivedc.estimates.attention_cost import math_attention_times
from fivedc.estimates.collectives import collective_seconds
from fivedc.estimates.gemm import Gemm, gemms_seconds
from fivedc.estimates.saved import SaveContext, regathered
from fivedc.estimates.terms import ISSUE, MEMORY_BOUND, PHASES, RECOMPUTATION, Ledger, UnitParts, comm_term, op_term
from fivedc.passes.attention_kernel import kernel_of
from fivedc.passes.fp8 import is_fp8
from fivedc.passes.stages import Unit

K = CollectiveKind
MATMULS = ("linear", "matmul")


@dataclass(frozen=True, slots=True)
class Work:
    """One op's forward on one rank for one microbatch."""

    matmul_flops: float = 0.0
    attention_flops: float = 0.0
    bytes: float = 0.0
    weight_flops: float = 0.0  # of the matmul FLOPs, those whose backward is a weight gradient (W)
    gemms: tuple[Gemm, ...] = ()  # the matmul FLOPs as GEMMs by shape (timed by shape on a tiled profile)
    fp8: bool = False  # the matmuls run in float8 (`fivedc/passes/fp8.py`): at the profile's fp8_flops
    cast_bytes: float = 0.0  # float8: the casts' memory traffic before the matmul (`fp8_cast_bytes`)


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


def op_work(c: SaveContext, op: Op) -> Work:
    if op.kind in MATMULS:
        x = c.layouts[op.args[0]][0].dims
        contracted = [d for d in x if d not in op.type.dims]
        spec = op.arg_specs[0].sharding if op.arg_specs and op.arg_specs[0] else None
        k = c.numel(tuple(contracted), spec)
        flops = 2.0 * c.numel(op.type.dims, op.sharding) * k
        rows = c.numel(tuple(d for d in op.type.dims if d in x), op.sharding)  # tokens (batch x seq) here
        features = c.numel(tuple(d for d in op.type.dims if d not in x), op.sharding)
        weight = op.args[1] in c.params
        work = Work(matmul_flops=flops, weight_flops=flops if weight else 0.0,
                    gemms=(Gemm(rows, features, k, weight=weight),))
        return replace(work, fp8=True, cast_bytes=fp8_cast_bytes(c, op)[0]) if is_fp8(op) else work
    if op.kind == "attention":  # every query row against the whole sequence (ring or gathered K/V)
        q_rows = c.numel(op.type.dims[:-1], op.sharding)  # batch x seq x heads on this rank
        flops = 4.0 * q_rows * attended_keys(op, c.graph.dim(c.graph.seq_dim)) * c.graph.dim(op.type.dims[-1])
        return Work(attention_flops=flops, bytes=4.0 * c.value_bytes(op.out))
    if op.kind == "moe":
        return _moe_work(c, op)
    moved = sum(c.value_bytes(a) for a in op.reads if a in c.layouts and a not in c.params)
    return Work(bytes=float(moved + (c.value_bytes(op.out) if op.type.dims else 0)))


def attended_keys(op: Op, seq: int) -> float:
    """Keys a query attends to, on average: seq, half of it causal; with a sliding window W the
    band's W a query less the triangle the first W queries miss, W (1 - W / 2 seq) (seq / 2 at
    W = seq, so a window as long as the sequence counts as plain causal)."""
    if not op.attr("causal", True):
        return float(seq)
    window = min(int(op.attr("window", 0) or 0) or seq, seq)
    return window * (1.0 - window / (2.0 * seq))


def _moe_work(c: SaveContext, op: Op) -> Work:
    x = op.args[0]
    hidden = c.layouts[x][0].dims[-1]
    tokens = c.value_numel(x) // c.graph.dim(hidden)
    rows = tokens * int(op.attr("top_k", 2))
    spec = op.arg_specs[2].sharding if op.arg_specs and op.arg_specs[2] else None
    w_dims = next(p.dims for p in _params(c.graph) if p.name == op.args[2])
    ffn = next(d for d in w_dims[1:] if d != hidden)
    ffn_local = c.graph.local_size(ffn, spec, c.mesh) if spec else c.graph.dim(ffn)
    h, matrices = c.graph.dim(hidden), (3 if len(op.args) == 5 else 2)
    experts = 2.0 * rows * h * ffn_local * matrices
    n_experts = c.graph.dim(next(d for d in _param_dims(c.graph, op.args[1]) if d != hidden))
    router = 2.0 * tokens * h * n_experts
    local = c.graph.local_size(w_dims[0], spec, c.mesh) if spec else c.graph.dim(w_dims[0])  # experts here
    per = rows / local  # a rank receives as many rows as it sends (balanced), spread over its experts
    up = Gemm(per, ffn_local, h, count=local)  # gate and up (SwiGLU) or up
    gemms = (*(up,) * (matrices - 1), Gemm(per, h, ffn_local, count=local), Gemm(tokens, n_experts, h))
    return Work(matmul_flops=experts + router, weight_flops=experts + router,
                bytes=4.0 * rows * h * c.dtype_bytes, gemms=gemms)


def _params(graph: Graph):
    yield from graph.body.params
    for item in graph.body.items:
        if isinstance(item, Repeat):
            yield from item.body.params


def _param_dims(graph: Graph, name: str) -> tuple[str, ...]:
    return next(p.dims for p in _params(graph) if p.name == name)


def work_seconds(work: Work, hw: Hardware, *, element_bytes: int) -> float:
    """The roofline time of an op's forward (a float8 linear's casts before it)."""
    compute = matmul_times(work, hw, element_bytes=element_bytes)[0] + \
        work.attention_flops / (hw.bf16_flops * hw.attention_efficiency)
    return max(compute, work.bytes / hw.op_bytes_per_s) + work.cast_bytes / hw.op_bytes_per_s


@functools.lru_cache(maxsize=64)
def float8_hardware(hw: Hardware) -> Hardware:
    """The profile as a float8 GEMM sees it: its peak the float8 tensor cores' (`fp8_flops`;
    a plan with --fp8 and a profile without them is refused at compile), its tiles and
    efficiency as they are (cuBLAS's float8 kernels tile alike, with twice the K per stage
    in bytes: not modelled)."""
    return dataclasses.replace(hw, bf16_flops=hw.fp8_flops) if hw.fp8_flops else hw


def fp8_cast_bytes(c: SaveContext, op: Op) -> tuple[float, float]:
    """(forward, backward) memory traffic of a float8 linear's casts, torchao's own count
    (torchao/float8/roofline_utils.py, `get_float8_mem_sympy`, tensorwise): a cast reads
    the tensor at the training dtype and writes it in float8 twice (row- and column-major,
    for the two matmuls that read it); its amax is one more read, except where it fuses
    into the op making the tensor (the input, the output gradient). Forward: the input
    (M K) and the weight (K N, amax read apart); backward: the output gradient (M N);
    the input and weight cast in forward are read again in backward as float8."""
    b, out = c.dtype_bytes, c.numel(op.type.dims, op.sharding)  # M N
    x = c.layouts[op.args[0]][0].dims
    spec = op.arg_specs[0].sharding if op.arg_specs and op.arg_specs[0] else None
    k = c.numel(tuple(d for d in x if d not in op.type.dims), spec)  # K
    m = c.value_numel(op.args[0]) // max(k, 1)  # M
    x, w = m * k, k * out // max(m, 1)
    return x * (b + 2) + w * (2 * b + 2), out * (b + 2)


def matmul_times(work: Work, hw: Hardware, *, element_bytes: int) -> tuple[float, float, float]:
    """(forward, input-gradient, weight-gradient) seconds of an op's matmuls: on a tiled profile
    each GEMM by its shape (`gemm.py`), else all its FLOPs at the flat matmul rate."""
    if work.fp8:  # float8 operands at the float8 peak (fivedc/passes/fp8.py)
        hw, element_bytes = float8_hardware(hw), 1
    if hw.tiled and work.gemms:
        return gemms_seconds(work.gemms, hw, element_bytes=element_bytes)
    peak = hw.bf16_flops * hw.matmul_efficiency
    return work.matmul_flops / peak, (2 * work.matmul_flops - work.weight_flops) / peak, work.weight_flops / peak


def op_times(c: SaveContext, op: Op, hw: Hardware) -> tuple[float, float, float]:
    """(forward, input-gradient, weight-gradient) seconds of one op: a matmul's backward
    is one matmul per operand needing a gradient (the weight's is W), attention's 2.5 x
    its forward, memory-bound work twice its traffic. Where the host runs the op itself (a
    CPU), each phase that runs takes also the host's time to issue it
    (`Hardware.op_latency_s`); where it issues ops ahead of the device (a GPU's stream),
    `unit_time` sets the issues against the work of the whole unit instead."""
    forward, backward, weight = _work_times(c, op, hw)
    latency = 0.0 if hw.host_runs_ahead else hw.op_latency_s
    return forward + latency, backward + latency, weight + (latency if weight else 0.0)


def issue_bound(seconds: float, issues: int, hw: Hardware) -> float:
    """A unit's phase where the host issues ahead of the device: the device's work, unless the
    host takes longer to issue its ops (then the device waits on it)."""
    return max(seconds, issues * hw.op_latency_s) if hw.host_runs_ahead else seconds


def _work_times(c: SaveContext, op: Op, hw: Hardware) -> tuple[float, float, float]:
    if op.kind == "attention" and kernel_of(op) == "math":
        return math_attention_times(c, op, hw)
    work = op_work(c, op)
    forward = work_seconds(work, hw, element_bytes=c.dtype_bytes)
    if op.kind == "attention":
        return forward, 2.5 * forward, 0.0
    _, grads, weight = matmul_times(work, hw, element_bytes=c.dtype_bytes)
    casts = fp8_cast_bytes(c, op)[1] / hw.op_bytes_per_s if work.fp8 else 0.0  # the output gradient's
    return forward, max(grads, 2 * work.bytes / hw.op_bytes_per_s) + casts, weight


# ---- collectives ----------------------------------------------------------------------------
@functools.lru_cache(maxsize=4096)
def _batched(graph: Graph, node) -> bool:
    return graph.batch_dim in node.type.dims if node.type else True


def unit_time(c: SaveContext, graph: Graph, unit: Unit, hw: Hardware, *, recompute: str,
              again: dict[str, str]) -> UnitTime:
    """Seconds of one unit for one microbatch, its blocking collectives included."""
    if unit.layer is None:
        items, repeat = graph.body.items[unit.start:unit.stop], None
    else:
        repeat = graph.body.items[unit.start]
        items = repeat.body.items
    fwd = bwd_in = bwd_w = comm = 0.0
    led = Ledger()  # the same seconds by term (`terms.py`)
    labels: dict[str, tuple[str, str]] = {}  # a sum overlapped in backward: the terms of its gradient and regather
    ahead_by: dict[str, float] = {}  # `ahead` and `back` by term
    back_by: dict[str, float] = {}
    behind: dict[str, float] = {}  # a redistribution's backward sum overlapped with weight gradients
    weights: dict[str, float] = {}  # and the weight-gradient seconds of the linears reading it
    early: dict[str, float] = {}  # there, SP's input gathered again: started before the readers' dX
    inputs: dict[str, float] = {}  # and the readers' input-gradient seconds
    gathering: dict[str, tuple[float, int]] = {}  # a forward all-gather in a ring: its seconds, group size
    made: dict[str, tuple[float, float]] = {}  # a linear's output: its forward and input-gradient seconds
    ahead = 0.0  # of the forward's collectives, what the matmuls beside them hide
    back = 0.0  # of the backward's gathers of a sum's gradient in a ring, what the input gradient hides
    issues = [0, 0, 0]  # ops issued in forward, input gradients, weight gradients
    per = repeat.count if repeat else 1
    for node in items:
        if isinstance(node, Redistribute):
            scale = 1.0 / c.microbatches if _batched(graph, node) else 1.0

            def seconds(steps, only=None) -> float:
                return sum(collective_seconds(x.kind, x.axes, x.bytes * scale, c.mesh, hw) * x.count / per
                           for x in steps if only is None or x.kind == only)

            f, i = seconds(node.forward), seconds(node.backward)
            w = seconds(node.forward, K.ALL_GATHER) if node.out in again else 0.0  # SP: gathered again
            fwd, bwd_in, bwd_w, comm = fwd + f, bwd_in + i, bwd_w + w, comm + f + i + w
            term_f, term_i = comm_term(node.forward), comm_term(node.backward)
            term_w = comm_term([x for x in node.forward if x.kind == K.ALL_GATHER])
            for phase, term, part in (("forward", term_f, f), ("input", term_i, i), ("weight", term_w, w)):
                led.add(phase, term, part)
            if any(x.overlaps for x in node.backward):
                behind[node.out], early[node.out], labels[node.out] = i, w, (term_i, term_w)
            if len(node.forward) == 1 and node.forward[0].overlaps:  # beside a linear (collective matmul)
                x, n = node.forward[0], c.mesh.size(*node.forward[0].axes)
                if x.kind == K.ALL_REDUCE:  # n all-reduces of 1/n: n times the latency
                    chunked = n * collective_seconds(x.kind, x.axes, x.bytes * scale / n, c.mesh, hw) * x.count / per
                    led.add("forward", term_f, chunked - f)
                    fwd, comm, f = fwd + chunked - f, comm + chunked - f, chunked
                if x.kind == K.ALL_GATHER:  # beside the next linear
                    gathering[node.out] = (f, n, term_f)
                else:  # beside the linear making its input
                    f_made, i_made = made.pop(node.src, (0.0, 0.0))
                    h = hidden_beside(x.kind, f, f_made, n)
                    ahead, ahead_by[term_f] = ahead + h, ahead_by.get(term_f, 0.0) + h
                    if node.backward and node.backward[0].overlaps:  # its gradient back in a ring, beside dX
                        h = hidden_beside(K.ALL_GATHER, i, i_made, n)
                        back, back_by[term_i] = back + h, back_by.get(term_i, 0.0) + h
            continue
        if not isinstance(node, Op):
            continue
        f, i, w = op_times(c, node, hw)
        term = op_term(node.kind)
        casts = [b / hw.op_bytes_per_s for b in fp8_cast_bytes(c, node)] if is_fp8(node) else (0.0, 0.0)
        for phase, part, cast in (("forward", f, casts[0]), ("input", i, casts[1]), ("weight", w, 0.0)):
            led.add(phase, term, part - cast)
            led.add(phase, MEMORY_BOUND, cast)  # a float8 linear's casts: memory-bound work
        if node.kind == "linear":
            made[node.out] = (f, i)
        if node.kind == "linear" and node.args[0] in gathering:
            seconds, n, term_f = gathering.pop(node.args[0])
            h = hidden_beside(K.ALL_GATHER, seconds, f, n)
            ahead, ahead_by[term_f] = ahead + h, ahead_by.get(term_f, 0.0) + h
        if node.kind == "linear" and node.args[0] in behind:
            weights[node.args[0]] = weights.get(node.args[0], 0.0) + w
            inputs[node.args[0]] = inputs.get(node.args[0], 0.0) + i
        extra_f = _op_collectives(c, node, hw, f, ledger=led)
        extra_i = _op_collectives(c, node, hw, i, backward=True, ledger=led)
        f, i, comm = f + extra_f, i + extra_i, comm + extra_f + extra_i
        again_here = recomputes_op(node, repeat, recompute)
        if again_here:
            i += f  # its forward runs again in backward
            led.add("input", RECOMPUTATION, f)
        fwd, bwd_in, bwd_w = fwd + f, bwd_in + i, bwd_w + w
        issues = [issues[0] + 1, issues[1] + 1 + again_here, issues[2] + bool(w)]
    summed = (fwd, bwd_in, bwd_w)
    fwd, bwd_in, bwd_w = (issue_bound(t, n, hw) for t, n in zip(summed, issues))
    for phase, before, after in zip(PHASES, summed, (fwd, bwd_in, bwd_w)):
        led.add(phase, ISSUE, after - before)
    keep = hw.overlap_keep  # what runs beside compute slows it by the SMs it holds
    fwd, comm = fwd - ahead * keep, comm - ahead * keep
    for term, part in ahead_by.items():
        led.add("forward", term, -part * keep)
    if repeat is not None and recomputes_layer(repeat, recompute):
        bwd_in += fwd  # the whole layer's forward again (its rings hidden again)
        led.add("input", RECOMPUTATION, fwd)
    hidden = keep * (back + sum(min(seconds, weights.get(name, 0.0)) + min(early[name], inputs.get(name, 0.0))
                                for name, seconds in behind.items()))
    for term, part in back_by.items():
        led.add("hidden", term, keep * part)
    for name, part in behind.items():
        led.add("hidden", labels[name][0], keep * min(part, weights.get(name, 0.0)))
        led.add("hidden", labels[name][1], keep * min(early[name], inputs.get(name, 0.0)))
    return UnitTime(fwd, bwd_in, bwd_w, comm, hidden, led.parts())


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
    from fivedc.ir.graph import Phase

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


def unit_times(c: SaveContext, graph: Graph, units: list[Unit], hw: Hardware, *, recompute: str) -> list[UnitTime]:
    """Every unit's seconds, a repeat's layers computed once."""
    again, cache, out = regathered(graph, recompute), {}, []
    for unit in units:
        key = graph.body.items[unit.start].name if unit.layer is not None else ("ops", unit.start)
        if key not in cache:
            cache[key] = unit_time(c, graph, unit, hw, recompute=recompute, again=again)
        out.append(cache[key])
    return out


def model_flops(graph: Graph, mesh: Mesh, *, dtype: str, dtype_bytes: int) -> float:
    """FLOPs of one step of the model itself (forward and backward, 3 x the forward's
    matmuls and attention; recomputation not counted, as MFU counts): from the ops' global
    sizes, whatever the mesh."""
    single = Mesh((1, 1, 1, 1, 1))
    c = SaveContext.of(graph, single, dtype=dtype, dtype_bytes=dtype_bytes)
    total = 0.0
    for node in graph.body.items:
        items = node.body.items if isinstance(node, Repeat) else (node,)
        layers = node.count if isinstance(node, Repeat) else 1
        for op in items:
            if isinstance(op, Op) and op.kind in (*MATMULS, "attention", "moe"):
                work = op_work(c, op)
                total += 3.0 * (work.matmul_flops + work.attention_flops) * layers
    return total if math.isfinite(total) else 0.0
