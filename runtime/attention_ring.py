"""Ring attention over a context-parallel group: K/V blocks travel the ring, the sequence is never gathered.

Each member holds its q rows and one K/V block; at every step it attends to the block
in hand (`runtime/attention_blocks.py`) while passing it on to the next member, and in
backward each block's dk/dv accumulator travels with it and comes home after one
extra hop. Blocks whose keys all lie outside the causal band or the window compute
nothing but are still passed on.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from fivedc.errors import ShapeError
from fivedc.runtime import attention_fused
from fivedc.runtime.attention_blocks import (
    Block, accumulation_dtype, backward_into, check_attention_args, empty_partial, forward_into, one_head_dim,
    row_delta,
)
from fivedc.runtime.attention_pairs import plan_pairs
from fivedc.runtime.p2p import NOTHING, Transfer, exchange


@dataclass(frozen=True, slots=True)
class Ring:
    """A context-parallel group as a ring: block i of K/V starts on ring member i."""

    group: Any  # torch.distributed.ProcessGroup
    index: int  # this rank's position in the ring
    size: int
    prev_rank: int  # global ranks, for point-to-point
    next_rank: int
    block_positions: tuple[Tensor, ...]  # positions of the K/V block of each ring member

    def __post_init__(self) -> None:
        if not 0 <= self.index < self.size or len(self.block_positions) != self.size:
            raise ShapeError(
                f"ring member {self.index} of {self.size} with {len(self.block_positions)} block positions",
                hint="give one position tensor per ring member and an index in 0..size-1",
            )


def make_ring(group: Any, *, block_positions: tuple[Tensor, ...]) -> Ring:
    """The ring of `group` (None: the default group), in the group's rank order."""
    index, size = dist.get_rank(group), dist.get_world_size(group)
    global_rank = (lambda i: i) if group is None else (lambda i: dist.get_global_rank(group, i))
    return Ring(group, index, size, global_rank((index - 1) % size), global_rank((index + 1) % size),
                tuple(block_positions))


def _exchange(ring: Ring, send: Tensor, tag: int) -> tuple[Tensor, Transfer]:
    """Start sending `send` to the next ring member and receiving its like from the previous."""
    if ring.size == 1:
        return send, NOTHING
    return exchange(send, next_rank=ring.next_rank, prev_rank=ring.prev_rank, group=ring.group, tag=tag)


def _ring_block(kv: Tensor, ring: Ring, step: int, q_pos: Tensor, causal: bool, fused: bool,
                softcap: float, window: int) -> Block:
    """The block in hand at `step`; its pairs are none where every key is outside the window
    (nothing computed, the block still passed on)."""
    kv_pos = ring.block_positions[(ring.index - step) % ring.size]
    pairs = plan_pairs(q_pos, kv_pos, causal=causal, tiles=not fused, window=window)
    return Block(kv[0], kv[1], kv_pos, pairs, softcap, window)


class _RingAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, q: Tensor, k: Tensor, v: Tensor, q_pos: Tensor, ring: Ring, causal: bool,
                softcap: float, fused: bool, window: int) -> Tensor:
        out, lse = empty_partial(q)
        fused = fused and attention_fused.available(q) and not softcap  # torch's kernel has no softcap
        kv = torch.stack((k, v))  # one packed buffer to send
        for step in range(ring.size):
            last = step == ring.size - 1
            arriving, transfer = (None, NOTHING) if last else _exchange(ring, kv, tag=0)
            forward_into(out, lse, q, q_pos, _ring_block(kv, ring, step, q_pos, causal, fused, softcap, window),
                          fused=fused)
            transfer.wait()
            kv = arriving
        out = out.to(q.dtype)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.q_pos, ctx.ring, ctx.causal, ctx.fused, ctx.softcap = q_pos, ring, causal, fused, softcap
        ctx.window = window
        return out

    @staticmethod
    def backward(ctx: Any, dout: Tensor) -> tuple[Tensor | None, ...]:
        q, k, v, out, lse = ctx.saved_tensors
        ring, dtype = ctx.ring, accumulation_dtype(q.dtype)
        grads = (dout, lse, row_delta(dout, out))
        dq = torch.zeros(q.shape, dtype=dtype, device=q.device)
        kv, acc, acc_transfer = torch.stack((k, v)), None, NOTHING
        for step in range(ring.size):
            last = step == ring.size - 1
            arriving, kv_transfer = (None, NOTHING) if last else _exchange(ring, kv, tag=0)
            dkv = torch.zeros(kv.shape, dtype=dtype, device=kv.device)
            block = _ring_block(kv, ring, step, ctx.q_pos, ctx.causal, ctx.fused, ctx.softcap, ctx.window)
            if ctx.fused:
                attention_fused.backward_into(dq, dkv, q, ctx.q_pos, block, dout, out, lse)
            else:
                backward_into(dq, dkv, q, ctx.q_pos, block, grads)
            acc_transfer.wait()  # the accumulator of the block in hand, from its earlier holders
            if acc is not None:
                dkv += acc
            acc, acc_transfer = _exchange(ring, dkv, tag=1)  # on to the block's next holder
            kv_transfer.wait()
            kv = arriving
        acc_transfer.wait()  # the extra hop: every accumulator is home
        return dq.to(q.dtype), acc[0].to(k.dtype), acc[1].to(v.dtype), None, None, None, None, None, None


def ring_attention(q: Tensor, k: Tensor, v: Tensor, q_pos: Tensor, ring: Ring, *, causal: bool,
                   softcap: float = 0.0, fused: bool = True, window: int = 0) -> Tensor:
    """Softmax attention of this rank's q rows to the K/V blocks of every ring member,
    exact and differentiable; K/V blocks travel the ring, the sequence is never gathered.

    Every member calls it with its own q/k/v block; q_pos are the global positions of
    the q rows, `ring.block_positions` those of every member's K/V block; `fused` as blockwise's.
    """
    q, k, v, width = one_head_dim(q, k, v)
    check_attention_args(q, k, v, q_pos, ring.block_positions[ring.index])
    return _RingAttention.apply(q, k, v, q_pos, ring, causal, float(softcap), fused, int(window))[..., :width]
