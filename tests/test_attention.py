"""Blockwise attention and the merge rule against torch's scaled_dot_product_attention.

Every numerical check runs in float64 and compares with SDPA on the full sequence in
natural order (GQA by `repeat_interleave`, as SDPA expects): the q rows are one cp
rank's chunks and k/v the whole sequence in all-gathered order, so the positions are
a permutation and causality must come from them, not from row order. Each runs twice:
with the blocks computed by torch's fused kernel (`runtime/attention_fused.py`, what
the CPU uses) and by the module's own matmuls (what other devices use).
"""

from __future__ import annotations

import contextlib
import math
from unittest import mock

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

from fivedc.errors import ShapeError
from fivedc.runtime import attention_blocks, attention_fused, attention_pairs
from fivedc.runtime.attention import blockwise_attention
from fivedc.runtime.attention_pairs import merge_partials, plan_pairs, position_runs
from fivedc.ir.seq_layout import SeqLayout, layout_order

TOL = 1e-12


@pytest.fixture(params=["fused", "matmuls"])
def kernels(request, monkeypatch) -> str:
    """Run a test with the blocks by the fused kernel, then by the matmuls."""
    if request.param == "matmuls":
        monkeypatch.setattr(attention_fused, "available", lambda q: False)
    return request.param


def rel(got: torch.Tensor, want: torch.Tensor) -> float:
    return ((got - want).abs().max() / want.abs().max()).item()


def cp_positions(seq: int, *, cp: int, rank: int, balanced: bool) -> torch.Tensor:
    """Global positions held by cp rank `rank` (balanced: chunks r and 2cp-1-r of 2cp)."""
    order = layout_order(SeqLayout.BALANCED if balanced else SeqLayout.CONTIGUOUS, seq, cp)
    share = seq // cp
    return torch.tensor(order[rank * share:(rank + 1) * share])


def gathered(seq: int, cp: int, *, balanced: bool) -> torch.Tensor:
    """Positions of the all-gathered sequence: the ranks' chunks in rank order."""
    return torch.cat([cp_positions(seq, cp=cp, rank=r, balanced=balanced) for r in range(cp)])


def sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, causal: bool) -> torch.Tensor:
    group = q.shape[1] // k.shape[1]
    return F.scaled_dot_product_attention(
        q, k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1), is_causal=causal
    )


def partial(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Plain-math partial attention over all of k/v (no GQA): normalised output and lse."""
    scores = q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1])
    return torch.softmax(scores, dim=-1) @ v, torch.logsumexp(scores, dim=-1)


def check_against_sdpa(
    *, batch: int, heads: int, kv_heads: int, seq: int, dim: int, cp: int, rank: int,
    balanced: bool, causal: bool, kv_blocks: int, seed: int = 0, v_dim: int | None = None,
) -> None:
    gen = torch.Generator().manual_seed(seed)
    q, k, v = (
        torch.randn(batch, h, seq, d, dtype=torch.float64, generator=gen).requires_grad_(True)
        for h, d in ((heads, dim), (kv_heads, dim), (kv_heads, v_dim or dim))
    )
    q_pos, kv_pos = cp_positions(seq, cp=cp, rank=rank, balanced=balanced), gathered(seq, cp, balanced=balanced)
    want = sdpa(q, k, v, causal=causal)[:, :, q_pos]
    got = blockwise_attention(q[:, :, q_pos], k[:, :, kv_pos], v[:, :, kv_pos], q_pos, kv_pos,
                              causal=causal, kv_blocks=kv_blocks)
    assert got.dtype == torch.float64 and rel(got, want) <= TOL
    dout = torch.randn(got.shape, dtype=torch.float64, generator=gen)
    got_grads = torch.autograd.grad(got, (q, k, v), dout)
    want_grads = torch.autograd.grad(want, (q, k, v), dout)
    for name, g, w in zip("qkv", got_grads, want_grads):
        assert rel(g, w) <= TOL, f"d{name}: {rel(g, w):.2e}"


# ---- the merge rule -----------------------------------------------------------------
def test_merge_of_two_halves_is_full_attention() -> None:
    q, k, v = torch.randn(2, 3, 5, 4, dtype=torch.float64), *torch.randn(2, 2, 3, 8, 4, dtype=torch.float64)
    out, lse = merge_partials(*partial(q, k[..., :3, :], v[..., :3, :]), *partial(q, k[..., 3:, :], v[..., 3:, :]))
    want_out, want_lse = partial(q, k, v)
    assert rel(out, want_out) <= TOL and rel(lse, want_lse) <= TOL


def test_merge_handles_rows_without_keys() -> None:
    out_a, lse_a = torch.randn(2, 3, 4, dtype=torch.float64), torch.randn(2, 3, dtype=torch.float64)
    empty_out, empty_lse = torch.zeros_like(out_a), torch.full_like(lse_a, -math.inf)
    out, lse = merge_partials(out_a, lse_a, empty_out, empty_lse)
    assert torch.equal(out, out_a) and torch.equal(lse, lse_a)
    out, lse = merge_partials(empty_out, empty_lse, out_a, lse_a)
    assert torch.equal(out, out_a) and torch.equal(lse, lse_a)
    mixed_lse = lse_a.clone()
    mixed_lse[0, 1] = -math.inf  # one row saw nothing on either side
    out, lse = merge_partials(empty_out, empty_lse, torch.where(mixed_lse[..., None] == -math.inf, 0, out_a), mixed_lse)
    assert not out.isnan().any() and lse[0, 1] == -math.inf and torch.equal(out[0, 1], torch.zeros(4, dtype=out.dtype))


def test_merge_is_associative_and_commutative() -> None:
    q, k, v = torch.randn(3, 6, 4, dtype=torch.float64), *torch.randn(2, 3, 9, 4, dtype=torch.float64)
    a, b, c = (partial(q, k[:, s], v[:, s]) for s in (slice(0, 2), slice(2, 7), slice(7, 9)))
    left = merge_partials(*merge_partials(*a, *b), *c)
    right = merge_partials(*a, *merge_partials(*b, *c))
    swapped = merge_partials(*c, *merge_partials(*b, *a))
    for got in (right, swapped):
        assert rel(got[0], left[0]) <= TOL and rel(got[1], left[1]) <= TOL


# ---- positions and the pair plan ------------------------------------------------------
def test_position_runs() -> None:
    assert position_runs(torch.tensor([0, 1, 2, 5, 6, 3])) == ((0, 3), (3, 2), (5, 1))
    assert position_runs(torch.arange(7)) == ((0, 7),)
    assert position_runs(torch.tensor([4, 3, 2])) == ((0, 1), (1, 1), (2, 1))
    assert position_runs(torch.tensor([], dtype=torch.long)) == ()
    assert position_runs(cp_positions(16, cp=4, rank=1, balanced=True)) == ((0, 2), (2, 2))
    assert position_runs(gathered(16, 2, balanced=True)) == ((0, 4), (4, 4), (8, 8))  # rank 1: 4..11


def test_balanced_layout_positions() -> None:
    assert cp_positions(8, cp=2, rank=0, balanced=True).tolist() == [0, 1, 6, 7]
    assert cp_positions(8, cp=2, rank=1, balanced=True).tolist() == [2, 3, 4, 5]
    assert sorted(gathered(24, 3, balanced=True).tolist()) == list(range(24))


def test_plan_skips_fully_masked_pairs_and_masks_only_the_diagonal() -> None:
    seq, cp = 32, 4
    q_pos, kv_pos = cp_positions(seq, cp=cp, rank=0, balanced=True), gathered(seq, cp, balanced=True)
    pairs = plan_pairs(q_pos, kv_pos, causal=True, kv_blocks=2)
    q_runs = position_runs(q_pos)
    kv_runs = [(o + b * 16, n) for b in range(2) for o, n in position_runs(kv_pos[b * 16:(b + 1) * 16])]
    assert len(q_runs) == 2 and len(kv_runs) == 7  # rank 3's chunks 12..15, 16..19 make one run
    planned = {(p.q, p.kv): p.masked for p in pairs}
    for qo, qn in q_runs:
        qp = q_pos[qo:qo + qn]
        for ko, kn in kv_runs:
            visible = kv_pos[ko:ko + kn][None, :] <= qp[:, None]
            if not visible.any():
                assert ((qo, qn), (ko, kn)) not in planned
            else:
                assert planned[(qo, qn), (ko, kn)] == (not visible.all())
    # rank 0 holds chunks 0 and 7: chunk 0 sees only itself, chunk 7 sees everything
    assert len(pairs) == 1 + 7 and sum(p.masked for p in pairs) == 2
    assert len(plan_pairs(q_pos, kv_pos, causal=False, kv_blocks=2)) == 14


def test_skipped_pairs_compute_no_scores(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(attention_fused, "available", lambda q: False)  # count the matmul path's scores
    seq, cp = 32, 4
    q_pos, kv_pos = cp_positions(seq, cp=cp, rank=0, balanced=True), gathered(seq, cp, balanced=True)
    calls: list[tuple[int, ...]] = []
    real = attention_blocks._scores

    def counting(q_rows, k_run, mask, scale, *rest):
        calls.append((q_rows.shape[-2], k_run.shape[-2], mask is not None))
        return real(q_rows, k_run, mask, scale, *rest)

    monkeypatch.setattr(attention_blocks, "_scores", counting)
    q = torch.randn(1, 4, 8, 4, dtype=torch.float64, requires_grad=True)
    k, v = torch.randn(2, 1, 2, seq, 4, dtype=torch.float64, requires_grad=True)  # group 2
    out = blockwise_attention(q, k, v, q_pos, kv_pos, causal=True, kv_blocks=4)
    # kv runs per block of 8: (0-3, 28-31), (4-7, 24-27), (8-11, 20-23), (12-19); q runs 0-3, 28-31
    assert sorted(calls) == sorted([(8, 4, True)] + [(8, 4, False)] * 5 + [(8, 8, False), (8, 4, True)])
    out.sum().backward()
    assert len(calls) == 16  # backward recomputes the same 8 pairs


def test_the_fused_kernel_gets_whole_runs_and_the_causal_diagonal(monkeypatch: pytest.MonkeyPatch) -> None:
    """The same plan for the fused kernel: runs are not cut into tiles, a diagonal pair is
    the kernel's causal mask (the same positions on both sides), the skipped pairs are
    never computed, and GQA's K/V go in unrepeated."""
    seq, cp = 32, 4
    q_pos, kv_pos = cp_positions(seq, cp=cp, rank=0, balanced=True), gathered(seq, cp, balanced=True)
    calls: list[tuple] = []
    real = attention_fused._FORWARD

    def counting(q, k, v, dropout, causal, attn_mask=None):
        calls.append((q.shape[-2], k.shape[-2], k.shape[1], causal, attn_mask is not None))
        return real(q, k, v, dropout, causal, attn_mask=attn_mask)

    monkeypatch.setattr(attention_fused, "_FORWARD", counting)
    monkeypatch.setattr(attention_pairs, "TILE", 2)  # would cut every run of 4: the fused path ignores it
    q = torch.randn(1, 4, 8, 4, dtype=torch.float64)
    k, v = torch.randn(2, 1, 2, seq, 4, dtype=torch.float64)
    blockwise_attention(q, k, v, q_pos, kv_pos, causal=True, kv_blocks=4)
    # q runs 0-3 and 28-31; kv runs per block (0-3, 28-31), (4-7, 24-27), (8-11, 20-23), (12-19)
    assert sorted(calls) == sorted([(4, 4, 2, True, False)] * 2 + [(4, 4, 2, False, False)] * 5 + [(4, 8, 2, False, False)])


# ---- blockwise attention against SDPA ---------------------------------------------------
@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("kv_heads", [4, 2, 1])
@pytest.mark.parametrize("kv_blocks", [1, 2, 4])
def test_blockwise_matches_sdpa_balanced_layout(causal: bool, kv_heads: int, kv_blocks: int, kernels) -> None:
    for rank in (0, 1):
        check_against_sdpa(batch=2, heads=4, kv_heads=kv_heads, seq=32, dim=8, cp=2, rank=rank,
                           balanced=True, causal=causal, kv_blocks=kv_blocks)


@pytest.mark.parametrize("causal", [True, False])
def test_blockwise_matches_sdpa_whole_sequence(causal: bool, kernels) -> None:
    check_against_sdpa(batch=1, heads=4, kv_heads=2, seq=48, dim=16, cp=1, rank=0,
                       balanced=False, causal=causal, kv_blocks=3)


@settings(max_examples=25, deadline=None)
@given(
    batch=st.integers(1, 2), kv_heads=st.sampled_from([1, 2]), group=st.sampled_from([1, 2, 3]),
    dim=st.sampled_from([1, 4, 8]), chunk=st.integers(1, 4), cp=st.integers(1, 3),
    balanced=st.booleans(), causal=st.booleans(), fused=st.booleans(), data=st.data(),
)
def test_blockwise_matches_sdpa_property(batch, kv_heads, group, dim, chunk, cp, balanced, causal, fused,
                                         data) -> None:
    seq = chunk * 2 * cp
    kv_blocks = data.draw(st.sampled_from([b for b in (1, 2, 3, 4, 6) if seq % b == 0]), label="kv_blocks")
    rank = data.draw(st.integers(0, cp - 1), label="rank")
    with contextlib.nullcontext() if fused else mock.patch.object(attention_fused, "available", lambda q: False):
        check_against_sdpa(batch=batch, heads=kv_heads * group, kv_heads=kv_heads, seq=seq, dim=dim, cp=cp,
                           rank=rank, balanced=balanced, causal=causal, kv_blocks=kv_blocks, seed=seq)


@pytest.mark.parametrize("v_dim", [5, 12])
def test_values_of_another_head_dim_than_queries_and_keys(v_dim: int, kernels) -> None:
    """DeepSeek-V3's attention (MLA): v's head_dim narrower than q/k's (v padded with zeros), or
    wider (q and k padded, q scaled so the softmax keeps q's 1/sqrt(head_dim)): SDPA's result."""
    for rank in (0, 1):
        check_against_sdpa(batch=2, heads=4, kv_heads=2, seq=16, dim=8, cp=2, rank=rank, balanced=True,
                           causal=True, kv_blocks=2, v_dim=v_dim)


def test_low_precision_accumulates_in_float32(kernels) -> None:
    q, k, v = torch.randn(3, 1, 4, 64, 16, dtype=torch.float64)
    pos = torch.arange(64)
    want = sdpa(q, k, v, causal=True)
    for dtype, tol in ((torch.bfloat16, 2e-2), (torch.float16, 2e-3)):
        low = [t.to(dtype).requires_grad_(True) for t in (q, k, v)]
        got = blockwise_attention(*low, pos, pos, causal=True, kv_blocks=4)
        assert got.dtype == dtype and rel(got.double(), want) <= tol
        grads = torch.autograd.grad(got, low, torch.ones_like(got))
        assert all(g.dtype == dtype and g.isfinite().all() for g in grads)


def test_shape_errors_name_the_fix() -> None:
    q, k = torch.zeros(1, 3, 8, 4), torch.zeros(1, 2, 8, 4)
    pos = torch.arange(8)
    with pytest.raises(ShapeError, match="multiple of kv_heads=2"):
        blockwise_attention(q, k, k, pos, pos, causal=True)
    with pytest.raises(ShapeError, match="kv_blocks=3 does not divide"):
        blockwise_attention(q[:, :2], k, k, pos, pos, causal=True, kv_blocks=3)
    with pytest.raises(ShapeError, match="one position"):
        blockwise_attention(q[:, :2], k, k, pos[:4], pos, causal=True)


@pytest.mark.parametrize("causal", [True, False])
def test_long_runs_are_cut_into_tiles(causal: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    """With TILE = 3 every score matrix is at most 3 x 3, and the result is unchanged."""
    monkeypatch.setattr(attention_pairs, "TILE", 3)
    pairs = plan_pairs(torch.arange(8), torch.arange(8), causal=causal)
    assert max(max(p.q[1], p.kv[1]) for p in pairs) == 3
    assert len(pairs) == (6 if causal else 9)  # 3 x 3 tiles, the 3 above the diagonal skipped
    check_against_sdpa(batch=1, heads=4, kv_heads=2, seq=16, dim=4, cp=2, rank=1, balanced=True,
                       causal=causal, kv_blocks=2)


@pytest.mark.parametrize("kv_blocks", [1, 2])
def test_scores_capped_by_a_softcap_match_the_written_out_attention(kv_blocks: int) -> None:
    """Gemma 2's logit softcapping, c * tanh(s / c) of the scaled scores before the mask: forward and
    gradients against the attention written out with torch ops, one cp rank's rows of a balanced layout."""
    gen = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(2, h, 16, 8, dtype=torch.float64, generator=gen).requires_grad_(True) for h in (4, 2, 2))
    q_pos, kv_pos = cp_positions(16, cp=2, rank=1, balanced=True), gathered(16, 2, balanced=True)
    cap = 1.5  # small enough that the tanh bends the scores
    scores = q @ k.repeat_interleave(2, dim=1).transpose(-1, -2) / math.sqrt(8)
    scores = (cap * torch.tanh(scores / cap)).masked_fill(~torch.ones(16, 16, dtype=torch.bool).tril(), -math.inf)
    want = (scores.softmax(-1) @ v.repeat_interleave(2, dim=1))[:, :, q_pos]
    got = blockwise_attention(q[:, :, q_pos], k[:, :, kv_pos], v[:, :, kv_pos], q_pos, kv_pos, causal=True,
                              kv_blocks=kv_blocks, softcap=cap)
    uncapped = blockwise_attention(q[:, :, q_pos], k[:, :, kv_pos], v[:, :, kv_pos], q_pos, kv_pos, causal=True)
    assert rel(got, want) <= TOL and rel(uncapped, want) > 1e-3
    dout = torch.randn(got.shape, dtype=torch.float64, generator=gen)
    for name, g, w in zip("qkv", torch.autograd.grad(got, (q, k, v), dout), torch.autograd.grad(want, (q, k, v), dout)):
        assert rel(g, w) <= TOL, f"d{name}: {rel(g, w):.2e}"


def band(seq: int, window: int) -> torch.Tensor:
    """The sliding-window mask written out: the query at i sees the keys at i - window < j <= i."""
    i, j = torch.arange(seq)[:, None], torch.arange(seq)[None, :]
    return (j <= i) & (j > i - window)


@pytest.mark.parametrize("window, kv_blocks", [(2, 1), (3, 2), (5, 4), (16, 2)])
def test_a_sliding_window_matches_the_written_out_band(kernels: str, window: int, kv_blocks: int) -> None:
    """One cp rank's rows of a balanced layout against the gathered k/v: forward and gradients equal
    SDPA with the band as its mask, and the pairs wholly below the band are not computed."""
    gen = torch.Generator().manual_seed(window)
    q, k, v = (torch.randn(2, h, 16, 8, dtype=torch.float64, generator=gen).requires_grad_(True) for h in (4, 2, 2))
    q_pos, kv_pos = cp_positions(16, cp=2, rank=0, balanced=True), gathered(16, 2, balanced=True)
    mask = band(16, window)
    want = F.scaled_dot_product_attention(q, k.repeat_interleave(2, 1), v.repeat_interleave(2, 1),
                                          attn_mask=mask)[:, :, q_pos]
    got = blockwise_attention(q[:, :, q_pos], k[:, :, kv_pos], v[:, :, kv_pos], q_pos, kv_pos, causal=True,
                              kv_blocks=kv_blocks, window=window)
    assert rel(got, want) <= TOL
    dout = torch.randn(got.shape, dtype=torch.float64, generator=gen)
    for name, g, w in zip("qkv", torch.autograd.grad(got, (q, k, v), dout), torch.autograd.grad(want, (q, k, v), dout)):
        assert rel(g, w) <= TOL, f"d{name}: {rel(g, w):.2e}"
    pairs = plan_pairs(q_pos, kv_pos, causal=True, kv_blocks=kv_blocks, window=window)
    seen = [(p.q, p.kv) for p in plan_pairs(q_pos, kv_pos, causal=True, kv_blocks=kv_blocks)]
    assert len(pairs) <= len(seen) and (window >= 16 or len(pairs) < len(seen))


def test_an_off_by_one_band_is_caught() -> None:
    """A window of W keys and one of W - 1 differ: the band's edge is exact, not near enough."""
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 2, 12, 4, dtype=torch.float64, generator=gen) for _ in range(3))
    pos = torch.arange(12)
    want = F.scaled_dot_product_attention(q, k, v, attn_mask=band(12, 4))
    assert rel(blockwise_attention(q, k, v, pos, pos, causal=True, window=4), want) <= TOL
    assert rel(blockwise_attention(q, k, v, pos, pos, causal=True, window=3), want) > 1e-3
    assert rel(blockwise_attention(q, k, v, pos, pos, causal=True, window=5), want) > 1e-3


def test_a_window_without_causal_is_refused() -> None:
    pos = torch.arange(4)
    with pytest.raises(ShapeError, match="window=2 with causal=False"):
        plan_pairs(pos, pos, causal=False, window=2)
