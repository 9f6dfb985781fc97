"""The kernel of the `aten` op kind (fivedc/ir/aten_call.py): the ATen call on this rank's tensors.

Each argument is laid out as the operator saw it at capture and the result goes back to
IR order. The sequence is put in global order where the operator reads it whole, and a
pointwise op's constants are cut, along the dims its `rows` name, to this rank's rows
(the sequence's positions, a head's shard, a microbatch's batch rows).
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from fivedc.ir.aten_call import (AtenCallError, arg_layouts, decode_call, from_torch, out_layout, pick, resolve,
                                 rows_of, to_torch, whole_dims)
from fivedc.ir.sharding import Sharding


def aten_kernel(ctx, op, args, dims):
    """An ATen operator (fivedc/ir/aten_call.py): each argument laid out as the operator saw it
    at capture, the result back in IR order. Replicated, it gets whole tensors with the
    sequence in global order; pointwise or along some dims, this rank's shards, the
    sequence put in global order only where it runs along it (then whole). A result's
    sequence computed in global order (whole, or new: a slice) goes back to layout order."""
    seq, whole = ctx.graph.seq_dim, whole_dims(op)
    order = ctx.seq_order() if whole is None or seq in whole or all(seq not in d for d in dims) else None
    sizes = dict(ctx.graph.dims)
    tensors = []
    names = str(op.attr("dtypes", "")).split(";")
    for t, t_dims, layout, name in zip(args, dims, arg_layouts(op), names + [""] * len(args)):
        sizes.update(zip(t_dims, t.shape))  # shards: the local sizes
        if order is not None and seq in t_dims:
            t = t.index_select(t_dims.index(seq), torch.argsort(order).to(t.device))
        t = to_torch(t, t_dims, layout)
        # the IR's integers are one kind: a tensor the operator saw as bool (a mask) is bool again
        tensors.append(t.bool() if name == "bool" and t.dtype != torch.bool else t)
    device = args[0].device if args else torch.device("cpu")
    call_args, call_kwargs = decode_call(str(op.attr("call")), tensors, device)
    if rows_of(op):
        call_args, call_kwargs = _constant_rows(ctx, op, sizes, tensors, order is not None, (call_args, call_kwargs))
    out = pick(op, resolve(str(op.attr("target")))(*call_args, **call_kwargs))
    out = from_torch(out, out_layout(op), sizes)
    if order is not None and seq in op.type.dims:
        out = out.index_select(op.type.dims.index(seq), order.to(out.device))
    return out


def _constant_rows(ctx, op, sizes, tensors, seq_in_order, call):
    """A pointwise op's call with its constants cut, along the result dims at its `rows`, to
    this rank's rows of each IR dim there (fivedc/ir/aten_call.py): the sequence's positions
    (in layout order, as the shard holds them), the batch's first rows (the frontend cuts
    there only constants alike in every batch row: a microbatch does not know its rows),
    any other dim's shard (in storage order)."""
    out, rows = out_layout(op), rows_of(op)
    picks = {d: _rows_of_dim(ctx, op, d, sizes[d], seq_in_order) for r in rows for d in out[r]}
    if all(p is None for p in picks.values()):
        return call  # every dim whole, in its own order: every row
    constants = []

    def cut(obj):
        if isinstance(obj, (list, tuple)):
            return type(obj)(cut(o) for o in obj)
        if isinstance(obj, dict):
            return {k: cut(v) for k, v in obj.items()}
        if isinstance(obj, Tensor) and not any(obj is t for t in tensors):
            for r in rows:
                j = r - (len(out) - obj.dim())
                if j >= 0 and obj.shape[j] > 1:
                    split = obj.reshape(*obj.shape[:j], *_whole(ctx, op, obj, j, out[r]), *obj.shape[j + 1:])
                    constants.extend((split, j + k) for k, d in enumerate(out[r]) if d == ctx.graph.batch_dim)
                    for k, d in enumerate(out[r]):
                        if picks[d] is not None:
                            split = split.index_select(j + k, picks[d].to(split.device))
                    obj = split.reshape(*split.shape[:j], -1, *split.shape[j + len(out[r]):])
        return obj

    call = cut(call)
    if picks.get(ctx.graph.batch_dim) is not None:
        key = ("alike along the batch", op.out, str(op.attr("call")))
        if key not in ctx._cache:  # once per op: the constants are the same at every call
            ctx._cache[key] = all(torch.equal(c, c.narrow(i, 0, 1).expand_as(c)) for c, i in constants)
        if not ctx._cache[key]:
            raise AtenCallError(f"aten op {op.out}: its `rows` cut a constant along the batch, but the "
                                f"constant differs between batch rows: the op must see the batch whole")
    return call


def _rows_of_dim(ctx, op, dim, local, seq_in_order):
    """The global rows of `dim` this rank holds (`local` of them), or None for all, in order."""
    graph, sharding = ctx.graph, op.sharding or Sharding()
    if local == graph.dim(dim) and (dim != graph.seq_dim or seq_in_order or ctx.seq_order() is None):
        return None
    if dim == graph.batch_dim:
        return torch.arange(local)
    start, stop = ctx.shard_range(dim, sharding)
    order = ctx.storage_order(dim, sharding)
    rows = torch.arange(start, stop) if order is None else order[start:stop]
    if len(rows) != local:
        raise AtenCallError(f"aten op {op.out}: {local} rows of {dim} here, but its sharding {sharding} "
                            f"gives {len(rows)}")
    return rows


def _whole(ctx, op, obj, j, group):
    """The sizes of the IR dims `group` that constant `obj` holds, row-major, at its dim j."""
    whole = [ctx.graph.dim(d) for d in group]
    if obj.shape[j] != math.prod(whole):
        raise AtenCallError(f"aten op {op.out}: a constant of {obj.shape[j]} rows where {'*'.join(group)} "
                            f"has {math.prod(whole)}")
    return whole
