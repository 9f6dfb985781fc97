"""Work and time per op, on one rank for one microbatch, on given hardware.

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

`unit_costs.py` adds an op's seconds up into its pipeline unit's, with the unit's
collectives and what of them hides behind compute.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from dataclasses import dataclass, replace

from fivedc.ir.hardware import Hardware
from fivedc.ir.graph import Graph, Op, Repeat
from fivedc.ir.mesh import Mesh
from fivedc.ir.ops import LINEAR_KINDS
from fivedc.estimates.attention_cost import math_attention_times
from fivedc.estimates.gemm import Gemm, gemms_seconds
from fivedc.instructions.done_again import DoneAgain
from fivedc.estimates.saved import SaveContext
from fivedc.passes.attention_kernel import kernel_of
from fivedc.passes.fp8 import is_fp8


@dataclass(frozen=True, slots=True)
class Work:
    """One op's forward on one rank for one microbatch."""

    matmul_flops: float = 0.0
    attention_flops: float = 0.0
    bytes: float = 0.0
    weight_flops: float = 0.0  # of the matmul FLOPs, those whose backward is a weight gradient (W)
    gemms: tuple[Gemm, ...] = ()  # the matmul FLOPs as GEMMs by shape (timed by shape on a tiled profile)
    fp8: bool = False  # the matmuls run in float8 (`passes/fp8.py`): at the profile's fp8_flops
    cast_bytes: float = 0.0  # float8: the casts' memory traffic before the matmul (`fp8_cast_bytes`)
    attention_kernel: str = "flash"  # the fused kernel of the attention FLOPs (`Hardware.attention_share`)


def op_work(c: SaveContext, op: Op) -> Work:
    if op.kind in LINEAR_KINDS:
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
        return Work(attention_flops=flops, bytes=4.0 * c.value_bytes(op.out), attention_kernel=kernel_of(op))
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
        work.attention_flops / (hw.bf16_flops * hw.attention_share(work.attention_kernel))
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
    if work.fp8:  # float8 operands at the float8 peak (passes/fp8.py)
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
    `unit_costs.unit_time` sets the issues against the work of the whole unit instead."""
    forward, backward, weight = _work_times(c, op, hw)
    latency = 0.0 if hw.host_runs_ahead else hw.op_latency_s
    return forward + latency, backward + latency, weight + (latency if weight else 0.0)


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


def model_flops(graph: Graph, mesh: Mesh, *, dtype: str, dtype_bytes: int) -> float:
    """FLOPs of one step of the model itself (forward and backward, 3 x the forward's
    matmuls and attention; recomputation not counted, as MFU counts): from the ops' global
    sizes, whatever the mesh."""
    single = Mesh((1, 1, 1, 1, 1))
    c = SaveContext.of(graph, single, dtype=dtype, dtype_bytes=dtype_bytes, again=DoneAgain())  # sizes only
    total = 0.0
    for node in graph.body.items:
        items = node.body.items if isinstance(node, Repeat) else (node,)
        layers = node.count if isinstance(node, Repeat) else 1
        for op in items:
            if isinstance(op, Op) and op.kind in (*LINEAR_KINDS, "attention", "moe"):
                work = op_work(c, op)
                total += 3.0 * (work.matmul_flops + work.attention_flops) * layers
    return total if math.isfinite(total) else 0.0
