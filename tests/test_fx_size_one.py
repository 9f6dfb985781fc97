"""Dims of size 1 in the fx frontend: one head, one k/v head, a batch of one, a sequence of one.

A size-1 dim is still a dim of the model: one-head nanoGPT and Llama (also GQA with
one k/v head, a head_dim of 1, batch 1, seq 1, and all of them at once) trace to
the IR a DSL model would have (`heads = 1` in the weights' dims) and compute the
module's loss and gradients in float64 (1e-12); parallelized, they train like the
plain module (1e-10). A parameter's size-1 dims ([1, seq, hidden] added to the
tokens) are broadcast dims, not model dims. Where a size-1 dim cannot be followed
(a squeeze of the batch of one), the error names the dim, the user's line and the fix.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from fivedc.errors import NotSupportedError
from fivedc.frontends.fx_module import trace_module
from fivedc.ir.graph import Op, Repeat, walk_ops
from fivedc.parallel.check import check_module
from test_frontend_fx import assert_same_as_module, line_of, llama, nanogpt

HERE = str(Path(__file__).resolve())


def gpt(*, batch: int = 2, heads: int = 1, embd: int = 8, seq: int = 8, layers: int = 2):
    config = nanogpt.GPTConfig(block_size=seq, vocab_size=24, n_layer=layers, n_head=heads, n_embd=embd, bias=True)
    return nanogpt.factory(batch=batch, config=config, seed=heads + seq)


def lla(*, batch: int = 2, heads: int = 1, kv: int = 1, dim: int = 8, seq: int = 8):
    args = llama.ModelArgs(dim=dim, n_layers=2, n_heads=heads, n_kv_heads=kv, vocab_size=24, ffn_dim=12,
                           max_seq_len=seq)
    return llama.factory(batch=batch, args=args, seed=heads + kv)


CASES = {  # name -> (factory, the dims of size 1 it has)
    "gpt-one-head": (lambda: gpt(), {"heads": 1, "kv_heads": 1}),
    "gpt-one-head-batch-1": (lambda: gpt(batch=1), {"batch": 1, "heads": 1, "kv_heads": 1}),
    "gpt-batch-1": (lambda: gpt(batch=1, heads=2), {"batch": 1}),
    "gpt-seq-1": (lambda: gpt(heads=2, seq=1), {"seq": 1}),
    "gpt-head-dim-1": (lambda: gpt(heads=4, embd=4), {"head_dim": 1}),
    "gpt-all-1": (lambda: gpt(batch=1, seq=1, layers=1), {"batch": 1, "seq": 1, "heads": 1, "kv_heads": 1}),
    "llama-one-head": (lambda: lla(), {"heads": 1, "kv_heads": 1}),
    "llama-gqa-one-kv-head": (lambda: lla(heads=4, dim=16), {"kv_heads": 1}),
    "llama-batch-1": (lambda: lla(batch=1, heads=2, kv=2), {"batch": 1}),
    "llama-seq-1": (lambda: lla(heads=2, kv=2, seq=1), {"seq": 1}),
    "llama-all-1": (lambda: lla(batch=1, seq=1), {"batch": 1, "seq": 1, "heads": 1, "kv_heads": 1}),
}


@pytest.mark.parametrize("case", list(CASES))
def test_size_one_dims_trace_to_the_modules_loss_and_gradients(case: str) -> None:
    make, ones = CASES[case]
    module, inputs = make()
    tm = trace_module(module, inputs)
    dims = dict(tm.graph.dims)
    assert {k: dims.get(k) for k in ones} == ones
    assert [k for k, v in dims.items() if v == 1] == sorted(ones, key=list(dims).index)  # no dim made up
    assert_same_as_module(tm, module, inputs)


def test_one_head_weights_keep_the_head_dim() -> None:
    for (module, inputs), q, kv, out in ((gpt(), "c_attn_q", "c_attn_k", "attn_c_proj"), (lla(), "wq", "wk", "wo")):
        graph = trace_module(module, inputs).graph
        (repeat,) = [i for i in graph.body.items if isinstance(i, Repeat)]
        params = {p.name: p.dims for p in repeat.body.params}
        assert params[q] == ("hidden", "heads", "head_dim") and params[kv] == ("hidden", "kv_heads", "head_dim")
        assert params[out] == ("heads", "head_dim", "hidden")


def make_model(*, kind: str, batch: int = 2):
    """For the workers: a one-head nanoGPT or a Llama with one query and one k/v head."""
    return gpt(batch=batch) if kind == "gpt" else lla(batch=batch)


@pytest.mark.parametrize("kind, mesh", [("gpt", "2x1x1x2x1"), ("llama", "2x1x1x1x1")])
def test_one_head_models_parallelized_train_like_the_plain_module(kind: str, mesh: str, worker_pool) -> None:
    report = check_module(f"{HERE}:make_model", kwargs={"kind": kind, "batch": 4}, mesh=mesh, pool=worker_pool)
    assert report.max_error <= 1e-10, report
    assert report.losses[1] != report.losses[0]


# ---- parameters with size-1 dims, and what cannot be followed ---------------------------------
class LearnedPositions(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb, self.head = nn.Embedding(16, 8), nn.Linear(8, 16)
        self.pos = nn.Parameter(torch.randn(1, 4, 8))  # broadcast over the batch
        self.scale = nn.Parameter(torch.randn(1, 1, 8))

    def forward(self, idx: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        h = (self.emb(idx) + self.pos) * self.scale
        return F.cross_entropy(self.head(h).view(-1, 16), targets.view(-1))


@pytest.mark.parametrize("batch", [1, 3])
def test_a_parameters_size_one_dims_are_broadcast_not_model_dims(batch: int) -> None:
    torch.manual_seed(batch)
    module = LearnedPositions().double()
    inputs = (torch.randint(0, 16, (batch, 4)), torch.randint(0, 16, (batch, 4)))
    tm = trace_module(module, inputs)
    params = {p.name: p.dims for p in tm.graph.body.params}
    assert params["pos"] == ("seq", "hidden") and params["scale"] == ("hidden",)
    assert dict(tm.graph.dims)["batch"] == batch
    assert_same_as_module(tm, module, inputs)


class SqueezesTheBatch(LearnedPositions):
    def forward(self, idx: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        h = self.emb(idx).squeeze(0)  # [seq, hidden] only because the batch is 1
        return F.cross_entropy(self.head(h), targets.view(-1))


def test_a_squeezed_size_one_dim_runs_replicated_and_says_why() -> None:
    """The IR cannot follow a squeeze of the batch dim of size 1; the op is kept as it is, computed
    whole on every rank (an `aten` op), with the reason at the user's line, and the model still trains."""
    module = SqueezesTheBatch().double()
    inputs = (torch.randint(0, 16, (1, 4)), torch.randint(0, 16, (1, 4)))
    tm = trace_module(module, inputs)
    islands = [op for op, _ in walk_ops(tm.graph.body) if isinstance(op, Op) and op.kind == "aten"]
    squeeze = next(op for op in islands if op.attr("target") == "aten.squeeze.dim")
    assert "squeeze of a model dim of size 1 (batch (size 1))" in squeeze.attr("reason")
    assert squeeze.loc.file == HERE and squeeze.loc.line == line_of(SqueezesTheBatch.forward, "squeeze(0)")
    assert_same_as_module(tm, module, inputs)