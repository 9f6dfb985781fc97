"""Gradient reduction: which axes each parameter's gradient must be summed over.

Every use of a parameter says (in its `ArgSpec`) over which axes the op's work is
split while the parameter is replicated: the data axes for every weight (each rank
saw part of the batch), and tp for a norm weight under sequence parallelism (each
rank saw part of the sequence). The union over uses is the parameter's
`grad_partial`: the runtime all-reduces its gradient over those axes after backward.
Where the uses differ (a tied table read by an embedding split over the tokens and by
a linear after an op that runs replicated, whole), a use whose work is whole over some
of those axes computes the same gradient on each of their ranks: it is marked
`grad_once` over them, and the runtime keeps its gradient on their first rank only
(zero elsewhere), so the sum counts it once.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import ClassVar

from fivedc.ir.graph import ArgSpec, Block, Graph, Op, Repeat
from fivedc.ir.mesh import MeshAxis
from fivedc.passes.base import CompileOptions


@dataclass(frozen=True, slots=True)
class ReduceGradients:
    name: ClassVar[str] = "reduce-gradients"
    purpose: ClassVar[str] = "the axes each parameter's gradient is summed over"

    def run(self, graph: Graph, options: CompileOptions) -> Graph:
        return replace(graph, body=self._count_once(self._block(graph.body, {}), {}))

    def _block(self, block: Block, outer: dict[str, set]) -> Block:
        uses: dict[str, list[tuple]] = {p.name: [] for p in block.params}
        scope = {**outer, **uses}
        items = []
        for item in block.items:
            if isinstance(item, Repeat):
                items.append(replace(item, body=self._block(item.body, scope)))
                continue
            if not isinstance(item, Op):
                items.append(item)
                continue
            for arg, spec in zip(item.arg_names, item.arg_specs):
                if arg is not None and arg in scope and spec is not None:
                    scope[arg].append((item, spec.grad_partial))
            items.append(item)
        params = tuple(replace(p, grad_partial=_union(uses[p.name])) for p in block.params)
        return replace(block, params=params, items=tuple(items))

    def _count_once(self, block: Block, outer: dict[str, tuple]) -> Block:
        """Each use of a parameter that misses some of its `grad_partial` axes gets them as `grad_once`."""
        scope = {**outer, **{p.name: p.grad_partial for p in block.params}}
        items = []
        for item in block.items:
            if isinstance(item, Repeat):
                item = replace(item, body=self._count_once(item.body, scope))
            elif isinstance(item, Op) and item.arg_specs:
                specs = tuple(_once(arg, spec, scope) for arg, spec in zip(item.arg_names, item.arg_specs))
                item = replace(item, arg_specs=specs) if specs != item.arg_specs else item
            items.append(item)
        return replace(block, items=tuple(items))


def _union(uses: list[tuple[Op, tuple]]) -> tuple:
    forms = {axes for _, axes in uses}
    if len(forms) == 1:
        return next(iter(forms))
    return tuple(a for a in MeshAxis if any(a in form for form in forms))


def _once(arg: str | None, spec: ArgSpec | None, scope: dict[str, tuple]) -> ArgSpec | None:
    if spec is None or arg is None or arg not in scope:
        return spec
    once = tuple(a for a in scope[arg] if a not in spec.grad_partial)
    return replace(spec, grad_once=once) if once != spec.grad_once else spec
