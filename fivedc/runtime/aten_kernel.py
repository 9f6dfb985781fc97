"""The kernel of the `aten` op kind (fivedc/ir/aten_call.py): the ATen call on this rank's tensors.

Each argument is laid out as the operator saw it at capture and the result goes back to
IR order. The sequence is put in global order where the operator reads it whole, and a
pointwise op's constants are cut, along the sequence (`rows`), to this rank's positions.
"""

from __future__ import annotations

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
    for t, t_dims, layout in zip(args, dims, arg_layouts(op)):
        sizes.update(zip(t_dims, t.shape))  # shards: the local sizes
        if order is not None and seq in t_dims:
            t = t.index_select(t_dims.index(seq), torch.argsort(order).to(t.device))
        tensors.append(to_torch(t, t_dims, layout))
    device = args[0].device if args else torch.device("cpu")
    call_args, call_kwargs = decode_call(str(op.attr("call")), tensors, device)
    if rows_of(op) and order is None:
        call_args, call_kwargs = _constant_rows(ctx, op, args, dims, tensors, (call_args, call_kwargs))
    out = pick(op, resolve(str(op.attr("target")))(*call_args, **call_kwargs))
    out = from_torch(out, out_layout(op), sizes)
    if order is not None and seq in op.type.dims:
        out = out.index_select(op.type.dims.index(seq), order.to(out.device))
    return out


def _constant_rows(ctx, op, args, dims, tensors, call):
    """A pointwise op's call with its constants cut, at its `rows` (the sequence), to the
    positions of this rank's shard (in layout order, as the shard holds them): a table's row
    i meets the activations' position i (fivedc/ir/aten_call.py)."""
    seq = ctx.graph.seq_dim
    local = next(t.shape[d.index(seq)] for t, d in zip(args, dims) if seq in d)
    if local == ctx.graph.dim(seq) and ctx.seq_order() is None:
        return call  # the whole sequence, in its own order: every row
    positions = ctx.positions(seq, op.sharding or Sharding())
    if len(positions) != local:
        raise AtenCallError(f"aten op {op.out}: {local} positions of the sequence here, but its sharding "
                            f"{op.sharding} gives {len(positions)}")
    ndim, rows = len(out_layout(op)), rows_of(op)

    def cut(obj):
        if isinstance(obj, (list, tuple)):
            return type(obj)(cut(o) for o in obj)
        if isinstance(obj, dict):
            return {k: cut(v) for k, v in obj.items()}
        if isinstance(obj, Tensor) and not any(obj is t for t in tensors):
            for r in rows:
                j = r - (ndim - obj.dim())
                if j >= 0 and obj.shape[j] > 1:
                    obj = obj.index_select(j, positions.to(obj.device))
        return obj

    return cut(call)
