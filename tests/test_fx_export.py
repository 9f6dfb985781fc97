"""The torch.export path: region wrappers inlined, `to()` read by its schema, export's checks dropped.

Hugging Face decoders compute their rotary tables in a `torch.no_grad()` region with
autocast off, which torch.export keeps as higher-order ops over submodules, and call
`inv_freq.to(device=x.device, dtype=torch.float)`; both stopped the export path.
These modules exercise the mechanisms themselves (they are not copies of a
library's model): the rewritten graph must hold no wrapper, compute what the
module computes, and refuse a no-grad region whose result depends on a parameter.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from fivedc.errors import NotSupportedError
from fivedc.frontends.fx.export import export_graph


class TableFromBuffer(nn.Module):
    """A table computed without gradients from a buffer and the input's dtype."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(4, 4)
        self.register_buffer("base", torch.arange(4.0), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        with torch.no_grad(), torch.autocast("cpu", enabled=False):
            table = torch.cos(self.base.to(device=x.device, dtype=torch.float64) * 2).to(x.dtype)
        return (self.proj(x) * table).sum()


class NoGradOverAWeight(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            scale = self.proj.weight.sum()
        return (self.proj(x) * scale).sum()


def _targets(gm) -> set[str]:
    return {str(n.target) for n in gm.graph.nodes if n.op == "call_function"}


def test_region_wrappers_are_inlined_and_compute_the_same() -> None:
    torch.manual_seed(0)
    module = TableFromBuffer().double()
    x = torch.randn(2, 4, dtype=torch.float64)
    gm = export_graph(module, {"x": x})
    targets = _targets(gm)
    assert not any("wrap_with" in t or "higher_order" in t for t in targets), targets
    assert not any("_assert_tensor_metadata" in t for t in targets)
    torch.testing.assert_close(gm(x), module(x), rtol=0, atol=0)
    to_calls = [n for n in gm.graph.nodes if n.op == "call_method" and n.target == "to"]
    assert to_calls and all(isinstance(n.kwargs["dtype"], torch.dtype) for n in to_calls)


def test_a_no_grad_region_over_a_weight_is_refused_at_its_line() -> None:
    with pytest.raises(NotSupportedError, match="no_grad\\(\\) region computes its result from trainable") as caught:
        export_graph(NoGradOverAWeight().double(), {"x": torch.randn(2, 4, dtype=torch.float64)})
    assert caught.value.loc is not None and caught.value.loc.file.endswith("test_fx_export.py")
