"""The first divergent op: verify names where a parallel run stops matching one device.

Faults are injected into random models on random meshes (one op's output on one
rank) and the report must name that op; plans with a wrong collective (a forward
all-reduce dropped, Megatron's backward all-reduce dropped, the gradient sync
dropped) must be located in the forward, the backward and the gradient sync. Correct
plans on every axis trace without a false divergence.
"""

from __future__ import annotations

from dataclasses import replace

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from fivedc.cli.main import main
from fivedc.errors import FivedcError
from fivedc.plan.faults import resolve_fault
from fivedc.frontends.dsl_file import load_model, parse_model
from fivedc.ir.graph import Block, Redistribute, Repeat
from fivedc.ir.mesh import Mesh
from fivedc.passes.base import CompileOptions
from fivedc.pipeline import compile_graph
from fivedc.runtime.train import TrainSettings
from fivedc.runtime.verify import Diagnosis, single_device_mesh, verify_plan
from fivedc.instructions.sites import data_dependent, find_site, is_float, sites
from random_models import draw_case

TOL = 1e-10


def traced(plan, graph, pool, fault=None, steps: int = 1):
    reference = compile_graph(graph, CompileOptions(mesh=single_device_mesh(), dtype="fp64"))
    return verify_plan(plan, reference, settings=TrainSettings(steps=steps), pool=pool,
                       diagnosis=Diagnosis(TOL, fault))


def compiled(graph, mesh: str, **options):
    return compile_graph(graph, CompileOptions(mesh=Mesh.parse(mesh), dtype="fp64", **options))


@settings(max_examples=5, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(case=draw_case(), pick=st.integers(0, 10_000), rank=st.integers(0, 7))
def test_an_injected_fault_is_the_first_divergence(case, pick, rank, worker_pool) -> None:
    graph = parse_model(case.text, filename="<random>")
    plan = compiled(graph, case.mesh, sequence_parallel=case.sp)
    candidates = [s for s in sites(plan.graph) if is_float(s)]
    site = candidates[pick % len(candidates)]
    fault = resolve_fault(plan, f"{site.id}@{rank % plan.mesh.world}")
    report = traced(plan, graph, worker_pool, fault)
    assert report.injected >= 1
    assert report.divergence is not None, report
    assert (report.divergence.id, report.divergence.phase, report.divergence.step) == (site.id, "forward", 1)
    assert report.divergence.ranks == (fault.rank,) or site.node.sharding.partial  # a summand: its group


@pytest.mark.parametrize("mesh,options,fault", [
    ("1x2x1x1x1", dict(schedule="1f1b", microbatches=4), "layers.1.m@1"),
    ("1x1x1x2x1", {}, "layers.0.a@1"),
    ("2x1x1x1x1", dict(zero=3), "logits@1"),
    ("1x1x2x2x1", dict(recompute="full", sequence_parallel=True), "layers.1.k@2"),
    ("1x1x2x1x1", dict(sequence_parallel=True), "layers.1.h~1@1"),  # a value SP gathers again in backward
])
def test_faults_are_found_on_every_axis(mesh, options, fault, worker_pool) -> None:
    graph = load_model("examples/tiny_llama.5d")
    plan = compiled(graph, mesh, **options)
    report = traced(plan, graph, worker_pool, resolve_fault(plan, fault))
    assert report.divergence.id == fault.split("@")[0] and report.divergence.phase == "forward"
    if plan.pipeline is not None:  # every microbatch's output was perturbed
        assert report.divergence.microbatches == (0, 1, 2, 3)


def _edit_node(plan, out: str, edit):
    """The plan with the redistribution `out` (top level or in a repeat body) replaced by edit(node)."""
    def block(b: Block) -> Block:
        items = []
        for item in b.items:
            if isinstance(item, Repeat):
                item = replace(item, body=block(item.body))
            elif isinstance(item, Redistribute) and item.out == out:
                item = edit(item)
            items.append(item)
        return replace(b, items=tuple(items))

    return replace(plan, graph=replace(plan.graph, body=block(plan.graph.body)))


def test_a_dropped_forward_all_reduce_is_located_at_its_redistribution(worker_pool) -> None:
    graph = load_model("examples/tiny_llama.5d")
    plan = compiled(graph, "1x1x2x1x1")
    site = next(s for s in sites(plan.graph) if s.kind == "redistribute" and s.node.forward
                and s.node.forward[0].kind == "all_reduce")
    broken = _edit_node(plan, site.value, lambda r: replace(r, forward=()))
    found = traced(broken, graph, worker_pool).divergence
    assert (found.step, found.phase, found.id) == (1, "forward", site.id)
    assert found.ranks == (0, 1)  # both tp ranks hold a summand where the sum should be


def test_a_dropped_backward_all_reduce_is_located_in_backward(worker_pool) -> None:
    """Megatron's f (identity forward, all-reduce of the input gradient) without its
    backward: every value matches, the gradient of the norm feeding the column linears
    is the first to differ, and the report lists the missing collective's neighbours."""
    graph = load_model("examples/tiny_llama.5d")
    plan = compiled(graph, "1x1x2x1x1", sequence_parallel=False)
    target = next(s for s in sites(plan.graph) if s.kind == "redistribute" and not s.node.forward
                  and s.layer == 1 and s.node.src == "h.1")
    broken = _edit_node(plan, target.value, lambda r: replace(r, backward=()))
    found = traced(broken, graph, worker_pool).divergence
    assert (found.step, found.phase, found.id) == (1, "backward", "layers.1.h.1")
    assert found.kind == "rmsnorm" and found.loc.line == 40


def test_a_dropped_gradient_sync_is_located_after_backward(worker_pool) -> None:
    graph = load_model("examples/tiny_llama.5d")
    plan = compiled(graph, "2x1x1x1x1")
    body = plan.graph.body
    broken = replace(plan, graph=replace(plan.graph, body=replace(body, params=tuple(
        replace(p, grad_partial=()) for p in body.params))))
    found = traced(broken, graph, worker_pool).divergence
    assert found.phase == "gradient sync" and found.id in {p.name for p in body.params}


@pytest.mark.parametrize("example,mesh,options", [
    ("tiny_llama", "2x2x1x1x1", dict(schedule="zb-h1", microbatches=2)),
    ("moe", "1x1x1x1x2", {}),
    ("gpt", "1x1x2x2x1", dict(sequence_parallel=True, cp_attention="allgather")),
])
def test_correct_plans_trace_without_a_divergence(example, mesh, options, worker_pool) -> None:
    graph = load_model(f"examples/{example}.5d")
    report = traced(compiled(graph, mesh, **options), graph, worker_pool, steps=2)
    assert report.traced and report.divergence is None and report.max_error <= TOL


def test_site_ids_and_what_depends_on_the_inputs() -> None:
    plan = compiled(load_model("examples/tiny_llama.5d"), "2x1x2x1x1", sequence_parallel=True)
    assert find_site(plan.graph, "q") == find_site(plan.graph, "layers.0.q")
    assert find_site(plan.graph, "layers.1.x.2").layer == 1 and find_site(plan.graph, "logits").layer is None
    ids = [s.id for s in sites(plan.graph)]
    assert len(ids) == len(set(ids)) and ids.index("layers.0.q") < ids.index("layers.1.q") < ids.index("logits")
    with pytest.raises(FivedcError, match="layers has 2 layers"):
        find_site(plan.graph, "layers.2.q")
    with pytest.raises(FivedcError, match="no op or redistribution"):
        find_site(plan.graph, "nosuch")
    dependent = data_dependent(plan.graph)
    assert {"x", "q", "logits", "loss"} <= dependent
    with pytest.raises(FivedcError, match="rank 9 does not compute"):
        resolve_fault(plan, "q@9")
    piped = compiled(load_model("examples/tiny_llama.5d"), "1x2x1x1x1")
    assert resolve_fault(piped, "logits").rank == 1  # the last stage's first rank


def test_the_cli_injects_a_fault_and_names_it(worker_pool, monkeypatch, capsys, tmp_path) -> None:
    from fivedc.runtime import pool

    monkeypatch.setattr(pool, "run_once", lambda fn, *, world, payload, **_: worker_pool.run(
        fn, world=world, payload=payload))
    code = main(["verify", "examples/gpt.5d", "--mesh", "2x1x2x1x1", "--steps", "1", "--inject-fault", "logits@3"])
    out, err = capsys.readouterr()
    err = " ".join(err.split())  # wrapped at 100 columns
    assert code == 1, err
    assert "first divergence: step 1, forward: the value of logits (linear)" in out
    assert "the checker found the injected fault: logits on rank 3" in out
    assert "first divergence: forward of logits" in err and "Traceback" not in err
    assert main(["verify", "examples/gpt.5d", "--mesh", "2x1x2x1x1", "--inject-fault", "nosuch"]) == 2
    assert "fivedc show PLAN --ops" in " ".join(capsys.readouterr().err.split())
    plan = tmp_path / "gpt.plan.json"
    assert main(["compile", "examples/gpt.5d", "--mesh", "2x1x2x1x1", "-q", "-o", str(plan)]) == 0
    capsys.readouterr()
    assert main(["show", str(plan), "--ops"]) == 0
    listed = capsys.readouterr().out
    assert "logits" in listed and "layers.[0-1]." in listed and "f:AR/tp" in listed
