"""Memory over a step without a pipeline: what is live together at each moment, and the peak.

Without a pipeline a rank's step is one microbatch: forward unit by unit (the loss in
the last), backward unit by unit in reverse, the gradient sums, the optimizer step.
Parameters and optimizer state are held throughout; the rest comes and goes:

    forward of unit u    what units 0..u keep for backward, no gradient (the last step
                         freed them), and u's momentary buffers: its working set, the
                         loss's (2 x the logits), MoE's all-to-all, attention's buffers,
                         ZeRO-3's gathered group and the next one, prefetched
    backward of unit u   what units 0..u still keep, the gradients of units u.. (u's being
                         made; a tied parameter's once), and u's buffers: its recomputed
                         region, the loss beside its put-off head dW, weight gradients put
                         off behind a sum, MoE's and attention's, ZeRO-3's group gathered
                         again (and the next, prefetched)
    end of u's backward  u's gradients are made and what it kept is freed: with overlap a
                         bucket starts its sum (ZeRO-0 one flat copy, ZeRO-2 two laid out
                         whole), ZeRO-3 reduce-scatters u's gradients beside its gathered
                         groups
    gradient sums        every gradient, and the buckets in flight: ZeRO-0 and ZeRO-1
                         copy a bucket into one flat buffer as its gradients are dropped
                         (one bucket beyond them), ZeRO-2 lays two whole buckets out
    optimizer step       every gradient, and AdamW's temporaries for its largest update

The buffers of a unit are `fivedc/estimates/transient.py`'s parts of that unit, and what a
unit keeps is `fivedc/estimates/activations.py`'s: this module only places them in time.
The peak is the largest moment. Under a pipeline the busiest moment is a backward with
every gradient made and the schedule's microbatches in flight, which `memory.py` sums
directly.
"""

from __future__ import annotations

from dataclasses import dataclass

from fivedc.estimates.activations import chunk_activations, unit_saves
from fivedc.estimates.memo import Memo, memo_units, param_sizes, save_context
from fivedc.ir.graph import Graph, Op, Repeat, walk_params
from fivedc.passes.stages import Unit


@dataclass(frozen=True, slots=True)
class Moment:
    """What a rank holds beyond its parameters and optimizer state at one moment of its step."""

    name: str
    grads: int
    activations: int
    transient: int
    buffer: str = ""  # the transient's name

    @property
    def bytes(self) -> int:
        return self.grads + self.activations + self.transient


@dataclass(frozen=True, slots=True)
class UnitBuffers:
    """One unit's momentary buffers, by moment (name, bytes), the largest of each moment used."""

    forward: tuple[tuple[str, int], ...]
    backward: tuple[tuple[str, int], ...]  # while its backward runs, beside all it keeps
    after: tuple[tuple[str, int], ...] = ()  # once its gradients are made and what it kept is freed


def peak_moment(moments: list[Moment]) -> Moment:
    return max(moments, key=lambda m: m.bytes)


def step_moments(memo: Memo, *, dtype_bytes: int, zero: int, recompute: str, unit_buffers: list[UnitBuffers],
                 sums: tuple[str, int], step: tuple[str, int]) -> list[Moment]:
    """Every moment of a step without a pipeline. `unit_buffers`: per unit its buffers
    (`transient.unit_buffers`); `sums` and `step`: the buffer of the gradient sums and of
    the optimizer step."""
    kept = kept_through(memo, dtype_bytes, recompute)
    grads = grads_from(memo, dtype_bytes, zero)
    out = []
    for u, unit in enumerate(memo_units(memo)):
        name, size = _largest(unit_buffers[u].forward)
        out.append(Moment(f"forward of {_unit_name(memo.graph, unit)}", 0, kept[u], size, name))
    for u, unit in reversed(list(enumerate(memo_units(memo)))):
        name, size = _largest(unit_buffers[u].backward)
        out.append(Moment(f"backward of {_unit_name(memo.graph, unit)}", grads[u], kept[u], size, name))
        if unit_buffers[u].after:
            name, size = _largest(unit_buffers[u].after)
            out.append(Moment(f"end of the backward of {_unit_name(memo.graph, unit)}", grads[u],
                              kept[u - 1] if u else 0, size, name))
    total = grads[0] if grads else 0
    out.append(Moment("gradient sums", total, 0, sums[1], sums[0]))
    out.append(Moment("optimizer step", total, 0, step[1], step[0]))
    return out


def _largest(buffers: tuple[tuple[str, int], ...]) -> tuple[str, int]:
    return max(buffers, key=lambda b: b[1], default=("", 0))


def _unit_name(graph: Graph, unit: Unit) -> str:
    if unit.layer is not None:
        return f"layer {unit.layer} of {graph.body.items[unit.start].name}"
    return unit.describe(graph)


def kept_through(memo: Memo, dtype_bytes: int, recompute: str) -> list[int]:
    """Per unit u: the bytes units 0..u keep for backward (with the constants), one microbatch."""
    def compute() -> list[int]:
        c = save_context(memo, dtype_bytes, 1, recompute)
        all_units, cache = memo_units(memo), memo.get(("unit saves", dtype_bytes, 1, recompute), dict)
        out = []
        for u in range(len(all_units)):
            kept, _, constants = chunk_activations(c, memo.graph, all_units[:u + 1], cache=cache)
            out.append(kept + sum(constants.values()))
        return out
    return memo.get(("kept through", dtype_bytes, recompute), compute)


def grads_from(memo: Memo, dtype_bytes: int, zero: int) -> list[int]:
    """Per unit u: the gradient bytes units u.. have made by the end of u's backward (a
    top-level parameter several units read counted once; ZeRO-2 and 3 hold a chunk of each)."""
    def compute() -> list[int]:
        own, top = unit_grads(memo, dtype_bytes, chunked=zero >= 2)
        seen: set = set()
        made, out = 0, []
        for u in reversed(range(len(own))):
            made += own[u] + sum(nbytes for key, nbytes in top[u] if key not in seen)
            seen.update(key for key, _ in top[u])
            out.append(made)
        return out[::-1]
    return memo.get(("grads from", dtype_bytes, zero), compute)


def unit_grads(memo: Memo, dtype_bytes: int, *, chunked: bool) -> tuple[list[int], list[tuple]]:
    """Per unit, the gradient bytes of a layer's own parameters, and the top-level parameters
    it reads with theirs (several units may read one): whole, or each a ZeRO chunk."""
    def compute() -> tuple[list[int], list[tuple]]:
        sizes = {(param.name, repeat.name if repeat else None): (chunk if chunked else local) * dtype_bytes
                 for param, repeat, local, chunk, _ in param_sizes(memo)}
        own, top = [], []
        for unit in memo_units(memo):
            keys = [key for key in dict.fromkeys(unit_params(memo.graph, unit)) if key in sizes]  # once a unit
            own.append(sum(sizes[key] for key in keys if key[1] is not None))
            top.append(tuple((key, sizes[key]) for key in keys if key[1] is None))
        return own, top
    return memo.get(("unit grads", dtype_bytes, chunked), compute)


def unit_params(graph: Graph, unit: Unit) -> list[tuple[str, str | None]]:
    """(parameter name, its repeat's name) of each parameter a unit reads: a layer reads
    its repeat's own parameters, top-level items the top-level parameters they name."""
    if unit.layer is not None:
        repeat: Repeat = graph.body.items[unit.start]
        return [(p.name, repeat.name) for p, _ in walk_params(repeat.body)]
    top = {p.name for p in graph.body.params}
    return [(a, None) for item in graph.body.items[unit.start:unit.stop] if isinstance(item, Op)
            for a in item.reads if a in top]


def recomputed_regions(memo: Memo, dtype_bytes: int, recompute: str) -> list[int]:
    """Per unit, the region its backward rebuilds (0 where nothing is recomputed)."""
    c = save_context(memo, dtype_bytes, 1, recompute)
    cache = memo.get(("unit saves", dtype_bytes, 1, recompute), dict)
    return [unit_saves(c, memo.graph, unit, cache=cache).transient for unit in memo_units(memo)]
