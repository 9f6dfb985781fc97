"""The estimate tables of the plan summary (`fivedc/plan/summary.py`): memory per rank and per
class of ranks, the step time, and which momentary buffer the transient is."""

from __future__ import annotations

from rich.table import Table
from rich.text import Text

from fivedc.estimates.memory import CATEGORIES
from fivedc.ir.mesh import MeshAxis
from fivedc.passes.base import DTYPE_BYTES
from fivedc.plan.execution_plan import ExecutionPlan
from fivedc.plan.tables import format_bytes, text_row, titled_table


def memory_table(plan: ExecutionPlan) -> Table:
    m = plan.memory
    busiest = m.busiest
    which = "" if len(m.ranks) == 1 else f" ({busiest.ranks})"
    table = titled_table(f"Memory per rank{which}", "category", "bytes", "exact")
    for name in CATEGORIES:
        value = getattr(busiest, name)
        text_row(table, name, format_bytes(value), f"{value:,}")
    return table


def memory_classes_table(plan: ExecutionPlan) -> Table | None:
    """One row per class of ranks holding different bytes (pipeline stages); with a GPU,
    whether each fits its usable memory."""
    if len(plan.memory.ranks) == 1 and plan.time is None:
        return None
    gpu = plan.time.hardware if plan.time else None
    extra = (f"on {gpu.key}",) if gpu else ()
    table = titled_table("Memory per class of ranks", "ranks", *CATEGORIES, *extra)
    for entry in plan.memory.ranks:
        fits = (("fits" if entry.total <= gpu.usable_bytes else "does not fit"),) if gpu else ()
        text_row(table, entry.ranks, *(format_bytes(getattr(entry, name)) for name in CATEGORIES), *fits)
    return table


def time_table(plan: ExecutionPlan) -> Table:
    """The step-time model's figures (`fivedc/estimates/step_time.py`)."""
    t, gpu = plan.time, plan.time.hardware
    grid = titled_table(f"Step time on {gpu.name} ({gpu.key})", "figure", "value")
    parts = [f"forward and backward {t.compute_seconds:.3g} s"]
    if plan.pipeline is not None:
        parts.append(f"bubble {t.bubble:.1%}")
    parts += [f"collectives in the layers {t.layer_comm_seconds:.3g} s", f"gradient sync {t.grad_sync_seconds:.3g} s"]
    if t.zero_gather_seconds:
        parts.append(f"ZeRO gathers {t.zero_gather_seconds:.3g} s")
    parts.append(f"optimizer {t.optimizer_seconds:.3g} s")
    fit = "every class of ranks fits" if all(e.total <= gpu.usable_bytes for e in plan.memory.ranks) else \
        "does not fit"
    for key, value in (
        ("step", f"{t.step_seconds:.3g} s ({'; '.join(parts)})"),
        ("throughput", f"{t.tokens_per_second:,.0f} tokens/s, {t.tflops_per_gpu:.0f} TFLOP/s per GPU, "
                       f"MFU {t.mfu:.1%}" + (" (of the bf16 peak; float8 linears run at the fp8 peak)"
                                             if plan.fp8 else "")),
        ("memory", f"{fit} in {format_bytes(gpu.usable_bytes)} ({gpu.memory_gib:g} GiB less {gpu.reserved_gib:g} "
                   f"reserved); the busiest, {plan.memory.busiest.ranks}, holds {format_bytes(plan.memory.total)}"),
    ):
        grid.add_row(Text(key), Text(value, overflow="fold"))
    grid.columns[1].ratio = 1
    return grid


def transient_text(plan: ExecutionPlan) -> str:
    """Which momentary buffer the busiest class's transient is (`fivedc/estimates/transient.py`)."""
    from fivedc.estimates.memo import Memo
    from fivedc.estimates.memory import peak_of_step, rank_activations
    from fivedc.estimates.transient import transients

    if plan.pipeline is None:
        peak = peak_of_step(Memo(plan.graph, plan.mesh, plan.dtype), DTYPE_BYTES[plan.dtype], plan.zero,
                            plan.recompute, plan.buckets, plan.overlap)[1]
        buffer = f", beside the {peak.buffer} ({format_bytes(peak.transient)})" if peak.transient else ""
        return (f"total: what is live at the busiest moment of the step, {peak.name}{buffer}; each category "
                "above is its largest over the step")
    kw = dict(dtype=plan.dtype, dtype_bytes=DTYPE_BYTES[plan.dtype], pipeline=plan.pipeline, recompute=plan.recompute)
    activations, regions = rank_activations(plan.graph, plan.mesh, **kw)
    pp = plan.mesh.size(MeshAxis.PP)
    parts = transients(plan.graph, plan.mesh, zero=plan.zero, regions=regions, buckets=plan.buckets,
                       overlap=plan.overlap, activations=activations, **kw)
    rank = plan.memory.busiest.pp_ranks(pp)[0]
    name, value = max(parts[rank].items(), key=lambda item: item[1])
    if not value:
        return "transient: no buffer beyond what is kept"
    return f"transient: the largest buffer held only for a moment, here the {name} ({format_bytes(value)})"
