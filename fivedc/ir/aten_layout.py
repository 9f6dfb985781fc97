"""The torch-free half of the `aten` op kind (`fivedc/ir/aten_call.py` has the other): its
layouts, the rule it is sharded by, and the dims it must see whole. The passes and the
planner read only these, so compiling or searching a model does not import torch.
"""

from __future__ import annotations

from fivedc.errors import FivedcError

Layout = tuple[tuple[str, ...], ...]  # torch dims, each the IR dims it is made of (empty: a size-1 dim)


class AtenCallError(FivedcError):
    """An `aten` op whose target or call cannot be used."""

# ---- layouts -----------------------------------------------------------------------------
def layout_text(layout: Layout) -> str:
    return ",".join("*".join(group) or "1" for group in layout)


def parse_layout(text: str) -> Layout:
    if text == "":
        return ()
    return tuple(() if group == "1" else tuple(group.split("*")) for group in text.split(","))


def arg_layouts(op) -> tuple[Layout, ...]:
    text = str(op.attr("layouts", ""))
    layouts = tuple(parse_layout(t) for t in text.split(";")) if op.args else ()
    if len(layouts) != len(op.args):
        raise AtenCallError(f"aten op {op.out} has {len(op.args)} arguments and {len(layouts)} layouts")
    return layouts


def out_layout(op) -> Layout:
    return parse_layout(str(op.attr("out", "")))


# ---- how it is sharded -------------------------------------------------------------------
RULES = ("replicated", "pointwise", "along", "matmul")
# what torch does not tag: scans and slices along a dim, and pointwise ops without the tag
ALONG = frozenset({"softmax", "_softmax", "log_softmax", "_log_softmax", "_safe_softmax", "cumsum", "cumprod",
                   "logcumsumexp", "cummax", "cummin", "sort", "argsort", "topk", "split", "split_with_sizes",
                   "unsafe_split", "chunk", "slice", "narrow", "select", "pad", "constant_pad_nd",
                   "repeat_interleave", "cat", "expand", "layer_norm", "rms_norm"})  # norms: without weights
MATMULS = frozenset({"matmul", "bmm", "mm"})  # [..., m, k] @ [..., k, n]: the rule `matmul`
PADS = frozenset({"pad", "constant_pad_nd"})  # along their last len(pad) // 2 dims
UNTAGGED_POINTWISE = frozenset({"masked_fill", "__and__", "__or__", "__xor__", "_to_copy", "to", "floor_divide",
                                "detach"})


def rule_of(op) -> str:
    rule = str(op.attr("rule") or "replicated")
    if rule not in RULES:
        raise AtenCallError(f"aten op {op.out}: rule {rule!r} is not one of {', '.join(RULES)}")
    return rule


def whole_dims(op) -> frozenset[str] | None:
    """The IR dims the op must see whole: None when it runs replicated (all of them); for a
    pointwise op those of its result's torch dims that a constant tensor in the call spans
    (but those where the constants are cut to the shards' rows: `rows_of`) or
    that merge several IR dims of an argument into one (none without either), in the result
    and in each argument; for an op along dims, the dims it runs along in each argument; for
    a matmul `[..., m, k] @ [..., k, n]`, both k and the n of the second (its rows and
    columns: only the batch dims and the first's m stay split)."""
    rule = rule_of(op)
    if rule == "replicated":
        return None
    if rule == "matmul":
        a, b = matmul_layouts(op)
        return frozenset(a[-1] + b[-2] + b[-1])
    if rule == "pointwise":
        out = out_layout(op)
        along = tuple(i for i in along_of(op, out) if i not in rows_of(op))
        seen = {d for i in along for d in out[i]}
        for arg in arg_layouts(op):  # right-aligned with the result: the same dims, or the parts of a merged one
            seen.update(d for i in along if 0 <= i - len(out) + len(arg) for d in arg[i - len(out) + len(arg)])
        return frozenset(seen)
    return frozenset(d for arg in arg_layouts(op) for i in along_of(op, arg) for d in arg[i])


def rows_of(op) -> tuple[int, ...]:
    """A pointwise op's result dims (among `along`) where its constant tensors are cut to this
    rank's rows of each IR dim there, so those dims keep their split: the sequence's positions
    (a rotary table a library applies by hand, under cp), a dim's shard (ALiBi's slopes per
    head, under tp), the batch's first rows for constants alike in every batch row (a mask
    built from the batch's shape, in a microbatch)."""
    text = str(op.attr("rows", "") or "")
    try:
        rows = tuple(int(i) for i in text.split(",")) if text else ()
    except ValueError:
        rows = None
    if rows is None or (rows and (rule_of(op) != "pointwise" or not set(rows) <= set(along_of(op, out_layout(op))))):
        raise AtenCallError(f"aten op {op.out}: `rows` names result dims a pointwise op's constants span, among "
                            f"`along` (got {op.attr('rows')!r})")
    return rows


def matmul_layouts(op) -> tuple[Layout, Layout]:
    """The two arguments of a `matmul` op, each of two torch dims or more."""
    layouts = arg_layouts(op)
    if len(layouts) != 2 or min(len(layout) for layout in layouts) < 2:
        raise AtenCallError(f"aten op {op.out}: a matmul on shards takes two tensors of two dims or more "
                            f"(got {op.attr('layouts')!r})")
    return layouts[0], layouts[1]


def along_of(op, layout) -> tuple[int, ...]:
    """The torch dims of `layout` the op runs along: of each argument for an `along` op (one
    tensor, or several of one rank: a cat), of the result for a pointwise op (those a constant
    spans, possibly none)."""
    layouts = arg_layouts(op)
    text = str(op.attr("along", "") or "")
    try:
        along = tuple(int(i) for i in text.split(",")) if text else ()
    except ValueError:
        along = None
    pointwise = rule_of(op) == "pointwise"
    ranks = {len(layout) for layout in layouts}
    if along is None or (not pointwise and (not along or len(ranks) != 1)) \
            or any(not 0 <= i < len(layout) for i in along):
        raise AtenCallError(f"aten op {op.out}: an op along dims takes tensors of one rank and `along` names their "
                            f"torch dims (got {op.attr('along')!r} for tensor arguments of ranks "
                            f"{sorted(len(layout) for layout in layouts)})")
    return along

def lines_up(along: tuple[int, ...], arg: Layout, out: Layout) -> bool:
    """An op along dims: its result keeps the argument's other dims, and along those keeps the
    dim, has size 1, a new dim, or some of the dims the argument has there (`x[..., 0::2]` of
    a head_dim made of pairs: the pairs' first dim), or drops it."""
    if len(out) != len(arg):
        return list(out) == [g for i, g in enumerate(arg) if i not in along]
    return all(o == g or (i in along and not set(o) & set(d for j, h in enumerate(arg) if j != i for d in h))
               for i, (g, o) in enumerate(zip(arg, out)))
