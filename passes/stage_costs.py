"""What a pipeline unit costs: the multiply-adds of its ops on one rank and the bytes of its parameters.

Cost of an op (`op_cost`): its multiply-adds on one rank (linear: output elements x
contracted size; attention: queries x keys x head dim, twice), else its output
elements. `unit_costs` sums them per unit (`passes/stages.py`), which the cut by
cost balances (`passes/stage_cuts.py`).
"""

from __future__ import annotations

from dataclasses import dataclass

from fivedc.ir.graph import Graph, Op, Redistribute, walk_ops
from fivedc.ir.mesh import Mesh
from fivedc.passes.chunk_params import outer_params, unit_top_params
from fivedc.passes.stages import units


def op_cost(graph: Graph, op: Op, mesh: Mesh, types: dict) -> float:
    out = graph.local_numel(op.type.dims, op.sharding, mesh)
    if op.kind in ("linear", "matmul"):
        x = types.get(op.args[0])
        contracted = [d for d in (x.dims if x else ()) if d not in op.type.dims]
        spec = op.arg_specs[0].sharding if op.arg_specs and op.arg_specs[0] else None
        return float(out * max(1, graph.local_numel(tuple(contracted), spec, mesh) if spec else 1))
    if op.kind == "attention":
        k_spec = op.arg_specs[1].sharding
        seq = graph.local_size(graph.seq_dim, k_spec, mesh)
        return 2.0 * out * seq
    return float(out)


@dataclass(frozen=True, slots=True)
class UnitCosts:
    """Per unit: its cost, the bytes of its own parameters (a layer's), and the top-level
    parameters it reads (a tied table is read by two units: a chunk counts it once,
    `chunk_param_bytes`); the bytes of each top-level parameter."""

    costs: tuple[float, ...]
    own_bytes: tuple[int, ...]
    reads: tuple[frozenset[str], ...]
    top_bytes: dict[str, int]

    def chunk_param_bytes(self, first: int, stop: int) -> int:
        read = frozenset().union(*self.reads[first:stop])
        return sum(self.own_bytes[first:stop]) + sum(self.top_bytes[n] for n in read)


def unit_costs(graph: Graph, mesh: Mesh, dtype_bytes: int) -> UnitCosts:
    """Cost and parameter bytes of every unit."""
    types = {}
    for node, _ in walk_ops(graph.body):
        if isinstance(node, (Op, Redistribute)):
            types[node.out] = node.type
    for item in graph.inputs:
        types[item.name] = item.type

    def block_cost(items) -> float:
        return sum(op_cost(graph, i, mesh, types) for i in items if isinstance(i, Op))

    def params_bytes(params) -> int:
        return sum(graph.local_numel(p.dims, p.sharding, mesh) for p in params) * dtype_bytes

    items, top = graph.body.items, {p.name for p in graph.body.params}
    costs, sizes, reads, layers = [], [], [], {}
    for unit in units(graph):
        if unit.layer is not None:  # every layer of a repeat costs the same
            if unit.start not in layers:
                body = items[unit.start].body
                layers[unit.start] = (block_cost(body.items), params_bytes(body.params),
                                      frozenset(outer_params(items[unit.start], top)))
            cost, size, read = layers[unit.start]
        else:
            cost, size = block_cost(items[unit.start:unit.stop]), 0
            read = frozenset(unit_top_params(items, unit, top))
        costs.append(cost)
        sizes.append(size)
        reads.append(read)
    top_bytes = {p.name: params_bytes((p,)) for p in graph.body.params}
    return UnitCosts(tuple(costs), tuple(sizes), tuple(reads), top_bytes)
