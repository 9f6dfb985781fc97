"""Does a plan fit its GPU, and if not, what would make it fit.

`check_fits` compares every class of ranks' total (`plan.memory`) with the GPU's
usable memory (`Hardware.usable_bytes`: its memory less what CUDA, NCCL and the
allocator reserve). A plan that does not fit is a `FitError` (exit 2, nothing
written) naming the class, its bytes by category and the limit, with what would
make it fit: each single change tried by compiling the model again (recomputation,
a higher ZeRO stage, sequence parallelism, more microbatches, pp or tp doubled at
the same world size by halving dp), and the ones that fit listed with their totals;
if none fits alone, pairs of them.
"""

from __future__ import annotations

from dataclasses import replace
from itertools import combinations

from fivedc.errors import FivedcError
from fivedc.ir.mesh import Mesh, MeshAxis
from fivedc.passes.base import CompileOptions

MAX_LISTED = 4


class FitError(FivedcError):
    """The plan needs more memory than its GPU has."""

    exit_code = 2


def does_not_fit(plan) -> list:
    """The classes of ranks whose total exceeds the GPU's usable memory."""
    limit = plan.time.hardware.usable_bytes
    return [entry for entry in plan.memory.ranks if entry.total > limit]


def check_fits(plan, options: CompileOptions) -> None:
    from fivedc.cli.plan_check import source_graph
    from fivedc.plan.summary import format_bytes

    over = does_not_fit(plan)
    if not over:
        return
    hw, worst = plan.time.hardware, max(over, key=lambda entry: entry.total)
    parts = ", ".join(f"{name} {format_bytes(getattr(worst, name))}"
                      for name in ("params", "grads", "optimizer", "activations", "transient"))
    found = fixes(source_graph(plan.graph), options, hw.usable_bytes)
    listed = "; or ".join(f"{what} ({format_bytes(total)})" for what, total in found[:MAX_LISTED])
    raise FitError(
        f"the plan does not fit on {hw.name}: ranks {worst.ranks} need {format_bytes(worst.total)} ({parts}), "
        f"{format_bytes(hw.usable_bytes)} usable of {hw.memory_gib:g} GiB",
        hint=(f"it fits with {listed}" if found else "nothing tried fits (recompute, ZeRO, SP, microbatches, pp or tp x2, "
              "and pairs of them): use more GPUs, or a GPU with more memory"))


def fixes(graph, options: CompileOptions, limit: int) -> list[tuple[str, int]]:
    """Changes (flags) that make the plan fit, with the busiest total each gives, best first."""
    singles = [change for change in _changes(options) if change[1] != options]
    fitting = [(what, total) for what, opts in singles if (total := _total(graph, opts)) is not None and total <= limit]
    if not fitting:
        for (a, x), (b, y) in combinations(singles, 2):
            merged = _merge(options, x, y)
            total = _total(graph, merged) if merged is not None else None
            if total is not None and total <= limit:
                fitting.append((f"{a} {b}", total))
    return sorted(fitting, key=lambda item: item[1])


def _total(graph, options: CompileOptions) -> int | None:
    from fivedc.pipeline import compile_graph

    try:
        return compile_graph(graph, replace(options, hardware=None)).memory.total
    except FivedcError:
        return None


def _changes(options: CompileOptions) -> list[tuple[str, CompileOptions]]:
    mesh, out = options.mesh, []
    for mode in ("selective", "full"):
        if options.recompute != mode:
            out.append((f"--recompute {mode}", replace(options, recompute=mode)))
    out += [(f"--zero {z}", replace(options, zero=z)) for z in (1, 2, 3) if z > options.zero]
    if mesh.size(MeshAxis.TP) > 1 and not options.sequence_parallel:
        out.append(("--sp", replace(options, sequence_parallel=True)))
    if mesh.size(MeshAxis.PP) > 1 and options.microbatches:
        out.append((f"--microbatches {options.microbatches * 2}", replace(options, microbatches=options.microbatches * 2)))
    dp = mesh.size(MeshAxis.DP)
    for axis, index in ((MeshAxis.PP, 1), (MeshAxis.TP, 2)):
        if dp % 2 == 0:
            sizes = list(mesh.sizes)
            sizes[0], sizes[index] = dp // 2, sizes[index] * 2
            bigger = Mesh(tuple(sizes), mesh.rank_order)
            out.append((f"--mesh {'x'.join(map(str, sizes))} ({axis}={sizes[index]})",
                        replace(options, mesh=bigger, microbatches=None if axis == MeshAxis.PP else options.microbatches)))
    return out


def _merge(base: CompileOptions, x: CompileOptions, y: CompileOptions) -> CompileOptions | None:
    """x's change and y's together (None when both change the same thing)."""
    merged = {}
    for field in ("recompute", "zero", "sequence_parallel", "microbatches", "mesh"):
        a, b, orig = getattr(x, field), getattr(y, field), getattr(base, field)
        if a != orig and b != orig:
            return None
        merged[field] = a if a != orig else b
    return replace(base, **merged)
