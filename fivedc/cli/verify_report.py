"""What `fivedc verify` prints and how it ends: the errors, the first divergence, the verdict.

`judge` prints a report (a plan's `VerifyReport` or a module's `ModuleCheck`: the
loss per step, the largest relative error of the loss, gradients and parameters,
MoE routing, and when the run was traced the first divergent op) and returns 0 when
every error is within the tolerance, else raises `VerifyMismatch` (exit 1) naming
that op and its line. With an injected fault it also checks the checker: the run
must fail at that op, and a checker that misses it is a bug (exit 4).
"""

from __future__ import annotations

from fivedc.cli.screen import say
from fivedc.errors import PassError, VerifyMismatch


def judge(report, tol: float, *, what: str, fault=None) -> int:
    """Print the report; 0 when every error is within `tol`, else `VerifyMismatch` (exit 1)
    naming the first divergent op when the run was traced. Errors are never NaN
    (runtime/compare.py: a non-finite value is an infinite error). With a `fault` the run
    must fail at that op: a checker that misses it is a bug (exit 4)."""
    _print_report(report, tol)
    if fault is not None:
        _judge_fault(report, fault)
    if not report.max_error <= tol:
        found = report.divergence
        worst = found.id if found is not None and found.error >= report.max_error else report.worst
        first = f"; first divergence: {found.phase} of {found.id} ({found.kind})" if found else ""
        raise VerifyMismatch(f"{what}: relative error {report.max_error:.3e} > {tol:.0e} ({worst}){first}",
                             loc=found.loc if found is not None else None, hint=_hint(report))
    return 0


def _hint(report) -> str:
    if report.divergence is not None:
        return ("fivedc show PLAN --ops (PLAN from fivedc compile with the same options) lists the ops around it "
                "with their shardings and collectives")
    if report.traced and getattr(report, "module", False):
        return ("the plan of the traced module matches one device op by op, so the difference lies between the "
                "module and its traced graph: fivedc verify FILE.py:FACTORY --mesh 1x1x1x1x1 shows it")
    if report.traced:
        return "the traced run found no op beyond the tolerance: the difference did not reproduce"
    return ""


def _judge_fault(report, fault) -> None:
    found = report.divergence
    if report.injected == 0 or found is None or found.id != fault.id:
        seen = f"named {found.phase} of {found.id}" if found else "found no divergence"
        raise PassError(f"the checker missed the fault injected into {fault.id} on rank {fault.rank} "
                        f"({report.injected} times applied): it {seen}")
    say(f"the checker found the injected fault: {fault.id} on rank {fault.rank} (exit 1, as it must)")


def _print_report(report, tol: float) -> None:
    print(f"{'step':>4}  {'reference loss':>22}  {'parallel loss':>22}")
    for step, (ref, par) in enumerate(zip(report.losses, report.parallel_losses), start=1):
        print(f"{step:>4}  {ref:>22.16f}  {par:>22.16f}")
    print("largest relative error (all ranks, all steps):")
    print(f"  loss        {report.loss_error:.3e}")
    print(f"  gradients   {report.grad_error:.3e}")
    print(f"  parameters  {report.param_error:.3e}   (worst: {report.worst})")
    if getattr(report, "state_error", None) is not None and getattr(report, "module", False):
        print(f"  buffers     {report.state_error:.3e}   (the states the forward writes, after the hooks)")
    _print_expert_load(report)
    if report.traced:
        say(report.divergence.describe() if report.divergence is not None
            else f"every op's value and gradient is within {tol:.0e} of the single-device run's")
    verdict = "OK" if report.max_error <= tol else "MISMATCH"  # inf > tol: a NaN run never passes
    print(f"{verdict}: tolerance {tol:.0e}, {report.world} processes")


def _print_expert_load(report, shown: int = 6) -> None:
    """Per step: each MoE layer's imbalance (busiest expert's tokens / mean), and drops."""
    if not report.expert_load:
        return
    print("expert load imbalance per MoE layer (the busiest expert's assignments over all ranks / the mean):")
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
        say(f"  step {step}: {text}{drops}", indent="      ")
    same = "the same as" if report.routing_matches else "DIFFERENT from"
    print(f"  routing: tokens per expert {same} the single-device run")

