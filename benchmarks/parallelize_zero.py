"""ZeRO under `fivedc.parallelize`: what a rank holds, and the step time, per stage.

Llama (`examples/llama.py`, 4 layers, hidden 256) parallelized over dp=4 with
zero=0..3 and trained with `torch.optim.AdamW` over `model.parameters()`, the
plain loop. For each stage, on rank 0 after a step: the bytes of the parameters
the rank holds, of their `.grad`, and of the optimizer's state (AdamW's two
moments), as a ratio to ZeRO-0's. The parameters held are the registered ones
plus the gathered copies still alive: under ZeRO-1/2 (`FlatChunks`) the full
local tensors the last forward gathered stay referenced (`sync.params`) until the
next forward replaces them, so between steps a rank holds its chunk and the whole
parameter (1 + 1/n of ZeRO-0's); ZeRO-3 (`GatheredOnUse`) frees what it gathers.
A further column counts what earlier forwards gathered and is still alive, waiting
for Python's cycle collector (each forward's `GradSync` is held by hooks on its
gathered tensors; when it held them strongly too, every forward's copies stayed:
5.0 here, before `FlatChunks` gave it weak references; now 0).
Beside them, the bytes the ZeRO paper's formula gives for the parameter, gradient
and optimizer state a rank keeps (Psi = the parameter count; stage 1 shards the
optimizer state, 2 also the gradients, 3 also the parameters), to compare. The
stages run side by side in one pool of 4 processes, alternating, so machine load
hits them alike; the step time is rank 0's median over `--steps` steps after one
warm-up step, then the median over `--rounds` rounds, also as a ratio to ZeRO-0.

    python benchmarks/parallelize_zero.py [--steps 5] [--rounds 5]
"""

from __future__ import annotations

import argparse
import gc
import statistics
import time
from pathlib import Path

import torch

from fivedc.frontends.python_file import import_file

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"
WORLD = 4


def build():
    m = import_file(EXAMPLES / "llama.py")
    args = m.ModelArgs(dim=256, n_layers=4, n_heads=8, n_kv_heads=4, vocab_size=2048, ffn_dim=688, max_seq_len=128)
    return m.factory(batch=8, args=args, dtype=torch.float32)


def stage_job(info, payload) -> dict | None:
    import fivedc
    from fivedc.parallel.grads import GradSync
    from fivedc.parallel.weights import FlatChunks

    stage, steps = payload
    torch.manual_seed(0)
    module, inputs = build()
    model = fivedc.parallelize(module, mesh=f"{WORLD}x1x1x1x1", example_inputs=inputs, zero=stage, device=info.device)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    times = []
    for _ in range(steps + 1):
        start = time.perf_counter()
        opt.zero_grad(set_to_none=True)
        model(*inputs).backward()
        opt.step()
        times.append(time.perf_counter() - start)
    size = lambda t: t.numel() * t.element_size()  # noqa: E731
    weights = model._fivedc_weights
    gathered = list(weights.gathered.values()) if isinstance(weights, FlatChunks) else []
    held_params = list(model.parameters()) + gathered  # registered, and the last forward's gathered copies
    mine = {id(p) for p in model.parameters()}
    earlier = [o for o in gc.get_objects() if isinstance(o, GradSync) and o is not getattr(weights, "sync", None)
               and o.owners and all(id(p) in mine for p in o.owners.values())]  # unreachable, not yet collected
    alive = [getattr(o.params, "alive", o.params.values)() for o in earlier]
    held = {
        "params": sum(size(p) for p in held_params),
        "uncollected": sum(size(t) for tensors in alive for t in tensors),
        "grads": sum(size(p.grad) for p in held_params if p.grad is not None),
        "optimizer": sum(size(v) for s in opt.state.values() for k, v in s.items() if k != "step"),
        "step_s": statistics.median(times[1:]),
        "psi": sum(p.numel() for p in module.parameters()),
    }
    return held if info.rank == 0 else None


def formula(stage: int, psi: int) -> dict[str, float]:
    """Bytes per rank in fp32 (4 bytes) with AdamW's 2 moments, ZeRO paper's sharding."""
    n = WORLD
    return {"params": 4 * psi / (n if stage >= 3 else 1), "grads": 4 * psi / (n if stage >= 2 else 1),
            "optimizer": 8 * psi / (n if stage >= 1 else 1)}


def main() -> None:
    from fivedc.runtime.pool import WorkerPool

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--rounds", type=int, default=5, help="alternating rounds over the stages")
    args = parser.parse_args()
    results: dict[int, list[dict]] = {s: [] for s in range(4)}
    with WorkerPool(WORLD) as pool:
        for _ in range(args.rounds):
            for stage in range(4):
                results[stage].append(pool.run(stage_job, world=WORLD, payload=(stage, args.steps))[0])
    base = results[0][0]
    base_time = statistics.median(r["step_s"] for r in results[0])
    print(f"Llama 4 layers, hidden 256, {base['psi']:,} parameters, dp={WORLD}, fp32, torch.optim.AdamW")
    print("| stage | params (registered + gathered copies held) | earlier forwards' copies not yet collected "
          "| grads | optimizer | paper's formula (params, grads, optimizer) | ms/step | step time vs ZeRO-0 |")
    print("|---|---|---|---|---|---|---|---|")
    for stage in range(4):
        got = results[stage][0]
        want = formula(stage, got["psi"])
        ratios = [got[k] / base[k] for k in ("params", "grads", "optimizer")]
        expect = [want[k] / formula(0, got["psi"])[k] for k in ("params", "grads", "optimizer")]
        seconds = statistics.median(r["step_s"] for r in results[stage])
        print(f"| ZeRO-{stage} | {ratios[0]:.4f} | {got['uncollected'] / base['params']:.4f} | {ratios[1]:.4f} "
              f"| {ratios[2]:.4f} | "
              f"{expect[0]:.4f}, {expect[1]:.4f}, {expect[2]:.4f} | {seconds * 1e3:.1f} | {seconds / base_time:.2f} |")


if __name__ == "__main__":
    main()
