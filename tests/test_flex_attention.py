"""FlexAttention as torchtitan calls it (`torch.compile(flex_attention)` over a block mask from
`torch.compile(create_block_mask)`, its mask closing over a tensor computed from positions):
captured by torch.export as torch's flex_attention op and rewritten into SDPA with the mask made
dense (fivedc/frontends/fx/flex.py). The models are in tests/flex_models.py; torchtitan's own
llama3 is in tests/test_titan_tune_models.py (skipped where torchtitan is not installed)."""

from __future__ import annotations

from pathlib import Path

from fivedc.cli.main import main
from fivedc.frontends.fx.flex import flex_attention_on_cpu
from fivedc.frontends.fx_module import trace_module
from fivedc.ir.graph import walk_ops
from fivedc.parallel.check import check_module
from test_frontend_fx import assert_same_as_module

MODELS = str(Path(__file__).resolve().parent / "flex_models.py")


def _ops(graph, kind: str) -> list:
    return [op for op, _ in walk_ops(graph.body) if op.kind == kind]


def test_flex_attention_over_a_causal_block_mask_is_the_irs_causal_attention(worker_pool) -> None:
    """One document per row: the block mask is the causal mask, so each layer's flex attention
    is the IR's causal attention (ring attention under cp), nothing runs replicated, and the
    model trains as on one device (its reference: torch's eager flex_attention op, float64) in
    a pipeline of two microbatches (the IR's attention on other axes: tests/test_context_parallel.py)."""
    from flex_models import flex_causal

    module, inputs = flex_causal()
    tm = trace_module(module, inputs)
    attention = _ops(tm.graph, "attention")
    assert len(attention) == len(module.layers) and all(op.attr("causal") for op in attention)
    assert not [op for op in _ops(tm.graph, "aten") if op.attr("rule") == "replicated"]
    with flex_attention_on_cpu(eager=True):  # torch refuses flex attention's CPU backward otherwise
        assert_same_as_module(tm, module, inputs)
    report = check_module(f"{MODELS}:flex_causal", mesh="1x2x1x1x1", steps=2, dtype="fp64", pool=worker_pool,
                          microbatches=2)
    assert report.max_error <= 1e-10, report


def test_flex_attention_over_a_sliding_window_is_the_irs_windowed_attention(worker_pool) -> None:
    """A mask_mod of the causal band of 3 keys: each layer's attention has window=3, nothing runs
    replicated, and under cp2 (ring) the model trains as on one device."""
    from flex_models import flex_window

    module, inputs = flex_window()
    tm = trace_module(module, inputs)
    attention = _ops(tm.graph, "attention")
    assert len(attention) == len(module.layers) and all(op.attr("window") == 3 for op in attention)
    assert not [op for op in _ops(tm.graph, "aten") if op.attr("rule") == "replicated"]
    report = check_module(f"{MODELS}:flex_window", mesh="1x1x1x2x1", steps=2, dtype="fp64", pool=worker_pool)
    assert report.max_error <= 1e-10, report


def test_flex_attention_over_documents_runs_as_sdpa_with_its_mask_replicated() -> None:
    """Two documents per row: the mask is not the causal one, so the attention is SDPA with the
    dense mask, an ATen op without a sharding rule: it runs replicated (as any replicated op:
    tests/test_replicated_ops.py trains them on several ranks), is listed with its line, and
    computes what the module's own flex attention does."""
    from flex_models import flex_documents

    module, inputs = flex_documents()
    tm = trace_module(module, inputs)
    assert not _ops(tm.graph, "attention")
    islands = [op for op in _ops(tm.graph, "aten") if op.attr("rule") == "replicated"]
    assert [op.attr("target") for op in islands] == ["aten.scaled_dot_product_attention.default"] * 2
    assert all(op.loc.file.endswith("flex_models.py") for op in islands)
    with flex_attention_on_cpu(eager=True):
        assert_same_as_module(tm, module, inputs)


def test_flex_attention_with_a_score_mod_is_refused_at_its_line(tmp_path, capsys) -> None:
    """A score_mod adds terms fivedc's attention does not compute: `fivedc compile` refuses it at
    the flex_attention call, exit 2, and writes no plan."""
    out = tmp_path / "p.plan.json"
    assert main(["compile", f"{MODELS}:flex_softcap", "--mesh", "1x1x1x1x1", "-o", str(out)]) == 2
    err = " ".join(capsys.readouterr().err.split())
    line = next(i for i, text in enumerate(Path(MODELS).read_text().splitlines(), 1) if "out = flex(" in text)
    assert "flex_attention with a score_mod" in err and f"flex_models.py:{line}:" in err, err
    assert "Traceback" not in err and not out.exists()
