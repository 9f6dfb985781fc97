"""The `fivedc` command: compile, show, verify, run, train, export, diff and check; errors, no tracebacks.

This file parses the command line and dispatches; what the commands share is in
`shared.py`, and the two that start processes are `verify.py` and
`run.py`. Every command turns a `FivedcError` into its rendered message
(file:line:col, the line and a caret, a hint) on stderr, wrapped to the output's width
(`fivedc.errors.fit`: 100 columns at most, a path never broken), and the error's exit code
(`fivedc.errors.EXIT_CODES`: 1 a mismatch, 2 bad input, 3 a rank failed, 4 a bug).
Nothing is written unless the command succeeds.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import traceback
from pathlib import Path

from fivedc.cli import screen
from fivedc.cli.shared import compile_model, load_graph
from fivedc.errors import EXIT_CODES, FivedcError, fit
from fivedc.runtime import DEFAULT_TIMEOUT_S
from fivedc.schedule.kinds import schedules_help
from fivedc.cli.rehearse import rehearse_args
from fivedc.cli.train import train_args

COMMANDS = {
    "compile": "compile a model for a mesh: write the plan and print a readable summary",
    "show": "list a plan's ops with their ids (--ops), or draw its pipeline schedule (--schedule out.png)",
    "verify": "train a few steps with the plan on local processes and compare with one device",
    "run": "execute a plan (or compile a model and execute it): loss, step time and memory per rank",
    "train": "train a model (or a plan) on token files: validation, checkpoints, resume on any mesh",
    "export": "consolidate a checkpoint into one .safetensors file with the model's own parameter names",
    "diff": "compare two plans (or model@mesh pairs): mesh, sharding, collectives, memory",
    "check": "check a saved plan: exactly what this fivedc compiles, and every group's ranks agree on its collectives",
    "rehearse": "run one rank of each class of a plan at full scale (on the meta device, or timed on cpu or "
    "cuda): its peak memory and step against the estimate",
    "search": "find the fastest layout (mesh and options) of a model on N GPUs: ranked, and the best plan written",
}


def _mesh_args(p: argparse.ArgumentParser, *, required: bool) -> None:
    p.add_argument("--mesh", required=required, help="DPxPPxTPxCPxEP (e.g. 8x16x8x4x4) or dp=2,tp=2")
    p.add_argument("--rank-order", default=None, help="innermost axis first (default tp,cp,ep,dp,pp)")
    sp = p.add_mutually_exclusive_group()
    sp.add_argument("--sp", dest="sp", action="store_true", default=None, help="sequence parallelism on")
    sp.add_argument("--no-sp", dest="sp", action="store_false", help="sequence parallelism off")
    _plan_option_args(p)


def _plan_option_args(p: argparse.ArgumentParser) -> None:
    """What besides the mesh and --sp shapes a plan: CP, ZeRO and buckets, the pipeline, recomputation."""
    from fivedc.passes.base import ATTENTION_KERNELS, CP_LAYOUTS, CP_VARIANTS, DEFAULT_BUCKET_MB
    from fivedc.passes.recompute import RECOMPUTE_MODES

    p.add_argument("--cp-attention", choices=CP_VARIANTS, default=None,
                   help="attention across cp: ring (default) or allgather; an op's @cp(...) wins")
    p.add_argument("--attention-kernel", choices=ATTENTION_KERNELS, default=None,
                   help="attention's kernel: flash (default; scores never held) or math (scores "
                   "materialised and kept, as Megatron-LM before flash attention); an op's kernel= wins")
    p.add_argument("--cp-layout", choices=CP_LAYOUTS, default=None,
                   help="sequence layout over cp (default balanced when attention is causal)")
    p.add_argument("--zero", type=int, default=0, metavar="STAGE",
                   help="ZeRO stage: 1 optimizer state, 2 + gradients, 3 + parameters (default 0: off)")
    p.add_argument("--bucket-mb", type=float, default=DEFAULT_BUCKET_MB,
                   help=f"gradient bucket size in MiB (default {DEFAULT_BUCKET_MB:g})")
    p.add_argument("--schedule", default=None, help=f"pipeline schedule for pp > 1: {schedules_help()}")
    p.add_argument("--microbatches", type=int, default=None, help="microbatches per step (default: max(pp, least))")
    p.add_argument("--virtual", type=int, default=None, help="chunks per pp rank for interleaved (default 2)")
    p.add_argument("--pp-layout", default=None, metavar="N,N,...",
                   help="layers per chunk instead of balancing by cost, e.g. 3,5,5,3")
    p.add_argument("--stage-boundary", action="append", default=[], metavar="PATTERN",
                   help="file.py:factory models: a pipeline chunk begins at the modules matching PATTERN "
                   "(e.g. layers.4; * matches one path element); repeat for more")
    p.add_argument("--no-overlap", dest="overlap", action="store_false",
                   help="sum gradients after backward, no ZeRO-3 prefetch, tensor parallelism's backward sums "
                   "not behind the weight gradients, its forward collectives not beside their linears (to measure "
                   "what overlap gains)")
    p.add_argument("--recompute", choices=RECOMPUTE_MODES, default=None,
                   help="activation recomputation: none, selective (attention recomputed in backward) or "
                   "full (each layer keeps only its input); default: the model's @recompute, else none")
    p.add_argument("--fp8", action="store_true",
                   help="linears' matmuls in float8 as torchao's tensorwise recipe runs them (e4m3 inputs and "
                   "weights, e5m2 gradients, dynamic scales; not the output head, attention or MoE experts)")


def _wide_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument("--wide", action="store_true",
                   help=f"print for a terminal of {screen.WIDE_COLUMNS}+ columns (default: at most {screen.MAX_COLUMNS})")


def _local_run_args(p: argparse.ArgumentParser) -> None:
    """How verify and run start their local processes."""
    p.add_argument("--timeout", type=float, default=DEFAULT_TIMEOUT_S, metavar="SECONDS",
                   help=f"how long a rank waits in one collective for the others before the run fails "
                   f"(default {DEFAULT_TIMEOUT_S:g}); a long computation never times out")
    p.add_argument("--force", action="store_true",
                   help="start the local processes even when the mesh or the plan's memory estimate "
                   "exceeds this machine")
    p.add_argument("--compile", action="store_true",
                   help="run each layer of a repeat as one torch.compile region (compiled once for every layer)")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="fivedc",
        description="A declarative compiler from a model graph to a 5-D parallel execution plan.",
        epilog="exit codes:\n" + "\n".join(f"  {code}  {what}" for code, what in EXIT_CODES.items()),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    from fivedc import __version__

    parser.add_argument("--version", action="version", version=f"fivedc {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", title="commands")
    c = sub.add_parser("compile", help=COMMANDS["compile"], description=COMMANDS["compile"])
    c.add_argument("model", help="a .5d model file, or path/to/file.py:factory (an nn.Module traced with torch.fx)")
    _mesh_args(c, required=True)
    c.add_argument("--dtype", default="bf16", help="training precision for the estimates (bf16, fp32, fp64)")
    c.add_argument("--global-batch", type=int, default=None, metavar="B",
                   help="sequences per step instead of the model's batch dim (as fivedc search takes it)")
    c.add_argument("--seq", type=int, default=None, metavar="S",
                   help="tokens per sequence instead of the model's sequence dim (as fivedc search takes it)")
    c.add_argument("-o", "--output", default=None, help="plan file to write (default MODEL.plan.json)")
    c.add_argument("-q", "--quiet", action="store_true", help="write the plan, print one line")
    c.add_argument("-v", "--verbose", action="store_true", help="list every parameter")
    c.add_argument("--wide", action="store_true", help="summary as wide tables (140+ columns; default: the terminal's, at most 100, 80 when piped)")
    c.add_argument("--passes", action="store_true", help="list the compiler's passes in order, with their times")
    c.add_argument("--no-weights", dest="weights", action="store_false",
                   help="file.py:factory: build the model under fivedc.empty_weights() (parameters on the meta "
                   "device, none allocated): the same plan, so a large config plans on a laptop")
    c.add_argument("--gpu", default=None, metavar="NAME",
                   help="estimate the step time on this GPU (h100, h800, a100, h200, tpu-v4, or one from --hardware) and "
                   "check that every rank fits its memory (exit 2 with what would make it fit)")
    c.add_argument("--hardware", action="append", default=[], metavar="FILE",
                   help="a TOML file of GPU profiles like fivedc/ir/hardware.toml, added to the built-in ones")
    v = sub.add_parser("verify", help=COMMANDS["verify"], description=COMMANDS["verify"])
    v.add_argument("model", help="a .5d model file, or path/to/file.py:factory (checked against the plain module)")
    _mesh_args(v, required=True)
    v.add_argument("--steps", type=int, default=2, help="AdamW steps (default 2)")
    v.add_argument("--dtype", default="fp64", help="fp64 (default) or fp32")
    v.add_argument("--tol", type=float, default=None, help="largest relative error allowed (fp64: 1e-10)")
    v.add_argument("--trace-divergence", action="store_true",
                   help="compare every op's value and gradient too, and name the first that differs (a mismatch "
                   "does this by itself in a second run)")
    v.add_argument("--inject-fault", default=None, metavar="OP[@RANK]",
                   help="the checker's self-test: perturb OP's output (an id from fivedc show PLAN --ops) on one "
                   "rank; verify must fail naming OP")
    _local_run_args(v)
    r = sub.add_parser("run", help=COMMANDS["run"], description=COMMANDS["run"])
    r.add_argument("model", help="a plan .json written by fivedc compile, a .5d model, or path/to/file.py:factory")
    _mesh_args(r, required=False)
    r.add_argument("--steps", type=int, default=10, help="AdamW steps (default 10)")
    r.add_argument("--dtype", default=None, help="fp32 (default), bf16 or fp64, for a model compiled here")
    r.add_argument("--lr", type=float, default=1e-3, help="AdamW learning rate (default 1e-3)")
    r.add_argument("--weight-decay", type=float, default=0.1, help="AdamW weight decay (default 0.1)")
    r.add_argument("--seed", type=int, default=0, help="seed of the parameters and the synthetic batch")
    r.add_argument("--source", default=None, metavar="MODEL",
                   help="for a plan: the model file it was compiled from (default: the file the plan names)")
    r.add_argument("--report", default=None, metavar="OUT.json",
                   help="write per rank the plan's memory estimate and what the run measured (bytes kept for "
                   "backward, parameters, gradients and optimizer state held; on CUDA the allocator's peak)")
    _local_run_args(r)
    v.add_argument("--seed", type=int, default=0)
    t = sub.add_parser("train", help=COMMANDS["train"], description=COMMANDS["train"])
    t.add_argument("model", help="a .5d model, path/to/file.py:factory (starts from the module's weights) or a plan .json")
    _mesh_args(t, required=False)
    train_args(t)
    _local_run_args(t)
    e = sub.add_parser("export", help=COMMANDS["export"], description=COMMANDS["export"])
    e.add_argument("checkpoint", help="a save directory (its latest checkpoint) or one step-N folder")
    e.add_argument("-o", "--output", required=True, help="the .safetensors file to write")
    e.add_argument("--strip-prefix", default=None, metavar="PREFIX",
                   help="drop PREFIX from the names (a wrapper's, e.g. model.) so the library's own model loads them")
    e.add_argument("--dtype", default=None, help="cast to fp64, fp32, bf16 or fp16 (default: as trained)")
    s = sub.add_parser("show", help=COMMANDS["show"], description=COMMANDS["show"])
    s.add_argument("plan", help="a plan .json written by fivedc compile")
    s.add_argument("--schedule", default=None, metavar="OUT", help="draw the pipeline schedule: a .png or .svg")
    s.add_argument("--ops", action="store_true",
                   help="list every op and redistribution with its id (what --inject-fault and a divergence name)")
    _wide_arg(s)
    d = sub.add_parser("diff", help=COMMANDS["diff"], description=COMMANDS["diff"])
    d.add_argument("a", help="a plan .json, or MODEL.5d@MESH")
    d.add_argument("b", help="a plan .json, or MODEL.5d@MESH")
    d.add_argument("--rank-order", default=None, help="rank order for model@mesh arguments")
    d.add_argument("--sp", dest="sp", action="store_true", default=None, help="sequence parallel for model@mesh")
    _plan_option_args(d)
    d.add_argument("--json", action="store_true", help="machine-readable output")
    _wide_arg(d)
    from fivedc.cli.search import search_args

    h = sub.add_parser("rehearse", help=COMMANDS["rehearse"], description=COMMANDS["rehearse"])
    h.add_argument("model", help="a plan .json written by fivedc compile, a .5d model, or path/to/file.py:factory")
    _mesh_args(h, required=False)
    rehearse_args(h)
    search_args(sub.add_parser("search", help=COMMANDS["search"], description=COMMANDS["search"]))
    k = sub.add_parser("check", help=COMMANDS["check"], description=COMMANDS["check"])
    k.add_argument("plan", help="a plan .json written by fivedc compile")
    k.add_argument("--source", default=None, metavar="MODEL",
                   help="the model file the plan was compiled from (default: the file the plan names)")
    k.add_argument("--collectives", action="store_true",
                   help="list what each class of ranks (one per pp rank) issues in one step, in order")
    return parser


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

    if not args.ops and args.schedule is None:
        raise FivedcError("fivedc show needs --ops (list the ops) or --schedule OUT (draw the schedule)",
                          hint=f"e.g. fivedc show {args.plan} --ops")
    if args.schedule is not None:  # the picture's target, before any work
        from fivedc.outputs import Output, check_outputs

        if Path(args.schedule).suffix not in (".png", ".svg"):
            raise FivedcError(f"cannot draw to {args.schedule}: the picture is .png or .svg")
        check_outputs([Output("--schedule", args.schedule, "picture")], inputs=(args.plan,))
    plan = load_plan(args.plan)
    if args.ops:
        from fivedc.plan.op_list import render_ops

        render_ops(plan, console=screen.console(wide=args.wide))
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
    from fivedc.plan.diff import diff_plans, render_diff

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
        from fivedc.proof.comm_program import class_programs

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
