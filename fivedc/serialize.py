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

from fivedc import ir
from fivedc.errors import PlanError, SourceLoc
from fivedc.mesh import Mesh
from fivedc.sharding import Sharding

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


def decode(hint: Any, data: Any) -> Any:
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if hint is Any or hint is ir.Scalar:
        return data
    if origin in (typing.Union, types.UnionType):
        if data is None:
            return None
        if isinstance(data, dict) and "node" in data:
            return decode(NODE_TAGS[data["node"]], data)
        for option in args:
            if option is type(None):
                continue
            if option in (str, float, int, bool) and isinstance(data, option):
                return data
        options = [a for a in args if a is not type(None) and a not in (str, float, int, bool)]
        return decode(options[0], data) if options else data
    if origin is tuple:
        if len(args) == 2 and args[1] is Ellipsis:
            return tuple(decode(args[0], v) for v in data)
        return tuple(decode(a, v) for a, v in zip(args, data))
    if hint is Sharding:
        return Sharding.parse(data)
    if hint is SourceLoc:
        return SourceLoc.parse(data)
    if hint is Mesh:
        from fivedc.mesh import MESH_ORDER, MeshAxis

        return Mesh(tuple(data["sizes"][str(a)] for a in MESH_ORDER), tuple(MeshAxis(a) for a in data["rank_order"]))
    if isinstance(hint, type) and issubclass(hint, Enum):
        return hint(data)
    if dataclasses.is_dataclass(hint):
        if not isinstance(data, dict):
            raise PlanError(f"expected an object for {hint.__name__}, got {data!r}")
        hints = _hints(hint)
        kwargs = {k: decode(hints[k], v) for k, v in data.items() if k != "node" and k in hints}
        return hint(**kwargs)
    return data
