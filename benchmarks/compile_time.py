"""Compile time of Llama 3 405B at 1, 16 and 16384 ranks, measured side by side.

Runs the compiles alternately (parse + passes + plan building + the proof that every
group's ranks agree, and writing the plan JSON), `--repeats` times each, and reports
the medians and their ratios, in wall time and in this process's CPU time (which a
loaded machine disturbs less), with the date and the load average. The issue's bar
(issues 2 and 41): flat in the world size, 16384 ranks (`2048x1x8x1x1`) within 1.2x of 16
ranks of the same layout (`2x1x8x1x1`: tp8, the same collectives); the agreement proof
of the published 16384-rank layout with 16 pipeline stages (`128x16x8x1x1 --sp`) under
0.2 s. The 1-rank plan has no collectives, so nothing to prove: its ratio shows what the
collectives and their proof cost.

`--cli N` also times the command itself, `fivedc compile examples/llama3_405b.5d --mesh M
--sp -o PLAN` (a new process each: start-up, imports, parse, passes, proof, summary,
plan written), N times for each of the two meshes of the bar, alternately.

    python benchmarks/compile_time.py [--repeats 21] [--cli 11]
"""

from __future__ import annotations

import argparse
import datetime
import os
import platform
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from fivedc.frontends.dsl_file import load_model
from fivedc.ir.mesh import Mesh
from fivedc.passes.base import CompileOptions
from fivedc.pipeline import compile_graph

MODEL = Path(__file__).resolve().parent.parent / "examples" / "llama3_405b.5d"
MESHES = ("1x1x1x1x1", "2x1x8x1x1", "2048x1x8x1x1", "128x16x8x1x1")
FLAT = ("2x1x8x1x1", "2048x1x8x1x1")  # 16 and 16384 ranks of one layout


def compile_once(mesh: str, out: Path) -> dict[str, float]:
    """Wall and CPU seconds to compile (parse, passes, plan), to compile and write the
    JSON, and the proof's own seconds (its pass, as `fivedc compile --passes` prints it)."""
    wall, cpu = time.perf_counter(), time.process_time()
    proofs: list = []
    plan = compile_graph(load_model(MODEL), CompileOptions(mesh=Mesh.parse(mesh), sequence_parallel=True),
                         proofs=proofs)
    compiled = time.perf_counter() - wall, time.process_time() - cpu
    plan.save(out)
    return {"compile": compiled[0], "compile cpu": compiled[1], "write": time.perf_counter() - wall,
            "write cpu": time.process_time() - cpu, "proof": proofs[0].seconds}


def command_once(mesh: str, out: Path) -> tuple[float, float]:
    """Wall and CPU seconds (user + system) of `fivedc compile` in a process of its own."""
    before, start = resource.getrusage(resource.RUSAGE_CHILDREN), time.perf_counter()
    subprocess.run([sys.executable, "-m", "fivedc.cli.main", "compile", str(MODEL), "--mesh", mesh, "--sp",
                    "-o", str(out)], check=True, stdout=subprocess.DEVNULL)
    wall, after = time.perf_counter() - start, resource.getrusage(resource.RUSAGE_CHILDREN)
    return wall, after.ru_utime + after.ru_stime - before.ru_utime - before.ru_stime


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=21)
    parser.add_argument("--cli", type=int, default=0, metavar="N", help="also time the command, N times per mesh")
    args = parser.parse_args()
    times: dict[str, list[dict[str, float]]] = {m: [] for m in MESHES}
    load_before = os.getloadavg()[0]
    with tempfile.TemporaryDirectory() as tmp:
        compile_once(MESHES[0], Path(tmp) / "warm.json")  # first parse builds the lark parser
        for _ in range(args.repeats):
            for mesh in MESHES:
                times[mesh].append(compile_once(mesh, Path(tmp) / "plan.json"))
    median = {m: {k: statistics.median(t[k] for t in times[m]) for k in times[m][0]} for m in MESHES}
    print(f"{datetime.date.today()}, {platform.python_implementation()} {platform.python_version()}, "
          f"{os.cpu_count()} cores, load average {load_before:.1f} before and {os.getloadavg()[0]:.1f} after, "
          f"{args.repeats} alternating repeats, medians (ms)")
    print("| mesh | ranks | compile | compile CPU | compile + write | compile + write CPU | proof |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    for mesh in MESHES:
        t = median[mesh]
        print(f"| `{mesh}` | {Mesh.parse(mesh).world} | {t['compile'] * 1e3:.1f} | {t['compile cpu'] * 1e3:.1f} | "
              f"{t['write'] * 1e3:.1f} | {t['write cpu'] * 1e3:.1f} | {t['proof'] * 1e3:.1f} |")
    small, large = median[FLAT[0]], median[FLAT[1]]
    print("16384 ranks / 16 ranks: " + ", ".join(f"{k} {large[k] / small[k]:.2f}" for k in small))
    worst = max(t["proof"] for t in times["128x16x8x1x1"])
    print(f"proof of 128x16x8x1x1 --sp: median {median['128x16x8x1x1']['proof'] * 1e3:.1f} ms, "
          f"max {worst * 1e3:.1f} ms")
    if args.cli:
        command: dict[str, list[tuple[float, float]]] = {m: [] for m in FLAT}
        with tempfile.TemporaryDirectory() as tmp:
            for _ in range(args.cli):
                for mesh in FLAT:
                    command[mesh].append(command_once(mesh, Path(tmp) / "plan.json"))
        wall = {m: statistics.median(w for w, _ in t) for m, t in command.items()}
        cpu = {m: statistics.median(c for _, c in t) for m, t in command.items()}
        print(f"fivedc compile --sp (a process each, {args.cli} alternating runs, load average now "
              f"{os.getloadavg()[0]:.1f}), medians: " + ", ".join(
                  f"--mesh {m} {wall[m]:.2f} s wall, {cpu[m]:.2f} s CPU" for m in FLAT)
              + f"; ratio {wall[FLAT[1]] / wall[FLAT[0]]:.2f} wall, {cpu[FLAT[1]] / cpu[FLAT[0]]:.2f} CPU")


if __name__ == "__main__":
    main()
