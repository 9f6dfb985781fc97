"""The attention of q to one block of K/V rows in hand, pair by pair, forward and backward.

A `Block` is the k/v rows in hand with their positions and planned pairs
(`runtime/attention_pairs.py`); `forward_into` merges q's attention to it into a
running partial (out, lse), and `backward_into` adds its share of dq, dk and dv,
each pair by matmuls here (scores of one pair at a time, GQA heads grouped over the
shared K/V, a softcap and a window's mask applied) or by torch's fused kernel
(`runtime/attention_fused.py`). Also the shared checks and buffers of blockwise
(`runtime/attention.py`) and ring (`runtime/attention_ring.py`) attention.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor

from fivedc.errors import ShapeError
from fivedc.runtime import attention_fused
from fivedc.runtime.attention_band import visible
from fivedc.runtime.attention_pairs import Pair, merge_partials

_LOW_PRECISION = (torch.float16, torch.bfloat16)


def accumulation_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float32 if dtype in _LOW_PRECISION else dtype


def _rows(x: Tensor, run: tuple[int, int], kv_heads: int, dtype: torch.dtype) -> Tensor:
    """Rows `run` of q-shaped x [b, heads, s, d] as [b, kv_heads, group * length, d]."""
    offset, length = run
    b, h, _, d = x.shape
    part = x[:, :, offset:offset + length].reshape(b, kv_heads, (h // kv_heads) * length, d)
    return part.to(dtype)


def _unrows(x: Tensor, heads: int) -> Tensor:
    """Inverse of `_rows` for one run: [b, kv_heads, group * length, ...] -> [b, heads, length, ...]."""
    b, kv_heads, rows = x.shape[:3]
    return x.reshape(b, heads, rows // (heads // kv_heads), *x.shape[3:])


def _scores(q_rows: Tensor, k_run: Tensor, mask: Tensor | None, scale: float, softcap: float = 0.0,
            capped: list | None = None) -> Tensor:
    """Scaled scores [b, kv_heads, group * m, n] (capped at softcap * tanh(s / softcap) when softcap > 0;
    `capped` then receives tanh(s / softcap)), -inf where `mask` [m, n] is False."""
    scores = torch.matmul(q_rows, k_run.transpose(-1, -2)).mul_(scale)
    if softcap:
        tanh = scores.div_(softcap).tanh_()
        if capped is not None:
            capped.append(tanh.clone())
        scores = tanh.mul_(softcap)
    if mask is not None:
        b, kv_heads, rows, n = scores.shape
        view = scores.view(b, kv_heads, rows // mask.shape[0], mask.shape[0], n)
        view.masked_fill_(~mask, -math.inf)
    return scores


def _finite(lse: Tensor) -> Tensor:
    return lse.masked_fill(lse == -math.inf, 0.0)


@dataclass(frozen=True, slots=True)
class Block:
    """The k/v rows in hand with their positions, and how to attend to them."""

    k: Tensor
    v: Tensor
    kv_pos: Tensor
    pairs: tuple[Pair, ...]
    softcap: float = 0.0
    window: int = 0


def _mask(pair: Pair, q_pos: Tensor, block: Block, device: torch.device) -> Tensor | None:
    if not pair.masked:
        return None
    (qo, qn), (ko, kn) = pair.q, pair.kv
    return visible(q_pos[qo:qo + qn], block.kv_pos[ko:ko + kn], block.window).to(device)


def forward_into(out: Tensor, lse: Tensor, q: Tensor, q_pos: Tensor, block: Block, *, fused: bool) -> None:
    """Merge the attention of q to `block` into the partial (out, lse) [b, heads, sq, ...],
    a pair at a time (by the fused kernel, or by `_pair_forward`'s matmuls)."""
    for pair in block.pairs:
        rows = slice(pair.q[0], pair.q[0] + pair.q[1])
        part, part_lse = (attention_fused.pair_forward(q, q_pos, block, pair) if fused
                          else _pair_forward(q, q_pos, block, pair, out.dtype))
        out[:, :, rows], lse[:, :, rows] = merge_partials(out[:, :, rows], lse[:, :, rows], part.to(out.dtype),
                                                          part_lse.to(lse.dtype))


def _pair_forward(q: Tensor, q_pos: Tensor, block: Block, pair: Pair, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
    """One pair's (output, log-sum-exp) by matmuls, GQA heads grouped over shared K/V."""
    heads, kv_heads, scale = q.shape[1], block.k.shape[1], q.shape[-1] ** -0.5
    (ko, kn) = pair.kv
    k_run, v_run = block.k[:, :, ko:ko + kn].to(dtype), block.v[:, :, ko:ko + kn].to(dtype)
    probs = _scores(_rows(q, pair.q, kv_heads, dtype), k_run, _mask(pair, q_pos, block, q.device), scale,
                    block.softcap)
    row_max = _finite(probs.amax(dim=-1))  # in place below: torch.logsumexp would copy the scores
    row_sum = probs.sub_(row_max.unsqueeze(-1)).exp_().sum(dim=-1)
    pair_lse = row_max + row_sum.log()  # -inf for a row that sees no key here
    pair_out = torch.matmul(probs, v_run).div_(row_sum.masked_fill(row_sum == 0, 1.0).unsqueeze(-1))
    return _unrows(pair_out, heads), _unrows(pair_lse, heads)


def backward_into(
    dq: Tensor, dkv: Tensor, q: Tensor, q_pos: Tensor, block: Block, grads: tuple[Tensor, Tensor, Tensor]
) -> None:
    """Add the gradients through the attention of q to `block`: into dq [b, heads, sq, d]
    and dkv [2, b, kv_heads, sk, d] (dk, dv). `grads` = (dout, lse, delta) of the whole rows."""
    dout, lse, delta = grads
    heads, kv_heads, scale, dtype = q.shape[1], block.k.shape[1], q.shape[-1] ** -0.5, dq.dtype
    for pair in block.pairs:
        (ko, kn), (qo, qn) = pair.kv, pair.q
        k_run, v_run = block.k[:, :, ko:ko + kn].to(dtype), block.v[:, :, ko:ko + kn].to(dtype)
        q_rows, dout_rows = _rows(q, pair.q, kv_heads, dtype), _rows(dout, pair.q, kv_heads, dtype)
        lse_rows = _rows(lse.unsqueeze(-1), pair.q, kv_heads, dtype)
        delta_rows = _rows(delta.unsqueeze(-1), pair.q, kv_heads, dtype)
        capped: list[Tensor] = []
        probs = _scores(q_rows, k_run, _mask(pair, q_pos, block, q.device), scale, block.softcap, capped)
        probs.sub_(_finite(lse_rows)).exp_()
        dkv[1, :, :, ko:ko + kn] += torch.matmul(probs.transpose(-1, -2), dout_rows)
        dscores = torch.matmul(dout_rows, v_run.transpose(-1, -2)).sub_(delta_rows).mul_(probs).mul_(scale)
        del probs
        if capped:  # through the cap: d(c tanh(s / c)) / ds = 1 - tanh(s / c)^2
            dscores.mul_(1 - capped.pop().square_())
        dq[:, :, qo:qo + qn] += _unrows(torch.matmul(dscores, k_run), heads)
        dkv[0, :, :, ko:ko + kn] += torch.matmul(dscores.transpose(-1, -2), q_rows)
        del dscores  # before the next pair's scores


def empty_partial(q: Tensor) -> tuple[Tensor, Tensor]:
    """A zero output and -inf log-sum-exp. The output is laid out [batch, sq, heads, d] in
    memory (a transposed view here), so the kernel's [batch, seq, heads, head_dim] result
    is contiguous and the next linear saves it as it is rather than a copy."""
    dtype = accumulation_dtype(q.dtype)
    b, h, s, d = q.shape
    out = torch.zeros((b, s, h, d), dtype=dtype, device=q.device).transpose(1, 2)
    return out, torch.full(q.shape[:-1], -math.inf, dtype=dtype, device=q.device)


def row_delta(dout: Tensor, out: Tensor) -> Tensor:
    dtype = accumulation_dtype(out.dtype)
    return (dout.to(dtype) * out.to(dtype)).sum(dim=-1)


def one_head_dim(q: Tensor, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor, Tensor, int]:
    """q, k and v with one head_dim, and v's own: where v's is narrower (DeepSeek-V3's MLA: q/k
    192, v 128), v padded with zeros (the output's extra columns are zero, cut off after);
    where wider, q and k padded (their products unchanged) and q scaled by sqrt(v's / theirs),
    so that the kernel's 1/sqrt(head_dim) is still 1/sqrt of q's. The kernels move K and V as
    one tensor, so they take one width."""
    d, width = q.shape[-1], v.shape[-1]
    if width < d:
        v = torch.nn.functional.pad(v, (0, d - width))
    elif width > d:
        q = torch.nn.functional.pad(q * math.sqrt(width / d), (0, width - d))
        k = torch.nn.functional.pad(k, (0, width - d))
    return q, k, v, width


def check_attention_args(q: Tensor, k: Tensor, v: Tensor, q_pos: Tensor, kv_pos: Tensor) -> None:
    if q.dim() != 4 or k.dim() != 4 or k.shape != v.shape:
        raise ShapeError(
            f"attention takes q [batch, heads, sq, d] and k, v [batch, kv_heads, sk, d]; "
            f"got q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}"
        )
    heads, kv_heads = q.shape[1], k.shape[1]
    if q.shape[0] != k.shape[0] or q.shape[-1] != k.shape[-1] or heads % kv_heads:
        raise ShapeError(
            f"q {tuple(q.shape)} does not match k/v {tuple(k.shape)}",
            hint=f"batch and head_dim must agree and heads={heads} must be a multiple of kv_heads={kv_heads}",
        )
    if q_pos.shape != (q.shape[2],) or kv_pos.shape != (k.shape[2],):
        raise ShapeError(
            f"q_pos {tuple(q_pos.shape)} and kv_pos {tuple(kv_pos.shape)} must hold one position "
            f"per row of q ({q.shape[2]}) and of k/v ({k.shape[2]})"
        )
