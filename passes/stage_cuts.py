"""Where the pipeline's chunks are cut: balanced by cost, or as a layout given in layers says.

`partition` cuts the units' costs (`passes/stage_costs.py`) into contiguous ranges so
that the most expensive is as cheap as it can be; `balance_v` then evens out the rank
pairs of a V schedule (DualPipeV); `layout_ranges` turns layers per chunk
(`--pp-layout`) into unit ranges. The model's own marks are `stages.marked_ranges`.
"""

from __future__ import annotations

from fivedc.errors import PlanError
from fivedc.ir.graph import Graph
from fivedc.passes.stages import units


def partition(costs: list[float], parts: int, *, what: str = "units") -> list[tuple[int, int]]:
    """Contiguous ranges, `parts` of them, each non-empty, minimising the largest sum."""
    check_enough(len(costs), parts, what)
    low, high = max(costs), sum(costs)
    for _ in range(60):
        if high - low <= high * 1e-13:  # closer than `_greedy`'s tolerance tells apart
            break
        mid = (low + high) / 2
        if _groups_needed(costs, mid) <= parts:
            high = mid
        else:
            low = mid
    ranges = _greedy(costs, high)
    while len(ranges) < parts:  # split the largest multi-unit range; the maximum cannot grow
        k = max((i for i, (a, b) in enumerate(ranges) if b - a > 1), key=lambda i: sum(costs[slice(*ranges[i])]))
        a, b = ranges[k]
        cut = _best_cut(costs, a, b)
        ranges[k:k + 1] = [(a, cut), (cut, b)]
    return ranges


def check_enough(n: int, parts: int, what: str) -> None:
    if n < parts:
        raise PlanError(f"the model has {n} {what} but the pipeline needs {parts} chunks",
                        hint=f"use pp * virtual stages <= {n}")


def _groups_needed(costs: list[float], limit: float) -> int:
    return len(_greedy(costs, limit))


def _greedy(costs: list[float], limit: float) -> list[tuple[int, int]]:
    ranges, start, total = [], 0, 0.0
    for i, cost in enumerate(costs):
        if total + cost > limit * (1 + 1e-12) and i > start:
            ranges.append((start, i))
            start, total = i, 0.0
        total += cost
    ranges.append((start, len(costs)))
    return ranges


def _best_cut(costs: list[float], a: int, b: int) -> int:
    return min(range(a + 1, b), key=lambda c: max(sum(costs[a:c]), sum(costs[c:b])))


def layout_ranges(layers_per_chunk: tuple[int, ...], graph: Graph) -> list[tuple[int, int]]:
    """Unit ranges for a layout given in repeat layers per chunk; the ops before the
    first layer join the first chunk, the ops after the last layer the last chunk."""
    all_units = units(graph)
    layer_units = [i for i, u in enumerate(all_units) if u.layer is not None]
    if sum(layers_per_chunk) != len(layer_units) or min(layers_per_chunk) < 0:
        raise PlanError(f"the layout {','.join(map(str, layers_per_chunk))} places {sum(layers_per_chunk)} layers, "
                        f"but the model has {len(layer_units)}", hint="give one count per chunk, summing to the layers")
    ranges, position = [], 0
    for k, count in enumerate(layers_per_chunk):
        first = 0 if k == 0 else layer_units[position]
        position += count
        stop = len(all_units) if k == len(layers_per_chunk) - 1 else layer_units[position]
        if stop <= first:
            raise PlanError(f"chunk {k} of the layout {','.join(map(str, layers_per_chunk))} would be empty",
                            hint="give every chunk at least one layer (the first and last may take only ops)")
        ranges.append((first, stop))
    return ranges


def balance_v(costs: list[float], ranges: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """DualPipeV's rank r runs chunks r and 2p-1-r: move units across chunk boundaries
    while that lowers the ranks' pair costs, largest first (compared as sorted lists, so
    a tie at the top still lets the next one come down), starting from chunks balanced
    one by one."""
    n = len(ranges)
    cuts = [b for _, b in ranges[:-1]]  # chunk k is [cuts[k-1], cuts[k])

    sums: dict[tuple[int, int], float] = {}  # a move changes one or two chunks: the others' sums are kept

    def chunk_sum(a: int, b: int) -> float:
        if (a, b) not in sums:
            sums[a, b] = sum(costs[a:b])
        return sums[a, b]

    def pairs(cuts: list[int]) -> list[float]:
        bounds = [0, *cuts, ranges[-1][1]]
        chunk = [chunk_sum(bounds[k], bounds[k + 1]) for k in range(n)]
        return sorted((chunk[r] + chunk[n - 1 - r] for r in range(n // 2)), reverse=True)

    end = ranges[-1][1]
    moves = [((k, step),) for k in range(n - 1) for step in (-1, 1)]  # one boundary, or it and its mirror
    moves += [((k, a), (n - 2 - k, b)) for k in range((n - 1) // 2) for a in (-1, 1) for b in (-1, 1)]
    best = pairs(cuts)
    improved = True
    while improved:
        improved = False
        for move in moves:
            moved = list(cuts)
            for k, step in move:
                moved[k] += step
            if not all(a < b for a, b in zip([0, *moved], [*moved, end])):
                continue
            trial = pairs(moved)
            if _lower(trial, best):
                cuts, best, improved = moved, trial, True
    bounds = [0, *cuts, ranges[-1][1]]
    return [(bounds[k], bounds[k + 1]) for k in range(n)]


def _lower(trial: list[float], best: list[float]) -> bool:
    """Whether `trial` (pair costs, largest first) is lower than `best`, lexicographically."""
    for x, y in zip(trial, best):
        if abs(x - y) > 1e-9 * max(abs(y), 1.0):
            return x < y
    return False
