"""The clock a schedule runs on: transfers paired, every action's start and end.

Execution semantics (the runtime implements exactly these):

- Each pp rank runs its actions one at a time, in list order.
- A SEND never waits: the runtime posts it (isend), keeps the handle and waits on
  it only at the end of the step.
- A RECV waits until its matching SEND has been issued (on the clock: has ended).
- Matching is first-in first-out per channel; a channel is (sender, receiver,
  direction), direction being activations (SEND_FORWARD/RECV_FORWARD) or gradients
  (SEND_BACKWARD/RECV_BACKWARD): the k-th RECV_FORWARD on rank b from rank a takes
  the k-th SEND_FORWARD from a to b, and both must name the same microbatch and
  chunk. With gloo: one tag per direction. NCCL runs a communicator's transfers in
  order on one stream, where a pending send holds back a later receive; that is
  not these semantics, so such a runtime needs a communicator (stream) per channel.
- A computation's inputs are on its rank when it starts: those from other ranks
  came through an earlier RECV, those from the same rank from an earlier action.

On the clock an action starts when its rank is free and, for a RECV, when the
matching SEND has ended; it lasts `costs[kind]`. A schedule in which some RECV can
never be matched this way deadlocks, and `simulate` raises `DeadlockError`.
"""

from __future__ import annotations

from collections.abc import Mapping

from fivedc.schedule.actions import PARTNER, RECVS, SENDS, ActionKind as K, Schedule, ScheduleError

DEFAULT_COSTS: Mapping[str, float] = {"F": 1, "B": 2, "I": 1, "W": 1, "SF": 0, "RF": 0, "SB": 0, "RB": 0}


class DeadlockError(ScheduleError):
    """Some ranks wait on receives whose sends can never be issued."""


def resolve_costs(costs: Mapping[str, float] | None) -> dict[str, float]:
    merged = dict(DEFAULT_COSTS)
    for key, value in (costs or {}).items():
        if str(key) not in DEFAULT_COSTS:
            raise ScheduleError(f"unknown action kind {key!r} in costs",
                                hint=f"use the kinds {', '.join(DEFAULT_COSTS)}")
        if value < 0:
            raise ScheduleError(f"cost of {key} is {value}; costs must be zero or positive")
        merged[str(key)] = value
    return merged


def pair_transfers(schedule: Schedule) -> list[list[tuple[int, int] | None]]:
    """Per rank and action: for a RECV, the (rank, index) of its SEND, matched FIFO per channel; else None."""
    sends: dict[tuple[int, int, K], list[int]] = {}
    recvs: dict[tuple[int, int, K], list[int]] = {}
    for r, acts in enumerate(schedule.ranks):
        for i, a in enumerate(acts):
            k = a.kind
            if k in SENDS:
                sends.setdefault((r, a.peer, k), []).append(i)
            elif k in RECVS:
                recvs.setdefault((a.peer, r, PARTNER[k]), []).append(i)
    wait: list[list[tuple[int, int] | None]] = [[None] * len(acts) for acts in schedule.ranks]
    for channel in set(sends) | set(recvs):
        src, dst, _ = channel
        s_idx, r_idx = sends.get(channel, []), recvs.get(channel, [])
        s_acts, r_acts, w = schedule.ranks[src], schedule.ranks[dst], wait[dst]
        for si, ri in zip(s_idx, r_idx):
            s, r = s_acts[si], r_acts[ri]
            if s.microbatch != r.microbatch or s.chunk != r.chunk:
                raise _unpaired(schedule, channel, s_idx, r_idx, s_idx.index(si))
            w[ri] = (src, si)
        if len(s_idx) != len(r_idx):
            raise _unpaired(schedule, channel, s_idx, r_idx, min(len(s_idx), len(r_idx)))
    return wait


def _unpaired(schedule: Schedule, channel: tuple[int, int, K], s_idx: list[int], r_idx: list[int],
              k: int) -> ScheduleError:
    src, dst, kind = channel
    s = f"{schedule.ranks[src][s_idx[k]]} (action {s_idx[k]})" if k < len(s_idx) else "nothing more"
    r = f"{schedule.ranks[dst][r_idx[k]]} (action {r_idx[k]})" if k < len(r_idx) else "nothing more"
    return ScheduleError(
        f"schedule {schedule.name}: sends and receives do not pair up in order on the "
        f"{'activation' if kind is K.SEND_FORWARD else 'gradient'} channel "
        f"rank {src} -> rank {dst}, transfer #{k}: rank {src} sends {s} but rank {dst} receives {r}",
        hint="each channel is first-in first-out: receive in the order the peer sends, one RECV per SEND")


def execute(schedule: Schedule, costs: Mapping[str, float],
            pairs: list[list[tuple[int, int] | None]] | None = None, *,
            chunk_costs: Mapping[str, list[float]] | None = None,
            delays: Mapping[str, list[float]] | None = None) -> tuple[list[list[float]], list[list[float]]]:
    """Start and end times of every action; raises DeadlockError if some rank can never finish.

    `chunk_costs[kind][c]` replaces `costs[kind]` for actions on chunk c (a model's
    chunks differ); `delays[kind][c]`, for a RECV kind, is how long its tensor travels:
    the RECV starts no earlier than its SEND's end plus that."""
    if chunk_costs or delays:
        return _execute_by_chunk(schedule, costs, pairs, chunk_costs or {}, delays or {})
    wait = pair_transfers(schedule) if pairs is None else pairs
    ranks = schedule.ranks
    by_kind = {k: costs[k.value] for k in K}
    start = [[0.0] * len(acts) for acts in ranks]
    end = [[0.0] * len(acts) for acts in ranks]
    pos, clock = [0] * len(ranks), [0.0] * len(ranks)
    waiters: dict[tuple[int, int], int] = {}
    todo = list(range(len(ranks)))
    while todo:
        r = todo.pop()
        i, t, acts = pos[r], clock[r], ranks[r]
        n, st, en, wt = len(acts), start[r], end[r], wait[r]
        while i < n:
            w = wt[i]
            if w is not None:
                if pos[w[0]] <= w[1]:  # the send is not issued yet
                    waiters[w] = r
                    break
                sent = end[w[0]][w[1]]
                if sent > t:
                    t = sent
            st[i] = t
            t += by_kind[acts[i].kind]
            en[i] = t
            i += 1
            if waiters and (r, i - 1) in waiters:
                pos[r] = i
                todo.append(waiters.pop((r, i - 1)))
        pos[r], clock[r] = i, t
    stuck = [r for r in range(len(ranks)) if pos[r] < len(ranks[r])]
    if stuck:
        raise _deadlock(schedule, stuck, pos, wait)
    return start, end


def _execute_by_chunk(schedule: Schedule, costs: Mapping[str, float], pairs, chunk_costs, delays):
    """`execute` with costs per (kind, chunk) and transfer delays: the same loop, slower."""
    wait = pair_transfers(schedule) if pairs is None else pairs
    ranks = schedule.ranks
    cost = {k: (chunk_costs[k.value] if k.value in chunk_costs else None, costs[k.value]) for k in K}
    delay = {k: delays.get(k.value) for k in K}
    start = [[0.0] * len(acts) for acts in ranks]
    end = [[0.0] * len(acts) for acts in ranks]
    pos, clock = [0] * len(ranks), [0.0] * len(ranks)
    waiters: dict[tuple[int, int], int] = {}
    todo = list(range(len(ranks)))
    while todo:
        r = todo.pop()
        i, t, acts = pos[r], clock[r], ranks[r]
        while i < len(acts):
            a, w = acts[i], wait[r][i]
            if w is not None:
                if pos[w[0]] <= w[1]:
                    waiters[w] = r
                    break
                travel = delay[a.kind]
                t = max(t, end[w[0]][w[1]] + (travel[a.chunk] if travel is not None else 0.0))
            start[r][i] = t
            per_chunk, plain = cost[a.kind]
            t += per_chunk[a.chunk] if per_chunk is not None else plain
            end[r][i] = t
            i += 1
            if waiters and (r, i - 1) in waiters:
                pos[r] = i
                todo.append(waiters.pop((r, i - 1)))
        pos[r], clock[r] = i, t
    stuck = [r for r in range(len(ranks)) if pos[r] < len(ranks[r])]
    if stuck:
        raise _deadlock(schedule, stuck, pos, wait)
    return start, end


def _deadlock(schedule: Schedule, stuck: list[int], pos: list[int],
              wait: list[list[tuple[int, int] | None]]) -> DeadlockError:
    ranks = schedule.ranks
    parts = []
    for r in stuck:
        src, si = wait[r][pos[r]]
        parts.append(f"rank {r} at action {pos[r]} ({ranks[r][pos[r]]}) waits for rank {src}'s action {si} "
                     f"({ranks[src][si]}), behind rank {src}'s action {pos[src]} ({ranks[src][pos[src]]})")
    return DeadlockError(f"schedule {schedule.name} deadlocks: " + "; ".join(parts),
                         hint="each RECV needs its SEND to be reachable without waiting on that RECV: move the "
                              "SEND earlier on its rank or the RECV later")
