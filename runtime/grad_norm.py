"""Gradient clipping by the global norm, over every TP/PP/EP/CP/ZeRO shard of every parameter.

The global norm is the norm of all gradients of the model as one device would
hold them. After the gradient sync each element of a full gradient is held by
several ranks: by every rank of the axes that neither split the parameter's dims
nor (under ZeRO, where each rank keeps only its chunk of the summed gradient: ZeRO-1/2
reduce-scatter it)
chunk it. A rank counts its local gradient in the sum of squares only where its
coordinate on each such axis is 0, so every element counts exactly once; pp ranks
hold different parameters, and count their own, but for a parameter several hold (a
tied weight's copies, summed alike): the first of them counts it. One all-reduce over the world
sums the counted squares; every rank then scales all of its gradients by torch's
factor, min(1, max_norm / (norm + 1e-6)) (`torch.nn.utils.clip_grad_norm_`), so
every shard of a gradient is scaled alike.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from fivedc.ir.graph import Param
from fivedc.runtime.reshard import first_holder


def counted_params(named: dict[str, Param], names, *, ctx, zero: int, specs,
                   shared: dict[str, tuple[int, ...]] | None = None) -> set[str]:
    """The parameters (of `names`, those this rank holds) whose local summed gradient this
    rank adds to the global norm: it is the first holder of that piece of the gradient
    (ZeRO-1, -2 and -3 keep a chunk of it per rank of the parameter's group; `shared`: the
    pp ranks holding copies of a parameter, a tied one's, whose gradients are equal)."""
    shared = shared or {}
    return {name for name in names
            if first_holder(named[name], ctx, chunked=zero >= 1 and specs[name].n > 1, pp_ranks=shared.get(name, ()))}


def clip_grad_norm(optimizer, counted: set[str], max_norm: float) -> float:
    """The global norm of the summed gradients in `optimizer.grads` (a `ZeroOptimizer`,
    after `reduce_gradients`); with `max_norm` > 0 every gradient is scaled in place so
    that the norm is at most `max_norm`. Every rank of the world must call it."""
    device = next(iter(optimizer.grads.values())).device if optimizer.grads else torch.device("cpu")
    squares = torch.zeros((), dtype=torch.float64, device=device)
    for name in sorted(counted):
        squares += torch.linalg.vector_norm(_real(optimizer, name), dtype=torch.float64) ** 2
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(squares)
    norm = squares.sqrt().item()
    if max_norm > 0:
        coef = min(1.0, max_norm / (norm + 1e-6))
        for grad in optimizer.grads.values():
            grad.mul_(coef)
    return norm


def _real(optimizer, name: str) -> torch.Tensor:
    """The gradient's real elements: a ZeRO chunk without its padding."""
    grad = optimizer.grads[name].reshape(-1)
    spec = optimizer.specs[name]
    return grad[: spec.owned_length] if optimizer.stage >= 1 and spec.n > 1 else grad
