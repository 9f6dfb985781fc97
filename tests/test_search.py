"""The layout search (fivedc/search/search.py): its scores are compile's, it never proposes what compile
refuses or what does not fit, it finds the one layout that fits, and it is deterministic.

Plan-level, no processes, small models (a search over 8 GPUs takes about a second).
"""

from __future__ import annotations

import dataclasses
import json

import pytest

from fivedc.cli.main import main
from fivedc.errors import NotSupportedError, ShapeError
from fivedc.frontends.dsl_file import parse_model
from fivedc.ir.hardware import GiB, hardware
from fivedc.ir.mesh import Mesh
from fivedc.pipeline import compile_graph
from fivedc.search.search import SearchError, search
from fivedc.search.space import Candidate

H100 = hardware("h100")

TINY = """
model tiny {
  dims { batch = 8  seq = 2048  hidden = 32  heads = 4  head_dim = hidden / heads  ffn = 64  vocab = 64  layers = 4 }
  input tokens: int[batch, seq]
  input targets: int[batch, seq]
  param wte: [vocab, hidden]
  x = embedding(tokens, wte)
  repeat layers {
    param ln: [hidden] = ones
    param wq: [hidden, heads, head_dim]
    param wk: [hidden, heads, head_dim]
    param wv: [hidden, heads, head_dim]
    param wo: [heads, head_dim, hidden]
    h = rmsnorm(x, ln)
    a = attention(linear(h, wq), linear(h, wk), linear(h, wv), causal=true)
    x = add(x, linear(a, wo))
    param w1: [hidden, ffn]
    param w2: [ffn, hidden]
    x = add(x, linear(gelu(linear(x, w1)), w2))
  }
  param head: [hidden, vocab]
  loss = cross_entropy(linear(x, head), targets)
  return loss
}
"""

# an MLP with odd dims (no tp), one op run (no pp), no attention (no cp): on 2 GPUs only dp=2
ODD = """
model odd {
  dims { batch = 2  hidden = 33  ffn = 99  vocab = 33 }
  input x: float[batch, hidden]
  input targets: int[batch]
  param w1: [hidden, ffn]
  param w2: [ffn, vocab]
  y = linear(gelu(linear(x, w1)), w2)
  loss = cross_entropy(y, targets)
  return loss
}
"""


@pytest.fixture(scope="module")
def tiny_result():
    return search(parse_model(TINY), gpus=8, hardware=H100, compile_best=False)  # every layout (keep=None)


def _picks(ranked) -> list:
    """Candidates of different kinds: the best, and the best with each of several features."""
    wanted = [lambda c: True, lambda c: c.mesh.sizes[3] > 1, lambda c: c.schedule == "interleaved",
              lambda c: c.schedule == "zb-h1", lambda c: c.schedule == "dualpipe", lambda c: c.zero == 3,
              lambda c: c.recompute != "none", lambda c: c.sp, lambda c: c.cp_attention == "allgather"]
    out = []
    for want in wanted:
        found = next((s for s in ranked if want(s.candidate)), None)
        if found is not None and found not in out:
            out.append(found)
    return out


def test_scores_are_what_compile_prints(tiny_result) -> None:
    graph = parse_model(TINY)
    picks = _picks(tiny_result.ranked)
    assert len(picks) >= 6  # several pipelines, CP, ZeRO-3, SP were ranked
    for scored in picks:
        plan = compile_graph(graph, scored.candidate.options(dtype="bf16", hardware=H100))
        assert plan.time.step_seconds == pytest.approx(scored.time.step_seconds, rel=1e-12), scored.candidate.flags()
        assert plan.time.mfu == pytest.approx(scored.time.mfu, rel=1e-12)
        assert plan.memory.total == scored.memory.total
        assert plan.memory.total <= H100.usable_bytes  # never a layout that does not fit


def test_ranked_best_first_and_deterministic(tiny_result) -> None:
    steps = [s.time.step_seconds for s in tiny_result.ranked]
    assert steps == sorted(steps)
    again = search(parse_model(TINY), gpus=8, hardware=H100, compile_best=False)
    assert [s.candidate for s in again.ranked] == [s.candidate for s in tiny_result.ranked]
    assert again.rejected == tiny_result.rejected
    assert sum(tiny_result.rejected.values()) > 0  # heads=4 refuses tp=8, 6 units refuse pp=8


def test_the_one_layout_that_fits() -> None:
    # dp=2 is the only mesh; of its ZeRO stages one needs the least memory (ZeRO-1 here: ZeRO-2
    # lays out its bucket twice, ZeRO-3 holds its one group gathered 3x in backward), and a GPU
    # sized between it and the next leaves it the only layout
    graph = parse_model(ODD)
    totals = {z: compile_graph(graph, Candidate(Mesh((2, 1, 1, 1, 1)), zero=z).options(dtype="bf16")).memory.total
              for z in (0, 1, 2, 3)}
    least, second = sorted(totals.values())[:2]
    assert least < second
    fits = next(z for z, total in totals.items() if total == least)
    small = dataclasses.replace(H100, memory_gib=1.0 + (least + second) / 2 / GiB, reserved_gib=1.0)
    result = search(graph, gpus=2, hardware=small)
    assert [s.candidate for s in result.ranked] == [Candidate(Mesh((2, 1, 1, 1, 1)), zero=fits)]
    assert result.plan.memory.total == least  # the best, compiled for real
    assert result.rejected["does not fit in the GPU's memory"] == 3


def test_cli_search_writes_the_best_plan_and_every_candidate(tmp_path, capsys) -> None:
    model = tmp_path / "tiny.5d"
    model.write_text(TINY)
    best, every = tmp_path / "best.plan.json", tmp_path / "all.json"
    assert main(["search", str(model), "--gpus", "8", "--gpu", "h100", "--top", "3", "--explain",
                 "-o", str(best), "--json", str(every)]) == 0
    out = capsys.readouterr().out
    data = json.loads(every.read_text())["candidates"]
    assert set(data[0]) == {"mesh", "options", "step_seconds", "memory_bytes", "mfu"}
    assert [c["step_seconds"] for c in data] == sorted(c["step_seconds"] for c in data)
    plan = json.loads(best.read_text())
    assert plan["time"]["step_seconds"] == data[0]["step_seconds"]
    assert "rejected, by reason" in out and "ShapeError: heads=N is not divisible by tp=N" in out
    assert f"best: fivedc compile {model}" in out


@pytest.mark.parametrize("argv, words", [
    (["--gpus", "12"], ["not a whole number of 8-GPU nodes", "--gpus 8 or 16"]),
    (["--gpus", "0"], ["must be a whole number of GPUs >= 1"]),
    (["--gpus", "8", "--gpu", "h1000"], ["unknown GPU 'h1000'", "choose one of"]),
    (["--gpus", "64", "--global-batch", "3"], ["no layout of tiny on 64 x h100", "global batch does not split"]),
])
def test_bad_input_exits_2_with_the_fix(tmp_path, capsys, argv, words) -> None:
    model = tmp_path / "tiny.5d"
    model.write_text(TINY)
    args = ["search", str(model), *argv] + ([] if "--gpu" in argv else ["--gpu", "h100"])
    assert main(args) == 2
    err = " ".join(capsys.readouterr().err.split())
    assert all(w in err for w in words), err
    assert "Traceback" not in err


def test_a_model_that_fits_nowhere(tmp_path, capsys) -> None:
    graph = parse_model(TINY)
    tiny_gpu = dataclasses.replace(H100, memory_gib=1.001, reserved_gib=1.0)
    with pytest.raises(SearchError) as error:
        search(graph, gpus=8, hardware=tiny_gpu)
    assert "does not fit in the GPU's memory" in error.value.message and "more GPUs" in error.value.hint


def test_parallelize_auto_compiles_the_searched_layout() -> None:
    from fivedc.frontends.python_file import load_factory
    from fivedc.parallel.parallelize import search_module

    module, example = load_factory("examples/nanogpt.py:factory")
    traced, plan = search_module(module, example, gpus=2, gpu="h100")
    best = search(traced.graph, gpus=2, hardware=H100, dtype="fp64", compile_best=False).best
    assert plan.mesh.world == 2 and plan.mesh == best.candidate.mesh
    assert plan.time.step_seconds == best.time.step_seconds


def test_the_search_runs_every_planning_pass_of_compile() -> None:
    from fivedc.pipeline import PLANNING_PASSES
    from fivedc.search.cases import PER_MODE, PER_PIPELINE, TIMING

    assert PER_PIPELINE + PER_MODE + TIMING == PLANNING_PASSES[:-1]  # all but prove-agreement, in order
    assert PLANNING_PASSES[-1].name == "prove-agreement"


def test_the_memo_changes_no_figure(tiny_result) -> None:
    # the planning passes on a draft without a memo (each figure computed where it is used)
    # give what compile (a memo per plan) and the search (one memo per sharded graph) give
    from fivedc.pipeline import GRAPH_PASSES, PLANNING_PASSES, run_passes
    from fivedc.plan.planning import Draft

    graph = parse_model(TINY)
    for scored in _picks(tiny_result.ranked)[:4]:
        options = scored.candidate.options(dtype="bf16", hardware=H100)
        draft = run_passes(Draft(graph), options, GRAPH_PASSES)
        for planning_pass in PLANNING_PASSES[:-1]:
            draft = planning_pass.plan(draft, options)
        assert draft.memo is None
        assert draft.memory == scored.memory and draft.time == scored.time, scored.candidate.flags()


MOE = "examples/moe.5d"


@pytest.mark.parametrize("model, gpus, keep, fp8", [(TINY, 8, 1, False), (TINY, 8, 5, False), (TINY, 16, 3, False),
                                                   (MOE, 8, 4, False), (TINY, 8, 5, True)])
def test_the_k_best_are_those_of_scoring_every_layout(model: str, gpus: int, keep: int, fp8: bool) -> None:
    # best first with pruning by bounds: the same K best, figures and order, as scoring everything
    from fivedc.frontends.dsl_file import load_model
    from fivedc.search.search import PRUNED

    graph = load_model(model) if model.endswith(".5d") else parse_model(model)
    every = search(graph, gpus=gpus, hardware=H100, compile_best=False, fp8=fp8)
    best = search(graph, gpus=gpus, hardware=H100, compile_best=False, keep=keep, fp8=fp8)
    assert best.ranked[:keep] == every.ranked[:keep]
    assert best.rejected[PRUNED] > 0 and PRUNED not in every.rejected
    assert sum(best.rejected.values()) + len(best.ranked) == sum(every.rejected.values()) + len(every.ranked)


@pytest.mark.parametrize("model, gpus, fp8", [(TINY, 8, False), (MOE, 8, False), (TINY, 8, True)])
def test_every_bound_is_below_the_plans_step_time(model: str, gpus: int, fp8: bool) -> None:
    # the bounds the search prunes by (fivedc/search/bounds.py), on every ranked layout
    from fivedc.frontends.dsl_file import load_model
    from fivedc.pipeline import GRAPH_PASSES, run_passes
    from fivedc.plan.planning import Draft
    from fivedc.search.cases import GraphCase

    graph = load_model(model) if model.endswith(".5d") else parse_model(model)
    ranked = search(graph, gpus=gpus, hardware=H100, compile_best=False, fp8=fp8).ranked
    assert all(s.candidate.fp8 == fp8 for s in ranked)
    cases: dict = {}
    for scored in ranked:
        c = scored.candidate
        key = (c.mesh, c.sp, c.cp_attention)
        if key not in cases:
            base = dataclasses.replace(c, schedule=None, microbatches=None, virtual=None, zero=0, recompute="none")
            sharded = run_passes(Draft(graph), base.options(dtype="bf16"), GRAPH_PASSES).graph
            cases[key] = GraphCase(base, sharded, dtype="bf16", hw=H100)
        case, step = cases[key], scored.time.step_seconds
        pipeline = (c.schedule, c.microbatches, c.virtual)
        assert case.mesh_bound("none") <= case.mesh_bound(c.recompute) <= step, c.flags()
        assert case.pipeline_bound(pipeline, c.recompute) + case.tail_bound(pipeline, c.zero) <= step, c.flags()
    assert len(cases) > 10


@pytest.mark.parametrize("model, sizes", [(TINY, (2, 1, 2, 2, 1)), (MOE, (2, 1, 1, 1, 4)), (MOE, (2, 1, 2, 1, 2))])
def test_the_graph_passes_do_not_depend_on_the_rank_order(model: str, sizes: tuple) -> None:
    # the search runs them once per mesh size and shares the graph among its rank orders
    from fivedc.frontends.dsl_file import load_model
    from fivedc.pipeline import GRAPH_PASSES, run_passes
    from fivedc.plan.planning import Draft
    from fivedc.search.space import rank_orders

    graph = load_model(model) if model.endswith(".5d") else parse_model(model)
    orders = rank_orders(sizes)
    assert len(orders) > 1
    graphs = [run_passes(Draft(graph), Candidate(Mesh(sizes, o), sp=True).options(dtype="bf16"), GRAPH_PASSES).graph
              for o in orders]
    assert all(g == graphs[0] for g in graphs[1:])


# the refusals the mesh sizes of 8 GPUs meet in TINY and MOE, by type: anything else fails the test
REFUSALS = {ShapeError: "is not divisible by tp", NotSupportedError: "under pipeline parallelism"}


@pytest.mark.parametrize("model, gpus, fp8", [(TINY, 8, False), (MOE, 8, False), (TINY, 8, True)])
def test_the_memory_bound_is_below_the_plans_memory(model: str, gpus: int, fp8: bool) -> None:
    # on every candidate the passes accept, fitting or not (a bound above would reject a layout that fits)
    from fivedc.frontends.dsl_file import load_model
    from fivedc.pipeline import GRAPH_PASSES, run_passes
    from fivedc.plan.planning import Draft
    from fivedc.search.cases import GraphCase
    from fivedc.search.space import mesh_sizes, rank_orders

    graph = load_model(model) if model.endswith(".5d") else parse_model(model)
    checked, refused, every = 0, [], mesh_sizes(graph, gpus=gpus, gpus_per_node=8, units=20)
    for sizes in every:
        base = Candidate(Mesh(sizes, rank_orders(sizes)[-1]), sp=sizes[2] > 1, cp_attention="ring" if sizes[3] > 1 else None,
                         fp8=fp8)
        try:
            sharded = run_passes(Draft(graph), base.options(dtype="bf16"), GRAPH_PASSES).graph
        except (ShapeError, NotSupportedError) as error:  # only the model's own limits, each located
            assert error.loc is not None and REFUSALS[type(error)] in error.message, error.render()
            refused.append(sizes)
            continue
        case = GraphCase(base, sharded, dtype="bf16", hw=H100)
        for pipeline in case.pipelines:
            if case.refusal(pipeline) is not None:
                continue
            for recompute, zero in case.modes:
                exact = case.planned(pipeline, recompute, zero).memory.total
                assert case.memory_bound(pipeline, recompute, zero) <= exact, (sizes, pipeline, recompute, zero)
                checked += 1
    # refused exactly where the model says so: tp=8 over its 4 heads; MoE: its aux_loss under pp
    assert refused == [s for s in every if s[2] == 8 or (model == MOE and s[1] > 1)] and checked > 100


def test_a_memory_bound_search_keeps_the_k_best() -> None:
    # a GPU on which most layouts of the tiny model do not fit: the bound rejects most of them,
    # and the K best (and how many do not fit) are those of scoring every layout
    from fivedc.search.search import DOES_NOT_FIT, PRUNED

    graph = parse_model(TINY)
    every = search(graph, gpus=8, hardware=H100, compile_best=False)
    totals = sorted(s.memory.total for s in every.ranked)
    small = dataclasses.replace(H100, memory_gib=1.0 + totals[len(totals) // 3] / GiB, reserved_gib=1.0)
    every = search(graph, gpus=8, hardware=small, compile_best=False)
    best = search(graph, gpus=8, hardware=small, compile_best=False, keep=3)
    assert best.ranked[:3] == every.ranked[:3]
    assert every.rejected[DOES_NOT_FIT] > len(every.ranked) and best.rejected[PRUNED] > 0


# ---- --fp8: every layout with float8 linears (the precision is the user's, never searched) -----------
def test_fp8_scores_every_layout_with_float8_linears_and_steps_faster() -> None:
    from fivedc.ir.graph import Op, walk_ops
    from fivedc.passes.fp8 import is_fp8

    graph = parse_model(TINY)
    bf16 = search(graph, gpus=8, hardware=H100, keep=3)
    fp8 = search(graph, gpus=8, hardware=H100, keep=3, fp8=True)
    assert all(s.candidate.fp8 for s in fp8.ranked) and not any(s.candidate.fp8 for s in bf16.ranked)
    assert fp8.plan.fp8 and any(is_fp8(op) for op, _ in walk_ops(fp8.plan.graph.body) if isinstance(op, Op))
    assert fp8.best.time.step_seconds < bf16.best.time.step_seconds  # the matmuls at H100's float8 peak
    for scored in fp8.ranked[:3]:  # what fivedc compile --fp8 of each prints
        plan = compile_graph(graph, scored.candidate.options(dtype="bf16", hardware=H100))
        assert plan.fp8 and plan.time.step_seconds == pytest.approx(scored.time.step_seconds, rel=1e-12)
        assert scored.candidate.flags().endswith("--fp8") and scored.candidate.as_json()["fp8"] is True


def test_cli_search_fp8_writes_a_float8_plan_compares_and_explains(tmp_path, capsys) -> None:
    from fivedc.cli.plan_check import load_plan

    model = tmp_path / "tiny.5d"
    model.write_text(TINY)
    steps = {}
    for fp8 in (False, True):
        best, every = tmp_path / f"best{fp8}.plan.json", tmp_path / f"all{fp8}.json"
        argv = ["search", str(model), "--gpus", "8", "--gpu", "h100", "--top", "3", "-o", str(best),
                "--json", str(every), "--compare", "4x1x2x1x1", "--explain"]
        assert main(argv + (["--fp8"] if fp8 else [])) == 0
        out = " ".join(capsys.readouterr().out.split())
        plan, data = load_plan(best), json.loads(every.read_text())["candidates"]  # load_plan: what compile gives
        assert plan.fp8 == fp8 and all(c["options"].get("fp8", False) == fp8 for c in data)
        assert ("with float8 linears (--fp8)" in out) == fp8 and ("--fp8 --gpu h100" in out) == fp8
        assert "compared: --mesh 4x1x2x1x1" + (" --fp8" if fp8 else "") in out
        assert "the step term by term" in out and "rejected, by reason" in out
        steps[fp8] = plan.time.step_seconds
    assert steps[True] < steps[False]


@pytest.mark.parametrize("model, argv, words", [
    (TINY, ["--gpu", "a100"], ["--fp8: the a100 profile", "no float8 tensor cores", "drop --fp8"]),
    (TINY, ["--gpu", "a100", "--compare", "8x1x1x1x1"], ["no float8 tensor cores", "drop --fp8"]),
    (ODD, ["--gpu", "h100"], ["--fp8: no linear of odd can run in float8", "multiples of 16", "drop --fp8"]),
], ids=["a100", "a100-compare", "no-linear"])
def test_search_fp8_refuses_what_compile_refuses(tmp_path, capsys, model, argv, words) -> None:
    path = tmp_path / "m.5d"
    path.write_text(model)
    assert main(["search", str(path), "--gpus", "8" if model == TINY else "2", "--fp8", *argv]) == 2
    err = " ".join(capsys.readouterr().err.split())
    assert all(w in err for w in words), err
    assert "Traceback" not in err and f"{path}:" not in err and "--compare" not in err  # no location: the option's
    compile_argv = ["compile", str(path), "--mesh", "8x1x1x1x1" if model == TINY else "2x1x1x1x1", "--fp8", *argv[:2]]
    assert main(compile_argv) == 2  # compile refuses it alike
    err = " ".join(capsys.readouterr().err.split())
    assert all(w in err for w in words), err
