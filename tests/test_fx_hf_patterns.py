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

transformers = pytest.importorskip("transformers")

from fivedc.errors import NotSupportedError  # noqa: E402
from fivedc.frontend_fx import trace_module  # noqa: E402
from fivedc.ir import Op, walk_ops  # noqa: E402
from fivedc.mesh import Mesh, MeshAxis  # noqa: E402
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


def test_a_scaled_rotary_is_refused_at_its_line() -> None:
    import transformers as T

    config = T.LlamaConfig(**hf_models._DENSE, rope_scaling={"rope_type": "linear", "factor": 2.0})
    model = hf_models.LogitsLoss(T.AutoModelForCausalLM.from_config(config, attn_implementation="sdpa")).double()
    ids = hf_models.torch.randint(0, hf_models.VOCAB, (hf_models.BATCH, hf_models.SEQ))
    with pytest.raises(NotSupportedError) as caught:
        trace_module(model, (ids, ids))
    assert caught.value.loc is not None and "modeling_llama.py" in caught.value.loc.file


@pytest.mark.parametrize("mesh", ["2x1x2x1x1", "1x1x1x2x1"])
def test_a_library_llama_trains_like_the_plain_module_in_fp32(mesh: str, worker_pool) -> None:
    """dp2 x tp2 and cp2, 2 AdamW steps. In fp32: Hugging Face computes RMSNorm and the
    rotary tables in float32 even inside a float64 model, and the IR does not model
    those casts yet, so fp64 would compare float32 rounding (docs/compatibility.md)."""
    from fivedc.parallel.check import check_module

    report = check_module("examples/hf_models.py:llama", kwargs={"loss": "logits"}, mesh=mesh, dtype="fp32",
                          pool=worker_pool)
    assert report.grad_error < 1e-5 and report.max_error < 1e-4, report

