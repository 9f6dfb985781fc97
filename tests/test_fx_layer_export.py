"""A deep model exported as two layers and unrolled (fivedc/frontends/fx/layer_export.py) is the
graph a whole export gives, node for node and number for number; a model whose layers differ is
exported whole."""

from __future__ import annotations

import pytest
import torch
import torch.fx as fx
from torch import nn

from fivedc.frontends.fx.export import export_graph
from fivedc.frontends.fx.layer_export import WholeExport, export_by_layers
from fivedc.frontends.python_file import import_file

import transformers  # the `test` extra installs it (pyproject.toml): missing, the tests fail
hf = import_file("examples/hf_models.py")


def canonical(gm: fx.GraphModule) -> list[tuple]:
    """The graph's computation in order: each node's op, target and arguments, a parameter by its
    name, an input by its name, another node by its position (names and get_attr order aside)."""
    position: dict[fx.Node, tuple] = {}
    out = []
    for node in gm.graph.nodes:
        if node.op in ("get_attr", "placeholder"):
            position[node] = (node.op, str(node.target))
            continue
        position[node] = ("node", len(out))
        args = fx.node.map_arg((node.args, node.kwargs), lambda a: position[a])
        scopes = tuple(v[0] for v in (node.meta.get("nn_module_stack") or {}).values())
        out.append((node.op, str(node.target), repr(args), scopes, node.meta.get("stack_trace")))
    return out


def both(model: nn.Module, inputs: dict) -> tuple[fx.GraphModule | None, fx.GraphModule]:
    return export_by_layers(model, inputs, export_graph), export_graph(model, inputs)


def test_a_deep_library_decoder_exports_by_layers_to_the_whole_export_s_graph() -> None:
    model, (ids, labels) = hf.build("deepseek_v3", dtype=torch.float32, num_hidden_layers=3)  # a dense first layer, then MoE layers
    inputs = {"input_ids": ids, "labels": labels}
    fast, whole = both(model, inputs)
    assert fast is not None  # layers 1 and 2 are one layer repeated
    assert canonical(fast) == canonical(whole)
    with torch.no_grad():
        assert torch.equal(fast(**inputs), whole(**inputs))


class Scaled(nn.Module):
    def __init__(self, scale: float) -> None:
        super().__init__()
        self.proj = nn.Linear(8, 8)
        self.scale = scale

    def forward(self, x):
        return torch.tanh(self.proj(x)) * self.scale


class Stack(nn.Module):
    def __init__(self, scales) -> None:
        super().__init__()
        self.layers = nn.ModuleList(Scaled(s) for s in scales)

    def forward(self, x):
        for layer in self.layers:
            x = layer(x)
        return x.sum()


@pytest.mark.parametrize("scales, unrolled", [((0.5, 0.5, 0.5, 0.5), True), ((0.5, 0.5, 0.5, 0.25), False),
                                              ((1.0, 0.5, 0.5, 0.5), True)])
def test_layers_that_run_other_ops_are_exported_whole(scales, unrolled: bool) -> None:
    """The last layer's other scale is seen in the eager record and the model is exported whole
    (a copy of layer 1 would scale by 0.5 there); a different first layer is exported as itself."""
    torch.manual_seed(0)
    model, x = Stack(scales).double(), {"x": torch.randn(2, 8, dtype=torch.float64)}
    fast, whole = both(model, x)
    assert isinstance(fast, fx.GraphModule) == unrolled
    if unrolled:
        assert canonical(fast) == canonical(whole)
        assert torch.equal(fast(**x), whole(**x))
    else:  # and says where the layers part
        assert fast == WholeExport("layer 3 of layers runs other ops than layer 1 (aten.mul.Tensor at call 3 on "
                                   "other arguments)")


def test_a_library_decoder_with_mixed_layer_types_is_exported_whole() -> None:
    """Gemma 3's sixth layer attends fully, the others through a sliding window: the eager
    record sees layer 5 read another mask, so no copy of layer 1 stands for it."""
    model, (ids, labels) = hf.build("gemma3", dtype=torch.float32, num_hidden_layers=7)
    assert model.model.config.layer_types[5] != model.model.config.layer_types[1]
    found = export_by_layers(model, {"input_ids": ids, "labels": labels}, export_graph)
    assert isinstance(found, WholeExport) and found.reason.startswith("layer 5 of model.model.layers runs other ops "
                                                                      "than layer 1 (")


def test_the_tracer_says_why_a_model_with_layers_is_exported_whole() -> None:
    """The slower whole export is never silent: the tracer's FxWarning carries the reason."""
    from fivedc.frontends.fx.trace import _by_layers
    from fivedc.frontends.fx_module import FxWarning

    model, x = Stack((0.5, 0.5, 0.5, 0.25)).double(), {"x": torch.randn(2, 8, dtype=torch.float64)}
    with pytest.warns(FxWarning, match="Stack is exported whole, not as two layers unrolled .*: layer 3 of layers"):
        assert _by_layers(model, x, export_graph) is None

    def failing(module, inputs):
        raise RuntimeError("a data-dependent branch\nmore")

    with pytest.warns(FxWarning, match="exporting two layers failed: RuntimeError: a data-dependent branch$"):
        assert _by_layers(Stack((0.5,) * 4).double(), x, failing) is None
