"""Tensor parallelism with its collectives behind compute (overlap), against without.

Llama (`examples/llama.py`, 4 layers, float32) under `fivedc.parallelize(mesh="1x1x2x1x1")`
on 2 local gloo processes, trained with `torch.optim.AdamW`, with and without SP: once
with `overlap=True` (each column-parallel linear input's backward all-reduce, or under
SP reduce-scatter, starts async and the readers' weight gradients are computed while
it runs: `runtime/tp_overlap.py`; and the forward's collectives run beside their
linears, under SP each gather before a column-parallel linear and each reduce-scatter
after a row-parallel one in a ring (that one's gradient gathered back in a ring beside
the linear's dX), without SP each all-reduce after a row-parallel linear by chunks:
`runtime/tp_ring.py`), once with `overlap=False` (they block). The variants
alternate round by round in the same processes, so machine load hits them alike. Per variant: rank 0's median step time over
`--steps` steps after a warm-up step, then the median over `--rounds` rounds; and the
seconds one step spends waiting in tensor parallelism's collectives, forward and backward
(the `wait` of the async ones, each hop's in a ring, each chunk's in a chunked
all-reduce, the whole call of a blocking one; also the embedding's sum and its
gradient's, which nothing hides), which is what overlap can hide.

    python benchmarks/tp_overlap.py [--dim 512] [--steps 5] [--rounds 5]
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import torch

from fivedc.frontends.python_file import import_file

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"
WORLD = 2


def build(dim: int):
    m = import_file(EXAMPLES / "llama.py")
    args = m.ModelArgs(dim=dim, n_layers=4, n_heads=8, n_kv_heads=4, vocab_size=2048, ffn_dim=dim * 8 // 3 // 8 * 8,
                       max_seq_len=256)
    return m.factory(batch=8, args=args, dtype=torch.float32)


def timed_waits():
    """Patch the collectives to add the seconds a rank waits in them to lists by phase: the
    whole call of a blocking one; the `finish` of an async sum or gather (backward's sums
    of the linears' input gradients, SP's inputs gathered again for dW); the waits of a
    ring's hops (forward's gathers and reduce-scatters, backward's gathers of their
    gradients) and of a chunked all-reduce's chunks. The lists and an undo."""
    import torch.distributed as dist
    from fivedc.runtime import collectives, p2p, saved

    spent: dict[str, list[float]] = {"backward": [], "forward": []}
    real = {"start_sum": collectives.start_sum, "start_gather": saved.start_gather,
            "apply_steps": collectives.apply_steps, "saved_apply_steps": saved.apply_steps,
            "hop_wait": p2p.Transfer.wait, "all_reduce": dist.all_reduce}

    def timed(fn, phase: str = "backward"):
        def call(*args, **kwargs):
            begin = time.perf_counter()
            out = fn(*args, **kwargs)
            spent[phase].append(time.perf_counter() - begin)
            return out
        return call

    def forward() -> bool:
        return torch._C._current_autograd_node() is None

    def started(start):
        return lambda *args, **kwargs: timed(start(*args, **kwargs))

    def blocking(apply):
        def call(x, steps, groups):
            return timed(apply, "forward" if forward() else "backward")(x, steps, groups)
        return call

    class TimedWork:  # a chunked all-reduce's chunk: its wait
        def __init__(self, work) -> None:
            self.work = work

        def wait(self, *args):
            return timed(self.work.wait, "forward")(*args)

    def all_reduce(*args, async_op=False, **kwargs):
        work = real["all_reduce"](*args, async_op=async_op, **kwargs)
        return TimedWork(work) if async_op and forward() and work is not None else work

    collectives.start_sum, saved.start_gather = started(real["start_sum"]), started(real["start_gather"])
    collectives.apply_steps, saved.apply_steps = blocking(real["apply_steps"]), blocking(real["saved_apply_steps"])
    p2p.Transfer.wait = lambda self: timed(real["hop_wait"], "forward" if forward() else "backward")(self)
    dist.all_reduce = all_reduce

    def undo():
        collectives.start_sum, saved.start_gather = real["start_sum"], real["start_gather"]
        collectives.apply_steps, saved.apply_steps = real["apply_steps"], real["saved_apply_steps"]
        p2p.Transfer.wait, dist.all_reduce = real["hop_wait"], real["all_reduce"]
    return spent, undo


def variant_job(info, payload) -> dict | None:
    import fivedc

    dim, sp, overlap, steps = payload
    torch.manual_seed(0)
    module, inputs = build(dim)
    model = fivedc.parallelize(module, mesh=f"1x1x{WORLD}x1x1", example_inputs=inputs, sequence_parallel=sp,
                               overlap=overlap, device=info.device)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    times, waits, gathers = [], [], []
    spent, undo = timed_waits()
    try:
        for _ in range(steps + 1):
            spent["backward"].clear(), spent["forward"].clear()
            start = time.perf_counter()
            opt.zero_grad(set_to_none=True)
            model(*inputs).backward()
            opt.step()
            times.append(time.perf_counter() - start)
            waits.append(sum(spent["backward"]))
            gathers.append(sum(spent["forward"]))
    finally:
        undo()
    if info.rank != 0:
        return None
    return {"step_s": statistics.median(times[1:]), "wait_s": statistics.median(waits[1:]),
            "gather_s": statistics.median(gathers[1:])}


def main() -> None:
    from fivedc.runtime.pool import WorkerPool

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dim", type=int, default=512)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--rounds", type=int, default=5, help="alternating rounds over the variants")
    args = parser.parse_args()
    variants = [(sp, overlap) for sp in (False, True) for overlap in (False, True)]
    results: dict[tuple, list[dict]] = {v: [] for v in variants}
    with WorkerPool(WORLD) as pool:
        for _ in range(args.rounds):
            for sp, overlap in variants:
                payload = (args.dim, sp, overlap, args.steps)
                results[(sp, overlap)].append(pool.run(variant_job, world=WORLD, payload=payload)[0])
    print(f"Llama 4 layers, hidden {args.dim}, tp={WORLD}, fp32, AdamW; medians of {args.steps} steps x {args.rounds} rounds")
    print("| SP | overlap | step (ms) | waiting in backward's collectives (ms/step) "
          "| waiting in forward's collectives (ms/step) | step vs overlap off |")
    print("|---|---|---|---|---|---|")
    for sp in (False, True):
        base = statistics.median(r["step_s"] for r in results[(sp, False)])
        for overlap in (False, True):
            rows = results[(sp, overlap)]
            step = statistics.median(r["step_s"] for r in rows)
            wait = statistics.median(r["wait_s"] for r in rows)
            gather = statistics.median(r["gather_s"] for r in rows)
            print(f"| {'on' if sp else 'off'} | {'on' if overlap else 'off'} | {step * 1e3:.1f} | {wait * 1e3:.1f} "
                  f"| {gather * 1e3:.1f} | {step / base:.3f} |")


if __name__ == "__main__":
    main()
