"""JSON encoding of the frozen IR and plan dataclasses, driven by their type hints.

Shardings and source locations are written in their text forms
(`batch:dp seq:tp`, `gpt.5d:12:5`) so a plan reads like the summary; fields at
their default value are left out; IR nodes carry a `node` tag. `decode` rebuilds
the exact objects, so `decode(T, encode(x)) == x` for every plan.
"""

from __future__ import annotations

import dataclasses
import functools
import sys
import types
import typing
from enum import Enum
from typing import Any

from fivedc.ir import graph as ir
from fivedc.errors import PlanError, SourceLoc
from fivedc.ir.mesh import Mesh
from fivedc.ir.sharding import Sharding

NODE_TAGS = {"op": ir.Op, "redistribute": ir.Redistribute, "repeat": ir.Repeat}
TAG_OF = {cls: tag for tag, cls in NODE_TAGS.items()}


def encode(value: Any) -> Any:
    if isinstance(value, Sharding):
        return str(value)
    if isinstance(value, SourceLoc):
        return str(value)
    if isinstance(value, Mesh):
        return {"sizes": value.as_dict(), "rank_order": [str(a) for a in value.rank_order]}
    if isinstance(value, Enum):
        return value.value
    if dataclasses.is_dataclass(value):
        out = {"node": TAG_OF[type(value)]} if type(value) in TAG_OF else {}
        for name, default in _fields(type(value)):
            item = getattr(value, name)
            if item is not default and item != default:
                out[name] = encode(item)
        return out
    if isinstance(value, tuple):
        return [encode(v) for v in value]
    return value


@functools.cache
def _fields(cls: type) -> tuple[tuple[str, Any], ...]:
    """(name, default) of each field written; `dim_locs` only serves error messages."""
    return tuple(
        (f.name, f.default if f.default is not dataclasses.MISSING else dataclasses.MISSING)
        for f in dataclasses.fields(cls)
        if f.name != "dim_locs"
    )


@functools.cache
def _hints(cls: type) -> dict[str, Any]:
    return typing.get_type_hints(cls, {**vars(ir), **vars(sys.modules[cls.__module__])})


def decode(hint: Any, data: Any, path: str = "plan") -> Any:
    """The object of type `hint` that `data` encodes; a `PlanError` naming the field
    (`path`) when `data` does not have the type the field declares."""
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if hint is Any:
        return data
    if hint is ir.Scalar or hint in _PRIMITIVES:
        return _primitive(hint, data, path)
    if origin in (typing.Union, types.UnionType):
        if data is None and type(None) in args:
            return None
        if isinstance(data, dict) and "node" in data:
            if data["node"] not in NODE_TAGS:
                raise PlanError(f"{path}: unknown node kind {data['node']!r}; one of {', '.join(NODE_TAGS)}")
            return decode(NODE_TAGS[data["node"]], data, path)
        for option in args:
            if option in _PRIMITIVES and _is(option, data):
                return data
        options = [a for a in args if a is not type(None) and a not in _PRIMITIVES]
        if not options:
            raise PlanError(f"{path}: expected {' or '.join(_name(a) for a in args)}, got {data!r}")
        return decode(options[0], data, path)
    if origin is tuple:
        if not isinstance(data, list):
            raise PlanError(f"{path}: expected a list, got {data!r}")
        if len(args) == 2 and args[1] is Ellipsis:
            return tuple(decode(args[0], v, f"{path}[{i}]") for i, v in enumerate(data))
        if len(args) != len(data):
            raise PlanError(f"{path}: expected {len(args)} items, got {len(data)}")
        return tuple(decode(a, v, f"{path}[{i}]") for i, (a, v) in enumerate(zip(args, data)))
    if hint in (Sharding, SourceLoc):
        if not isinstance(data, str):
            raise PlanError(f"{path}: expected text, got {data!r}")
        return Sharding.parse(data) if hint is Sharding else SourceLoc.parse(data)
    if hint is Mesh:
        return _mesh(data, path)
    if isinstance(hint, type) and issubclass(hint, Enum):
        try:
            return hint(data)
        except ValueError:
            raise PlanError(f"{path}: {data!r} is not one of {', '.join(str(m.value) for m in hint)}") from None
    if dataclasses.is_dataclass(hint):
        if not isinstance(data, dict):
            raise PlanError(f"{path}: expected an object for {hint.__name__}, got {data!r}")
        hints = _hints(hint)
        unknown = sorted(set(data) - set(hints) - {"node", "dim_locs"})
        if unknown:
            raise PlanError(f"{path}: {hint.__name__} has no field {unknown[0]!r}")
        kwargs = {k: decode(hints[k], v, f"{path}.{k}") for k, v in data.items() if k in hints}
        return hint(**kwargs)
    return data


_PRIMITIVES = (bool, int, float, str)


def _is(kind: type, data: Any) -> bool:
    """JSON's types as Python reads them: a bool is not an int, an int is a float."""
    if kind is bool:
        return isinstance(data, bool)
    if kind is int:
        return isinstance(data, int) and not isinstance(data, bool)
    if kind is float:
        return isinstance(data, (int, float)) and not isinstance(data, bool)
    return isinstance(data, kind)


def _primitive(hint: Any, data: Any, path: str) -> Any:
    kinds = _PRIMITIVES if hint is ir.Scalar else (hint,)
    if not any(_is(k, data) for k in kinds):
        raise PlanError(f"{path}: expected {' or '.join(_name(k) for k in kinds)}, got {data!r}")
    return data


def _name(kind: Any) -> str:
    return {bool: "true/false", int: "an integer", float: "a number", str: "text", type(None): "null"}.get(
        kind, getattr(kind, "__name__", str(kind)))


def _mesh(data: Any, path: str) -> Mesh:
    from fivedc.ir.mesh import MESH_ORDER, MeshAxis

    if not isinstance(data, dict) or not isinstance(data.get("sizes"), dict):
        raise PlanError(f"{path}: expected {{\"sizes\": {{\"dp\": N, ...}}, \"rank_order\": [...]}}, got {data!r}")
    sizes = []
    for axis in MESH_ORDER:
        size = data["sizes"].get(str(axis))
        if not _is(int, size) or size < 1:
            raise PlanError(f"{path}.sizes.{axis}: expected an integer >= 1, got {size!r}")
        sizes.append(size)
    order = data.get("rank_order", [str(a) for a in MESH_ORDER])
    if not isinstance(order, list) or sorted(map(str, order)) != sorted(map(str, MESH_ORDER)):
        raise PlanError(f"{path}.rank_order: expected each of dp, pp, tp, cp, ep once, got {order!r}")
    return Mesh(tuple(sizes), tuple(MeshAxis(a) for a in order))
