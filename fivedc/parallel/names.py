"""The module's own parameter names on a parallelized module (`fivedc/parallel/module.py`).

The plan names its parameters itself (`layers.0.c_attn_q`) and holds them in its own
layouts (a linear's weight [in, out], the heads a dim of their own); the module names
them by its state-dict keys (`transformer.h.0.attn.c_attn.weight`) in torch's layouts
([out, in], q, k and v rows of one fused tensor, each expert a module of its own).
`HeldNames` joins the two on one rank. Each module parameter whose IR parameters the
rank holds is one tensor under its key: its part of the module's tensor, in the module's
layout. Where the plan splits a dim over ranks that is the rank's block of it (a fused
qkv weight: the rank's q rows, then its k rows, then its v rows, as Megatron holds
them); an expert dim split over ep holds the rank's experts in placement order; and
separate experts are held under their own keys, the rank's experts only. Where a
rank's part has no shape in the module's layout (a reshape that splits a dim the plan
splits, unevenly), the key's tensor is the part flattened, the pieces end to end.

Every IR parameter is a view of these tensors (`to_ir`: a narrow, a transpose, a
reshape), made at each forward, so autograd takes the gradients back to the
module-named tensors and an optimizer steps those. Separate experts are one buffer's
consecutive slices, so their stack is a view too (`_Adjacent`); where they are not
(ZeRO's gathered copies, a conversion that replaced the parameters' storage), a stack
of copies. `to_held` is the inverse, for the tensors' first values and for loading.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

import torch
from torch import Tensor

from fivedc.errors import NotSupportedError
from fivedc.frontends.fx.params import ParamMapping
from fivedc.ir.graph import Param
from fivedc.parallel.grads import Grouping
from fivedc.passes.overlap import expand_units
from fivedc.plan.execution_plan import ExecutionPlan
from fivedc.runtime.kernel_context import KernelContext
from fivedc.runtime.program import grad_groups, qualified_params


@dataclass(frozen=True, slots=True)
class Piece:
    """One IR parameter (one expert of it, when stacked) as a part of a module-named tensor."""

    key: str  # the module's state-dict key of the tensor holding it
    start: int  # where along `axis` of that tensor it begins
    length: int  # how long it is along `axis`
    axis: int
    transpose: bool  # its last two dims are the IR's swapped
    shape: tuple[int, ...]  # its local shape in the module's layout (the last two dims swapped if `transpose`)
    ir_shape: tuple[int, ...]  # its local shape in the IR (one expert's, when stacked)

    def to_ir(self, held: Tensor) -> Tensor:
        part = held.narrow(self.axis, self.start, self.length)
        return (part.transpose(-2, -1) if self.transpose else part).reshape(self.ir_shape)

    def to_held(self, ir: Tensor) -> Tensor:
        part = ir.reshape(self.shape)
        return part.transpose(-2, -1) if self.transpose else part


@dataclass(frozen=True, slots=True)
class HeldNames:
    """Which module-named tensor holds which IR parameter on this rank (see the file's top)."""

    pieces: dict[str, tuple[Piece, ...]]  # per IR parameter: its piece, or one per local expert
    stacked: frozenset[str]  # the IR parameters stacked from separate experts
    shapes: dict[str, tuple[int, ...]]  # per module key held here: its local shape, in key order

    def ir(self, name: str, held: Mapping[str, Tensor]) -> Tensor:
        """The IR parameter `name` from the module-named tensors: views of them (separate
        experts: of the one buffer `to_held` lays them out in, else a stack of copies)."""
        pieces = self.pieces[name]
        if name not in self.stacked:
            return pieces[0].to_ir(held[pieces[0].key])
        experts = [held[p.key] for p in pieces]
        first = pieces[0]
        if _adjacent(experts) and all(p.shape == first.shape and p.start == first.start for p in pieces):
            part = _Adjacent.apply(*experts).narrow(first.axis + 1, first.start, first.length)
            return (part.transpose(-2, -1) if first.transpose else part).reshape(len(pieces), *first.ir_shape)
        return torch.stack([p.to_ir(held[p.key]) for p in pieces])

    def to_ir(self, held: Mapping[str, Tensor]) -> dict[str, Tensor]:
        return {name: self.ir(name, held) for name in self.pieces}

    def to_held(self, ir: Mapping[str, Tensor]) -> dict[str, Tensor]:
        """The module-named tensors (new, contiguous) from this rank's IR parameters."""
        parts: dict[str, list[tuple[Piece, Tensor]]] = {key: [] for key in self.shapes}
        for name, pieces in self.pieces.items():
            values = ir[name].unbind(0) if name in self.stacked else (ir[name],)
            for piece, value in zip(pieces, values):
                parts[piece.key].append((piece, piece.to_held(value)))
        out = {}
        for key, found in parts.items():
            found.sort(key=lambda item: item[0].start)
            whole = torch.cat([t for _, t in found], dim=found[0][0].axis) if len(found) > 1 else found[0][1]
            out[key] = whole.reshape(self.shapes[key]).clone(memory_format=torch.contiguous_format)
        for name in sorted(self.stacked):  # a layer's experts side by side in one buffer
            keys = [p.key for p in self.pieces[name]]
            if not _adjacent([out[k] for k in keys]) and len({self.shapes[k] for k in keys}) == 1:
                out.update(zip(keys, torch.stack([out[k] for k in keys]).unbind(0)))
        return out

    def keys_of(self, names: Iterable[str]) -> tuple[str, ...]:
        """The module keys holding these IR parameters, in their order, each once."""
        out: dict[str, None] = {}
        for name in names:
            out.update((p.key, None) for p in self.pieces.get(name, ()))
        return tuple(out)

    def grouping(self, plan: ExecutionPlan, ctx: KernelContext) -> Grouping:
        """The plan's gradient groups and buckets in module keys (a key in the first bucket
        naming any of its IR parameters)."""
        by_ir = grad_groups(plan.graph, ctx)
        groups = {p.key: by_ir[name] for name, pieces in self.pieces.items() for p in pieces}
        seen: set[str] = set()
        units = []
        for names, unit in expand_units(plan.buckets):
            keys = tuple(k for k in self.keys_of(names) if k not in seen)
            seen.update(keys)
            if keys:
                units.append((keys, unit))
        return Grouping(groups, tuple(keys for keys, _ in units), tuple(units), plan.overlap, plan.bucket_bytes)


def _adjacent(tensors: list[Tensor]) -> bool:
    """Whether the tensors are one buffer's consecutive slices (contiguous, of one shape)."""
    first = tensors[0]
    if not all(t.is_contiguous() and t.shape == first.shape and t.dtype == first.dtype for t in tensors):
        return False
    step = first.numel() * first.element_size()
    storage = first.untyped_storage().data_ptr()
    return all(t.untyped_storage().data_ptr() == storage and t.data_ptr() == first.data_ptr() + i * step
               for i, t in enumerate(tensors))


class _Adjacent(torch.autograd.Function):
    """Separate experts held side by side in one buffer, as the stack they are in the IR,
    without a copy; backward hands each its slice of the gradient."""

    @staticmethod
    def forward(fctx, *experts: Tensor) -> Tensor:
        first = experts[0]
        return first.as_strided((len(experts), *first.shape), (first.numel(), *first.stride()),
                                first.storage_offset())

    @staticmethod
    def backward(fctx, grad: Tensor):
        return grad.unbind(0)


@dataclass(frozen=True, slots=True)
class _Part:
    """One IR parameter (one local expert of it) found in a module key, before the key's
    parts are laid side by side."""

    name: str  # the IR parameter
    slot: int  # its local expert (0 when not stacked)
    mapping: ParamMapping
    shape: tuple[int, ...] | None  # its local shape in the module's layout (swapped if transposed), if any
    ir_shape: tuple[int, ...]  # its local shape in the IR (one expert's, when stacked)


def held_names(mappings: tuple[ParamMapping, ...], plan: ExecutionPlan, ctx: KernelContext,
               held: Iterable[str], order: Iterable[str]) -> HeldNames:
    """The module-named tensors holding the IR parameters `held` on this rank (`order`: the
    module's keys in its own order)."""
    specs = dict(qualified_params(plan.graph))
    by_ir: dict[str, list[ParamMapping]] = {}
    for m in mappings:
        by_ir.setdefault(m.ir_name, []).append(m)
    found: list[_Part] = []
    stacked = set()
    for name in held:
        full, local = _shapes(specs[name], plan, ctx)
        group = by_ir[name]
        if group[0].index is None:
            found.append(_Part(name, 0, group[0], _key_shape(group[0], full, local), local))
            continue
        stacked.add(name)
        by_index = {m.index: m for m in group}
        for slot, expert in enumerate(_local_experts(specs[name], plan, ctx)):
            m = by_index[expert]
            found.append(_Part(name, slot, m, _key_shape(m, full[1:], local[1:]), local[1:]))
    _same_groups(found, specs)
    return _assemble(found, stacked, list(order))


def _shapes(spec: Param, plan: ExecutionPlan, ctx: KernelContext) -> tuple[tuple[int, ...], tuple[int, ...]]:
    graph, mesh = plan.graph, plan.mesh
    return (tuple(graph.dim(d) for d in spec.dims),
            tuple(graph.local_size(d, spec.sharding, mesh) for d in spec.dims))


def _local_experts(spec: Param, plan: ExecutionPlan, ctx: KernelContext) -> list[int]:
    """The experts (indices into the stack) this rank holds, in the order it stores them."""
    dim = spec.dims[0]
    count = plan.graph.dim(dim)
    order = ctx.storage_order(dim, spec.sharding)
    start, stop = ctx.shard_range(dim, spec.sharding) if spec.sharding.axes_of(dim) else (0, count)
    return [int(e) for e in (order[start:stop] if order is not None else range(start, stop))]


def _key_shape(m: ParamMapping, full: tuple[int, ...], local: tuple[int, ...]) -> tuple[int, ...] | None:
    """The local shape of `m`'s part of its key, in the module's layout before the transpose
    (the last two dims swapped when `m.transpose`); None where the reshape from the IR's
    layout has no local counterpart."""
    key = list(m.key_shape)
    if m.rows is not None:
        key[m.axis] = m.rows[1] - m.rows[0]
    if m.transpose:
        key[-2], key[-1] = key[-1], key[-2]
    return _reshaped(full, local, tuple(key))


def _reshaped(full: tuple[int, ...], local: tuple[int, ...], target: tuple[int, ...]) -> tuple[int, ...] | None:
    """`target`'s local shape when a tensor of shape `full` reshaped to `target` is cut to
    `local`: dims merged take the product of their local sizes; a dim split into several
    cuts its first; None where neither fits."""
    out: list[int] = []
    i = j = 0
    while i < len(full) or j < len(target):
        group_i, group_j = _group(full, target, i, j)
        if group_i is None:
            return None
        parts = _local_group(full[i:group_i], local[i:group_i], target[j:group_j])
        if parts is None:
            return None
        out += parts
        i, j = group_i, group_j
    return tuple(out)


def _group(full, target, i: int, j: int) -> tuple[int | None, int]:
    """The ends of the smallest runs from i and j (one dim each, where there is one) with
    the same product; None where there are none."""
    a, i2 = (full[i], i + 1) if i < len(full) else (1, i)
    b, j2 = (target[j], j + 1) if j < len(target) else (1, j)
    while a != b:
        if a < b and i2 < len(full):
            a, i2 = a * full[i2], i2 + 1
        elif b < a and j2 < len(target):
            b, j2 = b * target[j2], j2 + 1
        else:
            return None, j2
    return i2, j2


def _local_group(full: tuple[int, ...], local: tuple[int, ...], target: tuple[int, ...]) -> list[int] | None:
    if full == local:
        return list(target)
    if len(target) == 1:
        return [math.prod(local)]
    if len(full) == 1:
        ratio = full[0] // local[0]
        first = next((k for k, size in enumerate(target) if size > 1), 0)
        if target[first] % ratio:
            return None
        return [size // ratio if k == first else size for k, size in enumerate(target)]
    return None


def _same_groups(found: list[_Part], specs: dict[str, Param]) -> None:
    """The IR parameters one key holds have one gradient group: its tensor is summed once."""
    partial: dict[str, tuple] = {}
    for part in found:
        key, axes = part.mapping.key, specs[part.name].grad_partial
        if partial.setdefault(key, axes) != axes:
            raise NotSupportedError(
                f"{key} holds IR parameters whose gradients are summed over different axes "
                f"({partial[key]} and {axes}, {part.name})",
                hint="pin the whole module one way (parallelize(..., shardings={...}))")


def _assemble(found: list[_Part], stacked: set[str], order: list[str]) -> HeldNames:
    """Each key's parts laid side by side (`_lay_out`), the keys in the module's order."""
    by_key: dict[str, list[_Part]] = {}
    for part in found:
        by_key.setdefault(part.mapping.key, []).append(part)
    pieces: dict[str, dict[int, Piece]] = {}
    shapes: dict[str, tuple[int, ...]] = {}
    rank = {key: k for k, key in enumerate(order)}
    for key in sorted(by_key, key=lambda k: rank.get(k, len(rank))):
        parts = sorted(by_key[key], key=lambda part: part.mapping.rows[0] if part.mapping.rows else 0)
        laid, shapes[key] = _lay_out(key, parts)
        for part, piece in zip(parts, laid):
            pieces.setdefault(part.name, {})[part.slot] = piece
    return HeldNames({n: tuple(by_slot[s] for s in sorted(by_slot)) for n, by_slot in pieces.items()},
                     frozenset(stacked), shapes)


def _lay_out(key: str, parts: list[_Part]) -> tuple[list[Piece], tuple[int, ...]]:
    """The pieces of one key and its local shape: in the module's layout when every part has
    one and they differ only along the key's axis, else flat, end to end."""
    axis = parts[0].mapping.axis
    if all(part.shape is not None for part in parts):
        held = [_unswapped(part.shape, part.mapping.transpose) for part in parts]
        rest = {tuple(h[:axis]) + tuple(h[axis + 1:]) for h in held}
        if len(rest) == 1 and len({len(h) for h in held}) == 1:
            out, start = [], 0
            for part, h in zip(parts, held):
                out.append(Piece(key, start, h[axis], axis, part.mapping.transpose, part.shape, part.ir_shape))
                start += h[axis]
            whole = list(held[0])
            whole[axis] = start
            return out, tuple(whole)
    out, start = [], 0
    for part in parts:
        size = math.prod(part.ir_shape)
        out.append(Piece(key, start, size, 0, False, (size,), part.ir_shape))
        start += size
    return out, (start,)


def _unswapped(shape: tuple[int, ...], transpose: bool) -> tuple[int, ...]:
    return (*shape[:-2], shape[-1], shape[-2]) if transpose else shape
