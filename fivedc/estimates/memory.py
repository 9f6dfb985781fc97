"""Memory per class of ranks: parameters, gradients, optimizer state, activations, transient peaks.

`estimate_memory` gives one `RankMemory` per class of ranks that hold different
bytes; ranks differ only by their pipeline stage (every rank of a stage holds the
same shards, and ZeRO's chunks are padded to equal sizes), so there is one class
per pp rank at most, and consecutive pp ranks holding the same bytes share one:
the plan stays flat in the world size. Per rank:

- params, grads, optimizer: the local shards of the parameters its chunks use (all
  of them without a pipeline) at the training dtype, AdamW state at 12 bytes per
  parameter in 16-bit training (fp32 master and two moments; 8 in fp32, 16 in
  fp64); ZeRO counts one padded chunk, ceil(local / n), for what it shards (stage 1
  the optimizer state, 2 also gradients, 3 also parameters: the ZeRO paper's
  2Ψ + 2Ψ + 12Ψ, each divided as its stage divides it); under a pipeline the gradients add
  up whole over the microbatches and are summed after the last, so ZeRO-2 holds them whole.
- activations: what its chunks keep for backward (`fivedc/estimates/activations.py`), for the
  microbatches its schedule keeps in flight at its peak, plus the constants.
- transient: the largest buffer alive only for a moment (`fivedc/estimates/transient.py`: a
  recomputed region, the forward's working set, the loss's gradient, ZeRO-3's
  gathers, gradient buckets, all-to-all and ring buffers, pipeline sends).

Each category is at its own largest over the step; `total` is what the rank holds at its
busiest moment. Under a pipeline that is a backward in the steady state, where every
gradient of the rank's chunks is made and the schedule's microbatches are in flight: the
categories' sum. Without a pipeline the step's moments are walked one by one
(`fivedc/estimates/timeline.py`: a unit's forward holds no gradient, its backward the
gradients made so far beside what units before it keep, the gradient sums and the
optimizer step no activation) and the busiest one is the total, which can be less than
the categories' sum (the summary names the moment).
"""

from __future__ import annotations

from dataclasses import dataclass

from fivedc.estimates.activations import chunk_activations, chunk_deferred
from fivedc.errors import PlanError
from fivedc.ir.graph import Graph
from fivedc.ir.mesh import Mesh, MeshAxis
from fivedc.passes.held_params import HeldParams, param_count
from fivedc.estimates.memo import Memo, memo_for, memo_units, param_sizes, rank_held, save_context
from fivedc.passes.stages import PipelineSpec
from fivedc.estimates.timeline import Moment, peak_moment, step_moments, unit_grads
from fivedc.estimates.transient import step_buffers, transients

# Bytes per parameter element of AdamW's state: in 16-bit training an fp32 master copy and
# fp32 moments (ZeRO's 12); in fp32 or fp64 the parameters are the master copy.
OPTIMIZER_BYTES = {"bf16": 12, "fp16": 12, "fp32": 8, "fp64": 16}
CATEGORIES = ("params", "grads", "optimizer", "activations", "transient", "total")


@dataclass(frozen=True, slots=True)
class RankMemory:
    """Bytes each rank of `ranks` holds (`all`, `pp=0`, `pp=1..14`, `pp=0,3`)."""

    ranks: str
    params: int
    grads: int
    optimizer: int
    activations: int
    transient: int
    total: int

    def __post_init__(self) -> None:
        parts = self.params + self.grads + self.optimizer + self.activations + self.transient
        if not self.params + self.optimizer <= self.total <= parts:
            raise PlanError(f"memory of ranks {self.ranks}: total {self.total} is not between what is held throughout "
                            f"({self.params + self.optimizer}) and the sum of its parts ({parts})")

    def pp_ranks(self, pp: int) -> tuple[int, ...]:
        """The pp ranks this entry covers, on a pipeline of `pp` ranks."""
        if self.ranks == "all":
            return tuple(range(pp))
        text = self.ranks.removeprefix("pp=")
        if ".." in text:
            first, last = text.split("..")
            return tuple(range(int(first), int(last) + 1))
        return tuple(int(r) for r in text.split(","))


@dataclass(frozen=True, slots=True)
class MemoryEstimate:
    """One entry per class of ranks; the categories read as attributes are the busiest
    class's (the one with the largest total): what must fit."""

    ranks: tuple[RankMemory, ...]

    @property
    def busiest(self) -> RankMemory:
        return max(self.ranks, key=lambda r: r.total)

    @property
    def params(self) -> int:
        return self.busiest.params

    @property
    def grads(self) -> int:
        return self.busiest.grads

    @property
    def optimizer(self) -> int:
        return self.busiest.optimizer

    @property
    def activations(self) -> int:
        return self.busiest.activations

    @property
    def transient(self) -> int:
        return self.busiest.transient

    @property
    def total(self) -> int:
        return self.busiest.total

    def of_pp_rank(self, pp_rank: int, pp: int) -> RankMemory:
        return next(r for r in self.ranks if pp_rank in r.pp_ranks(pp))


def estimate_memory(graph: Graph, *, mesh: Mesh, dtype: str, dtype_bytes: int, zero: int = 0,
                    pipeline: PipelineSpec | None = None, recompute: str = "none", buckets=(),
                    overlap: bool = True, memo: Memo | None = None, tied=()) -> MemoryEstimate:
    """Bytes per class of ranks; the transient is the largest part `fivedc/estimates/transient.py` finds.
    The per-layer figures come from `memo` (`fivedc/estimates/memo.py`), computed once per graph.
    A tied parameter is held (with its gradient and optimizer state) by every pp rank whose
    chunks use it; `tied`: the groups whose gradients those ranks sum (`passes/tied.py`)."""
    memo = memo_for(memo, graph, mesh, dtype)
    if pipeline is None:
        return MemoryEstimate((peak_of_step(memo, dtype_bytes, zero, recompute, buckets, overlap)[0],))
    pp = mesh.size(MeshAxis.PP)
    held = [held_bytes(memo, dtype_bytes, zero, pipeline, r) for r in range(pp)]
    activations, regions = memo.get(("rank activations", dtype_bytes, recompute, pipeline), lambda: rank_activations(
        graph, mesh, dtype=dtype, dtype_bytes=dtype_bytes, pipeline=pipeline, recompute=recompute, memo=memo))
    # the busiest moment of activations and gradients together: the gradients of a chunk are
    # there from its first backward on, not from the step's start
    together = memo.get(("kept with grads", dtype_bytes, recompute, pipeline), lambda: kept_with_grads(
        memo, dtype_bytes, recompute, pipeline)) if zero < 3 else \
        [a + grads for a, (_, grads, _) in zip(activations, held)]  # ZeRO-3's chunks: made after the last backward
    beyond = [t - grads for t, (_, grads, _) in zip(together, held)]  # what that moment holds beyond them
    parts = transients(graph, mesh, dtype=dtype, dtype_bytes=dtype_bytes, zero=zero, pipeline=pipeline,
                       recompute=recompute, regions=regions, buckets=buckets, overlap=overlap, memo=memo, tied=tied,
                       activations=beyond)
    rows = [(params, grads, optimizer, activations[r], max(parts[r].values()),
             params + optimizer + together[r] + max(parts[r].values()))
            for r, (params, grads, optimizer) in enumerate(held)]
    return MemoryEstimate(_classes(rows, pipeline is not None))


def peak_of_step(memo: Memo, dtype_bytes: int, zero: int, recompute: str, buckets,
                  overlap: bool) -> tuple[RankMemory, Moment]:
    """Without a pipeline: the step's busiest moment (`fivedc/estimates/timeline.py`), what
    is live then by category, and the moment."""
    params, grads, optimizer = held_bytes(memo, dtype_bytes, zero, None, None)
    key = ("step moments", dtype_bytes, zero, recompute, buckets, overlap)
    def compute() -> list[Moment]:
        unit_buffers, sums, step = step_buffers(memo, dtype_bytes, zero, recompute, buckets, overlap)
        return step_moments(memo, dtype_bytes=dtype_bytes, zero=zero, recompute=recompute,
                            unit_buffers=unit_buffers, sums=sums, step=step)
    moments = memo.get(key, compute)
    peak = peak_moment(moments)
    kept = max(m.activations for m in moments)
    largest = max(m.transient for m in moments)
    return RankMemory("all", params, grads, optimizer, kept, largest, params + optimizer + peak.bytes), peak


def rank_activations(graph: Graph, mesh: Mesh, *, dtype: str, dtype_bytes: int, pipeline: PipelineSpec | None,
                     recompute: str, memo: Memo | None = None,
                     grads: tuple[int, ...] | None = None) -> tuple[list[int], list[int]]:
    """Per pp rank (one entry without a pipeline): the activations at its schedule's peak
    (with its constants), and the largest recomputed region of one microbatch. With `grads`
    (under a pipeline, per chunk), the peak of the activations and those gradients together,
    each chunk's counted from its first backward on (`fivedc/schedule/batched.peaks`)."""
    from fivedc.passes.stage_plan import activations_in_flight

    memo = memo_for(memo, graph, mesh, dtype)
    m = pipeline.microbatches if pipeline else 1
    c = save_context(memo, dtype_bytes, m, recompute)
    all_units, cache = memo_units(memo), memo.get(("unit saves", dtype_bytes, m, recompute), dict)
    if pipeline is None:
        kept, region, constants = chunk_activations(c, graph, all_units, cache=cache)
        return [kept + sum(constants.values())], [region]
    pp = mesh.size(MeshAxis.PP)
    per_chunk, deferred, regions, constants, split = memo.get(
        ("chunk activations", dtype_bytes, recompute, pipeline),
        lambda: _chunk_figures(memo, c, all_units, cache, dtype_bytes, recompute, pipeline))
    key = ("in flight", pipeline.schedule, m, pipeline.virtual, tuple(per_chunk), tuple(deferred) if split else None,
           grads)
    in_flight = memo.get(key, lambda: activations_in_flight(pipeline, pp, per_chunk, deferred if split else None,
                                                            grads=grads))
    return [in_flight[r] + sum(constants[r].values()) for r in range(pp)], regions


def _chunk_figures(memo: Memo, c, all_units, cache, dtype_bytes: int, recompute: str, pipeline: PipelineSpec):
    """(what one microbatch keeps per chunk, what it keeps between I and W per chunk, each
    rank's largest recomputed region, each rank's constants, whether backward is split)."""
    graph, m, pp = memo.graph, pipeline.microbatches, memo.mesh.size(MeshAxis.PP)
    per_chunk, deferred, regions, constants = [], [], [0] * pp, [dict() for _ in range(pp)]
    for chunk in pipeline.chunks:
        before = pipeline.chunks[chunk.index - 1] if chunk.index > 0 else None
        received = before.sends if before is not None and before.rank != chunk.rank else ()  # else: handed over
        sends = chunk.sends or (graph.output,)  # the last chunk holds its loss until its backward
        chunk_units = all_units[chunk.units[0]:chunk.units[1]]
        kept, region, const = chunk_activations(c, graph, chunk_units, received=received, sends=sends, cache=cache)
        per_chunk.append(kept)
        deferred.append(memo.get(("deferred", dtype_bytes, m, recompute, chunk.units),
                                 lambda: chunk_deferred(c, graph, chunk_units)))
        regions[chunk.rank] = max(regions[chunk.rank], region)
        constants[chunk.rank].update(const)
    schedule = pipeline.build_schedule(pp)
    split = any(a.kind == "W" for acts in schedule.ranks for a in acts)
    return per_chunk, deferred, regions, constants, split


def held_bytes(memo: Memo, dtype_bytes: int, zero: int, pipeline: PipelineSpec | None,
               pp_rank: int | None) -> tuple[int, int, int]:
    """(params, grads, optimizer) bytes of one pp rank (every rank without a pipeline), kept in `memo`."""
    return memo.get(("held bytes", dtype_bytes, zero, _rank_units(pipeline, pp_rank)), lambda: _held(
        param_sizes(memo), memo.dtype, dtype_bytes, zero, rank_held(memo, pipeline, pp_rank),
        accumulates=pipeline is not None))


def _rank_units(pipeline: PipelineSpec | None, pp_rank: int | None) -> tuple | None:
    """The unit ranges a pp rank runs (what its parameters follow from); None: every unit."""
    return None if pipeline is None else tuple(c.units for c in pipeline.chunks if c.rank == pp_rank)


def _held(sizes: list[tuple], dtype: str, dtype_bytes: int, zero: int,
          held: HeldParams | None, *, accumulates: bool = False) -> tuple[int, int, int]:
    """(params, grads, optimizer) bytes of one pp rank (every rank without a pipeline). Under a
    pipeline (`accumulates`) the gradients add up whole over the microbatches and are summed
    after the last (`runtime/train.Trainer`): ZeRO-2 holds them whole, as ZeRO-1 does."""
    params = grads = optimizer = 0
    for param, repeat, local_numel, chunk, _ in sizes:
        n = param_count(held, param.name, repeat)
        params += (chunk if zero >= 3 else local_numel) * n
        grads += (chunk if zero >= 3 or (zero == 2 and not accumulates) else local_numel) * n
        optimizer += (chunk if zero >= 1 else local_numel) * n
    return params * dtype_bytes, grads * dtype_bytes, optimizer * OPTIMIZER_BYTES[dtype]


def _classes(rows: list[tuple[int, ...]], pipeline: bool) -> tuple[RankMemory, ...]:
    """Consecutive pp ranks with equal bytes (each row its categories, then its total) as one entry."""
    if not pipeline or all(row == rows[0] for row in rows):
        return (RankMemory("all", *rows[0]),)
    out, start = [], 0
    for r in range(1, len(rows) + 1):
        if r == len(rows) or rows[r] != rows[start]:
            name = f"pp={start}" if r - 1 == start else f"pp={start}..{r - 1}"
            out.append(RankMemory(name, *rows[start]))
            start = r
    return tuple(out)


def kept_with_grads(memo: Memo, dtype_bytes: int, recompute: str, pipeline: PipelineSpec) -> list[int]:
    """Per pp rank, the most bytes of activations in flight and gradients live at once under
    the schedule: each chunk's gradients (whole: they add up over the microbatches) join
    from its first backward on the rank. A top-level parameter two chunks of a rank read is
    counted with the first of them."""
    pp = memo.mesh.size(MeshAxis.PP)
    own, top = unit_grads(memo, dtype_bytes, chunked=False)
    seen: list[set] = [set() for _ in range(pp)]
    grads = []
    for chunk in pipeline.chunks:
        made = sum(own[chunk.units[0]:chunk.units[1]])
        for u in range(*chunk.units):
            for name, nbytes in top[u]:
                if name not in seen[chunk.rank]:
                    seen[chunk.rank].add(name)
                    made += nbytes
        grads.append(made)
    return rank_activations(memo.graph, memo.mesh, dtype=memo.dtype, dtype_bytes=dtype_bytes, pipeline=pipeline,
                            recompute=recompute, memo=memo, grads=tuple(grads))[0]
