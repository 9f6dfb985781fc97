"""A fault for the restart tests: `FIVEDC_FAULT` makes one rank's process die at a step, or mid-save.

`FIVEDC_FAULT=RANK:STEP[:save]` kills rank RANK's process (`os._exit`, as a crash
would: no cleanup, no message to its peers) as it begins step STEP (1-based: after
STEP - 1 steps), or with `:save` in the middle of the checkpoint of step STEP (its own
shard written, the checkpoint not committed). Several faults, comma-separated, apply
to successive attempts of the job: the first to the first attempt, the second to the
first restart, and so on; an attempt with no fault of its own runs clean. The attempt
is torchrun's `TORCHELASTIC_RESTART_COUNT` under torchrun, the restart count of the Ray
launcher or of the local one.

The variable is read in one place, `faults_from_env` (by the command, before any
process starts); the faults then travel in the job (`TrainJob.faults`), so a Ray
actor on another machine needs no environment of its own.
"""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass

from fivedc.errors import FivedcError

ENV = "FIVEDC_FAULT"
EXIT_CODE = 9  # what the dying rank's process exits with


@dataclass(frozen=True, slots=True)
class Fault:
    rank: int
    step: int  # 1-based: the step begun (or whose checkpoint is being saved) when the rank dies
    save: bool = False  # mid-save of step `step`'s checkpoint rather than as the step begins
    attempt: int = 0  # 0: the first attempt; k: the k-th restart

    def __post_init__(self) -> None:
        if self.rank < 0 or self.step < 1 or self.attempt < 0:
            raise FivedcError(f"{ENV}: rank {self.rank}, step {self.step} (want a rank >= 0 and a step >= 1)",
                              hint=f"e.g. {ENV}=1:12 or {ENV}=0:10:save")

    def strike(self, *, rank: int, attempt: int, step: int, saving: bool) -> None:
        """Exit this process at once when this fault is for here and now."""
        if (rank, attempt, step, saving) == (self.rank, self.attempt, self.step, self.save):
            where = f"while saving step {step}" if saving else f"at step {step}"
            print(f"fivedc: {ENV}: rank {rank} exits {where} (attempt {attempt + 1})", file=sys.stderr, flush=True)
            os._exit(EXIT_CODE)


def parse_faults(text: str) -> tuple[Fault, ...]:
    """`RANK:STEP[:save]`, comma-separated: one per attempt, in order."""
    faults = []
    for attempt, part in enumerate(p.strip() for p in text.split(",")):
        fields = part.split(":")
        if not 2 <= len(fields) <= 3 or (len(fields) == 3 and fields[2] != "save"):
            raise FivedcError(f"{ENV}={text!r}: {part!r} is not RANK:STEP or RANK:STEP:save",
                              hint=f"e.g. {ENV}=1:12 (rank 1 dies at step 12) or {ENV}=1:12,0:14:save")
        try:
            rank, step = int(fields[0]), int(fields[1])
        except ValueError:
            raise FivedcError(f"{ENV}={text!r}: {part!r} needs whole numbers for RANK and STEP",
                              hint=f"e.g. {ENV}=1:12") from None
        faults.append(Fault(rank, step, save=len(fields) == 3, attempt=attempt))
    return tuple(faults)


def faults_from_env() -> tuple[Fault, ...]:
    """The faults `FIVEDC_FAULT` asks for (none when it is unset or empty)."""
    text = os.environ.get(ENV, "").strip()
    return parse_faults(text) if text else ()


def launcher_attempt() -> int:
    """Which attempt of a torchrun job this process belongs to (0 outside torchrun)."""
    text = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    return int(text) if text.isdigit() else 0


def strike(faults: tuple[Fault, ...], *, rank: int, attempt: int, step: int, saving: bool = False) -> None:
    """Die here if one of `faults` is for this rank, attempt, step and phase."""
    for fault in faults:
        fault.strike(rank=rank, attempt=attempt, step=step, saving=saving)


__all__ = ["ENV", "EXIT_CODE", "Fault", "faults_from_env", "launcher_attempt", "parse_faults", "strike"]
