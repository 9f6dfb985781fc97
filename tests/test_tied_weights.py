"""Tied weights: an output projection whose weight is the embedding table.

GPT-2, Gemma and many small models share one tensor between the token embedding
([vocab, hidden]) and the output projection (nn.Linear's [out, in] = [vocab, hidden]).
The IR keeps it as one parameter that both ops use (`linear` takes a weight stored
[out, in]); its gradient sums both uses, and the plan trains exactly as on one device
(float64) under dp, tp (vocab-parallel for both uses) and ZeRO-3. Pipeline stages
cannot share it: that is refused at the line of the second use.
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest

from fivedc.errors import FivedcError
from fivedc.frontends.fx_module import trace_module
from fivedc.ir.graph import Annotation, Op, walk_ops
from fivedc.ir.mesh import Mesh
from fivedc.parallel.check import check_module
from fivedc.passes.base import CompileOptions
from fivedc.pipeline import compile_graph
from replicated_models import ShiftedLabels, tied_lm
from test_frontend_fx import assert_same_as_module, line_of

MODELS = str(Path(__file__).resolve().parent / "replicated_models.py")


def test_a_tied_table_is_one_parameter_used_twice() -> None:
    module, inputs = tied_lm()
    tm = trace_module(module, inputs)
    (table,) = [p for p in tm.graph.body.params if p.dims == ("vocab", "hidden")]
    users = [op.kind for op, _ in walk_ops(tm.graph.body) if isinstance(op, Op) and table.name in op.args]
    assert users == ["embedding", "linear"]
    assert_same_as_module(tm, module, inputs)
    plan = compile_graph(tm.graph, CompileOptions(mesh=Mesh.parse("2x1x2x1x1"), dtype="fp64"))
    (table,) = [p for p in plan.graph.body.params if p.dims == ("vocab", "hidden")]
    assert str(table.sharding) == "vocab:tp"  # both uses vocab-parallel: the same shard on each rank


@pytest.mark.parametrize("mesh, options", [("2x1x2x1x1", {"sequence_parallel": True}), ("2x1x1x1x1", {"zero": 3})])
def test_tied_weights_train_like_one_device(worker_pool, mesh: str, options: dict) -> None:
    report = check_module(f"{MODELS}:tied_lm", mesh=mesh, steps=2, dtype="fp64", pool=worker_pool, **options)
    assert report.max_error <= 1e-10, report


def test_pipeline_stages_cannot_share_a_tied_table() -> None:
    module, inputs = tied_lm()
    graph = trace_module(module, inputs, stage_boundaries=("head",)).graph
    with pytest.raises(FivedcError, match="cannot share a parameter") as info:
        compile_graph(graph, CompileOptions(mesh=Mesh.parse("1x2x1x1x1"), microbatches=1))
    assert info.value.exit_code == 2
    assert info.value.hint


def test_the_shardings_of_both_uses_must_agree() -> None:
    """A tied table that its two ops need sharded differently (the embedding kept whole by
    @replicate, the head vocab-parallel) is refused at the second use, not silently resharded."""
    module, inputs = tied_lm()
    graph = trace_module(module, inputs).graph
    items = tuple(replace(op, annotations=(Annotation("replicate", ()),)) if isinstance(op, Op) and
                  op.kind == "embedding" else op for op in graph.body.items)
    graph = replace(graph, body=replace(graph.body, items=items))
    with pytest.raises(FivedcError, match="sharded differently") as info:
        compile_graph(graph, CompileOptions(mesh=Mesh.parse("1x1x2x1x1")))
    assert info.value.loc.line == line_of(ShiftedLabels.forward, "logits = self.head(h)")
