"""Property tests: training with the plan equals training on one device.

Random models and meshes (dp, tp in {1, 2, 4}, sequence parallel on and off,
world <= 8) run 2 AdamW steps in float64 on gloo worker processes; loss,
gradients and parameters must match the single-device run to 1e-10.
"""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings

from fivedc.frontends.dsl_file import load_model, parse_model
from fivedc.ir.graph import Repeat
from fivedc.ir.mesh import Mesh
from fivedc.passes.base import CompileOptions
from fivedc.pipeline import compile_graph
from fivedc.runtime.train import TrainSettings
from fivedc.runtime.verify import single_device_mesh, verify_plan
from random_models import Case, draw_case

TOL = 1e-10


def check(graph, mesh: str, sp: bool, pool) -> None:
    plan = compile_graph(graph, CompileOptions(mesh=Mesh.parse(mesh), sequence_parallel=sp, dtype="fp64"))
    reference = compile_graph(graph, CompileOptions(mesh=single_device_mesh(), dtype="fp64"))
    report = verify_plan(plan, reference, settings=TrainSettings(steps=2), pool=pool)
    assert report.max_error <= TOL, report
    assert len(report.losses) == 2 and report.losses[1] != report.losses[0]


@settings(max_examples=14, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(case=draw_case())
def test_random_models_match_single_device(case: Case, worker_pool) -> None:
    check(parse_model(case.text, filename="<random>"), case.mesh, case.sp, worker_pool)


# tiny_llama has 2 kv-heads: tp=4 does not divide them (a compile error, tested elsewhere), so not at 1x1x4x1x1
@pytest.mark.parametrize("example,mesh,sp", [(e, m, sp) for e in ("gpt", "tiny_llama")
                                             for m, sp in (("2x1x2x1x1", True), ("1x1x4x1x1", False), ("4x1x2x1x1", True))
                                             if not (e == "tiny_llama" and m == "1x1x4x1x1")])
def test_examples_match_single_device(example: str, mesh: str, sp: bool, worker_pool) -> None:
    check(load_model(f"examples/{example}.5d"), mesh, sp, worker_pool)


def test_a_wrong_collective_is_caught(worker_pool) -> None:
    """The harness can fail: drop the dp gradient reduction and the error is large."""
    from dataclasses import replace

    graph = load_model("examples/tiny_llama.5d")
    plan = compile_graph(graph, CompileOptions(mesh=Mesh.parse("2x1x1x1x1"), dtype="fp64"))
    body = plan.graph.body
    broken = replace(plan, graph=replace(plan.graph, body=replace(body, params=tuple(replace(p, grad_partial=()) for p in body.params))))
    reference = compile_graph(graph, CompileOptions(mesh=single_device_mesh(), dtype="fp64"))
    report = verify_plan(broken, reference, settings=TrainSettings(steps=2), pool=worker_pool)
    assert report.grad_error > 1e-3


@pytest.mark.parametrize("mesh,sp,cp_attention", [("1x1x4x1x1", False, None), ("2x1x2x1x1", True, None),
                                                  ("1x1x2x2x1", True, "ring")])
def test_multi_query_attention_keeps_its_one_kv_head_whole_under_tp(mesh: str, sp: bool, cp_attention, worker_pool) -> None:
    """One k/v head (PaLM's multi-query attention) with q heads split over tp: k and v
    are computed whole on every tp rank and their gradients summed over tp."""
    from random_models import model_text

    text = model_text(style="llama", batch=4, seq=8, heads=4, kv_heads=1, head_dim=4, ffn=16, vocab=16, layers=2,
                      causal=True)
    graph = parse_model(text, filename="<mqa>")
    options = CompileOptions(mesh=Mesh.parse(mesh), sequence_parallel=sp, dtype="fp64", cp_attention=cp_attention)
    plan = compile_graph(graph, options)
    layers = [item for item in plan.graph.body.items if isinstance(item, Repeat)]
    shardings = {p.name: str(p.sharding) for p in layers[0].body.params}
    assert shardings["wk"] == shardings["wv"] == "replicated" and shardings["wq"] == "heads:tp"
    reference = compile_graph(graph, CompileOptions(mesh=single_device_mesh(), dtype="fp64"))
    report = verify_plan(plan, reference, settings=TrainSettings(steps=2), pool=worker_pool)
    assert report.max_error <= TOL, report
