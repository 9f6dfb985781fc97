"""ZeRO and overlap on gloo: step time with overlap on versus off, and bytes per rank per stage.

One GPT-style model (4 layers, hidden 256) on dp=4, trained in fp32 on a pool of 4
local gloo processes. Part 1 runs the same plan with overlap on and off, alternating
(on, off, on, off, ...) so drift in machine load hits both alike, and reports the
median step time of each and their ratio. Part 2 trains one step at each ZeRO stage
and compares the bytes each rank holds in parameters, gradients and optimizer state
with the plan's estimate and with the ZeRO paper's formula (here fp32: 4Ψ + 4Ψ + 8Ψ,
the optimizer term and then the gradient and parameter terms divided by N = 4 as
stages 1, 2 and 3 add them).

    python benchmarks/zero.py [--repeats 5] [--steps 4]
"""

from __future__ import annotations

import argparse
import statistics
import time

from fivedc.frontends.dsl_file import parse_model
from fivedc.ir.mesh import Mesh
from fivedc.passes.base import CompileOptions
from fivedc.pipeline import compile_graph
from fivedc.runtime.pool import RankInfo, WorkerPool

MODEL = """
model bench_gpt {
  dims { batch = 8  seq = 64  hidden = 256  heads = 8  head_dim = hidden / heads  ffn = 4 * hidden  vocab = 1024 }
  input tokens: int[batch, seq]
  input targets: int[batch, seq]
  param wte: [vocab, hidden]
  x = embedding(tokens, wte)
  repeat 4 as layers {
    param ln1: [hidden] = ones
    param wq: [hidden, heads, head_dim]
    param wk: [hidden, heads, head_dim]
    param wv: [hidden, heads, head_dim]
    param wo: [heads, head_dim, hidden]
    h = rmsnorm(x, ln1)
    a = attention(linear(h, wq), linear(h, wk), linear(h, wv), causal=true)
    x = add(x, linear(a, wo))
    param ln2: [hidden] = ones
    param w_up: [hidden, ffn]
    param w_down: [ffn, hidden]
    x = add(x, linear(gelu(linear(rmsnorm(x, ln2), w_up)), w_down))
  }
  param lnf: [hidden] = ones
  param w_head: [hidden, vocab]
  loss = cross_entropy(linear(rmsnorm(x, lnf), w_head), targets)
  return loss
}
"""
MESH, WORLD = "4x1x1x1x1", 4


def plan(zero: int, overlap: bool, bucket_mb: float = 1.0):
    graph = parse_model(MODEL, filename="bench_gpt.5d")
    options = CompileOptions(mesh=Mesh.parse(MESH), dtype="fp32", zero=zero, overlap=overlap, bucket_mb=bucket_mb)
    return compile_graph(graph, options)


def train_job(info: RankInfo, payload) -> dict:
    """Train `steps` steps after one warm-up step; the seconds per step, and the bytes held."""
    import torch

    from fivedc.runtime.train import TrainSettings
    from fivedc.runtime.verify import setup_rank, train_plan

    the_plan, steps = payload
    torch.set_num_threads(1)
    settings = TrainSettings(steps=1, dtype="fp32")
    program, params, inputs, _ = setup_rank(the_plan, info, settings)
    train_plan(the_plan, program, params, inputs, settings)  # warm-up
    start = time.perf_counter()
    record = train_plan(the_plan, program, params, inputs, TrainSettings(steps=steps, dtype="fp32"))
    return {"seconds": (time.perf_counter() - start) / steps, "held": record.held}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--steps", type=int, default=4)
    args = parser.parse_args()
    with WorkerPool(WORLD) as pool:
        print(f"## step time, overlap on vs off (ZeRO-0 and ZeRO-2, 1 MiB buckets, {MESH}, fp32, gloo)\n")
        print("| ZeRO | overlap on (ms/step) | overlap off (ms/step) | on / off |")
        print("|---|---|---|---|")
        for zero in (0, 2):
            times: dict[bool, list[float]] = {True: [], False: []}
            for _ in range(args.repeats):
                for overlap in (True, False):
                    results = pool.run(train_job, world=WORLD, payload=(plan(zero, overlap), args.steps))
                    times[overlap].append(max(r["seconds"] for r in results))
            on, off = statistics.median(times[True]), statistics.median(times[False])
            print(f"| {zero} | {on * 1e3:.1f} | {off * 1e3:.1f} | {on / off:.3f} |")
        base = plan(0, True)
        psi = base.memory.params // 4  # fp32 parameters, elements per rank (dp does not split them)
        print(f"\n## bytes per rank per ZeRO stage (Ψ = {psi:,} parameters, N = {WORLD}, fp32)\n")
        print("| ZeRO | measured params / grads / optimizer (MiB) | plan estimate | formula | measured / formula |")
        print("|---|---|---|---|---|")
        for zero in (0, 1, 2, 3):
            the_plan = plan(zero, True)
            held = max((r["held"] for r in pool.run(train_job, world=WORLD, payload=(the_plan, 1))),
                       key=lambda h: sum(h.values()))
            formula = {"params": 4 * psi / (WORLD if zero >= 3 else 1), "grads": 4 * psi / (WORLD if zero >= 2 else 1),
                       "optimizer": 8 * psi / (WORLD if zero >= 1 else 1)}
            estimate = {"params": the_plan.memory.params, "grads": the_plan.memory.grads,
                        "optimizer": the_plan.memory.optimizer}

            def mib(d: dict) -> str:
                return " / ".join(f"{d[k] / 2**20:.2f}" for k in ("params", "grads", "optimizer"))

            ratio = sum(held.values()) / sum(formula.values())
            print(f"| {zero} | {mib(held)} | {mib(estimate)} | {mib(formula)} | {ratio:.4f} |")


if __name__ == "__main__":
    main()
