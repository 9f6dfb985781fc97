"""The fx frontend's fallback: an op it has no handler for becomes a replicated `aten` op.

Where `fivedc/fx/ops.py` has no handler for an op, or its handler does not
understand this use of it (a slice that is not the whole dim, an integer
comparison), the op is kept as the ATen call it is (`fivedc/aten_call.py`): its
tensor arguments as IR values with the torch layout the operator saw, every other
argument written into the call. The result is a new tensor whose dims are new atoms
(one per torch dim); later ops unify them with the model's dims as usual, so a
shifted label tensor `[batch, seq]` meets the logits' batch and sequence at the
loss. Only ATen calls can be kept: the export path's nodes carry theirs
(`meta["aten"]`, `fivedc/fx/export.py`); a torch-level op of the symbolic path
cannot, and the model is captured again with torch.export (`frontend_fx.py`).
"""

from __future__ import annotations

import operator
from typing import TYPE_CHECKING

import torch
import torch.fx as fx

from fivedc.aten_call import AtenCallError, dtype_name, encode_call, resolve, target_name
from fivedc.fx.build import DOp, DValue
from fivedc.fx.locs import node_loc, scope
from fivedc.fx.values import Const, Frame, Pending, ParamRef, RepeatedKV, RouterLogits, T
from fivedc.ir import DType

if TYPE_CHECKING:
    from fivedc.fx.lower import Lowering


def aten_call_of(node: fx.Node):
    """(overload, args, kwargs) of the ATen call this node is, in fx nodes; None when it is none."""
    target, args, kwargs = node.meta.get("aten") or (node.target, node.args, node.kwargs)
    if isinstance(target, torch._ops.OpOverload) and target.namespace == "aten":
        return target, args, kwargs
    return None


def generic(lw: Lowering, frame: Frame, node: fx.Node, call, reason: str) -> T | None:
    """The replicated `aten` op for `node`; None when its ATen call reads values a pattern
    rewrote away (the caller reports why the node has no rule)."""
    overload, call_args, call_kwargs = call
    used = []
    fx.node.map_arg((call_args, call_kwargs), used.append)
    if any(n not in frame.syms for n in used):
        return None
    value_args, value_kwargs = fx.node.map_arg((call_args, call_kwargs), frame.traced.values.get)
    try:
        target = target_name(overload)
        resolve(target, value_args, value_kwargs)
    except AtenCallError as error:
        raise lw.unsupported(node, f"{error.message} (no sharding rule either: {reason})") from None
    value = frame.traced.values.get(node)
    items = list(value) if isinstance(value, (tuple, list)) else [value]
    if not items or not all(isinstance(v, torch.Tensor) for v in items):
        raise lw.unsupported(node, f"{target} returning {type(value).__name__} (no sharding rule: {reason})",
                             "a replicated op must return tensors")
    syms_args, syms_kwargs = fx.node.map_arg((call_args, call_kwargs), lambda n: frame.syms[n])
    tensors: list[T] = []

    def slot(obj):  # a tensor argument: the IR value holding it
        if isinstance(obj, (T, Pending, ParamRef, RepeatedKV, RouterLogits)):
            tensors.append(lw.tensor(frame, obj, node))
            return len(tensors) - 1
        return None

    def unwrap(obj):  # constant tensors as they are: the call holds them (small ones only)
        if isinstance(obj, Const):
            return obj.value
        if isinstance(obj, (list, tuple)):
            return type(obj)(unwrap(o) for o in obj)
        return obj

    try:
        text = encode_call(unwrap(tuple(syms_args)), {k: unwrap(v) for k, v in syms_kwargs.items()}, slot)
    except AtenCallError as error:
        raise lw.unsupported(node, f"{target}: {error.message}") from None
    dtypes = _arg_dtypes(frame, call_args, call_kwargs, tensors)
    outs = []
    wanted = _items_used(node, len(items))
    for index, item in enumerate(items):  # an op returning several tensors: one IR op per result used
        if index not in wanted:
            outs.append(None)
            continue
        atoms = tuple(lw.dims.new(s) for s in item.shape)
        dtype = DType.FLOAT if item.is_floating_point() else DType.INT
        out = DValue(node.name, atoms, dtype)
        attrs = (("target", target), ("call", text), ("dtypes", ";".join(dtypes)), ("reason", reason))
        attrs += (("item", index),) if isinstance(value, (tuple, list)) else ()
        frame.block.items.append(DOp(out, "aten", tuple(t.ref for t in tensors), attrs, node_loc(node), scope(node),
                                     layouts=(tuple(t.layout for t in tensors), tuple((a,) for a in atoms))))
        outs.append(T(out, atoms, tuple((a,) for a in atoms), dtype))
    return tuple(outs) if isinstance(value, (tuple, list)) else outs[0]


def _items_used(node: fx.Node, n: int) -> set[int]:
    """Which results of a call the graph reads (`values, _ = x.sort()` reads one)."""
    if all(u.op == "call_function" and u.target is operator.getitem and isinstance(u.args[1], int) for u in node.users):
        return {u.args[1] % n for u in node.users}
    return set(range(n))


def _arg_dtypes(frame: Frame, call_args, call_kwargs, tensors: list[T]) -> list[str]:
    """The example dtypes of the tensor arguments, in order (an integer tensor may be a bool mask)."""
    found = []

    def visit(a):
        if isinstance(a, fx.Node):
            v = frame.traced.values.get(a)
            if isinstance(v, torch.Tensor) and not isinstance(frame.syms.get(a), Const):
                found.append(dtype_name(v.dtype))
        return a

    fx.node.map_aggregate((call_args, call_kwargs), visit)
    if len(found) == len(tensors):
        return found
    return ["float" if t.dtype == DType.FLOAT else "int64" for t in tensors]
