"""Reading a checkpoint's pieces into the shards of any rank of any plan: the resharding reader.

A rank's shard of a tensor is a *block*: for each dim, the global indices it holds,
in the order it stores them (`program.shard` takes rows start..stop of the dim after
its storage order: the sequence's balanced layout under cp, an expert placement
under ep), written as runs of consecutive indices. A checkpoint records, for every
tensor, its global shape and the pieces its ranks wrote: a whole block, or (under
ZeRO) a flat range of a block's flattened elements (`runtime/checkpoint.py`).

To read a target block, the reader takes every saved block that meets it (its flat
pieces concatenated first, each checked to cover the block exactly), finds per dim
which target positions it holds and where, and copies them across; the pieces of
one tensor never overlap (one writer per piece), so the copies must cover the
target exactly once, which is checked. Whole pieces are read through safetensors'
slices (only the bounding box of what is needed); nothing is unpickled. The same
reader consolidates (a target block of the full tensor) for `fivedc export` and
`best_model.safetensors`.
"""

from __future__ import annotations

import contextlib
import math
from pathlib import Path

import torch
from torch import Tensor

from fivedc.errors import FivedcError
from fivedc.ir.mesh import MeshAxis
from fivedc.ir.sharding import Sharding

Runs = tuple[tuple[int, int], ...]
Block = tuple[Runs, ...]


def block_of(dims: tuple[str, ...], sharding: Sharding | None, ctx) -> Block:
    """The global indices a rank holds of each dim of a tensor sharded like `sharding`
    (what `program.shard` cuts), as runs."""
    out = []
    for dim in dims:
        sharding_ = sharding or Sharding()
        start, stop = ctx.shard_range(dim, sharding_) if sharding_.axes_of(dim) else (0, ctx.graph.dim(dim))
        order = ctx.storage_order(dim, sharding_)
        out.append(runs_of(order[start:stop]) if order is not None else ((start, stop),))
    return tuple(out)


def first_holder(param, ctx, *, chunked: bool, pp_ranks: tuple[int, ...] = ()) -> bool:
    """Whether this rank is the first of the ranks that hold the same piece of `param`
    (a `Param`): coordinate 0 on every axis that neither splits its dims nor, when
    `chunked` (ZeRO keeps a chunk per rank of its `grad_partial` group), chunks it.
    pp ranks hold different parameters, each the holder of its own, but for one held by
    several (`pp_ranks`: a tied weight's copies, DualPipe's two copies), where the first
    of them holds it (`passes/tied.shared_instances`)."""
    skip = set(param.sharding.split_axes()) if param.sharding is not None else set()
    skip |= set(param.grad_partial) if chunked else set()
    if pp_ranks and ctx.coords[MeshAxis.PP] != pp_ranks[0]:
        return False
    return all(c == 0 for a, c in ctx.coords.items() if a not in skip and a != MeshAxis.PP)


def whole(shape: tuple[int, ...]) -> Block:
    return tuple(((0, size),) for size in shape)


def runs_of(indices: Tensor) -> Runs:
    """Runs of consecutive increasing indices: [0, 1, 2, 7, 8] -> ((0, 3), (7, 9))."""
    values = indices.tolist()
    runs, start = [], 0
    for i in range(1, len(values) + 1):
        if i == len(values) or values[i] != values[i - 1] + 1:
            runs.append((values[start], values[i - 1] + 1))
            start = i
    return tuple(runs)


def indices_of(runs: Runs) -> Tensor:
    return torch.cat([torch.arange(a, b) for a, b in runs]) if runs else torch.zeros(0, dtype=torch.long)


def shape_of(block: Block) -> tuple[int, ...]:
    return tuple(sum(b - a for a, b in runs) for runs in block)


def block_text(block: Block) -> list[str]:
    """A block as JSON writes it: per dim its runs, `0:16,48:64`."""
    return [",".join(f"{a}:{b}" for a, b in runs) for runs in block]


def as_block(value: list[str]) -> Block:
    """The inverse of `block_text`."""
    try:
        return tuple(tuple((int(a), int(b)) for a, b in (run.split(":") for run in text.split(",")))
                     for text in value)
    except (AttributeError, ValueError):
        raise FivedcError(f"a checkpoint piece has block {value!r}, not runs like '0:16,48:64'") from None


class CheckpointReader:
    """The tensors of one checkpoint folder, by key (`param/layers.0.wq`)."""

    def __init__(self, folder: str | Path, index: dict) -> None:
        self.folder, self.index = Path(folder), index
        self._files = contextlib.ExitStack()
        self._open: dict[str, object] = {}

    def __enter__(self) -> CheckpointReader:
        return self

    def __exit__(self, *exc) -> None:
        self._files.close()

    def has(self, key: str) -> bool:
        return key in self.index["tensors"]

    def read(self, key: str, target: Block, dtype: torch.dtype) -> Tensor:
        """The target block of tensor `key`, assembled from every saved piece that meets it."""
        entry = self.index["tensors"][key]
        out = torch.empty(shape_of(target), dtype=dtype)
        want = [indices_of(runs) for runs in target]
        covered = 0
        for block, pieces in _by_block(entry["pieces"]).items():
            where = [_positions(w, indices_of(runs), size) for w, runs, size in zip(want, block, entry["shape"])]
            if any(len(t) == 0 for t, _ in where):
                continue
            values = self._block(key, block, pieces, [p for _, p in where])
            out[_grid([t for t, _ in where])] = values.to(dtype)
            covered += math.prod(len(t) for t, _ in where)
        if covered != out.numel():
            raise FivedcError(f"the checkpoint in {self.folder} holds {covered} of the {out.numel()} elements a rank "
                              f"needs of {key}: its files are incomplete", hint="resume from another checkpoint")
        return out

    def file_tensor(self, file: str, key: str) -> Tensor:
        """One tensor of one rank's file as it was written (a rank's own state)."""
        return self._file(file).get_tensor(key)

    def _block(self, key: str, block: Block, pieces: list[dict], positions: list[Tensor]) -> Tensor:
        """The elements of a saved block at `positions` (per dim, positions inside the block)."""
        shape = shape_of(block)
        if pieces[0]["flat"] is None:
            low = [int(p.min()) for p in positions]
            high = [int(p.max()) + 1 for p in positions]
            sliced = self._file(pieces[0]["file"]).get_slice(pieces[0]["key"])
            box = sliced[tuple(slice(a, b) for a, b in zip(low, high))] if shape else sliced[:]
            return box[_grid([p - a for p, a in zip(positions, low)])]
        flat = sorted(pieces, key=lambda p: p["flat"][0])
        starts = [p["flat"][0] for p in flat]
        stops = [p["flat"][1] for p in flat]
        if starts[0] != 0 or stops[-1] != math.prod(shape) or starts[1:] != stops[:-1]:
            raise FivedcError(f"the checkpoint in {self.folder} has ZeRO chunks of {key} that do not cover a shard "
                              f"(ranges {list(zip(starts, stops))} of {math.prod(shape)})",
                              hint="its files are incomplete: resume from another checkpoint")
        whole_ = torch.cat([self._file(p["file"]).get_tensor(p["key"]).reshape(-1) for p in flat]).view(shape)
        return whole_[_grid(positions)]

    def _file(self, name: str):
        if name not in self._open:
            from safetensors import safe_open

            path = self.folder / name
            if not path.is_file():
                raise FivedcError(f"the checkpoint in {self.folder} lists {name}, which is missing",
                                  hint="its files are incomplete: resume from another checkpoint")
            self._open[name] = self._files.enter_context(safe_open(str(path), framework="pt"))
        return self._open[name]


def consolidate(folder: str | Path, index: dict, *, kind: str = "param", dtype: torch.dtype | None = None
                ) -> dict[str, Tensor]:
    """Every full tensor of one kind (`param/NAME` -> NAME), as one device would hold it."""
    out = {}
    with CheckpointReader(folder, index) as reader:
        for key, entry in sorted(index["tensors"].items()):
            if key.startswith(kind + "/"):
                want = dtype or getattr(torch, entry["dtype"])
                out[key[len(kind) + 1:]] = reader.read(key, whole(tuple(entry["shape"])), want)
    return out


def _by_block(pieces: list[dict]) -> dict[Block, list[dict]]:
    out: dict[Block, list[dict]] = {}
    for piece in pieces:
        out.setdefault(as_block(piece["block"]), []).append(piece)
    return out


def _positions(want: Tensor, have: Tensor, size: int) -> tuple[Tensor, Tensor]:
    """(positions in `want`, positions in `have`) of the global indices both hold."""
    where = torch.full((size,), -1, dtype=torch.long)
    where[have] = torch.arange(len(have))
    found = where[want]
    mask = found >= 0
    return mask.nonzero().flatten(), found[mask]


def _grid(positions: list[Tensor]) -> tuple[Tensor, ...]:
    """Index tensors that select the outer product of per-dim positions."""
    last = len(positions) - 1
    return tuple(p.view(*([1] * d), -1, *([1] * (last - d))) for d, p in enumerate(positions))
