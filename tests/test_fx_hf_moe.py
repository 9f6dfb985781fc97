"""Hugging Face-style MoE blocks in the fx frontend (`examples/mixtral.py:hf_factory`).

`MixtralSparseMoeBlock` keeps each expert as its own module (`experts.3.w1`, an
`nn.ModuleList` of bias-free `nn.Linear`s), loops over the experts with
`index_add_` and returns `(out, router_logits)`. Traced, it is the same IR `moe`
op as the stacked block, with the experts' weights stacked: the module's loss and
gradients in float64 (1e-12), an exact state-dict map (each expert's [out, in]
weight a transposed slice of the stacked parameter), and, parallelized at dp x ep,
training like the plain module (1e-10) with full state dicts both ways. The tuple is
fine when only the output is used (`out, _ = moe(x)`, `moe(x)[0]`); using the router
logits is an error at the user's line that points at `fivedc_aux_loss`.
"""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from fivedc.errors import NotSupportedError
from fivedc.frontends.fx_module import trace_module
from fivedc.ir.graph import Repeat
from fivedc.ir.mesh import Mesh
from fivedc.parallel.check import check_module
from fivedc.passes.base import CompileOptions
from fivedc.pipeline import compile_graph
from test_frontend_fx import assert_same_as_module, line_of
from test_fx_moe import mixtral, moe_ops

HERE = str(Path(__file__).resolve())


def draw_hf(seed: int):
    rng = random.Random(seed)
    args = mixtral.ModelArgs(
        dim=4 * rng.choice([4, 8]), n_layers=rng.choice([1, 2]), n_heads=4, n_kv_heads=rng.choice([1, 2]),
        vocab_size=rng.choice([16, 48]), n_experts=rng.choice([2, 4, 8]), expert_ffn_dim=rng.choice([8, 24]),
        max_seq_len=rng.choice([4, 8]),
    )
    return mixtral.hf_factory(batch=rng.choice([1, 2, 3]), args=args, seed=seed)


@pytest.mark.parametrize("seed", [0, 1, 2, 3])
def test_hf_moe_block_traces_to_the_modules_loss_and_gradients(seed: int) -> None:
    module, inputs = draw_hf(seed)
    tm = trace_module(module, inputs)
    (op,) = moe_ops(tm.graph)
    assert dict(op.attrs) == {"top_k": 2, "score": "softmax", "normalize": True}
    assert_same_as_module(tm, module, inputs)


def test_separate_experts_are_slices_of_one_stacked_parameter_both_ways() -> None:
    module, inputs = mixtral.hf_factory()
    tm = trace_module(module, inputs)
    (repeat,) = [i for i in tm.graph.body.items if isinstance(i, Repeat)]
    params = {p.name: p.dims for p in repeat.body.params}
    (op,) = moe_ops(tm.graph)
    assert op.args[1:] == ("gate", "experts_w1", "experts_w3", "experts_w2")
    assert params["experts_w1"] == params["experts_w3"] == ("experts", "hidden", "expert_ffn")
    assert params["experts_w2"] == ("experts", "expert_ffn", "hidden")
    state = {k: torch.randn_like(v) for k, v in module.state_dict().items()}
    ir = tm.to_ir_params(state)
    back = tm.from_ir_params(ir)
    assert set(back) == set(state) and all(torch.equal(back[k], state[k]) for k in state)
    experts = len(module.layers[0].block_sparse_moe.experts)
    for e in range(experts):
        block = f"layers.1.block_sparse_moe.experts.{e}"
        assert torch.equal(ir["layers.1.experts_w1"][e], state[f"{block}.w1.weight"].t())
        assert torch.equal(ir["layers.1.experts_w2"][e], state[f"{block}.w2.weight"].t())
    found = tm.match("layers.*.block_sparse_moe.experts.*.w3")
    assert sorted((m.ir_name, m.index) for m in found) == sorted(
        (f"layers.{i}.experts_w3", e) for i in range(2) for e in range(experts))
    assert "experts.{0..3}.w1.weight" in tm.summary()


class TinyModel(nn.Module):
    def __init__(self, use: str, block: nn.Module | None = None) -> None:
        super().__init__()
        args = mixtral.ModelArgs(dim=8, n_experts=4, expert_ffn_dim=6)
        self.emb, self.head = nn.Embedding(12, 8), nn.Linear(8, 12, bias=False)
        self.moe = block or mixtral.MixtralSparseMoeBlock(args)
        self.use = use

    def forward(self, idx: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        h = self.emb(idx)
        if self.use == "index":
            return self.loss(h + self.moe(h)[0], targets)
        out, router_logits = self.moe(h)
        loss = self.loss(h + out, targets)
        if self.use == "aux":  # a load-balancing loss computed outside the block
            loss = loss + 0.01 * router_logits.softmax(-1).mean(0).pow(2).sum()
        return loss

    def loss(self, h: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(self.head(h).view(-1, 12), targets.view(-1))


def _tiny(use: str, block: nn.Module | None = None):
    torch.manual_seed(0)
    return TinyModel(use, block).double(), (torch.randint(0, 12, (2, 4)), torch.randint(0, 12, (2, 4)))


@pytest.mark.parametrize("use", ["index", "unpack"])
def test_a_tuple_returning_block_whose_logits_are_unused(use: str) -> None:
    module, inputs = _tiny(use)
    tm = trace_module(module, inputs)
    assert len(moe_ops(tm.graph)) == 1
    assert_same_as_module(tm, module, inputs)


def test_router_logits_used_outside_are_an_error_with_the_fix() -> None:
    module, inputs = _tiny("aux")
    with pytest.raises(NotSupportedError, match="router logits that MoE block moe returns") as info:
        trace_module(module, inputs)
    err = info.value
    assert err.loc.file == HERE and err.loc.line == line_of(TinyModel.forward, "router_logits.softmax")
    assert f":{line_of(TinyModel.forward, 'out, router_logits = self.moe(h)')}:" in err.message
    assert "fivedc_aux_loss" in err.hint and "aux_loss=0.01" in err.hint and "Traceback" not in err.render()


def test_fivedc_aux_loss_sets_the_ops_balancing_loss() -> None:
    block = mixtral.MixtralSparseMoeBlock(mixtral.ModelArgs(dim=8, n_experts=4, expert_ffn_dim=6))
    block.fivedc_aux_loss = 0.02
    module, inputs = _tiny("unpack", block)
    graph = trace_module(module, inputs).graph
    (op,) = moe_ops(graph)
    assert op.attr("aux_loss") == 0.02
    plan = compile_graph(graph, CompileOptions(mesh=Mesh.parse("1x1x1x1x2"), dtype="fp64"))
    assert moe_ops(plan.graph)[0].attr("aux_loss") == 0.02


class LogitsOfSomethingElse(mixtral.MixtralSparseMoeBlock):
    fivedc_moe = True

    def forward(self, hidden_states: torch.Tensor):
        out, logits = super().forward(hidden_states)
        return out, logits * 2.0


def test_a_second_output_that_is_not_the_router_logits_is_refused() -> None:
    block = LogitsOfSomethingElse(mixtral.ModelArgs(dim=8, n_experts=4, expert_ffn_dim=6))
    module, inputs = _tiny("unpack", block)
    with pytest.raises(NotSupportedError, match="second element is not the router logits"):
        trace_module(module, inputs)


# ---- parallelized ---------------------------------------------------------------------------
def test_hf_mixtral_parallelized_at_dp_ep_trains_like_the_plain_module(worker_pool) -> None:
    report = check_module("examples/mixtral.py:hf_factory", kwargs={"batch": 4}, mesh="2x1x1x1x2", pool=worker_pool)
    assert report.max_error <= 1e-10, report
    assert report.losses[1] != report.losses[0]


def state_job(info, payload):
    from fivedc.parallel.parallelize import parallelize

    module, inputs = mixtral.hf_factory(batch=4)
    model = parallelize(module, mesh="2x1x1x1x2", example_inputs=inputs)
    model.load_full_state_dict(payload)
    back = model.full_state_dict()
    mine = dict(model.named_parameters())
    local = {n: tuple(p.shape) for n, p in mine.items() if ".experts." in n}  # this rank's experts, by their keys
    shards = all(torch.equal(p.detach(), payload[n]) for n, p in mine.items())  # each whole: ep splits experts only
    names, view = model._fivedc_names, model._fivedc_weights.view()
    shared = all(view[n].untyped_storage().data_ptr() == mine[names.pieces[n][0].key].untyped_storage().data_ptr()
                 for n in names.stacked)  # the plan's stack of experts is a view of them, not a copy
    shards = shards and shared and bool(names.stacked)
    return sorted(set(back) ^ set(payload)), all(torch.equal(back[k], v) for k, v in payload.items()), local, shards


def test_full_state_dicts_of_separate_experts_round_trip_through_the_shards(worker_pool) -> None:
    module, _ = mixtral.hf_factory(batch=4)
    torch.manual_seed(5)
    state = {k: torch.randn_like(v) for k, v in module.state_dict().items()}
    results = worker_pool.run(state_job, world=4, payload=state)
    experts = {k for k in state if ".experts." in k}
    for extra, equal, local, shards in results:
        assert extra == [] and equal and shards
        assert set(local) < experts and len(local) == len(experts) // 2  # 4 experts split over ep=2
        assert all(shape == tuple(state[k].shape) for k, shape in local.items())
    ep_pairs = [set(results[r][2]) for r in (0, 1)]  # ranks 0 and 1: ep 0 and 1 (ep inside dp)
    assert ep_pairs[0].isdisjoint(ep_pairs[1]) and ep_pairs[0] | ep_pairs[1] == experts
