"""Capture without weights (`fivedc/frontends/weightless.py`): a model whose parameters were never allocated
plans exactly as the same model with weights does.

`fivedc.empty_weights()` registers every parameter on the meta device and makes the
buffers (rotary tables) on the CPU, also under a factory's own `torch.device("meta")`.
The frontend's example run then computes on meta wherever a parameter takes part and
for real where only inputs, buffers and shapes do, so the patterns it checks by value
(the rotary tables, the causal mask, repeat_kv, RMSNorm and MoE probes) still read
values. A model whose buffers have no values is refused at its buffer with that fix.
"""

from __future__ import annotations

import pytest
import torch

import fivedc
from fivedc.cli.main import main
from fivedc.errors import NotSupportedError
from fivedc.frontends.fx_module import trace_module
from fivedc.frontends.python_file import load_factory
from fivedc.ir.mesh import Mesh
from fivedc.passes.base import CompileOptions
from fivedc.pipeline import compile_graph
from test_frontend_fx import llama
from test_fx_moe import mixtral


def _plan(module, inputs, mesh: str):
    return compile_graph(trace_module(module, inputs).graph, CompileOptions(mesh=Mesh.parse(mesh), dtype="fp64",
                                                                            sequence_parallel=True))


def test_a_model_without_weights_plans_as_the_model_with_weights(tmp_path, capsys) -> None:
    """`fivedc compile file.py:factory --no-weights` writes the very plan the model with weights gives."""
    plans = [tmp_path / "with.json", tmp_path / "without.json"]
    for flags, out in (([], plans[0]), (["--no-weights"], plans[1])):
        assert main(["compile", "examples/llama.py:factory", "--mesh", "1x2x2x2x1", "--sp", "-q", "-o", str(out),
                     *flags]) == 0
    assert plans[0].read_bytes() == plans[1].read_bytes()
    capsys.readouterr()
    assert main(["compile", "examples/gpt.5d", "--mesh", "2x1x1x1x1", "--no-weights", "-o", str(tmp_path / "x")]) == 2
    assert "is a DSL model" in " ".join(capsys.readouterr().err.split()) and not (tmp_path / "x").exists()


def test_an_moe_model_without_weights_plans_as_with_them() -> None:
    """The MoE probe reads which weight is which on random weights of its own, not the model's."""
    with fivedc.empty_weights():
        empty, inputs = mixtral.factory()
    assert all(p.is_meta for p in empty.parameters()) and not any(b.is_meta for b in empty.buffers())
    real, real_inputs = mixtral.factory()
    assert _plan(empty, inputs, "1x1x1x1x2") == _plan(real, real_inputs, "1x1x1x1x2")


def test_a_factory_that_builds_on_the_meta_device_gets_real_buffers_under_empty_weights() -> None:
    def on_meta():
        with torch.device("meta"):
            return llama.factory()

    module, inputs = on_meta()  # as written: every buffer on meta too, nothing to read the rotary tables from
    with pytest.raises(NotSupportedError, match="buffer layers.0.attention.rope.cos .*has no values") as info:
        trace_module(module, inputs)
    assert "fivedc.empty_weights()" in info.value.hint and info.value.loc.file.endswith("llama.py")
    with fivedc.empty_weights():
        module, inputs = on_meta()
    assert all(p.is_meta for p in module.parameters()) and not any(b.is_meta for b in module.buffers())
    real, real_inputs = llama.factory()
    assert _plan(module, inputs, "2x1x2x1x1") == _plan(real, real_inputs, "2x1x2x1x1")


def test_a_hugging_face_model_without_weights_plans_as_with_them() -> None:
    """LlamaForCausalLM with its own loss: the rotary tables from the `inv_freq` buffer, the causal
    mask the masking utilities build on the embeddings' device (meta), repeat_kv by expand."""
    empty, inputs = load_factory("examples/hf_models.py:build", kwargs={"arch": "llama", "weights": False})
    assert all(p.is_meta for p in empty.parameters())
    real, real_inputs = load_factory("examples/hf_models.py:build", kwargs={"arch": "llama"})
    assert _plan(empty, inputs, "2x1x2x1x1") == _plan(real, real_inputs, "2x1x2x1x1")


def test_a_bf16_model_without_weights_is_captured_as_float64() -> None:
    """As a large config is built: its tables are read to float64 precision (the model is cast for the
    capture and back), so its rotary embedding is the IR's rope, not a refusal; the plan's precision
    is the compile's own."""
    from fivedc.ir.graph import Op, walk_ops

    kwargs = {"arch": "llama", "weights": False, "dtype": torch.bfloat16}
    module, inputs = load_factory("examples/hf_models.py:build", kwargs=kwargs)
    ops = [op for op, _ in walk_ops(trace_module(module, inputs).graph.body) if isinstance(op, Op)]
    assert sum(op.kind == "rope" for op in ops) == 4 and sum(op.kind == "attention" for op in ops) == 2
    assert {p.dtype for p in module.parameters()} == {torch.bfloat16} and all(p.is_meta for p in module.parameters())
