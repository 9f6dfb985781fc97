"""Run a plan: train a few steps on `world` processes and report loss, time and memory.

What `fivedc run` executes. Every rank builds its part of the plan's program,
its shards of seeded parameters (only its chunks' under a pipeline) and of a
seeded synthetic batch (`make_inputs`, the same every step), and trains with
everything the plan decides (`train_plan`: ZeRO, buckets, overlap, the schedule).
The report holds the loss of every step, each step's time on the slowest rank,
and the bytes each rank holds in parameters, gradients and optimizer state after
the last backward, to set against the plan's estimate. No single-device run and
no comparison: that is `fivedc verify`.
"""

from __future__ import annotations

from dataclasses import dataclass

from fivedc.plan import ExecutionPlan
from fivedc.runtime.train import TrainSettings
from fivedc.runtime.verify import setup_rank, train_plan


@dataclass(frozen=True)
class RunReport:
    world: int
    losses: tuple[float, ...]  # the full loss of every step
    seconds: tuple[float, ...]  # per step, the slowest rank's
    held: tuple[dict[str, int], ...]  # per rank: bytes in params, grads, optimizer state

    def most_held(self, kind: str) -> int:
        return max(h.get(kind, 0) for h in self.held)


def run_job(info, payload) -> dict:
    """One rank of a run (module-level, so a worker pool can pickle it)."""
    plan, settings = payload
    program, params, inputs, _ = setup_rank(plan, info, settings)
    record = train_plan(plan, program, params, inputs, settings, info)
    return {"losses": record.losses, "seconds": record.seconds, "held": record.held}


def merge_runs(results: list[dict]) -> RunReport:
    steps = len(results[0]["seconds"])
    return RunReport(
        world=len(results),
        losses=tuple(results[0]["losses"]),
        seconds=tuple(max(r["seconds"][k] for r in results) for k in range(steps)),
        held=tuple(r["held"] for r in results),
    )


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
