"""Ring attention on gloo against torch's scaled_dot_product_attention on one process.

Every rank builds the same full q/k/v and upstream gradient from a seed, takes its
chunks of the sequence (balanced: chunks r and 2cp-1-r of 2cp; contiguous: chunk r
of cp), runs `ring_attention` and backpropagates; it then compares its output and
its slices of dq/dk/dv with SDPA on the full sequence. All configurations of one cp
run inside one pool job, which returns the failure messages (empty when all pass).
"""

from __future__ import annotations

import itertools

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from fivedc.runtime.attention_ring import make_ring, ring_attention
from fivedc.runtime.pool import RankInfo, WorkerPool
from fivedc.ir.seq_layout import SeqLayout, layout_order

TOL = 1e-10
SEQ, HEADS, DIM = 32, 4, 8
CONFIGS = list(itertools.product((True, False), (True, False), (4, 2, 1)))  # causal, balanced, kv_heads


def cp_positions(seq: int, *, cp: int, rank: int, balanced: bool) -> torch.Tensor:
    """Global positions held by cp rank `rank` (balanced: chunks r and 2cp-1-r of 2cp)."""
    order = layout_order(SeqLayout.BALANCED if balanced else SeqLayout.CONTIGUOUS, seq, cp)
    share = seq // cp
    return torch.tensor(order[rank * share:(rank + 1) * share])


def rel(got: torch.Tensor, want: torch.Tensor) -> float:
    return ((got - want).abs().max() / want.abs().max()).item()


def reference(kv_heads: int, causal: bool, seed: int) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """The full inputs [q, k, v, dout] and SDPA's [out, dq, dk, dv]."""
    gen = torch.Generator().manual_seed(seed)
    q, k, v = (
        torch.randn(2, h, SEQ, DIM, dtype=torch.float64, generator=gen).requires_grad_(True)
        for h in (HEADS, kv_heads, kv_heads)
    )
    dout = torch.randn(2, HEADS, SEQ, DIM, dtype=torch.float64, generator=gen)
    group = HEADS // kv_heads
    out = F.scaled_dot_product_attention(
        q, k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1), is_causal=causal
    )
    grads = torch.autograd.grad(out, (q, k, v), dout)
    return [q.detach(), k.detach(), v.detach(), dout], [out.detach(), *grads]


def check_ring(group, cp: int, dtype: torch.dtype, tol: float, configs: list) -> list[str]:
    failures = []
    for n, (causal, balanced, kv_heads) in enumerate(configs):
        (q, k, v, dout), want = reference(kv_heads, causal, seed=n)
        positions = tuple(cp_positions(SEQ, cp=cp, rank=r, balanced=balanced) for r in range(cp))
        ring = make_ring(group, block_positions=positions)
        mine = positions[ring.index]
        local = [t[:, :, mine].to(dtype).requires_grad_(True) for t in (q, k, v)]
        out = ring_attention(*local, mine, ring, causal=causal)
        got = [out, *torch.autograd.grad(out, local, dout[:, :, mine].to(dtype))]
        for name, g, w in zip(("out", "dq", "dk", "dv"), got, want):
            error = rel(g.detach().double(), w[:, :, mine])
            if g.dtype != dtype or not error <= tol:
                failures.append(f"ring member {ring.index} of {cp} ({dtype}) causal={causal} "
                                f"balanced={balanced} kv_heads={kv_heads}: {name} {g.dtype} error {error:.2e}")
    return failures


def ring_job(info: RankInfo, rings: list[list[int]]) -> list[str]:
    """Every ring of `rings` (lists of global ranks) in turn; the whole world uses the default group."""
    failures = []
    for members in rings:
        group = None if members == list(range(info.world)) else dist.new_group(members)
        if info.rank not in members:
            continue
        failures += check_ring(group, len(members), torch.float64, TOL, CONFIGS)
        failures += check_ring(group, len(members), torch.bfloat16, 3e-2, CONFIGS[:1])
    return failures


@pytest.mark.parametrize(
    ("world", "rings"),
    [(4, [[0, 1, 2, 3], [0, 2], [1, 3]]), (2, [[1, 0], [0], [1]])],
    ids=["cp4-and-strided-cp2", "cp2-reversed-and-cp1"],
)
def test_ring_attention_matches_sdpa(worker_pool: WorkerPool, world: int, rings: list[list[int]]) -> None:
    failures = worker_pool.run(ring_job, world=world, payload=rings)
    assert [f for per_rank in failures for f in per_rank] == []
