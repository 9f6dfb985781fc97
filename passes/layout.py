"""Shared knowledge of the sharding rules: mesh, dims, the canonical layout, pairing.

`RuleContext` answers the questions every per-op rule asks: how big a dim is,
which mesh axes are in play (an axis of size 1 is never used), where a partial sum
should land when it must be resolved (the *canonical* layout: batch over the data
axes, and with sequence parallelism the sequence over tp), and whether a dim that a
column-parallel linear would split can stay split until something consumes it
(Megatron's column -> row pairing, found by looking ahead through the graph rather
than from module names).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from fivedc.errors import ShapeError, SourceLoc
from fivedc.ir.aten_layout import whole_dims
from fivedc.ir.graph import Graph, Op, Repeat, TensorType, walk_ops
from fivedc.ir.mesh import Mesh, MeshAxis
from fivedc.ir.ops import OP_SPECS, POINTWISE, OpFamily
from fivedc.ir.sharding import Sharding

# A dim split over tp stays split through them: every pointwise op (fivedc/ir/pointwise.py), and swiglu.
PASS_THROUGH = frozenset(POINTWISE) | frozenset(kind for kind, spec in OP_SPECS.items()
                                                if spec.family == OpFamily.SWIGLU)


def divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


@dataclass(slots=True)
class RuleContext:
    graph: Graph
    mesh: Mesh
    sequence_parallel: bool
    params: set[str]
    dtype_bytes: int = 2
    users: dict[str, list[tuple[Op, int]]] = field(default_factory=dict)
    escaping: set[str] = field(default_factory=set)  # values that leave a block: never kept split
    types: dict[str, TensorType] = field(default_factory=dict)  # of values (not parameters)

    @staticmethod
    def build(graph: Graph, mesh: Mesh, *, sequence_parallel: bool, dtype_bytes: int = 2) -> RuleContext:
        ctx = RuleContext(graph, mesh, sequence_parallel, params=set(), dtype_bytes=dtype_bytes)
        ctx.escaping.update(graph.body.yields)
        ctx.types.update({i.name: i.type for i in graph.inputs})
        for node, _ in walk_ops(graph.body):
            if isinstance(node, Repeat):
                ctx.params.update(p.name for p in node.body.params)
                ctx.types.update(zip(node.body.args, (ctx.types[c] for c in node.carried)))
                ctx.types.update(zip(node.results, (ctx.types[c] for c in node.carried)))
                ctx.escaping.update(node.carried + node.body.yields)
            elif isinstance(node, Op):
                ctx.types[node.out] = node.type
                for index, arg in node.reads_at:
                    ctx.users.setdefault(arg, []).append((node, index))
        ctx.params.update(p.name for p in graph.body.params)
        return ctx

    # ---- sizes ----------------------------------------------------------------------
    def size(self, dim: str) -> int:
        return self.graph.dim(dim)

    def active(self, axis: MeshAxis) -> MeshAxis | None:
        return axis if self.mesh.size(axis) > 1 else None

    @property
    def tp(self) -> MeshAxis | None:
        return self.active(MeshAxis.TP)

    @property
    def cp(self) -> tuple[MeshAxis, ...]:
        """The axes that split the sequence of every activation: (cp,) when cp > 1."""
        return (MeshAxis.CP,) if self.mesh.size(MeshAxis.CP) > 1 else ()

    @property
    def data_axes(self) -> tuple[MeshAxis, ...]:
        return tuple(a for a in (MeshAxis.DP, MeshAxis.EP) if self.mesh.size(a) > 1)

    def check_divisible(self, dim: str, axes: tuple[MeshAxis, ...], loc: SourceLoc | None, why: str) -> None:
        n, parts = self.size(dim), self.mesh.size(*axes)
        if n % parts:
            axis_text = "*".join(axes)
            choices = ", ".join(str(d) for d in divisors(n) if d <= 64)
            raise ShapeError(
                f"{dim}={n} is not divisible by {axis_text}={parts} ({why})",
                loc=loc or self.graph.dim_loc(dim),
                hint=f"choose {axis_text} in {{{choices}}}, or change {dim}",
            )

    # ---- the canonical layout -------------------------------------------------------
    def resolve_partial(self, sharding: Sharding, t: TensorType) -> Sharding:
        """Where a pending sum lands when its consumer leaves the choice free.

        A partial sum over tp becomes a sequence split over tp with sequence
        parallelism (a reduce-scatter; inside the cp split when there is one, so
        `seq:cp*tp`), and a replicated value without (an all-reduce).
        """
        out = sharding.with_partial(())
        seq = self.graph.seq_dim
        for axis in sharding.partial:
            if axis != MeshAxis.TP or not self.sequence_parallel or seq not in t.dims:
                continue
            axes = out.axes_of(seq)
            if axes in ((), self.cp) and self.size(seq) % self.mesh.size(*axes, axis) == 0:
                out = out.with_split(seq, axes + (axis,))
        return out

    def canonical(self, sharding: Sharding, t: TensorType) -> Sharding:
        """The layout of a value that crosses a layer boundary: no pending sums."""
        return self.resolve_partial(sharding, t)

    # ---- Megatron pairing by look-ahead ---------------------------------------------
    def can_stay_split(self, value: str, dim: str, depth: int = 0) -> bool:
        """True if every use of `value` can consume `dim` split over tp without a gather:
        a linear that contracts it (row-parallel), attention over heads, a vocab-parallel
        loss, or elementwise ops whose results can stay split in turn."""
        if value in self.escaping or depth > 64:
            return False
        uses = self.users.get(value, [])
        return bool(uses) and all(self._use_keeps_split(op, index, dim, depth) for op, index in uses)

    def _use_keeps_split(self, op: Op, index: int, dim: str, depth: int) -> bool:
        kind = op.kind
        if kind in ("linear", "matmul"):
            if index != 0 or op.annotation("replicate") or op.annotation("col"):
                return False
            return dim in self._contracted_dims(op)
        if kind in PASS_THROUGH:
            return self.can_stay_split(op.out, dim, depth + 1)
        if kind == "rope":
            return op.type is not None and dim != op.type.dims[-1] and self.can_stay_split(op.out, dim, depth + 1)
        if kind == "attention":
            if op.type is None or index > 2 or dim not in (op.type.dims[2], self._kv_dim(op)):
                return False
            if index > 0 and self.graph.dim(dim) == 1:  # one k/v head (MQA) stays whole: rules.py _attention
                return False
            return self.can_stay_split(op.out, op.type.dims[2], depth + 1)
        if kind == "cross_entropy":
            return index == 0 and self._arg_last_dim(op, 0) == dim
        if kind == "aten":  # computed on shards unless it runs along that dim (fivedc/ir/aten_call.py)
            whole = whole_dims(op)
            return whole is not None and dim not in whole and op.type is not None and dim in op.type.dims \
                and self.can_stay_split(op.out, dim, depth + 1)
        return False


    def _contracted_dims(self, op: Op) -> tuple[str, ...]:
        # Parameter names are scoped per repeat body, so use x and the output only.
        return tuple(d for d in self.types[op.args[0]].dims if d not in op.type.dims)

    def _kv_dim(self, op: Op) -> str:
        return self.types[op.args[1]].dims[2]

    def _arg_last_dim(self, op: Op, index: int) -> str:
        return self.types[op.args[index]].dims[-1]
