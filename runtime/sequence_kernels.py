"""The kernels that read the sequence's global positions: rope and attention.

Positions come from the `KernelContext` (`runtime/kernel_context.py`): a rank's chunk
of the sequence in layout order. `rope` rotates by a cos/sin table of them, computed
once per layout; `attention` runs SDPA on one device, and across cp blockwise
attention at global positions (`runtime/attention.py`), as ring attention
(`runtime/attention_ring.py`) or over the gathered K/V. Entries of
`runtime/kernels.py`'s table.
"""

from __future__ import annotations

import contextlib

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.nn.attention import SDPBackend, sdpa_kernel

from fivedc.ir.mesh import MeshAxis
from fivedc.ir.ops import parse_freqs
from fivedc.passes.attention_kernel import kernel_of
from fivedc.runtime.attention import blockwise_attention
from fivedc.runtime.attention_ring import ring_attention
from fivedc.runtime.kernel_context import Dims, align, index_device
from fivedc.runtime.precision import compute_dtype, for_matmul


def rope(ctx, op, args, dims):
    (x,), (x_dims,) = args, dims
    half = x.shape[-1] // 2
    cos, sin = _rope_table(ctx, op, x, x_dims)
    xc = x.to(cos.dtype)  # rotated in float32 at least, rounded once at the end (as a float32 table does)
    x1, x2 = xc[..., :half], xc[..., half:]
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1).to(x.dtype)


def _rope_table(ctx, op, x: Tensor, x_dims: Dims) -> tuple[Tensor, Tensor]:
    """cos and sin of this rank's global positions times the frequencies, aligned to x;
    computed once per layout, dtype and device (every layer and step reuses them)."""
    seq, sharding = ctx.graph.seq_dim, op.arg_sharding(0)
    theta = float(op.attr("theta", 10000.0))
    given = str(op.attr("freqs", "") or "")
    key = ("rope", str(sharding), theta, given, x.shape[-1], x_dims, compute_dtype(x.dtype), x.device)
    if key not in ctx._cache:  # angles in float32 at least: bfloat16 cannot count positions past 256
        dtype = compute_dtype(x.dtype)
        positions = ctx.positions(seq, sharding).to(device=x.device, dtype=dtype)
        half = x.shape[-1] // 2
        if given:
            freqs = torch.tensor(parse_freqs(given), dtype=dtype, device=x.device)
        else:
            freqs = theta ** (-torch.arange(0, half, dtype=dtype, device=x.device) / half)
        angles = positions[:, None] * freqs[None, :]
        ctx._cache[key] = tuple(align(f(angles), (seq, x_dims[-1]), x_dims) for f in (torch.cos, torch.sin))
    return ctx._cache[key]


def attention(ctx, op, args, dims):
    """SDPA on one device; across cp, blockwise attention at global positions: ring
    attention, or over the gathered K/V (one block per cp rank) for @cp(allgather).
    Scores capped by a `softcap` (which SDPA has not) take the blockwise kernel on one device too, and
    so does a sliding `window` (its pairs outside the band skipped, as across cp).
    The op's kernel (`passes/attention_kernel.py`): `math` runs SDPA's math backend
    (the scores materialised), and across cp the blocks by explicit matmuls; `flash2` pins
    SDPA to FlashAttention-2 on a GPU."""
    q, k, v = [t.transpose(1, 2) for t in for_matmul(*args)]  # [batch, heads, seq, head_dim]
    causal, softcap = bool(op.attr("causal", True)), float(op.attr("softcap", 0.0) or 0.0)
    window = int(op.attr("window", 0) or 0)
    fused = kernel_of(op) != "math"
    cp = ctx.mesh.size(MeshAxis.CP)
    if cp == 1 and (softcap or window):
        pos = torch.arange(q.shape[2], device=index_device(q.device))
        return blockwise_attention(q, k, v, pos, pos, causal=causal, softcap=softcap, fused=fused,
                                   window=window).transpose(1, 2)
    if cp == 1 and fused and q.is_meta:  # a rehearsal: the fused kernel a GPU runs (meta would take SDPA's math)
        return _fused_on_meta(q, k, v, causal).transpose(1, 2)
    if cp == 1:  # grouped-query heads share K/V inside the kernel: no repeated copies are kept
        with _backends(kernel_of(op), q):
            return F.scaled_dot_product_attention(q, k, v, is_causal=causal,
                                                  enable_gqa=q.shape[1] != k.shape[1]).transpose(1, 2)
    seq = ctx.graph.seq_dim
    q_pos = ctx.positions(seq, op.arg_sharding(0)).to(index_device(q.device))
    if op.annotation("cp").args[0] == "ring":
        out = ring_attention(q, k, v, q_pos, ctx.ring(op.arg_sharding(1), q.device), causal=causal, softcap=softcap,
                             fused=fused, window=window)
    else:
        kv_pos = ctx.positions(seq, op.arg_sharding(1)).to(index_device(q.device))
        out = blockwise_attention(q, k, v, q_pos, kv_pos, causal=causal, kv_blocks=cp, softcap=softcap, fused=fused,
                                  window=window)
    return out.transpose(1, 2)


def _backends(kernel: str, q: Tensor):
    """SDPA's backends for the op's kernel: math's; flash2 on a GPU, FlashAttention-2 (SDPA's
    flash backend; memory-efficient attention where it cannot run, as torchtitan pinned them;
    math only where neither can, float64), never cuDNN's; else what SDPA picks (on a CPU every
    fused kernel computes the same)."""
    if kernel == "math":
        return sdpa_kernel(SDPBackend.MATH)
    if kernel == "flash2" and q.is_cuda:
        return sdpa_kernel([SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH])
    return contextlib.nullcontext()


def _fused_on_meta(q: Tensor, k: Tensor, v: Tensor, causal: bool) -> Tensor:
    """The output of the kernel SDPA runs on a GPU, on meta tensors: flash attention (it shares
    K/V among grouped-query heads), or memory-efficient attention where v's head dim is not q's."""
    if q.shape[-1] == v.shape[-1]:
        return torch.ops.aten._scaled_dot_product_flash_attention(q, k, v, 0.0, causal)[0]
    return torch.ops.aten._scaled_dot_product_efficient_attention(q, k, v, None, True, 0.0, causal)[0]
