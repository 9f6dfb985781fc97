"""Sharding propagation: decide the sharding of every input, parameter and op.

One sweep in program order. Inputs split their batch dim over the data axes and
their sequence dim over cp.
Each op's rule (`passes/rules.py`) says what sharding it needs of each argument
and what it produces; a parameter takes the sharding its first use asks for. The
pass records, per argument, the axes over which the op's gradient for it is a
partial sum: the axes the op's output is split or partial over but the argument
is replicated over (a column-parallel linear's input over tp; any weight over dp).
Repeat bodies are swept once, with the carried values in their canonical layout.
"""

from __future__ import annotations

from collections import ChainMap
from dataclasses import dataclass, replace
from typing import ClassVar

from fivedc.errors import ShardingError
from fivedc.ir.graph import ArgSpec, Block, DType, Graph, Input, Op, Repeat, TensorType
from fivedc.ir.mesh import MeshAxis
from fivedc.ir.sharding import Sharding
from fivedc.passes.base import CompileOptions
from fivedc.passes.layout import RuleContext
from fivedc.passes.rules import SHARDING_RULES


def grad_partial_axes(arg: Sharding, out: Sharding) -> tuple[MeshAxis, ...]:
    """Axes the op's work is split over (its output is split or partial) while the
    argument is replicated: each rank then holds only a summand of its gradient."""
    work = set(out.split_axes()) | set(out.partial)
    return tuple(sorted(a for a in work if not arg.uses(a)))


@dataclass(frozen=True, slots=True)
class PropagateShardings:
    name: ClassVar[str] = "propagate-shardings"
    purpose: ClassVar[str] = "DP batch split, TP column/row pairing, SP and the CP split on every value"

    def run(self, graph: Graph, options: CompileOptions) -> Graph:
        ctx = RuleContext.build(
            graph, options.mesh, sequence_parallel=options.sp_enabled(graph), dtype_bytes=options.dtype_bytes
        )
        inputs = tuple(replace(i, sharding=self._input_sharding(ctx, i)) for i in graph.inputs)
        env = {i.name: i.sharding for i in inputs}
        types = {i.name: i.type for i in inputs}
        body = self._block(ctx, graph.body, env, types, ChainMap(), ChainMap())
        return replace(graph, inputs=inputs, body=body)

    def _input_sharding(self, ctx: RuleContext, item: Input) -> Sharding:
        batch, seq = item.type.dims[0], ctx.graph.seq_dim
        sharding = Sharding()
        if ctx.data_axes:
            ctx.check_divisible(batch, ctx.data_axes, item.loc, "the batch is split over the data axes")
            sharding = sharding.with_split(batch, ctx.data_axes)
        if ctx.cp and seq in item.type.dims[1:]:
            sharding = sharding.with_split(seq, ctx.cp)  # divisibility: passes/context.py
        return sharding

    def _block(self, ctx: RuleContext, block: Block, env: dict, types: dict, outer: ChainMap, outer_types: ChainMap) -> Block:
        """Sweep one block; parameters are scoped like names (a body sees the outer ones)."""
        params = outer.new_child({p.name: None for p in block.params})
        param_types = outer_types.new_child({p.name: TensorType(p.dims) for p in block.params})
        items = []
        for item in block.items:
            if isinstance(item, Repeat):
                items.append(self._repeat(ctx, item, env, types, params, param_types))
            else:
                items.append(self._op(ctx, item, env, types, params, param_types))
        new_params = tuple(replace(p, sharding=params[p.name] or Sharding()) for p in block.params)
        return replace(block, params=new_params, items=tuple(items))

    def _repeat(self, ctx: RuleContext, item: Repeat, env: dict, types: dict, params: ChainMap, param_types: ChainMap) -> Repeat:
        carried = tuple(ctx.canonical(env[c], types[c]) for c in item.carried)
        env.update(zip(item.body.args, carried))
        types.update(zip(item.body.args, (types[c] for c in item.carried)))
        body = self._block(ctx, item.body, env, types, params, param_types)
        env.update(zip(item.results, carried))
        types.update(zip(item.results, (types[c] for c in item.carried)))
        return replace(item, body=body, carried_shardings=carried)

    def _op(self, ctx: RuleContext, op: Op, env: dict, types: dict, params: ChainMap, param_types: ChainMap) -> Op:
        shardings, arg_types = [None] * len(op.args), [None] * len(op.args)  # None: a number literal
        for index, name in op.reads_at:
            if name in params:
                arg_types[index] = param_types[name]  # a parameter's sharding is the rule's to choose
            else:
                shardings[index], arg_types[index] = env[name], types[name]
        result = SHARDING_RULES[op.kind](ctx, op, shardings, arg_types)
        specs = []
        for index, (arg_type, need) in enumerate(zip(arg_types, result.args)):
            if need is None:
                specs.append(None)
                continue
            arg = op.read(index)
            if arg is not None and arg in params and params[arg] is None:
                next(m for m in params.maps if arg in m)[arg] = need
            elif arg is not None and arg in params and params[arg] != need:  # a tied weight's second use
                raise ShardingError(
                    f"parameter {arg} is used by two ops that need it sharded differently ({params[arg]} and "
                    f"{need}, here)", loc=op.loc, hint="untie the weights, or keep tp=1")
            is_float = arg_type is not None and arg_type.dtype == DType.FLOAT
            specs.append(ArgSpec(need, grad_partial_axes(need, result.out) if is_float else ()))
        env[op.out] = result.out
        types[op.out] = op.type
        return replace(op, sharding=result.out, arg_specs=tuple(specs), collectives=result.collectives)
