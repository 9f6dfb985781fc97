"""torch.export of a deep model in the time of a shallow one: two layers captured, the rest unrolled.

torch.export's cost grows with the ops it captures (about 0.25 s per Hugging Face decoder
layer on this project's 2-core machine), and a model's layers are nearly always one
layer repeated. So when the model holds a list of layers of one type and one set of
parameter shapes (`nn.ModuleList`/`nn.ModuleDict`, at least 3), `export_by_layers`
exports the model with its list cut to its first two layers, and copies the second
layer's part of the graph for each further layer, its parameters renamed (`layers.1.*`
to `layers.k.*`), the previous copy's values as its inputs.

That copy is the graph a full export gives only when every layer runs the same ops. That
is checked, not assumed: the model runs eagerly twice under a dispatch recorder, whole
and cut, and every ATen call is recorded with its arguments, where a tensor is named by
where it comes from (an input; a parameter or buffer, a layer's own relative to the
layer; an op's result, relative to its layer). The whole run must be the cut run with
its second layer repeated: the same calls before the layers, layer 0 as in the cut run,
every later layer as layer 1, the same calls after. A layer that differs in anything
(a per-layer scale, a sliding window on some layers, dense and MoE layers mixed, a
weight shared between layers, a model that collects every layer's output) fails the
check, and the model is exported whole, as before, with the reason (`WholeExport`, which
the tracer reports as an `FxWarning`). The two eager runs cost a fraction of the export
they save.

The record names each tensor by a typed origin, and a layer's calls are compared in
canonical forms relative to the layer (`fivedc/frontends/fx/layer_forms.py`).
"""

from __future__ import annotations

import contextlib
import copy
import functools
import warnings
from collections import OrderedDict
from dataclasses import dataclass

import torch
import torch.fx as fx
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten, tree_leaves

from fivedc.frontends.fx.layer_forms import (Constant, Input, LayerOutput, LayerResult, LayerState, Outside, Result,
                                              SegmentResult, State)
from fivedc.frontends.fx.locs import scope
from fivedc.frontends.fx.params import fetch_attr
from fivedc.frontends.weightless import example_run

_KEEP = 2  # layers exported: the first, and one that follows a layer (the template of the others)
_SMALL = 4096  # a constant tensor met by the recorder is named by its values up to this many elements


@dataclass(frozen=True, slots=True)
class WholeExport:
    """Why a model with a list of layers is exported whole, not as two layers unrolled."""

    reason: str


def export_by_layers(module: nn.Module, inputs: dict, export) -> fx.GraphModule | WholeExport | None:
    """`export(module, inputs)` (fivedc/frontends/fx/export.export_graph) with the model's list
    of layers cut to two and the graph unrolled to all of them; None when the model has no such
    list, a `WholeExport` saying why when its layers do not all run the same ops (the caller
    exports it whole)."""
    found = _layer_list(module)
    if found is None:
        return None
    path, count = found
    whole = _record(module, inputs, path)
    with _cut(module, path):
        cut = _record(module, inputs, path)
        differs = _difference(whole, cut, path, count)
        if differs is not None:
            return WholeExport(differs)
        gm = export(module, inputs)
    unrolled = _unroll(gm, module, path, count)
    if unrolled is None:
        return WholeExport(f"the graph of two layers of {path} does not show which value a layer hands the next")
    return unrolled


# ---- the list of layers -----------------------------------------------------------------
def _layer_list(module: nn.Module) -> tuple[str, int] | None:
    """(path, layers) of the longest list of at least 3 layers whose layers after the first are of
    one type and one set of parameter shapes (the first is exported as it is: DeepSeek-V3's dense
    first layer before its MoE layers)."""
    best = None
    for path, sub in module.named_modules():
        if not path or not isinstance(sub, (nn.ModuleList, nn.ModuleDict)) or len(sub) <= _KEEP:
            continue
        if best is not None and path.startswith(best[0] + "."):
            continue
        layers = list(sub._modules.values())[1:]
        if any(layer is None for layer in layers) or len({type(layer) for layer in layers}) != 1:
            continue
        shapes = {tuple((n, tuple(p.shape), p.dtype) for n, p in layer.named_parameters()) for layer in layers}
        if len(shapes) == 1 and (best is None or len(sub) > best[1]):
            best = (path, len(sub))
    return best


@contextlib.contextmanager
def _cut(module: nn.Module, path: str):
    """The list at `path` holds only its first `_KEEP` layers while the context is active."""
    holder = module.get_submodule(path)
    whole = holder._modules
    holder._modules = OrderedDict(list(whole.items())[:_KEEP])
    try:
        yield
    finally:
        holder._modules = whole


# ---- the eager record -------------------------------------------------------------------
class _Recorder(TorchDispatchMode):
    """Every ATen call of a run: (segment, func, arguments with tensors named by origin, results' shapes)."""

    def __init__(self, names: dict[int, object]) -> None:
        super().__init__()
        self.names = names  # id(tensor) -> its origin
        self.keep: list[torch.Tensor] = []  # every named tensor stays alive: its id stays its own
        self.layer: int | None = None
        self.calls: list[tuple] = []
        self.outputs: dict[int, list] = {}  # layer -> the origins of the tensors it returned

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        named = _map_tensors((args, kwargs), self._origin)
        index = len(self.calls)
        results = [t for t in tree_leaves(out) if isinstance(t, torch.Tensor)]
        for position, t in enumerate(results):
            self.names[id(t)] = Result(index, position)
            self.keep.append(t)
        self.calls.append((self.layer, func, named, tuple((tuple(t.shape), t.dtype) for t in results)))
        return out

    def _origin(self, t: torch.Tensor):
        if id(t) in self.names:
            return self.names[id(t)]
        if not t.is_meta and t.numel() <= _SMALL and t.device.type == "cpu":  # a constant made outside ATen
            return Constant(tuple(t.shape), t.dtype, tuple(t.flatten().tolist()))
        self.keep.append(t)
        return Outside(id(t))


def _map_tensors(tree, fn):
    leaves, spec = tree_flatten(tree)
    return spec, tuple(fn(x) if isinstance(x, torch.Tensor) else x for x in leaves)


def _record(module: nn.Module, inputs: dict, path: str) -> tuple[list[tuple], dict[int, list]]:
    """The run's calls (`_Recorder`), each tagged with the index of the layer of `path` it ran in,
    and the origins of what each layer returned."""
    names: dict[int, object] = {id(v): Input(k) for k, v in inputs.items() if isinstance(v, torch.Tensor)}
    names.update({id(p): State(n) for n, p in module.named_parameters()})
    names.update({id(b): State(n) for n, b in module.named_buffers()})
    recorder = _Recorder(names)
    holder = module.get_submodule(path)
    handles = []
    for index, layer in enumerate(holder._modules.values()):
        handles.append(layer.register_forward_pre_hook(functools.partial(_enter, recorder, index)))
        handles.append(layer.register_forward_hook(functools.partial(_leave, recorder)))
    try:
        with torch.random.fork_rng(devices=[]), torch.no_grad(), example_run(module), recorder:
            module(**inputs)
    finally:
        for handle in handles:
            handle.remove()
    return recorder.calls, recorder.outputs


def _enter(recorder: _Recorder, index: int, *_) -> None:
    recorder.layer = index


def _leave(recorder: _Recorder, layer: nn.Module, args, output) -> None:
    recorder.outputs[recorder.layer] = [recorder.names.get(id(t)) for t in tree_leaves(output)
                                        if isinstance(t, torch.Tensor)]
    recorder.layer = None


def _segments(record: tuple, path: str, count: int) -> list[list[tuple]] | None:
    """The calls canonicalised and split: before the layers, each layer, after (None when the
    layers did not run once each, in order). A tensor from another call is named by its
    segment and position there, a layer's relative to the consuming layer (after the layers:
    relative to the last), as the layer's m-th output where it is one; a layer's parameter by its
    name in the layer, the same way."""
    calls, outputs = record
    where: list[tuple] = []  # per call: (segment: "before" | layer | "after", position in it)
    sizes: dict = {}
    seen: list[int] = []
    for layer, *_ in calls:
        if layer is not None and (not seen or seen[-1] != layer):
            seen.append(layer)
        segment = layer if layer is not None else ("before" if not seen else "after")
        where.append((segment, sizes.get(segment, 0)))
        sizes[segment] = sizes.get(segment, 0) + 1
    if seen != list(range(count)):
        return None
    prefix = f"{path}."
    out: dict = {"before": [], "after": []} | {j: [] for j in range(count)}
    for (segment, _), (_, func, (spec, args), shapes) in zip(where, calls):
        anchor = segment if isinstance(segment, int) else (count - 1 if segment == "after" else 0)

        def canonical(arg):
            if isinstance(arg, Result):
                produced, position = where[arg.call]
                if not isinstance(produced, int):
                    return SegmentResult(produced, position, arg.position)
                if produced != segment and arg in outputs.get(produced, ()):
                    return LayerOutput(produced - anchor, outputs[produced].index(arg))
                return LayerResult(produced - anchor, position, arg.position)
            if isinstance(arg, State) and arg.name.startswith(prefix):
                index, _, rest = arg.name[len(prefix):].partition(".")
                if index.isdigit():
                    return LayerState(int(index) - anchor, rest)
            return arg

        out[segment].append((func, spec, tuple(canonical(a) for a in args), shapes))
    return [out["before"], *(out[j] for j in range(count)), out["after"]]


def _difference(whole: tuple, cut: tuple, path: str, count: int) -> str | None:
    """Where the whole run is not the cut run with its second layer repeated to `count` layers
    (None where it is)."""
    ours, theirs = _segments(whole, path, count), _segments(cut, path, _KEEP)
    if ours is None or theirs is None:
        return f"the layers of {path} do not each run once, in order"
    before, first, *later, after = ours
    for what, mine, model in (("the calls before the layers", before, theirs[0]),
                              (f"layer 0 of {path}", first, theirs[1]),
                              ("the calls after the layers", after, theirs[-1])):
        if mine != model:
            return f"{what} differ between the model and its first two layers ({_first_change(mine, model)})"
    for k, layer in enumerate(later, start=1):
        if layer != theirs[2]:
            return f"layer {k} of {path} runs other ops than layer 1 ({_first_change(layer, theirs[2])})"
    return None


def _first_change(mine: list[tuple], model: list[tuple]) -> str:
    """The first call where two segments part, as `aten.op at call i`."""
    for index, (a, b) in enumerate(zip(mine, model)):
        if a != b:
            return f"{_op_name(a[0])} where {_op_name(b[0])} ran, at call {index}" if a[0] != b[0] else \
                f"{_op_name(a[0])} at call {index} on other arguments"
    return f"{len(mine)} calls against {len(model)}"


def _op_name(func) -> str:
    return str(func)  # an OpOverload prints as aten.mul.Tensor


# ---- the graph unrolled -----------------------------------------------------------------
def _unroll(gm: fx.GraphModule, module: nn.Module, path: str, count: int) -> fx.GraphModule | None:
    """The cut model's graph with layer 1's nodes copied for layers 2 .. count-1 (None when the
    graph does not have the shape the records promise: the caller then exports the whole model)."""
    graph = gm.graph
    layer_nodes = {j: [n for n in graph.nodes if n.op not in ("placeholder", "get_attr") and _layer_of(n, path) == j]
                   for j in range(_KEEP)}
    first, second = layer_nodes[0], layer_nodes[1]
    if not first or not second:
        return None
    carried = _carried(first, second)  # a node of layer 0 layer 1 reads -> the node of layer 1 in its role
    if carried is None:
        return None
    in_second = set(second)
    own = f"{path}.1."
    params = {n.target: n for n in graph.nodes if n.op == "get_attr"}
    renamed: dict[str, fx.Node] = {}

    def param(node: fx.Node, k: int) -> fx.Node:
        target = f"{path}.{k}.{node.target[len(own):]}"
        if target not in renamed:
            with graph.inserting_before(first[0]), warnings.catch_warnings():
                warnings.simplefilter("ignore")  # layer k is not in the cut model's graph module: it is added below
                renamed[target] = params.get(target) or graph.get_attr(target)
        return renamed[target]

    previous, anchor, made = {n: n for n in second}, second[-1], set()
    for k in range(_KEEP, count):
        env: dict[fx.Node, fx.Node] = {}

        def source(arg: fx.Node) -> fx.Node:
            if arg in env:
                return env[arg]
            if arg in carried:  # what the layer reads of the layer before it
                return previous[carried[arg]]
            if arg.op == "get_attr" and str(arg.target).startswith(own):
                return param(arg, k)
            return arg  # computed before the layers: shared by all of them

        for node in second:
            with graph.inserting_after(anchor):
                anchor = env[node] = graph.node_copy(node, source)
            _relabel(anchor, path, k, source)
        previous = env
        made.update(env.values())
    last = previous
    for node in second:  # what follows the layers reads the last one
        for user in list(node.users):
            if user not in in_second and user not in made:
                user.replace_input_with(node, last[node])
    for node in graph.nodes:
        if node not in in_second and node not in made and "aten" in node.meta:
            node.meta["aten"] = fx.node.map_arg(node.meta["aten"], lambda a: last.get(a, a))
    attrs = {n.target: fetch_attr(module if n.target in renamed else gm, n.target)  # layers 2.. are the model's
             for n in graph.nodes if n.op == "get_attr"}
    unrolled = fx.GraphModule(attrs, graph, type(gm).__name__)
    graph.lint()
    return unrolled


def _carried(first: list[fx.Node], second: list[fx.Node]) -> dict[fx.Node, fx.Node] | None:
    """What layer 1 reads of layer 0, each with the node of layer 1 that the next layer reads
    in its place: a layer's one output (the hidden state), or, for layers of the same ops, the
    node at the same position; None when neither tells."""
    in_first, in_second = set(first), set(second)
    read = list(dict.fromkeys(a for n in second for a in n.all_input_nodes if a in in_first))
    given = [n for n in second if any(u not in in_second for u in n.users)]
    if len(read) == 1 and len(given) == 1:
        return {read[0]: given[0]}
    if len(first) == len(second) and all((a.op, a.target) == (b.op, b.target) for a, b in zip(first, second)):
        at = {n: i for i, n in enumerate(first)}
        return {a: second[at[a]] for a in read}
    return None


def _layer_of(node: fx.Node, path: str) -> int | None:
    for p in scope(node):
        if p.startswith(f"{path}."):
            index = p[len(path) + 1:].partition(".")[0]
            if index.isdigit():
                return int(index)
    return None


def _relabel(node: fx.Node, path: str, k: int, source) -> None:
    """A copy's own metadata: its module paths those of layer k, its ATen call on its own inputs."""
    node.meta = copy.copy(node.meta)
    old = f"{path}.1"
    stack = node.meta.get("nn_module_stack") or {}
    node.meta["nn_module_stack"] = {
        key: ((f"{path}.{k}" + value[0][len(old):],) + tuple(value[1:])
              if isinstance(value, tuple) and value and isinstance(value[0], str)
              and (value[0] == old or value[0].startswith(old + ".")) else value)
        for key, value in stack.items()}
    if "aten" in node.meta:
        node.meta["aten"] = fx.node.map_arg(node.meta["aten"], source)
