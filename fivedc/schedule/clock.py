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
    sends: dict[tuple[int, int, K], list[int]] = {}  # channel (sender, receiver, SEND kind) -> action indices
    recvs: dict[tuple[int, int, K], list[int]] = {}
    for rank, acts in enumerate(schedule.ranks):
        for index, action in enumerate(acts):
            if action.kind in SENDS:
                sends.setdefault((rank, action.peer, action.kind), []).append(index)
            elif action.kind in RECVS:
                recvs.setdefault((action.peer, rank, PARTNER[action.kind]), []).append(index)
    waits: list[list[tuple[int, int] | None]] = [[None] * len(acts) for acts in schedule.ranks]
    for channel in set(sends) | set(recvs):
        sender, receiver, _ = channel
        send_indices, recv_indices = sends.get(channel, []), recvs.get(channel, [])
        sent, received = schedule.ranks[sender], schedule.ranks[receiver]
        for k, (send_index, recv_index) in enumerate(zip(send_indices, recv_indices)):
            send, recv = sent[send_index], received[recv_index]
            if send.microbatch != recv.microbatch or send.chunk != recv.chunk:
                raise _unpaired(schedule, channel, send_indices, recv_indices, k)
            waits[receiver][recv_index] = (sender, send_index)
        if len(send_indices) != len(recv_indices):
            raise _unpaired(schedule, channel, send_indices, recv_indices, min(len(send_indices), len(recv_indices)))
    return waits


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
    waits = pair_transfers(schedule) if pairs is None else pairs
    clock = _Clock(schedule, waits, _durations(schedule, costs, chunk_costs or {}),
                   _travel_times(schedule, delays) if delays else None)
    runnable = list(range(len(schedule.ranks)))
    while runnable:
        runnable += clock.advance(runnable.pop())
    stuck = [rank for rank, acts in enumerate(schedule.ranks) if clock.done[rank] < len(acts)]
    if stuck:
        raise _deadlock(schedule, stuck, clock.done, waits)
    return clock.start, clock.end


def _durations(schedule: Schedule, costs: Mapping[str, float],
               chunk_costs: Mapping[str, list[float]]) -> list[list[float]]:
    """Each action's duration: `chunk_costs[kind][chunk]` where given, else `costs[kind]`."""
    plain = {kind: costs[kind.value] for kind in K}
    if not chunk_costs:
        return [[plain[action.kind] for action in acts] for acts in schedule.ranks]
    per_chunk = {kind: chunk_costs.get(kind.value) for kind in K}
    return [[plain[action.kind] if per_chunk[action.kind] is None else per_chunk[action.kind][action.chunk]
             for action in acts] for acts in schedule.ranks]


def _travel_times(schedule: Schedule, delays: Mapping[str, list[float]]) -> list[list[float]]:
    """How long each RECV's tensor travels after its SEND ends (`delays[kind][chunk]`, else 0); 0 for the rest."""
    per_chunk = {kind: delays.get(kind.value) for kind in K}
    return [[per_chunk[action.kind][action.chunk] if action.kind in RECVS and per_chunk[action.kind] is not None
             else 0.0 for action in acts] for acts in schedule.ranks]


class _Clock:
    """The state of the event loop: per rank, how many of its actions have run and when it is free."""

    def __init__(self, schedule: Schedule, waits: list[list[tuple[int, int] | None]], durations: list[list[float]],
                 travel: list[list[float]] | None) -> None:
        ranks = schedule.ranks
        self.waits, self.durations, self.travel = waits, durations, travel
        self.start = [[0.0] * len(acts) for acts in ranks]
        self.end = [[0.0] * len(acts) for acts in ranks]
        self.done = [0] * len(ranks)  # per rank: how many of its actions have run
        self.free_at = [0.0] * len(ranks)  # per rank: when its last action ended
        self.blocked: dict[tuple[int, int], int] = {}  # a SEND not issued yet -> the rank whose RECV waits on it

    def advance(self, rank: int) -> list[int]:
        """Run `rank`'s actions until it ends or reaches a RECV whose SEND is not issued yet;
        the ranks whose RECVs its SENDs unblocked."""
        index, now, done, end, blocked = self.done[rank], self.free_at[rank], self.done, self.end, self.blocked
        waits, durations, starts, ends = self.waits[rank], self.durations[rank], self.start[rank], end[rank]
        travel = self.travel[rank] if self.travel is not None else None
        unblocked = []
        while index < len(durations):
            send = waits[index]
            if send is not None:
                sender, send_index = send
                if done[sender] <= send_index:  # the SEND is not issued yet
                    blocked[send] = rank
                    break
                arrives = end[sender][send_index] + (travel[index] if travel is not None else 0.0)
                if arrives > now:
                    now = arrives
            starts[index] = now
            now += durations[index]
            ends[index] = now
            if blocked and (rank, index) in blocked:
                unblocked.append(blocked.pop((rank, index)))
            index += 1
        self.done[rank], self.free_at[rank] = index, now
        return unblocked


def _deadlock(schedule: Schedule, stuck: list[int], done: list[int],
              waits: list[list[tuple[int, int] | None]]) -> DeadlockError:
    ranks = schedule.ranks
    parts = []
    for rank in stuck:
        at = done[rank]
        sender, send_index = waits[rank][at]
        behind = done[sender]
        parts.append(f"rank {rank} at action {at} ({ranks[rank][at]}) waits for rank {sender}'s action {send_index} "
                     f"({ranks[sender][send_index]}), behind rank {sender}'s action {behind} ({ranks[sender][behind]})")
    return DeadlockError(f"schedule {schedule.name} deadlocks: " + "; ".join(parts),
                         hint="each RECV needs its SEND to be reachable without waiting on that RECV: move the "
                              "SEND earlier on its rank or the RECV later")
