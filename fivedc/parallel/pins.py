"""Sharding pins by module path: `{"transformer.h.*.attn.c_attn": "col"}` as IR annotations.

`fivedc.parallelize(..., shardings=...)` lets a user override the layout the passes
choose, by naming modules the way `named_modules()` does (`*` matches one path
element, usually the layer index). A pin becomes the `@col`, `@row` or
`@replicate` annotation a DSL model would carry, on every op that reads the
matched modules' parameters as its weight (a linear, matmul or embedding; a fused
projection split into q, k, v pins all three). What cannot hold is an error, never
a silent no-op: a pattern that matches no module with parameters, a pattern whose
modules no linear or embedding uses (a norm), two pins that disagree on one op,
and a pin on some layers of a repeated stack (the layers share one body and one
layout; pin them all with `*`, or make the layers differ so they are traced apart).
"""

from __future__ import annotations

import difflib
from collections.abc import Mapping
from dataclasses import replace

from fivedc.errors import ShardingError
from fivedc.frontends.fx_module import TracedModel
from fivedc.ir.graph import Annotation, Block, Graph, Op, Repeat
from fivedc.ir.ops import LINEAR_KINDS

MODES = ("col", "row", "replicate")
PINNABLE = (*LINEAR_KINDS, "embedding")  # the ops whose rules read @col/@row/@replicate
_ALIASES = {"colwise": "col", "column": "col", "rowwise": "row", "replicated": "replicate"}

Key = tuple[str | None, str]  # (repeat name or None, the IR Param's own name)


def pin_shardings(traced: TracedModel, shardings: Mapping[str, str] | None) -> Graph:
    """The traced graph with each pattern's mode as an annotation on the ops using its parameters."""
    if not shardings:
        return traced.graph
    pins: dict[Key, tuple[str, str]] = {}  # -> (mode, pattern)
    for pattern, mode in shardings.items():
        mode = _mode(pattern, mode)
        matched = traced.match(pattern)
        if not matched:
            raise _no_match(traced, pattern)
        _check_whole_repeats(traced, pattern, matched)
        for m in matched:
            key = (m.repeat, m.param)
            if key in pins and pins[key][0] != mode:
                other = pins[key][1]
                raise ShardingError(
                    f"sharding pins disagree on {m.module_path}: {other!r} -> {pins[key][0]}, {pattern!r} -> {mode}",
                    hint="give each module one mode",
                )
            pins[key] = (mode, pattern)
    used: set[str] = set()
    body = _annotate(traced.graph.body, pins, None, used)
    for pattern in shardings:
        if pattern not in used:
            raise _not_pinnable(traced, pattern)
    return replace(traced.graph, body=body)


def _mode(pattern: str, mode: object) -> str:
    text = str(mode).strip().lower().removeprefix("@")
    text = _ALIASES.get(text, text)
    if text not in MODES:
        raise ShardingError(
            f"sharding pin {pattern!r}: {mode!r} is not a mode",
            hint=f"use one of {', '.join(repr(m) for m in MODES)}",
        )
    return text


def _annotate(block: Block, pins: dict[Key, tuple[str, str]], repeat: Repeat | None, used: set[str]) -> Block:
    own = {p.name for p in block.params}
    items = []
    for item in block.items:
        if isinstance(item, Repeat):
            item = replace(item, body=_annotate(item.body, pins, item, used))
        elif isinstance(item, Op) and item.kind in PINNABLE and len(item.args) > 1 and item.read(1) is not None:
            weight = item.args[1]
            key = (repeat.name if repeat is not None and weight in own else None, weight)
            if key in pins:
                mode, pattern = pins[key]
                kept = tuple(a for a in item.annotations if a.kind not in MODES)
                item = replace(item, annotations=kept + (Annotation(mode, (), item.loc),))
                used.add(pattern)
        items.append(item)
    return replace(block, items=tuple(items))


def _check_whole_repeats(traced: TracedModel, pattern: str, matched) -> None:
    counts = {r.name: r.count for r in traced.graph.body.items if isinstance(r, Repeat)}
    layers: dict[str, set[str]] = {}
    for m in matched:
        if m.repeat is not None:
            layers.setdefault(m.repeat, set()).add(m.ir_name.split(".")[1])
    for repeat, seen in layers.items():
        if len(seen) != counts[repeat]:
            stack = next(m.pattern for m in matched if m.repeat == repeat)
            raise ShardingError(
                f"sharding pin {pattern!r} matches {len(seen)} of the {counts[repeat]} layers of {stack}; "
                "the layers of a repeated stack are traced once and share one layout",
                hint=f"pin every layer with {stack!r}",
            )


def _patterns(traced: TracedModel) -> list[str]:
    return sorted({m.pattern for m in traced.params})


def _no_match(traced: TracedModel, pattern: str) -> ShardingError:
    known = _patterns(traced)
    close = difflib.get_close_matches(pattern, known, n=3, cutoff=0.5)
    hint = f"did you mean {' or '.join(repr(c) for c in close)}? " if close else ""
    if pattern.rpartition(".")[2] in ("weight", "bias"):
        hint += "patterns name modules, not parameters (drop the .weight/.bias); "
    listing = ", ".join(known[:12]) + (", ..." if len(known) > 12 else "")
    return ShardingError(f"sharding pin {pattern!r} matches no module with parameters",
                         hint=f"{hint}modules with parameters: {listing}")


def _not_pinnable(traced: TracedModel, pattern: str) -> ShardingError:
    paths = sorted({m.pattern for m in traced.match(pattern)})
    return ShardingError(
        f"sharding pin {pattern!r} matches {', '.join(paths)}, whose parameters no linear or embedding uses as "
        "its weight; @col/@row/@replicate choose how a linear or an embedding is split",
        hint="pin the linear layers around it; norms and biases follow the activations they apply to",
    )
