"""Gradient reduction: which axes each parameter's gradient must be summed over.

Every use of a parameter says (in its `ArgSpec`) over which axes the op's work is
split while the parameter is replicated: the data axes for every weight (each rank
saw part of the batch), and tp for a norm weight under sequence parallelism (each
rank saw part of the sequence). The union over uses is the parameter's
`grad_partial`: the runtime all-reduces its gradient over those axes after backward.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import ClassVar

from fivedc.errors import NotSupportedError
from fivedc.ir.graph import Block, Graph, Op, Repeat
from fivedc.passes.base import CompileOptions


@dataclass(frozen=True, slots=True)
class ReduceGradients:
    name: ClassVar[str] = "reduce-gradients"
    purpose: ClassVar[str] = "the axes each parameter's gradient is summed over"

    def run(self, graph: Graph, options: CompileOptions) -> Graph:
        return replace(graph, body=self._block(graph.body, {}))

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
            for arg, spec in zip(item.args, item.arg_specs):
                if isinstance(arg, str) and arg in scope and spec is not None:
                    scope[arg].append((item, spec.grad_partial))
            items.append(item)
        params = tuple(replace(p, grad_partial=self._union(p.name, uses[p.name])) for p in block.params)
        return replace(block, params=params, items=tuple(items))

    def _union(self, name: str, uses: list[tuple[Op, tuple]]) -> tuple:
        forms = {axes for _, axes in uses}
        if len(forms) > 1:
            where = ", ".join(f"{op.kind} at {op.loc}" for op, _ in uses)
            raise NotSupportedError(
                f"parameter {name!r} is used by ops that split their work differently ({where})",
                loc=uses[0][0].loc,
                hint="use each parameter once, or give its uses the same sharding",
            )
        return next(iter(forms), ())
