"""What a rank holds at each moment of a step: every storage from its allocation to its free.

`LiveBytes` is a `TorchDispatchMode`: every op's output storages are recorded when first
seen, with their bytes and a category, and a weak-reference finalizer takes them off when
torch frees them (storages keep their Python object while alive, so one object is one
allocation). Nothing is allocated to find this out: on the meta device a tensor has a
storage with its size and no memory, so the runtime's own step at a 405B model's per-rank
shapes is counted on a laptop (`fivedc rehearse`, `runtime/rehearse.py`).

Categories, as the estimate has them (`fivedc/estimates/memory.py`): what is first seen is
`transient` (buffers in flight, collectives' buffers, recomputed regions, gathered ZeRO-3
parameters); `mark` moves a storage to another category: the parameters, the optimizer
state and the gradients (marked when their tensors are known), and `activations`, what
autograd keeps for backward (`runtime/saved.py`'s recorder hook, which sees every
saved tensor and the inputs of recomputed regions and pipeline boundaries). The peak is
the largest sum over the step; `at_peak` is how it splits, and `largest` the biggest
storages live at (within 1 % of) the peak.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass

import torch
from torch import Tensor
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten, tree_leaves, tree_unflatten

CATEGORIES = ("params", "grads", "optimizer", "activations", "transient")
SNAPSHOT_STEP = 1.01  # `largest` is taken again when the peak has grown by 1 %
LARGEST = 8


@dataclass(frozen=True)
class Storage:
    """One storage live at the peak: its bytes, category and the op that made it."""

    nbytes: int
    category: str
    made_by: str
    shape: tuple[int, ...]
    dtype: str


class LiveBytes(TorchDispatchMode):
    """Storages live on this thread's ops, by category; `peak`, `at_peak`, `largest`."""

    def __init__(self) -> None:
        super().__init__()
        self.live: dict[int, Storage] = {}  # id(storage object) -> what it is
        self.by_category = dict.fromkeys(CATEGORIES, 0)
        self.total = self.peak = 0
        self.at_peak = dict(self.by_category)
        self.largest: tuple[Storage, ...] = ()
        self._snapshot_at = 0
        # On the meta device an op's outputs depend only on its inputs' shapes: a functional op
        # seen before on the same shapes is answered from here (torch's meta kernels are Python)
        self._made: dict[tuple, tuple] = {}

    # ---- what torch tells ---------------------------------------------------------------
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        key = _shape_key(func, args, kwargs)
        made = self._made.get(key) if key is not None else None
        if made is not None:  # the same op on the same shapes made these before: make them again
            spec, layouts = made
            out = tree_unflatten([torch.empty_strided(size, stride, dtype=dtype, device="meta")
                                  for size, stride, dtype in layouts], spec)
        else:
            out = func(*args, **kwargs)
            if key is not None:
                self._remember(key, out)
        made_by = func.overloadpacket.__name__
        for t in (out,) if isinstance(out, Tensor) else tree_leaves(out):
            if isinstance(t, Tensor):
                self.see(t, made_by=made_by)
        return out

    def _remember(self, key, out) -> None:
        leaves, spec = tree_flatten(out)
        if leaves and all(isinstance(t, Tensor) and t.is_meta and t.storage_offset() == 0 for t in leaves):
            self._made[key] = (spec, [(tuple(t.shape), t.stride(), t.dtype) for t in leaves])

    def see(self, t: Tensor, *, made_by: str = "", category: str = "transient") -> None:
        """Record `t`'s storage if it is new."""
        storage = t.untyped_storage()
        key = id(storage)
        if key in self.live or storage.nbytes() == 0:
            return
        self.live[key] = Storage(storage.nbytes(), category, made_by, tuple(t.shape), str(t.dtype).removeprefix("torch."))
        weakref.finalize(storage, self._freed, key)
        self._add(category, storage.nbytes())

    def mark(self, tensors, category: str) -> None:
        """These tensors' storages are of `category` from now on (recorded first if new);
        a parameter or an optimizer state stays what it is."""
        for t in tensors:
            if not isinstance(t, Tensor):
                continue
            self.see(t, category=category, made_by="(held)")
            key = id(t.untyped_storage())
            old = self.live.get(key)
            if old is None or old.category == category or old.category in ("params", "optimizer"):
                continue
            self.by_category[old.category] -= old.nbytes
            self.by_category[category] += old.nbytes
            self.live[key] = Storage(old.nbytes, category, old.made_by, old.shape, old.dtype)
            if self.total == self.peak:  # still at the peak: it splits as now
                self.at_peak = dict(self.by_category)

    def add(self, t: Tensor) -> None:
        """The hook of `runtime/saved.py`: `t` is kept for backward."""
        self.mark([t], "activations")

    def reset_peak(self) -> None:
        """The peak from now on (after setting up, before the step)."""
        self.peak, self.at_peak, self._snapshot_at = self.total, dict(self.by_category), 0
        self._snapshot()

    # ---- bookkeeping ----------------------------------------------------------------------
    def _freed(self, key: int) -> None:
        storage = self.live.pop(key, None)
        if storage is not None:
            self._add(storage.category, -storage.nbytes)

    def _add(self, category: str, nbytes: int) -> None:
        self.by_category[category] += nbytes
        self.total += nbytes
        if self.total > self.peak:
            self.peak, self.at_peak = self.total, dict(self.by_category)
            if self.total >= self._snapshot_at * SNAPSHOT_STEP:
                self._snapshot()

    def _snapshot(self) -> None:
        self._snapshot_at = self.total
        self.largest = tuple(sorted(self.live.values(), key=lambda s: -s.nbytes)[:LARGEST])


_FUNCTIONAL: dict = {}  # op -> whether it neither mutates nor aliases (its schema says)


def _is_mark(leaf) -> bool:
    return type(leaf) is tuple and len(leaf) == 2 and leaf[0] == "list"


def _flat(args, kwargs):
    """The arguments one list deep, as ATen takes them, each list marked by its length (so
    `([a], [b, c])` and `([a, b], [c])` differ); a list inside a list yields a value no key takes."""
    for arg in (*args, *kwargs.values()):
        if isinstance(arg, (list, tuple)):
            yield ("list", len(arg))
            for item in arg:
                yield object() if isinstance(item, (list, tuple)) else item
        else:
            yield arg


def _shape_key(func, args, kwargs) -> tuple | None:
    """What a functional op's meta outputs depend on: the op, its tensors' shapes, strides
    and dtypes, its other arguments; None when the op may alias or mutate, or an input is
    not on the meta device, or an argument cannot be a key."""
    functional = _FUNCTIONAL.get(func)
    if functional is None:
        schema = func._schema
        functional = _FUNCTIONAL[func] = not (schema.is_mutable or any(r.alias_info for r in schema.returns))
    if not functional:
        return None
    parts: list = [func, tuple(kwargs)]
    for leaf in _flat(args, kwargs):
        if isinstance(leaf, Tensor):
            if not leaf.is_meta:
                return None
            parts.append((tuple(leaf.shape), leaf.stride(), leaf.dtype, leaf.storage_offset()))
        elif leaf is None or isinstance(leaf, (bool, int, float, str, torch.dtype, torch.device,
                                               torch.memory_format, torch.layout)) or _is_mark(leaf):
            parts.append((type(leaf), leaf))
        else:
            return None
    try:
        key = tuple(parts)
        hash(key)
    except TypeError:
        return None
    return key
