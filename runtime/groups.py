"""Process groups for the axes of a `Mesh`, built on torch's DeviceMesh.

One `MeshGroups` per run: it lays the 5-D mesh out as a DeviceMesh (outermost axis
first, so its rank numbering matches `Mesh`), takes single-axis groups from it, and
creates every composite group (e.g. dp x tp) eagerly, because group creation is a
collective that all ranks must enter in the same order. The contract the
collectives rely on: group index `index(axes)` orders the members as
`Mesh.group_ranks(axes, rank)` does (first axis outermost). The process group's
own rank order matches it, except on a torch whose `new_group` always sorts ranks
(no `sort_ranks` argument; 2.13 has it): there `positions(axes)` maps
process-group ranks to group indices and the collectives reorder chunks by it.
Axes of size 1 are dropped; a group of one rank is `None`.
"""

from __future__ import annotations

import inspect
from collections.abc import Iterable

import torch
import torch.distributed as dist
from torch.distributed import ProcessGroup
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from fivedc.errors import MeshError, PassError
from fivedc.ir.mesh import Mesh, MeshAxis

Axes = tuple[MeshAxis, ...]

# new_group(sort_ranks=False) keeps the caller's rank order (newer torch, e.g. 2.13).
KEEPS_ORDER = "sort_ranks" in inspect.signature(dist.new_group).parameters


def moves_nothing(group=None) -> bool:
    """Whether `group` (None: the default group) is torch's fake backend, as in a rehearsal
    (`runtime/rehearse.py`): its collectives return at once and move nothing."""
    return "fake" in str(dist.get_backend(group))


class MeshGroups:
    """The process groups of one mesh, as seen by this rank."""

    def __init__(
        self, mesh: Mesh, *, device_type: str, axis_sets: Iterable[tuple[MeshAxis, ...]] = (),
        pp_subsets: Iterable[tuple[int, ...]] = (),
    ) -> None:
        self.mesh = mesh
        self.device_type = device_type
        self.rank = dist.get_rank()
        if dist.get_world_size() != mesh.world:
            raise MeshError(
                f"the mesh {mesh} needs {mesh.world} processes but the process group has "
                f"{dist.get_world_size()}"
            )
        self.coords: dict[MeshAxis, int] = mesh.coords(self.rank)
        shape, names = mesh.device_mesh_layout()
        self.device_mesh: DeviceMesh = init_device_mesh(device_type, shape, mesh_dim_names=names)
        self._groups: dict[Axes, ProcessGroup] = {}
        self._positions: dict[Axes, tuple[int, ...]] = {}
        for axis in mesh.rank_order:
            if mesh.size(axis) > 1:
                self._add((axis,), self.device_mesh[str(axis)].get_group(), exact=True)
        for axes in axis_sets:
            key = self._key(axes)
            if len(key) > 1 and key not in self._groups:
                self._composite(key)
        self._pp_subsets: dict[tuple[int, ...], ProcessGroup | None] = {}
        for pp_ranks in sorted(set(pp_subsets)):
            self._pp_subset(pp_ranks)

    # ---- queries ------------------------------------------------------------------
    def group(self, axes: Iterable[MeshAxis]) -> ProcessGroup | None:
        """The group over `axes`; None when it has one member."""
        return self._groups[key] if (key := self._known(axes)) else None

    def pp_group(self, pp_ranks: tuple[int, ...]) -> ProcessGroup | None:
        """The group of this rank's pp group members at pp coordinates `pp_ranks` (the pp group
        itself when they are all of them): the ranks holding a tied parameter. This rank is one."""
        if len(pp_ranks) == self.mesh.size(MeshAxis.PP):
            return self.group((MeshAxis.PP,))
        if pp_ranks not in self._pp_subsets:
            raise PassError(f"no process group for pp ranks {list(pp_ranks)}",
                            hint="list them in MeshGroups(pp_subsets=...) on every rank")
        return self._pp_subsets[pp_ranks]

    def size(self, axes: Iterable[MeshAxis]) -> int:
        return self.mesh.size(*self._key(axes))

    def index(self, axes: Iterable[MeshAxis]) -> int:
        """This rank's position in the group of `axes` (first axis outermost)."""
        index = 0
        for axis in self._key(axes):
            index = index * self.mesh.size(axis) + self.coords[axis]
        return index

    def members(self, axes: Iterable[MeshAxis]) -> tuple[int, ...]:
        """The global ranks of this rank's group over `axes`, in group-index order."""
        return tuple(self.mesh.group_ranks(self._key(axes), self.rank))

    def positions(self, axes: Iterable[MeshAxis]) -> tuple[int, ...]:
        """For each process-group rank, its group index (the identity unless torch sorted the group)."""
        return self._positions[key] if (key := self._known(axes)) else (0,)

    # ---- construction -------------------------------------------------------------
    def _key(self, axes: Iterable[MeshAxis]) -> Axes:
        """Normalise: MeshAxis values, size-1 axes dropped (they do not change the order)."""
        key = tuple(MeshAxis(a) for a in axes)
        if len(set(key)) != len(key):
            raise PassError(f"axes {','.join(key)} name an axis twice")
        return tuple(a for a in key if self.mesh.size(a) > 1)

    def _known(self, axes: Iterable[MeshAxis]) -> Axes:
        key = self._key(axes)
        if key and key not in self._groups:
            raise PassError(
                f"no process group for axes {','.join(key)}",
                hint="composite groups must be listed in MeshGroups(axis_sets=...) on every rank",
            )
        return key

    def _add(self, axes: Axes, group: ProcessGroup, *, exact: bool) -> None:
        members = self.mesh.group_ranks(axes, self.rank)
        got = tuple(dist.get_process_group_ranks(group))
        if sorted(got) != sorted(members) or (exact and got != members):
            raise PassError(
                f"process group for {','.join(axes)} on rank {self.rank} has ranks {list(got)}, "
                f"expected {list(members)}"
            )
        self._groups[axes] = group
        self._positions[axes] = tuple(members.index(r) for r in got)

    def _composite(self, axes: Axes) -> None:
        """A flattened DeviceMesh slice when it has the right order, else `new_group`."""
        group = self._flattened(axes)
        members = self.mesh.group_ranks(axes, self.rank)
        ok = group is not None and tuple(dist.get_process_group_ranks(group)) == members
        # Every rank must take the same branch below, since new_group is collective.
        flag = torch.tensor([int(ok)], device=self._flag_device())
        dist.all_reduce(flag, op=dist.ReduceOp.MIN)
        if bool(flag.item()):
            assert group is not None
            return self._add(axes, group, exact=True)
        options = {"sort_ranks": False} if KEEPS_ORDER else {}
        for ranks in self.mesh.all_groups(axes):
            created = dist.new_group(list(ranks), **options)
            if self.rank in ranks:
                self._add(axes, created, exact=KEEPS_ORDER)

    def _pp_subset(self, pp_ranks: tuple[int, ...]) -> None:
        """`new_group` for the members at `pp_ranks` of every pp group (collective: every rank
        creates them all, in the same order); this rank keeps its own when it is a member."""
        options = {"sort_ranks": False} if KEEPS_ORDER else {}
        for line in self.mesh.all_groups((MeshAxis.PP,)):  # each ordered by pp coordinate
            ranks = tuple(line[r] for r in pp_ranks)
            created = dist.new_group(list(ranks), **options) if len(ranks) > 1 else None
            if self.rank in ranks:
                self._pp_subsets[pp_ranks] = created

    def _flattened(self, axes: Axes) -> ProcessGroup | None:
        """DeviceMesh slicing needs the axes in mesh order; `_flatten` is private API."""
        try:
            sub = self.device_mesh[tuple(str(a) for a in axes)]
            return sub._flatten("_".join(axes)).get_group()
        except (AttributeError, KeyError, RuntimeError, ValueError, TypeError):
            return None

    def _flag_device(self) -> torch.device:
        if self.device_type == "meta":  # a rehearsal's flag needs a value: the fake group moves nothing
            return torch.device("cpu")
        if self.device_type == "cuda":
            return torch.device("cuda", torch.cuda.current_device())
        return torch.device(self.device_type)
