"""Transient peaks: buffers a rank holds only for a moment, on top of what it keeps.

Under a pipeline, the plan's `transient` of a class of ranks is the largest of these,
each for one microbatch on one rank (they happen at different moments of the step, so
the largest, not their sum, is added to what the rank keeps). Without a pipeline each
part is placed at its moment of the step, beside what is live then
(`step_buffers`, `fivedc/estimates/timeline.py`). The parts:

- recomputed region: a layer (full) or attention (selective) rebuilt while its
  backward runs (`fivedc/estimates/activations.py`);
- forward working set: the values a unit computes and does not keep (a partial sum
  before its reduce-scatter, the gathered input of a linear under SP, a norm's
  output): the program holds one unit's values until the next unit overwrites them;
  with --fp8, beside them the largest float8 linear's float8 copies of its input and weight;
- loss: the logits' gradient beside the kept softmax, and a temporary as large
  (2 x the logits);
- ZeRO-3: without a pipeline, gathered by group (the buckets): in forward the groups
  of the unit running (a layer's, or the top level's) and the next group, prefetched;
  in backward a group gathered again, its gradients and their reduce-scatter buffer
  (3 x the group): the larger (`runtime/zero3.py`); under a pipeline the whole
  gathered parameters of the rank's chunks and their gradients for the step (2 x the
  local parameters); both also beside other parts (below);
- gradient buckets: ZeRO-0/1 copy a bucket's gradients into one flat buffer, dropping
  them (the largest bucket beyond the gradients); ZeRO-2 lays every bucket out whole
  before reduce-scattering it, two at a time (2 x the largest, `runtime/buckets.py`);
- MoE all-to-all: the rows sent to the experts and back ([R, hidden] each way);
- ring attention: the K/V block in hand and the one arriving, and in backward their
  gradient accumulators (4 x the packed K/V block at the dtype, 6 x at float32);
  the `math` attention kernel: the scores and their softmax at once (forward), or dP
  and dS (backward), 2 x the score elements at the dtype;
- weight gradients put off behind a tensor-parallel sum: the output gradients of the
  linears reading the summed input, the input's gradient and the sum's buffer (and
  under SP the input gathered again for dW); in the unit of the loss, beside the loss's
  buffers, which its backward reads (the head's dW, put off behind its input's sum);
- pipeline sends: one forward and one backward send buffer in flight (2 x the
  largest boundary);
- tied parameters: the flat buffer their holders all-reduce their gradients in (the
  largest group the rank holds), beside the gradients it is made of.

ZeRO-3's gathers are the exception: they are live together with the others (a layer's
backward holds its gathered group and its gradients while its recomputed region is
rebuilt; under a pipeline the gathered parameters stay for the step), so their sums
with what is beside them are parts too.

`transients` gives every part per pp rank, so the summary can say which one it is.
"""

from __future__ import annotations

from fivedc.ir.graph import CollectiveKind, Graph, Op, Redistribute, walk_params
from fivedc.ir.mesh import Mesh, MeshAxis
from fivedc.estimates.saved import VALUE, SaveContext, op_saves, score_elements
from fivedc.passes.attention_kernel import kernel_of
from fivedc.passes.fp8 import is_fp8
from fivedc.passes.communication import weight_readers
from fivedc.passes.held_params import HeldParams, param_count
from fivedc.estimates.memo import Memo, memo_for, memo_units, param_sizes, rank_held, save_context
from fivedc.estimates.timeline import UnitBuffers, recomputed_regions
from fivedc.passes.stages import PipelineSpec, Unit


def transients(graph: Graph, mesh: Mesh, *, dtype: str, dtype_bytes: int, zero: int, pipeline: PipelineSpec | None,
               recompute: str, regions: list[int], buckets=(), overlap: bool = True,
               memo: Memo | None = None, tied=(), activations: list[int] | None = None) -> list[dict[str, int]]:
    """Per pp rank (one entry without a pipeline): each transient part, in bytes. The parts
    that depend on the recomputation and those that depend on ZeRO are kept in `memo` apart
    (a layout search asks for every pairing of the two). `activations`, per pp rank, sets the
    optimizer step against the activations freed by then. Without a pipeline the step's
    moments are walked one by one instead (`step_buffers`, `fivedc/estimates/timeline.py`)."""
    memo = memo_for(memo, graph, mesh, dtype)
    kept = memo.get(("kept transients", dtype_bytes, recompute, pipeline, tuple(regions), tuple(tied)),
                    lambda: _kept_parts(memo, dtype_bytes, pipeline, recompute, regions, tied))
    zero_parts = memo.get(("zero transients", dtype_bytes, zero, pipeline, buckets),
                          lambda: _zero_parts(memo, dtype_bytes, zero, pipeline, buckets))
    out = []
    for r, (mine, theirs) in enumerate(zip(kept, zero_parts)):
        parts = {name: mine[name] for name in ("recomputed region", *UNIT_PARTS[:2])}
        parts |= theirs
        parts |= {name: mine[name] for name in (*UNIT_PARTS[2:], "pipeline sends", "tied gradient sum")
                  if name in mine}
        later = _chunk_grads(memo, dtype_bytes, pipeline, r) if zero == 3 and pipeline else 0
        out.append(parts | _zero3_beside(parts, zero, pipeline, buckets, later))
    if activations is not None:  # the step comes after backward: the activations are gone by then
        for r, parts in enumerate(out):
            step = STEP_BYTES.get(dtype, 0) * largest_update(memo, zero, pipeline, r if pipeline else None)
            parts[OPTIMIZER_STEP] = max(step - activations[r], 0)
            if pipeline is not None and parts.get("gradient buckets"):  # summed after the last backward
                parts[GRAD_SUMS] = max(parts.pop("gradient buckets") - activations[r], 0)
    return out


OPTIMIZER_STEP = "optimizer step's temporaries beyond the activations freed by then"
GRAD_SUMS = "gradient buckets beyond the activations freed by then"
# AdamW's temporaries per element of the part it updates (runtime/zero.adamw_): in
# 16-bit training the gradient in float32, the square root of the second moment and its
# quotient (float32 each); in fp32 and fp64 the last two, at the dtype.
STEP_BYTES = {"bf16": 12, "fp16": 12, "fp32": 8, "fp64": 16}


def largest_update(memo: Memo, zero: int, pipeline: PipelineSpec | None, pp_rank: int | None) -> int:
    """Elements of the largest part a rank's optimizer updates at once: a parameter's local
    shard, or under ZeRO its owned chunk."""
    held = rank_held(memo, pipeline, pp_rank)
    return max((chunk if zero else local for param, repeat, local, chunk, _ in param_sizes(memo)
                if param_count(held, param.name, repeat)), default=0)


def _zero3_beside(parts: dict[str, int], zero: int, pipeline: PipelineSpec | None, buckets,
                  later: int = 0) -> dict[str, int]:
    """ZeRO-3's gathered weights are live together with other parts, not at another moment:
    without a pipeline a layer's backward holds its unit's groups gathered again (a
    recomputed layer reads them all), their gradients as they come back, one group's
    reduce-scatter buffer, and its recomputed region; under a pipeline the gathered
    parameters and their gradients stay for the whole step, beside every other part, while
    the rank's summed chunks of the gradients (`later`, which the total counts as held) are
    made only after the last backward, from the whole ones."""
    if zero != 3 or not parts.get("ZeRO-3 gathers"):
        return {}
    if pipeline is None:
        unit, group = zero3_unit_and_group(buckets)
        return {ZERO3_BACKWARD: 2 * unit + group + parts["recomputed region"]}
    others = max(v for k, v in parts.items() if k != "ZeRO-3 gathers")
    return {ZERO3_STEP: max(parts["ZeRO-3 gathers"] + others - later, parts["ZeRO-3 gathers"])}


def _chunk_grads(memo: Memo, dtype_bytes: int, pipeline: PipelineSpec, pp_rank: int) -> int:
    """Bytes of a pp rank's ZeRO-3 gradient chunks (what its held gradients are)."""
    held = rank_held(memo, pipeline, pp_rank)
    return sum(chunk * param_count(held, param.name, repeat)
               for param, repeat, _, chunk, _ in param_sizes(memo)) * dtype_bytes


def _kept_parts(memo: Memo, dtype_bytes: int, pipeline: PipelineSpec | None, recompute: str,
                regions: list[int], tied=()) -> list[dict[str, int]]:
    """Per pp rank, the parts that follow from what the rank runs and keeps (not from ZeRO)."""
    graph, mesh, m = memo.graph, memo.mesh, pipeline.microbatches if pipeline else 1
    c = save_context(memo, dtype_bytes, m, recompute)
    all_units = memo_units(memo)
    figures = memo.get(("unit transients", dtype_bytes, m, recompute),
                       lambda: _unit_parts(c, graph, all_units))
    out = []
    for r in range(memo.mesh.size(MeshAxis.PP)) if pipeline else (None,):
        mine = [k for chunk in pipeline.chunks if chunk.rank == r
                for k in range(chunk.units[0], chunk.units[1])] if pipeline else range(len(all_units))
        parts = {"recomputed region": regions[r or 0]}
        for index, name in enumerate(UNIT_PARTS):
            parts[name] = max((figures[k][index] for k in mine), default=0)
        if pipeline:
            sent = [chunk for chunk in pipeline.chunks if chunk.rank == r and chunk.sends]
            parts["pipeline sends"] = 2 * max((sum(c.value_bytes(n) for n in chunk.sends) for chunk in sent), default=0)
            params = {p.name: p for p in graph.body.params}
            parts["tied gradient sum"] = max((sum(graph.local_numel(params[n].dims, params[n].sharding, mesh)
                                                  for n in g.names) * dtype_bytes for g in tied if r in g.pp_ranks),
                                             default=0)
        out.append(parts)
    return out


def _zero_parts(memo: Memo, dtype_bytes: int, zero: int, pipeline: PipelineSpec | None,
                buckets) -> list[dict[str, int]]:
    """Per pp rank, ZeRO-3's gathers and the gradient buckets."""
    graph, mesh = memo.graph, memo.mesh
    out = []
    for r in range(mesh.size(MeshAxis.PP)) if pipeline else (None,):
        held = rank_held(memo, pipeline, r)
        out.append({"ZeRO-3 gathers": zero3_gathers(graph, mesh, dtype_bytes, zero, pipeline, held, buckets),
                    "gradient buckets": _buckets(graph, mesh, dtype_bytes, zero, buckets, held)})
    return out


ZERO3_BACKWARD = "ZeRO-3 layer gathered, its gradients and its recomputed region"
ZERO3_STEP = "ZeRO-3 gathers and the largest other part"
LOSS_BESIDE = "loss beside its unit's weight gradients put off"
UNIT_PARTS = ("forward working set", "loss", "MoE all-to-all", "attention buffers", "weight gradients put off",
              LOSS_BESIDE)


def _unit_parts(c: SaveContext, graph: Graph, all_units: list[Unit]) -> list[tuple[int, ...]]:
    """Each unit's parts of `UNIT_PARTS`, a repeat's layers computed once."""
    cache: dict = {}
    again = c.regathered
    out = []
    for unit in all_units:
        key = ("layer", unit.start) if unit.layer is not None else (unit.start, unit.stop)
        if key not in cache:
            loss, put_off = loss_bytes(c, graph, unit), put_off_bytes(c, graph, unit, again)
            cache[key] = (working_set(c, graph, unit), loss,
                          _kernel_buffers(c, graph, unit, "moe"), _kernel_buffers(c, graph, unit, "attention"),
                          put_off, loss + put_off if loss and put_off else 0)
        out.append(cache[key])
    return out


def _items(graph: Graph, unit: Unit):
    if unit.layer is None:
        return graph.body.items[unit.start:unit.stop], None
    repeat = graph.body.items[unit.start]
    return repeat.body.items, repeat


def working_set(c: SaveContext, graph: Graph, unit: Unit) -> int:
    """Bytes of the values one unit computes and does not keep for backward (all of them
    in a layer recomputed whole)."""
    items, repeat = _items(graph, unit)
    kept: set[str] = set()
    if repeat is None or not c.again.layer(repeat):
        for op in items:
            if isinstance(op, Op):
                saves = c.value_args(op) if c.again.op(op, repeat) else op_saves(c, op)
                kept |= {s.key for s in saves if s.kind == VALUE}
    values = sum(c.value_bytes(node.out) for node in items
                 if isinstance(node, (Op, Redistribute)) and node.out not in kept and node.out != graph.output)
    return values + max((fp8_copies(c, op) for op in items if isinstance(op, Op) and is_fp8(op)), default=0)


def fp8_copies(c: SaveContext, op: Op) -> int:
    """Bytes of a float8 linear's float8 copies of its input and weight, one byte an element,
    live beside its forward matmul (torchao keeps neither for backward: `passes/fp8.py`)."""
    from fivedc.ir.graph import walk_params

    w = next(p for p, _ in walk_params(c.graph.body) if p.name == op.args[1])
    spec = op.arg_specs[1].sharding if len(op.arg_specs) > 1 and op.arg_specs[1] else None
    return c.value_numel(op.args[0]) + c.numel(w.dims, spec)


def loss_bytes(c: SaveContext, graph: Graph, unit: Unit) -> int:
    items, _ = _items(graph, unit)
    # two logits-sized tensors at once (16-bit logits: computed in float32, runtime/precision.py)
    return max((2 * c.value_numel(op.args[0]) * c.compute_bytes for op in items
                if isinstance(op, Op) and op.kind == "cross_entropy"), default=0)


def put_off_bytes(c: SaveContext, graph: Graph, unit: Unit, again=()) -> int:
    """Where a linear input's backward sum runs behind its readers' weight gradients
    (`runtime/tp_overlap.PutOff`): the readers' output gradients, kept for dW until
    the sum starts, beside the input's gradient and the sum's buffer, and under SP the
    input gathered again (`again`: `SaveContext.regathered`)."""
    items, _ = _items(graph, unit)
    params = {p.name for p, _ in walk_params(graph.body)}
    best = 0
    for node in items:
        if isinstance(node, Redistribute) and any(x.overlaps for x in node.backward):
            weights = set(weight_readers(items, node.out, params))
            readers = sum(c.value_bytes(op.out) for op in items if isinstance(op, Op) and op.kind == "linear"
                          and op.args[0] == node.out and op.args[1] in weights)
            best = max(best, readers + (3 if node.out in again else 2) * c.value_bytes(node.out))
    return best


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
        if kind == "attention" and kernel_of(op) == "math":  # the scores and P, or dP and dS
            best = max(best, 2 * score_elements(c, op) * c.dtype_bytes)
    return best


def zero3_gathers(graph: Graph, mesh: Mesh, dtype_bytes: int, zero: int, pipeline: PipelineSpec | None,
           held: HeldParams | None, buckets) -> int:
    if zero != 3:
        return 0
    if pipeline is not None:
        return 2 * sum(graph.local_numel(p.dims, p.sharding, mesh) * dtype_bytes * param_count(held, p.name, r)
                       for p, r in walk_params(graph.body) if mesh.size(*p.grad_partial) > 1)
    unit, group = zero3_unit_and_group(buckets)
    return max(unit + group, 3 * group)


def zero3_by_unit(buckets) -> dict[str | None, tuple[int, int]]:
    """Per repeat (None: the top level), (a unit's groups, its largest group) in bytes: what
    ZeRO-3 gathers while one of its layers (or the top level's ops) runs."""
    out: dict[str | None, tuple[int, int]] = {}
    for bucket in buckets:
        unit, group = out.get(bucket.repeat, (0, 0))
        out[bucket.repeat] = (unit + bucket.bytes, max(group, bucket.bytes))
    return out


def zero3_unit_and_group(buckets) -> tuple[int, int]:
    """(the largest unit's groups, the largest group) in bytes: a unit is a layer of a repeat
    (all alike) or the top level, a group one of the buckets."""
    units = zero3_by_unit(buckets).values()
    return max((unit for unit, _ in units), default=0), max((group for _, group in units), default=0)


def _buckets(graph: Graph, mesh: Mesh, dtype_bytes: int, zero: int, buckets, held: HeldParams | None) -> int:
    """ZeRO-0/1 copy a bucket into one flat buffer as its gradients are dropped; ZeRO-2, its
    buckets started during backward, lays two out whole at once. Under a pipeline (`held`)
    every bucket is summed after the last backward, ZeRO-2's as ZeRO-1's."""
    if zero == 3 or not buckets:
        return 0
    mine = [b for b in buckets if held is None or _on_rank(graph, b.params[0], held)]
    largest = max((b.bytes for b in mine), default=0)
    return 2 * largest if zero == 2 and held is None else largest


def _on_rank(graph: Graph, name: str, held: HeldParams) -> bool:
    """Whether a bucket's parameter (`layers.*.wq`, or a top-level name) is on the rank."""
    if ".*." not in name:
        return name in held.top
    prefix = name.split(".*.", 1)[0]
    return dict(held.layers).get(prefix, 0) > 0


def step_buffers(memo: Memo, dtype_bytes: int, zero: int, recompute: str, buckets=(), overlap: bool = True):
    """Without a pipeline, where each part of this module falls in the step
    (`fivedc/estimates/timeline.py`): per unit its forward and backward buffers, then the
    gradient sums' and the optimizer step's, as (name, bytes)."""
    graph, all_units = memo.graph, memo_units(memo)
    c = save_context(memo, dtype_bytes, 1, recompute)
    figures = memo.get(("unit transients", dtype_bytes, 1, recompute),
                       lambda: _unit_parts(c, graph, all_units))
    regions = recomputed_regions(memo, dtype_bytes, recompute)
    gathered = zero3_by_unit(buckets) if zero == 3 else {}
    summed = _buckets(graph, memo.mesh, dtype_bytes, zero, buckets, None)
    out = []
    for k in range(len(all_units)):
        working, loss, moe, attention, put_off, beside = figures[k]
        repeat = graph.body.items[all_units[k].start].name if all_units[k].layer is not None else None
        unit, group = gathered.get(repeat, (0, 0))
        forward = (("forward working set", working), ("loss", loss), ("MoE all-to-all", moe),
                   ("attention buffers", attention))
        backward = (("recomputed region", regions[k]), ("loss", loss), ("MoE all-to-all", moe),
                    ("attention buffers", attention), ("weight gradients put off", put_off), (LOSS_BESIDE, beside))
        after = (("gradient buckets", summed),) if overlap and zero in (0, 2) else ()  # started by its hooks
        if zero == 3:  # the gathered groups are live beside everything else of the unit
            forward = ((ZERO3_FORWARD, unit + group + max(b for _, b in forward)),)
            if regions[k]:  # checkpoint holds the rebuilt region until the region's backward is done
                backward = ((ZERO3_BACKWARD, 2 * unit + group + max(b for _, b in backward)),)
            else:  # what the unit kept is freed op by op as its gradients come
                backward = ((ZERO3_AGAIN, unit + group + max(b for _, b in backward)),)
                after = ((ZERO3_MADE, 2 * unit + group),)
        out.append(UnitBuffers(forward, backward, after))
    step = STEP_BYTES.get(memo.dtype, 0) * largest_update(memo, zero, None, None)
    return out, ("gradient buckets", summed), ("optimizer step's temporaries", step)


ZERO3_FORWARD = "ZeRO-3 layer gathered and the next, beside its buffers"
ZERO3_AGAIN = "ZeRO-3 layer gathered again and the next, beside its buffers"
ZERO3_MADE = "ZeRO-3 layer gathered, its gradients and their reduce-scatter buffer"
