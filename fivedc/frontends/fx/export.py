"""The torch.export fallback of the fx frontend: an exported aten graph in torch-level ops.

When `torch.fx` cannot follow a model's Python (`float()` of a shape,
`len()` of a tensor), `torch.export` usually can: it runs the Python with the
example shapes fixed. Its graph speaks ATen (`aten.linear`, `aten.view`) and takes
parameters as inputs; `export_graph` rewrites it into the vocabulary the rest of the
frontend reads (`F.linear`, `torch.reshape`, parameters as `get_attr` of their
state-dict key), keeping each node's user stack trace. ATen ops not in the table
stay as they are: fine where they only compute constants (masks, positions),
reported by name where they touch the model's data. Modules are inlined by export,
so repeated layers are not one `Repeat` on this path.
"""

from __future__ import annotations

import contextlib
import io
import logging
import operator

import torch
import torch.fx as fx
import torch.nn.functional as F
from torch import nn

from fivedc.frontends.fx.aten_rewrites import (baddbmm_written_out, call_like, complex_products_as_real,
                                               computed_norm_weights_apart, constant_expand_as, constant_index_as_slice,
                                               numpy_T_as_permute, stack_as_cat, unbind_as_selects)
from fivedc.frontends.fx.fill_writes import fill_writes
from fivedc.frontends.fx.flex import drop_dead, flex_attention_as_sdpa, flex_attention_on_cpu
from fivedc.frontends.fx.params import fetch_attr
from fivedc.ir.ops import POINTWISE
from fivedc.ir.pointwise import resolve

aten = torch.ops.aten
_REDUCTIONS = {0: "none", 1: "mean", 2: "sum"}

# aten op -> torch-level callable taking the same positional arguments
_SAME = {  # a pointwise op's ATen operators (fivedc/ir/pointwise.py) -> the function its kernel calls
    **{getattr(aten, name): resolve(pointwise.torch)
       for pointwise in POINTWISE.values() for name in pointwise.aten},
    aten.linear: F.linear, aten.neg: torch.neg, aten.rsqrt: torch.rsqrt, aten.sqrt: torch.sqrt, aten.pow: torch.pow,
    aten.mean: torch.mean,
    aten.view: torch.reshape, aten.reshape: torch.reshape, aten._unsafe_view: torch.reshape,
    aten.transpose: torch.transpose, aten.permute: torch.permute, aten.movedim: torch.movedim, aten.unsqueeze: torch.unsqueeze,
    aten.squeeze: torch.squeeze, aten.split: torch.split, aten.split_with_sizes: torch.split, aten.chunk: torch.chunk,
    aten.scaled_dot_product_attention: F.scaled_dot_product_attention, aten.matmul: torch.matmul,
    aten.bmm: torch.matmul, aten.addmm: torch.addmm, aten.masked_fill: torch.masked_fill, aten.eq: operator.eq,
    aten.repeat_interleave: torch.repeat_interleave, aten.dropout: F.dropout, aten.arange: torch.arange,
    aten.cat: torch.cat, aten.rms_norm: F.rms_norm, aten.flatten: torch.flatten, aten.unflatten: torch.unflatten,
}
_METHODS = {aten.clone: "clone", aten.contiguous: "contiguous", aten.alias: "clone", aten.lift_fresh_copy: "clone",
            aten.expand: "expand", aten.t: "t", aten.type_as: "type_as"}


_CHECKS = {aten._assert_tensor_metadata}


def export_graph(module: nn.Module, inputs: dict) -> fx.GraphModule:
    """Export `module` on keyword `inputs` and rewrite the graph into torch-level ops."""
    from torch.export.graph_signature import InputKind, OutputKind

    with _quiet(), flex_attention_on_cpu(eager=False):
        ep = torch.export.export(module, (), kwargs=inputs, strict=False)
    sig = ep.graph_signature
    flexed = flex_attention_as_sdpa(ep.graph_module)  # torchtitan's attention: SDPA with its mask, dense
    _inline_wrappers(ep.graph_module, trainable={s.arg.name for s in sig.input_specs
                                                 if s.kind in (InputKind.PARAMETER, InputKind.USER_INPUT)})
    fill_writes(ep.graph)  # a fresh tensor written slice by slice (DeepSeek-V3's expand_kv): cat, slice_scatter
    _functional(ep.graph)
    if flexed:
        drop_dead(ep.graph)
    complex_products_as_real(ep.graph)  # torchtitan's rotary: x viewed as complex times a complex table
    stack_as_cat(ep.graph)
    unbind_as_selects(ep.graph)
    numpy_T_as_permute(ep.graph)
    constant_index_as_slice(ep.graph, {s.arg.name: ep.constants[s.target] for s in sig.input_specs
                                       if s.kind == InputKind.CONSTANT_TENSOR})
    baddbmm_written_out(ep.graph)
    computed_norm_weights_apart(ep.graph, {s.arg.name for s in sig.input_specs if s.kind == InputKind.PARAMETER})
    constant_expand_as(ep.graph, {s.arg.name for s in sig.input_specs
                                  if s.kind in (InputKind.PARAMETER, InputKind.USER_INPUT)})
    canonical = {id(p): name for name, p in module.named_parameters()}  # a tied weight by its first name
    state = {s.arg.name: canonical.get(id(fetch_attr(module, s.target)), s.target) for s in sig.input_specs
             if s.kind in (InputKind.PARAMETER, InputKind.BUFFER)}
    constants = {s.arg.name: s.target for s in sig.input_specs if s.kind == InputKind.CONSTANT_TENSOR}
    user = [s.arg.name for s in sig.input_specs if s.kind == InputKind.USER_INPUT]
    names = dict(zip(user, [k for k, v in inputs.items() if isinstance(v, torch.Tensor)]))
    attrs: dict[str, object] = {key: fetch_attr(module, key) for key in state.values()}
    attrs.update({key: ep.constants[key] for key in constants.values()})
    graph, env = fx.Graph(), {}
    for node in ep.graph.nodes:
        if node.op == "placeholder":
            key = state.get(node.name) or constants.get(node.name)
            env[node] = graph.get_attr(key) if key else graph.placeholder(names.get(node.name, node.name))
        elif node.op == "output":
            outs = [a for a, s in zip(node.args[0], sig.output_specs) if s.kind == OutputKind.USER_OUTPUT]
            graph.output(env[outs[0]] if len(outs) == 1 else tuple(env[o] for o in outs))
        elif getattr(node.target, "overloadpacket", None) in _CHECKS:
            continue  # export's own checks of a value's dtype and device: nothing to compute
        else:
            args, kwargs = fx.node.map_arg((node.args, node.kwargs), lambda n: env[n])
            env[node] = _convert(graph, node, (args, kwargs))
            env[node].meta["aten"] = (node.target, args, kwargs)  # the call itself, where no rule fits
            env[node].meta["stack_trace"] = node.meta.get("stack_trace", "")
            env[node].meta["nn_module_stack"] = node.meta.get("nn_module_stack") or {}  # for stage marks
    return fx.GraphModule(attrs, graph, type(module).__name__)


# higher-order ops that only wrap a region (grad mode, autocast): (index of the submodule arg)
_WRAPPERS = {"wrap_with_set_grad_enabled": 1, "wrap_with_autocast": 4}


def _inline_wrappers(gm: fx.GraphModule, *, trainable: set[str]) -> None:
    """Replace each region wrapper (`torch.no_grad()` or autocast around some ops, which
    export keeps as a higher-order op over a submodule) by the ops of its region. A
    no-grad region's floating-point results computed from trainable values (a router's
    threshold from its scores, a scale from a weight) are read through `detach`: what
    the user computed without gradients passes none back, as in the module; tables
    from buffers and shapes (rotary embeddings) need none."""
    graph = gm.graph
    carries = set()  # nodes whose value depends on a parameter or a floating-point input
    for node in list(graph.nodes):
        if node.op == "placeholder":
            if node.name in trainable and _is_float(node):  # parameters and floating-point inputs
                carries.add(node)
            continue
        inputs = [a for a in node.all_input_nodes]
        wrapper = _WRAPPERS.get(getattr(node.target, "__name__", ""))
        if wrapper is None:
            if any(a in carries for a in inputs):
                carries.add(node)
            continue
        region = getattr(gm, node.args[wrapper].target)
        bound = [isinstance(a, fx.Node) and a in carries for a in node.args[wrapper + 1:]]
        placeholders = [n for n in region.graph.nodes if n.op == "placeholder"]
        _inline_wrappers(region, trainable={p.name for p, b in zip(placeholders, bound) if b})
        outputs = _splice(graph, node, region, node.args[wrapper + 1:])
        if node.target.__name__ == "wrap_with_set_grad_enabled" and not node.args[0] and _flows(region, bound):
            outputs = [_detached(graph, node, o) for o in outputs]
        for user in list(node.users):  # the wrapper returns a tuple, read with getitem
            user.replace_all_uses_with(outputs[user.args[1]])
            graph.erase_node(user)
            if any(a in carries for a in inputs):
                carries.add(outputs[user.args[1]])
        graph.erase_node(node)
    graph.eliminate_dead_code()
    gm.recompile()


def _detached(graph: fx.Graph, at: fx.Node, value):
    """`value.detach()` before `at`, where it is a floating-point tensor node; else itself."""
    if not isinstance(value, fx.Node) or not _is_float(value):
        return value
    with graph.inserting_before(at):
        return call_like(graph, at, torch.ops.aten.detach.default, (value,), value.meta["val"])


def _functional(graph: fx.Graph) -> None:
    """Rewrite an in-place op on a tensor of its own (`w /= w.sum(-1, keepdim=True)`,
    `x.index_put_(...)`) as its pure form, later reads of the tensor reading the result.
    Only where nothing else can see the write: the tensor is computed here (not an input,
    parameter or buffer), is no view of another (or the only view of one that nothing else
    reads), and has no view taken before the write.
    Other writes stay, and are reported where they touch the model's data."""
    for node in list(graph.nodes):
        pure = _pure_form(node)
        if pure is None or not node.args or not isinstance(node.args[0], fx.Node):
            continue
        target = node.args[0]
        before = set()
        for earlier in graph.nodes:
            if earlier is node:
                break
            before.add(earlier)
        if target.op == "placeholder" or (_aliases(target) and not _only_view_of_its_base(target)) or any(
                _aliases(u) for u in target.users if u in before):
            continue
        with graph.inserting_after(node):
            new = graph.call_function(pure, node.args, node.kwargs)
        new.meta = dict(node.meta)
        for user in list(target.users):
            if user is not node and user is not new and user not in before:
                user.replace_input_with(target, new)
        node.replace_all_uses_with(new)
        graph.erase_node(node)


def _pure_form(node: fx.Node):
    """`aten.div.Tensor` for a node of `aten.div_.Tensor` (writing only its first argument)."""
    overload = node.target
    if node.op != "call_function" or not isinstance(overload, torch._ops.OpOverload):
        return None
    schema = overload._schema
    name = overload.overloadpacket.__name__
    writes = [a.alias_info is not None and a.alias_info.is_write for a in schema.arguments]
    if not schema.is_mutable or not name.endswith("_") or name.startswith("_") or writes[:1] != [True] \
            or any(writes[1:]):
        return None
    packet = getattr(aten, name[:-1], None)
    return getattr(packet, overload._overloadname, None) if packet is not None else None


def _only_view_of_its_base(node: fx.Node) -> bool:
    """Whether `node` is a chain of views of a tensor computed here (not an input, parameter or
    buffer) that nothing else reads: each link, and the base, used only by the next link (Gemma 2's
    `q.mul_(scaling)` on its query transposed into heads). A write to it is then seen only through it."""
    while _aliases(node):
        parent = node.args[0]
        if not isinstance(parent, fx.Node) or len(parent.users) != 1:
            return False
        node = parent
    return node.op != "placeholder"


def _aliases(node: fx.Node) -> bool:
    """Whether a node's result may share memory with an argument (a view, an alias)."""
    overload = node.target
    if node.op != "call_function" or not isinstance(overload, torch._ops.OpOverload):
        return False
    return any(r.alias_info is not None for r in overload._schema.returns)


def _flows(region: fx.GraphModule, bound: list[bool]) -> bool:
    """Whether a value of the region's inputs marked in `bound` reaches its outputs (an
    input read only for its dtype or device does not)."""
    marked = set()
    flags = iter(bound)
    for inner in region.graph.nodes:
        if inner.op == "placeholder":
            if next(flags, False):
                marked.add(inner)
        elif inner.op == "output":
            return any(a in marked for a in inner.all_input_nodes)
        elif "_assert_tensor_metadata" not in str(inner.target) and any(a in marked for a in inner.all_input_nodes):
            marked.add(inner)
    return False


def _is_float(node: fx.Node) -> bool:
    value = node.meta.get("val")
    return isinstance(value, torch.Tensor) and value.is_floating_point()


def _splice(graph: fx.Graph, at: fx.Node, region: fx.GraphModule, args: tuple) -> list:
    """Copy `region`'s ops before `at`, its placeholders bound to `args`; its outputs."""
    env = {}
    placeholders = iter(args)
    with graph.inserting_before(at):
        for inner in region.graph.nodes:
            if inner.op == "placeholder":
                env[inner] = next(placeholders)
            elif inner.op == "output":
                outputs = inner.args[0]
                return [env[o] if isinstance(o, fx.Node) else o for o in outputs]
            else:
                env[inner] = graph.node_copy(inner, lambda n: env[n])
    raise ValueError("a region without an output")


@contextlib.contextmanager
def _quiet():
    """torch.export logs warnings and graph dumps when it fails; the caller reports the failure."""
    logger = logging.getLogger("torch")
    level = logger.level
    logger.setLevel(logging.ERROR)
    try:
        with contextlib.redirect_stderr(io.StringIO()):
            yield
    finally:
        logger.setLevel(level)


def _schema_args(node: fx.Node, args: tuple, kwargs: dict) -> dict:
    """An ATen call's arguments by their names in the op's schema."""
    names = [a.name for a in node.target._schema.arguments]
    return dict(zip(names, args)) | kwargs


def _convert(graph: fx.Graph, node: fx.Node, converted: tuple) -> fx.Node:
    args, kwargs = converted
    packet = getattr(node.target, "overloadpacket", None)
    if packet in _SAME:
        return graph.call_function(_SAME[packet], args, kwargs)
    if packet in _METHODS:
        return graph.call_method(_METHODS[packet], args, {})
    if packet is aten.embedding:
        padding = args[2] if len(args) > 2 and args[2] != -1 else None
        return graph.call_function(F.embedding, (args[1], args[0]), {"padding_idx": padding})
    if packet is aten.layer_norm:
        return graph.call_function(F.layer_norm, args[:5], {})
    if packet in (aten.softmax, aten._softmax):
        return graph.call_function(F.softmax, (args[0], args[1]), {})
    if packet in (aten._to_copy, aten.to):
        dtype = _schema_args(node, args, kwargs).get("dtype")  # to.dtype, to.device, to.dtype_layout alike
        return graph.call_method("to", (args[0],), {"dtype": dtype})
    if packet is aten.cross_entropy_loss:
        names = ("weight", "reduction", "ignore_index", "label_smoothing")
        options = dict(zip(names, args[2:])) | kwargs
        options["reduction"] = _REDUCTIONS[options.get("reduction", 1)]
        return graph.call_function(F.cross_entropy, args[:2], options)
    if packet is aten.slice:
        dim, start, end, step = (list(args[1:]) + [0, None, None, 1][len(args) - 1:])[:4]
        index = (slice(None),) * dim + (slice(start, end, step),)
        return graph.call_function(operator.getitem, (args[0], index), {})
    return graph.call_function(node.target, args, kwargs)
