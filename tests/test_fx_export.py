"""The torch.export path: region wrappers inlined, `to()` read by its schema, export's checks dropped.

Hugging Face decoders compute their rotary tables in a `torch.no_grad()` region with
autocast off, which torch.export keeps as higher-order ops over submodules, and call
`inv_freq.to(device=x.device, dtype=torch.float)`; both stopped the export path.
These modules exercise the mechanisms themselves (they are not copies of a
library's model): the rewritten graph must hold no wrapper, compute what the
module computes, and pass no gradient back through a no-grad region.
"""

from __future__ import annotations

import torch
from torch import nn

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


def test_a_no_grad_region_over_a_weight_passes_no_gradient_back() -> None:
    """`scale = w.sum()` under `torch.no_grad()`: inlined and read through `detach`, so the
    weight's gradient comes from the projection alone, as in the module."""
    torch.manual_seed(0)
    module, x = NoGradOverAWeight().double(), torch.randn(2, 4, dtype=torch.float64)
    gm = export_graph(module, {"x": x})
    assert "aten.detach.default" in _targets(gm)
    got = gm(x)
    got.backward()
    exported = module.proj.weight.grad.clone()
    module.zero_grad()
    want = module(x)
    want.backward()
    torch.testing.assert_close(got, want, rtol=0, atol=0)
    torch.testing.assert_close(exported, module.proj.weight.grad, rtol=0, atol=0)


class LongPositionTable(nn.Module):
    """A learned position table of 16 rows read at position ids [1, seq] of a sequence of 6."""

    def __init__(self) -> None:
        super().__init__()
        self.wte, self.wpe, self.head = nn.Embedding(10, 8), nn.Embedding(16, 8), nn.Linear(8, 10)

    def forward(self, idx: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        positions = torch.arange(idx.shape[1]).unsqueeze(0)
        logits = self.head(self.wte(idx) + self.wpe(positions))
        return torch.nn.functional.cross_entropy(logits.view(-1, 10), targets.view(-1))


def test_a_position_table_longer_than_the_sequence_is_read_at_its_first_rows() -> None:
    """GPT-2's: the table is one [positions, hidden] parameter, its first seq rows a slice along
    them that becomes the sequence (no replicated lookup); the loss and gradients are the module's."""
    from fivedc.ir.aten_call import whole_dims
    from fivedc.frontends.fx_module import trace_module
    from fivedc.ir.graph import Op, walk_ops
    from test_frontend_fx import assert_same_as_module

    torch.manual_seed(0)
    module, inputs = LongPositionTable().double(), (torch.randint(0, 10, (2, 6)), torch.randint(0, 10, (2, 6)))
    tm = trace_module(module, inputs)
    (op,) = [op for op, _ in walk_ops(tm.graph.body) if isinstance(op, Op) and op.kind == "aten"]
    assert op.attr("target") == "aten.slice.Tensor" and whole_dims(op) == {"positions"}
    assert {p.name: p.dims for p in tm.graph.body.params}["wpe"] == ("positions", "hidden")
    assert_same_as_module(tm, module, inputs)


class ScaledNorm(nn.Module):
    """`F.rms_norm` as torchtune's RMSNorm calls it (by keywords), in a forward torch.fx cannot follow
    (`float()` of a shape), so torch.export captures it: `aten.rms_norm`."""

    def __init__(self) -> None:
        super().__init__()
        self.scale, self.proj = nn.Parameter(torch.ones(8)), nn.Linear(8, 8)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        h = torch.nn.functional.rms_norm(x, normalized_shape=(8,), weight=self.scale, eps=1e-5)
        return torch.nn.functional.mse_loss(self.proj(h) * float(x.shape[-1]) ** -0.5, y)


def test_an_exported_rms_norm_is_the_ir_s_rmsnorm_not_a_replicated_op() -> None:
    """On the export path too: else it runs replicated and a pipeline cannot split it into microbatches."""
    from fivedc.frontends.fx_module import trace_module
    from fivedc.ir.graph import Op, walk_ops
    from test_frontend_fx import assert_same_as_module

    torch.manual_seed(0)
    module, inputs = ScaledNorm().double(), (torch.randn(4, 8, dtype=torch.float64), torch.randn(4, 8, dtype=torch.float64))
    tm = trace_module(module, inputs)
    ops = [op for op, _ in walk_ops(tm.graph.body) if isinstance(op, Op)]
    aten = [str(op.attr("target")) for op in ops if op.kind == "aten"]
    assert tm.exported and "rmsnorm" in [op.kind for op in ops] and not any("rms_norm" in t for t in aten), aten
    assert_same_as_module(tm, module, inputs)
