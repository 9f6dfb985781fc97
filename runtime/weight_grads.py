"""Zero-bubble's split backward: input gradients now (I), weight gradients later (W).

A linear layer's backward is two matmuls: dX = dY . W^T, on the path to the
previous stage, and dW = X^T . dY, needed only by the optimizer. Zero-bubble
schedules (ZB-H1) run the first in I, send dX on at once, and fill a bubble with
the second in W. Running autograd twice over the chunk (once for inputs, once for
weights) would redo the whole backward in W; instead, while a `WeightGradStore`
is deferring, `DeferrableLinear`'s backward computes dX and keeps (W, X, dY) for
later, and `WeightGradStore.take()` hands those to the W pass, which does only the
dW matmuls. Other weights (norms, embeddings, expert stacks) get their gradients in
I, with the activations' (they are elementwise or gathers, cheap next to matmuls).

Only a weight that is a leaf (a parameter, or ZeRO-3's gathered copy under a
pipeline) is deferred; a linear of two activations computes both in I. The store
lives in the `KernelContext`'s cache (`enable`); the `linear` kernel uses
`DeferrableLinear` only when one is there, so runs without a zero-bubble schedule
keep torch's own tensordot backward.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field

import torch
from torch import Tensor

KEY = "weight_grads"


@dataclass
class DeferredGrad:
    """dW = X^T . dY over the `lead` leading (non-contracted) dims of X and dY."""

    weight: Tensor
    x: Tensor
    grad_out: Tensor
    lead: int

    def run(self) -> None:
        dims = list(range(self.lead))
        grad = torch.tensordot(self.x, self.grad_out, dims=(dims, dims)).to(self.weight.dtype)
        torch.autograd.backward([self.weight], [grad])  # accumulates, and runs the weight's hooks


@dataclass
class WeightGradStore:
    deferring: bool = False
    pending: list[DeferredGrad] = field(default_factory=list)

    @contextlib.contextmanager
    def defer(self):
        """While this runs, linear weights' gradients are kept, not computed."""
        self.deferring = True
        try:
            yield
        finally:
            self.deferring = False

    def take(self) -> list[DeferredGrad]:
        out, self.pending = self.pending, []
        return out


def enable(ctx) -> WeightGradStore:
    """Make the `linear` kernel of this context's program deferrable; the store."""
    return ctx._cache.setdefault(KEY, WeightGradStore())


def store_of(ctx) -> WeightGradStore | None:
    return ctx._cache.get(KEY)


class DeferrableLinear(torch.autograd.Function):
    """`tensordot(x, w, dims=k)` whose weight gradient waits while the store defers."""

    @staticmethod
    def forward(fctx, x: Tensor, w: Tensor, k: int, store: WeightGradStore, value: Tensor | None = None) -> Tensor:
        fctx.k, fctx.store, fctx.weight_dtype = k, store, w.dtype
        fctx.weight = w if w.is_leaf else None  # only a leaf's gradient can wait (autograd owns the rest)
        w = w.to(x.dtype)  # autocast: x is in its dtype already (runtime/precision.py)
        fctx.save_for_backward(x, w)
        return torch.tensordot(x, w, dims=k) if value is None else value  # value: made as a ring brought x

    @staticmethod
    def backward(fctx, grad_out: Tensor):
        x, w = fctx.saved_tensors
        lead = x.dim() - fctx.k
        grad_x = grad_w = None
        if fctx.needs_input_grad[0]:
            grad_x = torch.tensordot(grad_out, w, dims=(list(range(lead, grad_out.dim())), list(range(fctx.k, w.dim()))))
        if fctx.needs_input_grad[1]:
            if fctx.store.deferring and fctx.weight is not None:
                fctx.store.pending.append(DeferredGrad(fctx.weight, x, grad_out, lead))
            else:
                dims = list(range(lead))
                grad_w = torch.tensordot(x, grad_out, dims=(dims, dims)).to(fctx.weight_dtype)
        return grad_x, grad_w, None, None, None
