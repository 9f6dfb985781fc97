"""Run a plan: train a few steps on `world` processes and report loss, time and memory.

What `fivedc run` executes. Every rank builds its part of the plan's program,
its shards of seeded parameters (only its chunks' under a pipeline) and of a
seeded synthetic batch (`make_inputs`, the same every step), and trains with
everything the plan decides (`train_plan`: ZeRO, buckets, overlap, the schedule).
The report holds the loss of every step, each step's time on the slowest rank,
the bytes each rank holds in parameters, gradients and optimizer state after the
last backward, and (with `TrainSettings.measure`) the peak of what its last step
kept for backward; `memory_report` sets them against the plan's estimate per rank
(`fivedc run --report out.json`). No single-device run and
no comparison: that is `fivedc verify`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from fivedc.estimates.memory import CATEGORIES
from fivedc.ir.mesh import MeshAxis
from fivedc.plan.execution_plan import ExecutionPlan
from fivedc.runtime.train import TrainSettings
from fivedc.runtime.verify import setup_rank, train_plan


@dataclass(frozen=True)
class RunReport:
    world: int
    losses: tuple[float, ...]  # the full loss of every step
    seconds: tuple[float, ...]  # per step, the slowest rank's
    held: tuple[dict[str, int], ...]  # per rank: bytes in params, grads, optimizer state
    kept: tuple[int, ...] = ()  # per rank: the last step's peak of bytes kept for backward (measure=True)
    peak: tuple[int | None, ...] = ()  # per rank: the CUDA allocator's peak over the run (None on CPU)
    device: str = "cpu"

    def most_held(self, kind: str) -> int:
        if kind == "activations":
            return max(self.kept, default=0)
        return max(h.get(kind, 0) for h in self.held)


def run_job(info, payload) -> dict:
    """One rank of a run (module-level, so a worker pool can pickle it)."""
    plan, settings = payload
    cuda = info.device.startswith("cuda")
    if cuda:
        torch.cuda.reset_peak_memory_stats(info.device)
    program, params, inputs, _ = setup_rank(plan, info, settings)
    record = train_plan(plan, program, params, inputs, settings, info)
    return {"losses": record.losses, "seconds": record.seconds, "held": record.held,
            "kept": record.kept[-1] if record.kept else 0, "device": info.device,
            "peak": torch.cuda.max_memory_allocated(info.device) if cuda else None}


def merge_runs(results: list[dict]) -> RunReport:
    steps = len(results[0]["seconds"])
    return RunReport(
        world=len(results),
        losses=tuple(results[0]["losses"]),
        seconds=tuple(max(r["seconds"][k] for r in results) for k in range(steps)),
        held=tuple(r["held"] for r in results),
        kept=tuple(r.get("kept", 0) for r in results),
        peak=tuple(r.get("peak") for r in results),
        device=str(results[0].get("device", "cpu")).split(":")[0],
    )


def memory_report(plan: ExecutionPlan, report: RunReport) -> dict:
    """Per rank, the plan's estimate for its class of ranks and what the run measured:
    parameters, gradients and optimizer state held after the last backward, the bytes kept
    for backward at the step's peak (saved tensors, each storage once), and on CUDA the
    allocator's peak as the total (the transient: what it adds to the rest). Bytes as
    integers; null where this device cannot measure it."""
    pp = plan.mesh.size(MeshAxis.PP)
    ranks = []
    for rank in range(report.world):
        entry = plan.memory.of_pp_rank(plan.mesh.coords(rank)[MeshAxis.PP], pp)
        held, peak = report.held[rank], report.peak[rank] if report.peak else None
        measured = {k: int(held.get(k, 0)) for k in ("params", "grads", "optimizer")}
        measured["activations"] = int(report.kept[rank]) if report.kept else 0
        kept = sum(measured.values())
        measured["transient"] = None if peak is None else max(int(peak) - kept, 0)
        measured["total"] = None if peak is None else int(peak)
        ranks.append({"rank": rank, "class": entry.ranks,
                      "estimated": {k: int(getattr(entry, k)) for k in CATEGORIES}, "measured": measured})
    return {"mesh": str(plan.mesh), "device": report.device, "ranks": ranks}


def run_plan(plan: ExecutionPlan, settings: TrainSettings, *, pool=None, timeout_s: float | None = None,
             on_progress=None) -> RunReport:
    """Train `settings.steps` steps with `plan` on `plan.mesh.world` local processes (a
    temporary pool unless `pool`); `on_progress(line)` hears each step."""
    from fivedc.runtime.pool import DEFAULT_TIMEOUT_S, run_once

    payload = (plan, settings)
    world = plan.mesh.world
    if pool is not None:
        return merge_runs(pool.run(run_job, world=world, payload=payload, on_progress=on_progress))
    return merge_runs(run_once(run_job, world=world, payload=payload, timeout_s=timeout_s or DEFAULT_TIMEOUT_S,
                               on_progress=on_progress))
