"""Measured against estimated: what a run holds on every rank, against the plan's figure for its class.

`fivedc run --report` measures, per rank: the parameters, gradients and optimizer
state held after the last backward, and the peak of what a step keeps for backward
(every storage autograd saves, each once, plus checkpoint's region inputs and the
pipeline's boundary values, alive until the backward: `runtime/saved.LiveMeter`).
Each must be within 5% of the plan's estimate (`fivedc/estimates/memory.py`), on meshes over
every axis, with pipeline schedules and recomputation.
"""

from __future__ import annotations

import pytest

from fivedc.frontends.dsl_file import parse_model
from fivedc.ir.mesh import Mesh
from fivedc.passes.base import CompileOptions
from fivedc.pipeline import compile_graph
from fivedc.runtime.run import memory_report, run_plan
from fivedc.runtime.train import TrainSettings
from random_models import model_text, moe_model_text

DENSE = {style: model_text(style=style, batch=4, seq=16, heads=4, kv_heads=2, head_dim=8, ffn=32, vocab=32, layers=2,
                           causal=True) for style in ("gpt", "llama")}
BALANCED_MOE = moe_model_text(batch=4, seq=8, hidden=16, experts=4, expert_ffn=16, vocab=32, layers=1, top_k=4,
                              score="softmax", swiglu=True, shared=True, down_first=False, extra="")  # every token to every expert

CASES = {  # name: (model, mesh, options)
    "tp2 sp": (DENSE["gpt"], "1x1x2x1x1", dict(sequence_parallel=True)),
    "dp2 tp2 sp selective": (DENSE["llama"], "2x1x2x1x1", dict(sequence_parallel=True, recompute="selective")),
    "cp2 ring full": (DENSE["llama"], "1x1x1x2x1", dict(recompute="full")),
    "cp2 all-gather": (DENSE["gpt"], "1x1x1x2x1", dict(cp_attention="allgather")),
    "dp2 zero3": (DENSE["llama"], "2x1x1x1x1", dict(zero=3)),
    "pp2 gpipe": (DENSE["gpt"], "1x2x1x1x1", dict(schedule="gpipe", microbatches=4)),
    "pp2 zb-h1 zero1": (DENSE["llama"], "2x2x1x1x1", dict(schedule="zb-h1", microbatches=2, zero=1)),
    "pp2 tp2 interleaved full": (DENSE["llama"], "1x2x2x1x1", dict(sequence_parallel=True, schedule="interleaved",
                                                                   microbatches=2, recompute="full")),
    "pp2 dualpipev": (DENSE["gpt"], "1x2x1x1x1", dict(schedule="dualpipev", microbatches=4)),
    "pp2 dualpipe": (DENSE["llama"], "1x2x1x1x1", dict(schedule="dualpipe", microbatches=4)),  # two copies
    "ep2 moe": (BALANCED_MOE, "1x1x1x1x2", dict()),
}


@pytest.mark.parametrize("name", list(CASES))
def test_measured_within_5_percent_of_the_estimate(worker_pool, name: str) -> None:
    text, mesh, options = CASES[name]
    plan = compile_graph(parse_model(text, filename="m.5d"),
                         CompileOptions(mesh=Mesh.parse(mesh), dtype="fp32", **options))
    settings = TrainSettings(steps=1, dtype="fp32", keep_grads=False, measure=True)
    report = memory_report(plan, run_plan(plan, settings, pool=worker_pool))
    assert len(report["ranks"]) == plan.mesh.world
    for entry in report["ranks"]:
        estimated, measured = entry["estimated"], entry["measured"]
        for kind in ("params", "grads", "optimizer", "activations"):
            assert measured[kind] == pytest.approx(estimated[kind], rel=0.05), (entry["rank"], kind, entry)
