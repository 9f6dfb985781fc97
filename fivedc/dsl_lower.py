"""Lowering of a parsed model (the lark tree of `grammars/fivedc.lark`) to `fivedc.ir.Graph`.

One walk, top to bottom: evaluate dims, declare inputs and params, check every call
against `fivedc.ops.OP_SPECS`, give every op result an SSA name unique in the graph
(`x`, `x.1`, ... for assignments, `linear#3` for nested calls) and turn each `repeat`
into a `Repeat` whose loop-carried values are the outer names its body reassigns.
Every user mistake raises `DslError` at the token that caused it. `parse_model` in
`fivedc/frontend_dsl.py` is the entry point; nothing here touches lark's parser.
"""

from __future__ import annotations

import difflib
from dataclasses import dataclass, field

from lark import Token, Tree

from fivedc.errors import DslError, SourceLoc
from fivedc.ir import Annotation, Block, DType, Graph, Input, Node, Op, Param, Repeat, Scalar, TensorType
from fivedc.dsl_values import MAX_DEPTH, Values, show as _show
from fivedc.ops import OP_SPECS, OpSpec

ANNOTATION_KINDS = ("col", "row", "replicate", "sp", "cp", "ep", "stage")
DTYPES = {"int": DType.INT, "float": DType.FLOAT}
INITS = ("normal", "ones", "zeros")
DEFAULT_STD = 0.02
MAX_DIM = 2**63 - 1
_WANT = {bool: "true or false", str: 'a "string"', int: "an integer", float: "a number"}


@dataclass(frozen=True, slots=True)
class Source:
    """The model text, split into lines the way lark counts them, for locations."""

    file: str
    text: str = field(repr=False)
    lines: tuple[str, ...] = field(repr=False)

    @staticmethod
    def of(text: str, file: str) -> Source:
        return Source(file, text, tuple(line.rstrip("\r") for line in text.split("\n")))

    def loc(self, line: int | None, col: int | None) -> SourceLoc:
        line = max(line or 1, 1)
        text = self.lines[line - 1] if line <= len(self.lines) else ""
        return SourceLoc(self.file, line, max(col or 1, 1), text)

    def at(self, node: Tree | Token) -> SourceLoc:
        meta = node if isinstance(node, Token) else node.meta
        return self.loc(getattr(meta, "line", 1), getattr(meta, "column", 1))

    def span(self, first: Tree | Token, last: Tree | Token) -> str:
        """The source text from the start of `first` to the end of `last`."""
        start = first.start_pos if isinstance(first, Token) else first.meta.start_pos
        end = last.end_pos if isinstance(last, Token) else last.meta.end_pos
        text = " ".join(self.text[start:end].split())
        return text if len(text) <= 40 else text[:37] + "..."

    def error(self, node: Tree | Token, message: str, hint: str = "") -> DslError:
        return DslError(message, loc=self.at(node), hint=hint)


class _Names:
    """Graph-unique SSA names: `x`, then `x.1`, `x.2`, ...; temporaries `linear#0`, ..."""

    def __init__(self) -> None:
        self.taken: set[str] = set()
        self.next: dict[str, int] = {}
        self.temps = 0

    def value(self, base: str) -> str:
        name, n = base, self.next.get(base, 1)
        while name in self.taken:
            name, n = f"{base}.{n}", n + 1
        self.next[base] = n
        self.taken.add(name)
        return name

    def temp(self, kind: str) -> str:
        name = f"{kind}#{self.temps}"
        self.temps += 1
        self.taken.add(name)
        return name


@dataclass(slots=True)
class _Scope:
    """What one block sees and builds: the model body, or one repeat body."""

    values: dict[str, str]  # user name -> current SSA name
    params: dict[str, Param]  # params visible here (outer ones included)
    repeat: str | None = None  # the prefix, inside a repeat body
    own: list[Param] = field(default_factory=list)
    items: list[Node] = field(default_factory=list)

    def child(self, prefix: str) -> _Scope:
        return _Scope(dict(self.values), dict(self.params), prefix)


def lower(tree: Tree, source: Source) -> Graph:
    """Lower the `start` tree of one model to a Graph (raises DslError)."""
    return _Lowering(source).graph(tree.children[0])


def _seq_dim(first: Input) -> str | None:
    """The sequence dim: the second dim of the first input when it is int tokens
    [batch, seq, ...] or float activations [batch, seq, features, ...]; a float
    [batch, features] input has none."""
    dims = first.type.dims
    needed = 2 if first.type.dtype == DType.INT else 3
    return dims[1] if len(dims) >= needed else None


class _Lowering(Values):
    def __init__(self, source: Source) -> None:
        self.src = source
        self.names = _Names()
        self.dims: dict[str, int] = {}
        self.dim_locs: dict[str, SourceLoc] = {}
        self.inputs: list[Input] = []
        self.declared: dict[str, tuple[str, SourceLoc]] = {}  # name -> (input|param|value, first loc)
        self.prefixes: dict[str, SourceLoc] = {}
        self.hidden: dict[str, str] = {}  # names local to a finished repeat -> its prefix

    # ---- model and blocks -----------------------------------------------------------
    def graph(self, model: Tree) -> Graph:
        name, *rest = model.children
        annotations = tuple(self.annotation(a) for a in rest if a.data == "annotation")
        top = _Scope({}, {})
        result = self.block([s for s in rest if s.data != "annotation"], top)
        if result is None:
            brace = self.src.loc(model.meta.end_line, model.meta.end_column - 1)
            raise DslError(f"model {name} has no return", loc=brace, hint="end it with `return <value>`")
        if not self.inputs:
            hint = "declare one: `input tokens: int[batch, seq]`"
            raise self.src.error(model, f"model {name} has no inputs", hint)
        first = self.inputs[0].type.dims
        return Graph(
            name=str(name),
            dims=tuple(self.dims.items()),
            inputs=tuple(self.inputs),
            body=Block(params=tuple(top.own), items=tuple(top.items), yields=(result,)),
            batch_dim=first[0],
            seq_dim=_seq_dim(self.inputs[0]),
            annotations=annotations,
            source=self.src.file,
            loc=self.src.at(model),
            dim_locs=tuple(self.dim_locs.items()),
        )

    def block(self, stmts: list[Tree], scope: _Scope) -> str | None:
        """Lower statements in order; the SSA name returned, if the block ends in `return`."""
        handlers = {
            "dims": self.dims_block,
            "input": self.input_decl,
            "param": self.param_decl,
            "assign": self.assign,
            "repeat": self.repeat,
        }
        for i, stmt in enumerate(stmts):
            if stmt.data == "ret":
                return self.ret(stmt, scope, last=i == len(stmts) - 1)
            handlers[stmt.data](stmt, scope)
        return None

    def ret(self, stmt: Tree, scope: _Scope, *, last: bool) -> str:
        if scope.repeat is not None:
            hint = "return the loss after the repeat"
            raise self.src.error(stmt, f"return inside repeat {scope.repeat}", hint)
        if not last:
            raise self.src.error(stmt, "return must be the last statement of the model")
        (name,) = stmt.children
        if name in scope.params:
            raise self.src.error(name, f"return needs a value, but {name} is a param")
        return self.ref(name, scope)

    # ---- declarations ---------------------------------------------------------------
    def dims_block(self, tree: Tree, scope: _Scope) -> None:
        if scope.repeat is not None:
            raise self.src.error(tree, "dims must be declared outside repeat")
        for dim_def in tree.children:
            name, expr = dim_def.children
            if name in self.dims:
                first = self.dim_locs[name]
                raise self.src.error(name, f"dim {name} is defined twice (first at {first})")
            value = self.expr(expr, 0)
            shown = f"{name} = {self.src.span(expr, expr)}"
            shown += "" if expr.data == "int_lit" else f" = {_show(value)}"
            if value < 1:
                raise self.src.error(name, f"dim {shown} must be at least 1")
            if value > MAX_DIM:
                raise self.src.error(name, f"dim {shown} is too large (at most 2**63 - 1)")
            self.dims[str(name)] = value
            self.dim_locs[str(name)] = self.src.at(name)

    def input_decl(self, tree: Tree, scope: _Scope) -> None:
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

    def param_decl(self, tree: Tree, scope: _Scope) -> None:
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
            raise self.src.error(name, message, _close(name, INITS))
        if not std:
            return str(name), DEFAULT_STD
        if name != "normal":
            raise self.src.error(std[0], f"{name} takes no argument; only normal(std) does")
        value = self.as_float(std[0], self.number(std[0]))
        if value <= 0:
            raise self.src.error(std[0], f"normal's std must be positive, got {_show(value)}")
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
            hint = _close(name, self.dims) or "dims are defined in `dims { ... }` before they are used"
            raise self.src.error(name, f"undefined dim {name}", hint)
        return self.dims[name]

    # ---- statements and calls -------------------------------------------------------
    def assign(self, tree: Tree, scope: _Scope) -> None:
        name, call = tree.children
        what, where = self.declared.get(name, ("value", None))
        if what == "param":
            message = f"{name} is already a param (declared at {where}); name the value differently"
            raise self.src.error(name, message)
        ssa = self.call(call, scope, 0, target=str(name))
        scope.values[str(name)] = ssa
        self.declared.setdefault(str(name), ("value", self.src.at(name)))

    def call(self, tree: Tree, scope: _Scope, depth: int, *, target: str | None = None) -> str:
        if depth > MAX_DEPTH:
            raise self.src.error(tree, f"calls are nested more than {MAX_DEPTH} deep")
        kind, *rest = tree.children
        spec = self.spec(kind)
        args: list[str | float] = []
        attrs: list[tuple[str, Scalar]] = []
        annotations: list[Annotation] = []
        for child in rest:
            if child.data == "annotation":
                annotations.append(self.annotation(child))
                if [a.kind for a in annotations].count(annotations[-1].kind) > 1:
                    raise self.src.error(child, f"@{annotations[-1].kind} is given twice on one call")
            elif child.data == "kwarg":
                attrs.append(self.kwarg(child, spec, attrs))
            elif attrs:
                raise self.src.error(child, "a positional argument cannot follow keyword arguments")
            else:
                args.append(self.arg(child, scope, depth))
        self.check_arity(tree, spec, len(args))
        out = self.names.temp(spec.kind) if target is None else self.names.value(target)
        op = Op(out, spec.kind, tuple(args), tuple(attrs), tuple(annotations), self.src.at(tree))
        scope.items.append(op)
        return out

    def spec(self, kind: Token) -> OpSpec:
        if kind not in OP_SPECS:
            hint = _close(kind, OP_SPECS) or f"known ops: {', '.join(OP_SPECS)}"
            raise self.src.error(kind, f"unknown op '{kind}'", hint)
        return OP_SPECS[kind]

    def check_arity(self, tree: Tree, spec: OpSpec, got: int) -> None:
        if spec.min_args <= got <= spec.max_args:
            return
        count = str(spec.max_args)
        if spec.min_args < spec.max_args:
            count = f"{spec.min_args} to {spec.max_args}"
        plural = "" if count == "1" else "s"
        raise self.src.error(
            tree, f"{spec.kind} takes {count} argument{plural} ({', '.join(spec.args)}), got {got}"
        )

    def arg(self, node: Tree, scope: _Scope, depth: int) -> str | float:
        if node.data == "call":
            return self.call(node, scope, depth + 1)
        if node.data == "ref":
            return self.ref(node.children[0], scope)
        return self.as_float(node, self.number(node))

    def ref(self, name: Token, scope: _Scope) -> str:
        if name in scope.values:
            return scope.values[name]
        if name in scope.params:
            return str(name)
        if name in self.hidden:
            hint = f"{name} is defined inside repeat {self.hidden[name]} and is not visible after it"
        elif name in self.dims:
            hint = f"{name} is a dim, not a value"
        else:
            hint = _close(name, [*scope.values, *scope.params])
        raise self.src.error(name, f"undefined name '{name}'", hint)

    def kwarg(self, tree: Tree, spec: OpSpec, attrs: list[tuple[str, Scalar]]) -> tuple[str, Scalar]:
        key, node = tree.children
        allowed = dict(spec.attrs)
        if key not in allowed:
            listing = f"allowed: {', '.join(allowed)}" if allowed else "it takes no keyword arguments"
            message = f"{spec.kind} has no keyword '{key}'; {listing}"
            raise self.src.error(key, message, _close(key, allowed))
        if any(k == key for k, _ in attrs):
            raise self.src.error(key, f"keyword '{key}' is given twice")
        value = self.literal(node, words=False)
        default = allowed[key]
        if isinstance(default, bool) or isinstance(default, str) or isinstance(value, (bool, str)):
            ok = type(value) is type(default)
        else:
            ok = isinstance(value, int) or isinstance(default, float)
            value = self.as_float(node, value) if isinstance(default, float) else value
        if not ok:
            want = _WANT[type(default)]
            raise self.src.error(node, f"{spec.kind}'s {key} takes {want}, got {_show(value)}")
        return str(key), value

    def annotation(self, tree: Tree) -> Annotation:
        kind, *args = tree.children
        if kind not in ANNOTATION_KINDS:
            allowed = ", ".join(f"@{k}" for k in ANNOTATION_KINDS)
            message = f"unknown annotation @{kind}; allowed: {allowed}"
            raise self.src.error(tree, message, _close(kind, ANNOTATION_KINDS))
        return Annotation(str(kind), tuple(self.literal(a, words=True) for a in args), self.src.at(tree))

    # ---- repeat ---------------------------------------------------------------------
    def repeat(self, tree: Tree, scope: _Scope) -> None:
        if scope.repeat is not None:
            hint = "put the repeats one after the other"
            raise self.src.error(tree, "nested repeat is not supported", hint)
        count_node, *stmts = tree.children
        name = stmts.pop(0) if stmts and isinstance(stmts[0], Token) else None
        prefix = self.repeat_prefix(tree, count_node, name)
        count = self.expr(count_node, 0)
        if count < 1:
            shown = f"{self.src.span(count_node, count_node)} = {_show(count)}"
            raise self.src.error(count_node, f"repeat count {shown} must be at least 1")
        assigned = (str(s.children[0]) for s in stmts if s.data == "assign")
        carried = [n for n in dict.fromkeys(assigned) if n in scope.values]
        body = self.repeat_body(stmts, scope.child(prefix), carried)
        results = tuple(self.names.value(n) for n in carried)
        outer = tuple(scope.values[n] for n in carried)
        scope.items.append(Repeat(prefix, count, outer, body, results, self.src.at(tree)))
        scope.values.update(zip(carried, results))

    def repeat_body(self, stmts: list[Tree], inner: _Scope, carried: list[str]) -> Block:
        """Lower a body whose `carried` names enter as fresh SSA args and leave as yields."""
        args = tuple(self.names.value(n) for n in carried)
        inner.values.update(zip(carried, args))
        outer = set(inner.values)
        self.block(stmts, inner)
        local = [n for n in inner.values if n not in outer] + [p.name for p in inner.own]
        self.hidden.update(dict.fromkeys(local, inner.repeat))
        yields = tuple(inner.values[n] for n in carried)
        return Block(args, tuple(inner.own), tuple(inner.items), yields)

    def repeat_prefix(self, tree: Tree, count: Tree, name: Token | None) -> str:
        if name is None and count.data != "dim_ref":
            message = "name this repeat: `repeat N as NAME { ... }`"
            raise self.src.error(count, message, "the name prefixes its params")
        prefix = str(name if name is not None else count.children[0])
        if prefix in self.prefixes:
            raise self.src.error(
                name or count, f"two repeats are named {prefix} (the first at {self.prefixes[prefix]})",
                "name one differently with `repeat N as NAME`",
            )
        self.prefixes[prefix] = self.src.at(tree)
        return prefix


def _close(word: str, choices) -> str:
    match = difflib.get_close_matches(str(word), [str(c) for c in choices], n=1)
    return f"did you mean '{match[0]}'?" if match else ""
