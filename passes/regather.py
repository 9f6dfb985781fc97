"""Sequence parallelism as Megatron runs it: which gathered values backward gathers again.

The all-gathered input of a column-parallel linear is not kept for backward: the linears
keep this rank's sequence shard and gather it again for their weight gradients. `regathered`
names those values (the estimates count the shard, `runtime/program.py` keeps a note in place
of the gathered tensor, the instruction list issues the gather again); `regather_collectives`
lists the extra all-gathers in the plan, each with its reason.
"""

from __future__ import annotations

from dataclasses import replace

from fivedc.ir.graph import CollectiveKind, Graph, Op, Phase, Redistribute, readers, walk_ops
from fivedc.ir.ops import LINEAR_KINDS
from fivedc.passes.recompute import recomputes_layer


def regathered(graph: Graph, recompute: str = "none") -> dict[str, str]:
    """Gathered values that are kept as their shard and gathered again in backward:
    a redistribution whose forward only all-gathers, read only as the input x of
    linears (Megatron's sequence parallelism keeps the shard of a column-parallel
    linear's input). Inside a layer recomputed whole nothing is kept anyway: left out."""
    uses_of = readers(graph.body)
    out = {}
    for node, repeat in walk_ops(graph.body):
        if not isinstance(node, Redistribute) or (repeat is not None and recomputes_layer(repeat, recompute)):
            continue
        gathers = [c for c in node.forward if c.kind != CollectiveKind.SLICE]
        uses = uses_of.get(node.out, [])
        if gathers and all(c.kind == CollectiveKind.ALL_GATHER for c in gathers) and uses and all(
                isinstance(op, Op) and op.kind in LINEAR_KINDS and i == 0 for op, i in uses):
            out[node.out] = node.src
    return out


def regather_collectives(graph: Graph, recompute: str = "none"):
    """The all-gathers backward runs again for the values `regathered` keeps as shards."""
    again = regathered(graph, recompute)
    out = []
    for node, _ in walk_ops(graph.body):
        if isinstance(node, Redistribute) and node.out in again:
            for c in node.forward:
                if c.kind == CollectiveKind.ALL_GATHER:
                    out.append(replace(c, phase=Phase.BACKWARD, overlaps="", reason=(
                        f"sequence parallelism: the linears reading {node.out} keep only this rank's shard "
                        f"({node.src}) for backward and gather it again there for their weight gradients "
                        "(as Megatron), instead of keeping the gathered tensor")))
    return out

