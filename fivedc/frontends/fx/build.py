"""The fx frontend's draft IR, and its finishing into a `fivedc.ir.graph.Graph` with names.

The lowering (`fivedc/frontends/fx/lower.py`) builds drafts whose dims are atoms of a
`DimTable` and whose values and parameters have no names yet. `finish` names the
dims (`DimTable.names`), the parameters (the shortest tail of the module path that
is unique in the model: `c_attn_q`, `attn_c_proj`, `mlp_c_proj`, `ln_1_b`), the
values (the fx node's name: `attn_c_attn`, `add_1`, numbered `.1`, `.2` where taken,
as the DSL numbers reassignments), and lists one `ParamMapping` per parameter
instance.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

from fivedc.errors import SourceLoc
from fivedc.frontends.fx.dims import DimTable
from fivedc.frontends.fx.params import ParamMapping
from fivedc.ir.graph import Annotation, Block, DType, Graph, Input, Op, Param, Repeat, Scalar, TensorType


@dataclass(frozen=True, slots=True)
class Source:
    """Where a parameter's values live: a state-dict key relative to its scope's module."""

    key: str
    key_shape: tuple[int, ...]
    rows: tuple[int, int] | None = None
    transpose: bool = False
    stack: tuple[str, ...] = ()  # keys stacked along the IR's first dim (separate experts); key is the first


@dataclass(eq=False)
class DValue:
    base: str
    atoms: tuple[int, ...]
    dtype: DType = DType.FLOAT


@dataclass(eq=False)
class DParam:
    module: str  # module path relative to the scope's module
    attr: str  # weight, bias, ...
    part: str  # q/k/v (or 0, 1, ...) of a split fused weight; "" otherwise
    atoms: tuple[int, ...]
    init: str
    source: Source
    loc: SourceLoc | None


@dataclass(eq=False)
class DOp:
    out: DValue
    kind: str
    args: tuple  # DValue | DParam | float
    attrs: tuple[tuple[str, Scalar], ...]
    loc: SourceLoc | None
    scope: tuple[str, ...] = ()  # the module paths (relative to the block's module) it was traced in
    annotations: tuple[Annotation, ...] = ()
    # an `aten` op's torch layouts in atoms: (one per tensor argument, the result's); named by `finish`
    layouts: tuple | None = None


@dataclass(eq=False)
class DBlock:
    params: list[DParam] = field(default_factory=list)
    items: list = field(default_factory=list)  # DOp | DRepeat
    args: list[DValue] = field(default_factory=list)
    yields: list[DValue] = field(default_factory=list)


@dataclass(eq=False)
class DRepeat:
    name: str
    path: str  # the ModuleList's path: `transformer.h`
    count: int
    carried: list[DValue]
    body: DBlock
    results: list[DValue]
    loc: SourceLoc | None
    stage_layers: tuple[int, ...] = ()


@dataclass(eq=False)
class Draft:
    name: str
    inputs: list[tuple[str, DValue, SourceLoc | None]]
    body: DBlock
    dims: DimTable
    source: str
    loc: SourceLoc | None


def finish(draft: Draft, *, share_dims: bool = True) -> tuple[Graph, tuple[ParamMapping, ...], dict[str, TensorType]]:
    """The graph, its parameter map, and the type the frontend expects of every op."""
    dims = draft.dims
    tensors = [dims.leaves(v.atoms) for _, v, _ in draft.inputs] + list(_tensors(draft.body, dims))
    dim_names = dims.names(tensors, share=share_dims)
    repeats = [r for r in draft.body.items if isinstance(r, DRepeat)]
    param_names = _param_names([draft.body] + [r.body for r in repeats], taken={r.name for r in repeats})
    namer = _Namer(set(param_names.values()) | set(dim_names.values()) | {r.name for r in repeats})

    def dims_of(atoms: tuple[int, ...]) -> tuple[str, ...]:
        return tuple(dim_names[a] for a in dims.leaves(atoms))

    values: dict[int, str] = {}
    expected: dict[str, TensorType] = {}

    def value(v: DValue) -> str:
        if id(v) not in values:
            values[id(v)] = namer.value(v.base)
        return values[id(v)]

    def arg(a) -> str | float:
        return param_names[id(a)] if isinstance(a, DParam) else value(a) if isinstance(a, DValue) else float(a)

    def block(b: DBlock) -> Block:
        args = tuple(value(v) for v in b.args)
        params = tuple(Param(param_names[id(p)], dims_of(p.atoms), p.init, 0.02, p.loc) for p in b.params)
        items = []
        for item in b.items:
            if isinstance(item, DRepeat):
                carried = tuple(value(v) for v in item.carried)
                body = block(item.body)
                items.append(Repeat(item.name, item.count, carried, body, tuple(value(v) for v in item.results), item.loc,
                                    stage_layers=item.stage_layers))
            else:
                args_ = tuple(arg(a) for a in item.args)
                attrs = item.attrs + (_layout_attrs(item.layouts, dims_of) if item.layouts is not None else ())
                items.append(Op(value(item.out), item.kind, args_, attrs, item.annotations, loc=item.loc))
                expected[value(item.out)] = TensorType(dims_of(item.out.atoms), item.out.dtype)
        return Block(args, params, tuple(items), tuple(value(v) for v in b.yields))

    inputs = tuple(Input(value(v), TensorType(dims_of(v.atoms), v.dtype), loc) for _, v, loc in draft.inputs)
    body = block(draft.body)
    named = {}
    for t in tensors:
        for atom in t:
            named.setdefault(dim_names[dims.find(atom)], dims.size(atom))
    for r in repeats:
        named.setdefault(r.name, r.count)
    first = inputs[0].type.dims
    graph = Graph(
        name=draft.name, dims=tuple(named.items()), inputs=inputs, body=body,
        batch_dim=first[0], seq_dim=first[1] if len(first) > 1 else None,
        source=draft.source, loc=draft.loc,
    )
    return graph, _mappings(draft, param_names, dims), expected


def _layout_attrs(layouts, dims_of) -> tuple[tuple[str, str], ...]:
    """An `aten` op's `layouts` and `out` attributes (fivedc/ir/aten_call.py) with the dims' names."""
    from fivedc.ir.aten_call import layout_text

    def named(layout) -> tuple[tuple[str, ...], ...]:
        return tuple(dims_of(group) for group in layout)

    args, out = layouts
    return (("layouts", ";".join(layout_text(named(layout)) for layout in args)),
            ("out", layout_text(named(out))))


def _tensors(b: DBlock, dims: DimTable):
    for p in b.params:
        yield dims.leaves(p.atoms)
    for v in b.args:
        yield dims.leaves(v.atoms)
    for item in b.items:
        if isinstance(item, DRepeat):
            yield from _tensors(item.body, dims)
        else:
            yield dims.leaves(item.out.atoms)


def _mappings(draft: Draft, names: dict[int, str], dims: DimTable) -> tuple[ParamMapping, ...]:
    out = []
    scopes = [(draft.body, None, "", 1)] + [
        (r.body, r, r.path, r.count) for r in draft.body.items if isinstance(r, DRepeat)
    ]
    for b, repeat, path, count in scopes:
        for i in range(count):
            for p in b.params:
                prefix = f"{path}.{i}." if repeat else ""
                stack = p.source.stack
                for index, key in enumerate(stack or (p.source.key,)):
                    owner = key.rpartition(".")[0] if stack else p.module
                    module = (prefix + owner).rstrip(".")
                    out.append(ParamMapping(
                        ir_name=f"{repeat.name}.{i}.{names[id(p)]}" if repeat else names[id(p)],
                        param=names[id(p)], repeat=repeat.name if repeat else None,
                        key=prefix + key, module_path=module,
                        pattern=(f"{path}.*." + owner).rstrip(".") if repeat else module,
                        ir_shape=tuple(dims.size(a) for a in dims.leaves(p.atoms)),
                        key_shape=p.source.key_shape, rows=p.source.rows, transpose=p.source.transpose,
                        index=index if stack else None,
                    ))
    return tuple(out)


def _param_names(blocks: list[DBlock], *, taken: set[str]) -> dict[int, str]:
    """Shortest unique tail of each module path (`c_attn`, `attn_c_proj`), plus part and attribute."""
    params = [p for b in blocks for p in b.params]
    paths = sorted({p.module for p in params})
    split = {path: path.split(".") if path else [] for path in paths}
    short: dict[str, str] = {}
    for path, parts in split.items():
        for k in range(1, len(parts) + 1):
            tail = parts[-k:]
            if tail[0].isdigit() and k < len(parts):
                continue
            if sum(1 for other in split.values() if other[-k:] == tail) == 1:
                break
        short[path] = "_".join(parts[-k:]) if parts else ""
    out: dict[int, str] = {}
    used = set(taken)
    for p in params:
        words = [short[p.module], p.part, "" if p.attr == "weight" and short[p.module] else "b" if p.attr == "bias" else p.attr]
        name = base = _identifier("_".join(w for w in words if w))
        n = 2
        while name in used:
            name, n = f"{base}_{n}", n + 1
        used.add(name)
        out[id(p)] = name
    return out


def _identifier(text: str) -> str:
    clean = re.sub(r"\W", "_", text) or "p"
    return clean if not clean[0].isdigit() else f"p{clean}"


class _Namer:
    """Graph-unique SSA names like the DSL's: `x`, then `x.1`, `x.2`, ..."""

    def __init__(self, reserved: set[str]) -> None:
        self.taken = set(reserved)

    def value(self, base: str) -> str:
        base = _identifier(base)
        name, n = base, 1
        while name in self.taken:
            name, n = f"{base}.{n}", n + 1
        self.taken.add(name)
        return name
