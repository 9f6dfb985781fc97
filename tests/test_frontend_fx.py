"""The torch.fx frontend: ordinary nn.Modules traced to fivedc's IR.

The traced graph, run by fivedc's own runtime on the module's weights, gives the
module's loss and gradients in float64 (to 1e-12, over a few drawn sizes); the
parameter map is an exact round trip; the traced graphs compile at dp x tp meshes
and train like the single-device run on gloo workers; the traced nanoGPT and its
DSL twin (`examples/nanogpt.5d`) compile to the same plan. Then the patterns
(hand-written attention and RMSNorm), the torch.export fallback, and the errors:
data-dependent control flow and unsupported ops at the user's line.
"""

from __future__ import annotations

import inspect
import math
import random
from pathlib import Path

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from fivedc.plan.diff import canonical_values, diff_plans
from fivedc.errors import FivedcError, NotSupportedError
from fivedc.frontends.dsl_file import load_model
from fivedc.frontends.python_file import import_file
from fivedc.frontends.fx_module import FxWarning, TracedModel, trace_module
from fivedc.ir.graph import Op, Repeat, walk_ops
from fivedc.ir.mesh import Mesh
from fivedc.passes.base import CompileOptions
from fivedc.pipeline import compile_graph
from fivedc.runtime.kernel_context import KernelContext
from fivedc.runtime.states import set_states
from fivedc.runtime.program import Program
from fivedc.runtime.train import TrainSettings
from fivedc.runtime.verify import single_device_mesh, verify_plan

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"
HERE = str(Path(__file__).resolve())


def _load(name: str):
    """The example `examples/<name>.py` as a module."""
    return import_file(EXAMPLES / f"{name}.py")


nanogpt, llama = _load("nanogpt"), _load("llama")


def line_of(fn, text: str) -> int:
    lines, start = inspect.getsourcelines(fn)
    return start + next(i for i, line in enumerate(lines) if text in line)


def run_ir(tm: TracedModel, module: nn.Module, inputs: tuple) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Loss and state-dict gradients of the traced graph, run by fivedc on one device."""
    plan = compile_graph(tm.graph, CompileOptions(mesh=single_device_mesh(), dtype="fp64"))
    ctx = KernelContext(plan.graph, plan.mesh, plan.mesh.coords(0))
    set_states(ctx, tm.state_values(module))  # the buffers the forward reads (an MoE routing bias)
    params = {k: v.detach().clone().requires_grad_(True) for k, v in tm.to_ir_params(module.state_dict()).items()}
    loss = Program(plan.graph, ctx).loss(params, {i.name: t for i, t in zip(tm.graph.inputs, inputs)})
    loss.backward()
    return loss.detach(), tm.from_ir_params({k: p.grad for k, p in params.items()})


def assert_same_as_module(tm: TracedModel, module: nn.Module, inputs: tuple) -> None:
    loss, grads = run_ir(tm, module, inputs)
    module.zero_grad()
    expected = module(*inputs)
    expected.backward()
    assert abs(loss.item() - expected.item()) <= 1e-12 * max(1.0, abs(expected.item()))
    named = {n: p for n, p in module.named_parameters() if p.grad is not None}  # the parameters forward uses
    assert set(grads) == set(named)
    for name, grad in grads.items():
        want = named[name].grad
        assert (grad - want).abs().max().item() <= 1e-12 * max(1.0, want.abs().max().item()), name


def draw_gpt(seed: int):
    rng = random.Random(seed)
    heads = rng.choice([2, 4])
    config = nanogpt.GPTConfig(
        block_size=rng.choice([4, 6, 8]), vocab_size=rng.choice([16, 40, 64]), n_layer=rng.choice([1, 2, 3]),
        n_head=heads, n_embd=heads * rng.choice([4, 8]), bias=rng.random() < 0.5,
    )
    return nanogpt.factory(batch=rng.choice([1, 2, 3]), config=config, seed=seed)


def draw_llama(seed: int):
    rng = random.Random(seed)
    kv = rng.choice([1, 2, 4])  # 1: multi-query attention
    heads = 4 if kv == 4 else 2 * kv  # grouped-query (and multi-head) attention
    args = llama.ModelArgs(
        dim=heads * rng.choice([4, 8]), n_layers=rng.choice([1, 2, 3]), n_heads=heads, n_kv_heads=kv,
        vocab_size=rng.choice([16, 48]), ffn_dim=rng.choice([24, 40]), max_seq_len=rng.choice([4, 8]),
        rope_theta=rng.choice([10000.0, 500.0]),
    )
    return llama.factory(batch=rng.choice([1, 2]), args=args, seed=seed)


# ---- numerics against the module ---------------------------------------------------------
@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("draw", [draw_gpt, draw_llama], ids=["nanogpt", "llama"])
def test_traced_graph_computes_the_modules_loss_and_gradients(draw, seed: int) -> None:
    module, inputs = draw(seed)
    assert_same_as_module(trace_module(module, inputs), module, inputs)


def test_parameter_map_is_an_exact_round_trip_with_fused_qkv() -> None:
    module, inputs = nanogpt.factory(config=nanogpt.GPTConfig(bias=True, n_layer=3))
    tm = trace_module(module, inputs)
    state = {k: torch.randn_like(v) for k, v in module.state_dict().items()}
    back = tm.from_ir_params(tm.to_ir_params(state))
    assert set(back) == set(state) and all(torch.equal(back[k], state[k]) for k in state)
    ir = tm.to_ir_params(state)
    hidden = module.config.n_embd
    w = state["transformer.h.2.attn.c_attn.weight"]  # torch: [3*hidden, hidden], rows q | k | v
    assert torch.equal(ir["layers.2.c_attn_k"].reshape(hidden, hidden), w[hidden : 2 * hidden].t())
    assert torch.equal(ir["layers.2.c_attn_v_b"].reshape(-1), state["transformer.h.2.attn.c_attn.bias"][2 * hidden :])
    parts = tm.match("transformer.h.*.attn.c_attn")
    assert {(m.param, m.key.rpartition(".")[2]) for m in parts} == {
        (f"c_attn_{p}{b}", attr) for p in "qkv" for b, attr in (("", "weight"), ("_b", "bias"))}
    assert {m.ir_name.split(".")[1] for m in parts} == {"0", "1", "2"}
    assert all(m.pattern == "transformer.h.*.attn.c_attn" for m in parts)


def test_dims_and_params_have_meaningful_names() -> None:
    module, inputs = llama.factory()
    graph = trace_module(module, inputs).graph
    dims = dict(graph.dims)
    assert {k: dims[k] for k in ("batch", "seq", "hidden", "heads", "kv_heads", "head_dim", "ffn", "vocab", "layers")} == {
        "batch": 2, "seq": 8, "hidden": 32, "heads": 4, "kv_heads": 2, "head_dim": 8, "ffn": 96, "vocab": 64, "layers": 2}
    (repeat,) = [i for i in graph.body.items if isinstance(i, Repeat)]
    params = {p.name: p.dims for p in repeat.body.params}
    assert params["wq"] == ("hidden", "heads", "head_dim") and params["wk"] == ("hidden", "kv_heads", "head_dim")
    assert params["wo"] == ("heads", "head_dim", "hidden") and params["w2"] == ("ffn", "hidden")
    kinds = [op.kind for op in repeat.body.items]
    assert kinds.count("rope") == 2 and "swiglu" in kinds and kinds.count("rmsnorm") == 2
    # every op points at the user's code
    assert all(op.loc is not None and op.loc.file.endswith(".py") and "fivedc/" not in op.loc.file
               for op, _ in walk_ops(graph.body) if isinstance(op, Op))


# ---- compiled and trained in parallel -------------------------------------------------------
@pytest.mark.parametrize("example", ["nanogpt", "llama"])
def test_traced_models_compile_and_train_like_one_device(example: str, worker_pool) -> None:
    module, inputs = (nanogpt if example == "nanogpt" else llama).factory(batch=4)
    graph = trace_module(module, inputs).graph
    for mesh in ("2x1x2x1x1", "1x1x2x1x1", "4x1x1x1x1") + (("1x1x4x1x1",) if example == "nanogpt" else ()):
        plan = compile_graph(graph, CompileOptions(mesh=Mesh.parse(mesh), sequence_parallel=True, dtype="fp64"))
        assert any(c.axes for c in plan.collectives)
    plan = compile_graph(graph, CompileOptions(mesh=Mesh.parse("2x1x2x1x1"), sequence_parallel=True, dtype="fp64"))
    reference = compile_graph(graph, CompileOptions(mesh=single_device_mesh(), dtype="fp64"))
    report = verify_plan(plan, reference, settings=TrainSettings(steps=2), pool=worker_pool)
    assert report.max_error <= 1e-10, report
    assert report.losses[1] != report.losses[0]


@pytest.mark.parametrize("mesh", ["2x1x2x1x1", "1x1x4x1x1"])
def test_traced_nanogpt_and_its_dsl_twin_compile_to_the_same_plan(mesh: str) -> None:
    module, inputs = nanogpt.factory()
    traced = canonical_values(trace_module(module, inputs).graph)
    written = canonical_values(load_model(EXAMPLES / "nanogpt.5d"))
    options = CompileOptions(mesh=Mesh.parse(mesh), sequence_parallel=True)
    a, b = compile_graph(traced, options), compile_graph(written, options)
    d = diff_plans(a, b)
    assert not d.params and not d.collectives and not d.groups, d.to_json()
    assert d.is_empty
    assert any(p.sharding.axes_of("vocab") for p, _ in [(p, None) for p in a.graph.body.params if p.name == "wte"])


# ---- repeated layers ------------------------------------------------------------------------
def test_repeated_layers_are_one_repeat_whatever_the_depth() -> None:
    bodies = []
    for layers in (2, 7):
        module, inputs = nanogpt.factory(config=nanogpt.GPTConfig(n_layer=layers))
        graph = trace_module(module, inputs).graph
        (repeat,) = [i for i in graph.body.items if isinstance(i, Repeat)]
        assert repeat.count == layers and repeat.name == "layers"
        bodies.append([(op.kind, op.args) for op in repeat.body.items])
    assert bodies[0] == bodies[1]


def test_layers_that_differ_are_inlined() -> None:
    module, inputs = nanogpt.factory(config=nanogpt.GPTConfig(n_layer=2))
    module.transformer.h[1].ln_1.eps = 1e-3  # not uniform any more: two inlined layers
    tm = trace_module(module, inputs)
    assert not any(isinstance(i, Repeat) for i in tm.graph.body.items)
    assert {m.param for m in tm.match("transformer.h.1.ln_1")} == {"h_1_ln_1"}
    assert_same_as_module(tm, module, inputs)


# ---- patterns and the export fallback ------------------------------------------------------
class HandWrittenAttention(nanogpt.CausalSelfAttention):
    def __init__(self, config) -> None:
        super().__init__(config)
        mask = torch.tril(torch.ones(config.block_size, config.block_size))
        self.register_buffer("bias", mask.view(1, 1, config.block_size, config.block_size))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, C = x.size()
        q, k, v = self.c_attn(x).split(self.n_embd, dim=2)
        k = k.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
        q = q.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
        v = v.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
        att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(k.size(-1)))
        att = att.masked_fill(self.bias[:, :, :T, :T] == 0, float("-inf"))
        att = F.softmax(att, dim=-1)
        y = att @ v
        return self.c_proj(y.transpose(1, 2).contiguous().view(B, T, C))


class ShapeInFloat(nanogpt.CausalSelfAttention):
    """float() of a traced shape: torch.fx cannot follow it, torch.export can."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, C = x.size()
        q, k, v = self.c_attn(x).split(self.n_embd, dim=2)
        q, k, v = (t.view(B, T, self.n_head, C // self.n_head).transpose(1, 2) for t in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=float(k.shape[-1]) ** -0.5)
        return self.c_proj(y.transpose(1, 2).contiguous().view(B, T, C))


class OwnScale(nanogpt.CausalSelfAttention):
    """SDPA with a scale of its own (Gemma 3 scales by query_pre_attn_scalar**-0.5, not head_dim's)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, C = x.size()
        q, k, v = self.c_attn(x).split(self.n_embd, dim=2)
        q, k, v = (t.view(B, T, self.n_head, C // self.n_head).transpose(1, 2) for t in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=0.3)
        return self.c_proj(y.transpose(1, 2).contiguous().view(B, T, C))


def test_attention_with_its_own_scale_scales_q_first() -> None:
    module, inputs = _with_attention(OwnScale)
    tm = trace_module(module, inputs)
    ops = [op for op, _ in walk_ops(tm.graph.body) if isinstance(op, Op)]
    at = next(i for i, op in enumerate(ops) if op.kind == "attention")
    q = next(op for op in ops[:at] if op.out == ops[at].args[0])
    head_dim = dict(tm.graph.dims)["head_dim"]
    assert q.kind == "mul" and math.isclose(q.args[1], 0.3 * math.sqrt(head_dim))
    assert_same_as_module(tm, module, inputs)


def _with_attention(cls):
    module, inputs = nanogpt.factory()
    for block in module.transformer.h:
        attn = cls(module.config).to(torch.float64)
        attn.load_state_dict(block.attn.state_dict(), strict=False)
        block.attn = attn
    return module, inputs


def test_hand_written_causal_attention_becomes_attention() -> None:
    module, inputs = _with_attention(HandWrittenAttention)
    tm = trace_module(module, inputs)
    kinds = [op.kind for op, _ in walk_ops(tm.graph.body) if isinstance(op, Op)]
    assert kinds.count("attention") == 1 and not tm.exported
    assert_same_as_module(tm, module, inputs)


def test_rmsnorm_written_out_is_recognised_by_its_pattern() -> None:
    class Norm(llama.RMSNorm):  # a name that does not say RMSNorm: traced through, then matched
        pass

    module, inputs = llama.factory()
    for block in module.layers:
        norm = Norm(module.layers[0].attention_norm.weight.shape[0])
        norm.load_state_dict(block.ffn_norm.state_dict())
        block.ffn_norm = norm.to(torch.float64)
    tm = trace_module(module, inputs)
    (repeat,) = [i for i in tm.graph.body.items if isinstance(i, Repeat)]
    assert [op.kind for op in repeat.body.items].count("rmsnorm") == 2
    assert_same_as_module(tm, module, inputs)


def test_export_fallback_where_fx_cannot_follow_the_python() -> None:
    module, inputs = _with_attention(ShapeInFloat)
    tm = trace_module(module, inputs)
    assert tm.exported and not any(isinstance(i, Repeat) for i in tm.graph.body.items)
    assert_same_as_module(tm, module, inputs)


# ---- errors and warnings --------------------------------------------------------------------
class TinyLM(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb, self.head = nn.Embedding(16, 8), nn.Linear(8, 16)

    def loss(self, h: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(self.head(h).view(-1, 16), targets.view(-1))


class DataDependent(TinyLM):
    def forward(self, idx: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        h = self.emb(idx)
        if h.sum() > 0:
            h = h * 2
        return self.loss(h, targets)


class Unsupported(TinyLM):
    def forward(self, idx: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        h = torch.cumsum(self.emb(idx), dim=1)
        return self.loss(h, targets)


class Dropping(TinyLM):
    def __init__(self) -> None:
        super().__init__()
        self.drop = nn.Dropout(0.1)

    def forward(self, idx: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return self.loss(self.drop(self.emb(idx)), targets)


TOKENS = (torch.randint(0, 16, (2, 4)), torch.randint(0, 16, (2, 4)))


def test_data_dependent_control_flow_names_the_users_line() -> None:
    with pytest.raises(FivedcError) as info:
        trace_module(DataDependent(), TOKENS)
    err = info.value
    assert err.loc.file == HERE and err.loc.line == line_of(DataDependent.forward, "if h.sum() > 0")
    assert "data-dependent" in err.message and "Traceback" not in err.render()
    assert "if h.sum() > 0:" in err.render()


def test_an_op_without_a_rule_runs_replicated_and_is_named_at_its_line() -> None:
    """torch.cumsum has no IR op: it is kept as its ATen call (a scan along the sequence, computed on
    shards of the other dims), with the reason at the user's line, and the model computes what the
    module computes."""
    module = Unsupported().double()
    tm = trace_module(module, TOKENS)
    (island,) = [op for op, _ in walk_ops(tm.graph.body) if isinstance(op, Op) and op.kind == "aten"]
    assert island.attr("target") == "aten.cumsum.default" and "cumsum" in island.attr("reason")
    assert island.loc.file == HERE and island.loc.line == line_of(Unsupported.forward, "torch.cumsum")
    assert_same_as_module(tm, module, TOKENS)


def test_what_is_dropped_is_a_warning_at_the_users_line() -> None:
    with pytest.warns(FxWarning, match="dropout") as record:
        tm = trace_module(Dropping(), TOKENS)
    assert record[0].filename == HERE and record[0].lineno == line_of(Dropping.forward, "self.drop")
    assert tm.warnings and str(line_of(Dropping.forward, "self.drop")) in tm.warnings[0]


def test_the_reference_runs_without_dropout_as_the_plan_does() -> None:
    """The IR has no dropout: a check's reference runs the module with every dropout at p=0."""
    from fivedc.frontends.fx.precision import without_dropout

    x = torch.randn(2, 2, 4, 8, dtype=torch.float64)
    plain = F.scaled_dot_product_attention(x, x, x)
    with without_dropout():
        assert torch.equal(F.dropout(x, 0.5, True), x) and torch.equal(nn.Dropout(0.9)(x), x)
        assert torch.equal(torch.dropout(x, 0.5, True), x)
        assert torch.allclose(F.scaled_dot_product_attention(x, x, x, dropout_p=0.5), plain)
        assert torch.allclose(F.scaled_dot_product_attention(x, x, x, None, 0.5), plain)
    assert not torch.equal(F.dropout(x, 0.5, True), x)


def test_tied_weights_are_one_parameter() -> None:
    """nanoGPT as Karpathy ties it (lm_head.weight = wte.weight): one IR parameter for both uses
    (tests/test_tied_weights.py trains it in parallel)."""
    module, inputs = nanogpt.factory()
    module.lm_head.weight = module.transformer.wte.weight
    tm = trace_module(module, inputs)
    assert len([p for p in tm.graph.body.params if p.dims == ("vocab", "hidden")]) == 1
    assert_same_as_module(tm, module, inputs)


def test_dims_of_equal_size_keep_their_meaning() -> None:
    args = llama.ModelArgs(dim=8, n_layers=2, n_heads=2, n_kv_heads=2, vocab_size=8, ffn_dim=8, max_seq_len=8)
    module, inputs = llama.factory(batch=8, args=args)
    tm = trace_module(module, inputs)
    (repeat,) = [i for i in tm.graph.body.items if isinstance(i, Repeat)]
    params = {p.name: p.dims for p in repeat.body.params}
    assert params["wq"] == ("hidden", "heads", "head_dim") and params["w1"] == ("hidden", "ffn")
    assert params["wk"] == ("hidden", "kv_heads", "head_dim") and params["w2"] == ("ffn", "hidden")
    assert [i.type.dims for i in tm.graph.inputs] == [("batch", "seq")] * 2
    assert {p.name: p.dims for p in tm.graph.body.params}["output"] == ("hidden", "vocab")
    assert_same_as_module(tm, module, inputs)


class DataDependentLoop(TinyLM):
    def forward(self, idx: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        h = self.emb(idx)
        for _ in range(int(idx.max())):  # neither torch.fx nor torch.export can follow this
            h = h * 2
        return self.loss(h, targets)


def test_a_model_neither_tracer_follows_names_the_users_line() -> None:
    with pytest.raises(NotSupportedError) as info:
        trace_module(DataDependentLoop(), TOKENS)
    err = info.value
    assert err.loc.file == HERE and err.loc.line == line_of(DataDependentLoop.forward, "range(int(idx.max()))")
    assert "Proxy" in err.message and "torch.export failed too" in err.hint


class InterleavedRotary(nn.Module):
    """Rotates adjacent pairs (Meta's complex form): not fivedc's half-split rope."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        half = x.shape[-1] // 2
        freqs = 10000.0 ** (-torch.arange(half, dtype=x.dtype) / half)
        angles = torch.arange(x.shape[1], dtype=x.dtype)[:, None] * freqs
        cos, sin = angles.cos()[None, :, None, :], angles.sin()[None, :, None, :]
        x1, x2 = x[..., 0::2], x[..., 1::2]
        return torch.stack((x1 * cos - x2 * sin, x1 * sin + x2 * cos), dim=-1).flatten(-2)


def test_a_rotary_module_of_another_convention_runs_as_aten_ops_on_shards() -> None:
    """Meta's interleaved rotary is not fivedc's half-split rope: its strided slices, products and
    stack run as ATen ops on shards inside the layer, at the rotary module's lines, the attention
    reads the head_dim the stack made of two dims as one (a clone at the attention's line), and
    the model computes what the module computes."""
    module, inputs = llama.factory()
    for block in module.layers:
        block.attention.rope = InterleavedRotary()
    tm = trace_module(module, inputs)
    islands = [op for op, _ in walk_ops(tm.graph.body) if isinstance(op, Op) and op.kind == "aten"]
    assert islands and all(op.attr("rule") != "replicated" for op in islands)
    rotary = [op for op in islands if op.loc.file == HERE]
    assert {op.loc.line for op in rotary} >= {line_of(InterleavedRotary.forward, "x[..., 0::2]")}
    assert {op.attr("target") for op in islands if op.loc.file != HERE} == {"aten.clone.default"}
    assert_same_as_module(tm, module, inputs)