"""What backward does again, read from the units' instruction lists.

Recomputation and sequence parallelism make backward do forward work again: a recomputed
op's forward (selective recomputation's attention core), a recomputed layer's whole forward
(full recomputation, at its recompute point), a gathered linear input gathered again for the
weight gradients. The expander places those instructions in each unit's backward
(`unit_program.py`: `FORWARD_AGAIN`, `LAYER_AGAIN`, `GATHER_AGAIN`); `done_again` reads them
back as the three facts the runtime (`runtime/program.py`), the step-time model
(`fivedc/estimates/unit_costs.py`) and the memory model (`fivedc/estimates/saved.SaveContext`)
act on, so that none decides them by its own rule.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from fivedc.instructions.events import COMPUTE, FORWARD_AGAIN, GATHER_AGAIN, LAYER_AGAIN
from fivedc.instructions.unit_program import distinct_units, unit_instructions
from fivedc.ir.graph import Graph, Op, Repeat
from fivedc.ir.mesh import Mesh
from fivedc.passes.stages import units


@dataclass(frozen=True, slots=True)
class DoneAgain:
    """`ops`: (its repeat's name, or None at top level; the op's output) of each op whose
    forward backward redoes on its own; `layers`: the repeats whose layers backward redoes
    whole; `gathered`: SP's gathered values -> the shard kept in each one's place."""

    ops: frozenset[tuple[str | None, str]] = frozenset()
    layers: frozenset[str] = frozenset()
    gathered: dict[str, str] = field(default_factory=dict, compare=False)

    def op(self, op: Op, repeat: Repeat | None) -> bool:
        """Whether backward redoes `op`'s forward on its own (not inside a layer redone whole)."""
        return (repeat.name if repeat is not None else None, op.out) in self.ops

    def layer(self, repeat: Repeat) -> bool:
        """Whether backward redoes each layer of `repeat` whole."""
        return repeat.name in self.layers


def done_again(graph: Graph, listed: dict) -> DoneAgain:
    """The facts of `listed` (`unit_program.unit_instructions`: unit -> its forward and
    backward instructions)."""
    ops: set[tuple[str | None, str]] = set()
    layers: set[str] = set()
    gathered: dict[str, str] = {}
    for unit, (_, backward) in listed.items():
        repeat = graph.body.items[unit.start].name if unit.layer is not None else None
        for e in backward:
            if e.phase == LAYER_AGAIN:
                layers.add(repeat)
            elif e.phase == FORWARD_AGAIN and e.op == COMPUTE:
                ops.add((repeat, e.node.out))
            elif e.phase == GATHER_AGAIN:
                gathered[e.node.out] = e.node.src
    return DoneAgain(frozenset(ops), frozenset(layers), gathered)


def read_done_again(graph: Graph, mesh: Mesh, *, recompute: str, dtype: str = "fp32") -> DoneAgain:
    """`done_again` of the graph's instruction lists (a repeat's first layer's, and every
    top-level unit's) under `recompute`."""
    return done_again(graph, unit_instructions(graph, mesh, recompute=recompute, dtype=dtype,
                                               wanted=list(distinct_units(graph, units(graph)).values())))
