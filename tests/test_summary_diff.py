"""The plan summary (`fivedc.plan.summary`) and the plan diff (`fivedc.plan.diff`).

The summary is checked as text, the way `fivedc compile` prints it: groups, the
parameter rows, a collective row with its reason, the memory rows; by default it
fits 80 columns with every key fact whole, `--wide` keeps the wide table. The diff is
checked on pairs of plans that differ in one setting (tp, sequence parallelism, dp)
against what the compiled plans themselves say.
"""

from __future__ import annotations

import dataclasses
import io
import json
from functools import cache
from pathlib import Path

import pytest
from rich.console import Console

from fivedc.cli.main import main
from fivedc.plan.diff import PlanDiff, diff_plans
from fivedc.plan.diff_report import render_diff
from fivedc.frontends.dsl_file import load_model
from fivedc.ir.graph import Phase
from fivedc.ir.mesh import Mesh, MeshAxis
from fivedc.passes.base import CompileOptions
from fivedc.pipeline import compile_graph
from fivedc.plan.execution_plan import ExecutionPlan
from fivedc.plan.summary import MAX_PARAM_ROWS, axes_text, format_bytes, op_shardings, render_summary

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"
TINY = EXAMPLES / "tiny_llama.5d"


@cache
def plan(mesh: str, sp: bool = True, model: Path = TINY, zero: int = 0) -> ExecutionPlan:
    """Gradient buckets of 1 byte: every parameter is summed on its own, so a
    parameter's gradient sync can be found by its name."""
    options = CompileOptions(mesh=Mesh.parse(mesh), sequence_parallel=sp, bucket_mb=2**-20, zero=zero)
    return compile_graph(load_model(str(model)), options)


def summary_text(p: ExecutionPlan, *, width: int = 160, verbose: bool = False, wide: bool = False) -> str:
    console = Console(record=True, width=width, no_color=True, file=io.StringIO())
    render_summary(p, console=console, verbose=verbose, wide=wide)
    return console.export_text()


def diff_text(d: PlanDiff) -> str:
    console = Console(record=True, width=160, no_color=True, file=io.StringIO())
    render_diff(d, console=console)
    return console.export_text()


def line_with(text: str, *needles: str) -> str:
    found = [line for line in text.splitlines() if all(n in line for n in needles)]
    assert found, f"no line contains all of {needles}:\n{text}"
    return found[0]


# ---- summary ---------------------------------------------------------------------------
def test_format_bytes() -> None:
    assert format_bytes(0) == "0 B"
    assert format_bytes(1023) == "1023 B"
    assert format_bytes(1024) == "1.0 KiB"
    assert format_bytes(1536 * 1024) == "1.5 MiB"
    assert format_bytes(3 * 2**30) == "3.0 GiB"
    assert format_bytes(-2048) == "-2.0 KiB"


def test_summary_of_tiny_llama_with_sp() -> None:
    p = plan("2x1x2x1x1")
    text = summary_text(p, wide=True)
    # header
    assert "tiny_llama" in text and "dp=2, pp=1, tp=2, cp=1, ep=1 (world 4)" in text
    assert "tp,cp,ep,dp,pp" in text
    assert line_with(text, "sequence parallel", "on")
    assert line_with(text, "dtype", "bf16")
    # groups: axes, size, count, strides
    assert line_with(text, "dp*tp", "4", "1", "2, 1")
    assert {g.axes for g in p.groups} == {(MeshAxis.DP,), (MeshAxis.TP,), (MeshAxis.DP, MeshAxis.TP)}
    # parameters
    row = line_with(text, "layers.*.wq × 2")
    assert "heads:tp" in row and "hidden=32 heads=4 head_dim=8" in row and "hidden=32 heads=2 head_dim=8" in row
    assert row.rstrip().endswith("dp")
    assert line_with(text, "layers.*.attn_norm × 2", "replicated", "dp*tp")
    # op kinds: ops inside the repeat count once per layer
    linear = op_shardings(p.graph)["linear"]
    assert linear["batch:dp +partial(tp)"] == 4 and linear["batch:dp vocab:tp"] == 1
    assert line_with(text, "linear", "batch:dp +partial(tp) ×4")
    # a reduce_scatter with its reason (rendered as text, not rich markup)
    rs = next(c for c in p.collectives if c.kind == "reduce_scatter" and c.tensor == "x")
    row = line_with(text, "forward", "reduce_scatter", " x ", "seq", format_bytes(rs.bytes))
    assert "sum the partial results" in row
    assert "[batch:dp +partial(tp)]" in text
    flat = " ".join(text.split())
    for phase in Phase:
        total = sum(c.bytes * c.count for c in p.collectives if c.phase == phase)
        assert f"{phase} {format_bytes(total)}" in flat
    # memory per rank
    m = p.memory
    for name, value in (("params", m.params), ("grads", m.grads), ("optimizer", m.optimizer),
                        ("activations", m.activations), ("transient", m.transient), ("total", m.total)):
        assert line_with(text, name, format_bytes(value), f"{value:,}")
    assert "what each op keeps for backward" in " ".join(text.split())
    assert "total: what is live at the busiest moment of the step, optimizer step" in " ".join(text.split())


def test_summary_reads_well_piped_at_120_columns() -> None:
    for model, mesh in ((TINY, "2x1x2x1x1"), (EXAMPLES / "llama3_405b.5d", "2048x1x8x1x1")):
        if not model.exists():
            continue
        text = summary_text(plan(mesh, False, model), width=120)
        assert max(len(line) for line in text.splitlines()) <= 120
        assert "\x1b[" not in text
        assert "sequence parallel" in text and "Memory per rank" in text


SUMMARIES_AT_80 = [  # (model, mesh, sp, zero): tp with sp, cp, ep, pp, ZeRO
    ("tiny_llama.5d", "2x1x2x1x1", True, 0),
    ("tiny_llama.5d", "1x1x1x4x1", False, 3),
    ("gpt.5d", "2x2x2x1x1", True, 1),
    ("gpt.5d", "1x1x2x2x1", False, 2),
    ("moe.5d", "2x1x1x1x2", False, 0),
    ("moe.5d", "1x1x2x1x2", True, 3),
]


@pytest.mark.parametrize("model,mesh,sp,zero", SUMMARIES_AT_80)
def test_summary_fits_80_columns_with_every_key_fact_whole(model: str, mesh: str, sp: bool, zero: int) -> None:
    p = plan(mesh, sp, EXAMPLES / model, zero)
    text = summary_text(p, width=80)
    assert max(len(line) for line in text.splitlines()) <= 80
    assert p.collectives and "\x1b[" not in text
    m = p.mesh
    assert line_with(text, "mesh", ", ".join(f"{a}={n}" for a, n in m.as_dict().items()), f"(world {m.world})")
    for name, value in (("params", p.memory.params), ("optimizer", p.memory.optimizer), ("total", p.memory.total)):
        assert line_with(text, name, format_bytes(value), f"{value:,}")
    for c in p.collectives:  # kind, group and tensor whole on the collective's first line
        assert line_with(text, str(c.phase), f"{c.kind} over {axes_text(c.axes)} of {c.tensor}",
                         f"{format_bytes(c.bytes)} × {c.count}")
    assert "Parameters" in text and "Memory per rank" in text


def test_summary_at_80_columns_puts_the_reason_under_the_collective() -> None:
    p = plan("2x1x2x1x1")
    lines = summary_text(p, width=80).splitlines()
    rs = next(c for c in p.collectives if c.kind == "reduce_scatter" and c.tensor == "x")
    at = lines.index(line_with("\n".join(lines), "forward", "reduce_scatter over tp of x along seq", "at 23:3"))
    indent = len(lines[at + 1]) - len(lines[at + 1].lstrip())
    assert indent > len("forward") and lines[at + 1].lstrip().startswith(rs.reason[:40].split(":")[0])
    wide = summary_text(p, width=80, wide=True)  # the wide table folds words at 80 columns
    assert any(c.kind not in wide for c in p.collectives)


def test_compile_prints_80_columns_piped_and_the_wide_table_with_wide(tmp_path, capsys, monkeypatch) -> None:
    monkeypatch.setenv("COLUMNS", "80")  # what a pipe or an unknown terminal gets
    monkeypatch.chdir(tmp_path)  # a short "wrote p.json" line
    args = ["compile", str(TINY), "--mesh", "2x1x2x1x1", "--sp", "-o", "p.json"]
    assert main(args) == 0
    narrow = capsys.readouterr().out
    assert max(len(line) for line in narrow.splitlines()) <= 80 and "reduce_scatter over tp of x" in narrow
    assert main(args + ["--wide"]) == 0
    wide = capsys.readouterr().out
    assert max(len(line) for line in wide.splitlines()) > 80
    assert line_with(wide, "forward", "reduce_scatter", " x ", "seq", "sum the partial results")


def test_summary_cuts_long_parameter_tables_unless_verbose() -> None:
    p = plan("2x1x2x1x1")
    body = p.graph.body
    extra = tuple(dataclasses.replace(body.params[0], name=f"extra{i}") for i in range(MAX_PARAM_ROWS))
    graph = dataclasses.replace(p.graph, body=dataclasses.replace(body, params=body.params + extra))
    big = dataclasses.replace(p, graph=graph)
    total = len(body.params) + len(extra) + sum(len(r.body.params) for r in body.items if hasattr(r, "body"))
    short = summary_text(big)
    assert f"{total - MAX_PARAM_ROWS} more parameters omitted" in short
    assert "layers.*.w_down × 2" not in short  # repeat params come last
    full = summary_text(big, verbose=True)
    assert "omitted" not in full and "layers.*.w_down × 2" in full


# ---- diff ------------------------------------------------------------------------------
def test_diff_of_a_plan_with_itself_is_empty() -> None:
    d = diff_plans(plan("2x1x2x1x1"), plan("2x1x2x1x1"))
    assert d.is_empty and d == PlanDiff()
    assert diff_text(d).strip() == "plans are identical"
    data = d.to_json()
    assert data["identical"] is True
    assert data["mesh"] == {} and data["options"] == {} and data["memory"] == {}
    assert data["groups"] == [] and data["params"] == []
    assert data["collectives"] == {"added": [], "removed": [], "resized": [], "overlapped": [], "bytes_per_step": {}}


def test_diff_tp1_vs_tp2() -> None:
    a, b = plan("2x1x1x1x1", False), plan("2x1x2x1x1", False)
    d = diff_plans(a, b)
    assert not d.is_empty
    assert d.to_json()["mesh"] == {"tp": [1, 2], "world": [2, 4]}
    wq = next(p for p in d.params if p.name == "layers.*.wq")
    assert wq.change == "changed" and wq.sharding == ("replicated", "heads:tp")
    assert "~ layers.*.wq: replicated -> heads:tp" in diff_text(d)
    # every collective over tp is new; nothing is removed
    added = d.collectives_with("added")
    tp_in_b = [c for c in b.collectives if c.axes == (MeshAxis.TP,)]
    assert len(tp_in_b) > 0 and len(added) == len(tp_in_b) and all(c.axes == "tp" for c in added)
    assert not d.collectives_with("removed")
    assert ("forward", "all_reduce", "x") in {(c.phase, c.kind, c.tensor) for c in added}
    # the dp gradient all-reduces of tp-sharded weights halve
    wq_sync = next(c for c in d.collectives_with("resized") if c.tensor.endswith(": layers.*.wq"))
    assert wq_sync.phase == "grad_sync" and wq_sync.bytes[1] * 2 == wq_sync.bytes[0]
    assert any(g.axes == "tp" and g.change == "added" for g in d.groups)
    assert {t.name for t in d.memory} >= {"params", "grads", "optimizer", "total"}


def test_diff_names_the_zero_stage_and_the_pipeline() -> None:
    def compiled(**fields) -> ExecutionPlan:
        return compile_graph(load_model(str(TINY)), CompileOptions(mesh=Mesh.parse("1x2x1x1x1"), **fields))

    d = diff_plans(compiled(), compiled(zero=2, schedule="gpipe", microbatches=4, pp_layout=(1, 1)))
    options = d.to_json()["options"]
    assert options["zero"] == [0, 2] and options["schedule"] == ["1f1b", "gpipe"]
    assert options["microbatches"] == [2, 4] and options["pipeline_cut"] == ["cost", "layout"]
    assert "pipeline_chunks" not in options  # the same chunks, cut two ways
    flat = diff_plans(plan("2x1x2x1x1"), compiled())
    assert flat.to_json()["options"]["schedule"] == ["-", "1f1b"]


def test_diff_sp_off_vs_on_swaps_all_reduce_for_reduce_scatter_and_all_gather() -> None:
    d = diff_plans(plan("2x1x2x1x1", False), plan("2x1x2x1x1", True))
    assert d.to_json()["options"] == {"sequence_parallel": [False, True]}
    removed = {c.tensor for c in d.collectives_with("removed") if c.kind == "all_reduce" and c.axes == "tp"}
    assert removed == {"x", "h", "linear#2", "h.1", "linear#5", "rmsnorm#6"}
    added = d.collectives_with("added")
    for kind in ("reduce_scatter", "all_gather"):
        assert {c.tensor for c in added if c.kind == kind} == removed
    assert all(c.dim == "seq" for c in added if c.kind != "all_reduce")
    assert not any(c.tensor == "loss" for c in d.collectives)  # the vocab-parallel loss is unchanged
    text = diff_text(d)
    assert "sequence parallel off -> on" in text
    assert "- forward all_reduce over tp of x" in text and "+ forward reduce_scatter over tp of x along seq" in text


def test_diff_overlap_off_vs_on_names_what_each_collective_runs_beside() -> None:
    """The same collectives, now beside compute: the backward sums behind the weight gradients,
    the row-parallel all-reduces in chunks beside their matmul (matched though they gain a dim)."""
    def compiled(**fields) -> ExecutionPlan:
        return compile_graph(load_model(str(TINY)), CompileOptions(mesh=Mesh.parse("1x1x2x1x1"), **fields))

    d = diff_plans(compiled(overlap=False), compiled())
    assert not d.collectives_with("added") and not d.collectives_with("removed")
    beside = {(c.phase, c.tensor): c.overlaps for c in d.collectives_with("overlapped")}
    assert beside[("forward", "linear#2")] == \
        ("", "the matmul of wo, in 2 chunks along batch, each summed while the next is made (collective matmul)")
    assert beside[("backward", "h")] == ("", "the weight gradients of wq, wk, wv (computed while it runs)")
    assert {phase for phase, _ in beside} == {"forward", "backward"}
    text = diff_text(d)
    assert "~ forward all_reduce over tp of linear#2 along batch: 2.0 KiB x 2; overlaps nothing -> the matmul of wo" \
        in text
    assert d.to_json()["collectives"]["overlapped"][0]["overlaps"][0] == ""


def test_to_json_is_serialisable_with_stable_keys() -> None:
    d = diff_plans(plan("2x1x1x1x1", False), plan("2x1x2x1x1", True))
    data = json.loads(json.dumps(d.to_json()))
    assert set(data) == {"mesh", "options", "groups", "params", "collectives", "memory", "replicated", "identical"}
    assert data["identical"] is False
    assert set(data["collectives"]) == {"added", "removed", "resized", "overlapped", "bytes_per_step"}
    mem = data["memory"]["params"]
    assert mem["b"] / mem["a"] == pytest.approx(mem["ratio"])
    assert json.dumps(d.to_json(), sort_keys=True) == json.dumps(d.to_json(), sort_keys=True)
    with pytest.raises(dataclasses.FrozenInstanceError):
        d.params = ()  # type: ignore[misc]
    assert all(isinstance(getattr(d, f.name), tuple) for f in dataclasses.fields(d))


def test_diff_dp2_vs_dp4_keeps_grad_sync_bytes() -> None:
    a, b = plan("2x1x2x1x1"), plan("4x1x2x1x1")
    d = diff_plans(a, b)
    assert d.to_json()["mesh"] == {"dp": [2, 4], "world": [4, 8]}
    # a gradient all-reduce moves one rank's parameter shard, which dp does not split
    assert not any(c.phase == "grad_sync" for c in d.collectives)
    assert "grad_sync" not in {t.name for t in d.bytes_per_step}
    sync_a = [(c.tensor, c.bytes) for c in a.collectives if c.phase == Phase.GRAD_SYNC]
    assert sync_a == [(c.tensor, c.bytes) for c in b.collectives if c.phase == Phase.GRAD_SYNC]
    # the tp collectives move activations, whose batch dp=4 splits twice as finely
    assert d.collectives and all(c.change == "resized" for c in d.collectives)
    assert all(c.bytes[1] * 2 == c.bytes[0] and c.count[0] == c.count[1] for c in d.collectives)
    memory = {t.name: t for t in d.memory}
    # what scales with the batch; the total is the optimizer step's moment, which does not
    assert set(memory) == {"activations"}
    assert memory["activations"].ratio == pytest.approx(0.5, abs=0.01)
    assert not d.params


def test_repeated_collective_keys_pair_up_in_order() -> None:
    a = plan("2x1x2x1x1")
    losses = [i for i, c in enumerate(a.collectives) if c.tensor == "loss"]
    assert len(losses) == 3  # same (phase, kind, axes, tensor, dim) three times
    b = dataclasses.replace(a, collectives=tuple(c for i, c in enumerate(a.collectives) if i != losses[0]))
    d = diff_plans(a, b)
    assert [(c.change, c.tensor) for c in d.collectives] == [("removed", "loss")]
    assert d.collectives[0].bytes == (64, None)
    bigger = dataclasses.replace(a.collectives[losses[1]], count=3)
    c = dataclasses.replace(a, collectives=tuple(bigger if i == losses[1] else x for i, x in enumerate(a.collectives)))
    d = diff_plans(a, c)
    assert [(x.change, x.count) for x in d.collectives] == [("resized", (1, 3))]
    assert "~ forward all_reduce over tp of loss: 64 B x 1 -> 3" in diff_text(d)


@pytest.mark.parametrize("schedule, m, v", [("1f1b", 8, None), ("gpipe", 8, None), ("1f1b", 16, None),
                                           ("interleaved", 8, 2)])
def test_the_summary_prints_the_bubble_of_the_published_formula(schedule: str, m: int, v) -> None:
    """Equal chunks, a backward twice a forward: 1F1B and GPipe idle (p - 1) / (m + p - 1) of the
    step, interleaved with v chunks per rank (p - 1) / (v m + p - 1) (Narayanan et al. 2021, eq. 1-2)."""
    from fivedc.plan.summary import pipeline_bubble

    p = 4
    options = CompileOptions(mesh=Mesh.parse("1x4x1x1x1"), schedule=schedule, microbatches=m,
                             virtual=v or 1, pp_layout=None)
    compiled = compile_graph(load_model(str(EXAMPLES / "llama3_405b.5d")), options)
    want = (p - 1) / ((v or 1) * m + p - 1)
    assert pipeline_bubble(compiled) == pytest.approx(want, rel=1e-12)
    assert f"bubble {want:.1%} of the step" in summary_text(compiled, width=400)


def test_a_summary_with_a_gpu_prints_one_bubble_the_step_time_models() -> None:
    """With --gpu the header's bubble is the step-time model's (the chunks' estimated seconds),
    the figure the step-time table breaks the step into, not a second one with equal chunks."""
    import re

    from fivedc.ir.hardware import hardware
    from fivedc.plan.summary import pipeline_bubble

    options = CompileOptions(mesh=Mesh.parse("1x4x1x1x1"), schedule="1f1b", microbatches=4, pp_layout=(20, 40, 40, 26),
                             hardware=hardware("h100"))
    compiled = compile_graph(load_model(str(EXAMPLES / "llama3_405b.5d")), options)
    assert abs(compiled.time.bubble - pipeline_bubble(compiled)) > 0.01  # unequal chunks: the two differ
    text = summary_text(compiled, width=400)
    assert set(re.findall(r"bubble (\d+\.\d)%", text)) == {f"{compiled.time.bubble * 100:.1f}"}
    assert "estimated seconds on h100" in text
