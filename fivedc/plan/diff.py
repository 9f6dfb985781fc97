"""What changes between two execution plans (`fivedc diff A B`).

`diff_plans(a, b)` compares the mesh (axis sizes, world, rank order), the options
(model, sequence parallelism, dtype, ZeRO stage, overlap, fp8; the pipeline's schedule,
microbatches, how its chunks were cut and what each holds), the mesh groups (matched by their axes), the
parameter shardings (matched by qualified name, `layers.*.wq`), the collectives,
the ops that run replicated (no sharding rule; matched by target and line) and the
memory estimate per rank (the busiest class's categories, and with pipeline stages
each pp rank's, `pp=R category`). Collectives are matched by (phase, kind, axes, tensor,
dim; not an all-reduce's); a key that occurs several times is paired up in plan order, a
pair whose bytes or count differ is "resized", one whose `overlaps` differ "overlapped".
A `PlanDiff` holds only what changed, as frozen dataclasses with tuple fields;
`to_json()` gives a stable dict for scripts and `diff_report.render_diff` a short report
marked `+` added, `-` removed, `~` changed.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, replace

from fivedc.ir.graph import Collective, Graph, Repeat, walk_params
from fivedc.estimates.memory import CATEGORIES
from fivedc.ir.mesh import MESH_ORDER, MeshAxis
from fivedc.plan.execution_plan import ExecutionPlan, qualified
from fivedc.ir.sharding import Sharding
from fivedc.plan.summary import axes_text, phase_totals, replicated_ops

MEMORY_CATEGORIES = CATEGORIES  # params, grads, optimizer, activations, transient, total
MARK = {"added": "+", "removed": "-", "resized": "~", "changed": "~", "overlapped": "~"}


@dataclass(frozen=True)
class ValueChange:
    """One scalar that differs: a mesh axis size, `world`, `rank_order`, an option."""

    name: str
    a: int | str | bool
    b: int | str | bool


@dataclass(frozen=True)
class GroupChange:
    axes: str  # `dp*tp`
    change: str  # added | removed | resized
    size: tuple[int | None, int | None]  # (in a, in b); None on the side it is missing from
    count: tuple[int | None, int | None]
    strides: tuple[tuple[int, ...] | None, tuple[int, ...] | None]


@dataclass(frozen=True)
class ParamChange:
    name: str  # qualified: `layers.*.wq`
    change: str  # added | removed | changed
    sharding: tuple[str | None, str | None]
    grad_reduced_over: tuple[str | None, str | None]  # `dp*tp`, `-`


@dataclass(frozen=True)
class CollectiveChange:
    change: str  # added | removed | resized | overlapped (what it runs beside changed)
    phase: str
    kind: str
    axes: str
    tensor: str
    dim: str | None
    bytes: tuple[int | None, int | None]  # per execution
    count: tuple[int | None, int | None]  # executions per step
    reason: str  # from b, or from a when removed
    overlaps: tuple[str | None, str | None] = (None, None)  # the compute it runs beside ("": none)


@dataclass(frozen=True)
class ReplicatedChange:
    """An op that runs replicated (no sharding rule) in one plan and not in the other."""

    change: str  # added | removed
    target: str  # aten.constant_pad_nd.default
    at: str  # its source location
    reason: str


@dataclass(frozen=True)
class TotalChange:
    """A per-step total (collective bytes of one phase) or a memory category."""

    name: str
    a: int
    b: int

    @property
    def ratio(self) -> float | None:
        return self.b / self.a if self.a else None


@dataclass(frozen=True)
class PlanDiff:
    mesh: tuple[ValueChange, ...] = ()  # axis sizes, then world, then rank_order
    options: tuple[ValueChange, ...] = ()  # model, sequence_parallel, dtype, zero, recompute, ...
    groups: tuple[GroupChange, ...] = ()
    params: tuple[ParamChange, ...] = ()
    collectives: tuple[CollectiveChange, ...] = ()
    bytes_per_step: tuple[TotalChange, ...] = ()  # per phase, only those that differ
    memory: tuple[TotalChange, ...] = ()  # per rank, only categories that differ
    replicated: tuple[ReplicatedChange, ...] = ()  # ops without a sharding rule, added or removed

    @property
    def is_empty(self) -> bool:
        return not any((self.mesh, self.options, self.groups, self.params, self.collectives,
                        self.bytes_per_step, self.memory, self.replicated))

    def collectives_with(self, change: str) -> tuple[CollectiveChange, ...]:
        return tuple(c for c in self.collectives if c.change == change)

    def to_json(self) -> dict:
        """Stable for scripts: every top-level key always present, lists in plan order.

        `mesh`, `options`: {name: [a, b]} for what changed. `groups`, `params`: lists of
        entries with a `change` field. `collectives`: {"added", "removed", "resized", "overlapped": lists,
        "bytes_per_step": {phase: {"a", "b"}}}. `memory`: {category: {"a", "b", "ratio"}}.
        """
        return {
            "identical": self.is_empty,
            "mesh": {v.name: [v.a, v.b] for v in self.mesh},
            "options": {v.name: [v.a, v.b] for v in self.options},
            "groups": [
                {"axes": g.axes, "change": g.change, "size": list(g.size), "count": list(g.count),
                 "strides": [list(s) if s is not None else None for s in g.strides]}
                for g in self.groups
            ],
            "params": [
                {"name": p.name, "change": p.change, "sharding": list(p.sharding),
                 "grad_reduced_over": list(p.grad_reduced_over)}
                for p in self.params
            ],
            "collectives": {
                **{change: [_collective_json(c) for c in self.collectives_with(change)]
                   for change in ("added", "removed", "resized", "overlapped")},
                "bytes_per_step": {t.name: {"a": t.a, "b": t.b} for t in self.bytes_per_step},
            },
            "memory": {t.name: {"a": t.a, "b": t.b, "ratio": t.ratio} for t in self.memory},
            "replicated": [{"change": r.change, "target": r.target, "at": r.at, "reason": r.reason}
                           for r in self.replicated],
        }


def canonical_values(graph: Graph) -> Graph:
    """The graph with its SSA values renamed in program order (v0, v1, ...), so plans
    of the same model from two frontends (DSL and torch.fx) diff by structure;
    parameter, input and dim names stay as they are."""
    names: dict[str, str] = {}

    def new(name: str) -> str:
        names[name] = f"v{len(names)}"
        return names[name]

    def ref(name: str) -> str:
        return names.get(name, name)

    def block(b):
        args, items = tuple(new(a) for a in b.args), []
        for item in b.items:
            if isinstance(item, Repeat):
                carried, body = tuple(ref(c) for c in item.carried), block(item.body)
                items.append(replace(item, carried=carried, body=body, results=tuple(new(r) for r in item.results)))
            else:
                items.append(replace(item, args=item.map_reads(ref), out=new(item.out)))
        return replace(b, args=args, items=tuple(items), yields=tuple(ref(y) for y in b.yields))

    return replace(graph, body=block(graph.body))


def _collective_json(c: CollectiveChange) -> dict:
    return {"phase": c.phase, "kind": c.kind, "axes": c.axes, "tensor": c.tensor, "dim": c.dim,
            "bytes": list(c.bytes), "count": list(c.count), "reason": c.reason, "overlaps": list(c.overlaps)}


# ---- comparison ------------------------------------------------------------------------
def _values(pairs: list[tuple[str, object, object]]) -> tuple[ValueChange, ...]:
    return tuple(ValueChange(name, a, b) for name, a, b in pairs if a != b)


def _groups(a: ExecutionPlan, b: ExecutionPlan) -> tuple[GroupChange, ...]:
    ga = {axes_text(g.axes): g for g in a.groups}
    gb = {axes_text(g.axes): g for g in b.groups}
    out = []
    for axes in list(ga) + [k for k in gb if k not in ga]:
        x, y = ga.get(axes), gb.get(axes)
        if x is not None and y is not None and (x.size, x.count, x.strides) == (y.size, y.count, y.strides):
            continue
        change = "added" if x is None else "removed" if y is None else "resized"
        out.append(GroupChange(
            axes, change,
            (x.size if x else None, y.size if y else None),
            (x.count if x else None, y.count if y else None),
            (x.strides if x else None, y.strides if y else None),
        ))
    return tuple(out)


def _param_table(plan: ExecutionPlan) -> dict[str, tuple[str, str]]:
    return {
        qualified(p.name, r): (str(p.sharding or Sharding()), axes_text(p.grad_partial))
        for p, r in walk_params(plan.graph.body)
    }


def _params(a: ExecutionPlan, b: ExecutionPlan) -> tuple[ParamChange, ...]:
    pa, pb = _param_table(a), _param_table(b)
    out = []
    for name in list(pa) + [k for k in pb if k not in pa]:
        x, y = pa.get(name), pb.get(name)
        if x == y:
            continue
        change = "added" if x is None else "removed" if y is None else "changed"
        out.append(ParamChange(name, change, (x[0] if x else None, y[0] if y else None),
                               (x[1] if x else None, y[1] if y else None)))
    return tuple(out)


def collective_key(c: Collective) -> tuple[str, str, str, str, str | None]:
    """What matches a collective across plans: not an all-reduce's dim (the chunks it runs in)."""
    return (str(c.phase), str(c.kind), axes_text(c.axes), c.tensor, None if c.kind == "all_reduce" else c.dim)


def _entry(change: str, x: Collective | None, y: Collective | None) -> CollectiveChange:
    phase, kind, axes, tensor, _ = collective_key(y or x)
    return CollectiveChange(
        change, phase, kind, axes, tensor, (y or x).dim,
        (x.bytes if x else None, y.bytes if y else None),
        (x.count if x else None, y.count if y else None),
        (y or x).reason,
        (x.overlaps if x else None, y.overlaps if y else None),
    )


def _collectives(a: ExecutionPlan, b: ExecutionPlan) -> tuple[CollectiveChange, ...]:
    """Removed and resized in a's order, then added in b's order."""
    pending: dict[tuple, list[int]] = defaultdict(list)  # key -> unmatched indices into b
    for i, c in enumerate(b.collectives):
        pending[collective_key(c)].append(i)
    changed, removed = [], []
    for x in a.collectives:
        same_key = pending[collective_key(x)]
        if not same_key:
            removed.append(_entry("removed", x, None))
            continue
        y = b.collectives[same_key.pop(0)]
        if (x.bytes, x.count) != (y.bytes, y.count):
            changed.append(_entry("resized", x, y))
        elif x.overlaps != y.overlaps:
            changed.append(_entry("overlapped", x, y))
    left = sorted(i for indices in pending.values() for i in indices)
    added = [_entry("added", None, b.collectives[i]) for i in left]
    return tuple(removed + changed + added)


def _totals(pairs: list[tuple[str, int, int]]) -> tuple[TotalChange, ...]:
    return tuple(TotalChange(name, x, y) for name, x, y in pairs if x != y)


def diff_plans(a: ExecutionPlan, b: ExecutionPlan) -> PlanDiff:
    """What changes going from plan `a` to plan `b`."""
    sizes_a, sizes_b = a.mesh.as_dict(), b.mesh.as_dict()
    mesh = _values(
        [(str(axis), sizes_a[axis], sizes_b[axis]) for axis in map(str, MESH_ORDER)]
        + [("world", a.mesh.world, b.mesh.world),
           ("rank_order", ",".join(a.mesh.rank_order), ",".join(b.mesh.rank_order))]
    )
    options = _values([
        ("model", a.graph.name, b.graph.name),
        ("sequence_parallel", a.sequence_parallel, b.sequence_parallel),
        ("dtype", a.dtype, b.dtype),
        ("zero", a.zero, b.zero),
        ("overlap", a.overlap, b.overlap),
        ("recompute", a.recompute, b.recompute),
        ("fp8", a.fp8, b.fp8),
        *_pipeline_values(a, b),
    ])
    ta, tb = phase_totals(a.collectives), phase_totals(b.collectives)
    memory = _totals([(name, getattr(a.memory, name), getattr(b.memory, name)) for name in MEMORY_CATEGORIES]
                     + _class_totals(a, b))
    return PlanDiff(
        mesh=mesh,
        options=options,
        groups=_groups(a, b),
        params=_params(a, b),
        collectives=_collectives(a, b),
        bytes_per_step=_totals([(phase, ta[phase], tb[phase]) for phase in ta]),
        memory=memory,
        replicated=_replicated(a, b),
    )


def _class_totals(a: ExecutionPlan, b: ExecutionPlan) -> list[tuple[str, int, int]]:
    """Per pp rank present in both, when either plan has several classes of ranks: each
    category of its class, named `pp=R category` (only those that differ are kept)."""
    if len(a.memory.ranks) == 1 and len(b.memory.ranks) == 1:
        return []
    pa, pb = a.mesh.size(MeshAxis.PP), b.mesh.size(MeshAxis.PP)
    out = []
    for r in range(min(pa, pb)):
        x, y = a.memory.of_pp_rank(r, pa), b.memory.of_pp_rank(r, pb)
        out += [(f"pp={r} {name}", getattr(x, name), getattr(y, name)) for name in MEMORY_CATEGORIES]
    return out


def _replicated(a: ExecutionPlan, b: ExecutionPlan) -> tuple[ReplicatedChange, ...]:
    """Replicated ops matched by (target, location), each occurrence paired in plan order."""
    def ops(plan: ExecutionPlan) -> list[tuple[str, str, str]]:
        return [(str(op.attr("target")), str(op.loc or "-"), str(op.attr("reason"))) for op, _ in replicated_ops(plan.graph)]

    left, right = ops(a), ops(b)
    out = []
    for entry in left:
        match = next((r for r in right if r[:2] == entry[:2]), None)
        if match is None:
            out.append(ReplicatedChange("removed", *entry))
        else:
            right.remove(match)
    out.extend(ReplicatedChange("added", *entry) for entry in right)
    return tuple(out)


def _pipeline_values(a: ExecutionPlan, b: ExecutionPlan) -> list[tuple[str, object, object]]:
    """The schedule, microbatches, how the chunks were cut and the chunks themselves ("-" at pp=1)."""
    def fields(plan: ExecutionPlan) -> dict[str, object]:
        spec = plan.pipeline
        if spec is None:
            return dict.fromkeys(("schedule", "microbatches", "pipeline_cut", "pipeline_chunks"), "-")
        return {"schedule": spec.schedule if spec.virtual == 1 else f"{spec.schedule} (v={spec.virtual})",
                "microbatches": spec.microbatches, "pipeline_cut": spec.cut,
                "pipeline_chunks": " | ".join(c.what for c in spec.chunks)}

    fa, fb = fields(a), fields(b)
    return [(name, fa[name], fb[name]) for name in fa]


__all__ = ["PlanDiff", "diff_plans", "collective_key", "canonical_values"]
