"""The terms a unit's seconds are made of, recorded while `unit_costs.unit_time` adds them up.

`unit_time` keeps a `Ledger` beside its sums: every second it adds to a phase (forward,
input gradient, weight gradient) it also adds to one term there, and what a whole
backward hides behind its compute (`UnitTime.hidden`) to a fourth phase. The terms:

    matmuls            linear, matmul and MoE ops (their roofline, whichever bound wins)
    attention          attention ops (flash or math kernel)
    memory-bound ops   every other op
    recomputation      forwards run again in backward (selective: those ops; full: the layer)
    op issue           where the host issues ops slower than the device runs them
    <axes> collectives a unit's collectives by the mesh axes of their group (tp, cp, ep,
                       tp+cp, ...): blocking ones whole, overlapped ones less what hides,
                       plus the compute units they hold beside the compute

so a unit's forward is the sum of its forward terms, and a whole backward the sum of its
input and weight terms less its hidden ones (`UnitParts.backward`); the step's breakdown
(`fivedc/estimates/breakdown.py`) adds them over the schedule.
"""

from __future__ import annotations

from dataclasses import dataclass

from fivedc.ir.mesh import MESH_ORDER
from fivedc.ir.ops import LINEAR_KINDS

MATMUL_KINDS = (*LINEAR_KINDS, "moe")
MATMULS, ATTENTION, MEMORY_BOUND = "matmuls", "attention", "memory-bound ops"
RECOMPUTATION, ISSUE = "recomputation", "op issue (host)"
PHASES = ("forward", "input", "weight", "hidden")

Terms = tuple[tuple[str, float], ...]


def op_term(kind: str) -> str:
    """The compute term of an op of `kind`."""
    if kind in MATMUL_KINDS:
        return MATMULS
    return ATTENTION if kind == "attention" else MEMORY_BOUND


def axes_label(axes) -> str:
    """`tp`, `dp+ep`, ...: the axes in mesh order (dp, pp, tp, cp, ep)."""
    present = set(axes)
    return "+".join(str(a) for a in MESH_ORDER if a in present) or "none"


def comm_term(steps) -> str:
    """The term of collectives `steps` (each with `.axes`): `<axes> collectives`."""
    return f"{axes_label({a for x in steps for a in x.axes})} collectives"


@dataclass(frozen=True, slots=True)
class UnitParts:
    """A unit's seconds for one microbatch by term, per phase (each phase sums to `UnitTime`'s)."""

    forward: Terms = ()
    input: Terms = ()
    weight: Terms = ()
    hidden: Terms = ()  # what a whole backward runs behind its compute: subtracted there

    def backward(self, *, whole: bool) -> Terms:
        """B: the input and weight terms, less the hidden ones in a whole backward."""
        out = merge(self.input, self.weight)
        return merge(out, tuple((k, -v) for k, v in self.hidden)) if whole else out


def merge(*parts: Terms, scale: float = 1.0) -> Terms:
    """The terms of `parts` added up (first appearance keeps the order), times `scale`."""
    out: dict[str, float] = {}
    for terms in parts:
        for k, v in terms:
            out[k] = out.get(k, 0.0) + v * scale
    return tuple(out.items())


class Ledger:
    """Seconds by term per phase, filled while a unit's time is added up."""

    __slots__ = ("_phases",)

    def __init__(self) -> None:
        self._phases: dict[str, dict[str, float]] = {p: {} for p in PHASES}

    def add(self, phase: str, term: str, seconds: float) -> None:
        if seconds:
            into = self._phases[phase]
            into[term] = into.get(term, 0.0) + seconds

    def share(self, phase: str, shares: dict[str, float], seconds: float) -> None:
        """`seconds` over the terms of `shares` in proportion to them."""
        total = sum(shares.values())
        for term, part in shares.items():
            self.add(phase, term, seconds * part / total if total else seconds / len(shares))

    def parts(self) -> UnitParts:
        return UnitParts(*(tuple(self._phases[p].items()) for p in PHASES))
