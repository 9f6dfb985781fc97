"""DeepSeek's DualPipe (bidirectional, DeepSeek-V3 report) and DualPipeV (its V-shaped fold).

Both place chunk c < p on rank c and chunk c >= p on rank 2p-1-c, so rank r holds
chunks r and 2p-1-r. DualPipeV runs one model of 2p chunks down the ranks and back
up (a V); the loss is on chunk 2p-1, on rank 0. DualPipe runs two copies of a model
of p chunks in opposite directions: copy A is chunks 0..p-1 (chunk s on rank s),
copy B is chunks p..2p-1 (stage s of copy B is chunk p+s, on rank p-1-s); the first
m/2 microbatches go through copy A and the rest through copy B.

Per rank, both follow the eight steps of deepseek-ai/DualPipe (`dualpipe.py` and
`dualpipev.py`), here with P = p (V) or p/2 (DualPipe), M = m (V) or m/2, and h =
the rank (V) or its distance from the nearer end (DualPipe). Phase 0 is the chunk
whose input comes first, phase 1 the other; X&Y is a pair DeepSeek's runtime
overlaps: both receives happen before it and both sends after it, and our
simulator runs it as X then Y, so F&B = F + B there.

1. (P-h-1)*2 x F0    2. (h+1) x F0 F1    3. (P-h-1) x I1 W F1
4. (M-2P+h+1) x F0&B1 F1&B0 (on the V's tip, h = P-1, the first F0 B1 is not a pair)
5. (P-h-1) x B1 F1&B0    6. (h+1) x B1 B0, as I1 / I0 from the middle on
7. (P-h-1) x W I0    8. (h+1) x W        (W: the oldest queued weight pass)
"""

from __future__ import annotations

from collections import deque

from fivedc.schedule.actions import Action, ActionKind as K, Schedule
from fivedc.schedule.p2p import add_p2p


def dualpipev(p: int, m: int) -> Schedule:
    """DualPipeV on p >= 2 ranks with m >= 2p microbatches."""
    ranks = [_v_rank(p, m, r, (r, 0), (2 * p - 1 - r, 0)) for r in range(p)]
    return _with_p2p(Schedule("dualpipev", p, m, 2, _v_placement(p), tuple(o for o, _ in ranks)), ranks)


def dualpipe(p: int, m: int) -> Schedule:
    """DualPipe on an even p >= 2 ranks with an even m >= 2p microbatches (m/2 each way)."""
    half, mh = p // 2, m // 2
    ranks = []
    for r in range(p):
        a, b = (r, 0), (2 * p - 1 - r, mh)  # (chunk, first microbatch) of copy A and copy B
        phases = (a, b) if r < half else (b, a)  # phase 0: the copy whose input is nearer
        ranks.append(_v_rank(half, mh, min(r, p - 1 - r), *phases))
    return _with_p2p(Schedule("dualpipe", p, m, 2, _v_placement(p), tuple(o for o, _ in ranks), pipelines=2), ranks)


def _with_p2p(schedule: Schedule, ranks: list[tuple[tuple[Action, ...], tuple[int, ...]]]) -> Schedule:
    return add_p2p(schedule, pairs=frozenset((r, i) for r, (_, pairs) in enumerate(ranks) for i in pairs))


def _v_placement(p: int) -> tuple[int, ...]:
    return tuple(c if c < p else 2 * p - 1 - c for c in range(2 * p))


def _v_rank(P: int, M: int, h: int, phase0: tuple[int, int],
            phase1: tuple[int, int]) -> tuple[tuple[Action, ...], tuple[int, ...]]:
    """One rank's computations, and the positions where its overlapped F&B pairs start."""
    r = _Rank(phase0, phase1)
    r.run("F0", (P - h - 1) * 2)
    r.run("F0 F1", h + 1)
    r.run("I1 W F1", P - h - 1)
    steady = M - 2 * P + h + 1  # >= 1 as M >= 2P
    if h == P - 1:  # DeepSeek does not overlap the first pair on the tip of the V
        r.run("F0 B1 F1&B0")
        steady -= 1
    r.run("F0&B1 F1&B0", steady)
    r.run("B1 F1&B0", P - h - 1)
    split = False
    for i in range(h + 1):  # from the middle on, split backwards and queue their weight passes
        split = split or (i == (h + 1) // 2 and h % 2 == 1)
        r.run("I1" if split else "B1")
        split = split or (i == (h + 1) // 2 and h % 2 == 0)
        r.run("I0" if split else "B0")
    r.run("W I0", P - h - 1)
    r.run("W", len(r.weights))
    return tuple(r.order), tuple(r.pairs)


class _Rank:
    """One rank's computations in the making: the next microbatch of each phase, queued W passes.

    `run` reads DeepSeek's step names: F0/F1 a forward of phase 0/1, B0/B1 a full backward,
    I0/I1 an input-gradient backward (its W queued), W the oldest queued weight pass, and
    X&Y an overlapped pair.
    """

    def __init__(self, phase0: tuple[int, int], phase1: tuple[int, int]) -> None:
        self.chunk, self.next_f, self.next_b = (phase0[0], phase1[0]), [phase0[1], phase1[1]], [phase0[1], phase1[1]]
        self.order: list[Action] = []
        self.pairs: list[int] = []
        self.weights: deque[tuple[int, int]] = deque()

    def run(self, steps: str, times: int = 1) -> None:
        for _ in range(times):
            for step in steps.split():
                if "&" in step:
                    self.pairs.append(len(self.order))
                for one in step.split("&"):
                    self._one(one)

    def _one(self, step: str) -> None:
        if step == "W":
            j, c = self.weights.popleft()
            self.order.append(Action(K.BACKWARD_WEIGHT, j, c))
            return
        kind, ph = K(step[0]), int(step[1])
        counter = self.next_f if kind is K.FORWARD else self.next_b
        j, c = counter[ph], self.chunk[ph]
        counter[ph] += 1
        self.order.append(Action(kind, j, c))
        if kind is K.BACKWARD_INPUT:
            self.weights.append((j, c))
