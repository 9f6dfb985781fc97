"""What `fivedc train` is asked to do: steps, learning-rate schedule, clipping, validation, saves.

`TrainConfig` is plain data shared by the command line, every rank's loop
(`runtime/train_loop.py`) and the checkpoint index (which records it, so that a
resumed run can say what changed). Its learning rate follows nanoGPT's schedule:
a linear warmup over `warmup` steps, then a cosine from `lr` down to `min_lr` at
the last step (`lr_at`). Every value is checked here, so a bad flag is an error
before any process starts.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

from fivedc.errors import FivedcError

# torch generators take seeds below 2**64; fivedc seeds one with seed * 1_000_003 + a
# 32-bit offset (a parameter's name, an epoch): `runtime/program.init_params`, `runtime/data`
SEED_MAX = (2**64 - 1 - 2**32) // 1_000_003
MAX_STEPS = 2**32 - 1  # so that an epoch number (at most the step) stays a 32-bit offset


@dataclass(frozen=True, slots=True)
class TrainConfig:
    steps: int  # the last step of the run (a resumed run continues to it)
    lr: float = 1e-3
    min_lr: float | None = None  # the cosine's floor; None: lr / 10 (nanoGPT's choice)
    warmup: int = 0  # steps of linear warmup
    weight_decay: float = 0.1
    clip: float = 1.0  # largest global gradient norm; 0: no clipping
    seed: int = 0  # of the parameters (DSL models) and of the data order
    val_every: int = 0  # validation loss every N steps (and at saves and the last step); 0: at those only
    val_batches: int = 8  # batches of the validation file per measurement (at most the file's)
    save_every: int = 0  # a checkpoint every N steps (and at the last step); 0: none
    keep: int = 3  # checkpoints kept besides the best

    def __post_init__(self) -> None:
        _at_least("--steps", self.steps, 1)
        if self.steps > MAX_STEPS:
            raise FivedcError(f"--steps {self.steps} is above the largest, {MAX_STEPS}", hint="give fewer steps")
        _at_least("--warmup", self.warmup, 0)
        _at_least("--val-every", self.val_every, 0)
        _at_least("--val-batches", self.val_batches, 1)
        _at_least("--save-every", self.save_every, 0)
        _at_least("--keep", self.keep, 1)
        _at_least("--seed", self.seed, 0)
        if self.seed > SEED_MAX:
            raise FivedcError(f"--seed {self.seed} is above the largest seed, {SEED_MAX}",
                              hint=f"give --seed between 0 and {SEED_MAX}")
        for flag, value in (("--lr", self.lr), ("--min-lr", self.floor), ("--weight-decay", self.weight_decay),
                            ("--clip", self.clip)):
            if not (math.isfinite(value) and value >= 0):
                raise FivedcError(f"{flag} {value} must be a finite number >= 0", hint=f"e.g. {flag} 0.1")
        if self.floor > self.lr:
            raise FivedcError(f"--min-lr {self.floor:g} is above --lr {self.lr:g}: the cosine decays from lr to min-lr",
                              hint=f"give --min-lr at most {self.lr:g}")
        if self.warmup >= self.steps and self.warmup > 0:
            raise FivedcError(f"--warmup {self.warmup} leaves no step of the {self.steps} to decay over",
                              hint=f"give --warmup below {self.steps}")

    @property
    def floor(self) -> float:
        return self.lr / 10 if self.min_lr is None else self.min_lr

    def lr_at(self, step: int) -> float:
        """The learning rate of step `step` (0-based: the first step taken is step 0).
        nanoGPT's `get_lr`: lr * (step + 1) / (warmup + 1) during warmup, then
        min_lr + (lr - min_lr) * (1 + cos(pi * t)) / 2 with t going from 0 at the end of
        warmup to 1 at the last step."""
        if step < self.warmup:
            return self.lr * (step + 1) / (self.warmup + 1)
        span = max(self.steps - 1 - self.warmup, 1)
        ratio = min((step - self.warmup) / span, 1.0)
        return self.floor + 0.5 * (1.0 + math.cos(math.pi * ratio)) * (self.lr - self.floor)

    def validates_at(self, step: int, *, saving: bool) -> bool:
        """Measure the validation loss after step `step` (1-based count of steps done)?"""
        return step == self.steps or saving or (self.val_every > 0 and step % self.val_every == 0)

    def saves_at(self, step: int) -> bool:
        return self.save_every > 0 and (step % self.save_every == 0 or step == self.steps)

    def to_json(self) -> dict:
        return asdict(self)


def _at_least(flag: str, value: int, least: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < least:
        raise FivedcError(f"{flag} {value} must be a whole number >= {least}", hint=f"e.g. {flag} {max(least, 1)}")
