"""Expert parallelism: placement, gradient groups, the plan's all-to-alls, the MoE
kernel's routing and drop rule, equivalence with the single-device run, and errors.

Property tests draw MoE models (experts, top-k, score, SwiGLU or GELU, shared
expert, balancing losses, capacity) on meshes with ep in {2, 4} composed with dp
and tp (world <= 8), and check 2 AdamW steps in float64 against one device to 1e-10;
dropless, with a capacity factor that drops tokens, and with ZeRO-1/2/3.
"""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
from hypothesis import HealthCheck, given, settings, strategies as st

from fivedc.cli.main import main
from fivedc.errors import DslError, NotSupportedError, ShapeError, ShardingError
from fivedc.frontends.dsl_file import load_model, parse_model
from fivedc.ir.graph import CollectiveKind, Op, Phase, Repeat, walk_ops, walk_params
from fivedc.ir.mesh import Mesh, MeshAxis
from fivedc.passes.base import CompileOptions
from fivedc.passes.experts import MoeSettings
from fivedc.pipeline import compile_graph
from fivedc.runtime.kernel_context import KernelContext
from fivedc.runtime import moe
from fivedc.runtime.moe import (batched_experts, capacity_keep, grouped_experts, local_experts, loop_experts, route,
                                sliced_experts)
from fivedc.runtime.train import TrainSettings
from fivedc.runtime.verify import reference_run, single_device_mesh, verify_plan
from fivedc.cli.verify_report import _print_report
from random_models import Case, draw_moe_case, moe_model_text

TOL = 1e-10
K = CollectiveKind
EXAMPLE = "examples/moe.5d"


def compile_text(text: str, mesh: str, **options):
    return compile_graph(parse_model(text, filename="moe_test.5d"),
                         CompileOptions(mesh=Mesh.parse(mesh), dtype="fp64", **options))


def verify(graph, mesh: str, pool, *, sp: bool = False, zero: int = 0):
    plan = compile_graph(graph, CompileOptions(mesh=Mesh.parse(mesh), sequence_parallel=sp, dtype="fp64", zero=zero))
    reference = compile_graph(graph, CompileOptions(mesh=single_device_mesh(), dtype="fp64"))
    report = verify_plan(plan, reference, settings=TrainSettings(steps=2), pool=pool)
    assert report.max_error <= TOL, report
    assert report.routing_matches and report.losses[0] != report.losses[1]
    return report


def example_with(extra: str = "", annotation: str = "", *, aux: float = 0.01) -> str:
    """examples/moe.5d with more moe keywords, an annotation, another aux loss coefficient."""
    text = open(EXAMPLE).read()
    return text.replace("aux_loss=0.01)", f"aux_loss={aux}{extra}){annotation}")


def moe_ops(plan) -> list[Op]:
    return [n for n, _ in walk_ops(plan.graph.body) if isinstance(n, Op) and n.kind == "moe"]


# ---- equivalence --------------------------------------------------------------------
SLOW = settings(deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])


@settings(SLOW, max_examples=8)
@given(case=draw_moe_case())
def test_random_moe_models_match_single_device(case: Case, worker_pool) -> None:
    verify(parse_model(case.text, filename="<random moe>"), case.mesh, worker_pool, sp=case.sp)


@settings(SLOW, max_examples=4)
@given(case=draw_moe_case(capacity=True))
def test_random_moe_models_with_a_capacity_that_drops(case: Case, worker_pool) -> None:
    report = verify(parse_model(case.text, filename="<random moe>"), case.mesh, worker_pool, sp=case.sp)
    assert sum(sum(load.dropped) for step in report.expert_load for load in step.values()) > 0


@settings(SLOW, max_examples=4)
@given(case=draw_moe_case(), zero=st.sampled_from([1, 2, 3]))
def test_random_moe_models_with_zero(case: Case, zero: int, worker_pool) -> None:
    verify(parse_model(case.text, filename="<random moe>"), case.mesh, worker_pool, sp=case.sp, zero=zero)


@pytest.mark.parametrize("mesh,extra,annotation,aux", [
    ("1x1x1x2x2", ", capacity_factor=0.5, bias_update=0.01", "", 0.01),       # cp: capacity over sequence chunks
    ("1x1x2x2x2", "", "", 1.0),                                               # the aux loss at tp=2, cp=2, ep=2
    ("2x1x1x1x4", "", " @ep(hierarchical, 2)", 0.01),                         # 2 nodes of 2 ep ranks
])
def test_example_moe_matches_single_device(mesh: str, extra: str, annotation: str, aux: float, worker_pool) -> None:
    verify(parse_model(example_with(extra, annotation, aux=aux), filename=EXAMPLE), mesh, worker_pool)


def test_moe_under_pipeline_parallelism(worker_pool) -> None:
    """Microbatches route independently; capacity is per sequence and the bias update
    sums the counts of every microbatch, so both hold under pp. The whole-batch aux
    loss does not, and is refused."""
    text = example_with(", capacity_factor=0.5, bias_update=0.01", aux=0.0).replace("aux_loss=0.0, ", "")
    verify(parse_model(text, filename=EXAMPLE), "2x2x1x1x2", worker_pool)
    with pytest.raises(NotSupportedError, match=r"aux_loss under pipeline parallelism \(pp=2\)") as info:
        compile_text(example_with(), "1x2x1x1x2")
    assert "bias_update" in info.value.hint and info.value.loc.line == 48


def test_a_broken_dispatch_is_caught(worker_pool) -> None:
    """Point the plan's all-to-alls at the dp group instead of ep: tokens reach the
    wrong experts, and the harness sees it."""
    graph = load_model(EXAMPLE)
    plan = compile_graph(graph, CompileOptions(mesh=Mesh.parse("2x1x1x1x2"), dtype="fp64"))

    def mutate(item):
        if isinstance(item, Repeat):
            return replace(item, body=replace(item.body, items=tuple(mutate(i) for i in item.body.items)))
        if isinstance(item, Op) and item.kind == "moe":
            wrong = tuple(replace(c, axes=(MeshAxis.DP,)) if c.kind == K.ALL_TO_ALL else c for c in item.collectives)
            return replace(item, collectives=wrong)
        return item

    body = plan.graph.body
    broken = replace(plan, graph=replace(plan.graph, body=replace(body, items=tuple(mutate(i) for i in body.items))))
    reference = compile_graph(graph, CompileOptions(mesh=single_device_mesh(), dtype="fp64"))
    report = verify_plan(broken, reference, settings=TrainSettings(steps=2), pool=worker_pool)
    assert report.grad_error > 1e-3


def test_the_aux_loss_and_the_bias_change_training() -> None:
    """Both balancing mechanisms really act (so the equivalence tests above test them)."""
    def router_grad(extra: str) -> torch.Tensor:
        aux = 1.0 if extra == "aux" else 0.0
        plan = compile_graph(parse_model(example_with("" if extra == "aux" else extra, aux=aux)),
                             CompileOptions(mesh=single_device_mesh(), dtype="fp64"))
        record = reference_run(plan, TrainSettings(steps=2))
        return record.grads[0]["layers.0.router"], record.expert_load

    plain, plain_load = router_grad("")
    with_aux, _ = router_grad("aux")
    assert (with_aux - plain).abs().max() > 1e-3 * plain.abs().max()
    _, biased_load = router_grad(", bias_update=0.1")
    assert biased_load[0] == plain_load[0] and biased_load[1] != plain_load[1]  # the bias acts after step 1


# ---- the plan -------------------------------------------------------------------------
def test_expert_placement_and_gradient_groups() -> None:
    plan = compile_graph(load_model(EXAMPLE), CompileOptions(mesh=Mesh.parse("2x1x2x1x2"), dtype="fp64"))
    params = {p.name: p for p, _ in walk_params(plan.graph.body)}
    for name in ("we_gate", "we_up", "we_down"):
        assert str(params[name].sharding) == "expert_ffn:tp experts:ep"
        assert params[name].grad_partial == (MeshAxis.DP,)  # each ep rank's experts: reduced over dp only
    assert params["router"].grad_partial == (MeshAxis.DP, MeshAxis.EP, MeshAxis.TP)
    assert params["wq"].grad_partial == (MeshAxis.DP, MeshAxis.EP)  # dense: dp x ep
    (op, ) = moe_ops(plan)
    assert str(op.annotation("ep")) == "@ep(contiguous, flat)"
    assert str(op.sharding) == "batch:dp*ep +partial(tp)"
    experts_bucket = [b for b in plan.buckets if "layers.*.we_up" in b.params]
    assert experts_bucket and experts_bucket[0].axes == (MeshAxis.DP,)  # ZeRO group = grad_partial
    zero3 = compile_graph(load_model(EXAMPLE), CompileOptions(mesh=Mesh.parse("2x1x2x1x2"), dtype="fp64", zero=3))
    gathers = {name: c.axes for c in zero3.collectives if c.kind == K.ALL_GATHER  # ZeRO-3 gathers by bucket
               for name in c.tensor.split(": ", 1)[1].split(", ")}
    assert gathers["layers.*.we_up"] == (MeshAxis.DP,) and gathers["layers.*.wq"] == (MeshAxis.DP, MeshAxis.EP)


@pytest.mark.parametrize("mesh", ["2x1x1x1x2", "1x1x2x1x4", "1x1x1x2x2", "2x1x1x1x4"])
def test_all_to_all_bytes_match_the_hand_formula(mesh: str) -> None:
    """tokens x top_k x hidden x bytes per rank, (ep-1)/ep of it on the wire, per layer:
    counts, dispatch and combine forward, and the two token all-to-alls backward."""
    m = Mesh.parse(mesh)
    plan = compile_graph(load_model(EXAMPLE), CompileOptions(mesh=m, dtype="bf16"))
    ep = m.size(MeshAxis.EP)
    tokens = 8 // m.size(MeshAxis.DP, MeshAxis.EP) * 8 // m.size(MeshAxis.CP)
    formula = tokens * 2 * 32 * 2 * (ep - 1) / ep
    a2a = [c for c in plan.collectives if c.kind == K.ALL_TO_ALL]
    counts = [c for c in a2a if "how many tokens" in c.reason]
    rows = [c for c in a2a if c not in counts]
    assert [c.phase for c in rows] == [Phase.FORWARD] * 2 + [Phase.BACKWARD] * 2
    assert all(c.bytes * (ep - 1) / ep == formula and c.count == 2 and c.axes == (MeshAxis.EP,) for c in rows)
    assert len(counts) == 1 and counts[0].bytes == 8 * 8  # 8 experts, int64
    assert "dispatch: each token to the ep ranks holding its top-2 experts" in rows[0].reason
    assert f"{tokens} tokens x top_k 2 x hidden 32 x 2 B" in rows[0].reason
    aux = [c for c in plan.collectives if "auxiliary loss" in c.reason]
    token_axes = tuple(a for a in (MeshAxis.DP, MeshAxis.EP, MeshAxis.CP) if m.size(a) > 1)
    assert len(aux) == 1 and aux[0].axes == token_axes and aux[0].bytes == 64


def test_deepseek_v3_compiles_with_32_way_expert_parallelism() -> None:
    plan = compile_graph(load_model("examples/deepseek_v3.5d"), CompileOptions(mesh=Mesh.parse("1x1x8x1x32")))
    layer = {p.name: p for p, r in walk_params(plan.graph.body) if r is not None and r.name == "moe"}
    local = plan.graph.local_numel(layer["we_up"].dims, layer["we_up"].sharding, plan.mesh)
    assert local == 256 // 32 * 7168 * 2048 // 8  # 8 experts per rank, ffn split over tp
    dispatch = next(c for c in plan.collectives if c.kind == K.ALL_TO_ALL and c.reason.startswith("dispatch"))
    assert dispatch.bytes == 15360 // 32 * 4096 * 8 * 7168 * 2 and dispatch.count == 58
    assert "each of the 8 tp ranks sends the same tokens" in dispatch.reason


@pytest.mark.parametrize("mesh,node,per_node,nodes", [("1x1x1x1x8", 4, 4, 2), ("1x1x2x1x8", 8, 4, 2),
                                                      ("1x1x4x1x4", 8, 2, 2), ("1x1x4x1x4", 4, 1, 4)])
def test_hierarchical_all_to_all_lists_bytes_per_level(mesh: str, node: int, per_node: int, nodes: int) -> None:
    text = example_with(annotation=f" @ep(hierarchical, {node})").replace("hidden = 32", "hidden = 64")
    plan = compile_text(text, mesh)
    dispatch = [c for c in plan.collectives if c.reason.startswith("dispatch:")]
    assert len(dispatch) == 2 and dispatch[0].bytes == dispatch[1].bytes
    assert f"intra-node ({node} ranks per node): among the {per_node} ep ranks" in dispatch[0].reason
    assert f"wire bytes {per_node - 1}/{per_node}" in dispatch[0].reason
    assert f"inter-node: among the {nodes} nodes' ranks" in dispatch[1].reason
    assert f"wire bytes {nodes - 1}/{nodes}" in dispatch[1].reason
    flat = compile_text(example_with().replace("hidden = 32", "hidden = 64"), mesh)
    assert sum(c.kind == K.ALL_TO_ALL for c in plan.collectives) == 2 * sum(
        c.kind == K.ALL_TO_ALL for c in flat.collectives)


def test_a_placement_can_be_given(worker_pool) -> None:
    """Strided and explicit placements: the plan says where the experts are, and the
    runtime stores each rank's experts in that order and matches one device."""
    plan = compile_text(example_with(annotation=" @ep(1, 0, 1, 0, 1, 0, 1, 0)"), "1x1x1x1x2")
    assert "placed as @ep(1,0,1,0,1,0,1,0)" in next(c.reason for c in plan.collectives if c.reason.startswith("dispatch:"))
    strided = compile_text("model m @ep(strided) {" + example_with().split("model moe {", 1)[1], "1x1x1x1x2")
    assert moe_ops(strided)[0].annotation("ep").args[0] == "strided"
    plain = parse_model(example_with(), filename="moe.5d")  # the same model: a placement changes no math
    reference = compile_graph(plain, CompileOptions(mesh=single_device_mesh(), dtype="fp64"))
    for text in (example_with(annotation=" @ep(1, 0, 1, 0, 1, 0, 1, 0)"), example_with(annotation=" @ep(strided)")):
        graph = parse_model(text, filename="moe.5d")
        parallel = compile_graph(graph, CompileOptions(mesh=Mesh.parse("2x1x1x1x2"), dtype="fp64"))
        report = verify_plan(parallel, reference, settings=TrainSettings(steps=2), pool=worker_pool)
        assert report.max_error <= 1e-10, report


# ---- the kernel, in one process -----------------------------------------------------
def _context(text: str):
    plan = compile_text(text, "1x1x1x1x1")
    (op,) = moe_ops(plan)
    return KernelContext(plan.graph, plan.mesh, plan.mesh.coords(0)), op


def test_capacity_keeps_first_choices_first_then_by_position() -> None:
    """One sequence of 4 tokens, top-2 of 2 experts, capacity 0.5 * 4 * 2 / 2 = 2 each."""
    text = example_with(", capacity_factor=0.5").replace("batch = 8", "batch = 1").replace("seq = 8", "seq = 4")
    text = text.replace("experts = 8", "experts = 2")
    ctx, op = _context(text)
    chosen = torch.tensor([[0, 1], [0, 1], [1, 0], [0, 1]])
    keep = capacity_keep(ctx, op, chosen, ("batch", "seq", "hidden"), (1, 4, 32), 2, MoeSettings.of(op))
    # expert 0: first choices of tokens 0, 1 (kept), 3 (dropped), second choice of token 2 (dropped)
    # expert 1: first choice of token 2, second choice of token 0 (kept), of tokens 1, 3 (dropped)
    assert keep.tolist() == [[True, True], [True, False], [True, False], [False, False]]


def test_batched_and_sliced_experts_equal_the_loop_over_experts() -> None:
    gen = torch.Generator().manual_seed(0)
    for recv in (torch.tensor([[3, 0, 2], [1, 4, 0]]), torch.tensor([[4, 0, 6]])):  # from 2 ranks; from one
        rows = torch.randn(int(recv.sum()), 5, generator=gen, dtype=torch.float64, requires_grad=True)
        for swiglu in (True, False):
            weights = [torch.randn(3, 5, 4, generator=gen, dtype=torch.float64) for _ in range(1 + swiglu)]
            weights.append(torch.randn(3, 4, 5, generator=gen, dtype=torch.float64))
            weights = [w.requires_grad_() for w in weights]
            kinds = (loop_experts, batched_experts, local_experts, grouped_experts) + \
                ((sliced_experts,) if len(recv) == 1 else ())
            results = []
            for experts in kinds:
                out = experts(rows, recv, weights, swiglu)
                results.append((out, *torch.autograd.grad(out.square().sum(), [rows, *weights])))
            for other in results[1:]:
                assert all(torch.allclose(a, b, rtol=1e-12, atol=1e-12) for a, b in zip(results[0], other))


def test_local_experts_slice_rows_from_one_rank_and_group_the_rest(monkeypatch) -> None:
    calls = []
    monkeypatch.setattr(moe, "sliced_experts", lambda *args: calls.append("sliced"))
    monkeypatch.setattr(moe, "grouped_experts", lambda *args: calls.append("grouped"))
    moe.local_experts(torch.zeros(5, 1), torch.tensor([[2, 3]]), [], True)
    moe.local_experts(torch.zeros(5, 1), torch.tensor([[2, 0], [1, 2]]), [], True)
    assert calls == ["sliced", "grouped"]


@pytest.mark.parametrize("score", ["softmax", "sigmoid"])
def test_routing_picks_top_k_and_normalises_the_gates(score: str) -> None:
    gen = torch.Generator().manual_seed(1)
    x, router = torch.randn(6, 4, generator=gen, dtype=torch.float64), torch.randn(4, 5, generator=gen, dtype=torch.float64)
    s = MoeSettings(top_k=2, score=score, capacity_factor=None, aux_loss=0, bias_update=0, normalize=True, swiglu=True)
    chosen, gates, scores = route(x, router, s, None)
    raw = (x @ router).softmax(-1) if score == "softmax" else (x @ router).sigmoid()
    assert chosen.tolist() == raw.topk(2).indices.tolist()
    assert torch.allclose(gates.sum(-1), torch.ones(6, dtype=torch.float64))
    assert torch.allclose(scores.sum(-1), torch.ones(6, dtype=torch.float64))
    bias = torch.zeros(5, dtype=torch.float64)
    bias[4] = 10.0  # the bias selects expert 4 for every token but does not weigh it
    chosen, gates, _ = route(x, router, s, bias)
    assert (chosen[:, 0] == 4).all() and torch.allclose(gates[:, 0], raw[:, 4] / raw.gather(1, chosen).sum(-1))


# ---- errors ---------------------------------------------------------------------------
@pytest.mark.parametrize("extra,annotation,mesh,error,message,hint", [
    ("", "", "1x1x1x1x3", ShapeError, "experts=8 is not divisible by ep=3", "choose ep in {1, 2, 4, 8}"),
    (", capacity_factor=0.0", "", "1x1x1x1x2", DslError, "capacity_factor=0 must be > 0", "leave it out"),
    (", capacity_factor=-1", "", "1x1x1x1x2", DslError, "capacity_factor=-1 must be > 0", "e.g. capacity_factor=1.25"),
    (", bias_update=-0.1", "", "1x1x1x1x2", DslError, "bias_update=-0.1 must be >= 0", "0 turns it off"),
    ("", " @ep(roundrobin)", "1x1x1x1x2", ShardingError, "'roundrobin' is not a choice", "@ep(strided)"),
    ("", " @ep(0, 0, 1)", "1x1x1x1x2", ShardingError, "each of the 8 experts, 4 per rank", "@ep(contiguous)"),
    ("", " @ep(hierarchical, 3)", "1x1x1x1x4", ShardingError, "does not split evenly into nodes of 3", "ranks per node"),
])
def test_bad_moe_settings_name_the_numbers_and_the_line(extra, annotation, mesh, error, message, hint) -> None:
    text = example_with(extra, annotation)
    with pytest.raises(error) as info:
        compile_text(text, mesh)
    assert message in info.value.message and hint in info.value.hint
    assert info.value.loc is not None and info.value.loc.line == 48 and "moe(" in info.value.loc.text


def test_top_k_larger_than_the_experts_and_an_unknown_score(tmp_path, capsys) -> None:
    with pytest.raises(ShapeError, match=r"top_k=9 must be between 1 and experts=8") as info:
        compile_text(example_with().replace("top_k=2", "top_k=9"), "1x1x1x1x1")
    assert info.value.hint == "choose top_k in 1..8, or add experts"
    with pytest.raises(DslError, match='score="tanh" is not a choice'):
        compile_text(example_with().replace('"softmax"', '"tanh"'), "1x1x1x1x1")
    model = tmp_path / "moe.5d"
    model.write_text(open(EXAMPLE).read())
    assert main(["compile", str(model), "--mesh", "1x1x1x1x3", "-o", str(tmp_path / "p.json")]) == 2
    err = " ".join(capsys.readouterr().err.split())
    assert f"{model}:48:" in err and "experts=8 is not divisible by ep=3" in err and "^" in err
    assert "Traceback" not in err


def test_verify_prints_the_expert_load(worker_pool, capsys) -> None:
    report = verify(parse_model(example_with(", capacity_factor=0.5"), filename=EXAMPLE), "2x1x1x1x2", worker_pool)
    routed = [sum(sum(load.routed) for load in step.values()) for step in report.expert_load]
    assert routed == [2 * 8 * 8 * 2] * 2  # layers x tokens x top-k, every step
    _print_report(report, TOL)
    out = capsys.readouterr().out
    assert "expert load imbalance per MoE layer (the busiest expert's assignments over all ranks / the mean):" in out
    assert "step 1: layers.0.r " in out and "dropped" in out
    assert "routing: tokens per expert the same as the single-device run" in out


def test_the_activation_estimate_counts_what_the_experts_keep() -> None:
    """The plan's activation estimate against the bytes autograd really saves in a
    forward (parameters and inputs aside, each storage once), for a model that is mostly
    one MoE layer on one device: equal (the save rule of `fivedc/estimates/saved.py`: routing,
    the routed rows, the experts' inner activations, the rows sent back)."""
    from fivedc.runtime.program import Program, init_params, make_inputs
    from fivedc.runtime.saved import SavedRecorder, saving_scope

    text = moe_model_text(batch=4, seq=64, hidden=64, experts=8, expert_ffn=64, vocab=32, layers=1, top_k=2,
                          score="softmax", swiglu=True, shared=False, down_first=False, extra=", aux_loss=0.1")
    plan = compile_graph(parse_model(text, filename="m.5d"), CompileOptions(mesh=single_device_mesh(), dtype="fp32"))
    params = {n: t.requires_grad_() for n, t in init_params(plan.graph, seed=0, dtype=torch.float32).items()}
    inputs = make_inputs(plan.graph, seed=0, dtype=torch.float32)
    recorder = SavedRecorder(exclude=[*params.values(), *inputs.values()])
    with saving_scope(recorder):
        Program(plan.graph, KernelContext(plan.graph, plan.mesh, plan.mesh.coords(0))).loss(params, inputs)
    assert recorder.bytes == plan.memory.activations