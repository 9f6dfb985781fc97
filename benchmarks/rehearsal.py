"""The memory estimate against the rehearsal: every class of ranks of each plan, estimated / rehearsed.

`fivedc rehearse` runs one rank of each class of a plan's ranks (the runtime's own step,
on the meta device, in a fake process group of the plan's world) and counts every storage
from its allocation to its free. This table sets the plan's estimate of each class's total
against that rank's peak: 1.00 is exact, below 1 the estimate is short of what the rank
holds (it would not fit where the plan says it does), above 1 it is pessimistic.

Rows: the examples at small meshes covering every axis, schedule, ZeRO stage and
recomputation mode (tiny models: seconds each), and with --full the two published layouts
of issue 36, each at full scale (minutes each on 2 cores).

    python benchmarks/rehearsal.py [--full] [--write]   # --write: the table in RESULTS.md
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

from results_block import replace_block  # beside this script

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "RESULTS.md"
BEGIN, END = "<!-- rehearsal:begin -->", "<!-- rehearsal:end -->"

SMALL = (
    "examples/gpt.5d --mesh 2x1x2x1x1 --sp",
    "examples/gpt.5d --mesh 2x1x2x1x1 --sp --recompute selective",
    "examples/gpt.5d --mesh 1x1x2x1x1 --recompute full",
    "examples/gpt.5d --mesh 4x1x1x1x1 --zero 1",
    "examples/gpt.5d --mesh 4x1x1x1x1 --zero 2",
    "examples/gpt.5d --mesh 4x1x1x1x1 --zero 3",
    "examples/gpt.5d --mesh 2x1x1x2x1",
    "examples/gpt.5d --mesh 1x2x1x1x1 --microbatches 4 --schedule 1f1b",
    "examples/gpt.5d --mesh 1x2x1x1x1 --microbatches 4 --schedule gpipe",
    "examples/gpt.5d --mesh 1x2x1x1x1 --microbatches 4 --schedule interleaved",
    "examples/gpt.5d --mesh 1x2x1x1x1 --microbatches 4 --schedule zb-h1",
    "examples/gpt.5d --mesh 1x2x1x1x1 --microbatches 4 --schedule dualpipev",
    "examples/gpt.5d --mesh 2x2x1x1x1 --microbatches 2 --schedule 1f1b --zero 1",
    "examples/gpt.5d --mesh 2x2x1x1x1 --microbatches 2 --schedule 1f1b --zero 2",
    "examples/gpt.5d --mesh 2x2x1x1x1 --microbatches 2 --schedule 1f1b --zero 3",
    "examples/tiny_llama.5d --mesh 2x1x2x1x1 --sp --zero 1",
    "examples/moe.5d --mesh 2x1x1x1x2",
    "examples/moe.5d --mesh 2x1x2x1x2 --sp --zero 2",
)
FULL = (  # issue 36's two published layouts
    "examples/llama3_405b.5d --mesh 128x16x8x1x1 --sp --zero 1 --recompute selective --schedule 1f1b "
    "--microbatches 16",
    "examples/deepseek_v3.5d --mesh 2x16x1x1x64 --schedule dualpipe --zero 1 --microbatches 120 "
    "--recompute full",
)


def rehearse(command: str):
    from fivedc.cli.main import build_parser
    from fivedc.cli.shared import compile_model
    from fivedc.runtime.rehearse import rehearse_plan

    args = build_parser().parse_args(["rehearse", *command.split()])
    plan = compile_model(args.model, args.mesh, args, dtype="bf16")
    return rehearse_plan(plan, workers=os.cpu_count() or 1 if len(plan.memory.ranks) >= 4 else 1)


def table(commands: tuple[str, ...]) -> list[str]:
    lines = ["| plan (`fivedc rehearse ...`) | ranks | estimate | rehearsed peak | est / peak | seconds |",
             "|---|---|---:|---:|---:|---:|"]
    for command in commands:
        start = time.perf_counter()
        rehearsal = rehearse(command)
        seconds = time.perf_counter() - start
        print(f"{command}: {seconds:.0f} s", file=sys.stderr)
        for c in rehearsal.classes:
            lines.append(f"| `{command}` | {c.ranks} | {_mib(c.estimated.total)} | {_mib(c.peak)} | "
                         f"{c.ratio:.3f} | {c.seconds:.1f} |")
    return lines


def _mib(n: int) -> str:
    return f"{n / 2**30:.2f} GiB" if n >= 2**30 else f"{n / 2**10:.1f} KiB"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--full", action="store_true", help="also the two published layouts at full scale")
    parser.add_argument("--write", action="store_true", help=f"replace the table in {RESULTS.name}")
    args = parser.parse_args()
    commands = SMALL + (FULL if args.full else ())
    text = "\n".join(table(commands))
    print(text)
    if args.write:
        replace_block(RESULTS, BEGIN, END, text)


if __name__ == "__main__":
    main()
