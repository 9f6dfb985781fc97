"""Compile time of Llama 3 405B at 1, 16 and 16384 ranks, measured side by side.

Runs the compiles alternately (parse + passes + plan building + the proof that every
group's ranks agree, and writing the plan JSON), `--repeats` times each, and reports
the medians and their ratios. The issue's bar: each under 2 s on a 2-core machine;
flat in the world size: 16384 ranks within 1.2x of 16 ranks of the same layout (tp8:
the same collectives). The 1-rank plan has no collectives, so nothing to prove: its
ratio shows what the collectives and their proof cost.

    python benchmarks/compile_time.py [--repeats 101]
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

from fivedc.frontends.dsl_file import load_model
from fivedc.ir.mesh import Mesh
from fivedc.passes.base import CompileOptions
from fivedc.pipeline import compile_graph

MODEL = Path(__file__).resolve().parent.parent / "examples" / "llama3_405b.5d"
MESHES = ("1x1x1x1x1", "2x1x8x1x1", "2048x1x8x1x1")


def compile_once(mesh: str, out: Path) -> tuple[float, float]:
    """Seconds to compile (parse, passes, plan) and to compile and write the JSON."""
    start = time.perf_counter()
    plan = compile_graph(load_model(MODEL), CompileOptions(mesh=Mesh.parse(mesh), sequence_parallel=True))
    compiled = time.perf_counter()
    plan.save(out)
    return compiled - start, time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=101)
    args = parser.parse_args()
    times: dict[str, list[tuple[float, float]]] = {m: [] for m in MESHES}
    with tempfile.TemporaryDirectory() as tmp:
        compile_once(MESHES[0], Path(tmp) / "warm.json")  # first parse builds the lark parser
        for _ in range(args.repeats):
            for mesh in MESHES:
                times[mesh].append(compile_once(mesh, Path(tmp) / "plan.json"))
    for column, label in ((0, "compile"), (1, "compile + write plan")):
        medians = {m: statistics.median(t[column] for t in times[m]) for m in MESHES}
        for mesh in MESHES:
            world, worst = Mesh.parse(mesh).world, max(t[column] for t in times[mesh])
            print(f"{label:<21} --mesh {mesh:<13} world {world:>6}: median {medians[mesh] * 1000:6.2f} ms (max {worst * 1000:.1f} ms)")
        print(f"{label:<21} ratio 16384 ranks / 16 ranks: {medians[MESHES[2]] / medians[MESHES[1]]:.2f}, "
              f"16384 ranks / 1 rank: {medians[MESHES[2]] / medians[MESHES[0]]:.2f}")


if __name__ == "__main__":
    main()
