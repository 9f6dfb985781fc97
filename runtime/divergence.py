"""The first divergent op: where a parallel run stops computing what one device computes.

Every rank traces each node's value and gradient (`runtime/trace.py`), and so does
the single-device reference. `first_divergence` walks the plan in program order,
step by step: each site's forward value, then (backward runs the other way) each
site's gradient from the last site to the first, then the parameters' gradients as
the optimizer gets them. It reports the first whose relative error (against the
largest magnitude of the full reference tensor, as every check does) exceeds the
tolerance: the op, its source line, the ranks and microbatches that differ, and the
plan's collectives around it.

How a rank's local tensor is held against the reference, with the plan's own
shardings: the reference is cut to the rank's shard (`runtime/program.shard`: the
sequence in cp's layout order, experts in their placement); a value pending a sum
over some axes (`+partial(tp)`) is summed over the ranks of that group first; a
gradient is never a pending sum (communication insertion sums a partial gradient
before it reaches an op's output). Under a pipeline each microbatch holds its slice
of the batch; a value without the batch dim is, per microbatch, a part of the whole
(computed from the inputs: a loss) or the whole (from parameters alone), and its
gradient the other way round.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor

from fivedc.errors import SourceLoc
from fivedc.ir.graph import Collective, Op, Redistribute
from fivedc.ir.mesh import MeshAxis
from fivedc.plan.execution_plan import ExecutionPlan
from fivedc.instructions.sites import Site, data_dependent, sites
from fivedc.runtime.compare import relative_error
from fivedc.runtime.kernel_context import KernelContext
from fivedc.runtime.program import shard

PHASES = ("forward", "backward", "gradient sync")


@dataclass(frozen=True, slots=True)
class Divergence:
    step: int
    phase: str  # forward (a value), backward (a value's gradient), gradient sync (a parameter's gradient)
    id: str  # the site's id (`fivedc show --ops`), or the parameter's name
    kind: str  # the op kind, "redistribute" or "parameter"
    loc: SourceLoc | None
    error: float
    ranks: tuple[int, ...]
    microbatches: tuple[int, ...]  # empty without a pipeline
    collectives: tuple[str, ...] = ()  # the plan's collectives around it, described

    def describe(self) -> str:
        where = f" at {self.loc}" if self.loc else ""
        what = {"forward": "the value of", "backward": "the gradient of",
                "gradient sync": "the summed gradient of"}[self.phase]
        micro = f", microbatch {', '.join(map(str, self.microbatches))}" if self.microbatches else ""
        ranks = ", ".join(map(str, self.ranks[:8])) + (" ..." if len(self.ranks) > 8 else "")
        lines = [f"first divergence: step {self.step}, {self.phase}: {what} {self.id} ({self.kind}){where}",
                 f"  relative error {self.error:.3e} on rank{'s' if len(self.ranks) > 1 else ''} {ranks}{micro}"]
        if self.collectives:
            lines.append("  the plan's collectives around it:")
            lines += [f"    {c}" for c in self.collectives]
        return "\n".join(lines)


@dataclass(frozen=True)
class RankTrace:
    """What one rank sends back: its coordinates, traced values and gradients (keys of
    `runtime/trace.Key`), and per step the errors of its parameters' summed gradients."""

    rank: int
    values: dict
    grads: dict
    param_grad_errors: tuple[dict[str, float], ...] = ()


def first_divergence(plan: ExecutionPlan, reference: dict, ranks: list[RankTrace], *, steps: int,
                     tol: float) -> Divergence | None:
    """The earliest site, in program order and step by step, that differs beyond `tol`."""
    checker = _Checker(plan, reference, ranks)
    order = sites(plan.graph)
    for step in range(1, steps + 1):
        for site in order:
            found = checker.site(step, site, grad=False, tol=tol)
            if found:
                return found
        for site in reversed(order):
            found = checker.site(step, site, grad=True, tol=tol)
            if found:
                return found
        found = checker.param_grads(step, tol)
        if found:
            return found
    return None


def worst_value_error(plan: ExecutionPlan, reference: dict, ranks: list[RankTrace], *, steps: int) -> float:
    """The largest error of any traced value or gradient (what `--trace-divergence` adds to verify)."""
    checker = _Checker(plan, reference, ranks)
    worst = 0.0
    for step in range(1, steps + 1):
        for site in sites(plan.graph):
            for grad in (False, True):
                errors = checker.errors(step, site, grad=grad)
                worst = max([worst, *(e for e, _, _ in errors)])
    return worst


class _Checker:
    def __init__(self, plan: ExecutionPlan, reference: dict, ranks: list[RankTrace]) -> None:
        self.plan, self.graph, self.mesh = plan, plan.graph, plan.mesh
        self.reference, self.ranks = reference, {r.rank: r for r in ranks}
        self.ctx = {r.rank: KernelContext(plan.graph, plan.mesh, plan.mesh.coords(r.rank)) for r in ranks}
        self.from_inputs = data_dependent(plan.graph)
        self.origin = {n.out: n.src for n, _ in _redistributions(plan.graph)}
        self.m = plan.pipeline.microbatches if plan.pipeline is not None else 1

    def _root(self, name: str) -> str:
        while name in self.origin:
            name = self.origin[name]
        return name

    def site(self, step: int, site: Site, *, grad: bool, tol: float) -> Divergence | None:
        bad = [(e, ranks, micro) for e, ranks, micro in self.errors(step, site, grad=grad) if not e <= tol]
        if not bad:
            return None
        error = max(e for e, _, _ in bad)
        ranks = tuple(sorted({r for _, rs, _ in bad for r in rs}))
        micro = tuple(sorted({j for _, _, js in bad for j in js})) if self.m > 1 else ()
        return Divergence(step, "backward" if grad else "forward", site.id, site.kind, site.node.loc, error,
                          ranks, micro, around(self.plan, site, grad=grad))

    def errors(self, step: int, site: Site, *, grad: bool) -> list[tuple[float, tuple[int, ...], tuple[int, ...]]]:
        """(error, ranks, microbatches) for each group of ranks holding `site`'s value."""
        if grad and isinstance(site.node, Redistribute):
            return []  # its gradient is a part of its source's: checked there, all uses summed
        table = self.reference["grads" if grad else "values"]
        full = table.get((step, self._root(site.value), site.layer, 0))
        if full is None:
            return []
        node = site.node
        dims, sharding = node.type.dims, node.sharding
        partial = () if grad else sharding.partial
        held = {r: self._local(t, step, site, grad) for r, t in self.ranks.items()}
        held = {r: parts for r, parts in held.items() if parts is not None}
        out = []
        for group in self._groups(held, partial):
            want = shard(full, dims, sharding.restrict(dims), self.ctx[group[0]])
            parts = [None if any(held[r][j] is None for r in group) else sum(held[r][j] for r in group)
                     for j in range(self.m)]
            for error, micro in self._compare(parts, want, full, dims, site.value, grad):
                out.append((error, tuple(group), micro))
        return out

    def _local(self, trace: RankTrace, step: int, site: Site, grad: bool) -> list[Tensor] | None:
        """A rank's tensor per microbatch; None when it does not compute the site. A value
        without a gradient where it has one elsewhere counts as a zero gradient."""
        keys = [(step, site.value, site.layer, j) for j in range(self.m)]
        values = [trace.values.get(k) for k in keys]
        if all(v is None for v in values):
            return None
        if grad:
            return [trace.grads.get(k, torch.zeros_like(v) if v is not None else None) for k, v in zip(keys, values)]
        return values

    def _groups(self, held: dict, partial: tuple[MeshAxis, ...]) -> list[list[int]]:
        """Ranks whose local values sum to one shard: those that differ only along `partial`."""
        groups: dict[tuple, list[int]] = {}
        for rank in sorted(held):
            coords = self.mesh.coords(rank)
            groups.setdefault(tuple(v for a, v in sorted(coords.items()) if a not in partial), []).append(rank)
        return list(groups.values())

    def _compare(self, parts: list, want: Tensor, full: Tensor, dims, value: str, grad: bool):
        """(error, microbatches) pairs: per microbatch slice, or the microbatches combined."""
        if any(p is None for p in parts):
            return [(math.inf, tuple(range(self.m)))]
        if self.m == 1:
            return [(relative_error(parts[0], want, full), ())]
        batch = self.graph.batch_dim
        if batch in dims:
            slices = want.chunk(self.m, dim=dims.index(batch))
            return [(relative_error(p, w, full), (j,)) for j, (p, w) in enumerate(zip(parts, slices))]
        summed = (value in self.from_inputs) != grad  # a part per microbatch: a loss's value, a weight's gradient
        if summed:
            return [(relative_error(sum(parts), want, full), tuple(range(self.m)))]
        return [(relative_error(p, want, full), (j,)) for j, p in enumerate(parts)]

    def param_grads(self, step: int, tol: float) -> Divergence | None:
        worst: dict[str, tuple[float, list[int]]] = {}
        for rank, trace in self.ranks.items():
            for name, error in (trace.param_grad_errors[step - 1] if len(trace.param_grad_errors) >= step else {}).items():
                if not error <= tol:
                    got = worst.setdefault(name, (0.0, []))
                    worst[name] = (max(got[0], error), got[1] + [rank])
        if not worst:
            return None
        name = max(worst, key=lambda n: worst[n][0])
        error, ranks = worst[name]
        sync = tuple(describe(c) for c in self.plan.collectives if c.phase == "grad_sync")[:4]
        return Divergence(step, "gradient sync", name, "parameter", None, error, tuple(ranks), (), sync)


def _redistributions(graph):
    from fivedc.ir.graph import walk_ops

    return [(n, r) for n, r in walk_ops(graph.body) if isinstance(n, Redistribute)]


def describe(c: Collective) -> str:
    where = f" at {c.loc}" if c.loc else ""
    return f"{c.phase} {c.kind} over {'x'.join(c.axes)} of {c.tensor}{where}: {c.reason}"


def around(plan: ExecutionPlan, site: Site, *, grad: bool) -> tuple[str, ...]:
    """The plan's collectives next to a site: for its value, those that made its inputs
    (the redistributions it reads) and its own; for its gradient, the backward ones of
    the redistributions and ops that read it."""
    from fivedc.instructions.sites import graph_nodes

    nodes = [n for n, _ in graph_nodes(plan.graph)]
    by_out = {n.out: n for n in nodes}
    node = site.node
    found: list[Collective] = []
    if not grad:
        if isinstance(node, Redistribute):
            found += node.forward
        else:
            found += [c for a in node.reads if isinstance(by_out.get(a), Redistribute) for c in by_out[a].forward]
            found += [c for c in node.collectives if c.phase == "forward"]
    else:
        for reader in nodes:
            if isinstance(reader, Redistribute) and reader.src == node.out:
                found += reader.backward
            elif isinstance(reader, Op) and node.out in reader.reads:
                found += [c for c in reader.collectives if c.phase == "backward"]
        if isinstance(node, Op):
            found += [c for c in node.collectives if c.phase == "backward"]
    return tuple(describe(c) for c in found if c.kind != "slice")
