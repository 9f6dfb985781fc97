"""A fresh tensor filled slice by slice, rewritten as the out-of-place ops that say the same.

Libraries build a tensor by allocating it and copying parts into slices of it, e.g.
DeepSeek-V3's `expand_kv`:

    key_states = kv_nope.new_empty(*shape[:-1], nope + rope)
    key_states[..., :nope].copy_(k_nope)
    key_states[..., nope:].copy_(k_rot)

which torch.export keeps as `new_empty`, `slice`, `copy_` (a write through a view, which
a plan cannot name). Where nothing else sees the tensor before the last write, the
pattern is a pure function of the copied values: `fill_writes` replaces it, on the
exported ATen graph, by

- `cat` of the copied values along the sliced dim, when the slices are of one dim, in
  order, and cover it exactly (the tensor's uninitialised values are never read);
- else a chain of `slice_scatter`s from zeros (`new_zeros`, `zeros`, `zeros_like` in
  place of the `empty` kinds, whose unwritten values are undefined: any value is theirs),
  or from the tensor itself when it was made with zeros.

Each copied value is broadcast to its slice's shape (`expand`) and cast to its dtype, as
`copy_` does. The tensor must be made by one of `FRESH` (so no other tensor aliases it),
written only through `aten.slice` views of it, each view used by exactly one `copy_`
whose own result is unused, and read only after the last write; otherwise the graph is
left as it is (and the write is reported where it touches the model's data).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.fx as fx

aten = torch.ops.aten
# allocations -> the allocation of zeros that stands for them (None: it is already zeros)
FRESH = {aten.new_empty.default: aten.new_zeros.default, aten.empty.memory_format: aten.zeros.default,
         aten.empty_like.default: aten.zeros_like.default, aten.new_zeros.default: None,
         aten.zeros.default: None, aten.zeros_like.default: None}


@dataclass(frozen=True, slots=True)
class _Write:
    view: fx.Node  # aten.slice of the fresh tensor
    copy: fx.Node  # aten.copy_(view, value)
    dim: int
    start: int
    stop: int
    step: int


def fill_writes(graph: fx.Graph) -> None:
    """Rewrite every fresh tensor filled through slices (see the module's docstring)."""
    for base in list(graph.nodes):
        if base.op == "call_function" and base.target in FRESH:
            writes = _writes(graph, base)
            if writes:
                _rewrite(graph, base, writes)


def _writes(graph: fx.Graph, base: fx.Node) -> list[_Write] | None:
    """The slice writes into `base` in graph order, or None when the pattern does not hold."""
    order = {node: i for i, node in enumerate(graph.nodes)}
    shape = _shape(base)
    if shape is None:
        return None
    writes, readers = [], []
    for user in base.users:
        if user.target is aten.slice.Tensor and user.args[0] is base and len(user.users) == 1:
            (copy,) = user.users
            if copy.target is aten.copy_.default and copy.args[0] is user and not copy.users:
                writes.append(_write(user, copy, shape))
                continue
        readers.append(user)
    if not writes or None in writes:
        return None
    writes.sort(key=lambda w: order[w.copy])
    last = order[writes[-1].copy]
    if any(order[r] < last for r in readers):
        return None  # read, or viewed otherwise, before it is complete
    return writes


def _write(view: fx.Node, copy: fx.Node, shape: tuple[int, ...]) -> _Write | None:
    args = list(view.args) + [None] * (5 - len(view.args))
    dim, start, stop, step = (args[1] if args[1] is not None else view.kwargs.get("dim", 0)), args[2], args[3], \
        args[4] if args[4] is not None else 1
    if not all(isinstance(v, int) for v in (dim, step)) or step < 1:
        return None
    dim %= len(shape)
    size = shape[dim]
    start, stop = _clamp(0 if start is None else start, size), _clamp(size if stop is None else stop, size)
    if not all(isinstance(v, int) for v in (start, stop)):
        return None
    return _Write(view, copy, dim, start, max(start, stop), step)


def _clamp(index, size: int):
    if not isinstance(index, int):
        return None
    index = index + size if index < 0 else index
    return min(max(index, 0), size)


def _covers(writes: list[_Write], shape: tuple[int, ...]) -> bool:
    """One dim, step 1, in order, end to end over the whole dim."""
    dims = {w.dim for w in writes}
    if len(dims) != 1 or any(w.step != 1 for w in writes):
        return False
    bounds = [(w.start, w.stop) for w in writes]
    return bounds[0][0] == 0 and bounds[-1][1] == shape[writes[0].dim] and \
        all(a[1] == b[0] for a, b in zip(bounds, bounds[1:])) and all(a < b for a, b in bounds)


def _rewrite(graph: fx.Graph, base: fx.Node, writes: list[_Write]) -> None:
    shape = _shape(base)
    readers = [u for u in base.users if u not in {w.view for w in writes}]  # before the new nodes read it
    with graph.inserting_before(writes[-1].copy.next):  # in order, after the last write
        values = [_as_slice(graph, w) for w in writes]
        if _covers(writes, shape):
            result = graph.call_function(aten.cat.default, (values, writes[0].dim))
        else:
            result = _scattered(graph, base, writes, values)
    result.meta = {k: v for k, v in base.meta.items() if k != "val"} | {"val": base.meta.get("val")}
    result.meta["stack_trace"] = writes[-1].copy.meta.get("stack_trace", base.meta.get("stack_trace", ""))
    for reader in readers:
        reader.replace_input_with(base, result)
    for w in writes:
        graph.erase_node(w.copy)
        graph.erase_node(w.view)
    if not base.users:
        graph.erase_node(base)


def _as_slice(graph: fx.Graph, write: _Write) -> fx.Node:
    """The copied value as `copy_` writes it: broadcast to the slice's shape, at its dtype."""
    value = write.copy.args[1]
    want, got = write.view.meta.get("val"), value.meta.get("val") if isinstance(value, fx.Node) else None
    node = value
    if got is not None and want is not None and got.dtype != want.dtype:
        node = graph.call_function(aten._to_copy.default, (node,), {"dtype": want.dtype})
        node.meta = {"val": got.to(want.dtype), "stack_trace": write.copy.meta.get("stack_trace", "")}
    if got is None or want is None or tuple(got.shape) != tuple(want.shape):
        node = graph.call_function(aten.expand.default, (node, list(want.shape)))
        node.meta = {"val": want, "stack_trace": write.copy.meta.get("stack_trace", "")}
    return node


def _scattered(graph: fx.Graph, base: fx.Node, writes: list[_Write], values: list[fx.Node]) -> fx.Node:
    """zeros (or the zero tensor itself), each slice then scattered in, in order."""
    zeros = FRESH[base.target]
    if zeros is None:
        current = base
    else:
        with graph.inserting_before(base):
            current = graph.call_function(zeros, base.args, dict(base.kwargs))
        current.meta = dict(base.meta)
    for w, value in zip(writes, values):
        current = graph.call_function(aten.slice_scatter.default, (current, value, w.dim, w.start, w.stop, w.step))
        current.meta = {"val": base.meta.get("val"), "stack_trace": w.copy.meta.get("stack_trace", "")}
    return current


def _shape(node: fx.Node) -> tuple[int, ...] | None:
    val = node.meta.get("val")
    shape = tuple(val.shape) if isinstance(val, torch.Tensor) else None
    return shape if shape is not None and all(isinstance(s, int) for s in shape) else None
