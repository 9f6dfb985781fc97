"""Figures of one compiled graph on one mesh, computed once and shared by every plan built from it.

The planning passes (`fivedc/plan/planning.py`: the stage partition, the buckets,
`memory.estimate_memory`, `step_time.estimate_time`) sum, over pipeline chunks and
ranks, per-layer figures: a unit's seconds, what it keeps for backward, its working
set, its parameters' local and ZeRO sizes. Those depend on the graph, the mesh and
the dtype, plus the microbatches and recomputation; not on the schedule, the chunks
or the ZeRO stage. A `Memo` holds them for one (graph, mesh, dtype) and rides on the
planning passes' `Draft`, so `compile_graph` computes each once per plan, and the
layout search (`fivedc/search/search.py`) once for all the candidates that share a
sharded graph: both run the same passes with the same figures, so the search's score
is what `fivedc compile` prints. The memo is optional everywhere: without one each
figure is computed where it is used, to the same value.

A memo is bound to its graph by identity: handing one to a function with another
graph, mesh or dtype is a bug (`PassError`), never a silently wrong figure.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable
from typing import TypeVar

from fivedc.errors import PassError
from fivedc.passes.held_params import HeldParams, held_params
from fivedc.ir.graph import walk_params
from fivedc.estimates.saved import SaveContext
from fivedc.instructions.done_again import done_again
from fivedc.instructions.unit_program import distinct_units, unit_instructions
from fivedc.passes.stages import PipelineSpec, units

T = TypeVar("T")


# Figures that follow from the mesh's sizes, not from its rank order (which only places
# ranks on nodes, so it changes collectives' seconds): the memos of one graph on the rank
# orders of one mesh may share them (`Memo.sharing`; the layout search does).
ORDER_FREE = frozenset({
    "units", "boundaries", "unit costs", "copy sync", "regathers", "partition", "param sizes", "held", "held bytes", "buckets",
    "model flops", "unit saves", "unit own bytes", "deferred", "in flight", "rank activations", "unit transients",
    "kept transients", "zero transients", "kept through", "grads from", "step moments", "kept with grads",
    "unit grads", "chunk activations", "unit instructions",
})


class Memo:
    """Values by key, computed on first use; for one graph, mesh and dtype."""

    __slots__ = ("graph", "mesh", "dtype", "_values", "_shared")

    def __init__(self, graph, mesh, dtype: str) -> None:
        self.graph, self.mesh, self.dtype = graph, mesh, dtype
        self._values: dict[Hashable, object] = {}
        self._shared = self._values

    def sharing(self, mesh) -> Memo:
        """A memo for the same graph on `mesh`, another rank order of the same sizes, sharing
        this one's `ORDER_FREE` figures."""
        if mesh.sizes != self.mesh.sizes:
            raise PassError(f"a memo for mesh {self.mesh} cannot share figures with mesh {mesh}: a bug in fivedc")
        other = Memo(self.graph, mesh, self.dtype)
        other._shared = self._shared
        return other

    def get(self, key: Hashable, compute: Callable[[], T]) -> T:
        values = self._shared if (key if isinstance(key, str) else key[0]) in ORDER_FREE else self._values
        try:
            return values[key]  # type: ignore[return-value]
        except KeyError:
            value = values[key] = compute()
            return value


def memo_for(memo: Memo | None, graph, mesh, dtype: str) -> Memo:
    """`memo` when it is this graph's, mesh's and dtype's; a fresh one when none is given."""
    if memo is None:
        return Memo(graph, mesh, dtype)
    if memo.graph is not graph or memo.mesh != mesh or memo.dtype != dtype:
        raise PassError(f"a memo of figures for mesh {memo.mesh} ({memo.dtype}) was used for mesh {mesh} ({dtype}) "
                        "or another graph: a bug in fivedc")
    return memo


def save_context(memo: Memo, dtype_bytes: int, microbatches: int, recompute: str) -> SaveContext:
    """The sizes of one microbatch's values on one rank (shared by memory and time)."""
    return memo.get(("save context", dtype_bytes, microbatches, recompute), lambda: SaveContext.of(
        memo.graph, memo.mesh, dtype=memo.dtype, dtype_bytes=dtype_bytes, microbatches=microbatches,
        recompute=recompute, again=done_again(memo.graph, memo_unit_instructions(memo, recompute))))


def memo_unit_instructions(memo: Memo, recompute: str) -> dict:
    """Each unit's forward and backward instructions (`unit_program.unit_instructions`), kept in
    `memo`: what its step-time figures price, the same for every hardware and microbatch count."""
    return memo.get(("unit instructions", recompute), lambda: unit_instructions(
        memo.graph, memo.mesh, recompute=recompute, dtype=memo.dtype,
        wanted=list(distinct_units(memo.graph, memo_units(memo)).values())))


def rank_held(memo: Memo, pipeline: PipelineSpec | None, pp_rank: int | None) -> HeldParams | None:
    """What a pp rank's chunks hold (None without a pipeline: everything)."""
    if pipeline is None:
        return None
    ranges = tuple(c.units for c in pipeline.chunks if c.rank == pp_rank)
    return memo.get(("held", ranges), lambda: held_params(memo.graph, pipeline, pp_rank=pp_rank,
                                                         all_units=memo_units(memo)))


def memo_units(memo: Memo) -> list:
    return memo.get("units", lambda: units(memo.graph))


def param_sizes(memo: Memo) -> list[tuple]:
    """Per parameter (in `walk_params` order): (param, its repeat, local elements, the ZeRO
    chunk a rank owns, the size of its gradient's group)."""
    def sizes() -> list[tuple]:
        graph, mesh, out = memo.graph, memo.mesh, []
        for param, repeat in walk_params(graph.body):
            local = graph.local_numel(param.dims, param.sharding, mesh)
            group = mesh.size(*param.grad_partial)
            out.append((param, repeat, local, -(-local // group), group))
        return out
    return memo.get("param sizes", sizes)
