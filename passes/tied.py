"""Parameters that several pipeline stages hold: tied weights, as Megatron keeps them.

A parameter used in two places along the model (the input embedding's table that is
also the output head's weight: GPT-2, Gemma, Llama 3.2, torchtune's `TiedLinear`)
is one IR parameter. When the pipeline puts its uses in chunks on different pp ranks,
each of those ranks holds a copy of it, with the one layout the parameter has
(vocab-parallel under tp, the same ZeRO chunks over its data-parallel group). The
copies start equal (every rank starts from the same values), and after the last
microbatch's backward, before the gradient sync, each rank's gradient of its uses
is summed with the others' by an all-reduce over the pp ranks that hold it (one
group per coordinate of the other axes): every copy then has the gradient of all
uses and takes the same update, so they stay equal. Megatron does the same for its
embedding group (`_allreduce_word_embedding_grads`).

Only top-level parameters can be shared (a repeat's layer parameters belong to one
layer, so to one chunk). DualPipe already runs two copies of every chunk on pp ranks
r and p-1-r and adds their gradients after the sync (`param_sync.copy_sync_collectives`);
a parameter whose holders are exactly such a pair is left to that exchange, any other
set of holders is summed here, and DualPipe's exchange then leaves it out.
"""

from __future__ import annotations

from dataclasses import dataclass

from fivedc.ir.graph import Graph
from fivedc.passes.chunk_params import chunk_param_names, outer_params, unit_top_params
from fivedc.passes.stages import PipelineSpec, units


@dataclass(frozen=True, slots=True)
class TiedGroup:
    """Top-level parameters held by the same pp ranks (more than one), summed together."""

    pp_ranks: tuple[int, ...]  # ascending
    names: tuple[str, ...]  # sorted: the order of the flat buffer every holder sums


def top_param_holders(graph: Graph, spec: PipelineSpec) -> dict[str, tuple[int, ...]]:
    """Every top-level parameter a chunk reads -> the pp ranks whose chunks read it, ascending."""
    all_units = units(graph)
    items = graph.body.items
    top = {p.name for p in graph.body.params}
    holders: dict[str, set[int]] = {}
    read_by_repeat: dict[int, set[str]] = {}  # what each repeat's body reads, the same for all its layers
    for chunk in spec.chunks:
        for unit in all_units[chunk.units[0]:chunk.units[1]]:
            if unit.layer is None:
                names = unit_top_params(items, unit, top)
            elif unit.start in read_by_repeat:
                names = read_by_repeat[unit.start]
            else:
                names = read_by_repeat[unit.start] = outer_params(items[unit.start], top)
            for name in names:
                holders.setdefault(name, set()).add(chunk.rank)
    return {name: tuple(sorted(ranks)) for name, ranks in holders.items()}


def tied_groups(graph: Graph, spec: PipelineSpec | None, pp: int) -> tuple[TiedGroup, ...]:
    """The groups of tied parameters a pipeline sums over their holders, by holder set
    (ascending): every rank of a set issues its all-reduces in this order."""
    if spec is None:
        return ()
    by_ranks: dict[tuple[int, ...], list[str]] = {}
    for name, ranks in top_param_holders(graph, spec).items():
        if len(ranks) > 1 and not _copy_pair(spec, ranks, pp):
            by_ranks.setdefault(ranks, []).append(name)
    return tuple(TiedGroup(ranks, tuple(sorted(names))) for ranks, names in sorted(by_ranks.items()))


def tied_names(graph: Graph, spec: PipelineSpec | None, pp: int) -> frozenset[str]:
    return frozenset(n for group in tied_groups(graph, spec, pp) for n in group.names)


def _copy_pair(spec: PipelineSpec, ranks: tuple[int, ...], pp: int) -> bool:
    """DualPipe: pp ranks r and p-1-r hold the two copies of the same chunks (their own exchange)."""
    return spec.kind.pipelines > 1 and len(ranks) == 2 and ranks[0] + ranks[1] == pp - 1


def holder_sets(graph: Graph, spec: PipelineSpec | None, pp: int) -> tuple[tuple[int, ...], ...]:
    """The sets of pp ranks that need a process group of their own for the tied sums
    (those that are not the whole pp axis)."""
    return tuple(g.pp_ranks for g in tied_groups(graph, spec, pp) if len(g.pp_ranks) < pp)


def shared_instances(graph: Graph, spec: PipelineSpec | None) -> dict[str, tuple[int, ...]]:
    """Every parameter instance that more than one pp rank holds (a tied one; under DualPipe
    every one) -> those pp ranks, ascending: a piece of it counts once, on the first
    (the gradient norm, a checkpoint's writer: `runtime/reshard.first_holder`)."""
    if spec is None:
        return {}
    holders: dict[str, list[int]] = {}
    for r in sorted({c.rank for c in spec.chunks}):
        for name in chunk_param_names(graph, spec, pp_rank=r):
            holders.setdefault(name, []).append(r)
    return {name: tuple(ranks) for name, ranks in holders.items() if len(ranks) > 1}
