"""The plain module as the plan computes it: float64 everywhere, and no dropout.

Libraries compute RMSNorm, the rotary tables or the loss in float32 on purpose
(`x.to(torch.float32)`, `logits.float()`, `torch.arange(..., dtype=torch.float)`),
even inside a float64 model. A plan computes at one dtype, so the casts are no ops
in the IR. To compare the two exactly, the float64 check runs the plain module
with every lower floating dtype read as float64, and the frontend captures a
float64 module the same way (so the tables it reads off are float64 too). Where
torch has no float64 kernel for an op on this device, the mode computes it exactly
with ops that have one: `torch._grouped_mm` (what `F.grouped_mm` calls; Hugging
Face's MoE experts use it, and on CPU it takes float32 and 16-bit floats only) as
one matrix product per group.

The IR has no dropout: the frontend drops it with a warning at its line. The
reference of a check runs the module with dropout off (`without_dropout`), so both
sides compute the same function; its random masks could not be matched anyway.
"""

from __future__ import annotations

import contextlib
import sys

import torch
from torch import Tensor, nn
from torch.overrides import TorchFunctionMode

_LOWER = (torch.float32, torch.float16, torch.bfloat16)


class _Float64Everywhere(TorchFunctionMode):
    """Every floating dtype a call names becomes float64 (`x.float()`, `x.to(torch.float32)`,
    `torch.arange(..., dtype=torch.float)`), so a model that computes its norms or rotary tables
    in float32 on purpose runs wholly in float64, as the plan does: the plan computes at one dtype."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if torch.compiler.is_compiling():  # a region torch compiles itself (flex attention's op, under export)
            return func(*args, **(kwargs or {}))
        if _from_torch_itself():  # torch.export's fake tensors of a float32 buffer must stay float32
            return func(*args, **(kwargs or {}))
        if func in (Tensor.float, Tensor.half, Tensor.bfloat16):
            func = Tensor.double
        args = tuple(_up(a) for a in args)
        kwargs = {k: _up(v) for k, v in (kwargs or {}).items()}
        if func is torch._grouped_mm and _grouped_in_float64(*args, **kwargs):
            return _grouped_mm(*args, **kwargs)
        return func(*args, **kwargs)


# torch's own machinery, whose dtypes describe tensors that exist (a fake copy of a float32 constant)
_INTERNALS = ("torch._subclasses", "torch._export", "torch.export", "torch._functorch", "torch._library",
              "torch._higher_order_ops", "torch._prims", "torch._refs", "torch._decomp", "torch.fx.experimental")
_PASSING = ("torch.overrides", "torch.utils._python_dispatch", "torch.utils._device")


def _from_torch_itself() -> bool:
    """Whether the torch call the mode sees comes from torch's own machinery, not from a model."""
    frame = sys._getframe(2)
    while frame is not None and frame.f_globals.get("__name__", "").startswith(_PASSING):
        frame = frame.f_back
    return frame is not None and frame.f_globals.get("__name__", "").startswith(_INTERNALS)


def _grouped_in_float64(mat_a, mat_b, offs=None, bias=None, out_dtype=None) -> bool:
    """A grouped product of a float64 [tokens, k] by [groups, k, n] at offsets (the MoE forward)."""
    return mat_a.dtype == torch.float64 and mat_a.dim() == 2 and mat_b.dim() == 3 and offs is not None \
        and bias is None and out_dtype in (None, torch.float64)


def _grouped_mm(mat_a: Tensor, mat_b: Tensor, offs: Tensor, bias=None, out_dtype=None) -> Tensor:
    """torch._grouped_mm's 2-D by 3-D case: the rows of group g (offs[g-1]:offs[g]) times mat_b[g];
    rows past the last offset are zero."""
    pieces, start = [], 0
    for g, end in enumerate(offs.tolist()):
        pieces.append(mat_a[start:end] @ mat_b[g].to(mat_a.dtype))
        start = end
    pieces.append(mat_a.new_zeros(mat_a.shape[0] - start, mat_b.shape[-1]))
    return torch.cat(pieces)


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
