"""The step-time model: seconds per step, bubble, tokens/s and MFU of a plan on given hardware.

A step (`estimate_time`) is

1. the pipeline's forward and backward of every microbatch: the schedule simulator
   (`fivedc/schedule/`) plays each rank's actions with each chunk's seconds per
   microbatch (`fivedc/estimates/unit_costs.py`: its units' roofline compute and blocking
   collectives), transfers delaying their RECV by their send/recv time over pp; its
   makespan and idle share (the bubble). Without a pipeline: one forward and backward.
   A whole backward (B) hides tensor parallelism's backward sums behind the weight
   gradients the plan overlaps them with (`UnitTime.hidden`); a schedule that splits it
   into I and W (`ScheduleKind.split_backward`) hides none: the runtime leaves every dW to W there.
2. the gradient sync the compute does not hide: summed over each parameter's ZeRO
   group (all-reduce; ZeRO-1/2 reduce-scatter), during backward when the plan overlaps
   it (no pipeline, overlap on, not ZeRO-1: only what exceeds the backward before the
   last bucket, and of what runs beside it the SMs it holds, `overlap_sm_share`), else
   all after it;
3. ZeRO's gathers: ZeRO-1/2 all-gather the updated parameters after the step; ZeRO-3
   gathers each group (a layer's parameters) at its use (forward gathers prefetched behind compute,
   backward ones and the reduce-scatters not) or, under a pipeline, once per step;
4. the optimizer: AdamW reads and writes parameters, gradients and its state on the
   owned part, memory-bound; and the runtime's copies around the sums (gradients into
   their buckets, ZeRO's gathered buffers into parameters: `_copy_bytes`), counted with
   the gradient sync.

The step is as long as its slowest pp rank. MFU = the model's FLOPs per step (3 x its
forward matmuls and attention, whatever is recomputed) / (step x world x peak);
tokens/s = the batch's tokens / step.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from fivedc.estimates.collectives import collective_seconds
from fivedc.estimates.costs import model_flops
from fivedc.estimates.unit_costs import unit_times
from fivedc.ir.hardware import Hardware
from fivedc.ir.graph import CollectiveKind, Graph
from fivedc.estimates.memory import OPTIMIZER_BYTES
from fivedc.ir.mesh import Mesh, MeshAxis
from fivedc.estimates.saved import SaveContext
from fivedc.passes.held_params import HeldParams, param_count
from fivedc.estimates.memo import Memo, memo_for, memo_unit_instructions, memo_units, param_sizes, rank_held, save_context
from fivedc.passes.stages import PipelineSpec
from fivedc.schedule import schedule_kind

K = CollectiveKind


@dataclass(frozen=True, slots=True)
class TimeEstimate:
    """Seconds per step on `hardware`, and what follows from them."""

    hardware: Hardware
    step_seconds: float
    compute_seconds: float  # forward and backward of every microbatch (the pipeline's makespan)
    bubble: float  # idle share of that, over the pp ranks
    layer_comm_seconds: float  # blocking collectives inside the layers, on the busiest rank, per step
    grad_sync_seconds: float  # gradient sync not hidden behind backward
    zero_gather_seconds: float  # ZeRO's parameter gathers not hidden
    optimizer_seconds: float
    tokens_per_second: float
    model_flops: float  # per step
    tflops_per_gpu: float
    mfu: float


def estimate_time(graph: Graph, *, mesh: Mesh, dtype: str, dtype_bytes: int, zero: int, overlap: bool,
                  buckets, pipeline: PipelineSpec | None, recompute: str, hardware: Hardware,
                  memo: Memo | None = None, tied=()) -> TimeEstimate:
    """The step on `hardware`, from per-layer seconds computed once per graph (`memo`);
    `tied`: the groups of tied parameters the pp ranks holding them sum (`passes/tied.py`)."""
    memo = memo_for(memo, graph, mesh, dtype)
    hw, m = hardware, pipeline.microbatches if pipeline else 1
    c = save_context(memo, dtype_bytes, m, recompute)
    times = memo_unit_times(memo, hw, dtype_bytes, m, recompute)
    if pipeline is None:
        makespan, bubble = sum(t.forward + t.backward for t in times), 0.0
        backward, last = sum(t.backward for t in times), times[0].backward if times else 0.0
        comm = [sum(t.comm - t.hidden for t in times)]
    else:
        makespan, bubble, comm = _pipelined(c, pipeline, mesh, hw, times, memo)
        backward = last = 0.0
    def after(r: int | None) -> tuple[float, float, float]:
        sync, gathers, optimizer = after_backward(param_sizes(memo), mesh, dtype, dtype_bytes, zero, overlap,
                                                  buckets, pipeline, rank_held(memo, pipeline, r), hw, backward,
                                                  last, makespan)
        return sync + _tied_seconds(param_sizes(memo), tied, r, mesh, dtype_bytes, hw), gathers, optimizer

    tail = max(after(r) for r in (range(mesh.size(MeshAxis.PP)) if pipeline else (None,)))
    sync, gathers, optimizer = tail
    step = makespan + sync + gathers + optimizer
    flops = memo.get(("model flops", dtype_bytes), lambda: model_flops(graph, mesh, dtype=dtype, dtype_bytes=dtype_bytes))
    tokens = graph.dim(graph.batch_dim) * (graph.dim(graph.seq_dim) if graph.seq_dim else 1)
    per_gpu = flops / step / mesh.world if step else 0.0
    return TimeEstimate(hw, step, makespan, bubble, max(comm), sync, gathers, optimizer, tokens / step if step else 0.0,
                        flops, per_gpu / 1e12, per_gpu / hw.bf16_flops)


def memo_unit_times(memo: Memo, hw: Hardware, dtype_bytes: int, microbatches: int, recompute: str) -> list:
    """Each unit's seconds for one of `microbatches` microbatches on `hw` (`unit_costs.unit_times`), kept in `memo`."""
    return memo.get(("unit times", hw, dtype_bytes, microbatches, recompute), lambda: unit_times(
        save_context(memo, dtype_bytes, microbatches, recompute), memo.graph, memo_units(memo), hw,
        recompute=recompute, instructions=memo_unit_instructions(memo, recompute)))


def _pipelined(c: SaveContext, pipeline: PipelineSpec, mesh: Mesh, hw: Hardware, times,
               memo: Memo) -> tuple[float, float, list]:
    """The schedule played with each chunk's seconds per microbatch."""
    per, travel = chunk_costs(c, pipeline, mesh, hw, times)
    whole = not pipeline.kind.split_backward
    delays = {"RF": travel, "RB": [0.0] + travel[:-1]}
    key = ("played", pipeline.schedule, pipeline.microbatches, pipeline.virtual,
           *(tuple(v) for v in per.values()), tuple(travel))
    makespan, bubble = memo.get(key, lambda: _play(pipeline.build_schedule(mesh.size(MeshAxis.PP)), per, delays))
    comm = [0.0] * mesh.size(MeshAxis.PP)
    for chunk in pipeline.chunks:
        comm[chunk.rank] += pipeline.microbatches * sum(t.comm - (t.hidden if whole else 0.0)
                                                        for t in times[chunk.units[0]:chunk.units[1]])
    return makespan, bubble, comm


def chunk_costs(c: SaveContext, pipeline: PipelineSpec, mesh: Mesh, hw: Hardware, times) -> tuple[dict, list]:
    """Each chunk's F, B, I and W seconds per microbatch, and its sent activations' seconds over pp."""
    per: dict[str, list[float]] = {"F": [], "B": [], "I": [], "W": []}
    travel = []
    whole = not pipeline.kind.split_backward  # else the runtime leaves every dW to W: nothing hides
    for chunk in pipeline.chunks:
        mine = times[chunk.units[0]:chunk.units[1]]
        per["F"].append(sum(t.forward for t in mine))
        per["B"].append(sum(t.backward if whole else t.backward_input + t.backward_weight for t in mine))
        per["I"].append(sum(t.backward_input for t in mine))
        per["W"].append(sum(t.backward_weight for t in mine))
        nbytes = sum(c.value_bytes(n) for n in chunk.sends)
        travel.append(collective_seconds(K.SEND_RECV, (MeshAxis.PP,), nbytes, mesh, hw) if nbytes else 0.0)
    return per, travel


def _play(schedule, per: dict, delays: dict) -> tuple[float, float]:
    """`simulate(schedule, chunk_costs=per, delays=delays)`'s makespan and bubble, to the
    last bit, from the schedule compiled once (`fivedc/schedule/batched.py`)."""
    from fivedc.schedule.batched import makespan_and_bubble, play, program

    prog = program(schedule)
    makespans, bubbles = makespan_and_bubble(*play(prog, np.array([cost_row(per, delays)])))
    return makespans[0], bubbles[0]


def cost_row(per: dict, delays: dict) -> list[float]:
    """One row of a schedule program's cost table: F, B, I, W per chunk, RF and RB delays, a zero."""
    return [*per["F"], *per["B"], *per["I"], *per["W"], *delays["RF"], *delays["RB"], 0.0]


def after_backward(sizes, mesh, dtype, dtype_bytes, zero, overlap, buckets, pipeline, held: HeldParams | None,
                    hw: Hardware, backward: float, last: float, makespan: float) -> tuple[float, float, float]:
    """(gradient sync, ZeRO gathers, optimizer) seconds one pp rank spends beyond the schedule."""
    t = tail_parts(sizes, mesh, dtype, dtype_bytes, zero, overlap, buckets, pipeline, held, hw, backward, last,
                   makespan)
    return t.sync + t.copies + t.pair, t.gathers, t.optimizer


@dataclass(frozen=True, slots=True)
class TailParts:
    """What one pp rank spends beyond the schedule (`after_backward`), by part."""

    sync: float  # the gradient sums not hidden
    copies: float  # the runtime's copies around them (`_copy_bytes`)
    pair: float  # DualPipe: the two copies add their gradients
    gathers: float  # ZeRO's gathers not hidden
    optimizer: float


def tail_parts(sizes, mesh, dtype, dtype_bytes, zero, overlap, buckets, pipeline, held: HeldParams | None,
               hw: Hardware, backward: float, last: float, makespan: float) -> TailParts:
    """`after_backward` by part."""
    groups: dict[tuple, int] = {}
    owned = 0
    for param, repeat, local, chunk, group in sizes:
        n = param_count(held, param.name, repeat)
        owned += (chunk if zero else local) * n
        if n and group > 1:  # the gradient's bytes as its sum moves (`param_sync.sync_bytes`)
            groups[param.grad_partial] = groups.get(param.grad_partial, 0) + \
                (chunk * group if zero else local) * dtype_bytes * n
    reduce = K.REDUCE_SCATTER if zero >= 1 else K.ALL_REDUCE
    sync = sum(collective_seconds(reduce, axes, b, mesh, hw) for axes, b in groups.items())
    gather = sum(collective_seconds(K.ALL_GATHER, axes, b, mesh, hw) for axes, b in groups.items())
    if zero == 3 and pipeline is None:  # by group: gathered forward (prefetched), again in backward, reduce-scattered
        scatter = sum(collective_seconds(K.REDUCE_SCATTER, axes, b, mesh, hw) for axes, b in groups.items())
        forward = makespan - backward  # the forward's gathers are prefetched behind it
        exposed_sync = scatter
        gathers = max(0.0, gather - forward) + min(gather, forward) * hw.overlap_sm_share + gather
    else:
        hidden = max(0.0, backward - last) if (pipeline is None and overlap and zero in (0, 2)) else 0.0
        beside = min(sync, hidden)  # run beside the backward, holding some of its SMs
        exposed_sync = max(sync - beside * hw.overlap_keep, sync / max(len(buckets), 1)) if hidden else sync
        gathers = gather if zero >= 1 else 0.0
    state = 2 * dtype_bytes + dtype_bytes + 2 * OPTIMIZER_BYTES[dtype]  # p read+write, g read, state read+write
    stream = hw.hbm_bytes_per_s * hw.memory_efficiency
    optimizer = owned * state / stream
    copies = _copy_bytes(sum(groups.values()), zero, pipeline) / stream
    pair = 0.0
    if pipeline is not None and pipeline.kind.pipelines > 1:  # the two copies add their gradients
        pair = collective_seconds(K.SEND_RECV, (MeshAxis.PP,), owned * dtype_bytes, mesh, hw)
    return TailParts(exposed_sync, copies, pair, gathers, optimizer)


def _copy_bytes(summed: float, zero: int, pipeline: PipelineSpec | None) -> float:
    """The memory traffic of the runtime's copies around the sums of `summed` gradient bytes:
    each gradient copied into its bucket (read and write, `runtime/buckets.py`); under
    ZeRO-1/2 the updated chunks copied back into whole parameters after their all-gather;
    under ZeRO-3 without a pipeline each group's gathered buffer split into its parameters
    in forward and again in backward. On the compute's path: nothing hides it."""
    copies = 2.0
    if zero in (1, 2):
        copies += 2.0
    if zero == 3 and pipeline is None:
        copies += 4.0
    return copies * summed


def _tied_seconds(sizes, tied, pp_rank: int | None, mesh: Mesh, dtype_bytes: int, hw: Hardware) -> float:
    """The all-reduces of the tied groups pp rank `pp_rank` holds (before its gradient sync)."""
    local = {param.name: size for param, repeat, size, _, _ in sizes if repeat is None}
    return sum(collective_seconds(K.ALL_REDUCE, (MeshAxis.PP,), sum(local[n] for n in g.names) * dtype_bytes,
                                  mesh, hw, members=len(g.pp_ranks)) for g in tied if pp_rank in g.pp_ranks)


def closed_form_makespan(schedule: str, p: int, m: int, v: int, forward: float, backward: float) -> float | None:
    """The makespan of a pipeline whose chunks all cost `forward` and `backward` per
    microbatch (a whole stage's; transfers free), by the published formulas: GPipe and
    1F1B (m + p - 1)(F + B), interleaved 1F1B (m v + p - 1)(F + B) / v with chunks of
    1/v of a stage (Narayanan et al. 2021; v = 1 gives the first); equal to the simulator's
    then (tests/test_step_time.py). None for schedules without one (split backward, a V,
    two copies: `ScheduleKind.has_closed_form`). A layout search can score
    candidates with it from per-layer costs computed once (`fivedc/estimates/unit_costs.unit_times`), with
    no compile and no simulation; the plan's own estimate plays the schedule, with its
    unequal chunks and transfer times."""
    if not schedule_kind(schedule).has_closed_form:
        return None
    return (m * v + p - 1) * (forward + backward) / v
