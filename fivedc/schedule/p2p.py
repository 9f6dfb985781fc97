"""Insert the point-to-point transfers into a schedule that lists only computations.

Every generator decides the order of computations on each rank and leaves the
transfers to `add_p2p`: a RECV goes immediately before the computation that needs
the tensor and a SEND immediately after the computation that produced it; for an
overlapped pair (DualPipe's F&B) both RECVs go before the pair and both SENDs after
it, so that a runtime can run the two computations together. Under
the execution semantics of `simulator.py` (a RECV waits for its SEND; SENDs never
wait) this placement is the one that waits least, and it keeps each (sender,
receiver, direction) channel in the order both sides compute, so sends and
receives pair up in order whenever both ranks take microbatches of a chunk in the
same order. Neighbouring chunks on the same rank (the tip of a V) need no transfer.
"""

from __future__ import annotations

from dataclasses import replace

from fivedc.schedule.actions import Action, ActionKind as K, Schedule

_BACKWARDS = (K.BACKWARD, K.BACKWARD_INPUT)


def add_p2p(schedule: Schedule, *, pairs: frozenset[tuple[int, int]] = frozenset()) -> Schedule:
    """`schedule` with the sends and receives each rank's computations need.

    `pairs` holds (rank, index) of computations that run overlapped with the next
    one (DualPipe's F&B): the receives of both go before the pair, the sends after it.
    """
    by_rank: dict[int, set[int]] = {}
    for r, i in pairs:
        by_rank.setdefault(r, set()).add(i)
    return replace(schedule, ranks=tuple(_rank_with_p2p(schedule, r, acts, by_rank.get(r, set()))
                                         for r, acts in enumerate(schedule.ranks)))


def _rank_with_p2p(s: Schedule, rank: int, actions: tuple[Action, ...], pairs: set[int]) -> tuple[Action, ...]:
    out: list[Action] = []
    neighbours: dict[int, tuple] = {}  # chunk -> its previous and next chunk, and their ranks when not this one
    n = 0
    while n < len(actions):
        if n in pairs:
            (r1, s1), (r2, s2) = _transfers(s, rank, actions[n], neighbours), \
                _transfers(s, rank, actions[n + 1], neighbours)
            out += [*r1, *r2, actions[n], actions[n + 1], *s1, *s2]
            n += 2
            continue
        recvs, sends = _transfers(s, rank, actions[n], neighbours)
        out += [*recvs, actions[n], *sends]
        n += 1
    return tuple(out)


def _transfers(s: Schedule, rank: int, a: Action, neighbours: dict[int, tuple]) -> tuple[list[Action], list[Action]]:
    """The receives computation `a` needs before it and the sends it makes after it."""
    j, c = a.microbatch, a.chunk
    if c not in neighbours:
        prev_c, next_c = s.prev_chunk(c), s.next_chunk(c)
        neighbours[c] = (prev_c, None if prev_c is None or s.placement[prev_c] == rank else s.placement[prev_c],
                         next_c, None if next_c is None or s.placement[next_c] == rank else s.placement[next_c])
    prev_c, prev_r, next_c, next_r = neighbours[c]
    if a.kind is K.FORWARD:
        return ([Action(K.RECV_FORWARD, j, prev_c, prev_r)] if prev_r is not None else [],
                [Action(K.SEND_FORWARD, j, c, next_r)] if next_r is not None else [])
    if a.kind in _BACKWARDS:
        return ([Action(K.RECV_BACKWARD, j, next_c, next_r)] if next_r is not None else [],
                [Action(K.SEND_BACKWARD, j, c, prev_r)] if prev_r is not None else [])
    return [], []
