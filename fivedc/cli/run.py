"""`fivedc run`: execute a plan (a saved one, or a model compiled on the spot).

`fivedc run PLAN.json` runs the plan as written; `fivedc run model.5d --mesh ...`
compiles first (the same options as `compile`). Started plainly it spawns the
mesh's world of local processes (gloo on CPU, NCCL with CUDA); under torchrun it
is one rank of that job. It trains `--steps` AdamW steps on a seeded synthetic
batch (`runtime/run.py`) and prints each step's loss and time (the slowest
rank's), then the bytes the busiest rank held against the plan's estimate: parameters,
gradients and optimizer state after the last backward, and the peak of what a step
kept for backward (saved tensors, `runtime/saved.LiveMeter`); `--report out.json` writes
them per rank (`runtime/run.memory_report`).
"""

from __future__ import annotations

import os

from fivedc.cli.screen import say
from fivedc.errors import FivedcError

def run_run(args, *, defaults) -> int:
    """`defaults`: the run command's arguments as parsed with no flags (which flags were given)."""
    from fivedc.cli.shared import check_local_run, executed_plan
    from fivedc.runtime.train import DTYPES, TrainSettings, check_trainable

    if args.steps < 1:
        raise FivedcError(f"--steps {args.steps} must be at least 1")
    check_local_run(args)
    plan = executed_plan(args, defaults, verb="running", dtype=args.dtype or "fp32", say=say)
    check_trainable(plan.graph)
    if plan.dtype not in DTYPES:
        raise FivedcError(f"the plan trains in {plan.dtype}; run trains in {', '.join(DTYPES)}",
                          hint="compile with --dtype fp32 (or bf16)")
    if args.compile and args.report:
        raise FivedcError("--report measures what each op keeps for backward, which compiled regions hide",
                          hint="drop --compile to measure memory, or --report to run compiled")
    settings = TrainSettings(steps=args.steps, lr=args.lr, weight_decay=args.weight_decay, seed=args.seed,
                             dtype=plan.dtype, keep_grads=False, measure=not args.compile, compile=args.compile)
    if "WORLD_SIZE" in os.environ:
        report = _under_launcher(plan, settings)
        if report is None:
            return 0
    else:
        from fivedc.cli.shared import progress_printer
        from fivedc.runtime.resources import check_local_resources
        from fivedc.runtime.run import run_plan

        check_local_resources(world=plan.mesh.world, bytes_per_rank=plan.memory.total, force=args.force,
                              what=f"running {args.model} on mesh {plan.mesh}")
        say(f"running {args.model} on mesh {plan.mesh} ({plan.mesh.world} processes, {args.steps} steps, "
            f"{plan.dtype}, a seeded synthetic batch)")
        report = run_plan(plan, settings, timeout_s=args.timeout, on_progress=progress_printer())
    _print_report(plan, report, compiled=args.compile)
    if args.report is not None:
        _write_report(args, plan, report)
    return 0


def _write_report(args, plan, report) -> None:
    import json

    from fivedc.files import write_output
    from fivedc.runtime.run import memory_report

    write_output(args.report, json.dumps(memory_report(plan, report), indent=1) + "\n",
                 inputs=(args.model.split(":")[0],), what="report")
    say(f"wrote {args.report}: per rank, the plan's memory estimate and what the run measured")


def _under_launcher(plan, settings):
    """One rank of a torchrun job; rank 0 returns the merged report, the others None."""
    from fivedc.runtime.pool import run_as_launched_rank
    from fivedc.runtime.run import merge_runs, run_job

    gathered = run_as_launched_rank(run_job, mesh=plan.mesh, payload=(plan, settings))
    return merge_runs(gathered) if gathered is not None else None


def _print_report(plan, report, *, compiled: bool = False) -> None:
    from fivedc.plan.summary import format_bytes

    print(f"{'step':>4}  {'loss':>12}  {'ms':>9}")
    for step, (loss, seconds) in enumerate(zip(report.losses, report.seconds), start=1):
        print(f"{step:>4}  {loss:>12.6f}  {seconds * 1e3:>9.1f}")
    later = sorted(report.seconds[1:]) or list(report.seconds)
    print(f"median step after the first: {later[len(later) // 2] * 1e3:.1f} ms (slowest rank)")
    print("held by the busiest rank (the plan's estimate for its busiest class):")
    for kind in ("params", "grads", "optimizer", "activations"):
        got, want = report.most_held(kind), max(getattr(entry, kind) for entry in plan.memory.ranks)
        shown = "not seen" if kind == "activations" and compiled else format_bytes(got)  # inside compiled graphs
        print(f"  {kind:<11} {shown:>10}   ({format_bytes(want)})")
    if report.peak and report.peak[0] is not None:
        print(f"  {'peak':<11} {format_bytes(max(report.peak)):>10}   ({format_bytes(plan.memory.total)}, the total)")
