"""Gradient buckets: sum gradients a bucket at a time, from backward hooks when overlap is on.

The plan's buckets (`passes/overlap.py`) expand to parameter instances in launch
order (a repeat body's buckets once per layer, last layer first). With overlap on,
each parameter's post-accumulate-grad hook marks it ready; a bucket starts its
asynchronous collective once all its gradients are ready and every bucket before
it has started, so all ranks start them in the plan's order. `finish` starts what
is left (everything, with overlap off), waits, and hands back the sums.

A bucket is one flat buffer. ZeRO-0 all-reduces the concatenated gradients. ZeRO-1
and ZeRO-2 reduce-scatter them (2Ψ with the gather of the updated parameters, not
the 3Ψ of an all-reduce and a gather): the buffer is laid out as [n, sum of chunks]
(row i holds every parameter's chunk i), which is what a reduce-scatter splits; on
gloo it is an all-reduce, and the rank keeps its row. ZeRO-2 starts them during
backward and drops each full gradient as its bucket starts; ZeRO-1 keeps the full
gradients until backward ends (its memory holds them whole) and reduce-scatters
every bucket then; at most two whole buckets are in flight (`IN_FLIGHT`: starting a
third waits for the oldest). A parameter's full gradient is released when its bucket
starts.
"""

from __future__ import annotations

import weakref

import torch
import torch.distributed as dist
from torch import Tensor

from fivedc.passes.overlap import expand_buckets

IN_FLIGHT = 2  # ZeRO-2: whole buckets laid out for their reduce-scatter at once

__all__ = ["GradBuckets", "call_weakly", "expand_buckets"]


def call_weakly(method: weakref.WeakMethod, *args, skip: int = 0):
    """A tensor hook that calls `method(*args, *its own arguments after the first skip)`, and
    does nothing once the method's object is gone. A hook holds its object weakly: a hold from a
    tensor (C++, unseen by gc) would keep the object, the collectives it started and through
    them their process group alive after the job (a long-lived worker's gloo threads piled up
    run after run)."""
    def hook(*given):
        bound = method()
        return bound(*args, *given[skip:]) if bound is not None else None
    return hook


class GradBuckets:
    def __init__(self, params: dict[str, Tensor], buckets: list[tuple[str, ...]], specs: dict, groups: dict,
                 *, stage: int, overlap: bool) -> None:
        self.params, self.buckets, self.specs, self.groups, self.stage = params, buckets, specs, groups, stage
        self.scatter = stage in (1, 2)  # reduce-scatter into this rank's chunk (else all-reduce)
        overlap = overlap and stage != 1  # ZeRO-1 keeps the full gradients through backward
        self.index_of = {name: k for k, names in enumerate(buckets) for name in names}
        self.ready: list[set[str]] = [set() for _ in buckets]
        self.started: list[tuple[Tensor, object]] = []
        self.started_early = 0  # buckets already started by hooks when `finish` was called (last step)
        if overlap:
            on_grad = weakref.WeakMethod(self._on_grad)
            for name in self.index_of:
                params[name].register_post_accumulate_grad_hook(call_weakly(on_grad, name, skip=1))

    def _on_grad(self, name: str) -> None:
        self.ready[self.index_of[name]].add(name)
        while len(self.started) < len(self.buckets) and self._is_ready(len(self.started)):
            self._start(len(self.started))

    def _is_ready(self, k: int) -> bool:
        return len(self.ready[k]) == len(self.buckets[k])

    def _start(self, k: int) -> None:
        names = self.buckets[k]
        group = self.groups[names[0]]
        if not self.scatter:
            flat = torch.cat([self._take_grad(name).reshape(-1) for name in names])
            self.started.append((flat, dist.all_reduce(flat, group=group, async_op=True)))
            return
        if k >= IN_FLIGHT:  # at most two whole buckets laid out at once: the oldest settles first
            self._settle(k - IN_FLIGHT)
        flat = self._laid_out(names)
        if flat.is_cuda and "nccl" in str(dist.get_backend(group)):
            out = torch.empty(flat.numel() // self.specs[names[0]].n, dtype=flat.dtype, device=flat.device)
            self.started.append((out, dist.reduce_scatter_tensor(out, flat, group=group, async_op=True)))
            return
        self.started.append((flat, dist.all_reduce(flat, group=group, async_op=True)))

    def _take_grad(self, name: str) -> Tensor:
        """A parameter's gradient (zeros for an unused one), dropped from the parameter."""
        p = self.params[name]
        grad = p.grad if p.grad is not None else torch.zeros_like(p)
        p.grad = None
        return grad

    def _laid_out(self, names: tuple[str, ...]) -> Tensor:
        """The bucket as one flat [n, sum of chunks] buffer (row i: every gradient's chunk i,
        the last one padded with zeros), each gradient copied in and dropped in turn: no
        second copy of the bucket is ever live."""
        n = self.specs[names[0]].n
        first = self.params[names[0]]
        flat = torch.zeros(n, sum(self.specs[name].chunk for name in names), dtype=first.dtype, device=first.device)
        offset = 0
        for name in names:
            spec, grad = self.specs[name], self._take_grad(name).reshape(-1)
            whole, rest = divmod(spec.numel, spec.chunk) if spec.chunk else (0, 0)
            block = flat[:, offset:offset + spec.chunk]
            block[:whole].copy_(grad[:whole * spec.chunk].view(whole, spec.chunk))
            if rest:
                block[whole, :rest].copy_(grad[whole * spec.chunk:])
            offset += spec.chunk
        return flat.reshape(-1)

    def _settle(self, k: int) -> None:
        """Wait for bucket k and keep only what it hands back (ZeRO-2: this rank's row)."""
        flat, work = self.started[k]
        if work is not None:
            work.wait()
            names = self.buckets[k]
            if self.scatter and flat.numel() > sum(self.specs[n].chunk for n in names):
                spec = self.specs[names[0]]
                flat = flat.view(spec.n, -1)[spec.index].clone()  # gloo: keep this rank's row only
            self.started[k] = (flat, None)

    def finish(self) -> dict[str, Tensor]:
        """Start what has not started, wait for every bucket, and return the summed
        gradients: full (stage 0) or this rank's chunk (stages 1, 2)."""
        self.started_early = len(self.started)
        for k in range(len(self.started), len(self.buckets)):
            self._start(k)
        out: dict[str, Tensor] = {}
        for k, names in enumerate(self.buckets):
            self._settle(k)
            flat = self.started[k][0]
            offset = 0
            for name in names:
                size = self.specs[name].chunk if self.scatter else self.params[name].numel()
                out[name] = flat[offset:offset + size]
                offset += size
        self.ready = [set() for _ in self.buckets]
        self.started = []
        return out
