"""The step-time model against `fivedc run` on this machine: predicted / measured per layout.

A `cpu` profile is measured first (`fivedc rehearse MODEL --mesh 1x1x1x1x1 --device cpu
--calibrate cpu.toml`: one rank's step timed by kind of work, with a copy stepping beside
it on the other core, and the gloo links between two local processes). Then each layout
below is compiled with that profile (`fivedc compile MODEL --mesh ... --hardware cpu.toml
--gpu cpu`) and run (`fivedc run`, gloo, one core per rank): the model's step against the
least measured step after the first two (other work on the machine only adds to a step,
and the calibration takes the least too). Every layout has two ranks, one per core of a
2-core machine; between them they cover every axis, four pipeline schedules, TP with and
without SP, the three ZeRO stages, full recomputation and no overlap. The calibration
times one rank with its collectives faked; everything the layouts add (the split of
work, the collectives, bubbles, overlap) is the model's structure.

    python benchmarks/cpu_step_time.py [--quick] [--write]   # --write: the table in RESULTS.md
"""

from __future__ import annotations

import argparse
import datetime
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from results_block import replace_block  # beside this script

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "RESULTS.md"
BEGIN, END = "<!-- cpu-step:begin -->", "<!-- cpu-step:end -->"
MODEL = "benchmarks/cpu_step.5d"
LAYOUTS = (
    "--mesh 2x1x1x1x1",
    "--mesh 2x1x1x1x1 --no-overlap",
    "--mesh 2x1x1x1x1 --zero 1",
    "--mesh 2x1x1x1x1 --zero 3",
    "--mesh 1x1x2x1x1",
    "--mesh 1x1x2x1x1 --sp",
    "--mesh 1x1x2x1x1 --recompute full",
    "--mesh 1x2x1x1x1 --schedule gpipe --microbatches 4",
    "--mesh 1x2x1x1x1 --schedule 1f1b --microbatches 4",
    "--mesh 1x2x1x1x1 --schedule interleaved --microbatches 4",
    "--mesh 1x2x1x1x1 --schedule zb-h1 --microbatches 4",
    "--mesh 1x1x1x2x1",
    "--mesh 1x1x1x1x2",
)
QUICK = ("--mesh 2x1x1x1x1", "--mesh 1x1x2x1x1", "--mesh 1x2x1x1x1 --schedule 1f1b --microbatches 4")
STEPS = 6  # the first two are warm-up


def calibrate(model: str, profile: Path) -> None:
    command = [sys.executable, "-m", "fivedc", "rehearse", model, "--mesh", "1x1x1x1x1", "--dtype", "fp32",
               "--device", "cpu", "--calibrate", str(profile)]
    subprocess.run(command, check=True, cwd=ROOT, stdout=subprocess.DEVNULL)


def compiled(model: str, layout: str, profile: Path):
    from fivedc.cli.main import build_parser
    from fivedc.cli.shared import compile_model

    args = build_parser().parse_args(["compile", model, *layout.split(), "--dtype", "fp32", "--gpu", "cpu",
                                      "--hardware", str(profile)])
    return compile_model(args.model, args.mesh, args, dtype="fp32")


def measured_step(plan) -> float:
    """`fivedc run`'s least step after the first two: other work on the machine only adds to a step."""
    from fivedc.runtime.run import run_plan
    from fivedc.runtime.train import TrainSettings

    return min(run_plan(plan, TrainSettings(steps=STEPS, dtype="fp32", keep_grads=False)).seconds[2:])


def own_work(plan) -> tuple[float, float]:
    """Rank 0's own work per step (compute, the copies around the sums, the optimizer; no
    collective, no idle time): the model's, and measured with the collectives faked
    (`fivedc rehearse --device cpu`'s timing)."""
    from fivedc.plan.work_counts import own_work_seconds
    from fivedc.runtime.calibrate import time_rank

    predicted = own_work_seconds(plan, plan.time.hardware)
    seconds = time_rank(plan, 0, beside=1)
    return predicted, seconds.forward_backward + seconds.optimizer


def table(model: str, layouts: tuple[str, ...], profile: Path) -> tuple[list[str], list[float]]:
    lines = ["| layout (`" + model + " ... --dtype fp32`) | predicted s | measured s | "
             "predicted / measured | rank 0's own work: predicted / measured |", "|---|---:|---:|---:|---:|"]
    ratios = []
    for layout in layouts:
        plan = compiled(model, layout, profile)
        predicted, measured = plan.time.step_seconds, measured_step(plan)
        own_predicted, own_measured = own_work(plan)
        ratios.append(predicted / measured)
        print(f"{layout}: predicted {predicted:.3f} s, measured {measured:.3f} s", file=sys.stderr)
        lines.append(f"| `{layout}` | {predicted:.3f} | {measured:.3f} | {ratios[-1]:.2f} | "
                     f"{own_predicted:.3f} / {own_measured:.3f} = {own_predicted / own_measured:.2f} |")
    return lines, ratios


def summary(ratios: list[float], profile_text: str) -> list[str]:
    load = os.getloadavg()[0]
    inside = sum(0.8 <= r <= 1.2 for r in ratios)
    return ["", f"- {len(ratios)} layouts: median predicted / measured {statistics.median(ratios):.2f}, "
            f"range {min(ratios):.2f}-{max(ratios):.2f}, {inside} within 20 %.",
            f"- Measured {datetime.date.today()} on {os.cpu_count()} cores, load {load:.1f} at the end; "
            "the profile it measured:", "", "```toml", profile_text.rstrip(), "```"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="three layouts instead of all")
    parser.add_argument("--write", action="store_true", help=f"replace the table in {RESULTS.name}")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as folder:
        profile = Path(folder) / "cpu.toml"
        start = time.perf_counter()
        calibrate(MODEL, profile)
        print(f"calibrated in {time.perf_counter() - start:.0f} s", file=sys.stderr)
        lines, ratios = table(MODEL, QUICK if args.quick else LAYOUTS, profile)
        text = "\n".join(lines + summary(ratios, profile.read_text()))
    print(text)
    if args.write:
        replace_block(RESULTS, BEGIN, END, text)


if __name__ == "__main__":
    main()
