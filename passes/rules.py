"""Per-op sharding rules: one small function per op family (`fivedc/ir/ops.OpFamily`), and per
op kind in `SHARDING_RULES`.

A rule sees the op, the current sharding of each value argument (`None` for
parameters, whose sharding the rule chooses, and for number literals) and the
argument types. It returns the sharding each argument must have and the sharding
of the output. It never inserts communication: where a required sharding differs
from what the producer gives, `passes/communication.py` adds the redistribution.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from fivedc.ir.ops import POINTWISE, OpFamily, by_family, counts_targets
from fivedc.ir.aten_layout import whole_dims
from fivedc.errors import ShardingError
from fivedc.ir.graph import Collective, CollectiveKind, Op, Phase, TensorType
from fivedc.ir.mesh import MeshAxis
from fivedc.ir.sharding import Sharding
from fivedc.passes.expert_collectives import moe_collectives
from fivedc.passes.layout import RuleContext

Shardings = list[Sharding | None]
Types = list[TensorType | None]


@dataclass(frozen=True, slots=True)
class RuleResult:
    args: tuple[Sharding | None, ...]
    out: Sharding
    collectives: tuple[Collective, ...] = ()


def _unsplit(sharding: Sharding, dims: tuple[str, ...]) -> Sharding:
    for dim in dims:
        sharding = sharding.with_split(dim, ())
    return sharding


def _without_tp(sharding: Sharding) -> Sharding:
    return sharding.without_axis(MeshAxis.TP)


def _mode(ctx: RuleContext, op: Op, default: str) -> str:
    modes = [a.kind for a in op.annotations if a.kind in ("col", "row", "replicate")]
    if len(modes) > 1:
        raise ShardingError(f"{op.kind} has conflicting annotations @{modes[0]} and @{modes[1]}", loc=op.loc)
    if ctx.tp is None:
        return "replicate"
    return modes[0] if modes else default


def _embedding(ctx: RuleContext, op: Op, shs: Shardings, types: Types) -> RuleResult:
    tokens, table = shs[0], types[1]
    mode = _mode(ctx, op, "vocab")
    if mode in ("col", "row"):
        raise ShardingError(f"embedding takes @replicate or the default vocab split, not @{mode}", loc=op.loc)
    if mode == "replicate":
        return RuleResult((tokens, Sharding()), tokens)
    vocab = table.dims[0]
    ctx.check_divisible(vocab, (MeshAxis.TP,), op.loc, "vocab-parallel embedding")
    return RuleResult((tokens, Sharding.of(**{vocab: (MeshAxis.TP,)})), tokens.with_partial((MeshAxis.TP,)))


def _linear(ctx: RuleContext, op: Op, shs: Shardings, types: Types) -> RuleResult:
    x_type, w_type = types[0], types[1]
    x = ctx.resolve_partial(shs[0], x_type)
    contracted = tuple(d for d in x_type.dims if d not in op.type.dims)
    outputs = tuple(d for d in w_type.dims if d not in contracted)  # w [in, out], or [out, in] (tied)
    row_dims = [d for d in contracted if MeshAxis.TP in x.axes_of(d)]
    if ctx.tp is None:
        default = "replicate"
    elif row_dims:
        default = "row"
    elif outputs and (ctx.can_stay_split(op.out, outputs[0]) or _tied_to_a_table(ctx, op)):
        default = "col"
    else:
        default = "replicate"
    mode = _mode(ctx, op, default)
    if mode == "row":
        dim = row_dims[0] if row_dims else contracted[0]
        ctx.check_divisible(dim, (MeshAxis.TP,), op.loc, "row-parallel linear")
        x = _without_tp(x).with_split(dim, (MeshAxis.TP,))
        w = Sharding.of(**{dim: (MeshAxis.TP,)})
        return RuleResult((x, w), x.restrict(op.type.dims).with_partial((MeshAxis.TP,)))
    if mode == "col":
        if not outputs:
            raise ShardingError("@col needs a weight with an output dim to split", loc=op.loc)
        dim = outputs[0]
        ctx.check_divisible(dim, (MeshAxis.TP,), op.loc, "column-parallel linear")
        x = _without_tp(x)
        w = Sharding.of(**{dim: (MeshAxis.TP,)})
        return RuleResult((x, w), x.restrict(op.type.dims).with_split(dim, (MeshAxis.TP,)))
    x = _unsplit(x, contracted)
    return RuleResult((x, Sharding()), x.restrict(op.type.dims))


def _tied_to_a_table(ctx: RuleContext, op: Op) -> bool:
    """Whether the linear's weight is also a vocab-parallel embedding's table (tied weights): the
    weight has that one layout, so the linear is column-parallel over the vocabulary even where
    its consumer reads the vocabulary whole (a gather before it, not a second layout)."""
    w = op.read(1)
    return _is_param(ctx, w) and any(use.kind == "embedding" and index == 1 and not use.annotation("replicate")
                                     for use, index in ctx.users.get(w, []))


def _is_param(ctx: RuleContext, name: str | None) -> bool:
    """Whether `name` (`Op.read`: None for a number literal) is a parameter."""
    return name is not None and name in ctx.params


def _elementwise(ctx: RuleContext, op: Op, shs: Shardings, types: Types) -> RuleResult:
    if _is_param(ctx, op.read(0)):
        if op.read(1) is None:  # a parameter and a number (Gemma's 1 + w): computed whole
            return RuleResult((Sharding(), None), Sharding())
        if _is_param(ctx, op.read(1)):
            raise ShardingError(f"{op.kind}: one operand must be an activation", loc=op.loc)
        if not POINTWISE[op.kind].commutative:
            raise ShardingError(f"{op.kind}: write the activation first, the parameter second", loc=op.loc)
        swapped = _elementwise_ordered(ctx, op, [shs[1], shs[0]], [types[1], types[0]], param=True)
        return RuleResult((swapped.args[1], swapped.args[0]), swapped.out)
    return _elementwise_ordered(ctx, op, shs, types, param=_is_param(ctx, op.read(1)))


def _elementwise_ordered(ctx: RuleContext, op: Op, shs: Shardings, types: Types, *, param: bool) -> RuleResult:
    a_sh, b_sh = shs
    a_type, b_type = types
    if b_type is None:  # a number: adding it to a pending sum would add it once per rank
        keep = op.kind in ("mul", "div")
        a = a_sh if keep else ctx.resolve_partial(a_sh, a_type)
        return RuleResult((a, None), a)
    if param:
        if not set(b_type.dims) <= set(a_type.dims):
            raise ShardingError(f"{op.kind}: a parameter operand must not add dims to {a_type}", loc=op.loc)
        a = ctx.resolve_partial(a_sh, a_type)
        b = a.restrict(b_type.dims)
        if any(axis in ctx.data_axes for axis in b.split_axes()):
            raise ShardingError(f"{op.kind}: a parameter would be split over a data axis", loc=op.loc)
        return RuleResult((a, b), a)
    if a_sh.partial and a_sh == b_sh and a_type == b_type and op.kind in ("add", "sub"):
        return RuleResult((a_sh, b_sh), a_sh)  # a sum of pending sums is a pending sum
    big, small = (0, 1) if len(a_type.dims) >= len(b_type.dims) else (1, 0)
    big_sh, small_sh = shs[big], shs[small]
    if types[small].dims == types[big].dims and not small_sh.partial \
            and (big_sh.partial or set(big_sh.split) < set(small_sh.split)):
        big_sh = small_sh  # the other is a pending sum, or split further: cutting this one costs nothing
    big_sh = ctx.resolve_partial(big_sh, types[big])
    out = [None, None]
    out[big], out[small] = big_sh, big_sh.restrict(types[small].dims)
    return RuleResult(tuple(out), big_sh)


def _unary(ctx: RuleContext, op: Op, shs: Shardings, types: Types) -> RuleResult:
    x = ctx.resolve_partial(shs[0], types[0])
    return RuleResult((x,), x)


def _whole(ctx: RuleContext, op: Op, shs: Shardings, types: Types) -> RuleResult:
    """The argument whole on every rank (pending sums added, splits gathered): a state's update is the
    one-device value, the same on every rank (fivedc/ir/states.py)."""
    return RuleResult((Sharding(),), Sharding())


def _swiglu(ctx: RuleContext, op: Op, shs: Shardings, types: Types) -> RuleResult:
    gate = ctx.resolve_partial(shs[0], types[0])
    return RuleResult((gate, gate), gate)


def _norm(ctx: RuleContext, op: Op, shs: Shardings, types: Types) -> RuleResult:
    x = _unsplit(ctx.resolve_partial(shs[0], types[0]), types[1].dims)  # the dims it normalises over
    return RuleResult((x,) + (Sharding(),) * (len(shs) - 1), x)


def _rope(ctx: RuleContext, op: Op, shs: Shardings, types: Types) -> RuleResult:
    x = _unsplit(ctx.resolve_partial(shs[0], types[0]), types[0].dims[-1:])
    return RuleResult((x,), x)


def _attention(ctx: RuleContext, op: Op, shs: Shardings, types: Types) -> RuleResult:
    """Heads split over tp as q's producer gives them, and k/v heads with them (a single
    k/v head, multi-query attention, stays whole on every rank: its gradient is then a
    sum over the heads' ranks); the sequence of q and of the output split over cp. K/V keep that split for ring attention (the blocks travel
    inside the op) or are gathered over cp for the allgather variant."""
    q_t, k_t, v_t = types
    seq = ctx.graph.seq_dim
    q = ctx.resolve_partial(shs[0], q_t).with_split(seq, ctx.cp).with_split(q_t.dims[3], ())
    heads_axes = kv_axes = q.axes_of(q_t.dims[2])
    if heads_axes and ctx.graph.dim(k_t.dims[2]) == 1:
        kv_axes = ()  # one k/v head (multi-query attention): whole on every rank, each rank's q heads share it
    elif heads_axes:
        ctx.check_divisible(k_t.dims[2], heads_axes, op.loc, "kv-heads must split like heads")
    ring = bool(ctx.cp) and op.annotation("cp").args[0] == "ring"
    batch = Sharding(((q_t.dims[0], q.axes_of(q_t.dims[0])),))

    def kv(t: TensorType) -> Sharding:
        return batch.with_split(t.dims[2], kv_axes).with_split(seq, ctx.cp if ring else ())

    out = q.with_split(q_t.dims[3], ()).rename({q_t.dims[3]: v_t.dims[3]})
    args = (q, kv(k_t), kv(v_t))
    return RuleResult(args, out, _ring_collectives(ctx, op, args[1], types) if ring else ())


def _ring_collectives(ctx: RuleContext, op: Op, kv: Sharding, types: Types) -> tuple[Collective, ...]:
    """Ring attention's P2P traffic: each hop passes the K/V block in hand to the next
    cp rank; backward passes K/V again and, with them, their gradient accumulators."""
    cp = ctx.mesh.size(MeshAxis.CP)
    block = sum(ctx.graph.local_numel(t.dims, kv, ctx.mesh) for t in types[1:]) * ctx.dtype_bytes

    def hop(phase: Phase, what: str, hops: int, why: str) -> Collective:
        reason = f"ring attention: {what}, {hops} hop{'s' * (hops != 1)} per layer, {why}"
        tensors = ",".join(str(a) for a in op.args[1:])
        return Collective(
            CollectiveKind.SEND_RECV, (MeshAxis.CP,), phase, tensors, block, reason,
            dim=ctx.graph.seq_dim, count=hops, loc=op.loc, overlaps="attention on the K/V block in hand",
        )

    return (
        hop(Phase.FORWARD, "pass the K/V block in hand to the next cp rank", cp - 1,
            "overlapped with attention to it; no rank holds the whole sequence"),
        hop(Phase.BACKWARD, "pass the K/V block in hand on again", cp - 1, "to recompute its scores"),
        hop(Phase.BACKWARD, "pass each K/V block's gradient accumulator along with it", cp,
            "each rank adds its part and the last hop brings it home"),
    )


def _cross_entropy(ctx: RuleContext, op: Op, shs: Shardings, types: Types) -> RuleResult:
    logits_t = types[0]
    logits = ctx.resolve_partial(shs[0], logits_t)
    vocab = logits_t.dims[-1]
    targets = logits.restrict(logits_t.dims[:-1])
    vocab_axes = logits.axes_of(vocab)
    tokens = ctx.graph.local_numel(logits_t.dims[:-1], logits, ctx.mesh)
    collectives = tuple(
        Collective(
            CollectiveKind.ALL_REDUCE,
            vocab_axes,
            Phase.FORWARD,
            op.out,
            tokens * 4,
            f"vocab-parallel cross-entropy: {what} over the {vocab} shards",
            loc=op.loc,
        )
        for what in ("max of the logits", "sum of exp(logits)", "logit of the target")
    ) if vocab_axes else ()
    split = targets.split_axes()
    if counts_targets(op) and split:
        collectives += (Collective(
            CollectiveKind.ALL_REDUCE, split, Phase.FORWARD, op.out, 8,
            f"cross-entropy with ignore_index={op.attr('ignore_index')}: "
            + ("the class weights of the counted targets, summed" if op.attr("weight", "") else
               "the number of counted targets") + " over the token shards (the mean divides by it)", loc=op.loc,
        ),)
    return RuleResult((logits, targets), Sharding(partial=split), collectives)


def _aten(ctx: RuleContext, op: Op, shs: Shardings, types: Types) -> RuleResult:
    """An ATen operator (fivedc/ir/aten_call.py). Replicated: every argument whole on every
    rank (gathered, pending sums added), the result computed whole; consumers cut their
    shards from it. Pointwise or along some dims (a reduction, scan or slice): computed
    on shards. The arguments keep the splits their producers give (the one with the
    most dims first, then splits of the others over axes not yet used), pending sums
    added, the dims it runs along whole, and a parameter's dims whole over the data
    axes; every argument is cut to that sharding and the result keeps it."""
    whole = whole_dims(op)
    if whole is None:
        return RuleResult(tuple(Sharding() for _ in shs), Sharding())
    values = sorted((i for i, sh in enumerate(shs) if sh is not None), key=lambda i: -len(types[i].dims))
    merged = Sharding()
    for i in values:
        for dim, axes in ctx.resolve_partial(shs[i], types[i]).split:
            if dim not in whole and not merged.axes_of(dim) and not any(merged.uses(a) for a in axes):
                merged = merged.with_split(dim, axes)
    params = [t for t, sh in zip(types, shs) if sh is None and t is not None]
    for dim in {d for t in params for d in t.dims}:
        if any(a in ctx.data_axes for a in merged.axes_of(dim)):
            merged = merged.with_split(dim, ())
    args = tuple(merged.restrict(t.dims) if t is not None else None for t in types)
    return RuleResult(args, merged.restrict(op.type.dims))


def _moe(ctx: RuleContext, op: Op, shs: Shardings, types: Types) -> RuleResult:
    """Tokens as the data axes and cp split them, hidden whole and replicated over tp;
    the expert weights split their experts dim over ep (placed by passes/experts.py)
    and their ffn dim over tp, so the output is partial over tp. The all-to-alls that
    carry tokens to their experts are the op's own collectives."""
    x_t = types[0]
    x = _without_tp(_unsplit(ctx.resolve_partial(shs[0], x_t), x_t.dims[-1:]))
    ep = (MeshAxis.EP,) if ctx.active(MeshAxis.EP) else ()
    weights = []
    for t in types[2:]:
        ffn = t.dims[2] if t.dims[1] == x_t.dims[-1] else t.dims[1]
        w = Sharding.of(**{t.dims[0]: ep})
        if ctx.tp is not None:
            ctx.check_divisible(ffn, (MeshAxis.TP,), op.loc, "tensor parallelism inside experts")
            w = w.with_split(ffn, (MeshAxis.TP,))
        weights.append(w)
    out = x.with_partial((MeshAxis.TP,)) if ctx.tp is not None else x
    return RuleResult((x, Sharding()) + tuple(weights), out, moe_collectives(ctx, op, x, types))


Rule = Callable[[RuleContext, Op, Shardings, Types], RuleResult]

# one rule per op family (fivedc/ir/ops.py says which ops each family holds)
SHARDING_RULES: dict[str, Rule] = by_family({
    OpFamily.EMBEDDING: _embedding,
    OpFamily.LINEAR: _linear,
    OpFamily.ELEMENTWISE: _elementwise,
    OpFamily.UNARY: _unary,
    OpFamily.STATE_ADD: _whole,
    OpFamily.SWIGLU: _swiglu,
    OpFamily.NORM: _norm,
    OpFamily.ROPE: _rope,
    OpFamily.ATTENTION: _attention,
    OpFamily.CROSS_ENTROPY: _cross_entropy,
    OpFamily.MOE: _moe,
    OpFamily.ATEN: _aten,
}, table="SHARDING_RULES")
