"""Lowering handler for attention: torch's scaled_dot_product_attention (and k/v heads repeated for it).

The IR's attention reads q, k and v as [batch, seq, heads, head_dim]; torch passes them
as [batch, heads, seq, head_dim]. A handler here brings each to the IR's order (on
shards: `fivedc/frontends/fx/local_moves.py`), checks that q, k and v agree and that the
sequence is the inputs' sequence, and keeps grouped-query heads (`RepeatedKV` from a
`repeat_interleave`, or `enable_gqa`) and a scale other than 1/sqrt(head_dim) (a `mul` of
q first). Routed from `fivedc/frontends/fx/ops.py`, beside the other layer-sized ops in
`fivedc/frontends/fx/layers.py`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import math

import torch.fx as fx

from fivedc.frontends.fx.layers import arg
from fivedc.frontends.fx.local_moves import in_ir_order, merged, with_own_atom
from fivedc.frontends.fx.values import Frame, RepeatedKV, T

if TYPE_CHECKING:  # the walk that calls these handlers (it imports this module)
    from fivedc.frontends.fx.lower import Lowering

_SDPA = ("query", "key", "value", "attn_mask", "dropout_p", "is_causal", "scale", "enable_gqa")


def attention(lw: Lowering, frame: Frame, node: fx.Node, args, kwargs) -> T:
    a = {name: arg(args, kwargs, i, name) for i, name in enumerate(_SDPA)}
    softcap = kwargs.get("softcap")  # capped_attention (fivedc/frontends/fx/recognise.py): Gemma 2's logit softcapping
    if a["attn_mask"] is not None:
        raise lw.unsupported(node, "attention with an explicit attn_mask", "use is_causal=True for a causal mask")
    if a["dropout_p"]:
        lw.warn(node, f"attention dropout_p={a['dropout_p']} is ignored: fivedc's attention has no dropout")
    one = "attention reads [batch, seq, heads, head_dim], one dim each"  # [b, h, s, d] in torch: as (0, 2, 1, 3)
    q = merged(lw, frame, node, lw.tensor(frame, a["query"], node), one, (0, 2, 1, 3))
    kv = [(s.t, s.repeats) if isinstance(s, RepeatedKV) else (lw.tensor(frame, s, node), 1) for s in (a["key"], a["value"])]
    (k, rep_k), (v, rep_v) = ((merged(lw, frame, node, t, one, (0, 2, 1, 3)), rep) for t, rep in kv)
    q, (b, h, s, d) = _bhsd(lw, frame, node, q, "query", ())
    k, (kb, kh, ks, kd) = _bhsd(lw, frame, node, k, "key", lw.ir(q))
    v, (vb, vh, vs, vd) = _bhsd(lw, frame, node, v, "value", lw.ir(q) + lw.ir(k))
    q, k, v = (_bshd(lw, frame, node, t, atoms) for t, atoms in ((q, (b, h, s, d)), (k, (kb, kh, ks, kd)),
                                                                   (v, (vb, vh, vs, vd))))
    for x, y in ((b, kb), (b, vb), (s, ks), (s, vs), (kh, vh), (d, kd)):
        lw.unify((x,), (y,), node, "attention: q, k and v disagree")
    if lw.dims.size(vd) == lw.dims.size(d):
        lw.unify((vd,), (d,), node, "attention")
    heads, kv_heads = lw.dims.size(h), lw.dims.size(kh)
    mqa = rep_k == 1 and kv_heads == 1  # one k/v head, broadcast over the query heads (Falcon's multi-query)
    if rep_k != rep_v or heads != kv_heads * rep_k and not mqa \
            and not (rep_k == 1 and a["enable_gqa"] and heads % kv_heads == 0):
        raise lw.unsupported(node, f"attention with {heads} query heads and {kv_heads} k/v heads")
    if lw.seq_atom is None or not lw.same(s, lw.seq_atom):
        raise lw.unsupported(node, "attention over a dim that is not the inputs' sequence dim")
    lw.dims.keep_whole(s)  # a later view that splits the sequence (a loss's reshape) runs as its ATen call
    scale = a["scale"]
    if scale is not None and not math.isclose(float(scale), 1 / math.sqrt(lw.dims.size(d)), rel_tol=1e-9):
        # the IR's attention scales by 1/sqrt(head_dim): another scale (Gemma 3's query_pre_attn_scalar)
        # is the same softmax of q scaled by scale * sqrt(head_dim) first
        factor = float(scale) * math.sqrt(lw.dims.size(d))
        q = T(lw.emit(frame, node, "mul", (q.ref, factor), q.ir), q.ir, q.layout, q.dtype)
    for atom, hint in ((h, "heads"), (kh, "kv_heads"), (d, "head_dim"), (vd, "head_dim")):
        lw.dims.hint(atom, hint, 70)
    atoms = (b, s, h, vd)
    window = int(kwargs.get("window") or 0)  # windowed_attention, capped_attention: a causal sliding window
    attrs = (("causal", bool(a["is_causal"])),) + ((("softcap", float(softcap)),) if softcap else ()) \
        + ((("window", window),) if window else ())
    out = lw.emit(frame, node, "attention", (q.ref, k.ref, v.ref), atoms, attrs)
    return T(out, atoms, ((b,), (h,), (s,), (vd,)))


def _bhsd(lw: Lowering, frame: Frame, node: fx.Node, t: T, what: str,
          others: tuple[int, ...]) -> tuple[T, tuple[int, int, int, int]]:
    """`t` (torch [batch, heads, seq, head_dim]) and its dims there, one IR dim each. One head
    (or a head_dim of 1), a size-1 torch dim without an IR dim, is given one: split off the
    front of head_dim (the back of heads), as a view of a projection into heads would, or,
    where that dim is also one of `others` (the IR dims of q, and of k: Falcon's q, k and v
    slices of one fused view share head_dim), a new dim of its own."""
    groups = lw.groups(t)
    if len(groups) == 4 and (groups[1] == ()) != (groups[3] == ()):
        whole = groups[3] or groups[1]
        if len(whole) == 1 and lw.ir(t)[-1] == whole[0] and not set(lw.dims.leaves(whole)) & set(others):
            size = lw.dims.size(whole[0])
            head, rest = lw.dims.refine(whole[0], (1, size) if groups[1] == () else (size, 1))
            groups = (groups[0], (head,), groups[2], (rest,))
        elif groups[1] == () and all(len(g) == 1 for i, g in enumerate(groups) if i != 1):
            t = with_own_atom(lw, frame, node, t, 1, lw.ir(t).index(groups[3][0]),  # before head_dim
                              f"attention {what} of one head: the head an IR dim of its own")
            groups = lw.groups(t)
    if len(groups) != 4 or any(len(g) != 1 for g in groups):
        raise lw.unsupported(node, f"attention {what} that is not [batch, heads, seq, head_dim]")
    return t, tuple(g[0] for g in groups)


def _bshd(lw: Lowering, frame: Frame, node: fx.Node, t: T, atoms: tuple[int, int, int, int]) -> T:
    """An attention input as the IR's attention reads it, [batch, seq, heads, head_dim]: as it
    is when it was that before a transpose(1, 2) (a projection viewed into heads), else moved
    into that order on shards (a tensor made [batch, heads, seq, head_dim], as DeepSeek-V3's
    query and key are, by a `cat` of two parts along head_dim)."""
    b, h, s, d = atoms
    return in_ir_order(lw, frame, node, t, ((b,), (s,), (h,), (d,)), "attention reads [batch, seq, heads, head_dim]")


def repeat_interleave(lw: Lowering, frame: Frame, node: fx.Node, args, kwargs) -> RepeatedKV:
    x = lw.tensor(frame, args[0], node)
    repeats, dim = arg(args, kwargs, 1, "repeats"), arg(args, kwargs, 2, "dim")
    if not isinstance(repeats, int) or dim is None or dim % len(x.layout) != 1:
        raise lw.unsupported(node, "repeat_interleave other than k/v heads for attention ([batch, heads, seq, d], dim=1)")
    return RepeatedKV(x, repeats, 1)
