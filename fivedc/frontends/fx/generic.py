"""The fx frontend's fallback: an op it has no handler for becomes an `aten` op.

Where `fivedc/frontends/fx/ops.py` has no handler for an op, or its handler does not
understand this use of it (a slice that is not the whole dim, an integer
comparison), the op is kept as the ATen call it is (`fivedc/ir/aten_call.py`): its
tensor arguments as IR values with the torch layout the operator saw, every other
argument written into the call.

Where torch says the operator is pointwise, or it is a reduction, scan or slice
along some dims (`fivedc.ir.aten_call.local_rule`), it runs on shards: its result's
dims are its arguments' (broadcast, or those it runs along dropped or new), so the
sequence and batch dims flow through it and the op keeps their splits. Otherwise it
runs replicated, and its result is a new tensor whose dims are new atoms (one per
torch dim of size above 1); later ops unify them with the model's dims as usual, so
a shifted label tensor `[batch, seq]` meets the logits' batch and sequence at the
loss.

Only ATen calls can be kept: the export path's nodes carry theirs (`meta["aten"]`,
`fivedc/frontends/fx/export.py`); a torch-level op of the symbolic path cannot, and the model
is captured again with torch.export (`fivedc/frontends/fx_module.py`).
"""

from __future__ import annotations

import operator
from typing import TYPE_CHECKING

import torch
import torch.fx as fx

from fivedc.ir.aten_call import PADS, AtenCallError, bind, dtype_name, encode_call, local_rule, resolve, target_name
from fivedc.frontends.fx.build import DOp, DValue
from fivedc.frontends.fx.locs import node_loc, scope
from fivedc.frontends.fx.values import (SIZE_ONE_HINT, Const, Frame, Pending, ParamRef, RepeatedKV, RouterLogits, T,
                                       TransposedParam, Unrecognised)
from fivedc.ir.graph import DType

if TYPE_CHECKING:
    from fivedc.frontends.fx.lower import Lowering


def aten_call_of(node: fx.Node):
    """(overload, args, kwargs) of the ATen call this node is (or of a library's custom operator),
    in fx nodes; None when it is none."""
    target, args, kwargs = node.meta.get("aten") or (node.target, node.args, node.kwargs)
    if isinstance(target, torch._ops.OpOverload) and target.namespace not in ("fivedc", "higher_order"):
        return target, args, kwargs
    return None


def generic(lw: Lowering, frame: Frame, node: fx.Node, call, reason: str) -> T | None:
    """The replicated `aten` op for `node`; None when its ATen call reads values a pattern
    rewrote away (the caller reports why the node has no rule)."""
    overload, call_args, call_kwargs = call
    if overload is torch.ops.aten.cat.default and call_args and isinstance(call_args[0], (list, tuple)):
        kept = [n for n in call_args[0] if not _empty(frame, n)]  # empty tensors add nothing to a cat
        if len(kept) == 1 and isinstance(frame.syms.get(kept[0]), T):
            return frame.syms[kept[0]]
        call_args = (kept, *call_args[1:])
    used = []
    fx.node.map_arg((call_args, call_kwargs), used.append)
    if any(n not in frame.syms for n in used):
        return None
    value_args, value_kwargs = fx.node.map_arg((call_args, call_kwargs), frame.traced.values.get)
    target = _resolved_target(lw, node, overload, value_args, value_kwargs, reason)
    value = frame.traced.values.get(node)
    items = _result_tensors(lw, node, target, value, reason)
    syms_args, syms_kwargs = fx.node.map_arg((call_args, call_kwargs), lambda n: frame.syms[n])
    syms_args = _kept_sizes(overload, syms_args, value_args)
    text, tensors = _encoded_call(lw, frame, node, target, syms_args, syms_kwargs)
    dtypes = _arg_dtypes(frame, call_args, call_kwargs, tensors)
    consts = [c.value for c in leaves((syms_args, syms_kwargs)) if isinstance(c, Const)]
    local = _local(lw, node, overload, value_args, value_kwargs, tensors, consts, items)
    if local:  # it has a sharding rule: the ATen operator's own
        reason = reason.replace("no sharding rule for ", "no IR op for ", 1)
    attrs = (("target", target), ("call", text), ("dtypes", ";".join(dtypes)), ("reason", reason)) + _rule_attrs(local)
    several = isinstance(value, (tuple, list))
    outs = _append_results(lw, frame, node, tensors, items, local, attrs, several=several)
    _keep_tokens_whole(lw, tensors)
    return tuple(outs) if several else outs[0]


def _resolved_target(lw: Lowering, node: fx.Node, overload, value_args, value_kwargs, reason: str) -> str:
    """The ATen operator's name, its call resolved on the example values (else an error saying why)."""
    try:
        target = target_name(overload)
        resolve(target, value_args, value_kwargs)
    except AtenCallError as error:
        raise lw.unsupported(node, f"{error.message} (no sharding rule either: {reason})") from None
    return target


def _result_tensors(lw: Lowering, node: fx.Node, target: str, value, reason: str) -> list[torch.Tensor]:
    """The example results of the call, one or several; a replicated op must return tensors."""
    items = list(value) if isinstance(value, (tuple, list)) else [value]
    if not items or not all(isinstance(v, torch.Tensor) for v in items):
        raise lw.unsupported(node, f"{target} returning {type(value).__name__} (no sharding rule: {reason})",
                             "a replicated op must return tensors")
    return items


def _encoded_call(lw: Lowering, frame: Frame, node: fx.Node, target: str, syms_args,
                  syms_kwargs) -> tuple[str, list[T]]:
    """The call as text (`encode_call`) and the IR values its tensor arguments' slots hold, in order."""
    tensors: list[T] = []

    def slot(obj):  # a tensor argument: the IR value holding it
        if isinstance(obj, (T, Pending, ParamRef, TransposedParam, RepeatedKV, RouterLogits)):
            tensors.append(lw.tensor(frame, obj, node))
            return len(tensors) - 1
        return None

    try:
        text = encode_call(_unwrap(tuple(syms_args)), {k: _unwrap(v) for k, v in syms_kwargs.items()}, slot)
    except AtenCallError as error:
        raise lw.unsupported(node, f"{target}: {error.message}") from None
    return text, tensors


def _unwrap(obj):
    """Constant tensors as they are: the call holds them (small ones only)."""
    if isinstance(obj, Const):
        return obj.value
    if isinstance(obj, (list, tuple)):
        return type(obj)(_unwrap(o) for o in obj)
    return obj


def _rule_attrs(local) -> tuple:
    """The op's rule attributes: `_local`'s rule with the dims it runs along and its rows, or replicated."""
    if not local:
        return (("rule", "replicated"),)
    return (("rule", local[0]),) + ((("along", ",".join(map(str, local[1]))),) if local[1] else ()) \
        + ((("rows", ",".join(map(str, local[3]))),) if local[3] else ())


def _append_results(lw: Lowering, frame: Frame, node: fx.Node, tensors: list[T], items: list, local, attrs: tuple,
                    *, several: bool) -> list[T | None]:
    """One IR op per result the graph reads (None for the others), appended to the frame's block."""
    outs: list[T | None] = []
    wanted = _items_used(node, len(items))
    for index, item in enumerate(items):
        if index not in wanted:
            outs.append(None)
            continue
        # replicated: new dims (a size-1 dim is a broadcast dim, not one of the model's)
        layout = local[2][index] if local else tuple((lw.dims.new(s),) if s != 1 else () for s in item.shape)
        atoms = tuple(a for group in layout for a in group)
        dtype = DType.FLOAT if item.is_floating_point() else DType.INT
        out = DValue(node.name, atoms, dtype)
        item_attrs = attrs + ((("item", index),) if several else ())
        frame.block.items.append(DOp(out, "aten", tuple(t.ref for t in tensors), item_attrs, node_loc(node),
                                     scope(node), layouts=(tuple(t.layout for t in tensors), layout)))
        outs.append(T(out, atoms, layout, dtype))
    return outs


def _keep_tokens_whole(lw: Lowering, tensors: list[T]) -> None:
    """The batch and sequence an ATen call reads stay one dim each: a later view that splits one
    (a loss's reshape into chunks of the sequence) runs as its own ATen call instead."""
    tokens = lw.tokens()
    for atom in {a for t in tensors for a in lw.ir(t) if lw.dims.find(a) in tokens}:
        lw.dims.keep_whole(atom)


def _empty(frame: Frame, node) -> bool:
    value = frame.traced.values.get(node) if isinstance(node, fx.Node) else None
    return isinstance(value, torch.Tensor) and value.numel() == 0


def _local(lw: Lowering, node: fx.Node, overload, args, kwargs, tensors: list[T], consts: list, items: list):
    """(rule, along, result layouts, rows) where the op can run on shards, else None (replicated).

    Pointwise: the result's layout is its tensor arguments' broadcast (their dims unified
    where torch lines them up); a constant tensor may take part only as one number. Along
    dims (a reduction, scan or slice): one tensor argument; its `dim` (all dims when it has
    none) is `along`; each result keeps the other dims, and along those it keeps the dim
    (softmax, cumsum), or has size 1 (keepdim), none (reduced away, select) or a new dim
    (topk's k, a slice). A pointwise op with a constant tensor (a table, a mask) cuts it,
    along the dims it spans, to the rows of the rank's shards (`rows`: the sequence's
    positions, the batch's first rows where every batch row is alike, any other dim's
    shard), and sees whole only a dim where a constant differs between batch rows; an op
    along dims of several tensors (a cat) takes them of one rank, their other dims one; an expand runs along the dims it grows. A matmul of two activations
    (`q @ k^T` written out): its batch dims and the first's rows (`_matmul_layout`)."""
    rule = local_rule(overload)
    if rule == "replicated" or not tensors:
        return None
    groups = [lw.groups(t) for t in tensors]
    try:
        if rule == "matmul":
            if consts or len(groups) != 2 or min(len(g) for g in groups) < 2 or len(items) != 1:
                return None
            layouts, along, rows = [_matmul_layout(lw, node, *groups)], (), ()
        elif rule == "pointwise":
            layout = groups[0]
            for other in groups[1:]:
                layout = broadcast(lw, node, layout, other)
            theirs = layout
            layout = _const_spanned(lw, layout, tuple(items[0].shape))
            layouts = [layout] * len(items)
            along = _spanned(consts, len(layout))
            if along is None:
                return None
            rows = tuple(i for i in along if theirs[i] and _cut_to_shards(lw, layout[i], len(layout) - i, consts))
        else:
            if consts or len({len(g) for g in groups}) != 1:
                return None
            along = _reduced_dims(overload, args, kwargs, len(groups[0]))
            for other in groups[1:]:  # several tensors (a cat): the dims it does not run along are one
                for i, (x, y) in enumerate(zip(groups[0], other)):
                    if i not in along and (x or y):
                        if not (x and y):
                            return None
                        lw.unify(x, y, node, "tensors that torch joins along another dim")
            layouts, rows = [reduced_layout(lw, groups[0], along, tuple(item.shape)) for item in items], ()
    except Unrecognised:
        return None
    for layout, item in zip(layouts, items):
        if layout is None or tuple(lw.dims.numel(g) for g in layout) != tuple(item.shape):
            return None
    return rule, along, layouts, rows


def _matmul_layout(lw: Lowering, node: fx.Node, a, b) -> tuple | None:
    """The result of `[..., m, k] @ [..., k, n]`: the broadcast batch dims, the first's m, and
    the second's n, or a new dim for it where its IR dims are among the others (`q @ k^T`,
    whose rows and columns are both the sequence); None where the dims do not come apart."""
    batch = broadcast(lw, node, a[:-2], b[:-2])
    n = b[-1]
    others = {leaf for group in batch + (a[-2],) for leaf in lw.dims.leaves(group)}
    if set(lw.dims.leaves(n)) & others:
        n = (lw.dims.new(lw.dims.numel(n)),) if lw.dims.numel(n) != 1 else ()
    layout = batch + (a[-2], n)
    leaves = [leaf for group in layout for leaf in lw.dims.leaves(group)]
    return layout if len(leaves) == len(set(leaves)) else None


def _const_spanned(lw: Lowering, layout: tuple, shape: tuple[int, ...]) -> tuple:
    """A pointwise result's layout where only a constant spans a dim (`arange(vocab) == target[..., None]`,
    a one-hot mask): a new dim there, which later ops unify with the model's (the logits' vocabulary); the
    op sees it whole (no argument holds a shard of it)."""
    if len(layout) != len(shape):
        return layout
    return tuple((lw.dims.new(size),) if not group and size != 1 else group for group, size in zip(layout, shape))


def _spanned(consts: list, ndim: int) -> tuple[int, ...] | None:
    """The torch dims of a pointwise op's result that a constant tensor in its call spans (size
    above 1, broadcast right-aligned): the op sees them whole. None where a constant has more dims."""
    spanned = set()
    for c in consts:
        if c.dim() > ndim:
            return None
        spanned.update(ndim - c.dim() + j for j, size in enumerate(c.shape) if size > 1)
    return tuple(sorted(spanned))


def _cut_to_shards(lw: Lowering, group: tuple[int, ...], from_end: int, consts: list) -> bool:
    """Whether the constants of a pointwise op can be cut, along a result dim they span (its
    atoms `group`, `from_end` dims from the last), to the rows of this rank's shard of each of
    its dims: yes, but where a constant differs from one batch row to the next (a microbatch
    does not know which rows of the batch it holds; rows alike, it takes the first)."""
    leaves = lw.dims.leaves(group)
    batch = set(lw.dims.leaves(tuple(lw.token_atoms[:1])))  # the first input's first dim
    sizes = [lw.dims.size(leaf) for leaf in leaves]
    for c in consts:
        j = c.dim() - from_end
        if j < 0 or c.shape[j] == 1 or not leaves:
            continue
        split = c.reshape(*c.shape[:j], *sizes, *c.shape[j + 1:])
        for k, leaf in enumerate(leaves):
            if leaf in batch and not torch.equal(split, split.narrow(j + k, 0, 1).expand_as(split)):
                return False
    return True


def _kept_sizes(overload, args: tuple, value_args: tuple) -> tuple:
    """An expand's sizes with -1 where it keeps its argument's size: run on a shard or on a
    microbatch, the call keeps the local size there (it grows only the dims it runs along)."""
    if overload.overloadpacket.__name__ != "expand" or len(args) < 2 or not isinstance(args[1], (list, tuple)):
        return args
    shape = tuple(value_args[0].shape)
    if len(args[1]) != len(shape):
        return args
    return (args[0], [-1 if size == have else size for size, have in zip(args[1], shape)], *args[2:])


def _reduced_dims(overload, args, kwargs, ndim: int) -> tuple[int, ...]:
    """The torch dims an op runs along: its `dim` argument, all when it has none; a pad's last
    len(pad) // 2 dims; the dims an expand grows; a norm's normalized_shape."""
    bound = bind(overload._schema, args, kwargs)
    if overload.overloadpacket.__name__ in PADS:
        return tuple(range(max(0, ndim - len(bound["pad"]) // 2), ndim))
    if "normalized_shape" in bound:  # a norm (its weight, if any, is a tensor argument of another rank)
        return tuple(range(ndim - len(bound["normalized_shape"]), ndim))
    if overload.overloadpacket.__name__ == "expand":
        shape, size = tuple(bound["self"].shape), list(bound["size"])
        if len(size) != ndim:
            return ()
        return tuple(i for i, (have, want) in enumerate(zip(shape, size)) if want not in (-1, have))
    dim = bound.get("dim")
    if dim is None or dim == []:
        return tuple(range(ndim))
    dims = dim if isinstance(dim, (list, tuple)) else [dim]
    if ndim == 0:
        return ()
    return tuple(sorted({int(d) % ndim for d in dims}))


def reduced_layout(lw: Lowering, groups, along: tuple[int, ...], shape: tuple[int, ...]):
    if not along:
        return None
    if len(shape) == len(groups):
        layout = []
        for i, (group, size) in enumerate(zip(groups, shape)):
            if i not in along or lw.dims.numel(group) == size:
                layout.append(group)  # kept (softmax, cumsum and sort keep the dim they run along)
            else:
                layout.append(() if size == 1 else (lw.dims.new(size),))  # keepdim, or topk's k
        return tuple(layout)
    if len(shape) == len(groups) - len(along):
        return tuple(g for i, g in enumerate(groups) if i not in along)
    return None


def broadcast(lw: Lowering, node: fx.Node, ga, gb) -> tuple:
    """The layout of a result torch broadcasts from operands laid out as `ga` and `gb`,
    right-aligned: dims both have are unified (`Unrecognised` where they cannot be)."""
    n = max(len(ga), len(gb))
    ga, gb = ((),) * (n - len(ga)) + tuple(ga), ((),) * (n - len(gb)) + tuple(gb)
    out = []
    for x, y in zip(ga, gb):
        one_x, one_y = lw.dims.numel(x) == 1, lw.dims.numel(y) == 1
        if x and y and one_x != one_y:  # a named dim of size 1 (a linear's one output feature) broadcast
            out.append(y if one_x else x)
            continue
        if x and y:
            lw.unify(x, y, node, "operands that torch broadcasts together")
            lx, ly = set(lw.dims.leaves(x)), set(lw.dims.leaves(y))
            if not (lx <= ly or ly <= lx):  # each holds a size-1 dim the other lacks: [1 head, d] + [batch 1, d]
                raise lw.unsupported(node, f"operands whose dims of size 1 ({lw.describe(lx ^ ly)}) do not line up",
                                     SIZE_ONE_HINT)
            x = x if lx >= ly else y  # the one that keeps a size-1 dim (a head) the other merged away
        out.append(x or y)
    return tuple(out)


def leaves(obj):
    """The non-container items of nested tuples, lists and dicts."""
    if isinstance(obj, (tuple, list)):
        for item in obj:
            yield from leaves(item)
    elif isinstance(obj, dict):
        for item in obj.values():
            yield from leaves(item)
    else:
        yield obj


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
