"""Pipeline schedules: every generator passes the checker, and the simulated bubbles and
activation peaks equal the published formulas, under the conditions stated per test.

Costs are integers, so makespans and idle times compare exactly. "Idle per rank" is
makespan minus the rank's busy time (equal on every rank for these schedules); the
bubble fraction is total idle / (p * makespan). Transfers cost 0.
"""

from __future__ import annotations

import json
import math
import time
from dataclasses import replace

import pytest
from hypothesis import given, settings, strategies as st

from fivedc.errors import PlanError
from fivedc.schedule import (SCHEDULES, Action, DeadlockError, Schedule, ScheduleError, check_schedule, draw_schedule,
                             make_schedule, min_microbatches, simulate)

FAST = settings(max_examples=20, deadline=None)
BUDGET = 2000  # most (microbatch, chunk) pairs drawn: each example stays around 0.05 s


@st.composite
def shapes(draw, name: str, *, m_at_least_p: bool = False):
    """(p, m, v) valid for `name`, with p up to 64 and m up to 256 (p*m*v within BUDGET;
    the test_largest_* tests cover p=64, m=256)."""
    even = name == "dualpipe"
    v = draw(st.integers(2, 4)) if name == "interleaved" else None
    most_p = 64 if name in ("gpipe", "1f1b") else math.isqrt(BUDGET // 4)  # these need m >= p or 2p
    least_p = 1 if name in ("gpipe", "1f1b", "zb-h1") else 2
    p = draw(st.integers(least_p, most_p).map(lambda p: p + p % 2 if even else p))
    low = max(min_microbatches(name, p), p if m_at_least_p else 1)
    high = max(low, min(256, BUDGET // (p * (v or 1))))
    m = draw(st.integers(low, high))
    if name == "interleaved":
        m = max(p, m - m % p)
    if even:
        m += m % 2
    return p, m, v


def run(name: str, p: int, m: int, v: int | None = None, **costs: int):
    """Generate, check (`simulate` runs check_schedule's static checks, and its run finds deadlocks) and simulate."""
    schedule = make_schedule(name, p, m, v)
    return schedule, simulate(schedule, costs)


# --- every generator passes the checker, at the extremes too ------------------------------

@pytest.mark.parametrize("name, v", [(n, 2 if n == "interleaved" else None) for n in SCHEDULES])
def test_largest_schedules_check_and_simulate_fast(name: str, v: int | None) -> None:
    schedule = make_schedule(name, 64, 256, v)
    start = time.perf_counter()
    result = simulate(schedule)  # with check_schedule's checks
    assert time.perf_counter() - start < 5  # about 0.5 s on a 2-core machine for 2*10^5 actions
    assert len(set(result.busy)) == 1 and result.makespan > result.busy[0]


@pytest.mark.parametrize("name", SCHEDULES)
def test_smallest_schedules_check(name: str) -> None:
    p = 2
    for m in range(min_microbatches(name, p), min_microbatches(name, p) + 5):
        if (name == "dualpipe" and m % 2) or (name == "interleaved" and m % p):
            continue
        check_schedule(make_schedule(name, p, m, 2 if name == "interleaved" else None))


# --- published bubble formulas ---------------------------------------------------------------

@FAST
@given(shape=shapes("gpipe"), f=st.integers(1, 4), b=st.integers(1, 4))
def test_gpipe_bubble_and_memory(shape, f: int, b: int) -> None:
    """GPipe: bubble (p-1)(F+B) per rank, fraction (p-1)/(m+p-1), any F and B; every rank holds m."""
    p, m, _ = shape
    _, r = run("gpipe", p, m, F=f, B=b)
    assert set(r.idle) == {(p - 1) * (f + b)}
    assert math.isclose(r.bubble_fraction, (p - 1) / (m + p - 1), abs_tol=1e-12)
    assert r.peak_live == (m,) * p


@FAST
@given(shape=shapes("1f1b"), f=st.integers(1, 4), b=st.integers(1, 4))
def test_1f1b_bubble_and_memory(shape, f: int, b: int) -> None:
    """1F1B: the same bubble as GPipe for any F, B and m (also m < p); rank r holds min(p-r, m)."""
    p, m, _ = shape
    _, r = run("1f1b", p, m, F=f, B=b)
    assert set(r.idle) == {(p - 1) * (f + b)}
    assert math.isclose(r.bubble_fraction, (p - 1) / (m + p - 1), abs_tol=1e-12)
    assert r.peak_live == tuple(min(p - rank, m) for rank in range(p))


@FAST
@given(shape=shapes("interleaved"), f=st.integers(1, 4), b=st.integers(1, 4))
def test_interleaved_bubble_and_memory(shape, f: int, b: int) -> None:
    """Megatron interleaved 1F1B, v chunks per rank each costing F, B (so a rank's layers cost vF, vB):
    bubble (p-1)(F+B) per rank = (p-1)(F_rank+B_rank)/v, fraction (p-1)/(v*m+p-1), for any F, B
    and any m that is a multiple of p (m = p included). Rank r holds Megatron's warm-up count
    (p-r-1)*2 + (v-1)*p, plus one, chunk activations (at most m*v)."""
    p, m, v = shape
    _, r = run("interleaved", p, m, v, F=f, B=b)
    assert set(r.idle) == {(p - 1) * (f + b)}
    assert math.isclose(r.bubble_fraction, (p - 1) / (v * m + p - 1), abs_tol=1e-12)
    assert r.peak_live == tuple(min((p - rank - 1) * 2 + (v - 1) * p + 1, m * v) for rank in range(p))


@FAST
@given(shape=shapes("zb-h1", m_at_least_p=True), f=st.integers(1, 4), i=st.integers(1, 4), w=st.integers(1, 4))
def test_zb_h1_bubble_and_memory(shape, f: int, i: int, w: int) -> None:
    """ZB-H1 (Qi et al. 2023): bubble (p-1)(F+I-W) per rank (the paper's (p-1)(T_F+T_B-T_W), B
    there being our I) when m >= p and W <= min(F, I); the paper's case is F = I = W. With a
    larger W the bubble is (p-1)max(F, I). 1F1B with B = I+W has (p-1)(F+I+W). The peak of live
    activations is 1F1B's, min(p, m): every rank holds up to p."""
    p, m, _ = shape
    _, r = run("zb-h1", p, m, F=f, I=i, W=w)
    assert set(r.idle) == {(p - 1) * (f + i - min(w, f, i))}
    if w <= min(f, i):
        assert set(r.idle) == {(p - 1) * (f + i - w)}
    _, one_f_one_b = run("1f1b", p, m, F=f, B=i + w)
    assert set(one_f_one_b.idle) == {(p - 1) * (f + i + w)}
    assert max(r.peak_live) == max(one_f_one_b.peak_live) == min(p, m)


@pytest.mark.parametrize("p", [2, 4, 8, 16])
def test_zb_h1_is_a_third_of_1f1b_with_equal_costs(p: int) -> None:
    """The paper's headline: with F = I = W, ZB-H1's bubble is one third of 1F1B's."""
    _, zb = run("zb-h1", p, 4 * p, F=1, I=1, W=1)
    _, base = run("1f1b", p, 4 * p, F=1, B=2)
    assert 3 * zb.idle[0] == base.idle[0] == 3 * (p - 1)


@FAST
@given(shape=shapes("dualpipev"), x=st.integers(1, 4), w=st.integers(0, 4))
def test_dualpipev_bubble_and_memory(shape, x: int, w: int) -> None:
    """DualPipeV = DualPipe folded onto p ranks (P = p): DeepSeek's (P-1)(F&B+B-3W) per rank.

    Costs: per chunk (half a rank's layers) F = I = x, W = w <= x, B = I + W; our ranks
    run an F&B pair one after the other, so F&B = F + B. The formula is exact for F = I
    and W <= F; with F < I DeepSeek's un-overlapped pair at the V's tip makes the bubble
    a little smaller, with F > I it is (P-1)(F-I) larger. Each rank holds 2p+1 chunk
    activations (DualPipe's PP+1 at twice the ranks, each half the size)."""
    p, m, _ = shape
    w = min(w, x)
    _, r = run("dualpipev", p, m, F=x, I=x, W=w, B=x + w)
    f_and_b, b = x + (x + w), x + w
    assert set(r.idle) == {(p - 1) * (f_and_b + b - 3 * w)}
    assert r.peak_live == (2 * p + 1,) * p


@FAST
@given(shape=shapes("dualpipe"), x=st.integers(1, 4), w=st.integers(0, 4))
def test_dualpipe_bubble_and_memory(shape, x: int, w: int) -> None:
    """DualPipe on p ranks (even), m microbatches half each way: (p/2-1)(F&B+B-3W) per rank
    under the same costs and conditions as DualPipeV (F = I >= W, F&B = F + B); each rank
    holds PP+1 = p+1 chunk activations, as in DeepSeek's table."""
    p, m, _ = shape
    w = min(w, x)
    _, r = run("dualpipe", p, m, F=x, I=x, W=w, B=x + w)
    f_and_b, b = x + (x + w), x + w
    assert set(r.idle) == {(p // 2 - 1) * (f_and_b + b - 3 * w)}
    assert r.peak_live == (p + 1,) * p


# --- the checker rejects broken schedules ------------------------------------------------

def edit(schedule: Schedule, rank: int, tokens: str) -> Schedule:
    """`schedule` with rank `rank`'s actions replaced by `tokens`."""
    ranks = list(schedule.ranks)
    ranks[rank] = tuple(Action.parse(t) for t in tokens.split())
    return replace(schedule, ranks=tuple(ranks))


def tokens(schedule: Schedule, rank: int) -> list[str]:
    return [str(a) for a in schedule.ranks[rank]]


def test_hand_written_two_rank_schedule_is_accepted() -> None:
    base = make_schedule("1f1b", 2, 1)
    assert tokens(base, 0) == ["F0.0", "SF0.0>1", "RB0.1<1", "B0.0"]
    assert tokens(base, 1) == ["RF0.0<0", "F0.1", "B0.1", "SB0.1>0"]


def test_rejects_backward_before_its_forward() -> None:
    s = make_schedule("1f1b", 2, 2)
    t = tokens(s, 1)  # RF0.0<0 F0.1 B0.1 SB0.1>0 RF1.0<0 F1.1 B1.1 SB1.1>0
    assert t[5:7] == ["F1.1", "B1.1"]
    t[5:7] = ["B1.1", "F1.1"]
    with pytest.raises(ScheduleError, match=r"rank 1 action 5 \(B1.1\): needs F1.1 before it on rank 1, but it "
                                            r"comes later, at action 6"):
        check_schedule(edit(s, 1, " ".join(t)))


def test_rejects_missing_backward() -> None:
    s = make_schedule("gpipe", 2, 3)
    t = [x for x in tokens(s, 0) if x != "B2.0" and x != "RB2.1<1"]
    s = edit(s, 0, " ".join(t))
    with pytest.raises(ScheduleError, match=r"do not pair up in order on the gradient channel rank 1 -> rank 0, "
                                            r"transfer #2: rank 1 sends SB2.1>0 \(action 11\) but rank 0 receives "
                                            r"nothing more"):
        check_schedule(s)
    s = edit(s, 1, " ".join(x for x in tokens(s, 1) if x != "SB2.1>0"))
    with pytest.raises(ScheduleError, match=r"microbatch 2 chunk 0 has no single backward .*B x0, I x0, W x0"):
        check_schedule(s)


def test_rejects_duplicated_forward() -> None:
    s = make_schedule("1f1b", 2, 2)
    t = tokens(s, 0)
    t.insert(t.index("F1.0") + 1, "F1.0")
    with pytest.raises(ScheduleError, match=r"rank 0 action \d+ \(F1.0\): repeats action \d+ \(F1.0\)"):
        check_schedule(edit(s, 0, " ".join(t)))


def test_rejects_b_and_i_for_one_microbatch() -> None:
    s = make_schedule("zb-h1", 2, 2)
    t = tokens(s, 1)
    t.insert(t.index("I0.1") + 1, "B0.1")
    with pytest.raises(ScheduleError, match=r"\(B0.1\): repeats action \d+ \(I0.1\)"):
        check_schedule(edit(s, 1, " ".join(t)))


def test_rejects_unmatched_and_misordered_sends() -> None:
    s = make_schedule("gpipe", 2, 2)
    unmatched = edit(s, 1, " ".join(x for x in tokens(s, 1) if x != "RF1.0<0"))
    with pytest.raises(ScheduleError, match=r"activation channel rank 0 -> rank 1, transfer #1: rank 0 sends SF1.0>1 "
                                            r"\(action 3\) but rank 1 receives nothing more"):
        check_schedule(unmatched)
    # rank 1 receives microbatch 1 first, but rank 0 sends microbatch 0 first
    misordered = edit(s, 1, "RF1.0<0 RF0.0<0 F0.1 F1.1 B0.1 SB0.1>0 B1.1 SB1.1>0")
    with pytest.raises(ScheduleError, match=r"transfer #0: rank 0 sends SF0.0>1 \(action 1\) but rank 1 receives "
                                            r"RF1.0<0 \(action 0\)"):
        check_schedule(misordered)


def test_rejects_wrong_peer_and_foreign_chunk() -> None:
    s = make_schedule("1f1b", 3, 1)
    with pytest.raises(ScheduleError, match=r"chunk 0 to chunk 1 is a transfer from rank 0 to rank 1"):
        check_schedule(edit(s, 0, "F0.0 SF0.0>2 RB0.1<1 B0.0"))
    with pytest.raises(ScheduleError, match=r"\(F0.1\): chunk 1 is on rank 1"):
        check_schedule(edit(s, 0, "F0.0 F0.1 SF0.0>1 RB0.1<1 B0.0"))


def test_rejects_deadlock_of_two_ranks_receiving_first() -> None:
    s = make_schedule("1f1b", 2, 1)
    stuck = edit(s, 0, "RB0.1<1 F0.0 SF0.0>1 B0.0")  # waits for rank 1's gradient before sending it input
    with pytest.raises(DeadlockError, match=r"rank 0 at action 0 \(RB0.1<1\) waits for rank 1's action 3 \(SB0.1>0\)"
                                            r".*rank 1 at action 0 \(RF0.0<0\) waits for rank 0's action 2"):
        check_schedule(stuck)
    assert issubclass(DeadlockError, ScheduleError) and issubclass(ScheduleError, PlanError)


# --- bad input to the generators --------------------------------------------------------

@pytest.mark.parametrize("args, message", [
    (("dualpipev", 4, 7), r"dualpipev with p=4 needs at least 8 microbatches, got m=7"),
    (("dualpipe", 4, 6), r"dualpipe with p=4 needs at least 8 microbatches, got m=6"),
    (("dualpipe", 3, 12), r"dualpipe needs an even number of pp ranks, got p=3"),
    (("dualpipe", 4, 9), r"m=9 is odd"),
    (("dualpipev", 1, 4), r"dualpipev needs at least 2 pp ranks, got p=1"),
    (("pipedream", 4, 8), r"unknown pipeline schedule 'pipedream'"),
    (("interleaved", 4, 8, 1), r"interleaved needs v >= 2 chunks per rank, got v=1"),
    (("interleaved", 4, 8), r"interleaved needs v >= 2 chunks per rank, got v=None"),
    (("interleaved", 4, 6, 2), r"m=6 is not a multiple of p=4"),
    (("interleaved", 1, 4, 2), r"interleaved needs at least 2 pp ranks, got p=1"),
    (("1f1b", 4, 8, 2), r"1f1b runs 1 chunk\(s\) per rank, not v=2"),
    (("gpipe", 0, 8), r"p=0 must be a positive integer"),
    (("zb-h1", 4, 0), r"m=0 must be a positive integer"),
])
def test_generator_errors_quote_the_numbers(args, message: str) -> None:
    with pytest.raises(ScheduleError, match=message) as info:
        make_schedule(*args)
    assert info.value.hint


def test_error_hints_give_the_fix() -> None:
    with pytest.raises(ScheduleError) as info:
        make_schedule("pipedream", 4, 8)
    assert info.value.hint == "choose one of " + ", ".join(SCHEDULES)
    with pytest.raises(ScheduleError) as info:
        make_schedule("interleaved", 4, 10, 2)
    assert info.value.hint == "use m=8 or m=12"
    with pytest.raises(ScheduleError) as info:
        make_schedule("dualpipe", 5, 20)
    assert info.value.hint.startswith("use p=4 or p=6")


# --- plain data -------------------------------------------------------------------------

@pytest.mark.parametrize("name", SCHEDULES)
def test_json_and_text_round_trip(name: str) -> None:
    s = make_schedule(name, 4, 8, 2 if name == "interleaved" else None)
    assert Schedule.from_dict(json.loads(json.dumps(s.to_dict()))) == s
    lines = s.to_text().splitlines()
    assert len(lines) == s.p + 1 and lines[1].startswith("rank 0: ")
    assert [Action.parse(t) for t in lines[1].split()[2:]] == list(s.ranks[0])


def test_placements() -> None:
    assert make_schedule("1f1b", 4, 4).placement == (0, 1, 2, 3)
    assert make_schedule("interleaved", 4, 4, 2).placement == (0, 1, 2, 3, 0, 1, 2, 3)
    assert make_schedule("dualpipev", 4, 8).placement == (0, 1, 2, 3, 3, 2, 1, 0)
    dual = make_schedule("dualpipe", 4, 8)
    assert dual.placement == (0, 1, 2, 3, 3, 2, 1, 0) and dual.pipelines == 2
    assert dual.chunk_range(3) == range(0, 4) and dual.chunk_range(4) == range(4, 8)


def test_bad_tokens_dicts_and_costs() -> None:
    for bad in ("X1.0", "F1", "SF1.0", "F1.0>2", "RF1.0>2"):
        with pytest.raises(ScheduleError, match="cannot read the action"):
            Action.parse(bad)
    with pytest.raises(ScheduleError, match="cannot read a schedule"):
        Schedule.from_dict({"name": "x"})
    s = make_schedule("1f1b", 2, 2)
    with pytest.raises(ScheduleError, match="unknown action kind 'X' in costs"):
        simulate(s, {"X": 1})
    with pytest.raises(ScheduleError, match="cost of F is -1"):
        simulate(s, {"F": -1})


def test_transfer_costs_delay_the_receiver() -> None:
    """A send costs its sender time, a receive its receiver; both add to the makespan."""
    s = make_schedule("1f1b", 2, 1)  # F0.0 SF0.0>1 RB0.1<1 B0.0 | RF0.0<0 F0.1 B0.1 SB0.1>0
    r = simulate(s, {"F": 1, "B": 2, "SF": 1, "RF": 1, "SB": 1, "RB": 1})
    assert r.start[1] == (1 + 1, 3, 4, 6) and r.end[0] == (1, 2, 8, 10)
    assert r.makespan == 10 and r.busy == (5, 5)


# --- the picture ------------------------------------------------------------------------

def test_draws_png_and_svg(tmp_path) -> None:
    s = make_schedule("zb-h1", 3, 4)
    png, svg = tmp_path / "zb.png", tmp_path / "zb.svg"
    result = draw_schedule(s, png, {"F": 1, "I": 1, "W": 1})
    draw_schedule(s, svg, {"F": 1, "I": 1, "W": 1})
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 1000
    text = svg.read_text()
    assert f"zb-h1: p=3 m=4 v=1  bubble {result.bubble_fraction:.1%}" in text
    assert "I input grad" in text and "idle" in text
    with pytest.raises(ScheduleError, match="name a .png or .svg file"):
        draw_schedule(s, tmp_path / "zb.pdf")


# ---- activations in flight: the memory estimate plays the schedule -------------------------------
def _spec(name: str, p: int, m: int, v: int | None = None):
    from fivedc.passes.stages import Chunk, PipelineSpec

    sched = make_schedule(name, p, m, v)
    chunks = tuple(Chunk(c, sched.placement[c], (c, c + 1), f"c{c}", 1.0, 0) for c in range(p * sched.v))
    return PipelineSpec(name, m, sched.v, chunks)


@pytest.mark.parametrize("p,m", [(2, 4), (4, 8), (4, 4), (3, 9)])
def test_activations_in_flight_follow_each_schedule(p: int, m: int) -> None:
    """With equal chunks, one microbatch through one chunk keeps A / (chunks x m) of the
    step's activations A; each schedule keeps its published count of them alive."""

    step = 2**20 * p * m * 6  # divisible, so the counts come out exact
    per = lambda chunks: step // (chunks * m)  # noqa: E731

    def activations_in_flight(spec, p, step):
        from fivedc.passes.stage_plan import activations_in_flight as played

        return played(spec, p, [per(len(spec.chunks))] * len(spec.chunks))
    assert activations_in_flight(_spec("gpipe", p, m), p, step) == (per(p) * m,) * p  # all m, every rank
    assert activations_in_flight(_spec("1f1b", p, m), p, step) == tuple(per(p) * min(p - r, m) for r in range(p))
    zb = activations_in_flight(_spec("zb-h1", p, m), p, step)  # kept until W: ZB-H1's peak is 1F1B's (its paper)
    assert zb == tuple(per(p) * count for count in simulate(make_schedule("zb-h1", p, m)).peak_live)
    assert max(zb) == per(p) * min(p, m)
    v = 2
    if m % p == 0:  # interleaved (Megatron): (p - r - 1) * 2 + (v - 1) * p + 1 chunk-microbatches on rank r
        got = activations_in_flight(_spec("interleaved", p, m, v), p, step)
        assert got == tuple(per(p * v) * min((p - r - 1) * 2 + (v - 1) * p + 1, m * v) for r in range(p))
    if m >= 2 * p:  # DualPipeV: 2p + 1 chunk-microbatches on every rank (the test above of peak_live)
        got = activations_in_flight(_spec("dualpipev", p, m), p, step)
        assert got == tuple(per(2 * p) * count for count in simulate(make_schedule("dualpipev", p, m)).peak_live)
    gpipe, one_f = (max(activations_in_flight(_spec(s, p, m), p, step)) for s in ("gpipe", "1f1b"))
    assert gpipe > one_f or m <= p  # GPipe is no longer counted like 1F1B
