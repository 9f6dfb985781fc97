"""Mixed precision: the kernels follow `torch.autocast`, as torch's own modules do.

Under `with torch.autocast(device, dtype=torch.bfloat16)` around a parallelized
module's forward (or `fivedc train/run --precision bf16-mixed`), the parameters stay
in float32 (the master weights, what the optimizer updates and the gradients are
reduced in) and the matrix products run in bfloat16: a `linear`/`matmul` casts its
input and weight to the autocast dtype (torch's autocast does not list `tensordot`,
which the linear kernel is), attention takes q, k, v in it. Norms, the loss and the
RoPE tables compute in float32 whatever their input (`compute_dtype`), as autocast
runs `layer_norm`, `cross_entropy` and friends. The cast of a weight is an autograd
op: its gradient arrives in the weight's float32.
"""

from __future__ import annotations

import torch
from torch import Tensor


def autocast_dtype(t: Tensor) -> torch.dtype | None:
    """The dtype autocast would run a matrix product of `t` in, or None outside autocast."""
    kind = t.device.type
    if kind != "meta" and t.is_floating_point() and torch.is_autocast_enabled(kind):
        return torch.get_autocast_dtype(kind)
    return None


def for_matmul(*tensors: Tensor) -> tuple[Tensor, ...]:
    """The tensors in autocast's dtype when autocast is on (else as they are)."""
    dtype = autocast_dtype(tensors[0])
    if dtype is None:
        return tensors
    return tuple(t.to(dtype) if t.is_floating_point() else t for t in tensors)


def compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """What a reduction (norm, softmax, log-sum-exp) of a `dtype` tensor computes in."""
    return torch.float32 if dtype in (torch.float16, torch.bfloat16) else dtype
