"""The compiler pipeline is one list of passes, and `fivedc compile --passes` shows it."""

from __future__ import annotations

from fivedc.cli.main import main
from fivedc.frontends.dsl_file import load_model
from fivedc.ir.mesh import Mesh
from fivedc.passes.base import CompileOptions
from fivedc.pipeline import PIPELINE, compile_graph, run_pipeline
from fivedc.plan.planning import assemble

PLANNING_ORDER = ["schedule", "stage-partition", "recompute", "buckets", "zero", "memory", "time", "prove-agreement"]


def test_every_decision_is_a_pass_with_a_purpose_in_order() -> None:
    names = [p.name for p in PIPELINE]
    assert names[-len(PLANNING_ORDER):] == PLANNING_ORDER
    assert names[0] == names[-len(PLANNING_ORDER) - 1] == "verify-ir"  # the graph passes, checked at both ends
    assert all(p.purpose and "\n" not in p.purpose for p in PIPELINE)


def test_the_plan_is_assembled_from_the_passes_decisions_alone() -> None:
    graph = load_model("examples/tiny_llama.5d")
    options = CompileOptions(mesh=Mesh.parse("2x2x1x1x1"), zero=1, microbatches=2)
    timings: list = []
    draft = run_pipeline(graph, options, timings=timings)
    assert [t.name for t in timings] == [p.name for p in PIPELINE]
    assert draft.pipeline is not None and draft.buckets and draft.memory is not None and draft.proof is not None
    assert assemble(draft, options) == compile_graph(graph, options)


def test_compile_lists_the_passes_with_their_times(tmp_path, capsys) -> None:
    assert main(["compile", "examples/tiny_llama.5d", "--mesh", "2x1x1x1x1", "--passes", "--wide",
                 "-o", str(tmp_path / "p.json")]) == 0
    out = capsys.readouterr().out
    out = out[out.index("passes (fivedc/pipeline.py)"):]
    places = [out.index(f" {p.name} ") for p in PIPELINE if p.name != "verify-ir"]
    assert places == sorted(places)  # in pipeline order
