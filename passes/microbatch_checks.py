"""Microbatches for a pipeline: how many by default, and whether the model can run in them.

The local batch must split into the microbatches (`check_microbatches`); ops that see
the whole batch at once cannot run one microbatch at a time (`check_per_microbatch`:
an `aten` op along the batch, a buffer write that is not a sum over the batch, a loss
counting targets computed from more than the inputs, whose ops `input_only_items`
finds). `choose_schedule` (`passes/stage_plan.py`) runs these checks.
"""

from __future__ import annotations

from fivedc.errors import NotSupportedError, PlanError
from fivedc.ir.aten_layout import whole_dims
from fivedc.ir.graph import Graph, Op, Redistribute, walk_ops
from fivedc.ir.mesh import Mesh, MeshAxis
from fivedc.ir.ops import counts_targets


def default_microbatches(graph: Graph, mesh: Mesh, p: int, least: int) -> int:
    """pp microbatches (or the schedule's least, if more), else the nearest count that
    splits the local batch: the next larger divisor, or the largest one."""
    local = graph.dim(graph.batch_dim) // mesh.size(MeshAxis.DP, MeshAxis.EP)
    want = max(p, least)
    divisors = [d for d in range(1, local + 1) if local % d == 0]
    return next((d for d in divisors if d >= want), divisors[-1])


def check_microbatches(graph: Graph, mesh: Mesh, m: int) -> None:
    batch = graph.dim(graph.batch_dim)
    data = mesh.size(MeshAxis.DP, MeshAxis.EP)
    local = batch // data
    if m < 1 or local % m:
        choices = ", ".join(str(d) for d in range(1, local + 1) if local % d == 0)
        raise PlanError(
            f"{graph.batch_dim}={batch} over dp*ep={data} leaves {local} per rank, which does not split into "
            f"{m} microbatches",
            hint=f"choose --microbatches in {{{choices}}}, or change {graph.batch_dim}",
        )


def input_only_items(graph: Graph, name: str) -> tuple[int, ...] | None:
    """The top-level items (indices) that compute value `name` from the inputs alone, in order
    (none: it is an input); None when it depends on a parameter, an activation or a repeat."""
    inputs = {i.name for i in graph.inputs}
    params = {p.name for p in graph.body.params}
    made = {item.out: i for i, item in enumerate(graph.body.items) if isinstance(item, (Op, Redistribute))}
    needed: set[int] = set()
    todo = [name]
    while todo:
        value = todo.pop()
        if value in inputs:
            continue
        if value in params or value not in made:
            return None
        index = made[value]
        if index not in needed:
            needed.add(index)
            item = graph.body.items[index]
            todo.extend(item.reads)
    return tuple(sorted(needed))


def check_per_microbatch(graph: Graph, m: int) -> None:
    """Ops that see the whole batch at once cannot run one microbatch at a time: an `aten` op
    that runs replicated or along the batch (it may reduce over it), and a loss with
    ignore_index whose targets are computed from more than the inputs (its count spans the
    step: the runtime counts it up front, from the inputs, running the ops that compute the
    targets once more on the whole step's inputs: `runtime/pipeline.py`)."""
    if m == 1:
        return
    inputs = {i.name for i in graph.inputs}
    additive = _added_sums(graph)
    for op, _ in walk_ops(graph.body):
        if not isinstance(op, Op) or op.out in additive:
            continue
        if op.kind == "state_add":
            raise NotSupportedError(
                f"a write of the module buffer {op.attr('state')} in a pipeline of {m} microbatches: each "
                "microbatch's forward would add it, one device's forward adds it once (only a sum over the "
                "batch adds up over the microbatches)", loc=op.loc, hint="use --microbatches 1, or pp=1")
        whole = whole_dims(op) if op.kind == "aten" else frozenset()
        if whole is None or graph.batch_dim in whole:
            how = "runs replicated (no sharding rule)" if whole is None else "runs along the batch"
            raise NotSupportedError(
                f"{op.attr('target')} {how} and sees the whole batch, so it cannot run "
                f"in {m} microbatches", loc=op.loc, hint="use --microbatches 1, or pp=1")
        if counts_targets(op) and op.args[1] not in inputs \
                and input_only_items(graph, op.args[1]) is None:
            raise NotSupportedError(
                f"cross_entropy with ignore_index over targets computed from more than the inputs ({op.args[1]}): "
                f"the count of targets spans the {m} microbatches", loc=op.loc,
                hint="compute the targets from the inputs only (a shift, a mask), pass them as an input, "
                "or use --microbatches 1")


_CASTS = ("aten.to.", "aten._to_copy.")


def _added_sums(graph: Graph) -> set[str]:
    """The `state_add` ops whose value is a sum over the batch (`aten.sum`, then casts) that nothing
    else reads, with that sum and its casts: each microbatch adds its rows' sum, and the
    microbatches' sums add up to the whole batch's (what one device adds)."""
    ops = {op.out: op for op, _ in walk_ops(graph.body) if isinstance(op, Op)}
    readers: dict[str, list[Op]] = {}
    for op in ops.values():
        for a in op.reads:
            readers.setdefault(a, []).append(op)
    out: set[str] = set()
    for op in ops.values():
        if op.kind != "state_add":
            continue
        chain, name = [op.out], op.args[0]
        while name in ops and ops[name].kind == "aten" and str(ops[name].attr("target")).startswith(_CASTS):
            chain.append(name)
            name = ops[name].args[0]
        source = ops.get(name)
        alone = all(len(readers.get(n, [])) == 1 for n in chain[1:] + [name])
        if source is not None and source.kind == "aten" and str(source.attr("target")).startswith("aten.sum.") \
                and alone:
            out.update(chain + [name])
    return out
