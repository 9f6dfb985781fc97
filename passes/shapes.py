"""Shape inference: give every op its output `TensorType`, checking that dims agree.

One small rule per op family (`fivedc/ir/ops.OpFamily`), and per op kind in `SHAPE_RULES`.
A rule gets the argument types (a `TensorType`, or `None` for a number literal) and
returns the output type, or raises `ShapeError` at the op's source line naming the dims
that disagree.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Callable, ClassVar

from fivedc.errors import ShapeError
from fivedc.ir.graph import Block, DType, Graph, Op, Repeat, TensorType
from fivedc.ir.ops import OP_SPECS, OpFamily, by_family, parse_freqs
from fivedc.passes.base import CompileOptions

ArgTypes = list[TensorType | None]


def _fail(op: Op, message: str, hint: str = "") -> ShapeError:
    return ShapeError(f"{op.kind}: {message}", loc=op.loc, hint=hint)


def _tensor(op: Op, types: ArgTypes, index: int, dtype: DType | None = DType.FLOAT) -> TensorType:
    t = types[index]
    name = OP_SPECS[op.kind].args[index]
    if t is None:
        raise _fail(op, f"argument {name!r} must be a tensor, not a number")
    if dtype is not None and t.dtype != dtype:
        raise _fail(op, f"argument {name!r} must be a {dtype} tensor, got {t}")
    return t


def _fmt(t: TensorType) -> str:
    return f"[{', '.join(t.dims)}]"


def contracted_count(x: TensorType, w: TensorType) -> int:
    """How many trailing dims of x match the leading dims of w (the longest match)."""
    for k in range(min(len(x.dims), len(w.dims)), 0, -1):
        if x.dims[-k:] == w.dims[:k]:
            return k
    return 0


def transposed_count(x: TensorType, w: TensorType) -> int:
    """How many trailing dims of x match the trailing dims of w, with a dim of w left over
    (a weight stored [out, in] as nn.Linear keeps it: a tied embedding table)."""
    for k in range(min(len(x.dims), len(w.dims) - 1), 0, -1):
        if x.dims[-k:] == w.dims[-k:]:
            return k
    return 0


def _linear(op: Op, types: ArgTypes, graph: Graph) -> TensorType:
    x, w = _tensor(op, types, 0), _tensor(op, types, 1)
    k = contracted_count(x, w)
    if k:
        dims = x.dims[:-k] + w.dims[k:]
    elif transposed_count(x, w):
        k = transposed_count(x, w)
        dims = x.dims[:-k] + w.dims[:-k]
    else:
        raise _fail(
            op,
            f"the trailing dims of x {_fmt(x)} match neither the leading nor the trailing dims of w {_fmt(w)}",
            hint="linear contracts x's last dims with w's first dims (or its last: a weight stored [out, in]), "
                 "matched by name",
        )
    if len(set(dims)) != len(dims):
        raise _fail(op, f"the result {_fmt(TensorType(dims))} would name a dim twice")
    return TensorType(dims)


def _embedding(op: Op, types: ArgTypes, graph: Graph) -> TensorType:
    tokens, table = _tensor(op, types, 0, DType.INT), _tensor(op, types, 1)
    if len(table.dims) != 2:
        raise _fail(op, f"the table must have two dims [vocab, hidden], got {_fmt(table)}")
    if table.dims[1] in tokens.dims:
        raise _fail(op, f"tokens {_fmt(tokens)} already have the table's dim {table.dims[1]!r}")
    padding, rows = op.attr("padding_idx"), graph.dim(table.dims[0])
    if padding is not None and not 0 <= padding < rows:
        raise _fail(op, f"padding_idx={padding} is not a row of the table ({table.dims[0]}={rows})")
    return TensorType(tokens.dims + (table.dims[1],))


def _elementwise(op: Op, types: ArgTypes, graph: Graph) -> TensorType:
    a = _tensor(op, types, 0)
    b = types[1]
    if b is None:
        return a
    b = _tensor(op, types, 1)
    big, small = (a, b) if len(a.dims) >= len(b.dims) else (b, a)
    if not set(small.dims) <= set(big.dims):
        raise _fail(
            op,
            f"cannot broadcast {_fmt(a)} with {_fmt(b)}",
            hint="one operand's dims must be a subset of the other's (broadcast by dim name)",
        )
    return big


def _unary(op: Op, types: ArgTypes, graph: Graph) -> TensorType:
    return _tensor(op, types, 0)


def _swiglu(op: Op, types: ArgTypes, graph: Graph) -> TensorType:
    gate, up = _tensor(op, types, 0), _tensor(op, types, 1)
    if gate.dims != up.dims:
        raise _fail(op, f"gate {_fmt(gate)} and up {_fmt(up)} must have the same dims")
    return gate


def _norm(op: Op, types: ArgTypes, graph: Graph) -> TensorType:
    """A norm over x's trailing dims that its weight has: one (hidden), or several (OLMo 2's
    q_norm over heads and head_dim, a norm of the projection before its view into heads)."""
    x = _tensor(op, types, 0)
    w = _tensor(op, types, 1)
    for index in range(1, len(types)):
        t = _tensor(op, types, index)
        if not t.dims or t.dims != x.dims[len(x.dims) - len(t.dims):] or t.dims != w.dims:
            name = OP_SPECS[op.kind].args[index]
            raise _fail(op, f"{name} {_fmt(t)} must be the trailing dims of x {_fmt(x)}, [{x.dims[-1]}] or more, "
                            "as the weight's")
    return x


def _rope(op: Op, types: ArgTypes, graph: Graph) -> TensorType:
    x = _tensor(op, types, 0)
    if graph.seq_dim not in x.dims[:-1]:
        raise _fail(op, f"x {_fmt(x)} has no sequence dim {graph.seq_dim!r} to take positions from")
    if graph.dim(x.dims[-1]) % 2:
        raise _fail(op, f"the rotated dim {x.dims[-1]}={graph.dim(x.dims[-1])} must be even")
    freqs = str(op.attr("freqs", "") or "")
    if freqs:
        try:
            count = len(parse_freqs(freqs))
        except ValueError:
            raise _fail(op, f"freqs must be numbers separated by commas, got {freqs[:40]!r}") from None
        if count != graph.dim(x.dims[-1]) // 2:
            raise _fail(op, f"freqs gives {count} frequencies; the rotated dim {x.dims[-1]} needs "
                            f"{graph.dim(x.dims[-1]) // 2}")
    return x


def _attention(op: Op, types: ArgTypes, graph: Graph) -> TensorType:
    q, k, v = (_tensor(op, types, i) for i in range(3))
    for name, t in (("q", q), ("k", k), ("v", v)):
        if len(t.dims) != 4 or t.dims[1] != graph.seq_dim:
            raise _fail(op, f"{name} {_fmt(t)} must be [batch, {graph.seq_dim}, heads, head_dim]")
    if k.dims[:2] != q.dims[:2] or v.dims[:3] != k.dims[:3]:
        raise _fail(op, f"q {_fmt(q)}, k {_fmt(k)} and v {_fmt(v)} must share batch, seq and kv-heads")
    if k.dims[3] != q.dims[3]:
        raise _fail(op, f"q {_fmt(q)} and k {_fmt(k)} must share their head dim")
    heads, kv_heads = graph.dim(q.dims[2]), graph.dim(k.dims[2])
    if heads % kv_heads:
        raise _fail(op, f"{q.dims[2]}={heads} is not a multiple of {k.dims[2]}={kv_heads} (GQA groups)")
    dims = q.dims[:3] + (v.dims[3],)
    if len(set(dims)) != 4:
        raise _fail(op, f"the result {_fmt(TensorType(dims))} would name a dim twice")
    _check_window(op)
    return TensorType(dims)


def _check_window(op: Op) -> None:
    window = op.attr("window", 0)
    if isinstance(window, bool) or not isinstance(window, int) or window < 0:
        raise _fail(op, f"attention's window is a whole number of keys >= 1 (0: none), got {window!r}")
    if window and not op.attr("causal", True):
        raise _fail(op, f"attention's window={window} needs causal=true",
                    "a sliding window is the causal band i - window < j <= i; drop window= or set causal=true")


def _cross_entropy(op: Op, types: ArgTypes, graph: Graph) -> TensorType:
    logits, targets = _tensor(op, types, 0), _tensor(op, types, 1, DType.INT)
    if logits.dims[:-1] != targets.dims:
        raise _fail(op, f"targets {_fmt(targets)} must be the logits' dims {_fmt(logits)} without the last")
    if op.attr("reduction", "mean") not in ("mean", "sum"):
        raise _fail(op, f"cross_entropy's reduction is 'mean' or 'sum', got {op.attr('reduction')!r}",
                    "the loss is one scalar: reduction='none' is for a sum or mean taken afterwards")
    smoothing = op.attr("label_smoothing", 0.0)
    if not 0.0 <= smoothing <= 1.0:
        raise _fail(op, f"cross_entropy's label_smoothing is between 0 and 1, got {smoothing}")
    _class_weights(op, graph.dim(logits.dims[-1]))
    return TensorType(())


def _class_weights(op: Op, classes: int) -> None:
    """cross_entropy's `weight`: one number per class, or none."""
    from fivedc.ir.ops import parse_freqs

    text = op.attr("weight", "")
    try:
        count = len(parse_freqs(text)) if text else classes
    except ValueError:
        raise _fail(op, f"cross_entropy's weight is numbers separated by commas, got {text[:40]!r}") from None
    if count != classes:
        raise _fail(op, f"cross_entropy's weight has {count} numbers for {classes} classes", "give one per class")


def _aten(op: Op, types: ArgTypes, graph: Graph) -> TensorType:
    """The result's dims from the `out` layout, checked by calling the operator on meta
    tensors of the arguments' shapes (fivedc/ir/aten_call.py)."""
    from fivedc.ir.aten_call import AtenCallError, arg_layouts, check_rule, meta_type, out_layout

    try:
        layouts, out = arg_layouts(op), out_layout(op)
        for index, (t, layout) in enumerate(zip(types, layouts)):
            if t is None:
                raise _fail(op, f"argument {index} must be a tensor, not a number (numbers go in its call)")
            if sorted(d for group in layout for d in group) != sorted(t.dims):
                raise _fail(op, f"argument {index} {_fmt(t)} is laid out as {op.attr('layouts')!r}: other dims")
        unknown = [d for group in out for d in group if d not in dict(graph.dims)]
        if unknown:
            raise _fail(op, f"its result names unknown dims {', '.join(unknown)}")
        shape, dtype = meta_type(op, types, graph.dim)
        check_rule(op, graph.dim)
    except AtenCallError as error:
        raise _fail(op, error.message) from None
    want = tuple(math.prod(graph.dim(d) for d in group) for group in out)
    if shape != want:
        raise _fail(op, f"{op.attr('target')} gives shape {list(shape)} on these arguments, but the op says "
                        f"{list(want)} ({op.attr('out')})")
    dims = tuple(d for group in out for d in group)
    if len(set(dims)) != len(dims):
        raise _fail(op, f"the result {_fmt(TensorType(dims))} would name a dim twice")
    return TensorType(dims, DType.FLOAT if dtype.is_floating_point else DType.INT)


def _moe(op: Op, types: ArgTypes, graph: Graph) -> TensorType:
    x = _tensor(op, types, 0)
    router = _tensor(op, types, 1)
    hidden = x.dims[-1]
    if len(router.dims) != 2 or router.dims[0] != hidden:
        raise _fail(op, f"router {_fmt(router)} must be [{hidden}, experts]")
    experts = router.dims[1]
    weights = [_tensor(op, types, i) for i in range(2, len(types))]
    ffn = set()
    for w in weights:
        if len(w.dims) != 3 or w.dims[0] != experts or hidden not in (w.dims[1], w.dims[2]):
            raise _fail(op, f"expert weight {_fmt(w)} must be [{experts}, {hidden}, ffn] or [{experts}, ffn, {hidden}]")
        ffn.add(w.dims[2] if w.dims[1] == hidden else w.dims[1])
    if len(ffn) > 1:
        raise _fail(op, f"the expert weights name different ffn dims ({', '.join(sorted(ffn))})",
                    hint="w_gate, w_up and w_down share one ffn dim")
    top_k = op.attr("top_k", 2)
    n = graph.dim(experts)
    if not isinstance(top_k, int) or not 1 <= top_k <= n:
        raise _fail(op, f"top_k={top_k} must be between 1 and {experts}={n}",
                    hint=f"choose top_k in 1..{n}, or add experts")
    return x


ShapeRule = Callable[[Op, ArgTypes, Graph], TensorType]

# one rule per op family (fivedc/ir/ops.py says which ops each family holds)
SHAPE_RULES: dict[str, ShapeRule] = by_family({
    OpFamily.EMBEDDING: _embedding,
    OpFamily.LINEAR: _linear,
    OpFamily.ELEMENTWISE: _elementwise,
    OpFamily.UNARY: _unary,
    OpFamily.STATE_ADD: _unary,
    OpFamily.SWIGLU: _swiglu,
    OpFamily.NORM: _norm,
    OpFamily.ROPE: _rope,
    OpFamily.ATTENTION: _attention,
    OpFamily.CROSS_ENTROPY: _cross_entropy,
    OpFamily.MOE: _moe,
    OpFamily.ATEN: _aten,
}, table="SHAPE_RULES")


@dataclass(frozen=True, slots=True)
class InferShapes:
    """Fill `Op.type` for every op; check dims agree and the output is a scalar."""

    name: ClassVar[str] = "infer-shapes"
    purpose: ClassVar[str] = "every value's dims and dtype from the ops' shape rules"

    def run(self, graph: Graph, options: CompileOptions) -> Graph:
        env: dict[str, TensorType] = {i.name: i.type for i in graph.inputs}
        body = self._block(graph.body, env, graph)
        loss = env[graph.output]
        if loss.dims or loss.dtype != DType.FLOAT:
            raise ShapeError(f"the model must return a float scalar loss; {graph.output!r} is {loss}", loc=graph.loc)
        return replace(graph, body=body)

    def _block(self, block: Block, env: dict[str, TensorType], graph: Graph) -> Block:
        env.update({p.name: TensorType(p.dims) for p in block.params})
        items = []
        for item in block.items:
            if isinstance(item, Repeat):
                env.update(zip(item.body.args, (env[c] for c in item.carried)))
                body = self._block(item.body, env, graph)
                for arg, out in zip(body.args, body.yields):
                    if env[arg] != env[out]:
                        raise ShapeError(
                            f"repeat {item.name}: a carried value enters as {env[arg]} and leaves as {env[out]}",
                            loc=item.loc,
                        )
                env.update(zip(item.results, (env[y] for y in body.yields)))
                items.append(replace(item, body=body))
            else:
                types = [None if a is None else env[a] for a in item.arg_names]  # None: a number literal
                out = SHAPE_RULES[item.kind](item, types, graph)
                env[item.out] = out
                items.append(replace(item, type=out))
        return replace(block, items=tuple(items))
