"""A schedule compiled once, then played for many cost vectors at once (numpy).

`simulate` (`simulator.py`) walks a schedule action by action in Python: a pipeline
of 32 ranks and 128 microbatches is 10^4 actions, tens of milliseconds. The layout
search (`fivedc/search/`) plays the same schedule with thousands of different chunk
costs (one per mesh, recomputation and rank order), and the memory estimate walks
it again for the activations in flight. `program(schedule)` turns a schedule into
index arrays once (cached); then

- `play(program, table)` gives, for each row of costs, the end of every rank's last
  action (the makespan is their largest) and each rank's busy time, with the same
  floating-point operations in the same order as `clock.execute` and `simulate`
  (a RECV starts at max(its rank's clock, its SEND's end + the delay), then every
  action adds its duration; busy times are summed in action order), so the figures
  are equal to the last bit (tests/test_schedules.py);
- `peaks(program, weights, deferred)` gives `peak_live_weighted` for integer weights
  (bytes) exactly: each rank's running sum of what its forwards keep, and its most; with
  `grads`, the gradients of each chunk join it from the chunk's first backward on the rank
  (B, or W under a split backward: where they are made, then accumulated over the rest).

The actions are played by levels: an action's level is one more than the larger of
its predecessor's on the rank and, for a RECV, its SEND's; all actions of a level
are computed by one vectorised step for every row.

Costs are given as a table with one row per case and `columns(program)` columns:
F, B, I and W seconds per chunk, then the RF and RB delays per chunk, then a zero.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from fivedc.schedule.actions import ActionKind as K, Schedule
from fivedc.schedule.clock import DeadlockError, pair_transfers

_DURATION = {K.FORWARD: 0, K.BACKWARD: 1, K.BACKWARD_INPUT: 2, K.BACKWARD_WEIGHT: 3}
_DELAY = {K.RECV_FORWARD: 4, K.RECV_BACKWARD: 5}


@dataclass(frozen=True, eq=False)
class ScheduleProgram:
    """A schedule as index arrays: actions numbered rank by rank, `n` (the last index) a zero."""

    p: int
    chunks: int
    n: int  # actions; index n is a constant zero
    offsets: np.ndarray  # rank r's actions are offsets[r] .. offsets[r+1]-1
    duration: np.ndarray  # per action: its column of the cost table (the zero column for transfers)
    delay: np.ndarray  # per action: its RECV delay's column (the zero column otherwise)
    levels: tuple[tuple[np.ndarray, np.ndarray, np.ndarray], ...]  # (actions, their predecessors, their sends)
    padded: np.ndarray  # [p, longest rank]: each rank's actions in order, padded with n
    live_plus: np.ndarray  # per action: the weight column it adds to the live bytes (2C: none)
    live_minus: np.ndarray  # ... and the one it takes away
    split_plus: np.ndarray  # the same under a split backward (I keeps `deferred` until W)
    split_minus: np.ndarray
    made: np.ndarray  # per action: the gradient column (2C + chunk) it makes first on its rank (3C: none)


def columns(program: ScheduleProgram) -> int:
    return 6 * program.chunks + 1


_PROGRAMS: dict[int, tuple[Schedule, ScheduleProgram]] = {}  # by the schedule's id (hashing one walks its actions)
_KEPT = 128


def program(schedule: Schedule) -> ScheduleProgram:
    """`schedule` compiled to index arrays, kept for the schedule object (immutable, and the
    plan passes share one per (name, p, m, v): `stages.cached_schedule`)."""
    kept = _PROGRAMS.get(id(schedule))
    if kept is not None and kept[0] is schedule:
        return kept[1]
    if len(_PROGRAMS) >= _KEPT:
        del _PROGRAMS[next(iter(_PROGRAMS))]
    compiled = _compile(schedule)
    _PROGRAMS[id(schedule)] = (schedule, compiled)
    return compiled


def _compile(schedule: Schedule) -> ScheduleProgram:
    ranks, c = schedule.ranks, schedule.num_chunks
    lengths = [len(acts) for acts in ranks]
    offsets = np.cumsum([0] + lengths)
    n, zero = int(offsets[-1]), 6 * c
    code = {k: i for i, k in enumerate(K)}
    kind = np.array([code[a.kind] for acts in ranks for a in acts] + [code[K.SEND_FORWARD]], dtype=np.int64)
    chunk = np.array([a.chunk for acts in ranks for a in acts] + [0], dtype=np.int64)
    by_code = np.array([_DURATION.get(k, -1) for k in K])
    d = by_code[kind]
    duration = np.where(d >= 0, d * c + chunk, zero)
    e = np.array([_DELAY.get(k, -1) for k in K])[kind]
    delay = np.where(e >= 0, e * c + chunk, zero)
    duration[n] = delay[n] = zero
    wait = pair_transfers(schedule)
    source = np.array([n if w is None else int(offsets[w[0]]) + w[1] for row in wait for w in row], dtype=np.int64)
    first = np.zeros(n, dtype=bool)
    first[offsets[:-1][np.array(lengths) > 0]] = True
    prev = np.where(first, n, np.arange(n) - 1)
    plus, minus, split_plus, split_minus = _live_columns(kind, chunk, c, n)
    longest = max(lengths, default=0)
    padded = np.full((len(ranks), longest), n)
    for r, length in enumerate(lengths):
        padded[r, :length] = np.arange(offsets[r], offsets[r] + length)
    return ScheduleProgram(schedule.p, c, n, offsets, duration, delay,
                           _levels(schedule, offsets, prev.tolist(), source.tolist(), n),
                           padded, plus, minus, split_plus, split_minus, _made_columns(schedule, c, n))


def _made_columns(schedule: Schedule, c: int, n: int) -> np.ndarray:
    """Per action, the gradient column (2C + chunk) whose gradients it makes first on its rank:
    the first B of a chunk, or its first W under a split backward (I leaves every weight's
    gradient to W); 3C elsewhere (none)."""
    made = np.full(n + 1, 3 * c)
    index = 0
    for acts in schedule.ranks:
        seen: set[int] = set()
        for a in acts:
            if a.kind in (K.BACKWARD, K.BACKWARD_WEIGHT) and a.chunk not in seen:
                seen.add(a.chunk)
                made[index] = 2 * c + a.chunk
            index += 1
    return made


def _live_columns(kind: np.ndarray, chunk: np.ndarray, c: int, n: int) -> tuple[np.ndarray, ...]:
    """Per action, the weight (0..C-1) or deferred (C..2C-1) column it adds to or frees from
    the live bytes (3C: none), without and with a split backward (as `peak_live_weighted`)."""
    code = {k: i for i, k in enumerate(K)}
    none = np.full(n + 1, 3 * c)
    is_f, is_b = kind == code[K.FORWARD], kind == code[K.BACKWARD]
    is_i, is_w = kind == code[K.BACKWARD_INPUT], kind == code[K.BACKWARD_WEIGHT]
    plus = np.where(is_f, chunk, none)
    minus = np.where(is_b | is_w, chunk, none)
    split_plus = np.where(is_f, chunk, np.where(is_i, c + chunk, none))
    split_minus = np.where(is_b | is_i, chunk, np.where(is_w, c + chunk, none))
    return plus, minus, split_plus, split_minus


def _levels(schedule: Schedule, offsets, prev: list[int], source: list[int], n: int) -> tuple:
    """Actions grouped by level (each after its predecessor on the rank and its SEND)."""
    level = [-1] * (n + 1)
    pos = [int(o) for o in offsets[:-1]]
    ends = [int(o) for o in offsets[1:]]
    progress = True
    while progress:
        progress = False
        for r in range(len(pos)):
            g, end = pos[r], ends[r]
            while g < end:
                s = source[g]
                ls = level[s]
                if s != n and ls < 0:
                    break
                lp = level[prev[g]]
                level[g] = (lp if lp > ls else ls) + 1
                g += 1
            if g != pos[r]:
                progress = True
                pos[r] = g
    if any(pos[r] < ends[r] for r in range(len(pos))):
        raise DeadlockError(f"schedule {schedule.name} deadlocks (simulate names the actions)")
    levels = np.array(level[:n])
    order = np.argsort(levels, kind="stable")
    cuts = np.flatnonzero(np.diff(levels[order])) + 1
    prev_a, source_a = np.array(prev), np.array(source)
    return tuple((idx, prev_a[idx], source_a[idx]) for idx in np.split(order, cuts) if idx.size)


def play(prog: ScheduleProgram, table: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Per row of `table` ([rows, columns(prog)]): each rank's last end ([rows, p]) and busy time ([rows, p])."""
    rows = table.shape[0]
    costs = np.ascontiguousarray(table.T)  # [columns, rows]: a level's actions are whole rows
    end = np.zeros((prog.n + 1, rows))
    duration, delay = costs[prog.duration], costs[prog.delay]
    for idx, before, sent in prog.levels:
        arrived = end[sent]
        arrived += delay[idx]
        np.maximum(end[before], arrived, out=arrived)
        arrived += duration[idx]
        end[idx] = arrived
    last = end[np.maximum(prog.offsets[1:] - 1, 0)].T
    last[:, prog.offsets[1:] == prog.offsets[:-1]] = 0.0
    busy = np.add.accumulate(duration[prog.padded], axis=1)[:, -1].T if prog.padded.shape[1] else \
        np.zeros((rows, prog.p))
    return np.ascontiguousarray(last), np.ascontiguousarray(busy)


def makespan_and_bubble(last: np.ndarray, busy: np.ndarray) -> tuple[list[float], list[float]]:
    """`SimResult.makespan` and `.bubble_fraction` of each row, as Python floats."""
    out_m, out_b = [], []
    for ends, times in zip(last.tolist(), busy.tolist()):
        makespan = max(ends, default=0.0)
        out_m.append(makespan)
        out_b.append(1 - sum(times) / (len(times) * makespan) if makespan else 0.0)
    return out_m, out_b


def peaks(prog: ScheduleProgram, weights: np.ndarray, deferred: np.ndarray | None = None,
          grads: np.ndarray | None = None) -> np.ndarray:
    """`peak_live_weighted` per row of integer `weights` ([rows, C]) and `deferred`: [rows, p]
    ints. With `grads` ([rows, C]: each chunk's gradient bytes) they count from the action
    that makes them, beside what that action's backward still holds (it frees its
    microbatch's activations as it ends)."""
    rows, c = weights.shape[0], prog.chunks
    table = np.zeros((rows, 3 * c + 1), dtype=np.int64)
    table[:, :c] = weights
    plus, minus = (prog.live_plus, prog.live_minus) if deferred is None else (prog.split_plus, prog.split_minus)
    if deferred is not None:
        table[:, c:2 * c] = deferred
    if grads is not None:
        table[:, 2 * c:3 * c] = grads
    delta = table[:, plus] - table[:, minus]
    delta[:, prog.n] = 0
    live = np.cumsum(delta[:, prog.padded], axis=2)
    if grads is not None:
        made = np.cumsum(table[:, prog.made][:, prog.padded], axis=2)  # the padding's column is the zero
        before = live - delta[:, prog.padded]  # what an action starts with: a backward's microbatch still kept
        live = np.maximum(live, before) + made
    return np.maximum(live.max(axis=2, initial=0), 0)


def kept_before_backward(schedule: Schedule) -> tuple[tuple[int, ...], ...]:
    """Per rank, the chunks of the forwards it runs before its first backward (B or I): what
    it keeps at that moment, since nothing is freed before a backward (`peak_live_weighted`'s
    live bytes then, a lower bound of its peak)."""
    out = []
    for acts in schedule.ranks:
        chunks = []
        for a in acts:
            if a.kind in (K.BACKWARD, K.BACKWARD_INPUT):
                break
            if a.kind == K.FORWARD:
                chunks.append(a.chunk)
        out.append(tuple(chunks))
    return tuple(out)
