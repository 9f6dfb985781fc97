"""Lowering of a parsed model (the lark tree of `grammars/fivedc.lark`) to `fivedc.ir.graph.Graph`.

One walk, top to bottom: evaluate dims, declare inputs and params
(`fivedc/frontends/dsl/decls.py`), check every call against `fivedc.ir.ops.OP_SPECS`, give every
op result an SSA name unique in the graph (`x`, `x.1`, ... for assignments,
`linear#3` for nested calls) and turn each `repeat` into a `Repeat` whose
loop-carried values are the outer names its body reassigns. Pipeline marks:
`x = f(g(y)) @stage` on a top-level statement puts the `@stage` annotation on the
statement's first op (g: a chunk begins there); `repeat layers @stage(4, 8)` sets
`Repeat.stage_layers`. Recomputation: `model m @recompute(selective)` is the model's
default mode, `repeat layers @recompute(full)` sets `Repeat.recompute` for that stack;
on a call it is an error. Every user mistake raises `DslError` at the token that
caused it. `parse_model` in `fivedc/frontends/dsl_file.py` is the entry point; nothing
here touches lark's parser.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from lark import Token, Tree

from fivedc.frontends.dsl.decls import Declarations, Scope
from fivedc.frontends.dsl.values import MAX_DEPTH, close as _close, show as _show
from fivedc.errors import DslError, SourceLoc
from fivedc.ir.graph import Annotation, Block, DType, Graph, Input, Op, Repeat, Scalar
from fivedc.ir.ops import OP_SPECS, OpSpec
from fivedc.passes.recompute import RECOMPUTE_MODES

ANNOTATION_KINDS = ("col", "row", "replicate", "sp", "cp", "ep", "stage", "recompute")
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


class _Lowering(Declarations):
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
        for tree, annotation in zip([a for a in rest if a.data == "annotation"], annotations):
            if annotation.kind == "stage":
                raise self.src.error(tree, "@stage marks where a pipeline chunk begins, not the model",
                                     "put @stage after a top-level op statement, or @stage(layer, ...) on a repeat")
            if annotation.kind == "recompute":
                self.recompute_mode(tree, annotation)
        top = Scope({}, {})
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

    def block(self, stmts: list[Tree], scope: Scope) -> str | None:
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

    def ret(self, stmt: Tree, scope: Scope, *, last: bool) -> str:
        if scope.repeat is not None:
            hint = "return the loss after the repeat"
            raise self.src.error(stmt, f"return inside repeat {scope.repeat}", hint)
        if not last:
            raise self.src.error(stmt, "return must be the last statement of the model")
        (name,) = stmt.children
        if name in scope.params:
            raise self.src.error(name, f"return needs a value, but {name} is a param")
        return self.ref(name, scope)

    # ---- statements and calls -------------------------------------------------------
    def assign(self, tree: Tree, scope: Scope) -> None:
        name, call = tree.children
        what, where = self.declared.get(name, ("value", None))
        if what == "param":
            message = f"{name} is already a param (declared at {where}); name the value differently"
            raise self.src.error(name, message)
        ssa = self.call(call, scope, 0, target=str(name))
        scope.values[str(name)] = ssa
        self.declared.setdefault(str(name), ("value", self.src.at(name)))

    def call(self, tree: Tree, scope: Scope, depth: int, *, target: str | None = None) -> str:
        if depth > MAX_DEPTH:
            raise self.src.error(tree, f"calls are nested more than {MAX_DEPTH} deep")
        kind, *rest = tree.children
        spec = self.spec(kind)
        first = len(scope.items)
        args: list[str | float] = []
        attrs: list[tuple[str, Scalar]] = []
        annotations: list[Annotation] = []
        for child in rest:
            if child.data == "annotation":
                annotations.append(self.annotation(child))
                if [a.kind for a in annotations].count(annotations[-1].kind) > 1:
                    raise self.src.error(child, f"@{annotations[-1].kind} is given twice on one call")
                if annotations[-1].kind == "stage":
                    self.check_stage_on_op(child, annotations[-1], scope, depth)
                if annotations[-1].kind == "recompute":
                    raise self.src.error(child, "@recompute goes on the model or on a repeat, not on a call",
                                         "e.g. `model m @recompute(selective) {` recomputes every attention, "
                                         "`repeat layers @recompute(full) {` each layer of that stack")
            elif child.data == "kwarg":
                attrs.append(self.kwarg(child, spec, attrs))
            elif attrs:
                raise self.src.error(child, "a positional argument cannot follow keyword arguments")
            else:
                args.append(self.arg(child, scope, depth))
        self.check_arity(tree, spec, len(args))
        out = self.names.temp(spec.kind) if target is None else self.names.value(target)
        stage = [a for a in annotations if a.kind == "stage"]
        if stage and first < len(scope.items):  # the statement's nested calls run first: its chunk begins there
            annotations.remove(stage[0])
            start = scope.items[first]
            scope.items[first] = replace(start, annotations=start.annotations + (stage[0],))
        op = Op(out, spec.kind, tuple(args), tuple(attrs), tuple(annotations), self.src.at(tree))
        scope.items.append(op)
        return out

    def check_stage_on_op(self, tree: Tree, stage: Annotation, scope: Scope, depth: int) -> None:
        """`x = f(...) @stage` at top level: a pipeline chunk begins at this statement."""
        if scope.repeat is not None:
            raise self.src.error(
                tree, f"@stage on an op inside repeat {scope.repeat}: a pipeline chunk can only begin at a layer",
                f"mark layers on the repeat instead: `repeat {scope.repeat} @stage(2) {{ ... }}` begins a chunk "
                "at layer 2",
            )
        if stage.args:
            raise self.src.error(
                tree, f"@stage on an op takes no arguments, got {stage}: it marks that a pipeline chunk "
                "begins at this statement",
                "write `@stage`; to begin chunks at layers of a repeat, write `repeat NAME @stage(2) { ... }`",
            )
        if depth > 0:
            raise self.src.error(tree, "@stage marks a whole statement, not a call nested in it",
                                 "put it after the statement's outermost call: `y = relu(linear(x, w)) @stage`")

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

    def arg(self, node: Tree, scope: Scope, depth: int) -> str | float:
        if node.data == "call":
            return self.call(node, scope, depth + 1)
        if node.data == "ref":
            return self.ref(node.children[0], scope)
        return self.as_float(node, self.number(node))

    def ref(self, name: Token, scope: Scope) -> str:
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
    def repeat(self, tree: Tree, scope: Scope) -> None:
        if scope.repeat is not None:
            hint = "put the repeats one after the other"
            raise self.src.error(tree, "nested repeat is not supported", hint)
        count_node, *stmts = tree.children
        name = stmts.pop(0) if stmts and isinstance(stmts[0], Token) else None
        marks = [s for s in stmts if s.data == "annotation"]
        stmts = stmts[len(marks):]
        prefix = self.repeat_prefix(tree, count_node, name)
        count = self.expr(count_node, 0)
        if count < 1:
            shown = f"{self.src.span(count_node, count_node)} = {_show(count)}"
            raise self.src.error(count_node, f"repeat count {shown} must be at least 1")
        recompute = [m for m in marks if self.annotation(m).kind == "recompute"]
        stage_layers = self.stage_layers([m for m in marks if m not in recompute], prefix, count)
        if len(recompute) > 1:
            raise self.src.error(recompute[1], f"@recompute is given twice on repeat {prefix}")
        mode = self.recompute_mode(recompute[0], self.annotation(recompute[0])) if recompute else None
        assigned = (str(s.children[0]) for s in stmts if s.data == "assign")
        carried = [n for n in dict.fromkeys(assigned) if n in scope.values]
        body = self.repeat_body(stmts, scope.child(prefix), carried)
        results = tuple(self.names.value(n) for n in carried)
        outer = tuple(scope.values[n] for n in carried)
        scope.items.append(Repeat(prefix, count, outer, body, results, self.src.at(tree), stage_layers=stage_layers,
                                  recompute=mode))
        scope.values.update(zip(carried, results))

    def recompute_mode(self, tree: Tree, mark: Annotation) -> str:
        """`@recompute(full)`: one of the modes (passes/recompute.py)."""
        if len(mark.args) != 1 or mark.args[0] not in RECOMPUTE_MODES:
            raise self.src.error(tree, f"{mark} needs one mode: {', '.join(RECOMPUTE_MODES)}",
                                 "e.g. @recompute(selective): attention recomputed in backward; @recompute(full): "
                                 "each layer keeps only its input")
        return str(mark.args[0])

    def stage_layers(self, trees: list[Tree], prefix: str, count: int) -> tuple[int, ...]:
        """`repeat layers @stage(4, 8)`: the layers at which a pipeline chunk begins."""
        layers: list[int] = []
        for i, tree in enumerate(trees):
            mark = self.annotation(tree)
            if mark.kind != "stage":
                raise self.src.error(tree, f"@{mark.kind} does not go on a repeat; only @stage(layer, ...) and "
                                     "@recompute(mode) do",
                                     f"put @{mark.kind} on the op call it is about, inside the body or after it")
            if i > 0:
                raise self.src.error(tree, f"@stage is given twice on repeat {prefix}",
                                     "list every layer in one @stage(...)")
            if not mark.args:
                raise self.src.error(
                    tree, f"@stage on repeat {prefix} needs the layers at which a pipeline chunk begins",
                    f"e.g. `repeat {prefix} @stage({count // 2}) {{ ... }}` begins a chunk at layer {count // 2}",
                )
            for node, layer in zip(tree.children[1:], mark.args):
                if not isinstance(layer, int) or isinstance(layer, bool):
                    shown = f'"{layer}"' if isinstance(node, Token) else _show(layer)
                    raise self.src.error(node, f"@stage takes layer numbers, got {shown}")
                if not 0 <= layer < count:
                    raise self.src.error(node, f"@stage({_show(layer)}): repeat {prefix} has layers 0 to {count - 1}")
                if layer in layers:
                    raise self.src.error(node, f"layer {layer} is marked twice in @stage")
                layers.append(layer)
        return tuple(sorted(layers))

    def repeat_body(self, stmts: list[Tree], inner: Scope, carried: list[str]) -> Block:
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

