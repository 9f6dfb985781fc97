"""The fx frontend on a Mixtral-style MoE (`examples/mixtral.py`): the sparse MoE block
becomes the IR's `moe` op, with the loss and gradients of the module in float64 (1e-12),
an exact parameter map over the stacked expert weights, and plans at ep=2 (with dp or
tp) that train like one device (1e-10). Then the recognition's corners: another
reading of the weights (stored in the IR layout, top-1 without renormalising) is
found by the probe, and a block marked `fivedc_moe = True` that computes something
else is an error naming it.
"""

from __future__ import annotations

import random

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from fivedc.errors import NotSupportedError
from fivedc.frontends.fx_module import trace_module
from fivedc.ir.graph import Op, Repeat, walk_ops
from fivedc.ir.mesh import Mesh
from fivedc.passes.base import CompileOptions
from fivedc.pipeline import compile_graph
from fivedc.runtime.train import TrainSettings
from fivedc.runtime.verify import single_device_mesh, verify_plan
from test_frontend_fx import _load, assert_same_as_module

mixtral = _load("mixtral")


def moe_ops(graph) -> list[Op]:
    return [op for op, _ in walk_ops(graph.body) if isinstance(op, Op) and op.kind == "moe"]


def draw_mixtral(seed: int):
    rng = random.Random(seed)
    kv = rng.choice([1, 2])
    args = mixtral.ModelArgs(
        dim=4 * rng.choice([4, 8]), n_layers=rng.choice([1, 2]), n_heads=4, n_kv_heads=kv,
        vocab_size=rng.choice([16, 48]), n_experts=rng.choice([2, 4, 8]), expert_ffn_dim=rng.choice([8, 24]),
        max_seq_len=rng.choice([4, 8]),
    )
    return mixtral.factory(batch=rng.choice([1, 2, 3]), args=args, seed=seed)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_traced_mixtral_computes_the_modules_loss_and_gradients(seed: int) -> None:
    module, inputs = draw_mixtral(seed)
    tm = trace_module(module, inputs)
    (op,) = moe_ops(tm.graph)
    assert dict(op.attrs) == {"top_k": 2, "score": "softmax", "normalize": True}
    assert_same_as_module(tm, module, inputs)


def test_stacked_expert_weights_map_transposed_and_back_exactly() -> None:
    module, inputs = mixtral.factory()
    tm = trace_module(module, inputs)
    state = {k: torch.randn_like(v) for k, v in module.state_dict().items()}
    back = tm.from_ir_params(tm.to_ir_params(state))
    assert set(back) == set(state) and all(torch.equal(back[k], state[k]) for k in state)
    ir = tm.to_ir_params(state)
    (repeat,) = [i for i in tm.graph.body.items if isinstance(i, Repeat)]
    params = {p.name: p.dims for p in repeat.body.params}
    (op,) = moe_ops(tm.graph)
    router, w_gate, w_up, w_down = op.args[1:]
    assert params[router] == ("hidden", "experts")
    assert params[w_gate] == params[w_up] == ("experts", "hidden", "expert_ffn")
    assert params[w_down] == ("experts", "expert_ffn", "hidden")
    moe = "layers.1.block_sparse_moe"
    assert torch.equal(ir[f"layers.1.{w_gate}"], state[f"{moe}.w1"].transpose(1, 2))
    assert torch.equal(ir[f"layers.1.{w_down}"], state[f"{moe}.w2"].transpose(1, 2))
    assert torch.equal(ir[f"layers.1.{router}"], state[f"{moe}.gate.weight"].t())


def test_traced_mixtral_compiles_with_expert_parallelism() -> None:
    module, inputs = mixtral.factory(batch=4)
    graph = trace_module(module, inputs).graph
    plan = compile_graph(graph, CompileOptions(mesh=Mesh.parse("1x1x1x1x2"), dtype="fp64"))
    assert "all_to_all" in {str(c.kind) for c in plan.collectives}
    (repeat,) = [i for i in plan.graph.body.items if isinstance(i, Repeat)]
    experts = {p.name: p.sharding.axes_of("experts") for p in repeat.body.params}
    (op,) = moe_ops(plan.graph)
    assert all(experts[w] for w in op.args[2:]) and not experts[op.args[1]]


@pytest.mark.parametrize("mesh", ["2x1x1x1x2", "1x1x2x1x2"])
def test_traced_mixtral_trains_like_one_device_at_ep2(mesh: str, worker_pool) -> None:
    module, inputs = mixtral.factory(batch=4)
    graph = trace_module(module, inputs).graph
    plan = compile_graph(graph, CompileOptions(mesh=Mesh.parse(mesh), dtype="fp64"))
    reference = compile_graph(graph, CompileOptions(mesh=single_device_mesh(), dtype="fp64"))
    report = verify_plan(plan, reference, settings=TrainSettings(steps=2), pool=worker_pool)
    assert report.max_error <= 1e-10, report
    assert report.routing_matches and report.losses[0] != report.losses[1]


# ---- recognition ------------------------------------------------------------------------
class SwitchMoE(nn.Module):
    """Top-1, gate = the probability (not renormalised), weights already in the IR layout."""

    def __init__(self, dim: int, experts: int, ffn: int) -> None:
        super().__init__()
        self.top_k = 1
        self.router = nn.Linear(dim, experts, bias=False)
        self.down = nn.Parameter(torch.randn(experts, ffn, dim) / ffn**0.5)
        self.up = nn.Parameter(torch.randn(experts, dim, ffn) / dim**0.5)
        self.gate_proj = nn.Parameter(torch.randn(experts, dim, ffn) / dim**0.5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        probs = self.router(x).softmax(-1)
        top, chosen = probs.topk(self.top_k, dim=-1)
        out = torch.zeros_like(x)
        for e in range(probs.shape[-1]):
            mask = (chosen == e).any(-1, keepdim=True).to(x.dtype)
            h = F.silu(x @ self.gate_proj[e]) * (x @ self.up[e])
            out = out + mask * (h @ self.down[e]) * (top * (chosen == e)).sum(-1, keepdim=True)
        return out


class TinyMoeModel(nn.Module):
    def __init__(self, block: nn.Module, dim: int = 8, vocab: int = 12) -> None:
        super().__init__()
        self.emb = nn.Embedding(vocab, dim)
        self.moe = block
        self.head = nn.Linear(dim, vocab, bias=False)

    def forward(self, idx: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        h = self.emb(idx)
        h = h + self.moe(h)
        return F.cross_entropy(self.head(h).view(-1, 12), targets.view(-1))


def _tiny(block: nn.Module):
    torch.manual_seed(0)
    model = TinyMoeModel(block).double()
    return model, (torch.randint(0, 12, (2, 4)), torch.randint(0, 12, (2, 4)))


def test_another_reading_of_an_moe_block_is_found_by_the_probe() -> None:
    module, inputs = _tiny(SwitchMoE(8, 4, 6))
    tm = trace_module(module, inputs)
    (op,) = moe_ops(tm.graph)
    assert dict(op.attrs) == {"top_k": 1, "score": "softmax", "normalize": False}
    assert op.args[2:] == ("moe_gate_proj", "moe_up", "moe_down")
    assert_same_as_module(tm, module, inputs)


def test_a_marked_block_that_is_not_the_ir_moe_is_an_error_naming_it() -> None:
    class WrongMoE(SwitchMoE):
        fivedc_moe = True

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return super().forward(x) * 2.0

    module, inputs = _tiny(WrongMoE(8, 4, 6))
    with pytest.raises(NotSupportedError, match="WrongMoE is marked fivedc_moe = True") as info:
        trace_module(module, inputs)
    assert info.value.loc is not None and info.value.loc.file.endswith("test_fx_moe.py")


@pytest.mark.parametrize("mesh", ["1x1x1x1x2", "1x1x2x1x2"])
def test_parallelized_mixtral_trains_like_the_plain_module_at_ep2(mesh: str, worker_pool) -> None:
    """`fivedc.parallelize` with experts spread over ep, trained with torch's AdamW."""
    from fivedc.parallel.check import check_module

    report = check_module("examples/mixtral.py:factory", mesh=mesh, pool=worker_pool)
    assert report.max_error <= 1e-10, report
    assert report.losses[1] != report.losses[0]
