"""Attention blocks by torch's fused kernel (flash attention on the CPU), for blockwise and ring attention.

A block is a (q run, k/v run) pair of `runtime/attention_pairs.py`: rows of consecutive
global positions. The fused kernel returns the block's output and its log-sum-exp,
which merge with the other blocks' exactly (`merge_partials`); its backward, given
the rows' final output and log-sum-exp (over every block), computes this block's
share of dq, dk and dv: P = exp(S - lse) are then the true attention weights
restricted to the block, and the softmax's row term is the whole row's. Grouped-query
heads share K/V inside the kernel (no repeated K/V), and a run is never cut into
tiles: the kernel keeps its memory linear in the sequence.

A causal pair on the diagonal covers the same positions on both sides whenever the
runs are aligned (cp's chunks are), and is the kernel's own causal mask; any other
partly visible pair gets an explicit additive mask. Used where torch has the kernel:
the CPU, in float64, float32, bfloat16 and float16 (`available`); elsewhere the
blocks are computed by `runtime/attention_blocks.py`'s own matmuls.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from fivedc.runtime.attention_band import visible as band

_FORWARD = getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu", None)
_BACKWARD = getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu_backward", None)
_DTYPES = (torch.float64, torch.float32, torch.bfloat16, torch.float16)


def available(q: Tensor) -> bool:
    """Whether the fused kernel computes attention for tensors like `q`."""
    return _FORWARD is not None and _BACKWARD is not None and q.device.type == "cpu" and q.dtype in _DTYPES


def _mask(pair, q_pos: Tensor, block, dtype: torch.dtype) -> tuple[bool, Tensor | None, Tensor | None]:
    """(is_causal, attn_mask, blind rows) for a pair: no mask, the kernel's causal mask (the
    same positions on both sides, no window), or an additive mask from the positions (a
    sliding window's band among them), with the rows that see no key of the pair (the
    kernel gives them log-sum-exp 0, not -inf)."""
    if not pair.masked:
        return False, None, None
    (qo, qn), (ko, kn) = pair.q, pair.kv
    rows, cols = q_pos[qo:qo + qn], block.kv_pos[ko:ko + kn]
    if qn == kn and not block.window and bool((rows == cols).all()):
        return True, None, None
    visible = band(rows, cols, block.window)
    mask = torch.zeros(visible.shape, dtype=dtype).masked_fill_(~visible, -math.inf)
    return False, mask, ~visible.any(dim=1)


def pair_forward(q: Tensor, q_pos: Tensor, block, pair) -> tuple[Tensor, Tensor]:
    """The attention of the pair's q rows to its k/v rows: (output, log-sum-exp), which
    `runtime/attention_blocks.py` merges with the other pairs'."""
    (qo, qn), (ko, kn) = pair.q, pair.kv
    causal, mask, blind = _mask(pair, q_pos, block, q.dtype)
    part, part_lse = _FORWARD(q[:, :, qo:qo + qn], block.k[:, :, ko:ko + kn], block.v[:, :, ko:ko + kn], 0.0,
                              causal, attn_mask=mask)
    if blind is not None and bool(blind.any()):
        part_lse = part_lse.masked_fill(blind.to(part_lse.device), -math.inf)
    return part, part_lse


def backward_into(dq: Tensor, dkv: Tensor, q: Tensor, q_pos: Tensor, block, dout: Tensor, out: Tensor,
                  lse: Tensor) -> None:
    """Add this block's share of the gradients into dq [b, heads, sq, d] and dkv [2, b,
    kv_heads, sk, d]; `out` and `lse` are the rows' final ones (over every block)."""
    for pair in block.pairs:
        (qo, qn), (ko, kn) = pair.q, pair.kv
        causal, mask, _ = _mask(pair, q_pos, block, q.dtype)
        rows = slice(qo, qo + qn)
        grad_q, grad_k, grad_v = _BACKWARD(
            dout[:, :, rows].contiguous(), q[:, :, rows], block.k[:, :, ko:ko + kn], block.v[:, :, ko:ko + kn],
            out[:, :, rows].contiguous(), lse[:, :, rows].contiguous(), 0.0, causal, attn_mask=mask)
        dq[:, :, rows] += grad_q
        dkv[0, :, :, ko:ko + kn] += grad_k
        dkv[1, :, :, ko:ko + kn] += grad_v
