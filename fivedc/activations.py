"""Activation bytes of one step on one rank, as the plan estimates them, with recomputation.

What an op keeps for backward is counted as its output (every op output is kept),
plus what two kernels keep inside: a `moe` op's routing and experts
(`moe_inner_activations`) and an `attention` op's own saved tensors beyond its inputs
and output (`attention_inner_bytes`). The runtime's attention is flash-style (SDPA's
flash kernel at cp = 1, blockwise or ring attention under cp): it never holds the
s x s scores, and keeps the log-sum-exp of each query row (float32 in 16-bit
training) and, at cp = 1 with grouped-query attention, K and V repeated for every
query head. So Megatron's 5·a·s²·b attention term (softmax output, dropout mask and
output, without flash attention) has no counterpart here: selective recomputation
removes these smaller tensors instead.

`step_activations` applies the plan's recompute mode (`fivedc/recompute.py`):

- none: everything above, for every op;
- selective: less the attention internals; one attention's internals come back,
  transiently, while its backward runs;
- full: a recomputed layer keeps only what it hands to the next (its yields: the
  carried values, Megatron's 2·s·b·h bytes per layer in 16-bit training, divided
  by tp under SP); while one layer's backward runs its recomputed activations are
  alive, so one layer's full count is transient.

`kept` scales with the microbatches a pipeline keeps in flight; `transient` is one
region's worth at a time, for one microbatch.
"""

from __future__ import annotations

from dataclasses import dataclass

from fivedc.ir import Graph, Op, Redistribute, Repeat, walk_ops
from fivedc.mesh import Mesh, MeshAxis
from fivedc.recompute import recomputes_layer, recomputes_op
from fivedc.sharding import Sharding

LOW_PRECISION = ("bf16", "fp16")  # their attention keeps its log-sum-exp in float32


@dataclass(frozen=True, slots=True)
class StepActivations:
    """Bytes on one rank for a whole step's batch: `kept` until their backward, and the
    `transient` peak of one recomputed region (at the batch of one microbatch: divide
    by the microbatches under a pipeline)."""

    kept: int
    transient: int = 0


def step_activations(graph: Graph, mesh: Mesh, *, dtype: str, dtype_bytes: int, recompute: str) -> StepActivations:
    kept = transient = 0
    for item in graph.body.items:
        if isinstance(item, Repeat):
            layer, inner = _block_bytes(graph, mesh, item, dtype, dtype_bytes, recompute)
            if recomputes_layer(item, recompute):
                kept += _yield_bytes(graph, mesh, item, dtype_bytes) * item.count
                transient = max(transient, layer + inner)
            else:
                kept += layer * item.count
                transient = max(transient, inner)
        elif isinstance(item, Op):
            own, inner = _op_bytes(graph, mesh, item, None, dtype, dtype_bytes, recompute)
            kept += own
            transient = max(transient, inner)
    return StepActivations(kept, transient)


def _block_bytes(graph, mesh, repeat: Repeat, dtype, dtype_bytes, recompute) -> tuple[int, int]:
    """One layer's kept bytes (its recomputed attention internals left out), and the
    largest internals of one of its recomputed attention ops."""
    kept = inner = 0
    for node, _ in walk_ops(repeat.body):
        if isinstance(node, Op):
            own, recomputed = _op_bytes(graph, mesh, node, repeat, dtype, dtype_bytes, recompute)
            kept += own
            inner = max(inner, recomputed)
    return kept, inner


def _op_bytes(graph, mesh, op: Op, repeat: Repeat | None, dtype, dtype_bytes, recompute) -> tuple[int, int]:
    """(bytes the op keeps, bytes of its internals that recomputation rebuilds instead)."""
    out = graph.local_numel(op.type.dims, op.sharding, mesh) * dtype_bytes
    out += moe_inner_activations(graph, op, repeat, mesh) * dtype_bytes
    inner = attention_inner_bytes(graph, op, mesh, dtype=dtype, dtype_bytes=dtype_bytes, repeat=repeat)
    if recomputes_op(op, repeat, recompute):
        return out, inner
    return out + inner, 0


def _yield_bytes(graph: Graph, mesh: Mesh, repeat: Repeat, dtype_bytes: int) -> int:
    """What one layer hands to the next: its yields, as the nodes defining them lay them
    out (a value carried through unchanged: as the value carried in)."""
    layout = {node.out: (node.type.dims, node.sharding) for node, _ in walk_ops(graph.body)
              if isinstance(node, (Op, Redistribute))}
    layout |= {i.name: (i.type.dims, i.sharding) for i in graph.inputs}
    total = 0
    for name in repeat.body.yields:
        if name not in layout:  # a body arg: the carried value
            name = repeat.carried[repeat.body.args.index(name)]
        dims, sharding = layout[name]
        total += graph.local_numel(dims, sharding or Sharding(), mesh) * dtype_bytes
    return total


def attention_inner_bytes(graph: Graph, op: Op, mesh: Mesh, *, dtype: str, dtype_bytes: int,
                          repeat: Repeat | None = None) -> int:
    """Bytes an `attention` op's kernel keeps besides its inputs and output, on one rank:
    the log-sum-exp per (batch, head, query row), float32 in 16-bit training, and at
    cp = 1 with grouped-query attention the K and V repeated to every query head
    (SDPA's inputs there, `runtime/kernels._attention`)."""
    if op.kind != "attention":
        return 0
    dims = op.type.dims  # [batch, seq, heads, head_dim]
    out = graph.local_numel(dims, op.sharding, mesh)
    lse = out // graph.local_size(dims[-1], op.sharding, mesh)
    total = lse * (4 if dtype in LOW_PRECISION else dtype_bytes)
    if mesh.size(MeshAxis.CP) == 1:
        kv = _value_dims(graph, repeat, op.args[1])
        k_sharding = op.arg_specs[1].sharding if op.arg_specs and op.arg_specs[1] else Sharding()
        if graph.local_size(kv[2], k_sharding, mesh) != graph.local_size(dims[2], op.sharding, mesh):
            total += 2 * out * dtype_bytes
    return total


def _value_dims(graph: Graph, repeat: Repeat | None, name: str) -> tuple[str, ...]:
    blocks = [graph.body] + ([repeat.body] if repeat else [])
    for block in blocks:
        for node, _ in walk_ops(block):
            if isinstance(node, (Op, Redistribute)) and node.out == name:
                return node.type.dims
    return next(i.type.dims for i in graph.inputs if i.name == name)


def moe_inner_activations(graph: Graph, op: Op, repeat: Repeat | None, mesh: Mesh) -> int:
    """Elements a `moe` op keeps for backward besides its output, on one rank: the
    router's scores [T, E], and for the R = T x top_k routed rows (about as many
    arrive at a rank as leave it), the rows its experts receive [R, hidden], their
    inner activations (SwiGLU: gate, up, silu and product, 4 x [R, ffn]; GELU: 2),
    and the rows sent back [R, hidden]. T: this rank's tokens; ffn: per tp rank. A
    lower bound: on one device the runtime keeps 1.05-1.2x this (tests/test_moe.py);
    with rows from several ep ranks its batched experts pad to the busiest expert and
    keep more (measured 1.5-1.9x, on one device, before experts ran on slices there)."""
    if op.kind != "moe":
        return 0
    hidden = op.type.dims[-1]
    tokens = graph.local_numel(op.type.dims, op.arg_specs[0].sharding, mesh) // graph.dim(hidden)
    experts = graph.dim(next(d for d in _param_dims(graph, repeat, op.args[1]) if d != hidden))
    weight = _param_dims(graph, repeat, op.args[2])
    ffn = next(d for d in weight[1:] if d != hidden)
    ffn_local = graph.local_size(ffn, op.arg_specs[2].sharding, mesh)
    rows = tokens * int(op.attr("top_k", 2))
    inner = (4 if len(op.args) == 5 else 2) * ffn_local
    return tokens * experts + rows * (2 * graph.dim(hidden) + inner)


def _param_dims(graph: Graph, repeat: Repeat | None, name: str) -> tuple[str, ...]:
    params = {p.name: p for p in graph.body.params} | ({p.name: p for p in repeat.body.params} if repeat else {})
    return params[name].dims
