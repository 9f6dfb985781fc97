"""`fivedc verify`: the equivalence check from the command line.

Started plainly, it spawns world-size local processes itself (gloo on CPU, NCCL
when CUDA is available). Started under torchrun (WORLD_SIZE set), it checks the
launcher's world size against the mesh and runs as one rank of that job. Either
way it prints the largest relative error of the loss, gradients and parameters
and exits 1 when one exceeds the tolerance (`fivedc/cli/verify_report.py`).

On a mismatch it runs the plan once more with every op's value and gradient traced
and names the first op that diverges (`runtime/divergence.py`); `--trace-divergence`
traces the first run itself (so a difference that leaves the loss alone fails
too), and `--inject-fault OP[@RANK]` perturbs one op on one rank: the checker's
self-test, which must fail naming that op. A `file.py:factory` module is checked
against the plain module; its divergence is located, and a fault injected, in the
plan of its traced graph run against that plan on one device (seeded weights and
inputs): the one reference that has a value for every op.
"""

from __future__ import annotations

import math
import os
from dataclasses import replace

from fivedc.cli.screen import say
from fivedc.errors import FivedcError
from fivedc.cli.verify_report import judge

DEFAULT_TOL = {"fp64": 1e-10, "fp32": 1e-4}


def run_verify(args) -> int:
    from fivedc.cli.shared import check_local_run, compile_options, load_graph
    from fivedc.ir.mesh import Mesh
    from fivedc.passes.base import CompileOptions
    from fivedc.pipeline import compile_graph
    from fivedc.runtime.train import TrainSettings, check_trainable
    from fivedc.runtime.verify import single_device_mesh

    if args.dtype not in DEFAULT_TOL:
        raise FivedcError(f"verify runs in fp64 or fp32, not {args.dtype!r}")
    if args.steps < 1:
        raise FivedcError(f"--steps {args.steps} must be at least 1")
    check_local_run(args)
    check_fault_flag(args)
    mesh = Mesh.parse(args.mesh, rank_order=args.rank_order)
    tol = args.tol if args.tol is not None else DEFAULT_TOL[args.dtype]
    if not (math.isfinite(tol) and tol >= 0):
        raise FivedcError(f"--tol {tol} is not a tolerance: it must be a finite number >= 0",
                          hint=f"e.g. --tol {DEFAULT_TOL[args.dtype]:g} (the default for {args.dtype})")
    from fivedc.frontends.python_file import is_spec

    module = is_spec(args.model)
    if module and "WORLD_SIZE" in os.environ:
        return _module_under_launcher(args, mesh, tol)
    graph = load_graph(args.model, args.stage_boundary)  # traced once; errors before any process starts
    check_trainable(graph)
    plan = compile_graph(graph, compile_options(args, mesh, dtype=args.dtype))
    # the reference recomputes nothing the option or the model's @recompute would (a repeat's own
    # @recompute stays: on one device it computes the same numbers)
    reference = compile_graph(graph, CompileOptions(mesh=single_device_mesh(), dtype=args.dtype, recompute="none",
                                                    fp8=plan.fp8))
    settings = TrainSettings(steps=args.steps, seed=args.seed, dtype=args.dtype, compile=args.compile)
    diagnosis = _diagnosis(args, plan, tol)
    if "WORLD_SIZE" in os.environ:
        report = _under_launcher(plan, reference, settings, diagnosis)
        return 0 if report is None else judge(report, tol, what="the parallel run differs from the single-device run",
                                              fault=diagnosis.fault if diagnosis else None)
    _check_machine(args, plan, reference)
    fault = diagnosis.fault if diagnosis else None
    say(f"verifying {args.model} on mesh {mesh} ({mesh.world} processes, {args.steps} steps, {args.dtype})"
        + (f"; injecting a fault into {fault.id} on rank {fault.rank}" if fault else ""))
    run_plan = _plan_runner(args, plan, reference, settings)
    if module and fault is None:
        report = _module_check(args, mesh)
        what = "the parallel module differs from the plain one"
        tol = _module_tol(args, report, tol)
    else:
        if module:
            print("(the fault goes into the plan of the traced module, checked against that plan on one device)")
        report = run_plan(diagnosis)
        what = "the parallel run differs from the single-device run"
    if not report.traced and (args.trace_divergence or not report.max_error <= tol):
        from fivedc.runtime.verify import Diagnosis

        print("locating the first divergence: the plan run again, every op's value and gradient traced")
        traced = run_plan(Diagnosis(tol))
        report = replace(report, traced=True, divergence=traced.divergence)
    return judge(report, tol, what=what, fault=fault)


def check_fault_flag(args) -> None:
    """`--inject-fault` names an op: an empty id would skip the self-test and pass."""
    if args.inject_fault is not None and not args.inject_fault.partition("@")[0].strip():
        raise FivedcError(f"--inject-fault {args.inject_fault!r} names no op: the self-test needs an op id",
                          hint="fivedc show PLAN --ops lists the ids (compile the model first, "
                          "fivedc compile MODEL --mesh ... -o PLAN.json), e.g. --inject-fault logits")


def _diagnosis(args, plan, tol: float):
    """What --trace-divergence and --inject-fault ask of the run (None: a plain run)."""
    from fivedc.plan.faults import resolve_fault
    from fivedc.runtime.verify import Diagnosis

    fault = resolve_fault(plan, args.inject_fault) if args.inject_fault is not None else None
    return Diagnosis(tol, fault) if fault is not None or args.trace_divergence else None


def _plan_runner(args, plan, reference, settings):
    """`run(diagnosis)`: the plan on local processes against the reference plan on one device."""
    from fivedc.cli.shared import progress_printer
    from fivedc.runtime.verify import verify_plan

    return lambda diagnosis: verify_plan(plan, reference, settings=settings, timeout_s=args.timeout,
                                         on_progress=progress_printer(), diagnosis=diagnosis)


def _module_options(args, mesh) -> dict:
    from fivedc.cli.shared import compile_options

    given = compile_options(args, mesh, dtype=args.dtype)  # the same options a compile of the module takes
    if given.fp8:
        raise FivedcError("--fp8: a file.py:factory model is checked as fivedc.parallelize runs it, against the "
                          "plain module, which has no float8 linears",
                          hint="drop --fp8, or verify the plan of its traced graph (fivedc compile ... --fp8 -o PLAN)")
    if given.attention_kernel is not None:
        raise FivedcError(f"--attention-kernel {given.attention_kernel}: a file.py:factory model is checked as "
                          "fivedc.parallelize runs it, with each attention's default kernel",
                          hint="drop --attention-kernel, or compile the model with it to see its estimates")
    return dict(sequence_parallel=given.sequence_parallel, cp_attention=given.cp_attention,
                cp_layout=given.cp_layout, overlap=given.overlap, bucket_mb=given.bucket_mb, zero=given.zero,
                schedule=given.schedule, microbatches=given.microbatches, virtual=given.virtual,
                pp_layout=given.pp_layout, recompute=given.recompute,
                stage_boundaries=tuple(args.stage_boundary), compile=args.compile)


def _module_check(args, mesh):
    """`file.py:factory`: the parallelized module against the plain one, both trained
    with torch's AdamW (fivedc/parallel/check.py)."""
    from fivedc.cli.shared import progress_printer
    from fivedc.parallel.check import check_module

    return check_module(args.model, mesh=mesh, steps=args.steps, dtype=args.dtype, seed=args.seed,
                        timeout_s=args.timeout, on_progress=progress_printer(), **_module_options(args, mesh))


def _module_under_launcher(args, mesh, tol: float) -> int:
    """One rank of a torchrun job checking a module; rank 0 judges."""
    import torch.distributed as dist

    from fivedc.parallel.check import check_module
    from fivedc.runtime.pool import check_world, init_from_env

    if args.inject_fault is not None or args.trace_divergence:
        raise FivedcError("--inject-fault and --trace-divergence of a file.py:factory module run local processes",
                          hint="run fivedc verify without torchrun for them")
    check_world(mesh.world, mesh=mesh)
    init_from_env()
    try:
        report = check_module(args.model, mesh=mesh, steps=args.steps, dtype=args.dtype, seed=args.seed,
                              **_module_options(args, mesh))
    finally:
        dist.destroy_process_group()
    if report is None:
        return 0
    return judge(report, _module_tol(args, report, tol), what="the parallel module differs from the plain one")


def _module_tol(args, report, tol: float) -> float:
    """The tolerance of a module check that ran in float32 (no float64 kernel for some op of the
    module, `report.note` says which): float32's, unless --tol gave one."""
    if not report.note:
        return tol
    say(f"note: {report.note}")
    return args.tol if args.tol is not None else DEFAULT_TOL[report.dtype]


def _check_machine(args, plan, reference) -> None:
    """Refuse (unless --force) a mesh this machine cannot run: every rank holds its share
    of the plan (its memory estimate) and the reference's record (parameters and every
    step's gradients), and this process runs the reference itself."""
    from fivedc.runtime.resources import check_local_resources

    record = (args.steps + 1) * reference.memory.params
    check_local_resources(world=plan.mesh.world, bytes_per_rank=plan.memory.total + record,
                          reference_bytes=reference.memory.total + record, force=args.force,
                          what=f"verifying {args.model} on mesh {plan.mesh}")


def _under_launcher(plan, reference_plan, settings, diagnosis):
    """One rank of a torchrun job; rank 0 returns the merged report, others None."""
    from fivedc.runtime.pool import check_world, run_as_launched_rank
    from fivedc.runtime.trace import ValueTrace
    from fivedc.runtime.fp8 import reference_blocks
    from fivedc.runtime.verify import merge_results, rank_job, reference_run

    check_world(plan.mesh.world, mesh=plan.mesh)  # before the reference run: a wrong launch fails at once
    tracer = ValueTrace(0) if diagnosis is not None else None
    reference = reference_run(reference_plan, settings, tracer=tracer, fp8_blocks=reference_blocks(plan))
    gathered = run_as_launched_rank(rank_job, mesh=plan.mesh, payload=(plan, reference, settings, diagnosis))
    if gathered is None:
        return None
    return merge_results(gathered, reference, plan=plan, tracer=tracer, diagnosis=diagnosis)
