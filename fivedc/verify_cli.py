"""`fivedc verify`: the equivalence check from the command line.

Started plainly, it spawns world-size local processes itself (gloo on CPU, NCCL
when CUDA is available). Started under torchrun (WORLD_SIZE set), it checks the
launcher's world size against the mesh and runs as one rank of that job. Either
way it prints the largest relative error of the loss, gradients and parameters
and exits 1 when one exceeds the tolerance.
"""

from __future__ import annotations

import math
import os

from fivedc.errors import FivedcError, VerifyMismatch

DEFAULT_TOL = {"fp64": 1e-10, "fp32": 1e-4}


def run_verify(args) -> int:
    from fivedc.cli_shared import check_local_run, compile_options, load_graph
    from fivedc.mesh import Mesh
    from fivedc.passes.base import CompileOptions
    from fivedc.pipeline import compile_graph
    from fivedc.runtime.train import TrainSettings, check_trainable
    from fivedc.runtime.verify import single_device_mesh

    if args.dtype not in DEFAULT_TOL:
        raise FivedcError(f"verify runs in fp64 or fp32, not {args.dtype!r}")
    if args.steps < 1:
        raise FivedcError(f"--steps {args.steps} must be at least 1")
    check_local_run(args)
    mesh = Mesh.parse(args.mesh, rank_order=args.rank_order)
    tol = args.tol if args.tol is not None else DEFAULT_TOL[args.dtype]
    if not (math.isfinite(tol) and tol >= 0):
        raise FivedcError(f"--tol {tol} is not a tolerance: it must be a finite number >= 0",
                          hint=f"e.g. --tol {DEFAULT_TOL[args.dtype]:g} (the default for {args.dtype})")
    from fivedc.frontend_py import is_spec

    if is_spec(args.model):
        return _verify_module(args, mesh, tol)
    graph = load_graph(args.model, args.stage_boundary)  # a DSL model (or a clear error)
    check_trainable(graph)
    plan = compile_graph(graph, compile_options(args, mesh, dtype=args.dtype))
    # the reference recomputes nothing the option or the model's @recompute would (a repeat's own
    # @recompute stays: on one device it computes the same numbers)
    reference = compile_graph(graph, CompileOptions(mesh=single_device_mesh(), dtype=args.dtype, recompute="none"))
    settings = TrainSettings(steps=args.steps, seed=args.seed, dtype=args.dtype)
    if "WORLD_SIZE" in os.environ:
        report = _under_launcher(plan, reference, settings)
        if report is None:
            return 0
    else:
        from fivedc.cli_shared import progress_printer
        from fivedc.runtime.verify import verify_plan

        _check_machine(args, plan, reference)
        print(f"verifying {args.model} on mesh {mesh} ({mesh.world} processes, {args.steps} steps, {args.dtype})")
        report = verify_plan(plan, reference, settings=settings, timeout_s=args.timeout,
                             on_progress=progress_printer())
    return judge(report, tol, what="the parallel run differs from the single-device run")


def _verify_module(args, mesh, tol: float) -> int:
    """`file.py:factory`: the parallelized module against the plain one, both trained
    with torch's AdamW (fivedc/parallel/check.py)."""
    from fivedc.cli_shared import compile_options, progress_printer
    from fivedc.parallel.check import check_module

    given = compile_options(args, mesh, dtype=args.dtype)  # the same options a compile of the module takes
    options = dict(sequence_parallel=given.sequence_parallel, cp_attention=given.cp_attention,
                   cp_layout=given.cp_layout, overlap=given.overlap, bucket_mb=given.bucket_mb, zero=given.zero,
                   schedule=given.schedule, microbatches=given.microbatches, virtual=given.virtual,
                   pp_layout=given.pp_layout, recompute=given.recompute,
                   stage_boundaries=tuple(args.stage_boundary))
    if "WORLD_SIZE" in os.environ:
        import torch.distributed as dist

        from fivedc.runtime.pool import check_world, init_from_env

        check_world(mesh.world, mesh=mesh)
        init_from_env()
        try:
            report = check_module(args.model, mesh=mesh, steps=args.steps, dtype=args.dtype, seed=args.seed, **options)
        finally:
            dist.destroy_process_group()
        if report is None:
            return 0
    else:
        from fivedc.cli_shared import load_graph
        from fivedc.passes.base import CompileOptions
        from fivedc.pipeline import compile_graph
        from fivedc.runtime.verify import single_device_mesh

        graph = load_graph(args.model, args.stage_boundary)  # traced once; errors before any process starts
        reference = compile_graph(graph, CompileOptions(mesh=single_device_mesh(), dtype=args.dtype, recompute="none"))
        _check_machine(args, compile_graph(graph, given), reference)
        print(f"verifying {args.model} on mesh {mesh} ({mesh.world} processes, {args.steps} steps, {args.dtype})")
        report = check_module(args.model, mesh=mesh, steps=args.steps, dtype=args.dtype, seed=args.seed,
                              timeout_s=args.timeout, on_progress=progress_printer(), **options)
    if report.note:  # no float64 kernel for some op of the module: checked in float32
        print(f"note: {report.note}")
        tol = args.tol if args.tol is not None else DEFAULT_TOL[report.dtype]
    return judge(report, tol, what="the parallel module differs from the plain one")


def _check_machine(args, plan, reference) -> None:
    """Refuse (unless --force) a mesh this machine cannot run: every rank holds its share
    of the plan (its memory estimate) and the reference's record (parameters and every
    step's gradients), and this process runs the reference itself."""
    from fivedc.runtime.resources import check_local_resources

    record = (args.steps + 1) * reference.memory.params
    check_local_resources(world=plan.mesh.world, bytes_per_rank=plan.memory.total + record,
                          reference_bytes=reference.memory.total + record, force=args.force,
                          what=f"verifying {args.model} on mesh {plan.mesh}")


def judge(report, tol: float, *, what: str) -> int:
    """Print the report; 0 when every error is within `tol`, else `VerifyMismatch` (exit 1).
    Errors are never NaN (runtime/compare.py: a non-finite value is an infinite error)."""
    _print_report(report, tol)
    if not report.max_error <= tol:
        raise VerifyMismatch(f"{what}: relative error {report.max_error:.3e} > {tol:.0e} ({report.worst})")
    return 0


def _under_launcher(plan, reference_plan, settings):
    """One rank of a torchrun job; rank 0 returns the merged report, others None."""
    from fivedc.runtime.pool import check_world, run_as_launched_rank
    from fivedc.runtime.verify import merge_results, rank_job, reference_run

    check_world(plan.mesh.world, mesh=plan.mesh)  # before the reference run: a wrong launch fails at once
    reference = reference_run(reference_plan, settings)
    gathered = run_as_launched_rank(rank_job, mesh=plan.mesh, payload=(plan, reference, settings))
    return merge_results(gathered, reference) if gathered is not None else None


def _print_report(report, tol: float) -> None:
    print(f"{'step':>4}  {'reference loss':>22}  {'parallel loss':>22}")
    for step, (ref, par) in enumerate(zip(report.losses, report.parallel_losses), start=1):
        print(f"{step:>4}  {ref:>22.16f}  {par:>22.16f}")
    print("largest relative error (all ranks, all steps):")
    print(f"  loss        {report.loss_error:.3e}")
    print(f"  gradients   {report.grad_error:.3e}")
    print(f"  parameters  {report.param_error:.3e}   (worst: {report.worst})")
    _print_expert_load(report)
    verdict = "OK" if report.max_error <= tol else "MISMATCH"  # inf > tol: a NaN run never passes
    print(f"{verdict}: tolerance {tol:.0e}, {report.world} processes")


def _print_expert_load(report, shown: int = 6) -> None:
    """Per step: each MoE layer's imbalance (busiest expert's tokens / mean), and drops."""
    if not report.expert_load:
        return
    print("expert load (assignments per expert over all ranks; imbalance = busiest / mean):")
    for step, layers in enumerate(report.expert_load, start=1):
        ratios = {name: load.imbalance for name, load in layers.items()}
        if len(ratios) <= shown:
            text = ", ".join(f"{name} {ratio:.2f}" for name, ratio in ratios.items())
        else:
            worst = max(ratios, key=ratios.get)
            text = f"{len(ratios)} layers, mean {sum(ratios.values()) / len(ratios):.2f}, worst {worst} {ratios[worst]:.2f}"
        routed = sum(sum(load.routed) for load in layers.values())
        dropped = sum(sum(load.dropped) for load in layers.values())
        drops = f"; dropped {dropped} of {routed} ({100 * dropped / routed:.1f}%)" if dropped else ""
        print(f"  step {step}: {text}{drops}")
    same = "the same as" if report.routing_matches else "DIFFERENT from"
    print(f"  routing: tokens per expert {same} the single-device run")

