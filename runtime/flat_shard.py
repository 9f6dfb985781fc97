"""A parameter cut over its ZeRO group, and gathered back.

`FlatShard` says how one parameter's flattened local tensor is cut into `n` equal
chunks (the last padded) over the ranks of its group, and gathers or
reduce-scatters one parameter; `gather_flat` gathers many at once, one collective
per group and bucket (`runtime/zero.py` and `fivedc/parallel/weights.py` use it).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import Tensor


@dataclass(frozen=True)
class FlatShard:
    """How one parameter's flattened local tensor is cut over its ZeRO group: `n`
    chunks of `chunk` elements (the tail padded with zeros), chunk `index` owned here.
    Owned buffers (ZeRO-3 parameters, ZeRO-2 gradients, AdamW moments) are always
    `chunk` long, so every rank holds the same bytes and collectives need no resizing."""

    numel: int
    n: int
    index: int
    group: object | None  # ProcessGroup; None when n == 1

    @property
    def chunk(self) -> int:
        return math.ceil(self.numel / self.n)

    @property
    def owned_length(self) -> int:
        """How many real (not padding) elements the owned chunk has."""
        return max(0, min(self.chunk, self.numel - self.index * self.chunk))

    def owned(self, flat: Tensor) -> Tensor:
        """The owned elements of a full flat tensor (a view; shorter than `chunk` at the tail)."""
        start = min(self.index * self.chunk, self.numel)
        return flat[start:start + self.owned_length]

    def pad(self, owned: Tensor) -> Tensor:
        out = torch.zeros(self.chunk, dtype=owned.dtype, device=owned.device)
        out[: owned.numel()] = owned
        return out

    def gather(self, chunk: Tensor) -> Tensor:
        """The full flat tensor from every rank's `chunk`-long owned buffer."""
        return self.gather_async(chunk).wait() if self.n > 1 else chunk

    def gather_async(self, chunk: Tensor) -> PendingGather:
        parts = [torch.empty_like(chunk) for _ in range(self.n)]
        work = dist.all_gather(parts, chunk.contiguous(), group=self.group, async_op=True)
        return PendingGather(parts, work, self.numel)

    def reduce_scatter(self, flat: Tensor) -> Tensor:
        """This rank's `chunk`-long buffer of the sum of `flat` over the group."""
        if self.n == 1:
            return flat
        padded = torch.zeros(self.chunk * self.n, dtype=flat.dtype, device=flat.device)
        padded[: self.numel] = flat
        if padded.is_cuda and "nccl" in str(dist.get_backend(self.group)):
            out = torch.empty(self.chunk, dtype=flat.dtype, device=flat.device)
            dist.reduce_scatter_tensor(out, padded, group=self.group)
            return out
        dist.all_reduce(padded, group=self.group)  # gloo: all-reduce, keep the chunk
        return padded[self.index * self.chunk:(self.index + 1) * self.chunk].clone()


@dataclass
class PendingGather:
    parts: list[Tensor]
    work: object
    numel: int

    def wait(self) -> Tensor:
        self.work.wait()
        whole = torch.cat(self.parts)
        return whole if whole.numel() == self.numel else whole[: self.numel]


def flat_shard(numel: int, group) -> FlatShard:
    if group is None:
        return FlatShard(numel, 1, 0, None)
    return FlatShard(numel, dist.get_world_size(group), dist.get_rank(group), group)


GATHER_BUCKET_BYTES = 25 * 2**20  # the plan's default bucket (DDP's 25 MiB)


def gather_flat(chunks: dict[str, Tensor], specs: dict[str, FlatShard], *, out: dict[str, Tensor] | None = None,
                buckets: Sequence[Sequence[str]] = (), bucket_bytes: int = GATHER_BUCKET_BYTES) -> dict[str, Tensor]:
    """Every parameter's full flat tensor from every rank's owned chunk, a few collectives
    in all instead of one per parameter.

    `chunks[name]` is this rank's owned part (at most `spec.chunk` elements; a shorter
    tail is padded with zeros). `buckets` (names per collective, in order: the plan's
    gradient buckets, each of one group) come first, as the plan lists ZeRO-1/2's
    gathers; the parameters in none of them are taken in name order and grouped by
    (process group, dtype, device); each group's padded chunks are concatenated into
    one send buffer and all-gathered with ONE collective, capped at `bucket_bytes` of
    gathered output (a group larger than that takes a few; a parameter larger than
    it, one of its own): the cap bounds the transient send and receive buffers, which
    uncapped would be a second copy of all of a group's parameters. Every rank of a
    group holds the same names and sizes in it, so all build the same buckets. They
    run in the order of their first name: that name is the same on every rank of the
    bucket's group, and differs between the buckets of one rank, so no ranks can wait
    on each other in a cycle across groups. The result is split into each parameter's
    flat tensor (`numel` long, padding dropped), written into `out[name]` when given
    (flat, `numel` long; it may alias the chunk) or into a new tensor. Exact: only
    copies. NCCL gathers into one tensor (`all_gather_into_tensor`), gloo into rows.
    """
    result: dict[str, Tensor] = {}
    for names in _gather_buckets(chunks, specs, buckets, bucket_bytes):
        spec, first = specs[names[0]], chunks[names[0]]
        sizes = [specs[n].chunk for n in names]
        send = torch.zeros(sum(sizes), dtype=first.dtype, device=first.device)
        for name, part in zip(names, send.split(sizes)):
            part[: chunks[name].numel()] = chunks[name].reshape(-1)
        gathered = torch.empty(spec.n, send.numel(), dtype=send.dtype, device=send.device)
        if send.is_cuda and "nccl" in str(dist.get_backend(spec.group)):
            dist.all_gather_into_tensor(gathered.view(-1), send, group=spec.group)
        else:
            dist.all_gather(list(gathered.unbind(0)), send, group=spec.group)
        for name, rows in zip(names, gathered.split(sizes, dim=1)):  # rows[i]: rank i's chunk of `name`
            numel = specs[name].numel
            dest = out[name] if out is not None else torch.empty(numel, dtype=send.dtype, device=send.device)
            result[name] = unpad_into(dest, rows)
    for name, chunk in chunks.items():  # nothing to gather over
        if specs[name].n == 1:
            whole = chunk.reshape(-1)[: specs[name].numel]
            result[name] = out[name].copy_(whole) if out is not None else whole
    return result


def _gather_buckets(chunks: dict[str, Tensor], specs: dict[str, FlatShard], buckets: Sequence[Sequence[str]],
                    bucket_bytes: int) -> list[list[str]]:
    """Names per collective: the given buckets (what of them is here), then the rest by
    (group, dtype, device) in name order, closed at `bucket_bytes`."""
    given = [kept for b in buckets if (kept := [n for n in b if n in chunks and specs[n].n > 1])]
    covered = {n for b in given for n in b}
    open_: dict[tuple, tuple[list[str], int]] = {}  # key -> (names, gathered bytes)
    done: list[list[str]] = []
    for name in sorted(chunks):
        spec, t = specs[name], chunks[name]
        if spec.n == 1 or name in covered:
            continue
        key, size = (id(spec.group), t.dtype, t.device), spec.n * spec.chunk * t.element_size()
        names, filled = open_.get(key, ([], 0))
        if names and filled + size > bucket_bytes:
            done.append(names)
            names, filled = [], 0
        open_[key] = (names + [name], filled + size)
    return given + sorted(done + [names for names, _ in open_.values()], key=lambda names: names[0])


def unpad_into(dest: Tensor, rows: Tensor) -> Tensor:
    """Copy the [n, chunk] gathered chunks into the flat `dest` (numel long), dropping the padding."""
    chunk = rows.shape[1]
    whole, rest = divmod(dest.numel(), chunk)
    dest[: whole * chunk].view(whole, chunk).copy_(rows[:whole])
    if rest:
        dest[whole * chunk:].copy_(rows[whole, :rest])
    return dest
