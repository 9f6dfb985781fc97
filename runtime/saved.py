"""What autograd keeps for backward: gathered tensors kept as notes, and a recorder of the rest.

Within `saving_scope`, a tensor given a note (`keep_as_note`) is not kept by autograd:
the scope's pack hook finds the tensor's root in the scope's `Notes` (a weak map from
root tensors to notes; nothing is set on tensors, and an entry goes with its tensor),
keeps the note instead, and the unpack hook makes the tensor again. Outside a scope no
note is taken. A `Note` is shared by every saved view of one gathered whole, and by the
members of a gathered group: the first unpack gathers, the last one lets the whole go
(`Note.take`); `start` begins the gather early, async where the subclass can (`launch`).
Two kinds of notes:

- ZeRO-3's gathered parameter groups (`runtime/zero3.GroupNote`: one all-gather of the
  group's chunks again, each parameter one part of it);
- the all-gathered input of column-parallel linears under sequence parallelism
  (`mark_regathered`, for the values `fivedc.passes.regather.regathered` names): the note
  (`GatherAgain`) holds this rank's shard and redoes the forward all-gather in backward,
  as Megatron does, so the linears keep 1/t of their input. Where their dW waits for the
  input gradient's sum (`runtime/tp_overlap.py`, which the program hands the note), the
  first reader's backward starts the gather async, so it runs while the readers compute dX.

`SavedRecorder` (given to `saving_scope`) counts the bytes of what is really kept:
each storage once, leaving out the ones it is told to (parameters, inputs); a note
counts the shard it holds. Recomputed regions (`runtime/recompute.py`) report the
inputs checkpoint holds for them through `held`, since they are not saved tensors.
`fivedc run --report` uses it to set the plan's estimate against the run.
"""

from __future__ import annotations

import abc
import contextlib
from collections.abc import Iterable

import torch
from torch import Tensor
from torch.utils.weak import WeakTensorKeyDictionary

from fivedc.runtime.collectives import apply_steps, start_gather

_ACTIVE: list[SavedRecorder] = []  # the recorder of the innermost recording scope


class SavedRecorder:
    """Bytes kept for backward, each storage once; `exclude` storages are never counted."""

    def __init__(self, exclude: Iterable[Tensor] = ()) -> None:
        self.excluded = {t.untyped_storage().data_ptr() for t in exclude}
        self.storages: dict[int, int] = {}

    def add(self, t: Tensor) -> None:
        if not isinstance(t, Tensor) or t.device.type == "meta":
            return
        storage = t.untyped_storage()
        ptr = storage.data_ptr()
        if ptr and ptr not in self.excluded:
            self.storages[ptr] = storage.nbytes()

    @property
    def bytes(self) -> int:
        return sum(self.storages.values())

    def reset(self) -> None:
        self.storages = {}


def held(tensors: Iterable) -> None:
    """Tensors the runtime keeps for backward outside autograd's saved tensors (the inputs
    of a recomputed region, a pipeline's boundary values): counted by the active recorder."""
    if _ACTIVE:
        for t in tensors:
            _ACTIVE[-1].add(t)


def root_of(t: Tensor) -> Tensor:
    """The tensor owning `t`'s storage: `t` itself, or the base it is a view of."""
    return t if t._base is None else t._base


class Note(abc.ABC):
    """What autograd keeps instead of a gathered tensor: how to gather it again. Every save of
    a tensor it covers takes a share (`at`); the first unpack gathers (or finishes the gather
    `start` began early, where `launch` can), the last one lets the whole go. A subclass says
    how to gather (`gather`, `launch`) and what it holds meanwhile (`kept`, counted as saved)."""

    def __init__(self) -> None:
        self.packed = 0  # saves not yet unpacked
        self.whole = None  # the gathered whole, between the first unpack and the last
        self.pending = None  # the finish of a gather started early

    @abc.abstractmethod
    def gather(self):
        """Gather the whole again (blocking)."""

    def launch(self):
        """Start the gather async: its finish (returning what `gather` does), or None where it cannot."""
        return None

    def kept(self) -> tuple[Tensor, ...]:
        return ()

    def start(self) -> None:
        """Begin the gather early, so it runs while backward computes something else."""
        if self.whole is None and self.pending is None:
            self.pending = self.launch()

    def at(self, t: Tensor, part=None) -> Packed:
        """What autograd keeps for `t` (`part` of the whole, or the whole for None)."""
        self.packed += 1
        held(self.kept())
        return Packed(self, part, (t.size(), t.stride(), t.storage_offset()))

    def take(self, part=None) -> Tensor:
        if self.pending is not None:
            self.whole, self.pending = self.pending(), None
        elif self.whole is None:
            self.whole = self.gather()
        whole = self.whole if part is None else self.whole[part]
        self.packed -= 1
        if self.packed <= 0:
            self.whole = None
        return whole


class Packed:
    """One saved tensor as autograd keeps it: its note, its part and its layout."""

    def __init__(self, note: Note, part, layout: tuple) -> None:
        self.note, self.part, self.layout = note, part, layout

    def get(self) -> Tensor:
        return root_of(self.note.take(self.part)).as_strided(*self.layout)


class GatherAgain(Note):
    """The note on a gathered activation: this rank's shard and the steps that gather it
    (early, async, where they are one all-gather)."""

    def __init__(self, shard: Tensor, steps, groups) -> None:
        super().__init__()
        self.shard, self.steps, self.groups = shard.detach(), steps, groups

    def kept(self) -> tuple[Tensor, ...]:
        return (self.shard,)

    def launch(self):
        if len(self.steps) == 1 and self.steps[0].kind == "all_gather":
            return start_gather(self.shard, self.steps[0], self.groups)
        return None

    def gather(self) -> Tensor:
        return apply_steps(self.shard, self.steps, self.groups)


class Notes:
    """The notes of a saving scope: the root of each tensor kept as a note, weakly (an entry
    goes with its tensor), mapped to its note and its part of the note's whole."""

    def __init__(self) -> None:
        self.roots = WeakTensorKeyDictionary()

    def add(self, t: Tensor, note: Note, part=None) -> None:
        self.roots[root_of(t)] = (note, part)

    def pack(self, t: Tensor):
        """The saved-tensor pack hook: a note where `t`'s root has one, else `t` (counted)."""
        found = self.roots.get(root_of(t))
        if found is not None:
            return found[0].at(t, found[1])
        held((t,))
        return t


_SCOPES: list[Notes] = []  # the notes of the enclosing saving scopes (nested ones share the outermost's)


def keep_as_note(t: Tensor, note: Note, part=None) -> Note:
    """Within a saving scope, autograd keeps `note` (`part` of it) for `t` and every view of
    `t`'s root; outside one, nothing changes (autograd keeps `t`)."""
    if _SCOPES:
        _SCOPES[-1].add(t, note, part)
    return note


def mark_regathered(gathered: Tensor, shard: Tensor, steps, groups) -> GatherAgain:
    """Backward makes `gathered` (the output of `apply_steps(shard, steps)`) again: its note."""
    return keep_as_note(gathered, GatherAgain(shard, steps, groups))


def _unpack(saved):
    return saved.get() if isinstance(saved, Packed) else saved


@contextlib.contextmanager
def saving_scope(recorder: SavedRecorder | None = None):
    """Around forward and backward: tensors given notes (`keep_as_note`) are kept as notes;
    with `recorder`, what is kept is counted. Yields the scope's `Notes`."""
    notes = _SCOPES[-1] if _SCOPES else Notes()
    _SCOPES.append(notes)
    if recorder is not None:
        _ACTIVE.append(recorder)
    try:
        with torch.autograd.graph.saved_tensors_hooks(notes.pack, _unpack):
            yield notes
    finally:
        if recorder is not None:
            _ACTIVE.remove(recorder)
        _SCOPES.pop()


class LiveMeter:
    """The peak of what a step keeps for backward on this rank: the storages recorded
    while each (microbatch, chunk) runs its forward stay alive until `release` (its
    backward is done); a storage kept by several (RoPE's tables) counts once."""

    def __init__(self) -> None:
        self.excluded: set[int] = set()
        self.kept: dict[object, dict[int, int]] = {}
        self.count: dict[int, int] = {}
        self.live = self.peak = 0

    def exclude(self, tensors: Iterable[Tensor]) -> None:
        """Storages never counted: parameters (also gathered ones) and inputs."""
        self.excluded |= {t.untyped_storage().data_ptr() for t in tensors if isinstance(t, Tensor)}

    @contextlib.contextmanager
    def forward(self, key):
        recorder = SavedRecorder()
        recorder.excluded = self.excluded
        _ACTIVE.append(recorder)
        try:
            yield recorder
        finally:
            _ACTIVE.remove(recorder)
            self.kept[key] = recorder.storages
            for ptr, nbytes in recorder.storages.items():
                self.count[ptr] = self.count.get(ptr, 0) + 1
                if self.count[ptr] == 1:
                    self.live += nbytes
            self.peak = max(self.peak, self.live)

    def hold(self, key, tensors: Iterable[Tensor]) -> None:
        """What `key` keeps from now on instead (an input-gradient pass keeps what its weight
        gradients need until W)."""
        self.release(key)
        with self.forward(key) as recorder:
            for t in tensors:
                recorder.add(t)

    def release(self, key) -> None:
        for ptr, nbytes in self.kept.pop(key, {}).items():
            self.count[ptr] -= 1
            if self.count[ptr] == 0:
                del self.count[ptr]
                self.live -= nbytes
