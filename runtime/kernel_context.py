"""What a kernel knows of where it runs: `KernelContext`, and `align` for matching dims by name.

A `KernelContext` knows this rank's coordinates, its groups, and the sequence layout
(global positions of a local chunk, for RoPE and the causal mask; the storage order of
a sequence or an experts dim; the cp ring for ring attention). `align` permutes and
unsqueezes a tensor to another's dim order. The kernels themselves are
`runtime/kernels.py`'s table.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import Tensor

from fivedc.errors import NotSupportedError
from fivedc.ir.graph import Graph, Op
from fivedc.ir.mesh import Mesh, MeshAxis
from fivedc.ir.seq_layout import layout_order
from fivedc.ir.sharding import Sharding
from fivedc.runtime.attention_ring import Ring


def index_device(device: torch.device) -> torch.device:
    """Where positions and other indices whose values the runtime reads live: beside the data,
    except on the meta device (a rehearsal), which has no values: there on the CPU."""
    return torch.device("cpu") if torch.device(device).type == "meta" else device

Dims = tuple[str, ...]


@dataclass(frozen=True)
class KernelContext:
    graph: Graph
    mesh: Mesh
    coords: dict[MeshAxis, int]
    groups: object | None = None  # runtime.groups.MeshGroups; None on a single device
    fp8_blocks: int = 1  # float8 linears: blocks of batch rows scaled apart (the reference; runtime/fp8.py)
    _cache: dict = field(default_factory=dict, compare=False, repr=False)
    # cross-entropy op -> its count of targets for the whole step, set by a pipeline before its microbatches
    step_counts: dict = field(default_factory=dict, compare=False, repr=False)

    def shard_range(self, dim: str, sharding: Sharding, coords: dict[MeshAxis, int] | None = None) -> tuple[int, int]:
        """Global [start, stop) of this rank's (or `coords`') chunk of `dim` (axes major-first)."""
        coords = coords or self.coords
        index = 0
        axes = sharding.axes_of(dim)
        for axis in axes:
            index = index * self.mesh.size(axis) + coords[axis]
        size = self.graph.local_size(dim, sharding, self.mesh)
        return index * size, (index + 1) * size

    def group(self, axes: tuple[MeshAxis, ...]):
        return self.groups.group(axes) if self.groups is not None else None

    # ---- the sequence layout (fivedc/ir/seq_layout.py) ------------------------------------
    def seq_order(self) -> Tensor | None:
        """The global position at each index of a layout-ordered sequence; None when
        the layout is the identity (cp = 1 or contiguous)."""
        if "order" not in self._cache:
            seq, cp = self.graph.seq_dim, self.mesh.size(MeshAxis.CP)
            order = layout_order(self.graph.seq_layout, self.graph.dim(seq), cp) if seq else []
            identity = order == list(range(len(order)))
            self._cache["order"] = None if identity else torch.tensor(order)
        return self._cache["order"]

    def storage_order(self, dim: str, sharding: Sharding) -> Tensor | None:
        """How a full tensor's `dim` is reordered before its chunks are cut, or None:
        the sequence in layout order; an experts dim split over ep by the placement
        (strided or explicit: rank r's experts stored together, in its order)."""
        if dim == self.graph.seq_dim:
            return self.seq_order()
        if MeshAxis.EP in sharding.axes_of(dim):
            if "experts" not in self._cache:
                self._cache["experts"] = _expert_orders(self.graph, self.mesh)
            return self._cache["experts"].get(dim)
        return None

    def positions(self, dim: str, sharding: Sharding, coords: dict[MeshAxis, int] | None = None) -> Tensor:
        """Global positions of this rank's chunk of `dim` (the sequence in layout order)."""
        start, stop = self.shard_range(dim, sharding, coords)
        order = self.seq_order() if dim == self.graph.seq_dim else None
        return torch.arange(start, stop) if order is None else order[start:stop]

    def ring(self, sharding: Sharding, device: torch.device) -> Ring:
        """The cp ring for K/V blocks split like `sharding`: neighbours and block positions."""
        if "ring" not in self._cache:
            cp_axes = (MeshAxis.CP,)
            members = self.mesh.group_ranks(cp_axes, self.mesh.rank_of(self.coords))
            index, size = self.coords[MeshAxis.CP], len(members)
            blocks = tuple(
                self.positions(self.graph.seq_dim, sharding, {**self.coords, MeshAxis.CP: j}).to(index_device(device))
                for j in range(size)
            )
            self._cache["ring"] = Ring(
                group=self.group(cp_axes), index=index, size=size,
                prev_rank=members[(index - 1) % size], next_rank=members[(index + 1) % size],
                block_positions=blocks,
            )
        return self._cache["ring"]


def _expert_orders(graph: Graph, mesh: Mesh) -> dict[str, Tensor]:
    """Experts dim -> storage order, for MoE ops whose placement is not contiguous."""
    from fivedc.ir.graph import Repeat, walk_ops
    from fivedc.passes.experts import ExpertLayout

    ep = mesh.size(MeshAxis.EP)
    params = {p.name: p for p in graph.body.params}
    orders: dict[str, list[int]] = {}
    for node, _ in walk_ops(graph.body):
        if isinstance(node, Repeat):
            params.update({p.name: p for p in node.body.params})
        if not (isinstance(node, Op) and node.kind == "moe" and ep > 1):
            continue
        dim = params[node.args[2]].dims[0]
        layout = ExpertLayout.of(node, graph.dim(dim), ep)
        order = [e for r in range(ep) for e in layout.local_experts(r)]
        if orders.setdefault(dim, order) != order:
            raise NotSupportedError(
                f"two MoE layers place the experts of dim {dim!r} differently", loc=node.loc,
                hint="give every layer the same @ep placement, or name their experts dims apart",
            )
    return {dim: torch.tensor(order) for dim, order in orders.items() if order != sorted(order)}


def align(t: Tensor, dims: Dims, target: Dims) -> Tensor:
    """View `t` (dims a subset of `target`) in `target`'s dim order, size 1 where absent."""
    order = [d for d in target if d in dims]
    t = t.permute([dims.index(d) for d in order])  # a list: a scalar (no dims) permutes too
    shape = [t.shape[order.index(d)] if d in dims else 1 for d in target]
    return t.reshape(shape)
