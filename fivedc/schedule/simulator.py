"""A schedule simulated: its clock (`clock.py`) plus bubble, makespan and live activations.

`simulate` checks a schedule statically (`check.py`), runs it on the clock and
reports each rank's busy time, the bubble and the most forwards each rank keeps
alive (`peak_live`, and `peak_live_weighted` for activation bytes by chunk).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from fivedc.schedule.actions import ActionKind as K, Schedule
from fivedc.schedule.check import check_static
from fivedc.schedule.clock import DEFAULT_COSTS, DeadlockError, execute, pair_transfers, resolve_costs

__all__ = ["DEFAULT_COSTS", "DeadlockError", "SimResult", "execute", "pair_transfers", "peak_live", "peak_live_weighted",
           "resolve_costs", "simulate"]


@dataclass(frozen=True, slots=True)
class SimResult:
    schedule: Schedule
    start: tuple[tuple[float, ...], ...]  # per rank, per action
    end: tuple[tuple[float, ...], ...]
    makespan: float
    busy: tuple[float, ...]  # per rank: total duration of its actions
    peak_live: tuple[int, ...]  # per rank: most (microbatch, chunk) forwards alive at once

    @property
    def idle(self) -> tuple[float, ...]:
        """Per rank: the bubble, makespan minus busy time."""
        return tuple(self.makespan - b for b in self.busy)

    @property
    def bubble_fraction(self) -> float:
        """Idle time over all ranks / (p * makespan) = 1 - total busy / (p * makespan)."""
        return 1 - sum(self.busy) / (len(self.busy) * self.makespan) if self.makespan else 0.0


def peak_live(schedule: Schedule) -> tuple[int, ...]:
    """Per rank, the most forwards alive at once: from F until the last of its B or W."""
    peaks = []
    step = {k: 0 for k in K} | {K.FORWARD: 1, K.BACKWARD: -1, K.BACKWARD_WEIGHT: -1}
    for acts in schedule.ranks:
        live = peak = 0
        for a in acts:
            live += step[a.kind]
            if live > peak:
                peak = live
        peaks.append(peak)
    return tuple(peaks)


def peak_live_weighted(schedule: Schedule, weights: Sequence[float],
                       deferred: Sequence[float] | None = None) -> tuple[float, ...]:
    """Per rank, the most of `weights[chunk]` alive at once over the forwards alive (as
    `peak_live` counts them): the activations a rank keeps at its peak when one
    microbatch's forward through chunk c keeps `weights[c]` until its backward. With
    `deferred`, an input-gradient pass I frees them but keeps `deferred[c]` (what the
    weight gradients need) until its W; without, everything stays until W."""
    peaks = []
    for acts in schedule.ranks:
        live = peak = 0.0
        for a in acts:
            if a.kind == K.FORWARD:
                live += weights[a.chunk]
                peak = max(peak, live)
            elif a.kind == K.BACKWARD:
                live -= weights[a.chunk]
            elif deferred is None:
                live -= weights[a.chunk] if a.kind == K.BACKWARD_WEIGHT else 0.0
            elif a.kind == K.BACKWARD_INPUT:
                live += deferred[a.chunk] - weights[a.chunk]
                peak = max(peak, live)
            elif a.kind == K.BACKWARD_WEIGHT:
                live -= deferred[a.chunk]
        peaks.append(peak)
    return tuple(peaks)


def simulate(schedule: Schedule, costs: Mapping[str, float] | None = None, *, check: bool = True,
             chunk_costs: Mapping[str, Sequence[float]] | None = None,
             delays: Mapping[str, Sequence[float]] | None = None) -> SimResult:
    """Run `schedule` on the clock with `costs` per action kind (defaults: F=1, B=2, I=1, W=1, transfers 0),
    or per kind and chunk (`chunk_costs`), RECVs waiting `delays[kind][chunk]` after their SEND.

    With `check`, first verifies what `check_schedule` verifies without running
    (dependencies, exactly-once, pairing); the run itself finds deadlocks. Busy time
    counts computations and transfers as the ranks spend them (not the delays).
    """
    pairs = check_static(schedule) if check else None
    c = resolve_costs(costs)
    per = {k: list(v) for k, v in (chunk_costs or {}).items()}
    start, end = execute(schedule, c, pairs, chunk_costs=per, delays={k: list(v) for k, v in (delays or {}).items()})
    by_kind = {k: c[k.value] for k in K}
    if per:
        busy = tuple(sum(per[a.kind.value][a.chunk] if a.kind.value in per else by_kind[a.kind] for a in acts)
                     for acts in schedule.ranks)
    else:
        busy = tuple(sum(by_kind[a.kind] for a in acts) for acts in schedule.ranks)
    makespan = max((e[-1] for e in end if e), default=0.0)
    return SimResult(schedule=schedule, start=tuple(map(tuple, start)), end=tuple(map(tuple, end)),
                     makespan=makespan, busy=busy, peak_live=peak_live(schedule))
