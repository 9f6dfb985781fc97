"""Activation recomputation: the runtime recomputes, keeps less, and computes the same.

On one device: under `full` every op of a layer runs twice per step (forward, then
again in backward) and autograd saves no tensor a layer computes but the one it
hands on; under `selective` only attention runs twice and none of its internals is
saved. Across ranks (float64, gloo, the shared worker pool): losses, gradients and
updated parameters with `selective` and `full` equal the single-device run without
recomputation on dp, tp+sp, cp (ring and all-gather), pp (1F1B, ZB-H1's split
backward) and ZeRO-3 meshes, and MoE layers count their tokens once. Then the option's
way through the CLI, the plan file, the summary, `fivedc diff` and the DSL.
"""

from __future__ import annotations

import json
import sys
from collections import Counter

import pytest
import torch
from hypothesis import HealthCheck, given, settings, strategies as st

from fivedc.errors import DslError, PlanError
from fivedc.frontends.dsl_file import load_model, parse_model
from fivedc.ir.graph import Op, Repeat, walk_ops
from fivedc.ir.mesh import Mesh
from fivedc.passes.base import CompileOptions
from fivedc.pipeline import compile_graph
from fivedc.plan.execution_plan import ExecutionPlan
from fivedc.cli.plan_check import check_plan
from fivedc.runtime import program as program_module
from fivedc.runtime.kernel_context import KernelContext
from fivedc.runtime.program import Program, init_params, make_inputs
from fivedc.runtime.train import TrainSettings
from fivedc.runtime.verify import single_device_mesh, verify_plan
from random_models import draw_case, moe_model_text

TINY = "examples/tiny_llama.5d"
TOL = 1e-10


# ---- one device: what runs twice, what is saved --------------------------------------------
KERNELS = dict(program_module.KERNELS)  # the kernels themselves, before a test wraps them


def _one_step(recompute: str, monkeypatch) -> tuple[Counter, Counter, object]:
    """Forward and backward of tiny_llama on one device in float64: each op's kernel
    calls, and how many tensors autograd saved (outside recomputed regions) while its
    kernel ran in the forward."""
    plan = compile_graph(load_model(TINY), CompileOptions(mesh=single_device_mesh(), dtype="fp64",
                                                          recompute=recompute))
    calls, saves = Counter(), Counter()
    saved: list[int] = []

    def counted(kind):
        def kernel(ctx, op, args, dims):
            calls[op.out] += 1
            before = len(saved)
            out = KERNELS[kind](ctx, op, args, dims)
            saves[op.out] += len(saved) - before
            return out
        return kernel

    for kind in KERNELS:
        monkeypatch.setitem(program_module.KERNELS, kind, counted(kind))
    params = {n: t.requires_grad_() for n, t in init_params(plan.graph, seed=0, dtype=torch.float64).items()}
    ctx = KernelContext(plan.graph, plan.mesh, plan.mesh.coords(0))
    inputs = make_inputs(plan.graph, seed=0, dtype=torch.float64)
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(1) or t, lambda t: t):
        loss = Program(plan.graph, ctx, recompute=recompute).loss(params, inputs)
        forward_saves = Counter(saves)
        loss.backward()
    return calls, forward_saves, plan


def _ops(plan) -> tuple[set[str], set[str], set[str], int]:
    """(ops in the layers, top-level ops, attention ops, layers)."""
    repeat = next(item for item in plan.graph.body.items if isinstance(item, Repeat))
    body = {node.out for node, _ in walk_ops(repeat.body) if isinstance(node, Op)}
    top = {item.out for item in plan.graph.body.items if isinstance(item, Op)}
    attention = {node.out for node, _ in walk_ops(plan.graph.body) if isinstance(node, Op) and node.kind == "attention"}
    return body, top, attention, repeat.count


def test_none_runs_each_op_once_and_saves_inside_the_layers(monkeypatch) -> None:
    calls, saves, plan = _one_step("none", monkeypatch)
    body, top, attention, layers = _ops(plan)
    assert all(calls[n] == layers for n in body) and all(calls[n] == 1 for n in top)
    assert all(saves[n] > 0 for n in attention) and sum(saves[n] for n in body) > sum(saves[n] for n in attention)


def test_full_recompute_runs_each_layer_twice_and_saves_nothing_inside(monkeypatch) -> None:
    calls, saves, plan = _one_step("full", monkeypatch)
    body, top, _, layers = _ops(plan)
    assert all(calls[n] == 2 * layers for n in body)  # each layer: forward, then again in backward
    assert all(calls[n] == 1 for n in top)
    assert all(saves[n] == 0 for n in body) and sum(saves[n] for n in top) > 0


def test_selective_recompute_runs_attention_twice_and_saves_none_of_its_internals(monkeypatch) -> None:
    calls, saves, plan = _one_step("selective", monkeypatch)
    body, top, attention, layers = _ops(plan)
    assert all(calls[n] == 2 * layers for n in attention)
    assert all(calls[n] == layers for n in body - attention) and all(calls[n] == 1 for n in top)
    assert all(saves[n] == 0 for n in attention)
    none_calls, none_saves, _ = _one_step("none", monkeypatch)
    assert all(saves[n] == none_saves[n] for n in body - attention)  # the rest keeps what it kept


# ---- across ranks: the same numbers --------------------------------------------------------
def check(graph, pool, mesh: str, recompute: str, **options):
    plan = compile_graph(graph, CompileOptions(mesh=Mesh.parse(mesh), dtype="fp64", recompute=recompute, **options))
    reference = compile_graph(graph, CompileOptions(mesh=single_device_mesh(), dtype="fp64"))
    report = verify_plan(plan, reference, settings=TrainSettings(steps=2), pool=pool)
    assert report.max_error <= TOL, report
    assert report.losses[1] != report.losses[0]
    return report


MESHES = {  # name -> (mesh, options)
    "dp": ("2x1x1x1x1", {}),
    "tp+sp": ("2x1x2x1x1", dict(sequence_parallel=True)),
    "cp ring": ("1x1x1x4x1", dict(cp_attention="ring")),
    "cp allgather, tp": ("1x1x2x2x1", dict(cp_attention="allgather", sequence_parallel=True)),
    "pp 1f1b": ("1x2x1x1x1", dict(schedule="1f1b", microbatches=4)),
    "pp zb-h1": ("1x2x1x1x1", dict(schedule="zb-h1", microbatches=2)),
    "zero-3": ("2x1x1x1x1", dict(zero=3)),
    "zero-3, pp": ("2x2x1x1x1", dict(zero=3, microbatches=2)),
}


@pytest.mark.parametrize("recompute", ["selective", "full"])
@pytest.mark.parametrize("name", list(MESHES))
def test_recompute_matches_single_device(name: str, recompute: str, worker_pool) -> None:
    mesh, options = MESHES[name]
    check(load_model(TINY), worker_pool, mesh, recompute, **options)


@settings(max_examples=6, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(case=draw_case(max_world=4), recompute=st.sampled_from(["selective", "full"]))
def test_random_models_with_recompute_match_single_device(case, recompute: str, worker_pool) -> None:
    check(parse_model(case.text, filename="<random>"), worker_pool, case.mesh, recompute,
          sequence_parallel=case.sp)


def test_moe_layers_recomputed_route_and_count_once(worker_pool) -> None:
    """A recomputed MoE layer runs its all-to-alls again but records its tokens once:
    the load the run reports is the single-device run's."""
    text = moe_model_text(batch=4, seq=8, hidden=16, experts=4, expert_ffn=16, vocab=16, layers=2, top_k=2,
                          score="softmax", swiglu=True, shared=False, down_first=False,
                          extra=", aux_loss=0.01, bias_update=0.001")
    report = check(parse_model(text, filename="moe.5d"), worker_pool, "2x1x1x1x2", "full")
    assert report.expert_load and report.routing_matches


# ---- the option: CLI, plan file, summary, diff, DSL ------------------------------------------
def fivedc(capsys, *args: str) -> tuple[int, str, str]:
    """`fivedc ARGS` in this process: exit code, stdout, stderr (argparse's exit is code 2)."""
    from fivedc.cli.main import main

    try:
        code = main(list(args))
    except SystemExit as stop:
        code = stop.code
    out = capsys.readouterr()
    return code, out.out, " ".join(out.err.split())  # stderr wraps at 100 columns


def test_the_option_on_the_command_line_and_in_the_plan(tmp_path, capsys) -> None:
    path = tmp_path / "p.json"
    code, out, err = fivedc(capsys, "compile", TINY, "--mesh", "2x1x2x1x1", "--sp", "--recompute", "full",
                            "-o", str(path))
    assert code == 0, err
    flat = " ".join(out.split())
    assert "recompute full: 2 layers keep only their input; backward runs their forward again" in flat
    assert "each recomputed layer keeps only its input" in flat
    data = json.loads(path.read_text())
    assert data["recompute"] == "full"
    assert fivedc(capsys, "check", str(path))[0] == 0
    data["recompute"] = "none"  # an edit: the collectives (SP's re-gathers) and memory it records no longer match
    path.write_text(json.dumps(data))
    with pytest.raises(PlanError, match="collectives|memory"):
        check_plan(ExecutionPlan.load(path))
    code, _, err = fivedc(capsys, "compile", TINY, "--mesh", "1x1x1x1x1", "--recompute", "most",
                          "-o", str(tmp_path / "x.json"))
    assert code == 2 and "invalid choice: 'most'" in err and "Traceback" not in err
    assert not (tmp_path / "x.json").exists()


def test_a_saved_plan_keeps_its_recompute_and_diff_shows_a_change(tmp_path, capsys) -> None:
    a, b = tmp_path / "a.json", tmp_path / "b.json"
    for path, mode in ((a, "none"), (b, "selective")):
        assert fivedc(capsys, "compile", TINY, "--mesh", "2x1x1x1x1", "--recompute", mode, "-o", str(path))[0] == 0
    code, _, err = fivedc(capsys, "run", str(a), "--recompute", "full")
    assert code == 2 and "--recompute would change them" in err
    assert json.loads(fivedc(capsys, "diff", str(a), str(b), "--json")[1])["options"] == {
        "recompute": ["none", "selective"]}
    assert "recompute none -> selective" in fivedc(capsys, "diff", str(a), str(b))[1]


def test_the_model_and_its_layer_stacks_choose(tmp_path) -> None:
    text = open(TINY).read()
    annotated = text.replace("model tiny_llama {", "model tiny_llama @recompute(selective) {")
    graph = parse_model(annotated, filename="t.5d")
    assert compile_graph(graph, CompileOptions(mesh=single_device_mesh())).recompute == "selective"
    assert compile_graph(graph, CompileOptions(mesh=single_device_mesh(), recompute="none")).recompute == "none"
    stacked = parse_model(text.replace("repeat layers {", "repeat layers @recompute(full) {"), filename="t.5d")
    plan = compile_graph(stacked, CompileOptions(mesh=single_device_mesh()))
    full = compile_graph(load_model(TINY), CompileOptions(mesh=single_device_mesh(), recompute="full"))
    assert plan.recompute == "none" and plan.memory.activations == full.memory.activations
    for wrong, message in (("repeat layers @recompute(most) {", "needs one mode"),
                           ("repeat layers @recompute(full) @recompute(none) {", "given twice"),
                           ("x = embedding(tokens, wte)", None)):
        source = text.replace("repeat layers {", wrong) if message else text.replace(
            wrong, "x = embedding(tokens, wte) @recompute(full)")
        with pytest.raises(DslError, match=message or "not on a call"):
            parse_model(source, filename="t.5d")


def test_parallelize_takes_the_option() -> None:
    from fivedc.parallel.parallelize import compile_module

    sys.path.insert(0, "examples")
    try:
        from nanogpt import factory
    finally:
        sys.path.remove("examples")
    module, inputs = factory()
    _, plan = compile_module(module, inputs, mesh=Mesh.parse("2x1x1x1x1"), recompute="selective")
    assert plan.recompute == "selective"
