"""`fivedc rehearse`: one rank of each class runs the plan's real step at full scale, on nothing.

`fivedc rehearse PLAN.json` or `fivedc rehearse MODEL --mesh ... [compile flags]` runs
`runtime/rehearse.py` for every class of ranks of the plan's memory estimate and
prints, per class, the estimate against the rehearsed peak, by category, with the
largest storages live at the peak; `--report out.json` writes them. `--device meta`
(the default) allocates nothing: a rank of a 405B plan runs on a laptop. `--device cpu`
runs each rank on real tensors and also times its step by kind of work
(`runtime/calibrate.py`), against the seconds a profile estimates for them (the
plan's `--gpu`, or `--gpu NAME --hardware FILE`); `--calibrate OUT.toml` writes this
machine's profile from those times and its links, for `fivedc compile --hardware`.
`--device cuda` does the same on a GPU, one class after another, and holds the estimate to
the CUDA caching allocator's peak; its `--calibrate` keeps the GPU's data-sheet profile
(`--gpu`, else the one its name matches) with the efficiencies measured.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import os
from dataclasses import dataclass
from pathlib import Path

from fivedc.errors import FivedcError

TOLERANCE = 0.05  # the estimate is held to the rehearsed peak within this
MANY_CLASSES = 4  # from this many classes on, one process per core rehearses them


def rehearse_args(p) -> None:
    p.add_argument("--device", choices=("meta", "cpu", "cuda"), default="meta",
                   help="meta (default): shapes and storages without memory, any plan on any machine; "
                   "cpu, cuda: real tensors, and each rank's step timed by kind of work")
    p.add_argument("--calibrate", default=None, metavar="OUT.toml",
                   help="with --device cpu or cuda: write this machine's hardware profile, measured (a plan "
                   "with pp=1)")
    p.add_argument("--gpu", default=None, metavar="NAME",
                   help="with --device cpu or cuda: the profile whose estimate the measured seconds are set "
                   "against (on cuda, the profile --calibrate measures the efficiencies of)")
    p.add_argument("--hardware", default=[], action="append", metavar="FILE",
                   help="a TOML file of profiles (as written by --calibrate) for --gpu")
    p.add_argument("--dtype", default=None, help="bf16 (default), fp32 or fp64, for a model compiled here")
    p.add_argument("--layers", type=int, default=None, metavar="N",
                   help="for a model compiled here: at most N layers in each repeat (a stage too large for the "
                   "device, at its per-layer shapes; the estimate is of the same smaller model)")
    p.add_argument("--source", default=None, metavar="MODEL",
                   help="for a plan: the model file it was compiled from (default: the file the plan names)")
    p.add_argument("--report", default=None, metavar="OUT.json",
                   help="write per class of ranks the estimate and the rehearsed peak, by category")


def run_rehearse(args, *, defaults) -> int:
    from fivedc.cli.shared import executed_plan, progress_printer
    from fivedc.runtime.rehearse import rehearse_plan
    from fivedc.runtime.train import DTYPES, check_trainable

    _check_device_flags(args)
    plan = executed_plan(args, defaults, verb="rehearsing", dtype=args.dtype or "bf16")
    check_trainable(plan.graph)
    if plan.dtype not in DTYPES:
        raise FivedcError(f"the plan trains in {plan.dtype}; the runtime trains in {', '.join(DTYPES)}",
                          hint="compile with --dtype bf16 (or fp32)")
    timing = _timing_setup(args, plan) if args.device != "meta" else None
    print(f"rehearsing {args.model} on mesh {plan.mesh} ({plan.mesh.world} ranks, {plan.dtype})")
    workers = 1 if args.device == "cuda" else _workers(len(plan.memory.ranks))  # one GPU: one class at a time
    print(f"one rank of each of {len(plan.memory.ranks)} classes of ranks, one step on the {args.device} device"
          + (f", {workers} at a time" if workers > 1 else ""))
    rehearsal = rehearse_plan(plan, device=args.device, workers=workers, on_progress=progress_printer())
    for line in render_rehearsal(rehearsal):
        print(line)
    seconds = _timed_classes(plan, rehearsal, timing) if timing is not None else {}
    if args.calibrate is not None:
        _write_profile(args, plan, timing, seconds[rehearsal.classes[0].ranks])
    if args.report is not None:
        from fivedc.files import write_output

        report = rehearsal.to_json()
        for entry in report["classes"]:
            if entry["ranks"] in seconds:
                entry["seconds"] = dataclasses.asdict(seconds[entry["ranks"]])
        write_output(args.report, json.dumps(report, indent=1) + "\n", inputs=(args.model.split(":")[0],),
                     what="report")
        print(f"wrote {args.report}")
    return 0


def _workers(classes: int) -> int:
    """Processes rehearsing at once: one per core for a plan of many classes (a full-scale
    pipeline: minutes each); a few classes run in this process (starting one costs seconds)."""
    return min(os.cpu_count() or 1, classes) if classes >= MANY_CLASSES else 1


def _check_device_flags(args) -> None:
    if args.device == "cuda":
        import torch

        if not torch.cuda.is_available():
            raise FivedcError("--device cuda: this machine has no GPU that torch can use",
                              hint="use --device cpu, or --device meta for memory alone")
    if args.device == "meta":
        for flag, value in (("--calibrate", args.calibrate), ("--gpu", args.gpu), ("--hardware", args.hardware)):
            if value:
                raise FivedcError(f"{flag} times the step on this machine; the {args.device} device runs nothing",
                                  hint="add --device cpu (or cuda on a GPU)")
    if args.calibrate is not None:
        from fivedc.files import check_output

        if not args.calibrate.endswith(".toml"):
            raise FivedcError(f"--calibrate {args.calibrate}: a profile is a .toml file",
                              hint="e.g. --calibrate cpu.toml")
        check_output(args.calibrate, inputs=(args.model.split(":")[0], *args.hardware), what="profile")


@dataclass(frozen=True)
class Timing:
    """What --device cpu sets the measured seconds against: the model's counts of the step's
    work (a plan without a pipeline) and a profile's rates; for --calibrate, the plan at
    a quarter of the batch too (the same ops on a quarter of the data)."""

    work: object | None  # StepWork
    hardware: object | None  # Hardware
    small: object | None = None  # ExecutionPlan: the plan at a quarter of its batch
    beside: int = 0  # processes stepping beside the timed rank, as fivedc run's other ranks would
    device: str = "cpu"  # where the step is timed: cpu or cuda
    matmuls: float | None = None  # the model's matmul seconds on `hardware` (each GEMM by its shape)
    attention: float | None = None  # and its attention seconds (each op at its kernel's share)


def _timing_setup(args, plan) -> Timing:
    """Everything that can refuse the command, before anything runs."""
    from fivedc.ir.hardware import hardware
    from fivedc.plan.work_counts import attention_seconds, matmul_seconds, step_work

    work = step_work(plan) if args.calibrate is not None or plan.pipeline is None else None
    gpu = hardware(args.gpu, tuple(args.hardware)) if args.gpu else (plan.time.hardware if plan.time else None)
    if args.device == "cuda" and args.gpu is None:
        gpu = hardware(_profile_of_this_gpu())
    small = _quarter_batch(args, plan) if args.calibrate is not None else None
    priced = work is not None and gpu is not None
    return Timing(work, gpu, small, _beside(args, plan), args.device, matmul_seconds(plan, gpu) if priced else None,
                  attention_seconds(plan, gpu) if priced else None)


def _profile_of_this_gpu() -> str:
    """The built-in profile whose GPU this one is, by the name CUDA gives it."""
    import torch

    from fivedc.ir.hardware import profiles

    name = torch.cuda.get_device_name()
    for key in profiles():
        if key.replace("-", "").upper() in name.replace(" ", "").upper():
            return key
    raise FivedcError(f"--device cuda: no built-in profile is this GPU ({name})",
                      hint="name the nearest with --gpu NAME (fivedc/ir/hardware.toml lists them)")


def _beside(args, plan) -> int:
    """How many processes step beside the timed one: one per other core `fivedc run`'s ranks
    would keep busy (for a profile, every core: it is for runs with a rank per core); on a
    GPU none (one rank per GPU)."""
    if args.device == "cuda":
        return 0
    cores = os.cpu_count() or 1
    return (cores if args.calibrate is not None else min(plan.mesh.world, cores)) - 1


def _quarter_batch(args, plan):
    from fivedc.cli.shared import compile_model

    batch = plan.graph.dim(plan.graph.batch_dim) if plan.graph.batch_dim else 0
    if args.model.endswith(".json"):
        raise FivedcError("--calibrate compiles the model again at a quarter of its batch: give the model, not a plan",
                          hint="e.g. fivedc rehearse model.5d --mesh 1x1x1x1x1 --device cpu --calibrate cpu.toml")
    if batch < 4 or batch % (4 * plan.mesh.size("dp")):
        raise FivedcError(f"--calibrate times the step at the batch ({batch}) and at a quarter of it, which must "
                          f"split over dp={plan.mesh.size('dp')}", hint="a model whose batch is a multiple of 4 x dp")
    args = argparse.Namespace(**{**vars(args), "global_batch": batch // 4})
    return compile_model(args.model, args.mesh, args, dtype=plan.dtype)


def _timed_classes(plan, rehearsal, timing: Timing) -> dict:
    from fivedc.runtime.calibrate import time_rank

    seconds = {}
    for c in rehearsal.classes:
        seconds[c.ranks] = time_rank(plan, c.rank, beside=timing.beside, device=timing.device)
        for line in render_seconds(c.ranks, c.rank, seconds[c.ranks], timing):
            print(line)
    return seconds


def render_seconds(ranks: str, rank: int, measured, timing: Timing) -> list[str]:
    """One rank's step by kind of work: measured, and estimated where a profile and the counts are."""
    estimated = _estimated_seconds(timing.work, timing.hardware, timing.matmuls, timing.attention) \
        if timing.work and timing.hardware else None
    head = f"  {'kind':<12} {'measured s':>11}"
    if estimated:
        head += f" {'estimated s':>12} {'est / measured':>15}   ({timing.hardware.key})"
    beside = f", {timing.beside} cop{'y' if timing.beside == 1 else 'ies'} of it beside" if timing.beside else ""
    lines = ["", f"ranks {ranks} (rank {rank}): one step's seconds by kind of work, fake collectives{beside}", head]
    rows = {"matmuls": measured.matmul, "attention": measured.attention, "other ops": measured.other,
            "optimizer": measured.optimizer}
    rows["total"] = sum(rows.values())
    for kind, value in rows.items():
        line = f"  {kind:<12} {value:>11.4f}"
        if estimated:
            guess = estimated[kind]
            line += f" {guess:>12.4f} {guess / value if value else float('inf'):>15.2f}"
        lines.append(line)
    return lines


def _estimated_seconds(work, hw, matmuls: float | None, attention: float | None = None) -> dict[str, float]:
    """The model's seconds by kind: the matmuls as the model prices their shapes where known,
    else at the flat rate; attention at each op's kernel's share where known, else at the
    attention efficiency; the rest from the counts and the profile's rates."""
    flat = work.matmul_flops / (hw.bf16_flops * hw.matmul_efficiency)
    out = {"matmuls": flat if matmuls is None else matmuls,
           "attention": work.attention_flops / (hw.bf16_flops * hw.attention_efficiency) if attention is None
           else attention,
           "other ops": work.op_bytes / hw.op_bytes_per_s + work.op_issues * hw.op_latency_s,
           "optimizer": work.optimizer_bytes / (hw.hbm_bytes_per_s * hw.memory_efficiency)}
    out["total"] = sum(out.values())
    return out


def _write_profile(args, plan, timing: Timing, measured) -> None:
    from fivedc.files import write_output
    from fivedc.ir.hardware import hardware
    from fivedc.runtime.calibrate import time_rank
    from fivedc.runtime.calibrate_links import time_links
    from fivedc.runtime.calibrate_profile import profile_of, profile_text

    gpu = timing.device == "cuda"
    small = time_rank(timing.small, 0, beside=timing.beside, device=timing.device)
    links = None if gpu else time_links()
    key = "".join(ch if ch.isalnum() else "_" for ch in Path(args.calibrate).stem.lower()) or timing.device
    source = f"{datetime.date.today()} fivedc rehearse {args.model} --mesh {plan.mesh} --device {timing.device}"
    hw = profile_of(key, (plan, timing.small), (measured, small), links, cores=os.cpu_count() or 1, source=source,
                    base=timing.hardware if gpu else None)
    text = profile_text(hw, (measured, small), links, source)
    write_output(args.calibrate, text, inputs=(args.model.split(":")[0],), what="profile")
    hardware(key, (args.calibrate,))  # it reads back as a profile
    if links:
        print(f"\nwrote {args.calibrate}: links {links.bytes_per_s / 1e9:.2f} GB/s, {links.latency_s * 1e6:.0f} us, "
              f"overlap share {links.overlap_share:.2f}")
    else:
        print(f"\nwrote {args.calibrate}:\n  matmuls {hw.matmul_efficiency:.2f}, attention {hw.attention_efficiency:.2f} "
              f"of the peak; other ops {hw.op_bytes_per_s / 1e12:.2f} TB/s, {hw.op_latency_s * 1e6:.1f} us per op")
    print(f"use it: fivedc compile MODEL --mesh ... --hardware {args.calibrate} --gpu {key}")


def render_rehearsal(rehearsal) -> list[str]:
    """Per class: each category estimated and at the rehearsed peak, the totals and their
    ratio, and the largest storages live at the peak; within 100 columns."""
    from fivedc.plan.summary import format_bytes
    from fivedc.runtime.live_bytes import CATEGORIES

    lines = []
    for c in rehearsal.classes:
        verdict = "within" if abs(c.ratio - 1) <= TOLERANCE else "OUTSIDE"
        what = "CUDA allocator's peak" if c.allocator else "rehearsed peak"
        lines += ["", f"ranks {c.ranks} (rank {c.rank}): estimate {format_bytes(c.estimated.total)}, "
                  f"{what} {format_bytes(c.measured)}: {c.ratio:.3f}x, {verdict} {TOLERANCE:.0%}"]
        if c.allocator:
            lines.append(f"  live storages' peak {format_bytes(c.peak)}, allocator reserved "
                         f"{format_bytes(c.allocator.reserved)}")
        lines.append(f"  {'':<12} {'estimated':>10} {'at the peak':>12}")
        lines += [f"  {k:<12} {format_bytes(getattr(c.estimated, k)):>10} {format_bytes(c.at_peak[k]):>12}"
                  for k in CATEGORIES]
        lines.append("  largest live at the peak:")
        lines += [f"    {format_bytes(s.nbytes):>10}  {s.category:<11} {s.dtype:<8} "
                  f"{'x'.join(map(str, s.shape)) or 'scalar':<22} {s.made_by}"[:100].rstrip() for s in c.largest[:5]]
    return lines
