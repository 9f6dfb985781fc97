"""One collective or transfer a rank issues, as the agreement proof compares them; a run of them."""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import NamedTuple

from fivedc.errors import SourceLoc
from fivedc.ir.mesh import MeshAxis


LAYER = "{layer}"  # in an event's description: the layer of the run that issues it (`at_layer`)
MICROBATCH = "{microbatch}"  # and its microbatch (a pipeline transfer's)
RING_TAG = 2  # a chunk passed around a tp ring (runtime/tp_ring.py); ring attention's are 0 and 1
# An instruction that runs kernels and puts nothing on the wire (an op's forward or backward, a
# chunk's weight gradients, the optimizer step): in a class's instruction list
# (`comm_program.class_instructions`, what `fivedc show PLAN --program` prints), never in the
# proof's events, which are that list's other instructions.
COMPUTE = "compute"
# What part of its node's work an instruction is (`Event.phase`; `done_again.py` reads them back):
# an op's or a redistribution's forward, its backward, a recomputed op's forward done again in
# backward on its own (selective), a recomputed layer's forward done again (full), and a
# gathered input gathered again for the weight gradients (sequence parallelism). "" where no
# node's (transfers, sums, the optimizer step).
FORWARD, BACKWARD, FORWARD_AGAIN, LAYER_AGAIN, GATHER_AGAIN = (
    "forward", "backward", "forward again", "layer again", "gather again")


@dataclass(frozen=True, slots=True)
class Event:
    op: str  # all_reduce | all_gather | reduce_scatter | all_to_all | send_recv (a ring hop) | send | recv
    # (or COMPUTE: an instruction list's kernel, no group)
    axes: tuple[MeshAxis, ...]  # the group (send, recv: pp)
    numel: int | None  # elements this rank puts in; None: sized at run time
    dtype: str
    what: str  # where it comes from, for a reader
    loc: SourceLoc | None = None
    peer: int | None = None  # send, recv: the other pp rank
    tag: int = 0  # send, recv: 0 activations, 1 gradients; a ring hop: 0 K/V, 1 their gradients, 2 a tp ring's chunk
    level: str = ""  # a part of the group (a hierarchical all-to-all: intra or inter)
    pp_ranks: tuple[int, ...] = ()  # a group over pp of only these pp ranks (a tied weight's holders); (): all
    # the graph node whose work it is (an op, a redistribution; a repeat body's node for all its
    # layers) and which part (`FORWARD`, ...): for the readers that price it, not for agreement
    node: object = field(default=None, compare=False, repr=False)
    phase: str = field(default="", compare=False)

    @property
    def group(self) -> tuple:
        """Which kind of group it runs on: its axes, and the pp ranks when only some form it."""
        return (self.axes, self.pp_ranks)

    @property
    def signature(self) -> tuple:
        """What the members of a group must agree on."""
        return (self.op, self.numel, self.dtype, self.tag, self.level)

    def __str__(self) -> str:
        if self.op == COMPUTE:
            return self.what
        size = "rows sized at run time" if self.numel is None else f"{self.numel} x {self.dtype}"
        peer = f" with pp rank {self.peer}" if self.peer is not None else ""
        level = f" ({self.level})" if self.level else ""
        some = f" (pp ranks {', '.join(map(str, self.pp_ranks))})" if self.pp_ranks else ""
        return f"{self.op}{level} over {'x'.join(self.axes)}{some}{peer}: {size}, {self.what}"


def templated(site) -> str:
    """A site's id with its layer left open (`LAYER`): what all layers of its repeat share."""
    return site.id if site.repeat is None else f"{site.repeat}.{LAYER}.{site.value}"


def at_layer(event: Event, layer: int | None, microbatch: int | None = None) -> Event:
    """`event` as issued at `layer` and `microbatch` (its description names them)."""
    what = event.what
    if layer is not None:
        what = what.replace(LAYER, str(layer))
    if microbatch is not None:
        what = what.replace(MICROBATCH, str(microbatch))
    return event if what == event.what else replace(event, what=what)


class Run(NamedTuple):
    """A segment of a class's program: events it issues together, and the layer and the
    microbatch they run at (None: not a layer's, or the same for every microbatch). The
    events are shared, never copied: a repeat's layers issue the same events, so one
    layer's forward (or backward) is one tuple for all its layers; a chunk's runs are the
    same for every microbatch, and so is a transfer between two chunks. An event's
    description names them `{layer}` and `{microbatch}` (`at_layer` fills them in)."""

    events: tuple[Event, ...]
    layer: int | None = None
    microbatch: int | None = None


def compute(what: str, loc: SourceLoc | None = None) -> Event:
    """An instruction that computes (`COMPUTE`): no group, nothing sent."""
    return Event(COMPUTE, (), None, "", what, loc)


def of_node(events, node, phase: str) -> list[Event]:
    """`events` as the instructions of `node`'s `phase` (`Event.node`, `Event.phase`)."""
    return [replace(e, node=node, phase=phase) for e in events]


def flatten(runs: tuple[Run, ...]) -> tuple[Event, ...]:
    return tuple(at_layer(e, layer, microbatch) for events, layer, microbatch in runs for e in events)
