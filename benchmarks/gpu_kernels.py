"""One GPU's kernels at the shapes training plans make: matmuls, attention, memory-bound ops.

What the step-time model prices (`fivedc/estimates/costs.py`) measured on a real GPU, to
hold the model to (issue 35: GEMM time from its shape, the attention kernel, memory-bound
ops). Each kernel is timed with CUDA events, the median of `--repeats` after warm-up, on
random bfloat16 data:

- matmuls: M tokens (1K to 16K) by the (K, N) of Llama 3 8B, 70B and 405B's projections,
  unsharded and split over tp = 2, 4, 8 (column-parallel: N/tp; row-parallel: K/tp);
- attention: `F.scaled_dot_product_attention`, causal and full, head dims 64 and 128,
  sequences 1K to 8K, forward and forward+backward (FLOPs: 4·b·h·s²·d forward, halved
  when causal; backward 2.5× forward, as FlashAttention counts it);
- memory-bound: an add, a copy and a fused RMSNorm-like chain on 2**28 elements.

Writes one JSON (`--json`), each row with its shape, seconds and achieved rate.

    python benchmarks/gpu_kernels.py --json gpu_kernels.json    # on a GPU (about 30 s)
"""

from __future__ import annotations

import argparse
import json
import statistics

import torch
import torch.nn.functional as F

PROJECTIONS = {  # model: (hidden, ffn, heads, kv_heads, head_dim), Llama 3 (table 3 of its paper)
    "8b": (4096, 14336, 32, 8, 128),
    "70b": (8192, 28672, 64, 8, 128),
    "405b": (16384, 53248, 128, 8, 128),
}
TOKENS = (1024, 2048, 4096, 8192, 16384)
TP = (1, 2, 4, 8)


def timed(fn, repeats: int) -> float:
    """Median seconds of `fn` on the GPU (CUDA events), after three warm-up calls."""
    for _ in range(3):
        fn()
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e-3)
    return statistics.median(times)


def matmul_shapes() -> list[tuple[str, int, int, int]]:
    """(what, M, K, N) of each model's projections at each tp and token count, without repeats."""
    seen, out = set(), []
    for model, (hidden, ffn, heads, kv, head_dim) in PROJECTIONS.items():
        qkv = (heads + 2 * kv) * head_dim
        for tp in TP:
            for what, k, n in ((f"{model} qkv/tp{tp}", hidden, qkv // tp), (f"{model} out/tp{tp}", hidden // tp, hidden),
                               (f"{model} up/tp{tp}", hidden, 2 * ffn // tp), (f"{model} down/tp{tp}", ffn // tp, hidden)):
                for m in TOKENS:
                    if (m, k, n) not in seen:
                        seen.add((m, k, n))
                        out.append((what, m, k, n))
    return out


def matmuls(repeats: int) -> list[dict]:
    rows = []
    for what, m, k, n in matmul_shapes():
        a = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
        b = torch.randn(k, n, device="cuda", dtype=torch.bfloat16)
        seconds = timed(lambda: a @ b, repeats)
        rows.append({"what": what, "m": m, "k": k, "n": n, "seconds": seconds, "tflops": 2 * m * k * n / seconds / 1e12})
    return rows


def attention(repeats: int) -> list[dict]:
    rows = []
    for head_dim in (64, 128):
        for seq in (1024, 2048, 4096, 8192):
            heads, batch = 2048 // head_dim * 2, max(1, 16384 // seq)
            q, k, v = (torch.randn(batch, heads, seq, head_dim, device="cuda", dtype=torch.bfloat16, requires_grad=True)
                       for _ in range(3))
            for causal in (True, False):
                forward_flops = 4 * batch * heads * seq * seq * head_dim / (2 if causal else 1)
                fwd = timed(lambda: F.scaled_dot_product_attention(q, k, v, is_causal=causal), repeats)
                out = F.scaled_dot_product_attention(q, k, v, is_causal=causal)
                grad = torch.randn_like(out)
                both = timed(lambda: torch.autograd.grad(F.scaled_dot_product_attention(q, k, v, is_causal=causal),
                                                         (q, k, v), grad), repeats)
                rows.append({"batch": batch, "heads": heads, "seq": seq, "head_dim": head_dim, "causal": causal,
                             "forward_s": fwd, "forward_backward_s": both,
                             "forward_tflops": forward_flops / fwd / 1e12,
                             "forward_backward_tflops": 3.5 * forward_flops / both / 1e12})
    return rows


def memory_bound(repeats: int) -> list[dict]:
    n = 2**28
    x, y = (torch.randn(n, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    w = torch.randn(4096, device="cuda", dtype=torch.bfloat16)
    x2 = x.view(-1, 4096)

    def rms():
        return x2 * torch.rsqrt(x2.float().pow(2).mean(-1, keepdim=True) + 1e-5).to(x2.dtype) * w

    rows = []
    for what, fn, moved in (("add", lambda: x + y, 3 * 2 * n), ("copy", lambda: x.clone(), 2 * 2 * n),
                            ("rmsnorm (eager ops)", rms, 2 * 2 * n)):
        seconds = timed(fn, repeats)
        rows.append({"what": what, "elements": n, "seconds": seconds, "bytes": moved, "gb_per_s": moved / seconds / 1e9})
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", required=True)
    parser.add_argument("--repeats", type=int, default=10)
    args = parser.parse_args()
    torch.backends.cuda.matmul.allow_tf32 = False
    result = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__,
              "matmuls": matmuls(args.repeats), "attention": attention(args.repeats),
              "memory_bound": memory_bound(args.repeats)}
    with open(args.json, "w") as f:
        json.dump(result, f, indent=1)
    mm = result["matmuls"]
    print(f"{result['gpu']}: {len(mm)} matmuls, {min(r['tflops'] for r in mm):.0f}-{max(r['tflops'] for r in mm):.0f} "
          f"TFLOP/s; attention fwd+bwd {min(r['forward_backward_tflops'] for r in result['attention']):.0f}-"
          f"{max(r['forward_backward_tflops'] for r in result['attention']):.0f} TFLOP/s; "
          + ", ".join(f"{r['what']} {r['gb_per_s']:.0f} GB/s" for r in result["memory_bound"]))


if __name__ == "__main__":
    main()
