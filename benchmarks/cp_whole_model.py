"""Context parallelism, the whole model: cp=2 on two processes against one process with both cores.

Llama (`examples/llama.py`, 4 layers, hidden 256, 8 heads, 4 K/V heads, sequence
`--seq`, batch 1, float32) trained with `torch.optim.AdamW`: once as the plain module
in one process with 2 threads (SDPA over the whole sequence; the other process waits
at a barrier), once as `fivedc.parallelize(..., mesh="1x1x1x2x1")` (ring attention,
load-balanced layout) on two processes with 1 thread each: the same cores either
way. The variants alternate round by round in the same two processes, so machine load
hits both alike; per variant rank 0's median step over `--steps` steps, then the
median over `--rounds` rounds. The issue's bar: cp=2 at most 1.1x the one process.

    python benchmarks/cp_whole_model.py [--seq 2048] [--steps 3] [--rounds 5]
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import torch
import torch.distributed as dist

from fivedc.frontends.python_file import import_file

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"
WORLD = 2


def build(seq: int):
    m = import_file(EXAMPLES / "llama.py")
    args = m.ModelArgs(dim=256, n_layers=4, n_heads=8, n_kv_heads=4, vocab_size=2048, ffn_dim=688, max_seq_len=seq)
    return m.factory(batch=1, args=args, dtype=torch.float32)


def step(model, inputs, opt) -> None:
    model(*inputs).backward()
    opt.step()
    opt.zero_grad(set_to_none=True)


def timed(model, inputs, opt, steps: int, threads: int, active: bool) -> float | None:
    """Median step of `steps` on this rank (None where it only waits)."""
    per = []
    for _ in range(steps):
        dist.barrier()
        if active:
            torch.set_num_threads(threads)
            start = time.perf_counter()
            step(model, inputs, opt)
            per.append(time.perf_counter() - start)
        dist.barrier()
    return statistics.median(per) if per else None


def bench_job(info, payload) -> dict | None:
    import fivedc

    seq, steps, rounds = payload
    torch.manual_seed(0)
    plain, inputs = build(seq)
    module, _ = build(seq)
    module.load_state_dict(plain.state_dict())
    cp = fivedc.parallelize(module, mesh="1x1x1x2x1", example_inputs=inputs)
    variants = {"one process, 2 threads": (plain, 2, info.rank == 0), "cp=2, 1 thread each": (cp, 1, True)}
    opts = {name: torch.optim.AdamW(model.parameters(), lr=1e-4) for name, (model, _, _) in variants.items()}
    times: dict[str, list[float]] = {name: [] for name in variants}
    for name, (model, threads, active) in variants.items():  # warm-up
        timed(model, inputs, opts[name], 1, threads, active)
    for _ in range(rounds):
        for name, (model, threads, active) in variants.items():
            t = timed(model, inputs, opts[name], steps, threads, active)
            if t is not None:
                times[name].append(t)
    return {name: statistics.median(t) for name, t in times.items()} if info.rank == 0 else None


def main() -> None:
    from fivedc.runtime.pool import WorkerPool

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seq", type=int, default=2048)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    with WorkerPool(WORLD) as pool:
        result = pool.run(bench_job, world=WORLD, payload=(args.seq, args.steps, args.rounds))[0]
    (one_name, one), (cp_name, cp) = result.items()
    print(f"{one_name:26s} {one * 1e3:9.1f} ms")
    print(f"{cp_name:26s} {cp * 1e3:9.1f} ms")
    print(f"cp=2 / one process: {cp / one:.2f}x step time (sequence {args.seq})")


if __name__ == "__main__":
    main()
