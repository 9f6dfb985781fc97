"""The readable plan summary that `fivedc compile` prints.

`render_summary` writes, with rich tables and no colour (it must read well when
piped), in order: a header (model, mesh, rank order, sequence parallelism, the
context-parallel layout and attention variants, the pipeline's schedule, how its
chunks were cut and its one bubble figure (the step-time model's with `--gpu`) (or that a pp=1 plan leaves the model's @stage marks unused), ZeRO,
overlap, activation recomputation, dtype, plan version), the mesh groups, the
pipeline chunks, one row per parameter (global and local shape, sharding, the axes
its gradient is summed over), the output shardings seen per op kind, the ops that
run replicated (no sharding rule) with their lines and reasons, every collective
with its bytes, count and reason followed by bytes per step per phase, and the
memory estimate per rank (the busiest class of ranks in bytes, then every class). By default it fits an 80-column
terminal (each collective is one line of facts with its reason wrapped below it);
`wide=True` gives one table row per collective, reason last, for 140 columns or
more. Every cell is a `Text`, never markup, because reasons quote shardings in
brackets (`[batch:dp seq:tp]`). `format_bytes` (`fivedc/plan/tables.py`) is shared with
`fivedc.plan.diff`; the estimate tables are in `fivedc/plan/summary_estimates.py`.
"""

from __future__ import annotations

from collections import Counter

from rich.console import Console, Group
from rich.padding import Padding
from rich.table import Table
from rich.text import Text

from fivedc.ir.aten_layout import whole_dims
from fivedc.ir.states import graph_states
from fivedc.ir.graph import Collective, Graph, Op, Param, Phase, Redistribute, Repeat, walk_ops, walk_params
from fivedc.ir.mesh import Mesh, MeshAxis
from fivedc.plan.execution_plan import ExecutionPlan, qualified
from fivedc.plan.summary_estimates import memory_classes_table, memory_table, time_table, transient_text
from fivedc.plan.tables import format_bytes, text_row, titled_table
from fivedc.passes.recompute import recomputed_regions
from fivedc.ir.seq_layout import describe
from fivedc.ir.sharding import Sharding
from fivedc.passes.stages import CUTS, has_marks

MAX_PARAM_ROWS = 40  # without --verbose, a longer parameter table is cut here
def axes_text(axes: tuple[str, ...]) -> str:
    """`dp*tp`, or `-` for no axes."""
    return "*".join(axes) if axes else "-"


def _mesh_text(mesh: Mesh) -> str:
    sizes = ", ".join(f"{axis}={size}" for axis, size in mesh.as_dict().items())
    return f"{sizes} (world {mesh.world})"


def _param_name(param: Param, repeat: Repeat | None) -> str:
    name = qualified(param.name, repeat)
    return f"{name} × {repeat.count}" if repeat else name


def _global_shape(dims: tuple[str, ...], graph: Graph) -> str:
    return " ".join(f"{d}={graph.dim(d)}" for d in dims) or "scalar"


def _local_shape(dims: tuple[str, ...], sharding: Sharding | None, graph: Graph, mesh: Mesh) -> str:
    sharding = sharding or Sharding()
    return " ".join(f"{d}={graph.local_size(d, sharding, mesh)}" for d in dims) or "scalar"


def _collective_dim(c: Collective) -> str:
    if c.dim and c.dim2:
        return f"{c.dim}->{c.dim2}"
    return c.dim or "-"


def phase_totals(collectives: tuple[Collective, ...]) -> dict[str, int]:
    """Bytes per step per phase (bytes x count), every phase listed, in `Phase` order."""
    totals = {str(p): 0 for p in Phase}
    for c in collectives:
        totals[str(c.phase)] += c.bytes * c.count
    return totals


def op_shardings(graph: Graph) -> dict[str, Counter[str]]:
    """Per op kind (first appearance order): output sharding text -> ops per step."""
    found: dict[str, Counter[str]] = {}
    for node, repeat in walk_ops(graph.body):
        if isinstance(node, Op):
            sharding = str(node.sharding or Sharding())
            found.setdefault(node.kind, Counter())[sharding] += repeat.count if repeat else 1
    return found


def _header(plan: ExecutionPlan) -> Table:
    graph = plan.graph
    grid = Table.grid(padding=(0, 2))
    grid.add_column(style="bold")
    grid.add_column()
    rows = (
        ("model", f"{graph.name} ({graph.source or 'no source file'})"),
        ("mesh", _mesh_text(plan.mesh)),
        ("rank order", ",".join(plan.mesh.rank_order) + " (innermost first)"),
        ("sequence parallel", "on" if plan.sequence_parallel else "off"),
        *((("context parallel", cp_text(plan)),) if plan.mesh.size(MeshAxis.CP) > 1 else ()),
        *((("pipeline", _pipeline_text(plan)),) if plan.pipeline or has_marks(graph) else ()),
        ("ZeRO", f"stage {plan.zero}" if plan.zero else "off"),
        ("overlap", _overlap_text(plan) + _beside_compute_text(plan)),
        ("recompute", recompute_text(plan)),
        ("dtype", plan.dtype),
        *((("fp8", _fp8_text(plan)),) if plan.fp8 else ()),
        ("plan version", str(plan.version)),
    )
    for key, value in rows:
        grid.add_row(Text(key), Text(value))
    for note in plan.notes:
        grid.add_row(Text("note"), Text(note))
    return grid


def _fp8_text(plan: ExecutionPlan) -> str:
    """How many linears run in float8 (passes/fp8.py), per layer stack and at top level."""
    from fivedc.ir.graph import Op, walk_ops
    from fivedc.passes.fp8 import is_fp8

    linears = [(op, repeat) for op, repeat in walk_ops(plan.graph.body) if isinstance(op, Op) and op.kind == "linear"]
    fp8 = sum(repeat.count if repeat else 1 for op, repeat in linears if is_fp8(op))
    total = sum(repeat.count if repeat else 1 for _, repeat in linears)
    return (f"{fp8} of {total} linears in float8 (torchao tensorwise: e4m3 inputs and weights, e5m2 gradients, "
            "dynamic scales); the rest at the dtype")


def _pipeline_text(plan: ExecutionPlan) -> str:
    spec = plan.pipeline
    if spec is None:
        return "off (pp=1): the model's @stage marks are not used"
    return (f"{spec.schedule}, {spec.microbatches} microbatches, {spec.virtual} chunk(s) per pp rank, "
            f"{CUTS[spec.cut]}; {_bubble_text(plan)}; draw it with: fivedc show PLAN --schedule out.png")


def _bubble_text(plan: ExecutionPlan) -> str:
    """The one bubble a summary prints: with a GPU (`--gpu`) the step-time model's (each chunk's
    estimated seconds and the transfers between them), which the step-time table breaks down
    too; without one, the schedule's own with equal chunks."""
    if plan.time is not None:
        return (f"bubble {plan.time.bubble:.1%} of the forward and backward (simulated with each chunk's "
                f"estimated seconds on {plan.time.hardware.key}, as under Step time)")
    return (f"bubble {pipeline_bubble(plan):.1%} of the step (simulated with equal chunks, a backward costing "
            "two forwards; --gpu estimates it with the chunks' costs)")


def pipeline_bubble(plan: ExecutionPlan) -> float:
    """The schedule's idle share of the step over all pp ranks, played on the clock with equal
    chunks and a backward twice a forward (1F1B: (p - 1) / (m + p - 1), as Megatron's paper).
    The step-time model's bubble (`plan.time.bubble`) plays the chunks' estimated seconds instead."""
    from fivedc.schedule import simulate

    return simulate(plan.pipeline.build_schedule(plan.mesh.size(MeshAxis.PP)), check=False).bubble_fraction


def _pipeline(plan: ExecutionPlan) -> Table:
    spec = plan.pipeline
    table = titled_table(f"Pipeline chunks ({CUTS[spec.cut]})", "chunk", "pp rank", "layers", "cost (share)",
                         "parameters", "sends")
    total = sum(c.cost for c in spec.chunks) or 1.0
    for c in spec.chunks:
        text_row(table, c.index, c.rank, c.what, f"{c.cost / total:.1%}", format_bytes(c.param_bytes),
             ", ".join(c.sends) or "-")
    return table


def _overlap_text(plan: ExecutionPlan) -> str:
    if not plan.overlap:
        return "off: gradients are summed after backward"
    if plan.pipeline is not None:
        return "gradients accumulate over the microbatches and are summed after the last"
    if plan.zero == 3:
        return "on: each parameter's next use is gathered while the current op computes"
    if plan.zero == 1:
        return (f"after backward under ZeRO-1 (it keeps the full gradients): {len(plan.buckets)} gradient "
                "buckets reduce-scattered then")
    size = format_bytes(plan.bucket_bytes)
    return f"on: {len(plan.buckets)} gradient buckets of up to {size}, summed during backward"


def _beside_compute_text(plan: ExecutionPlan) -> str:
    """How many of the redistributions' collectives in a step run beside compute (`overlaps`:
    tensor parallelism's sums behind weight gradients, its collectives beside the matmuls)."""
    total = beside = 0
    for node, repeat in walk_ops(plan.graph.body):
        if isinstance(node, Redistribute):
            for c in node.forward + node.backward:
                if c.kind != "slice" and plan.mesh.size(*c.axes) > 1:
                    total += repeat.count if repeat else 1
                    beside += (repeat.count if repeat else 1) if c.overlaps else 0
    return f"; {beside} of the {total} redistributions' collectives per step run beside compute" if beside else ""


def recompute_text(plan: ExecutionPlan) -> str:
    """The recompute mode and what it recomputes in this plan, counted per step."""
    layers, alone = recomputed_regions(plan.graph, plan.recompute)
    parts = ([f"{layers} layers keep only their input"] if layers else []) + \
            ([f"{alone} attention ops keep only q, k, v"] if alone else [])
    if not parts:
        return f"{plan.recompute}: every op keeps what its backward needs"
    return f"{plan.recompute}: {', '.join(parts)}; backward runs their forward again"


ACTIVATION_NOTES = {
    "none": "activations are what each op keeps for backward (its own save rule: fivedc/estimates/saved.py), "
            "for the microbatches the schedule keeps in flight (no recomputation)",
    "selective": "activations are what each op keeps for backward; attention kernels keep only "
                 "their inputs (their own buffers come back while their backward runs)",
    "full": "activations assume each recomputed layer keeps only its input (its activations come back "
            "while its backward runs)",
}


def cp_text(plan: ExecutionPlan) -> str:
    """The sequence layout over cp and how many attention ops use each variant."""
    variants: Counter[str] = Counter()
    for node, repeat in walk_ops(plan.graph.body):
        if isinstance(node, Op) and node.kind == "attention" and node.annotation("cp"):
            variants[str(node.annotation("cp").args[0])] += repeat.count if repeat else 1
    used = ", ".join(f"{variant} ×{n}" for variant, n in variants.items())
    return f"{describe(plan.graph.seq_layout, plan.mesh.size(MeshAxis.CP))}; attention: {used or 'none'}"


def _groups(plan: ExecutionPlan) -> Table:
    table = titled_table("Groups", "axes", "group size", "groups", "strides")
    for group in plan.groups:
        text_row(table, axes_text(group.axes), group.size, group.count, ", ".join(map(str, group.strides)))
    return table


def _params(plan: ExecutionPlan, *, verbose: bool) -> Table:
    graph, mesh = plan.graph, plan.mesh
    table = titled_table("Parameters", "parameter", "global shape", "sharding", "local shape", "grad reduced over")
    params = list(walk_params(graph.body))
    table.columns[0].overflow = "fold"  # a narrow terminal folds a long name instead of cutting it
    table.columns[0].min_width = min(24, max((len(qualified(p.name, r)) for p, r in params), default=1))
    shown = params if verbose or len(params) <= MAX_PARAM_ROWS else params[:MAX_PARAM_ROWS]
    for param, repeat in shown:
        text_row(
            table,
            _param_name(param, repeat),
            _global_shape(param.dims, graph),
            param.sharding or Sharding(),
            _local_shape(param.dims, param.sharding, graph, mesh),
            axes_text(param.grad_partial),
        )
    if len(shown) < len(params):
        table.caption = Text(f"... {len(params) - len(shown)} more parameters omitted (verbose shows all)")
        table.caption_justify = "left"
    return table


def _op_kinds(plan: ExecutionPlan) -> Table:
    table = titled_table("Output sharding per op kind", "op kind", "output shardings (ops per step)")
    for kind, counts in op_shardings(plan.graph).items():
        text_row(table, kind, ", ".join(f"{sharding} ×{n}" for sharding, n in counts.most_common()))
    return table


def replicated_ops(graph: Graph) -> list[tuple[Op, int]]:
    """The ops that run whole on every rank (`aten` with no sharding rule), with how many run per step."""
    return [(op, repeat.count if repeat else 1) for op, repeat in walk_ops(graph.body)
            if isinstance(op, Op) and op.kind == "aten" and whole_dims(op) is None]


def _replicated(plan: ExecutionPlan) -> Table | None:
    found = replicated_ops(plan.graph)
    if not found:
        return None
    table = titled_table("Replicated ops: no sharding rule, computed whole on every rank", "op", "at", "×", "reason")
    for op, count in found:
        text_row(table, f"{op.out} = {op.attr('target')}", _where(op, plan.graph), count, op.attr("reason"))
    return table


def _states(plan: ExecutionPlan) -> Table | None:
    """The module buffers the forward reads or adds to (fivedc/ir/states.py), whole on every rank."""
    found = graph_states(plan.graph)
    if not found:
        return None
    table = titled_table("States: module buffers the forward uses, whole on every rank", "buffer", "use")
    for state in found:
        use = "adds the whole batch's value to it" if state.written else "reads it"
        text_row(table, state.key, f"{state.op} {use}")
    return table


def _where(c: Collective | Op, graph: Graph) -> str:
    """`line:col` in the model's own file (named in the header), else `file:line:col`."""
    if c.loc is None:
        return "-"
    return f"{c.loc.line}:{c.loc.col}" if c.loc.file == graph.source else str(c.loc)


def _reason(c: Collective) -> str:
    return c.reason + (f" (overlaps: {c.overlaps})" if c.overlaps else "")


def _collectives(plan: ExecutionPlan, *, wide: bool) -> Table:
    table = _collectivetable(plan) if wide else _collective_list(plan)
    if not plan.collectives:
        table.caption = Text("no collectives: every rank computes independently")
        table.caption_justify = "left"
    return table


def _collective_list(plan: ExecutionPlan) -> Table:
    """Narrow form: per collective a line of facts, then its reason indented below."""
    table = titled_table("Collectives", "phase", "collective: bytes × count, where; why below")
    table.columns[1].ratio = 1
    for c in plan.collectives:
        dim = _collective_dim(c)
        where = _where(c, plan.graph)
        facts = (f"{c.kind} over {axes_text(c.axes)} of {c.tensor}" + (f" along {dim}" if dim != "-" else "")
                 + f": {format_bytes(c.bytes)} × {c.count}" + (f" at {where}" if where != "-" else ""))
        reason = Padding(Text(_reason(c), overflow="fold"), (0, 0, 0, 2))
        table.add_row(Text(str(c.phase)), Group(Text(facts, overflow="fold"), reason))
    return table


def _collectivetable(plan: ExecutionPlan) -> Table:
    table = titled_table("Collectives", "phase", "kind", "axes", "tensor", "dim", "bytes", "count", "at", "reason")
    for column in table.columns:
        column.overflow = "fold"
    table.columns[-1].ratio = 1
    table.columns[-1].min_width = 24
    for c in plan.collectives:
        text_row(table, c.phase, c.kind, axes_text(c.axes), c.tensor, _collective_dim(c), format_bytes(c.bytes),
             c.count, _where(c, plan.graph), _reason(c))
    return table


def render_summary(plan: ExecutionPlan, *, console: Console, verbose: bool = False, wide: bool = False) -> None:
    """Print the plan summary to `console`; `verbose` lists every parameter, `wide`
    gives the collective table (140+ columns) instead of the 80-column list."""
    console.print(Text(f"fivedc plan: {plan.graph.name}", style="bold"))
    console.print(_header(plan))
    console.print()
    console.print(_groups(plan))
    console.print()
    if plan.pipeline is not None:
        console.print(_pipeline(plan))
        console.print()
    console.print(_params(plan, verbose=verbose))
    console.print()
    console.print(_op_kinds(plan))
    console.print()
    for table in (_replicated(plan), _states(plan)):
        if table is not None:
            console.print(table)
            console.print()
    console.print(_collectives(plan, wide=wide))
    totals = phase_totals(plan.collectives)
    line = ", ".join(f"{phase} {format_bytes(n)}" for phase, n in totals.items())
    total = format_bytes(sum(totals.values()))
    console.print(Text(f"bytes per step (bytes × count): {line}; total {total}"))
    console.print()
    console.print(memory_table(plan))
    classes = memory_classes_table(plan)
    if classes is not None:
        console.print(classes)
    layers, alone = recomputed_regions(plan.graph, plan.recompute)
    console.print(Text(f"note: {ACTIVATION_NOTES['full' if layers else 'selective' if alone else 'none']}"))
    console.print(Text(f"note: {transient_text(plan)}"))
    if plan.time is not None:
        console.print()
        console.print(time_table(plan))


__all__ = ["MAX_PARAM_ROWS", "format_bytes", "op_shardings", "phase_totals", "render_summary", "replicated_ops"]
