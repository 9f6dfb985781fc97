"""Gradient sync for a parallelized module: summed by the time `loss.backward()` returns.

Each parameter shard's gradient is a summand over its `grad_partial` axes (dp, cp,
and tp for norm weights under SP). `GradSync` sums it there with the plan's
buckets (`runtime/buckets.py`), started during backward from post-accumulate-grad
hooks in the plan's order (or all at the end with overlap off), and completes
them in a callback queued on the autograd engine, which runs before `backward()`
returns. So `.grad` holds the full gradient of each shard when the user's
`opt.step()` runs, and any `torch.optim` optimizer works unchanged.

Under ZeRO-1/2 (`fivedc/parallel/weights.FlatChunks`) the tensors the forward read
are gathered copies and the parameters are their owned chunks (`owners`): the sum
goes to the chunk's `.grad`: its bucket's reduce-scatter (stages 1, 2, 3; stage 1
after backward, the others during it), adding to what it held.

Gradient accumulation keeps torch's semantics (`.grad` adds up until
`zero_grad()`): a hook on each parameter's incoming gradient sets the
accumulated, already summed `.grad` aside before this backward's gradient lands,
so only the new part is reduced, and adds it back afterwards. Parameters with
nothing to sum over (a 1x1x1x1x1 mesh) get no hooks at all.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial

import torch
from torch import Tensor

from fivedc.runtime.buckets import GradBuckets
from fivedc.runtime.flat_shard import FlatShard


@dataclass(frozen=True, slots=True)
class Grouping:
    """The plan's gradient sums in the names a parallelized module holds its tensors by
    (`fivedc/parallel/names.HeldNames.grouping`): each one's group (None: nothing to sum
    over), the buckets in launch order, each bucket with its unit (ZeRO-3 gathers a unit's
    groups together: `runtime/zero3.py`)."""

    groups: dict[str, object | None]
    buckets: tuple[tuple[str, ...], ...]
    units: tuple[tuple[tuple[str, ...], tuple[str, int]], ...]
    overlap: bool
    bucket_bytes: int


class GradSync:
    def __init__(self, params: dict[str, Tensor], grouping: Grouping, *, stage: int = 0,
                 specs: dict[str, FlatShard] | None = None, owners: dict[str, Tensor] | None = None) -> None:
        groups = grouping.groups
        synced = {name for name, group in groups.items()
                  if group is not None and name in params and params[name].requires_grad}
        buckets = [b for b in grouping.buckets if all(groups.get(n) is not None for n in b)]
        buckets = [kept for b in buckets if (kept := tuple(n for n in b if n in synced))]  # frozen ones dropped
        covered = {name for b in buckets for name in b}
        # a parameter the plan left out of its buckets still gets summed, alone, after backward
        buckets += [(name,) for name in params if name in synced and name not in covered]
        self.params, self.stage, self.specs, self.owners = params, stage, specs or {}, owners
        self.synced = tuple(name for name in params if name in synced)
        self.reducer = GradBuckets(params, buckets, self.specs, groups, stage=min(stage, 2), overlap=grouping.overlap)
        self.held: dict[str, Tensor | None] = {}  # .grad from earlier backwards, set aside
        self.queued = False
        for name in self.synced:
            params[name].register_hook(partial(self._incoming, name))

    def _incoming(self, name: str, grad: Tensor) -> None:
        """Before this backward's gradient is accumulated: set the summed one aside."""
        if not self.queued:
            torch.autograd.Variable._execution_engine.queue_callback(self._finish)
            self.queued = True
        p = self.params[name]
        self.held[name] = p.grad
        p.grad = None

    def _finish(self) -> None:
        """At the end of backward: start what is left, wait, and set each summed `.grad`."""
        self.queued = False
        for name in self.synced:
            if name not in self.held:  # no gradient in this backward: reduce zeros, keep the old one
                p = self.params[name]
                self.held[name], p.grad = p.grad, None
        summed = self.reducer.finish()
        for name, grad in summed.items():
            before = self.held.pop(name, None)
            if self.owners is None:
                p = self.params[name]
                grad = grad.view_as(p)
            else:  # ZeRO: the owned chunk goes to the parameter that is the chunk
                p = self.owners[name]
                before = p.grad
            p.grad = grad if before is None else before + grad
        self.held.clear()
