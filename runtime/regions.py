"""Compiled regions: each repeat's layer body as one `torch.compile` region.

With `compile=True` (`parallelize(..., compile=True)`; a string names torch.compile's backend) a
`Program` runs every layer of a repeat through one compiled function of tensors only:
(the values carried in, the layer's parameters, the values it reads from outside) ->
its yields. The IR walk happens while Dynamo traces; the compiled graph has only
the kernels' tensor ops, so one compilation serves every layer of the repeat (the
same shapes, other tensors) and backward compiles with it (AOTAutograd). Everything
outside repeats (embedding, head, loss) and the collectives between ranks run as
before: a collective inside a body is a graph break, which splits the region but
changes no result. Not compiled: layers that are recomputed as a whole (their
region is a checkpoint already) and a run traced op by op (verify's diagnosis reads
every value).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
from torch import Tensor

from fivedc.ir.graph import Repeat, outer_reads


@dataclass(frozen=True)
class RegionInputs:
    """What one layer of a repeat reads, by name: its body's params, the outer parameters and
    the outer values it uses (the carried values are the body's args)."""

    body_params: tuple[str, ...]
    outer_params: tuple[str, ...]
    outer_values: tuple[str, ...]

    @staticmethod
    def of(item: Repeat, scope: dict[str, str]) -> RegionInputs:
        body_params = tuple(p.name for p in item.body.params)
        reads = sorted(outer_reads(item.body) - set(item.body.args) - set(body_params))
        return RegionInputs(body_params, tuple(n for n in reads if n in scope),
                            tuple(n for n in reads if n not in scope))


class CompiledLayers:
    """The compiled function of each repeat of a program (compiled on first use)."""

    def __init__(self, program, backend: str = "inductor") -> None:
        self.program, self.backend = program, backend
        self._compiled: dict[str, tuple[RegionInputs, Callable]] = {}

    def run(self, item: Repeat, env: dict, dims: dict, params, scope: dict, inner: dict) -> None:
        """One layer of `item`: reads `env` (its args bound already), writes its yields."""
        if item.name not in self._compiled:  # the first layer runs eagerly once: it fills the kernels'
            self.program._block(item.body, env, dims, params, inner, item, None)  # caches (RoPE tables)
            self._compiled[item.name] = self._compile(item, dims, inner)
            return
        reads, fn = self._compiled[item.name]
        carried = [env[a] for a in item.body.args]
        weights = [params[inner[n]] for n in reads.body_params] + [params[scope[n]] for n in reads.outer_params]
        outer = [env[n] for n in reads.outer_values]
        for name, value in zip(item.body.yields, fn(carried, weights, outer)):
            env[name] = value

    def _compile(self, item: Repeat, dims: dict, inner: dict) -> tuple[RegionInputs, Callable]:
        """The region, its parameters named as the first layer's (every layer's have the same dims)."""
        reads = RegionInputs.of(item, inner)
        program, body = self.program, item.body
        known = {n: dims[n] for n in (*body.args, *reads.outer_values)}  # the same for every layer
        fixed_scope = {n: inner[n] for n in (*reads.body_params, *reads.outer_params)}
        names = tuple(fixed_scope.values())

        def layer(carried: list[Tensor], weights: list[Tensor], outer: list[Tensor]) -> list[Tensor]:
            env = dict(zip(body.args, carried))
            env.update(zip(reads.outer_values, outer))
            program._block(body, env, dict(known), dict(zip(names, weights)), fixed_scope, item, None)
            return [env[y] for y in body.yields]

        return reads, torch.compile(layer, dynamic=False, backend=self.backend)


