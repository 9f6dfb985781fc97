"""`fivedc search --compare MESH [--explain]`: the user's layout beside the best, the step term by term.

The breakdown (`fivedc/estimates/breakdown.py`) must be the step-time model's own seconds:
its terms add up to the plan's step, each unit's terms to that unit's phases, and a
pipeline's bubble to what the schedule simulator leaves idle on the busiest rank.
"""

from __future__ import annotations

import math

import numpy as np
import pytest

from fivedc.cli.main import main
from fivedc.estimates.breakdown import BUBBLE, PP_SENDS, plan_breakdown
from fivedc.estimates.memo import Memo
from fivedc.estimates.model_error import STEP_TIME
from fivedc.estimates.step_time import chunk_costs, cost_row, memo_unit_times
from fivedc.frontends.dsl_file import load_model
from fivedc.ir.hardware import hardware
from fivedc.ir.mesh import Mesh, MeshAxis
from fivedc.passes.base import DTYPE_BYTES, CompileOptions
from fivedc.pipeline import compile_graph
from fivedc.search.search import search

H100 = hardware("h100", ())
LAYOUTS = [  # (model, mesh, options): no pipeline, each kind of schedule, recomputation, ZeRO, SP, CP, EP
    ("gpt", "4x1x2x1x1", dict(zero=3, recompute="selective")),
    ("gpt", "2x1x4x1x1", dict(sequence_parallel=True, zero=1)),
    ("gpt", "2x2x2x1x1", dict(schedule="1f1b", microbatches=2, recompute="full")),
    ("gpt", "1x4x4x1x1", dict(sequence_parallel=True, schedule="zb-h1", microbatches=4, zero=3)),
    ("gpt", "1x2x1x1x1", dict(schedule="dualpipe", microbatches=4)),
    ("gpt", "1x2x2x1x1", dict(schedule="interleaved", microbatches=4, virtual=2, zero=2)),
    ("moe", "2x1x1x1x2", dict(zero=1)),
    ("llama3_405b", "16x32x8x4x1", dict(sequence_parallel=True, cp_attention="ring", schedule="interleaved",
                                        microbatches=128, virtual=2, zero=3)),
]


def _plan(model: str, mesh: str, options: dict):
    graph = load_model(f"examples/{model}.5d")
    return compile_graph(graph, CompileOptions(mesh=Mesh.parse(mesh), dtype="bf16", hardware=H100, **options))


@pytest.mark.parametrize("model,mesh,options", LAYOUTS, ids=[f"{m}-{x}" for m, x, _ in LAYOUTS])
def test_the_terms_add_up_to_the_models_step(model, mesh, options) -> None:
    plan = _plan(model, mesh, options)
    parts = plan_breakdown(plan)
    assert parts.step_seconds == plan.time.step_seconds
    assert math.isclose(sum(v for _, v in parts.terms), plan.time.step_seconds, rel_tol=1e-12)
    assert all(math.isfinite(v) and v > -1e-12 * plan.time.step_seconds for _, v in parts.terms), parts.terms
    recomputed = parts.seconds("recomputation")
    assert (recomputed > 0) == (plan.recompute != "none")
    assert (parts.seconds("tp collectives") > 0) == (plan.mesh.size(MeshAxis.TP) > 1)


@pytest.mark.parametrize("model,mesh,options", LAYOUTS[:6], ids=[f"{m}-{x}" for m, x, _ in LAYOUTS[:6]])
def test_each_units_terms_are_its_phases(model, mesh, options) -> None:
    """The ledger `unit_time` keeps beside its sums holds the same seconds, phase by phase."""
    plan = _plan(model, mesh, options)
    m = plan.pipeline.microbatches if plan.pipeline else 1
    for t in memo_unit_times(Memo(plan.graph, plan.mesh, plan.dtype), H100, DTYPE_BYTES[plan.dtype], m,
                             plan.recompute):
        for total, terms in ((t.forward, t.parts.forward), (t.backward_input, t.parts.input),
                             (t.backward_weight, t.parts.weight), (t.hidden, t.parts.hidden),
                             (t.backward, t.parts.backward(whole=True))):
            assert math.isclose(sum(v for _, v in terms), total, rel_tol=1e-12, abs_tol=1e-18), (total, terms)


PIPELINED = [x for x in LAYOUTS if "schedule" in x[2]]


@pytest.mark.parametrize("model,mesh,options", PIPELINED, ids=[f"{m}-{x}" for m, x, _ in PIPELINED])
def test_a_pipelines_bubble_is_what_the_simulator_leaves_idle(model, mesh, options) -> None:
    """With a pipeline: the busiest rank's work (the simulator's busy time), its idle time with
    free transfers (the bubble) and what the transfers add make the schedule's makespan."""
    from fivedc.estimates.memo import save_context
    from fivedc.schedule.batched import play, program

    plan = _plan(model, mesh, options)
    parts = plan_breakdown(plan)
    memo, m = Memo(plan.graph, plan.mesh, plan.dtype), plan.pipeline.microbatches
    times = memo_unit_times(memo, H100, 2, m, plan.recompute)
    per, _ = chunk_costs(save_context(memo, 2, m, plan.recompute), plan.pipeline, plan.mesh, H100, times)
    zeros = [0.0] * len(plan.pipeline.chunks)
    _, busy = play(program(plan.pipeline.build_schedule(plan.mesh.size(MeshAxis.PP))),
                   np.array([cost_row(per, {"RF": zeros, "RB": zeros})]))
    work = sum(v for k, v in parts.terms if k not in (BUBBLE, PP_SENDS)) - (
        plan.time.step_seconds - plan.time.compute_seconds)
    assert parts.seconds(BUBBLE) >= 0 and parts.seconds(PP_SENDS) > 0
    assert math.isclose(work, busy.max(), rel_tol=1e-9)
    assert math.isclose(busy[0][parts.pp_rank], busy.max(), rel_tol=1e-9)
    assert math.isclose(work + parts.seconds(BUBBLE) + parts.seconds(PP_SENDS), plan.time.compute_seconds,
                        rel_tol=1e-12)
    if plan.pipeline.schedule == "1f1b":
        assert parts.seconds(BUBBLE) > 0


def _best_flags() -> list[str]:
    result = search(load_model("examples/gpt.5d"), gpus=64, hardware=H100, compile_best=False, keep=1)
    return result.best.candidate.flags().replace("--mesh", "--compare").split()


SEARCH = ["search", "examples/gpt.5d", "--gpus", "64", "--gpu", "h100", "--top", "3"]


def test_comparing_the_best_with_itself_shows_no_difference(capsys) -> None:
    assert main(SEARCH + _best_flags() + ["--explain"]) == 0
    out = capsys.readouterr().out
    flat = " ".join(out.split())
    assert "(1.00x the best's" in flat and "would rank #1 of the layouts that fit" in flat
    assert "a tie with the best by the model's error" in flat
    assert "the compared layout's step is the best's, term by term" in flat
    rows = [line.split("│")[1:-1] for line in out.splitlines()[out.splitlines().index(
        next(line for line in out.splitlines() if line.startswith("the step term by term"))):] if "│" in line]
    assert len(rows) > 5
    for term, best, compared, diff, flag in rows:
        assert best.strip() == compared.strip() and diff.strip() in ("+0", "-0", "+0.0") and not flag.strip(), term


def test_a_compared_pipeline_gets_its_bubble_and_the_lead_is_explained(capsys) -> None:
    args = ["--compare", "4x4x4x1x1", "--schedule", "1f1b", "--microbatches", "1", "--recompute", "full"]
    assert main(SEARCH + args + ["--explain"]) == 0
    out = capsys.readouterr().out
    flat = " ".join(out.split())
    assert f"±{STEP_TIME.spread:.0%} on {STEP_TIME.runs} published runs" in flat
    assert "compared: --mesh 4x4x4x1x1 --schedule 1f1b --microbatches 1 --recompute full:" in flat
    bubble = next(line for line in out.splitlines() if line.startswith("│ pipeline bubble"))
    cells = [c.strip() for c in bubble.split("│")[1:-1]]
    assert float(cells[2].replace(",", "")) > float(cells[1].replace(",", "")) and cells[4] == "> model error"
    step = next(line for line in out.splitlines() if line.startswith("│ step"))
    row = [c.strip().replace(",", "") for c in step.split("│")[1:-1]]
    best, lead = float(row[1]), float(row[3])
    rests = lead - float(cells[3].replace(",", "")) <= STEP_TIME.spread * best  # a tie without the bubble
    said = "the lead rests on this one term" if rests else "the lead would hold without it"
    assert "pipeline bubble: " in flat and said in flat
    assert max(len(line) for line in out.splitlines()) <= 100


@pytest.mark.parametrize("keep", [1, 3])
def test_every_tie_of_the_best_is_scored(keep) -> None:
    """With the model's error as a band, pruning leaves every layout within it of the best:
    the ties `fivedc search` counts are those of scoring every layout."""
    graph = load_model("examples/gpt.5d")
    every = search(graph, gpus=64, hardware=H100, compile_best=False)
    some = search(graph, gpus=64, hardware=H100, compile_best=False, keep=keep, band=STEP_TIME.spread)
    plain = search(graph, gpus=64, hardware=H100, compile_best=False, keep=keep)
    limit = every.best.time.step_seconds * (1 + STEP_TIME.spread)
    ties = [s for s in every.ranked if s.time.step_seconds <= limit]
    assert [s for s in some.ranked if s.time.step_seconds <= limit] == ties
    met = len([s for s in plain.ranked if s.time.step_seconds <= limit])
    assert met < len(ties) if keep == 1 else met <= len(ties)  # what the band adds


def test_the_rank_of_a_compared_layout_counts_every_faster_layout(capsys) -> None:
    """The search scores every layout faster than the compared one, so its rank is exact."""
    graph = load_model("examples/gpt.5d")
    every = search(graph, gpus=64, hardware=H100, compile_best=False)
    plan = _plan("gpt", "4x4x4x1x1", dict(schedule="1f1b", microbatches=1, recompute="full"))
    faster = sum(s.time.step_seconds < plan.time.step_seconds for s in every.ranked)
    assert main(SEARCH + ["--compare", "4x4x4x1x1", "--schedule", "1f1b", "--microbatches", "1",
                          "--recompute", "full"]) == 0
    assert f"would rank #{faster + 1} of the layouts that fit" in " ".join(capsys.readouterr().out.split())


@pytest.mark.parametrize("argv,words", [
    (["--compare", "2x2x2x1x1"], "--compare 2x2x2x1x1 has 8 ranks, and the search --gpus 64"),
    (["--compare", "4x4x4"], "--compare 4x4x4: cannot parse mesh"),
    (["--compare", "dp=64,xp=1"], "--compare dp=64,xp=1:"),
    (["--zero", "2"], "--zero shapes the layout --compare names"),
    (["--compare", "64x1x1x1x1", "--schedule", "1f1b"], "--schedule set up a pipeline, and mesh 64x1x1x1x1 has pp=1"),
    (["--compare", "1x1x64x1x1"], "--compare 1x1x64x1x1:"),
])
def test_bad_compare_input_is_one_located_error(capsys, argv, words) -> None:
    assert main(SEARCH + argv) == 2
    captured = capsys.readouterr()
    assert words in " ".join(captured.err.split()) and "Traceback" not in captured.err
    assert captured.out == ""  # refused before the search runs
