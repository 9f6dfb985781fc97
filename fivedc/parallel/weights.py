"""Where a parallelized module keeps its weights, per ZeRO stage (used by `fivedc/parallel/module.py`).

Every mode holds one `nn.Parameter` per module parameter this rank holds (`params`,
under the module's keys, in its layout: `fivedc/parallel/names.py`); they are what a
torch optimizer over `parameters()` steps, so its state is sharded exactly as they are.
`view()` gives the program the plan's parameters, by the IR's names: views of them.

- `WholeShards` (ZeRO-0): the parameters are this rank's local (tp/ep-split)
  shards, and the forward reads views of them. `GradSync` sums their gradients over their
  `grad_partial` axes during backward.
- `FlatChunks` (ZeRO-1 and 2, and ZeRO-3 under a pipeline): the parameters are
  the owned chunks of the flattened local shards (`runtime/flat_shard.FlatShard`, padded
  so every rank holds the same bytes). Each forward all-gathers them into full
  local tensors (`runtime/flat_shard.gather_flat`: one collective per gradient
  bucket of the plan, not one per parameter), new leaves that autograd accumulates into, and
  a `GradSync` over those sums the gradients into the chunks' `.grad`: the full
  sum's owned slice (ZeRO-1, an all-reduce) or a reduce-scatter (ZeRO-2, 3). The
  optimizer updates only the chunks; the next forward gathers them again.
- `GatheredOnUse` (ZeRO-3): the parameters are the owned chunks; a layer's groups
  are gathered while it runs (`runtime/zero3.ShardedParams`), and backward gathers
  again instead of keeping; the gradient's chunk arrives through autograd, the
  gather's backward being a reduce-scatter.

Parameters with nothing to shard over (a group of one rank), and frozen ones, stay
whole local shards in every mode.
"""

from __future__ import annotations

import weakref
from collections.abc import Iterator, Mapping

import torch
from torch import Tensor, nn

from fivedc.parallel.grads import GradSync, Grouping
from fivedc.parallel.names import HeldNames
from fivedc.plan.execution_plan import ExecutionPlan
from fivedc.runtime.flat_shard import FlatShard, flat_shard, gather_flat
from fivedc.runtime.zero import gathered_params_scope
from fivedc.runtime.zero3 import ShardedParams


class WholeShards:
    """ZeRO-0: the local shards themselves."""

    def __init__(self, local: dict[str, Tensor], frozen: set[str], names: HeldNames, grouping: Grouping) -> None:
        self.names = names
        self.params = {n: nn.Parameter(t, requires_grad=n not in frozen) for n, t in local.items()}
        self.sync = GradSync(self.params, grouping)

    def view(self) -> dict[str, Tensor]:
        return self.names.to_ir(self.params)

    def scope(self):
        return gathered_params_scope(0)

    def forward_done(self, view) -> None:
        pass

    def local(self, name: str) -> Tensor:
        return self.params[name].detach()

    def local_grad(self, name: str) -> Tensor:
        p = self.params[name]
        return p.grad.detach() if p.grad is not None else torch.zeros_like(p)

    def load_local(self, name: str, tensor: Tensor) -> None:
        with torch.no_grad():
            self.params[name].copy_(tensor)


class _Chunked:
    """The parameters are owned chunks (`FlatShard`) where the ZeRO group has more than one rank."""

    def __init__(self, stage: int, local: dict[str, Tensor], frozen: set[str], names: HeldNames,
                 grouping: Grouping) -> None:
        self.stage, self.names, self.grouping = stage, names, grouping
        groups = grouping.groups
        self.shapes = {n: t.shape for n, t in local.items()}
        self.specs: dict[str, FlatShard] = {}
        self.params: dict[str, nn.Parameter] = {}
        for name, tensor in local.items():
            spec = flat_shard(tensor.numel(), groups.get(name))
            if spec.n > 1 and name not in frozen:
                self.specs[name] = spec
                self.params[name] = nn.Parameter(spec.pad(spec.owned(tensor.reshape(-1))))
            else:
                self.params[name] = nn.Parameter(tensor, requires_grad=name not in frozen)

    def local(self, name: str) -> Tensor:
        p = self.params[name].detach()
        return self.specs[name].gather(p).view(self.shapes[name]) if name in self.specs else p

    def local_grad(self, name: str) -> Tensor:
        p = self.params[name]
        grad = p.grad.detach() if p.grad is not None else torch.zeros_like(p)
        return self.specs[name].gather(grad).view(self.shapes[name]) if name in self.specs else grad

    def load_local(self, name: str, tensor: Tensor) -> None:
        with torch.no_grad():
            if name in self.specs:
                spec = self.specs[name]
                tensor = spec.pad(spec.owned(tensor.reshape(-1)))
            self.params[name].copy_(tensor)


class FlatChunks(_Chunked):
    """ZeRO-1/2 (and ZeRO-3 under a pipeline): gathered once per forward, summed into the chunks."""

    def __init__(self, stage: int, local: dict[str, Tensor], frozen: set[str], names: HeldNames,
                 grouping: Grouping) -> None:
        super().__init__(stage, local, frozen, names, grouping)
        self.sync: GradSync | None = None  # the last forward's
        self.gathered: dict[str, Tensor] = {}  # the last forward's whole tensors

    def view(self) -> dict[str, Tensor]:
        """Every chunked parameter gathered whole (`gather_flat`: one all-gather per plan
        bucket, not one per parameter), as a fresh leaf for this forward.

        The gathered tensors live until the next forward (held here) or while an
        autograd graph of theirs does. Their `GradSync` sees them through weak
        references: its hooks on them keep it alive, so strong ones would make a
        cycle, and every forward's whole parameters would wait for Python's cycle
        collector (5 extra copies after 6 steps, benchmarks/parallelize_zero.py)."""
        self.gathered = {}  # the previous forward's, unless a graph still holds them: freed before the gather
        full = gather_flat({n: self.params[n].detach() for n in self.specs}, self.specs,
                           buckets=self.grouping.buckets, bucket_bytes=self.grouping.bucket_bytes)
        self.gathered = {n: full[n].view(self.shapes[n]).requires_grad_(True) for n in self.specs}
        self.sync = GradSync(_WeakParams(self.gathered), self.grouping, stage=self.stage, specs=self.specs,
                             owners={n: self.params[n] for n in self.gathered})
        return self.names.to_ir({**self.params, **self.gathered})

    def scope(self):
        return gathered_params_scope(0)

    def forward_done(self, view) -> None:
        pass


class _WeakParams(Mapping[str, Tensor]):
    """A forward's gathered tensors, weakly. One already freed was used by no graph still
    alive, so its gradient in any backward is zero: it reads as a fresh zero leaf."""

    def __init__(self, tensors: dict[str, Tensor]) -> None:
        self.refs = {n: weakref.ref(t) for n, t in tensors.items()}
        self.meta = {n: (t.shape, t.dtype, t.device) for n, t in tensors.items()}

    def __getitem__(self, name: str) -> Tensor:
        t = self.refs[name]()
        if t is None:
            shape, dtype, device = self.meta[name]
            return torch.zeros(shape, dtype=dtype, device=device, requires_grad=True)
        return t

    def __iter__(self) -> Iterator[str]:
        return iter(self.refs)

    def __len__(self) -> int:
        return len(self.refs)

    def alive(self) -> list[Tensor]:
        return [t for ref in self.refs.values() if (t := ref()) is not None]


class GatheredOnUse(_Chunked):
    """ZeRO-3: gathered by group (the plan's buckets) while a layer runs, gathered again in
    backward, the group's gradients reduce-scattered into the chunks by autograd."""

    def __init__(self, local: dict[str, Tensor], frozen: set[str], names: HeldNames, grouping: Grouping) -> None:
        super().__init__(3, local, frozen, names, grouping)
        specs = {n: self.specs.get(n, FlatShard(t.numel(), 1, 0, None)) for n, t in local.items()}
        self.sharded = ShardedParams(self.params, specs, self.shapes, overlap=grouping.overlap,
                                     groups=grouping.units)  # gathered by the plan's buckets

    def view(self) -> _InPlan:
        return _InPlan(self.sharded.view(), self.names)

    def scope(self):
        return gathered_params_scope(3)

    def forward_done(self, view: _InPlan) -> None:
        view.gathered.done()


class _InPlan(Mapping[str, Tensor]):
    """ZeRO-3's gathered parameters by the IR's names: each read gathers (or finds gathered)
    the module-named tensors it is a view of, as the program reaches it."""

    def __init__(self, gathered, names: HeldNames) -> None:
        self.gathered, self.names = gathered, names

    def __getitem__(self, name: str) -> Tensor:
        return self.names.ir(name, self.gathered)

    def __iter__(self) -> Iterator[str]:
        return iter(self.names.pieces)

    def __len__(self) -> int:
        return len(self.names.pieces)


def make_weights(local: dict[str, Tensor], frozen: set[str], plan: ExecutionPlan, names: HeldNames,
                 grouping: Grouping):
    """The weights of a parallelized module for the plan's ZeRO stage (a pipeline gathers
    once per step, so ZeRO-3 under pp keeps the gathered tensors through the step)."""
    if plan.zero == 0:
        return WholeShards(local, frozen, names, grouping)
    if plan.zero == 3 and plan.pipeline is None:
        return GatheredOnUse(local, frozen, names, grouping)
    return FlatChunks(plan.zero, local, frozen, names, grouping)
