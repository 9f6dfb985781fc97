"""What autograd keeps for backward: gathered tensors kept as notes, and a recorder of the rest.

A tensor whose root carries `_fivedc_regather` is not kept by autograd: the pack hook
of `saving_scope` keeps a note instead, and the unpack hook makes the tensor again.
Two kinds of tensors carry such a note:

- ZeRO-3's gathered parameters (`runtime/zero.py`: the note gathers the chunk again);
- the all-gathered input of column-parallel linears under sequence parallelism
  (`mark_regathered`, for the values `fivedc.estimates.saved.regathered` names): the note holds
  this rank's shard and redoes the forward all-gather in backward, as Megatron does,
  so the linears keep 1/t of their input. The linears reading one gathered value share
  one note: the first unpack gathers, the last one lets it go. Where their dW waits for
  the input gradient's sum (`runtime/tp_overlap.py`), the first reader's backward
  starts the gather async, so it runs while the readers compute dX.

`SavedRecorder` (given to `saving_scope`) counts the bytes of what is really kept:
each storage once, leaving out the ones it is told to (parameters, inputs); a note
counts the shard it holds. Recomputed regions (`runtime/recompute.py`) report the
inputs checkpoint holds for them through `held`, since they are not saved tensors.
`fivedc run --report` uses it to set the plan's estimate against the run.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable

import torch
from torch import Tensor

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


class _GatherAgain:
    """The note on a gathered activation: this rank's shard and the steps that gather it.
    `start` begins the gather early (async, where it is one all-gather); `take` waits for it."""

    def __init__(self, shard: Tensor, steps, groups) -> None:
        self.shard, self.steps, self.groups = shard.detach(), steps, groups
        self.packed = 0
        self.whole: Tensor | None = None
        self.pending = None  # the finish of an all-gather started early

    def start(self) -> None:
        if self.whole is None and self.pending is None and len(self.steps) == 1 and self.steps[0].kind == "all_gather":
            self.pending = start_gather(self.shard, self.steps[0], self.groups)

    def at(self, t: Tensor) -> _Packed:
        self.packed += 1
        if _ACTIVE:
            _ACTIVE[-1].add(self.shard)
        return _Packed(self, (t.size(), t.stride(), t.storage_offset()))

    def take(self) -> Tensor:
        if self.pending is not None:
            self.whole, self.pending = self.pending(), None
        elif self.whole is None:
            self.whole = apply_steps(self.shard, self.steps, self.groups)
        whole = self.whole
        self.packed -= 1
        if self.packed <= 0:
            self.whole = None
        return whole


class _Packed:
    def __init__(self, note: _GatherAgain, layout: tuple) -> None:
        self.note, self.layout = note, layout

    def get(self) -> Tensor:
        return self.note.take().as_strided(*self.layout)


def regather_note(t: Tensor) -> _GatherAgain | None:
    """The note on `t`'s root if backward gathers it again (sequence parallelism's linear inputs)."""
    note = getattr(t if t._base is None else t._base, "_fivedc_regather", None)
    return note if isinstance(note, _GatherAgain) else None


def mark_regathered(gathered: Tensor, shard: Tensor, steps, groups) -> Tensor:
    """Note on `gathered` (the output of `apply_steps(shard, steps)`) that backward makes it again."""
    root = gathered if gathered._base is None else gathered._base
    root._fivedc_regather = _GatherAgain(shard, steps, groups)
    return gathered


def _pack(t: Tensor):
    root = t if t._base is None else t._base
    note = getattr(root, "_fivedc_regather", None)
    if note is not None:
        return note.at(t)
    if _ACTIVE:
        _ACTIVE[-1].add(t)
    return t


def _unpack(saved):
    return saved.get() if hasattr(saved, "get") and not isinstance(saved, Tensor) else saved


@contextlib.contextmanager
def saving_scope(recorder: SavedRecorder | None = None):
    """Around forward and backward: gathered tensors are kept as notes; with `recorder`,
    what is kept is counted."""
    if recorder is not None:
        _ACTIVE.append(recorder)
    try:
        with torch.autograd.graph.saved_tensors_hooks(_pack, _unpack):
            yield
    finally:
        if recorder is not None:
            _ACTIVE.remove(recorder)


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
