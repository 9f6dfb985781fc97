"""The deterministic figures of the README and benchmarks/RESULTS.md, computed again: drift fails.

Each check names a figure where a document prints it (a file and a pattern around it), the
`fivedc compile` command beside it, and how that figure follows from the command's plan (the
compiler's estimates: memory per rank, step time, MFU; every pass but the agreement proof, which
does not change them). The figure is printed as the document prints it and compared as text, so
any change of the estimate shows. Timings are not here: they depend on the machine.

    python benchmarks/check_results.py            # exit 0: every figure holds; 1: drift (listed)
    python benchmarks/check_results.py --write    # rewrite the drifted figures in place
    python benchmarks/check_results.py --only readme-recompute --root DIR   # DIR: a copy of the repo

A figure that cannot be found where its check looks (the sentence was rewritten) is an error
(exit 2) naming the file and the pattern: update the check with the document.
"""

from __future__ import annotations

import argparse
import re
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

ROOT = Path(__file__).resolve().parent.parent
GiB = 2**30
LLAMA = "compile examples/llama3_405b.5d --mesh 128x16x8x1x1 --sp"
LLAMA_ZERO1 = f"{LLAMA} --zero 1 --recompute selective --gpu h100"
DEEPSEEK = ("compile examples/deepseek_v3.5d --mesh 2x16x1x1x64 --schedule dualpipe --zero 1 --microbatches 120 "
            "--recompute full --gpu h800")


def plan_of(command: str):
    """The plan `fivedc COMMAND` compiles (its own parser and option builder), at the plan level."""
    import shlex

    from fivedc.cli.main import build_parser
    from fivedc.cli.shared import compile_options, load_graph
    from fivedc.ir.mesh import Mesh
    from fivedc.pipeline import PIPELINE, run_passes
    from fivedc.plan.planning import Draft, assemble

    args = build_parser().parse_args(shlex.split(command))
    options = compile_options(args, Mesh.parse(args.mesh, rank_order=args.rank_order), dtype=args.dtype)
    return assemble(run_passes(Draft(load_graph(str(ROOT / args.model))), options, PIPELINE[:-1]), options)


def step_and_mfu(command: str) -> str:
    t = plan_of(command).time
    return f"{t.step_seconds:.3g} s, {t.mfu * 100:.1f} %"


def total_gib(command: str) -> str:
    return f"{plan_of(command).memory.total / GiB:.1f}"


@dataclass(frozen=True, slots=True)
class Check:
    name: str
    file: str  # relative to the repository
    pattern: str  # a regular expression whose one group is the figure
    compute: Callable[[], str]  # the figure, printed as the document prints it
    command: str  # what gives it


def row_checks(name: str, row: str, command: str) -> tuple[Check, Check]:
    """The total memory (7th cell after the label) and the step and MFU (9th) of a row of
    RESULTS.md's acceptance table, each computed again from `command`."""
    label = r"\| " + re.escape(row) + r" \|"
    return (Check(f"{name}-total", "benchmarks/RESULTS.md", label + r"(?:[^|]*\|){6} ([\d.]+) GiB \|",
                  lambda: total_gib(command), f"fivedc {command}"),
            Check(f"{name}-step", "benchmarks/RESULTS.md", label + r"(?:[^|]*\|){8} ([^|]+) \|",
                  lambda: step_and_mfu(command), f"fivedc {command}"))


CHECKS = (
    Check("readme-recompute", "README.md", r"--recompute full -o l\.json +# activations per rank ([\d.]+ -> [\d.]+) GiB",
          lambda: " -> ".join(f"{plan_of(c).memory.activations / GiB:.1f}" for c in (LLAMA, f"{LLAMA} --recompute full")),
          f"fivedc {LLAMA} [--recompute full]"),
    Check("readme-llama3-fits", "README.md", r"# Llama 3's layout: fits, ([\d.]+) GiB", lambda: total_gib(LLAMA_ZERO1),
          f"fivedc {LLAMA_ZERO1}"),
    *row_checks("results-llama3", "Llama 3 405B, TP8 PP16 DP128 (1F1B, m = 16), SP, ZeRO-1, selective, H100",
                LLAMA_ZERO1),
    *row_checks("results-deepseek", "DeepSeek-V3, PP16 DualPipe EP64 DP2 (m = 120), ZeRO-1, full, H800", DEEPSEEK),
)


class CheckError(Exception):
    """A check that cannot find its figure (exit 2)."""


def located(check: Check, root: Path) -> tuple[str, re.Match]:
    path = root / check.file
    if not path.is_file():
        raise CheckError(f"{check.name}: {path} does not exist (--root must be the repository)")
    text = path.read_text()
    found = list(re.finditer(check.pattern, text))
    if len(found) != 1:
        raise CheckError(f"{check.name}: {check.file} has {len(found)} matches of {check.pattern!r}, not one: "
                         "update the check with the document")
    return text, found[0]


def run(checks, root: Path, *, write: bool = False) -> int:
    """0 when every figure holds; 1 when some drifted (rewritten in place with `write`)."""
    drifted = 0
    for check in checks:
        text, match = located(check, root)
        claimed, actual = match.group(1).strip(), check.compute()
        ok = claimed == actual
        drifted += not ok
        print(f"{'ok   ' if ok else 'DRIFT'} {check.name:24} {check.file}: {claimed!r}"
              + ("" if ok else f", now {actual!r} ({check.command})"))
        if write and not ok:
            start, end = match.span(1)
            (root / check.file).write_text(text[:start] + match.group(1).replace(claimed, actual) + text[end:])
    return 1 if drifted and not write else 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--write", action="store_true", help="rewrite the drifted figures in place")
    parser.add_argument("--only", action="append", choices=[c.name for c in CHECKS], help="these checks only")
    parser.add_argument("--root", type=Path, default=ROOT, help="the repository whose documents are checked")
    args = parser.parse_args(argv)
    checks = [c for c in CHECKS if not args.only or c.name in args.only]
    try:
        return run(checks, args.root, write=args.write)
    except CheckError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
