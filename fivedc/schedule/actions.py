"""A pipeline-parallel schedule as plain data: for each pp rank, its ordered actions.

An `Action` is one step a rank takes: a computation on one (microbatch, chunk) or one
half of a point-to-point transfer. Chunks ("virtual stages") are numbered globally
along the model, 0 .. p*v-1; `Schedule.placement[c]` is the pp rank holding chunk c.
A schedule may run `pipelines` independent model copies (DualPipe runs two, in
opposite directions): the chunks split into that many equal runs of consecutive
numbers, one per copy, and microbatch j goes through copy `j * pipelines // m`.
Within a copy, chunk c feeds chunk c+1 and its last chunk computes the loss.

A transfer is named after the computation that produced its tensor: SEND_FORWARD
j.c carries F j.c's output from chunk c to chunk c+1, SEND_BACKWARD j.c carries
B/I j.c's input gradient from chunk c to chunk c-1; the matching RECV carries the
same microbatch, chunk and kind, and each half names the other rank as `peer`.
The execution semantics are in `fivedc/schedule/simulator.py`.

Text form of an action: `F3.1` (kind, microbatch.chunk), `SF3.1>2`, `RF3.1<1`.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from enum import StrEnum
from typing import Any

from fivedc.errors import PlanError


class ScheduleError(PlanError):
    """A pipeline schedule that cannot be built, read, or executed as written."""


class ActionKind(StrEnum):
    FORWARD = "F"
    BACKWARD = "B"  # full backward: input and weight gradients
    BACKWARD_INPUT = "I"  # input gradient only (zero-bubble split)
    BACKWARD_WEIGHT = "W"  # weight gradient only (zero-bubble split)
    SEND_FORWARD = "SF"  # activations to the next chunk's rank
    RECV_FORWARD = "RF"
    SEND_BACKWARD = "SB"  # input gradients to the previous chunk's rank
    RECV_BACKWARD = "RB"


COMPUTE = frozenset({ActionKind.FORWARD, ActionKind.BACKWARD, ActionKind.BACKWARD_INPUT, ActionKind.BACKWARD_WEIGHT})
SENDS = frozenset({ActionKind.SEND_FORWARD, ActionKind.SEND_BACKWARD})
RECVS = frozenset({ActionKind.RECV_FORWARD, ActionKind.RECV_BACKWARD})
# The other half of a transfer.
PARTNER = {
    ActionKind.SEND_FORWARD: ActionKind.RECV_FORWARD,
    ActionKind.RECV_FORWARD: ActionKind.SEND_FORWARD,
    ActionKind.SEND_BACKWARD: ActionKind.RECV_BACKWARD,
    ActionKind.RECV_BACKWARD: ActionKind.SEND_BACKWARD,
}
_TOKEN = re.compile(r"^(SF|RF|SB|RB|F|B|I|W)(\d+)\.(\d+)(?:([<>])(\d+))?$")


@dataclass(frozen=True, slots=True)
class Action:
    kind: ActionKind
    microbatch: int
    chunk: int
    peer: int | None = None  # the other rank of a transfer; None for computations
    # No __post_init__: schedules hold 10^5 actions and `check_schedule` validates them all.

    def __str__(self) -> str:
        head = f"{self.kind.value}{self.microbatch}.{self.chunk}"
        if self.peer is None:
            return head
        return f"{head}{'>' if self.kind in SENDS else '<'}{self.peer}"

    @staticmethod
    def parse(token: str) -> Action:
        match = _TOKEN.match(token.strip())
        if match is None:
            raise ScheduleError(f"cannot read the action {token!r}",
                                hint="actions look like F3.1, B3.1, I3.1, W3.1, SF3.1>2, RF3.1<1, SB3.1>0, RB3.1<2")
        kind = ActionKind(match.group(1))
        arrow, peer = match.group(4), match.group(5)
        if arrow != (None if kind in COMPUTE else ">" if kind in SENDS else "<"):
            raise ScheduleError(f"cannot read the action {token!r}: a send names its peer after '>', a receive "
                                f"after '<', and a computation has no peer", hint="e.g. SF3.1>2, RF3.1<1, F3.1")
        return Action(kind, int(match.group(2)), int(match.group(3)), None if peer is None else int(peer))


@dataclass(frozen=True, slots=True)
class Schedule:
    name: str
    p: int  # pp ranks
    m: int  # microbatches per step
    v: int  # chunks per rank
    placement: tuple[int, ...]  # chunk -> pp rank
    ranks: tuple[tuple[Action, ...], ...]  # per pp rank, its actions in order
    pipelines: int = 1  # independent model copies (2 for DualPipe)

    def __post_init__(self) -> None:
        if self.p < 1 or self.m < 1 or self.v < 1 or self.pipelines < 1:
            raise ScheduleError(f"schedule {self.name}: p={self.p}, m={self.m}, v={self.v}, "
                                f"pipelines={self.pipelines} must all be at least 1")
        n = self.p * self.v
        if len(self.placement) != n or sorted(self.placement) != sorted(list(range(self.p)) * self.v):
            raise ScheduleError(f"schedule {self.name}: placement {self.placement} must list {n} chunks, "
                                f"{self.v} on each of the {self.p} ranks")
        if n % self.pipelines or self.m % self.pipelines:
            raise ScheduleError(f"schedule {self.name}: {n} chunks and m={self.m} microbatches must split "
                                f"evenly over {self.pipelines} pipelines")
        if len(self.ranks) != self.p:
            raise ScheduleError(f"schedule {self.name}: {len(self.ranks)} action lists for p={self.p} ranks",
                                hint="give one action list per pp rank")

    # --- geometry -----------------------------------------------------------------
    @property
    def num_chunks(self) -> int:
        return self.p * self.v

    def stage_of(self, chunk: int) -> int:
        """The pp rank holding `chunk`."""
        return self.placement[chunk]

    def chunks_of(self, rank: int) -> tuple[int, ...]:
        return tuple(c for c, r in enumerate(self.placement) if r == rank)

    def chunk_range(self, microbatch: int) -> range:
        """The chunks `microbatch` passes through, first to last (the last computes the loss)."""
        per = self.num_chunks // self.pipelines
        pipeline = microbatch * self.pipelines // self.m
        return range(pipeline * per, (pipeline + 1) * per)

    def prev_chunk(self, chunk: int) -> int | None:
        per = self.num_chunks // self.pipelines
        return None if chunk % per == 0 else chunk - 1

    def next_chunk(self, chunk: int) -> int | None:
        per = self.num_chunks // self.pipelines
        return None if (chunk + 1) % per == 0 else chunk + 1

    # --- plain data -----------------------------------------------------------------
    def to_text(self) -> str:
        """One line per rank: `rank 0: F0.0 SF0.0>1 F1.0 ...`, after a header line."""
        head = (f"# {self.name} p={self.p} m={self.m} v={self.v} pipelines={self.pipelines} "
                f"placement={','.join(map(str, self.placement))}")
        return "\n".join([head] + [f"rank {r}: " + " ".join(map(str, acts)) for r, acts in enumerate(self.ranks)])

    def to_dict(self) -> dict[str, Any]:
        return {"name": self.name, "p": self.p, "m": self.m, "v": self.v, "pipelines": self.pipelines,
                "placement": list(self.placement), "ranks": [[str(a) for a in acts] for acts in self.ranks]}

    @staticmethod
    def from_dict(data: dict[str, Any]) -> Schedule:
        try:
            return Schedule(name=str(data["name"]), p=int(data["p"]), m=int(data["m"]), v=int(data["v"]),
                            placement=tuple(int(r) for r in data["placement"]),
                            ranks=tuple(tuple(Action.parse(t) for t in acts) for acts in data["ranks"]),
                            pipelines=int(data.get("pipelines", 1)))
        except (KeyError, TypeError, ValueError, AttributeError) as e:
            raise ScheduleError(f"cannot read a schedule from this data: {e!r}",
                                hint="expected the keys name, p, m, v, placement, ranks (and pipelines)") from e

    def __str__(self) -> str:
        return self.to_text()
