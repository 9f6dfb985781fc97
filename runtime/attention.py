"""Exact attention computed block by block, locally and as ring attention over a CP group.

Attention over a key set is kept as a partial result: the output normalised over
those keys and the log-sum-exp of their scaled scores, and two partials over
disjoint key sets merge exactly (`merge_partials`). Every q and k/v row carries its
global sequence position, so causality is `pos_k <= pos_q` whatever the layout
(the load-balanced CP layout gives each rank two runs of positions). Pairs of
position runs are planned once (`plan_pairs`): fully masked pairs are skipped,
fully visible ones need no mask. `blockwise_attention` covers the local case and
`ring_attention` passes K/V blocks (and in backward their gradients) around the
ring of a context-parallel group. Layout: q [batch, heads, sq, head_dim], k and v
[batch, kv_heads, sk, head_dim]; grouped-query heads share K/V by broadcasting.
A `softcap` c > 0 (Gemma 2's logit softcapping) caps each scaled score s at
c * tanh(s / c) before the mask and the softmax; backward multiplies the scores'
gradient by its derivative 1 - tanh(s / c)^2, recomputed with the scores.
A causal `window` W > 0 (Mistral's and Gemma 2's sliding window) lets a query at
position i see the keys at i - W < j <= i: pairs whose keys all lie before every
query's window are skipped like those above the diagonal (a ring still passes the
block on), and pairs cut by the band's lower edge are masked.

Files: `runtime/attention_pairs.py` the merge rule and the pair plan;
`runtime/attention_blocks.py` the attention of q to one K/V block, pair by pair (by
matmuls, or by torch's fused kernel: `runtime/attention_fused.py`);
`runtime/attention_ring.py` ring attention; this file the local `blockwise_attention`.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from fivedc.runtime import attention_fused
from fivedc.runtime.attention_blocks import (
    Block, accumulation_dtype, backward_into, check_attention_args, empty_partial, forward_into, one_head_dim,
    row_delta,
)
from fivedc.runtime.attention_pairs import plan_pairs


class _BlockwiseAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, q: Tensor, k: Tensor, v: Tensor, q_pos: Tensor, kv_pos: Tensor,
                causal: bool, kv_blocks: int, softcap: float, fused: bool, window: int) -> Tensor:
        fused = fused and attention_fused.available(q) and not softcap  # torch's kernel has no softcap
        pairs = plan_pairs(q_pos, kv_pos, causal=causal, kv_blocks=kv_blocks, tiles=not fused, window=window)
        block = Block(k, v, kv_pos, pairs, softcap, window)
        out, lse = empty_partial(q)
        forward_into(out, lse, q, q_pos, block, fused=fused)
        out = out.to(q.dtype)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.positions, ctx.pairs, ctx.fused, ctx.softcap, ctx.window = (q_pos, kv_pos), pairs, fused, softcap, window
        return out

    @staticmethod
    def backward(ctx: Any, dout: Tensor) -> tuple[Tensor | None, ...]:
        q, k, v, out, lse = ctx.saved_tensors
        (q_pos, kv_pos), dtype = ctx.positions, accumulation_dtype(q.dtype)
        dq = torch.zeros(q.shape, dtype=dtype, device=q.device)
        dkv = torch.zeros((2, *k.shape), dtype=dtype, device=k.device)
        block = Block(k, v, kv_pos, ctx.pairs, ctx.softcap, ctx.window)
        if ctx.fused:
            attention_fused.backward_into(dq, dkv, q, q_pos, block, dout, out, lse)
        else:
            backward_into(dq, dkv, q, q_pos, block, (dout, lse, row_delta(dout, out)))
        return dq.to(q.dtype), dkv[0].to(k.dtype), dkv[1].to(v.dtype), None, None, None, None, None, None, None


def blockwise_attention(q: Tensor, k: Tensor, v: Tensor, q_pos: Tensor, kv_pos: Tensor, *,
                        causal: bool, kv_blocks: int = 1, softcap: float = 0.0, fused: bool = True,
                        window: int = 0) -> Tensor:
    """Softmax attention of q to k/v [batch, heads, sq, head_dim], computed without ever
    holding the scores of more than one (q run x k/v run) pair; exact, differentiable.

    q_pos [sq] and kv_pos [sk] are global positions; under `causal`, a query sees the
    keys at positions up to its own. k/v are cut into `kv_blocks` equal blocks. softcap > 0: scores
    capped at softcap * tanh(score / softcap). fused=False (the `math` kernel): explicit matmuls.
    window W > 0: a query at i sees the keys at i - W < j <= i (pairs outside the band skipped).
    """
    q, k, v, width = one_head_dim(q, k, v)
    check_attention_args(q, k, v, q_pos, kv_pos)
    return _BlockwiseAttention.apply(q, k, v, q_pos, kv_pos, causal, kv_blocks, float(softcap), fused,
                                     int(window))[..., :width]
