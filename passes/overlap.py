"""Overlap scheduling: gradient buckets in backward order, and what each collective hides behind.

Gradients are summed in buckets rather than one collective per parameter. A
bucket holds parameters with the same ZeRO group (their `grad_partial` axes), in
the order backward produces their gradients (the reverse of first use), and
closes when it reaches the bucket size. Buckets never span a pipeline chunk (each
pp rank sums the gradients of the parameters it holds) nor a layer boundary: a
repeat body's buckets are planned once and run once per layer (the plan stays the
size of one layer, whatever the depth). With overlap on, the runtime starts a
bucket's reduction from the backward hook of its last gradient, in the plan's
order, while backward computes the layers before it; with overlap off it reduces
every bucket after backward. ZeRO-3 without a pipeline gathers and reduce-scatters
by the same buckets, as FSDP2 by module (`runtime/zero3.py`): each bucket is a
group gathered at its first read and prefetched one group ahead; its reduce-scatter
runs inside backward once the group's last gradient is computed. The ZeRO gathers
that happen once per step (ZeRO-1/2 after the update, ZeRO-3 under a pipeline
before the first microbatch) go by the same buckets.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from fivedc.ir.graph import Block, Graph, Op, Param, Repeat
from fivedc.ir.mesh import Mesh, MeshAxis


@dataclass(frozen=True, slots=True)
class Bucket:
    index: int  # launch order in backward
    params: tuple[str, ...]  # qualified names; `layers.*.wq` for a repeat body's (one bucket per layer)
    axes: tuple[MeshAxis, ...]  # the ZeRO group: the parameters' grad_partial axes
    bytes: int  # per execution
    count: int = 1  # executions per step: the layers of a repeat body

    @property
    def repeat(self) -> str | None:
        """The repeat whose layers each run this bucket, if any."""
        first = self.params[0]
        return first.split(".*.")[0] if ".*." in first else None


def plan_buckets(graph: Graph, mesh: Mesh, *, param_bytes, bucket_bytes: int,
                 cuts: frozenset[int] = frozenset(), apart: tuple[tuple[str, ...], ...] = ()) -> tuple[Bucket, ...]:
    """Buckets in backward order. `param_bytes(param)` is what one parameter adds; `cuts`
    are the top-level items where a pipeline chunk begins (a bucket never spans one:
    each pp rank syncs the gradients of its own chunks); `apart`: groups of top-level
    parameters that several pp ranks hold (tied weights, `passes/tied.py`), each
    bucketed on its own, last, so that every bucket is held whole by the ranks that run it."""
    buckets: list[Bucket] = []
    params = {p.name: p for p in graph.body.params}
    separate = [([params[n] for n in names], None) for names in apart]
    for segment, repeat in reversed(separate + _segments(graph.body, cuts, {n for g in apart for n in g})):
        open_: dict[tuple, list[Param]] = {}
        for param in reversed(segment):
            if mesh.size(*param.grad_partial) == 1:
                continue
            group = open_.setdefault(param.grad_partial, [])
            group.append(param)
            if sum(param_bytes(p) for p in group) >= bucket_bytes:
                buckets.append(_bucket(len(buckets), open_.pop(param.grad_partial), repeat, param_bytes))
        for group in open_.values():
            buckets.append(_bucket(len(buckets), group, repeat, param_bytes))
    return tuple(buckets)


def _bucket(index: int, params: list[Param], repeat: Repeat | None, param_bytes) -> Bucket:
    names = tuple(f"{repeat.name}.*.{p.name}" if repeat else p.name for p in params)
    return Bucket(index, names, params[0].grad_partial, sum(param_bytes(p) for p in params),
                  repeat.count if repeat else 1)


def _segments(body: Block, cuts: frozenset[int], apart: set[str]) -> list[tuple[list[Param], Repeat | None]]:
    """The parameters in order of first use (but those `apart`), cut at repeat boundaries and at `cuts`.
    Top-level parameters first read inside a repeat's body (a scale every layer shares) are a
    top-level segment of their own just before the repeat's: their gradients are complete once
    backward has run the repeat's first layer, and ZeRO-3, which gathers their group in every
    layer, gathers them alone, not the top-level parameters around them."""
    params = {p.name: p for p in body.params}
    segments: list[tuple[list[Param], Repeat | None]] = [([], None)]
    seen: set[str] = set(apart)
    for index, item in enumerate(body.items):
        if index in cuts:
            segments.append(([], None))
        if isinstance(item, Repeat):
            outer = _first_uses(item.body, {n: p for n, p in params.items() if n not in seen})
            seen.update(p.name for p in outer)
            used = _first_uses(item.body, {p.name: p for p in item.body.params})
            segments += [(outer, None), (used, item), ([], None)]
            continue
        if isinstance(item, Op):
            for arg in item.reads:
                if arg in params and arg not in seen:
                    seen.add(arg)
                    segments[-1][0].append(params[arg])
    return [s for s in segments if s[0]]


def _first_uses(body: Block, params: dict[str, Param]) -> list[Param]:
    order: list[Param] = []
    for item in body.items:
        if isinstance(item, Op):
            for arg in item.reads:
                if arg in params and params[arg] not in order:
                    order.append(params[arg])
    return order


def expand_buckets(buckets: Sequence[Bucket]) -> list[tuple[str, ...]]:
    """Parameter instances per bucket execution, in launch order."""
    return [names for names, _ in expand_units(buckets)]


TOP_UNIT = ("", -1)  # the unit of the top-level parameters


def expand_units(buckets: Sequence[Bucket]) -> list[tuple[tuple[str, ...], tuple[str, int]]]:
    """Per bucket execution, in launch order: its parameter instances and its unit, the
    (repeat, layer) it runs for or `TOP_UNIT` (ZeRO-3 keeps a unit's groups gathered
    while the unit runs: `runtime/zero3.py`)."""
    out: list[tuple[tuple[str, ...], tuple[str, int]]] = []
    i = 0
    while i < len(buckets):
        repeat = buckets[i].repeat
        if repeat is None:
            out.append((buckets[i].params, TOP_UNIT))
            i += 1
            continue
        j = i
        while j < len(buckets) and buckets[j].repeat == repeat:
            j += 1
        for layer in reversed(range(buckets[i].count)):
            out += [(tuple(p.replace(".*.", f".{layer}.", 1) for p in b.params), (repeat, layer))
                    for b in buckets[i:j]]
        i = j
    return out
