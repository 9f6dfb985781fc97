"""Declarations in the DSL: the `dims` block, inputs and params (shapes and inits).

`Declarations` is a base of the lowering in `fivedc/frontends/dsl/lower.py`, as `Values` is:
it evaluates and checks what a model declares before its ops use it (dims at least
1, one batch dim shared by every input, a param or input declared once, a known
init), each mistake a `DslError` at its token. It needs from the lowering
`self.src`, `self.names`, `self.dims`, `self.dim_locs`, `self.inputs` and
`self.declared`; a `Scope` is what one block (the model body or a repeat body) sees and builds.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from lark import Token, Tree

from fivedc.frontends.dsl.values import Values, close, show
from fivedc.ir.graph import PARAM_INITS, DType, Input, Node, Param, TensorType


DTYPES = {"int": DType.INT, "float": DType.FLOAT}
INITS = PARAM_INITS
DEFAULT_STD = 0.02
MAX_DIM = 2**63 - 1


@dataclass(slots=True)
class Scope:
    """What one block sees and builds: the model body, or one repeat body."""

    values: dict[str, str]  # user name -> current SSA name
    params: dict[str, Param]  # params visible here (outer ones included)
    repeat: str | None = None  # the prefix, inside a repeat body
    own: list[Param] = field(default_factory=list)
    items: list[Node] = field(default_factory=list)

    def child(self, prefix: str) -> Scope:
        return Scope(dict(self.values), dict(self.params), prefix)


class Declarations(Values):
    def dims_block(self, tree: Tree, scope: Scope) -> None:
        if scope.repeat is not None:
            raise self.src.error(tree, "dims must be declared outside repeat")
        for dim_def in tree.children:
            name, expr = dim_def.children
            if name in self.dims:
                first = self.dim_locs[name]
                raise self.src.error(name, f"dim {name} is defined twice (first at {first})")
            value = self.expr(expr, 0)
            shown = f"{name} = {self.src.span(expr, expr)}"
            shown += "" if expr.data == "int_lit" else f" = {show(value)}"
            if value < 1:
                raise self.src.error(name, f"dim {shown} must be at least 1")
            if value > MAX_DIM:
                raise self.src.error(name, f"dim {shown} is too large (at most 2**63 - 1)")
            self.dims[str(name)] = value
            self.dim_locs[str(name)] = self.src.at(name)

    def input_decl(self, tree: Tree, scope: Scope) -> None:
        name, dtype, shape = tree.children
        if scope.repeat is not None:
            raise self.src.error(tree, "inputs must be declared outside repeat")
        self.check_new(name)
        if dtype not in DTYPES:
            raise self.src.error(dtype, f"unknown dtype {dtype}; an input is int[...] or float[...]")
        dims = self.shape(shape)
        if not dims:
            raise self.src.error(shape, f"input {name} needs at least one dim, the batch dim")
        if self.inputs and dims[0] != self.inputs[0].type.dims[0]:
            first = self.inputs[0]
            raise self.src.error(
                tree,
                f"input {name} starts with dim {dims[0]}, but every input must start with the "
                f"batch dim {first.type.dims[0]} (the first dim of input {first.name})",
            )
        self.names.value(str(name))
        scope.values[str(name)] = str(name)
        self.declared[str(name)] = ("input", self.src.at(name))
        self.inputs.append(Input(str(name), TensorType(dims, DTYPES[dtype]), self.src.at(tree)))

    def param_decl(self, tree: Tree, scope: Scope) -> None:
        name, shape, *init = tree.children
        if name in scope.params:
            first = scope.params[name].loc
            raise self.src.error(name, f"param {name} is declared twice (first at {first})")
        what, where = self.declared.get(name, ("param", None))
        if what != "param":
            raise self.src.error(name, f"param {name} clashes with the {what} {name} defined at {where}")
        kind, std = self.init(init[0]) if init else ("normal", DEFAULT_STD)
        param = Param(str(name), self.shape(shape), kind, std, self.src.at(tree))
        scope.params[param.name] = param
        scope.own.append(param)
        self.declared.setdefault(param.name, ("param", self.src.at(name)))

    def check_new(self, name: Token) -> None:
        if name in self.declared:
            what, where = self.declared[name]
            raise self.src.error(name, f"{name} is already declared as a {what} at {where}")

    def init(self, tree: Tree) -> tuple[str, float]:
        name, *std = tree.children
        if name not in INITS:
            message = f"unknown init {name}; use normal, normal(std), ones or zeros"
            raise self.src.error(name, message, close(name, INITS))
        if not std:
            return str(name), DEFAULT_STD
        if name != "normal":
            raise self.src.error(std[0], f"{name} takes no argument; only normal(std) does")
        value = self.as_float(std[0], self.number(std[0]))
        if value <= 0:
            raise self.src.error(std[0], f"normal's std must be positive, got {show(value)}")
        return "normal", value

    def shape(self, tree: Tree) -> tuple[str, ...]:
        dims: list[str] = []
        for dim in tree.children:
            self.dim_value(dim)
            if dim in dims:
                raise self.src.error(dim, f"dim {dim} appears twice in one shape")
            dims.append(str(dim))
        return tuple(dims)

    def dim_value(self, name: Token) -> int:
        if name not in self.dims:
            hint = close(name, self.dims) or "dims are defined in `dims { ... }` before they are used"
            raise self.src.error(name, f"undefined dim {name}", hint)
        return self.dims[name]
