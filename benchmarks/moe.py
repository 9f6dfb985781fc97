"""MoE on gloo: layer step time with ep=4, batched experts vs a Python loop over experts;
and all-to-all bytes per step, plan vs hand formula vs measured.

Part 1 runs one MoE layer (hidden 256, 1024 tokens per rank; 64 SwiGLU experts of
ffn 256 with top-2, then 256 of ffn 64 with top-8) forward and backward on 4 local
gloo processes with ep=4, the same routing and all-to-alls either way; only the local
experts differ: one batched matmul over experts padded to the busiest
(`batched_experts`) or a Python loop over the local experts (`loop_experts`).
The two alternate (batched, loop, batched, ...) so drift in machine load hits
both; the step time is the slowest rank's, the median over repeats.

Part 2 trains a 2-layer MoE model one step on dp=1, ep=4 and compares, per rank
and all-to-all, the bytes the plan lists (times (ep-1)/ep on the wire), the hand
formula tokens x top_k x hidden x bytes x (ep-1)/ep, and what was measured: the
rows this rank sent to other ep ranks (from its tokens per expert) x hidden x bytes.
Then DeepSeek-V3 at 1x1x8x1x32 from the plan alone.

    python benchmarks/moe.py [--repeats 5] [--steps 5]
"""

from __future__ import annotations

import argparse
import statistics
import time

from fivedc.frontends.dsl_file import load_model, parse_model
from fivedc.ir.graph import CollectiveKind, Op, walk_ops
from fivedc.ir.mesh import Mesh, MeshAxis
from fivedc.passes.base import CompileOptions
from fivedc.pipeline import compile_graph
from fivedc.runtime.pool import RankInfo, WorkerPool

LAYER = """
model moe_layer {{
  dims {{ batch = 16  seq = 256  hidden = 256  experts = {experts}  ffn = {ffn}  vocab = 64 }}
  input tokens: int[batch, seq]
  input targets: int[batch, seq]
  param wte: [vocab, hidden]
  param router: [hidden, experts]
  param we_gate: [experts, hidden, ffn]
  param we_up: [experts, hidden, ffn]
  param we_down: [experts, ffn, hidden]
  param head: [hidden, vocab]
  h = embedding(tokens, wte)
  x = add(h, moe(h, router, we_gate, we_up, we_down, top_k={top_k}))
  loss = cross_entropy(linear(x, head), targets)
  return loss
}}
"""
LAYERS = ((64, 256, 2), (256, 64, 8))  # (experts, ffn, top_k): Mixtral-like few large, DeepSeek-like many small
WORLD = 4


def layer_job(info: RankInfo, payload) -> dict:
    """Forward and backward of the MoE op alone, `steps` times after a warm-up, per experts_fn."""
    import torch

    from fivedc.runtime.moe import batched_experts, loop_experts, moe_kernel
    from fivedc.runtime.train import TrainSettings
    from fivedc.runtime.verify import setup_rank

    plan, which, steps = payload
    torch.set_num_threads(1)
    program, params, _, named = setup_rank(plan, info, TrainSettings(dtype="fp32"))
    op = next(n for n, _ in walk_ops(plan.graph.body) if isinstance(n, Op) and n.kind == "moe")
    x_dims = op.type.dims
    shape = [plan.graph.local_size(d, op.arg_specs[0].sharding, plan.mesh) for d in x_dims]
    x = torch.randn(shape, generator=torch.Generator().manual_seed(info.rank)).requires_grad_(True)
    weights = [params[a].requires_grad_(True) for a in op.args[1:]]
    dims = [x_dims] + [named[a].dims for a in op.args[1:]]
    experts_fn = {"batched": batched_experts, "loop": loop_experts}[which]

    def step() -> None:
        y = moe_kernel(program.ctx, op, [x, *weights], dims, experts_fn=experts_fn)
        y.square().sum().backward()

    step()
    start = time.perf_counter()
    for _ in range(steps):
        step()
    return {"seconds": (time.perf_counter() - start) / steps}


def bytes_job(info: RankInfo, plan) -> dict:
    """One training step; the rows this rank routed to experts on other ep ranks."""
    from fivedc.runtime.train import TrainSettings
    from fivedc.runtime.verify import setup_rank, train_plan

    settings = TrainSettings(steps=1, dtype="fp32")
    program, params, inputs, _ = setup_rank(plan, info, settings)
    record = train_plan(plan, program, params, inputs, settings)
    ep_index = program.ctx.coords[MeshAxis.EP]
    ep = plan.mesh.size(MeshAxis.EP)
    off_rank = {}
    for name, load in record.expert_load[0].items():
        per_rank = len(load.routed) // ep
        off_rank[name] = sum(n for e, n in enumerate(load.routed) if e // per_rank != ep_index)
    return {"off_rank": off_rank}


def part1(pool: WorkerPool, repeats: int, steps: int) -> None:
    print("## MoE layer step time, ep=4 (4 gloo processes, fp32): batched experts vs a Python loop\n")
    print("| experts (per rank) | expert ffn | top-k | tokens per rank | batched (ms/step) | loop (ms/step) "
          "| loop / batched |")
    print("|---|---|---|---|---|---|---|")
    for experts, ffn, top_k in LAYERS:
        text = LAYER.format(experts=experts, ffn=ffn, top_k=top_k)
        plan = compile_graph(parse_model(text, filename="moe_layer.5d"),
                             CompileOptions(mesh=Mesh.parse("1x1x1x1x4"), dtype="fp32"))
        times: dict[str, list[float]] = {"batched": [], "loop": []}
        for _ in range(repeats):
            for which in times:
                results = pool.run(layer_job, world=WORLD, payload=(plan, which, steps))
                times[which].append(max(r["seconds"] for r in results))
        batched, loop = statistics.median(times["batched"]), statistics.median(times["loop"])
        print(f"| {experts} ({experts // WORLD}) | {ffn} | {top_k} | 1024 | {batched * 1e3:.1f} | {loop * 1e3:.1f} "
              f"| {loop / batched:.2f} |")


def part2(pool: WorkerPool) -> None:
    text = open("examples/moe.5d").read()
    plan = compile_graph(parse_model(text, filename="examples/moe.5d"),
                         CompileOptions(mesh=Mesh.parse("1x1x1x1x4"), dtype="fp32"))
    ep, tokens, k, hidden, b = 4, 8 // 4 * 8, 2, 32, 4
    formula = tokens * k * hidden * b * (ep - 1) / ep
    rows = [c for c in plan.collectives if c.kind == CollectiveKind.ALL_TO_ALL and "how many tokens" not in c.reason]
    plan_wire = sum(c.bytes * c.count for c in rows) * (ep - 1) / ep
    results = pool.run(bytes_job, world=WORLD, payload=plan)
    measured = [sum(r["off_rank"].values()) * hidden * b * 4 for r in results]  # 4 token all-to-alls per layer
    print("\n## all-to-all bytes per step per rank (examples/moe.5d, 2 MoE layers, 1x1x1x1x4, fp32)\n")
    print("| | bytes per step per rank | / formula |")
    print("|---|---|---|")
    total = formula * 4 * 2
    print(f"| hand formula: {tokens} tokens x top_k {k} x hidden {hidden} x {b} B x 3/4, x 4 all-to-alls x 2 layers "
          f"| {total:,.0f} | 1.000 |")
    print(f"| plan: sum of the token all-to-alls' bytes x count x 3/4 | {plan_wire:,.0f} | {plan_wire / total:.3f} |")
    for rank, value in enumerate(measured):
        print(f"| measured, rank {rank}: rows sent to other ep ranks x hidden x {b} B | {value:,.0f} "
              f"| {value / total:.3f} |")
    ds = compile_graph(load_model("examples/deepseek_v3.5d"), CompileOptions(mesh=Mesh.parse("1x1x8x1x32")))
    dispatch = next(c for c in ds.collectives if c.reason.startswith("dispatch:"))
    ds_formula = 15360 // 32 * 4096 * 8 * 7168 * 2 * 31 / 32
    print(f"\nDeepSeek-V3 at 1x1x8x1x32 (bf16): dispatch per layer, plan {dispatch.bytes * 31 / 32:,.0f} B on the wire "
          f"per rank, formula {ds_formula:,.0f} B (ratio {dispatch.bytes * 31 / 32 / ds_formula:.3f}); "
          f"{dispatch.count} layers x 4 token all-to-alls = {dispatch.bytes * 31 / 32 * dispatch.count * 4 / 2**40:.1f} TiB "
          "per step per rank without microbatching")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--steps", type=int, default=5)
    args = parser.parse_args()
    with WorkerPool(WORLD) as pool:
        part1(pool, args.repeats, args.steps)
        part2(pool)


if __name__ == "__main__":
    main()
