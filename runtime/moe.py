"""MoE layers on one rank: routing, capacity, dispatch, the local experts, combine.

`moe_kernel` runs the `moe` op on this rank's tokens x [T, hidden] (batch split
over dp and ep, sequence over cp, replicated over tp; `passes/experts.py` says why):

1. route: scores = softmax or sigmoid of x @ router; each token's top-k experts by
   score (plus the balancing bias when `bias_update` is on: it only selects); gate
   weights = the chosen scores normalised to sum 1 (`normalize`, the default; with
   top_k=1 that is 1, so use normalize=false for Switch's gate = probability).
2. capacity, when `capacity_factor` is given: a group is one sequence (batch row);
   each expert keeps ceil(factor x tokens per row x top_k / E) of the row's
   assignments, all first choices before second choices, then by position; the
   rest are dropped (they add nothing: the residual carries the token). Under cp a
   row's chunks sit on several ranks, so per-chunk counts are all-reduced over cp
   and every rank ranks its assignments in the global order. The single-device
   run applies the same rule (one chunk per row).
3. dispatch: assignments sorted by (ep rank, local expert); the counts go through
   an all-to-all, then the token rows through `all_to_all_single` with those
   uneven splits (gloo supports uneven splits). `_AllToAll` is autograd-aware: its
   backward is the reverse all-to-all. `@ep(hierarchical)` moves rows in two
   steps, inside the node, then between nodes (`runtime/moe_a2a.py`).
4. experts (`local_experts`): rows that come from one rank (ep = 1, or one ep rank
   sending) arrive grouped by expert already, and each expert runs on its own slice,
   exact sizes, no copies (`sliced_experts`). Rows from several ranks are grouped by
   local expert first (`grouped_experts`), then sliced the same way; no padding, so
   what the experts keep is what the plan estimates. `batched_experts` (padded to the
   busiest expert, batched matmuls) and `loop_experts` (a loop by masks) are the
   benchmarks' alternatives.
5. combine: the reverse all-to-all; each token's outputs summed with its gates.

Balancing. `aux_loss=a`: Switch's a * E * sum_e f_e * P_e, f_e the share of the
batch's assignments routed to e and P_e the mean score of e normalised over the
experts, both over the whole batch: the counts are all-reduced over dp, ep and cp,
each rank adds its own tokens' part of P and divides by tp (the tp ranks hold the
same tokens), so the sum over ranks is the single-device value at any tp, cp, ep.
It reaches the gradients through `_AddAuxLoss` (identity forward; gradient 1 for
the loss in backward); the reported loss stays the model's. `bias_update=g`:
DeepSeek-V3's auxiliary-loss-free balancing, bias_e += g * sign(mean load - load_e)
after each step, from the whole batch's counts (summed over microbatches).
A module's own balancing (`bias_state`, `count_state`: its buffers, `runtime/states.py`)
chooses with the bias state and adds the whole batch's counts to the count state; the update
from them is the module's after-step hook.

Per-layer state (the bias, this step's tokens per expert) lives on the
`KernelContext`, keyed by the router's qualified name (`moe.3.router`), which
`register_params` tells it (a ZeRO-3 gathered copy's name: `register_gathered`); `end_step` (called by `runtime/train.py` after each
step) applies the bias update and hands back the load. A forward redone by activation
recomputation routes the same tokens again and records nothing.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor

from fivedc.ir.graph import Op
from fivedc.ir.mesh import MeshAxis
from fivedc.passes.experts import MoeSettings, token_axes
from fivedc.runtime.moe_a2a import Exchange
from fivedc.runtime.recompute import recomputing
from fivedc.runtime.states import add_to_state, read_state
from fivedc.ir.seq_layout import chunks_per_rank
from fivedc.ir.sharding import Sharding


@dataclass(frozen=True)
class ExpertLoad:
    """One MoE layer's assignments per expert in one step (top-k of every token)."""

    routed: tuple[int, ...]
    dropped: tuple[int, ...]  # of the routed, dropped by the capacity

    def __add__(self, other: ExpertLoad) -> ExpertLoad:
        return ExpertLoad(tuple(a + b for a, b in zip(self.routed, other.routed)),
                          tuple(a + b for a, b in zip(self.dropped, other.dropped)))

    @property
    def imbalance(self) -> float:
        """The busiest expert's tokens over the mean (1.0 is perfectly balanced)."""
        mean = sum(self.routed) / max(len(self.routed), 1)
        return max(self.routed) / mean if mean else 0.0


@dataclass
class MoeState:
    names: dict[int, str] = field(default_factory=dict)  # id(parameter tensor) -> qualified name
    gathered: Callable[[Tensor], str | None] | None = None  # ZeRO-3: a gathered copy's name
    bias: dict[str, Tensor] = field(default_factory=dict)
    pending: dict[str, tuple[float, Tensor]] = field(default_factory=dict)  # bias rate, this step's counts
    loads: dict[str, ExpertLoad] = field(default_factory=dict)

    def instance(self, op: Op, router: Tensor) -> str:
        """`moe.3.r`: the layer's prefix (from its router's qualified name) and the op's output."""
        for t in (router, router._base):
            if t is None:
                continue
            name = self.names.get(id(t)) or (self.gathered(t) if self.gathered is not None else None)
            if name:
                return f"{name.rpartition('.')[0]}.{op.out}" if "." in name else op.out
        return op.out


def moe_state(ctx) -> MoeState:
    if "moe" not in ctx._cache:
        ctx._cache["moe"] = MoeState()
    return ctx._cache["moe"]


def register_params(ctx, params: dict[str, Tensor]) -> None:
    """Tell the MoE kernels which parameter tensor is which (to name their layers)."""
    moe_state(ctx).names = {id(t): name for name, t in params.items()}


def register_gathered(ctx, name_of: Callable[[Tensor], str | None]) -> None:
    """ZeRO-3: tell the MoE kernels how to name a gathered copy of a parameter
    (`runtime/zero3.ShardedParams.name_of`)."""
    moe_state(ctx).gathered = name_of


def end_step(ctx) -> dict[str, ExpertLoad]:
    """After a step: apply the bias updates; this rank's tokens per expert, per layer."""
    state = moe_state(ctx)
    for name, (rate, load) in state.pending.items():
        load = load.to(state.bias[name])
        state.bias[name] += rate * torch.sign(load.mean() - load)
    loads, state.loads, state.pending = state.loads, {}, {}
    return loads


def discard_counts(ctx) -> None:
    """Forget the counts of forwards that were not training steps (evaluation): no bias
    update and no load come from them."""
    state = moe_state(ctx)
    state.loads, state.pending = {}, {}


# ---- the kernel -----------------------------------------------------------------------
def moe_kernel(ctx, op: Op, args: list, dims: list, *, experts_fn=None) -> Tensor:
    x, router, *weights = args
    s, state = MoeSettings.of(op), moe_state(ctx)
    name = state.instance(op, router)
    experts = router.shape[1]
    xt = x.reshape(-1, x.shape[-1])
    bias = state.bias.setdefault(name, xt.new_zeros(experts)) if s.bias_update else \
        read_state(ctx, s.bias_state, xt, experts) if s.bias_state else None
    chosen, gates, scores = route(xt, router, s, bias)
    keep = capacity_keep(ctx, op, chosen, dims[0], tuple(x.shape), experts, s) if s.capacity_factor else None
    routed = torch.bincount(chosen.reshape(-1), minlength=experts)
    dropped = torch.bincount(chosen[~keep], minlength=experts) if keep is not None else torch.zeros_like(routed)
    total = routed
    if s.aux_loss or s.bias_update or s.count_state:
        total = routed.clone()
        group = ctx.group(token_axes(ctx.mesh))
        if group is not None:
            dist.all_reduce(total, group=group)
    exchange = Exchange.of(ctx, op, experts)
    local = _oriented(weights, dims[2:], dims[0][-1])
    y = expert_forward(xt, chosen, gates, keep, local, exchange, s, experts_fn or local_experts)
    if s.aux_loss:
        y = _AddAuxLoss.apply(y, _aux_part(ctx, scores, total, dims[0], experts, s))
    if not recomputing(ctx):  # a recomputed forward (runtime/recompute.py) counts its tokens once
        _record(state, name, s, total, routed, dropped)
        if s.count_state:  # the module's tokens-per-expert buffer gains the whole batch's counts
            add_to_state(ctx, s.count_state, total)
    return y.reshape(x.shape)


def _record(state: MoeState, name: str, s: MoeSettings, total: Tensor, routed: Tensor, dropped: Tensor) -> None:
    """This forward's counts: for the bias update, and the load `end_step` reports."""
    if s.bias_update:
        rate, before = state.pending.get(name, (s.bias_update, torch.zeros_like(total)))
        state.pending[name] = (rate, before + total)
    load = ExpertLoad(tuple(routed.tolist()), tuple(dropped.tolist()))
    state.loads[name] = state.loads[name] + load if name in state.loads else load


def route(xt: Tensor, router: Tensor, s: MoeSettings, bias: Tensor | None) -> tuple[Tensor, Tensor, Tensor]:
    """(chosen experts [T, k], gate weights [T, k], scores normalised over the experts [T, E])."""
    logits = xt @ router
    scores = logits.softmax(-1) if s.score == "softmax" else logits.sigmoid()
    select = scores.detach() if bias is None else scores.detach() + bias
    chosen = select.topk(s.top_k, dim=-1).indices
    if chosen.is_meta:  # a rehearsal has no scores to choose by: each expert gets its even share, on the host
        chosen = even_routes(chosen.shape[0], s.top_k, experts=scores.shape[-1])
    gates = scores.gather(1, chosen.to(scores.device))
    if s.normalize:
        gates = torch.ones_like(gates.detach()) if s.top_k == 1 else gates / gates.sum(-1, keepdim=True)
    normalised = scores if s.score == "softmax" else scores / scores.sum(-1, keepdim=True)
    return chosen, gates, normalised


def even_routes(tokens: int, k: int, *, experts: int) -> Tensor:
    """[tokens, k]: token t's choices t*k .. t*k+k-1 modulo the experts (distinct when k <= E), so
    every expert receives tokens * k / E of them: the balanced load a plan is estimated for."""
    return (torch.arange(tokens * k) % experts).view(tokens, k)


def _oriented(weights: list[Tensor], dims: list, hidden: str) -> list[Tensor]:
    """Expert weights as [E_local, hidden, ffn] (gate, up) and [E_local, ffn, hidden] (down)."""
    out = [w if d[1] == hidden else w.transpose(1, 2) for w, d in zip(weights[:-1], dims[:-1])]
    return out + [weights[-1] if dims[-1][2] == hidden else weights[-1].transpose(1, 2)]


# ---- capacity -------------------------------------------------------------------------
def capacity_keep(ctx, op: Op, chosen: Tensor, x_dims: tuple, x_shape: tuple, experts: int,
                  s: MoeSettings) -> Tensor:
    """[T, k] bool: the assignments each expert keeps under the capacity, per batch row."""
    graph, k = ctx.graph, s.top_k
    rows, tokens = x_shape[0], chosen.shape[0]
    per_row = tokens // rows
    capacity = s.capacity(math.prod(graph.dim(d) for d in x_dims[1:-1]), experts)
    chunk, chunks, group = _token_chunks(ctx, op, x_dims, per_row, chosen.device)
    row = torch.arange(tokens, device=chosen.device) // per_row
    slot = torch.arange(k, device=chosen.device)
    key = ((row[:, None] * k + slot[None, :]) * chunks + chunk.repeat(rows)[:, None]) * experts + chosen
    key = key.view(rows, per_row, k).transpose(1, 2).reshape(-1)  # (row, choice, token) order
    counts = torch.bincount(key, minlength=rows * k * chunks * experts)
    order = torch.argsort(key, stable=True)
    within = torch.empty_like(key)
    within[order] = torch.arange(key.numel(), device=key.device) - (counts.cumsum(0) - counts)[key[order]]
    if group is not None:  # every chunk of the row, from the cp ranks that hold them
        dist.all_reduce(counts, group=group)
    grid = counts.view(rows, k * chunks, experts)
    before = (grid.cumsum(1) - grid).reshape(-1)  # earlier choices and chunks of the row
    keep = (before[key] + within) < capacity
    return keep.view(rows, k, per_row).transpose(1, 2).reshape(tokens, k)


def _token_chunks(ctx, op: Op, x_dims: tuple, per_row: int, device) -> tuple[Tensor, int, object]:
    """Each local token's sequence chunk in its row, the chunks per row, and the cp group."""
    seq, cp = ctx.graph.seq_dim, ctx.mesh.size(MeshAxis.CP)
    sharding = op.arg_specs[0].sharding if op.arg_specs and op.arg_specs[0] else Sharding()
    if cp == 1 or seq not in x_dims or MeshAxis.CP not in sharding.axes_of(seq):
        return torch.zeros(per_row, dtype=torch.long, device=device), 1, None
    chunks = cp * chunks_per_rank(ctx.graph.seq_layout)
    positions = ctx.positions(seq, sharding).to(device)
    chunk = positions // (ctx.graph.dim(seq) // chunks)
    return chunk.repeat_interleave(per_row // positions.numel()), chunks, ctx.group((MeshAxis.CP,))


# ---- balancing ------------------------------------------------------------------------
class _AddAuxLoss(torch.autograd.Function):
    """y unchanged; in backward the auxiliary loss gets gradient 1, as if added to the loss."""

    @staticmethod
    def forward(fctx, y: Tensor, aux: Tensor) -> Tensor:
        return y.view_as(y)

    @staticmethod
    def backward(fctx, grad: Tensor):
        return grad, torch.ones((), dtype=grad.dtype, device=grad.device)


def _aux_part(ctx, scores: Tensor, total: Tensor, x_dims: tuple, experts: int, s: MoeSettings) -> Tensor:
    """This rank's summand of a * E * sum_e f_e * P_e (its tokens' part of P, over tp)."""
    tokens = math.prod(ctx.graph.dim(d) for d in x_dims[:-1])
    share = total.to(scores) / (tokens * s.top_k)
    return s.aux_loss * experts * (share * scores.sum(0)).sum() / tokens / ctx.mesh.size(MeshAxis.TP)


# ---- dispatch, experts, combine -------------------------------------------------------
def expert_forward(xt: Tensor, chosen: Tensor, gates: Tensor, keep: Tensor | None, weights: list[Tensor],
                   exchange: Exchange, s: MoeSettings, experts_fn) -> Tensor:
    """The indices live beside the choices (on the host in a rehearsal, whose data has no values);
    each goes to the data's device where it indexes data (there, a no-op)."""
    tokens, hidden = xt.shape
    expert, gate = chosen.reshape(-1), gates.reshape(-1)
    token = torch.arange(tokens, device=chosen.device).repeat_interleave(s.top_k)
    if keep is not None:
        kept = keep.reshape(-1).nonzero().squeeze(1)
        expert, gate, token = expert[kept], gate[kept.to(gate.device)], token[kept]
    slot = exchange.slot.to(expert.device)[expert]  # (ep rank, local expert) as one number
    order = torch.argsort(slot, stable=True)
    slot, gate, token = slot[order], gate[order.to(gate.device)], token[order].to(xt.device)
    send = torch.bincount(slot, minlength=exchange.slots).view(exchange.size, -1)
    recv = exchange.counts(send)
    rows = exchange.dispatch(xt.index_select(0, token), send, recv)
    back = exchange.combine(experts_fn(rows, recv, weights, s.swiglu), send, recv)
    return xt.new_zeros(tokens, hidden).index_add(0, token, back * gate.unsqueeze(1))


def _local_expert(recv: Tensor) -> Tensor:
    """The local expert of each received row (rows come by source rank, then local expert)."""
    local = torch.arange(recv.shape[1], device=recv.device).repeat(recv.shape[0])
    return local.repeat_interleave(recv.reshape(-1))


def _ffn(x: Tensor, weights: list[Tensor], swiglu: bool, mm) -> Tensor:
    if swiglu:
        gate, up, down = weights
        return mm(F.silu(mm(x, gate)) * mm(x, up), down)
    up, down = weights
    return mm(F.gelu(mm(x, up)), down)


def local_experts(rows: Tensor, recv: Tensor, weights: list[Tensor], swiglu: bool) -> Tensor:
    """The local experts on their received rows, each on its own slice (exact sizes, no
    padding, so what they keep for backward is what the plan estimates): as they come
    when grouped by expert already (one source rank), else grouped first."""
    if recv.shape[0] == 1:
        return sliced_experts(rows, recv, weights, swiglu)
    return grouped_experts(rows, recv, weights, swiglu)


def grouped_experts(rows: Tensor, recv: Tensor, weights: list[Tensor], swiglu: bool) -> Tensor:
    """Rows from several source ranks sorted by local expert (stable), each expert on its
    slice, the results put back in arrival order."""
    order = torch.argsort(_local_expert(recv), stable=True)
    out = sliced_experts(rows.index_select(0, order.to(rows.device)), recv.sum(0, keepdim=True), weights, swiglu)
    return out.index_select(0, torch.argsort(order).to(rows.device))  # gathers keep only their index for backward


def sliced_experts(rows: Tensor, recv: Tensor, weights: list[Tensor], swiglu: bool) -> Tensor:
    """One source rank's rows, grouped by local expert: each expert's FFN on its slice. The
    experts' matrices by `unbind`, whose backward stacks their gradients once; indexing
    (`w[e]`) would fill a zero gradient of the whole stack for each expert and add each in."""
    parts = rows.split(recv[0].tolist())
    per_expert = [w.unbind(0) for w in weights]
    return torch.cat([_ffn(part, [w[e] for w in per_expert], swiglu, torch.matmul) for e, part in enumerate(parts)])


def batched_experts(rows: Tensor, recv: Tensor, weights: list[Tensor], swiglu: bool) -> Tensor:
    """All local experts at once: rows grouped by expert, padded to the busiest, bmm."""
    local = _local_expert(recv)
    order = torch.argsort(local, stable=True)
    per_expert = recv.sum(0)
    expert = local[order]
    slot = torch.arange(local.numel(), device=rows.device) - (per_expert.cumsum(0) - per_expert)[expert]
    depth = int(per_expert.max()) if local.numel() else 0
    padded = rows.new_zeros(recv.shape[1], depth, rows.shape[1]).index_put((expert, slot), rows[order])
    out = _ffn(padded, weights, swiglu, torch.bmm)[expert, slot]
    return torch.zeros_like(out).index_copy(0, order, out)


def loop_experts(rows: Tensor, recv: Tensor, weights: list[Tensor], swiglu: bool) -> Tensor:
    """The same, one local expert at a time in a Python loop (the baseline of benchmarks/moe.py)."""
    local = _local_expert(recv)
    out = rows.new_zeros(rows.shape[0], weights[-1].shape[-1])
    for e in range(recv.shape[1]):
        index = (local == e).nonzero().squeeze(1)
        out = out.index_copy(0, index, _ffn(rows[index], [w[e] for w in weights], swiglu, torch.matmul))
    return out


__all__ = ["ExpertLoad", "batched_experts", "end_step", "grouped_experts", "local_experts", "loop_experts",
           "moe_kernel", "register_gathered", "register_params", "route", "sliced_experts"]
