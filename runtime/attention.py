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
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from fivedc.errors import ShapeError
from fivedc.runtime import attention_fused
from fivedc.runtime.attention_band import visible
from fivedc.runtime.p2p import NOTHING, Transfer, exchange

_LOW_PRECISION = (torch.float16, torch.bfloat16)


# ---- the merge rule and the pair plan -------------------------------------------------
def merge_partials(out_a: Tensor, lse_a: Tensor, out_b: Tensor, lse_b: Tensor) -> tuple[Tensor, Tensor]:
    """Attention over the union of two disjoint key sets from the partials over each.

    out_* [..., sq, d] and lse_* [..., sq]; a row with lse = -inf saw no key in that
    part and contributes nothing (a row that saw none in either gets out 0, lse -inf).
    """
    lse = torch.logaddexp(lse_a, lse_b)
    finite = lse.masked_fill(lse == -math.inf, 0.0)
    weight_a = torch.exp(lse_a - finite).unsqueeze(-1)
    weight_b = torch.exp(lse_b - finite).unsqueeze(-1)
    return out_a * weight_a + out_b * weight_b, lse


def position_runs(pos: Tensor) -> tuple[tuple[int, int], ...]:
    """Maximal runs of consecutive positions (p, p+1, ...) in `pos`, as (offset, length)."""
    if pos.numel() == 0:
        return ()
    breaks = (torch.nonzero(pos[1:] - pos[:-1] != 1).flatten() + 1).tolist()
    starts = [0, *breaks]
    ends = [*breaks, pos.numel()]
    return tuple((s, e - s) for s, e in zip(starts, ends))


TILE = 256  # the longest run of q or k/v rows whose scores are formed at once


def _tiles(runs: tuple[tuple[int, int], ...]) -> list[tuple[int, int]]:
    """Runs cut into pieces of at most TILE rows, so a score matrix stays TILE x TILE."""
    tile = TILE
    return [(o + start, min(tile, n - start)) for o, n in runs for start in range(0, n, tile)]


@dataclass(frozen=True, slots=True)
class Pair:
    """A q run and a k/v run whose scores are computed together; `masked`: on the diagonal."""

    q: tuple[int, int]  # (offset, length) into the q rows
    kv: tuple[int, int]  # (offset, length) into the k/v rows
    masked: bool


def plan_pairs(q_pos: Tensor, kv_pos: Tensor, *, causal: bool, kv_blocks: int = 1,
               tiles: bool = True, window: int = 0) -> tuple[Pair, ...]:
    """The (q run, k/v run) pairs that see at least one key, k/v cut into `kv_blocks` blocks;
    with `tiles` every run is cut at TILE rows (a fused kernel takes whole runs); `window`
    W > 0 (causal only): a query at i sees the keys at i - W < j <= i."""
    _check_window(causal, window)
    cut = _tiles if tiles else (lambda runs: list(runs))
    sk = kv_pos.numel()
    if kv_blocks < 1 or sk % kv_blocks:
        divisors = [b for b in range(1, sk + 1) if sk % b == 0][:8]
        raise ShapeError(
            f"kv_blocks={kv_blocks} does not divide the {sk} k/v rows",
            hint=f"choose kv_blocks in {{{', '.join(map(str, divisors))}, ...}}",
        )
    q_runs = [(o, n, int(q_pos[o]), int(q_pos[o + n - 1])) for o, n in cut(position_runs(q_pos))]
    size = sk // kv_blocks
    kv_runs = []
    for start in range(0, sk, size):
        block = cut(position_runs(kv_pos[start:start + size]))
        kv_runs += [(start + o, n, int(kv_pos[start + o]), int(kv_pos[start + o + n - 1])) for o, n in block]
    pairs = []
    for qo, qn, q_first, q_last in q_runs:
        for ko, kn, k_first, k_last in kv_runs:
            if causal and k_first > q_last or window and k_last <= q_first - window:
                continue  # every key is after every query, or before every query's window
            cut_by_band = bool(window) and k_first <= q_last - window
            pairs.append(Pair((qo, qn), (ko, kn), masked=causal and k_last > q_first or cut_by_band))
    return tuple(pairs)


def _check_window(causal: bool, window: int) -> None:
    if window < 0 or window and not causal:
        raise ShapeError(f"attention window={window} with causal={causal}",
                         hint="a window is a number of keys >= 1 up to and including the query's own "
                              "position, so it needs causal attention; 0 means no window")


# ---- one pair of runs ------------------------------------------------------------------
def _compute_dtype(dtype: torch.dtype) -> torch.dtype:
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
class _Block:
    """The k/v rows in hand with their positions, and how to attend to them."""

    k: Tensor
    v: Tensor
    kv_pos: Tensor
    pairs: tuple[Pair, ...]
    softcap: float = 0.0
    window: int = 0


def _mask(pair: Pair, q_pos: Tensor, block: _Block, device: torch.device) -> Tensor | None:
    if not pair.masked:
        return None
    (qo, qn), (ko, kn) = pair.q, pair.kv
    return visible(q_pos[qo:qo + qn], block.kv_pos[ko:ko + kn], block.window).to(device)


def _forward_into(out: Tensor, lse: Tensor, q: Tensor, q_pos: Tensor, block: _Block, *, fused: bool) -> None:
    """Merge the attention of q to `block` into the partial (out, lse) [b, heads, sq, ...],
    a pair at a time (by the fused kernel, or by `_pair_forward`'s matmuls)."""
    for pair in block.pairs:
        rows = slice(pair.q[0], pair.q[0] + pair.q[1])
        part, part_lse = (attention_fused.pair_forward(q, q_pos, block, pair) if fused
                          else _pair_forward(q, q_pos, block, pair, out.dtype))
        out[:, :, rows], lse[:, :, rows] = merge_partials(out[:, :, rows], lse[:, :, rows], part.to(out.dtype),
                                                          part_lse.to(lse.dtype))


def _pair_forward(q: Tensor, q_pos: Tensor, block: _Block, pair: Pair, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
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


def _backward_into(
    dq: Tensor, dkv: Tensor, q: Tensor, q_pos: Tensor, block: _Block, grads: tuple[Tensor, Tensor, Tensor]
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


def _empty_partial(q: Tensor) -> tuple[Tensor, Tensor]:
    """A zero output and -inf log-sum-exp. The output is laid out [batch, sq, heads, d] in
    memory (a transposed view here), so the kernel's [batch, seq, heads, head_dim] result
    is contiguous and the next linear saves it as it is rather than a copy."""
    dtype = _compute_dtype(q.dtype)
    b, h, s, d = q.shape
    out = torch.zeros((b, s, h, d), dtype=dtype, device=q.device).transpose(1, 2)
    return out, torch.full(q.shape[:-1], -math.inf, dtype=dtype, device=q.device)


def _delta(dout: Tensor, out: Tensor) -> Tensor:
    dtype = _compute_dtype(out.dtype)
    return (dout.to(dtype) * out.to(dtype)).sum(dim=-1)


def _one_head_dim(q: Tensor, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor, Tensor, int]:
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


def _check(q: Tensor, k: Tensor, v: Tensor, q_pos: Tensor, kv_pos: Tensor) -> None:
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


# ---- local blockwise attention ---------------------------------------------------------
class _BlockwiseAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, q: Tensor, k: Tensor, v: Tensor, q_pos: Tensor, kv_pos: Tensor,
                causal: bool, kv_blocks: int, softcap: float, fused: bool, window: int) -> Tensor:
        fused = fused and attention_fused.available(q) and not softcap  # torch's kernel has no softcap
        pairs = plan_pairs(q_pos, kv_pos, causal=causal, kv_blocks=kv_blocks, tiles=not fused, window=window)
        block = _Block(k, v, kv_pos, pairs, softcap, window)
        out, lse = _empty_partial(q)
        _forward_into(out, lse, q, q_pos, block, fused=fused)
        out = out.to(q.dtype)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.positions, ctx.pairs, ctx.fused, ctx.softcap, ctx.window = (q_pos, kv_pos), pairs, fused, softcap, window
        return out

    @staticmethod
    def backward(ctx: Any, dout: Tensor) -> tuple[Tensor | None, ...]:
        q, k, v, out, lse = ctx.saved_tensors
        (q_pos, kv_pos), dtype = ctx.positions, _compute_dtype(q.dtype)
        dq = torch.zeros(q.shape, dtype=dtype, device=q.device)
        dkv = torch.zeros((2, *k.shape), dtype=dtype, device=k.device)
        block = _Block(k, v, kv_pos, ctx.pairs, ctx.softcap, ctx.window)
        if ctx.fused:
            attention_fused.backward_into(dq, dkv, q, q_pos, block, dout, out, lse)
        else:
            _backward_into(dq, dkv, q, q_pos, block, (dout, lse, _delta(dout, out)))
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
    q, k, v, width = _one_head_dim(q, k, v)
    _check(q, k, v, q_pos, kv_pos)
    return _BlockwiseAttention.apply(q, k, v, q_pos, kv_pos, causal, kv_blocks, float(softcap), fused,
                                     int(window))[..., :width]


# ---- ring attention --------------------------------------------------------------------
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
                softcap: float, window: int) -> _Block:
    """The block in hand at `step`; its pairs are none where every key is outside the window
    (nothing computed, the block still passed on)."""
    kv_pos = ring.block_positions[(ring.index - step) % ring.size]
    pairs = plan_pairs(q_pos, kv_pos, causal=causal, tiles=not fused, window=window)
    return _Block(kv[0], kv[1], kv_pos, pairs, softcap, window)


class _RingAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, q: Tensor, k: Tensor, v: Tensor, q_pos: Tensor, ring: Ring, causal: bool,
                softcap: float, fused: bool, window: int) -> Tensor:
        out, lse = _empty_partial(q)
        fused = fused and attention_fused.available(q) and not softcap  # torch's kernel has no softcap
        kv = torch.stack((k, v))  # one packed buffer to send
        for step in range(ring.size):
            last = step == ring.size - 1
            arriving, transfer = (None, NOTHING) if last else _exchange(ring, kv, tag=0)
            _forward_into(out, lse, q, q_pos, _ring_block(kv, ring, step, q_pos, causal, fused, softcap, window),
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
        ring, dtype = ctx.ring, _compute_dtype(q.dtype)
        grads = (dout, lse, _delta(dout, out))
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
                _backward_into(dq, dkv, q, ctx.q_pos, block, grads)
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
    q, k, v, width = _one_head_dim(q, k, v)
    _check(q, k, v, q_pos, ring.block_positions[ring.index])
    return _RingAttention.apply(q, k, v, q_pos, ring, causal, float(softcap), fused, int(window))[..., :width]
