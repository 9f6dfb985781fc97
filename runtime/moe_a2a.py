"""Token rows to the ep ranks that hold their experts and back: flat or hierarchical all-to-all.

`Exchange.of(ctx, op, experts)` reads the group from the plan (the axes of the op's
all-to-all collectives, so the runtime runs what the plan says) and the placement
and all-to-all kind from the op's `@ep(...)`. Per MoE call: `counts` exchanges how
many rows each rank sends to each (ep rank, local expert); `dispatch` sends the rows
(sorted by that slot) with those uneven splits and hands back the received rows in
(source rank, local expert) order; `combine` sends results back the same way in
reverse. Every step is `_AllToAll`, whose backward is the reverse all-to-all, and
row permutations, so autograd differentiates the whole exchange.

Hierarchical (`@ep(hierarchical, ranks per node)`): ep index i = node * g + local
index. Step 1 moves every row inside its node to the rank whose local index is
the destination's; step 2 moves it between nodes among ranks of equal local
index. Rows arrive in the same order as with the flat all-to-all. The two levels'
groups are made with `new_group(use_local_synchronization=True)` on first use, so
only their members take part.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import Tensor

from fivedc.errors import PassError
from fivedc.ir.graph import CollectiveKind, Op
from fivedc.passes.experts import ExpertLayout, node_levels
from fivedc.runtime.groups import moves_nothing


class _AllToAll(torch.autograd.Function):
    """Uneven all_to_all_single of rows; the gradient goes back with the splits swapped."""

    @staticmethod
    def forward(fctx, rows: Tensor, send: list[int], recv: list[int], group) -> Tensor:
        fctx.send, fctx.recv, fctx.group = send, recv, group
        return _all_to_all(rows, send, recv, group)

    @staticmethod
    def backward(fctx, grad: Tensor):
        return _all_to_all(grad, fctx.recv, fctx.send, fctx.group), None, None, None


def _all_to_all(rows: Tensor, send: list[int], recv: list[int], group) -> Tensor:
    if group is None:
        return rows.clone()
    out = rows.new_empty((sum(recv),) + tuple(rows.shape[1:]))
    dist.all_to_all_single(out, rows.contiguous(), recv, send, group=group)
    return out


def _exchange_counts(counts: Tensor, group) -> Tensor:
    """counts[i, ...] goes to rank i; the result's [i, ...] came from rank i."""
    if group is None or moves_nothing(group):  # a rehearsal: every rank sends what this one sends
        return counts.clone()
    out = torch.empty_like(counts)
    dist.all_to_all_single(out.view(-1), counts.contiguous().view(-1), group=group)
    return out


def _regroup(counts: Tensor, axes: tuple[int, ...]) -> Tensor:
    """Rows come in segments, counts[a, b, c] rows each in flattened order; the
    permutation that orders them by the segments' multi-index permuted by `axes`."""
    old = torch.arange(counts.numel(), device=counts.device).view(counts.shape).permute(*axes).reshape(-1)
    new = torch.empty_like(old)
    new[old] = torch.arange(old.numel(), device=old.device)
    segment = torch.arange(counts.numel(), device=counts.device).repeat_interleave(counts.reshape(-1))
    return torch.argsort(new[segment], stable=True)


def _permute(rows: Tensor, order: Tensor) -> Tensor:
    return rows.index_select(0, order.to(rows.device))


def _unpermute(rows: Tensor, order: Tensor) -> Tensor:
    """The inverse of `_permute`, as a gather (index_copy would keep `rows` for backward)."""
    return rows.index_select(0, torch.argsort(order).to(rows.device))


@dataclass
class Exchange:
    size: int  # ranks in the ep group
    slot: Tensor  # per expert: ep rank * local experts + its index there
    slots: int
    group: object | None = None
    levels: tuple | None = None  # hierarchical: (ranks per node g, nodes n, intra group, inter group)
    _state: dict = field(default_factory=dict)

    @staticmethod
    def of(ctx, op: Op, experts: int) -> Exchange:
        a2a = next((c for c in op.collectives if c.kind == CollectiveKind.ALL_TO_ALL), None)
        if a2a is None or ctx.groups is None or ctx.groups.size(a2a.axes) == 1:
            return Exchange(1, torch.arange(experts), experts)
        axes, groups = a2a.axes, ctx.groups
        if groups.positions(axes) != tuple(range(groups.size(axes))):
            raise PassError(f"the process group of {','.join(axes)} is not in mesh order; moe needs it")
        size = groups.size(axes)
        layout = ExpertLayout.of(op, experts, size)
        per_rank = experts // size
        held = [0] * size  # expert e is the held[r]-th of its owner r's (they store them in expert order)
        local = []
        for owner in layout.owners:
            local.append(held[owner])
            held[owner] += 1
        slot = torch.tensor([r * per_rank + i for r, i in zip(layout.owners, local)])
        levels = _levels(ctx, axes, layout.node_ranks) if layout.all_to_all == "hierarchical" else None
        return Exchange(size, slot, experts, groups.group(axes), levels)

    def counts(self, send: Tensor) -> Tensor:
        """[ep, local experts] rows this rank sends -> rows it receives, per source rank."""
        if self.levels is None:
            return _exchange_counts(send, self.group)
        g, n, intra, inter = self.levels
        per_node = send.view(n, g, -1)
        self._state["sent"] = per_node
        first = _exchange_counts(per_node.transpose(0, 1).contiguous(), intra)  # [from la, to node b, e]
        self._state["first"] = first
        return _exchange_counts(first.transpose(0, 1).contiguous(), inter).view(n * g, -1)  # [node a, la, e]

    def dispatch(self, rows: Tensor, send: Tensor, recv: Tensor) -> Tensor:
        if self.levels is None:
            return _AllToAll.apply(rows, send.sum(1).tolist(), recv.sum(1).tolist(), self.group)
        g, n, intra, inter = self.levels
        sent, first = self._state["sent"], self._state["first"]
        self._state["order1"] = order1 = _regroup(sent, (1, 0, 2))  # by destination's local index
        rows = _AllToAll.apply(_permute(rows, order1), sent.sum((0, 2)).tolist(), first.sum((1, 2)).tolist(), intra)
        self._state["order2"] = order2 = _regroup(first, (1, 0, 2))  # by destination node
        return _AllToAll.apply(_permute(rows, order2), first.sum((0, 2)).tolist(),
                               recv.view(n, g, -1).sum((1, 2)).tolist(), inter)

    def combine(self, rows: Tensor, send: Tensor, recv: Tensor) -> Tensor:
        if self.levels is None:
            return _AllToAll.apply(rows, recv.sum(1).tolist(), send.sum(1).tolist(), self.group)
        g, n, intra, inter = self.levels
        sent, first = self._state["sent"], self._state["first"]
        rows = _AllToAll.apply(rows, recv.view(n, g, -1).sum((1, 2)).tolist(), first.sum((0, 2)).tolist(), inter)
        rows = _unpermute(rows, self._state["order2"])
        rows = _AllToAll.apply(rows, first.sum((1, 2)).tolist(), sent.sum((0, 2)).tolist(), intra)
        return _unpermute(rows, self._state["order1"])


def _levels(ctx, axes, node_ranks: int) -> tuple:
    """(g, n, intra-node group, inter-node group) for this rank's ep group, made once."""
    key = ("moe-levels", axes, node_ranks)
    if key not in ctx._cache:
        g, n = node_levels(ctx.mesh, node_ranks)
        members = ctx.mesh.group_ranks(axes, ctx.mesh.rank_of(ctx.coords))
        index = members.index(ctx.mesh.rank_of(ctx.coords))
        node, local = divmod(index, g)
        intra = [members[node * g + i] for i in range(g)]
        inter = [members[b * g + local] for b in range(n)]
        make = lambda ranks: dist.new_group(ranks, use_local_synchronization=True) if len(ranks) > 1 else None  # noqa: E731
        ctx._cache[key] = (g, n, make(intra), make(inter))
    return ctx._cache[key]
