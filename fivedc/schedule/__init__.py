"""Pipeline-parallel schedules as plain data: generators, a checker and simulator, a picture.

    make_schedule(name, p, m, v=None) -> Schedule      (generators.py)
    check_schedule(schedule)                           (check.py)
    simulate(schedule, costs=None) -> SimResult        (simulator.py: the P2P semantics)
    draw_schedule(schedule, path, costs=None)          (picture.py, needs matplotlib)

Layer 2: may import `fivedc.ir` only.
"""

from fivedc.schedule.actions import Action, ActionKind, Schedule, ScheduleError
from fivedc.schedule.check import check_schedule
from fivedc.schedule.generators import SCHEDULES, make_schedule, min_microbatches
from fivedc.schedule.picture import draw_schedule
from fivedc.schedule.simulator import DEFAULT_COSTS, DeadlockError, SimResult, peak_live_weighted, simulate

__all__ = ["DEFAULT_COSTS", "SCHEDULES", "Action", "ActionKind", "DeadlockError", "Schedule", "ScheduleError",
           "SimResult", "check_schedule", "draw_schedule", "make_schedule", "min_microbatches", "peak_live_weighted",
           "simulate"]
