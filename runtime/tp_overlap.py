"""A linear input's tensor-parallel backward sum, run behind the weight gradients of its readers.

Megatron's async tensor parallelism: a column-parallel linear's input gradient dX is
summed over tp (an all-reduce; under SP a reduce-scatter) while the same backward
computes the weight gradient dW = X^T dY, which the sum does not need. Where the plan
marks a redistribution's backward sum so (`Collective.overlaps`, from
`passes/communication.py`), the program gives it a `PutOff` naming the
readers' weights, and hands the same `PutOff` to each reader's kernel with its weight's
index (`runtime/linear_paths.LinearFeed`; which linears read it is worked out once
from the plan, `LinearPath.put_off_by`):

- the redistribution takes those weights as inputs of its autograd node
  (`runtime/collectives.redistribute`), and each reader reads a detached weight
  (`PutOffLinear`), so the weight's gradient comes from the redistribution's node,
  not from the linear's: autograd accumulates it and runs its hooks (gradient
  buckets) in the same backward, with nothing nested;
- a reader's backward computes dX only and keeps (X, dY); under SP, where X is
  gathered again for dW (`runtime/saved.py`; the program hands the `PutOff` that
  note, `PutOff.regathered`, in or out of a saving scope), the first reader's backward starts
  that all-gather async, so it runs while the readers compute dX (Megatron's order:
  gather X, dX, then the sum of dX beside dW);
- the redistribution's backward, which autograd runs once every reader's dX is in,
  starts the sum async, computes the kept dW matmuls, waits, and returns the summed
  dX with the weights' gradients.

On NCCL the sum runs on the communicator's stream, beside the dW matmuls; on gloo in
its worker thread. The program uses it only while its input needs a gradient (else
the redistribution's backward never runs), outside compiled regions, and not with a
zero-bubble store (which puts dW off until W: `runtime/weight_grads.py`).
"""

from __future__ import annotations

import weakref

import torch
from torch import Tensor

from fivedc.runtime.saved import GatherAgain, root_of


class PutOff:
    """The weight gradients of the linears reading one redistributed value."""

    def __init__(self, weights: tuple[Tensor, ...]) -> None:
        self.weights = weights
        self.pending: list[tuple[int, Tensor, Tensor, int, tuple[int, ...] | None]] = []
        self.note: GatherAgain | None = None  # SP: how backward gathers the readers' input again
        self.gathered = None  # a weak reference to the root of the value that note is for

    def regathered(self, value: Tensor, note: GatherAgain) -> None:
        """SP: backward gathers `value` (the readers' input) again, by `note`."""
        self.note, self.gathered = note, weakref.ref(root_of(value))

    def note_for(self, x: Tensor) -> GatherAgain | None:
        """The note that gathers `x` again, if `x` is (a view of) the value `regathered` named."""
        return self.note if self.gathered is not None and self.gathered() is root_of(x) else None

    def index(self, weight: Tensor) -> int | None:
        return next((i for i, w in enumerate(self.weights) if w is weight), None)

    def weight_grads(self) -> list[Tensor | None]:
        """dW = X^T dY of every reader kept since the forward, per weight (summed over readers
        of one weight); None for a weight that needs none."""
        grads: list[Tensor | None] = [None] * len(self.weights)
        for index, x, grad_out, lead, undo in self.pending:
            x = x if isinstance(x, Tensor) else x.get()  # SP: the input gathered again (started early)
            dims = list(range(lead))
            grad = torch.tensordot(x, grad_out, dims=(dims, dims))
            grad = (grad if undo is None else grad.permute(undo)).to(self.weights[index].dtype)
            grads[index] = grad if grads[index] is None else grads[index] + grad
        self.pending = []
        return [g if w.requires_grad else None for g, w in zip(grads, self.weights)]


class PutOffLinear(torch.autograd.Function):
    """`tensordot(x, w, dims=k)` of a detached `w`: backward gives dX and keeps (X, dY) in
    `put_off` for the weight at `index`; `undo` permutes dW back to the weight's own order."""

    @staticmethod
    def forward(fctx, x: Tensor, w: Tensor, k: int, put_off: PutOff, index: int, undo: tuple[int, ...] | None,
                value: Tensor | None = None) -> Tensor:
        fctx.k, fctx.put_off, fctx.index, fctx.undo, fctx.lead = k, put_off, index, undo, x.dim() - k
        w = w.to(x.dtype)  # autocast: x is in its dtype already (runtime/precision.py)
        note = put_off.note_for(x)  # SP: x is gathered again for dW, by its note (which holds the shard only)
        fctx.x = note.at(x) if note is not None else None
        fctx.save_for_backward(*((w,) if note is not None else (w, x)))
        return torch.tensordot(x, w, dims=k) if value is None else value  # value: made as a ring brought x

    @staticmethod
    def backward(fctx, grad_out: Tensor):
        if fctx.x is not None:
            fctx.x.note.start()  # the gather runs while the readers compute dX; dW waits for it
            (w,), x = fctx.saved_tensors, fctx.x
        else:
            w, x = fctx.saved_tensors
        lead = fctx.lead
        grad_x = torch.tensordot(grad_out, w, dims=(list(range(lead, grad_out.dim())), list(range(fctx.k, w.dim()))))
        fctx.put_off.pending.append((fctx.index, x, grad_out, lead, fctx.undo))
        fctx.x = None
        return grad_x, None, None, None, None, None, None
