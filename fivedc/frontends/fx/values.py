"""The values of the fx lowering (`fivedc/frontends/fx/lower.py`) and its handlers (`ops.py`, `layers.py`).

Every fx node lowers to one of these (the lowering's docstring says when): `T` a
tensor held by an IR value or parameter, `Pending` a linear emitted at its first
use, `ParamRef` a parameter read, `Const` a tensor of neither inputs nor
parameters, `RepeatedKV` k or v repeated over heads, `RouterLogits` an MoE block's
logits; `Frame` is one graph being lowered. They live apart from the walk so that
the walk and its handlers can both import them.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.fx as fx
from torch import nn

from fivedc.errors import NotSupportedError
from fivedc.frontends.fx.build import DBlock, DParam, DValue
from fivedc.frontends.fx.warning import FxWarning  # noqa: F401 (where the frontend's modules take it)
from fivedc.frontends.fx.trace import Traced
from fivedc.ir.graph import DType


class Unrecognised(NotSupportedError):
    """An op the fx frontend has no rule for; the walk keeps it as a replicated `aten` op where it can."""


@dataclass(frozen=True, eq=False)
class T:
    ref: DValue | DParam
    ir: tuple[int, ...]
    layout: tuple[tuple[int, ...], ...]
    dtype: DType = DType.FLOAT


@dataclass(eq=False)
class Pending:
    x: T
    module: str  # module path of the linear, relative to the scope
    weight: str  # state-dict keys, relative to the scope
    bias: str | None
    shapes: tuple[tuple[int, ...], tuple[int, ...] | None]  # of the whole weight and bias entries
    rows: tuple[int, int]
    part: str
    node: fx.Node
    done: T | None = None


@dataclass(frozen=True, eq=False)
class ParamRef:
    key: str
    value: nn.Parameter


@dataclass(frozen=True, eq=False)
class TransposedParam:
    """`w.T` of a 2-D parameter: a linear's weight where a matmul takes it (Falcon's
    `x @ self.weight.T`), the parameter transposed where anything else does."""
    ref: ParamRef


@dataclass(frozen=True, eq=False)
class Const:
    value: torch.Tensor


@dataclass(frozen=True, eq=False)
class RepeatedKV:
    t: T
    repeats: int
    dim: int


@dataclass(frozen=True, eq=False)
class RouterLogits:
    """The router logits an MoE block returns beside its output (`out, logits = moe(x)`): usable by nothing,
    since the IR's moe routes inside and gives no logits out."""

    block: str  # the block's module path
    cls: str  # its class name
    node: fx.Node  # the block's call


DYNAMIC = (T, Pending, ParamRef, TransposedParam, RepeatedKV, RouterLogits)
SHAPE_QUERIES = {"size", "dim", "numel", "shape", "ndim", "dtype", "device", "is_floating_point"}


@dataclass(eq=False)
class Frame:
    """One graph being lowered: the top level, or a repeat body."""

    traced: Traced
    block: DBlock
    syms: dict
    params: dict  # (key, rows, role) -> DParam


SIZE_ONE_HINT = ("trace with example inputs (or a config) where that dim is larger than 1 (batch=2, n_head=2), "
                 "or keep the size-1 dim out of that view or squeeze")
