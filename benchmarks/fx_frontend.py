"""The torch.fx frontend and `fivedc.parallelize`: tracing + compile time, and step-time overhead.

Part 1: for each example (`examples/nanogpt.py`, `examples/llama.py`,
`examples/mixtral.py` in both its forms, at the sizes below) the time to trace the module into the IR (`trace_module`) and to compile
the graph for a 1x1x1x1x1 and a 2x1x2x1x1 (SP) mesh; medians of `--repeats`.

Part 2: the step time of the module parallelized at mesh 1x1x1x1x1 (fivedc's
Program and kernels, one process, no communication) against the plain module, with
the same loop (`zero_grad`, forward, `backward`, `torch.optim.AdamW.step`) in fp32
from the same weights on the same batch. Runs alternate (plain, fivedc, plain, ...)
so drift in machine load hits both alike; each run is `--steps` steps after one
warm-up step, and the table gives the median step time of each and their ratio
(the overhead of going through fivedc; target <= 1.05), as wall-clock time and as
this process's CPU time (which other processes' load on a shared machine does not
inflate). torch runs `--threads` intra-op threads (default 1: on a loaded machine,
spinning OpenMP threads make multi-threaded wall times erratic).

    python benchmarks/fx_frontend.py [--repeats 7] [--steps 5] [--threads 1]
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from pathlib import Path

import torch

from fivedc.frontends.python_file import import_file

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"


def _example(name: str):
    """The example `examples/<name>.py` as a module."""
    return import_file(EXAMPLES / f"{name}.py")


EXAMPLE_NAMES = ("nanogpt", "llama", "mixtral", "mixtral-hf")


def build(name: str, dtype=torch.float32):
    """A model of a size where a step is compute, not Python: 4 layers, hidden 256, seq 128.
    Mixtral: 8 experts of width 256, top-2 (its stacked-expert block); "mixtral-hf" the same
    with Hugging Face's block (a ModuleList of experts, a Python loop over them)."""
    if name == "nanogpt":
        m = _example("nanogpt")
        config = m.GPTConfig(block_size=128, vocab_size=2048, n_layer=4, n_head=8, n_embd=256)
        return m.factory(batch=8, config=config, dtype=dtype)
    sizes = dict(dim=256, n_layers=4, n_heads=8, n_kv_heads=4, vocab_size=2048, max_seq_len=128)
    if name == "llama":
        m = _example("llama")
        return m.factory(batch=8, args=m.ModelArgs(ffn_dim=688, **sizes), dtype=dtype)
    m = _example("mixtral")
    args = m.ModelArgs(n_experts=8, top_k=2, expert_ffn_dim=256, **sizes)
    factory = m.hf_factory if name == "mixtral-hf" else m.factory
    return factory(batch=8, args=args, dtype=dtype)


def trace_compile_times(name: str, repeats: int) -> dict[str, float]:
    from fivedc.frontends.fx_module import trace_module
    from fivedc.ir.mesh import Mesh
    from fivedc.passes.base import CompileOptions
    from fivedc.pipeline import compile_graph

    module, inputs = build(name)
    times: dict[str, list[float]] = {"trace": [], "1x1x1x1x1": [], "2x1x2x1x1": []}
    for _ in range(repeats):
        start = time.perf_counter()
        graph = trace_module(module, inputs).graph
        times["trace"].append(time.perf_counter() - start)
        for mesh, sp in (("1x1x1x1x1", False), ("2x1x2x1x1", True)):
            start = time.perf_counter()
            compile_graph(graph, CompileOptions(mesh=Mesh.parse(mesh), sequence_parallel=sp, dtype="fp32"))
            times[mesh].append(time.perf_counter() - start)
    return {k: statistics.median(v) for k, v in times.items()}


def _run(model, inputs, opt, steps: int) -> tuple[float, float]:
    """Wall and CPU seconds per step over `steps` steps (after the caller's warm-up)."""
    wall, cpu = time.perf_counter(), time.process_time()
    for _ in range(steps):
        opt.zero_grad(set_to_none=True)
        model(*inputs).backward()
        opt.step()
    return (time.perf_counter() - wall) / steps, (time.process_time() - cpu) / steps


def step_times(name: str, repeats: int, steps: int) -> dict[str, tuple[float, float]]:
    """Per model ("plain", "fivedc"): the median (wall, CPU) seconds per step."""
    import fivedc

    plain, inputs = build(name)
    other, _ = build(name)
    model = fivedc.parallelize(other, mesh="1x1x1x1x1", example_inputs=inputs)
    runs = {"plain": [], "fivedc": []}
    opts = {"plain": torch.optim.AdamW(plain.parameters(), lr=1e-4),
            "fivedc": torch.optim.AdamW(model.parameters(), lr=1e-4)}
    models = {"plain": plain, "fivedc": model}
    for key in runs:
        _run(models[key], inputs, opts[key], 1)  # warm-up
    for _ in range(repeats):
        for key in runs:
            runs[key].append(_run(models[key], inputs, opts[key], steps))
    return {k: (statistics.median(w for w, _ in v), statistics.median(c for _, c in v)) for k, v in runs.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    torch.manual_seed(0)
    torch.set_num_threads(args.threads)
    print(f"torch {torch.__version__}, {torch.get_num_threads()} thread(s), {os.cpu_count()} cores, "
          f"load average {os.getloadavg()[0]:.1f}")
    print("\n| example | parameters | trace (ms) | compile 1x1x1x1x1 (ms) | compile 2x1x2x1x1 SP (ms) |")
    print("|---|---|---|---|---|")
    for name in EXAMPLE_NAMES:
        t = trace_compile_times(name, args.repeats)
        n = sum(p.numel() for p in build(name)[0].parameters())
        print(f"| {name} | {n / 1e6:.2f} M | {t['trace'] * 1e3:.1f} | {t['1x1x1x1x1'] * 1e3:.1f} "
              f"| {t['2x1x2x1x1'] * 1e3:.1f} |", flush=True)
    print("\n| example | plain module wall / CPU (ms/step) | fivedc 1x1x1x1x1 wall / CPU (ms/step) "
          "| fivedc / plain, wall | fivedc / plain, CPU |")
    print("|---|---|---|---|---|")
    for name in EXAMPLE_NAMES:
        t = step_times(name, args.repeats, args.steps)
        (pw, pc), (fw, fc) = t["plain"], t["fivedc"]
        print(f"| {name} | {pw * 1e3:.1f} / {pc * 1e3:.1f} | {fw * 1e3:.1f} / {fc * 1e3:.1f} | {fw / pw:.3f} "
              f"| {fc / pc:.3f} |", flush=True)
    print(f"\nload average at the end {os.getloadavg()[0]:.1f}")


if __name__ == "__main__":
    main()
