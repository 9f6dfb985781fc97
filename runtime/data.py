"""Token files in, this rank's batch out: packed sequences, a deterministic sampler, resumable at any step.

A token file is a flat array of uint16 or uint32 token ids with no header, as
nanoGPT's `prepare.py` writes them (`np.array(ids, dtype=np.uint16).tofile(...)`),
read memory-mapped. Documents are packed: the file is cut into windows of seq + 1
tokens, window i starting at token i * seq (so every token but the first is a
target once), and a sample is a whole window: the inputs its first seq tokens, the
targets its last seq. No padding, no document boundaries (nanoGPT's convention).

The sampler is a pure function of (seed, step): epoch e = step // steps_per_epoch
shuffles the windows with a generator seeded by (seed, e), and step k takes the
k-th run of `batch` windows of that order (the tail that does not fill a batch is
left out of that epoch). So a run resumed at step k reads exactly what the
uninterrupted run would have, with no state to save but k. Every rank draws the
same global batch and reads from the file only its own rows (its shard of the
batch dim: dp and ep ranks read different rows) before cutting the other dims
(the sequence under cp) with `program.shard`.

`input_roles` says which of the model's inputs gets what: the one an embedding
reads takes the inputs; the one a cross-entropy reads as targets takes the next
tokens, or the same tokens when the model shifts its labels itself (a slice, narrow
or roll between the input and the loss, as Hugging Face's pad-and-slice).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from torch import Tensor

from fivedc.errors import FivedcError
from fivedc.ir.graph import DType, Graph, Op, Redistribute, readers

TOKEN_DTYPES = {"uint16": np.uint16, "uint32": np.uint32}
ROLES = ("inputs", "targets", "labels")  # labels: the input tokens themselves, shifted by the model


@dataclass(frozen=True)
class TokenFile:
    path: str
    dtype: str = "uint16"

    def array(self) -> np.memmap:
        return np.memmap(self.path, dtype=TOKEN_DTYPES[self.dtype], mode="r")


@dataclass(frozen=True)
class Sampler:
    """Which windows of a file make the global batch of each step."""

    tokens: int  # in the file
    seq: int
    batch: int
    seed: int
    shuffle: bool = True

    @property
    def windows(self) -> int:
        return (self.tokens - 1) // self.seq

    @property
    def steps_per_epoch(self) -> int:
        return self.windows // self.batch

    def rows(self, step: int) -> np.ndarray:
        """The window indices of step `step`'s global batch (0-based step)."""
        epoch, index = divmod(step, self.steps_per_epoch)
        order = self._order(epoch)
        return order[index * self.batch:(index + 1) * self.batch]

    def position(self, step: int) -> dict:
        """Where step `step` reads (for the checkpoint index and the log)."""
        epoch, index = divmod(step, self.steps_per_epoch)
        return {"step": step, "epoch": epoch, "batch_in_epoch": index, "steps_per_epoch": self.steps_per_epoch,
                "tokens_seen": step * self.batch * self.seq}

    def _order(self, epoch: int) -> np.ndarray:
        return _permutation(self.windows, self.seed, epoch) if self.shuffle else np.arange(self.windows)


@functools.lru_cache(maxsize=2)
def _permutation(windows: int, seed: int, epoch: int) -> np.ndarray:
    gen = torch.Generator().manual_seed(seed * 1_000_003 + epoch)
    return torch.randperm(windows, generator=gen).numpy()


def read_windows(file: np.memmap, rows: np.ndarray, seq: int) -> np.ndarray:
    """[len(rows), seq + 1] token ids: window r is tokens [r * seq, r * seq + seq + 1)."""
    out = np.empty((len(rows), seq + 1), dtype=np.int64)
    for i, r in enumerate(rows):
        out[i] = file[int(r) * seq:int(r) * seq + seq + 1]
    return out


# ---- the model's inputs ----------------------------------------------------------------
def input_roles(graph: Graph) -> dict[str, str]:
    """Each input of the model -> "inputs", "targets" (the next tokens) or "labels" (the
    same tokens: the model shifts them); a `FivedcError` for an input that is none."""
    users = {name: [node for node, _ in uses] for name, uses in readers(graph.body).items()}
    roles = {}
    for item in graph.inputs:
        role = _role(item.name, users) if item.type.dtype == DType.INT and len(item.type.dims) == 2 else None
        if role is None:
            dims = ", ".join(item.type.dims)
            raise FivedcError(
                f"fivedc train feeds token ids, and the model's input {item.name}: {item.type.dtype}[{dims}] is "
                "neither the tokens an embedding reads nor the targets of a cross-entropy",
                loc=graph.loc, hint="train a model whose inputs are token ids [batch, seq] and targets [batch, seq] "
                "(or labels the model shifts itself); fivedc run trains any model on synthetic data")
        roles[item.name] = role
    if "inputs" not in roles.values():
        raise FivedcError(f"no input of model {graph.name} is read by an embedding: there is nowhere to feed tokens",
                          loc=graph.loc, hint="the model's first input should be token ids read by an embedding")
    return roles


SHIFTS = ("aten.slice", "aten.narrow", "aten.roll")  # ATen calls that move the tokens along a dim


def _role(name: str, users: dict[str, list]) -> str | None:
    """Follow `name` through redistributions and ATen ops (noting one that shifts the
    tokens: a slice, narrow or roll) to an embedding's indices or a cross-entropy's targets."""
    todo, seen = [(name, False)], set()
    found = None
    while todo:
        value, shifted = todo.pop()
        for node in users.get(value, []):
            if isinstance(node, Op) and node.kind == "embedding" and node.args[0] == value and not shifted:
                return "inputs"
            if isinstance(node, Op) and node.kind == "cross_entropy" and node.args[1] == value:
                found = "labels" if shifted else "targets"
            elif isinstance(node, Redistribute) or node.kind == "aten":
                if node.out not in seen:
                    seen.add(node.out)
                    moves = isinstance(node, Op) and str(node.attr("target")).startswith(SHIFTS)
                    todo.append((node.out, shifted or moves))
    return found


def token_shape(graph: Graph) -> tuple[int, int]:
    """(batch, seq) of the model's token inputs: the sizes of their two dims, the same for all."""
    shapes = {(graph.dim(i.type.dims[0]), graph.dim(i.type.dims[1])) for i in graph.inputs}
    if len(shapes) != 1:
        raise FivedcError(f"the inputs of model {graph.name} differ in shape ({sorted(shapes)}): token inputs and "
                          "targets must both be [batch, seq]", loc=graph.loc)
    return shapes.pop()


def check_token_file(path: str, dtype: str, *, graph: Graph, what: str) -> int:
    """The number of tokens in `path`, after checking that it exists, has whole ids, holds
    one batch at least and no id outside the model's vocabulary."""
    from fivedc.runtime.program import _int_bound

    if dtype not in TOKEN_DTYPES:
        raise FivedcError(f"--data-dtype {dtype} is not a token type", hint="uint16 (nanoGPT's) or uint32")
    file = Path(path)
    if not file.is_file():
        raise FivedcError(f"{what} file {path} does not exist" if not file.exists() else f"{path} is not a file",
                          hint="make one with python examples/make_data.py DIR (a flat array of token ids)")
    size, item = file.stat().st_size, np.dtype(TOKEN_DTYPES[dtype]).itemsize
    if size % item:
        raise FivedcError(f"{path} has {size} bytes, not a whole number of {dtype} token ids ({item} bytes each)",
                          hint="is it a token file? give --data-dtype uint32 if it holds 4-byte ids")
    batch, seq = token_shape(graph)
    tokens = size // item
    if (tokens - 1) // seq < batch:
        raise FivedcError(f"{what} file {path} holds {tokens} tokens: not one batch of {batch} sequences of "
                          f"{seq} + 1 tokens ({batch * seq + 1} tokens)", hint="give a longer token file")
    vocab = min(_int_bound(graph, i.name) for i in graph.inputs)
    top = max(int(chunk.max()) for chunk in _chunks(TokenFile(path, dtype).array()))
    if top >= vocab:
        raise FivedcError(f"{what} file {path} holds token id {top}, and the model's vocabulary has {vocab} ids "
                          f"(0..{vocab - 1})", hint="make the data with the model's vocabulary, or a model with "
                          f"vocab > {top}; is --data-dtype {dtype} right?")
    return tokens


def _chunks(array: np.ndarray, size: int = 1 << 24):
    for start in range(0, len(array), size):
        yield array[start:start + size]


# ---- this rank's batch -------------------------------------------------------------------
class RankBatches:
    """This rank's shards of the model's inputs for any step, read from a token file."""

    def __init__(self, file: TokenFile, sampler: Sampler, graph: Graph, ctx, device: torch.device) -> None:
        self.file, self.sampler, self.graph, self.ctx, self.device = file, sampler, graph, ctx, device
        self.roles = input_roles(graph)
        self.array = file.array()

    def at(self, step: int, rows: np.ndarray | None = None) -> dict[str, Tensor]:
        """The inputs of step `step` (or of the given global `rows`), as this rank holds them."""
        from fivedc.runtime.program import shard

        rows = self.sampler.rows(step) if rows is None else rows
        out, cache = {}, {}
        for item in self.graph.inputs:
            batch_dim = item.type.dims[0]
            start, stop = self.ctx.shard_range(batch_dim, item.sharding)
            if (start, stop) not in cache:
                cache[(start, stop)] = torch.from_numpy(read_windows(self.array, rows[start:stop], self.sampler.seq))
            windows = cache[(start, stop)]
            tokens = windows[:, 1:] if self.roles[item.name] == "targets" else windows[:, :-1]
            rest = item.sharding.with_split(batch_dim, ())  # the rows are this rank's already
            out[item.name] = shard(tokens, item.type.dims, rest, self.ctx).to(self.device)
        return out
