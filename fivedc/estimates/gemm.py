"""Seconds of one GEMM from its shape: a roofline with tile and wave quantisation.

C[M, N] = A[M, K] · B[K, N] runs on a GPU as output tiles of tm x tn, one thread block
each, every block stepping through K by tk; the blocks run in waves over the SMs, one
block an SM at a time (a large-tile kernel's pipelined stages fill an SM's shared
memory). So a GEMM whose edges are not whole tiles computes the padding too, and one
with fewer tiles than SMs, or a last wave partly filled, leaves SMs idle:

    tiles   = ⌈M / tm⌉ ⌈N / tn⌉                    (the edges padded to whole tiles)
    steps   = ⌈K / tk⌉
    split   = min(⌊SMs / tiles⌋, steps) where tiles < SMs, else 1   (split-K: a tile's K
              steps shared by that many blocks, their float32 partial sums written and
              read back once more)
    waves   = ⌈tiles x split / SMs⌉                (the last wave partly idle)
    compute = waves x 2 tm tn ⌈steps / split⌉ tk / (matmul_efficiency x bf16_flops / SMs)
    memory  = ((MK + KN + MN) x element bytes + 2 x split x MN x 4 where split > 1)
              / (memory_efficiency x hbm_bytes_per_s)
    seconds = max(compute, memory), the least over the profile's tiles

A full wave of whole tiles runs at the large-GEMM rate (`matmul_efficiency`), so a large
GEMM costs what the flat rate says and a skinny one (tp8 at 1K tokens: a few dozen tiles
on 132 SMs) more per FLOP. cuBLAS's heuristic picks one kernel per shape among several
tile shapes (and split-K for a few tiles over a long K: a weight gradient's small output
over many tokens); the least time over the profile's `matmul_tiles` stands for that pick.
Not modelled: the host's time to launch a kernel (hidden where the host runs ahead,
`Hardware.host_runs_ahead`), and a kernel's rate below the full-wave one on a short K.

A profile without the tile terms (`sm_count`, `matmul_tiles`: the CPU profiles a
calibration writes, the TPU's) prices every GEMM at the flat rate, 2MNK / (matmul_efficiency
x bf16_flops), as a calibration measured it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from fivedc.ir.hardware import Hardware


@dataclass(frozen=True, slots=True)
class Gemm:
    """`count` alike GEMMs C[m, n] = A[m, k] · B[k, n] on one rank, one after another (a
    rank's experts, each on its own rows, as `runtime/moe.py` runs them: no grouped
    kernel sharing waves); `weight`: B is a parameter, so its gradient is a weight gradient (W)."""

    m: float
    n: float
    k: float
    count: float = 1.0
    weight: bool = True

    @property
    def flops(self) -> float:
        return 2.0 * self.m * self.n * self.k * self.count

    def input_gradient(self) -> Gemm:
        """dA[m, k] = dC[m, n] · Bᵀ: contracts n."""
        return Gemm(self.m, self.k, self.n, self.count, self.weight)

    def weight_gradient(self) -> Gemm:
        """dB[k, n] = Aᵀ · dC[m, n]: contracts m (the rows: tokens)."""
        return Gemm(self.k, self.n, self.m, self.count, self.weight)


def gemm_seconds(g: Gemm, hw: Hardware, *, element_bytes: int) -> float:
    """Seconds of `g` (all `count` of them, one after another) on `hw`."""
    if not hw.tiled or not g.flops:
        return g.flops / (hw.bf16_flops * hw.matmul_efficiency)
    return min(_tiled_seconds(g, tile, hw, element_bytes) for tile in hw.matmul_tiles) * g.count


def _tiled_seconds(g: Gemm, tile: tuple[int, int, int], hw: Hardware, element_bytes: int) -> float:
    """One GEMM in `tile`s: its waves at the full-wave rate (padding and the last wave's idle
    SMs counted), or its memory traffic, whichever takes longer."""
    tm, tn, tk = tile
    sms, steps = hw.sm_count, math.ceil(g.k / tk)
    tiles = math.ceil(g.m / tm) * math.ceil(g.n / tn)
    split = max(1, min(sms // tiles, steps)) if tiles < sms else 1
    flops = math.ceil(tiles * split / sms) * sms * 2.0 * tm * tn * math.ceil(steps / split) * tk
    moved = (g.m * g.k + g.k * g.n + g.m * g.n) * element_bytes + (2 * split * g.m * g.n * 4 if split > 1 else 0)
    return max(flops / (hw.bf16_flops * hw.matmul_efficiency), moved / (hw.hbm_bytes_per_s * hw.memory_efficiency))


def gemms_seconds(gemms, hw: Hardware, *, element_bytes: int) -> tuple[float, float, float]:
    """(forward, input-gradient, weight-gradient) seconds of an op's GEMMs: each forward GEMM's
    backward is its input's gradient (I) and its B's gradient (W where B is a parameter, else I)."""
    forward = backward = weight = 0.0
    for g in gemms:
        forward += gemm_seconds(g, hw, element_bytes=element_bytes)
        backward += gemm_seconds(g.input_gradient(), hw, element_bytes=element_bytes)
        dw = gemm_seconds(g.weight_gradient(), hw, element_bytes=element_bytes)
        weight, backward = (weight + dw, backward) if g.weight else (weight, backward + dw)
    return forward, backward, weight
