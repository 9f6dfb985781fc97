"""Measure this machine's links for the step-time model: latency, bandwidth, overlap.

`time_links` runs on two local processes joined by gloo (the pool `fivedc run` uses):
an all-reduce of a few bytes gives the latency per algorithm step, one of 16 MiB the
bandwidth, and a matmul run beside an all-reduce what share of the compute the
collective takes meanwhile (`overlap_sm_share`).

`runtime/calibrate_profile.py` turns the figures into a hardware profile.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch
import torch.distributed as dist

LINK_BYTES = 16 * 2**20  # the all-reduce whose time gives the bandwidth
SMALL_BYTES = 64  # and the one whose time is all latency


@dataclass(frozen=True)
class LinkSeconds:
    """Two local processes over gloo."""

    latency_s: float  # per step of a collective's algorithm
    bytes_per_s: float  # what an all-reduce moves per second per direction
    overlap_share: float  # of a collective's seconds run beside compute, what the compute loses


def time_links(*, timeout_s: float = 300.0) -> LinkSeconds:
    from fivedc.runtime.pool import run_once

    results = run_once(_link_job, world=2, payload=None, timeout_s=timeout_s)
    latency = max(r["latency"] for r in results)
    return LinkSeconds(latency, min(r["bandwidth"] for r in results), max(r["overlap"] for r in results))


def _link_job(info, payload) -> dict:
    """In each of two workers (gloo, one thread): latency, bandwidth, the overlap's cost."""
    small, large = torch.zeros(SMALL_BYTES // 4), torch.zeros(LINK_BYTES // 4)
    latency = _least_seconds(lambda: dist.all_reduce(small), 20) / 2  # a 2-rank ring: 2 steps
    reduce = _least_seconds(lambda: dist.all_reduce(large), 5)
    bandwidth = LINK_BYTES / max(reduce - 2 * latency, 1e-9)  # 2(n-1)/n of the bytes at n = 2
    a = torch.randn(512, 512)
    reps = max(1, round(reduce / _least_seconds(lambda: a @ a, 5)))  # compute about as long as the reduce
    alone = _least_seconds(lambda: [a @ a for _ in range(reps)], 3)

    def both():
        work = dist.all_reduce(large, async_op=True)
        for _ in range(reps):
            a @ a
        work.wait()

    together = _least_seconds(both, 3)
    overlap = (together - max(alone, reduce)) / max(min(alone, reduce), 1e-9)
    return {"latency": latency, "bandwidth": bandwidth, "overlap": min(max(overlap, 0.0), 0.99)}


def _least_seconds(fn, repeats: int) -> float:
    fn()  # warm-up
    dist.barrier()
    seconds = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        seconds.append(time.perf_counter() - start)
    return min(seconds)  # other work on the machine only adds
