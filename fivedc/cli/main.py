"""The `fivedc` command: compile, show, verify, run, train, export, diff and check; errors, no tracebacks.

This file dispatches the command line `arguments.py` parses; what the commands share is in
`shared.py`, and the two that start processes are `verify.py` and
`run.py`. Every command turns a `FivedcError` into its rendered message
(file:line:col, the line and a caret, a hint) on stderr, wrapped to the output's width
(`fivedc.errors.fit`: 100 columns at most, a path never broken), and the error's exit code
(`fivedc.errors.EXIT_CODES`: 1 a mismatch, 2 bad input, 3 a rank failed, 4 a bug).
Nothing is written unless the command succeeds.
"""

from __future__ import annotations

import json
import os
import sys
import time
import traceback
from pathlib import Path

from fivedc.cli import screen
from fivedc.cli.arguments import build_parser
from fivedc.cli.shared import compile_model, load_graph
from fivedc.errors import FivedcError, fit


def cmd_compile(args) -> int:
    from fivedc.files import check_output
    from fivedc.frontends.python_file import parse_spec
    from fivedc.plan.summary import format_bytes, render_summary

    model_file = parse_spec(args.model)[0]  # file.py:factory -> file.py; a .5d path as it is
    output = args.output if args.output is not None else model_file.stem + ".plan.json"  # str: keeps a trailing /
    check_output(output, inputs=(model_file,))  # fail before the compile; save checks again
    start = time.perf_counter()
    proofs: list = []
    timings: list = []
    plan = compile_model(args.model, args.mesh, args, dtype=args.dtype, proofs=proofs, timings=timings)
    seconds = time.perf_counter() - start
    if plan.time is not None:  # a plan that does not fit its GPU is bad input: say what would fit
        from fivedc.cli.fit import check_fits
        from fivedc.cli.plan_check import options_of

        check_fits(plan, options_of(plan))
    plan.save(output, inputs=(model_file,))
    if args.quiet:
        step = f", {plan.time.step_seconds:.3g} s per step on {plan.time.hardware.key}" if plan.time else ""
        print(f"wrote {output} ({len(plan.collectives)} collectives, {format_bytes(plan.memory.total)} per rank{step})")
    else:
        console = screen.console(wide=args.wide, piped=80)  # the summary fits 80 columns when piped
        render_summary(plan, console=console, verbose=args.verbose, wide=args.wide)
        print("\n" + screen.wrap(str(proofs[0]), width=console.width))
        if args.passes:
            _print_passes(timings, console)
        print(f"wrote {output} in {seconds:.2f} s")
    return 0


def _print_passes(timings, console) -> None:
    """The compiler's passes in the order they ran (fivedc/pipeline.py), each with its time."""
    from rich.table import Table

    table = Table(title="passes (fivedc/pipeline.py)", title_justify="left", box=None)
    for column, justify in (("#", "right"), ("pass", "left"), ("ms", "right"), ("what it decides", "left")):
        table.add_column(column, justify=justify)
    for index, timing in enumerate(timings, 1):
        table.add_row(str(index), timing.name, f"{timing.seconds * 1e3:.1f}", timing.purpose)
    console.print(table)


def cmd_verify(args) -> int:
    from fivedc.cli.verify import run_verify

    return run_verify(args)


def cmd_run(args) -> int:
    from fivedc.cli.run import run_run

    return run_run(args, defaults=build_parser().parse_args(["run", args.model]))


def cmd_rehearse(args) -> int:
    from fivedc.cli.rehearse import run_rehearse

    return run_rehearse(args, defaults=build_parser().parse_args(["rehearse", args.model]))


def cmd_train(args) -> int:
    from fivedc.cli.train import run_train

    return run_train(args, defaults=build_parser().parse_args(["train", args.model, "--data", args.data]))


def cmd_export(args) -> int:
    from fivedc.runtime.export import run_export

    return run_export(args, say=screen.say)


def cmd_show(args) -> int:
    from fivedc.cli.plan_check import load_plan
    from fivedc.schedule import draw_schedule

    if not args.ops and not args.program and args.schedule is None:
        raise FivedcError("fivedc show needs --ops (list the ops), --program (a rank's instructions) or "
                          "--schedule OUT (draw the schedule)", hint=f"e.g. fivedc show {args.plan} --ops")
    if args.schedule is not None:  # the picture's target, before any work
        from fivedc.outputs import Output, check_outputs

        if Path(args.schedule).suffix not in (".png", ".svg"):
            raise FivedcError(f"cannot draw to {args.schedule}: the picture is .png or .svg")
        check_outputs([Output("--schedule", args.schedule, "picture")], inputs=(args.plan,))
    plan = load_plan(args.plan)
    if args.ops:
        from fivedc.plan.op_list import render_ops

        render_ops(plan, console=screen.console(wide=args.wide))
    if args.program:
        from fivedc.cli.show_program import render_program

        render_program(plan, args.rank, console=screen.console(wide=args.wide))
    if args.schedule is None:
        return 0
    if plan.pipeline is None:
        raise FivedcError(f"{args.plan} has no pipeline (pp = 1): nothing to draw",
                          hint="compile with pp > 1, e.g. --mesh 1x4x1x1x1 --schedule 1f1b")
    out = Path(args.schedule)
    from fivedc.files import write_output
    from fivedc.ir.mesh import MeshAxis

    schedule = plan.pipeline.build_schedule(plan.mesh.size(MeshAxis.PP))
    draw = lambda tmp: draw_schedule(schedule, tmp)  # noqa: E731
    result = write_output(args.schedule, draw, inputs=(args.plan,), what="picture")
    screen.say(f"wrote {out}: {plan.pipeline.schedule}, bubble {result.bubble_fraction:.1%} of the step (unit costs)")
    return 0


def _load_side(text: str, args):
    from fivedc.cli.plan_check import load_plan

    if "@" in text and not text.endswith(".json"):
        model, mesh = text.rsplit("@", 1)
        return compile_model(model, mesh, args, dtype="bf16", pipeline_flags_need_pp=False)
    return load_plan(text)


def cmd_diff(args) -> int:
    from fivedc.plan.diff import diff_plans
    from fivedc.plan.diff_report import render_diff

    result = diff_plans(_load_side(args.a, args), _load_side(args.b, args))
    if args.json:
        print(json.dumps(result.to_json(), indent=1))
    else:
        render_diff(result, console=screen.console(wide=args.wide))
    return 0


def cmd_search(args) -> int:
    from fivedc.cli.search import run_search

    return run_search(args, screen.console(wide=args.wide))


def cmd_check(args) -> int:
    from fivedc.cli.plan_check import load_plan

    from fivedc.proof.agreement import prove_agreement

    from fivedc.cli.model_source import check_source

    plan = load_plan(args.plan)
    model_line = check_source(plan, plan_name=args.plan, source=args.source)
    screen.say(f"{args.plan}: a valid plan for mesh {plan.mesh} ({plan.mesh.world} ranks, {plan.dtype}, "
               f"{len(plan.collectives)} collectives): exactly what this fivedc compiles from the model in the plan "
               "and its options", indent="")
    screen.say(model_line, indent="")
    screen.say(str(prove_agreement(plan)), indent="")
    if args.collectives:
        from fivedc.instructions.comm_program import class_programs

        for pp_rank, events in class_programs(plan).items():
            print(f"\npp rank {pp_rank}: {len(events)} collectives and transfers per step, in issue order")
            for index, event in enumerate(events, start=1):
                screen.say(f"  #{index} {event}", indent="      ")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--"]:  # `torchrun ... -m fivedc.cli.main -- train ... --log F`: the `--` keeps torchrun off our flags
        argv = argv[1:]
    args = parser.parse_args(argv)
    if args.command is None:
        parser.print_help()
        return 2
    handler = {"compile": cmd_compile, "verify": cmd_verify, "run": cmd_run, "train": cmd_train, "export": cmd_export,
               "show": cmd_show, "diff": cmd_diff, "check": cmd_check, "search": cmd_search,
               "rehearse": cmd_rehearse}[args.command]
    try:
        return handler(args)
    except FivedcError as error:  # wrapped to the output's width, a path or file:line:col never broken
        print(error.render(width=screen.columns()), file=sys.stderr)
        return error.exit_code
    except KeyboardInterrupt:
        print("fivedc: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 1
    except Exception as error:  # a bug in fivedc: one line, the traceback only when asked for
        if os.environ.get("FIVEDC_TRACEBACK"):
            traceback.print_exc()
        print(fit(f"error: internal error in fivedc ({type(error).__name__}: {error})\n"
                  "hint: this is a bug in fivedc; FIVEDC_TRACEBACK=1 shows the traceback to report",
                  screen.columns()), file=sys.stderr)
        return 4


if __name__ == "__main__":
    sys.exit(main())

__all__ = ["main", "build_parser", "load_graph"]  # load_graph: models as every command reads them
