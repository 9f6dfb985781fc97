"""A proof, before any process starts, that every process group's ranks agree.

A collective completes only when every rank of its group calls it, with the same
operation and sizes, in the same order as the group's other collectives; a receive
completes only when its sender sends. A plan that breaks either hangs or corrupts
memory on a cluster. `prove_agreement` shows that no plan fivedc accepts does:

1. Every class of ranks (`fivedc/instructions/comm_program.py`: the ranks of one pp rank run one
   program) is expanded into the events of one training step.
2. For every group of ranks that issues a collective, the members' programs,
   projected on that group, are the same sequence of (operation, elements, dtype).
   A group whose members all belong to one class agrees by construction (every
   member runs that class's program, on shards of equal size: each dim divides by
   its axes); a group that spans classes (its axes include pp: the loss's sum) is
   compared class against class.
3. The classes are run against each other: a send never blocks, a receive waits for
   the matching send (first in, first out per sender, receiver and kind) and must
   find the sizes it expects, a collective over several classes waits for all of
   them. Every class must reach its end with nothing left unreceived: no deadlock.
4. Every parameter gradient that is summed over a group of more than one rank is
   summed exactly once, by the class that holds the parameter.

The programs are shared runs (`fivedc/proof/events.Run`): a repeat's layer is built
once for all its layers, a chunk's runs once for all its microbatches, and the proof reads
each distinct run once, so its cost follows the plan's structure, never the world size
(tens of milliseconds for Llama 3 405B over 16384 ranks, 16 pipeline stages or none).
A failure is a bug in fivedc's compiler (an `AgreementError`, exit 4) naming the
group, the two classes that disagree and their sequences around the first
difference.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass

from fivedc.instructions.comm_program import class_runs
from fivedc.instructions.events import Event, Run, at_layer
from fivedc.errors import PassError
from fivedc.ir.graph import param_instances
from fivedc.ir.mesh import Mesh, MeshAxis
from fivedc.passes.overlap import expand_buckets
from fivedc.passes.chunk_params import held_by_rank


class AgreementError(PassError):
    """The ranks of a group would issue different collectives: the plan would hang or corrupt."""


@dataclass(frozen=True, slots=True)
class AgreementProof:
    classes: int  # programs (one per pp rank)
    events: int  # in one step, over all classes
    groups: int  # kinds of group (axis sets) checked
    across: int  # of which span several classes
    transfers: int  # pipeline sends matched with their receives
    seconds: float
    built: int = 0  # events built: the distinct runs' (a layer once for its repeat, a chunk for its microbatches)

    def __str__(self) -> str:
        spans = f", {self.across} spanning several" if self.across else ""
        sends = f", {self.transfers} transfers matched" if self.transfers else ""
        return (f"every group's ranks issue the same collectives (proved over {self.classes} rank "
                f"class{'es' * (self.classes != 1)}: {self.events} events per step, {self.groups} kinds of group"
                f"{spans}{sends}; no deadlock; {self.seconds * 1e3:.0f} ms)")


class PpClasses:
    """Ranks classed by their pp coordinate (what the runtime's program depends on)."""

    def __init__(self, mesh: Mesh) -> None:
        self.mesh, self.p = mesh, mesh.size(MeshAxis.PP)

    def member_sets(self, axes: tuple[MeshAxis, ...], pp_ranks: tuple[int, ...] = ()) -> list[tuple[object, ...]]:
        """The classes each group over `axes` spans (one entry per kind of group); a group of
        only some pp ranks (`pp_ranks`: a tied weight's holders) spans those."""
        if pp_ranks:
            return [pp_ranks]
        if MeshAxis.PP in axes:
            return [tuple(range(self.p))]
        return [(s,) for s in range(self.p)]

    def describe(self, key) -> str:
        return f"pp rank {key}"


class RankClasses(PpClasses):
    """Classes given rank by rank (`class_of[rank]`), for small meshes: every group is
    enumerated. Tests use it to give one rank a program of its own."""

    def __init__(self, mesh: Mesh, class_of: dict[int, object]) -> None:
        super().__init__(mesh)
        self.class_of = class_of

    def member_sets(self, axes, pp_ranks: tuple[int, ...] = ()):
        seen: dict[tuple, None] = {}
        for rank in range(self.mesh.world):
            if pp_ranks and self.mesh.coords(rank)[MeshAxis.PP] not in pp_ranks:
                continue
            members = [r for r in self.mesh.group_ranks(axes, rank)
                       if not pp_ranks or self.mesh.coords(r)[MeshAxis.PP] in pp_ranks]
            seen[tuple(sorted({self.class_of[r] for r in members}, key=str))] = None
        return list(seen)

    def describe(self, key) -> str:
        ranks = [r for r, k in self.class_of.items() if k == key]
        return f"class {key} (rank{'s' * (len(ranks) > 1)} {', '.join(map(str, ranks[:8]))})"


def prove_agreement(plan, *, programs: dict | None = None, classes: PpClasses | None = None,
                    runs: dict | None = None) -> AgreementProof:
    """Check the plan's programs: its classes' runs (`class_runs`), or `runs` (by class) or
    `programs` (events by class) given, classed by `classes`; an `AgreementError` names the
    first disagreement."""
    start = time.perf_counter()
    if runs is None:
        runs = class_runs(plan) if programs is None else {k: (Run(tuple(v)),) for k, v in programs.items()}
    classes = classes or PpClasses(plan.mesh)
    memo = _Memo(runs)
    kinds = sorted(memo.kinds)
    across = 0
    for group in kinds:
        for members in classes.member_sets(*group):
            if len(members) > 1:  # a group within one class agrees by construction
                across += 1
                _same_sequences(group, members, memo, classes)
    transfers = _run_together(memo, classes)
    _summed_once(plan)
    return AgreementProof(len(runs), sum(len(run.events) for ofclass in runs.values() for run in ofclass),
                          len(kinds), across, transfers, time.perf_counter() - start, memo.built)


class _Memo:
    """What the proof reads of each distinct run's events, worked out once (by identity: the
    memo keeps every run alive, and a copy that differs in one event is a tuple of its own):
    the kinds of group they issue on, their collectives by group, and the events they play
    against other classes (transfers, and collectives over groups that span classes)."""

    def __init__(self, runs: dict) -> None:
        self.runs = runs
        self.by_group: dict[int, dict[tuple, list[Event]]] = {}
        self.kinds: set[tuple] = set()
        self.groups: set[tuple] = set()  # every group, transfers' (pp) included
        self._played: dict[int, tuple[int, list[tuple[int, Event]]]] = {}
        self.built = 0  # events of the distinct runs
        for ofclass in runs.values():
            for events, _, _ in ofclass:
                if id(events) not in self.by_group:
                    grouped: dict[tuple, list[Event]] = {}
                    for e in events:
                        if e.op in ("send", "recv"):
                            self.groups.add(e.group)
                        else:
                            grouped.setdefault(e.group, []).append(e)
                    self.by_group[id(events)] = grouped
                    self.kinds |= grouped.keys()
                    self.built += len(events)
        self.groups |= self.kinds

    def projection(self, key, group) -> list[Event]:
        """Class `key`'s collectives over `group`, in order."""
        return [at_layer(e, layer, microbatch) for events, layer, microbatch in self.runs[key]
                for e in self.by_group[id(events)].get(group, ())]

    def played(self, key, spanning) -> list[tuple[int, Event, int | None, int | None]]:
        """Class `key`'s transfers and collectives over a group in `spanning`, with their
        indices in its program and their run's layer and microbatch (`_shown`): the events
        that wait for other classes (the rest complete within the class)."""
        out, offset = [], 0
        for events, layer, microbatch in self.runs[key]:
            length, mine = self._played.get(id(events)) or self._play(events, spanning)
            if mine:
                out += [(offset + i, e, layer, microbatch) for i, e in mine]
            offset += length
        return out

    def _play(self, events, spanning) -> tuple[int, list[tuple[int, Event]]]:
        found = self._played[id(events)] = (len(events), [(i, e) for i, e in enumerate(events)
                                                           if e.op in ("send", "recv") or e.group in spanning])
        return found


def _same_sequences(group, members, memo: _Memo, classes) -> None:
    """The projections on `group` (axes, pp ranks) of the member classes' programs are equal."""
    first, (axes, pp_ranks) = members[0], group
    want = memo.projection(first, group)
    for other in members[1:]:
        got = memo.projection(other, group)
        index = next((i for i, (a, b) in enumerate(zip(want, got)) if a.signature != b.signature),
                     None if len(want) == len(got) else min(len(want), len(got)))
        if index is not None:
            name = "x".join(axes) + (f" (pp ranks {', '.join(map(str, pp_ranks))})" if pp_ranks else "")
            raise AgreementError(
                f"the ranks of a {name} group disagree at its collective #{index + 1}:\n"
                f"  {classes.describe(first)} issues:\n{_around(want, index)}\n"
                f"  {classes.describe(other)} issues:\n{_around(got, index)}",
                hint="a bug in fivedc's compiler or runtime: report the plan (fivedc compile -o) with this message")


def _around(events: list[Event], index: int, context: int = 2) -> str:
    lines = []
    for i in range(max(0, index - context), min(len(events), index + context + 1)):
        lines.append(f"    {'>' if i == index else ' '} #{i + 1} {_located(events[i])}")
    if index >= len(events):
        lines.append(f"    > #{index + 1} (nothing: its program ends here)")
    return "\n".join(lines)


def _shown(played: tuple) -> Event:
    """A played event as its run issues it (its description names the layer and microbatch)."""
    _, event, layer, microbatch = played
    return at_layer(event, layer, microbatch)


def _located(event: Event) -> str:
    return f"{event} (at {event.loc})" if event.loc is not None else str(event)


def _run_together(memo: _Memo, classes: PpClasses) -> int:
    """Play the classes against each other; the number of transfers matched. A receive
    waits for its send (FIFO per sender, receiver and kind); a collective that spans
    classes waits for all of them; everything else completes within a class, so only the
    transfers and the spanning collectives are played (`_Memo.played`)."""
    spanning = {group: members for group in memo.groups
                for members in classes.member_sets(*group) if len(members) > 1}
    programs = {key: memo.played(key, spanning) for key in memo.runs}
    position = {key: 0 for key in programs}
    channels: dict[tuple, deque[tuple]] = {}
    matched = 0
    while True:
        moved = False
        for key, events in programs.items():
            while position[key] < len(events):
                e = events[position[key]][1]
                if e.op == "send":
                    channels.setdefault((key, e.peer, e.tag), deque()).append(events[position[key]])
                elif e.op == "recv":
                    queue = channels.get((e.peer, key, e.tag))
                    if not queue:
                        break
                    _same_transfer(queue.popleft(), events[position[key]], key, classes)
                    matched += 1
                else:  # a collective over a group that spans classes
                    if not _all_arrived(e.group, spanning[e.group], programs, position):
                        break
                    for other in spanning[e.group]:
                        if other != key:
                            position[other] += 1
                position[key] += 1
                moved = True
        if all(position[k] == len(ev) for k, ev in programs.items()):
            break
        if not moved:
            _deadlock(programs, position, classes)
    left = [(k, q[0]) for k, q in channels.items() if q]
    if left:
        (src, dst, _), sent = left[0]
        raise AgreementError(f"{classes.describe(src)} sends {_shown(sent)} that {classes.describe(dst)} never "
                             "receives",
                             hint="a bug in fivedc's pipeline schedule or runtime: report the plan")
    return matched


def _all_arrived(group, members, programs, position) -> bool:
    """Every member class is at a collective over `group` (not a transfer, whose group is pp too)."""
    def at(m) -> bool:
        e = programs[m][position[m]][1] if position[m] < len(programs[m]) else None
        return e is not None and e.group == group and e.op not in ("send", "recv")

    return all(at(m) for m in members)


def _same_transfer(sent: tuple, received: tuple, key, classes) -> None:
    """The sizes a send puts in are those its receive expects (`sent`, `received`: played)."""
    if (sent[1].numel, sent[1].dtype) != (received[1].numel, received[1].dtype):
        sent, received = _shown(sent), _shown(received)
        raise AgreementError(
            f"{classes.describe(received.peer)} sends {sent.numel} x {sent.dtype} ({sent.what}) where "
            f"{classes.describe(key)} receives {received.numel} x {received.dtype} ({received.what})",
            hint="the two sides of a pipeline boundary size its buffer differently: a bug in fivedc")


def _deadlock(programs, position, classes) -> None:
    waiting = [f"  {classes.describe(k)} waits in #{ev[position[k]][0] + 1} {_located(_shown(ev[position[k]]))}"
               for k, ev in programs.items() if position[k] < len(ev)]
    raise AgreementError("the ranks would deadlock: no class can go on\n" + "\n".join(waiting),
                         hint="a bug in fivedc's pipeline schedule or runtime: report the plan")


def _summed_once(plan) -> None:
    """Each parameter whose gradient is summed over more than one rank is in exactly one
    gradient bucket of the pp rank that holds it (ZeRO-3 without a pipeline sums each
    gradient where it is gathered). Each bucket and parameter is looked at once, for the pp
    ranks that hold it."""
    if plan.zero == 3 and plan.pipeline is None:
        return
    pp = plan.mesh.size(MeshAxis.PP)
    held = held_by_rank(plan.graph, plan.pipeline, pp) if plan.pipeline else None
    holders: dict[str, list[int]] = {}
    for rank in range(pp) if held else ():
        for name in held[rank]:
            holders.setdefault(name, []).append(rank)
    everyone = list(range(pp))
    outside: dict[int, tuple] = {}  # pp rank -> its first bucket holding another rank's parameters
    counts: dict[tuple[int, str], int] = {}
    for bucket in expand_buckets(plan.buckets):
        ranks = sorted({r for n in bucket for r in holders.get(n, ())}) if held else everyone
        for rank in ranks:
            others = [n for n in bucket if held is not None and n not in held[rank]]
            if others:
                outside.setdefault(rank, (bucket, others))
            for name in bucket:
                counts[(rank, name)] = counts.get((rank, name), 0) + 1
    wrong: dict[int, tuple] = {}  # pp rank -> its first parameter not summed once
    for name, param in param_instances(plan.graph):
        if plan.mesh.size(*param.grad_partial) > 1:
            for rank in holders.get(name, ()) if held else everyone:
                if counts.get((rank, name), 0) != 1:
                    wrong.setdefault(rank, (name, param, counts.get((rank, name), 0)))
    for rank in sorted(outside.keys() | wrong.keys()):
        if rank in outside:
            bucket, others = outside[rank]
            raise AgreementError(f"gradient bucket {', '.join(bucket)} of pp rank {rank} holds "
                                 f"{', '.join(others)}, which another pp rank holds: no rank would sum it")
        name, param, count = wrong[rank]
        raise AgreementError(f"the gradient of {name} is summed over {'x'.join(param.grad_partial)} "
                             f"{count} times on pp rank {rank}, not once")
