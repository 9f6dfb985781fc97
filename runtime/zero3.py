"""ZeRO-3 by groups, as FSDP2 does it: one all-gather per group of parameters, not per use.

A group is one of the plan's gradient buckets (`passes/overlap.py`): parameters of
one ZeRO group (`grad_partial` axes), a layer's worth at most (a repeat body's buckets run
once per layer). At rest a rank keeps only its chunk of each (`FlatShard`). In forward
the first read of any of a group's parameters gathers the whole group with one
all-gather (`_GroupGather`); the group stays gathered while its unit runs (a layer of a
repeat; the top-level parameters are one unit) and is dropped when a parameter of
another unit is read, so a rank holds about one unit's parameters whole (and the next,
prefetched: with overlap on, the group gathered next in the previous step's order is
gathered while this one computes). Autograd does not keep the gathered tensors: the
saved-tensor hook of the saving scope (`runtime/saved.py`) keeps a note (`GroupNote`,
given to each gathered parameter by `keep_as_note`), and the first backward use of any
of the group's parameters gathers the group again (one all-gather), freed after its
last use. `ShardedParams.name_of` names a gathered copy (MoE layers name their state by
their router: `runtime/moe.py`). The gradients of the group's parameters come back to
`_GroupGather.backward` together, once every use's backward has run, and are summed
and scattered with one reduce-scatter into each rank's chunks.

So per group and step: an all-gather in forward, one in backward, one reduce-scatter,
what `fivedc/instructions/comm_program.py` expects and the plan lists. A parameter read again
after its unit was dropped (a tied embedding read by the head) gathers its group again;
its gradient then comes back in two parts, both reduce-scattered into its chunk.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist
from torch import Tensor
from torch.utils.weak import WeakTensorKeyDictionary

from fivedc.runtime.flat_shard import FlatShard, unpad_into
from fivedc.runtime.saved import Note, keep_as_note, root_of


class ParamGroup:
    """Parameters gathered and reduce-scattered together: their owned chunks side by side."""

    def __init__(self, names: Sequence[str], unit: tuple[str, int], specs: dict[str, FlatShard],
                 shapes: dict[str, torch.Size]) -> None:
        self.names, self.unit = tuple(names), unit
        self.specs = [specs[n] for n in self.names]
        self.shapes = [shapes[n] for n in self.names]
        self.sizes = [s.chunk for s in self.specs]
        self.n, self.index, self.group = self.specs[0].n, self.specs[0].index, self.specs[0].group

    def start(self, chunks: Sequence[Tensor]) -> tuple[Tensor, object]:
        """Start the all-gather of every rank's chunks: rows[i] is rank i's chunks, side by side."""
        send = torch.cat([c.detach().reshape(-1) for c in chunks])
        rows = torch.empty(self.n, send.numel(), dtype=send.dtype, device=send.device)
        if send.is_cuda and "nccl" in str(dist.get_backend(self.group)):
            work = dist.all_gather_into_tensor(rows.view(-1), send, group=self.group, async_op=True)
        else:
            work = dist.all_gather(list(rows.unbind(0)), send, group=self.group, async_op=True)
        return rows, work

    def unpack(self, started: tuple[Tensor, object]) -> list[Tensor]:
        """The whole parameters, each a tensor of its own (the padding dropped)."""
        rows, work = started
        work.wait()
        return [unpad_into(torch.empty(spec.numel, dtype=rows.dtype, device=rows.device), part).view(shape)
                for spec, shape, part in zip(self.specs, self.shapes, rows.split(self.sizes, dim=1))]

    def reduce_scatter(self, grads: Sequence[Tensor]) -> list[Tensor]:
        """Each rank's chunks of the gradients summed over the group, in one collective."""
        layout = torch.cat([_rows(g.reshape(-1), spec) for g, spec in zip(grads, self.specs)], dim=1)
        if layout.is_cuda and "nccl" in str(dist.get_backend(self.group)):
            mine = torch.empty(layout.shape[1], dtype=layout.dtype, device=layout.device)
            dist.reduce_scatter_tensor(mine, layout.view(-1), group=self.group)
        else:  # gloo has no reduce-scatter of its own (torch composes it of an all-reduce too)
            dist.all_reduce(layout, group=self.group)
            mine = layout[self.index].clone()
        return list(mine.split(self.sizes))


def _rows(flat: Tensor, spec: FlatShard) -> Tensor:
    padded = torch.zeros(spec.n * spec.chunk, dtype=flat.dtype, device=flat.device)
    padded[: spec.numel] = flat
    return padded.view(spec.n, spec.chunk)


class _GroupGather(torch.autograd.Function):
    """A group's whole parameters from the owned chunks (or from a prefetch under way);
    backward: their gradients' chunks, by one reduce-scatter."""

    @staticmethod
    def forward(fctx, group: ParamGroup, started, *chunks: Tensor):
        fctx.group = group
        return tuple(group.unpack(started if started is not None else group.start(chunks)))

    @staticmethod
    def backward(fctx, *grads: Tensor):
        return (None, None, *fctx.group.reduce_scatter(grads))


class ShardedParams:
    """ZeRO-3 parameters at rest: each the owned chunk of its flat local tensor (`chunks`,
    leaves that receive their gradient's chunk), gathered by group (`view()`). `groups`
    lists the names gathered together with their unit (the plan's buckets, expanded per
    layer: `fivedc.passes.overlap.expand_units`); a parameter in none is a group and a
    unit of its own."""

    def __init__(self, chunks: dict[str, Tensor], specs: dict[str, FlatShard], shapes: dict[str, torch.Size],
                 *, overlap: bool, groups: Sequence[tuple[Sequence[str], tuple[str, int]]] = ()) -> None:
        self.chunks, self.specs, self.shapes, self.overlap = chunks, specs, shapes, overlap
        named = [(tuple(n for n in g if n in chunks and specs[n].n > 1), unit) for g, unit in groups]
        covered = {n for g, _ in named for n in g}
        named += [((n,), (n, -1)) for n in chunks if specs[n].n > 1 and n not in covered]  # a unit of its own
        self.groups = [ParamGroup(g, unit, specs, shapes) for g, unit in named if g]
        self.group_of = {n: k for k, g in enumerate(self.groups) for n in g.names}
        self.gather_order: tuple[int, ...] = ()  # the groups the last forward gathered, in order
        self.prefetch: tuple[int, int, tuple] | None = None  # (position, group, started gather)
        self.named = WeakTensorKeyDictionary()  # a gathered parameter (its root) -> its name, weakly

    def name_of(self, t: Tensor) -> str | None:
        """The name of the parameter `t` (a root tensor) is the gathered copy of, if it is one."""
        return self.named.get(t)

    def view(self) -> _Gathered:
        return _Gathered(self)

    def gather(self, name: str) -> Tensor:
        """The full local parameter, a new tensor outside autograd (for checks)."""
        spec = self.specs[name]
        return spec.gather(self.chunks[name].detach()).view(self.shapes[name])


class _Gathered:
    """ZeRO-3's parameters as one forward sees them: a group gathered at the first read of
    any of its parameters and kept while its unit runs."""

    def __init__(self, sharded: ShardedParams) -> None:
        self.sharded = sharded
        self.gathered: list[int] = []  # groups in the order this forward gathered them
        self.unit: tuple | None = None
        self.held: dict[int, dict[str, Tensor]] = {}  # the current unit's gathered groups
        self.finished = False  # after forward (a recomputation in backward): no prefetch

    def __getitem__(self, name: str) -> Tensor:
        z = self.sharded
        if z.specs[name].n == 1:
            return z.chunks[name].view(z.shapes[name])
        k = z.group_of[name]
        group = z.groups[k]
        if group.unit != self.unit:  # a new unit: the last one's parameters go
            self.unit, self.held = group.unit, {}
        if k not in self.held:
            self.held[k] = self._gather(k)
        return self.held[k][name]

    def _gather(self, k: int) -> dict[str, Tensor]:
        z = self.sharded
        group = z.groups[k]
        started = None if self.finished else self._take_prefetch(k)
        self.gathered.append(k)
        outputs = _GroupGather.apply(group, started, *(z.chunks[n] for n in group.names))
        note = GroupNote(group, z)
        for name, full in zip(group.names, outputs):
            keep_as_note(full, note, name)
            z.named[root_of(full)] = name
        if not self.finished:
            self._prefetch_next()
        return dict(zip(group.names, outputs))

    def _take_prefetch(self, k: int):
        slot, self.sharded.prefetch = self.sharded.prefetch, None
        if slot is None:
            return None
        position, prefetched, started = slot
        if (position, prefetched) == (len(self.gathered), k):
            return started
        started[1].wait()  # the order changed: finish the collective every rank started, drop it
        return None

    def _prefetch_next(self) -> None:
        z, position = self.sharded, len(self.gathered)
        if z.overlap and position < len(z.gather_order):
            k = z.gather_order[position]
            z.prefetch = (position, k, z.groups[k].start([z.chunks[n] for n in z.groups[k].names]))

    def done(self) -> None:
        """After the forward: this step's gather order is the next step's prefetch order."""
        if self.sharded.prefetch is not None:
            self.sharded.prefetch[2][1].wait()
            self.sharded.prefetch = None
        self.sharded.gather_order = tuple(self.gathered)
        self.unit, self.held, self.finished = None, {}, True


class GroupNote(Note):
    """What autograd keeps of one gathered group: how to gather it again (one all-gather of
    its chunks), each parameter a part of the whole by its name (`runtime/saved.Note`)."""

    def __init__(self, group: ParamGroup, sharded: ShardedParams) -> None:
        super().__init__()
        self.group, self.sharded = group, sharded

    def gather(self) -> dict[str, Tensor]:
        chunks = [self.sharded.chunks[n] for n in self.group.names]
        return dict(zip(self.group.names, self.group.unpack(self.group.start(chunks))))
