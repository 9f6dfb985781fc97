"""Communication insertion: reconcile what each producer gives with what each consumer needs.

Wherever an op needs an argument in another sharding than its producer gave (or
will hand back a partial gradient for it), a `Redistribute` node is inserted
before the op, with the forward collectives, the backward collectives autograd
will run for the gradient, and for each a reason naming both sides and the source
line. Consumers that need the same thing share one node. Per mesh axis:

    producer -> consumer      forward          backward (gradient)
    partial  -> split d       reduce-scatter   all-gather
    partial  -> replicated    all-reduce       all-reduce if consumers give partial grads
    split d  -> replicated    all-gather       reduce-scatter if partial grads, else slice
    split d  -> split e       all-to-all       all-to-all back
    replicated -> split d     slice (local)    all-gather
    replicated -> replicated  -                all-reduce if partial grads (Megatron's f)

With overlap on, an all-gather whose next op is a linear reading it (SP's gather before a
column-parallel linear) runs in a ring of point-to-point hops, the linear multiplying
each chunk as it arrives while the next hop runs; so does a reduce-scatter of the linear
just before it (SP's row-parallel output), each chunk summed on around the ring as the
linear makes it, and in backward that sum's gradient comes back in a ring, the linear
making its input gradient a chunk at a time; and without SP, the all-reduce of the
linear just before it runs in n chunks, each summed (async) while the linear makes the
next (collective matmul, `runtime/tp_ring.py`). Their `overlaps` names the
matmul, and the step time hides them behind it (`fivedc/estimates/unit_costs.py`).

And a backward sum (one all-reduce or reduce-scatter) of a linear's input runs behind
that linear's weight gradient, as Megatron's async tensor parallelism: the linears that
read the redistributed value put off dW = X^T dY until their input gradient's sum has
started, then compute it while the sum runs (`runtime/tp_overlap.py`). The
collective's `overlaps` names those weights; the step time hides it behind their
weight-gradient seconds (`UnitTime.hidden`) except under a split backward (zero-bubble's
W runs later). The sum is not marked under ZeRO-3 without a pipeline (a weight there is
gathered at its use and its gradient reduce-scattered by its group's gather,
`runtime/zero3.py`, whose order of collectives this would move), nor for a weight
whose gradient is kept on one rank only (`ArgSpec.grad_once`).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import ClassVar

from fivedc.errors import NotSupportedError, PassError
from fivedc.ir.graph import (
    ArgSpec, Block, Collective, CollectiveKind, Graph, Op, Phase, Redistribute, Repeat, TensorType,
)
from fivedc.ir.mesh import MESH_ORDER, Mesh, MeshAxis
from fivedc.ir.sharding import Sharding
from fivedc.passes.base import CompileOptions

K = CollectiveKind


@dataclass(slots=True)
class _Where:
    """What a redistribution connects, for its reasons."""

    tensor: str
    producer: str
    consumer: str
    loc: object
    count: int


Step = tuple[K, MeshAxis, "str | None", "str | None"]  # kind, axis, dim, second dim


def behind_weight_grads(items: list, params: set[str]) -> list:
    """`items` with the backward sum of each linear's redistributed input marked as
    overlapping the weight gradients of the linears reading it (see the module's doc)."""
    out = list(items)
    for index, node in enumerate(out):
        if not isinstance(node, Redistribute) or len(node.backward) != 1:
            continue
        (step,) = node.backward
        weights = weight_readers(out, node.out, params)
        if step.kind in (K.ALL_REDUCE, K.REDUCE_SCATTER) and weights:
            overlaps = f"the weight gradients of {', '.join(weights)} (computed while it runs)"
            out[index] = replace(node, backward=(replace(step, overlaps=overlaps),))
    return out


def gathered_in_rings(items: list, params: set[str]) -> list:
    """`items` with each all-gather whose next item multiplies it marked to run in a ring
    beside that matmul (collective matmul): the next item is a linear reading the gathered
    value as its input, with a parameter as its weight, and keeps the gathered dim."""
    out = list(items)
    for index, node in enumerate(out[:-1]):
        reader = out[index + 1]
        if not (isinstance(node, Redistribute) and len(node.forward) == 1 and node.forward[0].kind == K.ALL_GATHER
                and isinstance(reader, Op) and reader.kind == "linear" and reader.args[0] == node.out
                and node.out not in reader.args[1:] and reader.args[1] in params
                and node.forward[0].dim in reader.type.dims
                and not (reader.arg_specs[0] and reader.arg_specs[0].grad_once)):
            continue
        overlaps = f"the matmul of {reader.args[1]}, chunk by chunk as a ring brings them (collective matmul)"
        out[index] = replace(node, forward=(replace(node.forward[0], overlaps=overlaps),))
    return out


def summed_in_rings(items: list, mesh: Mesh, params: set[str], types: dict, cuts) -> list:
    """`items` with the sum of the linear just before each redistribution marked to run beside
    that linear's matmul (collective matmul): a reduce-scatter in a ring, the linear making
    each chunk as the ring needs it (where it keeps the scattered dim), and its backward's
    gather in a ring, the linear's input gradient made a chunk at a time; an all-reduce in n
    chunks along the first dim of the linear's input it keeps that a rank can cut into n
    (`cuts(value, dim, n)`), each summed while the next is made. The linear has a parameter
    as its weight."""
    out = list(items)
    for index, node in enumerate(out[1:], start=1):
        maker = out[index - 1]
        if not (isinstance(node, Redistribute) and len(node.forward) == 1 and isinstance(maker, Op)
                and maker.kind == "linear" and maker.out == node.src and maker.args[1] in params
                and maker.args[0] not in params):
            continue
        (step,), x, weight = node.forward, maker.args[0], maker.args[1]
        kept = [d for d in types[x].dims if d in maker.type.dims]
        backward = node.backward
        if step.kind == K.REDUCE_SCATTER and step.dim in kept:
            step = replace(step, overlaps=f"the matmul of {weight}, chunk by chunk, each chunk summed on in a ring "
                                          "(collective matmul)")
            if len(backward) == 1 and backward[0].kind == K.ALL_GATHER:  # its gradient back in a ring
                backward = (replace(backward[0], overlaps=f"the input gradient of {weight}, chunk by chunk as a "
                                                          "ring brings them (collective matmul)"),)
        elif step.kind == K.ALL_REDUCE:
            n = mesh.size(*step.axes)
            dim = next((d for d in kept if cuts(x, d, n)), None)
            if dim is None:
                continue
            step = replace(step, dim=dim, overlaps=f"the matmul of {weight}, in {n} chunks along {dim}, each summed "
                                                   "while the next is made (collective matmul)")
        else:
            continue
        out[index] = replace(node, forward=(step,), backward=backward)
    return out


def weight_readers(items, value: str, params) -> tuple[str, ...]:
    """The weights (in `params`) of the linears among `items` that read `value` as their
    input, in order, each once; not a weight whose gradient is kept on one rank only."""
    return tuple(dict.fromkeys(
        op.args[1] for op in items if isinstance(op, Op) and op.kind == "linear" and op.args[0] == value
        and op.read(1) in params and not (op.arg_specs[1] and op.arg_specs[1].grad_once)))


def plan_steps(
    src: Sharding, dst: Sharding, grad_partial: tuple[MeshAxis, ...], *, mesh: Mesh
) -> tuple[list[Step], list[Step]]:
    """Forward and backward steps per axis, per the table above.

    A dim split over several axes (`seq:cp*tp`) changes only at its inner end: the
    axes both sides keep must be a common prefix. Forward runs all-reduces first,
    then gathers innermost axis first, then splits outermost first; the backward
    steps undo them in reverse.
    """
    _check_prefixes(src, dst, mesh)
    pairs: list[tuple[tuple[int, int], Step | None, Step | None]] = []
    for axis in MESH_ORDER:
        if mesh.size(axis) == 1:
            continue
        s_dim, d_dim = src.dim_of(axis), dst.dim_of(axis)
        s_partial, g = axis in src.partial, axis in grad_partial
        if axis in dst.partial:
            if not s_partial:
                raise PassError(f"cannot make a pending sum over {axis} from {src}")
            continue
        gather = (1, -src.axes_of(s_dim).index(axis)) if s_dim else (1, 0)
        split = (2, dst.axes_of(d_dim).index(axis)) if d_dim else (2, 0)
        if s_partial and d_dim:
            pairs.append((split, (K.REDUCE_SCATTER, axis, d_dim, None), (K.ALL_GATHER, axis, d_dim, None)))
        elif s_partial:
            pairs.append(((0, 0), (K.ALL_REDUCE, axis, None, None), (K.ALL_REDUCE, axis, None, None) if g else None))
        elif s_dim and d_dim and s_dim != d_dim:
            _check_all_to_all(src, dst, axis, s_dim, d_dim)
            pairs.append((gather, (K.ALL_TO_ALL, axis, d_dim, s_dim), (K.ALL_TO_ALL, axis, s_dim, d_dim)))
        elif s_dim and not d_dim:
            pairs.append((gather, (K.ALL_GATHER, axis, s_dim, None), (K.REDUCE_SCATTER if g else K.SLICE, axis, s_dim, None)))
        elif d_dim and not s_dim:
            pairs.append((split, (K.SLICE, axis, d_dim, None), (K.ALL_GATHER, axis, d_dim, None)))
        elif g and not s_dim:
            pairs.append(((0, 0), None, (K.ALL_REDUCE, axis, None, None)))
    pairs.sort(key=lambda pair: pair[0])
    forward = [f for _, f, _ in pairs if f is not None]
    backward = [b for _, _, b in reversed(pairs) if b is not None]
    return forward, backward


def _check_prefixes(src: Sharding, dst: Sharding, mesh: Mesh) -> None:
    for dim in {d for d, _ in src.split} | {d for d, _ in dst.split}:
        s_axes = tuple(a for a in src.axes_of(dim) if mesh.size(a) > 1)
        d_axes = tuple(a for a in dst.axes_of(dim) if mesh.size(a) > 1)
        kept = tuple(a for a in s_axes if a in d_axes)
        if s_axes[: len(kept)] != kept or d_axes[: len(kept)] != kept:
            raise NotSupportedError(
                f"redistributing {dim} from {'*'.join(s_axes)} to {'*'.join(d_axes)}: "
                "only the innermost axes of a dim can change ({src} -> {dst})".format(src=src, dst=dst)
            )


def _check_all_to_all(src: Sharding, dst: Sharding, axis: MeshAxis, s_dim: str, d_dim: str) -> None:
    if src.axes_of(s_dim)[-1] != axis or dst.axes_of(d_dim)[-1] != axis:
        raise NotSupportedError(
            f"moving {axis} from {s_dim} to {d_dim} when it is not the innermost axis of both ({src} -> {dst})"
        )


_FORWARD_WHY = {
    K.ALL_REDUCE: "sum the partial results over {axis}",
    K.REDUCE_SCATTER: "sum the partial results over {axis} and keep this rank's {dim} chunk",
    K.ALL_GATHER: "gather the {dim} chunks over {axis}",
    K.ALL_TO_ALL: "move the {axis} split from {dim2} to {dim}",
    K.SLICE: "keep this rank's {dim} chunk over {axis} (no communication)",
}
_BACKWARD_WHY = {
    K.ALL_REDUCE: "sum the partial input gradients over {axis}",
    K.REDUCE_SCATTER: "sum the partial input gradients over {axis} and keep this rank's {dim} chunk",
    K.ALL_GATHER: "gather the gradient's {dim} chunks over {axis}",
    K.ALL_TO_ALL: "move the gradient's {axis} split from {dim2} to {dim}",
    K.SLICE: "keep this rank's {dim} chunk of the gradient over {axis} (no communication)",
}


@dataclass(frozen=True, slots=True)
class InsertCommunication:
    name: ClassVar[str] = "insert-communication"
    purpose: ClassVar[str] = "redistributions where layouts differ, with their collectives and reasons"

    def run(self, graph: Graph, options: CompileOptions) -> Graph:
        env: dict[str, tuple[Sharding, str, TensorType]] = {
            i.name: (i.sharding, f"input {i.name}", i.type) for i in graph.inputs
        }
        body = _Inserter(graph, options).block(graph.body, env, count=1)
        return replace(graph, body=body)


class _Inserter:
    def __init__(self, graph: Graph, options: CompileOptions) -> None:
        self.graph, self.options, self.mesh = graph, options, options.mesh
        self.counter: dict[str, int] = {}

    def block(self, block: Block, env: dict, *, count: int) -> Block:
        for p in block.params:
            env[p.name] = (p.sharding, f"parameter {p.name}", TensorType(p.dims))
        cache: dict[tuple, str] = {}
        items: list = []
        for item in block.items:
            if isinstance(item, Repeat):
                items.extend(self.repeat(item, env, cache, count=count))
                continue
            args = list(item.args)
            for index, arg in item.reads_at:
                spec = item.arg_specs[index] if index < len(item.arg_specs) else None
                if spec is None:
                    continue
                is_param = env[arg][1].startswith("parameter ")
                need = ArgSpec(spec.sharding, () if is_param else spec.grad_partial)
                consumer = " ".join([item.kind, *map(str, item.annotations)])
                where = _Where(arg, env[arg][1], consumer, item.loc, count)
                args[index] = self.ensure(arg, need, env, cache, items, where)
            items.append(replace(item, args=tuple(args)))
            env[item.out] = (item.sharding, f"{item.kind} at {item.loc}", item.type)
        if self.options.overlap:
            params = {name for name, (_, producer, _) in env.items() if producer.startswith("parameter ")}
            types = {name: t for name, (_, _, t) in env.items()}
            items = summed_in_rings(gathered_in_rings(items, params), self.mesh, params, types,
                                    lambda value, dim, n: self.cuts(env[value][0], dim, n))
            if not (self.options.zero == 3 and self.mesh.size(MeshAxis.PP) == 1):
                items = behind_weight_grads(items, params)
        return replace(block, items=tuple(items))

    def cuts(self, sharding: Sharding, dim: str, n: int) -> bool:
        """Whether a rank's part of `dim` (split by `sharding`) cuts into n; not the batch under
        a pipeline, whose microbatches cut it at run time."""
        size = self.graph.local_size(dim, sharding, self.mesh)
        pipelined_batch = dim == self.graph.batch_dim and self.mesh.size(MeshAxis.PP) > 1
        return size >= n and size % n == 0 and not pipelined_batch

    def repeat(self, item: Repeat, env: dict, cache: dict, *, count: int) -> list:
        before: list = []
        carried = []
        for value, sharding in zip(item.carried, item.carried_shardings):
            where = _Where(value, env[value][1], f"repeat {item.name}", item.loc, count)
            carried.append(self.ensure(value, ArgSpec(sharding), env, cache, before, where))
        inner_env = dict(env)
        for arg, value in zip(item.body.args, carried):
            inner_env[arg] = (env[value][0], f"repeat {item.name} input", env[value][2])
        body = self.block(item.body, inner_env, count=count * item.count)
        ends: list = []
        yields = []
        body_cache: dict[tuple, str] = {}
        for value, sharding in zip(body.yields, item.carried_shardings):
            where = _Where(value, inner_env[value][1], f"the next layer of repeat {item.name}", item.loc, count * item.count)
            yields.append(self.ensure(value, ArgSpec(sharding), inner_env, body_cache, ends, where))
        body = replace(body, items=body.items + tuple(ends), yields=tuple(yields))
        for result, sharding, value in zip(item.results, item.carried_shardings, item.carried):
            env[result] = (sharding, f"repeat {item.name}", env[value][2])
        return before + [replace(item, carried=tuple(carried), body=body)]

    def ensure(self, value: str, need: ArgSpec, env: dict, cache: dict, out: list, where: _Where) -> str:
        have, producer, t = env[value]
        if have == need.sharding and not need.grad_partial:
            return value
        key = (value, need.sharding, need.grad_partial)
        if key in cache:
            return cache[key]
        forward, backward = plan_steps(have, need.sharding, need.grad_partial, mesh=self.mesh)
        if not forward and not backward:
            return value
        n = self.counter[value] = self.counter.get(value, 0) + 1
        name = f"{value}~{n}"
        node = Redistribute(
            out=name, src=value, type=t, src_sharding=have, sharding=need.sharding,
            grad_partial=need.grad_partial,
            forward=tuple(self.collective(s, Phase.FORWARD, have, need.sharding, t, where) for s in forward),
            backward=tuple(self.collective(s, Phase.BACKWARD, have, need.sharding, t, where) for s in backward),
            loc=where.loc,
        )
        out.append(node)
        env[name] = (need.sharding, producer, t)
        cache[key] = name
        return name

    def collective(self, step, phase: Phase, src: Sharding, dst: Sharding, t: TensorType, where: _Where) -> Collective:
        kind, axis, dim, dim2 = step
        # bytes: the larger side of the step, as held by this rank (gathered or pre-scatter)
        full = src if kind == K.ALL_TO_ALL else dst if kind == K.SLICE else src.without_axis(axis)
        nbytes = 0 if kind == K.SLICE else self.graph.local_numel(t.dims, full, self.mesh) * self.options.dtype_bytes
        template = (_FORWARD_WHY if phase == Phase.FORWARD else _BACKWARD_WHY)[kind]
        what = template.format(axis=axis, dim=dim, dim2=dim2)
        reason = f"{what}: {where.producer} gives [{src}], {where.consumer} needs [{dst}]"
        if phase == Phase.BACKWARD and kind in (K.ALL_REDUCE, K.REDUCE_SCATTER) and not src.partial:
            reason += f" and its work is split over {axis}, so each rank holds part of the gradient"
        return Collective(kind, (axis,), phase, where.tensor, nbytes, reason, dim=dim, count=where.count, loc=where.loc, dim2=dim2)
