"""One GPU: a ~1B dense Llama under bf16 autocast, fivedc against torch, side by side.

The Llama of `examples/llama.py` at TinyLlama's shape (hidden 2048, 22 layers, 32
heads, 4 K/V heads, SwiGLU 5632, vocab 32000: 1.1B parameters), sequence 2048,
batch 4, float32 master weights, each forward under `torch.autocast("cuda",
torch.bfloat16)`, `torch.optim.AdamW(fused=True)`. Variants, each in turn in one
process on the same GPU:

- eager: the plain module;
- compile: `torch.compile` of the plain module;
- fivedc: `fivedc.parallelize(module, mesh="1x1x1x1x1")` (the runtime's program on one
  device: its kernels, its fused RMSNorm/SwiGLU, SDPA);
- fivedc+compile: the same with `compile=True` (each layer of a repeat one compiled region),
  when fivedc has it.

Per variant: the median step time over `--steps` steps after `--warmup` steps (CUDA
synchronised), tokens/s, MFU (model FLOPs per step as PaLM counts them, 6N + 12·L·h·s
per token with N the parameters less the input embedding, over the H100's dense bf16
peak 989.4 TFLOP/s from fivedc/ir/hardware.toml) and the CUDA allocator's peak; the
ratios fivedc / eager and fivedc / compile. `--tiny` runs a small model on the CPU
(a smoke test of this script, no figures).

    python benchmarks/gpu_llama.py [--steps 10] [--warmup 3] [--variants eager,compile,fivedc]
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import time
from pathlib import Path

import torch

from fivedc.frontends.python_file import import_file

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"
PEAK_BF16 = 989.4e12  # H100 SXM dense bf16 (fivedc/ir/hardware.toml: h100)


LAYERS = 22


def build(tiny: bool, device: str):
    m = import_file(EXAMPLES / "llama.py")
    if tiny:
        args, batch = m.ModelArgs(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=256, ffn_dim=172,
                                  max_seq_len=32), 2
    else:
        args, batch = m.ModelArgs(dim=2048, n_layers=LAYERS, n_heads=32, n_kv_heads=4, vocab_size=32000, ffn_dim=5632,
                                  max_seq_len=2048), 4
    module, (tokens, targets) = m.factory(batch=batch, args=args, dtype=torch.float32)
    return module.to(device), (tokens.to(device), targets.to(device)), args


def memory_factory(*, tiny: bool = False):
    """The Llama at 0.44B (hidden 1024, 8 layers, sequence 2048, batch 2) for `fivedc run
    --report`: the plan's per-rank memory estimate against the CUDA allocator's peak."""
    m = import_file(EXAMPLES / "llama.py")
    if tiny:
        args = m.ModelArgs(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=256, ffn_dim=172, max_seq_len=32)
    else:
        args = m.ModelArgs(dim=1024, n_layers=8, n_heads=16, n_kv_heads=8, vocab_size=32000, ffn_dim=2816,
                           max_seq_len=2048)
    return m.factory(batch=2, args=args, dtype=torch.float32)


def step_factory(*, layers: int = LAYERS):
    """The benchmark's own 1.1B Llama (batch 4 x 2048 tokens) for `fivedc run` and `fivedc
    compile`: the runtime's step and the plan's predicted step on the same model."""
    m = import_file(EXAMPLES / "llama.py")
    args = m.ModelArgs(dim=2048, n_layers=layers, n_heads=32, n_kv_heads=4, vocab_size=32000, ffn_dim=5632,
                       max_seq_len=2048)
    return m.factory(batch=4, args=args, dtype=torch.float32)


def tiny_memory_factory():
    return memory_factory(tiny=True)


def model_flops(module, args, tokens: torch.Tensor) -> float:
    """PaLM's count (appendix B): 6N + 12·L·h·s per token, N without the input embedding."""
    n = sum(p.numel() for p in module.parameters()) - module.tok_embeddings.weight.numel()
    per_token = 6 * n + 12 * args.n_layers * args.dim * tokens.shape[1]
    return per_token * tokens.numel()


def variant(name: str, tiny: bool, device: str):
    import fivedc

    torch.manual_seed(0)
    module, inputs, args = build(tiny, device)
    flops = model_flops(module, args, inputs[0])
    if name == "eager":
        model = module
    elif name == "compile":
        model = torch.compile(module)
    elif name == "fivedc":
        model = fivedc.parallelize(module, mesh="1x1x1x1x1", example_inputs=inputs)
    elif name == "fivedc+compile":
        model = fivedc.parallelize(module, mesh="1x1x1x1x1", example_inputs=inputs, compile=True)
    elif name == "fivedc+aot_eager":  # the compiled regions without inductor (a CPU smoke test)
        model = fivedc.parallelize(module, mesh="1x1x1x1x1", example_inputs=inputs, compile="aot_eager")
    else:
        raise SystemExit(f"unknown variant {name!r}")
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=device == "cuda")
    return model, inputs, opt, flops


def measure(name: str, *, steps: int, warmup: int, tiny: bool, device: str) -> dict:
    cuda = device == "cuda"
    model, inputs, opt, flops = variant(name, tiny, device)
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    times, losses = [], []
    for step in range(warmup + steps):
        start = time.perf_counter()
        opt.zero_grad(set_to_none=True)
        with torch.autocast(device, dtype=torch.bfloat16):
            loss = model(*inputs)
        loss.backward()
        opt.step()
        if cuda:
            torch.cuda.synchronize()
        if step >= warmup:
            times.append(time.perf_counter() - start)
        losses.append(loss.detach().item())
    step_s = statistics.median(times)
    out = {"variant": name, "step_s": step_s, "tokens_per_s": inputs[0].numel() / step_s,
           "mfu": flops / step_s / PEAK_BF16, "peak_gib": torch.cuda.max_memory_allocated() / 2**30 if cuda else None,
           "losses": losses}
    del model, opt, inputs
    gc.collect()
    if cuda:
        torch.cuda.empty_cache()
    return out


def check_grads(names: list[str], *, tiny: bool, device: str) -> None:
    """One step's loss and gradients of each variant against eager's (bf16 autocast, the
    module's names): the worst relative error (to the largest magnitude) and where."""
    from fivedc.parallel.check import compare, train_module

    runs = {}
    for name in ["eager", *names]:
        model, inputs, _, _ = variant(name, tiny, device)
        run = train_module(model, inputs, steps=1, autocast="bf16")
        run.grads = [{k.replace("_orig_mod.", ""): v for k, v in g.items()} for g in run.grads]
        run.params = {k.replace("_orig_mod.", ""): v for k, v in run.params.items()}
        runs[name] = run
        del model
        gc.collect()
        if device == "cuda":
            torch.cuda.empty_cache()
    for name in names:
        report = compare(runs["eager"], runs[name])
        worst = sorted(((float((g - runs["eager"].grads[0][k]).abs().max() / runs["eager"].grads[0][k].abs().max()), k)
                        for k, g in runs[name].grads[0].items()), reverse=True)[:4]
        print(f"{name:15s} vs eager: loss {report.loss_error:.2e}, gradients {report.grad_error:.2e}; worst "
              + ", ".join(f"{k} {e:.2e}" for e, k in worst), flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--variants", default="eager,compile,fivedc,fivedc+compile")
    parser.add_argument("--tiny", action="store_true", help="a small model on the CPU (smoke test)")
    parser.add_argument("--json", help="write the results here")
    parser.add_argument("--layers", type=int, default=LAYERS)
    parser.add_argument("--check-grads", action="store_true",
                        help="one step's gradients of each variant against eager's, instead of timings")
    args = parser.parse_args()
    device = "cpu" if args.tiny or not torch.cuda.is_available() else "cuda"
    globals()["LAYERS"] = args.layers
    if args.check_grads:
        return check_grads([n for n in args.variants.split(",") if n != "eager"], tiny=args.tiny, device=device)
    if device == "cuda":
        print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}")
    results = []
    for name in args.variants.split(","):
        result = measure(name, steps=args.steps, warmup=args.warmup, tiny=args.tiny, device=device)
        results.append(result)
        peak = f"{result['peak_gib']:.1f} GiB" if result["peak_gib"] is not None else "-"
        print(f"{name:15s} step {result['step_s'] * 1e3:8.1f} ms  {result['tokens_per_s']:9.0f} tok/s  "
              f"MFU {result['mfu']:6.1%}  peak {peak}  loss {result['losses'][0]:.4f} -> {result['losses'][-1]:.4f}",
              flush=True)
    by_name = {r["variant"]: r for r in results}
    for ours, theirs in (("fivedc", "eager"), ("fivedc", "compile"), ("fivedc+compile", "compile")):
        if ours in by_name and theirs in by_name:
            print(f"{ours} / {theirs}: {by_name[ours]['step_s'] / by_name[theirs]['step_s']:.2f}x step time")
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
