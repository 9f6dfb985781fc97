"""What tells one pointwise op from another: a `Pointwise` on its `OpSpec` (fivedc/ir/ops.py).

The pointwise ops (the UNARY family: activations; the ELEMENTWISE family: add, sub, mul,
div) share their shape and sharding rules by family. What differs between them is data,
held here once per op and read by every table that used to list the kinds by hand:

    torch      the function the kernel calls   -> runtime/kernels.KERNELS
    saves      what its backward keeps         -> estimates/saved.SAVE_RULES, and
                                                  instructions/unit_program.SAVES_NOTHING
    functions, modules, methods, aten
               what the fx frontend reads as it -> frontends/fx/recognise (op names),
                                                  frontends/fx/export (aten targets),
                                                  frontends/fx/ops.HANDLERS

Torch objects are named by qualified name ("torch.nn.functional.gelu"): the IR never
imports torch (compiling a .5d model needs none of it); `resolve` looks one up where torch
is at hand (the runtime, the fx frontend). docs/adding-an-op.md walks through adding one.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from enum import StrEnum


class Saves(StrEnum):
    """What a pointwise op's backward keeps (fivedc/estimates/saved.py prices each form; the
    kernel saves what torch's autograd saves for `Pointwise.torch`)."""

    NOTHING = "nothing"  # add, sub: the gradient passes through
    INPUT = "input"  # gelu, silu: x
    OUTPUT = "output"  # relu, tanh, sigmoid: y (the gradient is a function of y)
    OTHER_OPERAND = "other operand"  # mul: each operand the other's gradient needs
    QUOTIENT_OPERANDS = "quotient operands"  # div: b when either needs a gradient, a when b does


@dataclass(frozen=True, slots=True)
class Pointwise:
    """One pointwise op's own facts. `torch` is the function its kernel calls, with the op's
    attributes as keywords (gelu: `approximate=`); the fx frontend recognises it too, and
    also `functions` (further callables: `operator.mul`), `modules` (nn module classes),
    `methods` (tensor method names other than the kind's own: `multiply`) and `aten` (names
    of the ATen operators `torch.export` gives for it: `aten.gelu` is "gelu"). A commutative
    elementwise op takes a number or a parameter first (the fx frontend and the sharding rule
    swap it second); a non-commutative one refuses that."""

    torch: str
    saves: Saves
    functions: tuple[str, ...] = ()
    modules: tuple[str, ...] = ()
    methods: tuple[str, ...] = ()
    aten: tuple[str, ...] = ()
    commutative: bool = False  # a op b == b op a: an operand that must come second may be swapped there

    def __post_init__(self) -> None:
        for name in (self.torch, *self.functions, *self.modules):
            if "." not in name:
                raise ValueError(f"pointwise: {name!r} is not a qualified name (write e.g. 'torch.nn.functional.gelu')")
        object.__setattr__(self, "saves", Saves(self.saves))

    @property
    def callables(self) -> tuple[str, ...]:
        """Every callable the fx frontend reads as this op, the kernel's first."""
        return (self.torch, *self.functions)


def resolve(qualname: str):
    """The object a qualified name names ("torch.nn.functional.gelu", "operator.iadd",
    "torch.nn.GELU"): the longest importable module prefix, then attributes."""
    parts = qualname.split(".")
    for cut in range(len(parts) - 1, 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:cut]))
        except ImportError:
            continue
        for attr in parts[cut:]:
            obj = getattr(obj, attr)
        return obj
    raise ImportError(f"{qualname}: no module to import it from")
