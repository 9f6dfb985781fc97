"""`fivedc search MODEL --gpus N --gpu NAME`: the command line of the layout search (fivedc/search/search.py).

Prints the top `--top` layouts (mesh, options, memory of the busiest rank, bubble,
step time, tokens/s, MFU, communication share) and the `fivedc compile` flags of
the best, the model's error on published runs and the layouts within it of the best (ties,
every one scored); `-o` writes the best plan (compiled for real, with its agreement proof),
`--json` every ranked candidate, best first, and `--explain` the rejected candidates
counted by reason. `--compare MESH [layout flags]` puts the user's layout beside the best
(`search_compare.py`), with `--explain` term by term. A rich progress bar runs on stderr while the meshes are sharded and the
layouts scored. Without `--json` the search scores only what can still be among the `--top`
best (fivedc/search/best_first.py); with it, every layout. `--fp8` scores every layout, and
the `--compare` one, with float8 linears (`fivedc compile --fp8`); the title, the best's flags,
`--json`'s options and the plan written say so.
"""

from __future__ import annotations

import dataclasses
import json
import sys
import time

from fivedc.cli.screen import command_line, say
from fivedc.cli.search_compare import compare_args, compared_layout, print_compared, print_explained


def search_args(p) -> None:
    p.add_argument("model", help="a .5d model file, or path/to/file.py:factory")
    p.add_argument("--gpus", type=int, required=True, help="GPUs in the cluster (the mesh's world size)")
    p.add_argument("--gpu", required=True, metavar="NAME", help="the GPU (h100, h800, a100, h200, tpu-v4, or from --hardware)")
    p.add_argument("--hardware", action="append", default=[], metavar="FILE", help="a TOML file of GPU profiles")
    p.add_argument("--gpus-per-node", type=int, default=None, help="GPUs per node (default: the profile's)")
    p.add_argument("--global-batch", type=int, default=None, metavar="B", help="sequences per step (default: the model's)")
    p.add_argument("--seq", type=int, default=None, metavar="S", help="tokens per sequence (default: the model's)")
    p.add_argument("--dtype", default="bf16", help="training precision (default bf16)")
    p.add_argument("--fp8", action="store_true",
                   help="every layout with float8 linears, as fivedc compile --fp8 (torchao's tensorwise recipe; "
                   "the precision is not searched); the GPU needs float8 tensor cores (h100, h800, h200)")
    p.add_argument("--top", type=int, default=5, metavar="K", help="layouts printed (default 5)")
    p.add_argument("-o", "--output", default=None, help="write the best plan here")
    p.add_argument("--json", default=None, metavar="ALL.json", help="write every ranked candidate, best first")
    p.add_argument("--explain", action="store_true", help="count the rejected candidates by reason; with --compare, both steps term by term")
    p.add_argument("--wide", action="store_true", help="print for a terminal of 140+ columns (default: at most 100)")
    compare_args(p)


def run_search(args, console) -> int:
    from fivedc.cli.shared import load_graph, with_shape
    from fivedc.estimates.model_error import STEP_TIME
    from fivedc.files import write_output
    from fivedc.outputs import Output, check_outputs
    from fivedc.frontends.python_file import parse_spec
    from fivedc.ir.hardware import hardware
    from fivedc.search.search import SearchError, check_fp8, search

    if args.top < 1:
        raise SearchError(f"--top {args.top} must be at least 1", hint="e.g. --top 5")
    model_file = parse_spec(args.model)[0]
    check_outputs([Output("-o", args.output) if args.output is not None else None,
                   Output("--json", args.json, "search results") if args.json is not None else None],
                  inputs=(model_file,))  # two outputs: never one file
    hw = hardware(args.gpu, tuple(args.hardware))
    if args.gpus_per_node is not None:
        if args.gpus_per_node < 1:
            raise SearchError(f"--gpus-per-node {args.gpus_per_node} must be at least 1", hint="e.g. --gpus-per-node 8")
        hw = dataclasses.replace(hw, gpus_per_node=args.gpus_per_node)
    graph = with_shape(load_graph(args.model), batch=args.global_batch, seq=args.seq)
    if args.fp8:  # compile's refusals, before the compared layout (which has --fp8 too) meets them
        check_fp8(graph, hw, args.dtype)
    compared = compared_layout(args, graph, hw, gpus=args.gpus, dtype=args.dtype)
    every_tie = args.explain or compared is not None  # scoring every tie doubles the largest searches' time
    start = time.perf_counter()
    with _Progress() as progress:  # --json lists every layout that fits; else the --top best (and their ties)
        result = search(graph, gpus=args.gpus, hardware=hw, dtype=args.dtype, progress=progress,
                        compile_best=args.output is not None or (args.explain and compared is not None),
                        keep=None if args.json is not None else args.top, band=STEP_TIME.spread if every_tie else 0.0,
                        floor=compared.step if compared is not None else 0.0, fp8=args.fp8)
    seconds = time.perf_counter() - start
    _print_top(result, args.top, console, graph, args.gpus, hw, seconds, every_tie or args.json is not None)
    if compared is not None:
        print_compared(result, compared, hw)
    if args.explain:
        _print_rejected(result, console)
        if compared is not None:
            print_explained(result, compared, console)
    if args.json is not None:
        text = json.dumps({"candidates": [s.as_json() for s in result.ranked]}, indent=1) + "\n"
        write_output(args.json, text, inputs=(model_file,), what="search results")
        print(f"wrote {args.json} ({len(result.ranked)} candidates)")
    if args.output is not None:
        result.plan.save(args.output, inputs=(model_file,))
        say(f"wrote {args.output}: the best plan, compiled ({result.proof})")
    return 0


class _Progress:
    """A rich progress bar on stderr over the meshes scored."""

    def __enter__(self):
        from rich.console import Console
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

        self._bar = Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                             console=Console(file=sys.stderr), transient=True)
        self._bar.__enter__()
        return self

    def start(self, total: int, what: str) -> None:
        self._task = self._bar.add_task(what, total=total)

    def advance(self, n: int = 1) -> None:
        self._bar.advance(self._task, n)

    def __exit__(self, *exc) -> None:
        self._bar.__exit__(*exc)


def _print_top(result, top: int, console, graph, gpus: int, hw, seconds: float, every_tie: bool) -> None:
    from rich.table import Table

    from fivedc.plan.summary import format_bytes

    precision = " with float8 linears (--fp8)" if result.best.candidate.fp8 else ""
    table = Table(title=f"best layouts of {graph.name} on {gpus} x {hw.name}{precision}", title_justify="left")
    for name in ("#", "mesh", "options", "memory", "bubble", "step", "tokens/s", "MFU", "comm"):
        table.add_column(name, justify="left" if name in ("mesh", "options") else "right")
    for rank, s in enumerate(result.ranked[:top], start=1):
        t = s.time
        table.add_row(str(rank), str(s.candidate.mesh), s.candidate.short(), format_bytes(s.memory.total),
                      f"{t.bubble:.1%}", f"{t.step_seconds:.3g} s", f"{t.tokens_per_second:,.0f}", f"{t.mfu:.1%}",
                      f"{s.comm_share:.0%}")
    console.print(table)
    _print_ties(result, top, every_tie)
    rejected = sum(result.rejected.values())
    say(f"{len(result.ranked)} layouts ranked, {rejected} rejected, over {result.meshes} meshes in {seconds:.1f} s")
    print(command_line(f"best: fivedc compile {graph.source or graph.name} {result.best.candidate.flags()} "
                       f"--gpu {hw.key}"))


def _print_ties(result, top: int, every_tie: bool) -> None:
    """The model's error on published runs, and the layouts it cannot tell from the best: all
    of them when the search scored every tie (`every_tie`), else those it scored on its way."""
    from fivedc.estimates.model_error import STEP_TIME

    best = result.ranked[0].time.step_seconds
    ties = sum(s.time.step_seconds <= best * (1 + STEP_TIME.spread) for s in result.ranked)
    say(STEP_TIME.line())
    if ties > 1:
        shown = f"#1-#{ties}" if ties <= top else f"#1-#{ties} ({ties - top} not shown)"
        counted = "" if every_tie else " (at least: --explain scores every tie)"
        say(f"layouts {shown} are within {STEP_TIME.spread:.0%} of the best{counted}: a tie by this model's error")


def _print_rejected(result, console) -> None:
    print("rejected, by reason:")
    for reason, count in sorted(result.rejected.items(), key=lambda item: (-item[1], item[0])):
        say(f"  {count:>8}  {reason}", indent=" " * 12)
