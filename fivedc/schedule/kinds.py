"""What each pipeline schedule is, as properties: the one place that knows schedules by name.

Outside `fivedc/schedule/` code asks a schedule's properties, never its name:
`schedule_kind(name)` looks the name up once (the CLI, the plan JSON and messages keep
the name) and the answer says how many chunks a pp rank runs, where they sit, how many
model copies run at once, whether backward is split into I and W, and what the
schedule needs of p and m. `generators.py` builds each schedule; a test checks that
both list the same names, and that no module outside this folder compares a name.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum

from fivedc.schedule.actions import ScheduleError

DEFAULT_VIRTUAL = 2  # chunks per rank when a schedule that takes --virtual is given none


class Placement(StrEnum):
    LOOP = "loop"  # chunk c on pp rank c % p (one chunk per rank: chunk s on rank s)
    V = "v"  # pp rank r holds chunks r and 2p-1-r: the model folded into a V (DualPipeV, DualPipe)


@dataclass(frozen=True, slots=True)
class ScheduleKind:
    name: str
    chunks_per_rank: int | None  # the schedule's chunks on each pp rank; None: the caller's --virtual
    placement: Placement
    pipelines: int = 1  # model copies run at once, in opposite directions (DualPipe: 2)
    split_backward: bool = False  # B split into I (input gradients) and W (weight gradients)
    forwards_first: bool = False  # every forward before any backward: live activations grow with m
    microbatches_per_rank: int = 0  # it needs m >= this * p (and m >= 1)
    microbatches_multiple_of_p: bool = False  # m a multiple of p (Megatron's interleaving)
    min_p: int = 1  # the fewest pp ranks it runs on

    @property
    def takes_virtual(self) -> bool:
        """Whether the caller chooses the chunks per rank (`--virtual`)."""
        return self.chunks_per_rank is None

    @property
    def folded(self) -> bool:
        """One model copy folded into a V: each rank runs two of the model's chunks, r and 2p-1-r."""
        return self.placement is Placement.V and self.pipelines == 1

    @property
    def has_closed_form(self) -> bool:
        """Whether the published (m v + p - 1)(F + B) / v makespan holds (equal chunks, free transfers)."""
        return self.placement is Placement.LOOP and not self.split_backward and self.pipelines == 1

    def virtual(self, given: int | None) -> int | None:
        """The v `make_schedule` takes: the given chunks per rank when the schedule takes them, else None."""
        return given if self.takes_virtual else None

    def per_rank(self, given: int | None = None) -> int:
        """The schedule's chunks on each pp rank (every copy's): fixed, or `given`, or DEFAULT_VIRTUAL."""
        return self.chunks_per_rank or given or DEFAULT_VIRTUAL

    def model_chunks_per_rank(self, given: int | None = None) -> int:
        """The model's chunks on each pp rank (DualPipe's second copy repeats the first's)."""
        return self.per_rank(given) // self.pipelines

    def min_microbatches(self, p: int) -> int:
        """The fewest microbatches it accepts for p ranks."""
        return max(1, self.microbatches_per_rank * p)


_KINDS = (
    ScheduleKind("gpipe", 1, Placement.LOOP, forwards_first=True),
    ScheduleKind("1f1b", 1, Placement.LOOP),
    ScheduleKind("interleaved", None, Placement.LOOP, microbatches_per_rank=1, microbatches_multiple_of_p=True,
                 min_p=2),
    ScheduleKind("zb-h1", 1, Placement.LOOP, split_backward=True),
    ScheduleKind("dualpipev", 2, Placement.V, split_backward=True, microbatches_per_rank=2, min_p=2),
    ScheduleKind("dualpipe", 2, Placement.V, pipelines=2, split_backward=True, microbatches_per_rank=2, min_p=2),
)
KINDS: dict[str, ScheduleKind] = {kind.name: kind for kind in _KINDS}
SCHEDULES = tuple(KINDS)
DEFAULT_SCHEDULE = "1f1b"


def schedule_kind(name: str) -> ScheduleKind:
    """The properties of the schedule `name`; a `ScheduleError` naming the known ones for any other."""
    kind = KINDS.get(name)
    if kind is None:
        raise ScheduleError(f"unknown pipeline schedule {name!r}", hint=f"choose one of {', '.join(SCHEDULES)}")
    return kind


def schedules_help() -> str:
    """The names for a command's help: `gpipe, 1f1b (default), ..., dualpipe (two model copies)`."""
    return ", ".join(kind.name + (" (default)" if kind.name == DEFAULT_SCHEDULE else "")
                     + (" (two model copies)" if kind.pipelines > 1 else "") for kind in _KINDS)
