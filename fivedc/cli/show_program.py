"""`fivedc show PLAN --program [--rank R]`: one rank's training step as its instruction list.

A rank runs the program of its class (its pp rank: `fivedc/proof/comm_program.rank_instructions`):
each op's forward and backward, the collectives and ring hops around them, pipeline sends and
receives, the gradients' sums, the optimizer step and ZeRO's gathers, in the order it issues
them. The collectives and transfers are the events the agreement proof checks, and
`tests/test_agreement.py` holds them to what the runtime calls. Runs that repeat one after the
other (the layers of a stack) are printed once, with the layers they stand for (`N` in the
names).
"""

from __future__ import annotations

import textwrap
from collections.abc import Iterator

from rich.console import Console
from rich.text import Text

from fivedc.errors import FivedcError
from fivedc.ir.mesh import MeshAxis
from fivedc.instructions.comm_program import rank_instructions
from fivedc.instructions.events import COMPUTE, LAYER, Event, Run, at_layer


def render_program(plan, rank: int, *, console: Console) -> None:
    world = plan.mesh.world
    if not 0 <= rank < world:
        raise FivedcError(f"--rank {rank} is not a rank of mesh {plan.mesh} ({world} ranks)",
                          hint=f"choose a rank from 0 to {world - 1}")
    pp = plan.mesh.coords(rank)[MeshAxis.PP]
    runs = rank_instructions(plan, pp)
    events = [e for run in runs for e in run.events]
    wire = sum(e.op != COMPUTE for e in events)
    peers = world // plan.mesh.size(MeshAxis.PP)
    console.print(Text(f"rank {rank} runs the program of pp rank {pp} (the {peers} ranks with pp = {pp} run the "
                       f"same): {len(events)} instructions in one training step, {wire} of them collectives and "
                       "transfers (what the agreement proof checks)"))
    width = max(40, console.width)
    last = ""
    for header, block in _blocks(runs):
        if header and header != last:
            console.print(Text(header, style="bold"))
        last = header
        for event in block:
            console.print(Text(_line(event, width)), soft_wrap=True)


def _blocks(runs: tuple[Run, ...]) -> Iterator[tuple[str, tuple[Event, ...]]]:
    """Consecutive runs of the same events (a stack's layers) as one block with its header."""
    i = 0
    while i < len(runs):
        run, j = runs[i], i + 1
        while j < len(runs) and runs[j].events is run.events and runs[j].microbatch == run.microbatch \
                and run.layer is not None and runs[j].layer == runs[j - 1].layer + 1:
            j += 1
        if j - i > 1:
            header = f"layers {run.layer}-{runs[j - 1].layer}, each (N the layer)"
            block = run.events
        else:
            header = "" if run.layer is None else f"layer {run.layer}"
            block = tuple(at_layer(e, run.layer) for e in run.events)
        if run.microbatch is not None:
            header = ", ".join(filter(None, (f"microbatch {run.microbatch}", header)))
            block = tuple(at_layer(e, None, run.microbatch) for e in block)
        yield header, block
        i = j


def _line(event: Event, width: int) -> str:
    kind = "compute" if event.op == COMPUTE else event.op
    text = str(event).replace(LAYER, "N")
    if event.op != COMPUTE:
        text = text[len(event.op):].lstrip()
    return textwrap.fill(text, width=width, initial_indent=f"  {kind:<15}", subsequent_indent=" " * 17)
