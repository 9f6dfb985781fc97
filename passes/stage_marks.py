"""The model's own pipeline marks (`@stage` ops, `Repeat.stage_layers`), checked.

Marks must sit where a chunk can begin (a top-level op or a layer of a repeat,
each layer once), must not come together with a layout given in layers, and must
give exactly the chunks the schedule runs; the errors name the marks and the fixes
(`choose_schedule`, `passes/stage_plan.py`, runs these checks).
"""

from __future__ import annotations

from fivedc.errors import PlanError, SourceLoc
from fivedc.ir.graph import Graph, Op, Repeat, walk_ops
from fivedc.schedule import schedule_kind
from fivedc.passes.stages import Unit


def check_marks(graph: Graph, all_units: list[Unit], layout: tuple[int, ...] | None, schedule: str,
                 p: int, per_rank: int) -> None:
    """Marks not together with a layout, and giving the chunks the schedule runs."""
    first = next(u for u in all_units if u.marked)
    where = [_mark_name(graph, u) for k, u in enumerate(all_units) if u.marked and k > 0]
    if layout is not None:
        raise PlanError(
            f"the model marks its pipeline chunks with @stage (at {_mark_name(graph, first)}) and --pp-layout "
            f"{','.join(map(str, layout))} gives layers per chunk too; use one of the two",
            loc=_mark_loc(graph, first),
            hint="drop --pp-layout to cut at the model's marks, or remove the @stage marks to cut as the layout says",
        )
    n, runs = len(where) + 1, p * per_rank
    if n == runs or per_rank < (2 if schedule_kind(schedule).takes_virtual else 1):
        return  # a bad --virtual is make_schedule's error
    boundaries = f"{len(where)} stage boundar{'y' if len(where) == 1 else 'ies'}"
    at = f" (before {', '.join(where)})" if where else " (a mark on the first op or layer cuts nothing)"
    raise PlanError(
        f"the model marks {boundaries}{at}, giving {n} chunk{'s' if n != 1 else ''}; "
        f"{schedule} on pp={p} runs {runs} chunks ({per_rank} per pp rank)",
        hint=_marks_hint(n, runs, schedule, p, per_rank),
    )


def _marks_hint(n: int, runs: int, schedule: str, p: int, per_rank: int) -> str:
    more = "remove" if n > runs else "add"
    fixes = [f"{more} {abs(n - runs)} mark{'s' if abs(n - runs) != 1 else ''}"]
    if n % per_rank == 0 and n // per_rank >= 2:
        fixes.append(f"use pp={n // per_rank} ({schedule} runs {per_rank} chunk{'s' if per_rank > 1 else ''} per rank)")
    kind = schedule_kind(schedule)
    if n % p == 0 and n // p >= 2 and not (kind.takes_virtual and n // p == per_rank):
        fixes.append(f"use --schedule interleaved --virtual {n // p} ({n // p} chunks per rank on pp={p})")
    if n == 2 * p and not kind.folded:
        fixes.append(f"use --schedule dualpipev (2 chunks per rank on pp={p})")
    if n == p and per_rank > 1:
        fixes.append(f"use --schedule 1f1b (1 chunk per rank on pp={p})")
    return "; or ".join(fixes)


def check_mark_places(graph: Graph) -> None:
    """Marks the DSL cannot write but another frontend could: layers out of range,
    twice, or `@stage` on an op inside a repeat body."""
    for item in graph.body.items:
        if isinstance(item, Repeat) and (len(set(item.stage_layers)) != len(item.stage_layers)
                                         or any(not 0 <= k < item.count for k in item.stage_layers)):
            raise PlanError(f"repeat {item.name} marks layers {list(item.stage_layers)} as chunk starts; "
                            f"each must be a different layer in 0..{item.count - 1}", loc=item.loc)
    for node, repeat in walk_ops(graph.body):
        if repeat is not None and isinstance(node, Op) and node.annotation("stage") is not None:
            raise PlanError(f"@stage on an op inside repeat {repeat.name}: a chunk can only begin at a layer",
                            loc=node.annotation("stage").loc or node.loc,
                            hint=f"mark layers on the repeat instead: repeat {repeat.name} @stage(2) {{ ... }}")


def _mark_name(graph: Graph, unit: Unit) -> str:
    """`layers.4`, or the marked op's value name (its kind, for a temporary) and line."""
    if unit.layer is not None:
        return f"{graph.body.items[unit.start].name}.{unit.layer}"
    op = next(i for i in graph.body.items[unit.start:unit.stop] if isinstance(i, Op) and i.annotation("stage"))
    name = op.kind if "#" in op.out else op.out
    return f"{name} (line {op.loc.line})" if op.loc else name


def _mark_loc(graph: Graph, unit: Unit) -> SourceLoc | None:
    if unit.layer is not None:
        return graph.body.items[unit.start].loc
    op = next(i for i in graph.body.items[unit.start:unit.stop] if isinstance(i, Op) and i.annotation("stage"))
    return op.annotation("stage").loc or op.loc
