"""Pipeline chunks cut where the model marks them: `@stage` on a top-level statement,
`repeat layers @stage(4, 8)` on a layer stack.

Checked here: units split at marks (a marked op begins its unit together with the
redistributions inserted for it); marks give exactly the chunks, for 1f1b,
interleaved and dualpipev, differently from the cost-balanced cut; a count that is
not the schedule's, marks with --pp-layout, and every bad DSL form are errors with
the numbers, the fix and the location; a marked model trains at pp=2 with dp or tp
exactly like the single-device run (float64, 1e-10); the CLI shows the marked chunks
and refuses a wrong count without a traceback.
"""

from __future__ import annotations

import io
import subprocess
import sys
from dataclasses import replace

import pytest
from rich.console import Console

from fivedc.cli.main import main
from fivedc.errors import DslError, PlanError
from fivedc.frontends.dsl_file import parse_model
from fivedc.ir.graph import Annotation, Op, Redistribute
from fivedc.ir.mesh import Mesh
from fivedc.passes.base import CompileOptions
from fivedc.pipeline import compile_graph
from fivedc.plan.execution_plan import ExecutionPlan
from fivedc.runtime.train import TrainSettings
from fivedc.runtime.verify import single_device_mesh, verify_plan
from fivedc.passes.stages import Unit, units
from fivedc.plan.summary import render_summary
from random_models import model_text
from test_dsl import _at

REPEAT = "  repeat {n} as layers {{"
HEAD = "  loss = cross_entropy(linear(rmsnorm(x, lnf), w_head), targets)"
SPLIT_HEAD = "  n = rmsnorm(x, lnf)\n  loss = cross_entropy(linear(n, w_head), targets)"


def marked(*, layers: int = 4, at: tuple[int, ...] = (), head: bool = False, split_head: bool = False,
           embedding: bool = False, batch: int = 4) -> str:
    """A small Llama-style model (dims divisible by 2) with `@stage` marks: layers `at`,
    the head statement (`split_head`: norm and head as two statements, the head marked)."""
    text = model_text(style="llama", batch=batch, seq=4, heads=2, kv_heads=2, head_dim=4, ffn=8, vocab=8,
                      layers=layers, causal=True)
    if at:
        text = text.replace(REPEAT.format(n=layers), f"  repeat {layers} as layers @stage({', '.join(map(str, at))}) {{")
    if split_head:
        text = text.replace(HEAD, SPLIT_HEAD)
    if head or split_head:
        text = text.replace("targets)\n  return", "targets) @stage\n  return")
    if embedding:
        text = text.replace("x = embedding(tokens, wte)", "x = embedding(tokens, wte) @stage")
    return text


def compile_text(text: str, mesh: str, **options) -> ExecutionPlan:
    return compile_graph(parse_model(text, filename="m.5d"), CompileOptions(mesh=Mesh.parse(mesh), **options))


# ---- units --------------------------------------------------------------------------------------
def test_units_split_at_a_marked_statement_and_at_marked_layers() -> None:
    graph = parse_model(marked(layers=3, at=(2,), head=True), filename="m.5d")
    # items: embedding, the repeat, then the head statement: rmsnorm#, linear#, loss
    assert [type(i).__name__ for i in graph.body.items] == ["Op", "Repeat", "Op", "Op", "Op"]
    assert graph.body.items[1].stage_layers == (2,)
    assert units(graph) == [
        Unit(0, 1), Unit(1, 2, 0), Unit(1, 2, 1), Unit(1, 2, 2, marked=True), Unit(2, 5, marked=True),
    ]
    # a mark in the middle of a run of ops splits the run there
    graph = parse_model(marked(layers=1, split_head=True), filename="m.5d")
    assert [i.out for i in graph.body.items[2:]] == ["n", "linear#7", "loss"]
    assert graph.body.items[3].annotation("stage") is not None  # the statement's first op carries the mark
    assert units(graph) == [Unit(0, 1), Unit(1, 2, 0), Unit(2, 3), Unit(3, 5, marked=True)]


def test_a_marked_op_begins_with_the_redistributions_inserted_for_it() -> None:
    plan = compile_text(marked(layers=2, split_head=True), "1x2x2x1x1", sequence_parallel=True, microbatches=2)
    items = plan.graph.body.items
    marked_op = next(k for k, i in enumerate(items) if isinstance(i, Op) and i.annotation("stage"))
    assert isinstance(items[marked_op - 1], Redistribute) and items[marked_op - 1].src == "n"  # all-gather of n
    last = units(plan.graph)[-1]
    assert last.marked and last.start == marked_op - 1
    first, second = plan.pipeline.chunks
    assert second.what == "linear+cross_entropy" and first.sends == ("n",)  # n is sent as rmsnorm left it


# ---- chunks -------------------------------------------------------------------------------------
@pytest.mark.parametrize("schedule,text,m,expected", [
    ("1f1b", marked(layers=4, at=(3,)), 2,
     [(0, "embedding, layers.0-2"), (1, "layers.3, rmsnorm+linear+cross_entropy")]),
    ("interleaved", marked(layers=4, at=(1, 3), head=True), 2,
     [(0, "embedding, layers.0"), (1, "layers.1-2"), (0, "layers.3"), (1, "rmsnorm+linear+cross_entropy")]),
    ("dualpipev", marked(layers=4, at=(0, 1, 2)), 4,
     [(0, "embedding"), (1, "layers.0"), (1, "layers.1"), (0, "layers.2-3, rmsnorm+linear+cross_entropy")]),
])
def test_marks_give_exactly_those_chunks(schedule: str, text: str, m: int, expected: list) -> None:
    plan = compile_text(text, "1x2x1x1x1", schedule=schedule, microbatches=m)
    assert [(c.rank, c.what) for c in plan.pipeline.chunks] == expected and plan.pipeline.cut == "marks"


def test_marks_differ_from_the_cost_balanced_cut() -> None:
    plain = compile_text(marked(layers=4), "1x2x1x1x1")
    assert [c.what for c in plain.pipeline.chunks] == ["embedding, layers.0-1", "layers.2-3, rmsnorm+linear+cross_entropy"]
    assert plain.pipeline.cut == "cost"
    plan = compile_text(marked(layers=4, at=(3,)), "1x2x1x1x1")
    assert [c.what for c in plan.pipeline.chunks] == ["embedding, layers.0-2", "layers.3, rmsnorm+linear+cross_entropy"]


def test_a_mark_on_the_first_op_cuts_nothing() -> None:
    plan = compile_text(marked(layers=2, at=(1,), embedding=True), "1x2x1x1x1")
    assert [c.what for c in plan.pipeline.chunks] == ["embedding, layers.0", "layers.1, rmsnorm+linear+cross_entropy"]
    with pytest.raises(PlanError) as error:
        compile_text(marked(layers=2, embedding=True), "1x2x1x1x1")
    assert error.value.message == (
        "the model marks 0 stage boundaries (a mark on the first op or layer cuts nothing), giving 1 chunk; "
        "1f1b on pp=2 runs 2 chunks (1 per pp rank)"
    )


def test_marks_on_one_pp_rank_are_not_used_and_the_summary_says_so() -> None:
    plan = compile_text(marked(layers=2, at=(1,)), "2x1x1x1x1")
    assert plan.pipeline is None
    assert "pipeline           off (pp=1): the model's @stage marks are not used" in _summary(plan)
    assert "pipeline" not in _summary(compile_text(marked(layers=2), "2x1x1x1x1"))


def test_the_summary_and_the_plan_file_say_how_the_chunks_were_cut(tmp_path) -> None:
    plan = compile_text(marked(layers=4, at=(3,)), "1x2x1x1x1")
    text = _summary(plan)
    assert "cut at the model's @stage marks" in text and "Pipeline chunks (cut at the model's @stage marks)" in text
    assert "balanced by cost" in _summary(compile_text(marked(layers=4), "1x2x1x1x1"))
    assert "layers per chunk from --pp-layout" in _summary(compile_text(marked(layers=4), "1x2x1x1x1", pp_layout=(1, 3)))
    plan.save(tmp_path / "p.json")
    assert ExecutionPlan.load(tmp_path / "p.json") == plan
    with pytest.raises(PlanError, match="unknown pipeline cut 'guess'"):
        replace(plan.pipeline, cut="guess")


def _summary(plan: ExecutionPlan) -> str:
    console = Console(record=True, width=200, no_color=True, file=io.StringIO())
    render_summary(plan, console=console)
    return console.export_text()


# ---- plan errors --------------------------------------------------------------------------------
@pytest.mark.parametrize("text,options,message,hint", [
    (marked(layers=4, at=(1, 2, 3)), {},
     "the model marks 3 stage boundaries (before layers.1, layers.2, layers.3), giving 4 chunks; "
     "1f1b on pp=2 runs 2 chunks (1 per pp rank)",
     "remove 2 marks; or use pp=4 (1f1b runs 1 chunk per rank); or use --schedule interleaved --virtual 2 "
     "(2 chunks per rank on pp=2); or use --schedule dualpipev (2 chunks per rank on pp=2)"),
    (marked(layers=4, at=(2,)), {"schedule": "interleaved"},
     "the model marks 1 stage boundary (before layers.2), giving 2 chunks; interleaved on pp=2 runs 4 chunks "
     "(2 per pp rank)",
     "add 2 marks; or use --schedule 1f1b (1 chunk per rank on pp=2)"),
    (marked(layers=4, at=(2,), head=True), {"schedule": "dualpipev", "microbatches": 4},
     "the model marks 2 stage boundaries (before layers.2, rmsnorm (line 39)), giving 3 chunks; "
     "dualpipev on pp=2 runs 4 chunks (2 per pp rank)",
     "add 1 mark"),
])
def test_a_mark_count_that_is_not_the_schedules_is_an_error(text: str, options: dict, message: str, hint: str) -> None:
    with pytest.raises(PlanError) as error:
        compile_text(text, "1x2x1x1x1", **options)
    assert error.value.message == message and error.value.hint == hint


def test_marks_and_a_layout_are_an_error_naming_both() -> None:
    text = marked(layers=4, at=(2,))
    with pytest.raises(PlanError) as error:
        compile_text(text, "1x2x1x1x1", pp_layout=(2, 2))
    assert error.value.message == ("the model marks its pipeline chunks with @stage (at layers.2) and --pp-layout 2,2 "
                                   "gives layers per chunk too; use one of the two")
    assert "drop --pp-layout" in error.value.hint and "remove the @stage marks" in error.value.hint
    assert (error.value.loc.line, error.value.loc.col) == _at(text, "repeat 4 as layers")
    text = marked(layers=4, head=True)
    with pytest.raises(PlanError) as error:
        compile_text(text, "1x2x1x1x1", pp_layout=(2, 2))
    assert (error.value.loc.line, error.value.loc.col) == _at(text, "@stage")


def test_marks_another_frontend_could_write_wrongly_are_plan_errors() -> None:
    graph = parse_model(marked(layers=2), filename="m.5d")
    repeat = graph.body.items[1]
    bad = replace(graph, body=replace(graph.body, items=(graph.body.items[0], replace(repeat, stage_layers=(2,)),
                                                         *graph.body.items[2:])))
    with pytest.raises(PlanError, match=r"repeat layers marks layers \[2\] as chunk starts; each must be a different "
                                        r"layer in 0..1"):
        compile_graph(bad, CompileOptions(mesh=Mesh.parse("1x2x1x1x1")))
    first = repeat.body.items[0]
    stage = Annotation("stage", (), first.loc)
    body = replace(repeat.body, items=(replace(first, annotations=(stage,)), *repeat.body.items[1:]))
    inner = replace(graph, body=replace(graph.body, items=(graph.body.items[0], replace(repeat, body=body),
                                                           *graph.body.items[2:])))
    with pytest.raises(PlanError, match="@stage on an op inside repeat layers") as error:
        compile_graph(inner, CompileOptions(mesh=Mesh.parse("1x2x1x1x1")))
    assert error.value.loc == first.loc


# ---- the DSL --------------------------------------------------------------------------------------
FRAME = "model m {\n  dims {\n    b = 2\n    h = 8\n  }\n  input t: float[b, h]\n  param w: [h]\n%s\n}\n"


@pytest.mark.parametrize("body,marker,message,hint", [
    ("  y = relu(t) @stage(2)\n  return y", "@stage(2)",
     "@stage on an op takes no arguments, got @stage(2): it marks that a pipeline chunk begins at this statement",
     "repeat NAME @stage(2)"),
    ("  x = relu(t)\n  repeat 3 as layers {\n    x = add(x, w) @stage\n  }\n  return x", "@stage",
     "@stage on an op inside repeat layers: a pipeline chunk can only begin at a layer",
     "mark layers on the repeat instead: `repeat layers @stage(2) { ... }`"),
    ("  y = relu(add(t, w) @stage)\n  return y", "@stage",
     "@stage marks a whole statement, not a call nested in it", "after the statement's outermost call"),
    ("  x = relu(t)\n  repeat 3 as layers @col {\n    x = add(x, w)\n  }\n  return x", "@col",
     "@col does not go on a repeat; only @stage(layer, ...) and @recompute(mode) do", "put @col on the op call"),
    ("  x = relu(t)\n  repeat 3 as layers @stage(1) @stage(2) {\n    x = add(x, w)\n  }\n  return x", "@stage(2)",
     "@stage is given twice on repeat layers", "one @stage(...)"),
    ("  x = relu(t)\n  repeat 3 as layers @stage {\n    x = add(x, w)\n  }\n  return x", "@stage",
     "@stage on repeat layers needs the layers at which a pipeline chunk begins", "`repeat layers @stage(1)"),
    ("  x = relu(t)\n  repeat 3 as layers @stage(1, 3) {\n    x = add(x, w)\n  }\n  return x", "3)",
     "@stage(3): repeat layers has layers 0 to 2", ""),
    ("  x = relu(t)\n  repeat 3 as layers @stage(-1) {\n    x = add(x, w)\n  }\n  return x", "-1",
     "@stage(-1): repeat layers has layers 0 to 2", ""),
    ("  x = relu(t)\n  repeat 3 as layers @stage(1.5) {\n    x = add(x, w)\n  }\n  return x", "1.5",
     "@stage takes layer numbers, got 1.5", ""),
    ('  x = relu(t)\n  repeat 3 as layers @stage("1") {\n    x = add(x, w)\n  }\n  return x', '"1"',
     '@stage takes layer numbers, got "1"', ""),
    ("  x = relu(t)\n  repeat 3 as layers @stage(2, 1, 2) {\n    x = add(x, w)\n  }\n  return x", "2) {",
     "layer 2 is marked twice in @stage", ""),
])
def test_bad_stage_marks_in_the_dsl(body: str, marker: str, message: str, hint: str) -> None:
    text = FRAME % body
    with pytest.raises(DslError) as error:
        parse_model(text, filename="m.5d")
    assert error.value.message == message and hint in error.value.hint
    assert error.value.loc.file == "m.5d" and (error.value.loc.line, error.value.loc.col) == _at(text, marker)


def test_stage_on_the_model_is_an_error() -> None:
    text = "model m @stage {\n  dims { b = 2 }\n  input t: float[b]\n  return t\n}\n"
    with pytest.raises(DslError) as error:
        parse_model(text, filename="m.5d")
    assert error.value.message == "@stage marks where a pipeline chunk begins, not the model"
    assert (error.value.loc.line, error.value.loc.col) == (1, 9)


# ---- equivalence with the single-device run --------------------------------------------------------
@pytest.mark.parametrize("text,mesh,options,chunks", [
    (marked(layers=3, at=(2,), batch=8), "2x2x1x1x1", {"microbatches": 2},
     ["embedding, layers.0-1", "layers.2, rmsnorm+linear+cross_entropy"]),
    (marked(layers=2, at=(0, 1), split_head=True), "1x2x2x1x1",
     {"schedule": "interleaved", "microbatches": 2, "sequence_parallel": True},
     ["embedding", "layers.0", "layers.1, rmsnorm", "linear+cross_entropy"]),
    (marked(layers=3, at=(0, 2), head=True), "1x2x2x1x1", {"schedule": "dualpipev", "microbatches": 4},
     ["embedding", "layers.0-1", "layers.2", "rmsnorm+linear+cross_entropy"]),
])
def test_a_marked_model_matches_single_device(text: str, mesh: str, options: dict, chunks: list, worker_pool) -> None:
    graph = parse_model(text, filename="marked.5d")
    plan = compile_graph(graph, CompileOptions(mesh=Mesh.parse(mesh), dtype="fp64", **options))
    assert [c.what for c in plan.pipeline.chunks] == chunks
    reference = compile_graph(graph, CompileOptions(mesh=single_device_mesh(), dtype="fp64"))
    report = verify_plan(plan, reference, settings=TrainSettings(steps=2), pool=worker_pool)
    assert report.max_error <= 1e-10, report
    assert report.losses[1] != report.losses[0]


# ---- the command line -------------------------------------------------------------------------------
def test_cli_shows_the_marked_chunks_and_refuses_a_wrong_count(tmp_path, capsys) -> None:
    model = tmp_path / "marked.5d"
    model.write_text(marked(layers=4, at=(3,)))
    out = tmp_path / "plan.json"
    assert main(["compile", str(model), "--mesh", "1x2x1x1x1", "-o", str(out)]) == 0
    text = capsys.readouterr().out
    assert "Pipeline chunks (cut at the model's @stage marks)" in text
    assert "embedding, layers.0-2" in text and "layers.3," in text and "rmsnorm+linear+cross_entropy" in text
    assert main(["compile", str(model), "--mesh", "1x4x1x1x1", "-o", str(tmp_path / "bad.json")]) == 2
    err = " ".join(capsys.readouterr().err.split())
    assert "the model marks 1 stage boundary (before layers.3), giving 2 chunks; 1f1b on pp=4 runs 4 chunks" in err
    assert "hint: add 2 marks" in err and "Traceback" not in err and not (tmp_path / "bad.json").exists()
    result = subprocess.run([sys.executable, "-m", "fivedc.cli.main", "compile", str(model), "--mesh", "1x2x1x1x1",
                             "--pp-layout", "2,2", "-q", "-o", str(tmp_path / "bad.json")], capture_output=True, text=True)
    assert result.returncode == 2 and "Traceback" not in result.stderr
    err = " ".join(result.stderr.split())  # wrapped to 100 columns, wherever the tmp path ends
    assert f"{model}:" in err and "--pp-layout 2,2 gives layers per chunk too" in err
