"""Hugging Face's rotary tables, expand-based repeat_kv and causal attn_mask, recognised by value.

A library decoder (transformers itself, a tiny Llama or Qwen3) under a training loop's
own logits loss (`examples/hf_models.LogitsLoss`) traces through torch.export. Its
rotary embedding is `q * cos + rotate_half(q) * sin` with tables computed from the
`inv_freq` buffer, its grouped-query attention repeats k/v with `expand` + `reshape`,
and its mask is a constant built by the masking utilities: each must become the IR's
`rope` (at the config's theta), `attention` (causal, GQA) and nothing else, and a
near miss (a linearly scaled rotary) must be refused at the rotary's line.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

import transformers  # the `test` extra installs it (pyproject.toml): missing, the tests fail

from fivedc.errors import NotSupportedError  # noqa: E402
from fivedc.frontends.fx_module import trace_module  # noqa: E402
from fivedc.ir.graph import Op, walk_ops  # noqa: E402
from fivedc.ir.mesh import Mesh, MeshAxis  # noqa: E402
from fivedc.passes.base import CompileOptions  # noqa: E402
from fivedc.pipeline import compile_graph  # noqa: E402

_spec = importlib.util.spec_from_file_location("hf_models", Path(__file__).parent.parent / "examples" / "hf_models.py")
hf_models = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(hf_models)


def _ops(graph) -> list[Op]:
    return [node for node, _ in walk_ops(graph.body) if isinstance(node, Op)]


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_rope_gqa_and_the_causal_mask_become_ir_ops(arch: str) -> None:
    model, inputs = hf_models.build(arch, loss="logits")
    config = model.model.config
    graph = trace_module(model, inputs).graph
    ops = _ops(graph)
    ropes = [op for op in ops if op.kind == "rope"]
    attention = [op for op in ops if op.kind == "attention"]
    layers = config.num_hidden_layers  # export inlines the layers: one attention and two ropes each
    assert len(attention) == layers and all(op.attr("causal") for op in attention)
    assert len(ropes) == 2 * layers
    theta = config.rope_parameters["rope_theta"]
    assert all(op.attr("theta") == pytest.approx(theta, rel=1e-6) for op in ropes)
    assert not any(op.kind in ("matmul", "cat") for op in ops)
    plan = compile_graph(graph, CompileOptions(mesh=Mesh.parse("2x1x2x1x1"), dtype="fp32"))
    assert any(MeshAxis.TP in c.axes for c in plan.collectives)  # the heads are split over tp


def test_a_scaled_rotary_keeps_its_own_frequencies(worker_pool) -> None:
    """Linear rope scaling divides the frequencies: no theta gives them, so the rope op carries the
    table's own (`freqs`), and the model trains as the module does under cp2, in float64."""
    from fivedc.parallel.check import check_module

    kwargs = {"arch": "llama", "loss": "logits", "rope_scaling": {"rope_type": "linear", "factor": 2.0}}
    model, inputs = hf_models.build(**kwargs)
    ropes = [op for op in _ops(trace_module(model, inputs).graph) if op.kind == "rope"]
    half = model.model.config.head_dim // 2
    assert ropes and all(len(str(op.attr("freqs")).split(",")) == half for op in ropes)
    report = check_module("examples/hf_models.py:build", kwargs=kwargs, mesh="1x1x1x2x1", dtype="fp64", pool=worker_pool)
    assert report.max_error <= 1e-10, report
