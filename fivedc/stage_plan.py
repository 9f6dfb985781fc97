"""The plan's pipeline: which schedule, how many microbatches, and the chunks.

`plan_pipeline` (called by `fivedc/pipeline.py` for pp > 1) checks the request
(enough layers, microbatches that split the batch, a schedule the runtime runs),
cuts the units into chunks (`fivedc/stages.py`: balanced by cost, or a layout
given in layers) and names, for each chunk, its layers, cost, parameter bytes and
the values it sends on; `pipeline_collectives` lists those transfers for the plan.
"""

from __future__ import annotations

from fivedc.errors import PlanError
from fivedc.ir import Collective, CollectiveKind, Graph, Phase
from fivedc.mesh import Mesh, MeshAxis
from fivedc.schedule import make_schedule, min_microbatches
from fivedc.stages import (
    Chunk, PipelineSpec, Unit, check_enough, boundary_values, layout_ranges, partition, unit_costs, units,
    value_types,
)

def pipeline_collectives(graph: Graph, mesh: Mesh, spec: PipelineSpec, dtype_bytes: int) -> list[Collective]:
    """The P2P transfers between consecutive chunks: activations forward, their
    gradients backward, once per microbatch."""
    types = value_types(graph)
    out = []
    for chunk in spec.chunks[:-1]:
        numel = 0
        for name in chunk.sends:
            t, sharding = types[name]
            numel += graph.local_numel(t.dims, sharding, mesh) // (spec.microbatches if graph.batch_dim in t.dims else 1)
        values = ", ".join(chunk.sends)
        nxt = spec.chunks[chunk.index + 1]
        if nxt.rank == chunk.rank:
            continue  # the next chunk runs on the same rank: handed over, not sent
        for phase, what in ((Phase.FORWARD, "activations"), (Phase.BACKWARD, "their gradients")):
            out.append(Collective(
                CollectiveKind.SEND_RECV, (MeshAxis.PP,), phase, values, numel * dtype_bytes,
                f"pipeline: chunk {chunk.index} (pp rank {chunk.rank}) and chunk {nxt.index} (pp rank {nxt.rank}) "
                f"exchange {what} at their boundary, once per microbatch",
                count=spec.microbatches, overlaps="the other microbatches' compute (as the schedule orders it)",
            ))
    return out


RUNNABLE = ("gpipe", "1f1b", "interleaved", "zb-h1", "dualpipev")


def plan_pipeline(graph: Graph, mesh: Mesh, *, schedule: str, microbatches: int | None, virtual: int | None,
                  layout: tuple[int, ...] | None, dtype_bytes: int) -> PipelineSpec | None:
    """Chunks and schedule for pp > 1 (None for pp = 1)."""
    p = mesh.size(MeshAxis.PP)
    if p == 1:
        return None
    if schedule == "dualpipe":
        raise PlanError("dualpipe keeps two copies of the model, which the runtime does not run",
                        hint="use dualpipev: the same V-shaped chunks and bubble on one copy")
    if virtual is None and schedule == "interleaved":
        virtual = 2
    if layout is None:  # before the batch is checked: too few layers is the first thing to fix
        check_enough(len(units(graph)), p * (virtual or (2 if schedule == "dualpipev" else 1)), "layers and op groups")
    m = microbatches if microbatches is not None else _default_microbatches(graph, mesh, p, min_microbatches(schedule, p))
    _check_microbatches(graph, mesh, m)
    sched = make_schedule(schedule, p, m, virtual)
    n_chunks = p * sched.v
    costs, sizes = unit_costs(graph, mesh, dtype_bytes)
    if layout is not None:
        if len(layout) != n_chunks:
            raise PlanError(f"the layout gives {len(layout)} chunks; {schedule} on pp={p} runs {n_chunks}",
                            hint=f"give {n_chunks} layer counts, one per chunk ({sched.v} per pp rank)")
        ranges = layout_ranges(layout, graph)
    else:
        ranges = partition(costs, n_chunks, what="layers and op groups")
    all_units = units(graph)
    chunks = []
    for k, (a, b) in enumerate(ranges):
        what = _describe(graph, all_units[a:b])
        sends = boundary_values(graph, b) if k < n_chunks - 1 else ()
        chunks.append(Chunk(k, sched.placement[k], (a, b), what, sum(costs[a:b]), sum(sizes[a:b]), sends))
    return PipelineSpec(schedule, m, sched.v, tuple(chunks))


def _default_microbatches(graph: Graph, mesh: Mesh, p: int, least: int) -> int:
    """pp microbatches (or the schedule's least, if more), else the nearest count that
    splits the local batch: the next larger divisor, or the largest one."""
    local = graph.dim(graph.batch_dim) // mesh.size(MeshAxis.DP, MeshAxis.EP)
    want = max(p, least)
    divisors = [d for d in range(1, local + 1) if local % d == 0]
    return next((d for d in divisors if d >= want), divisors[-1])


def _check_microbatches(graph: Graph, mesh: Mesh, m: int) -> None:
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


def _describe(graph: Graph, chunk_units: list[Unit]) -> str:
    """`embedding, layers.0-3`: op runs by kind, consecutive layers as a range."""
    parts: list[list] = []
    for unit in chunk_units:
        if unit.layer is None:
            parts.append(["ops", unit.describe(graph)])
            continue
        name = graph.body.items[unit.start].name
        if parts and parts[-1][0] == "layers" and parts[-1][1] == name:
            parts[-1][3] = unit.layer
        else:
            parts.append(["layers", name, unit.layer, unit.layer])
    return ", ".join(
        p[1] if p[0] == "ops" else f"{p[1]}.{p[2]}" + (f"-{p[3]}" if p[3] != p[2] else "") for p in parts
    )
