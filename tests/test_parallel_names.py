"""`fivedc.parallelize` names the parameters as the module does (`fivedc/parallel/names.py`).

A small model of nested modules (an embedding, layers of attention with q, k, v and o
projections and an MLP with biases, norms, a head tied to the embedding), parallelized
at tp=2 and at dp=2 and trained one step with AdamW whose parameter groups are chosen
by name: `named_parameters()` are the module's own names in its order (the tied weight
once, under its first name, as torch gives it), `state_dict()` has the module's keys
(the tied weight under both), and each tensor is this rank's block of the module's
tensor in the module's layout, before and after the step: a column-parallel linear's
rows, a row-parallel one's columns, the embedding's rows of the vocabulary, the rest
whole. A rank's `state_dict()` saved and loaded into another parallelized module gives
the same tensors. (nanoGPT's fused qkv weight: `tests/test_parallelize.py`; separate
experts under ep, each under its own key: `tests/test_fx_hf_moe.py`.)
"""

from __future__ import annotations

import io

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import fivedc
from fivedc.ir.mesh import MeshAxis

VOCAB, HIDDEN, HEADS, FFN, BATCH, SEQ = 16, 8, 2, 16, 4, 8


class Attention(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.q_proj, self.k_proj, self.v_proj, self.o_proj = (nn.Linear(HIDDEN, HIDDEN, bias=False) for _ in range(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape
        q, k, v = (p(x).view(b, s, HEADS, -1).transpose(1, 2) for p in (self.q_proj, self.k_proj, self.v_proj))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.o_proj(y.transpose(1, 2).reshape(b, s, HIDDEN))


class Mlp(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(HIDDEN, FFN), nn.Linear(FFN, HIDDEN)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(F.gelu(self.fc1(x)))


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm1, self.attn, self.norm2, self.mlp = nn.LayerNorm(HIDDEN), Attention(), nn.LayerNorm(HIDDEN), Mlp()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.norm1(x))
        return x + self.mlp(self.norm2(x))


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(VOCAB, HIDDEN)
        self.layers = nn.ModuleList([Block(), Block()])
        self.norm = nn.LayerNorm(HIDDEN)
        self.head = nn.Linear(HIDDEN, VOCAB, bias=False)
        self.head.weight = self.emb.weight  # tied

    def forward(self, tokens: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        x = self.emb(tokens)
        for layer in self.layers:
            x = layer(x)
        return F.cross_entropy(self.head(self.norm(x)).flatten(0, 1), targets.flatten())


def net(seed: int = 0) -> tuple[Net, tuple[torch.Tensor, torch.Tensor]]:
    torch.manual_seed(seed)
    module = Net().double()
    gen = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, VOCAB, (BATCH, SEQ + 1), generator=gen)
    return module, (tokens[:, :-1], tokens[:, 1:])


def one_step(model: nn.Module, inputs) -> dict[str, torch.Tensor]:
    """One AdamW step with parameter groups chosen by name: no decay for biases and norms."""
    named = list(model.named_parameters())
    plain = [p for n, p in named if n.endswith(".bias") or ".norm" in n or n.startswith("norm.")]
    decayed = [p for n, p in named if all(p is not q for q in plain)]
    opt = torch.optim.AdamW([{"params": decayed, "weight_decay": 0.1}, {"params": plain, "weight_decay": 0.0}], lr=0.05)
    model(*inputs).backward()
    opt.step()
    return {n: p.detach().cpu().clone() for n, p in named}


def names_job(info, mesh: str) -> dict:
    module, inputs = net()
    model = fivedc.parallelize(module, mesh=mesh, example_inputs=inputs, device=info.device)
    out = {"tp": model._fivedc_ctx.coords[MeshAxis.TP], "names": [n for n, _ in model.named_parameters()]}
    state = model.state_dict()
    out["keys"], out["tied"] = list(state), state["head.weight"].data_ptr() == state["emb.weight"].data_ptr()
    out["before"] = {n: p.detach().cpu().clone() for n, p in model.named_parameters()}
    out["after"] = one_step(model, inputs)
    saved = io.BytesIO()
    torch.save(model.state_dict(), saved)
    other = fivedc.parallelize(net(seed=3)[0], mesh=mesh, example_inputs=inputs, device=info.device,
                               sync_module_states=False)
    other.load_state_dict(torch.load(io.BytesIO(saved.getvalue())))
    out["reloaded"] = all(torch.equal(p.detach().cpu(), out["after"][n]) for n, p in other.named_parameters())
    return out


SPLIT_UNDER_TP = {  # the dim of the module's tensor each name's block is cut along at tp=2 (None: whole)
    "emb.weight": 0, "norm.weight": None, "norm.bias": None,
    "layers.0.norm1.weight": None, "layers.0.norm1.bias": None, "layers.0.norm2.weight": None,
    "layers.0.norm2.bias": None,
    "layers.0.attn.q_proj.weight": 0, "layers.0.attn.k_proj.weight": 0, "layers.0.attn.v_proj.weight": 0,
    "layers.0.attn.o_proj.weight": 1, "layers.0.mlp.fc1.weight": 0, "layers.0.mlp.fc1.bias": 0,
    "layers.0.mlp.fc2.weight": 1, "layers.0.mlp.fc2.bias": None,
}


def _block(full: torch.Tensor, split: int | None, rank: int, ranks: int) -> torch.Tensor:
    if split is None:
        return full
    size = full.shape[split] // ranks
    return full.narrow(split, rank * size, size)


@pytest.mark.parametrize("mesh, tp", [("1x1x2x1x1", 2), ("2x1x1x1x1", 1)])
def test_parameters_keep_the_modules_names_and_hold_its_blocks(worker_pool, mesh: str, tp: int) -> None:
    module, inputs = net()
    names = [n for n, _ in module.named_parameters()]
    keys = list(module.state_dict())
    assert "head.weight" in keys and "head.weight" not in names  # torch's own: tied, named once
    start = {n: p.detach().clone() for n, p in module.named_parameters()}
    stepped = one_step(module, inputs)
    outs = worker_pool.run(names_job, world=2, payload=mesh)
    assert sorted(out["tp"] for out in outs) == ([0, 1] if tp == 2 else [0, 0])
    for out in outs:
        assert out["names"] == names and out["keys"] == keys and out["tied"]
        assert out["reloaded"]
        for name in names:
            split = SPLIT_UNDER_TP[name.replace("layers.1.", "layers.0.")] if tp == 2 else None
            expected = _block(start[name], split, out["tp"], tp)
            assert out["before"][name].shape == expected.shape, name
            assert torch.equal(out["before"][name], expected), name
            after = _block(stepped[name], split, out["tp"], tp)
            assert torch.allclose(out["after"][name], after, rtol=1e-10, atol=1e-12), name


@pytest.mark.parametrize("full, local, target, expected", [
    ((8, 2, 4), (8, 1, 4), (8, 8), (8, 4)),  # heads merged into the features: the rank's heads
    ((2, 4, 8), (1, 4, 8), (8, 8), (4, 8)),  # an output projection's input features
    ((8,), (4,), (2, 4), (1, 4)),  # a dim split in two: its first part cut
    ((6,), (2,), (2, 3), None),  # 3 ranks' parts of a dim the module splits 2 x 3: no shape
])
def test_the_local_shape_in_the_modules_layout(full, local, target, expected) -> None:
    from fivedc.parallel.names import _reshaped

    assert _reshaped(full, local, target) == expected


def test_a_part_without_a_shape_in_the_modules_layout_is_held_flat() -> None:
    """Where one IR parameter of a fused key has no local shape in the module's layout, the
    key holds its parts flat, end to end, and the views give each back exactly."""
    from fivedc.frontends.fx.params import ParamMapping
    from fivedc.parallel.names import _lay_out, _Part

    def mapping(rows: tuple[int, int]) -> ParamMapping:
        return ParamMapping(ir_name="w", param="w", repeat=None, key="m.weight", module_path="m", pattern="m",
                            ir_shape=(6,), key_shape=(4, 3), rows=rows)

    parts = [_Part("a", 0, mapping((0, 2)), (2, 3), (6,)), _Part("b", 0, mapping((2, 4)), None, (2,))]
    pieces, shape = _lay_out("m.weight", parts)
    assert shape == (8,) and [(p.start, p.length) for p in pieces] == [(0, 6), (6, 2)]
    values = [torch.arange(6.0), torch.arange(6.0, 8.0)]
    held = torch.cat([p.to_held(v).reshape(-1) for p, v in zip(pieces, values)])
    assert all(torch.equal(p.to_ir(held), v) for p, v in zip(pieces, values))
    whole, _ = _lay_out("m.weight", [parts[0], _Part("b", 0, mapping((2, 4)), (2, 3), (6,))])
    assert [(p.start, p.length, p.axis) for p in whole] == [(0, 2, 0), (2, 2, 0)]  # both have one: rows
