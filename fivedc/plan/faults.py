"""A fault to inject: the checker's self-test (`fivedc verify --inject-fault OP[@RANK]`).

`resolve_fault` reads the user's text against the plan: OP is a site id as
`fivedc show PLAN --ops` lists them (`logits`, `layers.2.q`; a bare name in a layer
stack is its layer 0), RANK a rank that computes it (default: the first that does;
under a pipeline only its stage's ranks do). The runtime's trace
(`runtime/trace.py`) then adds a small constant to one element of that op's output
on that rank at step 1, and verify must fail naming the op.
"""

from __future__ import annotations

from dataclasses import dataclass

from fivedc.errors import FivedcError
from fivedc.instructions.sites import find_site, is_float, ranks_computing


@dataclass(frozen=True, slots=True)
class Fault:
    """Perturb `value` (in `layer` of its repeat; None at top level) on `rank` at `step`."""

    value: str
    layer: int | None
    rank: int
    step: int = 1
    size: float = 1e-2  # relative to the output's largest magnitude (at least 1)
    id: str = ""  # as the user named it (`fivedc show --ops`)


def resolve_fault(plan, text: str) -> Fault:
    """The `Fault` that `OP[@RANK]` names in `plan`, or a `FivedcError` saying what to give."""
    op, at, rank_text = text.partition("@")
    if not op.strip():
        raise FivedcError(f"--inject-fault {text!r} names no op: the self-test needs an op id",
                          hint="fivedc show PLAN --ops lists the ids, e.g. --inject-fault logits")
    site = find_site(plan.graph, op)
    if not is_float(site):
        raise FivedcError(f"{site.id} ({site.kind}) computes integers: a fault goes into a floating-point value",
                          hint="pick an op whose output is float (fivedc show PLAN --ops shows the types)")
    ranks = ranks_computing(site, plan.pipeline, plan.mesh)
    if not at:
        return Fault(site.value, site.layer, ranks[0], id=site.id)
    try:
        rank = int(rank_text)
    except ValueError:
        raise FivedcError(f"--inject-fault {text}: the rank after @ must be a number, not {rank_text!r}") from None
    if rank not in ranks:
        shown = ", ".join(map(str, ranks[:8])) + (" ..." if len(ranks) > 8 else "")
        raise FivedcError(f"--inject-fault {text}: rank {rank} does not compute {site.id}",
                          hint=f"ranks that do: {shown}")
    return Fault(site.value, site.layer, rank, id=site.id)
