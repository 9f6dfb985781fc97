"""The plan validator: a saved plan runs only if it is what this fivedc compiles.

A plan file is easy to edit and every field matters at run time: a mesh size, a
dim, a sharding, a collective's count. Rather than a list of rules that an edit
could slip past, `check_plan` re-derives the whole plan: it takes the model back
out of the plan's graph (`source_graph`: the ops, parameters and annotations the
frontend wrote, without what the passes added), reads the compile options back
(`options_of`: mesh, dtype, sequence parallelism, CP layout, ZeRO, buckets, the
pipeline, recomputation), compiles that again, and requires the result to equal the plan field
for field. An edit either yields the plan a fresh compile gives (and so runs as
one) or is a `PlanError` naming the first field that differs, before any process
starts. `load_plan` reads, decodes and checks a plan file: the one way the CLI
reads plans (`fivedc check PLAN.json` runs it alone).
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import replace
from pathlib import Path
from typing import Any

from fivedc.errors import FivedcError, PlanError
from fivedc.ir.graph import Block, Graph, Op, Redistribute, Repeat, walk_ops
from fivedc.ir.mesh import MeshAxis
from fivedc.passes.attention_kernel import kernel_of
from fivedc.passes.base import CompileOptions
from fivedc.pipeline import compile_graph
from fivedc.plan.execution_plan import ExecutionPlan
from fivedc.ir.seq_layout import SeqLayout
from fivedc.passes.stages import units
from fivedc.schedule import DEFAULT_SCHEDULE

RECOMPILE_HINT = "recompile the model with this fivedc (fivedc compile MODEL --mesh ... -o PLAN.json) instead of editing the plan"


def load_plan(path: str | Path) -> ExecutionPlan:
    """Read a plan file and check that it is exactly what this fivedc compiles."""
    plan = ExecutionPlan.load(path)
    check_plan(plan, source=str(path))
    return plan


def check_plan(plan: ExecutionPlan, *, source: str = "<plan>") -> None:
    """Raise `PlanError` unless compiling the plan's own model with its own options gives the plan."""
    try:
        fresh = compile_graph(source_graph(plan.graph), options_of(plan))
    except FivedcError as error:
        at = f" at {error.loc}" if error.loc else ""
        raise PlanError(f"{source} does not hold together: compiling its model with its options fails{at}: "
                        f"{error.message}", hint=RECOMPILE_HINT) from None
    except Exception as error:  # an edit the compiler cannot even read, e.g. a dim of the wrong kind
        raise PlanError(f"{source} does not hold together: compiling its model with its options fails "
                        f"({type(error).__name__}: {error})", hint=RECOMPILE_HINT) from None
    difference = first_difference(plan, fresh, "plan")
    if difference is not None:
        where, saved, compiled = difference
        raise PlanError(f"{source} is not the plan its model compiles to: {where} is {show(saved)} in the file, "
                        f"{show(compiled)} when compiled", hint=RECOMPILE_HINT)


def options_of(plan: ExecutionPlan) -> CompileOptions:
    """The compile options the plan records (every choice explicit)."""
    pipeline = plan.pipeline
    return CompileOptions(
        mesh=plan.mesh,
        sequence_parallel=plan.sequence_parallel,
        dtype=plan.dtype,
        cp_layout=str(plan.graph.seq_layout) if plan.mesh.size(MeshAxis.CP) > 1 else None,
        zero=plan.zero,
        overlap=plan.overlap,
        bucket_mb=plan.bucket_bytes / 2**20,
        schedule=pipeline.schedule if pipeline else DEFAULT_SCHEDULE,
        microbatches=pipeline.microbatches if pipeline else None,
        virtual=pipeline.kind.virtual(pipeline.virtual) if pipeline else None,
        pp_layout=_layers_per_chunk(plan) if pipeline and pipeline.cut == "layout" else None,
        recompute=plan.recompute,
        attention_kernel=recorded_attention_kernel(plan.graph),
        hardware=plan.time.hardware if plan.time else None,
        fp8=plan.fp8,
    )


def recorded_attention_kernel(graph: Graph) -> str | None:
    """The --attention-kernel a plan was compiled with, read off its attention ops: the
    option sets every op the model leaves unset, so it was math (or flash2) exactly when
    every op runs it (or the model named it on each, where the option changes nothing)."""
    kernels = {kernel_of(op) for op, _ in walk_ops(graph.body) if isinstance(op, Op) and op.kind == "attention"}
    return kernels.pop() if len(kernels) == 1 and kernels != {"flash"} else None


def _layers_per_chunk(plan: ExecutionPlan) -> tuple[int, ...]:
    """The --pp-layout that cuts the plan's chunks: repeat layers in each chunk's units."""
    all_units = units(plan.graph)
    chunks = plan.pipeline.chunks
    model = chunks[:len(chunks) // plan.pipeline.kind.pipelines]  # DualPipe: its second copy repeats them
    return tuple(sum(u.layer is not None for u in all_units[a:b]) for a, b in (c.units for c in model))


# ---- the model back out of a compiled graph ----------------------------------------------------
def source_graph(graph: Graph) -> Graph:
    """The graph as a frontend wrote it: no redistributions (their uses read the value
    they redistributed), no types, shardings, argument specs or collectives, the
    default sequence layout. Annotations the passes resolved (`@cp`, `@ep`) stay: they
    say what the plan chose, and compiling with them chooses the same."""
    origin = {node.out: node.src for node, _ in walk_ops(graph.body) if isinstance(node, Redistribute)}

    def original(name: str) -> str:
        while name in origin:
            name = origin[name]
        return name

    inputs = tuple(replace(i, sharding=None) for i in graph.inputs)
    return replace(graph, inputs=inputs, body=_strip_block(graph.body, original), seq_layout=SeqLayout.CONTIGUOUS)


def _strip_block(block: Block, original) -> Block:
    items = []
    for item in block.items:
        if isinstance(item, Redistribute):
            continue
        if isinstance(item, Repeat):
            items.append(replace(item, carried=tuple(map(original, item.carried)), carried_shardings=(),
                                 body=_strip_block(item.body, original)))
        else:
            items.append(replace(item, args=item.map_reads(original), type=None, sharding=None,
                                 arg_specs=(), collectives=()))
    params = tuple(replace(p, sharding=None, grad_partial=()) for p in block.params)
    return replace(block, params=params, items=tuple(items), yields=tuple(map(original, block.yields)))


# ---- where two plans differ ---------------------------------------------------------------------
FLOAT_TOLERANCE = 1e-9  # relative: the last bits of a figure differ between machines' maths libraries


def first_difference(a: Any, b: Any, path: str) -> tuple[str, Any, Any] | None:
    """(path, a's value, b's value) of the first field where `a` and `b` differ, or None.
    Floats agree within `FLOAT_TOLERANCE`: a plan compiled on one machine loads on another."""
    if a == b:
        return None
    if type(a) is not type(b):
        return path, a, b
    if isinstance(a, float):
        return None if math.isclose(a, b, rel_tol=FLOAT_TOLERANCE) else (path, a, b)
    if dataclasses.is_dataclass(a):
        fields = (f.name for f in dataclasses.fields(a) if f.compare)
        return next((d for f in fields if (d := first_difference(getattr(a, f), getattr(b, f), f"{path}.{f}"))), None)
    if isinstance(a, (tuple, list)):
        if len(a) != len(b):
            return f"{path} (length)", len(a), len(b)
        return next((d for i, (x, y) in enumerate(zip(a, b)) if (d := first_difference(x, y, f"{path}[{i}]"))), None)
    if isinstance(a, dict):
        if a.keys() != b.keys():
            return f"{path} (keys)", sorted(map(str, a)), sorted(map(str, b))
        return next((d for k in a if (d := first_difference(a[k], b[k], f"{path}[{k!r}]"))), None)
    return path, a, b


def show(value: Any) -> str:
    """A field's value in a message, at most 80 characters."""
    text = str(value) if isinstance(value, (int, float, str)) else repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


__all__ = ["check_plan", "load_plan", "source_graph", "options_of", "first_difference", "show"]
