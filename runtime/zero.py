"""ZeRO: optimizer state, gradients and parameters sharded over each parameter's replicas.

A parameter's ZeRO group is its `grad_partial` axes: the ranks that hold the same
replica of it and sum its gradient (dp and ep for dense weights, dp for experts,
and cp and, under SP, tp where those apply). Its local tensor is flattened and cut
into `n` equal chunks (the last one padded), chunk `i` owned by the rank with
group rank `i` (`runtime/flat_shard.py`). Per stage, on each rank:

- ZeRO-1: full gradients kept through backward, then reduce-scattered (each rank gets
  the sum of its chunk: 2Ψ with the gather below, not an all-reduce's 3Ψ); AdamW
  moments only for the owned chunk; the owned chunk of every parameter updated in
  place, then all parameters all-gathered, one collective per gradient bucket of the
  plan (`gather_flat`), not per parameter.
- ZeRO-2: the same reduce-scatter, bucket by bucket during backward, each full
  gradient dropped as its bucket starts; then as ZeRO-1.
- ZeRO-3: only the owned chunk of the parameter is kept at rest. The plan's buckets
  are its groups, as FSDP2's are its modules (`runtime/zero3.py`): one
  all-gather per group in forward, kept while its layer runs; one again in backward
  (autograd keeps a note, not the gathered tensors); one reduce-scatter of the
  group's gradients once its last one is computed. Under a pipeline (`keep_gathered`) the parameters are gathered once per step and
  kept across the microbatches, their gradients reduce-scattered after the last,
  both by the plan's buckets (as stages 1, 2 gather): the memory of whole parameters during
  the step, instead of m times the traffic.

AdamW is written out here (torch's formula, decoupled weight decay), because it
updates slices of parameters in place; in 16-bit training the owned chunk has an
fp32 master copy.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor

from fivedc.runtime.buckets import GradBuckets
from fivedc.runtime.flat_shard import flat_shard, gather_flat
from fivedc.runtime.saved import saving_scope
from fivedc.runtime.zero3 import ShardedParams, _Gathered


@dataclass
class _AdamState:
    exp_avg: Tensor
    exp_avg_sq: Tensor
    master: Tensor | None  # fp32 copy of the owned chunk in 16-bit training
    step: int = 0


def adamw_(p: Tensor, grad: Tensor, state: _AdamState, *, lr: float, weight_decay: float,
           betas=(0.9, 0.999), eps: float = 1e-8) -> None:
    """torch.optim.AdamW's update (single tensor, not amsgrad) of `p` in place; the
    moments may be longer than `p` (a padded chunk): their head is used."""
    beta1, beta2 = betas
    exp_avg, exp_avg_sq = state.exp_avg[: p.numel()], state.exp_avg_sq[: p.numel()]
    state.step += 1
    p.mul_(1 - lr * weight_decay)
    exp_avg.lerp_(grad, 1 - beta1)
    exp_avg_sq.mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
    bias_correction1 = 1 - beta1**state.step
    bias_correction2 = 1 - beta2**state.step
    denom = (exp_avg_sq.sqrt() / math.sqrt(bias_correction2)).add_(eps)
    p.addcdiv_(exp_avg, denom, value=-lr / bias_correction1)


def _all_reduced(grad: Tensor, group) -> Tensor:
    out = grad.clone()
    torch.distributed.all_reduce(out, group=group)
    return out


class ZeroOptimizer:
    """AdamW with ZeRO stage 0-3 over each parameter's `grad_partial` group.

    `params` maps qualified names to this rank's local (TP-sharded) parameters;
    `groups` maps names to the process group of their `grad_partial` axes (None
    when there is nothing to sum over). Stage 0 is plain data parallelism:
    all-reduce and a full update. The program's forward reads `view()`.
    """

    def __init__(self, params: dict[str, Tensor], groups: dict[str, object | None], *, stage: int,
                 lr: float, weight_decay: float, buckets: list[tuple[str, ...]] = (), overlap: bool = True,
                 keep_gathered: bool = False, units: list[tuple[str, int]] = ()) -> None:
        self.stage, self.lr, self.weight_decay, self.groups = stage, lr, weight_decay, groups
        self.overlap = overlap
        self.keep_gathered = keep_gathered and stage == 3  # a pipeline: gather once per step, not per use
        self.gathered: dict[str, Tensor] = {}
        self.shapes = {name: p.shape for name, p in params.items()}
        self.specs = {name: flat_shard(p.numel(), groups.get(name) if stage else None) for name, p in params.items()}
        if stage == 3:  # keep only the owned chunk, a leaf that receives its gradient's chunk
            self.params = {n: self.specs[n].pad(self.specs[n].owned(p.detach().reshape(-1))).requires_grad_(True)
                           for n, p in params.items()}
            self.sharded = ShardedParams(self.params, self.specs, self.shapes, overlap=overlap,
                                         groups=list(zip(buckets, units)))  # `units`: one per bucket
        else:
            self.params = {n: p.detach().requires_grad_(True) for n, p in params.items()}
        self.grads: dict[str, Tensor] = {}  # after `reduce_gradients`: summed, full or the owned chunk
        self.state: dict[str, _AdamState] = {}
        for name, p in self.params.items():
            chunk = self.specs[name].chunk
            sixteen_bit = p.dtype in (torch.bfloat16, torch.float16)
            dtype = torch.float32 if sixteen_bit else p.dtype
            master = self.specs[name].pad(self._owned(name, p).float()) if sixteen_bit else None
            zeros = lambda: torch.zeros(chunk, dtype=dtype, device=p.device)  # noqa: E731
            self.state[name] = _AdamState(zeros(), zeros(), master)
        in_buckets = [b for b in buckets if all(self.groups.get(n) is not None for n in b)]
        self.bucket_names = in_buckets  # stages 1, 2 gather the updated parameters by these, as the plan lists
        self.buckets = GradBuckets(self.params, in_buckets, self.specs, groups, stage=stage, overlap=overlap) \
            if stage < 3 else None

    def view(self) -> dict[str, Tensor] | _Gathered:
        if self.keep_gathered:  # whole parameters for the step, leaves that accumulate every microbatch
            full = gather_flat({n: p.detach() for n, p in self.params.items()}, self.specs, buckets=self.bucket_names)
            self.gathered = {n: (full[n] if self.specs[n].n > 1 else full[n].clone()).view(self.shapes[n])
                             .requires_grad_(True) for n in self.params}  # a one-rank group's is the chunk: copy
            return self.gathered
        return self.sharded.view() if self.stage == 3 else self.params

    def forward_done(self, view: dict[str, Tensor] | _Gathered) -> None:
        if isinstance(view, _Gathered):
            view.done()

    def reduce_gradients(self) -> None:
        """Sum each gradient over its group, bucket by bucket (stages 0-2; with overlap
        on, ZeRO-0/2's buckets mostly started during backward): the full sum for stage 0,
        the owned chunk by reduce-scatter for stages 1 and 2. Stage 3's gradients arrive
        summed and chunked."""
        whole = sum(p.grad.numel() * p.grad.element_size() for p in self.params.values() if p.grad is not None)
        summed = self.buckets.finish() if self.buckets is not None else {}
        if self.gathered:  # kept-gathered ZeRO-3: reduce-scatter once per step, by the plan's buckets
            summed.update(GradBuckets(self.gathered, self.bucket_names, self.specs, self.groups, stage=2,
                                      overlap=False).finish())
        for name, full in self.gathered.items():  # the rest (a bucket the pipeline split, a one-rank group): alone
            if name not in summed:
                grad = full.grad if full.grad is not None else torch.zeros_like(full)
                summed[name] = self.specs[name].reduce_scatter(grad.reshape(-1))  # as it is for one rank
        if self.stage < 3:  # a parameter in no bucket of this rank (a bucket the pipeline split): alone
            for name, p in self.params.items():
                if name not in summed and self.groups.get(name) is not None:
                    grad = (p.grad if p.grad is not None else torch.zeros_like(p)).reshape(-1)
                    summed[name] = self.specs[name].reduce_scatter(grad) if self.stage else _all_reduced(
                        grad, self.groups[name])
        self.gathered = {}
        self.grads = {}
        for name, p in self.params.items():
            grad = summed.get(name)
            if grad is None:  # stage 3, or nothing to sum over
                grad = p.grad if p.grad is not None else torch.zeros_like(p)
            self.grads[name] = grad
            p.grad = None
        after = sum(g.numel() * g.element_size() for g in self.grads.values())
        self.grad_bytes = max(whole, after) if self.stage <= 1 else after  # ZeRO-0/1 hold them whole

    def step(self) -> None:
        """AdamW on every owned part; then (stages 1, 2) every parameter gathered from
        the updated chunks, a few collectives in all (`gather_flat`)."""
        owned_chunks: dict[str, Tensor] = {}
        for name, p in self.params.items():
            spec, state = self.specs[name], self.state[name]
            grad = self._owned_grad(name)
            with torch.no_grad():
                owned = self._owned(name, p)
                if state.master is None:
                    adamw_(owned, grad, state, lr=self.lr, weight_decay=self.weight_decay)
                else:
                    master = state.master[: owned.numel()]
                    adamw_(master, grad.float(), state, lr=self.lr, weight_decay=self.weight_decay)
                    owned.copy_(master)
                if self.stage in (1, 2) and spec.n > 1:
                    owned_chunks[name] = owned
        if owned_chunks:  # every rank updated its chunk: gather the parameters, straight into them
            flat = {name: self.params[name].detach().view(-1) for name in owned_chunks}
            gather_flat(owned_chunks, self.specs, out=flat, buckets=self.bucket_names)
        self.grads = {}

    # ---- what a rank holds ----------------------------------------------------------------
    def full_grads(self) -> dict[str, Tensor]:
        """Every summed gradient at the parameter's local shape (gathers chunks; for checks)."""
        grads = gather_flat(self.grads, self.specs) if self.stage >= 1 else self.grads
        return {name: grad.reshape(self.shapes[name]).detach().clone() for name, grad in grads.items()}

    def full_params(self) -> dict[str, Tensor]:
        if self.stage != 3:
            return {n: p.detach().clone() for n, p in self.params.items()}
        full = gather_flat({n: p.detach() for n, p in self.params.items()}, self.specs)
        return {n: full[n].view(self.shapes[n]).clone() for n in self.params}

    def held_bytes(self) -> dict[str, int]:
        """Bytes this rank holds in parameters, summed gradients and optimizer state."""
        def size(t: Tensor | None) -> int:
            return t.numel() * t.element_size() if t is not None else 0

        states = self.state.values()
        return {
            "params": sum(size(p) for p in self.params.values()),
            "grads": getattr(self, "grad_bytes", sum(size(g) for g in self.grads.values())),
            "optimizer": sum(size(s.exp_avg) + size(s.exp_avg_sq) + size(s.master) for s in states),
        }

    def _owned(self, name: str, p: Tensor) -> Tensor:
        """What this rank updates: the whole flat parameter (stage 0; stage 3's chunk is
        the parameter) or its owned slice of the full one (stages 1, 2)."""
        flat = p.detach().view(-1)
        return self.specs[name].owned(flat) if self.stage in (1, 2) else flat

    def _owned_grad(self, name: str) -> Tensor:
        grad = self.grads[name].reshape(-1)
        return grad[: self.specs[name].owned_length] if self.stage in (1, 2) else grad


def gathered_params_scope(stage: int = 0):
    """Around forward and backward: autograd saves a gathered parameter (ZeRO-3), or a
    gathered activation under sequence parallelism, as a note to gather it again
    (`runtime/saved.py`), so it is freed after its use. Every stage: the activations'
    notes do not depend on ZeRO."""
    return saving_scope()
