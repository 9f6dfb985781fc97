"""The IR verifier: structural invariants, checked at pipeline entry and exit.

At entry: dims are defined (sizes >= 1), parameters' inits known, every name is defined once and before use, repeat
blocks carry as many values in as out, op kinds are known. At exit additionally:
every op has a type, an output sharding and one spec per argument, and every input
and parameter has a sharding. A violation is a bug in a frontend or a pass, so it
raises `PassError` with the node's source location.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import ClassVar

from fivedc.errors import PassError
from fivedc.ir.graph import PARAM_INITS, Block, Graph, Op, Redistribute, Repeat
from fivedc.ir.ops import OP_SPECS
from fivedc.passes.base import CompileOptions


@dataclass(frozen=True, slots=True)
class VerifyIR:
    stage: str = "entry"  # "entry" or "exit"
    name: ClassVar[str] = "verify-ir"
    purpose: ClassVar[str] = "check the IR: names defined before use, known ops; at exit, all typed and sharded"

    def run(self, graph: Graph, options: CompileOptions) -> Graph:
        dims = {name for name, _ in graph.dims}
        for name, size in graph.dims:
            if not isinstance(size, int) or isinstance(size, bool) or size < 1:
                raise PassError(f"dim {name} = {size!r} is not a size (an integer >= 1)", loc=graph.dim_loc(name))
        defined: set[str] = set()
        for item in graph.inputs:
            self._define(item.name, defined, item.loc)
            self._dims(item.type.dims, dims, item.loc)
            if self.stage == "exit" and item.sharding is None:
                raise PassError(f"input {item.name!r} has no sharding", loc=item.loc)
        self._block(graph.body, defined, dims)
        if graph.output not in defined:
            raise PassError(f"the output {graph.output!r} is not defined", loc=graph.loc)
        return graph

    def _define(self, name: str, defined: set[str], loc) -> None:
        if name in defined:
            raise PassError(f"{name!r} is defined twice", loc=loc)
        defined.add(name)

    def _dims(self, names, dims: set[str], loc) -> None:
        for name in names:
            if name not in dims:
                raise PassError(f"dim {name!r} is not defined", loc=loc)
        if len(set(names)) != len(names):
            raise PassError(f"dims {list(names)} name a dim twice", loc=loc)

    def _block(self, block: Block, defined: set[str], dims: set[str]) -> None:
        for param in block.params:
            self._define(param.name, defined, param.loc)
            self._dims(param.dims, dims, param.loc)
            if param.init not in PARAM_INITS or not (math.isfinite(param.std) and param.std >= 0):
                raise PassError(f"parameter {param.name!r} has init {param.init!r} (std {param.std}): "
                                f"one of {', '.join(PARAM_INITS)}, with a finite std >= 0", loc=param.loc)
            if self.stage == "exit" and param.sharding is None:
                raise PassError(f"parameter {param.name!r} has no sharding", loc=param.loc)
        for item in block.items:
            if isinstance(item, Repeat):
                self._repeat(item, defined, dims)
            elif isinstance(item, Redistribute):
                self._use(item.src, defined, item.loc)
                self._define(item.out, defined, item.loc)
            else:
                self._op(item, defined)
        for name in block.yields:
            self._use(name, defined, None)

    def _repeat(self, item: Repeat, defined: set[str], dims: set[str]) -> None:
        n = len(item.carried)
        if not (len(item.body.args) == len(item.body.yields) == len(item.results) == n) or item.count < 1:
            raise PassError(f"repeat {item.name!r} carries {n} values in but not as many out", loc=item.loc)
        for name in item.carried:
            self._use(name, defined, item.loc)
        inner = set(defined)
        for name in item.body.args:
            self._define(name, inner, item.loc)
        self._block(item.body, inner, dims)
        for name in item.results:
            self._define(name, defined, item.loc)

    def _use(self, name: str, defined: set[str], loc) -> None:
        if name not in defined:
            raise PassError(f"{name!r} is used before it is defined", loc=loc)

    def _op(self, op: Op, defined: set[str]) -> None:
        if op.kind not in OP_SPECS:
            raise PassError(f"unknown op kind {op.kind!r}", loc=op.loc)
        for arg in op.reads:
            self._use(arg, defined, op.loc)
        self._define(op.out, defined, op.loc)
        if self.stage == "exit":
            if op.type is None or op.sharding is None or len(op.arg_specs) != len(op.args):
                raise PassError(f"{op.kind} -> {op.out!r} was not typed and sharded", loc=op.loc)
