"""Peak memory per rank of one causal attention op, forward and backward, at cp = 1, 2, 4.

Two cp=1 baselines: standard attention (softmax(q k^T / sqrt(d)) v with the S x S
scores formed, as without a fused kernel), and `F.scaled_dot_product_attention`,
which the runtime calls at cp=1 (on CPU in float32 torch's flash kernel, whose
memory is linear in S). cp=2 and cp=4 run `ring_attention` over gloo on the balanced
layout (rank r holds chunks r and 2cp-1-r of 2cp), its score matrices cut into
TILE x TILE tiles. All run in one worker pool, side by side.

What is measured: the peak of CPU memory allocated through torch's allocator during
forward + backward, above the baseline that holds the rank's inputs (q, k, v and the
upstream gradient). The profiler (`profile_memory=True`) records every allocation
and free made while it runs as a `[memory]` event with its size in bytes; the
running sum of those sizes in event order is the memory allocated since the start,
and its maximum is the peak. Outputs and gradients count (they are allocated inside
the window); gloo's own transport buffers do not (they are not torch allocations).
A calibration run (4 MiB, then 12 MiB more, then both freed) must read 16 MiB.
The issue's bar: the cp=4 figure at most 0.35x the cp=1 figure (standard attention).

    python benchmarks/cp_attention_memory.py [--seq 4096]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from collections.abc import Callable

import torch
from torch.profiler import ProfilerActivity, profile

import torch.nn.functional as F

from fivedc.runtime.attention_pairs import TILE
from fivedc.runtime.attention_ring import make_ring, ring_attention
from fivedc.runtime.pool import RankInfo, WorkerPool
from fivedc.ir.seq_layout import SeqLayout, layout_order

HEADS, KV_HEADS, DIM, BATCH = 8, 8, 64, 1
MIB = 1 << 20


def peak_allocated(fn: Callable[[], object]) -> int:
    """Peak bytes allocated by torch on the CPU while `fn` runs, above what was held before."""
    with tempfile.TemporaryDirectory() as tmp:
        with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
            kept = fn()  # noqa: F841 -- results stay alive until the window closes
            del kept
        path = os.path.join(tmp, "trace.json")
        prof.export_chrome_trace(path)
        with open(path) as f:
            events = [e for e in json.load(f)["traceEvents"] if e.get("name") == "[memory]"]
    events.sort(key=lambda e: (e["ts"], e["args"].get("Ev Idx", 0)))
    total = peak = 0
    for event in events:
        total += event["args"]["Bytes"]
        peak = max(peak, total)
    return peak


def calibration() -> int:
    def allocate() -> None:
        first = torch.empty(MIB, dtype=torch.float32)
        second = torch.empty(3 * MIB, dtype=torch.float32)
        del first, second

    return peak_allocated(allocate)


def standard_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    scores = q @ k.transpose(-1, -2) / DIM**0.5
    causal = torch.ones(scores.shape[-2:], dtype=torch.bool).tril()
    return scores.masked_fill(~causal, float("-inf")).softmax(-1) @ v


def attention_job(info: RankInfo, payload: tuple[int, str]) -> float:
    """Peak MiB of one forward + backward on this rank."""
    seq, kernel = payload
    cp = info.world
    gen = torch.Generator().manual_seed(0)
    full = [torch.randn(BATCH, h, seq, DIM, generator=gen) for h in (HEADS, KV_HEADS, KV_HEADS, HEADS)]
    order, share = layout_order(SeqLayout.BALANCED, seq, cp), seq // cp
    positions = tuple(torch.tensor(order[r * share:(r + 1) * share]) for r in range(cp))
    mine = positions[info.rank]
    q, k, v, dout = (t[:, :, mine].contiguous() for t in full)
    del full
    q.requires_grad_(True), k.requires_grad_(True), v.requires_grad_(True)
    ring = make_ring(None, block_positions=positions) if cp > 1 else None

    def step() -> tuple[torch.Tensor, ...]:
        if kernel == "standard":
            out = standard_attention(q, k, v)
        elif kernel == "sdpa":
            out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        else:
            out = ring_attention(q, k, v, mine, ring, causal=True)
        return (out, *torch.autograd.grad(out, (q, k, v), dout))

    step()  # warm-up: first-call allocations (thread pools, gloo pairs) stay out of the figure
    return peak_allocated(step) / MIB


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seq", type=int, default=4096)
    args = parser.parse_args()
    if calibration() != 16 * MIB:
        sys.exit("profiler calibration failed: 4 MiB + 12 MiB did not read as a 16 MiB peak")
    print(f"causal attention fwd+bwd, float32, batch {BATCH}, {HEADS} heads (kv {KV_HEADS}), "
          f"head_dim {DIM}, seq {args.seq}, balanced layout, gloo")
    runs = [(1, "standard", "standard attention (S x S scores)"), (1, "sdpa", "SDPA (flash on CPU)"),
            (2, "ring", f"ring_attention, tiles {TILE}"), (4, "ring", f"ring_attention, tiles {TILE}")]
    rows = []
    with WorkerPool(4) as pool:
        for cp, kernel, label in runs:
            results = pool.run(attention_job, world=cp, payload=(args.seq, kernel))
            rows.append((cp, label, max(results), min(results)))
    standard, sdpa = rows[0][2], rows[1][2]
    print("| cp | kernel | peak MiB per rank (largest rank) | smallest rank | ratio to standard | ratio to SDPA |")
    print("|---|---|---|---|---|---|")
    for cp, label, worst, best in rows:
        print(f"| {cp} | {label} | {worst:.1f} | {best:.1f} | {worst / standard:.3f} | {worst / sdpa:.3f} |")
    ratio = rows[-1][2] / standard
    print(f"cp=4 / cp=1 (standard attention) = {ratio:.3f} (bar: <= 0.35): {'met' if ratio <= 0.35 else 'NOT met'}")


if __name__ == "__main__":
    main()
