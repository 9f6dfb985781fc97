"""Float8 linears (`--fp8`, torchao's tensorwise recipe): plan, pricing, memory and runtime.

The recipe's casts are checked against their formula with torch's own float8 dtypes, the
plan against one device in float64 (a float8 run agrees with its reference to
reassociation, and differs from the bf16 plan's numbers), the price against the profile's
float8 peak and torchao's count of the casts' traffic.
"""

from __future__ import annotations

import json
from dataclasses import replace

import pytest
import torch

from fivedc.errors import FivedcError, PlanError
from fivedc.estimates.costs import fp8_cast_bytes, op_times, op_work
from fivedc.estimates.gemm import gemms_seconds
from fivedc.estimates.saved import SaveContext
from fivedc.frontends.dsl_file import load_model
from fivedc.ir.graph import Op, walk_ops
from fivedc.ir.hardware import hardware
from fivedc.ir.mesh import Mesh
from fivedc.passes.base import CompileOptions
from fivedc.passes.fp8 import is_fp8
from fivedc.pipeline import compile_graph
from fivedc.runtime.fp8 import E4M3, E5M2, Fp8Linear, Operand, Fp8Cast
from fivedc.runtime.train import TrainSettings
from fivedc.runtime.verify import reference_run, verify_plan

TOL = 1e-10


def _compile(mesh: str, *, fp8: bool = True, dtype: str = "fp64", gpu: str | None = None, **kw):
    graph = load_model("examples/gpt.5d")
    return compile_graph(graph, CompileOptions(mesh=Mesh.parse(mesh), dtype=dtype, fp8=fp8,
                                               hardware=hardware(gpu) if gpu else None, **kw))


def _linears(plan):
    return [op for op, _ in walk_ops(plan.graph.body) if isinstance(op, Op) and op.kind == "linear"]


# ---- the plan -------------------------------------------------------------------------------
def test_every_linear_but_the_head_runs_in_float8():
    plan = _compile("2x1x2x1x1", sequence_parallel=True)
    fp8 = {op.args[1]: is_fp8(op) for op in _linears(plan)}
    assert fp8 == {"wq": True, "wk": True, "wv": True, "wo": True, "w_fc": True, "w_proj": True, "w_head": False}
    assert plan.fp8 and not _compile("2x1x2x1x1", fp8=False).fp8


def test_amax_is_all_reduced_over_the_shards_within_a_sample_only():
    """Column-parallel weights and their output gradients are split over tp, row-parallel
    inputs and weights too; nothing is reduced over dp (each rank's rows scale apart)."""
    plan = _compile("2x1x2x1x1", sequence_parallel=True)
    amax = {(c.tensor, c.phase.value) for op in _linears(plan) for c in op.collectives if c.reason.startswith("fp8:")}
    assert ("wq", "forward") in amax and ("a", "forward") in amax and ("wo", "forward") in amax
    assert not any(t == "h" for t, _ in amax)  # the column-parallel input is whole (gathered)
    assert all(c.axes == ("tp",) for c in plan.collectives if c.reason.startswith("fp8:"))
    assert not any(c.reason.startswith("fp8:") for c in _compile("2x1x1x1x1").collectives)


def test_a_saved_fp8_plan_loads_and_an_edit_is_refused(tmp_path):
    from fivedc.cli.plan_check import load_plan

    plan = _compile("2x1x2x1x1", dtype="bf16", sequence_parallel=True)
    path = tmp_path / "plan.json"
    plan.save(path)
    assert load_plan(path).fp8
    data = json.loads(path.read_text())
    data["fp8"] = False  # the ops still say float8: not what the options compile to
    path.write_text(json.dumps(data))
    with pytest.raises(PlanError, match="not the plan its model compiles to"):
        load_plan(path)


def test_the_diff_shows_the_option():
    from fivedc.plan.diff import diff_plans

    changes = {v.name: (v.a, v.b) for v in diff_plans(_compile("2x1x1x1x1", fp8=False),
                                                                _compile("2x1x1x1x1")).options}
    assert changes["fp8"] == (False, True)


def test_refused_where_it_cannot_hold():
    with pytest.raises(FivedcError, match="no float8 tensor cores"):
        _compile("1x1x1x1x1", dtype="bf16", gpu="a100")
    graph = load_model("examples/gpt.5d")
    small = replace(graph, dims=tuple((n, 12 if n == "hidden" else v) for n, v in graph.dims))
    with pytest.raises(FivedcError, match="no linear of gpt can run in float8"):
        compile_graph(small, CompileOptions(mesh=Mesh.parse("1x1x1x1x1"), fp8=True))


# ---- the price ------------------------------------------------------------------------------
def test_a_float8_linear_runs_at_the_fp8_peak_plus_its_casts():
    hw = hardware("h100")
    plan = _compile("1x1x2x1x1", dtype="bf16", gpu="h100")
    c = SaveContext.of(plan.graph, plan.mesh, dtype="bf16", dtype_bytes=2)
    op = next(op for op in _linears(plan) if op.args[1] == "w_fc")
    work = op_work(c, op)
    fwd_casts, bwd_casts = fp8_cast_bytes(c, op)
    x, w, out = 4 * 8 * 32, 32 * 128 // 2, 4 * 8 * 128 // 2  # M K, K N, M N on this rank
    assert (fwd_casts, bwd_casts) == (x * 4 + w * 6, out * 4)  # torchao's roofline_utils count at 2 bytes
    forward, backward, weight = op_times(c, op, hw)
    fp8_peak = replace(hw, bf16_flops=1979e12)  # the GEMM model at the float8 peak, float8 operands
    (gemm,) = work.gemms
    matmul, dx, dw = gemms_seconds((gemm,), fp8_peak, element_bytes=1)
    assert forward == pytest.approx(matmul + fwd_casts / hw.op_bytes_per_s)
    assert (backward, weight) == pytest.approx((dx + bwd_casts / hw.op_bytes_per_s, dw))
    flat = replace(hw, sm_count=None, matmul_tiles=())  # untiled: the FLOPs at the flat fp8 rate
    assert op_times(c, op, flat)[2] == pytest.approx(work.matmul_flops / (1979e12 * hw.matmul_efficiency))


def test_a_large_model_steps_faster_and_mfu_keeps_the_bf16_peak():
    graph = load_model("examples/llama3_405b.5d")
    options = CompileOptions(mesh=Mesh.parse("128x16x8x1x1"), sequence_parallel=True, zero=2, schedule="interleaved",
                             microbatches=16, hardware=hardware("h100"))
    bf16, fp8 = (compile_graph(graph, replace(options, fp8=f)).time for f in (False, True))
    assert fp8.model_flops == bf16.model_flops
    assert fp8.mfu / bf16.mfu == pytest.approx(bf16.step_seconds / fp8.step_seconds)
    assert 1.15 < bf16.step_seconds / fp8.step_seconds < 1.6  # matmuls ~2x, the rest not


# ---- memory ---------------------------------------------------------------------------------
def test_the_scales_are_kept_and_the_activations_are_the_linears():
    bf16, fp8 = _compile("1x1x1x1x1", fp8=False, dtype="bf16"), _compile("1x1x1x1x1", dtype="bf16")
    kept = len([op for op in _linears(fp8) if is_fp8(op)]) * 2  # six a layer, two layers
    assert fp8.memory.activations - bf16.memory.activations == kept * 2 * 4  # two float32 scales each


# ---- the recipe's numbers -------------------------------------------------------------------
def test_a_cast_is_torchaos_formula():
    x = torch.tensor([[0.5, -3.0], [1e-3, 2.0]], dtype=torch.float64)
    op = Operand(E4M3)
    scale = op.scale(x)
    assert scale.item() == pytest.approx(448.0 / 3.0, rel=1e-7) and scale.dtype == torch.float32
    expected = (torch.clamp(x * scale.double(), -448, 448).to(E4M3).double() / scale.double())
    assert torch.equal(op.cast(x, scale), expected)
    assert not torch.equal(op.cast(x, scale), x)  # a real rounding: e4m3 keeps 3 mantissa bits
    blocks = Operand(E5M2, batch=0, blocks=2).scale(x)  # each row its own amax
    assert blocks.flatten().tolist() == pytest.approx([57344 / 3.0, 57344 / 2.0], rel=1e-7)


def test_the_backward_is_the_recipes_three_float8_matmuls():
    torch.manual_seed(0)
    x = torch.randn(6, 16, dtype=torch.float64, requires_grad=True)
    w = torch.randn(16, 32, dtype=torch.float64, requires_grad=True)
    cast = Fp8Cast(Operand(E4M3), Operand(E4M3), Operand(E5M2))
    y = Fp8Linear.apply(x, w, 1, cast)
    dy = torch.randn_like(y)
    y.backward(dy)
    q = lambda o, t: o.cast(t, o.scale(t))  # noqa: E731
    x8, w8, dy8 = q(cast.x, x.detach()), q(cast.w, w.detach()), q(cast.dy, dy)
    assert torch.allclose(y, x8 @ w8, rtol=0, atol=1e-12)
    assert torch.allclose(x.grad, dy8 @ w8.T, rtol=0, atol=1e-12)
    assert torch.allclose(w.grad, x8.T @ dy8, rtol=0, atol=1e-12)


# ---- one device against a layout ------------------------------------------------------------
@pytest.mark.parametrize("mesh,kw", [("2x1x2x1x1", {"sequence_parallel": True}),
                                     ("1x1x2x2x1", {"sequence_parallel": True}),
                                     ("1x2x2x1x1", {"microbatches": 2})])
def test_a_float8_plan_matches_one_device(mesh, kw, worker_pool):
    plan = _compile(mesh, **kw)
    reference = _compile("1x1x1x1x1")
    report = verify_plan(plan, reference, settings=TrainSettings(steps=2), pool=worker_pool)
    assert report.max_error <= TOL, report
    plain = reference_run(_compile("1x1x1x1x1", fp8=False), TrainSettings(steps=2))
    assert abs(report.losses[0] - plain.losses[0]) > 1e-6  # float8 changes the numbers


def test_the_reference_scales_each_ranks_rows_apart():
    """At dp=2 one device must scale the two halves of the batch apart; scaling the whole
    batch at once gives other numbers (what a dp run would then be compared against)."""
    reference = _compile("1x1x1x1x1")
    whole, halves = (reference_run(reference, TrainSettings(steps=1), fp8_blocks=b).losses[0] for b in (1, 2))
    assert whole != halves


# ---- the rehearsal (the runtime on the meta device) against the estimate ------------------------
@pytest.mark.parametrize("model,mesh", [("examples/gpt.5d", "2x1x2x1x1")])
def test_a_rehearsed_float8_rank_holds_what_the_estimate_says(model, mesh):
    from fivedc.runtime.rehearse import rehearse_plan

    plan = compile_graph(load_model(model), CompileOptions(mesh=Mesh.parse(mesh), sequence_parallel=True, fp8=True))
    (rehearsed,) = rehearse_plan(plan).classes
    estimated = plan.memory.ranks[0]
    assert rehearsed.peak == pytest.approx(estimated.total, rel=0.05)
    assert rehearsed.at_peak["params"] == estimated.params


def test_the_casts_are_memory_bound_terms_of_the_step():
    """--explain's terms: a float8 layer's matmul term is its matmuls at the fp8 peak, its
    casts are added to the memory-bound ops (not hidden in the matmuls)."""
    from fivedc.estimates.unit_costs import unit_times
    from fivedc.passes.stages import units

    hw = hardware("h100")
    (bf16, fp8) = (_compile("1x1x1x1x1", fp8=f, dtype="bf16", gpu="h100") for f in (False, True))
    layer = {}
    for name, plan in (("bf16", bf16), ("fp8", fp8)):
        c = SaveContext.of(plan.graph, plan.mesh, dtype="bf16", dtype_bytes=2)
        all_units = units(plan.graph)
        k = next(i for i, u in enumerate(all_units) if u.layer is not None)
        layer[name] = (c, plan, dict(unit_times(c, plan.graph, all_units, hw, recompute="none")[k].parts.forward))
    c, plan, terms = layer["fp8"]
    casts = sum(fp8_cast_bytes(c, op)[0] for op in _linears(plan) if is_fp8(op)) / hw.op_bytes_per_s
    assert terms["memory-bound ops"] - layer["bf16"][2]["memory-bound ops"] == pytest.approx(casts)
    gemms = tuple(g for op in _linears(plan) if is_fp8(op) for g in op_work(c, op).gemms)
    assert terms["matmuls"] == pytest.approx(gemms_seconds(gemms, replace(hw, bf16_flops=hw.fp8_flops),
                                                           element_bytes=1)[0])
