"""A gather over tp run in a ring, its first reader's matmul computed chunk by chunk as they arrive.

Collective matmul (the all-gather side of Megatron's tp-comm-overlap and of torch's
async TP): under sequence parallelism a column-parallel linear reads its input gathered
over tp along the sequence. Where the plan marks that all-gather so (its forward
`Collective.overlaps`, from `fivedc/passes/communication.py`), the redistribution does
not wait for the whole tensor. It starts a ring (`RingGather`): hop s (1..n-1) sends the
chunk this rank received at hop s-1 (at hop 1, its own) to the next group member and
receives the following one from the previous member, so after hop s it holds chunk
i - s. The linear reading it (`fivedc/runtime/kernels._linear`, through `product`)
multiplies its own chunk first, then each chunk as its hop completes, while the next
hop runs; then the gathered tensor is put together for the other readers and for
autograd, whose backward is unchanged (the linear's, and the gather's reduce-scatter).

Hop s + 1 is posted once hop s's receive is done: it sends what that receive wrote.
The program finishes a ring no reader drove (`finish_ring`) before anything else reads
the value. Every rank of the group posts the same hops in the same order; the
agreement proof lists them as `send_recv` events (`fivedc/proof/comm_program.py`).
"""

from __future__ import annotations

import torch
from torch import Tensor

from fivedc.proof.events import RING_TAG
from fivedc.runtime.groups import MeshGroups
from fivedc.runtime.p2p import Transfer, exchange
from fivedc.runtime.precision import for_matmul

_ATTR = "_fivedc_ring"


class RingGather:
    """The chunks of one all-gather along `dim` over the group of `axes`, one hop at a time."""

    def __init__(self, shard: Tensor, dim: int, axes, groups: MeshGroups, out: Tensor) -> None:
        self.n, self.index, self.dim, self.out = groups.size(axes), groups.index(axes), dim, out
        members = groups.members(axes)
        self.next_rank, self.prev_rank = members[(self.index + 1) % self.n], members[(self.index - 1) % self.n]
        self.group = groups.group(axes)
        self.chunks: list[Tensor | None] = [None] * self.n
        self.chunks[self.index] = shard.detach().contiguous()
        self.transfers: list[Transfer] = []
        self.arrived = 0  # hops whose receive is done
        self.done = False
        self._post()

    def _holding_after(self, hop: int) -> int:
        return (self.index - hop) % self.n

    def _post(self) -> None:
        """Post the next hop: send what the last one brought (or this rank's own chunk)."""
        hop = len(self.transfers) + 1
        send = self.chunks[self._holding_after(hop - 1)]
        received, transfer = exchange(send, next_rank=self.next_rank, prev_rank=self.prev_rank, group=self.group,
                                      tag=RING_TAG)
        self.chunks[self._holding_after(hop)] = received
        self.transfers.append(transfer)

    def _take(self, hop: int) -> None:
        """Wait for hop `hop` (its send and receive; a request is waited for once), then post the next."""
        if self.arrived < hop:
            self.transfers[hop - 1].wait()
            self.arrived = hop
            if hop < self.n - 1:
                self._post()

    def arrivals(self):
        """(group index, chunk) in the order they arrive, this rank's own first; each hop is
        waited for, and the next one posted, as the caller asks for its chunk."""
        yield self.index, self.chunks[self.index]
        for hop in range(1, self.n):
            self._take(hop)
            yield self._holding_after(hop), self.chunks[self._holding_after(hop)]

    def finish(self) -> Tensor:
        """Wait for every hop and put the chunks together in `out` (the gathered value)."""
        if not self.done:
            for hop in range(1, self.n):
                self._take(hop)
            with torch.no_grad():
                torch.cat(self.chunks, dim=self.dim, out=self.out)  # type: ignore[arg-type]
            self.chunks, self.transfers, self.done = [], [], True
        return self.out


def start_ring(shard: Tensor, dim: int, axes, groups: MeshGroups) -> RingGather:
    """The ring that fills `.out`, the gathered tensor (empty until the chunks are in)."""
    shape = list(shard.shape)
    shape[dim] *= groups.size(axes)
    return RingGather(shard, dim, axes, groups, shard.new_empty(shape))


def mark_ring(value: Tensor, ring: RingGather) -> Tensor:
    setattr(value, _ATTR, ring)
    return value


def finish_ring(value: Tensor) -> None:
    """Complete the gather of `value` if a ring is still filling it."""
    ring = getattr(value, _ATTR, None)
    if ring is not None:
        ring.finish()


def product(x: Tensor, w: Tensor, k: int) -> Tensor | None:
    """`tensordot(x, w, dims=k)` without autograd, chunk by chunk as x's ring brings them
    (the gather dim is one x keeps), x completed at the end; None when no ring fills x."""
    ring: RingGather | None = getattr(x, _ATTR, None)
    if ring is None or ring.done:
        return None
    if ring.dim >= x.dim() - k:  # the gather dim is contracted: no chunk makes a part of the product
        ring.finish()
        return None
    out, size = None, x.shape[ring.dim] // ring.n
    with torch.no_grad():
        held = None
        for index, chunk in ring.arrivals():
            if held is None:
                chunk, held = for_matmul(chunk, w)  # autocast: w cast once
            else:
                (chunk,) = for_matmul(chunk)
            part = torch.tensordot(chunk, held.to(chunk.dtype), dims=k)
            if out is None:
                shape = list(part.shape)
                shape[ring.dim] *= ring.n
                out = part.new_empty(shape)
            out.narrow(ring.dim, index * size, size).copy_(part)  # one chunk's product at a time beside it
        ring.finish()
        return out


class Product(torch.autograd.Function):
    """`tensordot(x, w, dims=k)` whose forward value was computed already (`product`)."""

    @staticmethod
    def forward(fctx, x: Tensor, w: Tensor, k: int, value: Tensor) -> Tensor:
        fctx.k = k
        fctx.save_for_backward(x, w)
        return value

    @staticmethod
    def backward(fctx, grad_out: Tensor):
        x, w = fctx.saved_tensors
        lead = x.dim() - fctx.k
        grad_x = grad_w = None
        if fctx.needs_input_grad[0]:
            grad_x = torch.tensordot(grad_out, w, dims=(list(range(lead, grad_out.dim())), list(range(fctx.k, w.dim()))))
        if fctx.needs_input_grad[1]:
            dims = list(range(lead))
            grad_w = torch.tensordot(x, grad_out, dims=(dims, dims)).to(w.dtype)
        return grad_x, grad_w, None, None
