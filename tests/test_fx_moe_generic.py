"""MoE blocks as libraries write them today, recognised by behaviour (`fivedc/frontends/fx/moe.py`,
`fivedc/frontends/fx/moe_leaves.py`), with no name of a model or library in the rules.

A DeepSeek-style block written here (not from a library): a router module holding its
weight and a balancing bias buffer, sigmoid scores renormalised and scaled, experts
as stacked parameters with gate and up fused in one, a loop over the experts, and
shared experts added. Traced, it is one IR `moe` op (sigmoid, top-2), a
multiplication by its scale and the shared experts as ordinary linears, computing
the module's loss and gradients (float64, 1e-12) with an exact parameter map (each
half of the fused weight a slice), and it trains at ep=2 like one device. Its bias is
the op's routing bias (state), also where it is not zero; a buffer that changes the
routing otherwise is not the IR's moe: that block is traced through, its ops kept as
ATen calls, and computes the module's loss just the same.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from fivedc.frontends.fx_module import trace_module
from fivedc.frontends.fx.precision import float64_everywhere
from fivedc.ir.graph import Op, walk_ops
from fivedc.ir.mesh import Mesh
from fivedc.passes.base import CompileOptions
from fivedc.pipeline import compile_graph
from fivedc.runtime.train import TrainSettings
from fivedc.runtime.verify import single_device_mesh, verify_plan
from test_frontend_fx import assert_same_as_module
from test_fx_moe import _tiny, moe_ops

DIM, EXPERTS, FFN = 8, 4, 6


class Router(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(EXPERTS, DIM) / DIM**0.5)
        self.register_buffer("bias", torch.zeros(EXPERTS))  # loss-free balancing: it only selects
        self.top_k, self.routed_scale = 2, 2.5

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        scores = F.linear(x, self.weight).sigmoid()
        chosen = (scores + self.bias).topk(self.top_k, dim=-1).indices
        weights = scores.gather(-1, chosen)
        return chosen, weights / weights.sum(-1, keepdim=True) * self.routed_scale


class Experts(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.gate_up = nn.Parameter(torch.randn(EXPERTS, 2 * FFN, DIM) / DIM**0.5)
        self.down = nn.Parameter(torch.randn(EXPERTS, DIM, FFN) / FFN**0.5)

    def forward(self, x: torch.Tensor, chosen: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        out = torch.zeros_like(x)
        for e in range(EXPERTS):
            gate = (weights * (chosen == e)).sum(-1, keepdim=True)  # 0 where e is not chosen
            g, u = F.linear(x, self.gate_up[e]).chunk(2, dim=-1)
            out = out + gate * F.linear(F.silu(g) * u, self.down[e])
        return out


class SharedMLP(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.gate, self.up = nn.Linear(DIM, FFN, bias=False), nn.Linear(DIM, FFN, bias=False)
        self.down = nn.Linear(FFN, DIM, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(F.silu(self.gate(x)) * self.up(x))


class RoutedAndShared(nn.Module):
    """Named like nothing: found by its child `experts`."""

    def __init__(self) -> None:
        super().__init__()
        self.router, self.experts, self.shared = Router(), Experts(), SharedMLP()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, x.shape[-1])
        chosen, weights = self.router(flat)
        return self.experts(flat, chosen, weights).reshape(x.shape) + self.shared(x)


def _ops(graph, kind: str) -> list[Op]:
    return [op for op, _ in walk_ops(graph.body) if isinstance(op, Op) and op.kind == kind]


def test_a_block_with_a_scale_and_shared_experts_is_one_moe_op_plus_ordinary_ops() -> None:
    module, inputs = _tiny(RoutedAndShared())
    tm = trace_module(module, inputs)
    (op,) = moe_ops(tm.graph)
    assert dict(op.attrs) == {"top_k": 2, "score": "sigmoid", "normalize": True,
                              "bias_state": "moe.router.bias"}  # the balancing bias: state (fivedc/ir/states.py)
    assert [o.args for o in _ops(tm.graph, "mul") if o.args[0] == op.out] == [(op.out, 2.5)]  # its scale
    assert len(_ops(tm.graph, "linear")) == 4 and not _ops(tm.graph, "aten")  # the shared experts, the head
    assert_same_as_module(tm, module, inputs)
    state = {k: torch.randn_like(v) for k, v in module.state_dict().items()}
    ir = tm.to_ir_params(state)
    gate, up, down = (ir[name] for name in op.args[2:])
    assert torch.equal(gate, state["moe.experts.gate_up"][:, :FFN].transpose(1, 2))
    assert torch.equal(up, state["moe.experts.gate_up"][:, FFN:].transpose(1, 2))
    assert torch.equal(down, state["moe.experts.down"].transpose(1, 2))
    back = tm.from_ir_params(ir)
    assert all(torch.equal(back[k], state[k]) for k in back) and set(back) == set(state) - {"moe.router.bias"}


def test_a_bias_that_selects_other_experts_is_the_ops_routing_bias() -> None:
    """A trained model's bias (not zero): read at zero, then as the bias it is; the plan computes
    the module's loss with it (it chooses expert 0 always, 1 never)."""
    block = RoutedAndShared()
    block.router.bias.copy_(torch.tensor([4.0, -4.0, 0.0, 0.0]))
    module, inputs = _tiny(block)
    tm = trace_module(module, inputs)
    (op,) = moe_ops(tm.graph)
    assert op.attr("bias_state") == "moe.router.bias" and not _ops(tm.graph, "aten")
    assert_same_as_module(tm, module, inputs)


def test_a_buffer_that_changes_the_routing_otherwise_is_traced_through_not_refused() -> None:
    block = RoutedAndShared()
    block.router.forward = lambda flat: Router.forward(block.router, flat * (1 + block.router.bias[0]))
    block.router.bias.copy_(torch.tensor([0.5, 0.0, 0.0, 0.0]))  # scales the tokens: not a bias of the choice
    module, inputs = _tiny(block)
    tm = trace_module(module, inputs)
    assert not moe_ops(tm.graph) and {o.attr("target") for o in _ops(tm.graph, "aten")} >= {"aten.topk.default"}
    assert_same_as_module(tm, module, inputs)


@pytest.mark.parametrize("mesh", ["1x1x1x1x2"])
def test_a_block_with_shared_experts_trains_like_one_device_at_ep2(mesh: str, worker_pool) -> None:
    module, inputs = _tiny(RoutedAndShared())
    graph = trace_module(module, inputs).graph
    plan = compile_graph(graph, CompileOptions(mesh=Mesh.parse(mesh), dtype="fp64"))
    params = {p.name: p.sharding for p in plan.graph.body.params}
    assert params[moe_ops(plan.graph)[0].args[2]].axes_of("experts")  # the experts split over ep
    reference = compile_graph(graph, CompileOptions(mesh=single_device_mesh(), dtype="fp64"))
    report = verify_plan(plan, reference, settings=TrainSettings(steps=2), pool=worker_pool)
    assert report.max_error <= 1e-10, report


def test_float64_mode_computes_grouped_matrix_products_torch_has_no_float64_kernel_for() -> None:
    gen = torch.Generator().manual_seed(0)
    a, b = torch.randn(10, 8, generator=gen), torch.randn(3, 8, 4, generator=gen)
    offs = torch.tensor([2, 5, 9], dtype=torch.int32)
    with pytest.raises(RuntimeError):
        F.grouped_mm(a.double(), b.double(), offs=offs)  # no float64 kernel on CPU
    with float64_everywhere():
        got = F.grouped_mm(a.double(), b.double(), offs=offs)
    fp32 = torch._grouped_mm(a, b, offs=offs)
    a, b = a.double(), b.double()
    want = torch.cat([a[0:2] @ b[0], a[2:5] @ b[1], a[5:9] @ b[2]])
    assert got.dtype == torch.float64 and torch.allclose(got[:9], want, rtol=1e-12, atol=1e-12)
    assert torch.allclose(got[:9].float(), fp32[:9], rtol=1e-5, atol=1e-5)
    assert torch.equal(got[9:], torch.zeros(1, 4, dtype=torch.float64))  # rows past the last offset: none


def test_a_check_whose_float64_reference_has_no_kernel_runs_in_float32_and_says_so(worker_pool) -> None:
    """A library's operator with no float64 kernel (tests/library_ops.py) runs replicated in the plan;
    the float64 check cannot run the plain module, so both runs are in float32, and the report says why."""
    from fivedc.parallel.check import check_module

    report = check_module("tests/library_ops.py:doubled", mesh="1x1x1x1x1", steps=2, dtype="fp64", pool=worker_pool)
    assert report.dtype == "fp32" and "no float64 kernel" in report.note and "twice_f32" in report.note
    assert report.max_error <= 1e-4, report
