"""ZeRO-3 against torch's FSDP2: step time and collectives per step, side by side.

Llama (`examples/llama.py`, 4 layers, hidden 256, float32) on 2 local gloo processes,
trained with `torch.optim.AdamW`: once under FSDP2 (`fully_shard` on every layer and
on the root, torch's defaults: reshard after forward, prefetch), once under
`fivedc.parallelize(..., zero=3)` on a 2x1x1x1x1 mesh. The variants alternate round
by round in the same processes, so machine load hits both alike. Per variant: rank 0's
median step time over `--steps` steps after a warm-up step, the median over
`--rounds` rounds, and the collectives one step issues (the gloo process group's
operations as torch's profiler records them, whatever API issued them). Printed as
fivedc / FSDP2 ratios.

    python benchmarks/zero3_fsdp2.py [--steps 5] [--rounds 5]
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections import Counter

import torch
import torch.distributed as dist

from parallelize_zero import build  # the same Llama as benchmarks/parallelize_zero.py

WORLD = 2


def fsdp2(module):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (WORLD,))
    for layer in module.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(module, mesh=mesh)
    return module


def variant(name: str):
    import fivedc

    torch.manual_seed(0)
    module, inputs = build()
    model = fsdp2(module) if name == "fsdp2" else fivedc.parallelize(module, mesh=f"{WORLD}x1x1x1x1",
                                                                     example_inputs=inputs, zero=3)
    return model, inputs, torch.optim.AdamW(model.parameters(), lr=1e-4)


def collectives_of(fn) -> Counter:
    """The collectives `fn()` issues, by kind, as the profiler sees the gloo process group
    run them (both variants' own calls, whatever API they go through)."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        fn()
    return Counter(e.name.split(":", 1)[1] for e in prof.events() if e.name.startswith("gloo:"))


def step(model, inputs, opt) -> None:
    loss = model(*inputs)
    loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)


def bench_job(info, payload) -> dict | None:
    steps, rounds = payload
    built = {name: variant(name) for name in ("fsdp2", "fivedc")}
    times: dict[str, list[float]] = {name: [] for name in built}
    calls: dict[str, Counter] = {}
    for name, (model, inputs, opt) in built.items():  # warm up; count one step's collectives
        step(model, inputs, opt)
        calls[name] = collectives_of(lambda: step(model, inputs, opt))
    for _ in range(rounds):
        for name, (model, inputs, opt) in built.items():
            per = []
            for _ in range(steps):
                dist.barrier()
                start = time.perf_counter()
                step(model, inputs, opt)
                per.append(time.perf_counter() - start)
            times[name].append(statistics.median(per))
    if info.rank != 0:
        return None
    return {name: (statistics.median(t), dict(calls[name])) for name, t in times.items()}


def main() -> None:
    from fivedc.runtime.pool import WorkerPool

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    with WorkerPool(WORLD) as pool:
        result = pool.run(bench_job, world=WORLD, payload=(args.steps, args.rounds))[0]
    (t_fsdp, c_fsdp), (t_ours, c_ours) = result["fsdp2"], result["fivedc"]
    n_fsdp, n_ours = sum(c_fsdp.values()), sum(c_ours.values())
    print(f"{'':8s} {'step (ms)':>10s} {'collectives/step':>17s}  by kind")
    print(f"{'FSDP2':8s} {t_fsdp * 1e3:10.1f} {n_fsdp:17d}  {c_fsdp}")
    print(f"{'fivedc':8s} {t_ours * 1e3:10.1f} {n_ours:17d}  {c_ours}")
    print(f"fivedc / FSDP2: step time {t_ours / t_fsdp:.2f}x, collectives {n_ours / n_fsdp:.2f}x")


if __name__ == "__main__":
    main()
