"""Values rearranged on this rank's shards, with no communication: each an `aten` op the fx
frontend writes itself (not one the model called), for an op that reads its input in
another layout than the torch one it was given.

- `in_memory_order`, `in_ir_order`: the IR dims put in a torch layout's order (a pointwise
  `aten.clone`, as `.contiguous()` after a transpose);
- `with_own_atom`: a size-1 torch dim made an IR dim of its own (Falcon's one k/v head);
- `merged`: a torch dim made of several IR dims made one new dim (a rotary embedding
  that split head_dim into pairs);
- `sliced_rows`: the rows of a position table that the sequence reads (`aten.slice`);
- `repeated`: k or v repeated over heads for attention written out by hand.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch.fx as fx

from fivedc.frontends.fx.build import DOp, DValue
from fivedc.frontends.fx.generic import reduced_layout
from fivedc.frontends.fx.locs import node_loc, scope
from fivedc.frontends.fx.values import Frame, RepeatedKV, T
from fivedc.ir.graph import DType

if TYPE_CHECKING:
    from fivedc.frontends.fx.lower import Lowering


def in_memory_order(lw: Lowering, frame: Frame, node: fx.Node, t: T) -> T:
    """`t` with its IR dims in its torch layout's order: itself where they are, else a
    pointwise `aten.clone` on shards (the data moved locally, no communication), as
    `.contiguous()` does after a transpose, for an op that reads the IR order (a linear
    contracting the last torch dim)."""
    return in_ir_order(lw, frame, node, t, lw.groups(t), "the torch layout's dims in memory order")


def in_ir_order(lw: Lowering, frame: Frame, node: fx.Node, t: T, groups: tuple[tuple[int, ...], ...],
                reason: str) -> T:
    """`t` with its IR dims in the order of `groups` (its atoms, regrouped as a torch view of
    it would be), the torch layout unchanged: itself where they are, else a pointwise
    `aten.clone` on shards of that view (attention's q, k and v made by an op whose result
    is [batch, heads, seq, head_dim] in memory, where the IR's attention reads
    [batch, seq, heads, head_dim]: the data moved locally, no communication)."""
    flat = tuple(a for g in groups for a in g)
    if lw.ir(t) == flat:
        return t
    return T(_clone(frame, node, t, groups, groups, reason), flat, t.layout, t.dtype)


def _clone(frame: Frame, node: fx.Node, t: T, arg: tuple, out_layout: tuple, reason: str, along: str = "") -> DValue:
    """A pointwise `aten.clone` of `t` on shards, read as the torch layout `arg` and written as
    `out_layout` (in IR dims: the data moved locally, no communication); its result."""
    out = DValue(node.name, tuple(a for g in out_layout for a in g), t.dtype)
    dtype = "float" if t.dtype == DType.FLOAT else "int64"
    attrs = (("target", "aten.clone.default"), ("call", '{"args":[{"tensor":0}],"kwargs":{}}'), ("dtypes", dtype),
             ("reason", reason), ("rule", "pointwise")) + ((("along", along),) if along else ())
    frame.block.items.append(DOp(out, "aten", (t.ref,), attrs, node_loc(node), scope(node),
                                 layouts=((arg,), out_layout)))
    return out


def with_own_atom(lw: Lowering, frame: Frame, node: fx.Node, t: T, at: int, ir_at: int, reason: str) -> T:
    """`t` with its size-1 torch dim `at` (no IR dim: a slice of one position, Falcon's one k/v
    head) made an IR dim of its own, at position `ir_at` of the IR dims: a pointwise
    `aten.clone` on shards, whose argument is the IR tensor and whose result has the new dim."""
    ir = list(lw.ir(t))
    arg = tuple((a,) for a in ir[:ir_at]) + ((),) + tuple((a,) for a in ir[ir_at:])
    atom = lw.dims.new(1)
    out = _clone(frame, node, t, arg, tuple(g or (atom,) for g in arg), reason)
    layout = tuple(g if i != at else (atom,) for i, g in enumerate(lw.groups(t)))
    return T(out, out.atoms, layout, t.dtype)


def sliced_rows(lw: Lowering, frame: Frame, node: fx.Node, table: T, atom: int, n: int, start: int = 0) -> T:
    """Rows start..start+n of `table` as dim `atom` (a position table longer than the sequence):
    `aten.slice` along its rows, on shards of its other dims."""
    layout = ((atom,),) + table.layout[1:]
    atoms = tuple(a for group in layout for a in group)
    out = DValue(node.name, atoms, table.dtype)
    attrs = (("target", "aten.slice.Tensor"), ("call", f'{{"args":[{{"tensor":0}},0,{start},{start + n}],"kwargs":{{}}}}'),
             ("dtypes", "float"), ("reason", "the rows of a position table that the sequence reads"),
             ("rule", "along"), ("along", "0"))
    frame.block.items.append(DOp(out, "aten", (table.ref,), attrs, node_loc(node), scope(node),
                                 layouts=((table.layout,), layout)))
    return T(out, atoms, layout, table.dtype)


def repeated(lw: Lowering, frame: Frame, node: fx.Node, kv: RepeatedKV) -> T:
    """k or v repeated over heads (`RepeatedKV`) for a use other than attention (written-out
    attention the patterns did not recognise): `aten.repeat_interleave` along the heads, computed
    on shards of the other dims; the repeated heads are a new dim."""
    x = kv.t
    groups = lw.groups(x)
    size = lw.dims.numel(groups[kv.dim]) * kv.repeats
    layout = reduced_layout(lw, groups, (kv.dim,), tuple(size if i == kv.dim else lw.dims.numel(g)
                                                            for i, g in enumerate(groups)))
    atoms = tuple(a for group in layout for a in group)
    out = DValue(node.name, atoms, x.dtype)
    call = f'{{"args":[{{"tensor":0}},{kv.repeats}],"kwargs":{{"dim":{kv.dim}}}}}'
    attrs = (("target", "aten.repeat_interleave.self_int"), ("call", call),
             ("dtypes", "float" if x.dtype == DType.FLOAT else "int64"),
             ("reason", "k/v repeated over heads for attention written out by hand"), ("rule", "along"),
             ("along", str(kv.dim)))
    frame.block.items.append(DOp(out, "aten", (x.ref,), attrs, node_loc(node), scope(node),
                                 layouts=((x.layout,), layout)))
    return T(out, atoms, layout, x.dtype)


def merged(lw: Lowering, frame: Frame, node: fx.Node, t: T, reason: str, order: tuple[int, ...] | None = None) -> T:
    """`t` with each torch dim made of several IR dims made one new dim: itself where none is,
    else a pointwise `aten.clone` along those dims (each seen whole, so no split of its parts
    is lost), for an op that reads one IR dim there (attention's head_dim, when a rotary
    embedding that rotates pairs of it, torchtune's, made it of two). The result's IR dims are
    its torch dims in `order` (the torch order by default): the clone moves them there on shards.
    A size-1 torch dim without an IR dim (one k/v head) gets one of its own in the same clone, as
    `with_own_atom` gives it: the new dim is the clone's, so no later split of it (a head split
    off the front of head_dim) changes what the clone read."""
    groups = lw.groups(t)
    wide = tuple(i for i, g in enumerate(groups) if sum(lw.dims.size(a) != 1 for a in g) > 1)
    if not wide:
        return t
    order = tuple(range(len(groups))) if order is None else order
    layout = tuple((lw.dims.new(lw.dims.numel(g)),) if i in wide else g or (lw.dims.new(1),)
                   for i, g in enumerate(groups))
    ir_in, ir_out = tuple(groups[i] for i in order), tuple(layout[i] for i in order)
    out = _clone(frame, node, t, ir_in, ir_out, reason, along=",".join(str(order.index(i)) for i in wide))
    return T(out, out.atoms, layout, t.dtype)
