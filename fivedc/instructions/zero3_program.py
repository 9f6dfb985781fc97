"""ZeRO-3 without a pipeline: one step's events with the parameters gathered by group.

What `runtime/zero3.py` does, expanded: the groups are the plan's buckets per
layer (`expand_units`). In forward, at each op, every parameter it reads whose group
is not held gathers its group (an all-gather of the group's chunks, an *instance* of
the group); reading a parameter of another unit (a layer, or the top level) first
lets the held groups go. After forward nothing is held. In backward, at each node in
reverse: a recomputed region reads its parameters again the same way (gathers that no
gradient comes back to); then the first node that unpacks a saved parameter of an
instance gathers that instance again (once: the note keeps it until its last unpack);
the node's own collectives; and when the node is the instance's first reader in
forward, its last in backward, the instance's gradients are complete and reduce-
scattered (autograd runs the gather's backward next: it was created just before that
reader, after everything the reader's inputs came from).
"""

from __future__ import annotations

from fivedc.ir.graph import Redistribute
from fivedc.passes.overlap import expand_units
from fivedc.instructions.events import Event

__all__ = ["zero3_step"]


def zero3_step(x) -> list:
    """Forward and backward of one step under ZeRO-3 alone, for the `_Expander` `x`."""
    return _Groups(x).step()


class _Groups:
    def __init__(self, x) -> None:
        self.x = x
        self.groups = [(names, unit) for names, unit in expand_units(x.plan.buckets)]
        self.group_of = {n: k for k, (names, _) in enumerate(self.groups) for n in names}
        self.unit, self.held = None, {}
        self.instance_group: list[int] = []  # instance -> its group
        self.first_reader: dict[int, int] = {}  # site index -> instances it gathered (forward)
        self.saved: dict[int, list[int]] = {}  # site index -> instances whose parameters it saved

    def step(self) -> list:
        x, out = self.x, []
        for i, site in enumerate(x.sites):
            instances = self._read(site, out, f"for {site.id}")
            out += x.at(site, x.forward(site))
            if x.saves_params(site):
                self.saved[i] = instances
            for k in instances:
                self.first_reader.setdefault(k, i)
        self.unit, self.held = None, {}  # forward done: nothing held
        again: set[int] = set()
        for i in reversed(range(len(x.sites))):
            site = x.sites[i]
            if site.node.out not in x.trainable or isinstance(site.node, Redistribute):
                out += x.at(site, x.backward(site))  # a redistribution's steps, or nothing
                continue
            redone, phase = x.redone(site)
            for s in redone:
                self._read(s, out, f"again to recompute {s.id}")
                out += x.at(s, [x._again(e, phase) for e in x.forward(s)])
            out += x.at(site, x.input_again(site))
            for k in dict.fromkeys(self.saved.get(i, ())):
                if k not in again:
                    again.add(k)
                    out.append(self._event("all_gather", k, "gathered again for backward"))
            out += x.at(site, x.computed(site, "backward")) + x._kernel_backward(site)
            out += [self._event("reduce_scatter", k, "gradients reduce-scattered")
                    for k, first in self.first_reader.items() if first == i]
        return out

    def _read(self, site, out: list, why: str) -> list[int]:
        """The instances of the groups the op reads (gathering those not held), in argument order."""
        instances = []
        for name in self.x._param_args(site):
            if name not in self.group_of:  # a group of one rank: nothing to gather
                continue
            k = self.group_of[name]
            if self.groups[k][1] != self.unit:
                self.unit, self.held = self.groups[k][1], {}
            if k not in self.held:
                self.held[k] = len(self.instance_group)
                self.instance_group.append(k)
                out.append(self._event("all_gather", self.held[k], f"gathered {why}"))
            instances.append(self.held[k])
        return list(dict.fromkeys(instances))

    def _event(self, op: str, instance: int, what: str):
        x = self.x
        names, _ = self.groups[self.instance_group[instance]]
        param = x.params[names[0]]
        n = x.mesh.size(*param.grad_partial)
        numel = sum(x.chunk_numel(name) for name in names)
        return Event(op, param.grad_partial, numel if op == "all_gather" else numel * n, x.dtype,
                          f"ZeRO-3 group {', '.join(names)} {what}", param.loc)
