"""The torch.fx frontend: an ordinary `nn.Module` to fivedc's IR, with a parameter map.

`trace_module(module, example_inputs)` traces the module (`fivedc/frontends/fx/trace.py`:
torch.fx, the layers of a uniform `nn.ModuleList` kept as one `Repeat` traced once,
shape-only `if`/`assert` decided on the example shapes, torch.export as a fallback
in `fx/export.py`, user locations from `fx/locs.py`), rewrites known patterns
(`fx/patterns.py`; single-node recognition in `fx/recognise.py`), lowers every node
(`fx/lower.py`; handlers in `fx/ops.py` and `fx/layers.py`), names dims,
parameters and values (`fx/build.py`, dims via `fx/dims.py`) and checks the result
with the compiler's own shape inference. `TracedModel` holds the `Graph` (compile
it with `fivedc.pipeline.compile_graph`) and the two-way map between the module's
`state_dict` and the IR's qualified parameters (`fx/params.py`). Every IR node
carries the user's file and line (from the fx node's stack trace).

Recognised:
- modules: `nn.Linear` (weight [out, in] -> IR [in..., out...], bias as an add),
  `nn.Embedding` (plain lookup), `nn.LayerNorm` (1-D, with weight), `nn.RMSNorm` and
  modules named like RMSNorm, rotary modules named like Rotary/RoPE (both checked on
  a probe, see `fx/recognise.py`), MoE blocks (below), `nn.GELU` (none or tanh), `nn.SiLU`, `nn.ReLU`,
  `nn.Tanh`, `nn.Sigmoid`, `nn.Dropout` and `nn.Identity` (no-ops), `nn.CrossEntropyLoss`;
- functions and methods: `F.linear`, `x @ W` with a parameter W [in, out],
  `F.embedding`, `F.layer_norm`, `F.rms_norm`, the activations above, `+ - * /` and
  `neg` with tensors (broadcast) or numbers, `F.scaled_dot_product_attention`
  (is_causal or not, no mask, default scale, GQA by `repeat_interleave` of k/v
  heads or `enable_gqa`), `F.cross_entropy` (mean or sum, ignore_index, label smoothing, constant class
  weights; reduction='none' under one whole `.sum()`/`.mean()`: `fx/losses.py`), views and reshapes, transposes
  and permutes, size-1 `unsqueeze`/`squeeze`, full slices, casts and copies (no-ops:
  the plan's dtype decides the precision);
- patterns: a linear followed by `view(b, s, heads, head_dim)` (one linear with a
  [hidden, heads, head_dim] weight), a fused projection followed by `split`/`chunk`
  (one linear per part, `c_attn_q/_k/_v`), `wpe(arange(seq))` (the table as a
  [seq, hidden] parameter), `x * rsqrt(mean(x^2) + eps) * w`, softmax(q k^T / sqrt(d))
  v with a causal mask checked on its value, `silu(a) * b` (SwiGLU); and as Hugging
  Face decoders write them (through torch.export): `x * cos + rotate_half(x) * sin`
  with constant tables (rope, theta read off the tables, checked by value),
  `repeat_kv` by `expand` + `reshape`, and SDPA with a constant causal `attn_mask`.
- MoE blocks, lowered to one IR `moe` op (`fx/moe.py` reads a block by its behaviour,
  `fx/moe_leaves.py` keeps it whole while tracing: its token loop is never traced): a
  module marked `fivedc_moe = True`, named with `MoE`/`Moe`, or with a child `experts`,
  holding a router weight [experts, hidden] (an `nn.Linear` or a router module of its
  own) and SwiGLU experts (gate, up, down; gate and up may be fused in one, as Hugging
  Face's `gate_up_proj`), stacked over the experts or an `nn.ModuleList` of expert
  modules (stacked into one IR parameter, each expert a slice), plus children added to
  its output (shared experts) and a scale of the routed part (DeepSeek's); it takes one
  tensor [..., hidden] and returns the same shape, or `(out, router_logits)` of which only
  `out` may be used. Which weight is which, `top_k`, softmax or sigmoid scores,
  renormalised gates or not and the scale are read off a random probe; a block that
  matches no reading (group-limited routing, a balancing bias that is not zero) is
  traced through as generic ops, and so is every block of a model that computes
  otherwise with them kept whole (hooks that collect a block's inner outputs).
  `fivedc_aux_loss = a` on the block gives the op `aux_loss=a`. See `examples/mixtral.py`
  (`factory`, and `hf_factory` for the older Hugging Face layout).
- dims of size 1 (one head, a batch of one) stay dims of the IR: a view that merges
  one keeps it with its neighbour (a head with head_dim, the sequence with the batch);
  a parameter's size-1 dims ([1, seq, hidden]) are broadcast dims and left out.
Stage marks: a module with `fivedc_stage_boundary = True`, or matching a pattern of
`trace_module(..., stage_boundaries=("layers.4", "ln_f"))`, begins a pipeline chunk:
`Repeat.stage_layers` for a layer of a repeated stack, `@stage` on the first top-level
op traced from any other module (`fx/marks.py`; a mark inside a layer body is an error).
Not recognised, a `NotSupportedError` at the user's line with a hint: softmax,
matmul of activations, pow/mean/rsqrt outside those patterns, masks other than
causal, real slicing and indexing (`logits[:, :-1]`), `cat`/`stack`, interleaved
(complex) rotary embeddings, an `expand` that does not repeat k/v exactly,
tied or shared weights, `padding_idx`, data-dependent control flow, trained class
weights, per-token losses used other than by one whole sum or mean, a squeeze of a model dim of size 1, the router
logits of an MoE block used (the hint: `fivedc_aux_loss`), any other op or module. Approximations are an
`FxWarning` at the user's line: active dropout dropped, extra outputs beside the loss
dropped (`ignore_index` is represented: the loss's mean is over the targets it keeps).
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch
from torch import Tensor, nn
from torch.utils._pytree import tree_leaves

from fivedc.errors import NotSupportedError, PassError, ShapeError
from fivedc.frontends.fx.build import finish
from fivedc.frontends.fx.locs import def_loc, node_loc
from fivedc.frontends.fx.lower import FxWarning, Lowering
from fivedc.frontends.fx.marks import mark_layers, mark_stages, sink_input_only
from fivedc.frontends.fx.moe_leaves import blocks, moe_leaves
from fivedc.frontends.fx.flex import flex_attention_on_cpu
from fivedc.frontends.fx.precision import float64_everywhere, is_float64
from fivedc.frontends.fx.params import ParamMapping, from_ir_params, to_ir_params
from fivedc.frontends.fx.patterns import rewrite
from fivedc.frontends.fx.trace import export_trace, trace_graphs
from fivedc.frontends.fx.values import Unrecognised
from fivedc.ir.graph import Graph, Op, Repeat, TensorType, walk_ops
from fivedc.frontends.weightless import in_float64, meta_buffers
from fivedc.ir.mesh import Mesh
from fivedc.passes.base import CompileOptions
from fivedc.passes.shapes import InferShapes
from fivedc.passes.verify import VerifyIR

__all__ = ["TracedModel", "trace_module", "FxWarning", "ParamMapping"]


@dataclass(frozen=True, slots=True)
class TracedModel:
    graph: Graph
    params: tuple[ParamMapping, ...]  # one per IR parameter instance, in graph order
    warnings: tuple[str, ...] = ()  # what was dropped or approximated, with the user's line
    exported: bool = False  # traced with torch.export (repeated layers inlined)

    def to_ir_params(self, state_dict: dict[str, Tensor]) -> dict[str, Tensor]:
        """The IR's parameters (`layers.0.c_attn_q`, ...) from the module's state_dict."""
        return to_ir_params(self.params, state_dict)

    def from_ir_params(self, ir_params: dict[str, Tensor]) -> dict[str, Tensor]:
        """The inverse: state_dict entries (parameters only; buffers stay with the module)."""
        return from_ir_params(self.params, ir_params)

    def state_values(self, module: nn.Module) -> dict[str, Tensor]:
        """The graph's states (`fivedc/ir/states.py`: buffers the forward reads or adds to) as the
        module holds them now, copies by key: what a program starts from (`runtime/states.set_states`)."""
        from fivedc.ir.states import state_sizes

        out = {}
        for key in state_sizes(self.graph):
            try:
                out[key] = module.get_buffer(key).detach().clone()
            except AttributeError:
                raise NotSupportedError(f"the plan's state {key} is not a buffer of {type(module).__name__}",
                                        hint="give the module that was traced") from None
        return out

    def match(self, pattern: str) -> tuple[ParamMapping, ...]:
        """The IR parameters of the modules matching a path pattern (`transformer.h.*.attn.c_attn`)."""
        return tuple(m for m in self.params if m.matches(pattern))

    def summary(self) -> str:
        return _summary(self)


def trace_module(module: nn.Module, example_inputs: tuple | dict, *, name: str | None = None,
                 stage_boundaries: tuple[str, ...] | list[str] = ()) -> TracedModel:
    """Trace `module` on `example_inputs` (positional tuple, or keyword dict) into fivedc's IR.

    stage_boundaries: module-path patterns (`"layers.4"`, `"ln_f"`, `*` for one path element) at
    which a pipeline chunk begins, besides the modules marked `fivedc_stage_boundary = True`
    (`fivedc/frontends/fx/marks.py`)."""
    _no_meta_buffers(module)
    with in_float64(module), _kept_buffers(module):  # a model without weights, in bf16: captured as float64
        return _trace(module, example_inputs, name, stage_boundaries)  # (fivedc/frontends/weightless.py)


@contextlib.contextmanager
def _kept_buffers(module: nn.Module):
    """The module's buffers as they were, after the runs a trace makes (a forward that adds to a
    buffer, as an MoE block counting its tokens, must not count the example's)."""
    before = [(b, b.detach().clone()) for b in module.buffers() if not b.is_meta]
    try:
        yield
    finally:
        with torch.no_grad():
            for b, value in before:
                if b.shape == value.shape and b.dtype == value.dtype:
                    b.copy_(value)


def _trace(module: nn.Module, example_inputs: tuple | dict, name: str | None, stage_boundaries) -> TracedModel:
    blocks(module)  # MoE blocks are probed at the module's own precision (fivedc/frontends/fx/moe.py)
    # the model's own runs: float64 (fivedc/frontends/fx/precision.py), flex attention eager (fx/flex.py)
    with float64_everywhere(is_float64(module)), flex_attention_on_cpu(eager=True):
        with moe_leaves(module, on=_leaves_keep_outputs(module, example_inputs)):  # fivedc/frontends/fx/moe_leaves.py
            trace = trace_graphs(module, example_inputs)
            try:
                lowering, draft = _lower(trace, module, name, stage_boundaries)
            except Unrecognised as error:
                if trace.exported:
                    raise
                # an op without a rule: torch.export gives it as an ATen call, which can run replicated
                trace = export_trace(module, example_inputs, error)
                lowering, draft = _lower(trace, module, name, stage_boundaries)
    graph, mappings, expected = finish(draft, share_dims=True)
    if not _consistent(graph, expected):
        graph, mappings, expected = finish(draft, share_dims=False)
        _consistent(graph, expected, strict=True)
    return TracedModel(graph, mappings, tuple(lowering.warned), trace.exported)


def _no_meta_buffers(module: nn.Module) -> None:
    """A model without weights is planned from its buffers' values (rotary tables, masks): its
    parameters may be on the meta device, its buffers not (`fivedc/frontends/weightless.py`)."""
    unknown = meta_buffers(module)
    if unknown:
        owner = module.get_submodule(unknown[0].rpartition(".")[0])
        raise NotSupportedError(
            f"buffer {unknown[0]} of {type(module).__name__} has no values (it is on the meta device, or fake"
            f"{f'; {len(unknown) - 1} more' if len(unknown) > 1 else ''}): the plan reads what the model computes "
            "from its buffers (rotary tables, masks)", loc=def_loc(type(owner).__init__),
            hint="build the model under fivedc.empty_weights(): its parameters go to the meta device (no memory), "
            "its buffers are computed as usual")


def _leaves_keep_outputs(module: nn.Module, example_inputs: tuple | dict) -> bool:
    """Whether the module computes the same with its MoE blocks kept whole as without. They may not:
    a block's inner modules are not called then, so hooks on them (Hugging Face collects the router
    logits for its balancing loss that way) do not run; such a model is traced through its blocks."""
    if not blocks(module):
        return False
    outputs = []
    for on in (False, True):
        try:
            with moe_leaves(module, on=on), torch.no_grad():
                got = module(**example_inputs) if isinstance(example_inputs, dict) else module(*example_inputs)
        except Exception:  # with them whole it fails (hooks that collect a block's inner outputs found none):
            return not on  # traced through; the plain module fails at this precision: nothing to compare
        outputs.append([t for t in tree_leaves(got) if isinstance(t, Tensor)])
    plain, kept = outputs
    if any(t.is_meta for t in plain):
        return True  # no values to compare (a model without weights)
    return len(plain) == len(kept) and all(
        a.shape == b.shape and torch.allclose(a, b, rtol=1e-9 if a.dtype == torch.float64 else 1e-5, atol=1e-12)
        for a, b in zip(plain, kept))


def _lower(trace, module: nn.Module, name: str | None, stage_boundaries):
    for traced in (trace.top, *(r.body for r in trace.repeats)):
        _no_writes(traced.gm)
        rewrite(traced.gm, traced.values)
    lowering = Lowering(trace)
    draft = lowering.draft(name or type(module).__name__.lower())
    mark_stages(module, trace, draft, stage_boundaries)
    mark_layers(module, draft)  # layers inlined into top-level ops still make pipeline units
    sink_input_only(draft)  # each chunk computes what it needs of the inputs (labels shifted by the model)
    return lowering, draft


def _no_writes(gm) -> None:
    """A symbolic trace does not see that `x.mul_(2)` changes `x` (later reads use the node
    of `x`, and the write looks unused): an in-place method call is left to torch.export,
    which records the write (`fivedc/frontends/fx/export.py` rewrites it as a pure op where it can)."""
    for node in gm.graph.nodes:
        if node.op == "call_method" and node.target.endswith("_") and not node.target.startswith("_"):
            raise Unrecognised(f"Tensor.{node.target} writes to its tensor in place", loc=node_loc(node))


def _consistent(graph: Graph, expected: dict[str, TensorType], *, strict: bool = False) -> bool:
    """Shape inference agrees with the frontend on every op (shared dim names did no harm)."""
    options = CompileOptions(mesh=Mesh((1, 1, 1, 1, 1)))
    try:
        typed = InferShapes().run(VerifyIR().run(graph, options), options)
    except (ShapeError, PassError) as error:
        if strict:
            raise PassError(f"the fx frontend built an inconsistent graph: {error.message}", loc=error.loc) from None
        return False
    for op, _ in walk_ops(typed.body):
        if isinstance(op, Op) and op.type != expected[op.out]:
            if strict:
                raise PassError(f"the fx frontend and shape inference disagree on {op.out}", loc=op.loc)
            return False
    return True


# ---- summary --------------------------------------------------------------------------
def _summary(model: TracedModel) -> str:
    g = model.graph
    how = "torch.export" if model.exported else "torch.fx"
    lines = [f"model {g.name} {{  # traced with {how} from {g.loc or g.source}"]
    lines.append("  dims { " + ", ".join(f"{k} = {v}" for k, v in g.dims) + " }")
    for item in g.inputs:
        lines.append(f"  input {item.name}: {item.type.dtype}[{', '.join(item.type.dims)}]")
    keys = {}
    for m in model.params:
        keys.setdefault((m.repeat, m.param), m)
    _block(g.body, keys, None, lines, "  ")
    lines.append(f"  return {g.output}")
    lines.append("}")
    lines.extend(f"# warning: {text}" for text in model.warnings)
    return "\n".join(lines)


def _block(block, keys, repeat: str | None, lines: list[str], pad: str) -> None:
    for p in block.params:
        m = keys.get((repeat, p.name))
        where = "  # " + ".".join(filter(None, (_source(m), m.key.rpartition(".")[2]))) if m else ""
        extra = f"rows {m.rows[0]}:{m.rows[1]}" if m and m.rows else ""
        lines.append(f"{pad}param {p.name}: [{', '.join(p.dims)}]{where} {extra}".rstrip())
    for item in block.items:
        if isinstance(item, Repeat):
            carried = ", ".join(f"{c} as {a}" for c, a in zip(item.carried, item.body.args))
            stages = f" @stage({', '.join(map(str, item.stage_layers))})" if item.stage_layers else ""
            lines.append(f"{pad}repeat {item.count} as {item.name}{stages} {{  # carries {carried}")
            _block(item.body, keys, item.name, lines, pad + "  ")
            lines.append(f"{pad}}}  # -> {', '.join(item.results)}")
            continue
        args = [str(a) for a in item.args] + [f"{k}={_literal(v)}" for k, v in item.attrs]
        loc = f"  # {item.loc.file.rpartition('/')[2]}:{item.loc.line}" if item.loc else ""
        notes = "".join(f" {a}" for a in item.annotations)
        lines.append(f"{pad}{item.out} = {item.kind}({', '.join(args)}){notes}{loc}")
    if repeat is not None:
        lines.append(f"{pad}# yields {', '.join(block.yields)}")


def _source(m: ParamMapping) -> str:
    """The module pattern a parameter comes from; separate experts stacked as `experts.{0..3}.w1`."""
    if m.index is None:
        return m.pattern
    head, _, tail = f"{m.pattern}.".rpartition(f".{m.index}.")
    return f"{head}.{{0..{m.ir_shape[0] - 1}}}.{tail}".rstrip(".")


def _literal(value) -> str:
    """An attribute as the DSL writes it: true, "tanh", 1e-05."""
    if isinstance(value, bool):
        return "true" if value else "false"
    return f'"{value}"' if isinstance(value, str) else repr(value)
