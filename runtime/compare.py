"""How a parallel run's numbers are compared with the single-device run's.

Both equivalence checks (`runtime/verify.py` for a plan, `fivedc/parallel/check.py`
for a parallelized module) measure every loss, gradient and parameter with the
same rule: the largest absolute difference relative to the largest magnitude of
the reference tensor. A non-finite value is never a small error: NaN or Inf in
the parallel run where the reference is finite is an infinite error (so a run
whose numbers are all NaN is a mismatch, not error 0.0), and a non-finite
reference cannot be checked against at all, so it is a `ReferenceNotFinite`
error of its own. `Worst` keeps the largest error seen and where it was.

One exception to the tensor's own scale: a parameter whose gradient is zero up to
rounding at every step of the reference (a key bias with no rotary after it, which the
softmax's invariance to a shift of a row's scores cancels: OPT's, 1e-19 of the model's
largest gradient in float64) gets rounding noise as its gradient in
both runs, and AdamW turns that noise into steps of its own, different in each run. Its
gradients are compared at the scale of the model's largest gradient at that step, and the
parameter at the scale of the model's largest parameter: a real error there (a gradient
that is not zero) is still as large as the tensors it is measured against.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

import torch

from fivedc.errors import FivedcError


class ReferenceNotFinite(FivedcError):
    """The single-device run itself produced NaN or Inf: there is nothing to compare with."""


def relative_error(got: torch.Tensor, want: torch.Tensor, scale: torch.Tensor | None = None) -> float:
    """max |got - want| / max |scale| (scale: the full reference tensor, default `want`);
    inf when the shapes differ or `got` holds a non-finite value."""
    scale = want if scale is None else scale
    if got.shape != want.shape:
        return math.inf
    if not got.numel():
        return 0.0
    if not bool(torch.isfinite(got).all()):
        return math.inf
    denominator = max(scale.abs().max().item(), 1e-12) if scale.numel() else 1.0
    error = (got.double() - want.double()).abs().max().item() / denominator
    return error if math.isfinite(error) else math.inf


def loss_error(got: float, want: float) -> float:
    """|got - want| / |want|, inf when `got` is not finite."""
    if not math.isfinite(got):
        return math.inf
    return abs(got - want) / max(abs(want), 1e-12)


@dataclass(frozen=True, slots=True)
class Worst:
    """The largest error of one kind so far, and the tensor it was in."""

    error: float = 0.0
    where: str = ""

    def add(self, error: float, where: str) -> Worst:
        error = math.inf if math.isnan(error) else error  # NaN compares false with everything
        return Worst(error, where) if error > self.error else self


def compare_runs(got, want, *, names: tuple[str, ...], shard_of=None) -> dict[str, tuple[float, str]]:
    """The worst error of each kind ("loss", "grad", "param": (error, where)) between
    two runs (anything with `losses`, per-step `grads` and final `params`): every
    step's loss, the gradients of `names` at every step and their final values.
    `shard_of(name, full)` is the part of a reference tensor `got` holds (default:
    all of it); the scale is the full reference tensor. A missing step or tensor is
    an infinite error."""
    expected = shard_of or (lambda name, full: full)
    worst = {"loss": Worst(where="loss"), "grad": Worst(), "param": Worst()}
    largest_grads = [max((_magnitude(g) for g in step.values()), default=0.0) for step in want.grads]
    zero = zero_up_to_rounding(want.grads, largest_grads, names)
    model_scale = torch.tensor(max((_magnitude(want.params[n]) for n in names), default=0.0))
    if len(got.losses) != len(want.losses):
        worst["loss"] = worst["loss"].add(math.inf, f"{len(got.losses)} losses for {len(want.losses)} steps")
    for step, (mine, ref) in enumerate(zip(got.losses, want.losses), start=1):
        worst["loss"] = worst["loss"].add(loss_error(mine, ref), f"loss at step {step}")
    for step, ref in enumerate(want.grads, start=1):
        mine = got.grads[step - 1] if step <= len(got.grads) else {}
        for name in names:
            scale = torch.tensor(largest_grads[step - 1]) if name in zero else None
            worst["grad"] = worst["grad"].add(_error(mine.get(name), name, ref[name], expected, scale),
                                              f"gradient of {name} at step {step}")
    for name in names:
        scale = model_scale if name in zero else None
        worst["param"] = worst["param"].add(_error(got.params.get(name), name, want.params[name], expected, scale),
                                            name)
    return {kind: (w.error, w.where) for kind, w in worst.items()}


def compare_states(got: Mapping[str, torch.Tensor], want: Mapping[str, torch.Tensor],
                   keys: Iterable[str]) -> tuple[float, str]:
    """The worst error (and where) of the buffers `keys` after the last step: the states a forward
    writes and the after-step hooks update. One the parallel run lacks is an infinite error."""
    worst = Worst()
    for key in keys:
        full = want[key]
        mine = got.get(key)
        worst = worst.add(_error(None if mine is None else mine.to(full.dtype), key, full, lambda n, f: f),
                          f"buffer {key}")
    return worst.error, worst.where


ROUNDING = 1  # machine epsilons of the model's largest gradient: at most that, a gradient is rounding noise


def zero_up_to_rounding(grads: list[Mapping[str, torch.Tensor]], largest: list[float],
                        names: Iterable[str]) -> set[str]:
    """The parameters whose gradient, at every step, is at most ROUNDING epsilons of the
    model's largest gradient at that step (`largest`): below the rounding unit of the sums
    it is made of."""
    zero = set(names) if grads else set()
    for step, top in zip(grads, largest):
        floats = [g for g in step.values() if g.is_floating_point()]
        if not floats:
            return set()
        bound = ROUNDING * torch.finfo(floats[0].dtype).eps * top
        zero = {name for name in zero if name in step and _magnitude(step[name]) <= bound}
    return zero


def _magnitude(t: torch.Tensor) -> float:
    return t.abs().max().item() if t.numel() else 0.0


def _error(got: torch.Tensor | None, name: str, full: torch.Tensor, expected, scale=None) -> float:
    return math.inf if got is None else relative_error(got.cpu(), expected(name, full), full if scale is None else scale)


def check_reference(losses: Iterable[float], tensors: Iterable[Mapping[str, torch.Tensor]], *, what: str) -> None:
    """Raise `ReferenceNotFinite` when the single-device run's losses or tensors hold NaN/Inf."""
    for step, loss in enumerate(losses, start=1):
        if not math.isfinite(loss):
            _not_finite(f"loss {loss} at step {step}", what)
    for named in tensors:
        for name, tensor in named.items():
            if tensor.is_floating_point() and not bool(torch.isfinite(tensor).all()):
                _not_finite(f"a non-finite value in {name}", what)


def _not_finite(found: str, what: str) -> None:
    raise ReferenceNotFinite(
        f"the single-device run of {what} gives {found}: the reference itself diverges, "
        "so no parallel run can be checked against it",
        hint="check the model on one device first (e.g. a smaller learning rate, fp64, or fewer --steps)",
    )
