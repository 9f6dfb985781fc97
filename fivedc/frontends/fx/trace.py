"""Tracing an `nn.Module` for the fx frontend: graphs, example values, repeated layers, locations.

`trace_graphs` traces with `torch.fx` and a tracer that keeps the layers of a
*uniform* `nn.ModuleList` (same class, same parameter shapes, same settings,
called one after the other on the previous layer's output) as leaf calls; the first
layer is then traced once, on its own, as the body of one `Repeat`, so the work does
not grow with depth. Conditions on shapes (`assert t <= block_size`) are decided on
the example inputs, as `torch.export` would; a condition on tensor *data* is an
error at the user's line. Where symbolic tracing cannot follow the Python
(`float(x.shape[-1])`, `len()` of a tensor) the model is exported with
`torch.export` instead (`fivedc/frontends/fx/export.py`: no repeats then). Every graph is run
once on the example inputs (an `fx.Interpreter`), keeping each node's value.
"""

from __future__ import annotations

import contextlib
import inspect
import io
import warnings
from dataclasses import dataclass

import torch
import torch.fx as fx
from torch import nn

from fivedc.errors import FivedcError, NotSupportedError
from fivedc.frontends.fx.locs import caller_loc, def_loc, error_loc, frames, node_loc, user_loc
from fivedc.frontends.fx.moe import moe_spec
from fivedc.frontends.fx.params import fetch_attr
from fivedc.frontends.fx.recognise import is_recognised_leaf
from fivedc.frontends.fx.warning import FxWarning
from fivedc.frontends.weightless import example_run

STAGE_MARK = "fivedc_stage_boundary"  # a module attribute: a pipeline chunk begins at this module
_SHAPE_QUERIES = {"size", "dim", "shape", "ndim", "dtype", "device", "numel", "is_floating_point"}

# ---- the traced result ------------------------------------------------------------------
@dataclass
class Traced:
    """One traced graph: targets are relative to `root`, which sits at `path` in the model."""

    gm: fx.GraphModule
    root: nn.Module
    path: str
    values: dict[fx.Node, object]  # every node's value on the example inputs


@dataclass
class RepeatSpec:
    path: str  # the ModuleList: `transformer.h`
    calls: tuple[fx.Node, ...]  # its layers' call nodes in the top graph, in order
    body: Traced  # layer 0, traced on its own


@dataclass
class Trace:
    top: Traced
    repeats: tuple[RepeatSpec, ...]
    inputs: dict[str, torch.Tensor]  # placeholder name -> example tensor
    exported: bool  # traced by torch.export (no repeats)


def trace_graphs(module: nn.Module, example_inputs: tuple | dict) -> Trace:
    tensors, concrete = _bind(module, example_inputs)
    try:
        return _trace_fx(module, tensors, concrete)
    except FivedcError:
        raise
    except Exception as error:  # symbolic tracing cannot follow the Python: try torch.export
        return _exported(module, tensors, concrete, error)


def export_trace(module: nn.Module, example_inputs: tuple | dict, error: Exception) -> Trace:
    """The model captured with torch.export (after `error` stopped the symbolic trace's lowering)."""
    tensors, concrete = _bind(module, example_inputs)
    return _exported(module, tensors, concrete, error)


def _trace_fx(module: nn.Module, tensors: dict, concrete: dict) -> Trace:
    inline: set[str] = set()
    while True:
        lists = _uniform_lists(module, inline)
        top = _symbolic(module, lists, tensors, concrete)
        bad = [p for p in lists if not _chain(top, p, lists[p])]
        if not bad:
            break
        inline.update(bad)
    captured: dict[str, tuple] = {}
    values = _run(top, tensors | concrete, {f"{p}.0" for p in lists}, captured)
    repeats = []
    for path, count in lists.items():
        layer = module.get_submodule(f"{path}.0")
        args, kwargs = captured[f"{path}.0"]
        feed, fixed = _bind_call(layer, args, kwargs)
        body_gm = _symbolic(layer, {}, feed, fixed)
        body = Traced(body_gm, layer, f"{path}.0", _run(body_gm, feed | fixed, set(), {}))
        calls = tuple(next(n for n in top.graph.nodes if n.op == "call_module" and n.target == f"{path}.{i}")
                      for i in range(count))
        repeats.append(RepeatSpec(path, calls, body))
    return Trace(Traced(top, module, "", values), tuple(repeats), tensors, exported=False)


def _bind(module: nn.Module, example_inputs: tuple | dict) -> tuple[dict, dict]:
    """Example inputs by parameter name: tensors (traced) and everything else (fixed)."""
    signature = inspect.signature(module.forward)
    try:
        if isinstance(example_inputs, dict):
            bound = signature.bind(**example_inputs)
        else:
            bound = signature.bind(*tuple(example_inputs))
    except TypeError as error:
        raise FivedcError(f"the example inputs do not fit {type(module).__name__}.forward: {error}",
                          loc=def_loc(type(module).forward)) from None
    bound.apply_defaults()
    arguments = _flat_arguments(signature, bound.arguments)
    tensors = {k: v for k, v in arguments.items() if isinstance(v, torch.Tensor)}
    if not tensors:
        raise FivedcError("the example inputs hold no tensor", loc=def_loc(type(module).forward))
    return tensors, {k: v for k, v in arguments.items() if k not in tensors}


def _flat_arguments(signature: inspect.Signature, arguments: dict) -> dict:
    """Bound arguments with `**kwargs` spread by name and an empty `*args` left out: a forward
    written `forward(self, x, **kwargs)` is called `forward(x)`, not `forward(x, kwargs={})`."""
    flat = {}
    for name, value in arguments.items():
        kind = signature.parameters[name].kind
        if kind is inspect.Parameter.VAR_KEYWORD:
            flat.update(value)
        elif kind is not inspect.Parameter.VAR_POSITIONAL or value:
            flat[name] = value
    return flat


def _bind_call(layer: nn.Module, args: tuple, kwargs: dict) -> tuple[dict, dict]:
    bound = inspect.signature(layer.forward).bind(*args, **kwargs)
    bound.apply_defaults()
    tensors = {k: v for k, v in bound.arguments.items() if isinstance(v, torch.Tensor)}
    return tensors, {k: v for k, v in bound.arguments.items() if k not in tensors}


def _symbolic(root: nn.Module, lists: dict[str, int], tensors: dict, concrete: dict) -> fx.GraphModule:
    tracer = _Tracer(root, set(lists), tensors | concrete)
    graph = tracer.trace(root, concrete_args=concrete or None)
    names = list(inspect.signature(root.forward).parameters)
    placeholders = [n for n in graph.nodes if n.op == "placeholder"]
    if len(placeholders) == len(names):  # fx renames fixed arguments (`scale_1`); feed them by name
        for node, name in zip(placeholders, names):
            node.target = name
    return fx.GraphModule(root, graph, type(root).__name__)


def _exported(module: nn.Module, tensors: dict, concrete: dict, error: Exception) -> Trace:
    from fivedc.frontends.fx.export import export_graph

    try:
        gm = _by_layers(module, tensors | concrete, export_graph) or export_graph(module, tensors | concrete)
    except NotSupportedError:
        raise  # export captured the model and the frontend refused a part of it, at its line
    except Exception as export_error:
        reason = _first_line(export_error)
        raise NotSupportedError(
            f"cannot trace {type(module).__name__}: "
            f"{error.message if isinstance(error, FivedcError) else f'{type(error).__name__}: {_first_line(error)}'}",
            loc=getattr(error, "loc", None) or error_loc(error),  # an op the lowering refused: its line
            hint=f"torch.export failed too ({reason[:160]}); write forward with tensor ops whose shapes and "
            "control flow do not depend on tensor values (x.size(-1) ** -0.5 rather than float(x.shape[-1]))",
        ) from None
    values = _run(gm, tensors, set(), {})
    return Trace(Traced(gm, module, "", values), (), tensors, exported=True)


def _by_layers(module: nn.Module, inputs: dict, export_graph) -> fx.GraphModule | None:
    """Two layers exported and the graph unrolled (fivedc/frontends/fx/layer_export.py), or None:
    the whole export decides then (and reports its own failure). Where the model has a list of
    layers and that way fails, an `FxWarning` says why the slower whole export is used."""
    from fivedc.frontends.fx.layer_export import WholeExport, export_by_layers

    try:
        found = export_by_layers(module, inputs, export_graph)
    except Exception as error:  # the whole export meets the same fault and reports it, located
        found = WholeExport(f"exporting two layers failed: {type(error).__name__}: {_first_line(error)[:160]}")
    if isinstance(found, WholeExport):
        warnings.warn(f"{type(module).__name__} is exported whole, not as two layers unrolled (its export takes "
                      f"longer with each layer): {found.reason}", FxWarning, stacklevel=2)
        return None
    return found


def _first_line(error: BaseException) -> str:
    text = str(error).strip()
    return text.splitlines()[0] if text else type(error).__name__


# ---- the tracer -------------------------------------------------------------------------
class _Tracer(fx.Tracer):
    def __init__(self, root: nn.Module, lists: set[str], inputs: dict) -> None:
        super().__init__()
        self.proxy_buffer_attributes = True  # buffers become get_attr nodes: masks sliced by a traced length
        self.lists, self.inputs = lists, inputs
        self.root_module = root
        self.memo: dict[fx.Node, object] = {}
        self.evaluating = 0  # inside `_evaluate`: modules and attributes are the real ones, not traced
        # decided before tracing: recognising a module runs it, which must not be traced
        self.recognised = {id(m) for m in root.modules() if is_recognised_leaf(m)}

    def create_node(self, *args, **kwargs) -> fx.Node:
        # torch's own record_stack_traces symbolizes with the profiler, which imports
        # torch._inductor on first use (seconds); walking the Python frames is enough
        node = super().create_node(*args, **kwargs)
        loc = caller_loc()
        if loc is not None and not node.meta.get("stack_trace"):
            node.meta["stack_trace"] = f'File "{loc.file}", line {loc.line}, in forward\n'
        return node

    def getattr(self, attr, attr_val, parameter_proxy_cache):
        if self.evaluating:  # a parameter or buffer read while computing a condition's value
            return attr_val
        return super().getattr(attr, attr_val, parameter_proxy_cache)

    def call_module(self, m, forward, args, kwargs):
        if self.evaluating:
            return forward(*args, **kwargs)
        return super().call_module(m, forward, args, kwargs)

    def is_leaf_module(self, m: nn.Module, qualname: str) -> bool:
        if qualname.rpartition(".")[0] in self.lists:
            return True
        return id(m) in self.recognised or super().is_leaf_module(m, qualname)

    def to_bool(self, obj: fx.Proxy) -> bool:
        """`if`/`assert` on a traced value: decided on the example shapes when it only reads
        shapes; an error naming the user's line when it reads tensor data."""
        if self._reads_data(obj.node, set()):
            loc = user_loc(frames())
            raise NotSupportedError(
                "data-dependent control flow: a Python `if`, `while` or `assert` on a tensor's values",
                loc=loc,
                hint="fivedc compiles one graph for every input; compute both branches with tensor ops "
                "(torch.where) or move the condition out of forward",
            )
        return bool(self._evaluate(obj.node))

    def _reads_data(self, node: fx.Node, seen: set) -> bool:
        if node in seen:
            return False
        seen.add(node)
        if node.op in ("placeholder", "get_attr", "call_module"):
            return True
        query = node.target if node.op == "call_method" else node.args[1] if node.target is getattr else None
        if query in _SHAPE_QUERIES:
            return False
        return any(self._reads_data(n, seen) for n in node.all_input_nodes)

    def _evaluate(self, node: fx.Node) -> object:
        """The example value of a traced node (computed on the real tensors, tracing nothing)."""
        self.evaluating += 1
        try:
            return self._value(node)
        finally:
            self.evaluating -= 1

    def _value(self, node: fx.Node) -> object:
        if node not in self.memo:
            args = fx.node.map_arg(node.args, self._value)
            kwargs = fx.node.map_arg(node.kwargs, self._value)
            if node.op == "placeholder":
                value = self.inputs[str(node.target).lstrip("*")]
            elif node.op == "get_attr":
                value = fetch_attr(self.root_module, node.target)
            elif node.op == "call_module":
                value = self.root_module.get_submodule(node.target)(*args, **kwargs)
            elif node.op == "call_method":
                value = getattr(args[0], node.target)(*args[1:], **kwargs)
            else:
                value = node.target(*args, **kwargs)
            self.memo[node] = value
        return self.memo[node]


# ---- uniform layer stacks -------------------------------------------------------------
def _uniform_lists(module: nn.Module, inline: set[str]) -> dict[str, int]:
    """ModuleLists (outermost only) whose layers can be one `Repeat`: path -> layer count."""
    found: dict[str, int] = {}
    leaves = [p for p, m in module.named_modules() if p and (is_recognised_leaf(m) or moe_spec(m) is not None)]
    for path, sub in module.named_modules():
        if not isinstance(sub, nn.ModuleList) or len(sub) < 2 or path in inline or not path:
            continue
        if any(layer is None for layer in sub):  # a ModuleList with empty places (x-transformers' norms)
            continue
        if any(path.startswith(p + ".") for p in (*found, *leaves)):
            continue
        if _uniform(list(sub)):
            found[path] = len(sub)
    return found


def _uniform(layers: list[nn.Module]) -> bool:
    first = _signature(layers[0])
    if any(_signature(layer) != first for layer in layers[1:]):
        return False
    seen: set[int] = set()
    for layer in layers:
        ids = {id(p) for p in layer.parameters()}
        if ids & seen:
            return False  # a parameter shared between layers is one parameter, not one per layer
        seen |= ids
    buffers = [dict(layer.named_buffers()) for layer in layers]
    return all(torch.equal(b[k], buffers[0][k]) for b in buffers[1:] for k in b)


def _signature(layer: nn.Module) -> tuple:
    modules = tuple(
        (name, type(sub), tuple(sorted((k, v) for k, v in vars(sub).items()
                                       if not k.startswith("_") and k != STAGE_MARK  # marks one layer, see marks.py
                                       and isinstance(v, (bool, int, float, str, type(None))))))
        for name, sub in layer.named_modules()
    )
    params = tuple((n, tuple(p.shape), p.dtype) for n, p in layer.named_parameters())
    buffers = tuple((n, tuple(b.shape), b.dtype) for n, b in layer.named_buffers())
    return modules, params, buffers


def _chain(gm: fx.GraphModule, path: str, count: int) -> bool:
    """Layer i+1 takes layer i's output (and nothing else does), the other arguments are the same."""
    calls = [n for n in gm.graph.nodes if n.op == "call_module" and n.target.rpartition(".")[0] == path]
    if [n.target for n in calls] != [f"{path}.{i}" for i in range(count)]:
        return False
    for prev, call in zip(calls, calls[1:]):
        if not call.args or call.args[0] is not prev or list(prev.users) != [call]:
            return False
        if call.args[1:] != calls[0].args[1:] or call.kwargs != calls[0].kwargs:
            return False
    return bool(calls[0].args)


# ---- example values -------------------------------------------------------------------
class _Values(fx.Interpreter):
    """Runs the graph, keeping every node's value (not torch's ShapeProp: its metadata of every
    tensor, which nothing here reads, cost more than the run itself on a library model)."""

    def __init__(self, gm: fx.GraphModule, capture: set[str], captured: dict) -> None:
        super().__init__(gm)
        self.values: dict[fx.Node, object] = {}
        self.capture, self.captured = capture, captured

    def run_node(self, n: fx.Node) -> object:
        result = super().run_node(n)
        self.values[n] = result
        return result

    def call_module(self, target, args, kwargs):
        if target in self.capture:
            self.captured[target] = (args, kwargs)
        return super().call_module(target, args, kwargs)


def _run(gm: fx.GraphModule, feed: dict, capture: set[str], captured: dict) -> dict[fx.Node, object]:
    interp = _Values(gm, capture, captured)
    args = [feed.get(str(n.target).lstrip("*"), n.args[0] if n.args else None)
            for n in gm.graph.nodes if n.op == "placeholder"]
    try:
        with torch.no_grad(), contextlib.redirect_stderr(io.StringIO()), example_run(gm):  # fivedc/frontends/weightless.py
            interp.run(*args)
    except Exception as error:
        cause = error.__cause__ or error
        node = next((n for n in gm.graph.nodes if n not in interp.values), None)
        raise FivedcError(
            f"running the model on the example inputs failed: {type(cause).__name__}: {_first_line(cause)}",
            loc=(node_loc(node) if node is not None else None) or error_loc(cause),
        ) from None
    return interp.values
