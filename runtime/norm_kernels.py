"""The norm kernels (rmsnorm, layernorm) and swiglu; rmsnorm and swiglu keep less for backward.

`_RMSNorm` saves x and rstd, not the normalised x, and `_SwiGLU` saves gate and up,
recomputing silu(gate), as Megatron's fused kernels do; inside a compiled region
(`runtime/regions.py`) both run as plain ops, which the compiler fuses and
differentiates itself. Entries of `runtime/kernels.py`'s table.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from fivedc.runtime.precision import compute_dtype


class _RMSNorm(torch.autograd.Function):
    """x * rstd * w with rstd = 1 / sqrt(mean(x^2) + eps) over the last dim, saving only x
    and rstd for backward (as the fused norms Megatron uses), not the normalised x:
    dx = rstd * (dn - n * mean(dn * n)), dn = dy * w, n = x * rstd; dw = sum(dy * n)."""

    @staticmethod
    def forward(fctx, x: Tensor, w: Tensor, eps: float) -> Tensor:
        dtype = compute_dtype(x.dtype)
        xc = x.to(dtype)
        rstd = torch.rsqrt(xc.pow(2).mean(-1, keepdim=True) + eps)
        fctx.save_for_backward(x, rstd, w)
        return (xc * rstd * w.to(dtype)).to(x.dtype)

    @staticmethod
    def backward(fctx, grad: Tensor):
        x, rstd, w = fctx.saved_tensors
        dtype = rstd.dtype
        n = x.to(dtype) * rstd
        g = grad.to(dtype)
        grad_x = grad_w = None
        if fctx.needs_input_grad[0]:
            dn = g * w.to(dtype)
            grad_x = (rstd * (dn - n * (dn * n).mean(-1, keepdim=True))).to(x.dtype)
        if fctx.needs_input_grad[1]:
            grad_w = (g * n).reshape(-1, n.shape[-1]).sum(0).reshape(w.shape).to(w.dtype)
        return grad_x, grad_w, None


def rmsnorm(ctx, op, args, dims):
    x, w = args
    eps = float(op.attr("eps", 1e-5))
    shape = x.shape  # over the trailing dims w has: as one dim
    x, w = x.reshape(*shape[: x.dim() - w.dim()], -1), w.reshape(-1)
    if torch.compiler.is_compiling():  # a compiled region (runtime/regions.py): plain ops, which
        xc = x.to(compute_dtype(x.dtype))  # the compiler fuses and differentiates itself
        out = (xc * torch.rsqrt(xc.pow(2).mean(-1, keepdim=True) + eps) * w.to(xc.dtype)).to(x.dtype)
    else:
        out = _RMSNorm.apply(x, w, eps)
    return out.reshape(shape)


def swiglu(ctx, op, args, dims):
    if torch.compiler.is_compiling():
        return F.silu(args[0]) * args[1]
    return _SwiGLU.apply(args[0], args[1])


class _SwiGLU(torch.autograd.Function):
    """silu(gate) * up, saving only gate and up (silu(gate) is recomputed in backward, as
    Megatron's fused SwiGLU does): d_up = dy * silu(gate), d_gate = dy * up * s * (1 + gate
    * (1 - s)) with s = sigmoid(gate)."""

    @staticmethod
    def forward(fctx, gate: Tensor, up: Tensor) -> Tensor:
        fctx.save_for_backward(gate, up)
        return F.silu(gate) * up

    @staticmethod
    def backward(fctx, grad: Tensor):
        gate, up = fctx.saved_tensors
        s = torch.sigmoid(gate)
        grad_up = grad * gate * s if fctx.needs_input_grad[1] else None
        grad_gate = grad * up * s * (1 + gate * (1 - s)) if fctx.needs_input_grad[0] else None
        return grad_gate, grad_up


def layernorm(ctx, op, args, dims):
    x, w = args[0], args[1]
    b = args[2] if len(args) > 2 else None
    return F.layer_norm(x, x.shape[x.dim() - w.dim():], w, b, float(op.attr("eps", 1e-5)))
