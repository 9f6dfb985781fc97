"""Activation bytes on one rank: what each unit keeps for backward, per microbatch, with recomputation.

The save rules of `fivedc/estimates/saved.py` say what each op keeps; here they are summed per
pipeline unit (one layer of a repeat, or a run of top-level ops: `passes/stages.py`)
with the same tensor counted once, as autograd keeps one storage:

- a layer's own values and buffers are its own (`UnitSaves.own`); the body arguments
  it keeps are the previous layer's outputs (`args`); top-level values it keeps
  (`outer`) are counted once per chunk, whichever units keep them;
- constants (RoPE's tables) are kept once per rank, whatever the microbatches.

Recomputation (`passes/recompute.py`) changes what a unit keeps, as its instruction list does it
again in backward (`SaveContext.again`, `fivedc/instructions/done_again.py`):

- selective: an attention op keeps only its inputs q, k, v (the recomputed region's
  inputs, which checkpoint holds); its own buffers (the log-sum-exp) are rebuilt in
  backward, transiently;
- full: a layer keeps only what it reads from outside (its input, which checkpoint
  holds); while its backward runs its activations are rebuilt (transient, one layer
  at a time).

A chunk (`chunk_activations`) keeps its units' saves, the values it received from the
previous chunk and the values it sends to the next (the runtime holds both until the
backward), so under a pipeline each microbatch in flight through chunk c costs
`chunk_activations(c)` and the schedule says how many are in flight
(`stage_plan.activations_in_flight`). Without a pipeline there is one chunk and one
microbatch.
"""

from __future__ import annotations

from dataclasses import dataclass

from fivedc.ir.graph import Block, Graph, Op, Redistribute, Repeat, outer_reads
from fivedc.ir.ops import LINEAR_KINDS
from fivedc.estimates.saved import CONSTANT, OWN, SaveContext, op_saves
from fivedc.passes.stages import Unit


@dataclass(frozen=True, slots=True)
class UnitSaves:
    """What one unit keeps for one microbatch on one rank, in bytes."""

    own: int = 0  # values defined in the unit and buffers of its ops
    args: tuple[tuple[int, int], ...] = ()  # a layer: (body arg index, bytes) of the inputs it keeps
    outer: tuple[tuple[str, int], ...] = ()  # top-level values it keeps (counted once per chunk)
    constants: tuple[tuple[str, int], ...] = ()  # kept once per rank (RoPE tables)
    transient: int = 0  # the largest recomputed region of the unit, rebuilt while its backward runs


def block_saves(c: SaveContext, items, *, repeat: Repeat | None) -> UnitSaves:
    """The saves of `items` (a repeat body when `repeat` is given, else top-level items)."""
    kept: dict[str, tuple[int, str]] = {}
    constants: dict[str, int] = {}
    transient = 0
    for item in items:
        if not isinstance(item, Op):
            continue
        saves = op_saves(c, item)
        if c.again.op(item, repeat):  # the region keeps its inputs; the rest comes back in backward
            transient = max(transient, sum(s.bytes for s in saves if s.kind == OWN))
            saves = c.value_args(item)
        for s in saves:
            if s.kind == CONSTANT:
                constants[s.key] = s.bytes
            else:
                kept[s.key] = (s.bytes, s.kind)
    return _classify(kept, constants, transient, repeat)


def _classify(kept: dict[str, tuple[int, str]], constants: dict[str, int], transient: int,
              repeat: Repeat | None) -> UnitSaves:
    own, args, outer = 0, {}, {}
    body_args = repeat.body.args if repeat else ()
    defined = _defined(repeat.body) if repeat else set()
    for key, (nbytes, kind) in kept.items():
        if kind == OWN or key in defined:
            own += nbytes
        elif key in body_args:
            args[body_args.index(key)] = nbytes
        else:
            outer[key] = nbytes
    return UnitSaves(own, tuple(sorted(args.items())), tuple(sorted(outer.items())), tuple(sorted(constants.items())),
                     transient)


def _defined(block: Block) -> set[str]:
    return {node.out for node in block.items if isinstance(node, (Op, Redistribute))}


def layer_saves(c: SaveContext, repeat: Repeat) -> UnitSaves:
    """One layer of `repeat` (all its layers keep the same)."""
    normal = block_saves(c, repeat.body.items, repeat=repeat)
    if not c.again.layer(repeat):
        return normal
    held_args = tuple((i, c.value_bytes(a)) for i, a in enumerate(repeat.body.args)
                      if c.value(a))  # checkpoint holds the layer's inputs
    reads = outer_reads(repeat.body) - set(repeat.body.args)
    held_outer = tuple(sorted((s.key, s.bytes) for name in reads for s in c.value(name)))
    return UnitSaves(0, held_args, held_outer, (), normal.own + normal.transient)


def unit_saves(c: SaveContext, graph: Graph, unit: Unit, *, cache: dict | None = None) -> UnitSaves:
    """The saves of one unit; a repeat's layers share one computation through `cache`."""
    item = graph.body.items[unit.start]
    if unit.layer is None:
        return block_saves(c, graph.body.items[unit.start:unit.stop], repeat=None)
    cache = {} if cache is None else cache
    if item.name not in cache:
        cache[item.name] = layer_saves(c, item)
    return cache[item.name]


def chunk_activations(c: SaveContext, graph: Graph, chunk_units: list[Unit], *, received: tuple[str, ...] = (),
                      sends: tuple[str, ...] = (), cache: dict | None = None) -> tuple[int, int, dict]:
    """(bytes one microbatch keeps through these units, the largest transient, the constants).

    The first unit's kept body arguments, when it is a layer after the first, are the
    values received from the previous chunk (named as the repeat's results); received
    and sent values are held until the backward, counted once with the values kept."""
    own, shared, constants, transient = 0, {}, {}, 0
    if chunk_units:
        received = tuple(_boundary_key(graph, chunk_units[0], name, 0) for name in received)
        sends = tuple(_boundary_key(graph, chunk_units[-1], name, 1) for name in sends)
    for k, unit in enumerate(chunk_units):
        saves = unit_saves(c, graph, unit, cache=cache)
        own += saves.own
        transient = max(transient, saves.transient)
        constants.update(saves.constants)
        shared.update(saves.outer)
        repeat = graph.body.items[unit.start] if unit.layer is not None else None
        for index, nbytes in saves.args:
            if repeat is not None and unit.layer == 0:
                shared[repeat.carried[index]] = nbytes
            elif repeat is not None and k == 0:  # received: the previous layer ran on another chunk
                shared[_layer_input(repeat, unit.layer, index)] = nbytes
            else:
                own += nbytes
    for key, name in received + sends:
        if key not in shared and name in c.layouts and name not in c.inputs:
            shared[key] = c.value_bytes(name)
    return own + sum(shared.values()), transient, constants


def _layer_input(repeat: Repeat, layer: int, index: int) -> str:
    return f"{repeat.name}.{layer}:in{index}"


def _boundary_key(graph: Graph, unit: Unit, name: str, after: int) -> tuple[str, str]:
    """(key, value name) of a value crossing a cut before (after=0) or after (1) `unit`: a
    repeat's result names the output of the layer before a cut between layers, the
    input of the layer after it."""
    if unit.layer is not None:
        repeat = graph.body.items[unit.start]
        layer = unit.layer + after
        if name in repeat.results and 0 < layer < repeat.count:
            return _layer_input(repeat, layer, repeat.results.index(name)), name
    return name, name


def chunk_deferred(c: SaveContext, graph: Graph, chunk_units: list[Unit]) -> int:
    """What one microbatch keeps between its input-gradient pass (I) and its weight pass
    (W) under a split backward (`runtime/weight_grads.py`): each linear with a parameter
    weight keeps its input (as backward unpacked it: gathered) and its output's gradient."""
    total, layers = 0, {}
    for unit in chunk_units:
        if unit.layer is not None and unit.start in layers:  # every layer of a repeat keeps the same
            total += layers[unit.start]
            continue
        items = graph.body.items[unit.start].body.items if unit.layer is not None else \
            graph.body.items[unit.start:unit.stop]
        kept: dict[str, int] = {}
        for op in items:
            if isinstance(op, Op) and op.kind in LINEAR_KINDS and op.args[1] in c.params:
                x = op.args[0]
                if x in c.layouts and x not in c.inputs:
                    kept[x] = c.value_bytes(x)
                kept[op.out] = c.value_bytes(op.out)
        total += sum(kept.values())
        if unit.layer is not None:
            layers[unit.start] = sum(kept.values())
    return total
