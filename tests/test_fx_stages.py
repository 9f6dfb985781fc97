"""Pipeline stage marks in the fx frontend (`fivedc/frontends/fx/marks.py`).

A module marked `fivedc_stage_boundary = True` (class or instance) or matched by a
`stage_boundaries=` pattern of `trace_module` begins a pipeline chunk: a layer of a
repeated stack goes in `Repeat.stage_layers`, a top-level module puts `@stage` on
the first top-level op traced from it (also on the torch.export path and for layers
that were inlined). Marks inside a layer body or inside a block lowered as one op,
marks on modules that compute no op, and patterns that match nothing are errors that
say where and what to mark instead. Without marks nothing changes.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch.nn as nn

from fivedc.errors import FivedcError, NotSupportedError
from fivedc.frontends.fx_module import trace_module
from fivedc.ir.graph import Op, Repeat
from test_frontend_fx import ShapeInFloat, _with_attention, line_of, nanogpt
from test_fx_hf_moe import _tiny

HERE = str(Path(__file__).resolve())


def gpt(layers: int = 6):
    return nanogpt.factory(config=nanogpt.GPTConfig(n_layer=layers))


def marks(graph) -> tuple[dict[str, tuple[int, ...]], list[str]]:
    """(repeat name -> stage_layers, the top-level ops carrying @stage)."""
    repeats = {i.name: i.stage_layers for i in graph.body.items if isinstance(i, Repeat)}
    ops = [i.out for i in graph.body.items if isinstance(i, Op) and i.annotation("stage") is not None]
    return repeats, ops


@pytest.mark.parametrize("patterns, layers, ops", [
    ((), (), []),
    (("transformer.h.4", "transformer.ln_f"), (4,), ["transformer_ln_f"]),
    (["transformer.h.*"], (0, 1, 2, 3, 4, 5), []),
    (("transformer.h.?", "lm_head"), (0, 1, 2, 3, 4, 5), ["lm_head.1"]),
    (("transformer.h",), (0,), []),  # the stack itself: its first layer
    (("transformer",), (), ["transformer_wte"]),  # a container: the first op traced in it
])
def test_patterns_mark_layers_and_top_level_ops(patterns, layers, ops) -> None:
    module, inputs = gpt()
    graph = trace_module(module, inputs, stage_boundaries=patterns).graph
    assert marks(graph) == ({"layers": layers}, ops)
    (op,) = [i for i in graph.body.items if isinstance(i, Op) and i.out in ops] or [None]
    if op is not None:
        assert op.annotation("stage").loc == op.loc and op.loc.file.endswith("nanogpt.py")


class StageBlock(nanogpt.Block):
    fivedc_stage_boundary = True


def test_the_attribute_marks_on_the_instance_or_the_class() -> None:
    module, inputs = gpt(4)
    module.transformer.h[2].fivedc_stage_boundary = True  # the layers stay one repeat
    module.transformer.ln_f.fivedc_stage_boundary = True
    tm = trace_module(module, inputs)
    assert marks(tm.graph) == ({"layers": (2,)}, ["transformer_ln_f"])
    assert "repeat 4 as layers @stage(2) {" in tm.summary() and "@stage  # nanogpt.py" in tm.summary()
    module, inputs = gpt(3)
    for i, block in enumerate(module.transformer.h):
        marked = StageBlock(module.config).double()
        marked.load_state_dict(block.state_dict())
        module.transformer.h[i] = marked
    assert marks(trace_module(module, inputs, stage_boundaries=("lm_head",)).graph) == (
        {"layers": (0, 1, 2)}, ["lm_head.1"])


def test_inlined_layers_and_the_export_path_mark_top_level_ops() -> None:
    module, inputs = gpt(3)
    module.transformer.h[1].ln_1.eps = 1e-3  # not uniform: three inlined layers
    graph = trace_module(module, inputs, stage_boundaries=("transformer.h.2",)).graph
    assert marks(graph) == ({}, ["transformer_h_2_ln_1"])
    module, inputs = _with_attention(ShapeInFloat)
    tm = trace_module(module, inputs, stage_boundaries=("transformer.h.1", "transformer.ln_f"))
    assert tm.exported
    repeats, ops = marks(tm.graph)
    assert repeats == {} and len(ops) == 2 and ops[1].startswith("layer_norm")
    first = next(i for i in tm.graph.body.items if isinstance(i, Op) and i.out == ops[0])
    assert first.kind == "layernorm" and first.loc.line == line_of(nanogpt.Block.forward, "self.attn(self.ln_1(x))")


def test_a_mark_inside_a_layer_body_is_an_error_with_the_layer_to_mark() -> None:
    module, inputs = gpt(4)
    with pytest.raises(NotSupportedError, match="cannot begin at transformer.h.3.mlp") as info:
        trace_module(module, inputs, stage_boundaries=("transformer.h.3.mlp",))
    err = info.value
    assert "inside layer 3 of transformer.h" in err.message
    assert err.loc.line == line_of(nanogpt.MLP.forward, "self.c_proj(self.gelu(self.c_fc(x)))")
    assert "stage_boundaries=('transformer.h.3',)" in err.hint and "Traceback" not in err.render()
    module.transformer.h[1].attn.fivedc_stage_boundary = True
    with pytest.raises(NotSupportedError, match="the attribute fivedc_stage_boundary of CausalSelfAttention") as info:
        trace_module(module, inputs)
    assert "remove fivedc_stage_boundary from CausalSelfAttention" in info.value.hint


def test_a_pattern_that_matches_nothing_lists_similar_paths() -> None:
    module, inputs = gpt(6)
    with pytest.raises(FivedcError, match="'transformer.h.9' matches no module") as info:
        trace_module(module, inputs, stage_boundaries=("transformer.h.9",))
    assert "did you mean 'transformer.h.5'" in info.value.hint
    with pytest.raises(FivedcError, match="'layers.4' matches no module") as info:
        trace_module(module, inputs, stage_boundaries="layers.4")
    assert "transformer.h, transformer.ln_f" in info.value.hint


def test_marks_that_no_op_can_carry_are_errors() -> None:
    module, inputs = gpt(2)
    with pytest.raises(NotSupportedError, match="transformer.wpe .*no op of the plan") as info:
        trace_module(module, inputs, stage_boundaries=("transformer.wpe",))
    assert info.value.loc.line == line_of(nanogpt.GPT.forward, "self.transformer.wpe(pos)")
    module, inputs = _tiny("unpack")
    with pytest.raises(NotSupportedError, match="moe.experts.1 .*inside moe, which fivedc lowers as one op") as info:
        trace_module(module, inputs, stage_boundaries=("moe.experts.1",))
    assert info.value.loc.file.endswith("test_fx_hf_moe.py") and "mark moe itself" in info.value.hint
    assert marks(trace_module(module, inputs, stage_boundaries=("moe",)).graph) == ({}, ["moe"])


def test_an_unused_module_is_not_a_silent_mark() -> None:
    module, inputs = gpt(2)
    module.unused = nn.Linear(4, 4)
    with pytest.raises(NotSupportedError, match="cannot begin at unused"):
        trace_module(module, inputs, stage_boundaries=("unused",))
