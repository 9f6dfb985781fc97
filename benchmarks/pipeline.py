"""Pipeline schedules on gloo: measured step time of 1F1B versus GPipe (and the others),
side by side, for the same model, mesh and microbatches.

A GPT-style model of 8 layers on pp=4 (world 4), 8 microbatches, fp32. Each schedule
trains the same plan apart from the schedule; runs alternate schedule by schedule,
repeated, and the median step time of the slowest rank is reported with its ratio to
GPipe. The simulated bubbles and peak activations for p=16, m=64 are in
benchmarks/schedules.py.

    python benchmarks/pipeline.py [--repeats 3] [--steps 3]
"""

from __future__ import annotations

import argparse
import statistics

from fivedc.frontends.dsl_file import parse_model
from fivedc.ir.mesh import Mesh
from fivedc.passes.base import CompileOptions
from fivedc.pipeline import compile_graph
from fivedc.runtime.pool import WorkerPool

from zero import MODEL, train_job  # the same GPT-style model text and timing job

MESH, WORLD, MICROBATCHES = "1x4x1x1x1", 4, 8
SCHEDULES = ("gpipe", "1f1b", "interleaved", "zb-h1", "dualpipev")


def plan(schedule: str):
    text = MODEL.replace("repeat 4 as layers", "repeat 8 as layers")
    graph = parse_model(text, filename="bench_gpt.5d")
    return compile_graph(graph, CompileOptions(mesh=Mesh.parse(MESH), dtype="fp32", schedule=schedule,
                                               microbatches=MICROBATCHES))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--steps", type=int, default=3)
    args = parser.parse_args()
    plans = {name: plan(name) for name in SCHEDULES}
    times: dict[str, list[float]] = {name: [] for name in SCHEDULES}
    with WorkerPool(WORLD) as pool:
        for _ in range(args.repeats):
            for name in SCHEDULES:
                results = pool.run(train_job, world=WORLD, payload=(plans[name], args.steps))
                times[name].append(max(r["seconds"] for r in results))
    base = statistics.median(times["gpipe"])
    print(f"pp=4, {MICROBATCHES} microbatches, 8 layers hidden 256, fp32, gloo; median of {args.repeats} x {args.steps} steps\n")
    print("| schedule | ms/step | ratio to GPipe |")
    print("|---|---|---|")
    for name in SCHEDULES:
        t = statistics.median(times[name])
        print(f"| {name} | {t * 1e3:.1f} | {t / base:.3f} |")


if __name__ == "__main__":
    main()
