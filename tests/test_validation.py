"""The step-time and memory models against published training runs (benchmarks/validation.py),
and the attention kernel those runs used (`--attention-kernel math`) as part of the plan.

The published figures are the papers' (Narayanan et al. 2021 table 1, Korthikanti et al.
2022 tables 2, 3 and 5); the bounds are issue 35's acceptance, so a change that makes the
model optimistic or pessimistic again fails here.
"""

from __future__ import annotations

import math
import statistics
import sys
from pathlib import Path

import pytest

from fivedc.cli.main import main
from fivedc.cli.plan_check import check_plan, load_plan
from fivedc.errors import FivedcError
from fivedc.estimates.activations import layer_saves
from fivedc.estimates.breakdown import plan_breakdown
from fivedc.estimates.saved import SaveContext
from fivedc.frontends.dsl_file import parse_model
from fivedc.ir.graph import Op, Repeat, walk_ops
from fivedc.ir.hardware import hardware
from fivedc.ir.mesh import Mesh
from fivedc.passes.base import CompileOptions
from fivedc.pipeline import compile_graph
from fivedc.plan.work_counts import attention_seconds, step_work
from random_models import model_text

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "benchmarks"))
import validation  # noqa: E402


@pytest.fixture(scope="module")
def published() -> list:
    return validation.rows()


def test_step_time_holds_to_the_published_runs(published) -> None:
    tables = {r.run.key: r.ratio for r in published if not r.run.held_out}
    assert len(tables) == 18
    assert 0.93 <= statistics.median(tables.values()) <= 1.07, tables
    assert all(0.80 <= ratio <= 1.20 for ratio in tables.values()), tables


def test_runs_the_model_was_not_built_on_stay_within_thirty_percent(published) -> None:
    """MT-NLG 530B, BLOOM 176B, Llama 3 405B and torchtitan's FSDP runs (on A100s, and with
    async TP on Meta's 500 W H100s): every run within issue 35's 0.70-1.30, the median (0.87)
    within its 0.85-1.15. The median rests on the async TP row's GPU, whose peak is derived
    (the h100-gt profile): at the H100 SXM's peak it is 0.83 (the next test)."""
    held_out = {r.run.key: r.ratio for r in published if r.run.held_out}
    assert len(held_out) == 11
    assert all(0.70 <= ratio <= 1.30 for ratio in held_out.values()), held_out
    assert 0.85 <= statistics.median(held_out.values()) <= 1.15, held_out


def test_meta_h100s_peak_is_the_dies_at_500_w_and_the_table_shows_either_bound(published) -> None:
    """torchtitan's H100 pages ran on 96 GB HBM2e H100s at 500 W whose peak is "between SXM
    and NVL": h100-gt's is the die's clock at 500 W on a power law through the two data sheets
    (NVL 835.5 TFLOP/s at 400 W, SXM 989.4 at 700 W), and the table reprices its rows at each
    bound, so a reader sees what the held-out median owes to that choice."""
    gt, sxm = hardware("h100-gt"), hardware("h100")
    (_, (nvl_peak, nvl_fp8)), (_, (sxm_peak, sxm_fp8)) = validation.PEAK_BOUNDS
    assert sxm_peak == sxm.bf16_flops and sxm_fp8 == sxm.fp8_flops
    law = nvl_peak * (500 / 400) ** (math.log(sxm_peak / nvl_peak) / math.log(700 / 400))
    assert gt.bf16_flops == pytest.approx(law, rel=1e-4) and gt.fp8_flops == pytest.approx(2 * law, rel=1e-3)
    assert (gt.hbm_bytes_per_s, gt.sm_count) == (2.4e12, sxm.sm_count) and gt.memory_gib > sxm.memory_gib
    titan_h100 = {run.key for run in (*validation.RUNS, *validation.FP8_RUNS) if run.source.startswith(
        ("torchtitan benchmarks/llama3_h100", "torchtitan benchmarks/asyncTP"))}
    assert len(titan_h100) == 13
    assert all(run.gpu == "h100-gt" for run in (*validation.RUNS, *validation.FP8_RUNS) if run.key in titan_h100)
    nvl, _, at_sxm, _ = validation.peak_bounds(published)
    median = [float(line.split("median ")[1].split(";")[0]) for line in (nvl, at_sxm)]
    held = statistics.median(r.ratio for r in published if r.run.held_out)
    assert median[0] > held > median[1], (nvl, at_sxm)


def test_sp_and_selective_gain_what_korthikanti_measured(published) -> None:
    found = validation.speedups(published)
    assert [model for model, _, _ in found] == ["22b", "175b", "530b", "1t"]
    for model, predicted, measured in found:
        assert abs(predicted / measured - 1) <= 0.10, (model, predicted, measured)


def test_activations_per_layer_are_korthikantis_by_technique() -> None:
    found = validation.activation_rows()
    assert len(found) == len(validation.ACTIVATION_FORMULAS)
    for name, ours, paper in found:
        assert abs(ours / paper - 1) <= 0.10, (name, ours, paper)


def test_the_largest_published_pipeline_is_within_what_fivedc_plans_for() -> None:
    """Narayanan et al.'s 1T run: 512 microbatches through 64 stages (32768 schedule slots)."""
    from fivedc.ir.limits import MAX_SLOTS

    def chunks(run) -> int:
        flags = run.flags.split()
        virtual = int(flags[flags.index("--virtual") + 1]) if "--virtual" in flags else 1
        return int(run.mesh.split("x")[1]) * virtual

    assert max(r.microbatches * chunks(r) for r in validation.RUNS) == 512 * 64 <= MAX_SLOTS


def test_the_measured_step_follows_from_the_papers_flop_count() -> None:
    """Table 1's 1T row: 163 TFLOP/s on 3072 GPUs at batch 3072 is a 103 s step."""
    assert validation.narayanan_seconds(128, 25600, 3072, 3072, 163) == pytest.approx(102.6, abs=0.1)


# ---- the attention kernel ----------------------------------------------------------------------
TEXT = model_text(style="llama", batch=8, seq=64, heads=4, kv_heads=2, head_dim=16, ffn=128, vocab=256, layers=2,
                  causal=True)


def _plan(mesh: str = "1x1x2x1x1", **options):
    options = {"hardware": hardware("a100"), **options}
    return compile_graph(parse_model(TEXT, filename="m.5d"), CompileOptions(mesh=Mesh.parse(mesh), **options))


def _attention_ops(plan) -> list[Op]:
    return [op for op, _ in walk_ops(plan.graph.body) if isinstance(op, Op) and op.kind == "attention"]


def test_the_math_kernel_is_recorded_priced_and_keeps_the_scores() -> None:
    flash, math = _plan(), _plan(attention_kernel="math")
    assert [op.attr("kernel") for op in _attention_ops(flash)] == [None]  # flash: no attribute
    assert [op.attr("kernel") for op in _attention_ops(math)] == ["math"]
    assert math.time.step_seconds > flash.time.step_seconds
    saves = []
    for plan in (flash, math):
        c = SaveContext.of(plan.graph, plan.mesh, dtype=plan.dtype, dtype_bytes=2)
        repeat = next(item for item in plan.graph.body.items if isinstance(item, Repeat))
        layer = layer_saves(c, repeat)
        saves.append(layer.own + sum(b for _, b in layer.args))
    batch, heads, seq = 8, 4 // 2, 64  # tp 2 splits the heads
    lse = batch * heads * seq * 4  # flash's log-sum-exp per row, float32
    assert saves[1] - saves[0] == batch * heads * seq * seq * 2 - lse  # the softmax's output, bf16


def test_a_plan_with_the_math_kernel_checks_and_the_option_is_refused_when_unknown(tmp_path, capsys) -> None:
    out = tmp_path / "p.json"
    assert main(["compile", "examples/tiny_llama.5d", "--mesh", "1x1x2x1x1", "--attention-kernel", "math",
                 "-q", "-o", str(out)]) == 0
    plan = load_plan(out)
    check_plan(plan)  # recompiled from its own graph: the kernel is on the op
    assert main(["check", str(out)]) == 0  # and from its model file, with the option read off the ops
    assert [op.attr("kernel") for op in _attention_ops(plan)] == ["math"]
    with pytest.raises(FivedcError, match="attention kernel"):
        CompileOptions(mesh=Mesh.parse("1x1x1x1x1"), attention_kernel="xformers")


def test_flash2_is_flash_pinned_to_flashattention_2_slower_on_hopper_only(tmp_path) -> None:
    """FlashAttention-2 reaches 35 % of an H100's peak (the FlashAttention-3 paper's abstract)
    where the fused kernel SDPA picks reaches the profile's 55 %; on an A100 it is that kernel.
    It keeps what flash keeps, and a plan with it checks from its model file."""
    flash, flash2 = _plan(), _plan(attention_kernel="flash2")
    assert [op.attr("kernel") for op in _attention_ops(flash2)] == ["flash2"]
    assert flash2.time.step_seconds == flash.time.step_seconds  # an A100
    assert flash2.memory == flash.memory
    long = model_text(style="llama", batch=8, seq=2048, heads=4, kv_heads=2, head_dim=64, ffn=128, vocab=256,
                      layers=2, causal=True)  # attention's FLOPs, not its bytes, bound its time
    h100 = {kernel: compile_graph(parse_model(long, filename="m.5d"), CompileOptions(
        mesh=Mesh.parse("1x1x2x1x1"), hardware=hardware("h100"), attention_kernel=kernel)) for kernel in ("flash", "flash2")}
    attention = {kernel: plan_breakdown(plan).seconds("attention") for kernel, plan in h100.items()}
    assert attention["flash2"] == pytest.approx(attention["flash"] * 0.55 / 0.35, rel=1e-9)
    # `fivedc rehearse`'s estimate column prices each op at its kernel's share too
    counted = {kernel: attention_seconds(plan, hardware("h100")) for kernel, plan in h100.items()}
    flops = step_work(h100["flash"]).attention_flops
    assert counted["flash"] == pytest.approx(flops / (hardware("h100").bf16_flops * 0.55), rel=1e-9)
    assert counted["flash2"] == pytest.approx(flops / (hardware("h100").bf16_flops * 0.35), rel=1e-9)
    out = tmp_path / "p.json"
    assert main(["compile", "examples/tiny_llama.5d", "--mesh", "1x1x2x1x1", "--attention-kernel", "flash2",
                 "--gpu", "h100", "-q", "-o", str(out)]) == 0
    assert main(["check", str(out)]) == 0


def test_a_profiles_flash2_share_is_optional_and_checked(tmp_path) -> None:
    text = (ROOT / "fivedc" / "ir" / "hardware.toml").read_text()
    block = text[text.index("[a100]"):text.index("[a100-opa]")]
    own = tmp_path / "own.toml"
    own.write_text(block.replace("[a100]", "[mine]"))
    assert hardware("mine", (own,)).attention_share("flash2") == hardware("a100").attention_efficiency
    own.write_text(block.replace("[a100]", "[mine]") + "flash2_efficiency = 1.5\n")
    with pytest.raises(FivedcError, match="flash2_efficiency = 1.5 must be a number in"):
        hardware("mine", (own,))


def test_an_unknown_kernel_in_the_model_is_a_located_error() -> None:
    text = TEXT.replace("causal=true", 'causal=true, kernel="sparse"')
    assert 'kernel="sparse"' in text
    with pytest.raises(FivedcError, match="attention kernel 'sparse'") as error:
        compile_graph(parse_model(text, filename="m.5d"), CompileOptions(mesh=Mesh.parse("1x1x1x1x1")))
    assert error.value.loc is not None


@pytest.mark.parametrize("mesh, kernel", [("2x1x2x1x1", "math"), ("1x1x1x2x1", "math"), ("2x1x2x1x1", "flash2")])
def test_the_math_and_flash2_kernels_train_as_one_device(mesh: str, kernel: str) -> None:
    """math: on one device SDPA's math backend, across cp the blocks by explicit matmuls.
    flash2: SDPA pinned to FlashAttention-2 on a GPU, what SDPA picks on a CPU."""
    assert main(["verify", "examples/tiny_llama.5d", "--mesh", mesh, "--attention-kernel", kernel,
                 "--steps", "2"]) == 0


def test_the_search_reports_the_error_it_measured(published, capsys) -> None:
    """fivedc search's figures are this benchmark's, to two decimals, and it names the ties."""
    from fivedc.estimates.model_error import STEP_TIME

    ratios = [r.ratio for r in published]
    assert (STEP_TIME.runs, STEP_TIME.median, STEP_TIME.low, STEP_TIME.high) == (
        len(ratios), round(statistics.median(ratios), 2), round(min(ratios), 2), round(max(ratios), 2))
    assert main(["search", "examples/gpt.5d", "--gpus", "8", "--gpu", "h100"]) == 0
    out = capsys.readouterr().out
    flat = " ".join(out.split())  # the lines as printed, wrapped to 100 columns
    assert STEP_TIME.line() in flat and f"±{STEP_TIME.spread:.0%} on {STEP_TIME.runs} published runs" in flat
    assert f"are within {STEP_TIME.spread:.0%} of the best (at least: --explain scores every tie): a tie" in flat
    assert main(["search", "examples/gpt.5d", "--gpus", "8", "--gpu", "h100", "--explain"]) == 0
    flat = " ".join(capsys.readouterr().out.split())
    assert f"are within {STEP_TIME.spread:.0%} of the best: a tie" in flat  # every tie scored: the exact count


def test_what_runs_beside_compute_holds_some_of_its_sms(tmp_path) -> None:
    """A collective hidden beside compute still costs the SMs it holds: with the profile's
    share the step is longer than with none, by no more than the share of what hides."""
    import dataclasses

    from fivedc.ir.hardware import HardwareError, profiles

    h100 = hardware("h100")
    assert 0.1 < h100.overlap_sm_share < 0.15
    free = dataclasses.replace(h100, overlap_sm_share=0.0)
    graph = parse_model(TEXT, filename="m.5d")
    steps = [compile_graph(graph, CompileOptions(mesh=Mesh.parse("2x1x2x1x1"), sequence_parallel=True,
                                                 hardware=hw)).time.step_seconds for hw in (free, h100)]
    assert steps[1] > steps[0]
    mine = tmp_path / "gpus.toml"
    fields = dict(bf16_flops=1e12, hbm_bytes_per_s=1e12, memory_gib=8, reserved_gib=1, nvlink_bytes_per_s=1e11,
                  internode_bytes_per_s=1e10, gpus_per_node=8, matmul_efficiency=0.5, attention_efficiency=0.5,
                  memory_efficiency=0.5, link_efficiency=0.5, nvlink_latency_s=1e-6, internode_latency_s=1e-6)
    body = "\n".join(f"{k} = {v}" for k, v in fields.items())
    mine.write_text(f"[old]\n{body}\n")
    assert profiles((mine,))["old"].overlap_sm_share == 0.0  # optional: a profile without it hides for free
    mine.write_text(f"[bad]\n{body}\noverlap_sm_share = 1.5\n")
    with pytest.raises(HardwareError, match="overlap_sm_share = 1.5 must be a number in"):
        profiles((mine,))


def test_deepseek_v3_under_zero3_counts_what_a_moe_layers_backward_holds_at_once() -> None:
    """The layout the search once proposed for DeepSeek-V3 at 77.6 GiB (issue 35): at the last
    MoE layer's backward a rank holds its shards, every layer's kept input, the layer's
    experts gathered again and their gradients, and the layer rebuilt (full recomputation),
    all at once: over an H100's memory, so the plan must not say it fits."""
    from fivedc.cli.main import build_parser
    from fivedc.cli.shared import compile_options, load_graph
    from fivedc.estimates.memory import rank_activations
    from fivedc.ir.graph import walk_params
    from fivedc.pipeline import PIPELINE, run_passes
    from fivedc.plan.planning import Draft, assemble

    args = build_parser().parse_args(["compile", "examples/deepseek_v3.5d", "--mesh", "1024x1x2x1x1", "--sp",
                                      "--zero", "3", "--recompute", "full", "--gpu", "h100"])
    options = compile_options(args, Mesh.parse(args.mesh), dtype=args.dtype)
    plan = assemble(run_passes(Draft(load_graph("examples/deepseek_v3.5d")), options, PIPELINE[:-1]), options)
    graph, mesh, m = plan.graph, plan.mesh, plan.memory.busiest
    moe = next(item for item in graph.body.items if isinstance(item, Repeat) and item.name == "moe")
    layer = sum(graph.local_numel(p.dims, p.sharding, mesh) * 2 for p, r in walk_params(graph.body) if r is moe)
    tokens = graph.dim("batch") // 1024 * graph.dim("seq") // 2  # per rank: dp splits the batch, SP the sequence
    inputs = (3 + 58) * tokens * graph.dim("hidden") * 2  # each layer keeps its input, bf16
    _, regions = rank_activations(graph, mesh, dtype=plan.dtype, dtype_bytes=2, pipeline=None, recompute="full")
    together = m.params + m.grads + m.optimizer + inputs + 2 * layer + regions[0]
    assert layer > 10 * 2**30  # 256 experts' three matrices at tp 2
    assert m.transient >= 2 * layer + regions[0]  # the gathered layer is beside the rebuilt one
    assert m.total >= together > plan.time.hardware.usable_bytes


def test_deepseek_v3_is_held_out_as_an_fp8_run_at_its_published_layout() -> None:
    """180K H800 GPU hours per trillion tokens (DeepSeek-V3 report, table 1) at a step of
    15360 x 4096 tokens on 2048 GPUs; the layout 2x16x1x1x64 with 120 microbatches of one
    sequence per data-parallel rank; compiled with --fp8, apart from the model's error."""
    run = next(run for run in validation.FP8_RUNS if run.key == "deepseek-v3-2048")
    assert run.measured_s == pytest.approx(15360 * 4096 / (2048 * 1e12 / (180e3 * 3600)))
    assert run.microbatches == 120 and "--fp8" in run.argv() and run.gpu == "h800"
    assert run.key not in {r.key for r in validation.RUNS}


def test_torchtitans_float8_runs_are_held_out_at_their_tokens_per_gpu() -> None:
    """torchtitan's H100 tables count a rank's tokens over the step x cp x tp x pp: Llama 3.1
    8B at 32K on 8 GPUs, 3890 tokens/s a GPU, is a step of 32768 / 3890 s; 405B on 512 (tp 8,
    pp 8, 8 microbatches of 4 from a local batch of 32), 100 tokens/s, 32 x 8192 / (100 x 64)."""
    runs = {run.key: run for run in validation.FP8_RUNS}
    assert runs["titan-h100-8b-32k"].measured_s == pytest.approx(32768 / 3890)
    big = runs["titan-h100-405b-1f1b"]
    assert big.measured_s == pytest.approx(32 * 8192 / (100 * 64)) and big.microbatches == 8
    assert all("--fp8" in run.argv() and run.key not in {r.key for r in validation.RUNS} for run in runs.values())


def test_torchtitans_memory_readings_bound_the_busiest_ranks_tensors() -> None:
    """torchtitan's H100 tables give the busiest GPU's reserved peak (the caching allocator's,
    its free cached blocks included), so fivedc's busiest rank's tensors are below it; how far
    below is the memory model's published error (0.65-0.85 when this was written: fivedc is
    optimistic there, and the bound keeps it from getting worse or counting twice)."""
    found = [validation.row(run) for run in validation.FP8_RUNS if run.measured_gib is not None]
    assert len(found) == 11 and all(r.run.gpu == "h100-gt" for r in found)
    ratios = {r.run.key: r.predicted_gib / r.run.measured_gib for r in found}
    assert all(0.60 <= ratio <= 1.0 for ratio in ratios.values()), ratios
    text = validation.memory_table(found)
    assert "| titan-h100-8b-32k | h100-gt | 83.9 |" in text and "- Memory, predicted / measured: 11 runs" in text
