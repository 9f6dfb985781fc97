"""Bubble and activation memory of every pipeline schedule, simulated, next to the published formula.

The same model and work per step for every schedule: one rank's layers cost F=1,
B=2 (I=1, W=1 when split) per microbatch. A schedule with v chunks per rank gives
each chunk 1/v of that (interleaved, DualPipeV); DualPipe's two chunks per rank are
one stage of each of its two model copies, at full cost, with half the
microbatches going each way. Transfers are free. "Peak live" counts the
(microbatch, chunk) forwards a rank holds at once (the most over ranks); "in stages"
scales it by the chunk's share of a rank's layers, comparable across schedules.

    python benchmarks/schedules.py [--p 16] [--m 64]
"""

from __future__ import annotations

import argparse
from fractions import Fraction

from fivedc.schedule import make_schedule, simulate

# (name, v, chunk share of a rank's layers)
ROWS = (("gpipe", None, 1), ("1f1b", None, 1), ("interleaved", 2, Fraction(1, 2)), ("interleaved", 4, Fraction(1, 4)),
        ("zb-h1", None, 1), ("dualpipev", None, Fraction(1, 2)), ("dualpipe", None, 1))


def formula(name: str, p: int, busy: float, share: Fraction) -> str:
    """The published bubble per rank, as a fraction of the makespan (F, B, I, W: per chunk; F&B = F + B)."""
    f, b, i, w = (float(share * x) for x in (1, 2, 1, 1))
    idle = {"gpipe": (p - 1) * (f + b), "1f1b": (p - 1) * (f + b), "interleaved": (p - 1) * (f + b),
            "zb-h1": (p - 1) * (f + i - w), "dualpipev": (p - 1) * ((f + b) + b - 3 * w),
            "dualpipe": (p // 2 - 1) * ((f + b) + b - 3 * w)}[name]
    text = {"gpipe": "(p-1)(F+B)", "1f1b": "(p-1)(F+B)", "interleaved": "(p-1)(F+B)", "zb-h1": "(p-1)(F+I-W)",
            "dualpipev": "(p-1)(F&B+B-3W)", "dualpipe": "(p/2-1)(F&B+B-3W)"}[name]
    return f"{idle / (busy + idle):.4f} = {text}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--p", type=int, default=16)
    parser.add_argument("--m", type=int, default=64)
    args = parser.parse_args()
    p, m = args.p, args.m
    print(f"p={p} m={m}; a rank's layers cost F=1 B=2 I=1 W=1, a chunk its share; transfers free; "
          f"formulas in per-chunk costs, F&B = F + B (run one after the other)\n")
    print("| schedule | v | costs per chunk (F, B, I, W) | makespan | bubble fraction | published formula | "
          "peak live (chunks) | peak live (stages) |")
    print("|---|---|---|---|---|---|---|---|")
    for name, v, share in ROWS:
        costs = {k: float(share * x) for k, x in (("F", 1), ("B", 2), ("I", 1), ("W", 1))}
        schedule = make_schedule(name, p, m, v)
        result = simulate(schedule, costs)
        peak = max(result.peak_live)
        print(f"| {name} | {schedule.v} | {', '.join(f'{c:g}' for c in costs.values())} | {result.makespan:g} | "
              f"{result.bubble_fraction:.4f} | {formula(name, p, result.busy[0], share)} | {peak} | "
              f"{float(peak * share):g} |")


if __name__ == "__main__":
    main()
