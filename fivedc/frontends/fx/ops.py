"""The op table of the fx frontend: which handler lowers which op, and the small handlers.

`dispatch` first folds what does not depend on inputs or parameters (shape
arithmetic, `arange`, masks) to its example value, answers shape queries
(`x.size(1)`) from the example run, then routes by canonical op name
(`fivedc.frontends.fx.recognise.op_name`) to a handler: elementwise ops and activations here,
views and transposes here (they only change the torch layout), layer-sized ops in
`fivedc/frontends/fx/layers.py` (attention in `attention_lower.py`). An op without a handler, or a use its handler does not follow
(`Unrecognised`), runs replicated as its ATen call (`fivedc/frontends/fx/generic.py`) where it
is one; otherwise it is a `NotSupportedError` that names it and the user's line.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.fx as fx
from torch import nn

from fivedc.frontends.fx import attention_lower, layers, losses
from fivedc.frontends.fx.moe_lower import moe_block
from fivedc.frontends.fx.build import DParam
from fivedc.frontends.fx.layers import arg
from fivedc.frontends.fx.generic import aten_call_of, broadcast, generic, leaves
from fivedc.frontends.fx.values import (DYNAMIC, SHAPE_QUERIES, SIZE_ONE_HINT, Const, Frame, ParamRef, Pending,
                              RouterLogits, T, TransposedParam, Unrecognised)

if TYPE_CHECKING:  # the walk that calls these handlers (it imports this module)
    from fivedc.frontends.fx.lower import Lowering
from fivedc.frontends.fx.buffer_writes import buffer_write, is_buffer_write
from fivedc.frontends.fx.recognise import CASTS
from fivedc.ir.graph import DType
from fivedc.ir.ops import OP_SPECS, POINTWISE, OpFamily

_HINTS = {
    "softmax": "softmax is understood only inside attention: softmax(q @ k.transpose(-2, -1) / sqrt(d)) @ v "
               "(or use F.scaled_dot_product_attention)",
    "pow": "powers are understood only inside RMSNorm: x * rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w",
    "mean": "means are understood only inside RMSNorm: x * rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w",
    "rsqrt": "rsqrt is understood only inside RMSNorm: x * rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w",
    "cat": "concatenation is understood only inside a rotary module (class name containing 'Rotary')",
}

_DEFAULT_HINT = (
    "the IR computes with " + ", ".join(OP_SPECS) + " (fivedc/ir/ops.py); write this step with what maps to "
    "those (see fivedc/frontends/fx_module.py for what the frontend recognises), or leave it out of forward"
)


def dispatch(lw: Lowering, frame: Frame, node: fx.Node):
    values = frame.traced.values
    if node.op == "get_attr":
        value = values.get(node)
        if isinstance(value, nn.Parameter):
            return ParamRef(str(node.target), value)
        return Const(value) if isinstance(value, torch.Tensor) else value
    args, kwargs = fx.node.map_arg((node.args, node.kwargs), lambda n: frame.syms[n])
    name = lw.op_name(frame, node)
    if name == "getitem" and isinstance(args[0], (tuple, list)):  # unpacking (`out, logits = moe(x)`) uses nothing
        item = args[0][args[1]]
        return Const(item) if isinstance(item, torch.Tensor) else item
    if name not in SHAPE_QUERIES and not (name == "getattr" and args[1] in SHAPE_QUERIES):
        used = next((a for a in leaves((args, kwargs)) if isinstance(a, RouterLogits)), None)
        if used is not None:
            raise lw.logits_used(used, node)
    if is_buffer_write(node):  # `buffer.add_(value)`: a state of the plan (fivedc/frontends/fx/buffer_writes.py)
        return buffer_write(lw, frame, node, args, kwargs)
    stateful = node.op == "call_module" and any(True for _ in frame.traced.gm.get_submodule(node.target).parameters())
    if not stateful and not any(isinstance(a, DYNAMIC) for a in leaves((args, kwargs))):
        value = values.get(node)
        return Const(value) if isinstance(value, torch.Tensor) else value
    if name in SHAPE_QUERIES or (name == "getattr" and args[1] in SHAPE_QUERIES):
        return values.get(node)
    value = values.get(node)
    if isinstance(value, torch.Tensor) and value.numel() == 0:  # an empty slice (a rotary over all of
        return Const(value)  # head_dim leaves no pass-through part): nothing to compute, a `cat` drops it
    handler = HANDLERS.get(name)
    try:
        if handler is None:
            raise lw.unsupported(node, _describe(frame, node), _HINTS.get(name or "", _DEFAULT_HINT))
        return handler(lw, frame, node, args, kwargs)
    except Unrecognised as error:  # no rule: kept as the ATen call it is, replicated, where it is one
        call = aten_call_of(node)
        kept = generic(lw, frame, node, call, reason=_reason(frame, node, error)) if call is not None else None
        if kept is None:
            raise
        return kept


def _reason(frame: Frame, node: fx.Node, error: Unrecognised) -> str:
    what = error.message.removeprefix("not supported by the fx frontend: ")
    return f"no sharding rule for {what.rsplit(' (fx node', 1)[0]}"


def _describe(frame: Frame, node: fx.Node) -> str:
    if node.op == "call_module":
        m = frame.traced.gm.get_submodule(node.target)
        return f"module {type(m).__module__}.{type(m).__qualname__} ({node.target})"
    if node.op == "call_method":
        return f"Tensor.{node.target}"
    target = node.target
    if isinstance(target, torch._ops.OpOverload):
        return f"{target.namespace}.{target.overloadpacket.__name__}.{target._overloadname}"
    return f"{getattr(target, '__module__', '') or ''}.{getattr(target, '__name__', str(target))}".lstrip(".")


# ---- elementwise ------------------------------------------------------------------------
def _number(value) -> float | None:
    if isinstance(value, Const) and value.value.numel() == 1:
        value = value.value.item()
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return float(value)
    return None


def binary(kind: str):
    def handler(lw: Lowering, frame: Frame, node: fx.Node, args, kwargs) -> T:
        if kwargs.get("alpha", 1) != 1 or kwargs.get("rounding_mode") is not None or len(args) < 2:
            raise lw.unsupported(node, f"{kind} with alpha or rounding_mode")
        a, b = args[0], args[1]
        na, nb = _number(a), _number(b)
        if nb is not None:
            x = lw.tensor(frame, a, node)
            if x.dtype == DType.INT:
                raise lw.unsupported(node, f"{kind} of integer tensors")
            return T(lw.emit(frame, node, kind, (x.ref, nb), x.ir), x.ir, x.layout)
        if na is not None:
            x = lw.tensor(frame, b, node)
            if x.dtype == DType.INT:
                raise lw.unsupported(node, f"{kind} of integer tensors")
            if kind == "div":
                raise lw.unsupported(node, "a number divided by a tensor")
            if kind == "sub":
                neg = lw.emit(frame, node, "mul", (x.ref, -1.0), x.ir)
                return T(lw.emit(frame, node, "add", (neg, na), x.ir), x.ir, x.layout)
            if not POINTWISE[kind].commutative:
                raise lw.unsupported(node, f"{kind} of a number and a tensor (the number first)")
            return T(lw.emit(frame, node, kind, (x.ref, na), x.ir), x.ir, x.layout)
        ta, tb = lw.tensor(frame, a, node), lw.tensor(frame, b, node)
        if DType.INT in (ta.dtype, tb.dtype):
            raise lw.unsupported(node, f"{kind} of integer tensors")
        if POINTWISE[kind].commutative and isinstance(ta.ref, DParam) and not isinstance(tb.ref, DParam):
            ta, tb = tb, ta  # the activation first, as the sharding rules want it
        layout = broadcast(lw, node, lw.groups(ta), lw.groups(tb))
        ia, ib = lw.ir(ta), lw.ir(tb)
        big, small = (ia, ib) if len(ia) >= len(ib) else (ib, ia)
        if not set(small) <= set(big):
            raise lw.unsupported(node, f"{kind} where each operand has dims the other lacks (a broadcast that grows both)")
        return T(lw.emit(frame, node, kind, (ta.ref, tb.ref), big), big, layout)

    return handler


def unary(kind: str):
    """An activation; its attributes (gelu's approximate) are the module's attributes of those
    names, or the function's arguments after x, by position or keyword."""
    spec_attrs = OP_SPECS[kind].attrs

    def handler(lw: Lowering, frame: Frame, node: fx.Node, args, kwargs) -> T:
        x = lw.tensor(frame, args[0], node)
        module = frame.traced.gm.get_submodule(node.target) if node.op == "call_module" else None
        attrs = tuple((name, type(default)(getattr(module, name, default) if module is not None
                                           else arg(args, kwargs, 1 + i, name, default)))
                      for i, (name, default) in enumerate(spec_attrs))
        return T(lw.emit(frame, node, kind, (x.ref,), x.ir, attrs), x.ir, x.layout)

    return handler


def neg(lw: Lowering, frame: Frame, node: fx.Node, args, kwargs) -> T:
    x = lw.tensor(frame, args[0], node)
    return T(lw.emit(frame, node, "mul", (x.ref, -1.0), x.ir), x.ir, x.layout)


def swiglu(lw: Lowering, frame: Frame, node: fx.Node, args, kwargs) -> T:
    gate, up = lw.tensor(frame, args[0], node), lw.tensor(frame, args[1], node)
    layout = broadcast(lw, node, lw.groups(gate), lw.groups(up))
    if lw.ir(gate) != lw.ir(up):
        raise lw.unsupported(node, "silu(a) * b where a and b differ in shape or dim order")
    return T(lw.emit(frame, node, "swiglu", (gate.ref, up.ref), gate.ir), gate.ir, layout)


def identity(lw: Lowering, frame: Frame, node: fx.Node, args, kwargs):
    kind = lw.op_name(frame, node)
    value = frame.traced.values.get(node)
    if isinstance(args[0], T) and isinstance(value, torch.Tensor) and \
            value.is_floating_point() != (args[0].dtype == DType.FLOAT):  # the plan's dtype decides only floats'
        raise lw.unsupported(node, "a cast between integers and floating point")
    if kind == "dropout":
        m = frame.traced.gm.get_submodule(node.target) if node.op == "call_module" else None
        p = m.p if m is not None else arg(args, kwargs, 1, "p", 0.5)
        training = m.training if m is not None else arg(args, kwargs, 2, "training", True)
        if p and training:
            lw.warn(node, f"dropout (p={p}) is dropped: fivedc's IR has no dropout")
    x = args[0]
    return x if isinstance(x, (Pending, T)) else lw.tensor(frame, x, node)


# ---- layout ops: no IR op, a new torch layout -----------------------------------------------
def view(lw: Lowering, frame: Frame, node: fx.Node, args, kwargs) -> T:
    x = lw.tensor(frame, args[0], node)
    shape = tuple(frame.traced.values[node].shape)
    try:
        layout = lw.dims.regroup(x.layout, shape, tokens=lw.tokens())
    except Exception as error:
        raise lw.unsupported(node, f"a view or reshape to {shape}: {error}") from None
    return T(x.ref, x.ir, layout, x.dtype)


def transpose(lw: Lowering, frame: Frame, node: fx.Node, args, kwargs) -> T | ParamRef | TransposedParam:
    kind = lw.op_name(frame, node)
    n = frame.traced.values[node].dim()
    if kind == "permute":
        order = args[1] if len(args) == 2 and isinstance(args[1], (list, tuple)) else args[1:] or kwargs.get("dims")
        order = [d % n for d in order]
    elif kind == "movedim":  # x.movedim(1, -1): the dims named move, the others keep their order
        source, destination = arg(args, kwargs, 1, "source"), arg(args, kwargs, 2, "destination")
        source, destination = [[d % n for d in (v if isinstance(v, (list, tuple)) else [v])] for v in (source, destination)]
        order = [None] * n
        for src, dst in zip(source, destination):
            order[dst] = src
        rest = iter(d for d in range(n) if d not in source)
        order = [next(rest) if d is None else d for d in order]
    else:
        if kind in ("t", "getattr"):
            d0, d1 = n - 2, n - 1
        else:
            d0, d1 = arg(args, kwargs, 1, "dim0") % n, arg(args, kwargs, 2, "dim1") % n
        order = list(range(n))
        order[d0], order[d1] = order[d1], order[d0]
    if isinstance(args[0], ParamRef) and n == 2:  # w.T: a linear's weight, if a matmul takes it
        return TransposedParam(args[0]) if order == [1, 0] else args[0]
    x = lw.tensor(frame, args[0], node)
    return T(x.ref, x.ir, tuple(x.layout[i] for i in order), x.dtype)


def unsqueeze(lw: Lowering, frame: Frame, node: fx.Node, args, kwargs) -> T:
    x = lw.tensor(frame, args[0], node)
    dim = arg(args, kwargs, 1, "dim")
    dim = dim % (len(x.layout) + 1)
    return T(x.ref, x.ir, x.layout[:dim] + ((),) + x.layout[dim:], x.dtype)


def squeeze(lw: Lowering, frame: Frame, node: fx.Node, args, kwargs) -> T:
    x = lw.tensor(frame, args[0], node)
    dim = arg(args, kwargs, 1, "dim")
    dims = range(len(x.layout)) if dim is None else [d % len(x.layout) for d in (dim if isinstance(dim, (list, tuple)) else [dim])]
    named = [a for d in dims if lw.dims.numel(x.layout[d]) == 1 for a in lw.dims.leaves(x.layout[d])]
    if named:
        raise lw.unsupported(node, f"squeeze of a model dim of size 1 ({lw.describe(named)}): the IR keeps every "
                             "dim, so the tensors after it would not match", SIZE_ONE_HINT)
    return T(x.ref, x.ir, tuple(g for i, g in enumerate(x.layout) if i not in dims or g), x.dtype)


def getitem(lw: Lowering, frame: Frame, node: fx.Node, args, kwargs):
    base, index = args[0], args[1]
    if isinstance(base, (tuple, list)):
        return base[index]
    x = lw.tensor(frame, base, node)
    index = list(index) if isinstance(index, tuple) else [index]
    if Ellipsis in index:
        at = index.index(Ellipsis)
        used = sum(1 for item in index if item is not None and item is not Ellipsis)
        index[at : at + 1] = [slice(None)] * (len(x.layout) - used)
    layout, i = [], 0
    for item in index:
        if item is None:
            layout.append(())
            continue
        full = isinstance(item, slice) and item.step in (None, 1) and (item.start or 0) == 0 and \
            (item.stop is None or item.stop >= lw.dims.numel(x.layout[i]))
        if not full:
            raise lw.unsupported(node, f"indexing or slicing a tensor with {item!r}")
        layout.append(x.layout[i])
        i += 1
    return T(x.ref, x.ir, tuple(layout) + x.layout[i:], x.dtype)


def getattr_(lw: Lowering, frame: Frame, node: fx.Node, args, kwargs):
    if args[1] in ("T", "mT"):
        return transpose(lw, frame, node, args, kwargs)
    raise lw.unsupported(node, f"attribute .{args[1]} of a tensor")


def expand(lw: Lowering, frame: Frame, node: fx.Node, args, kwargs) -> T:
    x = lw.tensor(frame, args[0], node)
    if tuple(frame.traced.values[node].shape) != tuple(frame.traced.values[node.args[0]].shape):
        raise lw.unsupported(node, "expand that grows a dim",
                             "for grouped-query attention use k.repeat_interleave(n_rep, dim=1) or enable_gqa=True")
    return x


HANDLERS = {
    **{k: binary(k) if OP_SPECS[k].family == OpFamily.ELEMENTWISE else unary(k) for k in POINTWISE},
    "neg": neg, "swiglu": swiglu,
    **dict.fromkeys((*CASTS, "dropout"), identity),
    **dict.fromkeys(("view", "reshape", "flatten", "unflatten", "view_as", "reshape_as"), view),
    **dict.fromkeys(("transpose", "swapaxes", "permute", "t", "movedim"), transpose),
    "unsqueeze": unsqueeze, "squeeze": squeeze, "getitem": getitem, "getattr": getattr_, "expand": expand,
    "expand_as": expand,
    "linear": layers.linear, "matmul": layers.matmul, "addmm": layers.addmm, "split": layers.split, "chunk": layers.split,
    "embedding": layers.embedding, "layer_norm": layers.layer_norm, "rms_norm": layers.rms_norm, "rope": layers.rope,
    "moe": moe_block,
    "sdpa": attention_lower.attention, "repeat_interleave": attention_lower.repeat_interleave,
    "cross_entropy": losses.cross_entropy,
}
