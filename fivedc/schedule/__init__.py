"""Pipeline-parallel schedules as plain data: generators, a checker and simulator, a picture.

    schedule_kind(name) -> ScheduleKind                (kinds.py: what a schedule is, by property)
    make_schedule(name, p, m, v=None) -> Schedule      (generators.py)
    check_schedule(schedule)                           (check.py)
    simulate(schedule, costs=None) -> SimResult        (simulator.py: the P2P semantics)
    draw_schedule(schedule, path, costs=None)          (picture.py, needs matplotlib)

Layer 2: may import `fivedc.ir` only.
"""

from fivedc.schedule.actions import Action, ActionKind, Schedule, ScheduleError
from fivedc.schedule.check import check_schedule
from fivedc.schedule.generators import make_schedule, min_microbatches
from fivedc.schedule.kinds import (DEFAULT_SCHEDULE, DEFAULT_VIRTUAL, SCHEDULES, Placement, ScheduleKind,
                                   schedule_kind, schedules_help)
from fivedc.schedule.picture import draw_schedule
from fivedc.schedule.simulator import DEFAULT_COSTS, DeadlockError, SimResult, peak_live_weighted, simulate

__all__ = ["DEFAULT_COSTS", "DEFAULT_SCHEDULE", "DEFAULT_VIRTUAL", "SCHEDULES", "Action", "ActionKind", "DeadlockError", "Placement",
           "Schedule", "ScheduleError", "ScheduleKind", "SimResult", "check_schedule", "draw_schedule", "make_schedule",
           "min_microbatches", "peak_live_weighted", "schedule_kind", "schedules_help", "simulate"]
