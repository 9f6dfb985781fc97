"""Every op's value and gradient on one rank: what locates the first divergence.

A `Program` with a `ValueTrace` hands it each node's output as it computes it (ops
and redistributions, each layer of a repeat, each microbatch of a pipeline), and the
trace keeps a detached copy of the value and, through a tensor hook, of the gradient
that backward computes for it. A recomputed region runs its forward twice; the
second run's values are the same tensors again, so the first is kept. The parent
process gathers every rank's trace and the single-device run's and compares them in
program order (`runtime/divergence.py`).

A `Fault` makes the trace the checker's self-test: on one rank, at one step, it adds
a small constant to one element of one op's output (every microbatch's), so the op's
value differs from the reference while its gradient still flows (the perturbation
is a constant). `fivedc verify --inject-fault OP` must then fail and name that op.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import Tensor

from fivedc.plan.faults import Fault

Key = tuple[int, str, int | None, int]  # step, value name, layer (None: top level), microbatch


@dataclass
class ValueTrace:
    """One rank's op values and gradients; `step` and `microbatch` are set by the loop
    that runs the program (the training loop and the pipeline runner)."""

    rank: int
    fault: Fault | None = None
    step: int = 0
    microbatch: int = 0
    values: dict[Key, Tensor] = field(default_factory=dict)
    grads: dict[Key, Tensor] = field(default_factory=dict)
    injected: int = 0  # how many times the fault was applied

    def record(self, value: str, layer: int | None, out: Tensor) -> Tensor:
        """Keep `out` (the node's output) and its gradient to come; the output to use
        from here on (perturbed where the fault says so)."""
        if not isinstance(out, Tensor):
            return out
        key = (self.step, value, layer, self.microbatch)
        again = key in self.values  # a recomputed region's second forward: the same value again
        if self._faulty(value, layer):
            out = self._perturb(out, count=not again)
        if again:
            return out
        self.values[key] = out.detach().cpu().clone()
        if out.requires_grad:
            out.register_hook(lambda grad, key=key: self._keep_grad(key, grad))
        return out

    def _keep_grad(self, key: Key, grad: Tensor) -> None:
        self.grads[key] = grad.detach().cpu().clone()

    def _faulty(self, value: str, layer: int | None) -> bool:
        f = self.fault
        return f is not None and (f.value, f.layer, f.rank, f.step) == (value, layer, self.rank, self.step)

    def _perturb(self, out: Tensor, *, count: bool) -> Tensor:
        if not out.is_floating_point():
            return out  # refused before the run (fivedc/plan/faults.py): integers index tables
        self.injected += count
        size = self.fault.size * max(1.0, out.detach().abs().max().item() if out.numel() else 1.0)
        delta = torch.zeros_like(out.detach()).reshape(-1)
        delta[0] = size
        return out + delta.reshape(out.shape)

    def export(self) -> dict:
        """What goes back to the parent (CPU tensors)."""
        return {"values": self.values, "grads": self.grads, "injected": self.injected}
