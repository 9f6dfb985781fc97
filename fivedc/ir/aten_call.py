"""The `aten` op kind: an ATen operator the compiler has no sharding rule for, computed whole.

A frontend that meets an op it does not recognise (a label shift by `F.pad`, a
`cumsum`, a `where` on a mask) does not refuse the model: it records the ATen call
as an `aten` op, which runs *replicated*: its arguments are gathered to full
tensors, every rank computes the same full result, and the consumers cut their
shards from it. That is always correct, costs the gathers and the redundant compute,
and is listed in the plan and the summary with its source line and reason, so a
user sees where parallelism is lost.

An `aten` op's attributes say everything the kernel needs:

- `target`: the operator overload, `aten.constant_pad_nd.default`. Only operators
  that neither mutate their arguments nor draw random numbers, and are on the allow-list
  of pure tensor operators the frontend emits (`fivedc/ir/aten_allow.py`: never a file,
  process, seeding or I/O operator), are allowed (`resolve`): a plan file can name
  nothing else. Besides ATen's, a library's own custom operator
  (`transformers.grouped_mm_fallback.default`, registered with `torch.library`) is
  allowed where the library has registered it in the process: it always runs
  replicated, and a process that has not imported the library is told to.
- `call`: the arguments as JSON, `{"args": [...], "kwargs": {...}}`: numbers, bools,
  strings, lists and null as they are; `{"tensor": i}` the op's i-th value argument;
  `{"dtype": "float32"}`, `{"device": null}` (the rank's device), `{"layout":
  "strided"}`, `{"memory_format": "contiguous_format"}`; a small constant tensor as
  `{"constant": [...], "dtype": "int64"}`.
- `layouts`: each value argument as the torch tensor the operator sees, its dims
  separated by `,` (a dim made of several IR dims joins them with `*`, a broadcast
  dim of size 1 is `1`), the arguments separated by `;`. The IR keeps named dims
  in its own order; views and transposes only change this layout.
- `out`: the result's torch dims in the same notation; the op's IR dims are
  their IR dims in order.
- `dtypes`: each value argument's torch dtype at capture (`float` for any floating
  one: it runs at the plan's dtype; `int64`, `bool`, ...), separated by `;`, for
  shape inference on meta tensors.
- `reason`: why the IR has no op of its own for it (the handler that did not follow it).
- `item` (for an operator that returns several tensors, `topk`): which result this op is.
- `rule`: how it is sharded. `replicated` (the default): as above. `pointwise`: an
  operator torch tags pointwise (`torch.Tag.pointwise`), computed on each rank's
  shards, since every element of its result reads only the same element of its
  (broadcast) arguments: its arguments keep the splits their producers give, made
  to agree, with pending sums added. `along`: a reduction, scan or slice along some
  dims of its one argument (`mean(-1)`, `softmax`, `cumsum`, `topk`, `split`,
  `x[..., 1:]`), computed on shards split along any other dim; the dims it runs
  along are gathered whole. `matmul`: `[..., m, k] @ [..., k, n]` of two activations
  (attention written out by hand, `q @ k.transpose(-2, -1)`), computed on shards of
  the batch dims and of the first's rows m; k and the second's n are gathered whole,
  and n is a new dim of the result where its IR dims are already among the others
  (the key positions of a score matrix whose rows are the query positions).
- `along`: for rule `along`, the torch dims of its argument it runs along, comma
  separated; for rule `pointwise`, the torch dims of its result that a constant spans.
- `rows` (rule `pointwise` only, among `along`): the result's dims, each the sequence, at
  which the constants are rows by position (a rotary table applied by hand): the kernel
  cuts them to this rank's positions, so the sequence keeps its split under cp.

On a full tensor the sequence dim is stored in the cp layout's order
(`runtime/program.shard`); where the operator reads the sequence whole (replicated,
or an op along it) the kernel puts it back in global order for the call, and
the result's sequence dim into layout order again.
"""

from __future__ import annotations

import functools
import json
import math

import torch
from torch import Tensor

from fivedc.errors import ShapeError
from fivedc.ir.aten_allow import check_allowed
from fivedc.ir.aten_layout import (  # noqa: F401 (the whole kind importable from here)
    ALONG, MATMULS, PADS, RULES, UNTAGGED_POINTWISE, AtenCallError, Layout, along_of, lines_up, arg_layouts,
    layout_text, matmul_layouts, out_layout, parse_layout, rows_of, rule_of, whole_dims)


MAX_CONSTANT = 4096  # elements of a constant tensor written into a plan


def resolve(target: str, args: tuple | list | None = None, kwargs: dict | None = None):
    """The ATen overload `aten.NAME.OVERLOAD`, if it is one a plan may call (with these
    arguments, when given: an op that may draw random numbers is fine with dropout 0)."""
    parts = target.split(".")
    if len(parts) != 3 or not all(p.isidentifier() for p in parts) or parts[0] in _OWN:
        raise AtenCallError(f"aten op target {target!r} is not of the form aten.NAME.OVERLOAD (or a library's "
                            "NAMESPACE.NAME.OVERLOAD)")
    try:
        overload = getattr(getattr(getattr(torch.ops, parts[0]), parts[1]), parts[2])
    except (AttributeError, RuntimeError):
        if parts[0] == "aten":
            raise AtenCallError(f"aten op target {target!r} is not an ATen operator of torch {torch.__version__}") \
                from None
        raise AtenCallError(f"aten op target {target!r} is not an operator registered in this process",
                            hint=f"import the library that registers the {parts[0]}:: operators (torch.library) "
                            "before the plan is loaded") from None
    if not isinstance(overload, torch._ops.OpOverload):
        raise AtenCallError(f"aten op target {target!r} is not an operator overload")
    schema = overload._schema
    if schema.is_mutable:
        raise AtenCallError(f"aten op target {target!r} writes to its arguments; only pure operators run replicated")
    if torch.Tag.nondeterministic_seeded in getattr(overload, "tags", ()) and _draws(schema, args, kwargs):
        raise AtenCallError(f"aten op target {target!r} draws random numbers; the ranks and the reference would "
                            "draw different ones")
    check_allowed(target, overload)  # a plan is untrusted: only the pure operators the frontend emits
    return overload


def _draws(schema, args, kwargs) -> bool:
    """Whether a call of a possibly random operator draws: not with dropout_p/p 0 or train False."""
    if args is None:
        return False  # checked again where the arguments are known
    bound = bind(schema, args, kwargs)
    if "dropout_p" in bound:
        return bound["dropout_p"] not in (0, 0.0)
    if "train" in bound and bound["train"] is False:
        return False
    if "p" in bound and bound["p"] in (0, 0.0):
        return False
    return True


def bind(schema, args, kwargs) -> dict:
    """An ATen call's arguments by name, defaults filled in."""
    bound = {a.name: a.default_value for a in schema.arguments if a.has_default_value()}
    return bound | dict(zip((a.name for a in schema.arguments), args)) | dict(kwargs or {})


def dtype_name(dtype: torch.dtype) -> str:
    """How `dtypes` names an argument's dtype: `float` for every floating one."""
    return "float" if dtype.is_floating_point else str(dtype).removeprefix("torch.")


def target_name(overload) -> str:
    """`aten.constant_pad_nd.default` for the overload object (a library's: `transformers.NAME.OVERLOAD`)."""
    return f"{overload.namespace}.{overload.overloadpacket.__name__}.{overload._overloadname}"


_OWN = frozenset({"fivedc", "prim", "prims", "higher_order"})  # namespaces that are no library's operators


# ---- the call as JSON ---------------------------------------------------------------------
def encode_call(args: tuple, kwargs: dict, tensor_slot) -> str:
    """JSON of an ATen call; `tensor_slot(obj)` returns the value-argument index of a tensor
    argument (or None for a value that is not one)."""

    def enc(obj):
        slot = tensor_slot(obj)
        if slot is not None:
            return {"tensor": slot}
        if obj is None or isinstance(obj, (bool, int, float, str)):
            return obj
        if isinstance(obj, complex):
            raise AtenCallError(f"a complex number as an argument ({obj!r}): fivedc's IR is real")
        if isinstance(obj, (list, tuple)):
            return [enc(o) for o in obj]
        if isinstance(obj, torch.dtype):
            return {"dtype": str(obj).removeprefix("torch.")}
        if isinstance(obj, torch.device):
            return {"device": None}
        if isinstance(obj, torch.layout):
            return {"layout": str(obj).removeprefix("torch.")}
        if isinstance(obj, torch.memory_format):
            return {"memory_format": str(obj).removeprefix("torch.")}
        if isinstance(obj, Tensor):
            if obj.is_complex():
                raise AtenCallError(f"a constant complex tensor as an argument (fivedc's IR is real: "
                                    f"{str(obj.dtype).removeprefix('torch.')})")
            if obj.numel() > MAX_CONSTANT:
                raise AtenCallError(f"a constant tensor of {obj.numel()} elements as an argument "
                                    f"(at most {MAX_CONSTANT} are written into a plan)")
            return {"constant": obj.detach().cpu().tolist(), "dtype": str(obj.dtype).removeprefix("torch.")}
        raise AtenCallError(f"an argument of type {type(obj).__name__} ({obj!r:.60})")

    return json.dumps({"args": [enc(a) for a in args], "kwargs": {k: enc(v) for k, v in kwargs.items()}},
                      separators=(",", ":"))


def decode_call(text: str, tensors: list, device: torch.device) -> tuple[list, dict]:
    """The call's arguments, with `tensors` (torch-laid-out) in their places. A floating dtype the
    call names (`softmax(x, -1, dtype=torch.float32)`, a float32 constant mask) is the wider of it
    and the widest floating tensor argument's: the plan computes at one dtype, and a cast the
    library wrote around the op is no op in the IR (a float64 run stays float64; a bfloat16
    product still meets float32 where the library asked for it)."""
    wide = _widest_float(tensors)
    try:
        call = json.loads(text)
        args, kwargs = call["args"], call["kwargs"]
        if not isinstance(args, list) or not isinstance(kwargs, dict):
            raise TypeError("args must be a list and kwargs an object")
    except (ValueError, KeyError, TypeError) as error:
        raise AtenCallError(f"an aten op's call is not valid JSON of args and kwargs ({error})") from None

    def dec(obj):
        if isinstance(obj, list):
            return [dec(o) for o in obj]
        if not isinstance(obj, dict):
            return obj
        if set(obj) == {"tensor"} and isinstance(obj["tensor"], int) and 0 <= obj["tensor"] < len(tensors):
            return tensors[obj["tensor"]]
        if set(obj) == {"device"}:
            return device
        if set(obj) == {"dtype"}:
            return _at_least(_torch_attr(obj["dtype"], torch.dtype), wide)
        if set(obj) == {"layout"}:
            return _torch_attr(obj["layout"], torch.layout)
        if set(obj) == {"memory_format"}:
            return _torch_attr(obj["memory_format"], torch.memory_format)
        if set(obj) == {"constant", "dtype"}:
            dtype = _at_least(_torch_attr(obj["dtype"], torch.dtype), wide)
            return torch.tensor(obj["constant"], dtype=dtype, device=device)
        raise AtenCallError(f"an aten op's call holds an argument fivedc cannot read: {json.dumps(obj)[:80]}")

    return [dec(a) for a in args], {str(k): dec(v) for k, v in kwargs.items()}


def _widest_float(tensors: list) -> torch.dtype | None:
    floats = [t.dtype for t in tensors if isinstance(t, Tensor) and t.is_floating_point()]
    return functools.reduce(torch.promote_types, floats) if floats else None


def _at_least(dtype: torch.dtype, wide: torch.dtype | None) -> torch.dtype:
    """A floating `dtype` widened to `wide` (the widest floating tensor argument), others as they are."""
    return torch.promote_types(dtype, wide) if wide is not None and dtype.is_floating_point else dtype


def _torch_attr(name, kind):
    value = getattr(torch, str(name), None)
    if not isinstance(value, kind):
        raise AtenCallError(f"{name!r} is not a torch {kind.__name__}")
    return value


def to_torch(t: Tensor, dims: tuple[str, ...], layout: Layout) -> Tensor:
    """A tensor in IR dim order as the torch tensor `layout` describes."""
    flat = [d for group in layout for d in group]
    if sorted(flat) != sorted(dims):
        raise AtenCallError(f"layout {layout_text(layout)} does not hold the dims {', '.join(dims)}")
    t = t.permute(*[dims.index(d) for d in flat]) if flat else t
    size = dict(zip(flat, t.shape))
    return t.reshape([math.prod(size[d] for d in group) for group in layout])


def from_torch(t: Tensor, layout: Layout, sizes: dict[str, int]) -> Tensor:
    """A torch result laid out as `layout` in IR dim order (its dims in order, merged ones split)."""
    return t.reshape([sizes[d] for group in layout for d in group])


# ---- how it is sharded -------------------------------------------------------------------
def local_rule(overload) -> str:
    """The rule an operator may run under on shards: `pointwise`, `along` (its reductions too),
    `matmul`, or `replicated` (none)."""
    name = overload.overloadpacket.__name__
    tags = getattr(overload, "tags", ())
    if overload.namespace != "aten":
        return "replicated"  # a library's own operator: nothing says how it could be split
    if torch.Tag.pointwise in tags or name in UNTAGGED_POINTWISE or _scalar_where(overload):
        return "pointwise"
    if torch.Tag.reduction in tags or name in ALONG:
        return "along"
    if name in MATMULS:
        return "matmul"
    return "replicated"


def _scalar_where(overload) -> bool:
    """`torch.where(cond, 0, x)`: where.self is tagged pointwise, its overloads with a number are not
    (where.default, the indices of a condition, is not pointwise at all)."""
    return overload.overloadpacket.__name__ == "where" and overload._overloadname in ("ScalarSelf", "ScalarOther",
                                                                                      "Scalar")


def check_rule(op, size=lambda dim: 0) -> None:
    """A plan may run on shards only what allows it: the rule is the operator's own, and the
    result's torch dims line up with the arguments' (broadcast right-aligned for a pointwise
    op, where an argument's dim of size 1 (`size`: a dim's size) broadcasts too, or along a
    dim one new dim for the several IR dims an argument has there; for an op
    along dims each argument's dims with those it runs along kept, reduced to size 1, dropped
    or new: topk's k, a slice, a cat's joined dim, an expand's grown one)."""
    rule = rule_of(op)
    if rule == "replicated":
        return
    if local_rule(resolve(str(op.attr("target", "")))) != rule:
        raise AtenCallError(f"aten op {op.out}: {op.attr('target')} is not a {rule} operator")
    layouts, out = arg_layouts(op), out_layout(op)
    if rule == "pointwise":
        along = along_of(op, out)
        theirs = {d for layout in layouts for group in layout for d in group}
        if any(not set(out[i]) <= theirs for i in rows_of(op)):
            raise AtenCallError(f"aten op {op.out}: `rows` must name result dims its arguments have")

        def fits(g, o, i):  # broadcast, the same dims, or (seen whole) one dim of the result's own for several
            return g in ((), o) or all(size(d) == 1 for d in g) or (i in along and len(o) == 1 and o[0] not in theirs)

        if all(len(layout) <= len(out) and all(fits(g, o, len(out) - 1 - j) for j, (g, o)
                                               in enumerate(zip(reversed(layout), reversed(out))))
               for layout in layouts):
            return
    elif rule == "matmul":
        if _matmul_lines_up(*matmul_layouts(op), out):
            return
    elif all(lines_up(along_of(op, arg), arg, out) for arg in layouts):
        return
    raise AtenCallError(f"aten op {op.out}: its result {layout_text(out)} does not line up with its arguments "
                        f"{op.attr('layouts')} as a {rule} operator's")


def _matmul_lines_up(a: Layout, b: Layout, out: Layout) -> bool:
    """`[..., m, k] @ [..., k, n]`: the result's batch dims are the arguments' broadcast
    (right-aligned), then the first's m, then the second's n or a new dim of its own."""
    if len(out) != max(len(a), len(b)) or out[-2] != a[-2]:
        return False
    theirs = {d for layout in (a, b) for group in layout for d in group}
    if out[-1] != b[-1] and set(out[-1]) & theirs:
        return False
    batch = out[:-2]
    for arg in (a[:-2], b[:-2]):
        if any(g not in ((), o) for g, o in zip(reversed(arg), reversed(batch))):
            return False
    flat = [d for group in out for d in group]
    return len(flat) == len(set(flat))


def meta_type(op, arg_types: list, dim_size) -> tuple[tuple[int, ...], torch.dtype]:
    """The result's shape and dtype, by calling the operator on meta tensors of the arguments'
    shapes (in float64 for float arguments)."""
    tensors = []
    dtypes = str(op.attr("dtypes", "")).split(";")
    for t, layout, name in zip(arg_types, arg_layouts(op), dtypes + [""] * len(arg_types)):
        shape = [math.prod(dim_size(d) for d in group) for group in layout]
        tensors.append(torch.empty(shape, dtype=_meta_dtype(name, t.dtype), device="meta"))
    args, kwargs = decode_call(str(op.attr("call", "")), tensors, torch.device("meta"))
    overload = resolve(str(op.attr("target", "")), args, kwargs)
    try:
        out = overload(*args, **kwargs)
    except Exception as error:
        raise ShapeError(f"aten op {op.attr('target')} fails on arguments of these shapes: "
                         f"{type(error).__name__}: {str(error).splitlines()[0] if str(error) else ''}", loc=op.loc) from None
    out = pick(op, out)
    if not isinstance(out, Tensor):
        raise ShapeError(f"aten op {op.attr('target')} returns {type(out).__name__}, not one tensor", loc=op.loc)
    return tuple(out.shape), out.dtype


def pick(op, out):
    """The result the op stands for: the `item`-th of an operator returning several."""
    item = op.attr("item")
    if item is None:
        return out
    if not isinstance(out, (tuple, list)) or not isinstance(item, int) or not 0 <= item < len(out):
        raise AtenCallError(f"aten op {op.out}: item {item!r} of a result that is not a tuple that long")
    return out[item]


def _meta_dtype(name: str, ir_dtype: str) -> torch.dtype:
    """An argument's dtype on meta tensors: the recorded one, float64 for `float`, else by the IR dtype."""
    if name not in ("", "float"):
        return _torch_attr(name, torch.dtype)
    return torch.float64 if ir_dtype == "float" else torch.int64
