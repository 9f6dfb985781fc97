"""The plain module as the plan computes it: float64 everywhere, and no dropout.

Libraries compute RMSNorm, the rotary tables or the loss in float32 on purpose
(`x.to(torch.float32)`, `logits.float()`, `torch.arange(..., dtype=torch.float)`),
even inside a float64 model. A plan computes at one dtype, so the casts are no ops
in the IR. To compare the two exactly, the float64 check runs the plain module
with every lower floating dtype read as float64, and the frontend captures a
float64 module the same way (so the tables it reads off are float64 too).

The IR has no dropout: the frontend drops it with a warning at its line. The
reference of a check runs the module with dropout off (`without_dropout`), so both
sides compute the same function; its random masks could not be matched anyway.
"""

from __future__ import annotations

import contextlib

import torch
from torch import Tensor, nn
from torch.overrides import TorchFunctionMode

_LOWER = (torch.float32, torch.float16, torch.bfloat16)


class _Float64Everywhere(TorchFunctionMode):
    """Every floating dtype a call names becomes float64 (`x.float()`, `x.to(torch.float32)`,
    `torch.arange(..., dtype=torch.float)`), so a model that computes its norms or rotary tables
    in float32 on purpose runs wholly in float64, as the plan does: the plan computes at one dtype."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func in (Tensor.float, Tensor.half, Tensor.bfloat16):
            func = Tensor.double
        args = tuple(_up(a) for a in args)
        kwargs = {k: _up(v) for k, v in (kwargs or {}).items()}
        return func(*args, **kwargs)


def _up(value):
    if isinstance(value, torch.dtype) and value in _LOWER:
        return torch.float64
    if isinstance(value, (list, tuple)) and any(isinstance(v, torch.dtype) for v in value):
        return type(value)(_up(v) for v in value)
    return value


def float64_everywhere(on: bool = True):
    """The float64 reference: the plain module run with every lower floating dtype read as float64."""
    return _Float64Everywhere() if on else contextlib.nullcontext()


def is_float64(module: nn.Module) -> bool:
    """Whether the module's floating parameters are float64 (and it has some)."""
    dtypes = {p.dtype for p in module.parameters() if p.is_floating_point()}
    return dtypes == {torch.float64}


_F = torch.nn.functional
# each dropout function: the name and position of its probability
_DROPOUTS = {_F.dropout: ("p", 1), _F.dropout1d: ("p", 1), _F.dropout2d: ("p", 1), _F.dropout3d: ("p", 1),
             _F.alpha_dropout: ("p", 1), _F.feature_alpha_dropout: ("p", 1), torch.dropout: ("p", 1),
             _F.scaled_dot_product_attention: ("dropout_p", 4)}


class _WithoutDropout(TorchFunctionMode):
    """Every dropout call (nn.Dropout, F.dropout, SDPA's dropout_p) with probability 0."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = dict(kwargs or {})
        if func in _DROPOUTS:
            name, position = _DROPOUTS[func]
            if len(args) > position:
                args = (*args[:position], 0.0, *args[position + 1:])
            else:
                kwargs[name] = 0.0
        return func(*args, **kwargs)


def without_dropout(on: bool = True):
    """The reference as the plan computes it: dropout off (the IR has none)."""
    return _WithoutDropout() if on else contextlib.nullcontext()
