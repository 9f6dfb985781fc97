"""Pipeline schedules by name: GPipe, 1F1B, interleaved 1F1B, ZB-H1, DualPipeV, DualPipe.

`make_schedule(name, p, m, v)` returns the `Schedule` for p pp ranks and m
microbatches (tests/test_schedules.py runs `check_schedule` on every kind for p up
to 64 and m up to 256). Each generator below fixes the order of computations per rank; the
transfers are added by `p2p.add_p2p` (RECV just before its consumer, SEND just after
its producer). Chunk placement: plain schedules put chunk s on rank s; interleaved
puts chunk c on rank c % p; DualPipeV and DualPipe are in `dualpipe.py`. What each
schedule is (chunks per rank, placement, copies, split backward, what it needs of p
and m) is in `kinds.py`; the checks and the placement below read it from there.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable

from fivedc.schedule.actions import Action, ActionKind as K, Schedule, ScheduleError
from fivedc.schedule.dualpipe import _v_placement, dualpipe, dualpipev
from fivedc.schedule.kinds import SCHEDULES, Placement, schedule_kind
from fivedc.schedule.p2p import add_p2p

F, B, I, W = K.FORWARD, K.BACKWARD, K.BACKWARD_INPUT, K.BACKWARD_WEIGHT


def gpipe(p: int, m: int) -> Schedule:
    """All forwards, then all backwards (in microbatch order). Peak live activations: m."""
    return _plain("gpipe", p, m, [[Action(F, j, r) for j in range(m)] + [Action(B, j, r) for j in range(m)]
                                  for r in range(p)])


def one_f_one_b(p: int, m: int) -> Schedule:
    """PipeDream-flush / Megatron 1F1B: p-1-r warm-up forwards, then F and B alternate."""
    orders = []
    for r in range(p):
        warm = min(p - 1 - r, m)
        order = [Action(F, j, r) for j in range(warm)]
        for k in range(m - warm):
            order += [Action(F, warm + k, r), Action(B, k, r)]
        order += [Action(B, j, r) for j in range(m - warm, m)]
        orders.append(order)
    return _plain("1f1b", p, m, orders)


def zb_h1(p: int, m: int) -> Schedule:
    """ZB-H1 (Qi et al. 2023, "Zero Bubble Pipeline Parallelism"): 1F1B with B split into I and W.

    Rank r runs 1F1B's order with I for B, and holds back its first r weight passes:
    in the steady phase a W follows an I only once r Ws are pending, and the pending
    ones run at the end. Each rank keeps at most p forwards alive (1F1B's peak on rank 0).
    """
    return _plain("zb-h1", p, m, [_zb_h1_rank(p, m, r) for r in range(p)])


def _zb_h1_rank(p: int, m: int, r: int) -> list[Action]:
    warm = min(p - 1 - r, m)
    order = [Action(F, j, r) for j in range(warm)]
    pending: deque[int] = deque()
    for k in range(m):
        if warm + k < m:
            order.append(Action(F, warm + k, r))
        order.append(Action(I, k, r))
        pending.append(k)
        if len(pending) > r:
            order.append(Action(W, pending.popleft(), r))
    order += [Action(W, j, r) for j in pending]
    return order


def interleaved(p: int, m: int, v: int) -> Schedule:
    """Megatron's interleaved 1F1B: v chunks per rank (chunk c on rank c % p), m a multiple of p.

    Rank r walks m*v (microbatch, chunk) steps; step k is microbatch (k // (p*v))*p + k % p
    on local chunk (k // p) % v for forwards, v-1 minus that for backwards. It runs
    (p-r-1)*2 + (v-1)*p warm-up forwards, then one forward and one backward per step.
    """
    n, total = p * v, m * v

    def step(r: int, k: int, backward: bool) -> Action:
        local = (k // p) % v
        j = (k // n) * p + k % p
        return Action(B if backward else F, j, (v - 1 - local if backward else local) * p + r)

    orders = []
    for r in range(p):
        warm = min((p - r - 1) * 2 + (v - 1) * p, total)
        order = [step(r, k, False) for k in range(warm)]
        for k in range(total - warm):
            order += [step(r, warm + k, False), step(r, k, True)]
        order += [step(r, k, True) for k in range(total - warm, total)]
        orders.append(order)
    placement = tuple(c % p for c in range(n))
    return add_p2p(Schedule("interleaved", p, m, v, placement, tuple(map(tuple, orders))))


def _plain(name: str, p: int, m: int, orders: list[list[Action]]) -> Schedule:
    return add_p2p(Schedule(name, p, m, 1, tuple(range(p)), tuple(map(tuple, orders))))


# name -> builder taking (p, m, v); what each schedule is (chunks per rank, placement, ...) is in kinds.py
_BUILDERS: dict[str, Callable[[int, int, int], Schedule]] = {
    "gpipe": lambda p, m, v: gpipe(p, m),
    "1f1b": lambda p, m, v: one_f_one_b(p, m),
    "interleaved": interleaved,
    "zb-h1": lambda p, m, v: zb_h1(p, m),
    "dualpipev": lambda p, m, v: dualpipev(p, m),
    "dualpipe": lambda p, m, v: dualpipe(p, m),
}
if tuple(_BUILDERS) != SCHEDULES:
    raise ImportError(f"fivedc.schedule: builders {tuple(_BUILDERS)} and kinds {SCHEDULES} name different schedules")


def placement(name: str, p: int, v: int | None = None) -> tuple[tuple[int, ...], int]:
    """(chunk -> pp rank, pipelines) of `make_schedule(name, p, m, v)` for any m: where the
    chunks run, without generating the actions (the layout search bounds a pipeline's
    time from it before building its schedule)."""
    kind = schedule_kind(name)
    if kind.placement is Placement.V:
        return _v_placement(p), kind.pipelines
    return tuple(c % p for c in range(p * kind.per_rank(v))), kind.pipelines


def min_microbatches(name: str, p: int) -> int:
    """The fewest microbatches `name` accepts for p ranks."""
    return schedule_kind(name).min_microbatches(p)


def make_schedule(name: str, p: int, m: int, v: int | None = None) -> Schedule:
    """The schedule `name` for p pp ranks, m microbatches and (interleaved only) v chunks per rank."""
    check_request(name, p, m, v)
    return _BUILDERS[name](p, m, schedule_kind(name).per_rank(v))


def check_request(name: str, p: int, m: int, v: int | None = None) -> None:
    """Raise the `ScheduleError` `make_schedule(name, p, m, v)` raises, without building it."""
    kind = schedule_kind(name)
    for what, value in (("p", p), ("m", m), ("v", v)):
        if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < 1):
            raise ScheduleError(f"{name}: {what}={value!r} must be a positive integer",
                                hint=f"pass {what} as an int >= 1" + (" (or leave v out)" if what == "v" else ""))
    fixed_v = kind.chunks_per_rank
    if fixed_v is not None and v not in (None, fixed_v):
        raise ScheduleError(f"{name} runs {fixed_v} chunk(s) per rank, not v={v}",
                            hint=f"leave v out or pass v={fixed_v}")
    if kind.takes_virtual:
        _check_interleaved(p, m, v)
    if p < kind.min_p:
        raise ScheduleError(f"{name} needs at least {kind.min_p} pp ranks, got p={p}",
                            hint=f"use p >= {kind.min_p}, or 1f1b for p=1")
    if kind.pipelines > 1 and p % 2:
        raise ScheduleError(f"dualpipe needs an even number of pp ranks, got p={p}",
                            hint=f"use p={p - 1} or p={p + 1}, or dualpipev, which takes any p >= 2")
    least = kind.min_microbatches(p)
    if m < least:
        raise ScheduleError(f"{name} with p={p} needs at least {least} microbatches, got m={m}",
                            hint=f"use m >= {least}")
    if m % kind.pipelines:
        raise ScheduleError(f"dualpipe splits the microbatches evenly over two directions; m={m} is odd",
                            hint=f"use m={m + 1}")


def _check_interleaved(p: int, m: int, v: int | None) -> None:
    if v is None or v < 2:
        raise ScheduleError(f"interleaved needs v >= 2 chunks per rank, got v={v}",
                            hint="pass v=2 or more (v=1 is plain 1f1b)")
    if p < 2:
        raise ScheduleError(f"interleaved needs at least 2 pp ranks, got p={p}", hint="use 1f1b for p=1")
    if m % p:
        lower, upper = max(p, m - m % p), m - m % p + p
        raise ScheduleError(f"interleaved needs m a multiple of p (as in Megatron): m={m} is not a multiple of p={p}",
                            hint=f"use m={lower} or m={upper}" if lower != upper else f"use m={upper}")
