"""Pipeline stage marks in the fx frontend: the modules at which a pipeline chunk begins.

A module is marked when it has the attribute `fivedc_stage_boundary = True` (on its
class or on the instance), or when its path matches a pattern of
`trace_module(..., stage_boundaries=("layers.4", "ln_f"))` (dot-separated, `*`
matching one path element, as the sharding pins of `fivedc/parallel/pins.py`). A
chunk then begins at the module:
- a layer of a uniform `nn.ModuleList` that became a `Repeat` (`layers.4`; the list
  itself means its first layer): its index goes in `Repeat.stage_layers`;
- any other module whose ops are top-level (an embedding, the final norm, the layers
  of a list that was inlined): `@stage` (`Annotation("stage")`) on the first
  top-level op traced from it, or layer 0 when that first item is a repeat.
Layers inlined into top-level ops (the export path inlines every module; a list whose
layers differ) are still the pipeline's units: `mark_layers` puts `@layer(path)`
(`Annotation("layer")`) on the first top-level op of each layer of an `nn.ModuleList`
(or `nn.ModuleDict`),
where a unit begins (`passes/stages.py`) without forcing a cut; what follows the
last layer (the final norm, the head) begins a unit too.
Ops that compute from the inputs alone (Hugging Face's shifted labels: a pad and a slice of
the input ids) are placed at their first use (`sink_input_only`), so that the chunk that
uses them computes them, rather than an earlier chunk sending them on (a linear is emitted
at its first use, so the traced order can put them before the head that meets them).
What cannot be honoured is an error, never a silent no-op: a module inside a layer
of a repeat (its layers share one body), a module inside a block lowered as one op
(an MoE block's experts), a module that computes no op of the plan (dropout), and a
pattern that matches no module (with the paths it may have meant).
"""

from __future__ import annotations

import difflib
import fnmatch
from dataclasses import dataclass

from torch import nn

from fivedc.errors import FivedcError, NotSupportedError, SourceLoc
from fivedc.frontends.fx.build import DOp, DRepeat, Draft
from fivedc.frontends.fx.locs import def_loc, node_loc
from fivedc.frontends.fx.locs import scope
from fivedc.frontends.fx.moe_leaves import MOE_OPS, leaf
from fivedc.frontends.fx.trace import STAGE_MARK, Trace, Traced
from fivedc.ir.graph import Annotation


@dataclass(frozen=True, slots=True)
class Mark:
    path: str  # the module's path in the model
    how: str  # `the attribute fivedc_stage_boundary of Block` or `stage_boundaries pattern 'layers.4'`
    cls: type  # the module's class


def mark_stages(module: nn.Module, trace: Trace, draft: Draft, patterns: tuple[str, ...] | list[str]) -> None:
    """Put the stage marks of `module` and `patterns` on the draft's repeats and top-level ops."""
    for mark in marks(module, patterns):
        _apply(trace, draft, mark)


def mark_layers(module: nn.Module, draft: Draft) -> None:
    """`@layer(path)` on the first top-level op of each layer of the model's outermost
    `nn.ModuleList`s, and `nn.ModuleDict`s of modules of one class (torchtitan keeps its layers
    in one; nanoGPT's `transformer` dict of an embedding, the layers and a norm is no list of
    layers), whose ops are top-level (not a repeat's)."""
    lists = [path for path, m in module.named_modules() if path and len(getattr(m, "_modules", ())) > 1 and (
        isinstance(m, nn.ModuleList) or (isinstance(m, nn.ModuleDict) and len({type(c) for c in m.values()}) == 1))]
    lists = [p for p in lists if not any(p.startswith(q + ".") for q in lists)]
    ops = [item for item in draft.body.items if isinstance(item, DOp)]
    for path in lists:
        for name, _ in module.get_submodule(path).named_children():
            layer = f"{path}.{name}"
            _begin(next((op for op in ops if _within(layer, op.scope)), None), (layer,))
        inside = [i for i, op in enumerate(ops) if _within(path, op.scope)]
        if inside:  # what follows the last layer (a final norm, the head) is a unit of its own
            _begin(next((op for op in ops[inside[-1] + 1:] if not _within(path, op.scope)), None), ())


def sink_input_only(draft: Draft) -> None:
    """Move each unmarked top-level op that reads only inputs (or such ops' results) to just
    before its first user, keeping their order among themselves."""
    known = {id(v) for _, v, _ in draft.inputs}
    movable = []
    for item in draft.body.items:
        if isinstance(item, DOp) and not item.annotations and all(
                isinstance(a, (int, float)) or id(a) in known for a in item.args):
            movable.append(item)
            known.add(id(item.out))
    if movable:
        moving = {id(op) for op in movable}
        draft.body.items = _ordered([item for item in draft.body.items if id(item) not in moving], movable)


def _reads(item) -> set[int]:
    if isinstance(item, DOp):
        return {id(a) for a in item.args}
    return {id(v) for v in item.carried}


def _ordered(rest: list, movable: list[DOp]) -> list:
    """`rest` with each op of `movable` just before the first item that needs it (directly or
    through another moved op); ops nothing needs go last."""
    producers = {id(op.out): op for op in movable}
    placed: set[int] = set()
    out = []

    def place(value_ids: set[int]) -> None:
        for op in movable:  # in their own order: a producer comes before its users among them
            if id(op) in placed or id(op.out) not in _needed(value_ids, producers):
                continue
            placed.add(id(op))
            out.append(op)

    for item in rest:
        place(_reads(item))
        out.append(item)
    out.extend(op for op in movable if id(op) not in placed)
    return out


def _needed(value_ids: set[int], producers: dict) -> set[int]:
    """The values among `value_ids` made by moved ops, and what those read, transitively."""
    needed, todo = set(), [v for v in value_ids if v in producers]
    while todo:
        value = todo.pop()
        if value in needed:
            continue
        needed.add(value)
        todo.extend(a for a in map(id, producers[value].args) if a in producers)
    return needed


def _begin(op: DOp | None, args: tuple) -> None:
    if op is not None and not any(a.kind == "layer" for a in op.annotations):
        op.annotations += (Annotation("layer", args, op.loc),)


def marks(module: nn.Module, patterns) -> list[Mark]:
    if isinstance(patterns, str):
        patterns = (patterns,)
    found: dict[str, Mark] = {}
    paths = {path: m for path, m in module.named_modules() if path}
    for path, m in paths.items():
        if getattr(m, STAGE_MARK, False) is True:
            found[path] = Mark(path, f"the attribute {STAGE_MARK} of {type(m).__name__}", type(m))
    for pattern in patterns:
        matched = [p for p in paths if _matches(pattern, p)]
        if not matched:
            raise _no_match(pattern, list(paths))
        for path in matched:
            found.setdefault(path, Mark(path, f"stage_boundaries pattern {pattern!r}", type(paths[path])))
    return list(found.values())


def _matches(pattern: str, path: str) -> bool:
    want, have = pattern.split("."), path.split(".")
    return len(want) == len(have) and all(fnmatch.fnmatchcase(h, w) for h, w in zip(have, want))


def _apply(trace: Trace, draft: Draft, mark: Mark) -> None:
    repeats = [r for r in draft.body.items if isinstance(r, DRepeat)]
    for r in repeats:
        if mark.path == r.path:
            _add_layer(r, 0)
            return
        if mark.path.startswith(r.path + "."):
            index, _, inner = mark.path[len(r.path) + 1 :].partition(".")
            if not inner:
                _add_layer(r, int(index))
                return
            spec = next(spec for spec in trace.repeats if spec.path == r.path)
            raise _inside_layer(r, mark, int(index), _where(spec.body, inner, mark))
    for item in draft.body.items:
        if isinstance(item, DRepeat) and item.path.startswith(mark.path + "."):
            _add_layer(item, 0)
            return
        if isinstance(item, DOp) and _within(mark.path, item.scope):
            if not any(a.kind == "stage" for a in item.annotations):
                item.annotations += (Annotation("stage", (), item.loc),)
            return
    raise _no_op(trace, mark, _where(trace.top, mark.path, mark))


def _within(path: str, scope: tuple[str, ...]) -> bool:
    """Whether an op traced in `scope` is in module `path` (a container such as an nn.ModuleDict is
    never called, so it is in no scope: its children are)."""
    return any(p == path or p.startswith(path + ".") for p in scope)


def _add_layer(r: DRepeat, index: int) -> None:
    r.stage_layers = tuple(sorted({*r.stage_layers, index}))


def _where(traced: Traced, path: str, mark: Mark) -> SourceLoc | None:
    """The user's line of the first node traced in module `path` (its call, for a module kept whole)."""
    for node in traced.gm.graph.nodes:
        if _within(path, scope(node)) and (loc := node_loc(node)) is not None:
            return loc
    return def_loc(mark.cls.forward) if mark.cls.__module__.partition(".")[0] != "torch" else None


def _inside_layer(r: DRepeat, mark: Mark, index: int, at: SourceLoc | None) -> NotSupportedError:
    layer = f"{r.path}.{index}"
    fix = f"remove {STAGE_MARK} from {mark.cls.__name__} and " if mark.how.startswith("the attribute") else ""
    return NotSupportedError(
        f"a pipeline chunk cannot begin at {mark.path} ({mark.how}): it is inside layer {index} of {r.path}, "
        f"whose {r.count} layers are one repeated body; a chunk begins at a layer or at a top-level module",
        loc=at or r.loc,
        hint=f"{fix}mark the layer instead: stage_boundaries=({layer!r},), or {STAGE_MARK} = True on {layer}",
    )


def _no_op(trace: Trace, mark: Mark, at: SourceLoc | None) -> NotSupportedError:
    nodes = trace.top.gm.graph.nodes
    calls = [str(n.target) for n in nodes if n.op == "call_module"]  # modules kept whole, and MoE blocks
    calls += [leaf(n.args[1]).path for n in nodes if n.op == "call_function" and n.target in MOE_OPS]
    owner = next((c for c in calls if mark.path.startswith(c + ".")), None)
    if owner is not None:
        at = _where(trace.top, owner, mark)
        what = f"it is inside {owner}, which fivedc lowers as one op"
        hint = f"mark {owner} itself, or the module after it"
    else:
        what = ("no op of the plan is traced from it (it is never called, computes nothing the IR keeps, as a "
                "dropout, or gives a parameter as it is, as a position table read at arange(seq))")
        hint = "mark the module where the chunk should begin: the first one that computes something"
    return NotSupportedError(f"a pipeline chunk cannot begin at {mark.path} ({mark.how}): {what}", loc=at, hint=hint)


def _no_match(pattern: str, paths: list[str]) -> FivedcError:
    close = difflib.get_close_matches(pattern, paths, n=4, cutoff=0.5)
    depth = [p for p in paths if p.count(".") == pattern.count(".")]
    listing = ", ".join(depth[:12]) + (", ..." if len(depth) > 12 else "")
    hint = f"did you mean {' or '.join(repr(c) for c in close)}? " if close else ""
    return FivedcError(f"stage_boundaries pattern {pattern!r} matches no module of the model",
                       hint=f"{hint}patterns name module paths as named_modules() gives them "
                            f"(`*` matches one element); at that depth: {listing or 'none'}")
