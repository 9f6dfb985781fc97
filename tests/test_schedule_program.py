"""A schedule compiled to index arrays (fivedc/schedule/batched.py) plays as `simulate` does, to the last bit.

The layout search plays one schedule with thousands of cost vectors, and the plan's
memory and step time go through the same program; these tests hold its makespan,
bubble, busy times and activation peaks equal (==, not approx) to the action-by-action
simulator's, for every schedule kind, with unequal chunk costs and transfer delays.
"""

from __future__ import annotations

import random

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from fivedc.schedule import SCHEDULES, make_schedule, min_microbatches, peak_live_weighted, simulate
from fivedc.schedule.batched import columns, makespan_and_bubble, peaks, play, program


def _shape(name: str, p: int, m: int) -> tuple[int, int, int | None]:
    p = p + p % 2 if name == "dualpipe" else max(p, 2) if name in ("dualpipev", "interleaved") else p
    m = max(m, min_microbatches(name, p))
    if name == "interleaved":
        m = p * -(-m // p)
    if name == "dualpipe":
        m += m % 2
    return p, m, 2 if name == "interleaved" else None


@settings(max_examples=30, deadline=None)
@given(st.sampled_from(SCHEDULES), st.integers(1, 8), st.integers(1, 24), st.integers(0, 2**32))
def test_play_equals_simulate_bit_for_bit(name: str, p: int, m: int, seed: int) -> None:
    p, m, v = _shape(name, p, m)
    schedule, rng = make_schedule(name, p, m, v), random.Random(seed)
    chunks, rows, expected = schedule.num_chunks, [], []
    for _ in range(3):
        per = {k: [rng.uniform(1e-4, 1e-1) for _ in range(chunks)] for k in "FBIW"}
        travel = [rng.choice((0.0, rng.uniform(0, 1e-2))) for _ in range(chunks)]
        delays = {"RF": travel, "RB": [0.0, *travel[:-1]]}
        result = simulate(schedule, check=False, chunk_costs=per, delays=delays)
        expected.append((result.makespan, result.bubble_fraction, result.busy))
        rows.append([*per["F"], *per["B"], *per["I"], *per["W"], *delays["RF"], *delays["RB"], 0.0])
    table = np.array(rows)
    assert table.shape[1] == columns(program(schedule))
    last, busy = play(program(schedule), table)
    makespans, bubbles = makespan_and_bubble(last, busy)
    assert list(zip(makespans, bubbles, map(tuple, busy.tolist()))) == expected


@settings(max_examples=30, deadline=None)
@given(st.sampled_from(SCHEDULES), st.integers(1, 8), st.integers(1, 24), st.integers(0, 2**32))
def test_peaks_equal_peak_live_weighted(name: str, p: int, m: int, seed: int) -> None:
    p, m, v = _shape(name, p, m)
    schedule, rng = make_schedule(name, p, m, v), random.Random(seed)
    weights = [[rng.randrange(0, 10**11) for _ in range(schedule.num_chunks)] for _ in range(3)]
    deferred = [[rng.randrange(0, 10**11) for _ in range(schedule.num_chunks)] for _ in range(3)]
    split, whole = peaks(program(schedule), np.array(weights), np.array(deferred)), peaks(program(schedule), np.array(weights))
    for w, d, a, b in zip(weights, deferred, split.tolist(), whole.tolist()):
        assert a == [int(x) for x in peak_live_weighted(schedule, w, d)]
        assert b == [int(x) for x in peak_live_weighted(schedule, w)]


@pytest.mark.parametrize("name", SCHEDULES)
def test_a_large_schedule_plays_equal(name: str) -> None:
    p, m, v = _shape(name, 16, 64)
    schedule, rng = make_schedule(name, p, m, v), random.Random(1)
    per = {k: [rng.uniform(1e-3, 1e-2) for _ in range(schedule.num_chunks)] for k in "FBIW"}
    delays = {"RF": [1e-4] * schedule.num_chunks, "RB": [0.0] + [1e-4] * (schedule.num_chunks - 1)}
    result = simulate(schedule, check=False, chunk_costs=per, delays=delays)
    row = [*per["F"], *per["B"], *per["I"], *per["W"], *delays["RF"], *delays["RB"], 0.0]
    (makespan,), (bubble,) = makespan_and_bubble(*play(program(schedule), np.array([row])))
    assert (makespan, bubble) == (result.makespan, result.bubble_fraction)


@pytest.mark.parametrize("name", SCHEDULES)
def test_more_microbatches_keep_as_much_before_the_first_backward(name: str) -> None:
    # the search's memory bound reads these forwards from the schedule at 2p microbatches
    # for any m above it (fivedc/search/bounds.py): they must be a part of m's
    from collections import Counter

    from fivedc.schedule.batched import kept_before_backward

    for p in (2, 3, 4, 6, 8):
        p, reference, v = _shape(name, p, 2 * p)
        if reference != 2 * p:
            continue
        base = kept_before_backward(make_schedule(name, p, reference, v))
        for m in range(2 * p + 1, 5 * p + 1):
            if _shape(name, p, m)[1] != m:
                continue
            kept = kept_before_backward(make_schedule(name, p, m, v))
            for mine, smaller in zip(kept, base):
                assert not Counter(smaller) - Counter(mine), (name, p, m)
