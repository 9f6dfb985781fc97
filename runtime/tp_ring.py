"""Tensor parallelism's forward collectives in rings beside their linears (collective matmul).

Megatron's tp-comm-overlap and torch's async TP: under sequence parallelism a
column-parallel linear reads its input gathered over tp along the sequence, and a
row-parallel linear's partial output is reduce-scattered over tp along it. Where the
plan marks such a collective (its forward `Collective.overlaps`, from
`passes/communication.py`), it runs as n - 1 hops around the group's ring, each
hop beside one chunk's matmul:

- the gather (`RingGather`): the redistribution does not wait for the whole tensor. Hop
  s (1..n-1) sends the chunk this rank received at hop s-1 (at hop 1, its own) to the
  next member and receives the following one from the previous member, so after hop s
  it holds chunk i - s. The linear reading it (`runtime/kernels._linear`, through
  `product`, the program handing it the ring) multiplies its own chunk first, then each
  chunk as its hop completes, while the next hop runs; then the gathered tensor is put
  together for the other readers.
  Hop s + 1 is posted once hop s's receive is done: it sends what that receive wrote;
- the reduce-scatter (`RingSum`): the linear making the partial output (through
  `summed_product`, the program handing it the sum) makes its part of chunk i - 1 and sends it on; then its part of
  chunk i - 2 while that hop runs, adds what the previous member summed of that chunk,
  sends it on; and so on, ending with its own chunk summed over the group. In backward
  the sum's gradient is gathered back in a ring (`RingSum.gather_grad_of`), and the
  linear's `Product` makes its input gradient a chunk at a time as the hops land, then
  its weight gradient from the whole gradient;
- the all-reduce (`ChunkedSum`, without SP): the linear makes its product in n chunks,
  each chunk's all-reduce started as it is made, so all but the last run beside a
  chunk's matmul.

Either product enters autograd as the linear's (`Product`), so backward is unchanged.
Which linear reads a gather by chunks and which feeds a sum is worked out once from the
plan (`runtime/linear_paths.py`); the program passes the ring or sum to that
linear's kernel, finishes a gather before anything else reads the value (right after its
reader, the op after the redistribution), and runs a sum's hops on the whole value where
no linear fed them. Every rank of the group posts the
same hops in the same order; the agreement proof lists them as `send_recv` events
(`fivedc/instructions/comm_program.py`).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import Tensor

from fivedc.instructions.events import RING_TAG
from fivedc.runtime.collectives import Step, chunk_size
from fivedc.runtime.groups import MeshGroups
from fivedc.runtime.p2p import Transfer, exchange
from fivedc.runtime.precision import for_matmul


class _Ring:
    """This rank's place in the ring of the group of `step` (the plan's collective: its axes,
    in group-index order, and the tensor dim cut into n chunks)."""

    def __init__(self, step: Step, groups: MeshGroups) -> None:
        self.step, self.groups, self.dim = step, groups, step.dim
        self.n, self.index = groups.size(step.axes), groups.index(step.axes)
        members = groups.members(step.axes)
        self.next_rank, self.prev_rank = members[(self.index + 1) % self.n], members[(self.index - 1) % self.n]
        self.group = groups.group(step.axes)

    def chunk_size(self, t: Tensor) -> int:
        return chunk_size(t, self.step, self.n)

    def _exchange(self, send: Tensor) -> tuple[Tensor, Transfer]:
        return exchange(send, next_rank=self.next_rank, prev_rank=self.prev_rank, group=self.group, tag=RING_TAG)


class RingGather(_Ring):
    """The chunks of one all-gather `step`, one hop at a time."""

    def __init__(self, shard: Tensor, step: Step, groups: MeshGroups, out: Tensor) -> None:
        super().__init__(step, groups)
        self.out = out
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
        received, transfer = self._exchange(send)
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

    def finish(self) -> Tensor | None:
        """Wait for every hop and put the chunks together in `out`, the gathered value, which
        the first call returns (the ring lets go of it: whatever still holds the ring does not
        keep the value alive)."""
        if self.done:
            return None
        for hop in range(1, self.n):
            self._take(hop)
        with torch.no_grad():
            torch.cat(self.chunks, dim=self.dim, out=self.out)  # type: ignore[arg-type]
        out, self.out, self.chunks, self.transfers, self.done = self.out, None, [], [], True
        return out


def start_ring(shard: Tensor, step: Step, groups: MeshGroups) -> RingGather:
    """The ring of the all-gather `step` that fills `.out`, the gathered tensor (empty until
    the chunks are in)."""
    shape = list(shard.shape)
    shape[step.dim] *= groups.size(step.axes)  # type: ignore[index]
    return RingGather(shard, step, groups, shard.new_empty(shape))


def product(x: Tensor, w: Tensor, k: int, ring: RingGather) -> Tensor | None:
    """`tensordot(x, w, dims=k)` without autograd, chunk by chunk as `ring` (filling x, its
    `out`) brings them (the gather dim is one x keeps), x completed at the end; None when
    the ring is done already, or, completing x first, when the gather dim is contracted (the
    program's paths never ask for that: `runtime/linear_paths.py`)."""
    if ring.done:
        return None
    if ring.dim >= x.dim() - k:  # the gather dim is contracted: no chunk makes a part of the product
        ring.finish()
        return None
    out, size = None, ring.chunk_size(x)
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


class _Sum(_Ring):
    """A sum over the group fed chunk by chunk (`run`, subclasses), whose result is `out`."""

    sums_in_place = False  # whether `run` overwrites the addends it is given

    def __init__(self, step: Step, groups: MeshGroups) -> None:
        super().__init__(step, groups)
        self.out: Tensor | None = None

    def run(self, part) -> None:
        raise NotImplementedError

    def finish(self, whole: Tensor) -> Tensor:
        """The sum; where no product fed it, it runs on the chunks of `whole` now."""
        if self.out is None:
            size = self.chunk_size(whole)

            def part(j: int) -> Tensor:
                chunk = whole.detach().narrow(self.dim, j * size, size)
                return chunk.clone() if self.sums_in_place else chunk
            self.run(part)
        return self.out  # type: ignore[return-value]


class RingSum(_Sum):
    """A reduce-scatter `step` in a ring, fed chunk by chunk.

    The sum of chunk j starts on member j + 1 and goes around: at step t (0..n-1) this rank
    makes its part of chunk i - t - 1, adds what the previous member summed of it (the hop
    posted at step t - 1, which ran while this part was made) and sends it on; at the last
    step the chunk is its own, summed over the group: `out`. `grad_step`: the backward's
    all-gather of the sum's gradient, where the plan runs it in a ring too."""

    def __init__(self, step: Step, groups: MeshGroups, *, grad_step: Step | None = None) -> None:
        super().__init__(step, groups)
        self.grad_step = grad_step
        self.fed_product = False  # the linear's autograd node (`Product`) can take that gradient by chunks
        self.grad_ring: RingGather | None = None  # that gather, started by the sum's backward

    def gather_grad_of(self, grad: Tensor) -> Tensor:
        """The backward of the sum: its gradient gathered in a ring. Where the linear's `Product`
        takes it by chunks, the ring is left to it (the tensor returned fills as it runs);
        else it is waited for here."""
        ring = start_ring(grad, self.grad_step, self.groups)  # type: ignore[arg-type]
        if self.fed_product:
            self.grad_ring = ring
            return ring.out
        return ring.finish()

    def run(self, part) -> None:
        """`part(j)`: this rank's addend of chunk j, made when the ring needs it."""
        received = transfer = None
        for step in range(self.n):
            summed = part((self.index - step - 1) % self.n)
            if transfer is not None:
                transfer.wait()
                summed = summed + received
            if step < self.n - 1:
                received, transfer = self._exchange(summed.contiguous())
            else:
                self.out = summed


class ChunkedSum(_Sum):
    """An all-reduce `step` in n chunks along its dim, fed chunk by chunk: each chunk's
    all-reduce starts (async) as it is made, while the next one is; `out` is the whole sum,
    once every chunk's is done."""

    sums_in_place = True  # all-reduce sums into its input

    def run(self, part) -> None:
        """`part(j)`: this rank's addend of chunk j, made when its sum is to start."""
        summed, works = [], []
        for j in range(self.n):
            summed.append(part(j).contiguous())
            works.append(dist.all_reduce(summed[-1], group=self.group, async_op=True))
        for work in works:
            work.wait()
        self.out = torch.cat(summed, dim=self.dim)


def summed_product(x: Tensor, w: Tensor, k: int, ring: RingSum | ChunkedSum) -> Tensor | None:
    """`tensordot(x, w, dims=k)` without autograd (the partial product, whole) made chunk by chunk
    along the ring's dim in the order its sums need them (`RingSum.run`, `ChunkedSum.run`);
    None where that dim is one the product contracts."""
    lead = x.dim() - k
    if ring.dim >= lead:
        return None
    size = ring.chunk_size(x)
    out: list[Tensor] = []
    with torch.no_grad():
        x, w = for_matmul(x, w)
        w = w.to(x.dtype)

        def part(j: int) -> Tensor:
            made = torch.tensordot(x.narrow(ring.dim, j * size, size), w, dims=k)
            if not out:
                shape = list(made.shape)
                shape[ring.dim] *= ring.n
                out.append(made.new_empty(shape))
            out[0].narrow(ring.dim, j * size, size).copy_(made)
            return made
        ring.run(part)
        return out[0]


class Product(torch.autograd.Function):
    """`tensordot(x, w, dims=k)` whose forward value was computed already (`product`,
    `summed_product`). With `summing` (a `RingSum` whose gradient the plan gathers in a ring:
    `grad_step`),
    backward takes the output's gradient as that ring brings it: the input gradient of each
    chunk as it arrives, while the next hop runs; then the weight gradient, whole."""

    @staticmethod
    def forward(fctx, x: Tensor, w: Tensor, k: int, value: Tensor, summing: RingSum | None = None) -> Tensor:
        fctx.k, fctx.summing = k, summing
        if summing is not None:
            summing.fed_product = summing.grad_step is not None
        fctx.save_for_backward(x, w)
        return value

    @staticmethod
    def backward(fctx, grad_out: Tensor):
        x, w = fctx.saved_tensors
        lead = x.dim() - fctx.k
        ring = fctx.summing.grad_ring if fctx.summing is not None else None
        outputs = (list(range(lead, grad_out.dim())), list(range(fctx.k, w.dim())))
        grad_x = grad_w = None
        if ring is not None:  # the gradient arriving by chunks: dX a chunk at a time beside the hops
            fctx.summing.grad_ring, size = None, ring.chunk_size(grad_out)
            if fctx.needs_input_grad[0]:
                grad_x = x.new_empty(x.shape)
                for index, chunk in ring.arrivals():
                    grad_x.narrow(ring.dim, index * size, size).copy_(torch.tensordot(chunk, w, dims=outputs))
            grad_out = ring.finish()
        elif fctx.needs_input_grad[0]:
            grad_x = torch.tensordot(grad_out, w, dims=outputs)
        if fctx.needs_input_grad[1]:
            dims = list(range(lead))
            grad_w = torch.tensordot(x, grad_out, dims=(dims, dims)).to(w.dtype)
        return grad_x, grad_w, None, None, None
