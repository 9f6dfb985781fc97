"""Where an MoE block keeps its experts' weights, read off their names and shapes.

The fx frontend's MoE probe (`fivedc/frontends/fx/moe.py`) needs the block's expert weights
as the IR's three [experts, in, out] matrices (gate, up, down). They are stacked
parameters ([experts, a, b], two or three of them), or an `nn.ModuleList` of alike expert
modules with two or three 2-D weights each; `weight_readings` lists every assignment of
them to gate, up and down (a fused gate-up split in halves) whose shapes fit, and the probe
keeps the one whose output is the block's.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import torch
from torch import Tensor, nn


@dataclass(frozen=True, slots=True)
class ExpertWeight:
    """Where one of the IR's expert weights lives in the block."""

    keys: tuple[str, ...]  # relative to the block: one stacked [experts, a, b], or one [a, b] per expert
    transposed: bool  # stored [.., out, in] as nn.Linear stores it (the IR's is [.., in, out])
    half: int | None = None  # a fused gate-up: the first (0) or second (1) half of its output dim
    per_expert: bool = False  # keys are the experts' own weights (an nn.ModuleList), stacked by the IR

    def ir_value(self, params: dict[str, Tensor]) -> Tensor:
        """[experts, in, out] from the block's parameters by name."""
        w = torch.stack([params[k] for k in self.keys]) if self.per_expert else params[self.keys[0]]
        if self.half is not None:
            axis = -2 if self.transposed else -1
            n = w.shape[axis] // 2
            w = w.narrow(axis, self.half * n, n)
        return w.transpose(-2, -1) if self.transposed else w



def expert_lists(m: nn.Module) -> dict[str, tuple[int, list[tuple[str, tuple[int, ...]]]]]:
    """ModuleLists of alike expert modules with two or three 2-D weights each: name -> (experts, one's weights)."""
    out = {}
    for name, sub in m.named_modules():
        if not isinstance(sub, nn.ModuleList) or not len(sub):
            continue
        weights = [[(n, tuple(p.shape)) for n, p in e.named_parameters()] for e in sub]
        if all(w == weights[0] for w in weights) and len(weights[0]) in (2, 3) and all(len(s) == 2 for _, s in weights[0]):
            out[name] = (len(sub), weights[0])
    return out


def expert_sets(params, lists, in_lists, experts: int):
    """(ModuleList or "", weight names, stacked shapes) of the expert weights over `experts` experts."""
    stacked = [n for n, p in params.items() if p.dim() == 3 and p.shape[0] == experts and n not in in_lists]
    if len(stacked) in (2, 3):
        yield "", stacked, [tuple(params[n].shape) for n in stacked]
    for name, (count, weights) in lists.items():
        if count == experts:
            yield name, [n for n, _ in weights], [(experts, *s) for _, s in weights]


def weight_readings(listed: str, names: list[str], shapes: list[tuple], hidden: int, experts: int):
    """Every assignment of the weights to gate, up and down whose shapes fit [experts, hidden, ffn] and
    [experts, ffn, hidden] (a fused gate-up [experts, hidden, 2 ffn])."""

    def keys(i: int) -> tuple[str, ...]:
        return (names[i],) if not listed else tuple(f"{listed}.{e}.{names[i]}" for e in range(experts))

    def weight(i: int, flip: bool, half: int | None = None) -> ExpertWeight:
        return ExpertWeight(keys(i), flip, half, bool(listed))

    def laid(i: int, flip: bool) -> tuple:
        s = shapes[i]
        return (s[0], s[2], s[1]) if flip else s

    found = []
    n = len(names)
    for order in itertools.permutations(range(n)):
        for flips in itertools.product((False, True), repeat=n):
            ls = [laid(i, f) for i, f in zip(order, flips)]
            if n == 3:
                g, u, d = ls
                if g == u and g[1] == hidden and d == (experts, g[2], hidden):
                    found.append(tuple(weight(i, f) for i, f in zip(order, flips)))
            else:
                fused, d = ls
                if fused[1] == hidden and fused[2] % 2 == 0 and d == (experts, fused[2] // 2, hidden):
                    (i, fi), (j, fj) = zip(order, flips)
                    for gate in (0, 1):
                        found.append((weight(i, fi, gate), weight(i, fi, 1 - gate), weight(j, fj)))
    return tuple(found)
