"""Lower bounds of a candidate's step time, from per-layer seconds computed once per sharded graph.

The search (`search.py`) takes candidates in the order of these bounds and scores a
candidate in full (the planning passes) only while its bound does not exceed the K-th
best step time scored so far: a layout whose bound is larger cannot be among the K
best. Each bound is at most the plan's step time (`fivedc/estimates/step_time.py`)
for these reasons (tests/test_search.py holds every bound below the plan's figure on
every candidate of small models):

- a unit's seconds for one of m microbatches are at least its seconds for the whole
  local batch (one microbatch) divided by m: FLOPs and bytes of batched values divide
  by m exactly (the microbatches divide the local batch; a roofline max of two
  quantities divided by m is their max divided by m), a collective's latency and the
  bytes of unbatched values do not shrink;
- a pp rank runs its actions one at a time from time 0, so the schedule's makespan is
  at least, on every rank: its busy time (its chunks' forward and backward for every
  microbatch through them), plus the forwards of the chunks before its first chunk
  (microbatch 0 crosses them before the rank can start), plus, where the backward is
  not split (its last action is a backward, whose gradient still has to cross the
  chunks before), the backwards of those chunks;
- the busiest rank is busy at least the average: before the cut is known, the units'
  total seconds over pp;
- after the schedule, a pipeline's step adds the gradient sync, ZeRO's gathers and the
  optimizer of one pp rank (the one with the most sync): at least the most sync of any
  rank plus the least gathers and optimizer of any (`tail_bound`, from the plan's own
  `step_time.after_backward`, which under a pipeline does not depend on the schedule's
  seconds).

And a lower bound of the busiest rank's memory (`memory_bound`), to reject a layout that
cannot fit before its schedule is built: a rank holds its parameters and optimizer state
(exactly the plan's, `memory.held_bytes`) throughout, its gradients whole by the step's end
(under a pipeline from a chunk's first backward on), and, just before its first backward,
every forward it ran before it (nothing is freed before a backward): the bound takes the
larger of those two moments. Each forward keeps at least its units' own saved bytes and
the inputs of its layers after the first for the whole local batch, divided by m (`chunk_activations` adds what chunks share;
of the transients only ZeRO-3's gathered parameters under a pipeline, the plan's own).
Without a pipeline likewise (`single_bound`, `fivedc/estimates/timeline.py`).
Which forwards
run before the first backward is read from the schedule itself at m, or at 2p
microbatches when m is larger: a larger m runs the same ones or more
(tests/test_schedule_program.py).

Sums taken in another order than the plan's (differences of running sums here) may round
up: every bound is lowered by `MARGIN` (a relative 1e-9), far above rounding and far below
any real difference.
"""

from __future__ import annotations

import functools

from fivedc.estimates.activations import unit_saves
from fivedc.estimates.memo import Memo, memo_units, param_sizes, rank_held, save_context
from fivedc.estimates.memory import held_bytes
from fivedc.estimates.step_time import after_backward, memo_unit_times
from fivedc.estimates.transient import zero3_gathers
from fivedc.ir.hardware import Hardware
from fivedc.passes.stages import Chunk, PipelineSpec, cached_schedule
from fivedc.schedule.batched import kept_before_backward
from fivedc.schedule import schedule_kind

MARGIN = 1 - 1e-9


def mesh_bound(memo: Memo, hw: Hardware, *, dtype_bytes: int, recompute: str, pp: int) -> float:
    """Any pipeline of this sharded graph: the units' forward and backward seconds over pp
    (without a pipeline: its compute exactly, the step less its gradient sync and optimizer)."""
    times = memo_unit_times(memo, hw, dtype_bytes, 1, recompute)
    return sum(t.forward + t.backward for t in times) / pp * MARGIN


def pipeline_bound(memo: Memo, hw: Hardware, *, dtype_bytes: int, recompute: str, schedule: str,
                   microbatches: int, ranges: list[tuple[int, int]], placement: tuple[int, ...],
                   pipelines: int) -> float:
    """One pipeline: the busiest rank's bound (the module docstring), from the model's chunks
    (`ranges`, units per chunk), where each of the schedule's chunks runs (`placement`) and
    how many copies of the model the schedule runs (`pipelines`)."""
    f_before, b_before = memo.get(("unit seconds before", hw, dtype_bytes, recompute), lambda: (
        _prefix([t.forward for t in memo_unit_times(memo, hw, dtype_bytes, 1, recompute)] + [0.0]),
        _prefix([t.backward for t in memo_unit_times(memo, hw, dtype_bytes, 1, recompute)] + [0.0])))
    m = microbatches
    forward = [(f_before[b] - f_before[a]) / m for a, b in ranges]
    backward = [(b_before[b] - b_before[a]) / m for a, b in ranges]
    before_f, before_b = _prefix(forward), _prefix(backward)
    tail = not schedule_kind(schedule).split_backward
    per_rank: dict[int, list] = {}
    for k, rank in enumerate(placement):
        per_rank.setdefault(rank, []).append(k % len(ranges))
    worst = 0.0
    for chunks in per_rank.values():
        busy = sum(m // pipelines * (forward[s] + backward[s]) for s in chunks)
        head = min(before_f[s] for s in chunks)
        after = min(before_b[s] for s in chunks) if tail else 0.0
        worst = max(worst, head + busy + after)
    return worst * MARGIN


def _prefix(values: list[float]) -> list[float]:
    """values[0] + ... + values[s - 1] for each s."""
    out, total = [], 0.0
    for value in values:
        out.append(total)
        total += value
    return out


def memory_bound(memo: Memo, *, dtype_bytes: int, recompute: str, zero: int, schedule: str, microbatches: int,
                 virtual: int | None, ranges: list[tuple[int, int]], placement: tuple[int, ...]) -> int:
    """At most the busiest rank's bytes (the module docstring), for a pipeline cut into
    `ranges` (units per model chunk) and placed by `placement` (the schedule's chunks)."""
    held = held_rows(memo, dtype_bytes=dtype_bytes, zero=zero, schedule=schedule, virtual=virtual, ranges=ranges,
                     placement=placement)
    kept = kept_rows(memo, dtype_bytes=dtype_bytes, recompute=recompute, schedule=schedule, microbatches=microbatches,
                     virtual=virtual, ranges=ranges, placement=placement)
    return max(rest + max(grads, k) for (rest, grads), k in zip(held, kept))


def held_rows(memo: Memo, *, dtype_bytes: int, zero: int, schedule: str, virtual: int | None,
              ranges: list[tuple[int, int]], placement: tuple[int, ...]) -> list[tuple[int, int]]:
    """Per pp rank, (its parameters' and optimizer state's bytes, its gradients'), the plan's
    own. The gradients are held whole only from a chunk's first backward on
    (`memory.kept_with_grads`): the bound takes the larger of them and what forward keeps."""
    spec = PipelineSpec(schedule, 1, virtual or 1, tuple(
        Chunk(k, rank, ranges[k % len(ranges)], "", 0.0, 0) for k, rank in enumerate(placement)))
    out = []
    for r in range(max(placement) + 1):
        gathered = zero3_gathers(memo.graph, memo.mesh, dtype_bytes, zero, spec, rank_held(memo, spec, r), ()) if zero == 3 else 0
        params, grads, optimizer = held_bytes(memo, dtype_bytes, zero, spec, r)
        out.append((params + optimizer + gathered, grads))  # ZeRO-3 gathers: a transient
    return out


def single_bound(memo: Memo, *, dtype_bytes: int, recompute: str, zero: int) -> int:
    """At most the bytes of a rank without a pipeline: its parameters and optimizer state,
    and the larger of its gradients (at the gradient sums) and what one microbatch (the
    local batch) keeps through every unit (at the end of forward): the step's timeline
    (`fivedc/estimates/timeline.py`) has both moments."""
    own, args = memo.get(("unit own bytes", dtype_bytes, recompute), lambda: _unit_own(memo, dtype_bytes, recompute))
    params, grads, optimizer = held_bytes(memo, dtype_bytes, zero, None, None)
    return params + optimizer + max(grads, sum(own) + sum(args[1:]))


def kept_rows(memo: Memo, *, dtype_bytes: int, recompute: str, schedule: str, microbatches: int,
              virtual: int | None, ranges: list[tuple[int, int]], placement: tuple[int, ...]) -> list[int]:
    """Per pp rank, at most the activations it keeps just before its first backward."""
    m, p = microbatches, max(placement) + 1
    own, args = memo.get(("unit own bytes", dtype_bytes, recompute), lambda: _unit_own(memo, dtype_bytes, recompute))
    own_before, args_before = _prefix_int(own), _prefix_int(args)
    chunk_own = [(own_before[b] - own_before[a] + args_before[b] - args_before[a + 1]) // m for a, b in ranges]
    kept = _kept(schedule, p, min(m, 2 * p), schedule_kind(schedule).virtual(virtual))
    return [sum(chunk_own[k % len(ranges)] for k in kept[r]) for r in range(p)]


@functools.lru_cache(maxsize=256)
def _kept(schedule: str, p: int, m: int, virtual: int | None) -> tuple[tuple[int, ...], ...]:
    return kept_before_backward(cached_schedule(schedule, p, m, virtual))


def _unit_own(memo: Memo, dtype_bytes: int, recompute: str) -> tuple[list[int], list[int]]:
    """What each unit keeps for the whole local batch: of its own (values and buffers), and of
    its inputs (a layer's body arguments; a chunk counts them for every unit but its first)."""
    c, cache = save_context(memo, dtype_bytes, 1, recompute), {}
    saves = [unit_saves(c, memo.graph, unit, cache=cache) for unit in memo_units(memo)]
    return [s.own for s in saves], [sum(nbytes for _, nbytes in s.args) for s in saves]


def _prefix_int(values: list[int]) -> list[int]:
    out = [0]
    for value in values:
        out.append(out[-1] + value)
    return out


def tail_bound(memo: Memo, hw: Hardware, *, dtype_bytes: int, zero: int, overlap: bool, schedule: str,
               virtual: int | None, ranges: list[tuple[int, int]], placement: tuple[int, ...]) -> float:
    """At least the seconds a pipeline's step adds after its schedule (the module docstring)."""
    spec = PipelineSpec(schedule, 1, virtual or 1, tuple(
        Chunk(k, rank, ranges[k % len(ranges)], "", 0.0, 0) for k, rank in enumerate(placement)))

    def tail(held):  # ranks holding the same layers add the same seconds
        key = ("tail bound", held, hw, dtype_bytes, zero, overlap, spec.kind.pipelines > 1)
        return memo.get(key, lambda: after_backward(
            param_sizes(memo), memo.mesh, memo.dtype, dtype_bytes, zero, overlap, (), spec, held, hw, 0.0, 0.0, 0.0))

    tails = [tail(rank_held(memo, spec, r)) for r in range(max(placement) + 1)]
    return (max(sync for sync, _, _ in tails) + min(gathers + optimizer for _, gathers, optimizer in tails)) * MARGIN
