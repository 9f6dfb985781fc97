"""The attention block kernel against torch's SDPA on the same tensors, side by side.

Forward + backward of causal attention, [batch, heads, S, head_dim] with grouped-query
K/V, timed in one process, interleaved, medians of `--repeats`:

- SDPA: `F.scaled_dot_product_attention(..., is_causal=True, enable_gqa=True)`.
- fused: `blockwise_attention` with its blocks by the fused kernel (what the CPU runs:
  `runtime/attention_fused.py`), over the load-balanced halves of a cp=2 rank's
  sequence as ring attention sees them, and over the whole sequence at once.
- matmuls: the same with the blocks by the module's own matmuls in 256-row tiles (what
  every block was before, and what devices without the fused kernel run).

    python benchmarks/attention_kernel.py [--seq 2048] [--repeats 9] [--dtype fp32]
"""

from __future__ import annotations

import argparse
import statistics
import time
from unittest import mock

import torch
import torch.nn.functional as F

from fivedc.runtime import attention_fused
from fivedc.runtime.attention import blockwise_attention

DTYPES = {"fp32": torch.float32, "fp64": torch.float64, "bf16": torch.bfloat16}


def timed(fn, q, k, v) -> float:
    q, k, v = (t.detach().requires_grad_(True) for t in (q, k, v))
    start = time.perf_counter()
    out = fn(q, k, v)
    out.backward(torch.ones_like(out))
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seq", type=int, default=2048)
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--kv-heads", type=int, default=2)
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=9)
    parser.add_argument("--dtype", default="fp32", choices=DTYPES)
    args = parser.parse_args()
    dtype, s = DTYPES[args.dtype], args.seq
    q = torch.randn(args.batch, args.heads, s, args.head_dim, dtype=dtype)
    k, v = (torch.randn(args.batch, args.kv_heads, s, args.head_dim, dtype=dtype) for _ in range(2))
    pos = torch.arange(s)
    halves = torch.cat([torch.arange(0, s // 4), torch.arange(3 * s // 4, s)])  # cp=2 rank 0, balanced

    def sdpa(q, k, v):
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)

    def whole(q, k, v):
        return blockwise_attention(q, k, v, pos, pos, causal=True)

    def ring_rank(q, k, v):  # one cp=2 rank's queries against the whole sequence in two blocks
        return blockwise_attention(q[:, :, halves], k[:, :, halves], v[:, :, halves], halves, halves, causal=True)

    matmuls = mock.patch.object(attention_fused, "available", lambda t: False)
    variants = {"SDPA": (sdpa, None), "fused, whole sequence": (whole, None),
                "matmuls, whole sequence": (whole, matmuls),
                "fused, a cp=2 rank's half (SDPA/2 is even)": (ring_rank, None),
                "matmuls, a cp=2 rank's half": (ring_rank, matmuls)}
    times: dict[str, list[float]] = {name: [] for name in variants}
    for _ in range(args.repeats + 1):  # the first round warms up
        for name, (fn, patch) in variants.items():
            with patch or mock.patch.object(attention_fused, "_DTYPES", attention_fused._DTYPES):
                times[name].append(timed(fn, q, k, v))
    base = statistics.median(times["SDPA"][1:])
    print(f"causal attention fwd+bwd, batch {args.batch}, heads {args.heads} (kv {args.kv_heads}), S {s}, "
          f"head_dim {args.head_dim}, {args.dtype}, {torch.get_num_threads()} threads; medians of {args.repeats}")
    for name, samples in times.items():
        median = statistics.median(samples[1:])
        print(f"  {name:<44} {median * 1e3:9.1f} ms   {median / base:5.2f}x SDPA")


if __name__ == "__main__":
    main()
