"""Attention written out by hand with logit softcapping (Gemma 2's eager attention) becomes the
IR's `attention` with `softcap` (tests/eager_attention.py, no library): matmul of q and the
repeated k, a scale of its own, c * tanh(s / c), an additive causal mask, softmax, matmul with v.
Traced, each layer is one attention op (causal, the scale folded into q, the cap as an attribute)
computing the module's loss and gradients (float64, 1e-12), and under cp=2 ring attention
(capped blockwise scores) it trains like the module. A mask that is not causal is no match:
the scores then run as ATen ops and still compute the module's loss.
"""

from __future__ import annotations

import torch

from eager_attention import decoder
from fivedc.frontends.fx_module import trace_module
from fivedc.frontends.fx.precision import float64_everywhere
from fivedc.ir.graph import Op, walk_ops
from test_frontend_fx import assert_same_as_module


def _ops(graph, kind: str) -> list[Op]:
    return [op for op, _ in walk_ops(graph.body) if isinstance(op, Op) and op.kind == kind]


def test_written_out_attention_with_a_softcap_is_the_irs_attention() -> None:
    module, inputs = decoder()
    tm = trace_module(module, inputs)
    attention = _ops(tm.graph, "attention")
    assert len(attention) == 2 and all(dict(op.attrs) == {"causal": True, "softcap": 2.0} for op in attention)
    assert not _ops(tm.graph, "aten") and not _ops(tm.graph, "matmul")
    with float64_everywhere():  # its softmax in float32 read as float64, as the plan computes
        assert_same_as_module(tm, module, inputs)


def test_a_sliding_window_mask_is_the_attentions_window() -> None:
    module, inputs = decoder()
    s = inputs[0].shape[1]  # layer 0 sees a sliding window of 2 keys, its own and the one before
    window = torch.full((s, s), torch.finfo(torch.float32).min).triu(1) + torch.full((s, s), -1e9).tril(-2)
    module.attn[0].forward = lambda x, mask, layer=module.attn[0]: type(layer).forward(layer, x, window)
    tm = trace_module(module, inputs)
    attention = _ops(tm.graph, "attention")
    assert [op.attr("window", 0) for op in attention] == [2, 0] and not _ops(tm.graph, "aten")
    with float64_everywhere():
        assert_same_as_module(tm, module, inputs)


def test_a_mask_that_is_neither_causal_nor_a_window_runs_as_aten_ops() -> None:
    module, inputs = decoder()
    s = inputs[0].shape[1]  # layer 0: a window of 2 keys and the first key (an attention sink)
    sink = torch.full((s, s), torch.finfo(torch.float32).min).triu(1) + torch.full((s, s), -1e9).tril(-2)
    sink[:, 0] = 0.0
    module.attn[0].forward = lambda x, mask, layer=module.attn[0]: type(layer).forward(layer, x, sink)
    tm = trace_module(module, inputs)
    assert len(_ops(tm.graph, "attention")) == 1 and _ops(tm.graph, "aten")
    with float64_everywhere():
        assert_same_as_module(tm, module, inputs)


def test_capped_attention_trains_like_the_module_under_ring_cp(worker_pool) -> None:
    from fivedc.parallel.check import check_module

    report = check_module("tests/eager_attention.py:decoder", mesh="1x1x1x2x1", steps=2, dtype="fp64",
                          pool=worker_pool)
    assert report.max_error <= 1e-10, report
