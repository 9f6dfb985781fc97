"""Transient peaks: buffers a rank holds only for a moment, on top of what it keeps.

The plan's `transient` of a class of ranks is the largest of these, each for one
microbatch on one rank (they happen at different moments of the step, so the
largest, not their sum, is added to what the rank keeps):

- recomputed region: a layer (full) or attention (selective) rebuilt while its
  backward runs (`fivedc/estimates/activations.py`);
- forward working set: the values a unit computes and does not keep (a partial sum
  before its reduce-scatter, the gathered input of a linear under SP, a norm's
  output): the program holds one unit's values until the next unit overwrites them;
- loss: the logits' gradient beside the kept softmax, and a temporary as large
  (2 x the logits);
- ZeRO-3: without a pipeline the gathered parameter in use and the next one,
  prefetched (2 x the largest); under a pipeline the whole gathered parameters of the
  rank's chunks and their gradients for the step (2 x the local parameters);
- gradient buckets: ZeRO-0/1 copy a bucket's gradients into one flat buffer (the
  largest bucket); ZeRO-2 lays every bucket out whole before reduce-scattering it,
  two at a time (2 x the largest);
- MoE all-to-all: the rows sent to the experts and back ([R, hidden] each way);
- ring attention: the K/V block in hand and the one arriving, and in backward their
  gradient accumulators (4 x the packed K/V block at the dtype, 6 x at float32);
- pipeline sends: one forward and one backward send buffer in flight (2 x the
  largest boundary).

`transients` gives every part per pp rank, so the summary can say which one it is.
"""

from __future__ import annotations

from fivedc.ir.graph import CollectiveKind, Graph, Op, Redistribute, Repeat, walk_params
from fivedc.ir.mesh import Mesh, MeshAxis
from fivedc.passes.recompute import recomputes_layer, recomputes_op
from fivedc.estimates.saved import VALUE, SaveContext, op_saves
from fivedc.passes.stages import PipelineSpec, Unit, chunk_param_names, units


def transients(graph: Graph, mesh: Mesh, *, dtype: str, dtype_bytes: int, zero: int, pipeline: PipelineSpec | None,
               recompute: str, regions: list[int], buckets=(), overlap: bool = True) -> list[dict[str, int]]:
    """Per pp rank (one entry without a pipeline): each transient part, in bytes."""
    m = pipeline.microbatches if pipeline else 1
    c = SaveContext.of(graph, mesh, dtype=dtype, dtype_bytes=dtype_bytes, microbatches=m, recompute=recompute)
    all_units = units(graph)
    ranks = range(mesh.size(MeshAxis.PP)) if pipeline else (None,)
    out = []
    for r in ranks:
        mine = [u for chunk in pipeline.chunks if chunk.rank == r
                for u in all_units[chunk.units[0]:chunk.units[1]]] if pipeline else all_units
        local = chunk_param_names(graph, pipeline, pp_rank=r) if pipeline else None
        parts = {"recomputed region": regions[r or 0]}
        parts["forward working set"] = max((working_set(c, graph, u, recompute) for u in mine), default=0)
        parts["loss"] = max((loss_bytes(c, graph, u) for u in mine), default=0)
        parts["ZeRO-3 gathers"] = _zero3(graph, mesh, dtype_bytes, zero, pipeline, local)
        parts["gradient buckets"] = _buckets(graph, mesh, dtype_bytes, zero, buckets, local)
        parts["MoE all-to-all"] = max((_kernel_buffers(c, graph, u, "moe") for u in mine), default=0)
        parts["ring K/V"] = max((_kernel_buffers(c, graph, u, "attention") for u in mine), default=0)
        if pipeline:
            sent = [chunk for chunk in pipeline.chunks if chunk.rank == r and chunk.sends]
            parts["pipeline sends"] = 2 * max((sum(c.value_bytes(n) for n in chunk.sends) for chunk in sent), default=0)
        out.append(parts)
    return out


def _items(graph: Graph, unit: Unit):
    if unit.layer is None:
        return graph.body.items[unit.start:unit.stop], None
    repeat = graph.body.items[unit.start]
    return repeat.body.items, repeat


def working_set(c: SaveContext, graph: Graph, unit: Unit, recompute: str) -> int:
    """Bytes of the values one unit computes and does not keep for backward (all of them
    in a layer recomputed whole)."""
    items, repeat = _items(graph, unit)
    kept: set[str] = set()
    if repeat is None or not recomputes_layer(repeat, recompute):
        for op in items:
            if isinstance(op, Op):
                saves = c.value_args(op) if recomputes_op(op, repeat, recompute) else op_saves(c, op)
                kept |= {s.key for s in saves if s.kind == VALUE}
    return sum(c.value_bytes(node.out) for node in items
               if isinstance(node, (Op, Redistribute)) and node.out not in kept and node.out != graph.output)


def loss_bytes(c: SaveContext, graph: Graph, unit: Unit) -> int:
    items, _ = _items(graph, unit)
    return max((2 * c.value_bytes(op.args[0]) for op in items if isinstance(op, Op) and op.kind == "cross_entropy"),
               default=0)


def _kernel_buffers(c: SaveContext, graph: Graph, unit: Unit, kind: str) -> int:
    items, _ = _items(graph, unit)
    best = 0
    for op in items:
        if not isinstance(op, Op) or op.kind != kind:
            continue
        if kind == "moe" and any(col.kind == CollectiveKind.ALL_TO_ALL and c.mesh.size(*col.axes) > 1
                                 for col in op.collectives):
            rows = c.value_numel(op.args[0]) // c.graph.dim(c.layouts[op.args[0]][0].dims[-1]) * int(op.attr("top_k", 2))
            best = max(best, 2 * rows * c.graph.dim(c.layouts[op.args[0]][0].dims[-1]) * c.dtype_bytes)
        ring = op.annotation("cp") is not None and str(op.annotation("cp").args[0]) == "ring"
        if kind == "attention" and ring and c.mesh.size(MeshAxis.CP) > 1:
            kv = 2 * c.value_numel(op.args[1])
            best = max(best, 4 * kv * c.dtype_bytes + 6 * kv * c.compute_bytes)
    return best


def _zero3(graph: Graph, mesh: Mesh, dtype_bytes: int, zero: int, pipeline: PipelineSpec | None,
           local: set[str] | None) -> int:
    if zero != 3:
        return 0
    sizes = [graph.local_numel(p.dims, p.sharding, mesh) * dtype_bytes * _instances(p, r, local)
             for p, r in walk_params(graph.body) if mesh.size(*p.grad_partial) > 1]
    if pipeline is not None:
        return 2 * sum(sizes)
    largest = [graph.local_numel(p.dims, p.sharding, mesh) * dtype_bytes for p, _ in walk_params(graph.body)
               if mesh.size(*p.grad_partial) > 1]
    return 2 * max(largest, default=0)


def _instances(param, repeat: Repeat | None, local: set[str] | None) -> int:
    if repeat is None:
        return 1 if local is None or param.name in local else 0
    if local is None:
        return repeat.count
    return sum(f"{repeat.name}.{i}.{param.name}" in local for i in range(repeat.count))


def _buckets(graph: Graph, mesh: Mesh, dtype_bytes: int, zero: int, buckets, local: set[str] | None) -> int:
    if zero == 3 or not buckets:
        return 0
    mine = [b for b in buckets if local is None or _on_rank(b.params[0], local)]
    largest = max((b.bytes for b in mine), default=0)
    return 2 * largest if zero == 2 else largest


def _on_rank(name: str, local: set[str]) -> bool:
    if ".*." not in name:
        return name in local
    prefix, rest = name.split(".*.", 1)
    return any(n.startswith(prefix + ".") and n.endswith("." + rest) for n in local)

