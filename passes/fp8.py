"""Float8 linears (`--fp8`): which linears run their three matmuls in float8, recorded on the op.

The recipe is torchao's float8 training default (`Float8LinearConfig()`, recipe
"tensorwise"; torchao/float8/config.py, float8_linear.py `matmul_with_hp_or_float8_args`),
which torchtitan's `--model.converters float8` applies:

- dynamic tensorwise scaling: each operand's scale is max_fp8 / amax, amax the largest
  magnitude of the whole tensor as that call sees it, computed afresh at every call;
- forward: input and weight cast to float8 e4m3 (max 448), output = the product at the
  training dtype; backward: the output gradient cast to float8 e5m2 (max 57344), dX =
  dY8 W8 and dW = X8^T dY8 (the input and weight at the scales of the forward);
- what autograd keeps for backward is the training-dtype input and weight (torchao saves
  `input_hp, weight_hp_t` and casts again in backward), so the activations are those of a
  plain linear; the float8 copies live only beside their matmul;
- which linears: torchao converts `nn.Linear` modules only, and torchtitan's converter
  skips those whose in or out features are not multiples of 16 (`torch._scaled_mm`'s
  constraint: "N, K must be a multiple of 16", torchao `Float8LinearConfig.pad_inner_dim`)
  and the output head (its `filter_fqns`, default ["output"]: the logits' precision
  matters to the loss). Attention's own products, the MoE experts' grouped matmuls (a
  separate torchao prototype) and everything else stay at the training dtype.

Tensor parallelism: torchao's float8 under TP takes the amax of the DTensor, the whole
tensor over the tp shards (an all-reduce of the max). fivedc does so for every axis that
splits a tensor within a sample (tp, cp: its non-batch dims), so a layout computes the
function one device computes on the same rows. The batch is the one exception, as in
torchao: a data-parallel rank (dp, ep) and a pipeline microbatch scale by their own rows
(torchao under DDP/FSDP takes no amax across ranks); the single-device reference of
`fivedc verify` scales the same blocks of rows (`runtime/fp8.py`). The all-reduces of
one scalar each are in the op's collectives (forward: input and weight; backward: the
output gradient), priced by latency and listed for the agreement proof.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import ClassVar

from fivedc.errors import FivedcError
from fivedc.ir.graph import Block, Collective, CollectiveKind, Graph, Op, Phase, Repeat, walk_params
from fivedc.ir.mesh import MESH_ORDER, Mesh
from fivedc.ir.sharding import Sharding
from fivedc.passes.base import CompileOptions

RECIPE = "tensorwise"  # the attribute's value on a float8 linear
SCALAR_BYTES = 4  # an amax is one float32
GEMM_MULTIPLE = 16  # torch._scaled_mm: N and K multiples of 16


@dataclass(frozen=True, slots=True)
class ChooseFp8:
    name: ClassVar[str] = "fp8"
    purpose: ClassVar[str] = "--fp8: the linears that run in float8 (torchao tensorwise) and their amax all-reduces"

    def run(self, graph: Graph, options: CompileOptions) -> Graph:
        """Decides from the option alone: a plan's graph read back (`plan_check`) carries the
        marks of its compile, which a fresh compile must give again, not keep."""
        if not options.fp8 and not any(op.attr("fp8") is not None for op, _ in _ops(graph.body)):
            return graph
        heads = _head_dims(graph)
        params = {p.name: p for p, _ in walk_params(graph.body)}
        body = _choose(graph.body, graph, options.mesh, heads if options.fp8 else None, params)
        if options.fp8 and not any(is_fp8(op) for op, _ in _ops(body)):
            raise FivedcError(f"--fp8: no linear of {graph.name} can run in float8 (torchao converts linears "
                              f"whose in and out features are multiples of {GEMM_MULTIPLE}, not the output head)",
                              hint="drop --fp8")
        return replace(graph, body=body)


def is_fp8(op: Op) -> bool:
    """Whether a linear runs its matmuls in float8 (set by `ChooseFp8`)."""
    return op.kind == "linear" and op.attr("fp8") == RECIPE


def _ops(block: Block):
    for item in block.items:
        if isinstance(item, Repeat):
            yield from ((op, item) for op in item.body.items if isinstance(op, Op))
        elif isinstance(item, Op):
            yield item, None


def _choose(block: Block, graph: Graph, mesh: Mesh, heads: set[str] | None, params: dict) -> Block:
    """`heads` None: no linear in float8 (the option off)."""
    items = []
    for item in block.items:
        if isinstance(item, Repeat):
            item = replace(item, body=_choose(item.body, graph, mesh, heads, params))
        elif isinstance(item, Op) and item.attr("fp8") is not None:
            item = replace(item, attrs=tuple(a for a in item.attrs if a[0] != "fp8"))
        if isinstance(item, Op) and heads is not None and _eligible(item, graph, heads, params):
            item = replace(item, attrs=(*item.attrs, ("fp8", RECIPE)), collectives=(*item.collectives,
                                                                                   *amax_collectives(item, graph, mesh)))
        items.append(item)
    return replace(block, items=tuple(items))


def _head_dims(graph: Graph) -> set[str]:
    """The class dims of the losses' logits: a linear making one is an output head."""
    logits = {op.args[0] for op, _ in _ops(graph.body) if op.kind == "cross_entropy"}
    return {op.type.dims[-1] for op, _ in _ops(graph.body) if op.out in logits and op.type is not None and op.type.dims}


def _eligible(op: Op, graph: Graph, heads: set[str], params: dict) -> bool:
    if op.kind != "linear" or op.args[1] not in params or op.type is None:
        return False
    w = params[op.args[1]].dims
    out_dims = [d for d in op.type.dims if d in w]
    contracted = [d for d in w if d not in op.type.dims]
    if not out_dims or not contracted or any(d in heads for d in out_dims):
        return False
    size = lambda dims: math.prod(graph.dim(d) for d in dims)  # noqa: E731
    return size(out_dims) % GEMM_MULTIPLE == 0 and size(contracted) % GEMM_MULTIPLE == 0


def amax_axes(dims: tuple[str, ...], sharding: Sharding | None, graph: Graph, mesh: Mesh) -> tuple:
    """The mesh axes over which a tensor's amax is all-reduced: those splitting its dims
    other than the batch (the rows of a sample), each of size > 1, in mesh order."""
    if sharding is None:
        return ()
    axes = {a for d in dims if d != graph.batch_dim for a in sharding.axes_of(d) if mesh.size(a) > 1}
    return tuple(a for a in MESH_ORDER if a in axes)


def operand_amax_axes(op: Op, graph: Graph, mesh: Mesh, which: str) -> tuple:
    """`amax_axes` of a float8 linear's input (`x`), weight (`w`) or output gradient (`dy`),
    as the kernel holds them (the input after its redistribution, the output before)."""
    if which == "dy":
        return amax_axes(op.type.dims, op.sharding, graph, mesh)
    index = 0 if which == "x" else 1
    spec = op.arg_specs[index].sharding if len(op.arg_specs) > index and op.arg_specs[index] else None
    w = next(p.dims for p, _ in walk_params(graph.body) if p.name == op.args[1])
    # the input's dims: the output's that the weight does not make, and those the weight contracts
    dims = w if which == "w" else tuple(d for d in op.type.dims if d not in w) + tuple(d for d in w
                                                                                      if d not in op.type.dims)
    return amax_axes(dims, spec, graph, mesh)


def amax_collectives(op: Op, graph: Graph, mesh: Mesh) -> tuple[Collective, ...]:
    out = []
    for which, tensor, phase in (("x", op.args[0], Phase.FORWARD), ("w", op.args[1], Phase.FORWARD),
                                 ("dy", op.out, Phase.BACKWARD)):
        axes = operand_amax_axes(op, graph, mesh, which)
        if axes:
            what = {"x": "input", "w": "weight", "dy": "output gradient"}[which]
            out.append(Collective(CollectiveKind.ALL_REDUCE, axes, phase, tensor, SCALAR_BYTES,
                                  f"fp8: the amax of the {what} over its shards (tensorwise scale)", loc=op.loc))
    return tuple(out)
